//! The built-in handlers: Tasker's benchmark arithmetic (square the number), a decision
//! that routes by the task's input, and the test handlers the engine's own tests use to
//! fail, sleep and record attempts, and Tasker's CSV batch (analyze the rows, process
//! each worker's range with checkpoints, aggregate).

use crate::handler::{Registry, StepContext, StepError};
use serde_json::{json, Value};
use std::time::Duration;

pub fn register_all(r: &mut Registry) {
    r.register("math.square", square);
    r.register("test.fail_times", fail_times);
    r.register("test.sleep", sleep);
    r.register("decision.choose", choose);
    r.register("csv.analyze", csv_analyze);
    r.register("csv.process_batch", csv_process_batch);
    r.register("csv.aggregate", csv_aggregate);
}

/// Squares the product of the direct dependencies' results (a decision's outcome is
/// not a number and is skipped; a dependency never created has no result), or, when
/// there is no such result, the context's number (field `initialization.input`,
/// default `even_number`).
fn square(ctx: &StepContext) -> Result<Value, StepError> {
    let mut product: Option<i64> = None;
    for name in &ctx.dependencies {
        let Some(v) = ctx.ancestors.get(name) else {
            continue;
        };
        if v.get("step_names").is_some() {
            continue;
        }
        let n = number(v, name)?;
        product = Some(
            product
                .unwrap_or(1)
                .checked_mul(n)
                .ok_or_else(|| StepError::permanent("the product overflows 64 bits"))?,
        );
    }
    let input = match product {
        Some(p) => p,
        None => {
            let field = ctx.initialization["input"]
                .as_str()
                .unwrap_or("even_number");
            number(&ctx.context[field], field)?
        }
    };
    let squared = input
        .checked_mul(input)
        .ok_or_else(|| StepError::permanent(format!("{input} squared overflows 64 bits")))?;
    Ok(json!(squared))
}

fn number(v: &Value, what: &str) -> Result<i64, StepError> {
    v.as_i64()
        .ok_or_else(|| StepError::permanent(format!("`{what}` is {v}, not an integer")))
}

/// Fails the first `initialization.failures` attempts (retryable unless
/// `initialization.retryable` is false), then returns the attempt number.
fn fail_times(ctx: &StepContext) -> Result<Value, StepError> {
    let failures = ctx.initialization["failures"].as_u64().unwrap_or(u64::MAX);
    if u64::from(ctx.attempt) <= failures {
        let message = format!("planned failure of attempt {}", ctx.attempt);
        return Err(match ctx.initialization["retryable"].as_bool() {
            Some(false) => StepError::permanent(message),
            _ => StepError::retryable(message),
        });
    }
    Ok(json!({"attempt": ctx.attempt}))
}

/// A decision: creates the branches the context's field `initialization.field`
/// (default `branches`) lists, an array of step names.
fn choose(ctx: &StepContext) -> Result<Value, StepError> {
    let field = ctx.initialization["field"].as_str().unwrap_or("branches");
    match ctx.context[field].as_array() {
        Some(names) => Ok(json!({"type": "create_steps", "step_names": names})),
        None => Err(StepError::permanent(format!(
            "the context's `{field}` is {}, not a list of step names",
            ctx.context[field]
        ))),
    }
}

/// A field of the context, else of `initialization`, else `default`.
fn setting(ctx: &StepContext, field: &str, default: u64) -> u64 {
    ctx.context[field]
        .as_u64()
        .or_else(|| ctx.initialization[field].as_u64())
        .unwrap_or(default)
}

/// Most rows the synthetic CSV batch takes (a context asking for 2^64 - 1 rows wrapped
/// the cursors' arithmetic and had a worker loop for ever), and most batch workers.
const MAX_CSV_ROWS: u64 = 1 << 32;
const MAX_CSV_WORKERS: u64 = 1024;

/// The batchable step of the CSV batch: `rows` rows (default 1000, at most 2^32) split
/// into `worker_count` (default 5, at most 1024) contiguous ranges, one cursor
/// `{start, end}` each.
fn csv_analyze(ctx: &StepContext) -> Result<Value, StepError> {
    let rows = setting(ctx, "rows", 1000);
    let workers = setting(ctx, "worker_count", 5);
    if rows > MAX_CSV_ROWS || workers > MAX_CSV_WORKERS {
        return Err(StepError::permanent(format!(
            "rows {rows} and worker_count {workers}: at most {MAX_CSV_ROWS} rows and {MAX_CSV_WORKERS} workers"
        )));
    }
    let workers = workers.clamp(1, rows.max(1));
    // rows * k < 2^42: no overflow below the limits.
    let cursors: Vec<Value> = (0..workers)
        .map(|k| json!({"start": rows * k / workers, "end": rows * (k + 1) / workers}))
        .collect();
    Ok(
        json!({"type": "create_batches", "worker_count": workers, "cursors": cursors, "total_items": rows}),
    )
}

