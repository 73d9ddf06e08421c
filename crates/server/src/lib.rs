//! The server processes: the embedded server (control plane, N brokers and the
//! sequencer in one process, all attached to one region file in the data directory),
//! and in cluster mode the head (the same, with only some brokers local and possibly
//! an external sequencer), followers ([`follower`]) and the external sequencer
//! ([`sequencer_process`]).
//!
//! Owns: the data directory (region file, `topics.json`, a lock file), the control
//! plane (the only writer of topic metadata), cluster membership ([`cluster`]), the
//! admin HTTP API and `/metrics`, and the lifecycle of the brokers and the sequencer it
//! starts. It does not touch the data path itself: brokers and the sequencer do.

pub mod cluster;
pub mod config;
pub mod control;
pub mod cpu;
pub mod election;
pub mod failover;
pub mod follower;
#[doc(hidden)]
pub mod fuzzing;
pub mod health;
mod http;
pub mod http_server;
mod metrics;
mod open_files;
pub mod positions;
mod rates;
mod replica_dirs;
mod reserve;
mod room;
mod running_clock;
pub mod sequencer_process;
mod services;
mod sigbus;
pub mod workflow_proxy;

pub use config::ServerConfig;
pub use control::{BrokerLogInfo, TopicDefaults, TopicInfo, TopicSpec};

