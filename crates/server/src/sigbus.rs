//! The last word of a server whose region ran out of room after it started: a region
//! page its filesystem cannot hold kills the process with SIGBUS at the first write, which
//! no code can turn into an error. The start-up check (`room`) rules it out at start;
//! space others take later (a shared tmpfs filling up) can still do it under a sparse
//! region. Then, instead of dying without a word, the process says why and what to do,
//! and dies of the signal as before (its exit status still shows SIGBUS).
//!
//! Owns the process's SIGBUS disposition and one preformatted message.

use std::path::Path;
use std::sync::OnceLock;

/// The message the handler writes: formatted before any signal can arrive, because a
/// signal handler may not allocate.
static MESSAGE: OnceLock<Vec<u8>> = OnceLock::new();

/// Installs the handler for a region file at `region`. Once per process; later calls
/// keep the first message.
pub(crate) fn explain_on_sigbus(region: &Path) {
    let _ = MESSAGE.set(
        format!(
            "\nembarcadero: killed by SIGBUS: a page of the region file {} could not be \
             allocated, most likely because its filesystem is full. Free space there, move \
             region.path to a filesystem with room for the whole region, or set \
             region.prefault = true so that every page is allocated at start.\n",
            region.display()
        )
        .into_bytes(),
    );
    // SAFETY: `on_sigbus` only calls async-signal-safe functions (write, signal,
    // raise) and reads a OnceLock that is set before the handler is installed.
    unsafe {
        libc::signal(libc::SIGBUS, on_sigbus as *const () as libc::sighandler_t);
    }
}

extern "C" fn on_sigbus(signal: libc::c_int) {
    if let Some(message) = MESSAGE.get() {
        // SAFETY: write(2) on stderr with a pointer and length of a live, immutable
        // buffer; its result is ignored (nothing else can be done here).
        unsafe {
            libc::write(2, message.as_ptr().cast(), message.len());
        }
    }
    // SAFETY: restoring the default action and raising the signal again ends the
    // process the way SIGBUS would have, so callers see the same exit status.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}
