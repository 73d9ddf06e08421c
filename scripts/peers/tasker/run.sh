#!/usr/bin/env bash
# Issue 25: Tasker and Embarcadero's workflow engine on the same shapes, same machine, same run.
# Tasker: tasker-server + our Rust worker on the private PostgreSQL (fsync, synchronous_commit on).
# Embarcadero: serve + orchestrator + worker, events durable with RF 2 and ack 2.
# Each engine runs alone (the other's processes stopped); bench.py drives both over HTTP.
# Needs install.sh first. Usage: [EMBARCADERO=path] [ENGINES="tasker embarcadero"] [SUSTAINED_S=20]
#   [RAW_SAMPLES=200] [POLL_SAMPLES=50] [SHAPES=linear,batch,...] [CLIENTS=8 (the sustained run's)]
#   scripts/peers/tasker/run.sh [OUT_DIR]
# Writes OUT_DIR/table.txt and OUT_DIR/plot.svg, and each half's /proc/loadavg at its start and end
# into OUT_DIR/load.txt (the machine is shared: the load goes with the figures).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
REPO=$(cd "$PEER_DIR/../../.." && pwd)
EMB=${EMBARCADERO:-$REPO/target/release/embarcadero}
OUT=${1:-$(mktemp -d)}
RUN=$OUT/logs
SUSTAINED_S=${SUSTAINED_S:-20}
BENCH=(python3 "$PEER_DIR/bench.py" measure --sustained-seconds "$SUSTAINED_S"
  ${RAW_SAMPLES:+--raw-samples "$RAW_SAMPLES"} ${POLL_SAMPLES:+--poll-samples "$POLL_SAMPLES"}
  ${SHAPES:+--shapes "$SHAPES"} ${CLIENTS:+--clients "$CLIENTS"})
mkdir -p "$RUN"

# Waits (up to 120 s) for a process's readiness line in its log; fails with the log's tail.
wait_for() {
  local deadline=$((SECONDS + 120))
  until grep -qs "$2" "$1"; do
    [ $SECONDS -lt $deadline ] || { tail -20 "$1"; echo "timed out waiting for '$2' in $1" >&2; exit 1; }
    sleep 0.1
  done
}

stop_jobs() {
  jobs -p | xargs -r kill 2>/dev/null || true
  wait 2>/dev/null || true
}
trap stop_jobs EXIT

run_tasker() {
  local port=18180
  # A fresh PostgreSQL at this script's priority: a cluster left running by install.sh (or by a
  # session started under `nice`) would otherwise serve Tasker at that niceness.
  if pg_running; then as_pg pg_ctl -D "$PGDATA_DIR" -m fast -w stop >/dev/null; fi
  start_pg
  "$TASKER_BIN/tasker-config" "127.0.0.1:$port" >"$RUN/tasker.toml"
  # RUST_LOG=info as in the seed's run; set for Tasker's processes only.
  local env=(env TASKER_CONFIG_PATH="$RUN/tasker.toml" TASKER_TEMPLATE_PATH="$PEER_DIR/templates"
    RUST_LOG="${RUST_LOG:-info}")
  "${env[@]}" "$TASKER_BIN/tasker-server" >"$RUN/tasker-server.log" 2>&1 &
  wait_for "$RUN/tasker-server.log" 'tasker-server is running'
  "${env[@]}" "$TASKER_BIN/tasker-bench-worker" >"$RUN/tasker-worker.log" 2>&1 &
  wait_for "$RUN/tasker-worker.log" 'tasker-bench-worker is running'
  "${BENCH[@]}" --engine tasker --api "127.0.0.1:$port" --out "$OUT/tasker.json"
  stop_jobs
}

run_embarcadero() {
  local control api t
  "$EMB" serve --data-dir "$RUN/data" --base-port 0 --control-port 0 2>"$RUN/serve.log" &
  wait_for "$RUN/serve.log" 'embarcadero is serving'
  control=$(grep -o 'http://[0-9.:]*' "$RUN/serve.log" | head -1 | sed 's|http://||')
  "$EMB" orchestrator --control "$control" --listen 127.0.0.1:0 --rf 2 --ack 2 2>"$RUN/orch.log" &
  wait_for "$RUN/orch.log" 'orchestrator is serving'
  api=$(grep -o 'http://[0-9.:]*' "$RUN/orch.log" | tail -1 | sed 's|http://||')
  "$EMB" worker --control "$control" --rf 2 --ack 2 2>"$RUN/worker.log" &
  wait_for "$RUN/worker.log" 'is running'
  for t in "$PEER_DIR"/templates/*.yaml; do "$EMB" template register "$t" --api "$api" >/dev/null; done
  "${BENCH[@]}" --engine embarcadero --api "$api" --out "$OUT/embarcadero.json"
  stop_jobs
  rm -rf "$RUN/data"
}

ENGINES=${ENGINES:-tasker embarcadero}
for engine in $ENGINES; do
  echo "$engine start $(cat /proc/loadavg)" | tee -a "$OUT/load.txt"
  "run_$engine"
  echo "$engine end $(cat /proc/loadavg)" | tee -a "$OUT/load.txt"
done
results=()  # Tasker first: the table's ratio is Tasker's p50 over ours
for engine in tasker embarcadero; do [ ! -f "$OUT/$engine.json" ] || results+=("$OUT/$engine.json"); done
python3 "$PEER_DIR/bench.py" table "${results[@]}" | tee "$OUT/table.txt"
python3 "$PEER_DIR/bench.py" plot "${results[@]}" --out "$OUT/plot.svg"
echo "results and logs in $OUT"
