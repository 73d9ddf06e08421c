//! Rust step handlers: the [`StepHandler`] trait, what a handler is given
//! ([`StepContext`], with [`BatchInput`] for a batch worker) and returns ([`StepError`]
//! on failure), and the [`Registry`] a worker runs and a template's `handler.callable`
//! names are checked against.

use crate::event::Checkpoint;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
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
