#!/usr/bin/env bash
# Steady-state soak: one `embarcadero serve` (4 brokers, two disk replicas, retention on)
# under a fixed publish + subscribe load for SOAK_SECS (default 1800), the way an operator
# runs it for days, compressed. The load is `bench --control ... --mode e2e --verify`: RATE
# MB/s (default 100) of 1 KiB messages at order ORDER (default 2) and ack ACK (default 2,
# fsynced on both replicas), one subscriber reading everything in order, and at the end a
# check that every acknowledged message was delivered exactly once at consecutive
# positions. Every SAMPLE_SECS (default 30) the server's anonymous memory, open files,
# threads, CPU, free log segments and replica disk use go to $OUT/samples.csv.
#
# Fails (exit 1) if the check fails, the load falls behind its rate, or the server's
# anonymous memory (RssAnon: the region is a shared file and is not counted) peaks more
# than GROWTH_MIB (default 64) above the first sample after the first minute: a leak shows
# as steady growth, which a bounded server does not have. Replica disk
# use must stay under the retention (RETENTION_MIB per replica, default 1024) plus two
# segments. Not part of `cargo test`. Needs `cargo build --release -p embarcadero-cli`.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${EMBARCADERO_BIN:-target/release/embarcadero}
OUT=${OUT:-bench-results/soak}
SOAK_SECS=${SOAK_SECS:-1800}
RATE=${RATE:-100}
ORDER=${ORDER:-2}
ACK=${ACK:-2}
SAMPLE_SECS=${SAMPLE_SECS:-30}
GROWTH_MIB=${GROWTH_MIB:-64}
RETENTION_MIB=${RETENTION_MIB:-1024}
CONTROL_PORT=${CONTROL_PORT:-22140}
BASE_PORT=${BASE_PORT:-22100}
mkdir -p "$OUT"
DIR=$(mktemp -d)
REGION=/dev/shm/embarcadero-soak-$$.region
[ -d /dev/shm ] || REGION=$DIR/region
SEGMENT_MIB=64
cat >"$DIR/soak.toml" <<EOF
data_dir = "$DIR/data"
base_port = $BASE_PORT
control_port = $CONTROL_PORT

[region]
path = "$REGION"
prefault = true

[replication]
dirs = ["$DIR/replica1", "$DIR/replica2"]
segment_bytes = $((SEGMENT_MIB << 20))
retention_bytes = $((RETENTION_MIB << 20))
EOF
"$B" serve --config "$DIR/soak.toml" >"$OUT/server.log" 2>&1 &
SERVER=$!
cleanup() {
  kill "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
  rm -rf "$DIR" "$REGION"
}
trap cleanup EXIT
CONTROL=127.0.0.1:$CONTROL_PORT
for _ in $(seq 100); do
  curl -sf "http://$CONTROL/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -sf "http://$CONTROL/healthz" >/dev/null || {
  echo "the server did not start; its log, $OUT/server.log:"
  tail -20 "$OUT/server.log"
  exit 1
}

metric_sum() { # the sum of a metric family's samples on /metrics
  curl -s "http://$CONTROL/metrics" | awk -v m="$1" '$1 == m || index($1, m "{") == 1 { s += $2 } END { printf "%.2f\n", s }'
}
sample() {
  local anon_kib fds threads cpu free disk
  anon_kib=$(awk '/^RssAnon:/ { print $2 }' "/proc/$SERVER/status")
  fds=$(find "/proc/$SERVER/fd" -mindepth 1 -maxdepth 1 | wc -l)
  threads=$(awk '/^Threads:/ { print $2 }' "/proc/$SERVER/status")
  cpu=$(metric_sum process_cpu_seconds_total)
  free=$(metric_sum embarcadero_free_segments)
  disk=$( (du -sb "$DIR/replica1" "$DIR/replica2" 2>/dev/null || true) | awk '{ s += $1 } END { printf "%.0f\n", s }')
  echo "$((SECONDS - started)),$anon_kib,$fds,$threads,$cpu,$free,$disk" >>"$OUT/samples.csv"
}