use embarcadero_broker::{Broker, BrokerConfig, BrokerMetrics, SegmentPool};
use embarcadero_region::Region;
use embarcadero_replication::recovery::{self, Resume};
use embarcadero_replication::{Replicas, ReplicationConfig, ReplicationMetrics, TopicStore};
use embarcadero_sequencer::{Lease, Sequencer, SequencerConfig, SequencerMetrics};
use std::collections::HashMap;
use std::fs::File;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(
        "cannot use the data directory ({path}): {source}; make it writable by this user, or choose another with --data-dir"
    )]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot use the directory of disk replica {replica}, {path}: {source}; topics with disk replicas keep their copies there: fix its path or permissions (replication.dirs, EMBARCADERO_REPLICATION_DIRS)"
    )]
    ReplicaDir {
        replica: u32,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot read the previous region {path}: {source}; it may hold acknowledged messages the disk replicas do not have yet: fix its permissions (or the disk) and start again, or move the file away to start from the disk replicas alone (memory-only topics then start empty)"
    )]
    PreviousRegion {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("data directory {0} is in use by another embarcadero server; stop it or choose another --data-dir")]
    Locked(PathBuf),
    #[error(transparent)]
    Region(#[from] embarcadero_region::RegionError),
    #[error(transparent)]
    Topics(#[from] control::TopicError),
    #[error("cannot recover topic {topic:?} from its replicas: {source}; check the replica directories (replication.dirs) and their disks")]
    Recovery {
        topic: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Start(String),
}

/// What the admin API needs to know about one broker.
pub(crate) struct BrokerInfo {
    pub id: u32,
    pub addr: SocketAddr,
    pub metrics: Arc<BrokerMetrics>,
    pub pool: Arc<SegmentPool>,
}

/// State shared with the admin API thread.
pub(crate) struct Inner {
    pub config: ServerConfig,
    pub region: Arc<Region>,
    pub control: control::ControlPlane,
    pub brokers: Vec<BrokerInfo>,
    /// The embedded sequencer's counters (`None` with an external sequencer).
    pub sequencer_metrics: Option<Arc<SequencerMetrics>>,
    pub replication_metrics: Arc<ReplicationMetrics>,
    pub membership: cluster::Membership,
    pub started: Instant,
    /// Connections the admin API is serving right now (`http_server::HttpServer`).
    pub control_connections: Arc<std::sync::atomic::AtomicUsize>,
    /// Recent counter samples, for the rates `status` shows (`rates::watch`).
    pub rates: rates::Rates,
    /// Services beside the log that announced themselves (`/v1/services`).
    pub services: services::Services,
    /// Counters of the workflow API forwarded to the orchestrator (`workflow_proxy`).
    pub workflow_proxy: workflow_proxy::ProxyMetrics,
}

/// A running embedded server. Dropping it stops it.
pub struct Server {
    inner: Arc<Inner>,
    brokers: Vec<Broker>,
    /// The embedded sequencer and its lease (`None` with an external sequencer).
    sequencer: Option<(Sequencer, Lease)>,
    replicas: Replicas,
    /// The admin API: each connection on a thread of its own, so a slow call (a
    /// failover query waits for the sequencer) holds up no heartbeat.
    http: Option<http_server::HttpServer>,
    control_addr: SocketAddr,
    /// Release what dead followers held (`watch_membership`), raise position ceilings
    /// (`watch_ceilings`) and sample counters for rates (`rates::watch`).
    monitors: Vec<std::thread::JoinHandle<()>>,
    monitor_stop: Arc<std::sync::atomic::AtomicBool>,
    _lock: File,
}

impl Server {
    pub fn start(config: ServerConfig) -> Result<Self, ServerError> {
        config.validate()?;
        open_files::prepare(&config);
        // Refused before anything is touched: clients could not use what it advertises.
        let advertised = config.advertised_ip()?;
        let dir = config.data_dir.clone();
        let fresh = !dir.exists();
        std::fs::create_dir_all(&dir).map_err(|source| ServerError::DataDir {
            path: dir.clone(),
            source,
        })?;
        let mut lock = Some(lock_data_dir(&dir)?);
        let started = Self::start_locked(config, advertised, &mut lock);
        // A start that fails in a data directory it made leaves none behind (a taken
        // port would otherwise leave a lock file and empty replica directories). Only
        // while it holds the lock: another start racing it for the new directory, which
        // lost the lock or takes it next, must not see its directory removed.
        if started.is_err() && fresh {
            assert!(lock.is_some(), "a failed start still holds the lock");
            let _ = std::fs::remove_dir_all(&dir);
        }
        started
    }

    /// The rest of [`Self::start`]: takes the data directory's `lock` once started.
    fn start_locked(
        config: ServerConfig,
        advertised: IpAddr,
        lock: &mut Option<File>,
    ) -> Result<Self, ServerError> {
        replica_dirs::check_replica_dirs(&config.replica_dirs())?;
        // Ports before the region: a port in use is refused before a region file of a
        // gigabyte or more is made for nothing (and left behind).
        let ip = bind_ip(&config)?;
        let (listener, control_addr) = bind_control(ip, config.control_port)?;
        check_broker_ports(&config, ip)?;
        // Before anything else touches the region: the previous one is retired below.
        room::check_region_room(&config)?;
        sigbus::explain_on_sigbus(&config.region_path());
        let replica_dirs = config.replica_dirs();
        let (resumes, stores) = recover(&config, &replica_dirs)?;
        let (region, control) = open_region(&config, &replica_dirs, &resumes)?;
        let replicas = Replicas::start(region.clone(), replication_config(&config), stores)
            .map_err(|e| ServerError::Start(format!("cannot start the replica workers: {e}")))?;
        let sequencer = if config.cluster.sequencer == "embedded" {
            Some(start_sequencer(&config, &region)?)
        } else {
            None
        };
        let brokers = start_brokers(&config, &region, ip, &replica_dirs)?;
        let inner = Arc::new(Inner {
            brokers: broker_infos(&brokers, advertised),
            sequencer_metrics: sequencer.as_ref().map(|(s, _)| s.metrics()),
            replication_metrics: replicas.metrics(),
            membership: membership(&config, &brokers, advertised),
            config,
            region,
            control,
            started: Instant::now(),
            control_connections: Default::default(),
            rates: Default::default(),
            services: Default::default(),
            workflow_proxy: Default::default(),
        });
        let http = start_admin_api(listener, &inner)?;
        let (monitors, monitor_stop) = start_monitors(&inner)?;
        tracing::info!(
            control = %control_addr,
            brokers = ?inner.brokers.iter().map(|b| b.addr.to_string()).collect::<Vec<_>>(),
            data_dir = %inner.config.data_dir.display(),
            "embarcadero server started"
        );
        Ok(Self {
            inner,
            brokers,
            sequencer,
            replicas,
            http: Some(http),
            control_addr,
            monitors,
            monitor_stop,
            _lock: lock.take().expect("held until the start succeeds"),
        })
    }

    /// Address of the admin API (`http://{addr}/v1/...`).
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The brokers' addresses as clients reach them (`advertise`, else the bound ones).
    pub fn broker_addrs(&self) -> Vec<SocketAddr> {
        self.inner.brokers.iter().map(|b| b.addr).collect()
    }

    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.inner.region
    }

    pub fn create_topic(&self, spec: TopicSpec) -> Result<TopicInfo, control::TopicError> {
        let spec = self.inner.control.create(spec)?;
        self.inner.control.describe(&spec.name)
    }

    /// Deletes a topic (see `ControlPlane::delete`); returns it as it was just before.
    pub fn delete_topic(&self, name: &str) -> Result<TopicInfo, control::TopicError> {
        self.inner.control.delete(name)
    }

    pub fn topic(&self, name: &str) -> Result<TopicInfo, control::TopicError> {
        self.inner.control.describe(name)
    }

    /// Stops the sequencer and starts a new one on the same region, which rebuilds its
    /// state (cursors, positions, order-5 sessions) from the region alone. Brokers keep
    /// accepting batches meanwhile; they are ordered once the new sequencer runs.
    pub fn restart_sequencer(&mut self) -> Result<(), ServerError> {
        // Stop the old one and release its lease before the new one takes it.
        self.sequencer = None;
        self.sequencer = Some(start_sequencer(&self.inner.config, &self.inner.region)?);
        Ok(())
    }

    /// Stops the admin API, the brokers and the sequencer.
    pub fn stop(&mut self) {
        self.monitor_stop
            .store(true, std::sync::atomic::Ordering::Release);
        for t in self.monitors.drain(..) {
            t.thread().unpark();
            let _ = t.join();
        }
        if let Some(mut http) = self.http.take() {
            http.stop();
        }
        for b in &mut self.brokers {
            b.stop();
        }
        if let Some((sequencer, _lease)) = &mut self.sequencer {
            sequencer.stop();
        }
        self.sequencer = None;
        self.replicas.stop();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The IP address the brokers and the admin API bind to (`bind`), refused when it is
/// not one.
fn bind_ip(config: &ServerConfig) -> Result<IpAddr, ServerError> {
    config.bind.parse().map_err(|e| {
        ServerError::Start(format!(
            "bind address {:?} is not an IP address: {e}",
            config.bind
        ))
    })
}

/// What the admin API tells about each embedded broker: its address as clients reach
/// it (the `advertised` IP, the bound port) and its figures.
fn broker_infos(brokers: &[Broker], advertised: IpAddr) -> Vec<BrokerInfo> {
    brokers
        .iter()
        .map(|b| BrokerInfo {
            id: b.id(),
            addr: SocketAddr::new(advertised, b.local_addr().port()),
            metrics: b.metrics(),
            pool: b.segment_pool(),
        })
        .collect()
}

/// Once per heartbeat interval: a follower that has been declared dead no longer serves
/// its subscribers (they reconnect elsewhere), so its reader slots are released;
/// otherwise their pins would hold log memory, and with it every publisher of a
/// memory-only topic, until `broker.reader_stall_timeout_ms`. A follower declared dead
/// may still be serving, though (it missed heartbeats under load, then rejoins): only
/// slots whose own heartbeat has stopped for the death timeout are released, pass after
/// pass until none of the broker's is left, it is alive again, or the stall timeout has
/// passed (after which its pins hold nothing anyway). One still dead then is fenced
/// (`fence_declared_dead`): it had that long to rejoin.
fn watch_membership(inner: &Inner, stop: &std::sync::atomic::AtomicBool) {
    let cluster = &inner.config.cluster;
    let interval = Duration::from_millis(cluster.heartbeat_interval_ms);
    let death = interval * cluster.heartbeat_misses;
    // The membership's running clock counts at most half the death timeout per look:
    // looking at least every quarter of it keeps that clock at the wall's pace while
    // the head runs, whatever `heartbeat_misses` is (1 makes the interval the timeout).
    let look = interval.min(death / 4);
    let stall = Duration::from_millis(inner.config.broker.reader_stall_timeout_ms);
    // Brokers whose slots are being released: the incarnation declared dead, when, and
    // the slots the last pass found being claimed.
    let mut releasing: Vec<Releasing> = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        for (broker, incarnation) in inner.membership.newly_dead() {
            tracing::warn!(
                broker,
                "broker declared dead (no heartbeat for {death:?}); its subscribers' reader slots are released once they stop beating"
            );
            releasing.retain(|r| r.broker != broker);
            releasing.push(Releasing {
                broker,
                incarnation,
                since: inner.membership.running_now(),
                claims: Vec::new(),
                slots_left: true,
            });
        }
        releasing.retain_mut(|r| {
            // Rejoined: the same process serves its subscribers again.
            if inner.membership.is_alive_as(r.broker, r.incarnation) {
                return false;
            }
            if inner.membership.running_now().saturating_sub(r.since) > stall {
                fence_declared_dead(inner, r.broker, r.incarnation);
                return false;
            }
            if r.slots_left {
                r.slots_left = release_slots_of_dead(inner, r, death);
            }
            true
        });
        // A period, not a wait for an event: `stop` unparks it.
        std::thread::park_timeout(look);
    }
}

/// One pass releasing the reader slots of the dead broker `r` not beaten for `death`;
/// whether some of its slots are still beaten.
fn release_slots_of_dead(inner: &Inner, r: &mut Releasing, death: Duration) -> bool {
    let pass = inner
        .region
        .release_reader_slots(r.broker, death, &mut r.claims);
    if pass.freed > 0 {
        tracing::warn!(
            broker = r.broker,
            released = pass.freed,
            "released its subscribers' reader slots (broker declared dead, slots not beaten for {death:?})"
        );
    }
    pass.live > 0
}

/// Fences the logs of `broker`, declared dead as process `incarnation` a stall timeout
/// ago and not back (a fenced follower cannot rejoin: it must restart, and its new
/// process resumes the logs). Fencing otherwise waits for an order-2 publisher's failover
/// to ask about its batches, or for a new process to claim the id; a broker that died
/// under order-5 publishers only, or with none connected, was never fenced, and the
/// sequencer then waited for it to reclaim its batches before reusing their GOI slots:
/// the topic stalled for good a GOI's length of batches after the death. A fenced log's
/// batches free their slots once no one needs them (`Core::dead_brokers_batch_released`).
fn fence_declared_dead(inner: &Inner, broker: u32, incarnation: u64) {
    let fenced = inner
        .membership
        .fence_if_dead(broker, Some(incarnation), || {
            crate::failover::fence_broker(&inner.region, broker)
        });
    if let Ok(Some(logs @ 1..)) = fenced {
        tracing::warn!(
            broker,
            logs,
            "dead broker fenced: its uncommitted slots will never be ordered"
        );
    }
}

/// A broker declared dead whose reader slots `watch_membership` is releasing.
struct Releasing {
    broker: u32,
    /// The follower process declared dead: if it rejoins, its slots are its own again.
    incarnation: u64,
    /// When it was declared dead, on the membership's running clock (a head that did not
    /// run meanwhile does not fence a follower whose rejoin waits in its socket).
    since: Duration,
    /// The slots the last pass found being claimed for it.
    claims: Vec<(u32, u32)>,
    /// Some of its reader slots were still beaten at the last pass.
    slots_left: bool,
}

/// Every `positions::CEILING_CHECK`: raises the position ceilings of memory-only topics
/// that are getting close to theirs. A failure to persist (a full disk) is retried at
/// the next check; meanwhile positions carry on below the current ceiling, which is
/// half a step away at least, and only stop there.
fn watch_ceilings(inner: &Inner, stop: &std::sync::atomic::AtomicBool) {
    let mut failing = false;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        match inner.control.raise_ceilings() {
            Ok(_) if failing => {
                tracing::info!("position ceilings are saved again");
                failing = false;
            }
            Ok(_) => {}
            Err(e) if !failing => {
                tracing::error!("cannot raise the position ceilings of memory-only topics: {e}; their publishers stop once they reach the current ceiling");
                failing = true;
            }
            Err(_) => {}
        }
        std::thread::park_timeout(positions::CEILING_CHECK);
    }
}

/// The settings of broker `id` (the head's own, or a follower's from the head's).
pub(crate) fn broker_config(
    id: u32,
    incarnation: u64,
    listen: SocketAddr,
    b: &config::BrokerSettings,
    s: &config::SequencerSettings,
    replica_dirs: &[PathBuf],
) -> BrokerConfig {
    BrokerConfig {
        broker_id: id,
        incarnation,
        listen,
        max_message_bytes: b.max_message_bytes,
        max_batch_bytes: b.max_batch_bytes,
        high_watermark: b.high_watermark,
        low_watermark: b.low_watermark,
        backpressure_timeout: Duration::from_millis(b.backpressure_timeout_ms),
        payload_timeout: Duration::from_millis(b.payload_timeout_ms),
        max_connections: b.max_connections,
        max_connections_per_address: b.max_connections_per_address,
        max_subscribers_per_address: b.max_subscribers_per_address,
        shm: b.shm,
        shm_allowed_uids: b.shm_allowed_uids.clone(),
        shm_max_ring_bytes: b.shm_max_ring_bytes as usize,
        shm_feed_bytes: b.shm_feed_bytes as usize,
        idle_sleep_max: Duration::from_micros(b.idle_sleep_max_us),
        reader_stall_timeout: Duration::from_millis(b.reader_stall_timeout_ms),
        session_window: s.session_window,
        session_idle_evict: Duration::from_secs(s.session_idle_evict_secs),
        replica_dirs: replica_dirs.to_vec(),
        fault: (b.fault_broker == id as i64).then_some(embarcadero_broker::Fault {
            delay_fraction: b.fault_delay_fraction,
            delay: Duration::from_micros(b.fault_delay_us),
            drop_fraction: b.fault_drop_fraction,
            drop_limit: b.fault_drop_limit,
        }),
    }
}

/// The sequencer settings of `config`.
pub fn sequencer_config(config: &ServerConfig) -> SequencerConfig {
    sequencer_config_of(&config.sequencer, &config.broker)
}

pub(crate) fn sequencer_config_of(
    s: &config::SequencerSettings,
    b: &config::BrokerSettings,
) -> SequencerConfig {
    SequencerConfig {
        epoch: Duration::from_micros(s.epoch_us),
        idle_sleep_max: Duration::from_micros(b.idle_sleep_max_us),
        session_window: s.session_window,
        session_lease: Duration::from_millis(s.session_lease_ms),
        session_idle_evict: Duration::from_secs(s.session_idle_evict_secs),
        fencing_epoch: None,
        reader_stall_timeout: Duration::from_millis(b.reader_stall_timeout_ms),
    }
}

/// A fresh region, refilled from what recovery found, with its control plane: every
/// topic seeded where it continues and every memory-only topic's ceiling raised before
/// anything hands out a position.
fn open_region(
    config: &ServerConfig,
    replica_dirs: &[PathBuf],
    resumes: &[(u32, u8, Resume)],
) -> Result<(Arc<Region>, control::ControlPlane), ServerError> {
    let region = Arc::new(Region::create(&config.region_path(), config.capacities())?);
    if config.region.prefault {
        let started = std::time::Instant::now();
        region.prefault()?;
        tracing::info!(
            bytes = region.len(),
            ms = started.elapsed().as_millis() as u64,
            "region prefaulted"
        );
    }
    // Before any topic or broker writes there (`reserve`): no SIGBUS later.
    let reservation = reserve::Reservation::open(&region)
        .map_err(|e| ServerError::Start(format!("cannot open the region file: {e}")))?;
    reservation
        .fixed()
        .map_err(|e| ServerError::Start(e.to_string()))?;
    let control = control::ControlPlane::open(
        region.clone(),
        reservation,
        &config.data_dir,
        TopicDefaults {
            disk_replicas: replica_dirs.len() as u8,
            retention_bytes: config.replication.retention_bytes,
            retention_ms: config.replication.retention_ms,
            reader_stall: Duration::from_millis(config.broker.reader_stall_timeout_ms),
        },
    )?;
    for (slot, rf, resume) in resumes {
        recovery::seed(&region, *slot, *rf, resume);
    }
    // Before anything hands out a position: every memory-only topic's ceiling lies a
    // step beyond where it continues, on disk (`positions`).
    control.raise_ceilings()?;
    Ok((region, control))
}

/// Starts this process's brokers, each on `base_port + id` (any port with base 0).
fn start_brokers(
    config: &ServerConfig,
    region: &Arc<Region>,
    ip: IpAddr,
    replica_dirs: &[PathBuf],
) -> Result<Vec<Broker>, ServerError> {
    let mut brokers = Vec::new();
    for id in config.local_broker_ids()? {
        let port = broker_port(config, id)?;
        let broker_config = broker_config(
            id,
            embarcadero_region::owner::new_incarnation(),
            SocketAddr::new(ip, port),
            &config.broker,
            &config.sequencer,
            replica_dirs,
        );
        brokers.push(
            Broker::start(broker_config, region.clone())
                .map_err(|e| ServerError::Start(e.to_string()))?,
        );
    }
    Ok(brokers)
}

/// The port broker `id` listens on: `base_port + id`, or 0 (ephemeral) with a base of 0.
fn broker_port(config: &ServerConfig, id: u32) -> Result<u16, ServerError> {
    if config.base_port == 0 {
        return Ok(0);
    }
    u16::try_from(id)
        .ok()
        .and_then(|id| config.base_port.checked_add(id))
        .ok_or_else(|| {
            ServerError::Start(format!(
                "base port {} + broker {id} exceeds 65535",
                config.base_port
            ))
        })
}

/// Refuses a start whose broker ports are taken, before the region is made: each is
/// bound and let go again (the brokers bind them for good once the region is up; a
/// port taken in between is still refused then, only later).
fn check_broker_ports(config: &ServerConfig, ip: IpAddr) -> Result<(), ServerError> {
    for id in config.local_broker_ids()? {
        let port = broker_port(config, id)?;
        if port == 0 {
            continue;
        }
        std::net::TcpListener::bind(SocketAddr::new(ip, port)).map_err(|e| {
            ServerError::Start(format!(
                "cannot listen on broker {id}'s port {ip}:{port}: {e} (is another server running? choose other ports with --base-port)"
            ))
        })?;
    }
    Ok(())
}

/// Binds the admin API's port.
fn bind_control(ip: IpAddr, port: u16) -> Result<(std::net::TcpListener, SocketAddr), ServerError> {
    let listener = std::net::TcpListener::bind(SocketAddr::new(ip, port)).map_err(|e| {
        ServerError::Start(format!(
            "cannot listen on control port {ip}:{port}: {e} (is another server running? choose another port with --control-port)"
        ))
    })?;
    let addr = listener
        .local_addr()
        .map_err(|e| ServerError::Start(format!("control API: {e}")))?;
    Ok((listener, addr))
}

/// The cluster membership, with this process's brokers where clients reach them: at
/// the advertised address, not where they bind.
fn membership(
    config: &ServerConfig,
    brokers: &[Broker],
    advertised: IpAddr,
) -> cluster::Membership {
    cluster::Membership::new(
        config.brokers,
        &brokers
            .iter()
            .map(|b| {
                let addr = SocketAddr::new(advertised, b.local_addr().port());
                (b.id(), addr, b.incarnation())
            })
            .collect::<Vec<_>>(),
        Duration::from_millis(
            config.cluster.heartbeat_interval_ms * config.cluster.heartbeat_misses as u64,
        ),
    )
}

/// Serves the admin API on `listener`.
fn start_admin_api(
    listener: std::net::TcpListener,
    inner: &Arc<Inner>,
) -> Result<http_server::HttpServer, ServerError> {
    let routed = inner.clone();
    http_server::HttpServer::start(
        listener,
        "control",
        http_server::Limits::default(),
        inner.control_connections.clone(),
        move |request| http::respond(&routed, request),
    )
    .map_err(|e| ServerError::Start(format!("cannot start the admin API: {e}")))
}

/// Monitor threads and the flag that stops them.
type Monitors = (
    Vec<std::thread::JoinHandle<()>>,
    Arc<std::sync::atomic::AtomicBool>,
);

/// Starts the monitor threads (see `Server::monitors`).
fn start_monitors(inner: &Arc<Inner>) -> Result<Monitors, ServerError> {
    let monitor_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spawn = |name: &str, watch: fn(&Inner, &std::sync::atomic::AtomicBool)| {
        let (inner, stop) = (inner.clone(), monitor_stop.clone());
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || watch(&inner, &stop))
            .map_err(|e| ServerError::Start(format!("cannot start the {name} thread: {e}")))
    };
    let monitors = vec![
        spawn("cluster-monitor", watch_membership)?,
        spawn("position-ceilings", watch_ceilings)?,
        spawn("rates", rates::watch)?,
    ];
    Ok((monitors, monitor_stop))
}

