//! Where everything lives in the region. All addresses are byte offsets from the start
//! of the mapping, computed from the capacities in the header, so any process that maps
//! the file anywhere agrees on them.
//!
//! ```text
//! [header 4 KiB][control block 4 KiB]
//! [topic 0: meta | sequence line | bell | log control per broker | replica lines | reader
//!  slots | session slots | GOI ring | per broker: PBR ring, segment map]
//! [topic 1: ...] ... [topic max_topics-1]
//! [broker 0 segments][broker 1 segments] ...
//! ```

use crate::RegionError;

pub const REGION_MAGIC: [u8; 8] = *b"EMBREGN\0";
/// 5: the topic's position ceiling (`Region::position_ceiling`), which every process
/// that hands out positions must respect.
pub const LAYOUT_VERSION: u32 = 5;
pub const PAGE: u64 = 4096;

pub const HEADER_LEN: u64 = PAGE;
pub const CONTROL_LEN: u64 = PAGE;
/// Topic metadata, written by the control plane.
pub const TOPIC_META_LEN: u64 = 512;
/// Sequencer-owned line of a topic: committed_seq, next_position.
pub const TOPIC_SEQ_LEN: u64 = 128;
/// Doorbell rung when a topic's readable frontier moves.
pub const TOPIC_BELL_LEN: u64 = 64;
/// Per (topic, broker): a broker-owned line, a sequencer-owned line, a replica-owned line.
pub const LOG_CONTROL_LEN: u64 = 3 * 128;
pub const PBR_SLOT_LEN: u64 = 128;
pub const GOI_ENTRY_LEN: u64 = 128;
pub const SEG_MAP_ENTRY_LEN: u64 = 16;
/// Most brokers one region can describe (one doorbell line each in the control block).
pub const MAX_BROKERS: u32 = 32;
/// Disk replicas per topic at most (the replication factor counts the region copy too).
pub const MAX_REPLICAS: u32 = 7;
/// Per (topic, replica): the progress line that replica's worker owns.
pub const REPLICA_LINE_LEN: u64 = 128;
/// Subscriber pins per topic: readers whose positions hold back reclamation. Many, so
/// that a burst of subscribers (or one client with many connections, bounded by
/// `broker.max_connections_per_address`) does not leave later ones unprotected; scans
/// stop at the highest slot ever claimed (the readers line), so unused ones cost nothing.
pub const READER_SLOTS: u32 = 1024;
/// The readers line before a topic's reader slots: one above the highest slot ever
/// claimed (raised by claiming brokers, never lowered).
pub const READERS_LINE_LEN: u64 = 64;
/// Order-5 sessions per topic (the durable session table).
pub const SESSION_SLOTS: u32 = 256;
/// A session slot: state, client id, session epoch, committed high-water mark.
pub const SESSION_SLOT_LEN: u64 = 64;
/// A reader slot: heartbeat, then one position per possible broker, the owner word and
/// the client address word, then spare room.
pub const READER_SLOT_LEN: u64 = 8 * (1 + MAX_BROKERS as u64) + 56;
/// In a reader slot: 1 + the broker serving the reader.
pub const READER_OWNER_REL: u64 = 8 * (1 + MAX_BROKERS as u64);
/// In a reader slot: a hash of the subscriber's client address (0: not recorded), so a
/// cap per address can count an address's pins over every broker of the region.
pub const READER_ADDRESS_REL: u64 = READER_OWNER_REL + 8;
const _: () = assert!(READER_ADDRESS_REL + 8 <= READER_SLOT_LEN);

// ---------------------------------------------------------------- word offsets
// Offsets of the words inside each part, relative to the part's start. Every module that
// turns a part into words uses these names; the assertions below are the facts the layout
// rests on (parts do not overlap, lines with different writers are on different cache
// lines, a ring slot holds its record), checked when this crate compiles.

/// One cache line: words with different writers never share one.
pub const LINE: u64 = 64;
/// Bytes of a shared word.
pub const WORD: u64 = 8;

