//! Rust step handlers: the [`StepHandler`] trait, what a handler is given
//! ([`StepContext`], with [`BatchInput`] for a batch worker) and returns ([`StepError`]
//! on failure), and the [`Registry`] a worker runs and a template's `handler.callable`
//! names are checked against.

use crate::event::Checkpoint;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything a handler sees of its task.
#[derive(Debug, Clone)]
pub struct StepContext {
    pub task_uuid: String,
    pub step_name: String,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// The task's input.
    pub context: Value,
    /// The step's `handler.initialization` (null when absent).
    pub initialization: Value,
    /// The results of the step's ancestors (direct and indirect), by step name.
    pub ancestors: Map<String, Value>,
    /// The step's direct dependencies that exist, in the template's order (for a
    /// convergence after a batch: the worker instances).
    pub dependencies: Vec<String>,
    /// For an instance of a batch worker step: its cursor and the checkpoint to resume from.
    pub batch: Option<BatchInput>,
    /// When the worker reports this attempt timed out (the step's `timeout_seconds` from
    /// when the attempt started). The handler's thread cannot be stopped from outside: a
    /// handler that may run long checks [`Self::past_deadline`] and returns, for its
    /// outcome is dropped from then on.
    pub deadline: Instant,
    /// Set by the worker when the attempt's outcome is no longer wanted before its
    /// deadline: its task was cancelled or resolved by hand, or the attempt was taken
    /// back. See [`Self::should_stop`].
    pub cancellation: Cancellation,
}

/// Whether an attempt was called off, set once by the worker loop
/// ([`Cancellation::cancel`]) and read by its handler: by a look
/// ([`Cancellation::is_cancelled`]), a wait that ends early ([`Cancellation::sleep`]), or
/// a callback ([`Cancellation::on_cancel`], how the SDKs abort a JavaScript
/// `AbortSignal`). Shared by the clones of one attempt's context.
#[derive(Clone, Default)]
pub struct Cancellation(Arc<CancelShared>);

#[derive(Default)]
struct CancelShared {
    /// True once cancelled; never goes back (read without the lock by `is_cancelled`).
    cancelled: AtomicBool,
    /// Callbacks not run yet; taken (under the lock) by the one `cancel` that set the flag.
    callbacks: parking_lot::Mutex<Vec<Box<dyn FnOnce() + Send>>>,
    /// Notified (under `callbacks`' lock) by `cancel`, for `sleep`.
    woken: parking_lot::Condvar,
}

impl Cancellation {
    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(Ordering::SeqCst)
    }

    /// Calls the attempt off: runs every registered callback once, on this thread (so
    /// they must be quick), and ends every [`Self::sleep`]. Later calls do nothing.
    pub fn cancel(&self) {
        // The flag is set before the lock is taken, and callbacks are added under the
        // lock only after a look at the flag: each callback runs exactly once, here or
        // in `on_cancel`.
        if self.0.cancelled.swap(true, Ordering::SeqCst) {
            return;
        }
        let callbacks = std::mem::take(&mut *self.0.callbacks.lock());
        self.0.woken.notify_all();
        for f in callbacks {
            f();
        }
    }

    /// Runs `f` once the attempt is cancelled: now if it is already, else on the thread
    /// that cancels it.
    pub fn on_cancel(&self, f: impl FnOnce() + Send + 'static) {
        let mut callbacks = self.0.callbacks.lock();
        if self.is_cancelled() {
            drop(callbacks);
            f();
            return;
        }
        callbacks.push(Box::new(f));
    }

    /// Sleeps `d`, or less if the attempt is cancelled meanwhile; whether it was.
    pub fn sleep(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        let mut callbacks = self.0.callbacks.lock();
        while !self.is_cancelled() {
            if self.0.woken.wait_until(&mut callbacks, until).timed_out() {
                break;
            }
        }
        self.is_cancelled()
    }
}

impl fmt::Debug for Cancellation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cancellation({})", self.is_cancelled())
    }
}

/// What a batch worker instance is given.
#[derive(Debug, Clone)]
pub struct BatchInput {
    /// The cursor the batchable step gave this instance.
    pub cursor: Value,
    /// 1-based, of `count`.
    pub index: u32,
    pub count: u32,
    /// The last checkpoint an earlier attempt of this instance saved.
    pub resume: Option<Checkpoint>,
    /// Saves a checkpoint (an event in the log, applied only while this attempt holds
    /// the step), for the next attempt to resume from.
    pub checkpoints: CheckpointSink,
}

/// Where a handler's checkpoints go (the worker publishes them); a no-op in unit tests.
#[derive(Clone, Default)]
pub struct CheckpointSink(Option<std::sync::Arc<dyn Fn(Checkpoint) + Send + Sync>>);

impl CheckpointSink {
    pub fn new(f: impl Fn(Checkpoint) + Send + Sync + 'static) -> Self {
        Self(Some(std::sync::Arc::new(f)))
    }

    pub fn save(&self, checkpoint: Checkpoint) {
        if let Some(f) = &self.0 {
            f(checkpoint)
        }
    }
}

impl fmt::Debug for CheckpointSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CheckpointSink")
    }
}

