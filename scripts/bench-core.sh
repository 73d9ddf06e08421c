#!/usr/bin/env bash
# Reproduces the figures of docs/PERFORMANCE.md ("core log" section): machine ceilings,
# then publish-only and publish+subscribe runs of 1 KiB messages, ack 1, 4 brokers, for
# orders 0, 2 and 5 (ORDERS to choose), each repeated. Results go to $OUT (default: bench-results/) as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
RUNS=${RUNS:-3}
TOTAL=${TOTAL:-2000000000}
mkdir -p "$OUT"
cargo build --release -p embarcadero-cli
B=target/release/embarcadero
cargo run --release -q -p embarcadero-bench --example ceilings > "$OUT/ceilings.txt"
cat "$OUT/ceilings.txt"
for run in $(seq 1 "$RUNS"); do
  for mode in publish e2e; do
    for order in ${ORDERS:-0 2 5}; do
      f="$OUT/$mode-order$order-run$run.json"
      $B bench --mode "$mode" --order "$order" --ack 1 --size 1024 --total-bytes "$TOTAL" --json > "$f"
      python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
lat = d["ack_latency_us"]
e2e = d.get("e2e_latency_us") or {}
print(f'{d["mode"]:8} order {d["order"]}  {d["mb_per_s"]:8.1f} MB/s  {d["messages_per_s"]:10.0f} msg/s  '
      f'ack p50 {lat["p50"]} us p99 {lat["p99"]} us  e2e p50 {e2e.get("p50", "-")} us  '
      f'cpu {d["process_cpu_seconds_per_gb"]:.2f} s/GB')
PY
    done
  done
done
