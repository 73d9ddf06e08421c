//! A broker: one TCP port, one log per topic in the shared region.
//!
//! Owns: its listening socket (and, beside it, the Unix socket of local shared-memory
//! channels, `shm_conn`) and connections; the writer side of its (topic, broker)
//! logs (reservation, PBR commits, segment pool, reclamation); its line of each log's
//! control block (`written_frontier`, `reclaimed_*`); acknowledgements to its
//! publishers; serving subscribers (any broker can serve any topic: the data is all in
//! the region), over TCP or, for a local one, a shared-memory feed (`shm_feed`). It reads, but never writes, sequencer-owned fields (`ordered_pbr`,
//! GOI, `committed_seq`), replica-owned fields (`durable_pbr`, replica progress) and
//! topic metadata (control plane); it reads replicas' segment files to serve
//! subscribers positions that have left memory. Its one write to a sequencer-owned
//! record: raising the last-active stamp of an order-5 session it has a connection of
//! (a `fetch_max`, so it never undoes the sequencer's).
//!
//! Threads: one acceptor, one thread per connection (blocking sockets, payload read
//! straight into the region), and one service thread that advances frontiers,
//! reclaims memory and sends acknowledgements.

mod epoch_open;
mod fault;
mod log_writer;
mod net;
mod payload_wait;
mod publish;
mod resume;
mod service;
mod session;
mod session_end;
mod shm_conn;
mod shm_feed;
mod subscribe;
mod transport;

pub use log_writer::{LogWriter, Reservation, ReserveError, SegmentPool};
pub use resume::LogResume;

use embarcadero_region::{Capacities, Region};
use registry::Registry;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Settings of one broker.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    pub broker_id: u32,
    /// This process's incarnation of the broker id, recorded in the region as the
    /// owner of its logs; a process that finds another incarnation there stops writing.
    pub incarnation: u64,
    pub listen: SocketAddr,
    pub max_message_bytes: u64,
    pub max_batch_bytes: u64,
    /// Stop reading from publishers when this fraction of the broker's segments or of
    /// a PBR ring is in use and cannot be reclaimed...
    pub high_watermark: f64,
    /// ...and resume below this fraction.
    pub low_watermark: f64,
    /// Time spent above the high watermark before a publish is answered with a
    /// retriable BACKPRESSURE error.
    pub backpressure_timeout: Duration,
    /// Longest a batch's payload may take to arrive after its header: its reserved slot
    /// holds up every later batch of the log meanwhile.
    pub payload_timeout: Duration,
    /// Longest sleep of an idle poller.
    pub idle_sleep_max: Duration,
    /// A subscriber that makes no progress for this long stops holding back
    /// reclamation (it gets PositionNotRetained if its data is then reclaimed).
    pub reader_stall_timeout: Duration,
    /// Order 5: a batch more than this many above its session's committed high-water
    /// mark is refused (the sequencer's hold buffer is bounded by the same window).
    pub session_window: u64,
    /// Order 5: a session idle this long may give its slot in the session table to a
    /// new session (the sequencer's setting; the broker refuses a new session only
    /// when no slot is free or idle that long).
    pub session_idle_evict: Duration,
    /// Replica directories (replica 1 first): subscribers of replicated topics read
    /// from them what has left memory.
    pub replica_dirs: Vec<std::path::PathBuf>,
    /// Connections beyond this many are refused (TooManyConnections) as they arrive:
    /// each holds a thread, so the limit bounds what a flood of clients can take.
    pub max_connections: u64,
    /// Connections from one client address beyond this many are refused
    /// (TooManyConnections): one client cannot take every thread and reader slot.
    pub max_connections_per_address: u64,
    /// Reader slots of one topic that subscribers from one client address may hold over
    /// every broker of the region; more are refused (TooManyConnections), so no client
    /// can leave every other subscriber without a pin.
    pub max_subscribers_per_address: u32,
    /// Fault injection for experiments (`None` in normal operation).
    pub fault: Option<Fault>,
    /// Serve local publishers over shared-memory channels too (`shm_conn`), on the
    /// abstract Unix socket `embarcadero_shm::socket::broker_name(listen)`.
    pub shm: bool,
    /// Uids besides the broker's own that may open a shared-memory channel
    /// (`broker.shm_allowed_uids`); anyone else is refused with ShmRefused.
    pub shm_allowed_uids: Vec<u32>,
    /// Largest data ring a channel may bring (`broker.shm_max_ring_bytes`).
    pub shm_max_ring_bytes: usize,
    /// Bytes of each subscriber feed's ring (`broker.shm_feed_bytes`; a power of two
    /// the shm layout accepts, checked by the server's configuration).
    pub shm_feed_bytes: usize,
}