/// Row `i` of the synthetic product CSV: its inventory value in cents (price x quantity).
fn csv_row_value(i: u64) -> u64 {
    let price_cents = 100 + (i * 37) % 1000;
    let quantity = 1 + i % 9;
    price_cents * quantity
}

/// Rows the CSV batch worker sums between two looks at its deadline.
const DEADLINE_CHECK_ROWS: u64 = 4096;

/// A batch worker of the CSV batch: sums the inventory value of the rows of its cursor,
/// from the checkpoint of an earlier attempt if there is one, saving a checkpoint every
/// `checkpoint_every` rows (0: never) and then pausing `pause_ms` (for tests that kill
/// the worker mid-batch). The instance whose index is the context's `fail_batch` fails.
fn csv_process_batch(ctx: &StepContext) -> Result<Value, StepError> {
    let Some(batch) = &ctx.batch else {
        return Err(StepError::permanent(
            "csv.process_batch runs as a batch_worker step",
        ));
    };
    if ctx.context["fail_batch"].as_u64() == Some(u64::from(batch.index)) {
        return Err(StepError::permanent(format!(
            "planned failure of batch {}",
            batch.index
        )));
    }
    let end = number(&batch.cursor["end"], "cursor.end")? as u64;
    let (mut row, mut done, mut value) = match &batch.resume {
        Some(c) => (
            number(&c.cursor, "checkpoint.cursor")? as u64,
            c.items_done,
            c.partial["value"].as_u64().unwrap_or(0),
        ),
        None => (number(&batch.cursor["start"], "cursor.start")? as u64, 0, 0),
    };
    if row > end || end - row > MAX_CSV_ROWS {
        return Err(StepError::permanent(format!(
            "cursor from row {row} to {end}: want start <= end and at most {MAX_CSV_ROWS} rows"
        )));
    }
    let resumed_from = batch.resume.as_ref().map(|c| c.cursor.clone());
    let every = setting(ctx, "checkpoint_every", 0);
    let pause = Duration::from_millis(ctx.initialization["pause_ms"].as_u64().unwrap_or(0));
    while row < end {
        if done % DEADLINE_CHECK_ROWS == 0 && ctx.should_stop() {
            return Err(ctx.stop_error());
        }
        value += csv_row_value(row);
        (row, done) = (row + 1, done + 1);
        if every > 0 && done % every == 0 && row < end {
            let partial = json!({"value": value});
            let checkpoint = crate::event::Checkpoint {
                cursor: json!(row),
                items_done: done,
                partial,
            };
            batch.checkpoints.save(checkpoint);
            ctx.cancellation.sleep(pause.min(ctx.time_left()));
        }
    }
    Ok(json!({"rows": done, "value": value, "resumed_from": resumed_from}))
}

/// The convergence of the CSV batch: the rows and value of every batch that succeeded.
fn csv_aggregate(ctx: &StepContext) -> Result<Value, StepError> {
    let (mut rows, mut value, mut batches) = (0u64, 0u64, 0u64);
    // A failed instance (continue_on_failure) has no result: it is not a batch done.
    for r in ctx.dependency_results().filter(|r| !r.is_null()) {
        rows += r["rows"].as_u64().unwrap_or(0);
        value += r["value"].as_u64().unwrap_or(0);
        batches += 1;
    }
    Ok(json!({"rows": rows, "value": value, "batches": batches}))
}

