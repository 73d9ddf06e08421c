//! A topic's metadata block (state, name, order, retention, position ceiling) and its
//! progress lines: the sequencer's line, each broker's log control lines and the disk
//! replicas' lines.

use crate::coherence::store_fence;
use crate::layout::*;
use crate::slots::{TopicMeta, TopicState};
use crate::word::ReadWord;
use crate::Doorbell;
use crate::Region;
use std::sync::atomic::Ordering;

/// Progress of one disk replica of a topic; written only by that replica's worker.
pub struct ReplicaProgress<'a> {
    /// GOI entries below this index are on this replica's disk *and* on every earlier
    /// replica's (the chain token): the last replica's value is the topic's durable
    /// frontier.
    pub durable_seq: ReadWord<'a>,
    /// GOI entries below this index are on this replica's disk (fdatasync'd).
    pub own_durable_seq: ReadWord<'a>,
    /// 0 while healthy; otherwise the OS error number of the last failed write/sync.
    pub error: ReadWord<'a>,
    /// The global position that follows the entries below `durable_seq`.
    pub durable_position: ReadWord<'a>,
}

/// Per (topic, broker) frontiers. Each line has exactly one writer.
pub struct LogControl<'a> {
    // --- written by the broker that owns the log ---
    /// PBR slots below this index are committed (valid or void).
    pub written_frontier: ReadWord<'a>,
    /// Messages in the valid slots below `written_frontier`: the per-broker position.
    pub frontier_msgs: ReadWord<'a>,
    /// PBR slots below this index have been reclaimed and may be overwritten.
    pub reclaimed_pbr: ReadWord<'a>,
    /// Log bytes below this logical offset have been reclaimed.
    pub reclaimed_blog: ReadWord<'a>,
    /// 0, or 1 + the PBR index from which the broker's slots are never ordered: set by
    /// the control plane once it has declared the broker dead (the line's owner is then
    /// the control plane), so a broker that only seemed dead cannot add to the order.
    pub fence_pbr: ReadWord<'a>,
    /// A restarted broker resumes a fenced log here: the sequencer treats the slots from
    /// the fence up to this index as void (their publishers were told they were not
    /// ordered) and orders again from it. Written by the resuming broker before
    /// `resumed_fence`.
    pub resume_pbr: ReadWord<'a>,
    /// The `fence_pbr` value that `resume_pbr` lifts; while it differs from
    /// `fence_pbr`, the fence holds.
    pub resumed_fence: ReadWord<'a>,
    /// Odd while the broker's reclamation is between reading the reader pins and
    /// moving the reclaimed frontiers (see [`Region::await_reclaim_passes`]).
    pub reclaim_pass: ReadWord<'a>,
    // --- written by the sequencer ---
    /// PBR slots below this index are in the committed GOI prefix (orders 2, 5).
    pub ordered_pbr: ReadWord<'a>,
    /// The sequencer needs slots below this index reclaimed to reuse GOI slots.
    pub reclaim_request: ReadWord<'a>,
    /// Equals `fence_pbr` once the sequencer has ordered every slot it will ever order
    /// from this log: the GOI then says exactly which of the broker's batches made it.
    pub fence_ack: ReadWord<'a>,
    // --- written by the replication chain ---
    /// PBR slots below this index are on every replica's disk.
    pub durable_pbr: ReadWord<'a>,
}

/// The sequencer-owned line of a topic.
pub struct TopicSeq<'a> {
    /// GOI entries below this index are committed (the contiguous committed prefix).
    pub committed_seq: ReadWord<'a>,
    /// Messages covered by the committed prefix: the next global position.
    pub next_position: ReadWord<'a>,
    /// The position this region's GOI starts at: every entry it will hold is at or
    /// above it, and a memory-only topic's positions below it are gone. Written once,
    /// by the start-up that seeds the line (`recovery::seed`), before any sequencer.
    pub start_position: ReadWord<'a>,
}