// Header words.
pub(crate) const H_MAGIC: u64 = 0;
pub(crate) const H_VERSION: u64 = 8;
/// 7 words of capacities ([`Capacities`], in declaration order).
pub(crate) const H_CAPS: u64 = 16;
pub(crate) const H_CAPS_WORDS: u64 = 7;
pub(crate) const H_TOTAL_LEN: u64 = 72;
pub(crate) const H_CREATED_NS: u64 = 80;
pub(crate) const H_INIT_DONE: u64 = 88;
/// 2 words: the kernel boot id when the region was created.
pub(crate) const H_BOOT_ID: u64 = 96;
/// Nonzero once a restarted head has replaced this region.
pub(crate) const H_RETIRED: u64 = 112;
pub(crate) const INIT_DONE_TOKEN: u64 = 0x454d_4244_5245_4459; // "EMBDREDY"
/// Bytes of the header that [`crate::Region::check_header`] reads: up to the boot id.
pub const ATTACH_HEAD_LEN: usize = H_BOOT_ID as usize;
const _: () = assert!(H_CAPS + H_CAPS_WORDS * WORD == H_TOTAL_LEN);
const _: () = assert!(H_INIT_DONE + WORD <= ATTACH_HEAD_LEN as u64);
const _: () = assert!(H_RETIRED + WORD <= HEADER_LEN);

// Control block: fencing epoch and sequencer lease, then doorbells on their own lines.
pub(crate) const C_FENCING_EPOCH: u64 = 0;
pub(crate) const C_SEQUENCER_ID: u64 = 8;
pub(crate) const C_LEASE_DEADLINE_NS: u64 = 16;
/// [`OWNER_RECORD_LEN`] bytes: the lease holder's process.
pub(crate) const C_SEQUENCER_OWNER: u64 = 32;
pub(crate) const C_SEQUENCER_BELL: u64 = 512;
pub(crate) const C_REPLICATION_BELL: u64 = 768;
/// One [`BELL_LINE_LEN`] line per broker.
pub(crate) const C_BROKER_BELLS: u64 = 1024;
/// [`OWNER_RECORD_LEN`] bytes per broker: the process serving its logs.
pub(crate) const C_BROKER_OWNERS: u64 = 3072;
/// A doorbell (count and waiters, two u32 words) alone on its line.
pub(crate) const BELL_LINE_LEN: u64 = LINE;
pub(crate) const BELL_WAITERS_REL: u64 = 4;
/// An owner record: incarnation, boot, pid, start ticks.
pub(crate) const OWNER_RECORD_LEN: u64 = 4 * WORD;
pub(crate) const OWNER_INCARNATION: u64 = 0;
pub(crate) const OWNER_BOOT: u64 = 8;
pub(crate) const OWNER_PID: u64 = 16;
pub(crate) const OWNER_START_TICKS: u64 = 24;
const _: () = assert!(OWNER_START_TICKS + WORD == OWNER_RECORD_LEN);
const _: () = assert!(C_LEASE_DEADLINE_NS + WORD <= C_SEQUENCER_OWNER);
const _: () = assert!(C_SEQUENCER_OWNER + OWNER_RECORD_LEN <= C_SEQUENCER_BELL);
const _: () = assert!(C_SEQUENCER_BELL + BELL_LINE_LEN <= C_REPLICATION_BELL);
const _: () = assert!(C_REPLICATION_BELL + BELL_LINE_LEN <= C_BROKER_BELLS);
const _: () = assert!(C_BROKER_BELLS + MAX_BROKERS as u64 * BELL_LINE_LEN <= C_BROKER_OWNERS);
const _: () = assert!(C_BROKER_OWNERS + MAX_BROKERS as u64 * OWNER_RECORD_LEN <= CONTROL_LEN);
const _: () = assert!(BELL_WAITERS_REL + 4 <= BELL_LINE_LEN);
const _: () = assert!(TOPIC_BELL_LEN == BELL_LINE_LEN);

// Topic meta words (control plane).
pub(crate) const T_STATE: u64 = 0;
pub(crate) const T_GENERATION: u64 = 8;
/// order | rf << 8 | default_ack << 16 | name_len << 24
pub(crate) const T_PACKED: u64 = 16;
/// [`T_NAME_LEN`] bytes of name.
pub(crate) const T_NAME: u64 = 24;
pub(crate) const T_NAME_LEN: u64 = 64;
pub(crate) const T_CREATED_MS: u64 = 88;
pub(crate) const T_RETENTION_BYTES: u64 = 96;
pub(crate) const T_RETENTION_MS: u64 = 104;
/// The position ceiling of a memory-only topic, on a line of its own: the sequencer
/// (orders 2, 5) and every broker (orders 0, 1) read it once per epoch or service round,
/// while the other meta words are read only when a topic is looked up. Written by the
/// control plane only (one writer per field), and only raised once the new value is on
/// disk: see [`crate::Region::position_ceiling`].
pub(crate) const T_POSITION_CEILING: u64 = 128;
const _: () = assert!(T_NAME + T_NAME_LEN == T_CREATED_MS);
const _: () = assert!(T_RETENTION_MS + WORD <= T_POSITION_CEILING);
const _: () = assert!(T_POSITION_CEILING.is_multiple_of(LINE));
const _: () = assert!(T_POSITION_CEILING + LINE <= TOPIC_META_LEN);

