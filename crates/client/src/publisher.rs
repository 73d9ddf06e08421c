//! The publisher: messages are appended in their final wire form (64-byte header,
//! payload, padding) into a pooled batch buffer; sealed batches go round-robin to one
//! queue per connection, deflecting to the next queue when one is full and blocking
//! only when all are. Each connection has a sender thread (writes batches, resends on
//! BACKPRESSURE) and a reader thread (acks and errors).

use crate::admin::Admin;
use crate::conn::{self, Frame};
use crate::{now_ns, Error, Result};
use crossbeam_channel::{Receiver, Select, Sender, TryRecvError, TrySendError};
use embarcadero_wire::{
    message_stride, BatchHeader, BlogMessageHeader, ErrorCode, Hello, HelloOk, Role,
    MESSAGE_HEADER_LEN, SESSION_KEY_LEN,
};
use hdrhistogram::Histogram;
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::io::{IoSlice, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// 0: fire and forget; 1: ordered/visible; 2: durable.
    pub ack_level: u8,
    /// A batch is sealed once it holds this many bytes of messages.
    pub batch_bytes: usize,
    /// A non-empty batch is sealed this long after its first message, by the sender of
    /// the queue it is due on, which then writes it itself (no hand-off to another
    /// thread). When that sender is busy (writing, or waiting for acknowledgements), a
    /// backstop thread seals it `linger_backstop` later still. Zero sets no timer: the
    /// sender seals the batch as soon as it is free, so the batch holds what was
    /// appended while that sender woke up or finished its previous write (the lowest
    /// latency; below saturation it makes more, smaller batches).
    pub linger: Duration,
    /// See `linger`. Default 5 ms.
    pub linger_backstop: Duration,
    /// Connections (and queues) per broker.
    pub threads_per_broker: usize,
    /// Sealed batches each queue holds before the producer deflects to the next.
    pub queue_depth: usize,
    /// Batches a connection may have unacknowledged before its sender waits.
    pub max_inflight_batches: usize,
    pub client_id: Option<u64>,
    /// Order 5: the session's secret key, presented in every hello of the session so no
    /// one else (a subscriber sees the client id and epoch) can publish as it. `None`:
    /// 16 random bytes drawn when the publisher starts. A program that restarts and
    /// resumes a session under the same `client_id` must pass the key it used before.
    pub session_key: Option<[u8; SESSION_KEY_LEN]>,
    /// Longest `flush` wait.
    pub flush_timeout: Duration,
    /// Order 5: the session epoch to open, 1 or more; 0 (no session) for other orders.
    /// [`Publisher::connect`] picks 1 for order-5 topics when this is 0.
    pub session_epoch: u64,
    /// Try the next queue when the round-robin one is full (default). Off: wait for the
    /// round-robin queue, as the original did (for experiments).
    pub deflect: bool,
    /// Fault injection for experiments: make queue `.0` sleep `.1` before each batch it
    /// sends. `EMBARCADERO_SLOW_CONSUMER_QUEUE` and `EMBARCADERO_SLOW_CONSUMER_MS` set it.
    pub slow_queue: Option<(usize, Duration)>,
    /// Orders 2 and 5, publishers made with [`Publisher::connect`]: when a broker's
    /// connection fails, stop using that broker and move its unacknowledged batches to
    /// the live ones, resending exactly those that did not make it into the order
    /// (the head says which). Off: a lost connection fails the publisher.
    pub failover: bool,
    /// Publishers made with [`Publisher::connect`]: how often to re-read the live brokers
    /// from the head (also right after a failover) and connect to every broker process
    /// that joined since (a restarted broker, a new one). Zero: only the brokers
    /// `connect` found.
    pub membership_refresh: Duration,
    /// At most this many brokers are added after `connect` (each restart counts once):
    /// the queues live in slots reserved at start. Past it the publisher stops watching
    /// membership and keeps publishing to the brokers it has.
    pub max_joined_brokers: usize,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            ack_level: 1,
            batch_bytes: 512 * 1024,
            linger: Duration::from_millis(1),
            linger_backstop: Duration::from_millis(5),
            threads_per_broker: 1,
            queue_depth: 4,
            max_inflight_batches: 16,
            client_id: None,
            session_key: None,
            flush_timeout: Duration::from_secs(60),
            session_epoch: 0,
            deflect: true,
            slow_queue: None,
            failover: true,
            membership_refresh: Duration::from_secs(1),
            max_joined_brokers: 64,
        }
    }
}

/// Per-queue counters, reported at the end of a run.
#[derive(Debug, Clone, Serialize)]
pub struct QueueStats {
    pub broker: String,
    pub connection: usize,
    pub batches: u64,
    /// Batches acknowledged on this connection (those a failover found in the order count
    /// on the dead broker's queue).
    pub acked_batches: u64,
    /// Batches round-robin chose for this queue that went elsewhere because it was full.
    pub deflected: u64,
    /// Times the producer blocked because every queue was full when this one was due.
    pub producer_waits: u64,
    pub backpressure_retries: u64,
    /// Batches this queue's sender sealed itself when their linger ran out.
    pub lingered: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PublisherStats {
    pub client_id: u64,
    pub messages: u64,
    pub bytes: u64,
    pub batches: u64,
    pub acked_batches: u64,
    /// Seal-to-acknowledgement latency of batches, microseconds.
    pub ack_latency_us: LatencySummary,
    /// From publish to acknowledgement, microseconds: includes the linger wait,
    /// queueing, the network and the ordering. One figure per message, from its due time,
    /// for batches whose messages all came through [`Publisher::publish_due`]; otherwise
    /// one per batch, from its first message's publish (an upper bound for the rest,
    /// which saves a clock read per message).
    pub append_to_ack_us: LatencySummary,
    pub queues: Vec<QueueStats>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

impl LatencySummary {
    pub fn of(h: &Histogram<u64>) -> Self {
        Self {
            count: h.len(),
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        }
    }
}

struct Sealed {
    /// Order 5: the session sequence, assigned at seal; otherwise the sender numbers
    /// batches per connection.
    seq: Option<u64>,
    buf: Vec<u8>,
    num_msg: u32,
    sealed_at: Instant,
    /// When the batch's first message was published (its due time, if it was published
    /// with [`Publisher::publish_due`]): the start of its append-to-ack latency.
    first_at: Instant,
    /// Each message's due time, when every message was published with
    /// [`Publisher::publish_due`]: each message's append-to-ack latency runs from its own
    /// due time, as the peers' load generators count it. Empty otherwise.
    dues: Vec<Instant>,
    batch_id: u64,
    /// Position in seal order (0 for the first batch this publisher sealed).
    index: u64,
}

struct InFlight {
    seq: u64,
    batch: Sealed,
}

/// State of one connection shared by its sender and reader threads (never by others).
struct ConnShared {
    unacked: Mutex<VecDeque<InFlight>>,
    sent: AtomicU64,
    /// Highest cumulative count the broker acknowledged (a connection count for orders
    /// 0-2, the session's high-water mark for order 5).
    acked: AtomicU64,
    /// Distinct batches of this connection acknowledged so far.
    acked_batches: AtomicU64,
    /// Batch sequence to resend from after BACKPRESSURE, `u64::MAX` for none.
    resend_from: AtomicU64,
    backpressure_retries: AtomicU64,
    failed: Mutex<Option<Error>>,
    latency: Mutex<Histogram<u64>>,
    /// Append (first message of the batch published) to acknowledgement, microseconds.
    append_latency: Mutex<Histogram<u64>>,
}

impl ConnShared {
    /// Records the latencies of batches acknowledged at `now`: seal to ack per batch,
    /// append to ack per message (from each message's due time where it has one).
    fn record_latency(&self, batches: &[InFlight], now: Instant) {
        if batches.is_empty() {
            return;
        }
        let mut sealed = self.latency.lock();
        let mut appended = self.append_latency.lock();
        let micros = |since: Instant| (now.duration_since(since).as_micros() as u64).max(1);
        for f in batches {
            let _ = sealed.record(micros(f.batch.sealed_at));
            if f.batch.dues.is_empty() {
                let _ = appended.record(micros(f.batch.first_at));
            }
            for &due in &f.batch.dues {
                let _ = appended.record(micros(due));
            }
        }
    }
}

/// A broker id and the process serving it, as the head named them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct BrokerProcess {
    id: u32,
    incarnation: u64,
}

struct Queue {
    tx: Sender<Sealed>,
    /// The receiving end too, so a failover can take back what the sender never took.
    rx: Receiver<Sealed>,
    /// The broker's id in the cluster and the process serving it when this queue
    /// connected (known when discovered through the head): failover questions name the
    /// process, so a restarted broker's answer covers the old one.
    process: Option<BrokerProcess>,
    /// The broker is gone: nothing more is dispatched here; set before the failover.
    dead: AtomicBool,
    /// The sender thread has stopped (after `dead`): its batches are all in `unacked`.
    sender_done: AtomicBool,
    /// Batches a failover moved here from a dead broker's queue.
    moved: Mutex<VecDeque<Sealed>>,
    /// A dead queue's failover has finished: its batches are elsewhere (or the
    /// publisher failed). Until then `flush` waits for it.
    moved_out: AtomicBool,
    /// Held to check `dead` and hand a batch to `tx` as one step, and to set `dead`:
    /// once `dead` is set nothing more enters the channel, so a failover can empty it.
    gate: Mutex<()>,
    conn: Arc<ConnShared>,
    broker: String,
    connection: usize,
    dispatched: AtomicU64,
    deflected: AtomicU64,
    producer_waits: AtomicU64,
    /// Batches the sender sealed itself (see [`PublisherConfig::linger`]).
    lingered: AtomicU64,
    /// A batch due on this queue opened: its sender times the linger.
    batch_opened: (Sender<()>, Receiver<()>),
    /// The connection's current socket; replaced when an order-5 session reopens.
    stream: Mutex<TcpStream>,
    /// Bumped each time `stream` is replaced, so the reader follows.
    stream_gen: AtomicU64,
    /// Session epoch the current socket was opened with (0 without a session).
    epoch: AtomicU64,
}

impl Queue {
    /// A queue for a connection just opened to `broker` (not started yet).
    fn new(
        stream: TcpStream,
        broker: &str,
        process: Option<BrokerProcess>,
        connection: usize,
        depth: usize,
        epoch: u64,
    ) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(depth);
        Self {
            tx,
            rx,
            process,
            dead: AtomicBool::new(false),
            sender_done: AtomicBool::new(false),
            moved: Mutex::new(VecDeque::new()),
            moved_out: AtomicBool::new(false),
            gate: Mutex::new(()),
            conn: Arc::new(ConnShared {
                unacked: Mutex::new(VecDeque::new()),
                sent: AtomicU64::new(0),
                acked: AtomicU64::new(0),
                acked_batches: AtomicU64::new(0),
                resend_from: AtomicU64::new(u64::MAX),
                backpressure_retries: AtomicU64::new(0),
                failed: Mutex::new(None),
                latency: Mutex::new(Histogram::new(3).expect("valid histogram")),
                append_latency: Mutex::new(Histogram::new(3).expect("valid histogram")),
            }),
            broker: broker.to_string(),
            connection,
            dispatched: AtomicU64::new(0),
            deflected: AtomicU64::new(0),
            producer_waits: AtomicU64::new(0),
            lingered: AtomicU64::new(0),
            batch_opened: crossbeam_channel::bounded(1),
            stream: Mutex::new(stream),
            stream_gen: AtomicU64::new(0),
            epoch: AtomicU64::new(epoch),
        }
    }

