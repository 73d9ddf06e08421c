//! The write handles: each writer of the region's shared words gets exactly the words it
//! owns, from one method of [`Region`] each (this file), and nothing else can store them
//! (`docs` of the crate, "Who writes what", is the map). Read-only views of the same
//! words ([`crate::LogControl`], [`crate::TopicSeq`], [`crate::ReplicaProgress`], the
//! reader and session accessors) are for everyone.

use crate::layout::*;
use crate::word::{MonotonicU64, OwnedWord};
use crate::Region;
use std::sync::atomic::Ordering;

/// The words of a (topic, broker) log control that the broker serving the log writes.
pub struct BrokerLine<'a> {
    /// PBR slots below this index are committed (valid or void): the frontier pass.
    pub written_frontier: MonotonicU64<'a>,
    /// Messages in the valid slots below `written_frontier`: the per-broker position.
    /// Not a [`MonotonicU64`]: it is stored before `written_frontier`, so a broker that
    /// died between the two leaves it ahead of the frontier, and its successor numbers
    /// the same slots again from the frontier (`resume::written_prefix`), in rounds of a
    /// bounded number of slots, through smaller values.
    pub frontier_msgs: OwnedWord<'a>,
    /// PBR slots below this index are reclaimed: reclamation.
    pub reclaimed_pbr: MonotonicU64<'a>,
    /// Log bytes below this logical offset are reclaimed: reclamation.
    pub reclaimed_blog: MonotonicU64<'a>,
    /// Where a restarted broker resumes a fenced log (`broker/resume.rs`).
    pub resume_pbr: OwnedWord<'a>,
    /// The fence `resume_pbr` lifts, stored after it.
    pub resumed_fence: OwnedWord<'a>,
    /// Odd while a reclamation pass of a memory-only topic is between reading the
    /// reader pins and moving the reclaimed frontiers (see
    /// [`Region::await_reclaim_passes`]); one more at each start and end of a pass.
    pub reclaim_pass: MonotonicU64<'a>,
}

/// The words of a (topic, broker) log control that the sequencer writes.
pub struct SequencerLine<'a> {
    /// PBR slots below this index are in the committed GOI prefix.
    pub ordered_pbr: MonotonicU64<'a>,
    /// Slots below this index must be reclaimed for the GOI to move on (raised).
    pub reclaim_request: MonotonicU64<'a>,
    /// The fence the sequencer has finished ordering up to.
    pub fence_ack: OwnedWord<'a>,
}

/// The sequencer's line of a topic, and its reset of a session slot's durable mark.
pub struct SequencerTopic<'a> {
    region: &'a Region,
    topic: u32,
    /// GOI entries below this index are committed.
    pub committed_seq: MonotonicU64<'a>,
    /// The next global position.
    pub next_position: MonotonicU64<'a>,
    /// Where this region's positions start: written once by the start-up seed.
    pub start_position: OwnedWord<'a>,
}

impl SequencerTopic<'_> {
    /// Clears the durable mark of session `slot` when the sequencer hands the slot to a
    /// new session (the one exception to the mark only growing: a new session's batch
    /// sequence starts again).
    pub fn reset_session_durable_hwm(&self, slot: u32) {
        assert!(slot < SESSION_SLOTS, "session slot {slot}");
        self.region
            .owned_word(self.region.layout.session_slot_off(self.topic, slot) + S_DURABLE_HWM)
            .store(0, Ordering::Release);
    }
}

/// The progress line of one disk replica of a topic: its worker's.
pub struct ReplicaLine<'a> {
    /// GOI entries below this index are on this replica and every earlier one.
    pub durable_seq: MonotonicU64<'a>,
    /// GOI entries below this index are on this replica's disk.
    pub own_durable_seq: MonotonicU64<'a>,
    /// 0 while healthy, else the OS error number of the last failed write or sync.
    pub error: OwnedWord<'a>,
    /// The global position after the entries below `durable_seq`.
    pub durable_position: MonotonicU64<'a>,
    own_durable_seq_word: OwnedWord<'a>,
}

impl ReplicaLine<'_> {
    /// States what this replica's disk copy holds when its worker (re)opens it: the one
    /// store of `own_durable_seq` that may go back, because the copy on disk, not the
    /// word (which a fresh region's seed may have set for every replica alike), is what
    /// this replica can vouch for. Every later move is an `advance`.
    pub fn reopen_own_durable_seq(&self, durable: u64) {
        self.own_durable_seq_word.store(durable, Ordering::Release);
    }
}

