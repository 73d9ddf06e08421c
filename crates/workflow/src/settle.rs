//! A task's state, derived from its steps after every event that touches it, and the
//! route along legal task edges from the state it was in to the derived one (through
//! `evaluating_results` when there is no direct edge), each hop recorded with the event
//! that caused it. Complete and error are reached here, not by events of their own.
//!
//! For a task of protocol 2 ([`Task::protocol`]) settling also makes the moves that
//! need no clock and no liveness, which the orchestrator makes by events of its own
//! under protocol 1: a returned success that passes its check is completed, and every
//! ready step is enqueued (attempt after its last), at the position of the event that
//! allowed it. Every reader makes the same moves at the same position, so this is as
//! deterministic as the events it replaces, and it saves each step two trips through
//! the log. Retries, expiries, errors and staleness stay the orchestrator's (they need
//! its clock or its policy decisions).

use crate::event::{Event, StepRef};
use crate::machine::{legal_task, StepState, TaskState};
use crate::state::{Returned, Task, Transition};

/// The state the task's steps put it in.
///
/// When nothing of the task is ready, at a worker or returned, and nothing failed, it
/// waits: `waiting_for_dependencies` while some of its steps are pending behind
/// dependencies that are not finished (behind a step waiting out its retry's backoff,
/// or behind steps that can no longer finish by themselves, such as batch instances
/// `fail_fast` cancelled before an operator reset their failed sibling), else
/// `waiting_for_retry` (its only unfinished steps wait for their retry). Tasker's
/// `execution_status` falls to `waiting_for_dependencies` in the same idle cases
/// (nothing ready, nothing in process, no permanent failure); we keep
/// `waiting_for_retry` for a task whose remaining work is only retries.
pub fn derive(task: &Task) -> TaskState {
    use StepState as S;
    let any = |f: &dyn Fn(StepState) -> bool| task.created_steps().any(|s| f(s.state));
    if task.resolution.is_some() {
        return TaskState::ResolvedManually;
    }
    if task.cancelled {
        return TaskState::Cancelled;
    }
    // A batch instance that failed under `continue_on_failure` neither fails the task
    // nor keeps it from completing.
    let live = |i: &usize| task.steps[*i].created && !crate::batch::tolerated(task, *i);
    let mut counted = (0..task.steps.len()).filter(live);
    if counted.all(|i| matches!(task.steps[i].state, S::Complete | S::ResolvedManually)) {
        return TaskState::Complete;
    }
    let failed = (0..task.steps.len())
        .filter(live)
        .any(|i| task.steps[i].state == S::Error);
    if failed {
        return match any(&|s| s.is_active()) {
            true => TaskState::BlockedByFailures,
            false => TaskState::Error,
        };
    }
    if any(&|s| s == S::EnqueuedForOrchestration) {
        return TaskState::EvaluatingResults;
    }
    if task.ready_steps().next().is_some() {
        return TaskState::EnqueuingSteps;
    }
    if any(&|s| matches!(s, S::Enqueued | S::InProgress)) {
        return TaskState::StepsInProcess;
    }
    // What is left waits: for a retry only, or (pending steps, or live steps that
    // were cancelled when a sibling failed and were not brought back) for dependencies.
    match any(&|s| s == S::WaitingForRetry) && !any(&|s| s == S::Pending) {
        true => TaskState::WaitingForRetry,
        false => TaskState::WaitingForDependencies,
    }
}

/// Moves the task to its derived state (under protocol 2, with the fold's own moves).
pub fn settle(task: &mut Task, position: u64, ts_ms: u64) {
    move_to_derived(task, position, ts_ms);
    if task.protocol >= 2 {
        fold_moves(task, position, ts_ms);
    }
}

/// Protocol 2: completes the successes that pass their check, then (unless the task
/// is finished or blocked by failures, where the orchestrator would not either)
/// enqueues every ready step; the task settles after each, so its audit trail passes
/// through `evaluating_results` and `enqueuing_steps` as under protocol 1.
fn fold_moves(task: &mut Task, position: u64, ts: u64) {
    if task.state.is_terminal() {
        return;
    }
    let accepted: Vec<usize> = (0..task.steps.len())
        .filter(|&i| acceptable(task, i))
        .collect();
    for &i in &accepted {
        let at = step_ref(task, i, task.steps[i].attempt);
        move_step(task, i, &Event::StepCompleted(at), position, ts);
        crate::state::consequences(task, i, position, ts);
    }
    if !accepted.is_empty() {
        move_to_derived(task, position, ts);
    }
    if task.state.is_terminal() || task.state == TaskState::BlockedByFailures {
        return;
    }
    let ready: Vec<usize> = task.ready_steps().collect();
    for &i in &ready {
        let at = step_ref(task, i, task.steps[i].attempt + 1);
        move_step(task, i, &Event::StepEnqueued(at), position, ts);
    }
    if !ready.is_empty() {
        move_to_derived(task, position, ts);
    }
}

/// A returned success the orchestrator would complete ([`crate::decide`]'s check).
fn acceptable(task: &Task, i: usize) -> bool {
    let s = &task.steps[i];
    let Some(Returned::Success(result)) = &s.returned else {
        return false;
    };
    s.created
        && s.state == StepState::EnqueuedForOrchestration
        && crate::decide::check_result(task, i, task.spec(i), result).is_ok()
}

/// Applies a move the fold decided through the same checks as the event it stands
/// for; it was chosen because it fits, so a refusal is a bug.
fn move_step(task: &mut Task, i: usize, event: &Event, position: u64, ts: u64) {
    let how = crate::step_events::At {
        ready: true,
        timeout_s: task.spec(i).timeout_seconds,
        position,
        ts,
    };
    let moved = crate::step_events::apply(&mut task.steps[i], event, how);
    assert!(
        moved.is_ok(),
        "the fold's own {event:?} was refused: {moved:?}"
    );
}

fn step_ref(task: &Task, i: usize, attempt: u32) -> StepRef {
    StepRef {
        task: task.uuid.clone(),
        step: task.steps[i].name.clone(),
        attempt,
    }
}

fn move_to_derived(task: &mut Task, position: u64, ts_ms: u64) {
    let target = derive(task);
    task.updated_ms = ts_ms;
    while task.state != target {
        let next = next_hop(task.state, target);
        assert!(
            legal_task(task.state, next),
            "illegal task transition {:?} -> {next:?} of {}",
            task.state,
            task.uuid
        );
        task.history.push(Transition {
            from: task.state,
            to: next,
            position,
            ts_ms,
        });
        task.state = next;
    }
    if target.is_terminal() {
        task.completed_ms.get_or_insert(ts_ms);
    }
}

fn next_hop(from: TaskState, to: TaskState) -> TaskState {
    if from == TaskState::Pending {
        TaskState::Initializing
    } else if legal_task(from, to) || from == TaskState::EvaluatingResults {
        to
    } else {
        TaskState::EvaluatingResults
    }
}
