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
        // Readers take the index from the token, the sequencer from its cursor: the
        // header must say the same (the sequencer checks it where it reads).
        assert_eq!(
            h.pbr_index, index,
            "the header committed to PBR slot {index} of ({topic}, {broker}) names another"
        );
        let bytes = h.encode();
        let base = self.layout.pbr_slot_off(topic, broker, index);
        self.begin_rewrite(base + PBR_TOKEN, index, self.layout.caps.pbr_slots, || {
            format!("PBR slot of ({topic}, {broker})")
        });
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
        // The frontier pass and reclamation are the same thread: the slot is still there.
        assert!(
            self.pbr_holds(topic, broker, index),
            "start offset written to PBR slot {index} of ({topic}, {broker}), which no longer holds it"
        );
        self.pbr_word(topic, broker, index, bo::START_LOGICAL_OFFSET)
            .store(v, Ordering::Release);
    }

    /// Global position of the slot's first message; written by the sequencer.
    pub fn pbr_set_total_order(&self, topic: u32, broker: u32, index: u64, v: u64) {
        // Reclamation waits for `ordered_pbr`, which moves past the slot only after this.
        assert!(
            self.pbr_holds(topic, broker, index),
            "position written to PBR slot {index} of ({topic}, {broker}), which no longer holds it"
        );
        self.pbr_word(topic, broker, index, bo::TOTAL_ORDER)
            .store(v, Ordering::Release);
    }
}
