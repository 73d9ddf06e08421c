//! Replica workers: one thread per replica directory. Replica `r` (1-based) copies every
//! topic whose replication factor exceeds `r`.
//!
//! Per topic and pass, a worker:
//! 1. snapshots each broker's `ordered_pbr`, then the topic's `committed_seq` (the
//!    sequencer stores them in the opposite order, so every valid PBR slot below the
//!    snapshot is in a GOI entry below the snapshot's `committed_seq`; order 5 excepts
//!    resends dropped as duplicates, which are never ordered from their own slot and
//!    whose acknowledgement follows the session table, not `durable_pbr`);
//! 2. appends the GOI entries it has not copied yet (payload straight from the region
//!    into the page cache) up to `group_commit_bytes`;
//! 3. `fdatasync`s once for all of them (group commit) when the pass filled its byte
//!    budget or caught up and `group_commit_wait` has passed since the oldest unsynced
//!    record. The fsync runs on the worker's sync thread while the worker copies the
//!    next group (at most one group ahead, one sync in flight per topic), so the page
//!    cache copy and the device write overlap instead of taking turns;
//! 4. publishes its chain token: `durable_seq = min(own durable, previous replica's
//!    durable_seq)`. The last replica's token is the topic's durable frontier; it then
//!    raises the order-5 sessions' `durable_hwm`, and each broker's `durable_pbr` to the
//!    oldest snapshot the frontier covers, and wakes the brokers to send ack-2 acks.
//!
//! Nothing is acknowledged at level 2 before the fsync that covers it: `durable_pbr`
//! only moves after step 3 succeeded on every replica. A failed write or sync rewinds
//! the store to its last good sync and retries later; meanwhile nothing becomes durable,
//! so memory is not reclaimed either and publishers get backpressure, never loss.

use crate::record::RecordHeader;
use crate::session_slots::SessionSlots;
use crate::store::{ExpiredSegments, PendingSync, TopicStore};
use crate::topic_dir;
use embarcadero_region::backoff::Backoff;
use embarcadero_region::{Region, TopicMeta};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct ReplicationConfig {
    /// Directory of replica `r` is `dirs[r - 1]`; a topic may have at most
    /// `dirs.len() + 1` copies.
    pub dirs: Vec<PathBuf>,
    /// Disk segment size: a segment is closed (and becomes deletable by retention) once
    /// it holds this many bytes.
    pub segment_bytes: u64,
    /// Most bytes copied before an fsync.
    pub group_commit_bytes: u64,
    /// Once caught up, wait this long for more batches before an fsync (0: sync at once).
    pub group_commit_wait: Duration,
    /// Longest sleep of an idle worker.
    pub idle_sleep_max: Duration,
    /// After a disk error, try again after this long.
    pub retry_after_error: Duration,
    /// Fault injection: every replica write fails with ENOSPC while this file exists.
    pub fault_flag: Option<PathBuf>,
    /// Fault injection: every fdatasync waits 100 ms first while this file exists.
    pub slow_disk_flag: Option<PathBuf>,
}

impl ReplicationConfig {
    pub fn new(dirs: Vec<PathBuf>) -> Self {
        Self {
            dirs,
            segment_bytes: 64 << 20,
            group_commit_bytes: 8 << 20,
            group_commit_wait: Duration::ZERO,
            idle_sleep_max: Duration::from_millis(20),
            retry_after_error: Duration::from_millis(500),
            fault_flag: None,
            slow_disk_flag: None,
        }
    }
}

/// Upper bounds of the fsync latency histogram buckets, in microseconds.
pub const FSYNC_BUCKETS_US: [u64; 12] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
];

/// Counters of one replica, exported on `/metrics`.
#[derive(Debug, Default)]
pub struct ReplicaMetrics {
    pub bytes_written: AtomicU64,
    pub batches_written: AtomicU64,
    pub syncs: AtomicU64,
    pub disk_errors: AtomicU64,
    pub segments_removed: AtomicU64,
    /// Cumulative fsync counts per bucket of [`FSYNC_BUCKETS_US`] (the last is +Inf).
    pub fsync_buckets: [AtomicU64; FSYNC_BUCKETS_US.len() + 1],
    pub fsync_nanos: AtomicU64,
}