/// Misbehaviour to inject into one broker, to provoke gaps and fences on demand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fault {
    /// Fraction of batches delayed by `delay` before they reach the ring.
    pub delay_fraction: f64,
    pub delay: Duration,
    /// Fraction of batches dropped (committed void) before they reach the ring.
    pub drop_fraction: f64,
    /// Most batches dropped in all (0: no limit).
    pub drop_limit: u64,
}

impl BrokerConfig {
    pub fn new(broker_id: u32, listen: SocketAddr) -> Self {
        Self {
            broker_id,
            incarnation: embarcadero_region::owner::new_incarnation(),
            listen,
            max_message_bytes: 1 << 20,
            max_batch_bytes: 4 << 20,
            high_watermark: 0.90,
            low_watermark: 0.75,
            backpressure_timeout: Duration::from_secs(5),
            payload_timeout: Duration::from_secs(30),
            idle_sleep_max: Duration::from_millis(20),
            reader_stall_timeout: Duration::from_secs(30),
            session_window: 4096,
            session_idle_evict: Duration::from_secs(600),
            replica_dirs: Vec::new(),
            max_connections: 4096,
            max_connections_per_address: 1024,
            max_subscribers_per_address: 128,
            fault: None,
            shm: true,
            shm_allowed_uids: Vec::new(),
            shm_max_ring_bytes: 256 << 20,
            shm_feed_bytes: embarcadero_shm::layout::FEED_CAPACITY,
        }
    }
}

/// Counters exported on `/metrics`; updated once per batch, never per message.
#[derive(Debug, Default)]
pub struct BrokerMetrics {
    pub publish_batches: AtomicU64,
    pub publish_messages: AtomicU64,
    pub publish_bytes: AtomicU64,
    pub subscribe_batches: AtomicU64,
    pub subscribe_bytes: AtomicU64,
    pub acks_sent: AtomicU64,
    pub errors_sent: AtomicU64,
    pub backpressure_errors: AtomicU64,
    pub backpressure_waits: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    /// Connections refused because `max_connections` were open.
    pub connections_refused: AtomicU64,
    /// Connections refused because their address had `max_connections_per_address` open.
    pub connections_refused_per_address: AtomicU64,
    /// Subscriber connections closed because the subscriber sent bytes after its hello
    /// (a subscriber sends nothing) or left while it had nothing to receive.
    pub subscribers_dropped: AtomicU64,
    pub reclaimed_batches: AtomicU64,
    /// Partly filled last segments that idle logs gave back to a pool running short.
    pub retired_tails: AtomicU64,
    /// Order 5: batches held back because they were beyond their session's window.
    pub session_window_waits: AtomicU64,
    /// Order 5: hellos and connections refused because their session is bound to
    /// another key (SessionKeyMismatch): hijack attempts, or clients that lost their key.
    pub session_key_refusals: AtomicU64,
    /// Orders 0 and 1: service rounds that stopped numbering a log's batches because
    /// the next one would reach its topic's position ceiling (the control plane fell
    /// behind raising it).
    pub ceiling_stalls: AtomicU64,
    pub stages: StageTimes,
}

/// Cumulative time spent in each stage of the broker's data path, in nanoseconds:
/// one clock read per stage boundary per batch (or per service round), cheap enough to
/// leave on. Exported on /metrics and summarised by `embarcadero bench`.
#[derive(Debug, Default)]
pub struct StageTimes {
    /// Reserving a PBR slot and log space, including waits for memory (backpressure).
    pub reserve: AtomicU64,
    /// Receiving the payload from the socket straight into the region.
    pub receive: AtomicU64,
    /// Walking the message headers.
    pub validate: AtomicU64,
    /// Committing the PBR slot and ringing the doorbells.
    pub commit: AtomicU64,
    /// Service thread: advancing written frontiers.
    pub frontier: AtomicU64,
    /// Service thread: reclaiming memory.
    pub reclaim: AtomicU64,
    /// Service thread: sending acknowledgements.
    pub ack_send: AtomicU64,
    /// Per batch, from just before its commit (the end of its validation, whose clock
    /// read it reuses) until the service thread found it acknowledgeable:
    /// the epoch wait and sequencing for orders 2 and 5, the replicas for ack 2, the
    /// service thread's wake-up for every order. Batch-time, not thread time: batches
    /// in flight together each count.
    pub ack_wait: AtomicU64,
}

