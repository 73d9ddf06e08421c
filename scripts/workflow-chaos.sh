#!/usr/bin/env bash
# The workflow engine's chaos test (issue 27), not part of `cargo test`: a head and a
# follower broker, the workflow topic at rf 2 / ack 2, one orchestrator, three workers, a
# few hundred tasks of every shape while workers, the orchestrator and the follower are
# SIGKILLed at random moments and restarted; then every task must be complete, every step
# completed once, and every extra handler run accounted for by an attempt the audit trail
# shows lost or failed. The run and the checker are scripts/workflow_chaos.py; arguments
# are passed on (--tasks, --rate, --workers, --lease-ms, --min-secs, --gap, --seed, --keep).
# Builds the debug binary first unless EMBARCADERO_BIN names one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${EMBARCADERO_BIN:-}" ]]; then
  cargo build -q -p embarcadero-cli
  EMBARCADERO_BIN=target/debug/embarcadero
fi
exec python3 scripts/workflow_chaos.py --bin "$EMBARCADERO_BIN" "$@"
