//! The conditional and CSV batch shapes' handlers for Tasker, written from the behaviour of
//! Embarcadero's built-in handlers of the same names (crates/workflow/src/builtin.rs) so both
//! engines do the same work and give the same results:
//! - `decision.choose`: a decision creating the branches the task context's `branches` lists;
//! - `csv.analyze`: 1000 rows (context `rows`) split into 5 cursors (context `worker_count`);
//! - `csv.process_batch`: the inventory value of its cursor's rows of the synthetic CSV;
//! - `csv.aggregate`: the rows, value and batch count of every batch.
//!
//! Only the result envelopes differ, as each engine asks: Tasker wants the decision under
//! `decision_point_outcome` and the batches under `batch_processing_outcome`, and hands a batch
//! worker its cursor in `workflow_step.inputs` (read with tasker-worker's BatchWorkerContext).
//! This module owns no state; it touches only the step it is given.

use async_trait::async_trait;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tasker_shared::messaging::{
    BatchProcessingOutcome, CursorConfig, DecisionPointOutcome, StepExecutionResult,
};
use tasker_shared::TaskerResult;
use tasker_worker::batch_processing::BatchWorkerContext;
use tasker_worker::worker::handlers::StepHandler;
use tasker_worker::TaskSequenceStep;

type Body = fn(&TaskSequenceStep) -> Result<Value, String>;

/// A handler from a plain function: times it and wraps its outcome (failures permanent).
struct Plain {
    name: &'static str,
    body: Body,
}

#[async_trait]
impl StepHandler for Plain {
    async fn call(&self, step: &TaskSequenceStep) -> TaskerResult<StepExecutionResult> {
        let started = Instant::now();
        let uuid = step.workflow_step.workflow_step_uuid;
        let outcome = (self.body)(step);
        let ms = started.elapsed().as_millis() as i64;
        Ok(match outcome {
            Ok(v) => StepExecutionResult::success(uuid, v, ms, None),
            Err(e) => StepExecutionResult::failure(uuid, e, None, None, false, ms, None),
        })
    }
    fn name(&self) -> &str {
        self.name
    }
}

pub fn register(handlers: &mut HashMap<String, Arc<dyn StepHandler>>) {
    let all: [(&'static str, Body); 4] = [
        ("decision.choose", choose),
        ("csv.analyze", csv_analyze),
        ("csv.process_batch", csv_process_batch),
        ("csv.aggregate", csv_aggregate),
    ];
    for (name, body) in all {
        handlers.insert(name.into(), Arc::new(Plain { name, body }));
    }
}

fn context(step: &TaskSequenceStep) -> &Value {
    static NULL: Value = Value::Null;
    step.task.task.context.as_ref().unwrap_or(&NULL)
}

/// A decision: creates the branches the context's `branches` lists.
fn choose(step: &TaskSequenceStep) -> Result<Value, String> {
    let branches = &context(step)["branches"];
    let names = branches
        .as_array()
        .and_then(|a| a.iter().map(|n| n.as_str().map(String::from)).collect())
        .ok_or_else(|| format!("the context's `branches` is {branches}, not a list of names"))?;
    let outcome = DecisionPointOutcome::create_steps(names);
    Ok(json!({ "decision_point_outcome": outcome.to_value() }))
}

/// The batchable step: `rows` rows (default 1000) in `worker_count` (default 5) contiguous
/// ranges, as Embarcadero's csv.analyze; batch ids 001.. so instances are named process_001..
fn csv_analyze(step: &TaskSequenceStep) -> Result<Value, String> {
    let ctx = context(step);
    let rows = ctx["rows"].as_u64().unwrap_or(1000);
    let workers = ctx["worker_count"]
        .as_u64()
        .unwrap_or(5)
        .clamp(1, rows.max(1));
    let cursors: Vec<CursorConfig> = (0..workers)
        .map(|k| {
            let (start, end) = (rows * k / workers, rows * (k + 1) / workers);
            CursorConfig {
                batch_id: format!("{:03}", k + 1),
                start_cursor: json!(start),
                end_cursor: json!(end),
                batch_size: u32::try_from(end - start).unwrap_or(u32::MAX),
            }
        })
        .collect();
    let worker = step
        .step_definition
        .batch_config
        .as_ref()
        .map(|c| c.worker_template.clone())
        .ok_or("csv.analyze runs as a batchable step with a batch_config")?;
    let count = u32::try_from(workers).map_err(|_| "too many workers")?;
    let outcome = BatchProcessingOutcome::create_batches(worker, count, cursors, rows);
    Ok(json!({ "batch_processing_outcome": outcome.to_value() }))
}

/// Row `i` of the synthetic product CSV: its inventory value in cents (price x quantity).
fn csv_row_value(i: u64) -> u64 {
    let price_cents = 100 + (i * 37) % 1000;
    let quantity = 1 + i % 9;
    price_cents * quantity
}

/// A batch worker: sums the inventory value of the rows of its cursor.
fn csv_process_batch(step: &TaskSequenceStep) -> Result<Value, String> {
    let batch = BatchWorkerContext::from_step_data(step).map_err(|e| e.to_string())?;
    if batch.is_no_op() {
        return Ok(json!({"rows": 0, "value": 0}));
    }
    let (start, end) = (batch.start_position(), batch.end_position());
    if start > end {
        return Err(format!("cursor {start}..{end} runs backwards"));
    }
    let value: u64 = (start..end).map(csv_row_value).sum();
    Ok(json!({"rows": end - start, "value": value}))
}

/// The convergence: the rows and value of every batch. Its dependency results are the batch
/// instances' (Tasker names them at run time), told from any others by their `rows`/`value`.
fn csv_aggregate(step: &TaskSequenceStep) -> Result<Value, String> {
    let (mut rows, mut value, mut batches) = (0u64, 0u64, 0u64);
    for r in step.dependency_results.values() {
        if let (Some(n), Some(v)) = (r.result["rows"].as_u64(), r.result["value"].as_u64()) {
            rows += n;
            value += v;
            batches += 1;
        }
    }
    Ok(json!({"rows": rows, "value": value, "batches": batches}))
}
