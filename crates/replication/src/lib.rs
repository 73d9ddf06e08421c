//! Disk replicas: each copies a topic's batches out of the region, in global order,
//! into its own segment files, and makes them durable with group-committed
//! `fdatasync`. The chain of replicas advances the topic's durable frontier, which
//! ack-2 acknowledgements, memory reclamation and disk reads wait on.
//!
//! Owns: the replica directories and their segment files; the replica progress lines of
//! the region and the `durable_pbr` of each log; the `durable_hwm` word of order-5
//! session slots. It reads GOI entries, sequence lines and payload bytes, and writes
//! nothing else in the region. Brokers use [`reader::DiskReader`] to serve subscribers
//! from disk once memory has been reclaimed; the server uses [`recovery`] at start-up.

pub mod reader;
pub mod record;
pub mod recovery;
mod session_slots;
pub mod store;
pub mod worker;

pub use reader::{DiskReader, DiskSeek};
pub use record::{RecordHeader, RECORD_HEADER_LEN};
pub use store::TopicStore;
pub use worker::{Replicas, ReplicationConfig, ReplicationMetrics};

use std::path::{Path, PathBuf};

/// Directory of one topic's log inside a replica directory. The creation time makes a
/// re-created topic of the same name start a fresh log.
pub fn topic_dir(replica_dir: &Path, topic_name: &str, created_unix_ms: u64) -> PathBuf {
    replica_dir.join(format!("{topic_name}.{created_unix_ms}"))
}
