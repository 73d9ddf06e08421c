//! Space reservation in a (topic, broker) log.
//!
//! Several connections of one broker append to the same log. Each batch needs a PBR
//! slot and a contiguous range of log bytes, and both must be handed out in the same
//! order (so that reclaiming a prefix of the ring frees a prefix of the log). The pair
//! `(next PBR index, log tail)` is therefore advanced by one 128-bit compare-and-swap:
//! no lock is shared between connections. A batch never straddles a segment; the
//! connection whose reservation opens a new logical segment takes a physical segment
//! from the broker's pool and publishes it in the region's segment map.

use crossbeam_queue::ArrayQueue;
use embarcadero_region::Region;
use portable_atomic::AtomicU128;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Free physical segments of one broker, shared by all of its topics' logs.
pub struct SegmentPool {
    free: ArrayQueue<u32>,
    total: u32,
}

impl SegmentPool {
    pub fn new(total: u32) -> Self {
        let free = ArrayQueue::new(total as usize);
        for s in 0..total {
            free.push(s).expect("pool sized for every segment");
        }
        Self { free, total }
    }

    /// A pool of `used.len()` segments holding those not marked used.
    pub fn with_used(used: &[bool]) -> Self {
        let free = ArrayQueue::new(used.len().max(1));
        for (s, _) in used.iter().enumerate().filter(|(_, used)| !**used) {
            free.push(s as u32).expect("pool sized for every segment");
        }
        Self {
            free,
            total: used.len() as u32,
        }
    }

    pub fn pop(&self) -> Option<u32> {
        self.free.pop()
    }

    pub fn push(&self, segment: u32) {
        assert!(segment < self.total, "segment {segment} out of range");
        self.free
            .push(segment)
            .expect("a segment is returned to the pool at most once");
    }

    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn total(&self) -> u32 {
        self.total
    }
}

/// A reserved PBR slot and log range, owned by one connection until it commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    pub pbr_index: u64,
    pub log_offset: u64,
    pub len: u64,
}

/// Why a reservation could not be made right now. Both clear as the log is reclaimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    /// Every PBR slot is in use.
    RingFull,
    /// A new segment is needed and the broker's pool is empty.
    NoSegment,
}

/// The writer side of one (topic, broker) log.
pub struct LogWriter {
    pub topic: u32,
    pub broker: u32,
    region: Arc<Region>,
    pool: Arc<SegmentPool>,
    /// `next_pbr << 64 | tail`: the next PBR index and the end of reserved log bytes.
    state: AtomicU128,
}

impl LogWriter {
    pub fn new(region: Arc<Region>, pool: Arc<SegmentPool>, topic: u32, broker: u32) -> Self {
        Self {
            topic,
            broker,
            region,
            pool,
            state: AtomicU128::new(0),
        }
    }

    /// A writer continuing a log whose slots below `next_pbr` are all committed and
    /// whose bytes end at `tail` (see `resume`).
    pub fn continuing(
        region: Arc<Region>,
        pool: Arc<SegmentPool>,
        topic: u32,
        broker: u32,
        next_pbr: u64,
        tail: u64,
    ) -> Self {
        Self {
            state: AtomicU128::new(((next_pbr as u128) << 64) | tail as u128),
            ..Self::new(region, pool, topic, broker)
        }
    }

    /// `(reserved_pbr, reserved_tail)` from one load: a consistent pair.
    pub fn reserved(&self) -> (u64, u64) {
        let state = self.state.load(Ordering::Acquire);
        ((state >> 64) as u64, state as u64)
    }

    /// Next PBR index to be reserved; everything below it is reserved.
    pub fn reserved_pbr(&self) -> u64 {
        (self.state.load(Ordering::Acquire) >> 64) as u64
    }

    /// End of the reserved log bytes: every logical segment below `tail.div_ceil(seg)`
    /// has been taken from the pool (and not yet returned, unless reclaimed).
    pub fn reserved_tail(&self) -> u64 {
        self.state.load(Ordering::Acquire) as u64
    }

    /// Ends the log's partly filled last segment, if the log is still at `next` slots
    /// and `tail` bytes: the tail moves to the segment's end, so the next reservation
    /// opens a fresh segment, and the caller may give this one back to the pool. The
    /// caller has reclaimed every slot below `next` (nothing in the segment is live);
    /// a reservation made meanwhile wins, and the tail stays. Returns the new tail.
    ///
    /// Without this, each log holds its last segment for as long as it exists, and a
    /// broker with more idle topics than segments refuses every new one's batches.
    pub fn retire_tail(&self, next: u64, tail: u64) -> Option<u64> {
        let seg = self.region.capacities().segment_bytes;
        assert!(
            !tail.is_multiple_of(seg),
            "only a partly filled segment is retired (tail {tail})"
        );
        let end = tail.next_multiple_of(seg);
        let current = ((next as u128) << 64) | tail as u128;
        let retired = ((next as u128) << 64) | end as u128;
        self.state
            .compare_exchange(current, retired, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| end)
    }

