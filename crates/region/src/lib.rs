//! The shared memory region: one `MAP_SHARED` file that brokers, the sequencer and
//! the disk replicas attach to.
//!
//! Owns: the layout (offsets computed from the capacities in the header), the header
//! check on attach, typed single-writer accessors for every field, the PBR and GOI slot
//! formats with their commit tokens, the segment map, cross-process doorbells, and the
//! flush/fence hooks. It is the only crate with `unsafe`: everything that turns an
//! offset into memory goes through [`Region::word`] or the BLog byte accessors, which
//! check bounds. It knows nothing about sockets, topics' semantics, or ordering
//! policy; it only provides the memory protocol those are built on.
//!
//! Memory protocol (design axiom A2): every field has one writer; counters only grow;
//! a commit token (`publish_commit` of a PBR slot, `global_seq` of a GOI entry, `tag`
//! of a segment-map entry, `state` of a topic) is stored with `Release` after the data
//! it guards, and read with `Acquire` before that data. Readers that may race with
//! reclamation re-check the token (or the reclaimed frontier) after reading: a seqlock.

pub mod backoff;
pub mod coherence;
mod doorbell;
pub mod layout;
pub mod owner;
mod region;
mod slots;

pub use doorbell::Doorbell;
pub use layout::{Capacities, Layout, MAX_BROKERS, MAX_REPLICAS, READER_SLOTS, SESSION_SLOTS};
pub use owner::{Fenced, OwnerRecord, ProcessIdentity};
pub use region::{
    monotonic_ns, unix_ms, LogControl, Region, ReplicaProgress, SlowestReader, TopicSeq,
    ATTACH_HEAD_LEN, READER_CLAIMING,
};
pub use slots::{
    session_idle, GoiEntry, SessionRecord, SessionState, TopicMeta, TopicState, GOI_SESSION_START,
    NO_POSITION_CEILING,
};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("invalid region capacities: {0}")]
    BadCapacities(String),
    #[error("cannot use region file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not an Embarcadero region (bad magic); refusing to attach")]
    BadMagic { path: PathBuf },
    #[error("{path} has region layout version {found}, this build uses {expected}; start the server with a fresh data dir or the matching version")]
    VersionMismatch {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("{path} was not completely initialised (its creator died during set-up); remove it and start again")]
    Uninitialised { path: PathBuf },
    #[error("{path}: region {field} is {found} but {expected} was expected; every process attached to one region must use the same capacities")]
    LayoutMismatch {
        path: PathBuf,
        field: &'static str,
        found: u64,
        expected: u64,
    },
    #[error("{path} is {found} bytes but its header says {expected}; the file was truncated or is not a region")]
    Truncated {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
}
