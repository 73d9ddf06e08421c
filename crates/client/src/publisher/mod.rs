//! The publisher: messages are appended in their final wire form (64-byte header,
//! payload, padding) into a pooled batch buffer; sealed batches go round-robin to one
//! queue per connection, deflecting to the next queue when one is full and blocking
//! only when all are. Each connection has a sender thread (writes batches, resends on
//! BACKPRESSURE) and a reader thread (acks and errors).
//!
//! Its rooms: `batch` (building and sealing batches, the linger), `queue` (dispatch and
//! deflection over the connections' queues), `connection` (what a connection's two
//! threads share, opening it), `sender` and `reader` (those threads), `session` (order
//! 5: fences and reopening), `failover` (moving a dead broker's batches, following
//! membership), `stats` and `config`. This file holds the publisher's shared state
//! (`Inner`) and its public face.

use crate::admin::Admin;
use crate::conn::{self, Frame, Link};
use crate::shm::{Transport, Written};
use crate::{now_ns, Error, Result};
use crossbeam_channel::{Receiver, Select, Sender, TryRecvError, TrySendError};
use embarcadero_wire::{
    message_stride, BatchHeader, BlogMessageHeader, ErrorCode, Hello, HelloOk, Role,
    BATCH_HEADER_LEN, MESSAGE_HEADER_LEN, PUBLISH_OPENS_EPOCH, SESSION_KEY_LEN,
};
use hdrhistogram::Histogram;
use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::Serialize;
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod batch;
mod config;
mod connection;
mod failover;
mod lifecycle;
mod queue;
mod reader;
mod sender;
mod session;
mod stats;

use batch::*;
pub use config::PublisherConfig;
use config::*;
use connection::*;
use failover::*;
use lifecycle::Lifecycle;
use queue::*;
use reader::*;
use sender::*;
use session::*;
pub use stats::{LatencySummary, PublisherStats, QueueStats};

struct Inner {
    config: PublisherConfig,
    client_id: u64,
    max_message: usize,
    max_batch: usize,
    builder: Mutex<Builder>,
    /// Wakes the linger backstop at close.
    backstop_wake: Condvar,
    /// The open batch's linger deadline and the queue it is due on, for the senders to
    /// read without the builder's lock (see [`OpenBatch`]); 0: none open.
    open_batch: AtomicU64,
    /// Messages and payload bytes appended so far (the builder's counts): written only by
    /// the builder's holder, after each append, so they only grow; read by `stats` without
    /// the builder's lock, which a thread sealing may hold while it waits for room (an
    /// event loop asking for statistics must not wait with it).
    appended: [AtomicU64; 2],
    /// Where [`OpenBatch`] deadlines count from.
    created: Instant,
    /// The open batch's sender cannot take it (it waits at the in-flight limit): the
    /// backstop seals it at its linger deadline, not `linger_backstop` later.
    backstop_armed: AtomicBool,
    queues: Queues,
    pool: (Sender<Vec<u8>>, Receiver<Vec<u8>>),
    progress: (Mutex<()>, Condvar),
    closed: AtomicBool,
    /// Set once any connection failed, so `publish` checks one flag, not every connection.
    any_failed: AtomicBool,
    batches: AtomicU64,
    /// Seal indices of the batches not acknowledged yet (for ack 0: not written yet):
    /// its smallest entry is the acknowledged prefix. Numbered under this lock, so a
    /// sealed batch is never missing from it.
    outstanding: Mutex<BTreeSet<u64>>,
    next_batch_id: AtomicU64,
    topic: String,
    session: Option<Session>,
    slow_queue: Option<(usize, Duration)>,
    /// The topic's order level.
    order: u8,
    /// The head's control address, for failover questions.
    control: Option<String>,
    /// Failovers under way: `flush` is not done while batches are being moved.
    failovers: AtomicU64,
    /// Wakes the membership watcher before its next refresh (after a failover, at close).
    membership_wake: Sender<()>,
}

/// Publishes to one topic through every broker of a cluster.
pub struct Publisher {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
    /// The membership watcher; it returns the threads of the queues it added.
    membership: Option<JoinHandle<Vec<JoinHandle<()>>>>,
}

