#!/usr/bin/env bash
# Builds the `embarcadero` Python package and runs its pytest suite against real
# `embarcadero serve` processes. scripts/test.sh calls it with EMBARCADERO_BIN set to the
# cargo-built server binary.
#
# Installs, from PyPI only, maturin and pytest into a virtual environment under the
# repository's target directory ($CARGO_TARGET_DIR, else target/): target/sdk-python-venv.
#
# Debug build (`maturin develop`, no --release): this package's Cargo.toml, like the
# workspace's, optimises every dependency (the Rust client among them) at opt-level 2 even
# in debug builds, and builds them in the same target directory as the workspace, so the
# client runs at speed and most of it is already compiled. Only the thin binding itself is
# unoptimised, and a release build would recompile everything at a cost of minutes of the
# CI budget for no gain in what the tests check.
#
# The cluster-mode test (a follower SIGKILLed under load) runs by default; set
# EMBARCADERO_SKIP_SLOW_TESTS=1 to skip the tests marked slow.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
: "${EMBARCADERO_BIN:?set EMBARCADERO_BIN to the embarcadero binary (scripts/test.sh does)}"
export EMBARCADERO_BIN
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
venv="$CARGO_TARGET_DIR/sdk-python-venv"

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" "pytest>=7"
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q -m "$here/Cargo.toml"

markers=()
if [ "${EMBARCADERO_SKIP_SLOW_TESTS:-0}" = 1 ]; then
  markers=(-m "not slow")
fi
cd "$here"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${markers[@]}" tests
