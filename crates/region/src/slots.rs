//! Plain-value forms of the region's slots. The region stores them as 64-bit words so
//! that fields written after a commit (a PBR slot's `total_order`) are atomics too.

/// `GoiEntry::flags`: the first batch of an order-5 session the sequencer opened. A
/// client id may have several sessions over time (one ends while idle, the id comes
/// back): whoever folds committed batches into per-session marks starts over here.
pub const GOI_SESSION_START: u16 = 1;

/// One entry of a topic's global order index. `global_seq` (the GOI index + 1) is the
/// readiness token, written last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GoiEntry {
    pub batch_id: u64,
    /// Global position of the batch's first message.
    pub total_order: u64,
    /// Logical offset of the payload in the broker's log.
    pub blog_offset: u64,
    pub pbr_index: u64,
    pub client_id: u64,
    /// The batch's sequence number from its client (per connection or per session).
    pub client_seq: u64,
    pub session_epoch: u64,
    pub payload_size: u32,
    pub num_msg: u32,
    pub broker_id: u16,
    pub flags: u16,
    /// Reserved for the replication chain.
    pub replication_token: u32,
    /// Order 5: the session key hash of the connection that sent the batch (the PBR
    /// slot's); 0 for other orders. The sequencer binds a session to its first batch's.
    pub session_key_hash: u64,
}

impl GoiEntry {
    pub(crate) fn to_words(self) -> [u64; 15] {
        [
            self.batch_id,
            self.total_order,
            self.blog_offset,
            self.pbr_index,
            self.client_id,
            self.client_seq,
            self.session_epoch,
            self.payload_size as u64 | (self.num_msg as u64) << 32,
            self.broker_id as u64
                | (self.flags as u64) << 16
                | (self.replication_token as u64) << 32,
            self.session_key_hash,
            0,
            0,
            0,
            0,
            0,
        ]
    }

    pub(crate) fn from_words(w: &[u64; 15]) -> Self {
        // `to_words` leaves the spare words zero: anything else there was not written
        // as an entry (a torn read the token re-check should have refused).
        debug_assert!(
            w[10..].iter().all(|&spare| spare == 0),
            "a GOI entry's spare words hold {:?}",
            &w[10..]
        );
        Self {
            batch_id: w[0],
            total_order: w[1],
            blog_offset: w[2],
            pbr_index: w[3],
            client_id: w[4],
            client_seq: w[5],
            session_epoch: w[6],
            payload_size: w[7] as u32,
            num_msg: (w[7] >> 32) as u32,
            broker_id: w[8] as u16,
            flags: (w[8] >> 16) as u16,
            replication_token: (w[8] >> 32) as u32,
            session_key_hash: w[9],
        }
    }
}

/// Lifecycle of a topic slot; the state word is written last. A slot goes
/// Free -> Active -> Deleted within one region and never back: a deleted topic's slot is
/// reused only by the next start's fresh region (`docs/DESIGN.md`, "Topic delete"), so
/// no process can take a later topic's slot for the deleted one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicState {
    Free = 0,
    Active = 1,
    /// Deleted by the control plane: every process lets go of what it holds for it.
    Deleted = 2,
}

/// Metadata of one topic slot, written by the control plane only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicMeta {
    pub name: String,
    pub order: u8,
    pub replication_factor: u8,
    pub default_ack: u8,
    /// Bumped each time the slot is (re)used, so stale readers can tell.
    pub generation: u64,
    pub created_unix_ms: u64,
    /// Disk retention: keep at most this many bytes per replica (0: no limit)...
    pub retention_bytes: u64,
    /// ...and nothing older than this many milliseconds (0: no limit).
    pub retention_ms: u64,
    /// No position at or above this is handed out ([`NO_POSITION_CEILING`]: no limit);
    /// see `Region::position_ceiling`.
    pub position_ceiling: u64,
}

/// The position ceiling of a topic whose positions need none (replicated topics).
pub const NO_POSITION_CEILING: u64 = u64::MAX;

impl TopicMeta {
    /// A topic of this order in generation 1: one replica (memory only), ack 1 by
    /// default, no retention limits, no creation time, no position ceiling.
    pub fn new(name: &str, order: u8) -> Self {
        Self {
            name: name.to_string(),
            order,
            replication_factor: 1,
            default_ack: 1,
            generation: 1,
            created_unix_ms: 0,
            retention_bytes: 0,
            retention_ms: 0,
            position_ceiling: NO_POSITION_CEILING,
        }
    }
}

/// State of an order-5 session slot; the state word is written last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    Open = 1,
    /// A gap at the head outlived the lease; batches of this epoch are refused and the
    /// client must reopen with a higher epoch.
    Fenced = 2,
    /// Open, but its publisher closed and ended it (a session-end slot) with nothing
    /// held or still to come: a new session may take the slot at once, without waiting
    /// for it to be idle. A later batch or epoch open of the session makes it Open again.
    Ended = 3,
}

impl SessionState {
    pub fn from_u64(v: u64) -> Option<Self> {
        match v {
            1 => Some(Self::Open),
            2 => Some(Self::Fenced),
            3 => Some(Self::Ended),
            _ => None,
        }
    }
}

/// One order-5 session as the sequencer records it in the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionRecord {
    pub state: SessionState,
    pub client_id: u64,
    /// The session's current epoch; at most `u32::MAX` (it shares its word with `opener`).
    pub session_epoch: u64,
    /// The opener (`Hello::opener`) of the publisher that opened `session_epoch`
    /// through an epoch-open slot; 0 when unknown (opened by a batch of an older
    /// client, or rebuilt from disk), which any publisher of the session matches.
    pub opener: u32,
    /// Every batch of the session with `batch_seq` below this is in the committed GOI.
    pub committed_hwm: u64,
    /// Wall-clock time (ms since the Unix epoch) the session was last active: raised by
    /// the sequencer when it writes the slot (its last admitted batch) and by brokers
    /// while a connection of the session is open; 0 when unknown (a region written
    /// before this field existed). What the sequencer and the brokers judge idleness by.
    pub last_active_ms: u64,
    /// The topic's committed GOI count when the session was opened: every batch of this
    /// session is at or above it, so GOI entries of the same client id below it belong
    /// to an earlier session of that id, which ended. 0 for a region written before
    /// this field existed.
    pub opened_at: u64,
    /// `session_key_hash` of the key the session is bound to: its first batch's, kept
    /// across epochs. Brokers refuse a hello with another key. 0 when not bound yet (a
    /// session rebuilt from disk binds again with its next batch).
    pub key_hash: u64,
}

impl SessionRecord {
    /// True when the session has been idle at least `idle_ms` at `now_ms`.
    pub fn idle_at(&self, now_ms: u64, idle_ms: u64) -> bool {
        session_idle(self.last_active_ms, now_ms, idle_ms)
    }

    /// True when the sequencer may give the slot to a new session, by the record alone:
    /// its publisher ended it, or it has been idle at least `idle_ms` at `now_ms`.
    pub fn may_end_at(&self, now_ms: u64, idle_ms: u64) -> bool {
        self.state == SessionState::Ended || self.idle_at(now_ms, idle_ms)
    }
}

/// True when a session last active at `last_active_ms` has been idle at least `idle_ms`
/// at `now_ms`. A time in the future (the clock was set back) counts as active.
pub fn session_idle(last_active_ms: u64, now_ms: u64, idle_ms: u64) -> bool {
    now_ms
        .checked_sub(last_active_ms)
        .is_some_and(|idle| idle >= idle_ms)
}
