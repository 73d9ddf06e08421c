//! The epoch sequencer: gives every batch of an order-2 topic one global position.
//!
//! Owns: the GOI of every ordered topic, each topic's sequence line (`committed_seq`,
//! `next_position`), the sequencer line of every log (`ordered_pbr`,
//! `reclaim_request`) and the `total_order` field of PBR slots. It only reads PBR
//! slots and broker-owned frontiers; it never touches payload bytes (axiom A1).
//!
//! Pipeline: one scanner per (topic, broker) follows that broker's PBR with plain
//! loads of the commit tokens and collects committed descriptors into its own buffer
//! (no locks: the scanner is the only writer of its buffer). Once per epoch the
//! buffers are merged in broker order, positions are assigned with one atomic add per
//! topic, GOI entries are written with their token last, and then `committed_seq`
//! and each broker's `ordered_pbr` advance. A broker with nothing committed adds
//! nothing to an epoch, so a slow or idle broker never stalls the others.

use embarcadero_region::backoff::Backoff;
use embarcadero_region::{GoiEntry, Region};
use embarcadero_wire::BatchFlags;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct SequencerConfig {
    /// Length of an epoch; batches committed during one epoch are ordered together.
    pub epoch: Duration,
    /// Longest sleep while there is nothing to order.
    pub idle_sleep_max: Duration,
}

impl Default for SequencerConfig {
    fn default() -> Self {
        Self {
            epoch: Duration::from_micros(500),
            idle_sleep_max: Duration::from_millis(20),
        }
    }
}

/// Smallest epoch accepted.
pub const MIN_EPOCH: Duration = Duration::from_micros(50);

#[derive(Debug, Default)]
pub struct SequencerMetrics {
    pub epochs_sealed: AtomicU64,
    pub batches_ordered: AtomicU64,
    pub messages_ordered: AtomicU64,
    /// Total time spent sealing (assigning positions and writing the GOI), in ns.
    pub seal_nanos: AtomicU64,
    /// Times an epoch could not be fully sealed because GOI slots were still in use.
    pub goi_full_stalls: AtomicU64,
}

/// A running sequencer thread. Dropping it stops it.
pub struct Sequencer {
    shutdown: Arc<AtomicBool>,
    metrics: Arc<SequencerMetrics>,
    region: Arc<Region>,
    thread: Option<JoinHandle<()>>,
}

impl Sequencer {
    pub fn start(region: Arc<Region>, config: SequencerConfig) -> std::io::Result<Self> {
        if config.epoch < MIN_EPOCH {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "epoch {:?} is below the minimum of {MIN_EPOCH:?}",
                    config.epoch
                ),
            ));
        }
        let shutdown = Arc::new(AtomicBool::new(false));
        let metrics = Arc::new(SequencerMetrics::default());
        let mut core = Core::new(region.clone(), config, metrics.clone());
        let stop = shutdown.clone();
        let thread = std::thread::Builder::new()
            .name("sequencer".into())
            .spawn(move || core.run(&stop))?;
        Ok(Self {
            shutdown,
            metrics,
            region,
            thread: Some(thread),
        })
    }

    pub fn metrics(&self) -> Arc<SequencerMetrics> {
        self.metrics.clone()
    }

    pub fn stop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        self.region.sequencer_bell().ring();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Sequencer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A committed PBR slot waiting for the end of its epoch.
#[derive(Debug, Clone, Copy)]
struct Pending {
    pbr_index: u64,
    /// `None` for a void slot: it takes no position but still advances `ordered_pbr`.
    entry: Option<GoiEntry>,
}

struct Scanner {
    broker: u32,
    /// Next PBR index to look at.
    cursor: u64,
    buffer: Vec<Pending>,
}

struct TopicState {
    topic: u32,
    generation: u64,
    scanners: Vec<Scanner>,
    /// Next GOI index and next global position (mirrors of the region's sequence line).
    committed: u64,
    next_position: u64,
}

