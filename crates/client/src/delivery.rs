//! Delivery buffers: the memory a subscriber reads each delivery into, and
//! [`SharedBatch`], the handle by which [`crate::Subscriber::poll_shared`] lends one whole.
//!
//! Owns the bytes of each delivery and the rules for touching them. The bytes sit in
//! `UnsafeCell`s because a holder of a lent batch may hand them to a runtime that can
//! write them (a Node `Buffer`: JavaScript has no read-only byte arrays), and Rust allows
//! writes to memory others can reach only inside an `UnsafeCell`. The subscriber writes a
//! buffer only while it holds the sole reference (`Arc::get_mut`), and reads it only
//! until `poll_shared` returns; see [`SharedBatch::as_mut_ptr`] for a lender's side.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::Arc;

/// The bytes of one delivery (message headers and payloads, as the broker sent them).
#[derive(Default)]
pub(crate) struct DeliveryBuf(Vec<UnsafeCell<u8>>);

// SAFETY: shared access to a `DeliveryBuf` reads its bytes (`SharedBatch::bytes`,
// `DeliveryBuf::bytes`) or hands out a raw pointer (`SharedBatch::as_mut_ptr`), and whoever
// writes through that pointer owes the absence of concurrent readers and writers (its
// contract). Mutation through `&mut` (`fill`) is exclusive by construction. So sharing it
// between threads adds no data race beyond what that contract already excludes.
unsafe impl Sync for DeliveryBuf {}

impl DeliveryBuf {
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// The buffer resized to `len` bytes, to read a delivery into. Exclusive access
    /// (`Arc::get_mut` on a buffer nobody else holds) is what makes writing it sound.
    pub(crate) fn fill(&mut self, len: usize) -> &mut [u8] {
        if len > self.0.capacity() {
            // A new allocation rather than a resize: nothing old to copy, and fresh pages
            // come zeroed from the kernel, which `resize` would zero again by hand (a
            // profile of the Node subscriber showed that memset beside the page faults).
            self.0 = zeroed_cells(len);
        } else {
            self.0.resize_with(len, || UnsafeCell::new(0));
        }
        // SAFETY: `UnsafeCell<u8>` has the layout of `u8`; the `len` cells are initialised
        // and `&mut self` excludes every other reference for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), len) }
    }

    /// The bytes, to read. Nothing writes them while the slice lives: the subscriber
    /// writes only with `&mut` (`fill`), and a lender through `SharedBatch::as_mut_ptr`
    /// only while nobody reads (that function's contract).
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: layout as in `fill`; no write overlaps the slice's lifetime (above).
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len()) }
    }
}

/// `len` zeroed cells from `alloc_zeroed` (`vec![0u8; len]`), which skips writing memory
/// the allocator knows is zero already.
fn zeroed_cells(len: usize) -> Vec<UnsafeCell<u8>> {
    let mut bytes = std::mem::ManuallyDrop::new(vec![0u8; len]);
    let (ptr, len, capacity) = (bytes.as_mut_ptr(), bytes.len(), bytes.capacity());
    // SAFETY: `UnsafeCell<u8>` has the size and alignment of `u8`, so the allocation's
    // layout is unchanged; its ownership moves from `bytes` (never dropped) to the new Vec.
    unsafe { Vec::from_raw_parts(ptr.cast::<UnsafeCell<u8>>(), len, capacity) }
}

/// A confirmed delivery's bytes, lent whole by [`crate::Subscriber::poll_shared`]: the
/// subscriber reads nothing new into them while any clone is alive, so a message's
/// payload can be kept (or viewed, without a copy) for as long as its batch is.
#[derive(Clone)]
pub struct SharedBatch(pub(crate) Arc<DeliveryBuf>);

impl std::fmt::Debug for SharedBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBatch({} bytes)", self.len())
    }
}

