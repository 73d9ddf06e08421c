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
//!
//! Slots are reused: when a new session finds the table full, a session its publisher
//! ended on closing (a session-end slot, `SessionEnd`), else the session idle longest
//! (at least `session_idle_evict` by the table's last-active stamp, which brokers keep
//! fresh while the client is connected), ends, if it holds nothing and every batch of
//! it is on the disk replicas; its slot goes to the new one. An ended session is
//! forgotten: a client that comes back with the same id starts a new session from batch
//! 0, and one that still holds unacknowledged batches of the old one is told it expired
//! (the broker sees its slot taken by another client).

use crate::SequencerConfig;
use embarcadero_region::{
    session_idle, unix_ms, GoiEntry, Region, SessionRecord, SessionState, GOI_SESSION_START,
    SESSION_SLOTS,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The wall clock idleness is judged by; tests set their own.
fn wall_clock_ms() -> u64 {
    #[cfg(test)]
    if let Some(ms) = test_clock::NOW_MS.get() {
        return ms;
    }
    unix_ms()
}

#[cfg(test)]
pub(crate) mod test_clock {
    thread_local! {
        /// When set, the wall clock of sessions handled on this thread.
        pub static NOW_MS: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
    }
}

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
    /// The opener of `epoch` (`Hello::opener`), 0 when unknown (opened by a batch).
    opener: u32,
    /// An epoch opened while batches of the one before were admitted and not yet
    /// committed: until they are, the table keeps showing the one before.
    switch: Option<PendingSwitch>,
    /// Next sequence to admit.
    next_expected: u64,
    /// Every batch below this is in the committed GOI (what the table holds).
    committed_hwm: u64,
    held: BTreeMap<u64, Admitted>,
    fenced: bool,
    /// When the head of the session last stopped moving while batches were held.
    gap_since: Option<Instant>,
    /// Wall-clock ms of the session's last admitted batch.
    last_active_ms: u64,
    /// Batches admitted to `ready` and not committed yet: the session cannot end (the
    /// replicas' worker needs its slot for their entries).
    uncommitted: u64,
    /// GOI index of the session's last committed batch, if it is still in the ring:
    /// the slot can be given away only once the disk replicas have it.
    last_goi: Option<u64>,
    /// The topic's committed GOI count when the session was opened (see
    /// `SessionRecord::opened_at`).
    opened_at: u64,
    /// Opened here and nothing committed yet: its first GOI entry is flagged
    /// `GOI_SESSION_START`.
    starts: bool,
    /// The session key hash it is bound to (`SessionRecord::key_hash`); 0 until a batch
    /// binds it (a session rebuilt from disk). Never changes once set.
    key_hash: u64,
    /// Its publisher closed and ended it (a session-end slot) with nothing held or still
    /// to come: its slot may go to a new session without waiting for it to be idle. The
    /// table shows it (`SessionState::Ended`), so brokers let a new session's hello in.
    /// Cleared by any later batch or epoch open of the session.
    released: bool,
    dirty: bool,
}

/// What the table shows of a session while an epoch switch waits for the batches
/// admitted before it to commit. A new opener is told the committed mark once the table
/// holds its epoch, and numbers its batches from there: if the table showed the epoch
/// before every earlier batch committed, the opener would number batches the old epoch
/// still commits, and deduplication would drop the opener's as committed.
#[derive(Debug)]
struct PendingSwitch {
    /// The epoch before the switch, its opener and whether it was fenced.
    epoch: u64,
    opener: u32,
    fenced: bool,
    /// The table shows the new epoch once the committed mark reaches this: the head
    /// (`next_expected`) at the switch.
    until: u64,
    /// Epoch-open slots `(broker, pbr_index)` of the new epoch, kept outstanding until
    /// the table shows it: their brokers take the ordered frontier passing their slot
    /// with the table not holding the epoch for a refusal.
    slots: Vec<(u32, u64)>,
}

impl Session {
    fn record(&self, client_id: u64) -> SessionRecord {
        // Only admitted batches commit: the durable mark never passes the head.
        assert!(
            self.committed_hwm <= self.next_expected,
            "session of client {client_id}: committed up to {} but admitted only up to {}",
            self.committed_hwm,
            self.next_expected
        );
        let (epoch, opener, fenced) = match &self.switch {
            Some(p) => {
                assert!(
                    self.committed_hwm < p.until,
                    "client {client_id}: a switch pending past its mark"
                );
                (p.epoch, p.opener, p.fenced)
            }
            None => (self.epoch, self.opener, self.fenced),
        };
        SessionRecord {
            state: if fenced {
                SessionState::Fenced
            } else if self.released {
                SessionState::Ended
            } else {
                SessionState::Open
            },
            client_id,
            session_epoch: epoch,
            opener,
            committed_hwm: self.committed_hwm,
            last_active_ms: self.last_active_ms,
            opened_at: self.opened_at,
            key_hash: self.key_hash,
        }
    }

