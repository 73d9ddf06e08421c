//! The native half of the `embarcadero` npm package: a thin napi-rs binding of
//! `embarcadero-client` (crates/client). It owns only what crossing into Node needs:
//! running every call that may wait on the network off the JavaScript thread (on the
//! blocking pool of napi's tokio runtime, answering with a Promise), staging published
//! messages so `publish` never waits on the event loop, packing delivered messages
//! into a few typed arrays, and turning client errors into JavaScript errors the
//! TypeScript layer (`ts/`) rebuilds as typed classes. The protocol, batching, acks,
//! sessions and failover are the Rust client's, unchanged. The workflow `Worker` runs
//! TypeScript step handlers under the engine's own Rust worker loop (`workflow`).

// napi-derive registers the exported functions only outside `cfg(test)`, so a test build
// (clippy --all-targets) would see them as unused.
#![cfg_attr(test, allow(dead_code))]

mod admin;
mod error;
mod publisher;
mod subscriber;
mod tasks;
mod workflow;

use embarcadero_client::Error;
use napi::threadsafe_function::ThreadsafeFunction;

/// A function on the event loop's thread that JavaScript gives a native object once, for
/// its threads to end a wait with (`ThreadsafeFunctionCallMode::NonBlocking`): weak, so an
/// object nobody waits on does not keep the process alive (a waiting caller's timer does;
/// `ts/wake.ts`). The type is spelled out where napi reads it: its type generator does
/// not follow aliases.
pub(crate) type Waker = ThreadsafeFunction<(), (), (), napi::Status, false, true>;

/// Runs `f` on the blocking pool of napi's tokio runtime and waits for it there, so
/// the JavaScript thread only ever awaits a Promise.
pub(crate) async fn blocking<T, F>(f: F) -> napi::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, Error> + Send + 'static,
{
    blocking_as(f, error::to_js).await
}

/// [`blocking`] for a call whose error is not the client's: `to_js` makes it the
/// JavaScript error (the workflow API client's `ApiError`, say).
pub(crate) async fn blocking_as<T, E, F>(f: F, to_js: fn(E) -> napi::Error) -> napi::Result<T>
where
    T: Send + 'static,
    E: Send + 'static,
    F: FnOnce() -> Result<T, E> + Send + 'static,
{
    napi::bindgen_prelude::spawn_blocking(f)
        .await
        .map_err(|e| error::to_js(Error::Config(format!("the worker thread failed: {e}"))))?
        .map_err(to_js)
}

/// A transport as JavaScript names it (`"auto"`, `"tcp"` or `"shm"`; none: auto, the Rust
/// client's default).
pub(crate) fn transport(name: Option<String>) -> napi::Result<embarcadero_client::Transport> {
    name.map_or(Ok(embarcadero_client::Transport::Auto), |t| {
        t.parse().map_err(error::config)
    })
}

/// Milliseconds from JavaScript (a number) as a duration; negative or NaN is zero.
pub(crate) fn millis(ms: f64) -> std::time::Duration {
    // At most a century: a longer one is no limit in practice, and an `Instant` plus it
    // stays in range (a huge `timeoutMs` panicked here, which aborts Node).
    const LONGEST: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);
    if !(ms.is_finite() && ms > 0.0) {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::try_from_secs_f64(ms / 1e3).map_or(LONGEST, |d| d.min(LONGEST))
}
