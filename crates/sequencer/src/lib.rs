//! The epoch sequencer: gives every batch of an ordered topic (order 2 or 5) one global
//! position.
//!
//! Owns: the GOI of every ordered topic, each topic's sequence line (`committed_seq`,
//! `next_position`), the sequencer line of every log (`ordered_pbr`,
//! `reclaim_request`), the `total_order` field of PBR slots and the order-5 session
//! table (`sessions`; when it gives a slot to a new session it also resets the slot's
//! `durable_hwm`, otherwise the last replica's). It only reads PBR
//! slots and broker-owned frontiers; it never touches payload bytes (axiom A1).
//!
//! Pipeline: one scanner per (topic, broker) follows that broker's PBR with plain
//! loads of the commit tokens and hands committed descriptors to the topic's orderer,
//! one type per ordering mode (no locks: the sequencer thread is the only writer).
//! Order 2 ([`EpochMerge`]): a buffer per broker; once per epoch the buffers are merged
//! in broker order. Order 5 ([`sessions::Sessions`]): each batch takes its turn in its
//! session, and admitted batches are ordered in admission order. Either way, positions
//! are assigned in the GOI entries, written with their token last, and then
//! `committed_seq`, the topic's `next_position` (one atomic add) and each broker's
//! `ordered_pbr` advance. A broker with nothing committed adds nothing to an epoch, so
//! a slow or idle broker never stalls the others. The scan loop is generic over the orderer ([`Admit`]), so the
//! mode is chosen once per topic per scan and per seal, never per slot.
//!
//! Only the holder of the region's sequencer lease ([`lease`]) may run a sequencer on
//! a region; the server and `embarcadero sequencer` take it before starting one.

pub mod lease;
mod sessions;

#[cfg(test)]
mod epoch_open_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod session_end_tests;

pub use lease::{Lease, LeaseError, LeaseState};

use embarcadero_region::backoff::Backoff;
use embarcadero_region::{GoiEntry, LogControl, Region, TopicMeta};
use embarcadero_wire::{BatchFlags, BatchHeader};
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
    /// Order 5: how far above a session's next expected batch a batch may arrive.
    pub session_window: u64,
    /// Order 5: how long a gap at the head of a session may last before it is fenced.
    pub session_lease: Duration,
    /// Order 5: how long a session must have been idle before its slot in the session
    /// table may go to a new session (only when the table is full).
    pub session_idle_evict: Duration,
    /// The fencing epoch of the lease this sequencer runs under: it stops before an
    /// epoch's writes once the region's epoch has moved on (a successor took over while
    /// it was paused). `None`: unchecked (tests).
    pub fencing_epoch: Option<u64>,
    /// A reader whose broker has not beaten its pin for this long holds nothing back
    /// (the brokers' `reader_stall_timeout`): for the batches of a dead broker, whose
    /// GOI slots only the readers' pins hold (see `Core::dead_brokers_batch_released`).
    pub reader_stall_timeout: Duration,
}

impl Default for SequencerConfig {
    fn default() -> Self {
        Self {
            epoch: Duration::from_micros(500),
            idle_sleep_max: Duration::from_millis(20),
            session_window: 4096,
            session_lease: Duration::from_secs(30),
            session_idle_evict: Duration::from_secs(600),
            fencing_epoch: None,
            reader_stall_timeout: Duration::from_secs(30),
        }
    }
}

impl SequencerConfig {
    /// Whether this sequencer may still write the region: its lease is the current one
    /// (or unchecked). Every write outside a seal, such as a resume's completion of a
    /// predecessor's stores or a fence acknowledgement while idle, asks this first,
    /// as the seal does: a deposed sequencer is no writer of any sequencer line.
    fn may_write(&self, region: &Region) -> bool {
        self.fencing_epoch
            .is_none_or(|mine| region.fencing_epoch().load(Ordering::Acquire) == mine)
    }
}

/// Smallest epoch accepted.
pub const MIN_EPOCH: Duration = Duration::from_micros(50);

#[derive(Debug, Default)]
pub struct SequencerMetrics {
    pub epochs_sealed: AtomicU64,
    pub batches_ordered: AtomicU64,
    pub messages_ordered: AtomicU64,
    /// Total time spent sealing (assigning positions and writing the GOI), in ns: the
    /// sum of `goi_write_nanos` and `sequence_nanos`.
    pub seal_nanos: AtomicU64,
    /// Part of sealing: writing the epoch's GOI entries and each batch's position into
    /// its PBR slot, in ns.
    pub goi_write_nanos: AtomicU64,
    /// The rest of sealing: publishing the epoch's positions (the one atomic add and
    /// `committed_seq`), the brokers' ordered frontiers and bells, and for order 5 the
    /// session table, in ns.
    pub sequence_nanos: AtomicU64,
    /// Total time spent scanning PBRs for committed slots, in ns.
    pub scan_nanos: AtomicU64,
    /// Batch-nanoseconds spent waiting for an epoch to close: each batch from its
    /// broker's commit (`committed_ns`; from the scan that found it when the stamp is
    /// missing) to the seal that ordered it; divide by `batches_ordered` for the mean.
    /// Order 5: a batch the sessions drop counts until it is found, and time held
    /// behind a gap in its session does not count. Waiting time, not thread time.
    pub epoch_wait_nanos: AtomicU64,
    /// Times an epoch could not be fully sealed because GOI slots were still in use.
    pub goi_full_stalls: AtomicU64,
    /// Times an epoch could not be fully sealed because the next batch would have
    /// reached its memory-only topic's position ceiling (the control plane raises it
    /// long before: nonzero means it fell behind).
    pub ceiling_stalls: AtomicU64,
    /// Order-5 sessions that gave up their table slot to a new session.
    pub sessions_evicted: AtomicU64,
    /// Order-5 sessions their publishers ended on closing (marked Ended in the table;
    /// their slots go to new sessions first).
    pub sessions_ended_by_publisher: AtomicU64,
    /// Order-5 batches dropped because they claimed a session bound to another key:
    /// hijack attempts that got past the brokers' hello check.
    pub session_key_mismatches: AtomicU64,
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

/// Where ordering one broker's buffered slots in an epoch merge stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MergeStop {
    /// Every buffered slot was ordered: the merge goes on with the next broker.
    Drained,
    /// The next batch would pass the topic's position ceiling.
    Ceiling,
    /// The GOI has no free slot for the next batch (a stall).
    GoiFull,
}

/// Takes a topic's scanned slots until an epoch orders them. One implementation per
/// ordering mode; the scan loop is generic over it, so it is compiled once per mode and
/// the mode is chosen once per topic per scan, never per slot.
trait Admit {
    /// Takes slot `pbr_index` of `broker` (`entry` is `None` for a void slot). Each
    /// broker's slots come in PBR order, none skipped.
    fn admit(&mut self, region: &Region, broker: u32, pbr_index: u64, entry: Option<GoiEntry>);

    /// Takes slot `pbr_index` of `broker`, an epoch-open slot: void for every mode but
    /// order 5's sessions.
    fn open_epoch(
        &mut self,
        region: &Region,
        broker: u32,
        pbr_index: u64,
        _open: sessions::EpochOpen,
    ) {
        self.admit(region, broker, pbr_index, None);
    }

    /// Takes slot `pbr_index` of `broker`, a session-end slot: void for every mode but
    /// order 5's sessions.
    fn end_session(
        &mut self,
        region: &Region,
        broker: u32,
        pbr_index: u64,
        _end: sessions::SessionEnd,
    ) {
        self.admit(region, broker, pbr_index, None);
    }
}

/// Order 2: per broker, the slots scanned and not yet sealed, in PBR order; an epoch
/// merges them in broker order.
struct EpochMerge {
    /// Indexed by broker.
    buffers: Vec<Vec<Pending>>,
}

impl Admit for EpochMerge {
    fn admit(&mut self, _region: &Region, broker: u32, pbr_index: u64, entry: Option<GoiEntry>) {
        let buffer = &mut self.buffers[broker as usize];
        debug_assert!(
            buffer.last().is_none_or(|p| p.pbr_index + 1 == pbr_index),
            "a scanner takes its broker's slots in PBR order, none skipped"
        );
        buffer.push(Pending { pbr_index, entry });
    }
}

/// How a topic's scanned slots become GOI entries: one type per ordering mode.
enum Orderer {
    /// Order 2: the epoch merge of per-broker buffers.
    EpochMerge(EpochMerge),
    /// Order 5: sessions, their hold buffers and the admitted batches, ordered in
    /// admission order. Boxed: it is far larger than the merge, and reached once per
    /// topic per scan and per seal.
    Sessions(Box<sessions::Sessions>),
}

impl Orderer {
    /// Whether slots of `broker` were scanned and not sealed yet. Order 5 seals or
    /// holds what it admits: entries held for a session gap are not waited for (an
    /// order-5 publisher resends by session sequence, which needs no confirmation).
    fn unsealed(&self, broker: u32) -> bool {
        match self {
            Orderer::EpochMerge(m) => !m.buffers[broker as usize].is_empty(),
            Orderer::Sessions(_) => false,
        }
    }

    /// Batches scanned and waiting for an epoch: buffered (void slots, which are never
    /// ordered, left out), or admitted to an order-5 session's turn (a batch held for a
    /// gap in its session is not waiting for an epoch).
    fn queued(&self) -> usize {
        match self {
            Orderer::EpochMerge(m) => m
                .buffers
                .iter()
                .map(|b| b.iter().filter(|p| p.entry.is_some()).count())
                .sum(),
            Orderer::Sessions(s) => s.ready.len(),
        }
    }

    /// The order-5 sessions (tests).
    #[cfg(test)]
    fn sessions(&self) -> &sessions::Sessions {
        match self {
            Orderer::Sessions(s) => s,
            Orderer::EpochMerge(_) => panic!("not an order-5 topic"),
        }
    }
}