/// Sleeps `initialization.ms`, then returns the attempt number and its dependencies'
/// results (so a chain of sleeps still carries data). A sleep past the step's deadline
/// stops there, and a sleep called off (its task cancelled) at once.
fn sleep(ctx: &StepContext) -> Result<Value, StepError> {
    let ms = ctx.initialization["ms"].as_u64().unwrap_or(0);
    let (wanted, left) = (Duration::from_millis(ms), ctx.time_left());
    if ctx.cancellation.sleep(wanted.min(left)) {
        return Err(ctx.cancelled_error());
    }
    if wanted > left {
        return Err(ctx.deadline_error());
    }
    Ok(json!({"attempt": ctx.attempt, "slept_ms": ms}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(deps: &[(&str, Value)], context: Value) -> StepContext {
        StepContext {
            task_uuid: "t".into(),
            step_name: "s".into(),
            attempt: 1,
            context,
            initialization: Value::Null,
            ancestors: deps
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            dependencies: deps.iter().map(|(k, _)| k.to_string()).collect(),
            batch: None,
            deadline: std::time::Instant::now() + Duration::from_secs(3600),
            cancellation: Default::default(),
        }
    }

    #[test]
    fn square_takes_the_context_or_the_product_of_dependencies() {
        assert_eq!(square(&ctx(&[], json!({"even_number": 6}))), Ok(json!(36)));
        assert_eq!(
            square(&ctx(&[("a", json!(2)), ("b", json!(3))], json!({}))),
            Ok(json!(36))
        );
        assert!(!square(&ctx(&[], json!({}))).unwrap_err().retryable);
        let after_decision = ctx(
            &[("decide", json!({"step_names": ["x"]}))],
            json!({"even_number": 3}),
        );
        assert_eq!(square(&after_decision), Ok(json!(9)));
    }

    #[test]
    fn the_csv_batch_refuses_sizes_its_arithmetic_cannot_hold() {
        // 2^64 - 1 rows wrapped the cursors, and a worker looped on one for ever.
        let huge = ctx(&[], json!({"rows": u64::MAX}));
        assert!(!csv_analyze(&huge).unwrap_err().retryable);
        let many = ctx(&[], json!({"worker_count": 5000}));
        assert!(!csv_analyze(&many).unwrap_err().retryable);
        let largest = ctx(&[], json!({"rows": MAX_CSV_ROWS, "worker_count": 7}));
        let cursors = csv_analyze(&largest).unwrap()["cursors"].clone();
        assert_eq!(cursors[6]["end"], json!(MAX_CSV_ROWS));
        let mut backwards = ctx(&[], json!({}));
        backwards.batch = Some(crate::handler::BatchInput {
            cursor: json!({"start": 9, "end": 3}),
            index: 0,
            count: 1,
            resume: None,
            checkpoints: crate::handler::CheckpointSink::new(|_| {}),
        });
        assert!(!csv_process_batch(&backwards).unwrap_err().retryable);
    }

    /// A timed-out attempt's thread cannot be stopped from outside: the long built-in
    /// handlers look at their deadline and stop there rather than run on unwanted.
    #[test]
    fn the_long_handlers_stop_at_their_deadline() {
        let mut sleepy = ctx(&[], json!({}));
        sleepy.initialization = json!({"ms": 3_600_000});
        sleepy.deadline = std::time::Instant::now() + Duration::from_millis(20);
        let e = sleep(&sleepy).unwrap_err();
        assert!(e.retryable && e.message.contains("deadline"), "{e:?}");
        let mut rows = ctx(&[], json!({}));
        rows.deadline = std::time::Instant::now();
        rows.batch = Some(crate::handler::BatchInput {
            cursor: json!({"start": 0, "end": MAX_CSV_ROWS}),
            index: 0,
            count: 1,
            resume: None,
            checkpoints: crate::handler::CheckpointSink::new(|_| {}),
        });
        let e = csv_process_batch(&rows).unwrap_err();
        assert!(e.retryable && e.message.contains("deadline"), "{e:?}");
        // Within its deadline a sleep finishes.
        sleepy.initialization = json!({"ms": 1});
        sleepy.deadline = std::time::Instant::now() + Duration::from_secs(3600);
        assert_eq!(sleep(&sleepy).unwrap()["slept_ms"], json!(1));
    }

    #[test]
    fn the_csv_batch_resumes_from_its_checkpoint_with_the_same_total() {
        use crate::handler::{BatchInput, CheckpointSink};
        use std::sync::{Arc, Mutex};
        let analyzed = csv_analyze(&ctx(&[], json!({"rows": 10, "worker_count": 3}))).unwrap();
        assert_eq!(analyzed["cursors"][2], json!({"start": 6, "end": 10}));
        let saved = Arc::new(Mutex::new(Vec::new()));
        let sink = saved.clone();
        let mut c = ctx(&[], json!({"checkpoint_every": 2}));
        c.batch = Some(BatchInput {
            cursor: json!({"start": 0, "end": 5}),
            index: 1,
            count: 1,
            resume: None,
            checkpoints: CheckpointSink::new(move |cp| sink.lock().unwrap().push(cp)),
        });
        let whole = csv_process_batch(&c).unwrap();
        let expected: u64 = (0..5).map(csv_row_value).sum();
        assert_eq!(whole["value"], json!(expected));
        let first = saved.lock().unwrap()[0].clone();
        assert_eq!((first.cursor.clone(), first.items_done), (json!(2), 2));
        c.batch.as_mut().unwrap().resume = Some(first);
        let resumed = csv_process_batch(&c).unwrap();
        assert_eq!(
            (
                &resumed["value"],
                &resumed["rows"],
                &resumed["resumed_from"]
            ),
            (&json!(expected), &json!(5), &json!(2))
        );
    }

    #[test]
    fn choose_names_the_branches_the_context_lists() {
        let c = ctx(&[], json!({"branches": ["a", "c"]}));
        assert_eq!(choose(&c).unwrap()["step_names"], json!(["a", "c"]));
        assert!(!choose(&ctx(&[], json!({}))).unwrap_err().retryable);
    }
}
