#!/usr/bin/env bash
# Issue 25: Tasker and Embarcadero's workflow engine on the same shapes, same machine, same run.
# Tasker: tasker-server + our Rust worker on the private PostgreSQL (fsync, synchronous_commit on).
# Embarcadero: serve + orchestrator + worker, events durable with RF 2 and ack 2.
# Each engine runs alone (the other's processes stopped); bench.py drives both over HTTP.
# Needs install.sh first. Usage: [EMBARCADERO=path] [ENGINES="tasker embarcadero"] [SUSTAINED_S=20]
#   [RAW_SAMPLES=200] [POLL_SAMPLES=50] [SHAPES=linear,batch,...] [HANDLERS="rust python typescript"]
#   [CLIENTS=8 (our sustained run's)] [WORKER_ARGS="--concurrency 32" (more arguments for our Rust worker)]
#   [TASKER_CLIENTS=4] [TASKER_SUSTAINED_POLL_MS=50]
#   [TASKER_ORCHESTRATORS=2] [TASKER_WORKERS=2] [TASKER_FRESH_DB=1] [TASKER_DEPLOYMENT_MODE=EventDrivenOnly] [SWEEP=1,2,4,8 [SWEEP_POLL_MS=50]]
#   scripts/peers/tasker/run.sh [OUT_DIR]
# TASKER_ORCHESTRATORS / TASKER_WORKERS: how many tasker-server and worker processes (Tasker
# scales out by processes, each running one sequential command loop; 2 and 2 is its own
# benchmark's topology; the clients use the servers round-robin). TASKER_FRESH_DB=1 drops and re-creates Tasker's database before each
# Tasker run (ours starts from an empty data directory too). SWEEP: instead of measuring the
# shapes, sustained runs at these client counts (and SWEEP_POLL_MS intervals for Tasker; ours
# long-polls), SWEEP_S seconds each (default 15), into OUT_DIR/ENGINE-sweep.json and sweep.txt.
# HANDLERS: the languages of the workers' handlers, each run in turn in each engine (default rust;
# python and typescript need install-handlers.sh, run only SHAPES, default linear, and no
# sustained phase). Writes OUT_DIR/table.txt (Rust handlers) and OUT_DIR/overhead.txt (per-step
# cost of each language), OUT_DIR/plot.svg, and each run's /proc/loadavg at its start and end
# into OUT_DIR/load.txt (the machine is shared: the load goes with the figures).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "$0")/env.sh"
REPO=$(cd "$PEER_DIR/../../.." && pwd)
# The shapes, one YAML per shape read by both engines: the ones built into `embarcadero bench
# --mode workflow`.
TEMPLATES="$REPO/crates/cli/src/bench/workflow"
EMB=${EMBARCADERO:-$REPO/target/release/embarcadero}
OUT=${1:-$(mktemp -d)}
RUN=$OUT/logs
SUSTAINED_S=${SUSTAINED_S:-20}
HANDLERS=${HANDLERS:-rust}
mkdir -p "$RUN"

