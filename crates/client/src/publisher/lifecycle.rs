//! A queue's life as one value that only moves forward: its broker dies (nothing more is
//! dispatched to it), its sender stops, and a failover moves its batches out. Each step
//! is a flag that is set once and never cleared, so every reader sees a later state
//! than any it saw before.

use std::sync::atomic::{AtomicU8, Ordering};

/// The broker is gone: nothing more is dispatched to the queue; set before a failover.
const DEAD: u8 = 1;
/// The sender thread has stopped: every batch it took is in the connection's `unacked`.
const SENDER_STOPPED: u8 = 2;
/// The failover has finished: the queue's batches are elsewhere (or the publisher
/// failed); until then `flush` waits for it. Only ever after `DEAD`.
const MOVED_OUT: u8 = 4;

#[derive(Debug, Default)]
pub(super) struct Lifecycle(AtomicU8);

impl Lifecycle {
    pub(super) fn is_live(&self) -> bool {
        !self.has(DEAD)
    }

    /// Callers hold the queue's gate, so no dispatch is half done when it is set.
    pub(super) fn mark_dead(&self) {
        self.set(DEAD);
    }

    pub(super) fn sender_stopped(&self) -> bool {
        self.has(SENDER_STOPPED)
    }

    pub(super) fn mark_sender_stopped(&self) {
        self.set(SENDER_STOPPED);
    }

    pub(super) fn moved_out(&self) -> bool {
        self.has(MOVED_OUT)
    }

    pub(super) fn mark_moved_out(&self) {
        assert!(self.has(DEAD), "only a dead queue's batches are moved out");
        self.set(MOVED_OUT);
    }

    fn has(&self, flag: u8) -> bool {
        self.0.load(Ordering::Acquire) & flag != 0
    }

    /// The only write: a flag is added, never removed (no store, no clear).
    fn set(&self, flag: u8) {
        self.0.fetch_or(flag, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_kept_once_taken() {
        let life = Lifecycle::default();
        assert!(life.is_live() && !life.sender_stopped() && !life.moved_out());
        life.mark_sender_stopped();
        assert!(life.is_live() && life.sender_stopped());
        life.mark_dead();
        life.mark_dead();
        life.mark_moved_out();
        assert!(!life.is_live() && life.sender_stopped() && life.moved_out());
    }

    #[test]
    #[should_panic(expected = "only a dead queue's batches are moved out")]
    fn a_live_queue_cannot_be_moved_out() {
        Lifecycle::default().mark_moved_out();
    }
}