    /// Reserves a slot and `len` bytes (`0 < len <= segment_bytes`).
    pub fn reserve(&self, len: u64) -> Result<Reservation, ReserveError> {
        let caps = self.region.capacities();
        let seg = caps.segment_bytes;
        assert!(
            len > 0 && len <= seg,
            "batch of {len} bytes cannot fit a segment"
        );
        let log = self.region.log(self.topic, self.broker);
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            let next = (current >> 64) as u64;
            let tail = current as u64;
            if next >= log.reclaimed_pbr.load(Ordering::Acquire) + caps.pbr_slots {
                return Err(ReserveError::RingFull);
            }
            let start = if tail % seg + len > seg {
                tail.div_ceil(seg) * seg
            } else {
                tail
            };
            // The first byte of a logical segment is reserved by exactly one winner of
            // the CAS below, which maps the segment.
            let opens_segment = start % seg == 0;
            let segment = if opens_segment {
                Some(self.pool.pop().ok_or(ReserveError::NoSegment)?)
            } else {
                None
            };
            let new = ((next as u128 + 1) << 64) | (start + len) as u128;
            match self
                .state
                .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    assert!(
                        start >= tail && start % seg + len <= seg,
                        "a reservation lies after the tail and within one segment"
                    );
                    let logical = start / seg;
                    match segment {
                        Some(physical) => {
                            self.region
                                .seg_map_publish(self.topic, self.broker, logical, physical)
                        }
                        None => self.await_mapping(logical),
                    }
                    return Ok(Reservation {
                        pbr_index: next,
                        log_offset: start,
                        len,
                    });
                }
                Err(actual) => {
                    if let Some(physical) = segment {
                        self.pool.push(physical);
                    }
                    assert!(
                        (actual >> 64) as u64 >= next && actual as u64 >= tail,
                        "the reserved PBR index and log tail never go back"
                    );
                    current = actual;
                }
            }
        }
    }

    /// Waits for the mapping of `logical`: another connection opened this segment
    /// moments ago and publishes its mapping right after its CAS.
    fn await_mapping(&self, logical: u64) {
        let mut spins = 0u32;
        while self
            .region
            .seg_map_lookup(self.topic, self.broker, logical)
            .is_none()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // The mapper may be descheduled (2 cores).
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::Capacities;
    use std::collections::HashSet;

    fn caps() -> Capacities {
        Capacities {
            max_topics: 1,
            brokers: 1,
            goi_slots: 64,
            pbr_slots: 1024,
            segment_bytes: 4096,
            segments_per_broker: 16,
            seg_map_slots: 32,
        }
    }

    #[test]
    fn reservations_never_straddle_segments_and_take_segments_once() {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(Region::create(&dir.path().join("r"), caps()).unwrap());
        let pool = Arc::new(SegmentPool::new(16));
        let w = LogWriter::new(region.clone(), pool.clone(), 0, 0);
        let a = w.reserve(3000).unwrap();
        let b = w.reserve(3000).unwrap();
        assert_eq!((a.pbr_index, a.log_offset), (0, 0));
        assert_eq!(
            (b.pbr_index, b.log_offset),
            (1, 4096),
            "skips to the next segment"
        );
        assert_eq!(pool.free_count(), 14);
        assert!(region.blog_ptr(0, 0, b.log_offset, 3000).is_some());
    }

    #[test]
    fn empty_pool_and_full_ring_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(Region::create(&dir.path().join("r"), caps()).unwrap());
        let pool = Arc::new(SegmentPool::new(1));
        let w = LogWriter::new(region, pool, 0, 0);
        w.reserve(4096).unwrap();
        assert_eq!(w.reserve(64), Err(ReserveError::NoSegment));
    }

    /// Concurrent reservers get distinct, gap-free PBR indices and disjoint log ranges
    /// whose order matches the index order.
    #[test]
    fn concurrent_reservations_are_disjoint_and_ordered() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = caps();
        c.pbr_slots = 1 << 16;
        c.segment_bytes = 65536;
        c.segments_per_broker = 60;
        c.seg_map_slots = 64;
        let region = Arc::new(Region::create(&dir.path().join("r"), c).unwrap());
        let pool = Arc::new(SegmentPool::new(60));
        let w = Arc::new(LogWriter::new(region, pool, 0, 0));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let w = w.clone();
                std::thread::spawn(move || {
                    (0..500)
                        .map(|i| w.reserve(64 * (1 + (i + t) % 7)).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<Reservation> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        all.sort_by_key(|r| r.pbr_index);
        let indices: HashSet<u64> = all.iter().map(|r| r.pbr_index).collect();
        assert_eq!(indices.len(), 2000);
        assert_eq!(all.last().unwrap().pbr_index, 1999);
        for pair in all.windows(2) {
            assert!(pair[0].log_offset + pair[0].len <= pair[1].log_offset);
            assert_eq!(
                pair[0].log_offset / 65536,
                (pair[0].log_offset + pair[0].len - 1) / 65536
            );
        }
    }

    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Reserve(u64),
        /// Reclaim this many of the oldest live batches (as the service thread would).
        Reclaim(usize),
        /// Retire the partly filled last segment, once nothing in the log is live (as
        /// the service thread does for an idle log when the pool runs short).
        RetireTail,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u64..=64).prop_map(|lines| Op::Reserve(lines * 64)),
            1 => (1usize..6).prop_map(Op::Reclaim),
            1 => Just(Op::RetireTail),
        ]
    }

    proptest! {
        /// Against a model of the log: reservations get consecutive PBR indices, never
        /// exceed the ring or the pool, never straddle a segment, and no live range ever
        /// shares memory with another live range, however reservations, reclamations
        /// and retirements of an emptied log's last segment interleave.
        #[test]
        fn reservation_and_reclamation_keep_live_ranges_disjoint(ops in proptest::collection::vec(op(), 1..300)) {
            let dir = tempfile::tempdir().unwrap();
            let c = Capacities {
                max_topics: 1,
                brokers: 1,
                goi_slots: 64,
                pbr_slots: 16,
                segment_bytes: 4096,
                segments_per_broker: 4,
                seg_map_slots: 8,
            };
            let region = Arc::new(Region::create(&dir.path().join("r"), c).unwrap());
            let pool = Arc::new(SegmentPool::new(4));
            let w = LogWriter::new(region.clone(), pool.clone(), 0, 0);
            let line = region.broker_line(0, 0);
            let mut live: std::collections::VecDeque<Reservation> = Default::default();
            let mut next_index = 0;
            let mut freed_below = 0u64; // logical segments returned to the pool
            for op in ops {
                match op {
                    Op::Reserve(len) => match w.reserve(len) {
                        Ok(r) => {
                            prop_assert_eq!(r.pbr_index, next_index);
                            next_index += 1;
                            prop_assert_eq!(r.log_offset / 4096, (r.log_offset + len - 1) / 4096);
                            let p = region.blog_ptr(0, 0, r.log_offset, len).unwrap() as usize;
                            for other in &live {
                                let q = region.blog_ptr(0, 0, other.log_offset, other.len).unwrap() as usize;
                                prop_assert!(p + len as usize <= q || q + other.len as usize <= p,
                                    "{:?} overlaps live {:?}", r, other);
                            }
                            live.push_back(r);
                        }
                        Err(ReserveError::RingFull) => prop_assert_eq!(live.len(), 16),
                        Err(ReserveError::NoSegment) => prop_assert_eq!(pool.free_count(), 0),
                    },
                    Op::RetireTail => {
                        let tail = w.reserved_tail();
                        if !live.is_empty() || tail.is_multiple_of(4096) {
                            continue;
                        }
                        // A stale view of the log never retires it.
                        prop_assert_eq!(w.retire_tail(next_index + 1, tail), None);
                        let end = w.retire_tail(next_index, tail);
                        prop_assert_eq!(end, Some(tail.next_multiple_of(4096)));
                        prop_assert_eq!(w.reserved_tail(), end.unwrap());
                        line.reclaimed_blog.advance(end.unwrap(), Ordering::Release);
                        while freed_below < end.unwrap() / 4096 {
                            if let Some(s) = region.seg_map_lookup(0, 0, freed_below) {
                                pool.push(s);
                            }
                            freed_below += 1;
                        }
                        prop_assert_eq!(pool.free_count(), 4, "an empty log holds no segment");
                    }
                    Op::Reclaim(n) => {
                        for _ in 0..n.min(live.len()) {
                            live.pop_front();
                        }
                        // What the service thread does: move the frontiers, then free
                        // whole segments below the new reclaimed offset.
                        let reclaimed_blog = live.front().map_or_else(
                            || w.state.load(Ordering::Acquire) as u64,
                            |r| r.log_offset,
                        );
                        line.reclaimed_blog.advance(reclaimed_blog, Ordering::Release);
                        line.reclaimed_pbr.advance(next_index - live.len() as u64, Ordering::Release);
                        while freed_below < reclaimed_blog / 4096 {
                            if let Some(s) = region.seg_map_lookup(0, 0, freed_below) {
                                pool.push(s);
                            }
                            freed_below += 1;
                        }
                    }
                }
            }
        }
    }
}
