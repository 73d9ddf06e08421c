//! The broker logs' bytes: the segment map from logical to physical segments, and the
//! bounds-checked byte accessors over the segments.

use crate::layout::*;
use crate::Region;
use std::sync::atomic::Ordering;

impl Region {
    /// Records that logical segment `logical` of the (topic, broker) log lives in
    /// physical segment `physical` of that broker's pool. Owning broker only.
    pub fn seg_map_publish(&self, topic: u32, broker: u32, logical: u64, physical: u32) {
        assert!(physical < self.layout.caps.segments_per_broker);
        let off = self.layout.seg_map_off(topic, broker, logical);
        // A restarted broker may map again a segment its predecessor mapped for a
        // reservation it never committed; never one older than the slot holds.
        self.begin_rewrite(
            off + SM_TOKEN,
            logical,
            self.layout.caps.seg_map_slots,
            || format!("segment map slot of ({topic}, {broker})"),
        );
        self.word(off + SM_PHYSICAL)
            .store(physical as u64, Ordering::Relaxed);
        self.word(off + SM_TOKEN)
            .store(logical + 1, Ordering::Release);
    }

    /// The physical segment holding logical segment `logical`, if mapped.
    pub fn seg_map_lookup(&self, topic: u32, broker: u32, logical: u64) -> Option<u32> {
        let off = self.layout.seg_map_off(topic, broker, logical);
        if self.word(off + SM_TOKEN).load(Ordering::Acquire) != logical + 1 {
            return None;
        }
        let physical = self.word(off + SM_PHYSICAL).load(Ordering::Acquire);
        if self.word(off + SM_TOKEN).load(Ordering::Acquire) != logical + 1 {
            return None;
        }
        (physical < self.layout.caps.segments_per_broker as u64).then_some(physical as u32)
    }

    /// Address of `len` log bytes at logical offset `at` of a (topic, broker) log, if
    /// the segment is mapped and the range lies inside it. The memory may be reclaimed
    /// and overwritten concurrently: use the pointer only for copies whose result is
    /// re-validated against [`LogControl::reclaimed_blog`], or for ranges the caller
    /// owns (see [`Region::blog_bytes_mut`]).
    pub fn blog_ptr(&self, topic: u32, broker: u32, at: u64, len: u64) -> Option<*mut u8> {
        let seg = self.layout.caps.segment_bytes;
        let logical = at / seg;
        let within = at % seg;
        if within.checked_add(len)? > seg {
            return None;
        }
        let physical = self.seg_map_lookup(topic, broker, logical)?;
        let off = self.layout.segment_off(broker, physical) + within;
        debug_assert!(off + len <= self.len);
        // SAFETY: `off + len` lies within the segment area of the mapping (checked via
        // the capacities above), so the pointer stays inside the mapping.
        Some(unsafe { self.ptr.add(off as usize) })
    }

    /// Mutable access to a log range the caller has reserved and not yet committed.
    ///
    /// # Safety
    /// The caller must own `[at, at + len)` of the (topic, broker) log: reserved by
    /// this broker process, not committed, not reclaimable. No other Rust code reads
    /// or writes that range until the caller commits the PBR slot that covers it.
    // Exclusivity comes from the reservation protocol, not from `&mut self`: many
    // connections write disjoint ranges of one region at once.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn blog_bytes_mut(
        &self,
        topic: u32,
        broker: u32,
        at: u64,
        len: u64,
    ) -> Option<&mut [u8]> {
        let p = self.blog_ptr(topic, broker, at, len)?;
        // SAFETY: in bounds (blog_ptr) and exclusively owned per the caller's contract.
        Some(unsafe { std::slice::from_raw_parts_mut(p, len as usize) })
    }

    /// Shared access to a committed log range that cannot be reclaimed while borrowed.
    ///
    /// # Safety
    /// The caller must hold back reclamation of `[at, at + len)` for the lifetime of
    /// the slice (the owning broker's own reads before it may reclaim).
    pub unsafe fn blog_bytes(&self, topic: u32, broker: u32, at: u64, len: u64) -> Option<&[u8]> {
        let p = self.blog_ptr(topic, broker, at, len)?;
        // SAFETY: in bounds (blog_ptr); no writer per the caller's contract.
        Some(unsafe { std::slice::from_raw_parts(p, len as usize) })
    }
}
