//! Lending part of a producer's ring to a writer that builds a batch in place (issue 26:
//! the publisher writes each message once, straight into the ring, instead of into a
//! batch buffer that is then copied into the ring).
//!
//! Owns: [`Span`], the bytes lent out by [`crate::Producer::lend`] (written by their
//! one holder only, until the producer commits them), and [`Returns`], through which a
//! span is given back from any thread without the producer's lock. Touches: the lent
//! bytes of its ring, and the producer's `space_waiters` word (loaded) and the
//! consumer's `space_bell` (woken, never written).
//!
//! The protocol, whose rules the producer asserts: at most one span is out at a time;
//! it starts at the producer's tail with nothing unpublished before it; the producer
//! writes nothing while it is out; committing it (header written last, then the tail
//! published) keeps its bytes unoverwritten until the span is dropped, so a batch the
//! broker consumed but refused can still be resent from it; dropping a span that was
//! never committed cancels it (the broker never saw a byte of it).

use crate::bell;
use crate::layout::{RingPlace, C_SPACE_BELL, P_SPACE_WAITERS};
use crate::mapping::Mapping;
use crate::ring::RingMaps;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Where a span is: `limit` bytes from ring position `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lent {
    pub start: u64,
    pub limit: usize,
}

/// Spans given back (by start position) and not yet taken in by their producer.
#[derive(Clone)]
pub struct Returns {
    inner: Arc<ReturnsInner>,
}

struct ReturnsInner {
    starts: Mutex<Vec<u64>>,
    maps: RingMaps,
    place: RingPlace,
}

impl Returns {
    pub(crate) fn new(maps: RingMaps, place: RingPlace) -> Self {
        Self {
            inner: Arc::new(ReturnsInner {
                starts: Mutex::new(Vec::new()),
                maps,
                place,
            }),
        }
    }

    /// Gives the span at `start` back, and wakes the producer if it sleeps for room
    /// (the wait looks at its returns again after announcing itself, so either it sees
    /// this one or this sees it waiting).
    fn give_back(&self, start: u64) {
        self.inner
            .starts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(start);
        let (maps, place) = (&self.inner.maps, &self.inner.place);
        let waiters = maps.producer.u32_at(place.producer_line + P_SPACE_WAITERS);
        if waiters.load(Ordering::SeqCst) != 0 {
            bell::wake(maps.consumer.u32_at(place.consumer_line + C_SPACE_BELL));
        }
    }

    /// Takes every span given back so far.
    pub(crate) fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.inner.starts.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(crate) fn same(&self, other: &Returns) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Bytes of a ring lent to one writer. Written only through `&mut self`, so by one
/// thread at a time; given back to its producer when dropped.
pub struct Span {
    map: Arc<Mapping>,
    place: RingPlace,
    lent: Lent,
    returns: Returns,
    /// Set by the producer's commit: the bytes are published and only read from now on.
    committed: bool,
}

impl Span {
    pub(crate) fn new(map: Arc<Mapping>, place: RingPlace, lent: Lent, returns: Returns) -> Self {
        assert!(
            lent.limit <= place.capacity && place.bytes + place.capacity <= map.len(),
            "a span lies inside its ring"
        );
        Self {
            map,
            place,
            lent,
            returns,
            committed: false,
        }
    }

    pub fn lent(&self) -> Lent {
        self.lent
    }

    pub fn limit(&self) -> usize {
        self.lent.limit
    }

    pub fn is_committed(&self) -> bool {
        self.committed
    }

    pub(crate) fn mark_committed(&mut self) {
        self.committed = true;
    }

    pub(crate) fn returns(&self) -> &Returns {
        &self.returns
    }

    /// The ring bytes `[offset, offset + len)` of the span, as (ring index, length) of
    /// at most two pieces (the second when it wraps).
    fn pieces(&self, offset: usize, len: usize) -> [(usize, usize); 2] {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.lent.limit),
            "bytes {offset}+{len} inside a span of {}",
            self.lent.limit
        );
        let cap = self.place.capacity;
        let at = (self.lent.start as usize).wrapping_add(offset) & (cap - 1);
        let first = len.min(cap - at);
        [(at, first), (0, len - first)]
    }

    /// Copies `src` into the span at `offset`. Only before the span is committed: after,
    /// its bytes are the broker's to read.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) {
        assert!(!self.committed, "a committed span is read-only");
        let ring = self.ring_base();
        let mut from = 0;
        for (at, n) in self.pieces(offset, src.len()) {
            // SAFETY: `pieces` keeps `at + n` within the ring's `capacity` bytes, which
            // lie inside the mapping (checked in `new`; the Arc keeps it mapped). The
            // bytes are this span's: the producer lent them to this one holder and
            // writes nothing while they are out, and the consumer reads nothing past the
            // published tail, which is at or before the span's start. `src` is this
            // process's own memory, so the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(from), ring.add(at), n) };
            from += n;
        }
    }

    /// Copies `len` bytes of the span from `offset` out (to resend them elsewhere).
    /// What another process may have written there is copied as it is: the receiver
    /// validates it, as it validates everything from a ring.
    pub fn read_out(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let ring = self.ring_base();
        let mut to = 0;
        for (at, n) in self.pieces(offset, len) {
            // SAFETY: as in `write_at`, the source lies inside the ring; the span is kept
            // (not overwritten) while it exists; `out` holds `len` bytes of our own.
            unsafe { std::ptr::copy_nonoverlapping(ring.add(at), out.as_mut_ptr().add(to), n) };
            to += n;
        }
        out
    }

    fn ring_base(&self) -> *mut u8 {
        // SAFETY: `place.bytes` is inside the mapping (checked in `new`).
        unsafe { self.map.base().add(self.place.bytes) }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        self.returns.give_back(self.lent.start);
    }
}