impl SharedBatch {
    /// The delivery as the broker sent it: message headers and payloads.
    pub fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    /// Its length in bytes (without reading them).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte, as a pointer through which the bytes may be written: for lending
    /// them to a runtime that cannot be kept from writing them (a Node `Buffer`).
    ///
    /// Writing through it (or any pointer derived from it) is sound only: within
    /// [`Self::len`] bytes; after the `poll_shared` call that lent the batch has returned
    /// (the subscriber reads its headers until then); while no slice from [`Self::bytes`]
    /// of this batch or any clone of it is in use; and not racing another access to the
    /// same bytes. The subscriber reuses the buffer only once every clone is dropped, so
    /// a writer that holds a clone for as long as it writes never races the subscriber.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        // `raw_get` goes from the cells to their contents without a shared reference to
        // the bytes, so the pointer keeps the cells' permission to write.
        UnsafeCell::raw_get(self.0 .0.as_ptr())
    }

    /// Where `payload` (a message of this batch, as handed to the `poll_shared` callback)
    /// lies in [`Self::bytes`].
    pub fn range_of(&self, payload: &[u8]) -> Range<usize> {
        let base = self.0 .0.as_ptr() as usize;
        let start = (payload.as_ptr() as usize).wrapping_sub(base);
        assert!(
            start <= self.len() && payload.len() <= self.len() - start,
            "the payload is not one of this batch's"
        );
        start..start + payload.len()
    }
}

impl AsRef<[u8]> for SharedBatch {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch_of(bytes: &[u8]) -> SharedBatch {
        let mut buf = DeliveryBuf::default();
        buf.fill(bytes.len()).copy_from_slice(bytes);
        SharedBatch(Arc::new(buf))
    }

    #[test]
    fn a_payload_is_found_in_its_batch_and_only_there() {
        let batch = batch_of(&(0u8..100).collect::<Vec<_>>());
        assert_eq!(batch.range_of(&batch.bytes()[10..30]), 10..30);
        assert_eq!(batch.range_of(&batch.bytes()[100..]), 100..100);
        let other = [1u8; 4];
        // The bytes are not read by `range_of`: no state a panic could leave half-written.
        let outside =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| batch.range_of(&other)));
        assert!(outside.is_err(), "a payload of another buffer is refused");
    }

    /// What a Node `Buffer` over a lent batch does: writes through `as_mut_ptr` from
    /// another thread while the lender's clone (the subscriber's) is alive and unread;
    /// afterwards readers see exactly those bytes changed.
    #[test]
    fn writes_through_the_lent_pointer_change_only_those_bytes_and_are_seen_after() {
        let lender = batch_of(&[5u8; 64]);
        let lent = lender.clone();
        let writer = std::thread::spawn(move || {
            let p = lent.as_mut_ptr();
            // SAFETY: within the 64 bytes; nobody reads this batch until the join below
            // (the other clone is only held), and the join orders this write before it.
            unsafe { std::ptr::write_bytes(p.add(8), 0xee, 16) };
            drop(lent);
        });
        writer.join().expect("writer thread");
        let bytes = lender.bytes();
        assert!(bytes[..8].iter().all(|&b| b == 5));
        assert!(bytes[8..24].iter().all(|&b| b == 0xee));
        assert!(bytes[24..].iter().all(|&b| b == 5));
        assert_eq!(
            Arc::strong_count(&lender.0),
            1,
            "the writer's clone is gone"
        );
    }

    #[test]
    fn fill_resizes_and_keeps_the_layout_of_bytes() {
        let mut buf = DeliveryBuf::default();
        buf.fill(10).copy_from_slice(&[3u8; 10]);
        assert_eq!(buf.bytes(), &[3u8; 10]);
        buf.fill(4).copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(buf.bytes(), &[1, 2, 3, 4]);
        assert_eq!(buf.len(), 4);
        // Growing within the capacity zeroes the new part; past it, a new zeroed buffer.
        assert_eq!(buf.fill(8), &[1, 2, 3, 4, 0, 0, 0, 0]);
        assert_eq!(buf.fill(1 << 20).iter().filter(|&&b| b != 0).count(), 0);
        assert_eq!(buf.len(), 1 << 20);
    }
}
