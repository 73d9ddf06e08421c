//! The faults a chaos cycle injects into a [`LocalCluster`] of real processes: how each
//! strikes and how it is healed. Broker 2 (a follower), sequencer 0 (the active one; a
//! standby waits) and the head are the targets, and for `partition-pair` a pair of
//! parties among the head, the followers and the clients; the readers use brokers 0 and
//! 1 (through the head, to find the restarted brokers, when the head is killed).

use super::netns::{Netns, Party};
use embarcadero_cli::local_cluster::{LocalCluster, Member};
use std::path::{Path, PathBuf};

/// What the faults act through besides the cluster: the fault flag files' directory,
/// the network namespaces the brokers run in for a partition, and the pair a
/// `partition-pair` cycle parts.
pub struct Lab<'a> {
    pub flags: &'a Path,
    pub netns: Option<&'a Netns>,
    pub pair: Pair,
}

/// The follower broker the faults aim at.
pub const VICTIM_BROKER: u32 = 2;

/// Who a partition can part. In a partition cycle broker `b` runs in the lab's space
/// `b` (the head serves broker 0); the clients (publishers, readers) are in the host's
/// namespace with the sequencers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Head,
    Follower(u32),
    Clients,
}

impl Side {
    pub fn party(self) -> Party {
        match self {
            Side::Head => Party::Space(0),
            Side::Follower(b) => Party::Space(b as usize),
            Side::Clients => Party::Host,
        }
    }

    pub fn name(self) -> String {
        match self {
            Side::Head => "head".into(),
            Side::Follower(b) => format!("follower-{b}"),
            Side::Clients => "clients".into(),
        }
    }
}

/// Two sides a `partition-pair` cycle parts while each still reaches every other.
pub type Pair = (Side, Side);

/// The pairs `partition-pair` parts, one per pass over the faults in turn. Every pair
/// of processes that talk over the network: a follower and the head (joins and
/// heartbeats: the head may declare a follower dead that clients still reach), the
/// clients and a broker (connections stall while the head still sees it). Followers
/// never talk to each other, and sequencers talk to brokers only through the region's
/// memory, so cutting those pairs would change nothing.
pub const PAIRS: [Pair; 5] = [
    (Side::Head, Side::Follower(1)),
    (Side::Head, Side::Follower(VICTIM_BROKER)),
    (Side::Clients, Side::Follower(1)),
    (Side::Clients, Side::Head),
    (Side::Clients, Side::Follower(VICTIM_BROKER)),
];

/// Broker processes in a partition cycle's lab: the head and followers 1 and 2.
pub const PARTITION_SPACES: usize = 3;

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
    /// SIGKILL of the head (control plane, broker 0, the replica writers); the heal
    /// starts it again on its data directory and control port, and, since a restarted
    /// head replaces the region, the followers and sequencers again once they stopped.
    KillHead,
    /// Follower broker 2, in a network namespace of its own, is cut off from the head
    /// and every client (the veth link goes down) until the heal brings the link up.
    PartitionFollower,
    /// Two sides (the cycle's [`Pair`]) cannot reach each other, while both still reach
    /// everyone else, until the heal.
    PartitionPair,
}

pub const ALL: [Nemesis; 11] = [
    Nemesis::KillFollower,
    Nemesis::PauseFollower,
    Nemesis::KillSequencer,
    Nemesis::PauseSequencer,
    Nemesis::PauseHead,
    Nemesis::DeleteRegion,
    Nemesis::FullDisk,
    Nemesis::SlowDisk,
    Nemesis::KillHead,
    Nemesis::PartitionFollower,
    Nemesis::PartitionPair,
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
            Nemesis::KillHead => "kill-head",
            Nemesis::PartitionFollower => "partition-follower",
            Nemesis::PartitionPair => "partition-pair",
        }
    }

    pub fn parse(name: &str) -> Result<Self, String> {
        ALL.into_iter().find(|n| n.name() == name).ok_or_else(|| {
            let names: Vec<&str> = ALL.iter().map(|n| n.name()).collect();
            format!("no nemesis {name:?}; there are {}", names.join(", "))
        })
    }

    /// Injects the fault.
    pub fn strike(self, cluster: &mut LocalCluster, lab: &Lab) -> Result<(), String> {
        let flags = lab.flags;
        match self {
            Nemesis::KillHead => cluster.kill_head().map(drop),
            Nemesis::PartitionFollower => Self::netns(lab)?.cut(VICTIM_BROKER as usize),
            Nemesis::PartitionPair => {
                let (a, b) = lab.pair;
                Self::netns(lab)?.cut_pair(a.party(), b.party())
            }
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

    /// Undoes what can be undone: a paused process goes on, the disk has room again, a
    /// partition heals, a killed head is started again (as a service manager would). A
    /// killed follower or sequencer stays dead and a deleted region file stays deleted.
    pub fn heal(self, cluster: &mut LocalCluster, lab: &Lab) -> Result<(), String> {
        let flags = lab.flags;
        match self {
            Nemesis::KillHead => cluster.restart_head(),
            Nemesis::PartitionFollower => Self::netns(lab)?.mend(VICTIM_BROKER as usize),
            Nemesis::PartitionPair => {
                let (a, b) = lab.pair;
                Self::netns(lab)?.mend_pair(a.party(), b.party())
            }
            Nemesis::PauseFollower | Nemesis::PauseSequencer | Nemesis::PauseHead => {
                self.signal(cluster, "CONT")
            }
            Nemesis::FullDisk | Nemesis::SlowDisk => std::fs::remove_file(self.flag(flags))
                .map_err(|e| format!("cannot remove the {} flag: {e}", self.name())),
            Nemesis::KillFollower | Nemesis::KillSequencer | Nemesis::DeleteRegion => Ok(()),
        }
    }

    /// Whether the cycle runs the brokers in the lab's network namespaces.
    pub fn partitions(self) -> bool {
        matches!(self, Nemesis::PartitionFollower | Nemesis::PartitionPair)
    }

    fn netns<'a>(lab: &Lab<'a>) -> Result<&'a Netns, String> {
        lab.netns
            .ok_or_else(|| "the partition needs the cycle's network namespace".to_string())
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
