#!/usr/bin/env bash
# Soak of head restarts: `cargo test`'s ignored `head_restart_soak` (crates/cli/tests/
# cluster.rs). Each round starts a head, an external sequencer and a follower as processes,
# publishes order-2 rf-2 batches (on the follower, or through the head in alternate rounds)
# while a subscriber reads from the follower, SIGKILLs the head after a varying number of
# acknowledged ids, restarts it on the same data directory, waits for the old region's
# follower and sequencer to exit, starts them again, and checks that every acknowledged id
# is in the new region's order exactly once and that the old region's subscriber saw
# nothing the new order contradicts. ROUNDS (default 50) rounds, about a second each.
set -euo pipefail
cd "$(dirname "$0")/.."
HEAD_RESTART_ROUNDS=${ROUNDS:-50} cargo test --release -p embarcadero-cli --test cluster \
  -- --ignored --exact head_restart_soak --nocapture 2>&1 | grep -E "^round |test result|panicked|FAILED|missing|twice|delivered with" 