impl StageTimes {
    /// Adds the time since `since` to `stage` and returns now, the next stage's start.
    pub fn lap(stage: &AtomicU64, since: std::time::Instant) -> std::time::Instant {
        let now = std::time::Instant::now();
        stage.fetch_add((now - since).as_nanos() as u64, Ordering::Relaxed);
        now
    }
}

/// State shared by a broker's threads.
pub(crate) struct Shared {
    pub config: BrokerConfig,
    pub region: Arc<Region>,
    pub pool: Arc<SegmentPool>,
    /// One writer per topic slot, created when the first publisher arrives.
    pub writers: Vec<OnceLock<Arc<LogWriter>>>,
    /// Per topic slot, this broker's connections on the topic (`TopicConn`): a deleted
    /// topic's log is released once none is left.
    pub topic_conns: Vec<AtomicU64>,
    pub metrics: Arc<BrokerMetrics>,
    pub shutdown: AtomicBool,
    /// Set by the service thread while memory is above the high watermark.
    pub paused: AtomicBool,
    pub new_publishers: crossbeam_channel::Sender<Arc<publish::PublishConn>>,
    pub connections: Registry,
    /// Batches dropped by fault injection so far.
    pub fault_drops: AtomicU64,
    /// Payload bytes staged by connections at the moment (`payload_wait::stage`).
    pub staged_bytes: AtomicU64,
    /// The region was created on this host since it booted, so every process of the
    /// region reads this host's `CLOCK_MONOTONIC`: commits are time-stamped
    /// (`committed_ns`). A broker on another host leaves the stamp 0.
    pub stamp_commits: bool,
}

impl Shared {
    /// False once another process has taken over this broker id's logs (this one was
    /// declared dead and replaced): it must write nothing more to them.
    pub fn owns_logs(&self) -> bool {
        self.region
            .broker_owner(self.config.broker_id)
            .incarnation()
            == self.config.incarnation
    }

    pub fn writer(&self, topic: u32) -> &Arc<LogWriter> {
        self.writers[topic as usize].get_or_init(|| {
            Arc::new(LogWriter::new(
                self.region.clone(),
                self.pool.clone(),
                topic,
                self.config.broker_id,
            ))
        })
    }
}

/// A connection's hold on its topic: while any is held, the broker keeps the topic's
/// log (and its segments) even once the topic is deleted, since the connection may still
/// be writing into it or reading from it.
pub(crate) struct TopicConn<'a> {
    shared: &'a Shared,
    topic: u32,
}

impl<'a> TopicConn<'a> {
    /// Holds `topic` for a connection, unless it has been deleted: `None` then. The count
    /// is raised before the topic's state is read, and the service thread reads them the
    /// other way round (both sequentially consistent), so either the connection sees the
    /// deletion or the service thread sees the connection and waits for it.
    pub fn hold(shared: &'a Shared, topic: u32) -> Option<Self> {
        shared.topic_conns[topic as usize].fetch_add(1, Ordering::SeqCst);
        let held = Self { shared, topic };
        (!shared.region.topic_deleted(topic)).then_some(held)
    }
}

impl Drop for TopicConn<'_> {
    fn drop(&mut self) {
        let left = self.shared.topic_conns[self.topic as usize].fetch_sub(1, Ordering::SeqCst);
        // Wrapped, the count would keep a deleted topic's log from being released.
        assert!(
            left >= 1,
            "topic {}: more holds dropped than taken",
            self.topic
        );
        if left == 1 && self.shared.region.topic_deleted(self.topic) {
            // The last one: the service thread can release the log now.
            self.shared
                .region
                .broker_bell(self.shared.config.broker_id)
                .ring();
        }
    }
}

/// A running broker. Dropping it stops it.
pub struct Broker {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    /// The abstract socket name of its shared-memory channels, if it serves them.
    shm_name: Option<String>,
    threads: Vec<JoinHandle<()>>,
}