impl ReplicaMetrics {
    fn record_sync(&self, took: Duration) {
        let us = took.as_micros() as u64;
        let bucket = FSYNC_BUCKETS_US.partition_point(|b| *b < us);
        self.fsync_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.fsync_nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        self.syncs.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
pub struct ReplicationMetrics {
    /// Index `r - 1` for replica `r`.
    pub replicas: Vec<ReplicaMetrics>,
}

/// The running replica workers. Dropping them stops them.
pub struct Replicas {
    shutdown: Arc<AtomicBool>,
    region: Arc<Region>,
    metrics: Arc<ReplicationMetrics>,
    threads: Vec<JoinHandle<()>>,
}

impl Replicas {
    /// Starts one worker per replica directory. `stores` holds logs already opened by
    /// recovery, keyed by (topic slot, replica); the others are opened on first use.
    pub fn start(
        region: Arc<Region>,
        config: ReplicationConfig,
        mut stores: HashMap<(u32, u32), TopicStore>,
    ) -> std::io::Result<Self> {
        let shutdown = Arc::new(AtomicBool::new(false));
        let metrics = Arc::new(ReplicationMetrics {
            replicas: config
                .dirs
                .iter()
                .map(|_| ReplicaMetrics::default())
                .collect(),
        });
        let mut threads = Vec::new();
        for replica in 1..=config.dirs.len() as u32 {
            let mine: HashMap<u32, TopicStore> = stores
                .extract_if(|(_, r), _| *r == replica)
                .map(|((topic, _), store)| (topic, store))
                .collect();
            let (syncer, jobs) = mpsc::channel();
            let sync_region = region.clone();
            let sync_thread = std::thread::Builder::new()
                .name(format!("replica{replica}-sync"))
                .spawn(move || run_syncer(jobs, sync_region))?;
            let (retirer, expired) = mpsc::channel();
            let retention_metrics = metrics.clone();
            let retention_thread = std::thread::Builder::new()
                .name(format!("replica{replica}-retention"))
                .spawn(move || run_retention(expired, replica, retention_metrics))?;
            let mut worker = Worker {
                replica,
                region: region.clone(),
                config: config.clone(),
                metrics: metrics.clone(),
                preopened: mine,
                topics: Vec::new(),
                open_failed: HashMap::new(),
                syncer,
                retirer,
                retention_gone: std::cell::Cell::new(false),
            };
            let stop = shutdown.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("replica{replica}"))
                    .spawn(move || {
                        worker.run(&stop);
                        // Dropping the worker closes the job channels: the sync and
                        // retention threads end.
                        drop(worker);
                        let _ = sync_thread.join();
                        let _ = retention_thread.join();
                    })?,
            );
        }
        assert!(
            stores.is_empty(),
            "recovery opened logs of replicas without a directory: {:?}",
            stores.keys().collect::<Vec<_>>()
        );
        Ok(Self {
            shutdown,
            region,
            metrics,
            threads,
        })
    }

    pub fn metrics(&self) -> Arc<ReplicationMetrics> {
        self.metrics.clone()
    }

