//! `GET /v1/cluster`: which brokers serve and where, every member's state, the region,
//! the configuration a follower must share, and the sequencer's lease.
//!
//! The head's typed configuration and the region's capacities are type parameters: the
//! head serialises its own types and a follower reads them back typed, while clients,
//! which only need the brokers and the size limits, read them as plain JSON values and so
//! do not depend on the server's or the region's crates.

use serde::{Deserialize, Serialize};

/// One broker that serves now, as clients use it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BrokerAddr {
    pub id: u32,
    pub addr: String,
    /// The process serving the id (0 for the head's own brokers and older heads).
    #[serde(default)]
    pub incarnation: u64,
}

/// Where a broker id stands in the cluster's membership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Served by the head's own process.
    Local,
    /// A follower whose heartbeats arrive.
    Alive,
    /// A restarted follower that claimed its id and is taking over its logs; it serves
    /// once it joins with its address.
    Joining,
    /// A follower that stopped sending heartbeats.
    Dead,
    /// No process has claimed this id yet.
    Absent,
}

/// One broker id and the process behind it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemberView {
    pub id: u32,
    pub addr: Option<String>,
    pub state: MemberState,
    /// Milliseconds since the last heartbeat (followers only).
    pub last_heartbeat_ms: Option<u64>,
    pub incarnation: u64,
    /// Times a follower has joined under this id.
    pub joins: u64,
}

/// The shared-memory region every broker of the cluster maps.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RegionInfo<Caps = serde_json::Value> {
    pub path: String,
    pub bytes: u64,
    pub layout_version: u32,
    /// Brokers, topics and slots the region was laid out for.
    pub capacities: Caps,
}

/// Who holds the sequencer's lease, and under which fencing epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SequencerLease {
    /// `embedded` (the head runs it) or `external` (`embarcadero sequencer` processes).
    pub mode: String,
    /// The holder's id, as 16 hex digits.
    pub holder: String,
    pub fencing_epoch: u64,
    /// Milliseconds until the lease runs out; 0 once it has.
    pub lease_remaining_ms: u64,
}

/// `GET /v1/cluster`. A client needs only `brokers` and the two size limits; the rest
/// is optional when read, so a client reads any head that gives those (a head always
/// sends every field).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClusterInfo<Config = serde_json::Value, Caps = serde_json::Value> {
    /// The brokers that serve now: what publishers and subscribers connect to.
    pub brokers: Vec<BrokerAddr>,
    /// Every broker id, serving or not.
    #[serde(default)]
    pub members: Vec<MemberView>,
    /// The sequencer's epoch (0: not reported).
    #[serde(default)]
    pub epoch_us: u64,
    pub max_message_bytes: u64,
    pub max_batch_bytes: u64,
    #[serde(default = "none", skip_serializing_if = "Option::is_none")]
    pub region: Option<RegionInfo<Caps>>,
    /// What followers and an external sequencer need to run like the head's own.
    #[serde(default = "none", skip_serializing_if = "Option::is_none")]
    pub config: Option<Config>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequencer: Option<SequencerLease>,
}

/// `#[serde(default)]` for an `Option` of a type parameter, without asking the
/// parameter for `Default`.
fn none<T>() -> Option<T> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_document_round_trips_and_reads_untyped_parts_as_json() {
        let info: ClusterInfo = ClusterInfo {
            brokers: vec![BrokerAddr {
                id: 0,
                addr: "127.0.0.1:12141".into(),
                incarnation: 0,
            }],
            members: vec![MemberView {
                id: 1,
                addr: None,
                state: MemberState::Absent,
                last_heartbeat_ms: None,
                incarnation: 0,
                joins: 0,
            }],
            epoch_us: 500,
            max_message_bytes: 1 << 20,
            max_batch_bytes: 8 << 20,
            region: Some(RegionInfo {
                path: "/dev/shm/r".into(),
                bytes: 1 << 30,
                layout_version: 7,
                capacities: serde_json::json!({"brokers": 4}),
            }),
            config: Some(serde_json::json!({"broker": {}})),
            sequencer: Some(SequencerLease {
                mode: "embedded".into(),
                holder: format!("{:016x}", 42),
                fencing_epoch: 3,
                lease_remaining_ms: 0,
            }),
        };
        let text = serde_json::to_string(&info).unwrap();
        assert!(text.contains(r#""state":"absent""#), "{text}");
        let back: ClusterInfo = serde_json::from_str(&text).unwrap();
        assert_eq!(back, info);
    }

    #[test]
    fn a_client_reads_a_head_that_gives_only_what_clients_need() {
        let minimal = r#"{"brokers": [{"id": 0, "addr": "127.0.0.1:1"}],
                          "max_message_bytes": 1024, "max_batch_bytes": 4096}"#;
        let info: ClusterInfo = serde_json::from_str(minimal).unwrap();
        assert_eq!(info.brokers.len(), 1);
        assert!(info.region.is_none() && info.config.is_none() && info.sequencer.is_none());
    }
}