/// Follows one broker's PBR for one topic.
struct Scanner {
    broker: u32,
    /// Next PBR index to look at.
    cursor: u64,
}

impl Scanner {
    /// Hands the slot at the cursor (`None`: void) to the topic's orderer.
    fn take<A: Admit>(&mut self, region: &Region, orderer: &mut A, entry: Option<GoiEntry>) {
        orderer.admit(region, self.broker, self.cursor, entry);
        self.cursor += 1;
    }

    /// Hands the epoch-open slot at the cursor to the topic's orderer.
    fn take_open<A: Admit>(&mut self, region: &Region, orderer: &mut A, open: sessions::EpochOpen) {
        orderer.open_epoch(region, self.broker, self.cursor, open);
        self.cursor += 1;
    }

    /// Hands the session-end slot at the cursor to the topic's orderer.
    fn take_end<A: Admit>(&mut self, region: &Region, orderer: &mut A, end: sessions::SessionEnd) {
        orderer.end_session(region, self.broker, self.cursor, end);
        self.cursor += 1;
    }
}

/// The end of a topic's GOI as the sequencer wrote it: the next GOI index and the next
/// global position (what the region's sequence line says once published).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GoiTail {
    committed: u64,
    next_position: u64,
}

impl GoiTail {
    /// Where a predecessor's published order ends ([`Region::sequence_end`]), with the
    /// region's `next_position` brought up to it. `publish` stores `committed_seq` before
    /// `next_position`: a predecessor killed between the two leaves the word behind its
    /// last committed entry, and resuming from the word would give the next batch
    /// positions that entry already has (resuming from it with the stores the other way
    /// round skipped positions instead: a gap readers waited on).
    ///
    /// A sequencer whose lease has passed to another (`config.fencing_epoch`) writes
    /// nothing: the owner may be between its two stores, and completing them for it
    /// would move the word under its `add`. Such a sequencer stops at its next seal.
    fn resume(region: &Region, topic: u32, config: &SequencerConfig) -> Self {
        let (committed, next_position) = region.sequence_end(topic);
        let seq = region.sequencer_topic(topic);
        let stored = seq.next_position.load(Ordering::Acquire);
        if next_position > stored && config.may_write(region) {
            tracing::warn!(
                topic,
                next_position = stored,
                published_up_to = next_position,
                "a predecessor stopped between publishing an epoch and its positions; completing it"
            );
            // The epoch's entries are published already: this completes its second store.
            seq.next_position.advance(next_position, Ordering::Release);
        }
        assert!(
            next_position >= seq.start_position.load(Ordering::Acquire),
            "topic {topic}'s positions continue at or above where this region starts"
        );
        Self {
            committed,
            next_position,
        }
    }

    /// Writes `entry` as the next GOI entry (token last) and gives its batch, in its PBR
    /// slot too, the next global position.
    fn append(
        &mut self,
        region: &Region,
        topic: u32,
        broker: u32,
        pbr_index: u64,
        entry: GoiEntry,
    ) {
        assert!(
            entry.pbr_index == pbr_index && entry.broker_id as u32 == broker,
            "a GOI entry names the PBR slot it orders"
        );
        let entry = GoiEntry {
            total_order: self.next_position,
            ..entry
        };
        region.goi_write(topic, self.committed, &entry);
        region.pbr_set_total_order(topic, broker, pbr_index, entry.total_order);
        self.committed += 1;
        // `below_ceiling` let the batch in only if its positions fit below the ceiling.
        self.next_position = self
            .next_position
            .checked_add(entry.num_msg as u64)
            .expect("global positions never wrap");
    }
}

struct TopicState {
    orderer: Orderer,
    line: TopicLine,
}

/// Where the sequencer stands on one topic, whatever its ordering mode.
struct TopicLine {
    topic: u32,
    generation: u64,
    /// Has disk replicas, which wait on the replication bell for new batches.
    replicated: bool,
    /// One per broker, in broker order.
    scanners: Vec<Scanner>,
    /// Where the sequencer has written the GOI up to.
    tail: GoiTail,
}

impl TopicState {
    /// Resumes ordering `topic` where the region says the sequencer left it.
    fn resume(region: &Region, topic: u32, meta: &TopicMeta, config: &SequencerConfig) -> Self {
        let brokers = region.capacities().brokers;
        let orderer = if meta.order == 5 {
            Orderer::Sessions(Box::new(sessions::Sessions::recover(
                region,
                topic,
                meta.replication_factor,
                config,
            )))
        } else {
            Orderer::EpochMerge(EpochMerge {
                buffers: vec![Vec::new(); brokers as usize],
            })
        };
        let mut cursors: Vec<u64> = (0..brokers)
            .map(|broker| {
                region
                    .log(topic, broker)
                    .ordered_pbr
                    .load(Ordering::Acquire)
            })
            .collect();
        if meta.order == 2 && config.may_write(region) {
            catch_up_with_published_order(region, topic, &mut cursors);
        }
        for (broker, cursor) in (0..brokers).zip(&cursors) {
            // Brokers reclaim only below `ordered_pbr` (orders 2 and 5): a scan that
            // started below their reclaimed frontier would wait for slots that are gone.
            let reclaimed = region
                .log(topic, broker)
                .reclaimed_pbr
                .load(Ordering::Acquire);
            assert!(
                *cursor >= reclaimed,
                "topic {topic}, broker {broker}: ordered up to {cursor}, reclaimed up to {reclaimed}"
            );
        }
        let scanners = (0..brokers)
            .zip(cursors)
            .map(|(broker, cursor)| Scanner { broker, cursor })
            .collect();
        let tail = GoiTail::resume(region, topic, config);
        Self {
            orderer,
            line: TopicLine {
                topic,
                generation: meta.generation,
                replicated: meta.replication_factor >= 2,
                scanners,
                tail,
            },
        }
    }
}

/// Order 2: moves each broker's scan cursor, and its `ordered_pbr`, past every slot a
/// predecessor already published in the GOI.
///
/// A sequencer publishes an epoch (`committed_seq`) before it advances the brokers'
/// `ordered_pbr`: a broker must never acknowledge or reclaim a batch whose position is
/// not published yet. A predecessor killed between the two leaves `ordered_pbr` behind
/// the GOI, and a successor starting its scan there would give those batches a second
/// position (found by the fault campaign, docs/RELIABILITY.md). Each broker's entries
/// stand in the GOI in PBR order, so the last one below `committed_seq` tells where its
/// ordered slots end. Order 5 needs no such step: its session table, reconciled from the
/// GOI at recovery, drops the sequence numbers it has ordered already.
fn catch_up_with_published_order(region: &Region, topic: u32, cursors: &mut [u64]) {
    let committed = region
        .topic_seq(topic)
        .committed_seq
        .load(Ordering::Acquire);
    let oldest = committed.saturating_sub(region.capacities().goi_slots);
    let mut unresolved = cursors.len();
    let mut resolved = vec![false; cursors.len()];
    for g in (oldest..committed).rev() {
        if unresolved == 0 {
            break;
        }
        // A slot an unpublished write of the predecessor reused: look further back.
        let Some(e) = region.goi_read(topic, g) else {
            continue;
        };
        let b = e.broker_id as usize;
        assert!(
            b < cursors.len(),
            "GOI entry {g} of topic {topic} names broker {b}"
        );
        if resolved[b] {
            continue;
        }
        resolved[b] = true;
        unresolved -= 1;
        let past = e.pbr_index + 1;
        if past > cursors[b] {
            tracing::warn!(
                topic,
                broker = b,
                ordered_pbr = cursors[b],
                published_up_to = past,
                "a predecessor published slots it had not marked ordered; not ordering them again"
            );
            cursors[b] = past;
            region
                .sequencer_line(topic, b as u32)
                .ordered_pbr
                .advance(past, Ordering::Release);
            region.broker_bell(b as u32).ring();
        }
    }
}

/// What one scan shares across the logs it reads.
struct ScanPass<'a> {
    region: &'a Region,
    /// Brokers' commit stamps read this host's clock (see `Core::same_clock`).
    same_clock: bool,
    started_ns: u64,
    found: &'a mut Found,
}

/// Batches found by the current scan and the sum of their commit times
/// (`committed_ns`; 0 from a broker that does not stamp it, left out): their wait
/// before they were found.
#[derive(Debug, Default)]
struct Found {
    batches: u128,
    committed_ns: u128,
}

/// The epoch open a void slot flagged `EPOCH_OPEN` asks for, if it is one. Its epoch
/// must fit the session table's 32 bits (brokers refuse larger ones at the hello): a
/// slot that says otherwise is void, said in the log.
fn epoch_open(topic: u32, broker: u32, h: &BatchHeader) -> Option<sessions::EpochOpen> {
    if h.flags & BatchFlags::EPOCH_OPEN == 0 {
        return None;
    }
    if h.session_epoch == 0 || h.session_epoch > u32::MAX as u64 {
        tracing::error!(
            topic,
            broker,
            pbr_index = h.pbr_index,
            epoch = h.session_epoch,
            "epoch-open slot names an epoch outside 1..=u32::MAX; taken as void"
        );
        return None;
    }
    Some(sessions::EpochOpen {
        client_id: h.client_id,
        epoch: h.session_epoch,
        opener: h.batch_id as u32,
        key_hash: h.session_key_hash,
    })
}

/// The end of a session a void slot flagged `END_SESSION` asks for, if it is one.
fn session_end(h: &BatchHeader) -> Option<sessions::SessionEnd> {
    (h.flags & BatchFlags::END_SESSION != 0).then_some(sessions::SessionEnd {
        client_id: h.client_id,
        epoch: h.session_epoch,
        opener: h.batch_id as u32,
        key_hash: h.session_key_hash,
        next_seq: h.batch_seq,
    })
}

