//! Reader slots: the pins by which live subscribers hold back reclamation, and the
//! scans over them (the slowest reader, the count per client address).

use crate::layout::*;
use crate::region::monotonic_ns;
use crate::word::ReadWord;
use crate::Region;
use std::sync::atomic::Ordering;

/// Heartbeat value of a reader slot whose positions are not written yet.
pub const READER_CLAIMING: u64 = 1;

/// A live reader that holds memory back ([`Region::slowest_reader`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlowestReader {
    /// Its reader slot in the topic.
    pub slot: u32,
    /// The position it still needs (0 while the slot is being claimed).
    pub position: u64,
    /// The broker serving it, when recorded.
    pub broker: Option<u32>,
    /// How long ago its broker last beat for it.
    pub heartbeat_age_ns: u64,
}

impl Region {
    /// Heartbeat of a topic's reader slot: 0 when free, [`READER_CLAIMING`] while its
    /// positions are being written, otherwise the owner's last [`monotonic_ns`].
    /// One above the highest reader slot of `topic` ever claimed: every slot at or above
    /// it is free, so scans stop there.
    pub fn reader_slots_high(&self, topic: u32) -> u32 {
        let high = self
            .word(self.layout.readers_line_off(topic))
            .load(Ordering::Acquire);
        assert!(
            high <= READER_SLOTS as u64,
            "readers line out of range: {high}"
        );
        high as u32
    }

    pub fn reader_heartbeat(&self, topic: u32, slot: u32) -> ReadWord<'_> {
        self.read_word(self.layout.reader_slot_off(topic, slot) + RS_HEARTBEAT)
    }

    /// The position a reader still needs: index 0 for orders 2 and 5 (a global
    /// position), index `broker` for orders 0 and 1 (a position in that broker's log).
    /// Written only by the slot's owner.
    pub fn reader_position(&self, topic: u32, slot: u32, index: u32) -> ReadWord<'_> {
        assert!(index < MAX_BROKERS);
        self.read_word(
            self.layout.reader_slot_off(topic, slot) + RS_POSITIONS + WORD * index as u64,
        )
    }

    /// 1 + the broker serving a reader slot (0: none recorded). Written by that broker
    /// when it claims the slot, before the slot's positions.
    pub fn reader_owner(&self, topic: u32, slot: u32) -> ReadWord<'_> {
        self.read_word(self.layout.reader_slot_off(topic, slot) + READER_OWNER_REL)
    }

    /// A hash of the client address of the reader in `slot` (0: not recorded). Written
    /// by the claiming broker before the slot's heartbeat leaves [`READER_CLAIMING`].
    pub fn reader_address(&self, topic: u32, slot: u32) -> ReadWord<'_> {
        self.read_word(self.layout.reader_slot_off(topic, slot) + READER_ADDRESS_REL)
    }

    /// How many slots of `topic` are held (claimed or live) by readers from the client
    /// address with hash `address`; stale ones (older than `stall`) are not counted.
    pub fn readers_from(&self, topic: u32, address: u64, stall: std::time::Duration) -> u32 {
        assert_ne!(address, 0, "0 means an address that was not recorded");
        let now = monotonic_ns();
        (0..self.reader_slots_high(topic))
            .filter(|&slot| {
                let hb = self.reader_heartbeat(topic, slot).load(Ordering::Acquire);
                let live = hb == READER_CLAIMING
                    || (hb != 0 && now.saturating_sub(hb) <= stall.as_nanos() as u64);
                live && self.reader_address(topic, slot).load(Ordering::Acquire) == address
            })
            .count() as u32
    }

    /// Frees every reader slot `broker` holds, so that its subscribers (who reconnect
    /// elsewhere) stop holding memory at once instead of after the stall timeout. Only
    /// for a broker that serves no more (declared dead or replaced); a slot is freed with
    /// a compare-and-swap of the heartbeat it showed, so a reader still beating keeps it
    /// and finds out from its next beat. Returns how many it freed.
    pub fn release_reader_slots(&self, broker: u32) -> usize {
        // Owner words hold 1 + a broker of this region: another id matches no slot, so
        // its dead broker's pins would silently stay.
        assert!(broker < self.layout.caps.brokers, "broker {broker}");
        let mut freed = 0;
        for topic in 0..self.layout.caps.max_topics {
            for slot in 0..self.reader_slots_high(topic) {
                if self.reader_owner(topic, slot).load(Ordering::Acquire) != broker as u64 + 1 {
                    continue;
                }
                let heartbeat = self.word(self.layout.reader_slot_off(topic, slot) + RS_HEARTBEAT);
                let seen = heartbeat.load(Ordering::Acquire);
                if seen != 0
                    && heartbeat
                        .compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    freed += 1;
                }
            }
        }
        freed
    }

    /// The lowest position any live reader of `topic` still needs at `index`, or
    /// `u64::MAX` when no reader holds anything. A slot being claimed counts as 0; a
    /// slot whose heartbeat is older than `stall` is ignored.
    pub fn reader_floor(&self, topic: u32, index: u32, stall: std::time::Duration) -> u64 {
        self.slowest_reader(topic, index, stall)
            .map_or(u64::MAX, |r| r.position)
    }

    /// The live reader of `topic` that holds back the most at `index` (the one
    /// [`Region::reader_floor`] is the position of), for reclamation and for telling
    /// people who holds memory back. A slot being claimed is the slowest possible.
    pub fn slowest_reader(
        &self,
        topic: u32,
        index: u32,
        stall: std::time::Duration,
    ) -> Option<SlowestReader> {
        let now = monotonic_ns();
        let mut slowest: Option<SlowestReader> = None;
        for slot in 0..self.reader_slots_high(topic) {
            let hb = self.reader_heartbeat(topic, slot).load(Ordering::Acquire);
            if hb == 0
                || (hb != READER_CLAIMING && now.saturating_sub(hb) > stall.as_nanos() as u64)
            {
                continue;
            }
            let position = if hb == READER_CLAIMING {
                0
            } else {
                self.reader_position(topic, slot, index)
                    .load(Ordering::Acquire)
            };
            if slowest.as_ref().is_some_and(|s| s.position <= position) {
                continue;
            }
            let owner = self.reader_owner(topic, slot).load(Ordering::Acquire);
            slowest = Some(SlowestReader {
                slot,
                position,
                broker: owner.checked_sub(1).map(|b| b as u32),
                heartbeat_age_ns: if hb == READER_CLAIMING {
                    0
                } else {
                    now.saturating_sub(hb)
                },
            });
            if position == 0 {
                break;
            }
        }
        slowest
    }
}