    pub fn stop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        self.region.replication_bell().ring();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Replicas {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One topic as one replica copies it.
struct TopicCopy {
    topic: u32,
    meta: TopicMeta,
    store: TopicStore,
    /// Bytes appended since the last sync began.
    unsynced_bytes: u64,
    unsynced_since: Option<Instant>,
    /// The sync in flight on the sync thread, if any.
    syncing: Option<mpsc::Receiver<SyncDone>>,
    /// `durable_seq` last published (the chain token).
    published: u64,
    /// Last replica only: (committed_seq, ordered_pbr per broker) snapshots not yet
    /// covered by the durable frontier.
    snapshots: VecDeque<(u64, Vec<u64>)>,
    /// Last replica, order 5: GOI entries below this have raised their session's
    /// `durable_hwm`.
    sessions_done: u64,
    session_slots: SessionSlots,
    failing_since: Option<Instant>,
    retry_at: Option<Instant>,
    next_retention: Instant,
}

const TOPIC_REFRESH: Duration = Duration::from_millis(20);
const RETENTION_EVERY: Duration = Duration::from_secs(1);

struct Worker {
    replica: u32,
    region: Arc<Region>,
    config: ReplicationConfig,
    metrics: Arc<ReplicationMetrics>,
    preopened: HashMap<u32, TopicStore>,
    topics: Vec<TopicCopy>,
    /// Topics whose store could not be opened, and when to try again.
    open_failed: HashMap<u32, Instant>,
    /// Jobs for this replica's sync thread.
    syncer: mpsc::Sender<SyncJob>,
    /// Segments for this replica's retention thread to delete, with their topic's name.
    retirer: mpsc::Sender<(String, ExpiredSegments)>,
    /// The retention thread was found gone (reported once).
    retention_gone: std::cell::Cell<bool>,
}

/// A sync for the sync thread, and where to report its outcome.
struct SyncJob {
    pending: PendingSync,
    done: mpsc::Sender<SyncDone>,
}

struct SyncDone {
    pending: PendingSync,
    result: std::io::Result<()>,
    took: Duration,
}

/// Runs the fsyncs of one replica's topics in the order they were begun, then wakes
/// the worker.
fn run_syncer(jobs: mpsc::Receiver<SyncJob>, region: Arc<Region>) {
    for job in jobs {
        let started = Instant::now();
        let result = job.pending.run();
        let took = started.elapsed();
        let _ = job.done.send(SyncDone {
            pending: job.pending,
            result,
            took,
        });
        region.replication_bell().ring();
    }
}

/// Deletes the segment files retention took out of one replica's logs, off the worker
/// thread: a deletion takes tens of milliseconds (see `ExpiredSegments::remove`), and
/// on the worker nothing would be copied meanwhile.
fn run_retention(
    expired: mpsc::Receiver<(String, ExpiredSegments)>,
    replica: u32,
    metrics: Arc<ReplicationMetrics>,
) {
    // Per log, segments a failed deletion left: they go before any newer ones.
    let mut left: HashMap<PathBuf, ExpiredSegments> = HashMap::new();
    for (topic, newer) in expired {
        let mut segments = match left.remove(newer.dir()) {
            Some(mut older) => {
                older.extend(newer);
                older
            }
            None => newer,
        };
        let before = segments.len();
        let result = segments.remove();
        let removed = before - segments.len();
        metrics.replicas[replica as usize - 1]
            .segments_removed
            .fetch_add(removed as u64, Ordering::Relaxed);
        match result {
            Ok(()) => {
                tracing::debug!(replica, topic = %topic, removed, "retention removed old segments")
            }
            Err(e) => tracing::warn!(
                replica,
                topic = %topic,
                "retention could not remove a segment: {e} (tried again with the next ones)"
            ),
        }
        if !segments.is_empty() {
            left.insert(segments.dir().to_path_buf(), segments);
        }
    }
}

impl Worker {
    fn run(&mut self, shutdown: &AtomicBool) {
        let region = self.region.clone();
        let bell = region.replication_bell();
        let mut backoff = Backoff::new(self.config.idle_sleep_max);
        let mut last_refresh = Instant::now() - TOPIC_REFRESH;
        while !shutdown.load(Ordering::Relaxed) {
            let seen = bell.seen();
            if last_refresh.elapsed() >= TOPIC_REFRESH {
                self.refresh_topics();
                last_refresh = Instant::now();
            }
            let mut progress = false;
            let mut wake_at: Option<Instant> = None;
            let mut topics = std::mem::take(&mut self.topics);
            for t in &mut topics {
                progress |= self.pass(t);
                // With a sync in flight the sync thread's bell wakes the worker.
                if let (Some(since), None) = (t.unsynced_since, &t.syncing) {
                    let at = since + self.config.group_commit_wait;
                    wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
                }
            }
            self.topics = topics;
            if progress {
                backoff.reset();
            } else if let Some(at) = wake_at {
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
            } else {
                backoff.idle(Some((&bell, seen)));
            }
        }
        // A clean stop leaves nothing unsynced behind.
        let mut topics = std::mem::take(&mut self.topics);
        for t in &mut topics {
            match t.syncing.take().map(|rx| rx.recv()) {
                Some(Ok(done)) => {
                    let _ = t.store.finish_sync(done.pending, done.result);
                }
                // The sync thread died with the job: nothing it covered counts.
                Some(Err(_)) => t.store.sync_lost(),
                None => {}
            }
            if t.unsynced_bytes > 0 {
                let _ = t.store.sync();
            }
        }
    }

    /// Starts copying topics created since the last look, and removes deleted ones.
    fn refresh_topics(&mut self) {
        self.remove_deleted();
        let caps = self.region.capacities();
        for topic in 0..caps.max_topics {
            let Some(meta) = self.region.topic_meta(topic) else {
                continue;
            };
            if meta.order < 2 || (meta.replication_factor as u32) <= self.replica {
                continue;
            }
            if self.topics.iter().any(|t| t.topic == topic) {
                continue;
            }
            if self
                .open_failed
                .get(&topic)
                .is_some_and(|at| Instant::now() < *at)
            {
                continue;
            }
            let store = match self.preopened.remove(&topic) {
                Some(s) => Ok(s),
                None => {
                    let dir = topic_dir(
                        &self.config.dirs[self.replica as usize - 1],
                        &meta.name,
                        meta.created_unix_ms,
                    );
                    TopicStore::open(&dir, self.config.segment_bytes)
                }
            };
            let mut store = match store {
                Ok(s) => s,
                Err(e) => {
                    self.note_open_failure(topic, &meta, &e);
                    continue;
                }
            };
            if self.open_failed.remove(&topic).is_some() {
                self.region
                    .replica_line(topic, self.replica)
                    .error
                    .store(0, Ordering::Release);
                tracing::info!(replica = self.replica, topic = %meta.name, "the replica log opened");
            }
            store.set_fault_flag(self.config.fault_flag.clone());
            store.set_slow_disk_flag(self.config.slow_disk_flag.clone());
            let progress = self.region.replica(topic, self.replica);
            let durable = store.durable_seq();
            self.region
                .replica_line(topic, self.replica)
                .reopen_own_durable_seq(durable);
            let published = progress.durable_seq.load(Ordering::Acquire);
            self.topics.push(TopicCopy {
                topic,
                store,
                unsynced_bytes: 0,
                unsynced_since: None,
                syncing: None,
                published,
                snapshots: VecDeque::new(),
                sessions_done: published,
                session_slots: SessionSlots::default(),
                failing_since: None,
                retry_at: None,
                next_retention: Instant::now(),
                meta,
            });
        }
    }

    /// Stops copying deleted topics and removes their replica logs (this worker owns
    /// the files; a deleted topic's slot is never reused in this region, so what it
    /// copied meanwhile is only more of what is removed). A sync in flight is waited for
    /// first, so the sync thread holds no file of the directory.
    fn remove_deleted(&mut self) {
        let region = self.region.clone();
        let (deleted, kept) = std::mem::take(&mut self.topics)
            .into_iter()
            .partition(|t| region.topic_deleted(t.topic));
        self.topics = kept;
        let mut dirs: Vec<(u32, PathBuf)> = Vec::new();
        for mut t in deleted {
            if let Some(rx) = t.syncing.take() {
                let _ = rx.recv();
            }
            dirs.push((t.topic, t.store.dir().to_path_buf()));
        }
        let preopened: Vec<u32> = self
            .preopened
            .keys()
            .copied()
            .filter(|topic| region.topic_deleted(*topic))
            .collect();
        for topic in preopened {
            if let Some(store) = self.preopened.remove(&topic) {
                dirs.push((topic, store.dir().to_path_buf()));
            }
        }
        for (topic, dir) in dirs {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    tracing::info!(replica = self.replica, topic, dir = %dir.display(), "removed the replica log of a deleted topic")
                }
                Err(e) => {
                    tracing::warn!(replica = self.replica, topic, dir = %dir.display(), "cannot remove the replica log of a deleted topic: {e}; remove it by hand")
                }
            }
        }
    }

