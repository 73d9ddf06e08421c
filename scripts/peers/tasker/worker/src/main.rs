//! Tasker worker with the benchmark's handlers, for the side-by-side benchmark of issue 25.
//! It boots tasker-worker (which registers the YAML templates in TASKER_TEMPLATE_PATH and
//! listens on its namespace queues) and serves the dispatch channel with our handlers:
//! `math.square`, the same arithmetic as Embarcadero's built-in handler of that name, and
//! the conditional and CSV batch shapes' handlers (module `shapes`).

use async_trait::async_trait;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tasker_shared::messaging::StepExecutionResult;
use tasker_shared::TaskerResult;
use tasker_worker::worker::handlers::{
    HandlerDispatchConfig, HandlerDispatchService, StepHandler, StepHandlerRegistry,
};
use tasker_worker::{TaskSequenceStep, WorkerBootstrap};
use tokio::signal::unix::{signal, SignalKind};

mod shapes;

/// Handlers by their template `callable`; fixed at start, so lookups need no lock.
struct Registry(HashMap<String, Arc<dyn StepHandler>>);

#[async_trait]
impl StepHandlerRegistry for Registry {
    async fn get(&self, step: &TaskSequenceStep) -> Option<Arc<dyn StepHandler>> {
        self.0.get(&step.step_definition.handler.callable).cloned()
    }
    fn register(&self, name: &str, _handler: Arc<dyn StepHandler>) {
        tracing::warn!("handlers are fixed at start; ignoring registration of {name}");
    }
    fn handler_available(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
    fn registered_handlers(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
}

/// Squares the product of the direct dependencies' integer results, or, when there is no
/// such result, the task context's `even_number` (Embarcadero's `math.square`, so both engines
/// do the same work). As there, a decision's outcome is not a number and is skipped, and so is
/// a dependency a decision never created (a deferred convergence's).
struct Square;

fn square(step: &TaskSequenceStep) -> Result<i64, String> {
    let mut product: Option<i64> = None;
    for name in &step.step_definition.dependencies {
        let Some(result) = step.dependency_results.get(name).map(|r| &r.result) else {
            continue;
        };
        if result.get("decision_point_outcome").is_some() {
            continue;
        }
        let value = result
            .as_i64()
            .ok_or_else(|| format!("no integer result from dependency `{name}`"))?;
        let so_far = product.unwrap_or(1);
        product = Some(
            so_far
                .checked_mul(value)
                .ok_or("the product overflows 64 bits")?,
        );
    }
    let input = match product {
        Some(p) => p,
        None => step
            .task
            .task
            .context
            .as_ref()
            .and_then(|c| c.get("even_number"))
            .and_then(Value::as_i64)
            .ok_or("context field `even_number` is not an integer")?,
    };
    input
        .checked_mul(input)
        .ok_or_else(|| format!("{input} squared overflows 64 bits"))
}

#[async_trait]
impl StepHandler for Square {
    async fn call(&self, step: &TaskSequenceStep) -> TaskerResult<StepExecutionResult> {
        let started = Instant::now();
        let uuid = step.workflow_step.workflow_step_uuid;
        let outcome = square(step);
        let ms = started.elapsed().as_millis() as i64;
        Ok(match outcome {
            Ok(n) => StepExecutionResult::success(uuid, json!(n), ms, None),
            Err(e) => StepExecutionResult::failure(uuid, e, None, None, false, ms, None),
        })
    }
    fn name(&self) -> &str {
        "math.square"
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tasker_shared::logging::init_tracing();
    let mut handle = WorkerBootstrap::bootstrap().await?;
    let dispatch = handle
        .take_dispatch_handles()
        .ok_or("the worker gave no dispatch handles")?;
    let mut handlers: HashMap<String, Arc<dyn StepHandler>> = HashMap::new();
    handlers.insert("math.square".into(), Arc::new(Square));
    shapes::register(&mut handlers);
    let (service, _capacity) = HandlerDispatchService::new(
        dispatch.dispatch_receiver,
        dispatch.completion_sender,
        Arc::new(Registry(handlers)),
        HandlerDispatchConfig::default(),
    );
    tokio::spawn(service.run());
    // The run script waits for this line before it submits work.
    eprintln!("tasker-bench-worker is running");
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    handle.stop().await?;
    Ok(())
}