// The sequence line of a topic (sequencer; `start_position` by the start-up seed).
pub(crate) const Q_COMMITTED_SEQ: u64 = 0;
pub(crate) const Q_NEXT_POSITION: u64 = 8;
pub(crate) const Q_START_POSITION: u64 = 16;
const _: () = assert!(Q_START_POSITION + WORD <= TOPIC_SEQ_LEN);

// The log control of a (topic, broker): three 128-byte lines, one per writer.
/// The broker's line.
pub(crate) const LC_BROKER_LINE: u64 = 0;
pub(crate) const LC_WRITTEN_FRONTIER: u64 = LC_BROKER_LINE;
pub(crate) const LC_FRONTIER_MSGS: u64 = LC_BROKER_LINE + 8;
pub(crate) const LC_RECLAIMED_PBR: u64 = LC_BROKER_LINE + 16;
pub(crate) const LC_RECLAIMED_BLOG: u64 = LC_BROKER_LINE + 24;
/// Written by the control plane, on the broker's line: see `LogControl::fence_pbr`.
pub(crate) const LC_FENCE_PBR: u64 = LC_BROKER_LINE + 32;
pub(crate) const LC_RESUME_PBR: u64 = LC_BROKER_LINE + 40;
pub(crate) const LC_RESUMED_FENCE: u64 = LC_BROKER_LINE + 48;
pub(crate) const LC_RECLAIM_PASS: u64 = LC_BROKER_LINE + 56;
/// The sequencer's line.
pub(crate) const LC_SEQUENCER_LINE: u64 = LOG_CONTROL_LINE_LEN;
pub(crate) const LC_ORDERED_PBR: u64 = LC_SEQUENCER_LINE;
pub(crate) const LC_RECLAIM_REQUEST: u64 = LC_SEQUENCER_LINE + 8;
pub(crate) const LC_FENCE_ACK: u64 = LC_SEQUENCER_LINE + 16;
/// The replication chain's line.
pub(crate) const LC_CHAIN_LINE: u64 = 2 * LOG_CONTROL_LINE_LEN;
pub(crate) const LC_DURABLE_PBR: u64 = LC_CHAIN_LINE;
/// One writer's line of a log control.
pub(crate) const LOG_CONTROL_LINE_LEN: u64 = 128;
const _: () = assert!(LC_RESUMED_FENCE + WORD <= LC_RECLAIM_PASS);
const _: () = assert!(LC_RECLAIM_PASS + WORD <= LC_SEQUENCER_LINE);
const _: () = assert!(LC_FENCE_ACK + WORD <= LC_CHAIN_LINE);
const _: () = assert!(LC_DURABLE_PBR + WORD <= LOG_CONTROL_LEN);
const _: () = assert!(3 * LOG_CONTROL_LINE_LEN == LOG_CONTROL_LEN);

// Replica line words (that replica's worker).
pub(crate) const R_DURABLE_SEQ: u64 = 0;
pub(crate) const R_OWN_DURABLE_SEQ: u64 = 8;
pub(crate) const R_ERROR: u64 = 16;
pub(crate) const R_DURABLE_POSITION: u64 = 24;
const _: () = assert!(R_DURABLE_POSITION + WORD <= REPLICA_LINE_LEN);

// Reader slot words: the heartbeat, then one position per possible broker.
pub(crate) const RS_HEARTBEAT: u64 = 0;
pub(crate) const RS_POSITIONS: u64 = 8;
const _: () = assert!(RS_POSITIONS + MAX_BROKERS as u64 * WORD == READER_OWNER_REL);
const _: () = assert!(READERS_LINE_LEN >= WORD);