echo "seconds,rss_anon_kib,open_files,threads,cpu_seconds,free_segments,replica_bytes" >"$OUT/samples.csv"
started=$SECONDS
"$B" bench --no-ceilings --control "$CONTROL" --mode e2e --verify --order "$ORDER" --ack "$ACK" --rf 3 \
  --rate "$RATE" --duration "$SOAK_SECS" --json >"$OUT/bench.json" 2>"$OUT/bench.err" &
BENCH=$!
echo "soak: $SOAK_SECS s at $RATE MB/s, order $ORDER, ack $ACK, two replicas; samples in $OUT/samples.csv"
while kill -0 "$BENCH" 2>/dev/null; do
  sample
  for _ in $(seq "$SAMPLE_SECS"); do
    kill -0 "$BENCH" 2>/dev/null || break
    sleep 1
  done
done
bench_status=0
wait "$BENCH" || bench_status=$?
sample

python3 - "$OUT" "$GROWTH_MIB" "$RETENTION_MIB" "$SEGMENT_MIB" "$RATE" "$bench_status" <<'EOF'
import csv, json, sys
out, growth_mib, retention_mib, segment_mib, rate, status = sys.argv[1:]
rows = list(csv.DictReader(open(f"{out}/samples.csv")))
failures = []
if int(status) != 0:
    failures.append(f"bench exited {status}: {open(out + '/bench.err').read()[-2000:]}")
    run = None
else:
    run = json.load(open(f"{out}/bench.json"))
if run:
    check = run["check"]
    print(f"published {run['messages']} messages at {run['mb_per_s']:.1f} MB/s over {run['publish_seconds']:.0f} s; "
          f"exactly-once check {'PASSED' if check['passed'] else 'FAILED'}: {check['delivered']} delivered, "
          f"{check['missing']} missing, {check['duplicates']} duplicated, {check['out_of_place']} out of place")
    print(f"append-to-ack p50 {run['append_to_ack_us']['p50']} us, p99 {run['append_to_ack_us']['p99']} us; "
          f"end to end p50 {run['e2e_latency_us']['p50']} us, p99 {run['e2e_latency_us']['p99']} us")
    if not check["passed"]:
        failures.append(f"the exactly-once check failed: {json.dumps(check)}")
    if run["mb_per_s"] < 0.95 * float(rate):
        failures.append(f"the load fell behind: {run['mb_per_s']:.1f} MB/s of {rate}")
after_first_minute = [r for r in rows if int(r["seconds"]) >= 60] or rows
# The last row is taken after the load ended: the peak is the one that tells a leak.
first, last = after_first_minute[0], rows[-1]
peak = max(after_first_minute, key=lambda r: int(r["rss_anon_kib"]))
grew = (int(peak["rss_anon_kib"]) - int(first["rss_anon_kib"])) / 1024
print(f"server anonymous memory {int(first['rss_anon_kib']) / 1024:.1f} MiB at {first['seconds']} s, "
      f"peak {int(peak['rss_anon_kib']) / 1024:.1f} MiB at {peak['seconds']} s ({grew:+.1f} MiB); "
      f"open files at most {max(int(r['open_files']) for r in rows)}, "
      f"threads at most {max(int(r['threads']) for r in rows)}")
if grew > float(growth_mib):
    failures.append(f"anonymous memory grew by {grew:.0f} MiB (limit {growth_mib})")
disk_max = max(int(r["replica_bytes"]) for r in rows)
disk_limit = 2 * (int(retention_mib) + 2 * int(segment_mib)) << 20
limit = f"limit {disk_limit / 2**20:.0f}" if int(retention_mib) > 0 else "no retention"
print(f"replica disk use peaked at {disk_max / 2**20:.0f} MiB for both replicas ({limit})")
if int(retention_mib) > 0 and disk_max > disk_limit:
    failures.append(f"replica disk use {disk_max / 2**20:.0f} MiB is above retention ({disk_limit / 2**20:.0f} MiB)")
cpu = [float(r["cpu_seconds"]) for r in rows]
span = int(last["seconds"]) - int(rows[0]["seconds"])
if span > 0:
    print(f"server CPU {(cpu[-1] - cpu[0]) / span:.2f} cores on average")
for f in failures:
    print("FAILED:", f)
sys.exit(1 if failures else 0)
EOF
