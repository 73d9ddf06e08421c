//! The faults a chaos cycle injects into a [`LocalCluster`] of real processes: how each
//! strikes and how it is healed. Broker 2 (a follower) and sequencer 0 (the active one;
//! a standby waits) are the targets; the readers use brokers 0 and 1.

use embarcadero_cli::local_cluster::{LocalCluster, Member};
use std::path::{Path, PathBuf};

/// The follower broker the faults aim at.
pub const VICTIM_BROKER: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nemesis {
    /// SIGKILL of follower broker 2 (not restarted: the cluster carries on without it).
    KillFollower,
    /// SIGSTOP of follower broker 2, SIGCONT at the heal.
    PauseFollower,
    /// SIGKILL of the active sequencer; the standby takes over the lease.
    KillSequencer,
    /// SIGSTOP of the active sequencer (the standby may take over meanwhile), SIGCONT.
    PauseSequencer,
    /// SIGSTOP of the head (control plane and broker 0), SIGCONT at the heal.
    PauseHead,
    /// Unlinks the region file every process has mapped.
    DeleteRegion,
    /// Every replica write fails with ENOSPC (`replication.fault_enospc_flag`) until the
    /// heal removes the flag file.
    FullDisk,
    /// Every replica fdatasync waits 100 ms first (`replication.fault_slow_disk_flag`, a
    /// stand-in for a slow disk) until the heal removes the flag file.
    SlowDisk,
}

pub const ALL: [Nemesis; 8] = [
    Nemesis::KillFollower,
    Nemesis::PauseFollower,
    Nemesis::KillSequencer,
    Nemesis::PauseSequencer,
    Nemesis::PauseHead,
    Nemesis::DeleteRegion,
    Nemesis::FullDisk,
    Nemesis::SlowDisk,
];

impl Nemesis {
    pub fn name(self) -> &'static str {
        match self {
            Nemesis::KillFollower => "kill-follower",
            Nemesis::PauseFollower => "pause-follower",
            Nemesis::KillSequencer => "kill-sequencer",
            Nemesis::PauseSequencer => "pause-sequencer",
            Nemesis::PauseHead => "pause-head",
            Nemesis::DeleteRegion => "delete-region",
            Nemesis::FullDisk => "full-disk",
            Nemesis::SlowDisk => "slow-disk",
        }
    }

    pub fn parse(name: &str) -> Result<Self, String> {
        ALL.into_iter().find(|n| n.name() == name).ok_or_else(|| {
            let names: Vec<&str> = ALL.iter().map(|n| n.name()).collect();
            format!("no nemesis {name:?}; there are {}", names.join(", "))
        })
    }

    /// Injects the fault.
    pub fn strike(self, cluster: &mut LocalCluster, flags: &Path) -> Result<(), String> {
        match self {
            Nemesis::KillFollower => cluster.kill_follower(VICTIM_BROKER).map(drop),
            Nemesis::KillSequencer => cluster.kill_sequencer(0).map(drop),
            Nemesis::PauseFollower | Nemesis::PauseSequencer | Nemesis::PauseHead => {
                self.signal(cluster, "STOP")
            }
            Nemesis::DeleteRegion => std::fs::remove_file(&cluster.region_file)
                .map_err(|e| format!("cannot delete the region file: {e}")),
            Nemesis::FullDisk | Nemesis::SlowDisk => std::fs::write(self.flag(flags), b"")
                .map_err(|e| format!("cannot create the {} flag: {e}", self.name())),
        }
    }

    /// Undoes what can be undone: a paused process goes on, the disk has room again.
    /// A killed process stays dead and a deleted region file stays deleted.
    pub fn heal(self, cluster: &mut LocalCluster, flags: &Path) -> Result<(), String> {
        match self {
            Nemesis::PauseFollower | Nemesis::PauseSequencer | Nemesis::PauseHead => {
                self.signal(cluster, "CONT")
            }
            Nemesis::FullDisk | Nemesis::SlowDisk => std::fs::remove_file(self.flag(flags))
                .map_err(|e| format!("cannot remove the {} flag: {e}", self.name())),
            Nemesis::KillFollower | Nemesis::KillSequencer | Nemesis::DeleteRegion => Ok(()),
        }
    }

    /// The flag file of a disk fault, in `flags`.
    fn flag(self, flags: &Path) -> PathBuf {
        flags.join(self.name())
    }

    fn signal(self, cluster: &mut LocalCluster, signal: &str) -> Result<(), String> {
        let member = match self {
            Nemesis::PauseFollower => Member::Follower(VICTIM_BROKER),
            Nemesis::PauseSequencer => Member::Sequencer(0),
            _ => Member::Head,
        };
        cluster
            .member(member)
            .ok_or_else(|| format!("{member:?} is not running"))?
            .signal(signal)
    }
}

/// The fault flags a cluster's processes watch, as environment for them: the files
/// live in `flags`.
pub fn flag_settings(flags: &Path) -> Vec<(String, String)> {
    [
        (
            "EMBARCADERO_REPLICATION_FAULT_ENOSPC_FLAG",
            Nemesis::FullDisk,
        ),
        (
            "EMBARCADERO_REPLICATION_FAULT_SLOW_DISK_FLAG",
            Nemesis::SlowDisk,
        ),
    ]
    .into_iter()
    .map(|(name, n)| (name.to_string(), n.flag(flags).display().to_string()))
    .collect()
}
