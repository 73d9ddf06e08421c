//! The admin API's JSON documents (`docs/API.md`): one definition of each, which the
//! server serialises its answers from and parses its requests with, and which the client
//! (and through it the CLI and the SDKs) parses those answers into.
//!
//! Owns the types only: no I/O, no server state. Requests refuse fields they do not know
//! (`deny_unknown_fields`), so a misspelt option is an error, never silently dropped;
//! answers accept fields they do not know, so an older client reads a newer server.

mod cluster;
mod services;
mod status;
mod topics;

pub use cluster::{BrokerAddr, ClusterInfo, MemberState, MemberView, RegionInfo, SequencerLease};
pub use services::{ServiceAnnounce, ServiceInfo, ServiceLog};
pub use status::{BrokerRates, LocalBrokerStats, RatesReport, SequencerStats, StatusReport};
pub use topics::{BrokerLogInfo, ReaderLag, ReplicaError, TopicHealth, TopicInfo, TopicSpec};

/// Largest request body the server's HTTP APIs accept (the admin API, and the workflow
/// API through the control port or the orchestrator's own): a larger one is answered
/// 413. Clients check it before sending, since a server that refuses a body it has not
/// read closes the connection under a client still writing it.
pub const MAX_REQUEST_BODY: usize = 64 * 1024;
