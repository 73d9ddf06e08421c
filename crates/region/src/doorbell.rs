//! A cross-process doorbell (an event count) on a futex word inside the region.
//!
//! Writers `ring()` after publishing work: one atomic increment, and a `futex_wake`
//! system call only when a waiter announced itself. A poller that found no work calls
//! `wait(seen, timeout)` with the count it read *before* looking for work, so a ring
//! that happened in between makes the wait return at once: no lost wake-ups. The
//! timeout bounds the sleep anyway, so a dead writer process cannot hang a reader.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Two words in the region: `count` (the futex word) and `waiters`.
pub struct Doorbell<'a> {
    pub(crate) count: &'a AtomicU32,
    pub(crate) waiters: &'a AtomicU32,
}

impl Doorbell<'_> {
    /// The current count; read it before checking for work.
    #[inline]
    pub fn seen(&self) -> u32 {
        self.count.load(Ordering::SeqCst)
    }

    /// Announces new work.
    #[inline]
    pub fn ring(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) != 0 {
            futex_wake(self.count);
        }
    }

    /// Sleeps until the count differs from `seen` or `timeout` passes.
    pub fn wait(&self, seen: u32, timeout: Duration) {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        if self.count.load(Ordering::SeqCst) == seen {
            futex_wait(self.count, seen, timeout);
        }
        let before = self.waiters.fetch_sub(1, Ordering::SeqCst);
        // Paired with the add above; a count that wrapped would make every ring pay
        // for a futex_wake, and one that reads 0 with a sleeper would lose its wake-up.
        assert!(before > 0, "doorbell waiter count went below zero");
    }
}

#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 (inside the region mapping, which outlives
    // this call); FUTEX_WAIT without the private flag works across processes sharing
    // the mapping. The kernel only reads the word and the timespec.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
    // A ring, the count having moved, the timeout or a signal; anything else (a bad
    // address or timeout) would turn every wait into a silent busy loop.
    let errno = std::io::Error::last_os_error().raw_os_error();
    assert!(
        rc == 0 || matches!(errno, Some(libc::EAGAIN | libc::ETIMEDOUT | libc::EINTR)),
        "futex wait failed: {}",
        std::io::Error::last_os_error()
    );
}

#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`; FUTEX_WAKE only uses the address as a key.
    let rc = unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
    // Fails only for a bad address: the sleepers would then wait out their timeout.
    assert!(
        rc >= 0,
        "futex wake failed: {}",
        std::io::Error::last_os_error()
    );
}

#[cfg(not(target_os = "linux"))]
fn futex_wait(_word: &AtomicU32, _expected: u32, timeout: Duration) {
    std::thread::sleep(timeout.min(Duration::from_micros(200)));
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_word: &AtomicU32) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn ring_wakes_a_waiter_before_its_timeout() {
        let words = Arc::new((AtomicU32::new(0), AtomicU32::new(0)));
        let w = words.clone();
        let waiter = std::thread::spawn(move || {
            let bell = Doorbell {
                count: &w.0,
                waiters: &w.1,
            };
            // The count starts at 0; whether the ring comes before or after this
            // thread first looks, it ends the loop without waiting for the timeout.
            let start = Instant::now();
            while bell.seen() == 0 {
                bell.wait(0, Duration::from_secs(30));
            }
            start.elapsed()
        });
        // Ring until the waiter has gone; a ring before it sleeps is not lost either.
        let bell = Doorbell {
            count: &words.0,
            waiters: &words.1,
        };
        bell.ring();
        let waited = waiter.join().unwrap();
        assert!(waited < Duration::from_secs(30));
    }

    #[test]
    fn wait_with_stale_count_returns_immediately() {
        let (c, w) = (AtomicU32::new(5), AtomicU32::new(0));
        let bell = Doorbell {
            count: &c,
            waiters: &w,
        };
        // `seen` is stale (4 != 5): the futex refuses to sleep.
        bell.wait(4, Duration::from_secs(30));
        assert_eq!(w.load(Ordering::SeqCst), 0);
    }
}
