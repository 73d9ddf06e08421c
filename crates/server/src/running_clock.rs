//! The head's clock for heartbeats: how long this process has been running, not how long
//! the wall has.
//!
//! A follower is declared dead when the head has had no heartbeat from it for the death
//! timeout. Measured on the monotonic clock, a head that itself did not run for longer
//! than that (stopped, its VM paused, starved of CPU on a loaded host) woke up to find
//! every follower's last heartbeat too old: heartbeats sent meanwhile were waiting unread
//! in its sockets. Each follower was then told it was no longer a member, rejoined, and
//! its clients failed over for nothing. This clock counts the time between two looks, but
//! at most `max_step` of it: a gap that long is time nobody in this process looked, so
//! none of it is held against the followers. The head looks often when it runs (every
//! heartbeat it handles, and its membership watcher at least every quarter of the death
//! timeout), so a step of half the death timeout loses nothing while it runs.
//!
//! Owns its last look; touches nothing else.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RunningClock {
    /// The most one look adds, however long ago the last one was.
    max_step: Duration,
    /// The monotonic instant of the last look, and the running time counted up to it.
    last: Mutex<(Instant, Duration)>,
}

impl RunningClock {
    pub fn new(max_step: Duration) -> Self {
        assert!(!max_step.is_zero(), "a clock that never advances");
        Self {
            max_step,
            last: Mutex::new((Instant::now(), Duration::ZERO)),
        }
    }

    /// The running time now: never less than at any earlier look.
    pub fn now(&self) -> Duration {
        let mut last = self.last.lock();
        let real = Instant::now();
        let step = real.saturating_duration_since(last.0).min(self.max_step);
        let running = last.1 + step;
        assert!(running >= last.1, "the running time only grows");
        *last = (real, running);
        running
    }

    /// Test support: makes the last look `gap` older, as a process stopped for `gap`
    /// would find it.
    #[cfg(test)]
    pub fn stall(&self, gap: Duration) {
        let mut last = self.last.lock();
        last.0 = last
            .0
            .checked_sub(gap)
            .expect("a clock older than the boot");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_follows_the_monotonic_clock_between_close_looks_and_only_grows() {
        let clock = RunningClock::new(Duration::from_secs(60));
        let (start, real) = (clock.now(), Instant::now());
        let mut previous = start;
        while real.elapsed() < Duration::from_millis(20) {
            let now = clock.now();
            assert!(now >= previous);
            previous = now;
        }
        assert!(previous - start >= Duration::from_millis(20) - Duration::from_millis(1));
    }

    #[test]
    fn a_gap_without_looks_counts_as_at_most_one_step() {
        let clock = RunningClock::new(Duration::from_millis(300));
        let before = clock.now();
        clock.stall(Duration::from_secs(5));
        let after = clock.now();
        assert!(after - before >= Duration::from_millis(300));
        assert!(after - before < Duration::from_millis(300) + Duration::from_secs(1));
    }
}