// Session slot words. The durable mark is written by the replication chain (and reset by
// the sequencer when it hands the slot to another session); the rest is the sequencer's,
// but for the last-active stamp, which brokers raise too.
pub(crate) const S_STATE: u64 = 0;
pub(crate) const S_CLIENT_ID: u64 = 8;
/// The session epoch in the low 32 bits, the opener of that epoch in the high 32.
pub(crate) const S_SESSION_EPOCH: u64 = 16;
pub(crate) const S_COMMITTED_HWM: u64 = 24;
pub(crate) const S_DURABLE_HWM: u64 = 32;
pub(crate) const S_LAST_ACTIVE_MS: u64 = 40;
pub(crate) const S_OPENED_AT: u64 = 48;
pub(crate) const S_KEY_HASH: u64 = 56;
const _: () = assert!(S_KEY_HASH + WORD <= SESSION_SLOT_LEN);

// A PBR slot is one encoded batch header, its commit token in the last word.
pub(crate) const PBR_TOKEN: u64 = embarcadero_wire::batch::offsets::PUBLISH_COMMIT as u64;
const _: () = assert!(PBR_TOKEN + WORD == PBR_SLOT_LEN);
const _: () = assert!(PBR_SLOT_LEN == embarcadero_wire::BATCH_HEADER_LEN as u64);
const _: () = assert!(embarcadero_wire::batch::offsets::TOTAL_ORDER as u64 + WORD <= PBR_TOKEN);

// A GOI entry: its token (global_seq), then the entry's words.
pub(crate) const G_TOKEN: u64 = 0;
pub(crate) const G_WORDS: u64 = 8;
pub(crate) const G_WORD_COUNT: usize = 15;
const _: () = assert!(G_WORDS + G_WORD_COUNT as u64 * WORD == GOI_ENTRY_LEN);

// A segment-map entry: its token (logical segment + 1), then the physical segment.
pub(crate) const SM_TOKEN: u64 = 0;
pub(crate) const SM_PHYSICAL: u64 = 8;
const _: () = assert!(SM_PHYSICAL + WORD == SEG_MAP_ENTRY_LEN);

// Parts of a topic slot that follow one another start on whole lines.
const _: () = assert!(TOPIC_META_LEN.is_multiple_of(LINE) && TOPIC_SEQ_LEN.is_multiple_of(LINE));
const _: () =
    assert!(LOG_CONTROL_LEN.is_multiple_of(LINE) && REPLICA_LINE_LEN.is_multiple_of(LINE));
const _: () =
    assert!(READER_SLOT_LEN.is_multiple_of(WORD) && SESSION_SLOT_LEN.is_multiple_of(LINE));
const _: () = assert!(PBR_SLOT_LEN.is_multiple_of(LINE) && GOI_ENTRY_LEN.is_multiple_of(LINE));

/// Capacities of a region. Stored in its header; an attaching process must agree (the
/// head publishes them to followers as JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Capacities {
    pub max_topics: u32,
    pub brokers: u32,
    /// GOI ring slots per topic, a power of two.
    pub goi_slots: u64,
    /// PBR ring slots per (topic, broker), a power of two.
    pub pbr_slots: u64,
    /// Bytes per BLog segment, a multiple of 4096; the largest batch must fit in one.
    pub segment_bytes: u64,
    /// Segments in each broker's pool, shared by that broker's topics.
    pub segments_per_broker: u32,
    /// Segment-map ring slots per (topic, broker), a power of two above segments_per_broker.
    pub seg_map_slots: u64,
}

impl Default for Capacities {
    /// About 2.9 GiB of (sparse) file for 4 brokers and 256 topics: 768 MiB of log
    /// segments and 8.35 MiB per topic slot, which costs nothing until it is used
    /// (`docs/DESIGN.md`, "Topic delete").
    fn default() -> Self {
        Self {
            max_topics: 256,
            brokers: 4,
            goi_slots: 32768,
            pbr_slots: 8192,
            segment_bytes: 8 << 20,
            segments_per_broker: 24,
            seg_map_slots: 64,
        }
    }
}

