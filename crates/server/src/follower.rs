//! A follower: one broker in its own process (`embarcadero broker --follower`),
//! attached to the head's region file, registered with the head's control plane and
//! kept alive there by heartbeats.
//!
//! Owns: its broker (data port, logs of its broker id) and its membership (join,
//! heartbeats, rejoin after being declared dead). It takes every setting that must
//! match the cluster (broker limits, replica directories, the region's layout) from
//! the head, so a follower cannot disagree with the head about the region.

use crate::config::{BrokerSettings, SequencerSettings};
use crate::http_server::HttpServer;
use crate::ServerError;
use embarcadero_broker::Broker;
use embarcadero_region::{Capacities, Region};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct FollowerConfig {
    /// The head's control address (`host:port`).
    pub head: String,
    pub broker_id: u32,
    /// Where the data port listens.
    pub listen: SocketAddr,
    /// The address clients use to reach the data port (default: the bound address;
    /// needed when listening on 0.0.0.0). Port 0: the port the data port bound.
    pub advertise: Option<SocketAddr>,
    /// The region file as this host sees it (default: the head's path).
    pub region_path: Option<PathBuf>,
    /// Where this broker's `/metrics` listens (port 0: an ephemeral one).
    pub metrics_listen: SocketAddr,
}

/// The parts of the head's `/v1/cluster` document (`embarcadero_api::ClusterInfo`, with
/// its configuration and the region's capacities typed) that a follower and an external
/// sequencer run with.
#[derive(Debug)]
pub struct ClusterDoc {
    pub region: embarcadero_api::RegionInfo<Capacities>,
    pub config: SharedConfig,
}

/// The settings every process of the cluster must share with the head.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SharedConfig {
    pub broker: BrokerSettings,
    pub sequencer: SequencerSettings,
    pub cluster: crate::config::ClusterSettings,
    pub replica_dirs: Vec<PathBuf>,
}

/// Reads the head's cluster document.
pub fn fetch_cluster(head: &str) -> Result<ClusterDoc, ServerError> {
    let url = format!("http://{head}/v1/cluster");
    let response = ureq::get(&url)
        .timeout(Duration::from_secs(5))
        .call()
        .map_err(|e| {
            ServerError::Start(format!(
                "cannot reach the head's control API at {head}: {e}; start `embarcadero broker --head` first or fix --head-addr"
            ))
        })?;
    let doc: embarcadero_api::ClusterInfo<SharedConfig, Capacities> =
        response.into_json().map_err(|e| {
            ServerError::Start(format!(
                "the server at {head} did not answer with a cluster document ({e}); is --head-addr the head's control port?"
            ))
        })?;
    match (doc.region, doc.config) {
        (Some(region), Some(config)) => Ok(ClusterDoc { region, config }),
        _ => Err(ServerError::Start(format!(
            "the cluster document of {head} has no region or configuration; run the same embarcadero version on every host"
        ))),
    }
}

/// Attaches the region the head describes, refusing a file that is not that region.
pub fn attach_head_region(
    doc: &ClusterDoc,
    path_override: Option<&PathBuf>,
) -> Result<Arc<Region>, ServerError> {
    let head_path = PathBuf::from(&doc.region.path);
    let path = path_override.unwrap_or(&head_path);
    if doc.region.layout_version != embarcadero_region::layout::LAYOUT_VERSION {
        return Err(ServerError::Start(format!(
            "the head uses region layout version {} but this binary uses {}; run the same embarcadero version on every host",
            doc.region.layout_version,
            embarcadero_region::layout::LAYOUT_VERSION
        )));
    }
    let region = Region::attach(path, Some(doc.region.capacities)).map_err(|e| {
        ServerError::Start(format!(
            "region file {} is not the head's region: {e}; pass the path of the head's region file as this host sees it (--region)",
            path.display()
        ))
    })?;
    if region.len() != doc.region.bytes {
        return Err(ServerError::Start(format!(
            "region file {} is {} bytes but the head's is {}; pass the head's region file (--region)",
            path.display(),
            region.len(),
            doc.region.bytes
        )));
    }
    Ok(Arc::new(region))
}

/// A running follower broker. Dropping it stops it.
pub struct Follower {
    broker: Broker,
    region: Arc<Region>,
    /// `/metrics` and `/healthz`.
    metrics: HttpServer,
    stop: Arc<AtomicBool>,
    evicted: Arc<AtomicBool>,
    heartbeat: Option<JoinHandle<()>>,
    advertised: SocketAddr,
}

