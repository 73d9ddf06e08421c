#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder that reads untrusted bytes, with cargo afl
# (AFL++, stable toolchain). Usage:
#
#   scripts/fuzz.sh TARGET|all SECONDS
#
# Builds the targets in fuzz/ (installing cargo-afl if it is missing; `cargo install`
# builds AFL++ too), writes the seed corpora (wire frames from testdata/wire/*.json,
# hand-made seeds for the rest; see fuzz/src/bin/seeds.rs), then runs each target for
# SECONDS under `nice` and prints its executions, exec/s, crashes and hangs from afl's
# fuzzer_stats. Exits 1 if any target has a crash or a hang.
#
# Output goes to $FUZZ_OUT (default fuzz/out/<target>). A second run of a target resumes
# its queue and its counts (AFL_AUTORESUME), so runs add up towards the 10 million
# executions per target of docs/RELIABILITY.md; crash and hang files stay there (and keep
# failing the script) until they are moved out: reproduce one with
#   fuzz/target/release/TARGET < fuzz/out/TARGET/default/crashes/id:...
# then turn it into a unit test in the crate that owns the decoder, and move the file to
# fuzz/out/TARGET/fixed/. The crashes and hangs printed are the files still in
# default/crashes and default/hangs; "ever" is afl's count, fixed ones included. FUZZ_FRESH=1 starts
# every target from its seeds. Other knobs: FUZZ_NICE (15), FUZZ_TIMEOUT_MS (1000, a run
# longer than this is a hang if it also takes longer than FUZZ_HANG_MS, 5000, when run
# again), FUZZ_MEM_MB (2048, more is an out-of-memory crash),
# CARGO_TARGET_DIR (default fuzz/target). Not part of `cargo test` or CI.
set -euo pipefail
# Paths given relative (CARGO_TARGET_DIR, FUZZ_OUT) are relative to where it was run.
CALLED_FROM=$(pwd)
cd "$(dirname "$0")/.."
ROOT=$(pwd)
absolute() { (cd "$CALLED_FROM" && realpath -m "$1"); }
TARGETS=(wire_hello wire_frames wire_batch region_header replication_segment
    http_request admin_json config_toml workflow_events workflow_template)

usage() {
    echo "usage: $0 TARGET|all SECONDS   (targets: ${TARGETS[*]})" >&2
    exit 2
}
[ $# -eq 2 ] || usage
WHICH=$1
SECS=$2
[[ $SECS =~ ^[0-9]+$ ]] && [ "$SECS" -gt 0 ] || usage
if [ "$WHICH" = all ]; then
    RUN=("${TARGETS[@]}")
else
    [[ " ${TARGETS[*]} " == *" $WHICH "* ]] || usage
    RUN=("$WHICH")
fi

NICE=${FUZZ_NICE:-15}
OUT=$(absolute "${FUZZ_OUT:-$ROOT/fuzz/out}")
# Absolute: the build below runs in fuzz/, the targets are run from here.
CARGO_TARGET_DIR=$(absolute "${CARGO_TARGET_DIR:-$ROOT/fuzz/target}")
export CARGO_TARGET_DIR

if ! command -v cargo-afl >/dev/null 2>&1; then
    echo "== installing cargo-afl (builds AFL++)"
    nice -n "$NICE" cargo install --locked cargo-afl
fi
# afl-fuzz -h exits 1 even when it works: look at what it prints.
if ! (cargo afl fuzz -h 2>&1 || true) | grep -q -- '-V seconds'; then
    echo "== building AFL++ for this toolchain"
    nice -n "$NICE" cargo afl config --build
fi

echo "== building the fuzz targets (cargo afl build --release, into $CARGO_TARGET_DIR)"
(cd fuzz && nice -n "$NICE" cargo afl build --release --locked)
BIN=$CARGO_TARGET_DIR/release

SEEDS=$OUT/seeds
rm -rf "$SEEDS"
"$BIN/seeds" testdata/wire "$SEEDS"

export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
export AFL_AUTORESUME=1 AFL_NO_AFFINITY=1
# afl's timeout is wall-clock: at nice 19 on a busy machine an input of 1 ms of CPU has
# waited over a second for it. afl runs a timed-out input once more with this longer
# limit and saves it as a hang only if that times out too.
export AFL_HANG_TMOUT=${FUZZ_HANG_MS:-5000}
export EMBD_FUZZ_TMP=${EMBD_FUZZ_TMP:-$( [ -d /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}")}

afl_stat() { # afl_stat FILE KEY
    sed -n "s/^$2 *: *//p" "$1" | head -1
}

count_files() { # count_files DIR: afl's crash or hang files in DIR (not its README.txt)
    find "$1" -maxdepth 1 -type f -name 'id:*' 2>/dev/null | wc -l
}

failed=0
summary=()
for t in "${RUN[@]}"; do
    dir=$OUT/$t
    [ "${FUZZ_FRESH:-0}" = 1 ] && rm -rf "$dir"
    mkdir -p "$dir"
    # afl does not keep which queue entries had their (costly) cmplog stage: a resumed run
    # would redo it on the whole queue, every time. On a resume, only new finds get it.
    # (afl takes the variable as set whatever its value.)
    resume=()
    [ -d "$dir/default/queue" ] && resume=(env AFL_CMPLOG_ONLY_NEW=1)
    echo "== $t: ${SECS}s ($(date -u +%FT%TZ))${resume:+, resumed}"
    "${resume[@]}" nice -n "$NICE" cargo afl fuzz -i "$SEEDS/$t" -o "$dir" -V "$SECS" \
        -t "${FUZZ_TIMEOUT_MS:-1000}" -m "${FUZZ_MEM_MB:-2048}" -- "$BIN/$t" \
        >"$dir/afl.log" 2>&1 || {
        echo "afl-fuzz failed for $t; the end of $dir/afl.log:" >&2
        tail -20 "$dir/afl.log" >&2
        failed=1
        continue
    }
    s=$dir/default/fuzzer_stats
    execs=$(afl_stat "$s" execs_done)
    rate=$(afl_stat "$s" execs_per_sec)
    runtime=$(afl_stat "$s" run_time)
    edges=$(afl_stat "$s" edges_found)
    corpus=$(afl_stat "$s" corpus_count)
    # afl's saved_crashes/saved_hangs survive a resume, so they still count crash files
    # already fixed and moved to $dir/fixed; what is open is what is still in the folders.
    crashes=$(count_files "$dir/default/crashes")
    hangs=$(count_files "$dir/default/hangs")
    ever="$(afl_stat "$s" saved_crashes)/$(afl_stat "$s" saved_hangs)"
    line=$(printf '%-20s execs %12s  exec/s %8s  crashes %3s  hangs %3s  (ever %s)  run_time %6ss  edges %5s  corpus %5s' \
        "$t" "$execs" "$rate" "$crashes" "$hangs" "$ever" "$runtime" "$edges" "$corpus")
    echo "$line"
    summary+=("$line")
    if [ "$crashes" != 0 ] || [ "$hangs" != 0 ]; then
        echo "   !! $t: see $dir/default/crashes and $dir/default/hangs" >&2
        failed=1
    fi
done

echo "== summary (cumulative over resumed runs; $(date -u +%FT%TZ))"
printf '%s\n' "${summary[@]}"
exit $failed
