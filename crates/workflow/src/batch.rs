//! Batch steps: a `batchable` step's result (cursors and a worker count) becomes one
//! instance of each `batch_worker` step that depends on it per cursor, created by the
//! fold when the batchable step completes, and the convergence after them waits for
//! the instances. Also the batch's failure strategy: what an instance's failure does to
//! its siblings and to the task.

use crate::machine::StepState;
use crate::state::{Step, Task};
use crate::template::StepType;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The most worker instances one batchable step may ask for.
pub const MAX_BATCH_WORKERS: usize = 1000;

/// What one batch worker instance is given: its cursor and place among its siblings.
/// (`parent`, skipped when serialized, is restored by [`crate::snapshot`].)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchSlot {
    /// The batchable step that created it.
    #[serde(skip)]
    pub parent: usize,
    pub cursor: Value,
    /// 1-based.
    pub index: u32,
    pub count: u32,
}

/// What an instance's failure (after its retries) does; the batchable step's
/// `batch_config.failure_strategy`, `fail_fast` unless given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureStrategy {
    /// The other instances and the convergence run; the task completes, the failed
    /// instance counted in `failed_steps` and its result absent from the convergence's.
    ContinueOnFailure,
    /// The other instances still running are cancelled and the task fails.
    #[default]
    FailFast,
    /// The other instances run to completion (retries included), the convergence does
    /// not run, and the task fails.
    Isolate,
}

/// The strategy a `batch_config` names (`None`: it names one that does not exist).
pub fn strategy_of(batch_config: Option<&Value>) -> Option<FailureStrategy> {
    match batch_config.and_then(|c| c.get("failure_strategy")) {
        None => Some(FailureStrategy::default()),
        Some(v) => serde_json::from_value(v.clone()).ok(),
    }
}

/// The cursors a batchable step's result asks for: `{"cursors": [...], "worker_count": n}`
/// (`worker_count`, when given, must be the number of cursors; `{"type": "no_batches"}`
/// asks for none).
pub fn batch_cursors(result: &Value) -> Result<Vec<Value>, String> {
    if result.get("type").and_then(Value::as_str) == Some("no_batches") {
        return Ok(Vec::new());
    }
    let Some(cursors) = result.get("cursors").and_then(Value::as_array) else {
        return Err(format!(
            "a batchable step returns {{\"cursors\": [...], \"worker_count\": n}}, not {result}"
        ));
    };
    if let Some(n) = result.get("worker_count") {
        if n.as_u64() != Some(cursors.len() as u64) {
            return Err(format!(
                "worker_count is {n} but there are {} cursors (one per worker)",
                cursors.len()
            ));
        }
    }
    if cursors.len() > MAX_BATCH_WORKERS {
        return Err(format!(
            "{} workers asked for; at most {MAX_BATCH_WORKERS}",
            cursors.len()
        ));
    }
    Ok(cursors.clone())
}

/// The cursors batchable step `parent`'s result asks for, checked against its task: as
/// [`batch_cursors`], and at most [`MAX_BATCH_WORKERS`] instances in all over the batch
/// worker steps after it (each gets one instance per cursor). Without that bound a template
/// with thousands of worker steps made one result create millions of steps, in every
/// reader of the log (memory, and minutes of folding, at each replay).
pub fn instance_cursors(task: &Task, parent: usize, result: &Value) -> Result<Vec<Value>, String> {
    let cursors = batch_cursors(result)?;
    let workers = worker_steps(task, parent).count();
    let instances = cursors.len().saturating_mul(workers);
    if instances > MAX_BATCH_WORKERS {
        return Err(format!(
            "{} cursors for {workers} batch_worker steps make {instances} instances; at most {MAX_BATCH_WORKERS}",
            cursors.len()
        ));
    }
    Ok(cursors)
}

/// The batch worker steps whose instances batchable step `parent` creates.
fn worker_steps(task: &Task, parent: usize) -> impl Iterator<Item = usize> + '_ {
    (0..task.steps.len()).filter(move |&w| {
        task.spec(w).step_type == StepType::BatchWorker && task.deps[w] == [parent]
    })
}

/// The name of instance `index` (1-based) of batch worker step `worker`.
pub fn instance_name(worker: &str, index: usize) -> String {
    format!("{worker}_{index:03}")
}

/// The batchable step `parent` completed: creates the instances of each batch worker
/// step depending on it, and makes every step depending on a worker step depend on
/// its instances.
pub(crate) fn create_instances(task: &mut Task, parent: usize) {
    // A result the orchestrator's check refuses (a completion forged past it) creates none.
    let cursors = task.steps[parent]
        .result
        .as_ref()
        .and_then(|r| instance_cursors(task, parent, r).ok())
        .unwrap_or_default();
    let workers: Vec<usize> = worker_steps(task, parent).collect();
    for w in workers {
        let first = task.steps.len();
        for (k, cursor) in cursors.iter().enumerate() {
            let mut step = Step::new(
                &instance_name(&task.steps[w].name, k + 1),
                task.steps[w].spec,
            );
            step.created = true;
            step.batch = Some(BatchSlot {
                parent,
                cursor: cursor.clone(),
                index: k as u32 + 1,
                count: cursors.len() as u32,
            });
            task.steps.push(step);
            task.deps.push(vec![parent]);
        }
        let instances: Vec<usize> = (first..task.steps.len()).collect();
        for deps in task.deps.iter_mut().filter(|d| d.contains(&w)) {
            deps.extend(&instances);
        }
    }
}