impl Publisher {
    /// Discovers the brokers from the control plane at `control` and connects.
    pub fn connect(control: &str, topic: &str, config: PublisherConfig) -> Result<Self> {
        // Before any request, and the same error however the publisher is made: the
        // topic's name and the settings alone (one broker assumed, no joins counted).
        crate::check_topic_name(topic)?;
        check_config(&config, 1, false)?;
        let admin = Admin::new(control);
        let cluster = admin.cluster()?;
        let mut config = config;
        if config.session_epoch == 0 && admin.describe_topic(topic).is_ok_and(|t| t.order == 5) {
            config.session_epoch = 1;
        }
        let brokers: Vec<(Option<BrokerProcess>, String)> = cluster
            .brokers
            .into_iter()
            .map(|b| {
                let process = BrokerProcess {
                    id: b.id,
                    incarnation: b.incarnation,
                };
                (Some(process), b.addr)
            })
            .collect();
        Self::start(&brokers, Some(control.to_string()), topic, config)
    }

    /// Connects to the given brokers directly (no failover: that needs the head).
    pub fn connect_brokers(
        brokers: &[String],
        topic: &str,
        config: PublisherConfig,
    ) -> Result<Self> {
        let brokers: Vec<(Option<BrokerProcess>, String)> =
            brokers.iter().map(|a| (None, a.clone())).collect();
        Self::start(&brokers, None, topic, config)
    }

    fn start(
        brokers: &[(Option<BrokerProcess>, String)],
        control: Option<String>,
        topic: &str,
        config: PublisherConfig,
    ) -> Result<Self> {
        crate::check_topic_name(topic)?;
        let room_for_joins = check_config(&config, brokers.len(), control.is_some())?;
        let watch_membership = control.is_some() && !config.membership_refresh.is_zero();
        let client_id = config.client_id.unwrap_or_else(crate::random_client_id);
        let mut config = config;
        if config.session_key.is_none() {
            config.session_key = Some(crate::random_session_key()?);
        }
        let opener = crate::random_opener()?;
        let connected;
        (connected, config.session_epoch) =
            connect_all(&config, (client_id, opener), topic, brokers)?;
        let found = Found::of(connected.iter().map(|(_, ok)| ok));
        let first_seqs: Vec<u64> = connected.iter().map(|(_, ok)| ok.next_batch_seq).collect();
        let queues = Queues::new(
            connected.into_iter().map(|(queue, _)| queue).collect(),
            room_for_joins,
        );
        // One pending wake is enough: the watcher reads the whole membership each time.
        let (membership_wake, membership_woken) = crossbeam_channel::bounded(1);
        let inner = Arc::new(Inner::new(
            config,
            (client_id, opener),
            topic,
            control,
            &found,
            queues,
            membership_wake,
        ));
        let mut threads = Vec::new();
        for (index, first_seq) in first_seqs.into_iter().enumerate() {
            start_connection(&inner, index, first_seq, 0, &mut threads)?;
        }
        let l = inner.clone();
        threads.push(spawn("pub-linger".into(), move || linger_backstop(l))?);
        let membership = if watch_membership {
            let w = inner.clone();
            Some(spawn("pub-members".into(), move || {
                follow_membership(w, membership_woken)
            })?)
        } else {
            None
        };
        Ok(Self {
            inner,
            threads,
            membership,
        })
    }

    pub fn client_id(&self) -> u64 {
        self.inner.client_id
    }

    /// Largest payload the brokers accept.
    pub fn max_message_bytes(&self) -> usize {
        self.inner.max_message
    }

    /// Appends one message. Returns once it is in a batch; see [`Publisher::flush`].
    pub fn publish(&self, payload: &[u8]) -> Result<()> {
        self.append(payload, None)
    }

    /// Appends `payloads` in order, together: one batch holds them all (and the broker
    /// appends them at once) unless they do not fit in one, where the batch is sealed
    /// between two of them as for single appends. For messages that belong together,
    /// such as a result and the claims it allows: one batch costs the brokers one append
    /// and each subscriber one delivery, where separate appends may take one each.
    /// Nothing is appended if any payload is too large (or the publisher is closed or
    /// failed).
    pub fn publish_all(&self, payloads: &[&[u8]]) -> Result<()> {
        self.append_all(payloads)
    }

    /// As [`Publisher::publish_all`], but never waits: appends the payloads in order until
    /// the next would have to wait (for room in a queue to seal a full batch into, or for
    /// a thread sealing one), and returns how many it appended. For a caller on an event
    /// loop, which hands the rest to a thread that may wait (the Node SDK). Nothing is
    /// appended if any payload is too large (or the publisher is closed or failed).
    pub fn try_publish_all(&self, payloads: &[&[u8]]) -> Result<usize> {
        self.try_append_all(payloads)
    }

