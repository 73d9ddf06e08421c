//! Releasing the GIL around the client's waits, and what happens when the interpreter
//! exits while a thread is inside one.
//!
//! A thread that comes back for the GIL after the interpreter began to finalize (a
//! daemon thread inside `poll()` or `publish()` when the program ends) is ended by
//! CPython before 3.14 with `pthread_exit`: a forced unwind through PyO3's frames, which
//! aborts the whole process ("FATAL: exception not rethrown", exit status 134) instead
//! of letting it exit. CPython 3.14, and newer PyO3 releases, park such a thread for
//! good instead; this module does the same for this package on every version it
//! supports.
//!
//! The protocol, between an `atexit` hook (registered when the module loads, so it runs
//! after the user's own hooks and before CPython marks itself finalizing) and every
//! thread coming back from a released call:
//! - a returning thread first counts itself in `RETURNING`, then looks at `EXITING`: if
//!   it is set (and this is not the exiting thread), it counts itself out and parks for
//!   good; otherwise it takes the GIL back and only then counts itself out;
//! - the hook sets `EXITING`, then releases the GIL until `RETURNING` is zero (at most
//!   `DRAIN`): the threads that looked before it was set get the GIL back while the
//!   interpreter is still whole.
//!
//! Both sides use SeqCst, so of "count in, then look" and "set, then read the count" one
//! sees the other: no thread re-takes the GIL unseen once the hook has drained.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// Set by the `atexit` hook: the interpreter is exiting.
static EXITING: AtomicBool = AtomicBool::new(false);
/// The thread the interpreter exits on (it alone may still come back for the GIL).
static EXIT_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// Threads between the end of a released call and holding the GIL again.
static RETURNING: AtomicUsize = AtomicUsize::new(0);
/// Longest the hook waits for returning threads: a bound, should one never get the GIL.
const DRAIN: Duration = Duration::from_secs(1);

/// Runs `f` with the GIL released, as `Python::allow_threads` does; a thread that comes
/// back after the interpreter started to exit parks for good instead of re-taking the
/// GIL (see the module's opening comment).
pub(crate) fn released<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let out = py.allow_threads(|| {
        let out = f();
        count_in_or_park();
        out
    });
    RETURNING.fetch_sub(1, Ordering::SeqCst);
    out
}

/// Takes the GIL from a thread of the binding's own (a workflow worker's handler
/// thread), as `Python::with_gil` does, under the same protocol as [`released`].
pub(crate) fn attached<T>(f: impl FnOnce(Python<'_>) -> T) -> T {
    count_in_or_park();
    Python::with_gil(|py| {
        RETURNING.fetch_sub(1, Ordering::SeqCst);
        f(py)
    })
}

/// Counts the calling thread in as about to take the GIL, or parks it for good if the
/// interpreter is exiting on another thread.
fn count_in_or_park() {
    RETURNING.fetch_add(1, Ordering::SeqCst);
    if !EXITING.load(Ordering::SeqCst) {
        return;
    }
    if EXIT_THREAD.get() == Some(&std::thread::current().id()) {
        return;
    }
    RETURNING.fetch_sub(1, Ordering::SeqCst);
    loop {
        std::thread::park();
    }
}

/// The `atexit` hook: from now on returning threads park, and those already on their
/// way back get the GIL before the interpreter starts to come apart.
#[pyfunction]
fn _note_interpreter_exit(py: Python<'_>) {
    let _ = EXIT_THREAD.set(std::thread::current().id());
    EXITING.store(true, Ordering::SeqCst);
    py.allow_threads(|| {
        let deadline = Instant::now() + DRAIN;
        while RETURNING.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Registers the hook; called once, when the module loads.
pub(crate) fn register_exit_hook(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(_note_interpreter_exit, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}