impl ScanPass<'_> {
    /// Scans every broker's log of one topic into its orderer.
    fn scan_topic<A: Admit>(&mut self, line: &mut TopicLine, orderer: &mut A) {
        for s in &mut line.scanners {
            self.scan_log(line.topic, s, orderer);
        }
    }

    /// Takes the committed slots from `s`'s cursor on, at most `MAX_SCAN_PER_PASS`.
    fn scan_log<A: Admit>(&mut self, topic: u32, s: &mut Scanner, orderer: &mut A) {
        let region = self.region;
        let limit = self.fence_limit(topic, s, orderer);
        let mut taken = 0;
        while taken < MAX_SCAN_PER_PASS && s.cursor < limit {
            let Some(h) = region.pbr_read(topic, s.broker, s.cursor) else {
                self.assert_not_reclaimed(topic, s);
                break;
            };
            // The pair of `pbr_commit`'s check: the slot at the cursor holds its index.
            assert_eq!(
                h.pbr_index, s.cursor,
                "topic {topic}, broker {}: PBR slot {} names index {}",
                s.broker, s.cursor, h.pbr_index
            );
            let valid = h.flags & BatchFlags::VALID != 0;
            // A batch fits one segment, and its size the GOI entry's 32 bits.
            assert!(
                !valid || h.total_size <= u32::MAX as u64,
                "topic {topic}, broker {}: batch {} of {} bytes",
                s.broker,
                s.cursor,
                h.total_size
            );
            if valid {
                self.note_found(h.committed_ns);
            } else if let Some(open) = epoch_open(topic, s.broker, &h) {
                s.take_open(region, orderer, open);
                taken += 1;
                continue;
            } else if let Some(end) = session_end(&h) {
                s.take_end(region, orderer, end);
                taken += 1;
                continue;
            }
            let entry = valid.then_some(GoiEntry {
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
                session_key_hash: h.session_key_hash,
            });
            s.take(region, orderer, entry);
            taken += 1;
        }
    }

    /// At a slot it cannot read yet: the slot is not committed yet, or its topic was
    /// deleted (whose logs brokers let go of at once). Brokers reclaim an ordered topic's
    /// log only below `ordered_pbr`, which never passes this cursor: a slot reclaimed
    /// before it was ordered would stop this scanner for good, without a word.
    fn assert_not_reclaimed(&self, topic: u32, s: &Scanner) {
        let reclaimed = self
            .region
            .log(topic, s.broker)
            .reclaimed_pbr
            .load(Ordering::Acquire);
        assert!(
            reclaimed <= s.cursor || self.region.topic_deleted(topic),
            "topic {topic}, broker {}: PBR slot {} was reclaimed (up to {reclaimed}) before it was ordered",
            s.broker,
            s.cursor
        );
    }

    /// The PBR index `s` may scan below. A fenced broker's slots at or above the fence
    /// are never ordered; a restarted broker lifts the fence from its own first slot
    /// on, and the slots in between count as void (taken here).
    fn fence_limit<A: Admit>(&self, topic: u32, s: &mut Scanner, orderer: &mut A) -> u64 {
        let log = self.region.log(topic, s.broker);
        let fence = log.fence_pbr.load(Ordering::Acquire);
        let limit = fence.checked_sub(1).unwrap_or(u64::MAX);
        if fence != 0 && log.resumed_fence.load(Ordering::Acquire) == fence && s.cursor >= limit {
            let resume = log.resume_pbr.load(Ordering::Acquire);
            // The restarted broker's own slots start at or after the last one its
            // predecessor had before the fence (`resume_log` asserts it where it writes).
            assert!(
                resume >= limit,
                "topic {topic}, broker {}: resumes at {resume}, below its fence {fence}",
                s.broker
            );
            while s.cursor < resume {
                s.take(self.region, orderer, None);
            }
            return u64::MAX;
        }
        limit
    }

    /// Counts a found batch's wait before this scan, from its broker's commit stamp.
    fn note_found(&mut self, committed_ns: u64) {
        // A stamp after this scan began is not from this host's clock.
        if self.same_clock && committed_ns != 0 && committed_ns <= self.started_ns {
            self.found.batches += 1;
            self.found.committed_ns += committed_ns as u128;
        }
    }
}

/// Most slots one scanner takes per pass, so one busy broker cannot monopolise a pass.
const MAX_SCAN_PER_PASS: usize = 4096;
const TOPIC_REFRESH: Duration = Duration::from_millis(20);

struct Core {
    region: Arc<Region>,
    config: SequencerConfig,
    metrics: Arc<SequencerMetrics>,
    topics: Vec<TopicState>,
    /// Batches scanned and waiting for their epoch, as of `queued_since`: the epoch
    /// wait after a batch is found is this count integrated over time (see
    /// [`Core::account_epoch_wait`]).
    queued: u64,
    queued_since: Instant,
    /// Batches found by the current scan (see [`Found`]).
    found: Found,
    /// The region was created on this host since it booted, so brokers' commit stamps
    /// read the same clock as this sequencer's; else they are not used.
    same_clock: bool,
}

impl Core {
    fn new(region: Arc<Region>, config: SequencerConfig, metrics: Arc<SequencerMetrics>) -> Self {
        let same_clock = region.created_this_boot();
        Self {
            region,
            config,
            metrics,
            topics: Vec::new(),
            queued: 0,
            queued_since: Instant::now(),
            found: Found::default(),
            same_clock,
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
            let scan_started = Instant::now();
            let pending = self.scan();
            let now = Instant::now();
            self.metrics.scan_nanos.fetch_add(
                now.duration_since(scan_started).as_nanos() as u64,
                Ordering::Relaxed,
            );
            self.account_epoch_wait(now, embarcadero_region::monotonic_ns());
            if pending == 0 {
                // Fences are set on idle topics too (a dead broker stops traffic).
                if self.config.may_write(&region) {
                    for t in &self.topics {
                        self.acknowledge_fences(t);
                    }
                }
                backoff.idle(Some((&bell, seen)));
                continue;
            }
            backoff.reset();
            if now >= next_seal {
                if !self.config.may_write(&region) {
                    tracing::error!(
                        mine = self.config.fencing_epoch,
                        current = region.fencing_epoch().load(Ordering::Acquire),
                        "another sequencer took over the region (fencing epoch moved on); this one stops without writing"
                    );
                    return;
                }
                self.seal_epoch();
                // Epochs tick at a fixed period while there is traffic; after an idle
                // spell the first batch is sealed at once.
                next_seal = (next_seal + self.config.epoch).max(now);
            } else {
                std::thread::sleep(next_seal - now);
            }
        }
    }

    /// Picks up ordered topics created since the last look, resuming from the region,
    /// and lets go of deleted ones: their slots are never reused in this region, so the
    /// sequencer at worst orders a deleted topic's batches for one more look, into lines
    /// nobody reads.
    fn refresh_topics(&mut self) {
        let caps = self.region.capacities();
        let region = &self.region;
        self.topics.retain(|t| {
            let deleted = region.topic_deleted(t.line.topic);
            if deleted {
                tracing::info!(
                    topic = t.line.topic,
                    "the sequencer let go of a deleted topic"
                );
            }
            !deleted
        });
        for topic in 0..caps.max_topics {
            let Some(meta) = self.region.topic_meta(topic) else {
                continue;
            };
            if meta.order < 2 {
                continue;
            }
            if let Some(t) = self.topics.iter().find(|t| t.line.topic == topic) {
                if t.line.generation == meta.generation {
                    continue;
                }
                self.topics.retain(|t| t.line.topic != topic);
            }
            let state = TopicState::resume(&self.region, topic, &meta, &self.config);
            self.topics.push(state);
        }
        // Two orderers of one topic would both write its GOI and sequence line.
        debug_assert!(
            self.topics.iter().enumerate().all(|(i, t)| self.topics[..i]
                .iter()
                .all(|u| u.line.topic != t.line.topic)),
            "the sequencer orders each topic once"
        );
    }

    /// Collects newly committed PBR slots; returns how many are waiting in buffers.
    fn scan(&mut self) -> usize {
        let mut pass = ScanPass {
            region: &self.region,
            same_clock: self.same_clock,
            started_ns: embarcadero_region::monotonic_ns(),
            found: &mut self.found,
        };
        let mut waiting = 0;
        for t in &mut self.topics {
            waiting += match &mut t.orderer {
                Orderer::EpochMerge(m) => {
                    pass.scan_topic(&mut t.line, m);
                    m.buffers.iter().map(Vec::len).sum::<usize>()
                }
                Orderer::Sessions(sessions) => {
                    sessions.tick(pass.region, Instant::now());
                    pass.scan_topic(&mut t.line, sessions.as_mut());
                    self.metrics
                        .sessions_evicted
                        .fetch_add(std::mem::take(&mut sessions.evictions), Ordering::Relaxed);
                    self.metrics.sessions_ended_by_publisher.fetch_add(
                        std::mem::take(&mut sessions.publisher_ends),
                        Ordering::Relaxed,
                    );
                    self.metrics.session_key_mismatches.fetch_add(
                        std::mem::take(&mut sessions.key_mismatches),
                        Ordering::Relaxed,
                    );
                    sessions.ready.len() + sessions.dirty as usize
                }
            };
        }
        waiting
    }

    /// Adds the batch-time waited for epochs since the last call, and counts the
    /// batches waiting now. A batch waits from its broker's commit to the seal that
    /// orders it, in two parts: until the scan that finds it ends (`now_ns`, the
    /// region host's monotonic clock, against its `committed_ns`), then as one of the
    /// `queued` count, integrated over time, so nothing is kept per batch. `run` calls
    /// this after every scan, so right before sealing; [`Core::seal_epoch`] recounts
    /// after.
    fn account_epoch_wait(&mut self, now: Instant, now_ns: u64) {
        let waited = now.saturating_duration_since(self.queued_since).as_nanos() as u64;
        let found = std::mem::take(&mut self.found);
        let before_found = (found.batches * now_ns as u128).saturating_sub(found.committed_ns);
        let before_found = u64::try_from(before_found).unwrap_or(u64::MAX);
        self.metrics.epoch_wait_nanos.fetch_add(
            self.queued
                .saturating_mul(waited)
                .saturating_add(before_found),
            Ordering::Relaxed,
        );
        self.queued_since = now;
        self.queued = self.count_queued();
    }

