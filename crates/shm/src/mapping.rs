//! A channel's memory: one `MAP_SHARED` mapping of a memfd, shared by the client and
//! its broker, and the words in it. A mapping is writable, or read-only (a subscriber's
//! view of its feed, a broker's of the subscriber's cursor page): the kernel faults any
//! store into a read-only one, so code that would store there asserts first.
//!
//! Owns: the mapping (unmapped on drop). Touches: nothing outside it.

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use std::io;
use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// A shared mapping of a whole memfd, writable or read-only.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is plain memory shared by design; every access goes through
// atomics or through copies whose result is validated before use (see `ring`).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared and writable. The caller has checked (or, for
    /// the client, made sure) that the file is at least `len` bytes and cannot shrink:
    /// a page past the end of the file would raise SIGBUS on access.
    pub fn map(fd: impl AsFd, len: usize) -> io::Result<Self> {
        Self::map_with(fd, len, true)
    }

    /// Maps `len` bytes of `fd` shared and read-only (the same conditions as [`Self::map`]).
    pub fn map_read_only(fd: impl AsFd, len: usize) -> io::Result<Self> {
        Self::map_with(fd, len, false)
    }

    fn map_with(fd: impl AsFd, len: usize, writable: bool) -> io::Result<Self> {
        let size = NonZeroUsize::new(len).ok_or(io::ErrorKind::InvalidInput)?;
        let prot = if writable {
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE
        } else {
            ProtFlags::PROT_READ
        };
        // SAFETY: a fresh mapping chosen by the kernel overlaps nothing of ours.
        let ptr = unsafe { mmap(None, size, prot, MapFlags::MAP_SHARED, fd, 0) }
            .map_err(io::Error::from)?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
            writable,
        })
    }

    /// Whether this process may store into the mapping.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The 64-bit word at `offset`.
    pub fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.len,
            "word inside the mapping"
        );
        // SAFETY: in bounds and aligned (asserted; the mapping is page aligned); the
        // word lives as long as `self`; another process may write it at any time, which
        // an atomic allows.
        unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU64) }
    }

    /// The 32-bit word at `offset`.
    pub fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "word inside the mapping"
        );
        // SAFETY: as in `u64_at`.
        unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU32) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` with this length and nothing borrows
        // it any more (every borrow is tied to `&self`).
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}