    /// Like [`Publisher::publish`], for a message that was due at `due` (a load generator
    /// on a fixed schedule): its append-to-ack and end-to-end latencies are counted from
    /// `due` instead of from now, so time the caller spent behind its schedule (or
    /// blocked in here) is not left out. The linger still runs from the append.
    pub fn publish_due(&self, payload: &[u8], due: Instant) -> Result<()> {
        self.append(payload, Some(due))
    }

    /// Seals the open batch and waits until everything published so far is
    /// acknowledged at the configured level (for ack 0: written to the sockets).
    pub fn flush(&self) -> Result<()> {
        let inner = &self.inner;
        {
            let mut b = inner.builder.lock();
            if b.num_msg > 0 {
                inner.seal(&mut b)?;
            }
        }
        let deadline = Instant::now() + inner.config.flush_timeout;
        loop {
            inner.first_error()?;
            // A dead broker's batches count where the failover moved them, once moved.
            let done = inner.failovers.load(Ordering::Acquire) == 0
                && inner.queues.iter().all(|q| {
                    if !q.is_live() {
                        return q.life.moved_out();
                    }
                    let sent = q.conn.sent.load(Ordering::Acquire);
                    sent == q.dispatched.load(Ordering::Acquire)
                        && (inner.config.ack_level == 0
                            || q.conn.acked_batches.load(Ordering::Acquire) >= sent)
                });
            if done {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(inner.config.flush_timeout));
            }
            let mut g = inner.progress.0.lock();
            inner.progress.1.wait_for(&mut g, Duration::from_millis(20));
        }
    }

    /// Batches sealed so far.
    pub fn batches_sealed(&self) -> u64 {
        self.inner.batches.load(Ordering::Acquire)
    }

    /// The acknowledged prefix in seal order: every one of the first `acked_prefix()`
    /// batches this publisher sealed is acknowledged (for ack 0: written), wherever a
    /// failover moved it. Unlike a count of acknowledgements, it stops at the oldest
    /// batch still waiting, so it shows when a broker's death holds batches up.
    pub fn acked_prefix(&self) -> u64 {
        let outstanding = self.inner.outstanding.lock();
        outstanding
            .first()
            .copied()
            .unwrap_or_else(|| self.inner.batches.load(Ordering::Acquire))
    }

    /// Flushes, then closes every connection. On an order-5 topic, once everything is
    /// acknowledged, it also ends the session, so that the server can give its slot to a
    /// new session at once (a publisher dropped without `close`, or whose flush failed,
    /// holds its slot until the session has been idle for the server's
    /// `sequencer.session_idle_evict_secs`).
    pub fn close(mut self) -> Result<PublisherStats> {
        let flushed = self.flush();
        if flushed.is_ok() {
            self.inner.end_session();
        }
        let stats = self.stats();
        self.shutdown();
        flushed.map(|_| stats)
    }

    fn shutdown(&mut self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.backstop_wake.notify_all();
        let _ = self.inner.membership_wake.try_send(());
        // The watcher first: once it has stopped no queue is added, so every connection
        // is shut below and every thread joined.
        if let Some(watcher) = self.membership.take() {
            if let Ok(started) = watcher.join() {
                self.threads.extend(started);
            }
        }
        for q in self.inner.queues.iter() {
            let _ = q.stream.lock().shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Inner {
    fn first_error(&self) -> Result<()> {
        for q in self.queues.iter() {
            if let Some(e) = q.conn.failed.lock().clone() {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Waits (bounded) for `cond`, waking on progress notifications.
    fn wait_until(&self, limit: Duration, cond: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if cond() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || self.closed.load(Ordering::Relaxed) {
                return false;
            }
            let mut g = self.progress.0.lock();
            self.progress
                .1
                .wait_for(&mut g, (deadline - now).min(Duration::from_millis(10)));
        }
    }

    /// Records the first failure of a connection and wakes anyone waiting on it.
    fn fail(&self, conn: &ConnShared, error: Error) {
        {
            let mut f = conn.failed.lock();
            if f.is_none() {
                *f = Some(error);
            }
        }
        self.any_failed.store(true, Ordering::Release);
        self.notify_progress();
    }

    fn notify_progress(&self) {
        let _g = self.progress.0.lock();
        self.progress.1.notify_all();
    }

    /// Counts a batch as acknowledged without its ack passing through the queue (the
    /// ack overtook it, or a fence reported it committed) and recycles its buffer.
    fn settle(&self, conn: &ConnShared, f: InFlight) {
        self.acknowledged([f.batch.index]);
        conn.acked_batches.fetch_add(1, Ordering::Release);
        self.recycle(f.batch.buf);
    }

    /// Takes acknowledged batches (by seal index) out of the outstanding set.
    fn acknowledged(&self, indices: impl IntoIterator<Item = u64>) {
        let mut outstanding = self.outstanding.lock();
        for index in indices {
            outstanding.remove(&index);
        }
    }

    /// Queues sent batches for acknowledgement, settling at once any the broker already
    /// acknowledged: an ack can overtake the sender. `acked` is read under the queue lock,
    /// which is where the reader moves it.
    fn requeue(&self, conn: &ConnShared, batches: impl IntoIterator<Item = InFlight>) {
        let mut settled = Vec::new();
        {
            let mut unacked = conn.unacked.lock();
            let acked = conn.acked.load(Ordering::Acquire);
            for f in batches {
                if f.seq < acked {
                    settled.push(f);
                } else {
                    unacked.push_back(f);
                }
            }
        }
        // Acknowledged before this point: timed from now, which overstates them a little.
        conn.record_latency(&settled, Instant::now());
        for f in settled {
            self.settle(conn, f);
        }
    }

    /// A batch's bytes are no longer needed: a buffer goes back to the pool, a span
    /// back to its ring.
    fn recycle(&self, buf: Bytes) {
        if let Bytes::Heap(mut buf) = buf {
            buf.clear();
            let _ = self.pool.0.send(buf);
        }
    }
}

/// Refuses settings no publisher can run with; returns how many queues to reserve for
/// brokers that join later (0 when membership is not followed).
fn check_config(config: &PublisherConfig, brokers: usize, through_head: bool) -> Result<usize> {
    if config.ack_level > 2 {
        return Err(Error::Config(format!(
            "ack level {} does not exist; choose 0, 1 or 2",
            config.ack_level
        )));
    }
    let at_least_one = [
        (brokers, "brokers (the topic's server has none?)"),
        (config.threads_per_broker, "threads_per_broker"),
        (config.queue_depth, "queue_depth"),
        // None in flight would never send a batch: every flush would wait its timeout.
        (config.max_inflight_batches, "max_inflight_batches"),
    ];
    if let Some((_, what)) = at_least_one.iter().find(|(n, _)| *n == 0) {
        return Err(Error::Config(format!("{what} must be at least 1")));
    }
    if config.transport != Transport::Tcp {
        embarcadero_shm::layout::check_data_capacity(config.shm_ring_bytes as u64)
            .map_err(|e| Error::Config(format!("shm_ring_bytes: {e}")))?;
    }
    if !through_head || config.membership_refresh.is_zero() {
        return Ok(0);
    }
    config
        .max_joined_brokers
        .checked_mul(config.threads_per_broker)
        .filter(|&slots| slots <= MAX_JOINED_QUEUES)
        .ok_or_else(|| {
            Error::Config(format!(
                "max_joined_brokers x threads_per_broker is above {MAX_JOINED_QUEUES}"
            ))
        })
}

/// Opens every broker's connections at start. Order 5: as a new epoch of the session,
/// above the one the session is at, for a publisher never joins an epoch it did not
/// open (see [`PUBLISH_OPENS_EPOCH`]); the configured epoch is the least it opens.
/// Returns the queues with their HelloOks, and the epoch opened.
fn connect_all(
    config: &PublisherConfig,
    (client_id, opener): (u64, u32),
    topic: &str,
    brokers: &[(Option<BrokerProcess>, String)],
) -> Result<(Vec<(Queue, HelloOk)>, u64)> {
    let mut epoch = config.session_epoch;
    for _ in 0..=MAX_EPOCH_OPENS {
        let mut connected = Vec::new();
        let mut session_at = None;
        for (process, addr) in brokers {
            let session = SessionHello {
                epoch,
                opens: epoch > 0,
                opener,
            };
            match connect_broker(config, client_id, topic, session, *process, addr)? {
                Opened::Connected(queues) => connected.extend(queues),
                Opened::SessionAt(current) => {
                    session_at = Some(current);
                    break;
                }
            }
        }
        let Some(current) = session_at else {
            return Ok((connected, epoch));
        };
        assert!(
            current >= epoch,
            "a broker refuses only an epoch not above the session's"
        );
        // Dropping `connected` closes what opened: no batch went on them.
        epoch = current.saturating_add(1);
    }
    Err(Error::Broker {
        broker: brokers.first().map(|(_, a)| a.clone()).unwrap_or_default(),
        code: ErrorCode::SessionFenced,
        message: format!(
            "the order-5 session of client id {client_id} moved to a newer epoch at each of {} opens in a row: other publishers with this client id and session key are opening it too",
            MAX_EPOCH_OPENS + 1
        ),
    })
}

/// Opens of a new epoch that meet a newer one each time before giving up.
const MAX_EPOCH_OPENS: usize = 5;

/// What the brokers' HelloOks said, taken together: the order, where an order-5
/// session stands, and the limits every broker accepts.
struct Found {
    order: Option<u8>,
    session_start: u64,
    max_message: usize,
    max_batch: usize,
}

impl Found {
    fn of<'a>(oks: impl Iterator<Item = &'a HelloOk> + Clone) -> Self {
        Self {
            order: oks.clone().last().map(|ok| ok.order),
            session_start: oks.clone().map(|ok| ok.next_batch_seq).max().unwrap_or(0),
            max_message: oks
                .clone()
                .map(|ok| ok.max_message_bytes as usize)
                .min()
                .unwrap_or(u32::MAX as usize),
            max_batch: oks
                .map(|ok| ok.max_batch_bytes as usize)
                .min()
                .unwrap_or(u32::MAX as usize),
        }
    }
}

impl Inner {
    fn new(
        config: PublisherConfig,
        (client_id, opener): (u64, u32),
        topic: &str,
        control: Option<String>,
        found: &Found,
        queues: Queues,
        membership_wake: Sender<()>,
    ) -> Self {
        let batch_bytes = config
            .batch_bytes
            .clamp(MESSAGE_HEADER_LEN, found.max_batch);
        Inner {
            builder: Mutex::new(Builder::new(batch_bytes)),
            slow_queue: config.slow_queue.or_else(slow_queue_from_env),
            session: (found.order == Some(5)).then(|| Session {
                next_seq: AtomicU64::new(found.session_start),
                epoch: AtomicU64::new(config.session_epoch),
                fences: AtomicU64::new(0),
                // Every batch below the start is another publisher's (or an earlier
                // run's): none of this one's is acknowledged yet.
                fenced_hwm: AtomicU64::new(0),
                opened: AtomicU64::new(config.session_epoch),
                opener,
                own_id: config.client_id.is_none(),
            }),
            config: PublisherConfig {
                batch_bytes,
                // Instants past these would overflow; a backstop of 0 would spin.
                linger: config.linger.min(LONGEST_LINGER),
                linger_backstop: config
                    .linger_backstop
                    .clamp(Duration::from_micros(100), LONGEST_LINGER),
                ..config
            },
            client_id,
            max_message: found.max_message,
            max_batch: found.max_batch,
            backstop_wake: Condvar::new(),
            open_batch: AtomicU64::new(0),
            appended: [AtomicU64::new(0), AtomicU64::new(0)],
            created: Instant::now(),
            backstop_armed: AtomicBool::new(false),
            queues,
            pool: crossbeam_channel::unbounded(),
            progress: (Mutex::new(()), Condvar::new()),
            closed: AtomicBool::new(false),
            any_failed: AtomicBool::new(false),
            batches: AtomicU64::new(0),
            outstanding: Mutex::new(BTreeSet::new()),
            // Unique across publisher instances too (a restarted publisher may reuse its
            // client id): failover asks the head about batches by id.
            next_batch_id: AtomicU64::new(crate::random_client_id() << 32),
            topic: topic.to_string(),
            order: found.order.unwrap_or(2),
            control,
            failovers: AtomicU64::new(0),
            membership_wake,
        }
    }
}

/// Most queues a publisher reserves room for, beyond those of `connect`.
const MAX_JOINED_QUEUES: usize = 1 << 16;

fn spawn<T: Send + 'static>(
    name: String,
    body: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(body)
        .map_err(|e| Error::Config(format!("cannot spawn a thread: {e}")))
}
