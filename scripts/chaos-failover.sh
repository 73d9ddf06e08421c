#!/usr/bin/env bash
# Soak of broker failover: `embarcadero bench --mode failure` again and again for SOAK_SECS
# (default 1500), cycling through order 2 and 5, ack 1 and ack 2 (rf 2, disk replicas), one
# and three publishers, each run SIGKILLing a follower at a random moment between 0.3 and
# 3.5 s into a 5 s run and checking that every acknowledged message is delivered exactly
# once in one order. Stops at the first failing run and prints its output; the output of
# every run is kept in $OUT (default bench-results/chaos). Not part of `cargo test`: it
# takes as long as you give it. Needs `cargo build --release -p embarcadero-cli` first.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${EMBARCADERO_BIN:-target/release/embarcadero}
OUT=${OUT:-bench-results/chaos}
SOAK_SECS=${SOAK_SECS:-1500}
# A run still going after HANG_SECS (default 120; a run takes about 10 s) has its processes'
# stacks written next to its output (gdb, if installed), and is then killed.
HANG_SECS=${HANG_SECS:-120}
mkdir -p "$OUT"

# Waits up to HANG_SECS for process $1; past that, writes the stacks of every process of
# the binary (the run's bench and the cluster it started) to $2, kills it and returns 1.
wait_or_dump() {
  local pid=$1 stacks=$2 waited=0
  while kill -0 "$pid" 2>/dev/null; do
    if ((waited >= HANG_SECS * 10)); then
      for p in $(pgrep -f "^$B " || true); do
        { echo "=== pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline")"; } 2>/dev/null
        command -v gdb >/dev/null && gdb -p "$p" -batch -ex "thread apply all bt 20" 2>/dev/null
      done >"$stacks"
      pkill -KILL -P "$pid" 2>/dev/null || true
      kill -KILL "$pid" 2>/dev/null || true
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}
configs=(
  "--order 2 --ack 1"
  "--order 5 --ack 1"
  "--order 2 --ack 2 --rf 2"
  "--order 5 --ack 2 --rf 2"
  "--order 2 --ack 1 --publishers 3"
)
run=0
end=$((SECONDS + SOAK_SECS))
while ((SECONDS < end)); do
  for cfg in "${configs[@]}"; do
    run=$((run + 1))
    kill_after=$(python3 -c "import random; print(round(random.uniform(0.3, 3.5), 2))")
    out="$OUT/run-$run.txt"
    # shellcheck disable=SC2086 # the configuration is a list of arguments
    "$B" bench --no-ceilings --mode failure $cfg --duration 5 --kill-after-secs "$kill_after" >"$out" 2>&1 &
    pid=$!
    if ! wait_or_dump "$pid" "$out.stacks"; then
      echo "run $run did not end within ${HANG_SECS}s; stacks of its processes: $out.stacks"
    fi
    if ! wait "$pid"; then
      echo "run $run FAILED ($cfg --kill-after-secs $kill_after); its output, $out:"
      tail -30 "$out"
      exit 1
    fi
    echo "run $run ($cfg, kill after $kill_after s): $(grep -o 'exactly-once check PASSED: [0-9]* messages' "$out")"
  done
done
echo "all $run runs passed"