    fn is_last(&self, t: &TopicCopy) -> bool {
        self.replica + 1 == t.meta.replication_factor as u32
    }

    /// One pass over one topic; returns whether anything moved.
    fn pass(&self, t: &mut TopicCopy) -> bool {
        let now = Instant::now();
        if t.retry_at.is_some_and(|at| now < at) {
            return false;
        }
        let mut progress = match self.collect_sync(t) {
            Ok(finished) => finished,
            Err(e) => {
                self.on_disk_error(t, &e);
                return true;
            }
        };
        let committed = self.snapshot(t);
        match self.copy_group(t, committed, now) {
            Ok(copied) => progress |= copied,
            Err(e) => {
                self.on_disk_error(t, &e);
                return true;
            }
        }
        progress |= self.sync_if_due(t, committed);
        progress |= self.advance_chain(t);
        if now >= t.next_retention {
            t.next_retention = now + RETENTION_EVERY;
            self.apply_retention(t);
        }
        progress
    }

    /// Applies the sync in flight if it finished; returns whether one did. A failed
    /// sync, or a sync thread found gone, is a disk error.
    fn collect_sync(&self, t: &mut TopicCopy) -> std::io::Result<bool> {
        let Some(rx) = &t.syncing else {
            return Ok(false);
        };
        match rx.try_recv() {
            Ok(done) => {
                t.syncing = None;
                self.finish_sync(t, done)?;
                Ok(true)
            }
            Err(mpsc::TryRecvError::Empty) => Ok(false),
            Err(mpsc::TryRecvError::Disconnected) => {
                t.syncing = None;
                t.store.sync_lost();
                Err(std::io::Error::other("the replica sync thread is gone"))
            }
        }
    }