    /// Whether a batch presenting `key_hash` may belong to this session: the session is
    /// not bound yet, or bound to that key. (Brokers refuse keyless order-5 hellos, so a
    /// batch without a key can only match a session that is not bound either.)
    fn accepts_key(&self, key_hash: u64) -> bool {
        self.key_hash == 0 || self.key_hash == key_hash
    }

    /// Binds an unbound session to the key of the batch that fills its head: the batch
    /// numbered next, which only the session's owner sends first (a batch held ahead of
    /// the head binds nothing). A session's key never changes, across epochs too: a new
    /// epoch continues the old one's marks, so a stranger must not get them.
    fn bind_key(&mut self, key_hash: u64) {
        if self.key_hash == 0 && key_hash != 0 {
            self.key_hash = key_hash;
            self.dirty = true;
        }
        debug_assert!(
            key_hash == 0 || self.key_hash == key_hash,
            "admitted a foreign key"
        );
    }

    /// Moves the session to a newer `epoch` opened by `opener` (0: by a batch): it
    /// continues from the committed mark, its held batches are void (returned, to be
    /// dropped), and the epoch before stops admitting. The table shows the new epoch
    /// only once every batch admitted before the switch is committed.
    fn switch_epoch(&mut self, epoch: u64, opener: u32) -> Vec<Admitted> {
        assert!(epoch > self.epoch, "a session's epoch only grows");
        if self.uncommitted > 0 {
            let until = self.next_expected;
            let p = self.switch.get_or_insert_with(|| PendingSwitch {
                epoch: self.epoch,
                opener: self.opener,
                fenced: self.fenced,
                until,
                slots: Vec::new(),
            });
            p.until = until;
        }
        self.epoch = epoch;
        self.opener = opener;
        self.fenced = false;
        self.next_expected = self.committed_hwm.max(self.next_expected);
        self.gap_since = None;
        self.dirty = true;
        std::mem::take(&mut self.held).into_values().collect()
    }
}

/// An epoch-open PBR slot (`BatchFlags::EPOCH_OPEN`): a broker asks for epoch `epoch`
/// of `client_id`'s session for the publisher `opener`, presenting `key_hash`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EpochOpen {
    pub client_id: u64,
    pub epoch: u64,
    pub opener: u32,
    pub key_hash: u64,
}

/// A session-end PBR slot (`BatchFlags::END_SESSION`): the publisher `opener` of epoch
/// `epoch` of `client_id`'s session, presenting `key_hash`, closed after everything it
/// sent was acknowledged; `next_seq` is the batch it would have numbered next.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionEnd {
    pub client_id: u64,
    pub epoch: u64,
    pub opener: u32,
    pub key_hash: u64,
    pub next_seq: u64,
}

/// Logs the 1st, 2nd, 4th, ... dropped batch of another key (`total` so far), so that a
/// client that keeps trying does not flood the log.
fn warn_foreign_key(topic: u32, b: &Admitted, total: u64) {
    if !total.is_power_of_two() {
        return;
    }
    tracing::warn!(
        total,
        topic,
        client = b.entry.client_id,
        broker = b.broker,
        batch_seq = b.entry.client_seq,
        "order-5 batch claims a session bound to another key; dropped (a hijack attempt?)"
    );
}

/// Why a batch or an epoch open has no session to join.
enum NoSession {
    /// The session table has no slot for a new session.
    NoSlot,
    /// The session is bound to another key than the one presented.
    ForeignKey,
}

/// What the committed GOI says of one client id's latest session.
struct Folded {
    hwm: u64,
    epoch: u64,
    last_goi: u64,
    /// The latest session's first entry is in the ring: its marks are these alone.
    from_start: bool,
    /// The key hash of the latest session's first entry seen (0: none had one).
    key_hash: u64,
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
    /// Per broker: the ordered frontier (`ordered_pbr`) last stored.
    last_ordered: Vec<u64>,
    window: u64,
    lease: Duration,
    idle_evict_ms: u64,
    /// Replication factor of the topic: with disk replicas a slot is given away only
    /// after they have every batch of its session.
    replication_factor: u32,
    /// GOI entries below this are on every disk replica (`u64::MAX` without replicas).
    durable_frontier: u64,
    /// Wall-clock ms, refreshed on every `tick`.
    now_ms: u64,
    /// Sessions that ended to free their slot, not yet counted in the metrics.
    pub evictions: u64,
    /// Sessions their publishers ended, not yet counted in the metrics.
    pub publisher_ends: u64,
    /// Batches dropped for a key other than their session's, not yet in the metrics.
    pub key_mismatches: u64,
    /// All batches dropped for another key, for rate-limiting the warning.
    key_mismatches_total: u64,
    /// Something changed that must reach the region (a drop, a fence).
    pub dirty: bool,
}