/// Takes the region's sequencer lease, then starts the embedded sequencer.
fn start_sequencer(
    config: &ServerConfig,
    region: &Arc<Region>,
) -> Result<(Sequencer, Lease), ServerError> {
    let lease = Lease::acquire(
        region.clone(),
        embarcadero_region::owner::new_incarnation(),
        Duration::from_millis(config.cluster.sequencer_lease_ms),
    )
    .map_err(|e| ServerError::Start(e.to_string()))?;
    let sequencer = Sequencer::start(
        region.clone(),
        SequencerConfig {
            fencing_epoch: Some(lease.fencing_epoch()),
            ..sequencer_config(config)
        },
    )
    .map_err(|e| ServerError::Start(format!("cannot start the sequencer: {e}")))?;
    Ok((sequencer, lease))
}

fn replication_config(config: &ServerConfig) -> ReplicationConfig {
    let r = &config.replication;
    ReplicationConfig {
        dirs: config.replica_dirs(),
        segment_bytes: r.segment_bytes,
        group_commit_bytes: r.group_commit_bytes,
        group_commit_wait: Duration::from_micros(r.group_commit_wait_us),
        idle_sleep_max: Duration::from_micros(config.broker.idle_sleep_max_us),
        retry_after_error: Duration::from_millis(r.retry_after_error_ms),
        fault_flag: (!r.fault_enospc_flag.as_os_str().is_empty())
            .then(|| r.fault_enospc_flag.clone()),
        slow_disk_flag: (!r.fault_slow_disk_flag.as_os_str().is_empty())
            .then(|| r.fault_slow_disk_flag.clone()),
    }
}

