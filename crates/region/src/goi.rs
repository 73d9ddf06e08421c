//! The global order index: one ring per topic of the sequencer's entries, each guarded
//! by its token.

use crate::coherence::{flush_range, store_fence};
use crate::layout::*;
use crate::slots::GoiEntry;
use crate::Region;
use std::sync::atomic::Ordering;

impl Region {
    /// Writes GOI entry `index` with its token (`index + 1`) last. Sequencer only.
    pub fn goi_write(&self, topic: u32, index: u64, e: &GoiEntry) {
        let base = self.layout.goi_entry_off(topic, index);
        self.begin_rewrite(base + G_TOKEN, index, self.layout.caps.goi_slots, || {
            format!("GOI slot of topic {topic}")
        });
        for (i, v) in e.to_words().iter().enumerate() {
            self.word(base + G_WORDS + WORD * i as u64)
                .store(*v, Ordering::Relaxed);
        }
        flush_range(
            self.word(base).as_ptr() as *const u8,
            GOI_ENTRY_LEN as usize,
        );
        store_fence();
        self.word(base + G_TOKEN)
            .store(index + 1, Ordering::Release);
        flush_range(
            self.word(base + G_TOKEN).as_ptr() as *const u8,
            WORD as usize,
        );
    }

    /// Reads GOI entry `index` if the slot holds it; re-check with [`Region::goi_holds`]
    /// after using data it points to.
    pub fn goi_read(&self, topic: u32, index: u64) -> Option<GoiEntry> {
        let base = self.layout.goi_entry_off(topic, index);
        if self.word(base + G_TOKEN).load(Ordering::Acquire) != index + 1 {
            return None;
        }
        let mut w = [0u64; G_WORD_COUNT];
        for (i, slot) in w.iter_mut().enumerate() {
            *slot = self
                .word(base + G_WORDS + WORD * i as u64)
                .load(Ordering::Acquire);
        }
        let e = GoiEntry::from_words(&w);
        (self.word(base + G_TOKEN).load(Ordering::Acquire) == index + 1).then_some(e)
    }

    pub fn goi_holds(&self, topic: u32, index: u64) -> bool {
        self.word(self.layout.goi_entry_off(topic, index) + G_TOKEN)
            .load(Ordering::Acquire)
            == index + 1
    }

    /// The GOI index currently stored in the slot `index` maps to, if any.
    pub fn goi_slot_occupant(&self, topic: u32, index: u64) -> Option<u64> {
        let token = self
            .word(self.layout.goi_entry_off(topic, index))
            .load(Ordering::Acquire);
        let occupant = token.checked_sub(1);
        // `goi_write` asserts the same where it stores the token.
        debug_assert!(
            occupant.is_none_or(|o| (o ^ index) & (self.layout.caps.goi_slots - 1) == 0),
            "GOI slot of index {index} of topic {topic} holds entry {occupant:?} of another slot"
        );
        occupant
    }
}