impl Sessions {
    /// Rebuilds a topic's sessions from the region's table and the committed GOI.
    pub fn recover(
        region: &Region,
        topic: u32,
        replication_factor: u8,
        config: &SequencerConfig,
    ) -> Self {
        let mut s = Self::empty(region, topic, replication_factor, config);
        s.refresh_durable_frontier(region);
        s.load_table(region);
        let folded = s.fold_goi_tail(region);
        s.reconcile(folded);
        s.dirty = s.by_client.values().any(|x| x.dirty);
        s.debug_check();
        s
    }

    /// The invariants the sessions keep between a scan and a seal, checked in debug
    /// builds where a recovery or an epoch's changes are complete (it walks every session
    /// and the admitted batches): each session in its own table slot, marked used; the
    /// committed mark never past the head; a head gap timed exactly while batches are
    /// held, and none held by a fenced session; each session's uncommitted count is its
    /// batches waiting in `ready`, each of them still outstanding; nothing outstanding
    /// below the ordered frontier last stored (brokers reclaim below it).
    fn debug_check(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let mut holder: Vec<Option<u64>> = vec![None; SESSION_SLOTS as usize];
        let mut waiting: HashMap<u64, u64> = HashMap::new();
        for b in &self.ready {
            *waiting.entry(b.entry.client_id).or_default() += 1;
            debug_assert!(
                self.outstanding[b.broker as usize].contains(&b.pbr_index),
                "admitted batch at PBR {} of broker {} is not outstanding",
                b.pbr_index,
                b.broker
            );
        }
        for (&client, s) in &self.by_client {
            let previous = holder[s.slot as usize].replace(client);
            debug_assert!(
                self.used_slots[s.slot as usize] && previous.is_none(),
                "session slot {} holds clients {previous:?} and {client}, or is not marked used",
                s.slot
            );
            debug_assert!(s.committed_hwm <= s.next_expected, "client {client}: {s:?}");
            debug_assert_eq!(
                s.held.is_empty(),
                s.gap_since.is_none(),
                "client {client}: a head gap is timed while batches are held"
            );
            debug_assert!(
                !s.fenced || s.held.is_empty(),
                "client {client}: fenced but holding"
            );
            debug_assert!(
                !s.released || (s.held.is_empty() && s.switch.is_none() && !s.fenced),
                "client {client}: released with batches held or a switch pending: {s:?}"
            );
            debug_assert!(
                s.switch.as_ref().is_none_or(|p| p.until > s.committed_hwm
                    && s.uncommitted > 0
                    && p.epoch < s.epoch
                    && p.slots
                        .iter()
                        .all(|&(b, i)| self.outstanding[b as usize].contains(&i))),
                "client {client}: an epoch switch pending without batches to wait for: {s:?}"
            );
            debug_assert_eq!(
                waiting.remove(&client).unwrap_or(0),
                s.uncommitted,
                "client {client}: uncommitted batches are those in `ready`"
            );
        }
        debug_assert!(
            waiting.is_empty(),
            "admitted batches of sessions that ended: {waiting:?}"
        );
        for (broker, outstanding) in self.outstanding.iter().enumerate() {
            debug_assert!(
                outstanding
                    .first()
                    .is_none_or(|&i| i >= self.last_ordered[broker]),
                "broker {broker}: PBR slot {:?} outstanding below the ordered frontier {}",
                outstanding.first(),
                self.last_ordered[broker]
            );
        }
    }

    /// No session yet; the brokers' ordered frontiers as the region holds them.
    fn empty(
        region: &Region,
        topic: u32,
        replication_factor: u8,
        config: &SequencerConfig,
    ) -> Self {
        let brokers = region.capacities().brokers;
        Self {
            topic,
            by_client: HashMap::new(),
            used_slots: vec![false; SESSION_SLOTS as usize],
            ready: VecDeque::new(),
            outstanding: vec![BTreeSet::new(); brokers as usize],
            last_ordered: (0..brokers)
                .map(|b| region.log(topic, b).ordered_pbr.load(Ordering::Acquire))
                .collect(),
            window: config.session_window,
            lease: config.session_lease,
            idle_evict_ms: config.session_idle_evict.as_millis() as u64,
            replication_factor: replication_factor as u32,
            durable_frontier: 0,
            now_ms: wall_clock_ms(),
            evictions: 0,
            publisher_ends: 0,
            key_mismatches: 0,
            key_mismatches_total: 0,
            dirty: false,
        }
    }

