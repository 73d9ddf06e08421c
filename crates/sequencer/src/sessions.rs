//! Order 5: total order plus per-session FIFO across brokers.
//!
//! A session is `(client_id, session_epoch)`; each of its batches carries the next
//! `batch_seq` of the session, whichever broker it was sent to. Per session the
//! sequencer keeps `next_expected`: a batch with that sequence is admitted (and any held
//! successors cascade after it), a lower one is a duplicate or late retransmit and is
//! dropped (it is already committed, so it stays acknowledged), a higher one waits in a
//! hold buffer bounded by the session window. Admitted batches are ordered in admission
//! order, so the GOI respects every session's order. A gap at the head of a session that
//! outlives the lease fences the session: its held batches are dropped and its epoch is
//! refused until the client reopens with a higher one. Sessions are independent: a gap
//! in one never delays another.
//!
//! Durable state: the region's session table holds, per session, the epoch and the
//! committed high-water mark (every batch below it is in the committed GOI), state word
//! last. A restarted sequencer rebuilds from the table, reconciled with the GOI tail
//! (the table is written after `committed_seq`, so it may lag by one epoch).

use embarcadero_region::{GoiEntry, Region, SessionRecord, SessionState, SESSION_SLOTS};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A batch admitted to (or held for) the global order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admitted {
    pub broker: u32,
    pub pbr_index: u64,
    pub entry: GoiEntry,
}

#[derive(Debug)]
struct Session {
    slot: u32,
    epoch: u64,
    /// Next sequence to admit.
    next_expected: u64,
    /// Every batch below this is in the committed GOI (what the table holds).
    committed_hwm: u64,
    held: BTreeMap<u64, Admitted>,
    fenced: bool,
    /// When the head of the session last stopped moving while batches were held.
    gap_since: Option<Instant>,
    dirty: bool,
}

pub(crate) struct Sessions {
    topic: u32,
    by_client: HashMap<u64, Session>,
    used_slots: Vec<bool>,
    /// Admitted batches in admission order, waiting for the end of the epoch.
    pub ready: VecDeque<Admitted>,
    /// Per broker: PBR indices scanned but neither committed nor dropped. A broker's
    /// ordered frontier cannot pass the lowest of them.
    outstanding: Vec<BTreeSet<u64>>,
    window: u64,
    lease: Duration,
    /// Something changed that must reach the region (a drop, a fence).
    pub dirty: bool,
}

impl Sessions {
    /// Rebuilds a topic's sessions from the region's table and the committed GOI.
    pub fn recover(region: &Region, topic: u32, window: u64, lease: Duration) -> Self {
        let brokers = region.capacities().brokers as usize;
        let mut s = Self {
            topic,
            by_client: HashMap::new(),
            used_slots: vec![false; SESSION_SLOTS as usize],
            ready: VecDeque::new(),
            outstanding: vec![BTreeSet::new(); brokers],
            window,
            lease,
            dirty: false,
        };
        for slot in 0..SESSION_SLOTS {
            if let Some(r) = region.session_read(topic, slot) {
                s.used_slots[slot as usize] = true;
                s.by_client.insert(
                    r.client_id,
                    Session {
                        slot,
                        epoch: r.session_epoch,
                        next_expected: r.committed_hwm,
                        committed_hwm: r.committed_hwm,
                        held: BTreeMap::new(),
                        fenced: r.state == SessionState::Fenced,
                        gap_since: None,
                        dirty: false,
                    },
                );
            }
        }
        // Batches committed after the table was last written.
        let committed = region
            .topic_seq(topic)
            .committed_seq
            .load(Ordering::Acquire);
        let from = committed.saturating_sub(region.capacities().goi_slots);
        for g in from..committed {
            let Some(e) = region.goi_read(topic, g) else {
                continue;
            };
            let session = match s.by_client.get_mut(&e.client_id) {
                Some(session) => session,
                None => match s.open(e.client_id, e.session_epoch) {
                    Some(session) => session,
                    None => continue,
                },
            };
            if e.client_seq + 1 > session.committed_hwm {
                session.committed_hwm = e.client_seq + 1;
                session.next_expected = session.committed_hwm;
                session.epoch = session.epoch.max(e.session_epoch);
                session.dirty = true;
            }
        }
        s.dirty = s.by_client.values().any(|x| x.dirty);
        s
    }

    fn open(&mut self, client_id: u64, epoch: u64) -> Option<&mut Session> {
        let slot = self.used_slots.iter().position(|used| !used)? as u32;
        self.used_slots[slot as usize] = true;
        Some(self.by_client.entry(client_id).or_insert(Session {
            slot,
            epoch,
            next_expected: 0,
            committed_hwm: 0,
            held: BTreeMap::new(),
            fenced: false,
            gap_since: None,
            dirty: true,
        }))
    }