impl Region {
    /// Writes a topic's metadata; the state word goes last. Control plane only.
    pub fn write_topic_meta(&self, topic: u32, meta: &TopicMeta) {
        let base = self.layout.topic_off(topic);
        let name = meta.name.as_bytes();
        assert!(name.len() <= 64);
        // A deleted topic's slot may still be held by processes letting go of it.
        assert!(
            !self.topic_deleted(topic),
            "topic slot {topic} held a deleted topic: it is reused only by a new region"
        );
        self.word(base + T_STATE)
            .store(TopicState::Free as u64, Ordering::Release);
        self.word(base + T_GENERATION)
            .store(meta.generation, Ordering::Relaxed);
        let packed = meta.order as u64
            | (meta.replication_factor as u64) << 8
            | (meta.default_ack as u64) << 16
            | (name.len() as u64) << 24;
        self.word(base + T_PACKED).store(packed, Ordering::Relaxed);
        let mut padded = [0u8; 64];
        padded[..name.len()].copy_from_slice(name);
        for i in 0..8 {
            let v = u64::from_le_bytes(padded[i * 8..i * 8 + 8].try_into().unwrap());
            self.word(base + T_NAME + WORD * i as u64)
                .store(v, Ordering::Relaxed);
        }
        self.word(base + T_CREATED_MS)
            .store(meta.created_unix_ms, Ordering::Relaxed);
        self.word(base + T_RETENTION_BYTES)
            .store(meta.retention_bytes, Ordering::Relaxed);
        self.word(base + T_RETENTION_MS)
            .store(meta.retention_ms, Ordering::Relaxed);
        self.word(base + T_POSITION_CEILING)
            .store(meta.position_ceiling, Ordering::Relaxed);
        store_fence();
        self.word(base + T_STATE)
            .store(TopicState::Active as u64, Ordering::Release);
        // What every process reads back is what was written: the packing of order, RF,
        // ack and name length into one word has room for each.
        debug_assert_eq!(
            self.topic_meta(topic).as_ref(),
            Some(meta),
            "topic {topic}'s metadata reads back as written"
        );
    }

    /// Marks an active topic deleted (state word only; the rest of its slot stays as it
    /// was, for the processes still letting go of it). Control plane only, and only
    /// after the deletion is on disk. Rings every bell that a process holding state of
    /// the topic may be sleeping on, so each notices at once.
    pub fn delete_topic(&self, topic: u32) {
        let base = self.layout.topic_off(topic);
        let was = self
            .word(base + T_STATE)
            .swap(TopicState::Deleted as u64, Ordering::SeqCst);
        // Free -> Active -> Deleted, once: the control plane deletes only a topic it
        // wrote, so another state means its table and the region disagree.
        assert_eq!(
            was,
            TopicState::Active as u64,
            "topic slot {topic} deleted while not active"
        );
        self.topic_bell(topic).ring();
        for b in 0..self.layout.caps.brokers {
            self.broker_bell(b).ring();
        }
        self.sequencer_bell().ring();
        self.replication_bell().ring();
    }

    /// Whether `topic`'s slot holds a deleted topic (see [`TopicState`]). One load: cheap
    /// enough for a connection's every round.
    pub fn topic_deleted(&self, topic: u32) -> bool {
        let base = self.layout.topic_off(topic);
        self.word(base + T_STATE).load(Ordering::SeqCst) == TopicState::Deleted as u64
    }

    /// Whether `topic`'s slot has ever held a topic in this region (active or deleted): a
    /// free slot has nothing in its lines and rings, so start-up scans pass it by (a
    /// scan reads every page of a slot's rings, megabytes per slot).
    pub fn topic_slot_used(&self, topic: u32) -> bool {
        let base = self.layout.topic_off(topic);
        self.word(base + T_STATE).load(Ordering::Acquire) != TopicState::Free as u64
    }