    /// Takes every session the region's table holds, as of its last write.
    fn load_table(&mut self, region: &Region) {
        for slot in 0..SESSION_SLOTS {
            let Some(r) = region.session_read(self.topic, slot) else {
                continue;
            };
            self.used_slots[slot as usize] = true;
            let session = Session {
                slot,
                epoch: r.session_epoch,
                opener: r.opener,
                switch: None,
                next_expected: r.committed_hwm,
                committed_hwm: r.committed_hwm,
                held: BTreeMap::new(),
                fenced: r.state == SessionState::Fenced,
                gap_since: None,
                // A region from before the field: idle from now on.
                last_active_ms: if r.last_active_ms == 0 {
                    self.now_ms
                } else {
                    r.last_active_ms
                },
                uncommitted: 0,
                last_goi: None,
                opened_at: r.opened_at,
                starts: false,
                released: r.state == SessionState::Ended,
                key_hash: r.key_hash,
                dirty: false,
            };
            let previous = self.by_client.insert(r.client_id, session);
            assert!(
                previous.is_none(),
                "the session table holds client {} in two slots",
                r.client_id
            );
        }
    }

    /// What the committed GOI still in the ring says of each client id's latest
    /// session: batches committed after the table was last written, and the last GOI
    /// index of every session. Entries of a client id from before its session was
    /// opened belong to an earlier session of the id, which ended; a session start in
    /// the ring makes the marks start over too.
    fn fold_goi_tail(&self, region: &Region) -> HashMap<u64, Folded> {
        let committed = region
            .topic_seq(self.topic)
            .committed_seq
            .load(Ordering::Acquire);
        let from = committed.saturating_sub(region.capacities().goi_slots);
        let mut folded: HashMap<u64, Folded> = HashMap::new();
        for g in from..committed {
            let Some(e) = region.goi_read(self.topic, g) else {
                continue;
            };
            let opened_at = self.by_client.get(&e.client_id).map_or(0, |x| x.opened_at);
            if g < opened_at {
                continue;
            }
            let start = Folded {
                hwm: 0,
                epoch: 0,
                last_goi: g,
                from_start: e.flags & GOI_SESSION_START != 0,
                key_hash: e.session_key_hash,
            };
            let f = folded.entry(e.client_id).or_insert(Folded {
                from_start: false,
                ..start
            });
            if start.from_start {
                *f = start;
            }
            f.hwm = f.hwm.max(e.client_seq + 1);
            f.epoch = f.epoch.max(e.session_epoch);
            f.last_goi = g;
        }
        folded
    }

    /// Brings the sessions up to what the GOI says: the table may lag the GOI by an
    /// epoch, never lead it. A session not in the table (a region from before the
    /// table was written at once) takes a free slot; with none free it is one that
    /// ended.
    fn reconcile(&mut self, folded: HashMap<u64, Folded>) {
        for (client, f) in folded {
            if !self.by_client.contains_key(&client) {
                let slot = self.free_slot();
                if self.open_in(client, f.epoch, slot).is_none() {
                    continue;
                }
            }
            let session = self.by_client.get_mut(&client).expect("opened above");
            // The table is written after `committed_seq`: it may lag the GOI, never lead
            // it. Without a session start in the ring, the GOI still holds the session's
            // latest batch (the ring keeps the newest entries), so its mark is the higher.
            assert!(
                f.from_start || f.hwm >= session.committed_hwm,
                "client {client}: the session table's mark {} leads the committed GOI's {}",
                session.committed_hwm,
                f.hwm
            );
            session.last_goi = Some(f.last_goi);
            let hwm = if f.from_start {
                f.hwm
            } else {
                f.hwm.max(session.committed_hwm)
            };
            if (hwm != session.committed_hwm || f.epoch > session.epoch)
                && std::mem::take(&mut session.released)
            {
                // Batches the table had not caught up with came after the end it shows.
                session.dirty = true;
            }
            if f.epoch > session.epoch {
                // Opened by a batch the table had not caught up with: by whom is unknown.
                session.epoch = f.epoch;
                session.opener = 0;
            }
            if session.key_hash == 0 && f.key_hash != 0 {
                session.key_hash = f.key_hash;
                session.dirty = true;
            }
            if hwm != session.committed_hwm {
                session.committed_hwm = hwm;
                session.next_expected = hwm;
                session.dirty = true;
            }
        }
    }

