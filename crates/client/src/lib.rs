//! The Rust client library: [`Publisher`], [`Subscriber`] and [`Admin`].
//!
//! Owns: client-side batching (messages are written once, in their final wire form,
//! into pooled batch buffers), the per-connection queues and their sender/ack-reader
//! threads, acknowledgement tracking, and subscriber reassembly of positions. It talks
//! to brokers only through the protocol in `embarcadero-wire` and to the control plane
//! only through its HTTP API; it never maps the region.

mod admin;
mod conn;
mod cursor_fit;
mod delivery;
mod publisher;
mod read_ahead;
mod shm;
mod subscriber;

pub use admin::{
    check_topic_name, control_url, not_the_admin_api, unreachable_hint, Admin, BrokerAddr,
    BrokerLogInfo, BrokerRates, ClusterInfo, LocalBrokerStats, MemberState, MemberView,
    RatesReport, ReaderLag, ReplicaError, SequencerLease, SequencerStats, ServiceAnnounce,
    ServiceInfo, ServiceLog, StatusReport, TopicHealth, TopicInfo, TopicSpec, BUSY_RETRY_FOR,
    TOPIC_NAME_RULES,
};
pub use cursor_fit::CursorMismatch;
pub use delivery::SharedBatch;
pub use embarcadero_api::MAX_REQUEST_BODY;
pub use publisher::{LatencySummary, Publisher, PublisherConfig, PublisherStats, QueueStats};
pub use read_ahead::{Collect, Polled, ReadAhead, SubscriberStatus};
pub use shm::Transport;
pub use subscriber::{Cursor, Message, MessageRef, Subscriber, SubscriberConfig};

use embarcadero_wire::ErrorCode;

/// Everything that can go wrong in the client.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("cannot reach {what} at {addr}: {message}")]
    Connect {
        what: &'static str,
        addr: String,
        message: String,
    },
    #[error("admin API error ({status}): {message}")]
    Admin { status: u16, message: String },
    #[error("broker {broker} refused: {message} ({code:?})")]
    Broker {
        broker: String,
        code: ErrorCode,
        message: String,
    },
    #[error("connection to broker {broker} lost: {message}")]
    ConnectionLost { broker: String, message: String },
    #[error("protocol violation from {peer}: {message}")]
    Protocol { peer: String, message: String },
    #[error("message of {size} bytes exceeds the broker's maximum of {max} bytes")]
    MessageTooLarge { size: usize, max: usize },
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A topic name the server would refuse, caught before any request is sent.
    #[error("{0}")]
    InvalidName(String),
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("the publisher is closed")]
    Closed,
    #[error("no live broker left to publish to; check `embarcadero status`")]
    NoLiveBroker,
}

impl Error {
    /// The broker error code, if the broker refused something.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Broker { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the server is (for now) not there, as while it restarts: it refused or
    /// dropped the connection, no broker of it is alive, or it did not answer in time.
    /// What is worth trying again later, unlike a refusal: `pub` and `sub --retry-for`
    /// reconnect after these, and the workflow's processes and workers wait them out
    /// (`embarcadero_workflow::supervisor`).
    pub fn server_gone(&self) -> bool {
        matches!(
            self,
            Error::ConnectionLost { .. }
                | Error::Connect { .. }
                | Error::NoLiveBroker
                | Error::Timeout(_)
        )
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A fresh order-5 session key from the operating system's random source.
pub fn random_session_key() -> Result<[u8; embarcadero_wire::SESSION_KEY_LEN]> {
    let mut key = [0u8; embarcadero_wire::SESSION_KEY_LEN];
    getrandom::fill(&mut key)
        .map_err(|e| Error::Config(format!("cannot draw a session key: {e}")))?;
    Ok(key)
}

/// An order-5 publisher's opener (`Hello::opener`): 32 random bits, never 0 (which
/// means "unknown" to a broker).
pub(crate) fn random_opener() -> Result<u32> {
    let mut bytes = [0u8; 4];
    loop {
        getrandom::fill(&mut bytes)
            .map_err(|e| Error::Config(format!("cannot draw a session opener: {e}")))?;
        let opener = u32::from_le_bytes(bytes);
        if opener != 0 {
            return Ok(opener);
        }
    }
}

/// A client id that is unique with overwhelming probability (time, pid, hasher seed),
/// odd, and at most [`embarcadero_wire::MAX_JSON_SAFE`]: it is shown as a JSON number
/// (`sub --format jsonl`, `pub --json`), which jq and JavaScript read as a double. 52
/// random bits: two of 256 live publishers of a topic share one with a chance of 7e-12.
pub fn random_client_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    let id = (h.finish() & embarcadero_wire::MAX_JSON_SAFE) | 1;
    assert!(id & 1 == 1 && id <= embarcadero_wire::MAX_JSON_SAFE);
    id
}

/// Wall-clock nanoseconds since the Unix epoch: the clock messages' `publish_ts_ns`
/// is read from, so end-to-end latency compares against this one.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn client_ids_are_odd_distinct_and_survive_a_javascript_number() {
        let ids: std::collections::HashSet<u64> =
            (0..1000).map(|_| super::random_client_id()).collect();
        assert_eq!(ids.len(), 1000, "distinct");
        for id in ids {
            assert_eq!(id & 1, 1, "{id}");
            assert!(id <= embarcadero_wire::MAX_JSON_SAFE, "{id}");
            // A double holds it exactly: what jq and JavaScript read is the id.
            assert_eq!(id as f64 as u64, id);
        }
    }
}
