#!/usr/bin/env bash
# Workflow latency, phase 1: a server, an orchestrator and one worker on this host;
# 200 linear 4-step tasks one after another, each from POST to complete (long poll).
# Events are durable (topic RF 2, ack 2; ACK=1 for ordered only, RF 1).
# TRACE=FILE: the orchestrator and the worker append a latency trace of every event they
# read to FILE (see crates/workflow/src/trace.rs); scripts/workflow_trace.py reads it.
# TASK_PROTOCOL=1: tasks of protocol 1 (the orchestrator enqueues and completes steps by
# events; docs/WORKFLOW.md), for comparison; default: the orchestrator's (2).
# EPOCH_US=N: the sequencer's epoch (default: the server's, 500 us).
# CLIENTS=N: N closed-loop clients run the COUNT tasks between them (throughput; prints
# tasks/s too); default 1, one task at a time.
# LINGER_US=N: the orchestrator's and the worker's publisher linger (default 0).
# CLIENT_BIN=PATH: the binary whose `task bench` drives the tasks (default BIN), so that an
# older engine can be measured by the same client.
# PERF=DIR: record `perf record -g` of the orchestrator and the worker while the tasks run,
# into DIR/orch.data, DIR/worker.data and DIR/serve.data.
# WORKER_ARGS="...": more arguments for the worker (e.g. "--concurrency 32").
# SNAPSHOT_EVERY=N: the orchestrator snapshots its state every N events (into the run's
# temporary directory), to see that snapshots stay off the tasks' path.
# Usage: [ACK=1] [TRACE=FILE] [TASK_PROTOCOL=1] [EPOCH_US=N] [CLIENTS=N] [PERF=DIR] [SNAPSHOT_EVERY=N]
#   scripts/workflow_latency.sh [BIN] [COUNT]
set -euo pipefail
BIN=${1:-target/release/embarcadero}
COUNT=${2:-200}
ACK=${ACK:-2}
RF=$([ "$ACK" = 2 ] && echo 2 || echo 1)
DIR=$(mktemp -d)
[ -n "${TRACE:-}" ] && export EMBARCADERO_WORKFLOW_TRACE="$TRACE"
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT

"$BIN" serve --data-dir "$DIR/data" --base-port 0 --control-port 0 \
  ${EPOCH_US:+--epoch-us "$EPOCH_US"} 2>"$DIR/serve.log" &
SERVE_PID=$!
until grep -q 'embarcadero is serving' "$DIR/serve.log"; do sleep 0.1; done
CONTROL=$(grep -o 'http://[0-9.:]*' "$DIR/serve.log" | head -1 | sed 's|http://||')

"$BIN" orchestrator --control "$CONTROL" --listen 127.0.0.1:0 --rf "$RF" --ack "$ACK" ${LINGER_US:+--linger-us "$LINGER_US"} \
  ${TASK_PROTOCOL:+--task-protocol "$TASK_PROTOCOL"} \
  ${SNAPSHOT_EVERY:+--data-dir "$DIR/orch" --snapshot-every "$SNAPSHOT_EVERY"} 2>"$DIR/orch.log" &
ORCH_PID=$!
until grep -q 'orchestrator is serving' "$DIR/orch.log"; do sleep 0.1; done
API=$(grep -o 'http://[0-9.:]*' "$DIR/orch.log" | tail -1 | sed 's|http://||')

# shellcheck disable=SC2086 # WORKER_ARGS is a list of words
"$BIN" worker --control "$CONTROL" --rf "$RF" --ack "$ACK" ${LINGER_US:+--linger-us "$LINGER_US"} \
  ${WORKER_ARGS:-} 2>"$DIR/worker.log" &
WORKER_PID=$!
until grep -q 'is running' "$DIR/worker.log"; do sleep 0.1; done

cat >"$DIR/linear.yaml" <<'YAML'
name: linear
namespace: bench
version: 1.0.0
steps:
  - {name: one, handler: {callable: math.square}}
  - {name: two, dependencies: [one], handler: {callable: math.square}}
  - {name: three, dependencies: [two], handler: {callable: math.square}}
  - {name: four, dependencies: [three], handler: {callable: math.square}}
YAML
"$BIN" template register "$DIR/linear.yaml" --api "$API"
if [ -n "${PERF:-}" ]; then
  mkdir -p "$PERF"
  perf record -g -F 999 -p "$ORCH_PID" -o "$PERF/orch.data" 2>"$PERF/orch.perf.log" &
  perf record -g -F 999 -p "$WORKER_PID" -o "$PERF/worker.data" 2>"$PERF/worker.perf.log" &
  perf record -g -F 999 -p "$SERVE_PID" -o "$PERF/serve.data" 2>"$PERF/serve.perf.log" &
fi
# CPU seconds (user + system) a process has used so far.
cpu_s() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
echo "load before: $(cat /proc/loadavg)"
CPU_BEFORE="$(cpu_s $SERVE_PID) $(cpu_s $ORCH_PID) $(cpu_s $WORKER_PID)"
"${CLIENT_BIN:-$BIN}" task bench --namespace bench --name linear --context '{"even_number":2}' --count "$COUNT" \
  --clients "${CLIENTS:-1}" --api "$API"
echo "CPU s during the tasks (serve orchestrator worker): before $CPU_BEFORE, after $(cpu_s $SERVE_PID) $(cpu_s $ORCH_PID) $(cpu_s $WORKER_PID); load $(cat /proc/loadavg)" >&2
# Events and batches in the log (registration and warm-up included): events per batch is
# what the server's per-batch costs are divided by.
curl -s "http://$CONTROL/v1/topics/workflow.events" | python3 -c '
import json, sys
t = json.load(sys.stdin)
events, batches = t["next_position"], t["committed_batches"]
print(f"log: {events} events in {batches} batches ({events / max(batches, 1):.2f} events per batch)")' >&2 || true
if [ -n "${SNAPSHOT_EVERY:-}" ]; then
  # How many snapshots were written and how long the last one held the state's lock.
  curl -s "http://$API/metrics" | grep -E '^embarcadero_workflow_snapshot' || true
fi