    fn is_live(&self) -> bool {
        !self.dead.load(Ordering::Acquire)
    }

    /// Stops dispatching to this queue (its broker is gone).
    fn mark_dead(&self) {
        let _gate = self.gate.lock();
        self.dead.store(true, Ordering::Release);
    }

    /// Takes a batch a failover moved from a dead queue, unless this one is dead too.
    fn try_take_moved(&self, batch: Sealed) -> Result<(), Sealed> {
        let _gate = self.gate.lock();
        if !self.is_live() {
            return Err(batch);
        }
        self.moved.lock().push_back(batch);
        self.dispatched.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Hands `sealed` to the channel unless the queue is dead or full.
    fn try_hand(&self, sealed: Sealed) -> Result<(), Sealed> {
        let _gate = self.gate.lock();
        if !self.is_live() {
            return Err(sealed);
        }
        match self.tx.try_send(sealed) {
            Ok(()) => {
                self.dispatched.fetch_add(1, Ordering::Release);
                Ok(())
            }
            Err(TrySendError::Full(s)) | Err(TrySendError::Disconnected(s)) => Err(s),
        }
    }
}

/// The publisher's queues, one per connection. They are only ever appended (at start,
/// and when a broker joins) and never removed, so an index stays valid for the threads
/// and failovers that hold it. Reading takes no lock: a slot is set before the count that
/// covers it is published (Release), and readers load the count with Acquire.
struct Queues {
    slots: Box<[OnceLock<Queue>]>,
    len: AtomicUsize,
    /// Serialises appends (start, then the membership watcher).
    appending: Mutex<()>,
}

impl Queues {
    /// The queues of `start`, with room for `more` later.
    fn new(initial: Vec<Queue>, more: usize) -> Self {
        let queues = Self {
            slots: (0..initial.len() + more).map(|_| OnceLock::new()).collect(),
            len: AtomicUsize::new(0),
            appending: Mutex::new(()),
        };
        if queues.append(initial).is_err() {
            unreachable!("sized for the initial queues");
        }
        queues
    }

    fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    fn has_room_for(&self, count: usize) -> bool {
        self.len() + count <= self.slots.len()
    }

    fn iter(&self) -> impl Iterator<Item = &Queue> {
        self.slots[..self.len()]
            .iter()
            .map(|slot| slot.get().expect("slots below the count are set"))
    }

    /// Appends `queues` and returns the index of the first one, or hands them back when
    /// they do not fit.
    fn append(&self, queues: Vec<Queue>) -> Result<usize, Vec<Queue>> {
        let _appending = self.appending.lock();
        let first = self.len.load(Ordering::Relaxed);
        if first + queues.len() > self.slots.len() {
            return Err(queues);
        }
        let count = queues.len();
        for (slot, queue) in self.slots[first..].iter().zip(queues) {
            if slot.set(queue).is_err() {
                unreachable!("slots above the count are empty");
            }
        }
        self.len.store(first + count, Ordering::Release);
        Ok(first)
    }
}

impl std::ops::Index<usize> for Queues {
    type Output = Queue;

