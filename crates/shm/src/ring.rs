//! The two halves of a single-producer single-consumer byte ring in a channel
//! (`layout` says where its words are and who writes them).
//!
//! Owns: each side's own position (the authoritative copy is local: the word in shared
//! memory is only published, never read back) and the checks of the other side's.
//! Touches: its ring's bytes and the words of its own line; loads the other line.

use crate::bell;
use crate::layout::{
    RingPlace, C_DATA_WAITERS, C_HEAD, C_SPACE_BELL, P_DATA_BELL, P_SPACE_WAITERS, P_TAIL,
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

/// The producer half: copies bytes in, publishes `tail`, rings `data_bell`.
pub struct Producer {
    map: Arc<Mapping>,
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
        assert!(place.capacity.is_power_of_two());
        assert!(
            place.bytes + place.capacity <= map.len(),
            "ring inside the mapping"
        );
        Self {
            map,
            place,
            tail: 0,
            published: 0,
            head_seen: 0,
        }
    }

    fn line_u64(&self, line: usize, word: usize) -> &AtomicU64 {
        self.map.u64_at(line + word)
    }

    fn space_bell(&self) -> &AtomicU32 {
        self.map.u32_at(self.place.consumer_line + C_SPACE_BELL)
    }

    /// Room left, from the consumer's `head`, which is checked: it may not go back nor
    /// pass what was published.
    pub fn room(&mut self) -> io::Result<usize> {
        let head = self
            .line_u64(self.place.consumer_line, C_HEAD)
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
        let n = bytes.len().min(self.room()?);
        if n == 0 {
            return Ok(0);
        }
        let cap = self.place.capacity;
        let start = (self.tail as usize) & (cap - 1);
        let first = n.min(cap - start);
        // SAFETY: both ranges are inside this ring's bytes (start < cap, first <=
        // cap - start, n - first <= start), which only this producer writes until it
        // publishes them; `bytes` is local memory, so they do not overlap.
        unsafe {
            let ring = self.map.base().add(self.place.bytes);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ring.add(start), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), ring, n - first);
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
        self.line_u64(self.place.producer_line, P_TAIL)
            .store(self.tail, Ordering::Release);
        let bell = self.map.u32_at(self.place.producer_line + P_DATA_BELL);
        bell.fetch_add(1, Ordering::SeqCst);
        let waiters = self.map.u32_at(self.place.consumer_line + C_DATA_WAITERS);
        if waiters.load(Ordering::SeqCst) != 0 {
            bell::wake(bell);
        }
    }

    /// Waits until `want` bytes (at most the capacity) are free, `deadline` passes or
    /// `alive` says the peer is gone.
    pub fn wait_room(
        &mut self,
        want: usize,
        deadline: Option<Instant>,
        mut alive: impl FnMut() -> bool,
    ) -> io::Result<Waited> {
        let want = want.min(self.place.capacity);
        let mut spins = 0;
        loop {
            let seen = self.space_bell().load(Ordering::SeqCst);
            if self.room()? >= want {
                return Ok(Waited::Ready);
            }
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            if !alive() {
                return Ok(Waited::Gone);
            }
            let Some(timeout) = sleep_for(deadline) else {
                return Ok(Waited::TimedOut);
            };
            let waiters = self.map.u32_at(self.place.producer_line + P_SPACE_WAITERS);
            waiters.store(1, Ordering::SeqCst);
            if self.space_bell().load(Ordering::SeqCst) == seen {
                bell::wait(self.space_bell(), seen, timeout);
            }
            waiters.store(0, Ordering::SeqCst);
        }
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
        bell::wake(self.space_bell());
    }
}

/// The consumer half: loads and checks `tail`, copies bytes out, publishes `head`.
pub struct Consumer {
    map: Arc<Mapping>,
    place: RingPlace,
    /// Bytes consumed (authoritative).
    head: u64,
    /// The largest `tail` seen: the producer's must never go below it.
    tail_seen: u64,
}

impl Consumer {
    pub fn new(map: Arc<Mapping>, place: RingPlace) -> Self {
        assert!(place.capacity.is_power_of_two());
        assert!(
            place.bytes + place.capacity <= map.len(),
            "ring inside the mapping"
        );
        Self {
            map,
            place,
            head: 0,
            tail_seen: 0,
        }
    }

    fn data_bell(&self) -> &AtomicU32 {
        self.map.u32_at(self.place.producer_line + P_DATA_BELL)
    }

    pub fn capacity(&self) -> usize {
        self.place.capacity
    }

    /// Bytes the producer published and this side has not consumed, from its `tail`,
    /// which is checked: it may not go back nor run more than a capacity ahead.
    pub fn available(&mut self) -> io::Result<usize> {
        let tail = self
            .map
            .u64_at(self.place.producer_line + P_TAIL)
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
            let ring = self.map.base().add(self.place.bytes);
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
        self.map
            .u64_at(self.place.consumer_line + C_HEAD)
            .store(self.head, Ordering::Release);
        let bell = self.map.u32_at(self.place.consumer_line + C_SPACE_BELL);
        bell.fetch_add(1, Ordering::SeqCst);
        let waiters = self.map.u32_at(self.place.producer_line + P_SPACE_WAITERS);
        if waiters.load(Ordering::SeqCst) != 0 {
            bell::wake(bell);
        }
    }

    /// Waits until `want` bytes (at most the capacity) are published, `deadline` passes
    /// or `alive` says the peer is gone (bytes it published before leaving still count).
    pub fn wait_available(
        &mut self,
        want: usize,
        deadline: Option<Instant>,
        mut alive: impl FnMut() -> bool,
    ) -> io::Result<Waited> {
        let want = want.min(self.place.capacity);
        let mut spins = 0;
        loop {
            let seen = self.data_bell().load(Ordering::SeqCst);
            if self.available()? >= want {
                return Ok(Waited::Ready);
            }
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            if !alive() {
                let ready = self.available()? >= want;
                return Ok(if ready { Waited::Ready } else { Waited::Gone });
            }
            let Some(timeout) = sleep_for(deadline) else {
                return Ok(Waited::TimedOut);
            };
            let waiters = self.map.u32_at(self.place.consumer_line + C_DATA_WAITERS);
            waiters.store(1, Ordering::SeqCst);
            if self.data_bell().load(Ordering::SeqCst) == seen {
                bell::wait(self.data_bell(), seen, timeout);
            }
            waiters.store(0, Ordering::SeqCst);
        }
    }

    /// Wakes a thread of this process sleeping for data (after a local shutdown).
    pub fn wake_local(&self) {
        bell::wake(self.data_bell());
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
