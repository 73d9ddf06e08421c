#!/usr/bin/env bash
# Publishers in separate processes against one running server: starts `embarcadero serve`
# (4 brokers, region on /dev/shm, prefaulted), then for each N given runs N concurrent
# `embarcadero bench --control ...` processes that split TOTAL bytes (default 2 GB) of 1 KiB
# messages, each on a topic of its own (order ORDER, default 2; ack 1). Prints each process's
# MB/s and the aggregate over the wall time from the first start to the last exit (process
# start-up included, so a lower bound). JSON per process in $OUT (default bench-results/processes).
# Usage: scripts/bench-processes.sh 1 2 4
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/processes}
TOTAL=${TOTAL:-2000000000}
ORDER=${ORDER:-2}
PORT=${PORT:-17140}
mkdir -p "$OUT"
cargo build --release -p embarcadero-cli
B=target/release/embarcadero
DATA=$(mktemp -d)
REGION=/dev/shm/embarcadero-processes-$$.region
EMBARCADERO_REGION_PATH=$REGION EMBARCADERO_REGION_PREFAULT=true \
  $B serve --data-dir "$DATA" --base-port 0 --control-port "$PORT" 2> "$OUT/serve.log" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$DATA" "$REGION"' EXIT
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$PORT/v1/cluster" > /dev/null && break
  sleep 0.1
done
for n in "$@"; do
  pids=()
  start=$(date +%s.%N)
  for i in $(seq "$n"); do
    $B bench --no-ceilings --control "127.0.0.1:$PORT" --order "$ORDER" --ack 1 --size 1024 \
      --total-bytes $((TOTAL / n)) --json > "$OUT/n$n-p$i.json" 2> /dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"
  end=$(date +%s.%N)
  python3 - "$OUT" "$n" "$start" "$end" <<'PY'
import json, sys
out, n, start, end = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
runs = [json.load(open(f"{out}/n{n}-p{i}.json")) for i in range(1, n + 1)]
total = sum(r["payload_bytes"] for r in runs)
print(f"{n} process(es): each {[round(r['mb_per_s']) for r in runs]} MB/s; "
      f"{total / 1e6:.0f} MB in {end - start:.2f} s = {total / (end - start) / 1e6:.0f} MB/s aggregate")
PY
done