/// The strategy of the batch instance `i` belongs to (`None`: not an instance).
pub fn strategy(task: &Task, i: usize) -> Option<FailureStrategy> {
    let parent = task.steps[i].batch.as_ref()?.parent;
    Some(strategy_of(task.spec(parent).batch_config.as_ref()).unwrap_or_default())
}

/// An instance that failed under `continue_on_failure`: it does not fail the task.
pub fn tolerated(task: &Task, i: usize) -> bool {
    task.steps[i].state == StepState::Error
        && strategy(task, i) == Some(FailureStrategy::ContinueOnFailure)
}

/// Instance `i` failed for good: under `fail_fast`, its siblings still running are
/// cancelled.
pub(crate) fn on_error(task: &mut Task, i: usize, position: u64, ts: u64) {
    if strategy(task, i) != Some(FailureStrategy::FailFast) {
        return;
    }
    let parent = task.steps[i].batch.as_ref().map(|b| b.parent);
    for s in &mut task.steps {
        let sibling = s.batch.as_ref().map(|b| b.parent) == parent;
        if sibling && !s.state.is_terminal() {
            s.enter(StepState::Cancelled, position, ts);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::decide::{decide, Clock};
    use crate::event::{Envelope, Event, Outcome, StepRef};
    use crate::machine::StepState;
    use crate::state::State;
    use serde_json::json;

    /// A batchable step `an` and three batch worker steps after it.
    const THREE_WORKERS: &str = "name: three\nnamespace: p\nversion: '1'\nsteps:
  - {name: an, type: batchable, handler: {callable: x}}
  - {name: w1, type: batch_worker, dependencies: [an], handler: {callable: x}}
  - {name: w2, type: batch_worker, dependencies: [an], handler: {callable: x}}
  - {name: w3, type: batch_worker, dependencies: [an], handler: {callable: x}}
";

    fn apply(s: &mut State, event: Event) -> bool {
        let env = Envelope {
            ts_ms: 1,
            term: None,
            event,
        };
        s.apply(s.next_position, &env).is_ok()
    }

    /// Task `t` (under `protocol`) whose `an` returned `cursors` cursors.
    fn returned(protocol: u8, cursors: usize) -> State {
        let mut s = State::default();
        let template = crate::validate::load(THREE_WORKERS, None).unwrap();
        assert!(apply(&mut s, Event::TemplateRegistered { template }));
        let created = Event::TaskCreated {
            task: "t".into(),
            namespace: "p".into(),
            name: "three".into(),
            version: "1".into(),
            context: json!({}),
            idempotency_key: None,
            identity: None,
            protocol: Some(protocol),
        };
        assert!(apply(&mut s, created));
        let at = StepRef {
            task: "t".into(),
            step: "an".into(),
            attempt: 1,
        };
        if protocol == 1 {
            assert!(apply(&mut s, Event::StepEnqueued(at.clone())));
        }
        let worker = "w".to_string();
        let claim = Event::StepClaimed {
            at: at.clone(),
            worker: worker.clone(),
        };
        assert!(apply(&mut s, claim));
        let result = json!({ "cursors": vec![0; cursors] });
        let outcome = Outcome::Success { result };
        assert!(apply(
            &mut s,
            Event::StepResult {
                at,
                worker,
                outcome
            }
        ));
        s
    }

    #[test]
    fn a_batch_result_making_more_than_1000_instances_over_its_worker_steps_creates_none() {
        // 334 cursors (fewer than 1000) for three worker steps made 1002 instances: with
        // thousands of worker steps, millions of steps from one result, in every reader.
        let s = returned(2, 333);
        assert_eq!(
            s.tasks["t"].steps.len(),
            4 + 999,
            "999 instances are allowed"
        );
        let s = returned(2, 334);
        let an = s.tasks["t"].step("an").unwrap();
        assert_eq!(
            an.state,
            StepState::EnqueuedForOrchestration,
            "not completed"
        );
        assert_eq!(s.tasks["t"].steps.len(), 4);
        let clock = Clock {
            now_ms: 1,
            lease_ms: 100,
            claimed_at: &|_| Some(1),
            worker_seen: &|_| Some(1),
        };
        let decided = decide(&s, &clock).0;
        assert!(
            matches!(&decided[..], [Event::StepErrored { reason, .. }] if reason.contains("1002 instances; at most 1000")),
            "{decided:?}"
        );
        // A completion written anyway (protocol 1: the orchestrator's event) creates none.
        let mut s = returned(1, 334);
        let at = StepRef {
            task: "t".into(),
            step: "an".into(),
            attempt: 1,
        };
        assert!(apply(&mut s, Event::StepCompleted(at)));
        assert_eq!(s.tasks["t"].steps.len(), 4);
    }
}