impl Capacities {
    pub fn validate(&self) -> Result<(), RegionError> {
        let bad = |what: String| Err(RegionError::BadCapacities(what));
        if self.brokers == 0 || self.brokers > MAX_BROKERS {
            return bad(format!(
                "brokers must be 1..={MAX_BROKERS}, got {}",
                self.brokers
            ));
        }
        if self.max_topics == 0 || self.max_topics > 4096 {
            return bad(format!(
                "max_topics must be 1..=4096, got {}",
                self.max_topics
            ));
        }
        for (name, v) in [
            ("goi_slots", self.goi_slots),
            ("pbr_slots", self.pbr_slots),
            ("seg_map_slots", self.seg_map_slots),
        ] {
            if v < 8 || !v.is_power_of_two() {
                return bad(format!("{name} must be a power of two >= 8, got {v}"));
            }
        }
        if self.segment_bytes < PAGE || !self.segment_bytes.is_multiple_of(PAGE) {
            return bad(format!(
                "segment_bytes must be a multiple of 4096, got {}",
                self.segment_bytes
            ));
        }
        if self.segments_per_broker < 2 {
            return bad("segments_per_broker must be at least 2".into());
        }
        if self.seg_map_slots <= self.segments_per_broker as u64 {
            return bad(format!(
                "seg_map_slots ({}) must exceed segments_per_broker ({})",
                self.seg_map_slots, self.segments_per_broker
            ));
        }
        Ok(())
    }
}

/// Offsets computed from [`Capacities`].
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub caps: Capacities,
    pub control_off: u64,
    pub topics_off: u64,
    pub topic_stride: u64,
    pub topic_seq_rel: u64,
    pub topic_bell_rel: u64,
    pub log_control_rel: u64,
    pub replicas_rel: u64,
    pub readers_rel: u64,
    pub sessions_rel: u64,
    pub goi_rel: u64,
    pub per_broker_rel: u64,
    pub per_broker_stride: u64,
    pub seg_map_rel_in_broker: u64,
    pub segments_off: u64,
    pub total_len: u64,
}

const fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

impl Layout {
    pub fn new(caps: Capacities) -> Result<Self, RegionError> {
        caps.validate()?;
        // The capacities may come from a region file's header or a configuration file:
        // sizes that overflow are an error, not a wrapped layout.
        let too_big =
            || RegionError::BadCapacities(format!("{caps:?} make a region of 2^64 bytes or more"));
        let add = |a: u64, b: u64| a.checked_add(b).ok_or_else(too_big);
        let mul = |a: u64, b: u64| a.checked_mul(b).ok_or_else(too_big);
        let up = |n: u64, to: u64| n.checked_next_multiple_of(to).ok_or_else(too_big);
        let b = caps.brokers as u64;
        let topic_seq_rel = TOPIC_META_LEN;
        let topic_bell_rel = topic_seq_rel + TOPIC_SEQ_LEN;
        let log_control_rel = topic_bell_rel + TOPIC_BELL_LEN;
        let replicas_rel = log_control_rel + b * LOG_CONTROL_LEN;
        let readers_rel = replicas_rel + MAX_REPLICAS as u64 * REPLICA_LINE_LEN;
        let sessions_rel = readers_rel + READERS_LINE_LEN + READER_SLOTS as u64 * READER_SLOT_LEN;
        let goi_rel = round_up(sessions_rel + SESSION_SLOTS as u64 * SESSION_SLOT_LEN, PAGE);
        let per_broker_rel = add(goi_rel, mul(caps.goi_slots, GOI_ENTRY_LEN)?)?;
        let seg_map_rel_in_broker = mul(caps.pbr_slots, PBR_SLOT_LEN)?;
        let per_broker_stride = up(
            add(
                seg_map_rel_in_broker,
                mul(caps.seg_map_slots, SEG_MAP_ENTRY_LEN)?,
            )?,
            PAGE,
        )?;
        let topic_stride = up(add(per_broker_rel, mul(b, per_broker_stride)?)?, PAGE)?;
        let control_off = HEADER_LEN;
        let topics_off = control_off + CONTROL_LEN;
        let segments_off = up(
            add(topics_off, mul(caps.max_topics as u64, topic_stride)?)?,
            1 << 21,
        )?;
        let total_len = add(
            segments_off,
            mul(mul(b, caps.segments_per_broker as u64)?, caps.segment_bytes)?,
        )?;
        let layout = Self {
            caps,
            control_off,
            topics_off,
            topic_stride,
            topic_seq_rel,
            topic_bell_rel,
            log_control_rel,
            replicas_rel,
            readers_rel,
            sessions_rel,
            goi_rel,
            per_broker_rel,
            per_broker_stride,
            seg_map_rel_in_broker,
            segments_off,
            total_len,
        };
        layout.assert_parts_in_order();
        Ok(layout)
    }

