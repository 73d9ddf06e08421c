#!/usr/bin/env bash
# Reproduces the figures of docs/PERFORMANCE.md ("the performance bar" section): 1 KiB
# messages, ack 1, 4 brokers. Per run and order (ORDERS, default 0 2 5): publish-only with
# the machine's ceilings measured in the same process right after (every run measures them), and
# publish + one ordered subscriber; then the fixed-rate runs at RATE MB/s (default 330,
# 10% of order 2's saturation on the project's machine) with LINGER_US (default 0: a batch
# is sealed as soon as its sender is free, the client's lowest-latency setting), each after
# WARMUP_MESSAGES (default 100000, a third of a second at 330 MB/s) published on the same
# schedule and left out of the figures, as the peers' warm-up is. Ends with the bar's
# ratios, computed from the JSON files it wrote to $OUT (default bench-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
RUNS=${RUNS:-3}
TOTAL=${TOTAL:-2000000000}
RATE=${RATE:-330}
RATE_TOTAL=${RATE_TOTAL:-990000000}
LINGER_US=${LINGER_US:-0}
WARMUP_MESSAGES=${WARMUP_MESSAGES:-100000}
ORDERS=${ORDERS:-0 2 5}
mkdir -p "$OUT"
cargo build --release -p embarcadero-cli
B=target/release/embarcadero
line() {
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
a = d["append_to_ack_us"]
e2e = d.get("e2e_latency_us") or {}
rate = f'rate {d["rate_mb_per_s"]:.0f}' if d.get("rate_mb_per_s") else "flat out"
print(f'{d["mode"]:8} order {d["order"]} {rate:9} {d["mb_per_s"]:8.1f} MB/s {d["messages_per_s"]:10.0f} msg/s  '
      f'append-to-ack p50 {a["p50"]} p99 {a["p99"]} p99.9 {a["p999"]} us  e2e p50 {e2e.get("p50", "-")} us  '
      f'cpu {d["process_cpu_seconds_per_gb"]:.2f} s/GB')
PY
}
for run in $(seq 1 "$RUNS"); do
  for order in $ORDERS; do
    f="$OUT/publish-order$order-run$run.json"
    $B bench --mode publish --order "$order" --ack 1 --size 1024 --total-bytes "$TOTAL" --json > "$f"
    line "$f"
    f="$OUT/e2e-order$order-run$run.json"
    $B bench --mode e2e --order "$order" --ack 1 --size 1024 --total-bytes "$TOTAL" --json > "$f"
    line "$f"
  done
  for order in $ORDERS; do
    f="$OUT/rate$RATE-order$order-run$run.json"
    $B bench --mode publish --order "$order" --ack 1 --size 1024 --total-bytes "$RATE_TOTAL" \
      --rate "$RATE" --linger-us "$LINGER_US" --warmup-messages "$WARMUP_MESSAGES" --json > "$f"
    line "$f"
  done
done
python3 - "$OUT" "$RATE" <<'PY'
import glob, json, statistics, sys
out, rate = sys.argv[1], sys.argv[2]
def runs(pattern):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{pattern}"))]
def mean(xs):
    return statistics.mean(xs) if xs else float("nan")
pub = {o: runs(f"publish-order{o}-run*.json") for o in (0, 2, 5)}
e2e = {o: runs(f"e2e-order{o}-run*.json") for o in (0, 2, 5)}
lat = {o: runs(f"rate{rate}-order{o}-run*.json") for o in (0, 2, 5)}
def loopback(d):
    return next(c["mb_per_s"] for c in d["ceilings"] if c["name"].startswith("loopback_tcp streams=1"))
print("\nThe bar (issue 5), from these runs:")
if pub[0]:
    ratios = [d["mb_per_s"] / loopback(d) for d in pub[0]]
    print(f'  order 0 publish-only: {mean([d["mb_per_s"] for d in pub[0]]):.0f} MB/s, '
          f'{100 * mean(ratios):.1f}% of the same run\'s loopback ceiling (bar: 60%); '
          f'per run {", ".join(f"{100 * r:.1f}%" for r in ratios)}')
    # Not the bar: one stream per broker, each received into a ring the size of a
    # broker's log in the region, as brokers receive: into memory that is not in the cache.
    ring = lambda d: next((c["mb_per_s"] for c in d["ceilings"] if c["name"].startswith("loopback_tcp_ring")), None)
    if all(ring(d) for d in pub[0]):
        ratios = [d["mb_per_s"] / ring(d) for d in pub[0]]
        print(f'  order 0 against loopback into log-sized rings, a stream per broker ({mean([ring(d) for d in pub[0]]):.0f} MB/s): '
              f'{100 * mean(ratios):.1f}%; per run {", ".join(f"{100 * r:.1f}%" for r in ratios)}')
    for o in (2, 5):
        if pub[o]:
            print(f'  order {o} publish-only: {mean([d["mb_per_s"] for d in pub[o]]):.0f} MB/s, '
                  f'{100 * mean([d["mb_per_s"] for d in pub[o]]) / mean([d["mb_per_s"] for d in pub[0]]):.0f}% of order 0 (bar: at least 90%)')
for o in (0, 2, 5):
    if e2e[o] and pub[o]:
        print(f'  order {o} publish + ordered subscriber: {mean([d["mb_per_s"] for d in e2e[o]]):.0f} MB/s, '
              f'{100 * mean([d["mb_per_s"] for d in e2e[o]]) / mean([d["mb_per_s"] for d in pub[o]]):.0f}% of publish-only (bar: 50%)')
for o in (0, 2, 5):
    if lat[o]:
        epoch = lat[o][0]["epoch_us"]
        p50 = [d["append_to_ack_us"]["p50"] for d in lat[o]]
        p99 = [d["append_to_ack_us"]["p99"] for d in lat[o]]
        print(f'  order {o} at {rate} MB/s: append-to-ack p50 {p50} us (bar: {epoch // 2 + 150}), '
              f'p99 {p99} us (bar: under 2000)')
PY
