//! `GET /v1/status`: the head's whole picture for `embarcadero status`: the cluster,
//! topics with counters, recent rates, its own brokers' counters and its sequencer.

use crate::{ClusterInfo, ServiceInfo, TopicInfo};
use serde::{Deserialize, Serialize};

/// Counters of one broker the head's own process serves (followers keep their own).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LocalBrokerStats {
    pub id: u32,
    pub addr: String,
    pub publish_bytes: u64,
    pub publish_batches: u64,
    pub publish_messages: u64,
    pub subscribe_bytes: u64,
    /// Open connections, publishers and subscribers.
    pub connections: u64,
    /// Times a publisher waited for log space.
    pub backpressure_waits: u64,
    /// Free segments in the broker's pool.
    pub free_segments: u64,
}

/// The head's sequencer, or `External` when `embarcadero sequencer` processes order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum SequencerStats {
    Embedded {
        epochs: u64,
        batches_ordered: u64,
        messages_ordered: u64,
    },
    External,
}

/// Rates over the last seconds; `{}` until the head has two samples.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RatesReport {
    /// The time the rates are taken over (about 5 s); absent (0) until there are rates.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub window_ms: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub brokers: Vec<BrokerRates>,
    /// Messages written per second, by topic name.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub topics: std::collections::BTreeMap<String, u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One local broker's counters as rates per second.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BrokerRates {
    pub id: u32,
    pub publish_bytes_per_s: u64,
    pub publish_messages_per_s: u64,
    pub subscribe_bytes_per_s: u64,
    pub backpressure_waits_per_s: u64,
}

/// `GET /v1/status` (type parameters as [`ClusterInfo`]'s).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StatusReport<Config = serde_json::Value, Caps = serde_json::Value> {
    pub version: String,
    pub uptime_s: u64,
    pub cluster: ClusterInfo<Config, Caps>,
    pub topics: Vec<TopicInfo>,
    pub rates: RatesReport,
    pub brokers: Vec<LocalBrokerStats>,
    pub sequencer: SequencerStats,
    /// Services that announced themselves to the head (`/v1/services`).
    #[serde(default)]
    pub services: Vec<ServiceInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequencer_is_tagged_by_its_mode() {
        let embedded = SequencerStats::Embedded {
            epochs: 1,
            batches_ordered: 2,
            messages_ordered: 3,
        };
        let v = serde_json::to_value(&embedded).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"mode": "embedded", "epochs": 1, "batches_ordered": 2, "messages_ordered": 3})
        );
        let external: SequencerStats = serde_json::from_str(r#"{"mode":"external"}"#).unwrap();
        assert_eq!(external, SequencerStats::External);
    }

    #[test]
    fn rates_are_an_empty_object_until_there_are_two_samples() {
        let v = serde_json::to_value(RatesReport::default()).unwrap();
        assert_eq!(v, serde_json::json!({}));
        let back: RatesReport = serde_json::from_value(v).unwrap();
        assert_eq!(back, RatesReport::default());
    }
}
