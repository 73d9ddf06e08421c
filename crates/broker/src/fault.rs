//! Fault injection on the publish path, for experiments (`broker.fault_*`): the chosen
//! broker delays or drops a fraction of the batches it receives. Off (the normal case)
//! it costs one branch per batch.
//!
//! Owns only each connection's dice; the drop count it shares is `Shared::fault_drops`.

use crate::Fault;
use std::sync::atomic::{AtomicU64, Ordering};

/// One connection's dice: a xorshift generator seeded per connection, so connections
/// of one client do not roll the same numbers.
pub(crate) struct FaultDice<'a> {
    fault: Option<&'a Fault>,
    seed: u64,
}

impl<'a> FaultDice<'a> {
    pub(crate) fn new(fault: Option<&'a Fault>, client_id: u64, connection_index: u32) -> Self {
        Self {
            fault,
            seed: client_id ^ (connection_index as u64) << 32 | 1,
        }
    }

    /// Delays the batch when the dice say so, then says whether to drop it (counted in
    /// `drops`, up to the fault's limit).
    pub(crate) fn delay_then_drop(&mut self, drops: &AtomicU64) -> bool {
        let Some(fault) = self.fault else {
            return false;
        };
        if self.roll() < fault.delay_fraction {
            std::thread::sleep(fault.delay);
        }
        self.roll() < fault.drop_fraction
            && (fault.drop_limit == 0 || drops.fetch_add(1, Ordering::Relaxed) < fault.drop_limit)
    }

    /// A uniform number in [0, 1).
    fn roll(&mut self) -> f64 {
        assert_ne!(
            self.seed, 0,
            "xorshift never reaches 0 from a non-zero seed"
        );
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        (self.seed >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn off_drops_nothing_and_on_drops_up_to_its_limit() {
        let drops = AtomicU64::new(0);
        let mut off = FaultDice::new(None, 7, 0);
        assert!((0..1000).all(|_| !off.delay_then_drop(&drops)));
        let fault = Fault {
            delay_fraction: 0.0,
            delay: Duration::ZERO,
            drop_fraction: 1.0,
            drop_limit: 3,
        };
        let mut on = FaultDice::new(Some(&fault), 7, 0);
        let dropped = (0..10).filter(|_| on.delay_then_drop(&drops)).count();
        assert_eq!(dropped, 3);
    }

    #[test]
    fn rolls_are_uniform_enough_to_hit_a_fraction() {
        let mut dice = FaultDice::new(None, 12345, 1);
        let below = (0..10_000).filter(|_| dice.roll() < 0.25).count();
        assert!(
            (2_000..3_000).contains(&below),
            "{below} of 10000 below 0.25"
        );
    }
}
