//! `/v1/services`: processes that run beside the log and want to be found through the
//! head (the workflow orchestrator), so `embarcadero status` shows them with no setting.

use serde::{Deserialize, Serialize};

/// `POST /v1/services`: "a `kind` service serves at `addr`; forget it if I am silent for
/// `ttl_ms`". Sent again well within the ttl; unknown fields are refused.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ServiceAnnounce {
    /// What it is: 1 to 32 lower-case letters, digits, `-` or `_` (`workflow`).
    pub kind: String,
    /// Where its HTTP API listens (`host:port`), at most 256 bytes.
    pub addr: String,
    /// How long the head keeps the entry without a new announcement (100 ms to 60 s).
    pub ttl_ms: u64,
    /// The log the service folds, if it folds one: the head refuses the announcement
    /// (409) unless it has that very topic, so a service of another cluster (a stale
    /// process pointed at a port this head now has) is never listed or forwarded to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<ServiceLog>,
}

/// A topic as it was created: its name and creation time, which together tell it apart
/// from a topic of the same name in another cluster or one deleted and made again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ServiceLog {
    pub topic: String,
    pub created_unix_ms: u64,
}

/// One live service, as `GET /v1/services` and `/v1/status` list it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ServiceInfo {
    pub kind: String,
    pub addr: String,
    /// Milliseconds since its last announcement.
    pub last_seen_ms: u64,
    pub ttl_ms: u64,
    /// The topic it folds, as its announcement named it (checked by the head).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<ServiceLog>,
}