    fn free_slot(&mut self) -> Option<u32> {
        let slot = self.used_slots.iter().position(|used| !used)?;
        self.used_slots[slot] = true;
        Some(slot as u32)
    }

    /// Opens a session for a client the table does not hold, in a free slot or in the
    /// one an idle session gives up; `None` when there is neither. The table holds the
    /// new session at once, with a fresh durable mark, before any of its batches can
    /// commit: a successor sequencer, the replicas' worker and the brokers find it
    /// there, never the session that held the slot before.
    fn open(
        &mut self,
        region: &Region,
        client_id: u64,
        (epoch, opener): (u64, u32),
    ) -> Option<&mut Session> {
        assert!(
            !self.by_client.contains_key(&client_id),
            "client {client_id} already has a session"
        );
        let slot = match self.free_slot() {
            Some(slot) => Some(slot),
            None => self.end_idlest(region),
        };
        let topic = self.topic;
        let opened_at = region
            .topic_seq(topic)
            .committed_seq
            .load(Ordering::Acquire);
        debug_assert!(
            slot.is_none_or(|slot| self.by_client.values().all(|s| s.slot != slot)),
            "a table slot holds one session"
        );
        let session = self.open_in(client_id, epoch, slot)?;
        session.opened_at = opened_at;
        session.opener = opener;
        session.starts = true;
        region
            .sequencer_topic(topic)
            .reset_session_durable_hwm(session.slot);
        region.session_write(topic, session.slot, &session.record(client_id));
        Some(session)
    }

    fn open_in(&mut self, client_id: u64, epoch: u64, slot: Option<u32>) -> Option<&mut Session> {
        let slot = slot?;
        // `or_insert` would hand back an existing session as if it were new; the slot
        // must be one taken for it (`free_slot`, or an ended session's).
        assert!(
            !self.by_client.contains_key(&client_id) && self.used_slots[slot as usize],
            "client {client_id} opened in slot {slot}: it has a session, or the slot is not taken"
        );
        Some(self.by_client.entry(client_id).or_insert(Session {
            slot,
            epoch,
            opener: 0,
            switch: None,
            next_expected: 0,
            committed_hwm: 0,
            held: BTreeMap::new(),
            fenced: false,
            gap_since: None,
            last_active_ms: self.now_ms,
            uncommitted: 0,
            last_goi: None,
            opened_at: 0,
            starts: false,
            key_hash: 0,
            released: false,
            dirty: true,
        }))
    }

    /// Ends a session, if one may end, and returns its slot: one its publisher ended
    /// (`released`) first, else the one idle longest, idle at least `session_idle_evict`
    /// by both its last admitted batch and the table's stamp (which brokers raise while
    /// its client is connected); either way nothing held or waiting for
    /// the end of the epoch, and every batch on the disk replicas (their worker finds a
    /// session's slot through the table for each of its entries). The clock alone is
    /// not trusted: a jump must not end a session with batches in flight.
    fn end_idlest(&mut self, region: &Region) -> Option<u32> {
        let (now, idle, frontier) = (self.now_ms, self.idle_evict_ms, self.durable_frontier);
        let topic = self.topic;
        let (&client, _, last_active) = self
            .by_client
            .iter()
            .filter(|(_, s)| {
                s.held.is_empty() && s.uncommitted == 0 && s.last_goi.is_none_or(|g| g < frontier)
            })
            .map(|(client, s)| {
                let stamp = region
                    .session_read(topic, s.slot)
                    .filter(|r| r.client_id == *client)
                    .map_or(0, |r| r.last_active_ms);
                (client, s, s.last_active_ms.max(stamp))
            })
            .filter(|(_, s, last_active)| s.released || session_idle(*last_active, now, idle))
            // Released sessions first: their publishers said they will not come back.
            .min_by_key(|(_, s, last_active)| (!s.released, *last_active))?;
        let s = self.by_client.remove(&client).expect("found above");
        tracing::info!(
            topic,
            client,
            epoch = s.epoch,
            committed_hwm = s.committed_hwm,
            idle_s = now.saturating_sub(last_active) / 1000,
            ended_by_publisher = s.released,
            "order-5 session ended (by its publisher, or idle), and its slot went to a new session"
        );
        self.evictions += 1;
        Some(s.slot)
    }

