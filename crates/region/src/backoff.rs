//! Idle back-off for pollers: spin briefly, then sleep. A poller with a doorbell sleeps
//! on it until it rings (every writer that has work for the poller rings its bell), with
//! a bounded timeout as the safety net; one without a bell yields, then sleeps ever
//! longer. An idle server therefore sleeps in the kernel instead of burning a core, and
//! on a 2-core machine the pollers do not starve the network threads.
//!
//! Why bell-driven pollers skip the yields and short sleeps: at 10% load the brokers'
//! service threads woke about ten times per epoch to yield or time out (20 000 context
//! switches a second each) and took a third of the process's CPU, with no latency to
//! show for it (`docs/PERFORMANCE.md`, "The performance bar", session 5).

use crate::Doorbell;
use std::time::Duration;

/// Progress of one poller through spin, yield and sleep.
#[derive(Debug)]
pub struct Backoff {
    step: u32,
    max_sleep: Duration,
}

const SPIN_STEPS: u32 = 6;
const YIELD_STEPS: u32 = 10;

impl Backoff {
    pub fn new(max_sleep: Duration) -> Self {
        Self { step: 0, max_sleep }
    }

    /// Work was found: start over with spinning.
    #[inline]
    pub fn reset(&mut self) {
        self.step = 0;
    }

    /// No work: spin a little longer than last time, then sleep. With `bell`/`seen` (the
    /// count read before the poller looked for work) the sleep is on the bell, until it
    /// rings or `max_sleep` passes; without, yields and then ever longer sleeps.
    pub fn idle(&mut self, bell: Option<(&Doorbell<'_>, u32)>) {
        if let Some((bell, seen)) = bell.filter(|_| self.step >= SPIN_STEPS) {
            bell.wait(seen, self.max_sleep);
            self.step = self.step.saturating_add(1);
            return;
        }
        if self.step < SPIN_STEPS {
            for _ in 0..(1u32 << self.step) {
                std::hint::spin_loop();
            }
        } else if self.step < SPIN_STEPS + YIELD_STEPS {
            std::thread::yield_now();
        } else {
            let exp = (self.step - SPIN_STEPS - YIELD_STEPS).min(10);
            std::thread::sleep(Duration::from_micros(20u64 << exp).min(self.max_sleep));
        }
        self.step = self.step.saturating_add(1);
    }

    /// True once a poller without a bell has reached the sleeping stage.
    pub fn is_sleeping(&self) -> bool {
        self.step >= SPIN_STEPS + YIELD_STEPS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaches_sleep_and_resets() {
        let mut b = Backoff::new(Duration::from_micros(50));
        for _ in 0..(SPIN_STEPS + YIELD_STEPS) {
            assert!(!b.is_sleeping());
            b.idle(None);
        }
        assert!(b.is_sleeping());
        b.idle(None);
        b.reset();
        assert!(!b.is_sleeping());
    }

    #[test]
    fn with_a_bell_it_sleeps_on_the_bell_right_after_spinning() {
        let words = std::sync::Arc::new((
            std::sync::atomic::AtomicU32::new(0),
            std::sync::atomic::AtomicU32::new(0),
        ));
        let w = words.clone();
        let poller = std::thread::spawn(move || {
            let bell = Doorbell {
                count: &w.0,
                waiters: &w.1,
            };
            // A long safety timeout: only a ring ends this test quickly.
            let mut b = Backoff::new(Duration::from_secs(60));
            for _ in 0..=SPIN_STEPS {
                b.idle(Some((&bell, 0)));
            }
        });
        // The poller registers as the bell's waiter at step SPIN_STEPS, with no yields first.
        while words.1.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(!poller.is_finished(), "poller never waited on its bell");
            std::hint::spin_loop();
        }
        Doorbell {
            count: &words.0,
            waiters: &words.1,
        }
        .ring();
        poller.join().unwrap();
    }
}
