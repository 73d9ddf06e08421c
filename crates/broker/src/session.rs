//! The broker's read-only view of one order-5 session in the region's session table
//! (written by the sequencer): its committed high-water mark and whether the epoch a
//! connection speaks for has been fenced.

use embarcadero_region::{Region, SessionState};

pub struct SessionView {
    topic: u32,
    client_id: u64,
    epoch: u64,
    slot: Option<u32>,
}

/// What a connection needs to know about its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionStatus {
    /// Every batch below this is committed in the GOI.
    pub committed_hwm: u64,
    /// Every batch below this is on every disk replica (replicated topics).
    pub durable_hwm: u64,
    /// The connection's epoch was fenced or superseded by a newer one.
    pub fenced: bool,
}

impl SessionStatus {
    /// Batches below this count as acknowledged at `ack_level`: committed, and for
    /// ack 2 also durable. A client resumes (after a fence or a reconnect) from here.
    pub fn acked_hwm(&self, ack_level: u8) -> u64 {
        if ack_level == 2 {
            self.durable_hwm.min(self.committed_hwm)
        } else {
            self.committed_hwm
        }
    }
}

impl SessionView {
    pub fn new(topic: u32, client_id: u64, epoch: u64) -> Self {
        Self {
            topic,
            client_id,
            epoch,
            slot: None,
        }
    }

    /// The session's current status; a session the sequencer has not seen yet has
    /// committed nothing.
    pub fn status(&mut self, region: &Region) -> SessionStatus {
        let cached = self
            .slot
            .and_then(|slot| region.session_read(self.topic, slot))
            .filter(|r| r.client_id == self.client_id);
        let record = cached.or_else(|| {
            let (slot, r) = region.session_find(self.topic, self.client_id)?;
            self.slot = Some(slot);
            Some(r)
        });
        match (record, self.slot) {
            (Some(r), Some(slot)) => SessionStatus {
                committed_hwm: r.committed_hwm,
                durable_hwm: region
                    .session_durable_hwm(self.topic, slot)
                    .load(std::sync::atomic::Ordering::Acquire),
                fenced: r.session_epoch > self.epoch
                    || (r.session_epoch == self.epoch && r.state == SessionState::Fenced),
            },
            _ => SessionStatus {
                committed_hwm: 0,
                durable_hwm: 0,
                fenced: false,
            },
        }
    }

    /// True when the session has no slot in the table and cannot get one: every slot
    /// holds another client's session, so the sequencer drops this session's batches.
    /// Meant for a session not seen yet; one that has a slot is never crowded out.
    pub fn crowded_out(&self, region: &Region) -> bool {
        self.slot.is_none()
            && region.session_find(self.topic, self.client_id).is_none()
            && region.session_table_full(self.topic)
    }
}

/// The error text of a SessionsExhausted frame.
pub fn exhausted_message(topic: &str) -> String {
    format!(
        "all {} order-5 session slots of topic {topic:?} hold other clients' sessions (a \
         topic keeps one per client id that ever published to it); publish with a client \
         id that has a session on it, or use another topic",
        embarcadero_region::SESSION_SLOTS
    )
}

/// The error text of a SessionFenced frame; clients parse `hwm=N`.
pub fn fenced_message(epoch: u64, hwm: u64) -> String {
    format!(
        "session epoch {epoch} is fenced: a gap at its head outlived the session lease (or a newer epoch exists); hwm={hwm}; reopen with epoch {} and resend from batch {hwm}",
        epoch + 1
    )
}
