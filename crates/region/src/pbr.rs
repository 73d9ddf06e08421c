//! The pending batch rings: one ring of batch headers per (topic, broker), each slot
//! guarded by its commit token.

use crate::coherence::{flush_range, store_fence};
use crate::layout::*;
use crate::Region;
use embarcadero_wire::{batch::offsets as bo, BatchHeader};
use std::sync::atomic::{AtomicU64, Ordering};

impl Region {
    fn pbr_word(&self, topic: u32, broker: u32, index: u64, field: usize) -> &AtomicU64 {
        self.word(self.layout.pbr_slot_off(topic, broker, index) + field as u64)
    }

    /// Publishes a PBR slot: every field, then the commit token `index + 1` with
    /// `Release`. Only the broker connection that reserved `index` may call this.
    pub fn pbr_commit(&self, topic: u32, broker: u32, index: u64, h: &BatchHeader) {
        let bytes = h.encode();
        let base = self.layout.pbr_slot_off(topic, broker, index);
        self.invalidate(base + PBR_TOKEN);
        let previous = self.word(base + PBR_TOKEN).load(Ordering::Relaxed);
        assert!(
            previous <= index + 1,
            "PBR slot of ({topic}, {broker}) holds index {} and would go back to {index}",
            previous.wrapping_sub(1)
        );
        for field in (0..PBR_TOKEN as usize).step_by(WORD as usize) {
            let v = u64::from_le_bytes(bytes[field..field + WORD as usize].try_into().unwrap());
            self.word(base + field as u64).store(v, Ordering::Relaxed);
        }
        flush_range(self.word(base).as_ptr() as *const u8, PBR_SLOT_LEN as usize);
        store_fence();
        self.word(base + PBR_TOKEN)
            .store(index + 1, Ordering::Release);
        flush_range(
            self.word(base + PBR_TOKEN).as_ptr() as *const u8,
            WORD as usize,
        );
    }

    /// Reads the PBR slot for absolute `index` if its token says it holds that index.
    pub fn pbr_read(&self, topic: u32, broker: u32, index: u64) -> Option<BatchHeader> {
        let commit = self.pbr_word(topic, broker, index, bo::PUBLISH_COMMIT);
        if commit.load(Ordering::Acquire) != index + 1 {
            return None;
        }
        let mut bytes = [0u8; PBR_SLOT_LEN as usize];
        for field in (0..PBR_SLOT_LEN as usize).step_by(WORD as usize) {
            let v = self
                .pbr_word(topic, broker, index, field)
                .load(Ordering::Acquire);
            bytes[field..field + WORD as usize].copy_from_slice(&v.to_le_bytes());
        }
        let h = BatchHeader::decode(&bytes).expect("128 bytes");
        (h.publish_commit == index + 1 && commit.load(Ordering::Acquire) == index + 1).then_some(h)
    }

    /// True while slot `index` still holds that index (a reader's seqlock re-check).
    pub fn pbr_holds(&self, topic: u32, broker: u32, index: u64) -> bool {
        self.pbr_word(topic, broker, index, bo::PUBLISH_COMMIT)
            .load(Ordering::Acquire)
            == index + 1
    }

    /// Per-broker position of the slot's first message; written by the owning broker's
    /// frontier pass after the commit, read by readers below `written_frontier`.
    pub fn pbr_set_start_offset(&self, topic: u32, broker: u32, index: u64, v: u64) {
        self.pbr_word(topic, broker, index, bo::START_LOGICAL_OFFSET)
            .store(v, Ordering::Release);
    }

    /// Global position of the slot's first message; written by the sequencer.
    pub fn pbr_set_total_order(&self, topic: u32, broker: u32, index: u64, v: u64) {
        self.pbr_word(topic, broker, index, bo::TOTAL_ORDER)
            .store(v, Ordering::Release);
    }
}
