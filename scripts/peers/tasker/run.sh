#!/usr/bin/env bash
# Issue 25: Tasker and Embarcadero's workflow engine on the same shapes, same machine, same run.
# Tasker: tasker-server + our Rust worker on the private PostgreSQL (fsync, synchronous_commit on).
# Embarcadero: serve + orchestrator + worker, events durable with RF 2 and ack 2.
# Each engine runs alone (the other's processes stopped); bench.py drives both over HTTP.
# Needs install.sh first. Usage: [EMBARCADERO=path] [ENGINES="tasker embarcadero"] [SUSTAINED_S=20]
#   [RAW_SAMPLES=200] [POLL_SAMPLES=50] [SHAPES=linear,batch,...] [HANDLERS="rust python typescript"]
#   [CLIENTS=8 (the sustained run's)] [WORKER_ARGS="--concurrency 32" (more arguments for our Rust worker)]
#   scripts/peers/tasker/run.sh [OUT_DIR]
# HANDLERS: the languages of the workers' handlers, each run in turn in each engine (default rust;
# python and typescript need install-handlers.sh, run only SHAPES, default linear, and no
# sustained phase). Writes OUT_DIR/table.txt (Rust handlers) and OUT_DIR/overhead.txt (per-step
# cost of each language), OUT_DIR/plot.svg, and each run's /proc/loadavg at its start and end
# into OUT_DIR/load.txt (the machine is shared: the load goes with the figures).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
REPO=$(cd "$PEER_DIR/../../.." && pwd)
EMB=${EMBARCADERO:-$REPO/target/release/embarcadero}
OUT=${1:-$(mktemp -d)}
RUN=$OUT/logs
SUSTAINED_S=${SUSTAINED_S:-20}
HANDLERS=${HANDLERS:-rust}
mkdir -p "$RUN"

# The measuring client for one engine ($1) with handlers in language $2: its result file is
# OUT/ENGINE.json for Rust handlers, OUT/ENGINE-LANGUAGE.json otherwise.
bench() {
  local shapes=${SHAPES:-} sustained=$SUSTAINED_S out=$OUT/$1.json
  if [ "$2" != rust ]; then shapes=${SHAPES:-linear} sustained=0 out=$OUT/$1-$2.json; fi
  python3 "$PEER_DIR/bench.py" measure --engine "$1" --handlers "$2" --api "$3" --out "$out" \
    --sustained-seconds "$sustained" ${shapes:+--shapes "$shapes"} \
    ${RAW_SAMPLES:+--raw-samples "$RAW_SAMPLES"} ${POLL_SAMPLES:+--poll-samples "$POLL_SAMPLES"} \
    ${CLIENTS:+--clients "$CLIENTS"}
}

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

# Python and TypeScript handlers (install-handlers.sh): a virtual environment with tasker-py and
# our Python SDK; our TypeScript SDK built in sdk/typescript.
HANDLERS_VENV=$TASKER_CACHE/handlers-venv
export EMBARCADERO_TS=$REPO/sdk/typescript

# Starts Tasker's worker with handlers in language $1, logging to $2; waits until it is ready.
start_tasker_worker() {
  case $1 in
    rust) "${env[@]}" "$TASKER_BIN/tasker-bench-worker" >"$2" 2>&1 & ;;
    python) "${env[@]}" "$HANDLERS_VENV/bin/python" "$PEER_DIR/handlers/tasker_worker.py" >"$2" 2>&1 & ;;
    *) echo "unknown HANDLERS language $1" >&2; exit 2 ;;
  esac
  wait_for "$2" "worker is running\|tasker-bench-worker is running"
}

run_tasker() {
  local lang=$1 port=18180
  if [ "$lang" = typescript ]; then
    echo "Tasker publishes no TypeScript worker (docs/BENCHMARKS.md): no tasker typescript run" >&2
    return 0
  fi
  [ -x "$TASKER_BIN/tasker-server" ] ||
    { echo "no $TASKER_BIN/tasker-server: run install.sh, or set TASKER_TARGET_DIR" >&2; exit 1; }
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
  start_tasker_worker "$lang" "$RUN/tasker-worker-$lang.log"
  bench tasker "$lang" "127.0.0.1:$port"
  stop_jobs
}

run_embarcadero() {
  local lang=$1 control api t log=$RUN/worker-$1.log
  "$EMB" serve --data-dir "$RUN/data" --base-port 0 --control-port 0 2>"$RUN/serve.log" &
  wait_for "$RUN/serve.log" 'embarcadero is serving'
  control=$(grep -o 'http://[0-9.:]*' "$RUN/serve.log" | head -1 | sed 's|http://||')
  "$EMB" orchestrator --control "$control" --listen 127.0.0.1:0 --rf 2 --ack 2 2>"$RUN/orch.log" &
  wait_for "$RUN/orch.log" 'orchestrator is serving'
  api=$(grep -o 'http://[0-9.:]*' "$RUN/orch.log" | tail -1 | sed 's|http://||')
  # Every worker publishes its events as the orchestrator does: RF 2, ack 2.
  case $lang in
    # shellcheck disable=SC2086 # WORKER_ARGS is a list of words
    rust) "$EMB" worker --control "$control" --rf 2 --ack 2 ${WORKER_ARGS:-} 2>"$log" & ;;
    python) "$HANDLERS_VENV/bin/python" "$PEER_DIR/handlers/embarcadero_worker.py" \
      --control "$control" --rf 2 --ack 2 2>"$log" & ;;
    typescript) node "$PEER_DIR/handlers/embarcadero-worker.mjs" --control "$control" --rf 2 \
      --ack 2 2>"$log" & ;;
    *) echo "unknown HANDLERS language $lang" >&2; exit 2 ;;
  esac
  wait_for "$log" 'is running'
  for t in "$PEER_DIR"/templates/*.yaml; do "$EMB" template register "$t" --api "$api" >/dev/null; done
  bench embarcadero "$lang" "$api"
  stop_jobs
  rm -rf "$RUN/data"
}

ENGINES=${ENGINES:-tasker embarcadero}
for engine in $ENGINES; do
  for lang in $HANDLERS; do
    echo "$engine $lang start $(cat /proc/loadavg)" | tee -a "$OUT/load.txt"
    "run_$engine" "$lang"
    echo "$engine $lang end $(cat /proc/loadavg)" | tee -a "$OUT/load.txt"
  done
done
results=() all=()  # Tasker first: the table's ratio is Tasker's p50 over ours
for engine in tasker embarcadero; do
  [ ! -f "$OUT/$engine.json" ] || results+=("$OUT/$engine.json")
  for lang in rust python typescript; do
    f=$OUT/$engine-$lang.json
    [ "$lang" = rust ] && f=$OUT/$engine.json
    [ ! -f "$f" ] || all+=("$f")
  done
done
if [ ${#results[@]} -gt 0 ]; then
  python3 "$PEER_DIR/bench.py" table "${results[@]}" | tee "$OUT/table.txt"
  python3 "$PEER_DIR/bench.py" plot "${results[@]}" --out "$OUT/plot.svg"
fi
if [ "$HANDLERS" != rust ]; then
  python3 "$PEER_DIR/bench.py" overhead "${all[@]}" | tee "$OUT/overhead.txt"
fi
echo "results and logs in $OUT"
