#!/usr/bin/env bash
# Installs what `HANDLERS="python typescript" run.sh` needs, idempotently, everything from
# package registries, into TASKER_CACHE (outside the repository) except our TypeScript SDK's
# build outputs (sdk/typescript/build, native/: git-ignored):
# - Tasker's Python worker, tasker-py (PyPI, its prebuilt wheel), and our Python SDK
#   (sdk/python, `maturin develop --release`: the test build of its test.sh is unoptimised)
#   in one virtual environment, $TASKER_CACHE/handlers-venv;
# - our TypeScript SDK built in place with its release addon. Tasker has no TypeScript worker
#   to install: @tasker-systems/tasker, the name its release script publishes, is not on the
#   npm registry (404; docs/BENCHMARKS.md).
# Compiles at `nice -n ${TASKER_NICE:-10}`. Usage: scripts/peers/tasker/install-handlers.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
REPO=$(cd "$PEER_DIR/../../.." && pwd)
TASKER_PY_VERSION=0.1.8
NICE=(nice -n "${TASKER_NICE:-10}")

python_handlers() {
  local venv=$TASKER_CACHE/handlers-venv
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "tasker-py==$TASKER_PY_VERSION" \
    "maturin>=1.5,<2"
  # Our SDK, optimised (the measurement compares its cost with Rust handlers'), into the
  # same environment.
  VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$REPO/target" \
    "${NICE[@]}" maturin develop --release -q -m "$REPO/sdk/python/Cargo.toml"
  "$venv/bin/python" -c 'import tasker_core, embarcadero.workflow'
}

typescript_handlers() {
  # Ours: the devDependencies without the `prepare` script (a debug build), then the release
  # addon (`npm run bench` builds the same) and the TypeScript.
  (cd "$REPO/sdk/typescript" && npm ci --no-audit --no-fund --ignore-scripts --silent &&
    "${NICE[@]}" npm run --silent build:native:release && npm run --silent build:ts)
}

python_handlers
typescript_handlers
echo "handlers installed: $TASKER_CACHE/handlers-venv, sdk/typescript/build and native/"