/// Most slots one scanner takes per pass, so one busy broker cannot monopolise a pass.
const MAX_SCAN_PER_PASS: usize = 4096;
const TOPIC_REFRESH: Duration = Duration::from_millis(20);

struct Core {
    region: Arc<Region>,
    config: SequencerConfig,
    metrics: Arc<SequencerMetrics>,
    topics: Vec<TopicState>,
}

impl Core {
    fn new(region: Arc<Region>, config: SequencerConfig, metrics: Arc<SequencerMetrics>) -> Self {
        Self {
            region,
            config,
            metrics,
            topics: Vec::new(),
        }
    }

    fn run(&mut self, shutdown: &AtomicBool) {
        let region = self.region.clone();
        let bell = region.sequencer_bell();
        let mut backoff = Backoff::new(self.config.idle_sleep_max);
        let mut next_seal = Instant::now();
        let mut last_refresh = Instant::now() - TOPIC_REFRESH;
        while !shutdown.load(Ordering::Relaxed) {
            let seen = bell.seen();
            if last_refresh.elapsed() >= TOPIC_REFRESH {
                self.refresh_topics();
                last_refresh = Instant::now();
            }
            let pending = self.scan();
            let now = Instant::now();
            if pending == 0 {
                backoff.idle(Some((&bell, seen)));
                continue;
            }
            backoff.reset();
            if now >= next_seal {
                self.seal_all();
                // Epochs tick at a fixed period while there is traffic; after an idle
                // spell the first batch is sealed at once.
                next_seal = (next_seal + self.config.epoch).max(now);
            } else {
                std::thread::sleep(next_seal - now);
            }
        }
    }

    /// Picks up ordered topics created since the last look, resuming from the region.
    fn refresh_topics(&mut self) {
        let caps = self.region.capacities();
        for topic in 0..caps.max_topics {
            let Some(meta) = self.region.topic_meta(topic) else {
                continue;
            };
            if meta.order < 2 {
                continue;
            }
            if let Some(t) = self.topics.iter().find(|t| t.topic == topic) {
                if t.generation == meta.generation {
                    continue;
                }
                self.topics.retain(|t| t.topic != topic);
            }
            let seq = self.region.topic_seq(topic);
            self.topics.push(TopicState {
                topic,
                generation: meta.generation,
                scanners: (0..caps.brokers)
                    .map(|broker| Scanner {
                        broker,
                        cursor: self
                            .region
                            .log(topic, broker)
                            .ordered_pbr
                            .load(Ordering::Acquire),
                        buffer: Vec::new(),
                    })
                    .collect(),
                committed: seq.committed_seq.load(Ordering::Acquire),
                next_position: seq.next_position.load(Ordering::Acquire),
            });
        }
    }

    /// Collects newly committed PBR slots; returns how many are waiting in buffers.
    fn scan(&mut self) -> usize {
        let region = &self.region;
        let mut waiting = 0;
        for t in &mut self.topics {
            for s in &mut t.scanners {
                let mut taken = 0;
                while taken < MAX_SCAN_PER_PASS {
                    let Some(h) = region.pbr_read(t.topic, s.broker, s.cursor) else {
                        break;
                    };
                    let entry = (h.flags & BatchFlags::VALID != 0).then_some(GoiEntry {
                        batch_id: h.batch_id,
                        total_order: 0,
                        blog_offset: h.log_offset,
                        pbr_index: s.cursor,
                        client_id: h.client_id,
                        client_seq: h.batch_seq,
                        session_epoch: h.session_epoch,
                        payload_size: h.total_size as u32,
                        num_msg: h.num_msg,
                        broker_id: s.broker as u16,
                        flags: 0,
                        replication_token: 0,
                    });
                    s.buffer.push(Pending {
                        pbr_index: s.cursor,
                        entry,
                    });
                    s.cursor += 1;
                    taken += 1;
                }
                waiting += s.buffer.len();
            }
        }
        waiting
    }

