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
    RingPlace, C_DATA_WAITERS, C_HEAD, C_SPACE_BELL, LINE, P_DATA_BELL, P_SPACE_WAITERS, P_TAIL,
};
use crate::mapping::Mapping;
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
/// The producer's tail and the consumer's head are told the same way.
fn announce(position: &AtomicU64, value: u64, bell: &AtomicU32, waiters: &AtomicU32) {
    position.store(value, Ordering::Release);
    bell.fetch_add(1, Ordering::SeqCst);
    if waiters.load(Ordering::SeqCst) != 0 {
        bell::wake(bell);
    }
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
        if bell.load(Ordering::SeqCst) == seen {
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
            maps,
            place,
            tail: 0,
            published: 0,
            head_seen: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.place.capacity
    }

    /// Room left, from the consumer's `head`, which is checked: it may not go back nor
    /// pass what was published.
    pub fn room(&mut self) -> io::Result<usize> {
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
        let used = self.tail - head;
        debug_assert!(used <= self.place.capacity as u64);
        Ok(self.place.capacity - used as usize)
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
        let n = len.min(self.room()?);
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

    /// Publishes what was written and rings the consumer's doorbell.
    pub fn publish(&mut self) {
        if self.published == self.tail {
            return;
        }
        assert!(self.tail > self.published, "positions only grow");
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
        wait_for(bell, waiters, deadline, alive, || Ok(self.room()? >= want))
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
        announce(
            maps.consumer_u64(place, C_HEAD),
            self.head,
            maps.consumer_u32(place, C_SPACE_BELL),
            maps.producer_u32(place, P_SPACE_WAITERS),
        );
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