#[derive(serde::Serialize)]
struct MembershipCall {
    id: u32,
    addr: SocketAddr,
    incarnation: u64,
}

impl Follower {
    pub fn start(config: FollowerConfig) -> Result<Self, ServerError> {
        // As `serve` does (`open_files`): a broker's connections each hold descriptors.
        crate::open_files::raise_open_files_limit();
        let doc = fetch_cluster(&config.head)?;
        let brokers = doc.region.capacities.brokers;
        if config.broker_id >= brokers {
            return Err(ServerError::Start(format!(
                "broker id {} is out of range: the head's cluster has brokers 0..{brokers}; pick another --broker-id",
                config.broker_id
            )));
        }
        let region = attach_head_region(&doc, config.region_path.as_ref())?;
        let incarnation = embarcadero_region::owner::new_incarnation();
        // The id first: the head refuses it while the previous process is alive, and
        // fences the logs that process left, so its publishers get exact answers before
        // this process resumes those logs (in `Broker::start`).
        let dead_after = Duration::from_millis(
            doc.config.cluster.heartbeat_interval_ms * doc.config.cluster.heartbeat_misses as u64,
        );
        claim(&config.head, config.broker_id, incarnation, dead_after)?;
        let broker = start_broker(&config, &doc, &region, incarnation)?;
        let metrics = serve_metrics(config.metrics_listen, &broker)?;
        let advertised = match config.advertise {
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), broker.local_addr().port()),
            Some(a) => a,
            None => broker.local_addr(),
        };
        let call = MembershipCall {
            id: config.broker_id,
            addr: advertised,
            incarnation,
        };
        // Claimed only once the port serves, so clients never see a dead address.
        post(&config.head, "join", &call)?;
        let stop = Arc::new(AtomicBool::new(false));
        let evicted = Arc::new(AtomicBool::new(false));
        let interval = Duration::from_millis(doc.config.cluster.heartbeat_interval_ms);
        let heartbeat = spawn_heartbeats(&config.head, call, interval, &stop, &evicted, &region)?;
        tracing::info!(
            broker = config.broker_id,
            addr = %advertised,
            head = %config.head,
            "follower broker joined the cluster"
        );
        Ok(Self {
            broker,
            region,
            metrics,
            stop,
            evicted,
            heartbeat: Some(heartbeat),
            advertised,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.advertised
    }

    pub fn id(&self) -> u32 {
        self.broker.id()
    }

    /// Where this broker's `/metrics` is served.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics.local_addr()
    }

    /// True once the head gave this broker id to another process: this one must stop.
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// True once a restarted head replaced the region this follower is attached to: its
    /// broker stopped acknowledging, and this process must stop; started again, it
    /// attaches to the new region.
    pub fn region_retired(&self) -> bool {
        self.region.is_retired()
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.heartbeat.take() {
            let _ = t.join();
        }
        self.metrics.stop();
        self.broker.stop();
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts the follower's broker on `region`, with the settings the head's cluster
/// document `doc` gives every broker.
fn start_broker(
    config: &FollowerConfig,
    doc: &ClusterDoc,
    region: &Arc<Region>,
    incarnation: u64,
) -> Result<Broker, ServerError> {
    let broker_config = crate::broker_config(
        config.broker_id,
        incarnation,
        config.listen,
        &doc.config.broker,
        &doc.config.sequencer,
        &doc.config.replica_dirs,
    );
    Broker::start(broker_config, region.clone()).map_err(|e| ServerError::Start(e.to_string()))
}

/// Serves the follower's `/metrics` and `/healthz` on `listen`: its broker's figures.
fn serve_metrics(listen: SocketAddr, broker: &Broker) -> Result<HttpServer, ServerError> {
    let info = crate::BrokerInfo {
        id: broker.id(),
        addr: broker.local_addr(),
        metrics: broker.metrics(),
        pool: broker.segment_pool(),
    };
    crate::metrics::serve_metrics_only(listen, "a follower", "follower-metrics", move || {
        crate::metrics::follower_metrics(&info)
    })
}

/// Starts the thread that sends the head `call` as a heartbeat every `interval`, and
/// rejoins when declared dead, until `stop` is raised; it raises `evicted` when the
/// head gave the id to another process.
fn spawn_heartbeats(
    head: &str,
    call: MembershipCall,
    interval: Duration,
    stop: &Arc<AtomicBool>,
    evicted: &Arc<AtomicBool>,
    region: &Arc<Region>,
) -> Result<JoinHandle<()>, ServerError> {
    let (stop, evicted, head) = (stop.clone(), evicted.clone(), head.to_string());
    let region = region.clone();
    std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || heartbeats(&head, &call, interval, &stop, &evicted, &region))
        .map_err(|e| ServerError::Start(format!("cannot start heartbeats: {e}")))
}

