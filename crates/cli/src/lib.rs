//! The library half of `embarcadero-cli`: what the `embarcadero` binary shares with the
//! crate's examples (a cluster of real processes for failure runs).

pub mod local_cluster;