    /// Step 1: snapshots each broker's `ordered_pbr` (last replica only), then the
    /// topic's `committed_seq`, which it returns.
    fn snapshot(&self, t: &mut TopicCopy) -> u64 {
        let region = &self.region;
        let last = self.is_last(t);
        let ordered: Vec<u64> = if last {
            (0..region.capacities().brokers)
                .map(|b| region.log(t.topic, b).ordered_pbr.load(Ordering::Acquire))
                .collect()
        } else {
            Vec::new()
        };
        let committed = region
            .topic_seq(t.topic)
            .committed_seq
            .load(Ordering::Acquire);
        if let Some((c, o)) = t.snapshots.back() {
            assert!(
                *c <= committed && o.iter().zip(&ordered).all(|(before, now)| before <= now),
                "committed_seq and ordered_pbr never go backwards"
            );
        }
        if last
            && t.snapshots
                .back()
                .is_none_or(|(c, o)| *c != committed || *o != ordered)
        {
            t.snapshots.push_back((committed, ordered));
        }
        committed
    }

    /// Step 2: appends the GOI entries not copied yet, below `committed`, up to the
    /// group's byte budget; returns whether it copied any.
    fn copy_group(&self, t: &mut TopicCopy, committed: u64, now: Instant) -> std::io::Result<bool> {
        let region = &self.region;
        let metrics = &self.metrics.replicas[self.replica as usize - 1];
        let budget = self.config.group_commit_bytes;
        // The log on disk never runs ahead of the committed GOI: entries are copied only
        // below `committed_seq`, and recovery seeds the GOI where the logs end.
        assert!(
            t.store.next_seq() <= committed,
            "replica {} of topic {} holds records up to {}, beyond the committed GOI ({committed})",
            self.replica,
            t.topic,
            t.store.next_seq()
        );
        let mut copied = 0u64;
        let mut result = Ok(());
        // At most one group ahead of the sync in flight; a full segment waits for the
        // sync that closes it.
        while t.store.next_seq() < committed && t.unsynced_bytes < budget && !t.store.is_full() {
            let g = t.store.next_seq();
            // Below `committed_seq` the entry is written, and it stays until this
            // replica has it on disk: the sequencer reuses a GOI slot only once its
            // batch is reclaimed, which waits for every replica (`durable_pbr`).
            let e = region.goi_read(t.topic, g).unwrap_or_else(|| {
                panic!(
                    "GOI entry {g} of topic {} vanished before replica {} copied it",
                    t.topic, self.replica
                )
            });
            // SAFETY: the batch cannot be reclaimed while we read it: reclamation of a
            // replicated topic waits for `durable_pbr`, which only moves once every
            // replica, this one included, has this entry on disk.
            let payload = unsafe {
                region.blog_bytes(
                    t.topic,
                    e.broker_id as u32,
                    e.blog_offset,
                    e.payload_size as u64,
                )
            };
            // The sequencer copies a batch's place from the PBR slot its broker wrote
            // after reserving it in its own log.
            let payload = payload.unwrap_or_else(|| {
                panic!(
                    "GOI entry {g} of topic {} points outside broker {}'s log",
                    t.topic, e.broker_id
                )
            });
            let h = RecordHeader::of(g, &e, payload);
            if let Err(err) = t.store.append(&h, payload) {
                result = Err(err);
                break;
            }
            copied += h.record_len();
            t.unsynced_bytes += h.record_len();
            metrics.batches_written.fetch_add(1, Ordering::Relaxed);
        }
        if copied > 0 {
            metrics.bytes_written.fetch_add(copied, Ordering::Relaxed);
            t.unsynced_since.get_or_insert(now);
        }
        result.map(|()| copied > 0)
    }