/// Where each topic resumes, and its opened replica logs keyed by (slot, replica).
type Recovered = (Vec<(u32, u8, Resume)>, HashMap<(u32, u32), TopicStore>);

/// Recovers every topic from its replica logs and from the previous region, if that
/// region can be trusted (see `embarcadero_replication::recovery`).
fn recover(config: &ServerConfig, replica_dirs: &[PathBuf]) -> Result<Recovered, ServerError> {
    let topics = control::load_topics(&config.data_dir)?;
    let path = config.region_path();
    let old = previous_region(&path)?;
    let mut resumes = Vec::new();
    let mut stores = HashMap::new();
    for t in &topics {
        let (name, rf) = (&t.spec.name, t.spec.replication_factor);
        let old_topic = old.as_ref().and_then(|r| {
            // `topics.json` and the previous region were read from disk: the slot must
            // be one of that region's before it addresses anything in it.
            (t.slot < r.capacities().max_topics).then_some(())?;
            r.topic_meta(t.slot)
                .filter(|m| &m.name == name && m.created_unix_ms == t.created_unix_ms)
                .map(|_| (r, t.slot))
        });
        let resume = if rf >= 2 {
            let (opened, resume) = recover_replicated_topic(config, replica_dirs, t, old_topic)?;
            for (i, store) in opened.into_iter().enumerate() {
                stores.insert((t.slot, i as u32 + 1), store);
            }
            resume
        } else {
            positions::memory_only_resume(t, old_topic, config.capacities().brokers)
        };
        tracing::info!(
            topic = %name,
            batches = resume.next_seq,
            next_position = resume.next_position,
            broker_positions = ?resume.broker_positions,
            sessions = resume.sessions.len(),
            "topic recovered"
        );
        resumes.push((t.slot, rf, resume));
    }
    Ok((resumes, stores))
}