# The measuring client for one engine ($1) with handlers in language $2: its result file is
# OUT/ENGINE.json for Rust handlers, OUT/ENGINE-LANGUAGE.json otherwise.
bench() {
  local shapes=${SHAPES:-} sustained=$SUSTAINED_S out=$OUT/$1.json poll
  if [ -n "${SWEEP:-}" ]; then
    poll=${SWEEP_POLL_MS:-50}
    [ "$1" = tasker ] || poll=long
    echo "$1 sweep, $(echo "$3" | tr ',' '\n' | wc -l) API process(es), poll $poll" |
      tee -a "$OUT/sweep.txt"
    python3 "$PEER_DIR/bench.py" sweep --engine "$1" --api "$3" --clients "$SWEEP" \
      --poll-ms "$poll" --seconds "${SWEEP_S:-15}" --out "$OUT/$1-sweep.json" |
      tee -a "$OUT/sweep.txt"
    return
  fi
  if [ "$2" != rust ]; then shapes=${SHAPES:-linear} sustained=0 out=$OUT/$1-$2.json; fi
  # Tasker's throughput peaks at 2-4 closed-loop clients and falls with more (its polls cost
  # it; docs/BENCHMARKS.md), so its sustained run has its own client count.
  local clients=${CLIENTS:-8}
  [ "$1" != tasker ] || clients=${TASKER_CLIENTS:-4}
  python3 "$PEER_DIR/bench.py" measure --engine "$1" --handlers "$2" --api "$3" --out "$out" \
    --sustained-seconds "$sustained" ${shapes:+--shapes "$shapes"} \
    ${RAW_SAMPLES:+--raw-samples "$RAW_SAMPLES"} ${POLL_SAMPLES:+--poll-samples "$POLL_SAMPLES"} \
    --clients "$clients" \
    ${TASKER_SUSTAINED_POLL_MS:+--sustained-poll-ms "$TASKER_SUSTAINED_POLL_MS"}
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
export EMBARCADERO_TS=${EMBARCADERO_TS:-$REPO/sdk/typescript}

# Starts Tasker's worker number $3 with handlers in language $1, logging to $2; waits until it
# is ready. Each worker gets its own TASKER_WORKER_ID (tasker-worker's own variable).
start_tasker_worker() {
  local id=(env TASKER_WORKER_ID="worker-$(printf %03d "$3")")
  case $1 in
    rust) "${env[@]}" "${id[@]}" "$TASKER_BIN/tasker-bench-worker" >"$2" 2>&1 & ;;
    python) "${env[@]}" "${id[@]}" "$HANDLERS_VENV/bin/python" "$PEER_DIR/handlers/tasker_worker.py" \
      >"$2" 2>&1 & ;;
    *) echo "unknown HANDLERS language $1" >&2; exit 2 ;;
  esac
  wait_for "$2" "worker is running\|tasker-bench-worker is running"
}

run_tasker() {
  local lang=$1 i port apis=() env
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
  # An empty schema, as our engine starts from an empty data directory: rows of earlier runs
  # would otherwise grow the tables Tasker's readiness queries read.
  if [ "${TASKER_FRESH_DB:-1}" = 1 ]; then "$PEER_DIR/install.sh" --no-build --fresh-db >/dev/null; fi
  for ((i = 1; i <= ${TASKER_ORCHESTRATORS:-2}; i++)); do
    port=$((18179 + i))
    # TASKER_DEPLOYMENT_MODE: EventDrivenOnly (default here: LISTEN/NOTIFY only, documented by
    # Tasker as its lowest-latency mode for stable networks; it gave Tasker ~40% more
    # throughput here), Hybrid (the crates' default) or PollingOnly (docs/BENCHMARKS.md).
    "$TASKER_BIN/tasker-config" "127.0.0.1:$port" |
      sed "s/^deployment_mode = \"Hybrid\"/deployment_mode = \"${TASKER_DEPLOYMENT_MODE:-EventDrivenOnly}\"/" \
        >"$RUN/tasker-$i.toml"
    # RUST_LOG=info as in the seed's run; set for Tasker's processes only.
    env=(env TASKER_CONFIG_PATH="$RUN/tasker-$i.toml" TASKER_TEMPLATE_PATH="$TEMPLATES"
      RUST_LOG="${RUST_LOG:-info}")
    "${env[@]}" "$TASKER_BIN/tasker-server" >"$RUN/tasker-server-$i.log" 2>&1 &
    wait_for "$RUN/tasker-server-$i.log" 'tasker-server is running'
    apis+=("127.0.0.1:$port")
  done
  env=(env TASKER_CONFIG_PATH="$RUN/tasker-1.toml" TASKER_TEMPLATE_PATH="$TEMPLATES"
    RUST_LOG="${RUST_LOG:-info}")
  for ((i = 1; i <= ${TASKER_WORKERS:-2}; i++)); do
    start_tasker_worker "$lang" "$RUN/tasker-worker-$lang-$i.log" "$i"
  done
  bench tasker "$lang" "$(IFS=,; echo "${apis[*]}")"
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
  for t in "$TEMPLATES"/*.yaml; do "$EMB" template register "$t" --api "$api" >/dev/null; done
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
if [ -n "${SWEEP:-}" ]; then
  echo "results and logs in $OUT"
  exit 0
fi
if [ ${#results[@]} -gt 0 ]; then
  python3 "$PEER_DIR/bench.py" table "${results[@]}" | tee "$OUT/table.txt"
  python3 "$PEER_DIR/bench.py" plot "${results[@]}" --out "$OUT/plot.svg"
fi
if [ "$HANDLERS" != rust ]; then
  python3 "$PEER_DIR/bench.py" overhead "${all[@]}" | tee "$OUT/overhead.txt"
fi
echo "results and logs in $OUT"
