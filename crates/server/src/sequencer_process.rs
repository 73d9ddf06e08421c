//! The sequencer as its own process (`embarcadero sequencer`): attaches to the head's
//! region, takes the region's sequencer lease (at once, or as a standby once the
//! active one's lease expires), and orders the region until stopped or until it
//! learns that it lost the lease.
//!
//! Owns: its lease and its sequencer thread. It rebuilds every piece of sequencer
//! state from the region at start (as a restarted embedded sequencer does).

use crate::follower::{attach_head_region, fetch_cluster};
use crate::ServerError;
use embarcadero_region::Region;
use embarcadero_sequencer::{Lease, Sequencer};
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
}

/// An active external sequencer. Dropping it stops ordering and releases the lease.
pub struct SequencerProcess {
    // Field order: the sequencer stops before the lease is released.
    sequencer: Sequencer,
    lease: Lease,
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
        let id = crate::new_sequencer_id();
        let lease = if config.standby {
            tracing::info!(
                "standby: waiting for the region's sequencer lease ({} ms)",
                duration.as_millis()
            );
            match Lease::acquire_when_free(region.clone(), id, duration, duration / 10, give_up) {
                Some(lease) => lease,
                None => return Ok(None),
            }
        } else {
            Lease::acquire(region.clone(), id, duration)
                .map_err(|e| ServerError::Start(e.to_string()))?
        };
        let sequencer = Sequencer::start(
            region.clone(),
            crate::sequencer_config_of(&doc.config.sequencer, &doc.config.broker),
        )
        .map_err(|e| ServerError::Start(format!("cannot start the sequencer: {e}")))?;
        tracing::info!(
            id = format_args!("{id:016x}"),
            fencing_epoch = lease.fencing_epoch(),
            "sequencer active"
        );
        Ok(Some(Self {
            sequencer,
            lease,
            region,
        }))
    }

    pub fn fencing_epoch(&self) -> u64 {
        self.lease.fencing_epoch()
    }

    /// True once another sequencer took the lease over: this one must stop at once.
    pub fn lost_lease(&self) -> bool {
        self.lease.is_lost()
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    pub fn stop(&mut self) {
        self.sequencer.stop();
    }
}