/// The region the previous server left at `path`, retired, if it can be trusted
/// (created since the last boot); `None` when there is none or it cannot be trusted,
/// which leaves the disk replicas alone to recover from. A region file written since the
/// boot that cannot be read (its permissions, a disk error) is an error: it may hold
/// acknowledged messages the replicas do not have yet, and replacing it would lose them
/// without a word beyond a warning (an operator's first days: a region left owned by
/// root).
fn previous_region(path: &Path) -> Result<Option<Region>, ServerError> {
    Ok(match Region::attach(path, None) {
        Ok(r) if r.created_this_boot() => {
            // Followers and sequencers of the previous head may still be attached and
            // writing: from here on they acknowledge nothing more, so nothing they
            // acknowledge can be missing from what the recovery then reads from it.
            r.retire();
            tracing::info!(region = %path.display(), "recovering from the previous server's region (retired first: a process of that server still attached to it, if any, acknowledges nothing more)");
            Some(r)
        }
        Ok(_) => {
            tracing::warn!(region = %path.display(), "the region file predates the last boot and cannot be trusted; recovering from the disk replicas only");
            None
        }
        Err(embarcadero_region::RegionError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            None
        }
        Err(embarcadero_region::RegionError::Io { source, .. }) if !predates_boot(path) => {
            return Err(ServerError::PreviousRegion {
                path: path.to_path_buf(),
                source,
            });
        }
        Err(e) => {
            tracing::warn!(
                "cannot use the previous region ({e}); recovering from the disk replicas only"
            );
            None
        }
    })
}