    fn refresh_durable_frontier(&mut self, region: &Region) {
        let frontier = match self.replication_factor {
            0 | 1 => u64::MAX,
            rf => region
                .replica(self.topic, rf - 1)
                .durable_seq
                .load(Ordering::Acquire),
        };
        // A slot is given away once the frontier passed its session's last batch: a
        // frontier that went back could not take that back.
        assert!(
            frontier >= self.durable_frontier,
            "the durable frontier only grows"
        );
        self.durable_frontier = frontier;
    }

    fn drop_batch(&mut self, b: &Admitted) {
        let was_outstanding = self.outstanding[b.broker as usize].remove(&b.pbr_index);
        // The pair of `committed`'s check: each scanned batch leaves once, either way.
        assert!(
            was_outstanding,
            "a dropped batch (PBR {} of broker {}) was scanned and neither committed nor dropped",
            b.pbr_index, b.broker
        );
        self.dirty = true;
    }

    /// Refreshes the clocks and the replicas' frontier, and fences every session whose
    /// head gap is older than the lease. Called before every scan.
    pub fn tick(&mut self, region: &Region, now: Instant) {
        self.now_ms = wall_clock_ms();
        self.refresh_durable_frontier(region);
        self.fence_expired(now);
    }

    fn fence_expired(&mut self, now: Instant) {
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

    /// The flags of `b`'s GOI entry: the first committed batch of a session opened here
    /// is flagged as its start. Called just before `b` is appended.
    pub fn goi_flags(&mut self, b: &Admitted) -> u16 {
        match self.by_client.get_mut(&b.entry.client_id) {
            Some(s) if s.starts => {
                debug_assert_eq!(b.entry.client_seq, 0, "a new session starts at batch 0");
                s.starts = false;
                GOI_SESSION_START
            }
            _ => 0,
        }
    }

    /// Records that `b` is now in the committed GOI at index `goi` (called in commit order).
    pub fn committed(&mut self, b: &Admitted, goi: u64) {
        let was_outstanding = self.outstanding[b.broker as usize].remove(&b.pbr_index);
        assert!(
            was_outstanding,
            "a committed batch was scanned and not dropped"
        );
        // A session with uncommitted batches never ends (`end_idlest`).
        let s = self
            .by_client
            .get_mut(&b.entry.client_id)
            .expect("an admitted batch's session lives until the batch is committed");
        assert!(
            s.uncommitted > 0,
            "committed more batches than were admitted"
        );
        assert!(
            s.last_goi.is_none_or(|g| g < goi),
            "a session's batches are committed in GOI order"
        );
        // Admitted one after another from the committed mark, and committed in admission
        // order: the durable table's mark moves by exactly one batch.
        assert_eq!(
            b.entry.client_seq, s.committed_hwm,
            "client {}: batch committed out of its session's order",
            b.entry.client_id
        );
        s.committed_hwm = s.committed_hwm.max(b.entry.client_seq + 1);
        s.last_goi = Some(goi);
        s.uncommitted -= 1;
        s.dirty = true;
        if s.switch
            .as_ref()
            .is_some_and(|p| s.committed_hwm >= p.until)
        {
            let p = s.switch.take().expect("checked above");
            for (broker, pbr_index) in p.slots {
                let was_outstanding = self.outstanding[broker as usize].remove(&pbr_index);
                assert!(was_outstanding, "an epoch-open slot held for its switch");
            }
        }
    }

    /// Writes changed sessions to the region's table.
    pub fn write_table(&mut self, region: &Region) {
        for (client, s) in self.by_client.iter_mut().filter(|(_, s)| s.dirty) {
            region.session_write(self.topic, s.slot, &s.record(*client));
            s.dirty = false;
        }
        self.dirty = false;
        self.debug_check();
    }

    /// The ordered frontier of `broker`: everything scanned below `cursor` is committed
    /// or dropped, except what is still outstanding.
    fn ordered_frontier(&self, broker: u32, cursor: u64) -> u64 {
        self.outstanding[broker as usize]
            .first()
            .copied()
            .unwrap_or(cursor)
    }

    /// The ordered frontier of `broker` (scanned up to `cursor`), if it moved since it
    /// was last stored; the caller stores it.
    pub fn frontier_moved(&mut self, broker: u32, cursor: u64) -> Option<u64> {
        let frontier = self.ordered_frontier(broker, cursor);
        // Only scanned slots are outstanding: the frontier never passes the scan.
        assert!(
            self.outstanding[broker as usize]
                .last()
                .is_none_or(|&i| i < cursor),
            "broker {broker}: PBR slot {:?} outstanding at or past the scan cursor {cursor}",
            self.outstanding[broker as usize].last()
        );
        let last = &mut self.last_ordered[broker as usize];
        assert!(
            frontier >= *last,
            "a broker's ordered frontier only grows: brokers reclaim below it"
        );
        (frontier != *last).then(|| {
            *last = frontier;
            frontier
        })
    }

    /// Batches held behind gaps, over all sessions.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.by_client.values().map(|s| s.held.len()).sum()
    }
}

