//! The two halves of a single-producer single-consumer byte ring in a channel
//! (`layout` says where its words are and who writes them).
//!
//! Owns: each side's own position (the authoritative copy is local: the word in shared
//! memory is only published, never read back), the checks of the other side's, and the
//! one wait both sides use ([`wait_for`]). Touches: its ring's bytes and the words of
//! its own line; loads the other line. The producer's line and the bytes may live in
//! another mapping than the consumer's line ([`RingMaps`]): a subscriber's feed is
//! read-only to it, and only its cursor page is its own.

use crate::bell;
use crate::layout::{
    RingPlace, C_DATA_WAITERS, C_HEAD, C_SPACE_BELL, LINE, P_DATA_BELL, P_SPACE_WAITERS,
    P_SPACE_WAKE_AT, P_TAIL,
};
use crate::lend::{Kept, KeptState, Lent, Returns, Span};
use crate::mapping::Mapping;
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest sleep on a doorbell between looks at the peer's liveness.
pub const POLL: Duration = Duration::from_millis(20);
/// Looks at the ring before sleeping: a batch or ack often follows within microseconds.
const SPINS: u32 = 200;

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    Ready,
    TimedOut,
    /// The peer left (or this side was shut down) and the ring does not hold enough.
    Gone,
}

fn violation(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// Where a ring lives: the producer's line and the ring's bytes in `producer`, the
/// consumer's line in `consumer`. A publishing channel has both in one mapping; a
/// subscriber's feed splits them so that each side can write only its own.
#[derive(Clone)]
pub struct RingMaps {
    pub producer: Arc<Mapping>,
    pub consumer: Arc<Mapping>,
}

impl RingMaps {
    /// Both halves in one mapping.
    pub fn one(map: Arc<Mapping>) -> Self {
        Self {
            producer: map.clone(),
            consumer: map,
        }
    }

    fn check(&self, place: &RingPlace) {
        assert!(place.capacity.is_power_of_two());
        assert!(
            place.bytes + place.capacity <= self.producer.len()
                && place.producer_line + LINE <= self.producer.len(),
            "ring and producer line inside the producer's mapping"
        );
        assert!(
            place.consumer_line + LINE <= self.consumer.len(),
            "consumer line inside the consumer's mapping"
        );
    }

    fn producer_u64(&self, place: &RingPlace, word: usize) -> &AtomicU64 {
        self.producer.u64_at(place.producer_line + word)
    }

    fn producer_u32(&self, place: &RingPlace, word: usize) -> &AtomicU32 {
        self.producer.u32_at(place.producer_line + word)
    }

    fn consumer_u64(&self, place: &RingPlace, word: usize) -> &AtomicU64 {
        self.consumer.u64_at(place.consumer_line + word)
    }

    fn consumer_u32(&self, place: &RingPlace, word: usize) -> &AtomicU32 {
        self.consumer.u32_at(place.consumer_line + word)
    }
}

/// One side's move, told to the other: stores its new `position` (Release: the bytes
/// before it are visible first), rings `bell`, and wakes the peer only if it announced
/// itself in `waiters` (SeqCst, the pair of [`wait_for`]'s, so a wake-up is never lost).
/// The producer's tail is told this way, the consumer's head by [`announce_room`].
fn announce(position: &AtomicU64, value: u64, bell: &AtomicU32, waiters: &AtomicU32) {
    position.store(value, Ordering::Release);
    bell.fetch_add(1, Ordering::SeqCst);
    if waiters.load(Ordering::SeqCst) != 0 {
        bell::wake(bell);
    }
}

/// As [`announce`] for a consumer's `head`, but the producer is woken only once `head`
/// has reached `wake_at`, the point below which it cannot have the room it waits for
/// ([`P_SPACE_WAKE_AT`]). Woken at every small step instead, a producer waiting for a
/// quarter of the ring looked, slept again and, on two cores, took the CPU from the very
/// consumer it waited for (docs/PERFORMANCE.md, "Session 25"). Returns whether it woke.
fn announce_room(
    head_word: &AtomicU64,
    head: u64,
    bell: &AtomicU32,
    waiters: &AtomicU32,
    wake_at: &AtomicU32,
) -> bool {
    head_word.store(head, Ordering::Release);
    bell.fetch_add(1, Ordering::SeqCst);
    // `wake_at` was written before `waiters` was set, so once that is seen, so is it. A
    // producer that never writes it (one built before it existed) leaves 0: any move.
    let at = wake_at.load(Ordering::Relaxed);
    let wake = waiters.load(Ordering::SeqCst) != 0 && (at == 0 || reached(head, at));
    if wake {
        bell::wake(bell);
    }
    wake
}

/// Whether `head` is at or past `wake_at`, a position's low 32 bits: the two are less
/// than a ring's capacity (at most 1 GiB) apart, so the wrapping difference says which
/// comes first.
pub(crate) fn reached(head: u64, wake_at: u32) -> bool {
    (head as u32).wrapping_sub(wake_at) as i32 >= 0
}

/// Waits until `ready` says so, `deadline` passes or `alive` says the peer is gone: the
/// one wait of both halves (a producer waiting for room rings on the consumer's
/// `space_bell` and flags `space_waiters`; a consumer waiting for data the reverse).
/// Spins [`SPINS`] looks first, then sleeps on `bell` at most [`POLL`] at a time,
/// announcing itself in `waiters` (SeqCst with the other side's ring and load, so a
/// wake-up is never lost). A peer that left may have made `ready` true before going:
/// that still counts.
fn wait_for(
    bell: &AtomicU32,
    waiters: &AtomicU32,
    deadline: Option<Instant>,
    mut alive: impl FnMut() -> bool,
    mut ready: impl FnMut() -> io::Result<bool>,
) -> io::Result<Waited> {
    let mut spins = 0;
    loop {
        let seen = bell.load(Ordering::SeqCst);
        if ready()? {
            return Ok(Waited::Ready);
        }
        if spins < SPINS {
            spins += 1;
            std::hint::spin_loop();
            continue;
        }
        if !alive() {
            return Ok(if ready()? {
                Waited::Ready
            } else {
                Waited::Gone
            });
        }
        let Some(timeout) = sleep_for(deadline) else {
            return Ok(Waited::TimedOut);
        };
        waiters.store(1, Ordering::SeqCst);
        // Looked at again once announced: a producer's room also grows when a lent span
        // is given back, which rings no bell (`lend::Returns` wakes a waiter it sees).
        if bell.load(Ordering::SeqCst) == seen && !ready()? {
            bell::wait(bell, seen, timeout);
        }
        waiters.store(0, Ordering::SeqCst);
    }
}

/// The producer half: copies bytes in, publishes `tail`, rings `data_bell`.
pub struct Producer {
    maps: RingMaps,
    place: RingPlace,
    /// Bytes written, published or not (authoritative).
    tail: u64,
    /// Bytes published to the consumer.
    published: u64,
    /// The largest `head` seen: the consumer's must never go below it.
    head_seen: u64,
    /// The span lent out to be built in place ([`Self::lend`]), if any: it starts at
    /// `tail`, and nothing else is written while it is out.
    lent: Option<Lent>,
    /// Committed spans kept for resending, in ring order. Their bytes are not
    /// overwritten until given back or copied out ([`Self::reclaim`]).
    kept: VecDeque<KeptSpan>,
    /// Where spans come back from other threads.
    returns: Returns,
    /// Kept spans copied out of the ring because a write needed their room.
    copied_out: u64,
}

/// A committed span the producer keeps in its ring for its holder.
struct KeptSpan {
    start: u64,
    end: u64,
    given_back: bool,
    /// Shared with the span: where its bytes are.
    where_: Arc<Kept>,
}

impl Producer {
    pub fn new(map: Arc<Mapping>, place: RingPlace) -> Self {
        Self::split(RingMaps::one(map), place)
    }

    /// A producer whose consumer's line lives in another mapping (read-only is enough:
    /// a producer only loads it).
    pub fn split(maps: RingMaps, place: RingPlace) -> Self {
        maps.check(&place);
        assert!(
            maps.producer.is_writable(),
            "a producer writes its line and bytes"
        );
        Self {
            returns: Returns::new(maps.clone(), place),
            maps,
            place,
            tail: 0,
            published: 0,
            head_seen: 0,
            lent: None,
            kept: VecDeque::new(),
            copied_out: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.place.capacity
    }

    /// Room left, from the consumer's `head`, which is checked: it may not go back nor
    /// pass what was published; and from the oldest kept span.
    pub fn room(&mut self) -> io::Result<usize> {
        self.take_returns();
        let head = self.head()?;
        Ok(self.room_from(head))
    }

    /// Room for a write of `want` bytes: as [`Self::room`], after copying out kept
    /// spans that the consumer has read past and that hold that room ([`Self::reclaim`]).
    fn room_to_write(&mut self, want: usize) -> io::Result<usize> {
        self.take_returns();
        let head = self.head()?;
        Ok(self.reclaim(want, head))
    }

    /// The consumer's `head`, checked.
    fn head(&mut self) -> io::Result<u64> {
        let head = self
            .maps
            .consumer_u64(&self.place, C_HEAD)
            .load(Ordering::Acquire);
        if head < self.head_seen || head > self.published {
            return Err(violation(format!(
                "ring consumer position {head} is outside [{}, {}]",
                self.head_seen, self.published
            )));
        }
        self.head_seen = head;
        Ok(head)
    }

    fn room_from(&self, head: u64) -> usize {
        let floor = self.kept.front().map_or(head, |k| k.start.min(head));
        let used = self.tail - floor;
        assert!(
            used <= self.place.capacity as u64,
            "the producer wrote over bytes not consumed or kept"
        );
        self.place.capacity - used as usize
    }

    /// Copies kept spans out of the ring, oldest first, while fewer than `want` bytes
    /// are free and the oldest kept span is one the consumer has read into (so that its
    /// bytes, not the consumer, hold the room); returns the room. This is what makes a
    /// producer's room depend on its consumer only (see `crate::lend`): a kept span is
    /// given back when its batch is acknowledged, which may wait for the very bytes this
    /// producer is about to write.
    fn reclaim(&mut self, want: usize, head: u64) -> usize {
        loop {
            let room = self.room_from(head);
            let Some(front) = self.kept.front() else {
                return room;
            };
            if room >= want || front.start >= head {
                return room;
            }
            let (start, end, where_) = (front.start, front.end, front.where_.clone());
            let mut state = where_.lock();
            match &*state {
                KeptState::InRing => {
                    *state = KeptState::Copied(self.read_ring(start, end).into_boxed_slice());
                    drop(state);
                    self.kept.pop_front();
                    self.copied_out += 1;
                    self.pop_given_back();
                }
                // Its drop put it in the returns, under the lock just taken.
                KeptState::GivenBack => {
                    drop(state);
                    self.take_returns();
                }
                KeptState::Copied(_) => unreachable!("a span copied out is forgotten"),
            }
        }
    }

    /// The ring's bytes from position `start` to `end` (at most a capacity).
    fn read_ring(&self, start: u64, end: u64) -> Vec<u8> {
        let cap = self.place.capacity;
        let n = usize::try_from(end - start).expect("a span fits the address space");
        assert!(n <= cap, "a kept span lies inside its ring");
        let at = (start as usize) & (cap - 1);
        let first = n.min(cap - at);
        let mut out = vec![0u8; n];
        // SAFETY: both source ranges are inside this ring's bytes (at < cap, first <=
        // cap - at, n - first <= at); `out` holds `n` bytes of this process's own.
        unsafe {
            let ring = self.maps.producer.base().add(self.place.bytes);
            std::ptr::copy_nonoverlapping(ring.add(at), out.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(ring, out.as_mut_ptr().add(first), n - first);
        }
        out
    }

    /// Kept spans copied out of the ring so far because a write needed their room.
    pub fn copied_out(&self) -> u64 {
        self.copied_out
    }

    /// Copies as much of `bytes` as fits (unpublished until [`Self::publish`]).
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        // SAFETY: a slice is valid for reads of its length.
        unsafe { self.write_ptr(bytes.as_ptr(), bytes.len()) }
    }

    /// As [`Self::write`], from memory that is not a Rust slice because another
    /// process may change it meanwhile (a broker copying from its region); whatever is
    /// copied is the caller's to re-check.
    ///
    /// # Safety
    /// `src` is valid for reads of `len` bytes, and is not inside this ring.
    pub unsafe fn write_ptr(&mut self, src: *const u8, len: usize) -> io::Result<usize> {
        let n = len.min(self.room_to_write(len)?);
        assert!(
            self.lent.is_none(),
            "nothing is written while a span is lent"
        );
        if n == 0 {
            return Ok(0);
        }
        let cap = self.place.capacity;
        let start = (self.tail as usize) & (cap - 1);
        let first = n.min(cap - start);
        // SAFETY: both destination ranges are inside this ring's bytes (start < cap,
        // first <= cap - start, n - first <= start), which only this producer writes
        // until it publishes them; `src` is readable for `n <= len` bytes (the caller's
        // promise) and lies outside the ring, so they do not overlap.
        unsafe {
            let ring = self.maps.producer.base().add(self.place.bytes);
            std::ptr::copy_nonoverlapping(src, ring.add(start), first);
            std::ptr::copy_nonoverlapping(src.add(first), ring, n - first);
        }
        self.tail += n as u64;
        Ok(n)
    }

    /// Lends the next `limit` bytes of the ring to be built in place, if nothing is
    /// lent already, everything written is published, and that much room is free; else
    /// `None` (the caller builds elsewhere and copies). See `crate::lend`.
    pub fn lend(&mut self, limit: usize) -> io::Result<Option<Span>> {
        if limit == 0 || limit > self.place.capacity {
            return Ok(None);
        }
        let room = self.room()?;
        if self.lent.is_some() || self.published != self.tail || room < limit {
            return Ok(None);
        }
        let lent = Lent {
            start: self.tail,
            limit,
        };
        self.lent = Some(lent);
        let map = self.maps.producer.clone();
        Ok(Some(Span::new(map, self.place, lent, self.returns.clone())))
    }

    /// Whether a span is lent out (and not given back).
    pub fn is_lent(&mut self) -> bool {
        self.take_returns();
        self.lent.is_some()
    }

    /// Publishes `span`'s first `len` bytes, after writing `header` at its start, and
    /// keeps them unoverwritten until the span is dropped. `false` (nothing done) when
    /// the span is not the one this producer has lent out (another channel's, or one
    /// whose channel was replaced): the caller copies its bytes instead.
    pub fn commit(&mut self, span: &mut Span, len: usize, header: &[u8]) -> bool {
        self.take_returns();
        if !span.returns().same(&self.returns) || self.lent != Some(span.lent()) {
            return false;
        }
        assert!(!span.is_committed(), "a span is committed once");
        assert!(
            header.len() <= len && len <= span.limit(),
            "a batch of {len} bytes with a {}-byte header in a span of {}",
            header.len(),
            span.limit()
        );
        assert_eq!(
            span.lent().start,
            self.tail,
            "a lent span starts at the tail"
        );
        span.write_at(0, header);
        let where_ = Kept::new();
        span.mark_committed(where_.clone());
        self.lent = None;
        let start = self.tail;
        self.tail = start + len as u64;
        self.kept.push_back(KeptSpan {
            start,
            end: self.tail,
            given_back: false,
            where_,
        });
        self.publish();
        true
    }

    /// Takes in the spans given back since last time.
    fn take_returns(&mut self) {
        for start in self.returns.take() {
            self.forget(start);
        }
    }

    /// A span given back: a lent one is cancelled (nothing of it was published), a kept
    /// one may be overwritten once every older kept span is given back too.
    fn forget(&mut self, start: u64) {
        if self.lent.is_some_and(|l| l.start == start) {
            assert_eq!(
                self.tail, start,
                "nothing was written while the span was out"
            );
            self.lent = None;
            return;
        }
        let Ok(i) = self.kept.binary_search_by_key(&start, |k| k.start) else {
            panic!("span at {start} given back but neither lent nor kept");
        };
        assert!(!self.kept[i].given_back, "span at {start} given back twice");
        self.kept[i].given_back = true;
        self.pop_given_back();
    }

    /// Forgets the oldest kept spans while they are given back.
    fn pop_given_back(&mut self) {
        while self.kept.front().is_some_and(|k| k.given_back) {
            self.kept.pop_front();
        }
    }

    /// Publishes what was written and rings the consumer's doorbell.
    pub fn publish(&mut self) {
        if self.published == self.tail {
            return;
        }
        assert!(self.tail > self.published, "positions only grow");
        assert!(
            self.kept.back().is_none_or(|k| k.end <= self.tail),
            "kept spans lie before the tail"
        );
        self.published = self.tail;
        let (maps, place) = (&self.maps, &self.place);
        announce(
            maps.producer_u64(place, P_TAIL),
            self.tail,
            maps.producer_u32(place, P_DATA_BELL),
            maps.consumer_u32(place, C_DATA_WAITERS),
        );
    }

    /// Waits until `want` bytes (at most the capacity) are free, `deadline` passes or
    /// `alive` says the peer is gone.
    pub fn wait_room(
        &mut self,
        want: usize,
        deadline: Option<Instant>,
        alive: impl FnMut() -> bool,
    ) -> io::Result<Waited> {
        let want = want.min(self.place.capacity);
        let (maps, place) = (self.maps.clone(), self.place);
        let bell = maps.consumer_u32(&place, C_SPACE_BELL);
        let waiters = maps.producer_u32(&place, P_SPACE_WAITERS);
        // Room is at most what the consumer's head leaves (kept spans only take more),
        // so `want` needs head at `tail + want - capacity`; never asked past what is
        // published, which the consumer can always reach.
        let needed = (self.tail + want as u64).saturating_sub(self.place.capacity as u64);
        let wake_at = needed.min(self.published) as u32;
        maps.producer_u32(&place, P_SPACE_WAKE_AT)
            .store(wake_at, Ordering::Relaxed);
        // For a write: kept spans give way (`reclaim`), so only the consumer is waited for.
        wait_for(bell, waiters, deadline, alive, || {
            Ok(self.room_to_write(want)? >= want)
        })
    }

    /// Writes all of `parts` in order, publishing as room runs out and at the end.
    pub fn write_all(
        &mut self,
        parts: &[&[u8]],
        mut alive: impl FnMut() -> bool,
    ) -> io::Result<()> {
        let mut left: usize = parts.iter().map(|p| p.len()).sum();
        for part in parts {
            let mut done = 0;
            while done < part.len() {
                let n = self.write(&part[done..])?;
                done += n;
                left -= n;
                if n == 0 {
                    self.publish();
                    let want = left.min(self.place.capacity / 4).max(1);
                    if self.wait_room(want, None, &mut alive)? == Waited::Gone {
                        return Err(io::ErrorKind::BrokenPipe.into());
                    }
                }
            }
        }
        self.publish();
        Ok(())
    }

    /// Wakes a thread of this process sleeping for room (after a local shutdown).
    pub fn wake_local(&self) {
        bell::wake(self.maps.consumer_u32(&self.place, C_SPACE_BELL));
    }
}

/// The consumer half: loads and checks `tail`, copies bytes out, publishes `head`.
pub struct Consumer {
    maps: RingMaps,
    place: RingPlace,
    /// Bytes consumed (authoritative).
    head: u64,
    /// The largest `tail` seen: the producer's must never go below it.
    tail_seen: u64,
    /// How often this side woke a producer sleeping for room (only grows).
    producer_wakes: u64,
}

impl Consumer {
    pub fn new(map: Arc<Mapping>, place: RingPlace) -> Self {
        Self::split(RingMaps::one(map), place)
    }

    /// A consumer whose producer's line and bytes live in another mapping (read-only is
    /// enough: a consumer only loads them).
    pub fn split(maps: RingMaps, place: RingPlace) -> Self {
        maps.check(&place);
        assert!(maps.consumer.is_writable(), "a consumer writes its line");
        Self {
            maps,
            place,
            head: 0,
            tail_seen: 0,
            producer_wakes: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.place.capacity
    }

    /// Bytes the producer published and this side has not consumed, from its `tail`,
    /// which is checked: it may not go back nor run more than a capacity ahead.
    pub fn available(&mut self) -> io::Result<usize> {
        let tail = self
            .maps
            .producer_u64(&self.place, P_TAIL)
            .load(Ordering::Acquire);
        if tail < self.tail_seen {
            return Err(violation(format!(
                "ring producer position went back from {} to {tail}",
                self.tail_seen
            )));
        }
        if tail - self.head > self.place.capacity as u64 {
            return Err(violation(format!(
                "ring producer position {tail} is more than the ring's {} bytes past the consumer's {}",
                self.place.capacity, self.head
            )));
        }
        self.tail_seen = tail;
        Ok((tail - self.head) as usize)
    }

    /// Copies the next `dest.len()` bytes out without consuming them; the caller has
    /// seen that many [`Self::available`]. The producer may be rewriting them (a
    /// hostile one): whatever is copied is validated by the caller, never the ring.
    pub fn copy_out(&self, dest: &mut [u8]) {
        let cap = self.place.capacity;
        let n = dest.len();
        assert!(
            n as u64 <= self.tail_seen - self.head,
            "copy only what is published"
        );
        let start = (self.head as usize) & (cap - 1);
        let first = n.min(cap - start);
        // SAFETY: both source ranges are inside this ring's bytes (as in
        // `Producer::write`); `dest` is this process's own memory, not the mapping.
        unsafe {
            let ring = self.maps.producer.base().add(self.place.bytes);
            std::ptr::copy_nonoverlapping(ring.add(start), dest.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(ring, dest.as_mut_ptr().add(first), n - first);
        }
    }

    /// Gives `n` bytes back to the producer and rings its doorbell.
    pub fn consume(&mut self, n: usize) {
        assert!(
            n as u64 <= self.tail_seen - self.head,
            "consume only what is published"
        );
        if n == 0 {
            return;
        }
        self.head += n as u64;
        let (maps, place) = (&self.maps, &self.place);
        let woke = announce_room(
            maps.consumer_u64(place, C_HEAD),
            self.head,
            maps.consumer_u32(place, C_SPACE_BELL),
            maps.producer_u32(place, P_SPACE_WAITERS),
            maps.producer_u32(place, P_SPACE_WAKE_AT),
        );
        self.producer_wakes += u64::from(woke);
    }

    /// How often [`Self::consume`] woke a producer sleeping for room.
    pub fn producer_wakes(&self) -> u64 {
        self.producer_wakes
    }

    /// Waits until `want` bytes (at most the capacity) are published, `deadline` passes
    /// or `alive` says the peer is gone (bytes it published before leaving still count).
    pub fn wait_available(
        &mut self,
        want: usize,
        deadline: Option<Instant>,
        alive: impl FnMut() -> bool,
    ) -> io::Result<Waited> {
        let want = want.min(self.place.capacity);
        let (maps, place) = (self.maps.clone(), self.place);
        let bell = maps.producer_u32(&place, P_DATA_BELL);
        let waiters = maps.consumer_u32(&place, C_DATA_WAITERS);
        wait_for(bell, waiters, deadline, alive, || {
            Ok(self.available()? >= want)
        })
    }

    /// Wakes a thread of this process sleeping for data (after a local shutdown).
    pub fn wake_local(&self) {
        bell::wake(self.maps.producer_u32(&self.place, P_DATA_BELL));
    }
}

/// How long to sleep on a doorbell: [`POLL`], or less before `deadline`; `None` once it
/// has passed.
fn sleep_for(deadline: Option<Instant>) -> Option<Duration> {
    match deadline {
        None => Some(POLL),
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            (!left.is_zero()).then(|| left.min(POLL))
        }
    }
}