    /// Step 3: begins the group commit on the sync thread when it is due (the group
    /// filled its budget or a segment, or the copy caught up with `committed` and the
    /// oldest unsynced record waited `group_commit_wait`); returns whether it did.
    fn sync_if_due(&self, t: &mut TopicCopy, committed: u64) -> bool {
        let caught_up = t.store.next_seq() >= committed;
        let due = t.syncing.is_none()
            && t.unsynced_bytes > 0
            && (t.unsynced_bytes >= self.config.group_commit_bytes
                || t.store.is_full()
                || (caught_up
                    && t.unsynced_since
                        .is_some_and(|s| s.elapsed() >= self.config.group_commit_wait)));
        if !due {
            return false;
        }
        let (done, syncing) = mpsc::channel();
        let job = SyncJob {
            pending: t.store.begin_sync(),
            done,
        };
        if let Err(mpsc::SendError(job)) = self.syncer.send(job) {
            // The sync thread is gone (it panicked): sync here instead.
            let started = Instant::now();
            let result = job.pending.run();
            let _ = job.done.send(SyncDone {
                pending: job.pending,
                result,
                took: started.elapsed(),
            });
        }
        t.syncing = Some(syncing);
        t.unsynced_bytes = 0;
        t.unsynced_since = None;
        true
    }

