//! What `embarcadero.Subscriber` reads ahead: the Rust client's [`ReadAhead`] thread polls
//! while Python handles the messages of the previous poll, so the network read and the
//! per-message work in Python overlap instead of adding up. This module says what one
//! poll keeps for Python ([`Messages`]) and how far ahead the thread reads.

use embarcadero_client::{Collect, MessageRef, SharedBatch};

/// Polls waiting to be taken before the thread stops reading.
pub const READ_AHEAD: usize = 8;
/// Most bytes of batches one poll takes (whole batches; at least one): the batches of
/// a poll are freed only when Python has taken its last message, so a poll of
/// everything ready (up to the subscriber's whole read-ahead) kept tens of MiB away from
/// the subscriber's buffer reuse, and the reader faulted in fresh memory instead.
pub const POLL_BYTES: usize = 1 << 20;

/// The Rust subscriber and its read-ahead thread, as Python's subscriber holds them.
pub type ReadAhead = embarcadero_client::ReadAhead<Messages>;

/// A message's fields, and where its payload lies: in batch `batch` of its poll.
pub struct Meta {
    pub position: u64,
    pub broker_id: u16,
    pub client_id: u64,
    pub batch_seq: u64,
    pub index_in_batch: u32,
    pub publish_ts_ns: u64,
    /// Index into [`Messages::batches`].
    batch: u32,
    payload_at: u32,
    payload_len: u32,
}

/// What one poll brought: each message's fields and where its payload is, in the
/// batches the Rust subscriber lent (kept alive, and unchanged, while this is:
/// `Subscriber::poll_shared`). One reference per batch, none per message. No payload
/// is copied here: Python copies each once, into its `bytes`, from the batch it came in.
#[derive(Default)]
pub struct Messages {
    batches: Vec<SharedBatch>,
    pub metas: Vec<Meta>,
}

impl Collect for Messages {
    fn collect(&mut self, batch: &SharedBatch, m: MessageRef<'_>) {
        let same = |b: &SharedBatch| b.as_mut_ptr() == batch.as_mut_ptr();
        if !self.batches.last().is_some_and(same) {
            self.batches.push(batch.clone());
        }
        let range = batch.range_of(m.payload);
        // A delivery is at most 256 MiB (the client refuses larger), so offsets fit.
        let (payload_at, payload_len) = (u32::try_from(range.start), u32::try_from(range.len()));
        self.metas.push(Meta {
            position: m.position,
            broker_id: m.broker_id,
            client_id: m.client_id,
            batch_seq: m.batch_seq,
            index_in_batch: m.index_in_batch,
            publish_ts_ns: m.publish_ts_ns,
            batch: (self.batches.len() - 1) as u32,
            payload_at: payload_at.expect("a delivery is under 4 GiB"),
            payload_len: payload_len.expect("a delivery is under 4 GiB"),
        });
    }

    fn count(&self) -> usize {
        self.metas.len()
    }

    fn positions(&self) -> Vec<(u16, u64)> {
        self.metas
            .iter()
            .map(|m| (m.broker_id, m.position))
            .collect()
    }
}

impl Messages {
    /// The payload of `meta`, one of this poll's messages.
    pub fn payload(&self, meta: &Meta) -> &[u8] {
        let at = meta.payload_at as usize;
        &self.batches[meta.batch as usize].bytes()[at..at + meta.payload_len as usize]
    }
}
