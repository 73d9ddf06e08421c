#!/usr/bin/env bash
# Workflow latency, A/B: runs scripts/workflow_latency.sh in turn for an older binary, the
# new one with --task-protocol 1 and the new one with its default protocol, ROUNDS times
# (interleaved, so that each of the three sees about the same machine load), printing the
# load average around each run. Traces of the new binary's runs go to TRACE_DIR
# (scripts/workflow_trace.py reads them).
# Usage: scripts/workflow_latency_ab.sh BEFORE_BIN [NEW_BIN] [COUNT]
# Env: ROUNDS (default 2), TRACE_DIR (default: a new temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1
NEW=${2:-target/release/embarcadero}
COUNT=${3:-200}
TRACE_DIR=${TRACE_DIR:-$(mktemp -d)}
for round in $(seq 1 "${ROUNDS:-2}"); do
  echo "round $round, load $(cat /proc/loadavg)"
  echo -n "  before:     "; scripts/workflow_latency.sh "$BEFORE" "$COUNT" 2>&1 | grep " tasks of "
  echo "    load $(cat /proc/loadavg)"
  echo -n "  protocol 1: "
  TASK_PROTOCOL=1 TRACE="$TRACE_DIR/p1-$round.trace" scripts/workflow_latency.sh "$NEW" "$COUNT" 2>&1 | grep " tasks of "
  echo "    load $(cat /proc/loadavg)"
  echo -n "  protocol 2: "
  TRACE="$TRACE_DIR/p2-$round.trace" scripts/workflow_latency.sh "$NEW" "$COUNT" 2>&1 | grep " tasks of "
  echo "    load $(cat /proc/loadavg)"
done
echo "traces in $TRACE_DIR"