impl StepContext {
    /// How long until [`Self::deadline`]; zero once it has passed.
    pub fn time_left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Whether the attempt has timed out: its outcome is no longer wanted.
    pub fn past_deadline(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Whether the attempt was called off before its deadline (see
    /// [`Self::cancellation`]): its outcome is no longer wanted.
    pub fn is_cancelled(&self) -> bool {
        self.cancellation.is_cancelled()
    }

    /// Whether a handler should stop: past its deadline, or called off.
    pub fn should_stop(&self) -> bool {
        self.past_deadline() || self.is_cancelled()
    }

    /// The failure a handler returns when it stops because it was called off (nothing
    /// publishes it: the step has moved on).
    pub fn cancelled_error(&self) -> StepError {
        StepError::retryable(format!(
            "step {} was called off (attempt {}): its task was cancelled or resolved, or the attempt was taken back",
            self.step_name, self.attempt
        ))
    }

    /// The failure a handler returns when it stops at its deadline, or called off.
    pub fn stop_error(&self) -> StepError {
        match self.is_cancelled() {
            true => self.cancelled_error(),
            false => self.deadline_error(),
        }
    }

    /// The failure a handler returns when it stops at its deadline.
    pub fn deadline_error(&self) -> StepError {
        StepError::retryable(format!(
            "step {} stopped at its deadline (attempt {})",
            self.step_name, self.attempt
        ))
    }

    /// The results of the direct dependencies, in order.
    pub fn dependency_results(&self) -> impl Iterator<Item = &Value> {
        self.dependencies
            .iter()
            .filter_map(|d| self.ancestors.get(d))
    }
}

/// A failed attempt: whether to retry, and (optionally) after how long.
#[derive(Debug, Clone, PartialEq)]
pub struct StepError {
    pub message: String,
    pub retryable: bool,
    pub retry_after_ms: Option<u64>,
}

impl StepError {
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: true,
            retry_after_ms: None,
        }
    }

    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: false,
            retry_after_ms: None,
        }
    }
}

pub trait StepHandler: Send + Sync {
    fn call(&self, ctx: &StepContext) -> Result<Value, StepError>;
}

impl<F> StepHandler for F
where
    F: Fn(&StepContext) -> Result<Value, StepError> + Send + Sync,
{
    fn call(&self, ctx: &StepContext) -> Result<Value, StepError> {
        self(ctx)
    }
}

/// Handlers by callable name.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: BTreeMap<String, Arc<dyn StepHandler>>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register(&mut self, callable: impl Into<String>, h: impl StepHandler + 'static) {
        self.handlers.insert(callable.into(), Arc::new(h));
    }

    pub fn get(&self, callable: &str) -> Option<Arc<dyn StepHandler>> {
        self.handlers.get(callable).cloned()
    }

    pub fn names(&self) -> BTreeSet<String> {
        self.handlers.keys().cloned().collect()
    }

    /// The example and benchmark handlers `embarcadero worker` runs.
    pub fn builtin() -> Self {
        let mut r = Self::new();
        crate::builtin::register_all(&mut r);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn counting(count: &Arc<AtomicUsize>) -> impl FnOnce() + Send + 'static {
        let count = count.clone();
        move || {
            count.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn each_callback_runs_once_whether_registered_before_or_after_the_cancel() {
        let (c, count) = (Cancellation::default(), Arc::new(AtomicUsize::new(0)));
        c.on_cancel(counting(&count));
        assert_eq!(count.load(Ordering::SeqCst), 0);
        c.cancel();
        assert!(c.is_cancelled());
        assert_eq!(count.load(Ordering::SeqCst), 1);
        c.on_cancel(counting(&count)); // already cancelled: runs at once
        c.cancel(); // a second cancel runs nothing again
        assert_eq!(count.load(Ordering::SeqCst), 2);
    }

    /// Registration racing the cancel on another thread: every callback runs exactly
    /// once, whichever side wins each race.
    #[test]
    fn callbacks_racing_the_cancel_each_run_exactly_once() {
        for round in 0..2000 {
            let (c, count) = (Cancellation::default(), Arc::new(AtomicUsize::new(0)));
            let registering = {
                let (c, count) = (c.clone(), count.clone());
                std::thread::spawn(move || (0..4).for_each(|_| c.on_cancel(counting(&count))))
            };
            if round % 2 == 0 {
                std::thread::yield_now();
            }
            c.cancel();
            registering.join().unwrap();
            assert_eq!(count.load(Ordering::SeqCst), 4, "round {round}");
        }
    }

    #[test]
    fn a_sleep_ends_when_cancelled_and_runs_its_course_when_not() {
        let c = Cancellation::default();
        assert!(
            !c.sleep(Duration::from_millis(1)),
            "not cancelled: the whole sleep"
        );
        let cancelling = {
            let c = c.clone();
            std::thread::spawn(move || c.cancel())
        };
        // An hour, unless the cancel ends it (the test would hang otherwise).
        assert!(c.sleep(Duration::from_secs(3600)));
        cancelling.join().unwrap();
        assert!(
            c.sleep(Duration::from_secs(3600)),
            "cancelled: no wait at all"
        );
    }
}
