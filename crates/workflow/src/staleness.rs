//! Staleness: Tasker's `lifecycle` thresholds acted on. Given an open task and the
//! time, the `step_stale` events that fail the steps stuck past their template's
//! thresholds (the task then fails, and the steps are dead-lettered with reason
//! `staleness`). Pure: the orchestrator passes its clock in, and publishes the events,
//! so every reader of the log applies the same failures.

use crate::event::{Event, StepRef};
use crate::machine::{StepState, TaskState};
use crate::state::{Step, Task};
use crate::template::Lifecycle;

/// What a stale step's error begins with (the DLQ's `staleness` reason looks for it).
pub const STALE: &str = "stale:";

/// The `step_stale` events for `task` at `now_ms` (none without `lifecycle`).
pub fn stale_steps(task: &Task, now_ms: u64) -> Vec<Event> {
    let Some(limits) = &task.template.lifecycle else {
        return Vec::new();
    };
    let whole_task = task_threshold(task, limits, now_ms);
    let mut out = Vec::new();
    for step in task.created_steps().filter(|s| !s.state.is_terminal()) {
        let why = whole_task
            .clone()
            .or_else(|| step_threshold(task, step, limits, now_ms));
        if let Some(why) = why {
            let at = StepRef {
                task: task.uuid.clone(),
                step: step.name.clone(),
                attempt: step.attempt,
            };
            out.push(Event::StepStale {
                at,
                state: step.state,
                reason: format!("{STALE} {why}"),
            });
        }
    }
    out
}

/// A threshold of the whole task passed: every unfinished step is stale.
fn task_threshold(task: &Task, limits: &Lifecycle, now_ms: u64) -> Option<String> {
    let entered = task.history.last().map_or(task.created_ms, |t| t.ts_ms);
    if let Some(m) = over(limits.max_duration_minutes, task.created_ms, now_ms) {
        return Some(format!(
            "the task ran past lifecycle.max_duration_minutes ({m})"
        ));
    }
    let waiting = task.state == TaskState::WaitingForDependencies;
    let m = over(limits.max_waiting_for_dependencies_minutes, entered, now_ms)?;
    waiting.then(|| {
        format!("the task waited for dependencies past lifecycle.max_waiting_for_dependencies_minutes ({m})")
    })
}

/// A threshold of this step's state passed.
fn step_threshold(task: &Task, step: &Step, limits: &Lifecycle, now_ms: u64) -> Option<String> {
    let entered = step.history.last().map_or(task.created_ms, |t| t.ts_ms);
    match step.state {
        s if s.is_active() => {
            let m = over(limits.max_steps_in_process_minutes, entered, now_ms)?;
            Some(format!(
                "{} past lifecycle.max_steps_in_process_minutes ({m})",
                s.name()
            ))
        }
        StepState::WaitingForRetry => {
            let m = over(limits.max_waiting_for_retry_minutes, entered, now_ms)?;
            Some(format!(
                "waiting for a retry past lifecycle.max_waiting_for_retry_minutes ({m})"
            ))
        }
        _ => None,
    }
}

/// The threshold (minutes), if one is set and `since_ms` is longer ago than it.
fn over(minutes: Option<f64>, since_ms: u64, now_ms: u64) -> Option<f64> {
    let m = minutes?;
    let elapsed_ms = now_ms.saturating_sub(since_ms) as f64;
    (elapsed_ms > m * 60_000.0).then_some(m)
}