impl Broker {
    /// Binds the port and starts the broker's threads.
    pub fn start(config: BrokerConfig, region: Arc<Region>) -> std::io::Result<Self> {
        let caps = region.capacities();
        check_fits_region(&config, &caps)?;
        let listener = TcpListener::bind(config.listen).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "broker {} cannot listen on {}: {e} (is another server running? choose another port with --base-port)",
                    config.broker_id, config.listen
                ),
            )
        })?;
        let local_addr = listener.local_addr()?;
        let broker = config.broker_id;
        resume::take_ownership(&region, broker, config.incarnation).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("broker {broker} cannot fence off the previous process of its logs: {e}; stop it by hand and start again"),
            )
        })?;
        let (pool, resumed) = resume::resume_broker(&region, broker);
        let writers: Vec<OnceLock<Arc<LogWriter>>> =
            (0..caps.max_topics).map(|_| OnceLock::new()).collect();
        for (topic, r) in resumed.iter().filter(|(_, r)| r.next_pbr > 0) {
            let writer = resume::resumed_writer(region.clone(), pool.clone(), *topic, broker, r);
            let _ = writers[*topic as usize].set(Arc::new(writer));
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            pool,
            writers,
            topic_conns: (0..caps.max_topics).map(|_| AtomicU64::new(0)).collect(),
            metrics: Arc::new(BrokerMetrics::default()),
            shutdown: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            new_publishers: tx,
            connections: Registry::default(),
            fault_drops: AtomicU64::new(0),
            staged_bytes: AtomicU64::new(0),
            stamp_commits: region.created_this_boot(),
            config,
            region,
        });
        let mut threads = spawn_threads(&shared, rx, listener)?;
        let shm_name = if shared.config.shm {
            start_shm(&shared, local_addr, &mut threads)
        } else {
            None
        };
        Ok(Self {
            shared,
            local_addr,
            shm_name,
            threads,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The abstract Unix socket name local clients open shared-memory channels on, if
    /// this broker serves them.
    pub fn shm_name(&self) -> Option<&str> {
        self.shm_name.as_deref()
    }

    pub fn id(&self) -> u32 {
        self.shared.config.broker_id
    }

    /// The process serving this broker id (see `BrokerConfig::incarnation`).
    pub fn incarnation(&self) -> u64 {
        self.shared.config.incarnation
    }

    pub fn metrics(&self) -> Arc<BrokerMetrics> {
        self.shared.metrics.clone()
    }

    /// This broker's pool of BLog segments (for gauges).
    pub fn segment_pool(&self) -> Arc<SegmentPool> {
        self.shared.pool.clone()
    }

    /// Stops accepting, closes every connection and joins the broker's threads.
    pub fn stop(&mut self) {
        if self.shared.shutdown.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the acceptor with a connection of our own, then close every socket so
        // connection threads blocked in reads return.
        let _ = TcpStream::connect_timeout(&self.local_addr, Duration::from_secs(1));
        if let Some(name) = &self.shm_name {
            let _ = embarcadero_shm::socket::connect(name);
        }
        self.shared.connections.shutdown_all();
        self.shared
            .region
            .broker_bell(self.shared.config.broker_id)
            .ring();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.shared.connections.wait_empty(Duration::from_secs(5));
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Refuses a configuration the region cannot serve: a broker id beyond the region's
/// brokers, or a batch limit above its segment size (a batch is reserved inside one segment).
fn check_fits_region(config: &BrokerConfig, caps: &Capacities) -> std::io::Result<()> {
    if config.broker_id >= caps.brokers {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "broker id {} is outside the region's {} brokers",
                config.broker_id, caps.brokers
            ),
        ));
    }
    if config.max_batch_bytes > caps.segment_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "max_batch_bytes {} exceeds the region's segment size {}",
                config.max_batch_bytes, caps.segment_bytes
            ),
        ));
    }
    Ok(())
}

/// Starts the broker's service thread (fed new publishers on `new_publishers`) and then
/// its TCP acceptor on `listener`; returns their handles in that order.
fn spawn_threads(
    shared: &Arc<Shared>,
    new_publishers: crossbeam_channel::Receiver<Arc<publish::PublishConn>>,
    listener: TcpListener,
) -> std::io::Result<Vec<JoinHandle<()>>> {
    let mut threads = Vec::new();
    let s = shared.clone();
    threads.push(
        std::thread::Builder::new()
            .name(format!("broker{}-service", s.config.broker_id))
            .spawn(move || service::run(s, new_publishers))?,
    );
    let s = shared.clone();
    threads.push(
        std::thread::Builder::new()
            .name(format!("broker{}-accept", s.config.broker_id))
            .spawn(move || accept_loop(s, listener))?,
    );
    Ok(threads)
}

