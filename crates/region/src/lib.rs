//! The shared memory region: one `MAP_SHARED` file that brokers, the sequencer and
//! the disk replicas attach to.
//!
//! Owns: the layout (offsets computed from the capacities in the header), the header
//! check on attach, typed single-writer accessors for every field, the PBR and GOI slot
//! formats with their commit tokens, the segment map, cross-process doorbells, and the
//! flush/fence hooks. It is the only crate with `unsafe`: everything that turns an
//! offset into memory goes through `Region::word` (crate-private) or the BLog byte accessors, which
//! check bounds. It knows nothing about sockets, topics' semantics, or ordering
//! policy; it only provides the memory protocol those are built on.
//!
//! Memory protocol (design axiom A2): every field has one writer; counters only grow;
//! a commit token (`publish_commit` of a PBR slot, `global_seq` of a GOI entry, `tag`
//! of a segment-map entry, `state` of a topic) is stored with `Release` after the data
//! it guards, and read with `Acquire` before that data. Readers that may race with
//! reclamation re-check the token (or the reclaimed frontier) after reading: a seqlock.
//!
//! # Who writes what
//!
//! The rule "one writer per field" is kept by types: the words a writer stores are only
//! reachable through its write handle, obtained from one method of [`Region`] each
//! (`handles.rs`); every other accessor returns a read-only [`ReadWord`]. Records written
//! as a whole (a PBR slot, a GOI entry, a session slot, a topic's metadata) are written
//! by one method each ("methods" below), which never hands out the words. A counter that
//! only grows is a [`MonotonicU64`], whose `advance` asserts that it does (in release
//! builds too: one extra load of a word the writer owns). The writers, by process role:
//!
//! | writer | handle | words | call sites |
//! |---|---|---|---|
//! | broker, service thread | [`BrokerLine`] | `written_frontier`, `reclaimed_pbr`, `reclaimed_blog`, `reclaim_pass` (monotonic); `frontier_msgs` (not asserted: see [`BrokerLine::frontier_msgs`]) | `broker/service.rs` |
//! | broker, restart | [`BrokerLine`] | `resume_pbr`, `resumed_fence`; ends a `reclaim_pass` its predecessor left open | `broker/resume.rs` |
//! | broker, connection | methods | a reserved PBR slot (`pbr_commit`), its seg-map entry (`seg_map_publish`) | `broker/publish.rs`, `log_writer.rs` |
//! | broker, frontier pass | method | PBR `start_logical_offset` (`pbr_set_start_offset`) | `broker/service.rs` |
//! | broker, subscriber | [`ReaderSlotHandle`] | a claimed reader slot's heartbeat (compare-and-swap), positions, owner, address; the readers line (raised) | `broker/subscribe.rs` |
//! | broker, session | method | a session's last-active stamp (raised, `session_touch`) | `broker/session.rs` |
//! | broker, start | [`OwnerRecord`] | its owner record | `broker/lib.rs`, `resume.rs` |
//! | sequencer | [`SequencerLine`] | `ordered_pbr` (monotonic), `reclaim_request` (raised), `fence_ack` | `sequencer/lib.rs` |
//! | sequencer | [`SequencerTopic`] | `committed_seq`, `next_position` (monotonic); resets a session slot's durable mark | `sequencer/lib.rs`, `sessions.rs` |
//! | sequencer | methods | GOI entries (`goi_write`), session slots (`session_write`), PBR `total_order` | `sequencer/lib.rs`, `sessions.rs` |
//! | sequencer candidates | [`LeaseWords`] | `fencing_epoch` (monotonic), `sequencer_id`, `lease_deadline_ns` (compare-and-swap); the sequencer owner record | `sequencer/lease.rs` |
//! | replica worker | [`ReplicaLine`] | its progress line: `durable_seq`, `own_durable_seq`, `durable_position` (monotonic; `own_durable_seq` restated on opening the disk copy), `error` | `replication/worker.rs` |
//! | last replica's worker | [`ChainMarks`] | `durable_pbr` per broker, a session's durable mark (raised) | `replication/worker.rs` |
//! | control plane | [`ControlPlane`] | `fence_pbr` (declaring a broker dead), the position ceiling (raised) | `server/failover.rs`, `control.rs` |
//! | control plane | methods | topic meta and state, Free → Active → Deleted (`write_topic_meta`, `delete_topic`); freeing a dead broker's unbeaten reader slots by compare-and-swap (`release_reader_slots`) | `server/control.rs`, `lib.rs` |
//! | start-up seed (no other writer runs yet) | the owners' handles | the sequence line, `start_position`, broker positions, replica lines, session table | `replication/recovery.rs` |
//! | region creator; restarted head | methods | the header (`create`), the retired flag (`retire`) | `server/lib.rs` |
//! | anyone | [`Doorbell`] | bells are counters every process may ring | everywhere |

pub mod backoff;
mod blog;
pub mod coherence;
mod control;
mod doorbell;
mod goi;
mod handles;
pub mod layout;
pub mod owner;
mod pbr;
mod readers;
mod region;
mod sessions;
mod slots;
#[cfg(test)]
mod tests;
mod topic;
mod word;

pub use doorbell::Doorbell;
pub use handles::{
    BrokerLine, ChainMarks, ControlPlane, LeaseWords, ReaderSlotHandle, ReplicaLine, SequencerLine,
    SequencerTopic,
};
pub use layout::{
    Capacities, Layout, ATTACH_HEAD_LEN, MAX_BROKERS, MAX_REPLICAS, READER_SLOTS, SESSION_SLOTS,
};
pub use owner::{Fenced, OwnerRecord, ProcessIdentity};
pub use readers::{Released, SlowestReader, READER_CLAIMING};
pub use region::{monotonic_ns, unix_ms, Region};
pub use slots::{
    session_idle, GoiEntry, SessionRecord, SessionState, TopicMeta, TopicState, GOI_SESSION_START,
    NO_POSITION_CEILING,
};
pub use topic::{LogControl, ReplicaProgress, TopicSeq};
pub use word::{MonotonicU64, OwnedWord, ReadWord};

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