    /// Batches scanned and not yet ordered (see [`Orderer::queued`]).
    fn count_queued(&self) -> u64 {
        self.topics.iter().map(|t| t.orderer.queued() as u64).sum()
    }

    /// Seals the epoch; what it ordered no longer counts as waiting.
    fn seal_epoch(&mut self) {
        self.seal_all();
        self.queued = self.count_queued();
    }

    fn seal_all(&mut self) {
        let start = Instant::now();
        let mut topics = std::mem::take(&mut self.topics);
        let mut goi_write = Duration::ZERO;
        for t in &mut topics {
            goi_write += self.seal(t);
        }
        self.topics = topics;
        let sealing = start.elapsed();
        self.metrics.epochs_sealed.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .seal_nanos
            .fetch_add(sealing.as_nanos() as u64, Ordering::Relaxed);
        self.metrics
            .goi_write_nanos
            .fetch_add(goi_write.as_nanos() as u64, Ordering::Relaxed);
        self.metrics.sequence_nanos.fetch_add(
            sealing.saturating_sub(goi_write).as_nanos() as u64,
            Ordering::Relaxed,
        );
    }

    /// Orders one topic's waiting batches the way its ordering mode does, then confirms
    /// its fences. Returns the time spent writing the GOI.
    fn seal(&self, t: &mut TopicState) -> Duration {
        let goi_write = match &mut t.orderer {
            Orderer::EpochMerge(m) => self.seal_epoch_merge(&mut t.line, m),
            Orderer::Sessions(sessions) => self.seal_sessions(&mut t.line, sessions),
        };
        // After `committed_seq` is published: whoever reads the acknowledgement then
        // finds every ordered entry below the fence under `committed_seq`.
        self.acknowledge_fences(t);
        goi_write
    }

    /// Orders one order-5 topic's admitted batches, in admission order. Returns the
    /// time spent writing the GOI.
    fn seal_sessions(&self, t: &mut TopicLine, sessions: &mut sessions::Sessions) -> Duration {
        let region = &self.region;
        let goi_slots = region.capacities().goi_slots;
        let start = t.tail;
        let ceiling = region.position_ceiling(t.topic).load(Ordering::Acquire);
        let writing = Instant::now();
        while let Some(b) = sessions.ready.front().copied() {
            if !self.below_ceiling(t.tail, &b.entry, ceiling) {
                break;
            }
            if !self.goi_slot_free(t.topic, t.replicated, t.tail.committed, goi_slots) {
                self.metrics.goi_full_stalls.fetch_add(1, Ordering::Relaxed);
                break;
            }
            let goi = t.tail.committed;
            let entry = GoiEntry {
                flags: b.entry.flags | sessions.goi_flags(&b),
                ..b.entry
            };
            t.tail.append(region, t.topic, b.broker, b.pbr_index, entry);
            sessions.ready.pop_front();
            sessions.committed(&b, goi);
        }
        let goi_write = writing.elapsed();
        self.publish(t.topic, start, t.tail);
        self.announce(t.topic, t.replicated, start, t.tail);
        // The table after committed_seq: recovery reconciles a lagging table from the GOI.
        sessions.write_table(region);
        for s in &t.scanners {
            if let Some(frontier) = sessions.frontier_moved(s.broker, s.cursor) {
                region
                    .sequencer_line(t.topic, s.broker)
                    .ordered_pbr
                    .advance(frontier, Ordering::Release);
            }
            // Acks of order-5 sessions follow the table: wake every broker.
            region.broker_bell(s.broker).ring();
        }
        goi_write
    }

    /// Orders one order-2 topic's buffered batches, broker by broker in broker order.
    /// Returns the time spent writing the GOI.
    fn seal_epoch_merge(&self, t: &mut TopicLine, m: &mut EpochMerge) -> Duration {
        let region = &self.region;
        let goi_slots = region.capacities().goi_slots;
        let start = t.tail;
        let ceiling = region.position_ceiling(t.topic).load(Ordering::Acquire);
        let mut ordered_upto: Vec<Option<u64>> = vec![None; m.buffers.len()];
        let mut stop = MergeStop::Drained;
        let writing = Instant::now();
        for (broker, buffer) in m.buffers.iter_mut().enumerate() {
            let upto = &mut ordered_upto[broker];
            stop = self.merge_buffer(t, broker, buffer, upto, ceiling, goi_slots);
            if stop != MergeStop::Drained {
                break;
            }
        }
        let goi_write = writing.elapsed();
        if stop == MergeStop::GoiFull {
            self.metrics.goi_full_stalls.fetch_add(1, Ordering::Relaxed);
        }
        if t.tail == start && ordered_upto.iter().all(Option::is_none) {
            // Nothing new: what the GOI holds is published already.
            return goi_write;
        }
        self.publish(t.topic, start, t.tail);
        // Counted and announced before any acknowledgement can go out.
        self.announce(t.topic, t.replicated, start, t.tail);
        self.advance_ordered_pbr(t, &ordered_upto);
        goi_write
    }

    /// Orders the prefix of `broker`'s buffered slots that fits: up to the topic's
    /// position `ceiling` and while the GOI (of `goi_slots` entries) has room. Takes the
    /// ordered slots out of `buffer`; `upto` becomes the PBR index past the last one.
    #[inline]
    fn merge_buffer(
        &self,
        t: &mut TopicLine,
        broker: usize,
        buffer: &mut Vec<Pending>,
        upto: &mut Option<u64>,
        ceiling: u64,
        goi_slots: u64,
    ) -> MergeStop {
        let region = &self.region;
        let mut stop = MergeStop::Drained;
        let mut used = 0;
        for p in buffer.iter() {
            if let Some(e) = p.entry {
                if !self.below_ceiling(t.tail, &e, ceiling) {
                    stop = MergeStop::Ceiling;
                    break;
                }
                if !self.goi_slot_free(t.topic, t.replicated, t.tail.committed, goi_slots) {
                    stop = MergeStop::GoiFull;
                    break;
                }
                t.tail
                    .append(region, t.topic, broker as u32, p.pbr_index, e);
            }
            *upto = Some(p.pbr_index + 1);
            used += 1;
        }
        buffer.drain(..used);
        // What stays buffered continues right after what was ordered: the merge
        // takes each broker's slots as one prefix, none skipped.
        assert!(
            buffer
                .first()
                .zip(*upto)
                .is_none_or(|(next, upto)| next.pbr_index == upto),
            "topic {}, broker {broker}: ordered up to {:?} but {:?} is next",
            t.topic,
            *upto,
            buffer.first().map(|p| p.pbr_index)
        );
        stop
    }

    /// Tells each broker how far the epoch ordered its log (`ordered_upto`, by broker:
    /// the PBR index past the last slot ordered, `None` if none was), and wakes it.
    fn advance_ordered_pbr(&self, t: &TopicLine, ordered_upto: &[Option<u64>]) {
        let region = &self.region;
        for (broker, upto) in ordered_upto.iter().enumerate() {
            if let Some(upto) = upto {
                // Only scanned slots are ordered: brokers reclaim below this.
                assert!(
                    *upto <= t.scanners[broker].cursor,
                    "topic {}, broker {broker}: ordered up to {upto}, scanned only to {}",
                    t.topic,
                    t.scanners[broker].cursor
                );
                // Brokers reclaim below it: `advance` asserts it only grows.
                region
                    .sequencer_line(t.topic, broker as u32)
                    .ordered_pbr
                    .advance(*upto, Ordering::Release);
                region.broker_bell(broker as u32).ring();
            }
        }
    }

    /// Confirms each fence once this topic's GOI holds every slot of the fenced log
    /// that will ever be ordered: the scanner reached the fence and nothing it took
    /// is left unsealed (see [`Orderer::unsealed`]).
    fn acknowledge_fences(&self, t: &TopicState) {
        let topic = t.line.topic;
        for s in &t.line.scanners {
            let log = self.region.log(topic, s.broker);
            let fence = log.fence_pbr.load(Ordering::Acquire);
            if fence != 0
                && s.cursor + 1 >= fence
                && !t.orderer.unsealed(s.broker)
                && log.fence_ack.load(Ordering::Acquire) != fence
            {
                self.region
                    .sequencer_line(topic, s.broker)
                    .fence_ack
                    .store(fence, Ordering::Release);
            }
        }
    }

    /// Publishes the GOI entries appended since `start`: `committed_seq` (the readiness
    /// of the prefix), then one atomic add per topic per epoch for their positions.
    fn publish(&self, topic: u32, start: GoiTail, end: GoiTail) {
        if end == start {
            return;
        }
        // A tail that moved appended entries; positions may stay (batches of no messages).
        assert!(
            end.committed > start.committed && end.next_position >= start.next_position,
            "topic {topic}: the GOI tail went from {start:?} to {end:?}"
        );
        let seq = self.region.sequencer_topic(topic);
        // The pair of the `next_position` check below: the region holds what this
        // sequencer last published, so nobody else wrote the line meanwhile.
        assert_eq!(
            seq.committed_seq.load(Ordering::Acquire),
            start.committed,
            "the sequencer is the only writer of committed_seq"
        );
        // `committed_seq` first: the entries carry their positions, so a successor of a
        // sequencer killed between the two stores finds where the positions end in the
        // last entry (`GoiTail::resume`). The other way round, the word led the published
        // entries and a successor continued from it, past positions no entry took.
        seq.committed_seq.advance(end.committed, Ordering::Release);
        let previous = seq
            .next_position
            .add(end.next_position - start.next_position, Ordering::AcqRel);
        assert_eq!(
            previous, start.next_position,
            "the sequencer is the only writer of next_position"
        );
    }

