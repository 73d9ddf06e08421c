//! The three kinds of shared word the region hands out: one anyone may read
//! ([`ReadWord`]), one only its owner stores ([`OwnedWord`]) and a counter only its owner
//! moves, and only forward ([`MonotonicU64`]). The last two are reachable only through the
//! write handles of `handles.rs`, so who may store a word is said by the type a process
//! holds, not by a comment.

use std::sync::atomic::{AtomicU64, Ordering};

/// A shared word, for reading only.
#[derive(Clone, Copy)]
pub struct ReadWord<'a>(&'a AtomicU64);

impl<'a> ReadWord<'a> {
    pub(crate) fn new(word: &'a AtomicU64) -> Self {
        Self(word)
    }

    #[inline]
    pub fn load(&self, order: Ordering) -> u64 {
        self.0.load(order)
    }
}

/// A shared word its owner (whoever holds the handle it came from) may store.
#[derive(Clone, Copy)]
pub struct OwnedWord<'a>(&'a AtomicU64);

impl<'a> OwnedWord<'a> {
    pub(crate) fn new(word: &'a AtomicU64) -> Self {
        Self(word)
    }

    #[inline]
    pub fn load(&self, order: Ordering) -> u64 {
        self.0.load(order)
    }

    #[inline]
    pub fn store(&self, value: u64, order: Ordering) {
        self.0.store(value, order)
    }

    /// For words with several would-be owners that take turns by compare-and-swap (the
    /// lease deadline, a reader slot's heartbeat).
    #[inline]
    pub fn compare_exchange(
        &self,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        self.0.compare_exchange(current, new, success, failure)
    }
}

/// A counter that only grows: frontiers, positions, epochs. [`MonotonicU64::advance`]
/// asserts it (kept in release builds: one load of a word its single writer owns, so
/// it is in that writer's cache), which turns a silent reordering bug into a crash at
/// the store that would have gone backwards.
#[derive(Clone, Copy)]
pub struct MonotonicU64<'a> {
    word: &'a AtomicU64,
    /// What the counter is, for the assertion's message.
    name: &'static str,
}

impl<'a> MonotonicU64<'a> {
    pub(crate) fn new(word: &'a AtomicU64, name: &'static str) -> Self {
        Self { word, name }
    }

    #[inline]
    pub fn load(&self, order: Ordering) -> u64 {
        self.word.load(order)
    }

    /// Stores `to`, which must be at least the current value. Only for a counter with
    /// one writer (the load and the store are not one atomic step).
    #[inline]
    pub fn advance(&self, to: u64, order: Ordering) {
        let now = self.word.load(Ordering::Relaxed);
        assert!(
            to >= now,
            "{} only grows: {now} would become {to}",
            self.name
        );
        self.word.store(to, order);
    }

    /// Stores `to` whatever the counter holds: for other crates' unit tests that build
    /// the state a crash leaves (feature `test-support`, for dev-dependencies only).
    #[cfg(feature = "test-support")]
    pub fn set_for_test(&self, to: u64) {
        self.word.store(to, Ordering::Release);
    }

    /// Raises the counter to `to` if it is below (a `fetch_max`, for counters several
    /// parties raise); returns the previous value.
    #[inline]
    pub fn raise(&self, to: u64, order: Ordering) -> u64 {
        self.word.fetch_max(to, order)
    }

    /// Adds `delta` (a `fetch_add`); returns the previous value. Asserts the sum does
    /// not wrap, which would move the counter backwards.
    #[inline]
    pub fn add(&self, delta: u64, order: Ordering) -> u64 {
        let previous = self.word.fetch_add(delta, order);
        assert!(
            previous.checked_add(delta).is_some(),
            "{} overflowed: {previous} + {delta}",
            self.name
        );
        previous
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_monotonic_counter_moves_forward_or_stays() {
        let w = AtomicU64::new(5);
        let m = MonotonicU64::new(&w, "test counter");
        m.advance(5, Ordering::Release);
        m.advance(9, Ordering::Release);
        assert_eq!(m.raise(7, Ordering::AcqRel), 9, "raise never lowers");
        assert_eq!(m.add(1, Ordering::AcqRel), 9);
        assert_eq!(m.load(Ordering::Acquire), 10);
    }

    #[test]
    #[should_panic(expected = "test counter only grows: 10 would become 3")]
    fn a_monotonic_counter_refuses_to_go_back() {
        let w = AtomicU64::new(10);
        MonotonicU64::new(&w, "test counter").advance(3, Ordering::Release);
    }

    #[test]
    #[should_panic(expected = "overflowed")]
    fn a_monotonic_counter_refuses_to_wrap() {
        let w = AtomicU64::new(u64::MAX);
        MonotonicU64::new(&w, "test counter").add(1, Ordering::AcqRel);
    }
}
