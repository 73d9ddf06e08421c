#!/usr/bin/env bash
# Builds the `embarcadero` Python package and runs its pytest suite against real
# `embarcadero serve` processes. scripts/test.sh calls it with EMBARCADERO_BIN set to the
# cargo-built server binary.
#
# Installs, from PyPI only, maturin, pytest and ruff (lint) into a virtual environment under the
# repository's target directory ($CARGO_TARGET_DIR, else target/): target/sdk-python-venv.
#
# Debug build (`maturin develop`, no --release) with no optimisation and no debug info
# anywhere (this package's Cargo.toml, dev profile): the cheapest compile on CI's two cores,
# about 50 s from nothing, against 4 min 23 s with every dependency optimised; the suite
# measures no speed and runs as fast. Benchmarks build the release wheel.
#
# The whole suite, the cluster-mode test (a follower SIGKILLed under load) included, runs
# in about 10 s; the build takes the rest of the budget.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
: "${EMBARCADERO_BIN:?set EMBARCADERO_BIN to the embarcadero binary (scripts/test.sh does)}"
export EMBARCADERO_BIN
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
venv="$CARGO_TARGET_DIR/sdk-python-venv"

if [ ! -x "$venv/bin/python" ]; then
  python="${PYTHON:-python3}"
  # A Python without the venv module (Debian's python3 without python3-venv) gets
  # virtualenv from PyPI instead.
  "$python" -m venv "$venv" 2>/dev/null || {
    rm -rf "$venv"
    "$python" -m pip install -q --user --disable-pip-version-check virtualenv
    "$python" -m virtualenv -q "$venv"
  }
fi
# This crate is outside the workspace that .ci/run formats and lints: check its format
# here (no compile); `cargo clippy --all-targets -- -D warnings` is clean too, run by hand.
cargo fmt --manifest-path "$here/Cargo.toml" --check
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" "pytest>=7" "ruff==0.17.6"
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop -q -m "$here/Cargo.toml"

cd "$here"
"$venv/bin/ruff" check --quiet python tests bench.py
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests
