//! A task's state, derived from its steps after every event that touches it, and the
//! route along legal task edges from the state it was in to the derived one (through
//! `evaluating_results` when there is no direct edge), each hop recorded with the event
//! that caused it. Complete and error are reached here, not by events of their own.

use crate::machine::{legal_task, StepState, TaskState};
use crate::state::{Task, Transition};

/// The state the task's steps put it in.
pub fn derive(task: &Task) -> TaskState {
    use StepState as S;
    let any = |f: &dyn Fn(StepState) -> bool| task.created_steps().any(|s| f(s.state));
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
    if any(&|s| s == S::WaitingForRetry) {
        return TaskState::WaitingForRetry;
    }
    TaskState::WaitingForDependencies
}

/// Moves the task to its derived state.
pub fn settle(task: &mut Task, position: u64, ts_ms: u64) {
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
