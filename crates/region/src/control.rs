//! The header's flags and the control block: the doorbells, the sequencer lease words,
//! the fencing epoch and the owner records of the sequencer and of each broker.

use crate::coherence::flush_range;
use crate::layout::*;
use crate::region::boot_id;
use crate::word::ReadWord;
use crate::Region;
use crate::{Doorbell, OwnerRecord};
use std::sync::atomic::Ordering;

impl Region {
    /// Rung by brokers when they commit a PBR slot; the sequencer sleeps on it.
    pub fn sequencer_bell(&self) -> Doorbell<'_> {
        self.bell_at(self.layout.control_off + C_SEQUENCER_BELL)
    }

    /// Rung when anything a broker's ack/service thread waits for moves.
    pub fn broker_bell(&self, broker: u32) -> Doorbell<'_> {
        assert!(broker < self.layout.caps.brokers);
        self.bell_at(self.layout.control_off + C_BROKER_BELLS + broker as u64 * BELL_LINE_LEN)
    }

    /// Rung when a topic with disk replicas gets newly ordered batches, and when a
    /// replica's progress moves (the chain's next replica waits for it).
    pub fn replication_bell(&self) -> Doorbell<'_> {
        self.bell_at(self.layout.control_off + C_REPLICATION_BELL)
    }

    /// True when the region was created since the machine last booted. Only then can
    /// its contents be trusted after a crash: a process crash leaves every store in the
    /// page cache, a machine crash leaves whatever part happened to reach the disk.
    pub fn created_this_boot(&self) -> bool {
        let boot = boot_id();
        boot != [0, 0]
            && self.word(H_BOOT_ID).load(Ordering::Acquire) == boot[0]
            && self.word(H_BOOT_ID + WORD).load(Ordering::Acquire) == boot[1]
    }

    /// Marks the region as replaced. A head that restarts builds a fresh region from what
    /// this one holds; processes still attached to this one (followers, sequencers) must
    /// stop acknowledging anything read from it, because what they read afterwards may be
    /// missing from the fresh region. Call before reading the region for recovery: the
    /// full fence pairs with the one in [`Region::is_retired`], so a process that still
    /// saw the region live read nothing the recovery misses.
    pub fn retire(&self) {
        self.word(H_RETIRED).store(1, Ordering::SeqCst);
        flush_range(self.word(H_RETIRED).as_ptr() as *const u8, 8);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// True once a restarted head replaced this region (see [`Region::retire`]). Call
    /// after reading what an acknowledgement or a delivery reports and before sending
    /// it: the fence orders those reads before this load.
    pub fn is_retired(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.word(H_RETIRED).load(Ordering::SeqCst) != 0
    }

    pub fn fencing_epoch(&self) -> ReadWord<'_> {
        self.read_word(self.layout.control_off + C_FENCING_EPOCH)
    }

    pub fn sequencer_id(&self) -> ReadWord<'_> {
        self.read_word(self.layout.control_off + C_SEQUENCER_ID)
    }

    pub fn lease_deadline_ns(&self) -> ReadWord<'_> {
        self.read_word(self.layout.control_off + C_LEASE_DEADLINE_NS)
    }

    /// The process holding the sequencer lease (written by each new holder).
    pub fn sequencer_owner(&self) -> OwnerRecord<'_> {
        self.owner_at(self.layout.control_off + C_SEQUENCER_OWNER)
    }

    /// The process serving `broker`'s logs (written by each broker at start).
    pub fn broker_owner(&self, broker: u32) -> OwnerRecord<'_> {
        assert!(broker < self.layout.caps.brokers);
        self.owner_at(self.layout.control_off + C_BROKER_OWNERS + OWNER_RECORD_LEN * broker as u64)
    }

    fn owner_at(&self, off: u64) -> OwnerRecord<'_> {
        OwnerRecord {
            incarnation: self.word(off + OWNER_INCARNATION),
            boot: self.word(off + OWNER_BOOT),
            pid: self.word(off + OWNER_PID),
            start_ticks: self.word(off + OWNER_START_TICKS),
        }
    }
}
