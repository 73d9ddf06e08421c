//! Lending part of a producer's ring to a writer that builds a batch in place (issue 26:
//! the publisher writes each message once, straight into the ring, instead of into a
//! batch buffer that is then copied into the ring).
//!
//! Owns: [`Span`], the bytes lent out by [`crate::Producer::lend`] (written by their
//! one holder only, until the producer commits them); [`Kept`], where a committed
//! span's bytes are while its holder may still read them; and [`Returns`], through
//! which a span is given back from any thread without the producer's lock. Touches:
//! the lent bytes of its ring, and the producer's `space_waiters` word (loaded) and the
//! consumer's `space_bell` (woken, never written).
//!
//! The protocol, whose rules the producer asserts: at most one span is out at a time;
//! it starts at the producer's tail with nothing unpublished before it; the producer
//! writes nothing while it is out; committing it (header written last, then the tail
//! published) keeps its bytes readable through the span until the span is dropped, so a
//! batch the broker consumed but refused, or whose broker died, can still be resent from
//! it; dropping a span that was never committed cancels it (the broker never saw a byte
//! of it).
//!
//! A committed span's bytes stay in the ring only while the producer does not need
//! their room: a producer that must write and finds its room held by kept spans the
//! consumer has read past copies them out of the ring ([`KeptState::Copied`]) rather
//! than wait for their holders to drop them. Its room thus depends on its consumer
//! alone, never on a span's holder: a publisher drops a span when its batch is
//! acknowledged, and at order 5 that acknowledgement may wait for a batch that this very
//! producer has still to write (a failover moves a dead broker's batches, with the
//! session's lowest sequences, into the live channels' rings; issue 26's revert).

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

/// Where a committed span's bytes are, shared by the span and its producer; changed
/// only under its lock, which [`Span::read_out`] holds while it copies from the ring.
pub(crate) struct Kept {
    state: Mutex<KeptState>,
}

pub(crate) enum KeptState {
    /// In the ring, which the producer does not overwrite in this state.
    InRing,
    /// Copied out of the ring by the producer, which needed their room: the producer
    /// has forgotten the span, whose drop gives nothing back.
    Copied(Box<[u8]>),
    /// Given back by the span's drop (pushed to the producer's [`Returns`] under the
    /// lock, so a producer that sees this state finds the span in its returns).
    GivenBack,
}

impl Kept {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(KeptState::InRing),
        })
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, KeptState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Bytes of a ring lent to one writer. Written only through `&mut self`, so by one
/// thread at a time; given back to its producer when dropped.
pub struct Span {
    map: Arc<Mapping>,
    place: RingPlace,
    lent: Lent,
    returns: Returns,
    /// Set by the producer's commit: the bytes are published and only read from now on,
    /// from the ring or from where the producer copied them.
    kept: Option<Arc<Kept>>,
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
            kept: None,
        }
    }

    pub fn lent(&self) -> Lent {
        self.lent
    }

    pub fn limit(&self) -> usize {
        self.lent.limit
    }

    pub fn is_committed(&self) -> bool {
        self.kept.is_some()
    }

    pub(crate) fn mark_committed(&mut self, kept: Arc<Kept>) {
        assert!(self.kept.is_none(), "a span is committed once");
        self.kept = Some(kept);
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
        assert!(self.kept.is_none(), "a committed span is read-only");
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

    /// Asks the CPU to fetch, for writing, the cache lines of the span's bytes
    /// `[offset, offset + len)` (clipped to the span): what its writer fills next. A ring
    /// line that has left the cache otherwise costs its fetch at the store itself, and the
    /// publisher's next lock waits for that store to drain (docs/PERFORMANCE.md, session
    /// 30). A hint only: nothing is read or written, and a span of any state may be asked.
    pub fn prefetch_for_write(&self, offset: usize, len: usize) {
        let end = offset.saturating_add(len).min(self.lent.limit);
        if offset >= end {
            return;
        }
        let ring = self.ring_base();
        for (at, n) in self.pieces(offset, end - offset) {
            let mut line = at & !(CACHE_LINE - 1);
            while line < at + n {
                prefetch_line_for_write(ring.wrapping_add(line));
                line += CACHE_LINE;
            }
        }
    }

    /// Copies `len` bytes of the span from `offset` out (to resend them elsewhere):
    /// from the ring, or from where the producer copied a committed span when it
    /// needed the room. What another process may have written there is copied as it
    /// is: the receiver validates it, as it validates everything from a ring.
    pub fn read_out(&self, offset: usize, len: usize) -> Vec<u8> {
        let Some(kept) = &self.kept else {
            // Lent and uncommitted: the producer writes nothing while a span is out.
            return self.read_ring(offset, len);
        };
        // Held while copying from the ring: the producer copies a span out (and may
        // then overwrite its bytes) only under this lock.
        let state = kept.lock();
        match &*state {
            KeptState::InRing => self.read_ring(offset, len),
            KeptState::Copied(bytes) => {
                let end = offset.checked_add(len).filter(|&end| end <= bytes.len());
                let end = end.unwrap_or_else(|| {
                    panic!(
                        "bytes {offset}+{len} of a span of {} committed",
                        bytes.len()
                    )
                });
                bytes[offset..end].to_vec()
            }
            KeptState::GivenBack => unreachable!("a span is given back only by its drop"),
        }
    }

    fn read_ring(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let ring = self.ring_base();
        let mut to = 0;
        for (at, n) in self.pieces(offset, len) {
            // SAFETY: as in `write_at`, the source lies inside the ring; the span's bytes
            // are not overwritten while it is lent, nor while it is kept in the ring
            // (the caller holds the `Kept` lock); `out` holds `len` bytes of our own.
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
        let Some(kept) = &self.kept else {
            self.returns.give_back(self.lent.start);
            return;
        };
        let mut state = kept.lock();
        if matches!(*state, KeptState::InRing) {
            *state = KeptState::GivenBack;
            // Under the lock: see `KeptState::GivenBack`.
            self.returns.give_back(self.lent.start);
        }
        // Copied out: the producer let go of it then.
    }
}

/// The cache line size the prefetch hints step by (x86-64's and most ARM cores').
const CACHE_LINE: usize = 64;

/// `prefetchw` of the line holding `addr` (a no-op on other architectures, and a NOP on
/// x86 cores without it).
#[inline(always)]
fn prefetch_line_for_write(addr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetchw` is a hint: it reads and writes no memory, cannot fault whatever
    // `addr` is, and leaves registers and flags alone; only the cache state changes.
    unsafe {
        std::arch::asm!(
            "prefetchw [{0}]",
            in(reg) addr,
            options(nostack, preserves_flags, readonly)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}