impl crate::Admit for Sessions {
    fn open_epoch(&mut self, region: &Region, broker: u32, pbr_index: u64, open: EpochOpen) {
        assert!(
            pbr_index >= self.last_ordered[broker as usize],
            "PBR slot {pbr_index} of broker {broker} scanned below its ordered frontier {}",
            self.last_ordered[broker as usize]
        );
        self.take_epoch_open(region, broker, pbr_index, open);
    }

    fn end_session(&mut self, region: &Region, broker: u32, pbr_index: u64, end: SessionEnd) {
        self.admit(region, broker, pbr_index, None);
        self.take_end(end);
    }

    /// Takes one scanned PBR slot (`entry` is `None` for a void slot).
    fn admit(&mut self, region: &Region, broker: u32, pbr_index: u64, entry: Option<GoiEntry>) {
        let Some(entry) = entry else {
            self.dirty = true;
            return;
        };
        // Below the frontier last stored the slot is ordered already (brokers may have
        // reclaimed it): a scan there would order it a second time.
        assert!(
            pbr_index >= self.last_ordered[broker as usize],
            "PBR slot {pbr_index} of broker {broker} scanned below its ordered frontier {}",
            self.last_ordered[broker as usize]
        );
        let fresh = self.outstanding[broker as usize].insert(pbr_index);
        assert!(
            fresh,
            "PBR slot {pbr_index} of broker {broker} scanned twice"
        );
        let batch = Admitted {
            broker,
            pbr_index,
            entry,
        };
        if !self.admissible(region, &batch) {
            return self.drop_batch(&batch);
        }
        for b in self.place(batch) {
            self.drop_batch(&b);
        }
    }
}

impl Sessions {
    /// Whether `b` may join its session: the session exists or can be opened, `b`
    /// carries the session's key, and its epoch is current and not fenced (or newer).
    /// Counts the session active.
    fn admissible(&mut self, region: &Region, b: &Admitted) -> bool {
        let entry = b.entry;
        let opening = (entry.session_epoch, 0);
        match self.joinable(region, entry.client_id, opening, entry.session_key_hash) {
            Ok(session) => {
                entry.session_epoch > session.epoch
                    || (entry.session_epoch == session.epoch && !session.fenced)
            }
            Err(NoSession::NoSlot) => false,
            Err(NoSession::ForeignKey) => {
                warn_foreign_key(self.topic, b, self.key_mismatches_total);
                false
            }
        }
    }

    /// The session of `client_id`, opened at `opening` (epoch, opener) if it has none,
    /// when `key_hash` may be its key; counted active. A foreign key is counted in the
    /// metrics, a missing table slot said in the log.
    fn joinable(
        &mut self,
        region: &Region,
        client_id: u64,
        opening: (u64, u32),
        key_hash: u64,
    ) -> Result<&mut Session, NoSession> {
        if !self.has_or_opens(region, client_id, opening) {
            return Err(NoSession::NoSlot);
        }
        let session = self.by_client.get_mut(&client_id).expect("opened above");
        if !session.accepts_key(key_hash) {
            self.key_mismatches += 1;
            self.key_mismatches_total += 1;
            return Err(NoSession::ForeignKey);
        }
        session.last_active_ms = self.now_ms;
        if std::mem::take(&mut session.released) {
            session.dirty = true;
        }
        Ok(session)
    }

    /// Whether `client_id` has a session, opening it at `(epoch, opener)` if not; a
    /// session that finds no table slot is refused, said in the log.
    fn has_or_opens(&mut self, region: &Region, client_id: u64, opening: (u64, u32)) -> bool {
        if self.by_client.contains_key(&client_id)
            || self.open(region, client_id, opening).is_some()
        {
            return true;
        }
        tracing::error!(
            topic = self.topic,
            client = client_id,
            "all {SESSION_SLOTS} order-5 session slots hold sessions active in the last {} s; batch or epoch open dropped",
            self.idle_evict_ms / 1000
        );
        false
    }

