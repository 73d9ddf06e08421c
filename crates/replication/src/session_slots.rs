//! Which session slot of a topic holds a client's order-5 session, remembered by the last
//! replica so it need not scan the session table for every GOI entry.
//!
//! The cache is only a hint: the sequencer gives an idle session's slot to another client
//! (and the idle one, when it returns, a new slot), so every hit is checked against the
//! region. It is bounded: the table has [`SESSION_SLOTS`] slots, each holding at most one
//! client, so entries past twice that are mostly clients long gone, and are dropped by
//! one pass that keeps only the entries the region still confirms. Without the bound, a
//! topic with many short-lived publishers (new client ids) grew it for ever.
//!
//! Owns: nothing in the region; reads session slots only.

use embarcadero_region::{Region, SESSION_SLOTS};
use std::collections::HashMap;

/// Entries at which the cache is pruned to the sessions the region still holds.
const PRUNE_AT: usize = 2 * SESSION_SLOTS as usize;

/// client id → session slot, for one topic (see the module comment).
#[derive(Default)]
pub(crate) struct SessionSlots {
    slots: HashMap<u64, u32>,
}

impl SessionSlots {
    /// The slot of `topic`'s session table that holds `client_id`'s session now, if any.
    pub(crate) fn find(&mut self, region: &Region, topic: u32, client_id: u64) -> Option<u32> {
        let holds = |slot: u32| {
            region
                .session_read(topic, slot)
                .is_some_and(|r| r.client_id == client_id)
        };
        if let Some(&slot) = self.slots.get(&client_id) {
            if holds(slot) {
                return Some(slot);
            }
        }
        let (slot, _) = region.session_find(topic, client_id)?;
        if self.slots.len() >= PRUNE_AT {
            self.prune(region, topic);
        }
        self.slots.insert(client_id, slot);
        assert!(self.slots.len() <= PRUNE_AT, "the cache stays bounded");
        Some(slot)
    }

    /// Keeps only the entries whose slot still holds their client: at most one per slot.
    fn prune(&mut self, region: &Region, topic: u32) {
        self.slots.retain(|&client, &mut slot| {
            region
                .session_read(topic, slot)
                .is_some_and(|r| r.client_id == client)
        });
        assert!(self.slots.len() <= SESSION_SLOTS as usize);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::{Capacities, SessionRecord, SessionState};

    fn session(client_id: u64) -> SessionRecord {
        SessionRecord {
            state: SessionState::Open,
            client_id,
            session_epoch: 1,
            opener: 0,
            committed_hwm: 0,
            last_active_ms: 1,
            opened_at: 0,
            key_hash: 0,
        }
    }

    /// Thousands of short-lived publishers take turns in the same few slots: the cache
    /// never holds more than its bound, and still finds every live session.
    #[test]
    fn many_short_lived_sessions_keep_the_cache_bounded_and_every_lookup_right() {
        let dir = tempfile::tempdir().unwrap();
        let caps = Capacities {
            max_topics: 1,
            brokers: 1,
            goi_slots: 1024,
            pbr_slots: 256,
            segment_bytes: 1 << 20,
            segments_per_broker: 2,
            seg_map_slots: 8,
        };
        let region = Region::create(&dir.path().join("region"), caps).unwrap();
        let mut cache = SessionSlots::default();
        for client in 1..=5_000u64 {
            let slot = (client % 8) as u32;
            region.session_write(0, slot, &session(client));
            assert_eq!(
                cache.find(&region, 0, client),
                Some(slot),
                "client {client}"
            );
            assert!(cache.len() <= PRUNE_AT, "{} entries", cache.len());
            // The client whose slot was taken is no longer found.
            if client > 8 {
                assert_eq!(cache.find(&region, 0, client - 8), None);
            }
        }
    }
}