    /// Reads a topic's metadata if the slot is active.
    pub fn topic_meta(&self, topic: u32) -> Option<TopicMeta> {
        let base = self.layout.topic_off(topic);
        if self.word(base + T_STATE).load(Ordering::Acquire) != TopicState::Active as u64 {
            return None;
        }
        let packed = self.word(base + T_PACKED).load(Ordering::Relaxed);
        let name_len = ((packed >> 24) & 0xff).min(64) as usize;
        let mut bytes = [0u8; 64];
        for i in 0..8 {
            let v = self
                .word(base + T_NAME + 8 * i as u64)
                .load(Ordering::Relaxed);
            bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        Some(TopicMeta {
            name: String::from_utf8_lossy(&bytes[..name_len]).into_owned(),
            order: packed as u8,
            replication_factor: (packed >> 8) as u8,
            default_ack: (packed >> 16) as u8,
            generation: self.word(base + T_GENERATION).load(Ordering::Relaxed),
            created_unix_ms: self.word(base + T_CREATED_MS).load(Ordering::Relaxed),
            retention_bytes: self.word(base + T_RETENTION_BYTES).load(Ordering::Relaxed),
            retention_ms: self.word(base + T_RETENTION_MS).load(Ordering::Relaxed),
            position_ceiling: self.position_ceiling(topic).load(Ordering::Relaxed),
        })
    }

    /// No position of `topic` may be handed out at or above this value (a global
    /// position for orders 2 and 5, a per-broker one for orders 0 and 1):
    /// [`NO_POSITION_CEILING`](crate::NO_POSITION_CEILING) for replicated topics, whose positions the disk replicas
    /// keep. A memory-only topic restarted without its previous region starts at the
    /// ceiling persisted beside `topics.json`, so this bound is what makes a position
    /// never reused. Written by the control plane only (after persisting the value),
    /// and only raised; read by the sequencer once per epoch and by each broker's
    /// service thread once per round, never on a connection's data path.
    pub fn position_ceiling(&self, topic: u32) -> ReadWord<'_> {
        self.read_word(self.layout.topic_off(topic) + T_POSITION_CEILING)
    }

    /// Finds an active topic by name: its slot id and metadata.
    pub fn find_topic(&self, name: &str) -> Option<(u32, TopicMeta)> {
        (0..self.layout.caps.max_topics)
            .filter_map(|t| self.topic_meta(t).map(|m| (t, m)))
            .find(|(_, m)| m.name == name)
    }

