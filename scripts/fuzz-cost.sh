#!/usr/bin/env bash
# Where a running fuzz campaign's time goes, independent of how busy the machine is:
#
#   scripts/fuzz-cost.sh OUT_DIR SECONDS
#
# OUT_DIR is a target's afl output directory of a campaign that is running now (e.g.
# /work/fuzz-out/http_request). Over SECONDS it samples the CPU time (user + system,
# from /proc) of afl-fuzz and of the target's processes, and the executions afl counted
# (plot_data, written every 5 s), and prints CPU microseconds per execution for each:
# the target's share is what the harness and the decoder cost; afl-fuzz's is the
# fuzzer's own (mutation, map classification). Wall-clock exec/s on a shared machine
# mostly says how much CPU the others left; this does not.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OUT_DIR SECONDS" >&2; exit 2; }
OUT=$1
SECS=$2
PLOT=$OUT/default/plot_data
BIN=$(head -1 "$OUT/default/cmdline") # afl writes the target's command line there
HZ=$(getconf CLK_TCK)

fuzzer_pid() { # the afl-fuzz whose -o is OUT
    pgrep -f -- "afl-fuzz .*-o $OUT( |$)" | head -1
}
target_pids() { # every process running the target binary (fork servers, persistent children)
    pgrep -f -x -- "$BIN( .*)?" || true
}
ticks() { # summed utime+stime of the pids given
    local sum=0 pid f
    for pid in "$@"; do
        f=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
        f=${f##*) }
        set -- $f
        sum=$((sum + ${12} + ${13}))
    done
    echo "$sum"
}
execs() { # total_execs of plot_data's last line
    tail -1 "$PLOT" | awk -F', *' '{print $12}'
}

pid=$(fuzzer_pid)
[ -n "$pid" ] || { echo "no afl-fuzz running on $OUT" >&2; exit 1; }
# Wait for a fresh plot_data line so the execution count and the CPU sample line up.
wait_line() {
    local before
    before=$(tail -1 "$PLOT")
    while [ "$(tail -1 "$PLOT")" = "$before" ]; do sleep 0.2; done
}
wait_line
e0=$(execs); f0=$(ticks "$pid"); t0=$(ticks $(target_pids)); w0=$(date +%s.%N)
sleep "$SECS"
wait_line
e1=$(execs); f1=$(ticks "$pid"); t1=$(ticks $(target_pids)); w1=$(date +%s.%N)
n=$((e1 - e0))
[ "$n" -gt 0 ] || { echo "no executions in the window" >&2; exit 1; }
awk -v n="$n" -v fz="$((f1 - f0))" -v tg="$((t1 - t0))" -v hz="$HZ" -v w="$(echo "$w1 - $w0" | bc)" \
    -v load="$(cut -d' ' -f1-3 /proc/loadavg)" -v out="$OUT" 'BEGIN {
    printf "%s: %d execs in %.0f s wall (%.0f exec/s), load %s\n", out, n, w, n / w, load
    printf "  CPU us/exec: target %.1f, afl-fuzz %.1f, total %.1f  (=> %.0f exec/s per free core)\n",
        tg / hz * 1e6 / n, fz / hz * 1e6 / n, (tg + fz) / hz * 1e6 / n, n / ((tg + fz) / hz)
}'