    /// The facts every offset computed from this layout rests on, once the capacities
    /// are known (those that hold for any capacities are checked at compile time above):
    /// the parts of a topic slot follow one another without overlap, each broker's rings
    /// fit its stride, the slots fit before the segments, and the segments end the file.
    /// `Region::map` relies on the page alignment for its `madvise`.
    fn assert_parts_in_order(&self) {
        let b = self.caps.brokers as u64;
        assert!(
            self.log_control_rel + b * LOG_CONTROL_LEN <= self.replicas_rel
                && self.replicas_rel + MAX_REPLICAS as u64 * REPLICA_LINE_LEN <= self.readers_rel
                && self.sessions_rel + SESSION_SLOTS as u64 * SESSION_SLOT_LEN <= self.goi_rel
                && self.goi_rel + self.caps.goi_slots * GOI_ENTRY_LEN <= self.per_broker_rel,
            "the parts of a topic slot overlap: {self:?}"
        );
        assert!(
            self.seg_map_rel_in_broker + self.caps.seg_map_slots * SEG_MAP_ENTRY_LEN
                <= self.per_broker_stride
                && self.per_broker_rel + b * self.per_broker_stride <= self.topic_stride,
            "a broker's rings overflow its part of the topic slot: {self:?}"
        );
        assert!(
            self.topics_off.is_multiple_of(PAGE)
                && self.topic_stride.is_multiple_of(PAGE)
                && self.topics_off + self.caps.max_topics as u64 * self.topic_stride
                    <= self.segments_off
                && self.segments_off.is_multiple_of(PAGE),
            "the topic slots overlap the segments or are not page-aligned: {self:?}"
        );
        assert_eq!(
            self.segments_off + b * self.caps.segments_per_broker as u64 * self.caps.segment_bytes,
            self.total_len,
            "the segments end the region"
        );
    }

    pub fn topic_off(&self, topic: u32) -> u64 {
        debug_assert!(topic < self.caps.max_topics);
        self.topics_off + topic as u64 * self.topic_stride
    }

    pub fn log_control_off(&self, topic: u32, broker: u32) -> u64 {
        debug_assert!(broker < self.caps.brokers);
        self.topic_off(topic) + self.log_control_rel + broker as u64 * LOG_CONTROL_LEN
    }

    /// Progress line of disk replica `replica` (1-based, as in "replica 1 of RF - 1").
    pub fn replica_line_off(&self, topic: u32, replica: u32) -> u64 {
        debug_assert!((1..=MAX_REPLICAS).contains(&replica));
        self.topic_off(topic) + self.replicas_rel + (replica as u64 - 1) * REPLICA_LINE_LEN
    }

    pub fn reader_slot_off(&self, topic: u32, slot: u32) -> u64 {
        debug_assert!(slot < READER_SLOTS);
        self.topic_off(topic) + self.readers_rel + READERS_LINE_LEN + slot as u64 * READER_SLOT_LEN
    }

    /// The readers line of `topic` (see [`READERS_LINE_LEN`]).
    pub fn readers_line_off(&self, topic: u32) -> u64 {
        self.topic_off(topic) + self.readers_rel
    }

    pub fn session_slot_off(&self, topic: u32, slot: u32) -> u64 {
        debug_assert!(slot < SESSION_SLOTS);
        self.topic_off(topic) + self.sessions_rel + slot as u64 * SESSION_SLOT_LEN
    }

    pub fn goi_entry_off(&self, topic: u32, index: u64) -> u64 {
        self.topic_off(topic) + self.goi_rel + (index & (self.caps.goi_slots - 1)) * GOI_ENTRY_LEN
    }

    pub fn pbr_slot_off(&self, topic: u32, broker: u32, index: u64) -> u64 {
        // Beyond the brokers it would land in the next topic's block.
        debug_assert!(broker < self.caps.brokers);
        self.topic_off(topic)
            + self.per_broker_rel
            + broker as u64 * self.per_broker_stride
            + (index & (self.caps.pbr_slots - 1)) * PBR_SLOT_LEN
    }

    pub fn seg_map_off(&self, topic: u32, broker: u32, logical_segment: u64) -> u64 {
        debug_assert!(broker < self.caps.brokers);
        self.topic_off(topic)
            + self.per_broker_rel
            + broker as u64 * self.per_broker_stride
            + self.seg_map_rel_in_broker
            + (logical_segment & (self.caps.seg_map_slots - 1)) * SEG_MAP_ENTRY_LEN
    }