    pub fn topic_seq(&self, topic: u32) -> TopicSeq<'_> {
        let base = self.layout.topic_off(topic) + self.layout.topic_seq_rel;
        TopicSeq {
            committed_seq: self.read_word(base + Q_COMMITTED_SEQ),
            next_position: self.read_word(base + Q_NEXT_POSITION),
            start_position: self.read_word(base + Q_START_POSITION),
        }
    }

    /// Where a topic's published order ends: `committed_seq`, and the position that
    /// follows the last committed GOI entry. The sequencer publishes an epoch's
    /// `committed_seq` before its `next_position`, so the stored `next_position` may lag
    /// the committed prefix by one epoch (a sequencer stopped between the two stores),
    /// never lead it; whoever continues the order (a successor, a restart of a
    /// memory-only topic) resumes from here, not from the stored word alone. When the
    /// last entry is not in the ring (none in this region yet, or its slot reused by a
    /// write that was never published) the two stores were not split, and the stored
    /// word is the end.
    pub fn sequence_end(&self, topic: u32) -> (u64, u64) {
        let seq = self.topic_seq(topic);
        // `next_position` first: whatever epoch it is from, its `committed_seq` was
        // stored before it, so the load that follows sees that epoch or a later one.
        let stored = seq.next_position.load(Ordering::Acquire);
        let committed = seq.committed_seq.load(Ordering::Acquire);
        let Some(last) = committed
            .checked_sub(1)
            .and_then(|g| self.goi_read(topic, g))
        else {
            return (committed, stored);
        };
        // Every entry of this region is at or above where its positions start (the
        // seed); one below would be a line continued from the wrong place.
        assert!(
            last.total_order >= seq.start_position.load(Ordering::Acquire),
            "topic {topic}: GOI entry {} at position {} below the region's first",
            committed - 1,
            last.total_order
        );
        let end = last
            .total_order
            .checked_add(last.num_msg as u64)
            .expect("global positions never wrap");
        // With the stores in that order the word never leads the prefix; a region a
        // sequencer from before the fix left in the window is the caller's to report.
        (committed, end.max(stored))
    }

    /// Rung when a topic's readable frontier moves; subscribers sleep on it.
    pub fn topic_bell(&self, topic: u32) -> Doorbell<'_> {
        self.bell_at(self.layout.topic_off(topic) + self.layout.topic_bell_rel)
    }

    pub fn log(&self, topic: u32, broker: u32) -> LogControl<'_> {
        // Beyond the region's brokers the words would be the topic's replica lines.
        assert!(broker < self.layout.caps.brokers, "broker {broker}");
        let base = self.layout.log_control_off(topic, broker);
        LogControl {
            written_frontier: self.read_word(base + LC_WRITTEN_FRONTIER),
            frontier_msgs: self.read_word(base + LC_FRONTIER_MSGS),
            reclaimed_pbr: self.read_word(base + LC_RECLAIMED_PBR),
            reclaimed_blog: self.read_word(base + LC_RECLAIMED_BLOG),
            fence_pbr: self.read_word(base + LC_FENCE_PBR),
            resume_pbr: self.read_word(base + LC_RESUME_PBR),
            resumed_fence: self.read_word(base + LC_RESUMED_FENCE),
            reclaim_pass: self.read_word(base + LC_RECLAIM_PASS),
            ordered_pbr: self.read_word(base + LC_ORDERED_PBR),
            reclaim_request: self.read_word(base + LC_RECLAIM_REQUEST),
            fence_ack: self.read_word(base + LC_FENCE_ACK),
            durable_pbr: self.read_word(base + LC_DURABLE_PBR),
        }
    }

    /// Progress line of disk replica `replica` (1-based) of `topic`.
    pub fn replica(&self, topic: u32, replica: u32) -> ReplicaProgress<'_> {
        assert!((1..=MAX_REPLICAS).contains(&replica), "replica {replica}");
        let base = self.layout.replica_line_off(topic, replica);
        ReplicaProgress {
            durable_seq: self.read_word(base + R_DURABLE_SEQ),
            own_durable_seq: self.read_word(base + R_OWN_DURABLE_SEQ),
            error: self.read_word(base + R_ERROR),
            durable_position: self.read_word(base + R_DURABLE_POSITION),
        }
    }

    /// The topic's durable frontier: GOI entries below it are on every replica's disk.
    /// `replication_factor` counts the region copy; 1 means no disk replicas (0).
    pub fn durable_seq(&self, topic: u32, replication_factor: u8) -> u64 {
        self.last_replica(topic, replication_factor)
            .map_or(0, |r| r.durable_seq.load(Ordering::Acquire))
    }

    /// The last disk replica's line (the end of the chain), if the topic has replicas.
    fn last_replica(&self, topic: u32, replication_factor: u8) -> Option<ReplicaProgress<'_>> {
        match replication_factor as u32 {
            0 | 1 => None,
            rf => Some(self.replica(topic, (rf - 1).min(MAX_REPLICAS))),
        }
    }

    /// The position after the topic's durable frontier: subscribers of a replicated
    /// topic read below it. 0 without disk replicas.
    pub fn durable_position(&self, topic: u32, replication_factor: u8) -> u64 {
        self.last_replica(topic, replication_factor)
            .map_or(0, |r| r.durable_position.load(Ordering::Acquire))
    }
}
