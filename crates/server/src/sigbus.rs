//! The last word of a server killed by SIGBUS on its region: a region page that cannot be
//! backed kills the process at the first access, which no code can turn into an error.
//! Running out of room cannot cause it any more (`room` checks at start, `reserve`
//! allocates every range before it is written), so what is left is the region file being
//! truncated or replaced by another program, or its filesystem failing. Instead of dying
//! without a word, the process says so and what to do, and dies of the signal as before
//! (its exit status still shows SIGBUS).
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
             accessed. Every range of it is allocated before it is written, so another \
             program most likely truncated or replaced the file, or its filesystem failed. \
             Keep other programs away from region.path and start the server again: it \
             builds a fresh region from its disk replicas.\n",
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