/// What the end of a topic's replication chain (its last replica's worker) marks durable.
pub struct ChainMarks<'a> {
    region: &'a Region,
    topic: u32,
}

impl<'a> ChainMarks<'a> {
    /// PBR slots of `broker`'s log below this are on every replica's disk.
    pub fn durable_pbr(&self, broker: u32) -> MonotonicU64<'a> {
        assert!(broker < self.region.layout.caps.brokers, "broker {broker}");
        self.region.monotonic(
            self.region.layout.log_control_off(self.topic, broker) + LC_DURABLE_PBR,
            "a log's durable PBR frontier",
        )
    }

    /// Order 5, ack 2: the session in `slot` has every batch below this on disk.
    pub fn session_durable_hwm(&self, slot: u32) -> MonotonicU64<'a> {
        assert!(slot < SESSION_SLOTS, "session slot {slot}");
        self.region.monotonic(
            self.region.layout.session_slot_off(self.topic, slot) + S_DURABLE_HWM,
            "a session's durable mark",
        )
    }
}

/// The control plane's words outside the topic metadata (which it writes with
/// [`Region::write_topic_meta`] and [`Region::delete_topic`]).
pub struct ControlPlane<'a> {
    region: &'a Region,
}

impl<'a> ControlPlane<'a> {
    /// The fence of `broker`'s log of `topic`, set once the broker is declared dead.
    pub fn fence_pbr(&self, topic: u32, broker: u32) -> OwnedWord<'a> {
        // Beyond the region's brokers the word would be a replica line's.
        assert!(broker < self.region.layout.caps.brokers, "broker {broker}");
        self.region
            .owned_word(self.region.layout.log_control_off(topic, broker) + LC_FENCE_PBR)
    }

    /// The topic's position ceiling: only raised, and only once on disk.
    pub fn position_ceiling(&self, topic: u32) -> MonotonicU64<'a> {
        self.region.monotonic(
            self.region.layout.topic_off(topic) + T_POSITION_CEILING,
            "a topic's position ceiling",
        )
    }
}

/// The sequencer lease words of the control block: every candidate may take the lease
/// by compare-and-swap of the deadline; the winner then writes the epoch and its id.
pub struct LeaseWords<'a> {
    /// Raised by one for each new lease holder.
    pub fencing_epoch: MonotonicU64<'a>,
    pub sequencer_id: OwnedWord<'a>,
    pub deadline_ns: OwnedWord<'a>,
}

/// One reader slot of a topic, for the broker claiming or holding it (and the control
/// plane freeing it). The heartbeat decides who holds it: only the broker that moved it
/// from 0 to [`crate::READER_CLAIMING`] writes the rest.
pub struct ReaderSlotHandle<'a> {
    region: &'a Region,
    topic: u32,
    slot: u32,
    /// 0 free, [`crate::READER_CLAIMING`] while claimed, else the holder's last beat.
    pub heartbeat: OwnedWord<'a>,
    /// 1 + the broker serving the reader.
    pub owner: OwnedWord<'a>,
    /// A hash of the reader's client address (0: not recorded).
    pub address: OwnedWord<'a>,
}

impl<'a> ReaderSlotHandle<'a> {
    /// The position the reader still needs at `index` (see [`Region::reader_position`]).
    /// Not a [`MonotonicU64`]: a new claim of the slot starts from wherever its reader is.
    pub fn position(&self, index: u32) -> OwnedWord<'a> {
        assert!(index < MAX_BROKERS, "reader position index {index}");
        self.region.owned_word(
            self.region.layout.reader_slot_off(self.topic, self.slot)
                + RS_POSITIONS
                + WORD * index as u64,
        )
    }

    /// Records that this slot is being claimed, before its heartbeat is set, so scans
    /// that start after the claim look at it: raises the topic's readers line, which
    /// every claiming broker raises and nothing lowers.
    pub fn mark_claimed(&self) {
        self.region
            .monotonic(
                self.region.layout.readers_line_off(self.topic),
                "a topic's readers line",
            )
            .raise(self.slot as u64 + 1, Ordering::AcqRel);
    }
}