    /// Wakes the topic's subscribers (and replicas) and counts the epoch's work.
    fn announce(&self, topic: u32, replicated: bool, start: GoiTail, end: GoiTail) {
        if end == start {
            return;
        }
        self.region.topic_bell(topic).ring();
        if replicated {
            self.region.replication_bell().ring();
        }
        self.metrics
            .batches_ordered
            .fetch_add(end.committed - start.committed, Ordering::Relaxed);
        self.metrics
            .messages_ordered
            .fetch_add(end.next_position - start.next_position, Ordering::Relaxed);
    }

    /// Whether `entry` may take the next positions: all of them below the topic's
    /// position ceiling, which a memory-only topic restarted without its region starts
    /// from (`Region::position_ceiling`). One compare per batch; a batch that does not
    /// fit waits, with every batch behind it, for the control plane to raise the ceiling.
    fn below_ceiling(&self, tail: GoiTail, entry: &GoiEntry, ceiling: u64) -> bool {
        let fits = tail
            .next_position
            .checked_add(entry.num_msg as u64)
            .is_some_and(|end| end <= ceiling);
        if !fits {
            self.metrics.ceiling_stalls.fetch_add(1, Ordering::Relaxed);
        }
        fits
    }

    /// GOI slot of index `g` may be overwritten only once the batch of its previous
    /// occupant has left memory; otherwise ask that batch's broker to reclaim it.
    fn goi_slot_free(&self, topic: u32, replicated: bool, g: u64, goi_slots: u64) -> bool {
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
        if self.dead_brokers_batch_released(topic, replicated, &log, &e) {
            return true;
        }
        self.region
            .sequencer_line(topic, e.broker_id as u32)
            .reclaim_request
            .raise(e.pbr_index + 1, Ordering::AcqRel);
        self.region.broker_bell(e.broker_id as u32).ring();
        false
    }

