//! `/v1/topics`: what to create (`TopicSpec`) and what a topic reports (`TopicInfo`
//! with its broker logs and health).

use serde::{Deserialize, Serialize};

/// `POST /v1/topics`: what to create. Unknown fields are refused: a misspelt or invented
/// one (`"replication": 2`) would otherwise be dropped without a word and the topic
/// created with a default the caller did not ask for. (The server's `topics.json` record
/// flattens this type; serde does not apply the refusal there, so old files keep loading.)
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TopicSpec {
    pub name: String,
    /// 0 (none), 1 (FIFO per broker), 2 (total order), 5 (total order + session FIFO).
    pub order: u8,
    /// Copies including the in-memory one; 2 or more adds disk replicas.
    #[serde(default = "one")]
    pub replication_factor: u8,
    /// The ack level `pub` uses when not told.
    #[serde(default = "one")]
    pub default_ack: u8,
    /// Disk retention in bytes per replica (0: no limit; `None`: the server's
    /// `replication.retention_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_bytes: Option<u64>,
    /// Disk retention in milliseconds (0: no limit; `None`: the server's
    /// `replication.retention_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_ms: Option<u64>,
}

fn one() -> u8 {
    1
}

impl TopicSpec {
    /// A memory-only topic of `order` with ack level 1 and the server's retention.
    pub fn new(name: impl Into<String>, order: u8) -> Self {
        Self {
            name: name.into(),
            order,
            replication_factor: 1,
            default_ack: 1,
            retention_bytes: None,
            retention_ms: None,
        }
    }

    /// With `rf` copies: the region plus `rf - 1` disk replicas.
    pub fn replicated(mut self, rf: u8) -> Self {
        self.replication_factor = rf;
        self
    }
}

/// `GET /v1/topics/{name}`: a topic with its live counters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TopicInfo {
    pub name: String,
    /// The topic's slot in the region.
    pub id: u32,
    pub order: u8,
    pub replication_factor: u8,
    pub default_ack: u8,
    /// Disk retention in bytes per replica (0: no limit).
    #[serde(default)]
    pub retention_bytes: u64,
    /// Disk retention in milliseconds (0: no limit).
    #[serde(default)]
    pub retention_ms: u64,
    pub created_unix_ms: u64,
    /// Orders 2 and 5: batches in the committed global order.
    pub committed_batches: u64,
    /// Replicated topics: batches of the global order on every disk replica.
    #[serde(default)]
    pub durable_batches: u64,
    /// Replicated topics: the position after the durable ones; subscribers read below
    /// it (0 for memory-only topics).
    #[serde(default)]
    pub durable_position: u64,
    /// Orders 2 and 5: the next global message position.
    pub next_position: u64,
    /// One entry per broker log.
    pub brokers: Vec<BrokerLogInfo>,
    /// Replica disk errors and the subscriber furthest behind (all absent from servers
    /// from before health was reported).
    #[serde(default)]
    pub health: TopicHealth,
}

/// One broker's log of a topic.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BrokerLogInfo {
    pub broker: u32,
    /// PBR slots written.
    pub written_batches: u64,
    /// Messages written: orders 0 and 1, the next position in this broker's log.
    pub messages: u64,
    /// PBR slots in the global order (orders 2 and 5).
    pub ordered_batches: u64,
    /// PBR slots below this are on every disk replica (replicated topics).
    pub durable_batches: u64,
    /// PBR slots whose memory was released.
    pub reclaimed_batches: u64,
}

/// A topic's health. Absent keys mean none.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TopicHealth {
    /// Subscribers that currently pin memory (live reader slots).
    #[serde(default)]
    pub readers: u32,
    /// The subscriber furthest behind, if any is connected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowest_reader: Option<ReaderLag>,
    /// Disk replicas whose last write or sync failed (empty when all are healthy).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replica_errors: Vec<ReplicaError>,
}

/// How far one subscriber is behind the topic's writers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReaderLag {
    /// Its reader slot in the topic.
    pub slot: u32,
    /// The broker serving it, when known.
    #[serde(default)]
    pub broker: Option<u32>,
    /// The position it still needs (orders 0 and 1: in the log of `log_broker`).
    pub position: u64,
    /// Orders 0 and 1: whose log `position` is in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_broker: Option<u32>,
    /// Messages written that it has not read yet.
    pub behind: u64,
    /// Time since its broker last beat for it.
    pub heartbeat_age_ms: u64,
}

/// A disk replica that fails (the OS error of its last failed write or sync).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReplicaError {
    /// 1-based replica number.
    pub replica: u32,
    pub errno: u64,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_specs_refuse_unknown_fields_and_default_the_rest() {
        let e = serde_json::from_str::<TopicSpec>(r#"{"name":"t","order":2,"replication":2}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `replication`"), "{e}");
        let spec: TopicSpec = serde_json::from_str(r#"{"name":"t","order":2}"#).unwrap();
        assert_eq!(spec, TopicSpec::new("t", 2));
    }

    #[test]
    fn the_documented_topic_answer_parses_into_typed_fields() {
        // The example of docs/API.md, "GET /v1/topics/{name}".
        let info: TopicInfo = serde_json::from_str(
            r#"{"name": "orders", "id": 0, "order": 2, "replication_factor": 2,
                "default_ack": 1, "retention_bytes": 0, "retention_ms": 0,
                "created_unix_ms": 1764075600000, "committed_batches": 3,
                "durable_batches": 3, "durable_position": 5000, "next_position": 5000,
                "brokers": [{"broker": 0, "written_batches": 1, "messages": 2731,
                             "ordered_batches": 1, "durable_batches": 1,
                             "reclaimed_batches": 0}],
                "health": {"readers": 1,
                           "slowest_reader": {"slot": 0, "broker": 2, "position": 4000,
                                              "behind": 1000, "heartbeat_age_ms": 12},
                           "replica_errors": [{"replica": 1, "errno": 28,
                                "message": "No space left on device (os error 28)"}]}}"#,
        )
        .unwrap();
        assert_eq!(info.brokers[0].messages, 2731);
        let slowest = info.health.slowest_reader.as_ref().unwrap();
        assert_eq!((slowest.broker, slowest.behind), (Some(2), 1000));
        assert_eq!(info.health.replica_errors[0].errno, 28);
        let again: TopicInfo =
            serde_json::from_value(serde_json::to_value(&info).unwrap()).unwrap();
        assert_eq!(
            again, info,
            "what the server writes, the client reads back unchanged"
        );
    }

    #[test]
    fn a_healthy_topic_omits_what_it_does_not_have() {
        let v = serde_json::to_value(TopicHealth::default()).unwrap();
        assert_eq!(v, serde_json::json!({"readers": 0}));
        let h: TopicHealth = serde_json::from_str("{}").unwrap();
        assert_eq!(h, TopicHealth::default());
    }
}