/// Whether the file at `path` was last written before this machine booted (by its
/// modification time against `/proc/stat`'s `btime`): a region that old could not be
/// trusted even if it could be read, so one that cannot be read loses nothing. False
/// when either cannot be read.
fn predates_boot(path: &Path) -> bool {
    let booted = std::fs::read_to_string("/proc/stat").ok().and_then(|stat| {
        let secs = stat.lines().find_map(|l| l.strip_prefix("btime "))?;
        let secs: u64 = secs.trim().parse().ok()?;
        Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
    });
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    matches!((modified, booted), (Some(m), Some(b)) if m < b)
}

/// Opens replicated topic `t`'s replica logs (one directory per replica beyond the
/// first) and recovers them, with `old_topic` from the previous region if any.
fn recover_replicated_topic(
    config: &ServerConfig,
    replica_dirs: &[PathBuf],
    t: &control::PersistedTopic,
    old_topic: Option<recovery::OldTopic<'_>>,
) -> Result<(Vec<TopicStore>, Resume), ServerError> {
    let (name, rf) = (&t.spec.name, t.spec.replication_factor);
    let dirs: Vec<PathBuf> = replica_dirs
        .iter()
        .take(rf as usize - 1)
        .map(|d| embarcadero_replication::topic_dir(d, name, t.created_unix_ms))
        .collect();
    if dirs.len() + 1 < rf as usize {
        return Err(ServerError::Start(format!(
            "topic {name:?} has replication factor {rf} but only {} replica directories are configured; restore replication.dirs",
            replica_dirs.len()
        )));
    }
    recovery::recover_replicated(&dirs, config.replication.segment_bytes, old_topic).map_err(
        |source| ServerError::Recovery {
            topic: name.clone(),
            source,
        },
    )
}

fn lock_data_dir(dir: &Path) -> Result<File, ServerError> {
    // The lock file itself is named: a directory that can be written may still hold a
    // LOCK another user owns (a first run as root).
    let path = dir.join("LOCK");
    let file = File::create(&path).map_err(|source| ServerError::DataDir {
        path: path.clone(),
        source,
    })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(ServerError::Locked(dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(source)) => Err(ServerError::DataDir {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A previous region that exists but cannot be read stops the start, naming it: it
    /// may hold acknowledged messages the disk replicas lack. (As root, permissions do
    /// not stop a read, so a directory stands for the unreadable file here.)
    #[test]
    fn a_previous_region_that_cannot_be_read_stops_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        assert!(previous_region(&path).unwrap().is_none(), "none at all");
        std::fs::create_dir(&path).unwrap();
        let e = previous_region(&path).err().expect("refused").to_string();
        assert!(
            e.contains(&path.display().to_string()) && e.contains("move the file away"),
            "{e}"
        );
        // One last written before the boot could not be trusted anyway: passed over.
        let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1);
        File::open(&path).unwrap().set_modified(old).unwrap();
        assert!(previous_region(&path).unwrap().is_none());
    }
}
