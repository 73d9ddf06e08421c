//! Futex doorbells on words of a channel: wait with a timeout, wake without writing.
//!
//! Owns: the two futex system calls. Touches: the word it is given only.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` holds `expected`, at most `timeout` (or until woken). The word is
/// shared between processes, so the futex is not private.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 in a mapping that outlives the call; the
    // kernel only reads it and the timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every thread sleeping on `word` (the word itself is not written, so any
/// thread may call this, also one that does not own the word).
pub fn wake(word: &AtomicU32) {
    // SAFETY: as in `wait`; FUTEX_WAKE uses the address as a key only.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
