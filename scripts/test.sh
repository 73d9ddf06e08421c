#!/usr/bin/env bash
# The repository's one test command (the README's): the Rust workspace, then every client
# library's suite. Each library under sdk/ that has a `test.sh` is tested by it, against the
# `embarcadero` binary this script builds; each such script says what it installs (from the
# package registries only) and where.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
shopt -s nullglob
for suite in sdk/*/test.sh; do
  echo "== ${suite%/test.sh}"
  cargo build -q -p embarcadero-cli
  EMBARCADERO_BIN="$PWD/target/debug/embarcadero" bash "$suite"
done
