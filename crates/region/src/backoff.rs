//! Idle back-off for pollers: spin briefly, then yield, then sleep on a doorbell with a
//! bounded timeout. An idle server therefore sleeps in the kernel instead of burning a
//! core, and on a 2-core machine the pollers do not starve the network threads.

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

    /// No work: wait a little longer than last time. `bell`/`seen` let a writer cut a
    /// sleep short; pass the count read before the poller looked for work.
    pub fn idle(&mut self, bell: Option<(&Doorbell<'_>, u32)>) {
        if self.step < SPIN_STEPS {
            for _ in 0..(1u32 << self.step) {
                std::hint::spin_loop();
            }
        } else if self.step < SPIN_STEPS + YIELD_STEPS {
            std::thread::yield_now();
        } else {
            let exp = (self.step - SPIN_STEPS - YIELD_STEPS).min(10);
            let sleep = Duration::from_micros(20u64 << exp).min(self.max_sleep);
            match bell {
                Some((bell, seen)) => bell.wait(seen, sleep),
                None => std::thread::sleep(sleep),
            }
        }
        self.step = self.step.saturating_add(1);
    }

    /// True once the poller has reached the sleeping stage.
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
}
