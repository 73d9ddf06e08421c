//! Reader slots: the pins by which live subscribers hold back reclamation, and the
//! scans over them (the slowest reader, the count per client address).

use crate::layout::*;
use crate::region::monotonic_ns;
use crate::word::ReadWord;
use crate::Region;
use std::sync::atomic::Ordering;

/// Heartbeat value of a reader slot whose positions are not written yet.
pub const READER_CLAIMING: u64 = 1;

/// What one pass of [`Region::release_reader_slots`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Slots it freed.
    pub freed: usize,
    /// Slots of the broker it left alone because they are still beaten (or were just
    /// being claimed): look again later.
    pub live: usize,
}

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

    /// One pass of freeing the reader slots `broker` held, for a broker declared dead:
    /// its subscribers (who reconnect elsewhere) stop holding memory within about
    /// `stale_after` instead of after the stall timeout.
    ///
    /// Being declared dead is not proof of being gone: a follower that missed its
    /// heartbeats under load, or was paused, rejoins and goes on serving. So a slot is
    /// freed only once its own heartbeat, which the serving thread stamps as its reader
    /// makes progress or waits, is older than `stale_after`. A slot still being claimed
    /// carries no time: it is freed when `claims_seen` (what the previous pass found
    /// being claimed for this broker; this pass writes what it finds) shows it was being
    /// claimed then too, a claim taking microseconds. Each slot is freed with a
    /// compare-and-swap of the heartbeat it showed, so a reader that beats meanwhile
    /// keeps it. Call again while [`Released::live`] is not 0.
    pub fn release_reader_slots(
        &self,
        broker: u32,
        stale_after: std::time::Duration,
        claims_seen: &mut Vec<(u32, u32)>,
    ) -> Released {
        // Owner words hold 1 + a broker of this region: another id matches no slot, so
        // its dead broker's pins would silently stay.
        assert!(broker < self.layout.caps.brokers, "broker {broker}");
        let now = monotonic_ns();
        let stale_after = stale_after.as_nanos() as u64;
        let mut done = Released::default();
        let mut claims = Vec::new();
        for topic in 0..self.layout.caps.max_topics {
            for slot in 0..self.reader_slots_high(topic) {
                if self.reader_owner(topic, slot).load(Ordering::Acquire) != broker as u64 + 1 {
                    continue;
                }
                let heartbeat = self.word(self.layout.reader_slot_off(topic, slot) + RS_HEARTBEAT);
                let seen = heartbeat.load(Ordering::Acquire);
                let due = match seen {
                    0 => continue,
                    READER_CLAIMING => {
                        claims.push((topic, slot));
                        claims_seen.contains(&(topic, slot))
                    }
                    beat => now.saturating_sub(beat) > stale_after,
                };
                if !due {
                    done.live += 1;
                } else if heartbeat
                    .compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    done.freed += 1;
                }
            }
        }
        *claims_seen = claims;
        done
    }

    /// Call after storing a reader slot's positions and heartbeat: waits until every
    /// reclamation pass over `topic`'s logs that may have read the pins before those
    /// stores has moved its reclaimed frontiers, so that what the reader then finds
    /// retained stays retained while it is pinned. Without this, a pass that read the
    /// pins just before the claim (and saw none) could reclaim the very batch the reader
    /// had just found in memory: a check-then-pin race.
    ///
    /// Why it is enough: a pass makes its word odd, then fences, then reads the pins; the
    /// caller stored its pin, then fences, then reads the word. Of the two fences one is
    /// first: either the pass reads the pin, or this reads the odd word and waits for the
    /// pass to end (its frontiers are stored before its word becomes even). A pass that
    /// does not end within `patience` (its broker died or is paused mid-pass) is not waited
    /// for; returns whether every pass ended. Readers re-check what they sent anyway, so a
    /// `false` costs at worst a refusal, never a wrong delivery.
    pub fn await_reclaim_passes(&self, topic: u32, patience: std::time::Duration) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        let deadline = std::time::Instant::now() + patience;
        let mut all_ended = true;
        for broker in 0..self.layout.caps.brokers {
            let pass = self.log(topic, broker).reclaim_pass;
            let seen = pass.load(Ordering::Acquire);
            if seen.is_multiple_of(2) {
                continue;
            }
            let mut spins = 0u32;
            while pass.load(Ordering::Acquire) == seen {
                if std::time::Instant::now() >= deadline {
                    all_ended = false;
                    break;
                }
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        all_ended
    }

    /// The lowest position any live reader of `topic` still needs at `index`, or
    /// `u64::MAX` when no reader holds anything. A slot being claimed counts as 0; a
    /// slot whose heartbeat is older than `stall` is ignored.
    pub fn reader_floor(&self, topic: u32, index: u32, stall: std::time::Duration) -> u64 {
        self.reader_floor_past(topic, index, stall, None)
    }

    /// [`Region::reader_floor`], not counting the readers (claimed, not being claimed)
    /// whose position is at or below `passed`: the reclaimer passes a floor that has
    /// held it back under pressure for a whole stall timeout, which fresh readers would
    /// otherwise renew for ever by attaching at the oldest position one after another.
    pub fn reader_floor_past(
        &self,
        topic: u32,
        index: u32,
        stall: std::time::Duration,
        passed: Option<u64>,
    ) -> u64 {
        let floor = self
            .slowest_reader_past(topic, index, stall, passed)
            .map_or(u64::MAX, |r| r.position);
        assert!(
            passed.is_none_or(|p| floor > p || floor == 0),
            "a floor past {passed:?} is above it (or a slot being claimed): {floor}"
        );
        floor
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
        self.slowest_reader_past(topic, index, stall, None)
    }

    /// [`Region::slowest_reader`] among the readers above `passed` (and those being
    /// claimed), see [`Region::reader_floor_past`].
    fn slowest_reader_past(
        &self,
        topic: u32,
        index: u32,
        stall: std::time::Duration,
        passed: Option<u64>,
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
            if hb != READER_CLAIMING && passed.is_some_and(|p| position <= p) {
                continue;
            }
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
