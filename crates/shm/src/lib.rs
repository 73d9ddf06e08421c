//! Local shared-memory transport (issue 26): a client on the broker's host publishes
//! through a channel, one sealed memfd per connection that only it and its broker map,
//! instead of a TCP socket.
//!
//! Owns: the channel's layout (`layout`, the one place its words are declared), the
//! mapping (`mapping`), the two single-producer single-consumer byte rings (`ring`),
//! lending ring space to a batch built in place (`lend`),
//! futex doorbells (`bell`) and the Unix-socket handshake that hands the memfd over with
//! the peer's uid checked (`socket`). Touches: the channel's memory and the sockets
//! given to it; never the region. The broker and the client both build on it; neither
//! trusts what the other writes into the channel.

pub mod bell;
pub mod layout;
pub mod lend;
pub mod mapping;
pub mod ring;
pub mod socket;

pub use lend::Span;
pub use mapping::Mapping;
pub use ring::{Consumer, Producer, Waited};

#[cfg(test)]
mod tests;