/// Listens for shared-memory channels beside the TCP port; a broker that cannot (the
/// name is taken by another process) serves TCP only, and says so.
fn start_shm(
    shared: &Arc<Shared>,
    local_addr: SocketAddr,
    threads: &mut Vec<JoinHandle<()>>,
) -> Option<String> {
    let name = embarcadero_shm::socket::broker_name(local_addr);
    let listener = match embarcadero_shm::socket::listen(&name) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(
                broker = shared.config.broker_id,
                "no shared-memory channels: cannot listen on the abstract socket {name:?}: {e}; local clients use TCP"
            );
            return None;
        }
    };
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("broker{}-shm-accept", s.config.broker_id))
        .spawn(move || shm_conn::accept_loop(s, listener));
    match spawned {
        Ok(t) => {
            threads.push(t);
            Some(name)
        }
        Err(e) => {
            tracing::warn!("no shared-memory channels: cannot start their acceptor: {e}");
            None
        }
    }
}

/// Failed accepts, logged at most once a second with how many failed meanwhile: out of
/// file descriptors, every pending connection fails its accept in turn, and one line
/// each filled the log at 400 lines a second (an adversarial run, session 33).
struct AcceptFailures {
    since_logged: u64,
    logged_at: Option<Instant>,
}

impl AcceptFailures {
    fn note(&mut self, broker: u32, e: &std::io::Error) {
        self.since_logged += 1;
        let now = Instant::now();
        if self
            .logged_at
            .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
        {
            return;
        }
        let n = std::mem::take(&mut self.since_logged);
        let hint = if e.raw_os_error() == Some(libc::EMFILE) {
            "; out of file descriptors: raise the open-files limit (ulimit -Hn, systemd LimitNOFILE=) or lower broker.max_connections"
        } else {
            ""
        };
        tracing::warn!(broker, failed = n, "accept failed: {e}{hint}");
        self.logged_at = Some(now);
    }
}

fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut failures = AcceptFailures {
        since_logged: 0,
        logged_at: None,
    };
    for stream in listener.incoming() {
        if shared.shutdown.load(Ordering::SeqCst) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                failures.note(shared.config.broker_id, &e);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let s = shared.clone();
        let clone = match stream.try_clone() {
            Ok(c) => c,
            Err(_) => continue,
        };
        // Counted here, before the thread exists, so that a burst of connections cannot
        // slip past the limit.
        let open = &shared.metrics.connections_open;
        if open.fetch_add(1, Ordering::Relaxed) >= shared.config.max_connections {
            open.fetch_sub(1, Ordering::Relaxed);
            net::refuse_over_limit(&shared, stream, net::Limit::Broker);
            continue;
        }
        let address = stream.peer_addr().map(|a| a.ip()).ok();
        let per_address = shared.config.max_connections_per_address;
        let Some(id) = shared.connections.add(clone, address, per_address) else {
            open.fetch_sub(1, Ordering::Relaxed);
            net::refuse_over_limit(&shared, stream, net::Limit::PerAddress);
            continue;
        };
        let spawned = std::thread::Builder::new()
            .name(format!("broker{}-conn", shared.config.broker_id))
            .spawn(move || {
                s.metrics.connections_total.fetch_add(1, Ordering::Relaxed);
                let _registered = Registered {
                    registry: &s.connections,
                    open: &s.metrics.connections_open,
                    id,
                };
                net::handle_connection(&s, stream);
            });
        match spawned {
            Ok(_detached) => {}
            Err(e) => {
                tracing::error!("cannot spawn a connection thread: {e}");
                shared.connections.remove(id);
                open.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// A connection thread's entry in the registry and in the open-connection count, given
/// back when the thread ends, also by a panic (a stale entry would keep a socket open
/// and make `stop` wait for a thread that is gone).
pub(crate) struct Registered<'a> {
    pub registry: &'a Registry,
    pub open: &'a AtomicU64,
    pub id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let open = self.open.fetch_sub(1, Ordering::Relaxed);
        // Wrapped, the count would refuse every later connection as over the limit.
        debug_assert!(open >= 1, "more connections closed than opened");
        self.registry.remove(self.id);
    }
}

/// Open connections, so that `stop` can close them. Touched on connect and
/// disconnect only, never per batch.
mod registry {
    use std::collections::HashMap;
    use std::net::{IpAddr, Shutdown, TcpStream};
    use std::os::unix::net::UnixStream;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    #[derive(Default)]
    pub struct Registry {
        inner: Mutex<Inner>,
    }

    #[derive(Default)]
    struct Inner {
        /// The id the last connection got; ids only grow.
        last_id: u64,
        /// Open connections by id, with the client address each counts against.
        streams: HashMap<u64, (Socket, Option<IpAddr>)>,
        /// Open connections per client address; an address with none has no entry.
        per_address: HashMap<IpAddr, u64>,
    }

    /// A connection's socket: TCP, or the Unix socket of a shared-memory channel.
    enum Socket {
        Tcp(TcpStream),
        Unix(UnixStream),
    }

    impl Socket {
        fn shutdown(&self) {
            let _ = match self {
                Socket::Tcp(s) => s.shutdown(Shutdown::Both),
                Socket::Unix(s) => s.shutdown(Shutdown::Both),
            };
        }
    }

    impl Registry {
        /// Registers a shared-memory channel's socket (local: no address limit).
        pub fn add_unix(&self, stream: UnixStream) -> u64 {
            let mut g = self.inner.lock().unwrap();
            g.last_id += 1;
            let id = g.last_id;
            g.streams.insert(id, (Socket::Unix(stream), None));
            id
        }

        /// Registers a connection from `address`, unless that address already has
        /// `per_address_limit` open: `None` then.
        pub fn add(
            &self,
            stream: TcpStream,
            address: Option<IpAddr>,
            per_address_limit: u64,
        ) -> Option<u64> {
            let mut g = self.inner.lock().unwrap();
            if let Some(ip) = address {
                let count = g.per_address.entry(ip).or_insert(0);
                if *count >= per_address_limit {
                    if *count == 0 {
                        g.per_address.remove(&ip);
                    }
                    return None;
                }
                *count += 1;
            }
            g.last_id += 1;
            let id = g.last_id;
            g.streams.insert(id, (Socket::Tcp(stream), address));
            Some(id)
        }

        pub fn remove(&self, id: u64) {
            // Also from a panicking thread: a poisoned lock still guards a valid map.
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let Some((_, Some(ip))) = g.streams.remove(&id) else {
                return;
            };
            // Runs from a drop guard, also while unwinding: it must not panic there.
            let count = g.per_address.entry(ip).or_insert(0);
            debug_assert!(*count > 0, "per-address counts never go below zero");
            *count = count.saturating_sub(1);
            if *count == 0 {
                g.per_address.remove(&ip);
            }
        }

        pub fn shutdown_all(&self) {
            for (stream, _) in self.inner.lock().unwrap().streams.values() {
                stream.shutdown();
            }
        }

        #[cfg(test)]
        pub fn len(&self) -> usize {
            self.inner.lock().unwrap().streams.len()
        }

        /// Waits (bounded) for every connection thread to deregister after
        /// `shutdown_all`; connection threads are detached, so this is how `stop`
        /// knows they are gone.
        pub fn wait_empty(&self, limit: Duration) {
            let deadline = Instant::now() + limit;
            while !self.inner.lock().unwrap().streams.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_thread_that_panics_still_deregisters() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let registry = Registry::default();
        let open = AtomicU64::new(1);
        let ip = Some(client.local_addr().unwrap().ip());
        let id = registry.add(client, ip, 1).unwrap();
        assert_eq!(registry.len(), 1);
        let outcome = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let _registered = Registered {
                        registry: &registry,
                        open: &open,
                        id,
                    };
                    panic!("a bug in a connection handler");
                })
                .join()
        });
        assert!(outcome.is_err(), "the thread panicked");
        assert_eq!(registry.len(), 0, "the socket clone is no longer held");
        assert_eq!(open.load(Ordering::Relaxed), 0);
        let again = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(
            registry.add(again, ip, 1).is_some(),
            "the address's count was given back too"
        );
    }

    #[test]
    fn an_address_gets_at_most_its_limit_of_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let connect = || std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let registry = Registry::default();
        let a: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let b: std::net::IpAddr = "127.0.0.2".parse().unwrap();
        let first = registry.add(connect(), Some(a), 2).unwrap();
        registry.add(connect(), Some(a), 2).unwrap();
        assert_eq!(registry.add(connect(), Some(a), 2), None, "a third from a");
        assert!(registry.add(connect(), Some(b), 2).is_some(), "b is not a");
        registry.remove(first);
        assert!(
            registry.add(connect(), Some(a), 2).is_some(),
            "a place came free"
        );
    }
}
