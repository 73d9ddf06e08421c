//! The order-5 session table: one slot per session, written by the sequencer as a
//! seqlock, with a last-active stamp brokers raise and a durable mark the replicas raise.

use crate::coherence::store_fence;
use crate::layout::*;
use crate::slots::{SessionRecord, SessionState};
use crate::word::ReadWord;
use crate::Region;
use std::sync::atomic::Ordering;

impl Region {
    /// Writes a session slot, state word last. Sequencer only. The last-active stamp is
    /// only raised (brokers raise it too, `session_touch`); a slot given to another
    /// session keeps the previous holder's stamp, which is older than the new one's.
    ///
    /// The state word carries a write count above its low byte (a seqlock): a reader
    /// that slept through a whole rewrite sees the word change, so it can never take
    /// one client's id with another's marks when the slot goes to another session.
    pub fn session_write(&self, topic: u32, slot: u32, s: &SessionRecord) {
        assert!(slot < SESSION_SLOTS, "session slot {slot} out of range");
        // The epoch shares its word with the opener: brokers refuse larger epochs.
        assert!(
            s.session_epoch <= u32::MAX as u64,
            "session epoch {} of client {} does not fit the table's 32 bits",
            s.session_epoch,
            s.client_id
        );
        let base = self.layout.session_slot_off(topic, slot);
        let writes = (self.word(base + S_STATE).load(Ordering::Relaxed) >> 8).wrapping_add(1);
        // State 0 with the count: being rewritten (a free slot's word is all zero).
        self.word(base + S_STATE)
            .store(writes << 8, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        self.word(base + S_CLIENT_ID)
            .store(s.client_id, Ordering::Relaxed);
        self.word(base + S_SESSION_EPOCH)
            .store(s.session_epoch | (s.opener as u64) << 32, Ordering::Relaxed);
        self.word(base + S_COMMITTED_HWM)
            .store(s.committed_hwm, Ordering::Relaxed);
        self.word(base + S_LAST_ACTIVE_MS)
            .fetch_max(s.last_active_ms, Ordering::Relaxed);
        self.word(base + S_OPENED_AT)
            .store(s.opened_at, Ordering::Relaxed);
        self.word(base + S_KEY_HASH)
            .store(s.key_hash, Ordering::Relaxed);
        store_fence();
        self.word(base + S_STATE)
            .store(s.state as u64 | writes << 8, Ordering::Release);
        // The reader's view of the slot is the writer's: the same record, but for the
        // last-active stamp, which brokers may have raised meanwhile.
        debug_assert!(
            self.session_read(topic, slot).is_some_and(|r| r
                == SessionRecord {
                    last_active_ms: r.last_active_ms,
                    ..*s
                }
                && r.last_active_ms >= s.last_active_ms),
            "session slot {slot} of topic {topic} reads back other than written: {s:?}"
        );
    }

    /// Reads a session slot if it is in use. A slot being rewritten is waited for (a
    /// rewrite is a few stores), so a slot in use never reads as free; only a writer
    /// that stopped mid-rewrite (a crashed sequencer) leaves it reading as free.
    pub fn session_read(&self, topic: u32, slot: u32) -> Option<SessionRecord> {
        const SPINS: u32 = 10_000;
        let base = self.layout.session_slot_off(topic, slot);
        for _ in 0..SPINS {
            let word = self.word(base + S_STATE).load(Ordering::Acquire);
            if word == 0 {
                return None;
            }
            let Some(state) = SessionState::from_u64(word & 0xff) else {
                std::hint::spin_loop();
                continue;
            };
            let epoch_word = self.word(base + S_SESSION_EPOCH).load(Ordering::Acquire);
            let rec = SessionRecord {
                state,
                client_id: self.word(base + S_CLIENT_ID).load(Ordering::Acquire),
                session_epoch: epoch_word & u32::MAX as u64,
                opener: (epoch_word >> 32) as u32,
                committed_hwm: self.word(base + S_COMMITTED_HWM).load(Ordering::Acquire),
                last_active_ms: self.word(base + S_LAST_ACTIVE_MS).load(Ordering::Acquire),
                opened_at: self.word(base + S_OPENED_AT).load(Ordering::Acquire),
                key_hash: self.word(base + S_KEY_HASH).load(Ordering::Acquire),
            };
            if self.word(base + S_STATE).load(Ordering::Acquire) == word {
                return Some(rec);
            }
        }
        None
    }

    /// Raises the last-active stamp of the session in `slot` to `now_ms`: a broker does
    /// while the session's client is connected, so that it is not taken for idle.
    pub fn session_touch(&self, topic: u32, slot: u32, now_ms: u64) {
        self.word(self.layout.session_slot_off(topic, slot) + S_LAST_ACTIVE_MS)
            .fetch_max(now_ms, Ordering::Relaxed);
    }

    /// Order 5, ack 2: every batch of the session in `slot` with `batch_seq` below
    /// this is on every replica's disk. Written only by the last replica's worker.
    pub fn session_durable_hwm(&self, topic: u32, slot: u32) -> ReadWord<'_> {
        self.read_word(self.layout.session_slot_off(topic, slot) + S_DURABLE_HWM)
    }

    /// Finds the session slot of `client_id` in a topic's session table.
    pub fn session_find(&self, topic: u32, client_id: u64) -> Option<(u32, SessionRecord)> {
        (0..SESSION_SLOTS).find_map(|slot| {
            self.session_read(topic, slot)
                .filter(|r| r.client_id == client_id)
                .map(|r| (slot, r))
        })
    }

    /// True when a new session of `topic` can get a slot: one is free, or held by a
    /// session its publisher ended or idle for at least `idle_ms` at `now_ms` (the
    /// sequencer ends one of those for a new one). Only by the stamps: the sequencer may still find no
    /// session it can end (batches not yet on the replicas).
    pub fn session_table_has_room(&self, topic: u32, now_ms: u64, idle_ms: u64) -> bool {
        (0..SESSION_SLOTS).any(|slot| {
            self.session_read(topic, slot)
                .is_none_or(|r| r.may_end_at(now_ms, idle_ms))
        })
    }
}
