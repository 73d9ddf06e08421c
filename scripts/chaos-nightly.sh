#!/usr/bin/env bash
# Nightly fault campaign: ten minutes of `scripts/chaos.sh` (every fault, a fresh seed),
# after a release build. Exits non-zero on the first anomaly; the failing cycle's history
# stays in bench-results/chaos-histories.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p embarcadero-cli
CHAOS_SECS=600 scripts/chaos.sh "$@"