    fn index(&self, index: usize) -> &Queue {
        self.slots[index].get().expect("an appended queue")
    }
}

/// Order 5: the publisher's session.
struct Session {
    next_seq: AtomicU64,
    /// The epoch (re)opened connections use; raised after a fence.
    epoch: AtomicU64,
    /// Bumped on every fence; each sender reopens its connection when it changes.
    fences: AtomicU64,
    /// The highest committed high-water mark a fence reported.
    fenced_hwm: AtomicU64,
}

struct Builder {
    buf: Vec<u8>,
    num_msg: u32,
    /// When the open batch's first message was appended (the linger runs from here).
    first_at: Option<Instant>,
    /// The wall clock at that moment: every message of the batch carries it.
    opened_ns: u64,
    /// The due time its first message was published with, if any (latency only).
    first_due: Option<Instant>,
    /// Every message's due time while all of them have one (see [`Sealed::dues`]).
    dues: Vec<Instant>,
    /// The last batch was sealed when its linger ran out, not by size: the load is
    /// light, so the next batch's sender is woken to time its linger.
    lingered_last: bool,
    round_robin: usize,
}

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
    messages: AtomicU64,
    bytes: AtomicU64,
    batches: AtomicU64,
    /// Seal indices of the batches not acknowledged yet (for ack 0: not written yet):
    /// its smallest entry is the acknowledged prefix. Numbered under this lock, so a
    /// sealed batch is never missing from it.
    outstanding: Mutex<BTreeSet<u64>>,
    counter: AtomicU64,
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
        if config.ack_level > 2 {
            return Err(Error::Config(format!(
                "ack level {} does not exist; choose 0, 1 or 2",
                config.ack_level
            )));
        }
        if brokers.is_empty() || config.threads_per_broker == 0 || config.queue_depth == 0 {
            return Err(Error::Config(
                "need at least one broker, one connection per broker and a queue depth of 1".into(),
            ));
        }
        let watch_membership = control.is_some() && !config.membership_refresh.is_zero();
        let room_for_joins = if watch_membership {
            config
                .max_joined_brokers
                .checked_mul(config.threads_per_broker)
                .filter(|&slots| slots <= MAX_JOINED_QUEUES)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "max_joined_brokers x threads_per_broker is above {MAX_JOINED_QUEUES}"
                    ))
                })?
        } else {
            0
        };
        let client_id = config.client_id.unwrap_or_else(crate::random_client_id);
        let mut config = config;
        if config.session_key.is_none() {
            config.session_key = Some(crate::random_session_key()?);
        }
        let slow_queue = config.slow_queue.or_else(slow_queue_from_env);
        let mut connected = Vec::new();
        for (process, addr) in brokers {
            connected.extend(connect_broker(
                &config,
                client_id,
                topic,
                config.session_epoch,
                *process,
                addr,
            )?);
        }
        let order = connected.last().map(|(_, ok)| ok.order);
        let session_start = connected
            .iter()
            .map(|(_, ok)| ok.next_batch_seq)
            .max()
            .unwrap_or(0);
        let max_message = connected
            .iter()
            .map(|(_, ok)| ok.max_message_bytes as usize)
            .min()
            .unwrap_or(u32::MAX as usize);
        let max_batch = connected
            .iter()
            .map(|(_, ok)| ok.max_batch_bytes as usize)
            .min()
            .unwrap_or(u32::MAX as usize);
        let first_seqs: Vec<u64> = connected.iter().map(|(_, ok)| ok.next_batch_seq).collect();
        let queues = Queues::new(
            connected.into_iter().map(|(queue, _)| queue).collect(),
            room_for_joins,
        );
        let batch_bytes = config.batch_bytes.clamp(MESSAGE_HEADER_LEN, max_batch);
        // One pending wake is enough: the watcher reads the whole membership each time.
        let (membership_wake, membership_woken) = crossbeam_channel::bounded(1);
        let inner = Arc::new(Inner {
            builder: Mutex::new(Builder {
                buf: Vec::with_capacity(batch_bytes + MESSAGE_HEADER_LEN * 2),
                num_msg: 0,
                first_at: None,
                opened_ns: 0,
                first_due: None,
                dues: Vec::new(),
                lingered_last: true,
                round_robin: 0,
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
            max_message,
            max_batch,
            backstop_wake: Condvar::new(),
            open_batch: AtomicU64::new(0),
            created: Instant::now(),
            backstop_armed: AtomicBool::new(false),
            queues,
            pool: crossbeam_channel::unbounded(),
            progress: (Mutex::new(()), Condvar::new()),
            closed: AtomicBool::new(false),
            any_failed: AtomicBool::new(false),
            messages: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            outstanding: Mutex::new(BTreeSet::new()),
            counter: AtomicU64::new(0),
            // Unique across publisher instances too (a restarted publisher may reuse its
            // client id): failover asks the head about batches by id.
            next_batch_id: AtomicU64::new(crate::random_client_id() << 32),
            topic: topic.to_string(),
            session: (order == Some(5)).then(|| Session {
                next_seq: AtomicU64::new(session_start),
                epoch: AtomicU64::new(config.session_epoch),
                fences: AtomicU64::new(0),
                fenced_hwm: AtomicU64::new(session_start),
            }),
            slow_queue,
            order: order.unwrap_or(2),
            control,
            failovers: AtomicU64::new(0),
            membership_wake,
        });
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

    /// Like [`Publisher::publish`], for a message that was due at `due` (a load generator
    /// on a fixed schedule): its append-to-ack and end-to-end latencies are counted from
    /// `due` instead of from now, so time the caller spent behind its schedule (or
    /// blocked in here) is not left out. The linger still runs from the append.
    pub fn publish_due(&self, payload: &[u8], due: Instant) -> Result<()> {
        self.append(payload, Some(due))
    }

    fn append(&self, payload: &[u8], due: Option<Instant>) -> Result<()> {
        let inner = &self.inner;
        if inner.closed.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        if inner.any_failed.load(Ordering::Relaxed) {
            inner.first_error()?;
        }
        if payload.len() > inner.max_message {
            return Err(Error::MessageTooLarge {
                size: payload.len(),
                max: inner.max_message,
            });
        }
        let stride = message_stride(payload.len() as u64) as usize;
        let mut b = inner.builder.lock();
        if b.num_msg > 0 && b.buf.len() + stride > inner.max_batch {
            inner.seal(&mut b)?;
        }
        if b.num_msg == 0 {
            // One clock read per batch, not per message: a read costs 100+ ns where the
            // kernel cannot serve it from the vDSO (this project's VMs), which was 9% of
            // a publish-only run. Every message carries its batch's opening time, which
            // overstates its end-to-end latency by at most the batch's linger; on a fixed
            // schedule, the first message's due time, so end-to-end latency does not
            // excuse a late publish either.
            let late = due.map_or(0, |d| d.elapsed().as_nanos() as u64);
            b.opened_ns = now_ns().saturating_sub(late);
        }
        // On a schedule, each message carries its own due time (the batch's opening
        // time plus its offset in the schedule, so still no clock read).
        let publish_ts_ns = match (due, b.first_due) {
            (Some(due), Some(first)) if b.num_msg > 0 => {
                b.opened_ns + due.saturating_duration_since(first).as_nanos() as u64
            }
            _ => b.opened_ns,
        };
        let header = BlogMessageHeader {
            size: payload.len() as u32,
            publish_ts_ns,
            counter: inner.counter.fetch_add(1, Ordering::Relaxed),
            client_id: inner.client_id,
            ..Default::default()
        };
        let mut encoded = [0u8; MESSAGE_HEADER_LEN];
        header.encode_into(&mut encoded);
        // Written once in its final form: no zero-fill first.
        let end = b.buf.len() + stride;
        b.buf.extend_from_slice(&encoded);
        b.buf.extend_from_slice(payload);
        b.buf.resize(end, 0);
        b.num_msg += 1;
        if b.num_msg == 1 {
            let now = Instant::now();
            b.first_at = Some(now);
            b.first_due = due.map(|d| d.min(now));
            b.dues.clear();
            // The sender of the queue this batch is due on times its linger.
            // (Past `OpenBatch`'s 16 bits of queue index, only the backstop seals.)
            if let Some(owner) = inner
                .live_queue_from(b.round_robin)
                .filter(|&o| o < OpenBatch::MAX_OWNER)
            {
                let open = OpenBatch {
                    owner,
                    deadline: now + inner.config.linger,
                };
                inner
                    .open_batch
                    .store(open.encode(inner.created), Ordering::Release);
                // Under load batches fill before their linger runs out and the wake-up
                // would be wasted: each idle sender looks at the open batch anyway
                // before it waits, and at least every `SENDER_IDLE_WAIT`.
                if b.lingered_last {
                    let _ = inner.queues[owner].batch_opened.0.try_send(());
                }
            }
        }
        match due {
            Some(due) if b.dues.len() + 1 == b.num_msg as usize => {
                let due = due.max(b.first_due.expect("set by the batch's first message"));
                b.dues.push(due);
            }
            // A message without a due time: the batch falls back to its first message's.
            _ => b.dues.clear(),
        }
        inner.messages.fetch_add(1, Ordering::Relaxed);
        inner
            .bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        if b.buf.len() >= inner.config.batch_bytes {
            inner.seal(&mut b)?;
        }
        Ok(())
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
            // A dead broker's batches count where the failover moved them.
            // A dead broker's batches count where the failover moved them, once moved.
            let done = inner.failovers.load(Ordering::Acquire) == 0
                && inner.queues.iter().all(|q| {
                    if !q.is_live() {
                        return q.moved_out.load(Ordering::Acquire);
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

    pub fn stats(&self) -> PublisherStats {
        let inner = &self.inner;
        let (all, appended) = self.latency_histograms();
        PublisherStats {
            client_id: inner.client_id,
            messages: inner.messages.load(Ordering::Relaxed),
            bytes: inner.bytes.load(Ordering::Relaxed),
            batches: inner.batches.load(Ordering::Relaxed),
            acked_batches: inner
                .queues
                .iter()
                .map(|q| q.conn.acked_batches.load(Ordering::Relaxed))
                .sum(),
            ack_latency_us: LatencySummary::of(&all),
            append_to_ack_us: LatencySummary::of(&appended),
            queues: inner
                .queues
                .iter()
                .map(|q| QueueStats {
                    broker: q.broker.clone(),
                    connection: q.connection,
                    batches: q.dispatched.load(Ordering::Relaxed),
                    acked_batches: q.conn.acked_batches.load(Ordering::Relaxed),
                    deflected: q.deflected.load(Ordering::Relaxed),
                    producer_waits: q.producer_waits.load(Ordering::Relaxed),
                    backpressure_retries: q.conn.backpressure_retries.load(Ordering::Relaxed),
                    lingered: q.lingered.load(Ordering::Relaxed),
                })
                .collect(),
        }
    }

    /// The raw latency histograms behind [`PublisherStats`] (seal to ack, and append
    /// to ack, in microseconds), so several publishers' figures can be merged exactly.
    pub fn latency_histograms(&self) -> (Histogram<u64>, Histogram<u64>) {
        let mut sealed = Histogram::<u64>::new(3).expect("valid histogram");
        let mut appended = Histogram::<u64>::new(3).expect("valid histogram");
        for q in self.inner.queues.iter() {
            let _ = sealed.add(&*q.conn.latency.lock());
            let _ = appended.add(&*q.conn.append_latency.lock());
        }
        (sealed, appended)
    }

    /// Flushes, then closes every connection.
    pub fn close(mut self) -> Result<PublisherStats> {
        let flushed = self.flush();
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
    /// Whether a lost connection to `q`'s broker is failed over rather than fatal.
    fn can_fail_over(&self, q: &Queue) -> bool {
        self.config.failover
            && self.order >= 2
            && self.control.is_some()
            && q.process.is_some()
            && !self.closed.load(Ordering::Relaxed)
    }

    fn first_error(&self) -> Result<()> {
        for q in self.queues.iter() {
            if let Some(e) = q.conn.failed.lock().clone() {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Order 5: the session's epoch `fenced_epoch` was fenced with everything below `hwm`
    /// committed. The first report opens the next epoch; every sender then reopens its
    /// connection and resends what is not committed.
    fn fence(&self, fenced_epoch: u64, hwm: u64) {
        let Some(session) = &self.session else { return };
        session.fenced_hwm.fetch_max(hwm, Ordering::AcqRel);
        if session
            .epoch
            .compare_exchange(
                fenced_epoch,
                fenced_epoch + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            tracing::info!(
                client = self.client_id,
                epoch = fenced_epoch + 1,
                hwm,
                "order-5 session fenced; reopening with the next epoch"
            );
            session.fences.fetch_add(1, Ordering::AcqRel);
        }
        self.notify_progress();
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

    /// Hands the open batch to a queue: round-robin, deflecting past full queues,
    /// blocking only when every queue is full.
    fn seal(&self, b: &mut Builder) -> Result<()> {
        let (sealed, due) = self.take_sealed(b);
        self.dispatch(sealed, due)
    }

    /// Takes the open batch out of the builder as a sealed batch, with the queue it is
    /// due on (round-robin).
    fn take_sealed(&self, b: &mut Builder) -> (Sealed, usize) {
        let now = Instant::now();
        b.lingered_last = b.first_at.is_some_and(|f| now >= f + self.config.linger);
        let fresh = self.pool.1.try_recv().unwrap_or_else(|_| {
            Vec::with_capacity(self.config.batch_bytes + MESSAGE_HEADER_LEN * 2)
        });
        let buf = std::mem::replace(&mut b.buf, fresh);
        let seq = self
            .session
            .as_ref()
            .map(|session| session.next_seq.fetch_add(1, Ordering::Relaxed));
        let index = {
            let mut outstanding = self.outstanding.lock();
            let index = self.batches.fetch_add(1, Ordering::AcqRel);
            outstanding.insert(index);
            index
        };
        let sealed = Sealed {
            seq,
            buf,
            num_msg: b.num_msg,
            sealed_at: now,
            first_at: b.first_due.or(b.first_at).unwrap_or_else(Instant::now),
            dues: {
                let capacity = b.dues.len();
                std::mem::replace(&mut b.dues, Vec::with_capacity(capacity))
            },
            batch_id: self.next_batch_id.fetch_add(1, Ordering::Relaxed),
            index,
        };
        b.num_msg = 0;
        b.first_at = None;
        self.open_batch.store(0, Ordering::Release);
        self.backstop_armed.store(false, Ordering::Relaxed);
        b.first_due = None;
        let due = b.round_robin;
        b.round_robin = (due + 1) % self.queues.len();
        (sealed, due)
    }

    /// The live queue a batch due on queue `due` goes to: `due` itself, or the next
    /// live one after it.
    fn live_queue_from(&self, due: usize) -> Option<usize> {
        let n = self.queues.len();
        (0..n)
            .map(|i| (due + i) % n)
            .find(|&i| self.queues[i].is_live())
    }

    /// For queue `index`'s idle sender: the open batch, sealed, if it is due on this
    /// queue and its linger has run out (counted as dispatched here under the builder's
    /// lock, so `flush` never sees it nowhere); else when to look again.
    fn linger_for(&self, index: usize) -> Linger {
        // Most calls end here, without the lock the producer takes for every message.
        match OpenBatch::decode(self.open_batch.load(Ordering::Acquire), self.created) {
            Some(open) if open.owner == index => {
                if Instant::now() < open.deadline {
                    return Linger::Until(open.deadline);
                }
            }
            // Its owner died after it opened: the next live queue takes it over (below).
            Some(open) if !self.queues[open.owner].is_live() => {}
            _ => return Linger::NotDue,
        }
        // Never wait long for the builder: a producer blocked in `dispatch` (every queue
        // full) holds it until a sender makes room, so a sender that waited here would
        // deadlock with it.
        let Some(mut b) = self.builder.try_lock_for(BUILDER_WAIT) else {
            return Linger::Busy;
        };
        let Some(first) = b.first_at else {
            return Linger::NotDue;
        };
        if self.live_queue_from(b.round_robin) != Some(index) {
            return Linger::NotDue;
        }
        let deadline = first + self.config.linger;
        if Instant::now() < deadline {
            return Linger::Until(deadline);
        }
        // A batch sealed earlier waits in this queue's channel (every dispatch happens
        // under the builder's lock, so this cannot change while it is held): written
        // now, this one would overtake it. Take that one first.
        if !self.queues[index].rx.is_empty() {
            return Linger::Busy;
        }
        let (sealed, _) = self.take_sealed(&mut b);
        let q = &self.queues[index];
        q.dispatched.fetch_add(1, Ordering::Release);
        q.lingered.fetch_add(1, Ordering::Relaxed);
        Linger::Sealed(sealed)
    }

    /// For a sender about to wait at its in-flight limit: if the open batch is due on
    /// its queue, the backstop seals it on time instead (and dispatch deflects it from a
    /// full queue), so a slow broker's batches do not grow past their linger.
    fn arm_backstop_if_owner(&self, index: usize) {
        let open = OpenBatch::decode(self.open_batch.load(Ordering::Acquire), self.created);
        if open.is_some_and(|o| o.owner == index)
            && !self.backstop_armed.swap(true, Ordering::Relaxed)
        {
            self.backstop_wake.notify_all();
        }
    }

    /// Hands a sealed batch to queue `due` or, deflecting, the next live one with room;
    /// blocks only when every live queue is full.
    fn dispatch(&self, mut sealed: Sealed, due: usize) -> Result<()> {
        let n = self.queues.len();
        let Some(due) = self.live_queue_from(due) else {
            self.first_error()?;
            return Err(Error::NoLiveBroker);
        };
        let tries = if self.config.deflect { n } else { 1 };
        for i in 0..tries {
            match self.queues[(due + i) % n].try_hand(sealed) {
                Ok(()) => {
                    if i > 0 {
                        self.queues[due].deflected.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(());
                }
                Err(s) => sealed = s,
            }
        }
        self.queues[due]
            .producer_waits
            .fetch_add(1, Ordering::Relaxed);
        loop {
            self.first_error()?;
            if self.closed.load(Ordering::Relaxed) {
                return Err(Error::Closed);
            }
            // Only the round-robin queue will do without deflection, while it lives.
            let targets: Vec<usize> = if self.config.deflect || !self.queues[due].is_live() {
                (0..n).filter(|&i| self.queues[i].is_live()).collect()
            } else {
                vec![due]
            };
            if targets.is_empty() {
                return Err(Error::NoLiveBroker);
            }
            let mut select = Select::new();
            for &i in &targets {
                select.send(&self.queues[i].tx);
            }
            // Ready, then handed through the gate: the queue may have died meanwhile.
            if let Ok(ready) = select.ready_timeout(Duration::from_millis(100)) {
                match self.queues[targets[ready]].try_hand(sealed) {
                    Ok(()) => return Ok(()),
                    Err(s) => sealed = s,
                }
            }
        }
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

    fn recycle(&self, mut buf: Vec<u8>) {
        buf.clear();
        let _ = self.pool.0.send(buf);
    }
}

/// Most queues a publisher reserves room for, beyond those of `connect`.
const MAX_JOINED_QUEUES: usize = 1 << 16;

/// Longest wait for the head's answer when the membership watcher reads it: `close`
/// waits for the watcher, so it must not hang on a head that stopped answering.
const MEMBERSHIP_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

fn spawn<T: Send + 'static>(
    name: String,
    body: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(body)
        .map_err(|e| Error::Config(format!("cannot spawn a thread: {e}")))
}

/// Opens the `threads_per_broker` connections of one broker with the publisher's hello,
/// the same at start and when a broker joins later: their queues (not started yet), each
/// with the broker's HelloOk. `session_epoch`: order 5, the epoch the session is at.
fn connect_broker(
    config: &PublisherConfig,
    client_id: u64,
    topic: &str,
    session_epoch: u64,
    process: Option<BrokerProcess>,
    addr: &str,
) -> Result<Vec<(Queue, HelloOk)>> {
    (0..config.threads_per_broker)
        .map(|connection| {
            let hello = Hello {
                role: Role::Publish,
                ack_level: config.ack_level,
                client_id,
                session_epoch,
                start_position: 0,
                connection_index: connection as u32,
                cursor_count: 0,
                topic: topic.to_string(),
                session_key: config.session_key.expect("drawn when the publisher starts"),
            };
            let (stream, ok) = conn::open(addr, &hello, &[])?;
            let epoch = if ok.order == 5 { session_epoch } else { 0 };
            let queue = Queue::new(stream, addr, process, connection, config.queue_depth, epoch);
            Ok((queue, ok))
        })
        .collect()
}

/// Starts the sender and the ack reader of queue `index`. `first_seq`: its HelloOk's
/// `next_batch_seq`, where orders 0-2 number the connection's batches from;
/// `fences_seen`: order 5, the session's fence count when the connection was opened (a
/// later fence makes the sender reopen it, as every other).
fn start_connection(
    inner: &Arc<Inner>,
    index: usize,
    first_seq: u64,
    fences_seen: u64,
    threads: &mut Vec<JoinHandle<()>>,
) -> Result<()> {
    let a = inner.clone();
    threads.push(spawn(format!("pub-send-{index}"), move || {
        sender(a, index, first_seq, fences_seen)
    })?);
    let b = inner.clone();
    threads.push(spawn(format!("pub-acks-{index}"), move || {
        reader(b, index)
    })?);
    Ok(())
}

/// Follows membership for a publisher made with `connect`: every `membership_refresh`,
/// and when woken (after a failover), reads the live brokers from the head and connects
/// to each broker process it has never had a queue for: a restarted broker (a new
/// incarnation of an id) or a new one. A process whose connections it lost is not
/// reconnected: its failover fences it. Returns the threads it started, for `shutdown`.
fn follow_membership(inner: Arc<Inner>, woken: Receiver<()>) -> Vec<JoinHandle<()>> {
    let admin = Admin::with_timeout(
        inner.control.as_deref().expect("watched through the head"),
        MEMBERSHIP_REQUEST_TIMEOUT,
    );
    let per_broker = inner.config.threads_per_broker;
    let mut threads = Vec::new();
    // Processes an attempt failed for: reported once, not at every refresh.
    let mut reported = HashSet::new();
    // Processes that do not match this publisher (order, limits): they will not start
    // matching, so they are not tried again. One that did not answer is.
    let mut mismatched = HashSet::new();
    loop {
        let _ = woken.recv_timeout(inner.config.membership_refresh);
        if inner.closed.load(Ordering::Relaxed) {
            return threads;
        }
        let brokers = match admin.cluster() {
            Ok(cluster) => cluster.brokers,
            Err(e) => {
                tracing::debug!("cannot read the cluster's brokers: {e}");
                continue;
            }
        };
        for b in brokers {
            let process = BrokerProcess {
                id: b.id,
                incarnation: b.incarnation,
            };
            if inner.closed.load(Ordering::Relaxed) {
                return threads;
            }
            if mismatched.contains(&process)
                || inner.queues.iter().any(|q| q.process == Some(process))
            {
                continue;
            }
            if !inner.queues.has_room_for(per_broker) {
                tracing::warn!(
                    limit = inner.config.max_joined_brokers,
                    "added as many joined brokers as max_joined_brokers allows; \
                     publishing to the brokers this publisher has from now on"
                );
                return threads;
            }
            match add_broker(&inner, process, &b.addr, &mut threads) {
                Ok(()) => tracing::info!(
                    broker = %b.addr,
                    id = b.id,
                    incarnation = b.incarnation,
                    "a broker joined; publishing to it too"
                ),
                Err(e) => {
                    if matches!(e, Error::Config(_)) {
                        mismatched.insert(process);
                    }
                    if reported.insert(process) {
                        tracing::warn!(broker = %b.addr, "cannot use a broker that joined: {e}");
                    }
                }
            }
        }
    }
}

/// Connects to a broker that joined after `start` and, once its threads run, dispatches
/// to it like to any other queue.
fn add_broker(
    inner: &Arc<Inner>,
    process: BrokerProcess,
    addr: &str,
    threads: &mut Vec<JoinHandle<()>>,
) -> Result<()> {
    // Order 5: join the session at its current epoch. The fence count is read first: a
    // fence after it (even one whose epoch the hello already carries) makes the new
    // senders reopen, which is harmless.
    let (fences_seen, session_epoch) = match &inner.session {
        Some(session) => (
            session.fences.load(Ordering::Acquire),
            session.epoch.load(Ordering::Acquire),
        ),
        None => (0, inner.config.session_epoch),
    };
    let connected = connect_broker(
        &inner.config,
        inner.client_id,
        &inner.topic,
        session_epoch,
        Some(process),
        addr,
    )?;
    // Batches are sealed for the limits of the brokers found at start.
    if let Some((_, ok)) = connected.iter().find(|(_, ok)| {
        ok.order != inner.order
            || (ok.max_message_bytes as usize) < inner.max_message
            || (ok.max_batch_bytes as usize) < inner.max_batch
    }) {
        return Err(Error::Config(format!(
            "order {} and limits of {} / {} bytes (message / batch) do not match this \
             publisher's order {} and {} / {} bytes",
            ok.order,
            ok.max_message_bytes,
            ok.max_batch_bytes,
            inner.order,
            inner.max_message,
            inner.max_batch
        )));
    }
    let first_seqs: Vec<u64> = connected.iter().map(|(_, ok)| ok.next_batch_seq).collect();
    let queues = connected.into_iter().map(|(queue, _)| queue).collect();
    let Ok(first) = inner.queues.append(queues) else {
        return Err(Error::Config("no room for more queues".into()));
    };
    for (offset, first_seq) in first_seqs.into_iter().enumerate() {
        let index = first + offset;
        if let Err(e) = start_connection(inner, index, first_seq, fences_seen, threads) {
            // The queue takes batches already: without its threads the publisher fails,
            // as `start` does.
            inner.fail(&inner.queues[index].conn, e.clone());
            return Err(e);
        }
    }
    Ok(())
}

/// Seals a batch that its queue's sender did not take when its linger ran out (the
/// sender was writing, waiting for acknowledgements, or gone), `linger_backstop` later.
/// Normally a batch is sealed by that sender itself ([`Inner::linger_for`]).
fn linger_backstop(inner: Arc<Inner>) {
    let mut b = inner.builder.lock();
    while !inner.closed.load(Ordering::Relaxed) {
        let late = if inner.backstop_armed.load(Ordering::Relaxed) {
            inner.config.linger
        } else {
            inner.config.linger + inner.config.linger_backstop
        };
        match b.first_at {
            Some(first) if Instant::now() >= first + late => {
                if inner.seal(&mut b).is_err() {
                    return;
                }
            }
            Some(first) => {
                let wait = (first + late).saturating_duration_since(Instant::now());
                inner.backstop_wake.wait_for(&mut b, wait);
            }
            // Not woken when a batch opens (its sender is): looks again this often.
            None => {
                inner
                    .backstop_wake
                    .wait_for(&mut b, inner.config.linger_backstop);
            }
        }
    }
}

/// What an idle sender does about the open batch (see [`Inner::linger_for`]).
enum Linger {
    /// Due on this queue and lingered out: the sender writes it.
    Sealed(Sealed),
    /// Due on this queue; its linger runs out then.
    Until(Instant),
    /// No open batch, or it is due on another queue.
    NotDue,
    /// The builder is held (by the producer, appending or waiting for room), or a batch
    /// sealed earlier waits in this queue's channel: look again soon, meanwhile taking
    /// what the channel brings.
    Busy,
}

/// The open batch as the senders see it: packed into one `u64` (the deadline in whole
/// microseconds since the publisher was created, rounded up, above 16 bits of queue
/// index + 1), so a sender can read it without the builder's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OpenBatch {
    owner: usize,
    deadline: Instant,
}

impl OpenBatch {
    /// Queue indexes from here on do not fit.
    const MAX_OWNER: usize = 0xffff;

    fn encode(&self, base: Instant) -> u64 {
        let since = self.deadline.saturating_duration_since(base);
        let micros = since.as_micros() + u128::from(!since.subsec_nanos().is_multiple_of(1000));
        let micros = u64::try_from(micros)
            .unwrap_or(u64::MAX)
            .min(u64::MAX >> 16);
        assert!(
            self.owner < Self::MAX_OWNER,
            "queue index {} does not fit",
            self.owner
        );
        (micros << 16) | (self.owner as u64 + 1)
    }

    fn decode(packed: u64, base: Instant) -> Option<Self> {
        let owner = (packed & 0xffff).checked_sub(1)? as usize;
        Some(Self {
            owner,
            deadline: base + Duration::from_micros(packed >> 16),
        })
    }
}

/// Longest linger (and backstop) a publisher honours.
const LONGEST_LINGER: Duration = Duration::from_secs(3600);

/// Longest a sender waits for the builder's lock.
const BUILDER_WAIT: Duration = Duration::from_micros(50);

/// The next batch for an idle sender.
enum Next {
    Batch(Sealed),
    /// Nothing yet: go round the sender's loop again.
    Again,
    Stop,
}

/// Longest an idle sender waits before going round its loop again.
const SENDER_IDLE_WAIT: Duration = Duration::from_millis(5);

/// A batch from queue `index`'s channel, or the open batch once its linger runs out if it
/// is due on this queue; else waits for either (a batch opening wakes this sender).
fn next_batch(inner: &Inner, index: usize) -> Next {
    let q = &inner.queues[index];
    match q.rx.try_recv() {
        Ok(b) => return Next::Batch(b),
        Err(TryRecvError::Disconnected) => return Next::Stop,
        Err(TryRecvError::Empty) => {}
    }
    let wait = match inner.linger_for(index) {
        Linger::Sealed(b) => return Next::Batch(b),
        Linger::Until(deadline) => deadline
            .saturating_duration_since(Instant::now())
            .min(SENDER_IDLE_WAIT),
        Linger::NotDue => SENDER_IDLE_WAIT,
        Linger::Busy => BUILDER_WAIT,
    };
    crossbeam_channel::select! {
        recv(q.rx) -> r => match r {
            Ok(b) => Next::Batch(b),
            Err(_) => Next::Stop,
        },
        recv(q.batch_opened.1) -> _ => Next::Again,
        default(wait) => {
            if inner.closed.load(Ordering::Relaxed) {
                Next::Stop
            } else {
                Next::Again
            }
        }
    }
}

fn write_batch(stream: &mut TcpStream, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let mut slices = [IoSlice::new(header), IoSlice::new(payload)];
    let mut bufs = &mut slices[..];
    while !bufs.is_empty() {
        let n = stream.write_vectored(bufs)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Writes the batches of one queue; resends from the refused batch after BACKPRESSURE.
fn sender(inner: Arc<Inner>, index: usize, first_seq: u64, fences_seen: u64) {
    let q = &inner.queues[index];
    let conn = &q.conn;
    let Ok(mut stream) = q.stream.lock().try_clone() else {
        return;
    };
    let mut next_seq = first_seq;
    let mut fences_handled = fences_seen;
    let mut backoff = Duration::from_millis(5);
    // A failed write: with failover, the reader (whose read fails too once the socket
    // is shut) moves this queue's batches to the live brokers.
    let fail = |e: std::io::Error| {
        if inner.closed.load(Ordering::Relaxed) {
            return;
        }
        if inner.can_fail_over(q) {
            q.mark_dead();
            let _ = q.stream.lock().shutdown(std::net::Shutdown::Both);
        } else {
            inner.fail(
                conn,
                Error::ConnectionLost {
                    broker: q.broker.clone(),
                    message: e.to_string(),
                },
            );
        }
    };
    // Whatever ends the sender, the failover waits for it before collecting `unacked`.
    struct Done<'a>(&'a AtomicBool, &'a Inner);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            self.1.notify_progress();
        }
    }
    let _done = Done(&q.sender_done, &inner);
    // A write error on an order-5 connection may be the broker closing a fenced epoch:
    // give the reader a moment to report the fence before calling it a failure.
    // A reader that already started a failover (the broker is gone) ends the wait.
    let fenced_meanwhile = |handled: u64| {
        inner.session.as_ref().is_some_and(|session| {
            inner.wait_until(Duration::from_secs(2), || {
                session.fences.load(Ordering::Acquire) != handled || !q.is_live()
            }) && q.is_live()
        })
    };
    loop {
        if conn.failed.lock().is_some() || q.dead.load(Ordering::Acquire) {
            return;
        }
        if let Some(session) = &inner.session {
            let fences = session.fences.load(Ordering::Acquire);
            if fences != fences_handled {
                fences_handled = fences;
                match reopen(&inner, index) {
                    Ok(new) => stream = new,
                    Err(e) => return inner.fail(conn, e),
                }
                continue;
            }
        }
        let resend_from = conn.resend_from.swap(u64::MAX, Ordering::AcqRel);
        if resend_from != u64::MAX {
            conn.backpressure_retries.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(backoff);
            if inner.closed.load(Ordering::Relaxed) {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_millis(500));
            let tail: Vec<InFlight> = {
                let mut unacked = conn.unacked.lock();
                let keep = unacked.iter().take_while(|f| f.seq < resend_from).count();
                unacked.drain(keep..).collect()
            };
            let epoch = q.epoch.load(Ordering::Acquire);
            let mut written = true;
            for f in &tail {
                let header = batch_header(&inner, f.seq, &f.batch, epoch);
                if let Err(e) = write_batch(&mut stream, &header, &f.batch.buf) {
                    if !fenced_meanwhile(fences_handled) {
                        // Back with the unacknowledged ones, for the failover.
                        conn.unacked.lock().extend(tail);
                        return fail(e);
                    }
                    written = false;
                    break;
                }
            }
            if !written {
                // Put them back; the reopen resends them.
                let mut unacked = conn.unacked.lock();
                for f in tail {
                    unacked.push_back(f);
                }
                continue;
            }
            inner.requeue(conn, tail);
            continue;
        }
        // Batches moved here from a dead broker go first and past the in-flight limit:
        // for order 5 the acknowledgements of what is in flight may wait for them.
        let moved = q.moved.lock().pop_front();
        let batch = match moved {
            Some(b) => b,
            None => {
                if inner.config.ack_level > 0
                    && conn.unacked.lock().len() >= inner.config.max_inflight_batches
                {
                    if inner.closed.load(Ordering::Relaxed) {
                        return;
                    }
                    inner.arm_backstop_if_owner(index);
                    let mut g = inner.progress.0.lock();
                    inner.progress.1.wait_for(&mut g, Duration::from_millis(5));
                    continue;
                }
                match next_batch(&inner, index) {
                    Next::Batch(b) => b,
                    Next::Again => continue,
                    Next::Stop => return,
                }
            }
        };
        if let Some((slow, pause)) = inner.slow_queue {
            if slow == index {
                std::thread::sleep(pause);
            }
        }
        let seq = match batch.seq {
            Some(seq) => seq,
            None => {
                let seq = next_seq;
                next_seq += 1;
                seq
            }
        };
        let header = batch_header(&inner, seq, &batch, q.epoch.load(Ordering::Acquire));
        if let Err(e) = write_batch(&mut stream, &header, &batch.buf) {
            if !fenced_meanwhile(fences_handled) {
                // Kept with the unacknowledged batches, for the failover.
                conn.unacked.lock().push_back(InFlight { seq, batch });
                conn.sent.fetch_add(1, Ordering::Release);
                return fail(e);
            }
            // Keep it with the unacknowledged batches: the reopen resends it.
        }
        backoff = Duration::from_millis(5);
        if inner.config.ack_level > 0 {
            inner.requeue(conn, [InFlight { seq, batch }]);
        } else {
            inner.acknowledged([batch.index]);
            inner.recycle(batch.buf);
        }
        conn.sent.fetch_add(1, Ordering::Release);
        inner.notify_progress();
    }
}

/// Order 5, after a fence: opens the connection again with the session's new epoch,
/// counts what the fence reported committed as acknowledged, and resends the rest of
/// this connection's unacknowledged batches in order (the sequencer drops any that turn
/// out to be committed already, so each is delivered exactly once).
fn reopen(inner: &Inner, index: usize) -> Result<TcpStream, Error> {
    let q = &inner.queues[index];
    let conn = &q.conn;
    let session = inner.session.as_ref().expect("order-5 publisher");
    let mut attempts = 0;
    let (mut stream, epoch, hwm) = loop {
        let epoch = session.epoch.load(Ordering::Acquire);
        let hello = Hello {
            role: Role::Publish,
            ack_level: inner.config.ack_level,
            client_id: inner.client_id,
            session_epoch: epoch,
            start_position: 0,
            connection_index: q.connection as u32,
            cursor_count: 0,
            topic: inner.topic.clone(),
            session_key: inner
                .config
                .session_key
                .expect("drawn when the publisher starts"),
        };
        match conn::open(&q.broker, &hello, &[]) {
            // The broker knows less of the session than this connection was told, or
            // more than it ever sent: the session ended (idle, its slot given away) and
            // the marks are gone or another session's.
            Ok((_, ok))
                if ok.next_batch_seq < conn.acked.load(Ordering::Acquire)
                    || ok.next_batch_seq > session.next_seq.load(Ordering::Acquire) =>
            {
                return Err(Error::Broker {
                    broker: q.broker.clone(),
                    code: ErrorCode::SessionExpired,
                    message: format!(
                        "the broker's record of this order-5 session is not this publisher's (it acknowledged up to batch {} and sent up to {}; the broker now expects batch {}): the session ended while idle and its slot went to another session; batches not yet acknowledged may or may not be in the log: start a new publisher and resend them",
                        conn.acked.load(Ordering::Acquire),
                        session.next_seq.load(Ordering::Acquire),
                        ok.next_batch_seq
                    ),
                });
            }
            Ok((stream, ok)) => {
                let hwm = ok
                    .next_batch_seq
                    .max(session.fenced_hwm.load(Ordering::Acquire));
                break (stream, epoch, hwm);
            }
            // Fenced again meanwhile: take the newer epoch and try again.
            Err(e) if e.code() == Some(ErrorCode::SessionFenced) && attempts < 5 => {
                attempts += 1;
                if let Error::Broker { message, .. } = &e {
                    inner.fence(epoch, parse_hwm(message).unwrap_or(0));
                }
            }
            Err(e) => return Err(e),
        }
    };
    let lost = |e: std::io::Error| Error::ConnectionLost {
        broker: q.broker.clone(),
        message: e.to_string(),
    };
    {
        let mut current = q.stream.lock();
        let _ = current.shutdown(std::net::Shutdown::Both);
        *current = stream.try_clone().map_err(lost)?;
    }
    q.epoch.store(epoch, Ordering::Release);
    q.stream_gen.fetch_add(1, Ordering::AcqRel);
    conn.resend_from.store(u64::MAX, Ordering::Release);
    inner.notify_progress();
    let pending: Vec<InFlight> = conn.unacked.lock().drain(..).collect();
    let mut resent = Vec::new();
    for f in pending {
        if f.seq < hwm {
            inner.settle(conn, f);
        } else {
            let header = batch_header(inner, f.seq, &f.batch, epoch);
            write_batch(&mut stream, &header, &f.batch.buf).map_err(lost)?;
            resent.push(f);
        }
    }
    conn.acked.fetch_max(hwm, Ordering::AcqRel);
    inner.requeue(conn, resent);
    inner.notify_progress();
    Ok(stream)
}

/// The committed high-water mark in a SessionFenced error text (`hwm=N`).
fn parse_hwm(message: &str) -> Option<u64> {
    let rest = &message[message.find("hwm=")? + 4..];
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

fn batch_header(inner: &Inner, seq: u64, batch: &Sealed, session_epoch: u64) -> [u8; 128] {
    BatchHeader {
        batch_seq: seq,
        client_id: inner.client_id,
        num_msg: batch.num_msg,
        epoch_created: now_ns(),
        batch_id: batch.batch_id,
        session_epoch,
        total_size: batch.buf.len() as u64,
        ..Default::default()
    }
    .encode()
}

/// `EMBARCADERO_SLOW_CONSUMER_QUEUE=N` and `EMBARCADERO_SLOW_CONSUMER_MS=M` (default 1).
fn slow_queue_from_env() -> Option<(usize, Duration)> {
    let queue = std::env::var("EMBARCADERO_SLOW_CONSUMER_QUEUE")
        .ok()?
        .parse::<i64>()
        .ok()?;
    let ms = std::env::var("EMBARCADERO_SLOW_CONSUMER_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    (queue >= 0).then(|| (queue as usize, Duration::from_millis(ms)))
}

/// Moves the batches of queue `index`, whose broker is gone, to the live brokers:
/// every unacknowledged batch that is not in the global order is dispatched again, and
/// those that are (the head answers from the GOI once it has fenced the dead broker)
/// count as acknowledged. Order 5 resends them all: the sequencer drops any session
/// sequence it already has, so each is delivered exactly once.
fn fail_over(inner: &Inner, index: usize, cause: Error) {
    let q = &inner.queues[index];
    let conn = &q.conn;
    inner.failovers.fetch_add(1, Ordering::AcqRel);
    q.mark_dead();
    let _ = q.stream.lock().shutdown(std::net::Shutdown::Both);
    // The head is about to fence the broker: its other connections will get no more
    // acknowledgements, so they fail over too (their readers see the shutdown). Those to
    // another process of the same id (a restart) are not affected.
    for other in inner.queues.iter().filter(|o| o.process == q.process) {
        if other.is_live() {
            other.mark_dead();
            let _ = other.stream.lock().shutdown(std::net::Shutdown::Both);
        }
    }
    tracing::warn!(broker = %q.broker, "lost the broker ({cause}); moving its batches to the live brokers");
    let result = (|| -> Result<usize> {
        if !inner.wait_until(Duration::from_secs(30), || {
            q.sender_done.load(Ordering::Acquire)
        }) {
            return Err(Error::Timeout(Duration::from_secs(30)));
        }
        // Marked dead: nothing enters the channel any more, so this empties it for good.
        let mut moved: Vec<Sealed> = q.moved.lock().drain(..).collect();
        moved.extend(q.rx.try_iter());
        let unacked: Vec<InFlight> = conn.unacked.lock().drain(..).collect();
        let acked = conn.acked.load(Ordering::Acquire);
        let unknown: Vec<u64> = unacked
            .iter()
            .filter(|f| f.seq >= acked)
            .map(|f| f.batch.batch_id)
            .collect();
        let ordered = if inner.order == 2 && !unknown.is_empty() {
            ordered_on_dead_broker(inner, q, &unknown)?
        } else {
            Vec::new()
        };
        for f in unacked {
            if f.seq < acked || ordered.contains(&f.batch.batch_id) {
                inner.settle(conn, f);
            } else {
                moved.push(f.batch);
            }
        }
        let count = moved.len();
        // Spread over the live queues, in order (order 5 resends by session sequence).
        let n = inner.queues.len();
        let mut next = index + 1;
        for mut batch in moved {
            if inner.order != 5 {
                // Order 2: the new connection numbers it.
                batch.seq = None;
            }
            let mut tried = 0;
            loop {
                if tried == n {
                    return Err(Error::NoLiveBroker);
                }
                let target = &inner.queues[next % n];
                next += 1;
                tried += 1;
                match target.try_take_moved(batch) {
                    Ok(()) => break,
                    Err(b) => batch = b,
                }
            }
        }
        Ok(count)
    })();
    match result {
        Ok(count) => tracing::info!(broker = %q.broker, batches = count, "failover done"),
        Err(e) => inner.fail(conn, e),
    }
    q.moved_out.store(true, Ordering::Release);
    inner.failovers.fetch_sub(1, Ordering::AcqRel);
    inner.notify_progress();
    // The broker may come back (restarted) or others may have joined: look now rather
    // than at the next refresh.
    let _ = inner.membership_wake.try_send(());
}

/// Asks the head which of `batch_ids` (this connection's unacknowledged batches) made
/// it into the order; waits (at most 30 s) until the head has declared the broker dead.
/// A head that cannot be reached fails them at once (were it restarting, it could not
/// answer either), and so does one that restarted since they were sent (410).
fn ordered_on_dead_broker(inner: &Inner, q: &Queue, batch_ids: &[u64]) -> Result<Vec<u64>> {
    let admin = Admin::new(inner.control.as_deref().expect("checked by can_fail_over"));
    let broker = q.process.expect("checked by can_fail_over");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match admin.failover(
            &inner.topic,
            broker.id,
            broker.incarnation,
            inner.client_id,
            batch_ids,
            inner.config.ack_level,
        ) {
            Err(Error::Admin { status: 409, .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// Reads acks and errors of one connection.
fn reader(inner: Arc<Inner>, index: usize) {
    let q = &inner.queues[index];
    let conn = &q.conn;
    let mut generation = q.stream_gen.load(Ordering::Acquire);
    let mut epoch = q.epoch.load(Ordering::Acquire);
    let Ok(mut stream) = q.stream.lock().try_clone() else {
        return;
    };
    // Order 5: after a fence the sender replaces the socket; follow it.
    let next_stream = |generation: u64| -> Option<(u64, u64, TcpStream)> {
        inner.session.as_ref()?;
        if !inner.wait_until(Duration::from_secs(5), || {
            q.stream_gen.load(Ordering::Acquire) != generation
        }) {
            return None;
        }
        let generation = q.stream_gen.load(Ordering::Acquire);
        let epoch = q.epoch.load(Ordering::Acquire);
        let stream = q.stream.lock().try_clone().ok()?;
        Some((generation, epoch, stream))
    };
    loop {
        match conn::read_frame(&mut stream, &q.broker, 64) {
            Ok(Frame::Ack { count }) => {
                let now = Instant::now();
                let mut done = Vec::new();
                {
                    // `acked` moves under the queue lock: the sender checks it under the
                    // same lock when it queues a batch the broker acknowledged before
                    // the sender got to queue it.
                    let mut unacked = conn.unacked.lock();
                    while unacked.front().is_some_and(|f| f.seq < count) {
                        done.push(unacked.pop_front().expect("front exists"));
                    }
                    conn.acked.fetch_max(count, Ordering::AcqRel);
                }
                conn.record_latency(&done, now);
                inner.acknowledged(done.iter().map(|f| f.batch.index));
                conn.acked_batches
                    .fetch_add(done.len() as u64, Ordering::Release);
                for f in done {
                    inner.recycle(f.batch.buf);
                }
                inner.notify_progress();
            }
            Ok(Frame::Error(e)) if e.code == ErrorCode::Backpressure => {
                conn.resend_from.store(e.batch_seq, Ordering::Release);
            }
            Ok(Frame::Error(e))
                if e.code == ErrorCode::SessionFenced && inner.session.is_some() =>
            {
                inner.fence(epoch, parse_hwm(&e.message).unwrap_or(0));
                match next_stream(generation) {
                    Some((g, ep, s)) => (generation, epoch, stream) = (g, ep, s),
                    None => return inner.fail(conn, conn::broker_error(&q.broker, e)),
                }
            }
            Ok(Frame::Error(e)) => {
                return inner.fail(conn, conn::broker_error(&q.broker, e));
            }
            Ok(other) => {
                return inner.fail(
                    conn,
                    Error::Protocol {
                        peer: q.broker.clone(),
                        message: format!("unexpected frame on a publish connection: {other:?}"),
                    },
                );
            }
            Err(e) => {
                if inner.closed.load(Ordering::Relaxed) {
                    inner.notify_progress();
                    return;
                }
                let replaced = || {
                    // Order 5: a fence reopen replaces the socket; give it a moment.
                    inner.session.is_some()
                        && inner.wait_until(Duration::from_millis(200), || {
                            q.stream_gen.load(Ordering::Acquire) != generation
                        })
                };
                if inner.can_fail_over(q) && !replaced() {
                    return fail_over(&inner, index, e);
                }
                // The socket may have been replaced (or closed by the broker for a
                // fence another connection reported): follow it if so.
                match next_stream(generation) {
                    Some((g, ep, s)) => (generation, epoch, stream) = (g, ep, s),
                    None => {
                        inner.fail(conn, e);
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_batch_packs_its_owner_and_a_deadline_never_earlier_than_its_own() {
        let base = Instant::now();
        assert_eq!(OpenBatch::decode(0, base), None, "0: no batch open");
        for (owner, nanos) in [(0, 0), (3, 1), (3, 999), (7, 1000), (65534, 123_456_789)] {
            let open = OpenBatch {
                owner,
                deadline: base + Duration::from_nanos(nanos),
            };
            let back = OpenBatch::decode(open.encode(base), base).unwrap();
            assert_eq!(back.owner, owner);
            assert!(back.deadline >= open.deadline, "rounded up, never early");
            assert!(back.deadline - open.deadline < Duration::from_micros(1));
        }
    }
}