impl Region {
    /// The broker line of `broker`'s log of `topic`: for the broker serving that log
    /// (its service thread, its restart) and the start-up seed only.
    pub fn broker_line(&self, topic: u32, broker: u32) -> BrokerLine<'_> {
        // Beyond the region's brokers the line would be another topic's.
        assert!(broker < self.layout.caps.brokers, "broker {broker}");
        let base = self.layout.log_control_off(topic, broker);
        BrokerLine {
            written_frontier: self.monotonic(base + LC_WRITTEN_FRONTIER, "written_frontier"),
            frontier_msgs: self.owned_word(base + LC_FRONTIER_MSGS),
            reclaimed_pbr: self.monotonic(base + LC_RECLAIMED_PBR, "reclaimed_pbr"),
            reclaimed_blog: self.monotonic(base + LC_RECLAIMED_BLOG, "reclaimed_blog"),
            resume_pbr: self.owned_word(base + LC_RESUME_PBR),
            resumed_fence: self.owned_word(base + LC_RESUMED_FENCE),
            reclaim_pass: self.monotonic(base + LC_RECLAIM_PASS, "reclaim_pass"),
        }
    }

    /// The sequencer's line of `broker`'s log of `topic`: for the sequencer only.
    pub fn sequencer_line(&self, topic: u32, broker: u32) -> SequencerLine<'_> {
        assert!(broker < self.layout.caps.brokers, "broker {broker}");
        let base = self.layout.log_control_off(topic, broker);
        SequencerLine {
            ordered_pbr: self.monotonic(base + LC_ORDERED_PBR, "ordered_pbr"),
            reclaim_request: self.monotonic(base + LC_RECLAIM_REQUEST, "reclaim_request"),
            fence_ack: self.owned_word(base + LC_FENCE_ACK),
        }
    }

    /// The sequence line of `topic`: for the sequencer and the start-up seed only.
    pub fn sequencer_topic(&self, topic: u32) -> SequencerTopic<'_> {
        assert!(topic < self.layout.caps.max_topics, "topic {topic}");
        let base = self.layout.topic_off(topic) + self.layout.topic_seq_rel;
        SequencerTopic {
            region: self,
            topic,
            committed_seq: self.monotonic(base + Q_COMMITTED_SEQ, "committed_seq"),
            next_position: self.monotonic(base + Q_NEXT_POSITION, "next_position"),
            start_position: self.owned_word(base + Q_START_POSITION),
        }
    }

    /// The progress line of disk replica `replica` (1-based) of `topic`: for that
    /// replica's worker and the start-up seed only.
    pub fn replica_line(&self, topic: u32, replica: u32) -> ReplicaLine<'_> {
        assert!((1..=MAX_REPLICAS).contains(&replica), "replica {replica}");
        let base = self.layout.replica_line_off(topic, replica);
        ReplicaLine {
            durable_seq: self.monotonic(base + R_DURABLE_SEQ, "a replica's durable_seq"),
            own_durable_seq: self
                .monotonic(base + R_OWN_DURABLE_SEQ, "a replica's own_durable_seq"),
            error: self.owned_word(base + R_ERROR),
            durable_position: self
                .monotonic(base + R_DURABLE_POSITION, "a replica's durable_position"),
            own_durable_seq_word: self.owned_word(base + R_OWN_DURABLE_SEQ),
        }
    }

    /// The durable marks of `topic`: for the last replica's worker and the seed only.
    pub fn chain_marks(&self, topic: u32) -> ChainMarks<'_> {
        assert!(topic < self.layout.caps.max_topics, "topic {topic}");
        ChainMarks {
            region: self,
            topic,
        }
    }

    /// The control plane's words: for the head's control plane only.
    pub fn control_plane(&self) -> ControlPlane<'_> {
        ControlPlane { region: self }
    }

    /// The lease words: for sequencer candidates only (`sequencer/lease.rs`).
    pub fn lease_words(&self) -> LeaseWords<'_> {
        let base = self.layout.control_off;
        LeaseWords {
            fencing_epoch: self.monotonic(base + C_FENCING_EPOCH, "fencing_epoch"),
            sequencer_id: self.owned_word(base + C_SEQUENCER_ID),
            deadline_ns: self.owned_word(base + C_LEASE_DEADLINE_NS),
        }
    }

    /// Reader slot `slot` of `topic`: for the broker claiming or holding it.
    pub fn reader_slot(&self, topic: u32, slot: u32) -> ReaderSlotHandle<'_> {
        assert!(slot < READER_SLOTS, "reader slot {slot}");
        let base = self.layout.reader_slot_off(topic, slot);
        ReaderSlotHandle {
            region: self,
            topic,
            slot,
            heartbeat: self.owned_word(base + RS_HEARTBEAT),
            owner: self.owned_word(base + READER_OWNER_REL),
            address: self.owned_word(base + READER_ADDRESS_REL),
        }
    }
}