    fn seal_all(&mut self) {
        let start = Instant::now();
        let mut topics = std::mem::take(&mut self.topics);
        for t in &mut topics {
            self.seal(t);
        }
        self.topics = topics;
        self.metrics.epochs_sealed.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .seal_nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Orders one topic's buffered batches, scanner by scanner in broker order.
    fn seal(&self, t: &mut TopicState) {
        let region = &self.region;
        let goi_slots = region.capacities().goi_slots;
        let first_index = t.committed;
        let first_position = t.next_position;
        let mut ordered_upto: Vec<Option<u64>> = vec![None; t.scanners.len()];
        let mut stalled = false;
        for s in &mut t.scanners {
            let mut used = 0;
            for p in &s.buffer {
                if let Some(mut e) = p.entry {
                    let g = t.committed;
                    if !self.goi_slot_free(t.topic, g, goi_slots) {
                        stalled = true;
                        break;
                    }
                    e.total_order = t.next_position;
                    region.goi_write(t.topic, g, &e);
                    region.pbr_set_total_order(t.topic, s.broker, p.pbr_index, e.total_order);
                    t.committed += 1;
                    t.next_position += e.num_msg as u64;
                }
                ordered_upto[s.broker as usize] = Some(p.pbr_index + 1);
                used += 1;
            }
            s.buffer.drain(..used);
            if stalled {
                break;
            }
        }
        if stalled {
            self.metrics.goi_full_stalls.fetch_add(1, Ordering::Relaxed);
        }
        if t.committed == first_index && ordered_upto.iter().all(Option::is_none) {
            return;
        }
        let seq = region.topic_seq(t.topic);
        // One atomic add per topic per epoch publishes the epoch's positions.
        let previous = seq
            .next_position
            .fetch_add(t.next_position - first_position, Ordering::AcqRel);
        debug_assert_eq!(previous, first_position, "the sequencer is the only writer");
        seq.committed_seq.store(t.committed, Ordering::Release);
        for (broker, upto) in ordered_upto.iter().enumerate() {
            if let Some(upto) = upto {
                region
                    .log(t.topic, broker as u32)
                    .ordered_pbr
                    .store(*upto, Ordering::Release);
                region.broker_bell(broker as u32).ring();
            }
        }
        region.topic_bell(t.topic).ring();
        self.metrics
            .batches_ordered
            .fetch_add(t.committed - first_index, Ordering::Relaxed);
        self.metrics
            .messages_ordered
            .fetch_add(t.next_position - first_position, Ordering::Relaxed);
    }

    /// GOI slot of index `g` may be overwritten only once the batch of its previous
    /// occupant has left memory; otherwise ask that batch's broker to reclaim it.
    fn goi_slot_free(&self, topic: u32, g: u64, goi_slots: u64) -> bool {
        let Some(old) = g.checked_sub(goi_slots) else {
            return true;
        };
        let Some(e) = self.region.goi_read(topic, old) else {
            return true;
        };
        let log = self.region.log(topic, e.broker_id as u32);
        if log.reclaimed_pbr.load(Ordering::Acquire) > e.pbr_index {
            return true;
        }
        log.reclaim_request
            .fetch_max(e.pbr_index + 1, Ordering::AcqRel);
        self.region.broker_bell(e.broker_id as u32).ring();
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::{Capacities, TopicMeta};
    use embarcadero_wire::BatchHeader;

    fn region(goi_slots: u64) -> (tempfile::TempDir, Arc<Region>) {
        let dir = tempfile::tempdir().unwrap();
        let caps = Capacities {
            max_topics: 2,
            brokers: 3,
            goi_slots,
            pbr_slots: 64,
            segment_bytes: 4096,
            segments_per_broker: 4,
            seg_map_slots: 8,
        };
        let r = Arc::new(Region::create(&dir.path().join("r"), caps).unwrap());
        r.write_topic_meta(
            1,
            &TopicMeta {
                name: "t".into(),
                order: 2,
                replication_factor: 1,
                default_ack: 1,
                generation: 1,
                created_unix_ms: 0,
            },
        );
        (dir, r)
    }

    fn commit(r: &Region, broker: u32, index: u64, num_msg: u32, valid: bool) {
        r.pbr_commit(
            1,
            broker,
            index,
            &BatchHeader {
                batch_seq: index,
                client_id: broker as u64,
                num_msg,
                broker_id: broker as u16,
                flags: if valid {
                    BatchFlags::VALID
                } else {
                    BatchFlags::VOID
                },
                pbr_index: index,
                total_size: 64 * num_msg as u64,
                log_offset: index * 1024,
                ..Default::default()
            },
        );
    }

    fn core(r: &Arc<Region>) -> Core {
        let mut c = Core::new(r.clone(), SequencerConfig::default(), Default::default());
        c.refresh_topics();
        c
    }

    #[test]
    fn epoch_merges_brokers_in_order_and_skips_void_slots() {
        let (_d, r) = region(64);
        commit(&r, 2, 0, 3, true);
        commit(&r, 0, 0, 2, true);
        commit(&r, 0, 1, 0, false);
        commit(&r, 0, 2, 1, true);
        let mut c = core(&r);
        assert_eq!(c.scan(), 4);
        c.seal_all();
        let seq = r.topic_seq(1);
        assert_eq!(seq.committed_seq.load(Ordering::Acquire), 3);
        assert_eq!(seq.next_position.load(Ordering::Acquire), 6);
        let order: Vec<(u16, u64, u64)> = (0..3)
            .map(|g| {
                let e = r.goi_read(1, g).unwrap();
                (e.broker_id, e.pbr_index, e.total_order)
            })
            .collect();
        assert_eq!(order, vec![(0, 0, 0), (0, 2, 2), (2, 0, 3)]);
        assert_eq!(r.log(1, 0).ordered_pbr.load(Ordering::Acquire), 3);
        assert_eq!(r.log(1, 1).ordered_pbr.load(Ordering::Acquire), 0);
        assert_eq!(r.log(1, 2).ordered_pbr.load(Ordering::Acquire), 1);
        assert_eq!(r.pbr_read(1, 2, 0).unwrap().total_order, 3);
    }

    #[test]
    fn a_gap_in_one_broker_does_not_stall_another() {
        let (_d, r) = region(64);
        // Broker 1 has slot 1 committed but not slot 0 (a slow connection).
        commit(&r, 1, 1, 1, true);
        commit(&r, 2, 0, 1, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 1);
        assert_eq!(r.goi_read(1, 0).unwrap().broker_id, 2);
        commit(&r, 1, 0, 1, true);
        c.scan();
        c.seal_all();
        let brokers: Vec<(u16, u64)> = (1..3)
            .map(|g| {
                let e = r.goi_read(1, g).unwrap();
                (e.broker_id, e.pbr_index)
            })
            .collect();
        assert_eq!(brokers, vec![(1, 0), (1, 1)], "per-broker FIFO kept");
    }

    #[test]
    fn full_goi_waits_for_reclamation_instead_of_overwriting() {
        let (_d, r) = region(8);
        for i in 0..10 {
            commit(&r, 0, i, 1, true);
        }
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 8);
        let log = r.log(1, 0);
        assert_eq!(log.reclaim_request.load(Ordering::Acquire), 1);
        // The broker reclaims the first two batches; the rest can now be ordered.
        log.reclaimed_pbr.store(2, Ordering::Release);
        c.scan();
        c.seal_all();
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 10);
        assert_eq!(r.goi_read(1, 9).unwrap().pbr_index, 9);
    }

    #[test]
    fn restarted_sequencer_resumes_from_the_region() {
        let (_d, r) = region(64);
        commit(&r, 0, 0, 2, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        drop(c);
        commit(&r, 0, 1, 5, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        let e = r.goi_read(1, 1).unwrap();
        assert_eq!((e.pbr_index, e.total_order), (1, 2));
        assert_eq!(r.topic_seq(1).next_position.load(Ordering::Acquire), 7);
    }
}