    /// Takes one scanned PBR slot (`entry` is `None` for a void slot).
    pub fn admit(&mut self, broker: u32, pbr_index: u64, entry: Option<GoiEntry>) {
        let Some(entry) = entry else {
            self.dirty = true;
            return;
        };
        self.outstanding[broker as usize].insert(pbr_index);
        let batch = Admitted {
            broker,
            pbr_index,
            entry,
        };
        let seq = entry.client_seq;
        let window = self.window;
        if !self.by_client.contains_key(&entry.client_id)
            && self.open(entry.client_id, entry.session_epoch).is_none()
        {
            tracing::error!(
                topic = self.topic,
                client = entry.client_id,
                "all {SESSION_SLOTS} order-5 session slots are in use; batch dropped"
            );
            return self.drop_batch(&batch);
        }
        let session = self
            .by_client
            .get_mut(&entry.client_id)
            .expect("opened above");
        if entry.session_epoch < session.epoch
            || (entry.session_epoch == session.epoch && session.fenced)
        {
            return self.drop_batch(&batch);
        }
        let mut dropped = Vec::new();
        if entry.session_epoch > session.epoch {
            // The client reopened after a fence: a new epoch continues from the
            // committed high-water mark; anything held from the old epoch is void.
            session.epoch = entry.session_epoch;
            session.fenced = false;
            session.next_expected = session.committed_hwm.max(session.next_expected);
            dropped.extend(std::mem::take(&mut session.held).into_values());
            session.gap_since = None;
            session.dirty = true;
        }
        if seq < session.next_expected
            || seq >= session.next_expected + window
            || session.held.contains_key(&seq)
        {
            dropped.push(batch);
        } else if seq == session.next_expected {
            self.ready.push_back(batch);
            session.next_expected += 1;
            while let Some(next) = session.held.remove(&session.next_expected) {
                self.ready.push_back(next);
                session.next_expected += 1;
            }
            session.gap_since = (!session.held.is_empty()).then(Instant::now);
        } else {
            if session.held.is_empty() {
                session.gap_since = Some(Instant::now());
            }
            session.held.insert(seq, batch);
        }
        for b in dropped {
            self.drop_batch(&b);
        }
    }

    fn drop_batch(&mut self, b: &Admitted) {
        self.outstanding[b.broker as usize].remove(&b.pbr_index);
        self.dirty = true;
    }

    /// Fences every session whose head gap is older than the lease.
    pub fn fence_expired(&mut self, now: Instant) {
        let mut dropped = Vec::new();
        for (client, s) in self.by_client.iter_mut() {
            let Some(since) = s.gap_since else { continue };
            if now.duration_since(since) < self.lease {
                continue;
            }
            tracing::info!(
                topic = self.topic,
                client,
                epoch = s.epoch,
                missing = s.next_expected,
                held = s.held.len(),
                "order-5 session fenced: its head gap outlived the lease"
            );
            dropped.extend(std::mem::take(&mut s.held).into_values());
            s.fenced = true;
            s.gap_since = None;
            s.dirty = true;
        }
        for b in &dropped {
            self.drop_batch(b);
        }
        if !dropped.is_empty() || self.by_client.values().any(|s| s.dirty) {
            self.dirty = true;
        }
    }

    /// Records that `b` is now in the committed GOI (called in commit order).
    pub fn committed(&mut self, b: &Admitted) {
        self.outstanding[b.broker as usize].remove(&b.pbr_index);
        if let Some(s) = self.by_client.get_mut(&b.entry.client_id) {
            s.committed_hwm = s.committed_hwm.max(b.entry.client_seq + 1);
            s.dirty = true;
        }
    }

    /// Writes changed sessions to the region's table.
    pub fn write_table(&mut self, region: &Region) {
        for (client, s) in self.by_client.iter_mut().filter(|(_, s)| s.dirty) {
            region.session_write(
                self.topic,
                s.slot,
                &SessionRecord {
                    state: if s.fenced {
                        SessionState::Fenced
                    } else {
                        SessionState::Open
                    },
                    client_id: *client,
                    session_epoch: s.epoch,
                    committed_hwm: s.committed_hwm,
                },
            );
            s.dirty = false;
        }
        self.dirty = false;
    }

    /// The ordered frontier of `broker`: everything scanned below `cursor` is committed
    /// or dropped, except what is still outstanding.
    pub fn ordered_frontier(&self, broker: u32, cursor: u64) -> u64 {
        self.outstanding[broker as usize]
            .first()
            .copied()
            .unwrap_or(cursor)
    }

    /// Batches held behind gaps, over all sessions.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.by_client.values().map(|s| s.held.len()).sum()
    }
}