    /// Takes an epoch-open slot: a newer epoch switches the session to it (opening the
    /// session if it has none), and an unbound session is bound to its opener's key
    /// (the batch that fills an unbound head binds it otherwise, `place`). Any other
    /// open changes nothing: its broker refuses the hello (or, for the opener's other
    /// connections, joins) from what the table shows. The slot is void; while a switch
    /// waits for earlier batches to commit it stays outstanding, as does every open
    /// taken meanwhile, so that no broker sees the frontier pass its slot before the
    /// table is current.
    fn take_epoch_open(&mut self, region: &Region, broker: u32, pbr_index: u64, open: EpochOpen) {
        self.dirty = true;
        let opening = (open.epoch, open.opener);
        let Ok(session) = self.joinable(region, open.client_id, opening, open.key_hash) else {
            return;
        };
        let mut dropped = Vec::new();
        if open.epoch > session.epoch {
            dropped = session.switch_epoch(open.epoch, open.opener);
        }
        if (open.epoch, open.opener) == (session.epoch, session.opener) {
            // The opener owns the session from its hello: a stranger's batch 0 sent
            // before the opener's own must not bind the session to the stranger's key.
            session.bind_key(open.key_hash);
        }
        // Held whatever it asked for: its broker answers from the table once the
        // frontier passes the slot, and the table is not current before the switch is.
        if let Some(p) = &mut session.switch {
            p.slots.push((broker, pbr_index));
            let fresh = self.outstanding[broker as usize].insert(pbr_index);
            assert!(
                fresh,
                "PBR slot {pbr_index} of broker {broker} scanned twice"
            );
        }
        for b in &dropped {
            self.drop_batch(b);
        }
    }

    /// Takes a session's end: released when it is the session as it stands (epoch,
    /// opener, key) and everything its publisher numbered was admitted, none held or
    /// waiting for an epoch switch. Any other end changes nothing (a late one, after a
    /// new publisher opened the session; one whose batches are still on their way):
    /// the session then ends once idle, as if no end had come.
    fn take_end(&mut self, end: SessionEnd) {
        let Some(session) = self.by_client.get_mut(&end.client_id) else {
            return;
        };
        let current = session.epoch == end.epoch
            && session.opener == end.opener
            && session.key_hash == end.key_hash;
        let complete = session.next_expected == end.next_seq
            && session.held.is_empty()
            && session.switch.is_none()
            && !session.fenced;
        if current && complete && !session.released {
            session.released = true;
            session.dirty = true;
            self.publisher_ends += 1;
            tracing::debug!(
                topic = self.topic,
                client = end.client_id,
                epoch = end.epoch,
                next_seq = end.next_seq,
                "order-5 session ended by its publisher; its slot may go to a new session"
            );
        }
    }

    /// Puts an admissible batch in its session's place: admitted to `ready` (with the
    /// held successors it frees) when it is the next one, held when it is ahead within
    /// the window. Returns the batches to drop: `b` itself when it is a duplicate, late
    /// or beyond the window; held batches a new epoch voids.
    fn place(&mut self, b: Admitted) -> Vec<Admitted> {
        let (seq, window) = (b.entry.client_seq, self.window);
        let session = self
            .by_client
            .get_mut(&b.entry.client_id)
            .expect("admissible: the session exists");
        let mut dropped = Vec::new();
        if b.entry.session_epoch > session.epoch {
            // A batch of an epoch no epoch-open slot announced (an older client).
            dropped.extend(session.switch_epoch(b.entry.session_epoch, 0));
        }
        if seq < session.next_expected
            || seq >= session.next_expected + window
            || session.held.contains_key(&seq)
        {
            dropped.push(b);
        } else if seq == session.next_expected {
            session.bind_key(b.entry.session_key_hash);
            self.ready.push_back(b);
            session.next_expected += 1;
            session.uncommitted += 1;
            while let Some(next) = session.held.remove(&session.next_expected) {
                // Held while the session was unbound, by someone else than its owner.
                if !session.accepts_key(next.entry.session_key_hash) {
                    self.key_mismatches += 1;
                    self.key_mismatches_total += 1;
                    warn_foreign_key(self.topic, &next, self.key_mismatches_total);
                    dropped.push(next);
                    break;
                }
                self.ready.push_back(next);
                session.next_expected += 1;
                session.uncommitted += 1;
            }
            session.gap_since = (!session.held.is_empty()).then(Instant::now);
        } else {
            if session.held.is_empty() {
                session.gap_since = Some(Instant::now());
            }
            session.held.insert(seq, b);
        }
        debug_assert!(
            session
                .held
                .keys()
                .all(|&k| k > session.next_expected && k < session.next_expected + window),
            "a session holds only batches ahead of its head, within the window"
        );
        dropped
    }
}
