//! Rust step handlers: the [`StepHandler`] trait, what a handler is given
//! ([`StepContext`]) and returns ([`StepError`] on failure), and the [`Registry`] a
//! worker runs and a template's `handler.callable` names are checked against.

use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

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
    /// The step's direct dependencies, in the template's order.
    pub dependencies: Vec<String>,
}

impl StepContext {
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