    pub fn segment_off(&self, broker: u32, physical: u32) -> u64 {
        debug_assert!(broker < self.caps.brokers && physical < self.caps.segments_per_broker);
        self.segments_off
            + (broker as u64 * self.caps.segments_per_broker as u64 + physical as u64)
                * self.caps.segment_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default must fit a filesystem of a few GiB (the start-up room check wants
    /// all of it): a topic slot is 8.35 MiB with the default rings.
    #[test]
    fn default_region_is_under_three_gib() {
        let l = Layout::new(Capacities::default()).unwrap();
        assert!(l.total_len < 3 << 30, "{} bytes", l.total_len);
        assert!(
            l.topic_stride < 9 << 20,
            "{} bytes per slot",
            l.topic_stride
        );
    }

    #[test]
    fn sections_do_not_overlap() {
        let caps = Capacities {
            max_topics: 3,
            brokers: 2,
            goi_slots: 16,
            pbr_slots: 8,
            segment_bytes: 8192,
            segments_per_broker: 3,
            seg_map_slots: 8,
        };
        let l = Layout::new(caps).unwrap();
        let last_topic_end = l.topic_off(2) + l.topic_stride;
        assert!(last_topic_end <= l.segments_off);
        let last_pbr = l.pbr_slot_off(2, 1, 7) + PBR_SLOT_LEN;
        assert!(last_pbr <= l.seg_map_off(2, 1, 0));
        assert!(l.seg_map_off(2, 1, 7) + SEG_MAP_ENTRY_LEN <= last_topic_end);
        assert!(l.goi_entry_off(0, 15) + GOI_ENTRY_LEN <= l.pbr_slot_off(0, 0, 0));
        assert!(l.log_control_off(0, 1) + LOG_CONTROL_LEN <= l.replica_line_off(0, 1));
        assert!(l.replica_line_off(0, MAX_REPLICAS) + REPLICA_LINE_LEN <= l.reader_slot_off(0, 0));
        assert!(
            l.reader_slot_off(0, READER_SLOTS - 1) + READER_SLOT_LEN <= l.session_slot_off(0, 0)
        );
        assert!(
            l.session_slot_off(0, SESSION_SLOTS - 1) + SESSION_SLOT_LEN <= l.goi_entry_off(0, 0)
        );
        assert_eq!(l.segment_off(1, 2) + 8192, l.total_len);
        // Rings wrap by masking.
        assert_eq!(l.goi_entry_off(1, 3), l.goi_entry_off(1, 19));
    }

    #[test]
    fn control_block_holds_every_broker_doorbell() {
        // Doorbells start at 1024 and take one 64-byte line per broker.
        assert!(1024 + MAX_BROKERS as u64 * 64 <= 3072);
        // Broker owner records follow at 3072, four words per broker.
        assert!(3072 + MAX_BROKERS as u64 * 32 <= CONTROL_LEN);
    }

    #[test]
    fn bad_capacities_are_refused() {
        let ok = Capacities::default();
        for bad in [
            Capacities { brokers: 0, ..ok },
            Capacities {
                goi_slots: 1000,
                ..ok
            },
            Capacities {
                segment_bytes: 1000,
                ..ok
            },
            Capacities {
                seg_map_slots: 16,
                ..ok
            },
        ] {
            assert!(Layout::new(bad).is_err(), "{bad:?}");
        }
    }

    /// Found by fuzzing the region header check (`fuzz/`, target `region_header`): a
    /// header (or a configuration) with huge capacities made the size computation
    /// overflow, a panic in debug builds and a wrapped, too small layout in release.
    #[test]
    fn capacities_too_large_for_64_bits_are_refused() {
        let ok = Capacities::default();
        for bad in [
            Capacities {
                goi_slots: 1 << 60,
                ..ok
            },
            Capacities {
                pbr_slots: 1 << 62,
                ..ok
            },
            Capacities {
                seg_map_slots: 1 << 63,
                ..ok
            },
            Capacities {
                segment_bytes: u64::MAX - 4095,
                ..ok
            },
            Capacities {
                pbr_slots: 1 << 50,
                max_topics: 4096,
                brokers: MAX_BROKERS,
                ..ok
            },
        ] {
            assert!(
                matches!(Layout::new(bad), Err(RegionError::BadCapacities(_))),
                "{bad:?}"
            );
        }
    }
}