    /// Whether `e`, a batch of a broker the control plane declared dead (its fence
    /// holds: the broker did not restart), is needed by no one, so that its GOI slot may
    /// take a new entry although its log keeps the bytes. A dead broker reclaims
    /// nothing, so waiting for its `reclaimed_pbr` stalled the topic for good once the
    /// GOI wrapped to its entries, a GOI's length of batches after its death (found by
    /// the failover bench running that long). Released means what the broker's own
    /// reclamation asks, less what only it can do: on every replica's disk (replicated
    /// topics, whose readers read the disks past memory), or read by every live reader
    /// (memory-only topics). A reader that starts at an overwritten entry is told the
    /// position is not retained, as after any reclamation (`subscribe.rs`).
    fn dead_brokers_batch_released(
        &self,
        topic: u32,
        replicated: bool,
        log: &LogControl,
        e: &GoiEntry,
    ) -> bool {
        let fence = log.fence_pbr.load(Ordering::Acquire);
        let dead = fence != 0 && log.resumed_fence.load(Ordering::Acquire) != fence;
        if !dead {
            return false;
        }
        // Fences only rise, and nothing at or above one is ever ordered.
        assert!(
            e.pbr_index < fence - 1,
            "topic {topic}: broker {}'s batch at PBR {} is in the GOI above its fence {fence}",
            e.broker_id,
            e.pbr_index
        );
        if replicated {
            return log.durable_pbr.load(Ordering::Acquire) > e.pbr_index;
        }
        let floor = self
            .region
            .reader_floor(topic, 0, self.config.reader_stall_timeout);
        floor >= e.total_order + e.num_msg as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::{
        monotonic_ns, Capacities, TopicMeta, GOI_SESSION_START, SESSION_SLOTS,
    };

    pub(super) fn region(goi_slots: u64) -> (tempfile::TempDir, Arc<Region>) {
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
        r.write_topic_meta(1, &TopicMeta::new("t", 2));
        (dir, r)
    }

    pub(super) fn commit(r: &Region, broker: u32, index: u64, num_msg: u32, valid: bool) {
        commit_at(r, broker, index, num_msg, valid, 0);
    }

    /// [`commit`] with the broker's commit time (`committed_ns`; 0: not stamped).
    pub(super) fn commit_at(
        r: &Region,
        broker: u32,
        index: u64,
        num_msg: u32,
        valid: bool,
        committed_ns: u64,
    ) {
        r.pbr_commit(
            1,
            broker,
            index,
            &BatchHeader {
                committed_ns,
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

    pub(super) fn core(r: &Arc<Region>) -> Core {
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
    fn no_batch_takes_a_position_at_or_above_the_ceiling_until_it_is_raised() {
        let (_d, r) = region(64);
        // Positions 0..5 fit below 6; the third batch (5, 6, 7) would not.
        r.control_plane().position_ceiling(1).set_for_test(6);
        commit(&r, 0, 0, 2, true);
        commit(&r, 0, 1, 3, true);
        commit(&r, 0, 2, 3, true);
        commit(&r, 1, 0, 1, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        let seq = r.topic_seq(1);
        assert_eq!(seq.committed_seq.load(Ordering::Acquire), 2);
        assert_eq!(seq.next_position.load(Ordering::Acquire), 5);
        assert_eq!(r.log(1, 0).ordered_pbr.load(Ordering::Acquire), 2);
        assert_eq!(
            r.log(1, 1).ordered_pbr.load(Ordering::Acquire),
            0,
            "a later broker waits too: the order is merged in broker order"
        );
        assert_eq!(c.metrics.ceiling_stalls.load(Ordering::Relaxed), 1);
        c.seal_all();
        assert_eq!(
            seq.committed_seq.load(Ordering::Acquire),
            2,
            "still waiting"
        );
        r.control_plane()
            .position_ceiling(1)
            .advance(1 << 32, Ordering::Release);
        c.seal_all();
        assert_eq!(seq.committed_seq.load(Ordering::Acquire), 4);
        assert_eq!(seq.next_position.load(Ordering::Acquire), 9);
    }

    #[test]
    fn order5_batches_wait_at_the_ceiling_too() {
        let (_d, r) = session_region();
        r.control_plane().position_ceiling(0).set_for_test(1);
        commit_session(&r, 0, 0, 7, 1, 0);
        commit_session(&r, 0, 1, 7, 1, 1);
        let mut c = session_core(&r, Duration::from_secs(30));
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(7, 0)]);
        r.control_plane()
            .position_ceiling(0)
            .advance(1 << 32, Ordering::Release);
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(7, 0), (7, 1)]);
    }

    #[test]
    fn epoch_wait_is_each_batch_from_its_commit_to_its_seal() {
        let (_d, r) = region(64);
        commit_at(&r, 0, 0, 1, true, 10_000);
        // A void slot is never ordered, so it never waits.
        commit_at(&r, 0, 1, 0, false, 11_000);
        // Not stamped (a broker from before the field): counted from when it is found.
        commit_at(&r, 1, 0, 1, true, 0);
        let mut c = core(&r);
        assert!(c.same_clock, "the test's region was created on this boot");
        let t0 = Instant::now();
        c.queued_since = t0;
        let ms = Duration::from_millis;
        assert_eq!(c.scan(), 3);
        c.account_epoch_wait(t0, 15_000);
        assert_eq!(c.queued, 2);
        commit_at(&r, 2, 0, 1, true, 20_000);
        assert_eq!(c.scan(), 4);
        c.account_epoch_wait(t0 + ms(1), 30_000);
        c.account_epoch_wait(t0 + ms(4), 33_000);
        c.seal_epoch();
        assert_eq!(c.queued, 0);
        c.account_epoch_wait(t0 + ms(10), 39_000);
        // Before being found: 5 us and 10 us. Found, waiting for the seal: two batches
        // 4 ms, the third (found at 1 ms) 3 ms. Nothing after the seal.
        let m = &c.metrics;
        assert_eq!(
            m.epoch_wait_nanos.load(Ordering::Relaxed),
            ms(11).as_nanos() as u64 + 15_000
        );
        // Sealing splits into writing the GOI and the rest, with nothing lost.
        assert_eq!(
            m.seal_nanos.load(Ordering::Relaxed),
            m.goi_write_nanos.load(Ordering::Relaxed) + m.sequence_nanos.load(Ordering::Relaxed)
        );
        assert!(m.goi_write_nanos.load(Ordering::Relaxed) > 0);
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
    fn a_fenced_log_is_ordered_up_to_its_fence_and_never_beyond() {
        let (_d, r) = region(64);
        // Broker 1 died with slots 0 and 1 committed, slot 2 a hole.
        commit(&r, 1, 0, 1, true);
        commit(&r, 1, 1, 1, true);
        let log = r.log(1, 1);
        r.control_plane()
            .fence_pbr(1, 1)
            .store(2 + 1, Ordering::Release);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        assert_eq!(log.ordered_pbr.load(Ordering::Acquire), 2);
        assert_eq!(
            log.fence_ack.load(Ordering::Acquire),
            3,
            "everything below the fence is in the GOI"
        );
        // A zombie fills the hole and commits more: none of it is ordered.
        commit(&r, 1, 2, 1, true);
        commit(&r, 1, 3, 1, true);
        commit(&r, 0, 0, 1, true);
        c.scan();
        c.seal_all();
        assert_eq!(log.ordered_pbr.load(Ordering::Acquire), 2);
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 3);
        assert_eq!(r.goi_read(1, 2).unwrap().broker_id, 0);
    }

    #[test]
    fn a_resumed_log_skips_the_fenced_slots_and_orders_the_new_process_slots() {
        let (_d, r) = region(64);
        // Broker 1 died with slot 0 committed and slot 1 a hole; slot 2 was committed
        // after the hole. Publishers were told slots 1 and 2 are not ordered.
        commit(&r, 1, 0, 1, true);
        commit(&r, 1, 2, 1, true);
        let log = r.log(1, 1);
        r.control_plane()
            .fence_pbr(1, 1)
            .store(1 + 1, Ordering::Release);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        assert_eq!(log.fence_ack.load(Ordering::Acquire), 2);
        // A new process voids the hole, resumes at 3 and commits slot 3.
        commit(&r, 1, 1, 0, false);
        let line = r.broker_line(1, 1);
        line.resume_pbr.store(3, Ordering::Release);
        line.resumed_fence.store(2, Ordering::Release);
        commit(&r, 1, 3, 5, true);
        c.scan();
        c.seal_all();
        let ordered: Vec<(u16, u64)> = (0..r.topic_seq(1).committed_seq.load(Ordering::Acquire))
            .map(|g| {
                let e = r.goi_read(1, g).unwrap();
                (e.broker_id, e.pbr_index)
            })
            .collect();
        assert_eq!(ordered, vec![(1, 0), (1, 3)], "slot 2 stays unordered");
        assert_eq!(log.ordered_pbr.load(Ordering::Acquire), 4);
        assert_eq!(
            log.fence_ack.load(Ordering::Acquire),
            2,
            "the old process's answer stands"
        );
        // The new process dies too: a second fence holds again.
        commit(&r, 1, 5, 1, true);
        r.control_plane()
            .fence_pbr(1, 1)
            .store(4 + 1, Ordering::Release);
        c.scan();
        c.seal_all();
        assert_eq!(log.ordered_pbr.load(Ordering::Acquire), 4);
        assert_eq!(log.fence_ack.load(Ordering::Acquire), 5);
    }

    #[test]
    fn a_fence_on_an_idle_log_is_acknowledged() {
        let (_d, r) = region(64);
        let mut c = core(&r);
        let log = r.log(1, 2);
        r.control_plane()
            .fence_pbr(1, 2)
            .store(1, Ordering::Release);
        assert_eq!(c.scan(), 0);
        for t in &c.topics {
            c.acknowledge_fences(t);
        }
        assert_eq!(log.fence_ack.load(Ordering::Acquire), 1);
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
        r.broker_line(1, 0)
            .reclaimed_pbr
            .advance(2, Ordering::Release);
        c.scan();
        c.seal_all();
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 10);
        assert_eq!(r.goi_read(1, 9).unwrap().pbr_index, 9);
    }

    /// A broker declared dead reclaims nothing, yet its batches stay in the GOI: their
    /// slots are taken again once no live reader needs them (memory-only), so the
    /// topic goes on a GOI's length after the death instead of stalling for good.
    #[test]
    fn a_dead_brokers_batches_free_their_goi_slots_once_no_reader_needs_them() {
        let (_d, r) = region(8);
        // Broker 1 commits two batches (positions 0 and 1), they are ordered, it dies.
        commit(&r, 1, 0, 1, true);
        commit(&r, 1, 1, 1, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        r.control_plane()
            .fence_pbr(1, 1)
            .store(2 + 1, Ordering::Release);
        // A live reader still needs position 1.
        let pin = r.reader_slot(1, 0);
        pin.mark_claimed();
        pin.position(0).store(1, Ordering::Release);
        pin.heartbeat.store(monotonic_ns(), Ordering::Release);
        for i in 0..10 {
            commit(&r, 0, i, 1, true);
        }
        let committed = |c: &mut Core| {
            c.scan();
            c.seal_all();
            r.topic_seq(1).committed_seq.load(Ordering::Acquire)
        };
        assert_eq!(
            committed(&mut c),
            9,
            "position 0's slot is taken again; position 1 is still read"
        );
        assert_eq!(r.log(1, 1).reclaimed_pbr.load(Ordering::Acquire), 0);
        pin.position(0).store(2, Ordering::Release);
        assert_eq!(
            committed(&mut c),
            10,
            "then position 1's; broker 0's own batches wait for its reclamation"
        );
        r.broker_line(1, 0)
            .reclaimed_pbr
            .advance(2, Ordering::Release);
        assert_eq!(committed(&mut c), 12);
        // A broker that restarted (its fence lifted) reclaims for itself again.
        r.broker_line(1, 1)
            .resumed_fence
            .store(3, Ordering::Release);
        let e = r.goi_read(1, 11).unwrap();
        assert!(!c.dead_brokers_batch_released(1, false, &r.log(1, 1), &e));
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

    /// A sequencer killed after publishing an epoch's `committed_seq` but before
    /// advancing `ordered_pbr`: its successor must not order those batches again. Found
    /// by `embarcadero chaos` (SIGKILL of the active sequencer, order 2; see
    /// docs/RELIABILITY.md, "Fault campaign"). Order 5 covers the same window in
    /// `a_restarted_sequencer_recovers_sessions_from_table_and_goi`.
    #[test]
    fn a_successor_does_not_order_again_what_was_published_before_ordered_pbr_moved() {
        let (_d, r) = region(64);
        commit(&r, 0, 0, 2, true);
        commit(&r, 1, 0, 3, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        drop(c);
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 2);
        for b in 0..2 {
            r.sequencer_line(1, b).ordered_pbr.set_for_test(0);
        }
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        let seq = r.topic_seq(1);
        assert_eq!(
            (
                seq.committed_seq.load(Ordering::Acquire),
                seq.next_position.load(Ordering::Acquire)
            ),
            (2, 5),
            "the two batches are in the order once"
        );
        for b in 0..2 {
            assert_eq!(
                r.log(1, b).ordered_pbr.load(Ordering::Acquire),
                1,
                "broker {b}'s ordered slot is marked ordered again, so it is acknowledged"
            );
        }
        commit(&r, 0, 1, 4, true);
        c.scan();
        c.seal_all();
        assert_eq!(
            (
                seq.committed_seq.load(Ordering::Acquire),
                seq.next_position.load(Ordering::Acquire)
            ),
            (3, 9),
            "a batch committed after the takeover continues the order"
        );
    }

    /// A sequencer whose lease passed to another while it was paused writes no
    /// sequencer line when it next looks at its topics: completing a predecessor's
    /// stores (`next_position`, `ordered_pbr`) is the lease holder's job, and the holder
    /// may be between those very stores. Only the current holder completes them.
    #[test]
    fn a_deposed_sequencer_completes_no_predecessor_stores_on_resume() {
        let (_d, r) = region(64);
        commit(&r, 0, 0, 2, true);
        commit(&r, 1, 0, 3, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        drop(c);
        // The window a kill leaves: the epoch is published, its positions and the
        // brokers' ordered frontiers are not.
        r.sequencer_topic(1).next_position.set_for_test(0);
        for b in 0..2 {
            r.sequencer_line(1, b).ordered_pbr.set_for_test(0);
        }
        let lease = r.lease_words();
        let deposed = lease.fencing_epoch.add(1, Ordering::AcqRel) + 1;
        lease.fencing_epoch.add(1, Ordering::AcqRel);
        let config = |epoch| SequencerConfig {
            fencing_epoch: Some(epoch),
            ..SequencerConfig::default()
        };
        let mut stale = Core::new(r.clone(), config(deposed), Default::default());
        stale.refresh_topics();
        assert_eq!(r.topic_seq(1).next_position.load(Ordering::Acquire), 0);
        for b in 0..2 {
            assert_eq!(r.log(1, b).ordered_pbr.load(Ordering::Acquire), 0);
        }
        let mut holder = Core::new(r.clone(), config(deposed + 1), Default::default());
        holder.refresh_topics();
        assert_eq!(
            r.topic_seq(1).next_position.load(Ordering::Acquire),
            5,
            "the lease holder completes the interrupted epoch"
        );
        for b in 0..2 {
            assert_eq!(r.log(1, b).ordered_pbr.load(Ordering::Acquire), 1);
        }
    }

    /// A sequencer killed between the two stores that publish an epoch (`committed_seq`,
    /// then its positions in `next_position`), before `ordered_pbr` moved: the successor
    /// continues the positions where the last committed entry ends, so none is given
    /// twice (resuming from the word) or skipped (the stores the other way round, as
    /// before: a gap readers waited on).
    #[test]
    fn a_successor_continues_positions_after_a_kill_between_committed_seq_and_next_position() {
        let (_d, r) = region(64);
        commit(&r, 0, 0, 2, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        // The epoch the predecessor is killed in: positions 2..5 and 5..9.
        commit(&r, 0, 1, 3, true);
        commit(&r, 1, 0, 4, true);
        c.scan();
        c.seal_all();
        drop(c);
        let seq = r.topic_seq(1);
        assert_eq!(seq.committed_seq.load(Ordering::Acquire), 3);
        // What the kill leaves: `committed_seq` stored, `next_position` and the brokers'
        // ordered frontiers still at the epoch before.
        r.sequencer_topic(1).next_position.set_for_test(2);
        r.sequencer_line(1, 0).ordered_pbr.set_for_test(1);
        r.sequencer_line(1, 1).ordered_pbr.set_for_test(0);
        assert_eq!(
            r.sequence_end(1),
            (3, 9),
            "the last entry says where positions end"
        );
        commit(&r, 2, 0, 1, true);
        let mut c = core(&r);
        assert_eq!(
            seq.next_position.load(Ordering::Acquire),
            9,
            "the successor completes the interrupted epoch before it orders anything"
        );
        c.scan();
        c.seal_all();
        let order: Vec<(u16, u64, u64)> = (0..seq.committed_seq.load(Ordering::Acquire))
            .map(|g| {
                let e = r.goi_read(1, g).unwrap();
                (e.broker_id, e.pbr_index, e.total_order)
            })
            .collect();
        assert_eq!(
            order,
            vec![(0, 0, 0), (0, 1, 2), (1, 0, 5), (2, 0, 9)],
            "each batch once, positions contiguous"
        );
        assert_eq!(seq.next_position.load(Ordering::Acquire), 10);
    }

    /// A line seeded to continue a topic in a new region has no entry of its own to end
    /// at: its stored word is the end, and the first batch ordered continues from it.
    #[test]
    fn a_seeded_line_without_entries_ends_at_its_stored_position() {
        let (_d, r) = region(64);
        let seq = r.sequencer_topic(1);
        seq.start_position.store(100, Ordering::Release);
        seq.next_position.advance(100, Ordering::Release);
        seq.committed_seq.advance(7, Ordering::Release);
        assert_eq!(r.sequence_end(1), (7, 100));
        commit(&r, 0, 0, 2, true);
        let mut c = core(&r);
        c.scan();
        c.seal_all();
        assert_eq!(r.goi_read(1, 7).unwrap().total_order, 100);
        assert_eq!(r.sequence_end(1), (8, 102));
        assert_eq!(r.topic_seq(1).next_position.load(Ordering::Acquire), 102);
    }

    // ------------------------------------------------------------------ order 5

    pub(super) fn session_region() -> (tempfile::TempDir, Arc<Region>) {
        let (d, r) = region(64);
        r.write_topic_meta(0, &TopicMeta::new("s", 5));
        (d, r)
    }

    pub(super) fn commit_session(
        r: &Region,
        broker: u32,
        index: u64,
        client: u64,
        epoch: u64,
        seq: u64,
    ) {
        commit_keyed(r, broker, index, (client, 0), epoch, seq);
    }

    /// Commits a batch of session `client` whose connection presented `key_hash`.
    pub(super) fn commit_keyed(
        r: &Region,
        broker: u32,
        index: u64,
        (client, key_hash): (u64, u64),
        epoch: u64,
        seq: u64,
    ) {
        r.pbr_commit(
            0,
            broker,
            index,
            &BatchHeader {
                batch_seq: seq,
                client_id: client,
                session_epoch: epoch,
                num_msg: 1,
                broker_id: broker as u16,
                flags: BatchFlags::VALID,
                pbr_index: index,
                total_size: 64,
                log_offset: index * 64,
                session_key_hash: key_hash,
                ..Default::default()
            },
        );
    }

    pub(super) fn session_core(r: &Arc<Region>, lease: Duration) -> Core {
        let config = SequencerConfig {
            session_lease: lease,
            ..SequencerConfig::default()
        };
        let mut c = Core::new(r.clone(), config, Default::default());
        c.refresh_topics();
        c
    }

    pub(super) fn goi_sessions(r: &Region) -> Vec<(u64, u64)> {
        let n = r.topic_seq(0).committed_seq.load(Ordering::Acquire);
        (0..n)
            .map(|g| {
                let e = r.goi_read(0, g).unwrap();
                (e.client_id, e.client_seq)
            })
            .collect()
    }

    #[test]
    fn session_order_holds_across_brokers_and_other_sessions_flow() {
        let (_d, r) = session_region();
        let mut c = session_core(&r, Duration::from_secs(30));
        // Client 7 sent seq 0, 1, 2 to brokers 0, 1, 2; 1 and 2 arrive first.
        commit_session(&r, 2, 0, 7, 1, 2);
        commit_session(&r, 1, 0, 7, 1, 1);
        commit_session(&r, 2, 1, 8, 1, 0); // another session, behind the held batch
        c.scan();
        c.seal_all();
        assert_eq!(
            goi_sessions(&r),
            vec![(8, 0)],
            "session 8 is not delayed by 7's gap"
        );
        assert_eq!(c.topics[0].orderer.sessions().held(), 2);
        // Broker 2's slot 0 is held, so its ordered frontier stays below it.
        assert_eq!(r.log(0, 2).ordered_pbr.load(Ordering::Acquire), 0);
        commit_session(&r, 0, 0, 7, 1, 0);
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(8, 0), (7, 0), (7, 1), (7, 2)]);
        assert_eq!(r.log(0, 2).ordered_pbr.load(Ordering::Acquire), 2);
        let (_, rec) = r.session_find(0, 7).unwrap();
        assert_eq!((rec.committed_hwm, rec.session_epoch), (3, 1));
    }

    #[test]
    fn duplicates_and_stale_epochs_are_dropped_but_pass_the_frontier() {
        let (_d, r) = session_region();
        let mut c = session_core(&r, Duration::from_secs(30));
        commit_session(&r, 0, 0, 7, 2, 0);
        commit_session(&r, 1, 0, 7, 2, 0); // retransmit through another broker
        commit_session(&r, 1, 1, 7, 1, 1); // stale epoch
        commit_session(&r, 0, 1, 7, 2, 1);
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(7, 0), (7, 1)]);
        assert_eq!(r.log(0, 1).ordered_pbr.load(Ordering::Acquire), 2);
        assert_eq!(r.session_find(0, 7).unwrap().1.committed_hwm, 2);
    }

    #[test]
    fn a_batch_with_another_key_never_takes_a_sessions_place() {
        const OWNER: u64 = 0xa11ce;
        const THIEF: u64 = 0xbad;
        let (_d, r) = session_region();
        let mut c = session_core(&r, Duration::from_secs(30));
        // Before the session is bound, a stranger's batch held ahead of its head binds
        // nothing, and is dropped once the owner's head batch binds the session.
        commit_keyed(&r, 2, 0, (7, THIEF), 1, 1);
        c.scan();
        c.seal_all();
        commit_keyed(&r, 0, 0, (7, OWNER), 1, 0);
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(7, 0)]);
        assert_eq!(c.metrics.session_key_mismatches.load(Ordering::Relaxed), 1);
        // Someone who read client 7's id and epoch from a delivery sends its next batch,
        // and a reopen with a higher epoch, through other brokers.
        commit_keyed(&r, 1, 0, (7, THIEF), 1, 1);
        commit_keyed(&r, 2, 1, (7, THIEF), 2, 1);
        c.scan();
        c.seal_all();
        assert_eq!(
            goi_sessions(&r),
            vec![(7, 0)],
            "the thief's batches are dropped"
        );
        assert_eq!(c.metrics.session_key_mismatches.load(Ordering::Relaxed), 3);
        assert_eq!(
            r.log(0, 1).ordered_pbr.load(Ordering::Acquire),
            1,
            "a dropped batch does not hold its broker's frontier"
        );
        let (_, rec) = r.session_find(0, 7).unwrap();
        assert_eq!(
            (rec.key_hash, rec.session_epoch),
            (OWNER, 1),
            "not reopened"
        );
        // The owner's own next batch is still admitted, also by a restarted sequencer,
        // which finds the binding in the table.
        commit_keyed(&r, 0, 1, (7, OWNER), 1, 1);
        drop(c);
        let mut c = session_core(&r, Duration::from_secs(30));
        commit_keyed(&r, 1, 1, (7, THIEF), 1, 2);
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(7, 0), (7, 1)]);
        assert_eq!(c.metrics.session_key_mismatches.load(Ordering::Relaxed), 1);
        assert_eq!(r.goi_read(0, 1).unwrap().session_key_hash, OWNER);
    }

    #[test]
    fn a_restarted_sequencer_recovers_sessions_from_table_and_goi() {
        let (_d, r) = session_region();
        let mut c = session_core(&r, Duration::from_secs(30));
        for seq in 0..3 {
            commit_session(&r, seq as u32 % 3, seq / 3, 7, 1, seq);
        }
        c.scan();
        c.seal_all();
        drop(c);
        // Simulate a crash between committed_seq and the table write: the table lags.
        let (slot, rec) = r.session_find(0, 7).unwrap();
        r.session_write(
            0,
            slot,
            &embarcadero_region::SessionRecord {
                committed_hwm: 1,
                ..rec
            },
        );
        // ...and between the table and ordered_pbr: brokers' frontiers lag too, so the
        // restarted sequencer rescans batches that are already committed.
        for b in 0..3 {
            r.sequencer_line(0, b).ordered_pbr.set_for_test(0);
        }
        commit_session(&r, 1, 1, 7, 1, 3);
        let mut c = session_core(&r, Duration::from_secs(30));
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(7, 0), (7, 1), (7, 2), (7, 3)]);
        assert_eq!(r.session_find(0, 7).unwrap().1.committed_hwm, 4);
    }

    #[test]
    fn a_gap_outliving_the_lease_fences_the_session_until_a_new_epoch() {
        let (_d, r) = session_region();
        let mut c = session_core(&r, Duration::from_millis(1));
        commit_session(&r, 0, 0, 7, 1, 0);
        commit_session(&r, 1, 0, 7, 1, 2); // seq 1 was lost
        c.scan();
        c.seal_all();
        std::thread::sleep(Duration::from_millis(5));
        c.scan();
        c.seal_all();
        let (_, rec) = r.session_find(0, 7).unwrap();
        assert_eq!(rec.state, embarcadero_region::SessionState::Fenced);
        assert_eq!(rec.committed_hwm, 1);
        assert_eq!(
            r.log(0, 1).ordered_pbr.load(Ordering::Acquire),
            1,
            "held batch dropped"
        );
        // Same epoch: refused. The client reopens with epoch 2 and resubmits 1 and 2.
        commit_session(&r, 1, 1, 7, 1, 1);
        commit_session(&r, 0, 1, 7, 2, 2);
        commit_session(&r, 2, 0, 7, 2, 1);
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r), vec![(7, 0), (7, 1), (7, 2)]);
        let (_, rec) = r.session_find(0, 7).unwrap();
        assert_eq!(rec.state, embarcadero_region::SessionState::Open);
        assert_eq!((rec.session_epoch, rec.committed_hwm), (2, 3));
    }

    /// A region with room for more than a full session table of batches.
    pub(super) fn wide_session_region(replication_factor: u8) -> (tempfile::TempDir, Arc<Region>) {
        let dir = tempfile::tempdir().unwrap();
        let caps = Capacities {
            max_topics: 1,
            brokers: 1,
            goi_slots: 1024,
            pbr_slots: 1024,
            segment_bytes: 4096,
            segments_per_broker: 4,
            seg_map_slots: 8,
        };
        let r = Arc::new(Region::create(&dir.path().join("r"), caps).unwrap());
        r.write_topic_meta(
            0,
            &TopicMeta {
                replication_factor,
                ..TopicMeta::new("s", 5)
            },
        );
        (dir, r)
    }

    pub(super) const MINUTE_MS: u64 = 60_000;

    /// Fills the session table: client `c` (0..256) publishes its batch 0 at `at_ms`.
    pub(super) fn fill_session_table(r: &Arc<Region>, c: &mut Core, at_ms: u64) {
        sessions::test_clock::NOW_MS.set(Some(at_ms));
        for client in 0..SESSION_SLOTS as u64 {
            commit_session(r, 0, client, client, 1, 0);
        }
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(r).len(), SESSION_SLOTS as usize);
    }

    pub(super) fn idle_core(r: &Arc<Region>) -> Core {
        let config = SequencerConfig {
            session_idle_evict: Duration::from_secs(600),
            ..SequencerConfig::default()
        };
        let mut c = Core::new(r.clone(), config, Default::default());
        c.refresh_topics();
        c
    }

    #[test]
    fn a_full_table_gives_the_slot_of_the_longest_idle_session_to_a_new_one() {
        let (_d, r) = wide_session_region(1);
        let mut c = idle_core(&r);
        let t0 = 1_000 * MINUTE_MS;
        fill_session_table(&r, &mut c, t0);
        let (slot_of_5, _) = r.session_find(0, 5).unwrap();
        r.chain_marks(0)
            .session_durable_hwm(slot_of_5)
            .advance(77, Ordering::Release);
        // Eleven minutes on: every client but 5 is still connected (its broker keeps
        // its stamp fresh), or published a minute ago.
        let now = t0 + 11 * MINUTE_MS;
        for client in (0..SESSION_SLOTS as u64).filter(|&c| c != 5) {
            let (slot, _) = r.session_find(0, client).unwrap();
            let stamp = if client % 2 == 0 {
                now
            } else {
                now - MINUTE_MS
            };
            r.session_touch(0, slot, stamp);
        }
        sessions::test_clock::NOW_MS.set(Some(now));
        commit_session(&r, 0, 256, 1000, 1, 0);
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r).last(), Some(&(1000, 0)), "admitted");
        let (slot, rec) = r.session_find(0, 1000).unwrap();
        assert_eq!(slot, slot_of_5, "the idle session's slot");
        assert_eq!((rec.committed_hwm, rec.last_active_ms), (1, now));
        assert_eq!(
            r.session_durable_hwm(0, slot).load(Ordering::Acquire),
            0,
            "the previous holder's durable mark does not carry over"
        );
        assert!(r.session_find(0, 5).is_none(), "session 5 ended");
        assert_eq!(c.metrics.sessions_evicted.load(Ordering::Relaxed), 1);

        // No other session has been idle ten minutes: the next new one finds no slot,
        // and its batch is dropped, not left holding the broker's frontier.
        commit_session(&r, 0, 257, 1001, 1, 0);
        c.scan();
        c.seal_all();
        assert!(r.session_find(0, 1001).is_none());
        assert_eq!(goi_sessions(&r).len(), SESSION_SLOTS as usize + 1);
        assert_eq!(r.log(0, 0).ordered_pbr.load(Ordering::Acquire), 258);

        // Client 5 comes back: a new session, from batch 0, in the slot of the session
        // idle longest by then.
        let later = now + 10 * MINUTE_MS + 1;
        sessions::test_clock::NOW_MS.set(Some(later));
        commit_session(&r, 0, 258, 5, 1, 0);
        c.scan();
        c.seal_all();
        assert_eq!(goi_sessions(&r).last(), Some(&(5, 0)));
        assert_eq!(r.session_find(0, 5).unwrap().1.committed_hwm, 1);
        let ended: Vec<u64> = (0..SESSION_SLOTS as u64)
            .filter(|&c| r.session_find(0, c).is_none())
            .collect();
        assert_eq!(ended.len(), 1, "{ended:?}");
        assert_eq!(ended[0] % 2, 1, "one stamped a minute before the others");

        // A restarted sequencer keeps ended sessions ended, though their batches are
        // still in the GOI ring.
        drop(c);
        let c = idle_core(&r);
        let table: std::collections::HashSet<u64> = (0..SESSION_SLOTS)
            .filter_map(|s| r.session_read(0, s).map(|rec| rec.client_id))
            .collect();
        assert_eq!(table.len(), SESSION_SLOTS as usize);
        assert!(table.contains(&1000) && table.contains(&5));
        drop(c);
        sessions::test_clock::NOW_MS.set(None);
    }

    #[test]
    fn a_session_keeps_its_slot_until_the_disk_replicas_have_its_batches() {
        let (_d, r) = wide_session_region(2);
        let mut c = idle_core(&r);
        let t0 = 1_000 * MINUTE_MS;
        fill_session_table(&r, &mut c, t0);
        sessions::test_clock::NOW_MS.set(Some(t0 + 60 * MINUTE_MS));
        commit_session(&r, 0, 256, 1000, 1, 0);
        c.scan();
        c.seal_all();
        assert!(
            r.session_find(0, 1000).is_none(),
            "every session idle an hour, but none of their batches is on the replica"
        );
        // The replica catches up with all but the last session's batch.
        let replica = r.replica_line(0, 1);
        replica.durable_seq.advance(255, Ordering::Release);
        commit_session(&r, 0, 257, 1000, 1, 0);
        c.scan();
        c.seal_all();
        let (slot, _) = r.session_find(0, 1000).unwrap();
        assert!(
            r.session_find(0, 255).is_some(),
            "its batch is not durable yet"
        );
        assert_ne!(slot, r.session_find(0, 255).unwrap().0);
        assert_eq!(c.metrics.sessions_evicted.load(Ordering::Relaxed), 1);
        sessions::test_clock::NOW_MS.set(None);
    }

    #[test]
    fn a_clock_jump_does_not_end_a_session_with_a_batch_waiting_for_its_epoch() {
        let (_d, r) = wide_session_region(1);
        let mut c = idle_core(&r);
        let t0 = 1_000 * MINUTE_MS;
        fill_session_table(&r, &mut c, t0);
        // Client 7's next batch is admitted, then the clock jumps an hour before the
        // epoch is sealed. Every other session is connected.
        commit_session(&r, 0, 256, 7, 1, 1);
        c.scan();
        let later = t0 + 60 * MINUTE_MS;
        for client in (0..SESSION_SLOTS as u64).filter(|&c| c != 7) {
            let (slot, _) = r.session_find(0, client).unwrap();
            r.session_touch(0, slot, later);
        }
        sessions::test_clock::NOW_MS.set(Some(later));
        commit_session(&r, 0, 257, 1000, 1, 0);
        c.scan();
        c.seal_all();
        assert!(r.session_find(0, 1000).is_none(), "no session could end");
        assert_eq!(r.session_find(0, 7).unwrap().1.committed_hwm, 2);
        assert_eq!(goi_sessions(&r).last(), Some(&(7, 1)));
        sessions::test_clock::NOW_MS.set(None);
    }

    /// Client 5's session ends while idle and the id comes back with a new session: a
    /// restarted sequencer gives the new session its own marks, not the ended one's
    /// (whose batches are still in the GOI ring, with higher sequence numbers), both
    /// before the new session has committed anything and after.
    #[test]
    fn a_restarted_sequencer_keeps_a_returning_client_ids_new_session_apart() {
        let (_d, r) = wide_session_region(1);
        let mut c = idle_core(&r);
        let t0 = 1_000 * MINUTE_MS;
        fill_session_table(&r, &mut c, t0);
        for seq in 1..10 {
            commit_session(&r, 0, 255 + seq, 5, 1, seq);
        }
        c.scan();
        c.seal_all();
        assert_eq!(r.session_find(0, 5).unwrap().1.committed_hwm, 10);
        // Eleven minutes on, everyone but 5 connected: 1000 takes 5's slot.
        let now = t0 + 11 * MINUTE_MS;
        let touch_all_but = |idle: u64, at: u64| {
            for slot in 0..SESSION_SLOTS {
                let rec = r.session_read(0, slot).unwrap();
                if rec.client_id != idle {
                    r.session_touch(0, slot, at);
                }
            }
        };
        touch_all_but(5, now);
        sessions::test_clock::NOW_MS.set(Some(now));
        commit_session(&r, 0, 265, 1000, 1, 0);
        c.scan();
        c.seal_all();
        assert!(r.session_find(0, 5).is_none());
        // Later client 5 comes back, starting over from batch 0, in client 6's slot.
        let later = now + 11 * MINUTE_MS;
        touch_all_but(6, later);
        sessions::test_clock::NOW_MS.set(Some(later));
        commit_session(&r, 0, 266, 5, 1, 0);
        c.scan();
        // The sequencer stops before the epoch is sealed; a successor takes over.
        drop(c);
        let mut c = idle_core(&r);
        c.scan();
        c.seal_all();
        assert_eq!(
            goi_sessions(&r).last(),
            Some(&(5, 0)),
            "not taken for a duplicate"
        );
        assert_eq!(r.session_find(0, 5).unwrap().1.committed_hwm, 1);
        commit_session(&r, 0, 267, 5, 1, 1);
        c.scan();
        c.seal_all();
        drop(c);
        let mut c = idle_core(&r);
        c.scan();
        c.seal_all();
        assert_eq!(r.session_find(0, 5).unwrap().1.committed_hwm, 2);
        let g = goi_sessions(&r).iter().position(|x| *x == (5, 0)).unwrap() as u64;
        assert_eq!(
            r.goi_read(0, g).unwrap().flags,
            GOI_SESSION_START,
            "the new session's first batch marks its start for the disk replicas' fold"
        );
        sessions::test_clock::NOW_MS.set(None);
    }
}
