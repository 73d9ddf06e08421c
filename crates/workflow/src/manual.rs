//! An operator's changes to a failed step: reset it for retry, resolve it manually
//! (its dependents run without a result from it) or complete it manually (with a
//! result); and the rerun of a failed task (every failed step reset at once, with the
//! batch instances `fail_fast` cancelled). Each is an event checked like the engine's
//! own step events (the step must
//! be in `error`, at the attempt the event names, so a repeated command is refused),
//! allowed on a task that is blocked or failed (which it reopens), never on one that
//! completed or was cancelled.

use crate::batch::FailureStrategy;
use crate::event::{Event, StepRef};
use crate::machine::{StepState, TaskState};
use crate::state::{Rejected, State};
use serde_json::Value;

pub(crate) fn apply(
    state: &mut State,
    event: &Event,
    position: u64,
    ts: u64,
) -> Result<(), Rejected> {
    let Some(at) = event.step_ref() else {
        unreachable!("not a step event: {event:?}")
    };
    let task = state
        .task_mut(&at.task)
        .ok_or_else(|| Rejected::UnknownTask(at.task.clone()))?;
    let index = task
        .index_of(&at.step)
        .ok_or_else(|| Rejected::UnknownStep {
            task: at.task.clone(),
            step: at.step.clone(),
        })?;
    let open = !matches!(
        task.state,
        TaskState::Complete | TaskState::Cancelled | TaskState::ResolvedManually
    );
    let outcome = match open {
        false => Err(Rejected::TaskClosed {
            task: at.task.clone(),
            state: task.state,
        }),
        true => change(&mut task.steps[index], event, at, position, ts),
    };
    match &outcome {
        Ok(()) => {
            restore_cut_short(task, index, position, ts);
            crate::state::consequences(task, index, position, ts);
            task.completed_ms = None;
            crate::settle::settle(task, position, ts);
        }
        Err(e) => {
            let note = format!(
                "position {position}: {} of attempt {}: {e}",
                event.kind(),
                at.attempt
            );
            task.steps[index].refused.push(note);
        }
    }
    outcome
}

/// `task_rerun`: every failed step of a failed task goes back to `pending` (as a
/// reset), with the batch instances a `fail_fast` failure cancelled, and the task is
/// reopened; refused for a task that is not in `error`.
pub(crate) fn rerun(state: &mut State, uuid: &str, position: u64, ts: u64) -> Result<(), Rejected> {
    let task = state
        .task_mut(uuid)
        .ok_or_else(|| Rejected::UnknownTask(uuid.to_string()))?;
    if task.state != TaskState::Error {
        return Err(Rejected::NotFailed {
            task: uuid.to_string(),
            state: task.state,
        });
    }
    assert!(!task.cancelled, "a cancelled task is not in error");
    for i in 0..task.steps.len() {
        let step = &task.steps[i];
        let failed = step.created && step.state == StepState::Error;
        // A batch instance cancelled because a sibling failed under `fail_fast` (the
        // only way a step of a task that was not cancelled is): it runs again as well,
        // or the batch's convergence could never run.
        let cut_short = step.created
            && step.state == StepState::Cancelled
            && crate::batch::strategy(task, i) == Some(FailureStrategy::FailFast);
        if failed || cut_short {
            reset(&mut task.steps[i], position, ts);
        }
    }
    task.completed_ms = None;
    crate::settle::settle(task, position, ts);
    assert!(
        task.state != TaskState::Error,
        "a rerun task with its failed steps pending is open"
    );
    Ok(())
}

/// An operator settled the failed instance `i` of a `fail_fast` batch (reset, resolved
/// or completed it): the siblings its failure cancelled go back to `pending`, as in a
/// rerun, or the batch's convergence would wait for ever. Under `fail_fast` the first
/// failure cancels every sibling not finished, so `i` was the batch's only failed one.
fn restore_cut_short(task: &mut crate::state::Task, i: usize, position: u64, ts: u64) {
    if crate::batch::strategy(task, i) != Some(FailureStrategy::FailFast) {
        return;
    }
    let parent = task.steps[i].batch.as_ref().map(|b| b.parent);
    for s in &mut task.steps {
        let sibling = s.created && s.batch.as_ref().map(|b| b.parent) == parent;
        assert!(
            !(sibling && s.state == StepState::Error),
            "fail_fast leaves one failed instance, the one settled"
        );
        if sibling && s.state == StepState::Cancelled {
            reset(s, position, ts);
        }
    }
}

/// A failed step starts again: its failure counts too (the attempt number does not,
/// so fencing by attempt still holds).
fn reset(step: &mut crate::state::Step, position: u64, ts: u64) {
    step.failures = 0;
    step.lease_losses = 0;
    step.worker = None;
    step.enter(StepState::Pending, position, ts);
}

fn change(
    step: &mut crate::state::Step,
    event: &Event,
    at: &StepRef,
    position: u64,
    ts: u64,
) -> Result<(), Rejected> {
    if step.state != StepState::Error || step.attempt != at.attempt {
        return Err(Rejected::Superseded {
            event: event.kind(),
            at: at.clone(),
            current: step.attempt,
            state: step.state,
        });
    }
    match event {
        Event::StepReset { .. } => reset(step, position, ts),
        Event::StepResolved {
            complete, result, ..
        } => {
            let to = match complete {
                true => StepState::Complete,
                false => StepState::ResolvedManually,
            };
            step.result = match complete {
                true => Some(result.clone().unwrap_or(Value::Null)),
                false => result.clone(),
            };
            step.enter(to, position, ts);
        }
        other => unreachable!("not an operator's event: {other:?}"),
    }
    Ok(())
}
