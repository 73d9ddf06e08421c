//! The sequencer as its own process (`embarcadero sequencer`): attaches to the head's
//! region, is elected in etcd when one is given ([`crate::election`]), takes the
//! region's sequencer lease (at once, or as a standby once the active one's lease
//! expires), and orders the region until stopped or until it learns that it lost the
//! lease or the leadership.
//!
//! Owns: its lease, its sequencer thread and its `/metrics` server. It rebuilds every piece of sequencer
//! state from the region at start (as a restarted embedded sequencer does).

use crate::election::{self, Leadership};
use crate::follower::{attach_head_region, fetch_cluster};
use crate::http_server::HttpServer;
use crate::ServerError;
use embarcadero_region::Region;
use embarcadero_sequencer::{Lease, Sequencer, SequencerConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct SequencerProcessConfig {
    /// The head's control address (`host:port`).
    pub head: String,
    /// The region file as this host sees it (default: the head's path).
    pub region_path: Option<PathBuf>,
    /// Wait for the lease instead of failing when another sequencer holds it.
    pub standby: bool,
    /// etcd endpoint (`http://host:2379`): elect the sequencer there first, so
    /// sequencers on different hosts agree on one leader. `None`: the region lease alone.
    pub etcd: Option<String>,
    /// Names the election key, so several clusters can share one etcd.
    pub cluster_name: String,
    /// Where to serve `/metrics` and `/healthz` (port 0: an ephemeral one).
    pub metrics_listen: SocketAddr,
}

/// An active external sequencer. Dropping it stops ordering and releases the lease.
pub struct SequencerProcess {
    // Field order: the sequencer stops before the leases are released.
    sequencer: Sequencer,
    metrics: HttpServer,
    lease: Lease,
    leadership: Option<Leadership>,
    region: Arc<Region>,
}

impl SequencerProcess {
    /// Returns `Ok(None)` when `give_up` was raised while waiting as a standby.
    pub fn start(
        config: &SequencerProcessConfig,
        give_up: &AtomicBool,
    ) -> Result<Option<Self>, ServerError> {
        let doc = fetch_cluster(&config.head)?;
        let region = attach_head_region(&doc, config.region_path.as_ref())?;
        let duration = Duration::from_millis(doc.config.cluster.sequencer_lease_ms);
        let id = embarcadero_region::owner::new_incarnation();
        // With etcd: lead there first (standbys wait in the campaign), then take the
        // region's lease, waiting for a dead predecessor's to run out.
        let leadership = match &config.etcd {
            Some(endpoint) => match lead_in_etcd(config, endpoint, id, duration, give_up)? {
                Some(l) => Some(l),
                None => return Ok(None),
            },
            None => None,
        };
        let wait = config.standby || leadership.is_some();
        let Some(lease) = take_lease(&region, id, duration, wait, give_up)? else {
            return Ok(None);
        };
        let sequencer = Sequencer::start(
            region.clone(),
            SequencerConfig {
                fencing_epoch: Some(lease.fencing_epoch()),
                ..crate::sequencer_config_of(&doc.config.sequencer, &doc.config.broker)
            },
        )
        .map_err(|e| ServerError::Start(format!("cannot start the sequencer: {e}")))?;
        // Bound once active: a standby's port refuses connections rather than leaving
        // scrapes to time out. Failing here drops the lease just taken.
        let counters = sequencer.metrics();
        let metrics = crate::metrics::serve_metrics_only(
            config.metrics_listen,
            "an external sequencer",
            "sequencer-metrics",
            move || crate::metrics::sequencer_process_metrics(&counters),
        )?;
        tracing::info!(
            id = format_args!("{id:016x}"),
            fencing_epoch = lease.fencing_epoch(),
            "sequencer active"
        );
        Ok(Some(Self {
            sequencer,
            metrics,
            lease,
            leadership,
            region,
        }))
    }

    /// Where `/metrics` is served.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics.local_addr()
    }

    pub fn fencing_epoch(&self) -> u64 {
        self.lease.fencing_epoch()
    }

    /// True once another sequencer took the lease over (or the etcd leadership was
    /// lost): this one must stop at once.
    pub fn lost_lease(&self) -> bool {
        self.lease.is_lost() || self.leadership.as_ref().is_some_and(Leadership::is_lost)
    }

    /// True once a restarted head replaced the region this sequencer orders: nothing
    /// it orders there counts any more, and this process must stop; started again, it
    /// attaches to the new region.
    pub fn region_retired(&self) -> bool {
        self.region.is_retired()
    }

    pub fn stop(&mut self) {
        self.sequencer.stop();
    }
}

/// Campaigns for the leadership in etcd at `endpoint` (a standby waits there; an
/// active start fails at once if another sequencer leads). `Ok(None)` when `give_up`
/// was raised while waiting.
fn lead_in_etcd(
    config: &SequencerProcessConfig,
    endpoint: &str,
    id: u64,
    duration: Duration,
    give_up: &AtomicBool,
) -> Result<Option<Leadership>, ServerError> {
    let key = election::election_key(&config.cluster_name);
    if !config.standby {
        if let Some(holder) = election::current_leader(endpoint, &key)
            .map_err(|e| ServerError::Start(e.to_string()))?
        {
            return Err(ServerError::Start(format!(
                "sequencer {holder} leads this cluster in etcd ({endpoint}, key {key}); start this one with --standby to take over when it stops"
            )));
        }
    }
    if config.standby {
        tracing::info!(endpoint, key, "standby: waiting to be elected in etcd");
    }
    election::campaign(endpoint, &key, &format!("{id:016x}"), duration, give_up)
        .map_err(|e| ServerError::Start(e.to_string()))
}

/// Takes the region's sequencer lease: at once, or, to `wait` (a standby, or a leader
/// in etcd whose dead predecessor's lease must run out), once it is free. `Ok(None)`
/// when `give_up` was raised while waiting.
fn take_lease(
    region: &Arc<Region>,
    id: u64,
    duration: Duration,
    wait: bool,
    give_up: &AtomicBool,
) -> Result<Option<Lease>, ServerError> {
    let lease = if wait {
        tracing::info!(
            "standby: waiting for the region's sequencer lease ({} ms)",
            duration.as_millis()
        );
        match Lease::acquire_when_free(region.clone(), id, duration, duration / 10, give_up) {
            Some(lease) => lease,
            None if region.is_retired() => {
                return Err(ServerError::Start(
                    "the head restarted and replaced the region this standby waited on; start it again to attach to the new region".into(),
                ))
            }
            None => return Ok(None),
        }
    } else {
        Lease::acquire(region.clone(), id, duration)
            .map_err(|e| ServerError::Start(e.to_string()))?
    };
    Ok(Some(lease))
}