/// Claims `id` for `incarnation`. A restart can be quicker than the head's failure
/// detection: while the previous process still counts as alive, the claim is retried
/// until the head has had time to declare it dead.
fn claim(head: &str, id: u32, incarnation: u64, dead_after: Duration) -> Result<(), ServerError> {
    #[derive(serde::Serialize)]
    struct Claim {
        id: u32,
        incarnation: u64,
    }
    let url = format!("http://{head}/v1/cluster/claim");
    let deadline = std::time::Instant::now() + dead_after * 2 + Duration::from_secs(1);
    let mut told = false;
    loop {
        match ureq::post(&url)
            .timeout(Duration::from_secs(5))
            .send_json(Claim { id, incarnation })
        {
            Ok(_) => return Ok(()),
            Err(ureq::Error::Status(409, response)) if std::time::Instant::now() < deadline => {
                if !std::mem::replace(&mut told, true) {
                    let body: serde_json::Value = response.into_json().unwrap_or_default();
                    tracing::info!(
                        broker = id,
                        "{}; waiting for the head to declare that process dead",
                        body["error"].as_str().unwrap_or("the id is taken")
                    );
                }
                std::thread::sleep(dead_after / 4);
            }
            Err(ureq::Error::Status(code, response)) => {
                let body: serde_json::Value = response.into_json().unwrap_or_default();
                return Err(ServerError::Start(format!(
                    "the head refused broker id {id} ({code}): {}",
                    body["error"].as_str().unwrap_or("no reason given")
                )));
            }
            Err(e) => {
                return Err(ServerError::Start(format!(
                    "cannot reach the head at {head}: {e}"
                )))
            }
        }
    }
}

fn post(head: &str, what: &str, call: &MembershipCall) -> Result<(), ServerError> {
    let url = format!("http://{head}/v1/cluster/{what}");
    match ureq::post(&url)
        .timeout(Duration::from_secs(5))
        .send_json(call)
    {
        Ok(_) => Ok(()),
        Err(ureq::Error::Status(code, response)) => {
            let body: serde_json::Value = response.into_json().unwrap_or_default();
            let message = body["error"]
                .as_str()
                .unwrap_or("no reason given")
                .to_string();
            Err(ServerError::Start(format!(
                "the head refused {what} of broker {} ({code}): {message}",
                call.id
            )))
        }
        Err(e) => Err(ServerError::Start(format!(
            "cannot reach the head at {head}: {e}"
        ))),
    }
}

fn heartbeats(
    head: &str,
    call: &MembershipCall,
    interval: Duration,
    stop: &AtomicBool,
    evicted: &AtomicBool,
    region: &Region,
) {
    let mut unreachable = false;
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(interval);
        // A restarted head does not know this process's region: never rejoin it.
        if region.is_retired() {
            return;
        }
        let url = format!("http://{head}/v1/cluster/heartbeat");
        match ureq::post(&url).timeout(interval * 2).send_json(call) {
            Ok(_) => {
                if std::mem::take(&mut unreachable) {
                    tracing::info!(head, "the head answers heartbeats again");
                }
            }
            Err(ureq::Error::Status(404, _)) => {
                // Declared dead (a pause, a lost network): claim the id again.
                match post(head, "join", call) {
                    Ok(()) => tracing::warn!(
                        broker = call.id,
                        "the head had declared this broker dead; it rejoined"
                    ),
                    Err(e) => {
                        tracing::error!("{e}; this broker stops serving");
                        evicted.store(true, Ordering::Release);
                        return;
                    }
                }
            }
            Err(e) => {
                if !std::mem::replace(&mut unreachable, true) {
                    tracing::warn!(
                        head,
                        "cannot send a heartbeat to the head ({e}); still serving, retrying every {interval:?}"
                    );
                }
            }
        }
    }
}
