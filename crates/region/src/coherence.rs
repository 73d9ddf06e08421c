//! Flush and fence hooks for memory that is not cache coherent (a CXL pool shared by
//! hosts). On ordinary memory (the default) they compile to nothing but a compiler
//! fence: `Release`/`Acquire` atomics already order stores for other processes on the
//! same host. The call sites mark where a non-coherent build must write back lines:
//! after payload bytes, before a commit token, and after the token itself.

/// Writes back the cache lines covering `len` bytes at `ptr` (no-op on coherent memory).
#[inline(always)]
pub fn flush_range(ptr: *const u8, len: usize) {
    #[cfg(all(feature = "noncoherent", target_arch = "x86_64"))]
    {
        let mut p = (ptr as usize) & !63;
        let end = ptr as usize + len;
        while p < end {
            // SAFETY: clflush takes any address inside a mapping the caller can read;
            // callers pass ranges inside the live region mapping.
            unsafe { core::arch::x86_64::_mm_clflush(p as *const u8) };
            p += 64;
        }
    }
    #[cfg(not(all(feature = "noncoherent", target_arch = "x86_64")))]
    {
        let _ = (ptr, len);
    }
}

/// Orders earlier flushes and stores before later ones.
#[inline(always)]
pub fn store_fence() {
    #[cfg(all(feature = "noncoherent", target_arch = "x86_64"))]
    // SAFETY: sfence has no memory-safety preconditions.
    unsafe {
        core::arch::x86_64::_mm_sfence()
    };
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}