    /// Applies a finished sync: what it covered is durable on this replica.
    fn finish_sync(&self, t: &mut TopicCopy, done: SyncDone) -> std::io::Result<()> {
        t.store.finish_sync(done.pending, done.result)?;
        self.metrics.replicas[self.replica as usize - 1].record_sync(done.took);
        let progress = self.region.replica_line(t.topic, self.replica);
        progress
            .own_durable_seq
            .advance(t.store.durable_seq(), Ordering::Release);
        if let Some(since) = t.failing_since.take() {
            progress.error.store(0, Ordering::Release);
            tracing::info!(
                replica = self.replica,
                topic = %t.meta.name,
                "replica disk writes work again after {:.1} s",
                since.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// A topic's replica log that cannot be opened: counted and shown as the replica's
    /// error (so `status` and the metrics say so, as for a failed write), said in the
    /// log with its directory, and tried again after `retry_after_error`.
    fn note_open_failure(&mut self, topic: u32, meta: &TopicMeta, e: &std::io::Error) {
        let metrics = &self.metrics.replicas[self.replica as usize - 1];
        metrics.disk_errors.fetch_add(1, Ordering::Relaxed);
        let code = e.raw_os_error().unwrap_or(libc::EIO) as u64;
        self.region
            .replica_line(topic, self.replica)
            .error
            .store(code, Ordering::Release);
        let dir = topic_dir(
            &self.config.dirs[self.replica as usize - 1],
            &meta.name,
            meta.created_unix_ms,
        );
        tracing::error!(
            replica = self.replica,
            topic = %meta.name,
            dir = %dir.display(),
            "cannot open the replica log: {e}; nothing of the topic becomes durable (acknowledgements at level 2 wait, and so do readers of a durable topic) until it can be opened: fix the directory (replication.dirs), retrying every {:?}",
            self.config.retry_after_error
        );
        self.open_failed
            .insert(topic, Instant::now() + self.config.retry_after_error);
    }

    fn on_disk_error(&self, t: &mut TopicCopy, e: &std::io::Error) {
        // The sync in flight finishes first: rewinding under it would truncate what it
        // may be about to report durable.
        match t.syncing.take().map(|rx| rx.recv()) {
            Some(Ok(done)) => {
                let _ = self.finish_sync(t, done);
            }
            Some(Err(_)) => t.store.sync_lost(),
            None => {}
        }
        let metrics = &self.metrics.replicas[self.replica as usize - 1];
        metrics.disk_errors.fetch_add(1, Ordering::Relaxed);
        let code = e.raw_os_error().unwrap_or(libc::EIO) as u64;
        self.region
            .replica_line(t.topic, self.replica)
            .error
            .store(code, Ordering::Release);
        if t.failing_since.is_none() {
            t.failing_since = Some(Instant::now());
            tracing::error!(
                replica = self.replica,
                topic = %t.meta.name,
                dir = %t.store.dir().display(),
                "cannot write the replica log: {e}; nothing new becomes durable (ack-2 publishers wait, memory fills and publishers get backpressure) until the disk recovers; free space or fix the disk, retrying every {:?}",
                self.config.retry_after_error
            );
        }
        if let Err(e) = t.store.rewind() {
            tracing::warn!(replica = self.replica, topic = %t.meta.name, "cannot rewind the replica log: {e}");
        }
        // Whatever the rewind's outcome, the next copy starts at the last good sync.
        assert_eq!(
            t.store.next_seq(),
            t.store.durable_seq(),
            "nothing unsynced survives a disk error"
        );
        t.unsynced_bytes = 0;
        t.unsynced_since = None;
        t.retry_at = Some(Instant::now() + self.config.retry_after_error);
    }

    /// Publishes the chain token and, on the last replica, what it makes durable.
    fn advance_chain(&self, t: &mut TopicCopy) -> bool {
        let region = &self.region;
        let own = t.store.durable_seq();
        let previous = match self.replica {
            1 => u64::MAX,
            r => region
                .replica(t.topic, r - 1)
                .durable_seq
                .load(Ordering::Acquire),
        };
        let mut chain = own.min(previous);
        // Both terms only grow (this replica's syncs finish in order, the previous
        // replica's token is monotonic): the chain token never goes back.
        assert!(
            chain >= t.published,
            "replica {} of topic {}: chain token {chain} below the published {}",
            self.replica,
            t.topic,
            t.published
        );
        let last = self.is_last(t);
        if last && t.meta.order == 5 && chain > t.published {
            chain = self.raise_session_hwms(t, chain);
        }
        let mut moved = false;
        if chain > t.published {
            self.publish_chain(t, chain, last);
            moved = true;
        }
        if last && self.apply_snapshots(t) {
            moved = true;
        }
        moved
    }

    /// Publishes `chain` (above the published token) as this replica's durable token,
    /// with the position its newest durable entry ends at, and wakes whoever waits for
    /// it: the next replica and, on the `last` one, the topic's subscribers.
    fn publish_chain(&self, t: &mut TopicCopy, chain: u64, last: bool) {
        let region = &self.region;
        let line = region.replica_line(t.topic, self.replica);
        // Entries at or above the last replica's frontier cannot be reclaimed
        // before it moves on, and it is at most this replica's published token, so
        // the newest durable one is still in the GOI.
        let e = region.goi_read(t.topic, chain - 1).unwrap_or_else(|| {
            panic!(
                "GOI entry {} of topic {} left the ring before replica {} published it durable",
                chain - 1,
                t.topic,
                self.replica
            )
        });
        let position = e.total_order + e.num_msg as u64;
        // The GOI and the log on disk agree on where the durable records end.
        assert!(
            chain != t.store.next_seq() || position == t.store.next_position(),
            "replica {} of topic {}: GOI entry {} ends at position {position}, the log at {}",
            self.replica,
            t.topic,
            chain - 1,
            t.store.next_position()
        );
        line.durable_position.advance(position, Ordering::Release);
        line.durable_seq.advance(chain, Ordering::Release);
        t.published = chain;
        region.replication_bell().ring();
        if last {
            // Subscribers of a replicated topic wait for the durable frontier.
            region.topic_bell(t.topic).ring();
        }
    }

    /// On the last replica: applies the snapshots of per-broker ordered positions that
    /// the published frontier now covers, waking the brokers if any durable position
    /// rose. Returns whether one did.
    fn apply_snapshots(&self, t: &mut TopicCopy) -> bool {
        let region = &self.region;
        // A snapshot may have been taken after the frontier already covered its
        // committed_seq (ordered_pbr moves after committed_seq): apply those too.
        let mut raised = false;
        while let Some((c, ordered)) = t.snapshots.front() {
            if *c > t.published {
                break;
            }
            let marks = region.chain_marks(t.topic);
            for (b, o) in ordered.iter().enumerate() {
                raised |= marks.durable_pbr(b as u32).raise(*o, Ordering::AcqRel) < *o;
            }
            t.snapshots.pop_front();
        }
        if raised {
            for b in 0..region.capacities().brokers {
                region.broker_bell(b).ring();
            }
        }
        raised
    }

    /// Order 5: raises `durable_hwm` of the sessions of GOI entries below `chain`;
    /// returns how far it got (a session the sequencer has not entered in its table
    /// yet is retried on the next pass).
    fn raise_session_hwms(&self, t: &mut TopicCopy, chain: u64) -> u64 {
        let region = &self.region;
        assert!(
            t.sessions_done >= t.published,
            "session marks are raised before the frontier that covers them is published"
        );
        while t.sessions_done < chain {
            let g = t.sessions_done;
            // At or above the published frontier (`sessions_done` starts there, and the
            // frontier moves only after this): not reclaimable yet, so still in the GOI.
            // A restart seeds the frontier at the new region's first entry.
            let e = region.goi_read(t.topic, g).unwrap_or_else(|| {
                panic!(
                    "GOI entry {g} of topic {} left the ring before its session's durable mark was raised",
                    t.topic
                )
            });
            if e.session_epoch > 0 {
                let Some(slot) = t.session_slots.find(region, t.topic, e.client_id) else {
                    break;
                };
                region
                    .chain_marks(t.topic)
                    .session_durable_hwm(slot)
                    .raise(e.client_seq + 1, Ordering::AcqRel);
            }
            t.sessions_done += 1;
        }
        t.sessions_done
    }

    fn apply_retention(&self, t: &mut TopicCopy) {
        let (bytes, ms) = match self.region.topic_meta(t.topic) {
            Some(m) => (m.retention_bytes, m.retention_ms),
            None => return,
        };
        if bytes == 0 && ms == 0 {
            return;
        }
        let age = (ms > 0).then(|| Duration::from_millis(ms));
        let expired = t.store.take_expired(bytes, age);
        if !expired.is_empty()
            && self.retirer.send((t.meta.name.clone(), expired)).is_err()
            && !self.retention_gone.replace(true)
        {
            // The retention thread is gone (it panicked) with segments older than these
            // still undeleted: deleting these would leave a hole in the log on disk.
            // They stay; the next start's retention removes them all, in order.
            tracing::error!(
                replica = self.replica,
                topic = %t.meta.name,
                "the retention thread is gone; old segments stay on disk until the next start"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::tests::write_log;
    use crate::store::{list_segments, TopicStore};

    /// A deletion that fails for the oldest segment must not go on with newer ones: the
    /// retention thread keeps them behind it, so the segments left on disk are still one
    /// contiguous log, which a start reads whole.
    #[test]
    fn a_failed_deletion_never_leaves_a_hole_in_the_log_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = write_log(dir.path(), 24);
        let before = list_segments(dir.path()).unwrap();
        assert!(before.len() >= 5, "{before:?}");
        // The oldest segment cannot be renamed: a directory holds its `.del` name.
        std::fs::create_dir(before[0].path.with_extension("del")).unwrap();
        let total = store.bytes();
        let older = store.take_expired(total - 1, None);
        let newer = store.take_expired(1, None);
        assert!(!older.is_empty() && !newer.is_empty());

        let metrics = Arc::new(ReplicationMetrics {
            replicas: vec![ReplicaMetrics::default()],
        });
        let (send, expired) = mpsc::channel();
        send.send(("t".to_string(), older)).unwrap();
        send.send(("t".to_string(), newer)).unwrap();
        drop(send);
        run_retention(expired, 1, metrics.clone());

        assert_eq!(
            list_segments(dir.path()).unwrap(),
            before,
            "nothing after the stuck segment was deleted"
        );
        assert_eq!(
            metrics.replicas[0].segments_removed.load(Ordering::Relaxed),
            0
        );
        drop(store);
        std::fs::remove_dir(before[0].path.with_extension("del")).unwrap();
        let reopened = TopicStore::open(dir.path(), 400).unwrap();
        assert_eq!((reopened.first_seq(), reopened.next_seq()), (0, 24));
    }
}
