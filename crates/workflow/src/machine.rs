//! Tasker's task and step state machines: the states, and the edges a task or a step
//! may move along. The fold ([`crate::state`]) moves states only through [`legal_task`]
//! and [`legal_step`]; anything else is a bug it asserts against.

use serde::{Deserialize, Serialize};

/// Declares a state enum and `ALL`, its states in declaration order (one list, so
/// the two cannot disagree).
macro_rules! states {
    ($name:ident { $($state:ident),+ $(,)? }) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($state),+
        }

        impl $name {
            /// Every state, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$state),+];
        }
    };
}

states!(TaskState {
    Pending,
    Initializing,
    EnqueuingSteps,
    StepsInProcess,
    EvaluatingResults,
    WaitingForDependencies,
    WaitingForRetry,
    BlockedByFailures,
    Complete,
    Error,
    Cancelled,
    ResolvedManually,
});

states!(StepState {
    Pending,
    Enqueued,
    InProgress,
    EnqueuedForOrchestration,
    Complete,
    Error,
    Cancelled,
    ResolvedManually,
    WaitingForRetry,
});

impl TaskState {
    pub fn is_terminal(self) -> bool {
        use TaskState::*;
        matches!(self, Complete | Error | Cancelled | ResolvedManually)
    }

    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

impl StepState {
    pub fn is_terminal(self) -> bool {
        use StepState::*;
        matches!(self, Complete | Error | Cancelled | ResolvedManually)
    }

    /// Handed to a worker, or back from one and not decided yet.
    pub fn is_active(self) -> bool {
        use StepState::*;
        matches!(self, Enqueued | InProgress | EnqueuedForOrchestration)
    }

    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

/// The task edges. Of the terminal states only `error` has ways out: an operator's
/// reset or resolution of its failed step re-evaluates it, and an operator may resolve
/// the whole task by hand. Any unfinished task may be cancelled or resolved manually
/// (Tasker's `ResolveManually` from any non-terminal state, which includes its
/// `ManualResolution` of a task `blocked_by_failures`).
pub fn legal_task(from: TaskState, to: TaskState) -> bool {
    use TaskState::*;
    if from == Error {
        return matches!(to, EvaluatingResults | ResolvedManually);
    }
    if from.is_terminal() {
        return false;
    }
    if matches!(to, Cancelled | ResolvedManually) {
        return true;
    }
    match from {
        Pending => matches!(to, Initializing),
        Initializing => matches!(to, EnqueuingSteps | Complete | Error),
        EnqueuingSteps => matches!(to, StepsInProcess | EvaluatingResults),
        StepsInProcess => matches!(to, EvaluatingResults),
        EvaluatingResults => matches!(
            to,
            EnqueuingSteps
                | StepsInProcess
                | WaitingForDependencies
                | WaitingForRetry
                | BlockedByFailures
                | Complete
                | Error
        ),
        WaitingForDependencies => matches!(to, EvaluatingResults),
        WaitingForRetry => matches!(to, EnqueuingSteps | EvaluatingResults),
        BlockedByFailures => matches!(to, EvaluatingResults | Error),
        Complete | Error | Cancelled | ResolvedManually => false,
    }
}

/// The step edges. A failed step has the operator's ways out: reset (to `pending`),
/// resolved or completed manually; a cancelled one only the rerun of its task (a batch
/// instance cancelled by a sibling's failure under `fail_fast`).
pub fn legal_step(from: StepState, to: StepState) -> bool {
    use StepState::*;
    if from == Error {
        return matches!(to, Pending | ResolvedManually | Complete);
    }
    // A batch instance `fail_fast` cancelled comes back with its task's rerun.
    if from == Cancelled {
        return to == Pending;
    }
    if from.is_terminal() {
        return false;
    }
    if to == Cancelled {
        return true;
    }
    // Any unfinished step may fail for staleness (`step_stale`).
    if to == Error {
        return true;
    }
    match from {
        Pending => matches!(to, Enqueued),
        Enqueued => matches!(to, InProgress),
        InProgress => matches!(to, EnqueuedForOrchestration),
        EnqueuedForOrchestration => matches!(to, Complete | WaitingForRetry),
        WaitingForRetry => matches!(to, Enqueued),
        Complete | Error | Cancelled | ResolvedManually => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_have_no_way_out() {
        for s in [TaskState::Complete, TaskState::Error, TaskState::Cancelled] {
            assert!(!legal_task(s, TaskState::Pending));
            assert!(!legal_task(s, TaskState::Cancelled));
        }
        assert!(legal_task(TaskState::Error, TaskState::EvaluatingResults));
        assert!(!legal_step(StepState::Complete, StepState::Enqueued));
        assert!(legal_step(StepState::Error, StepState::Pending));
        assert!(!legal_step(StepState::Error, StepState::Enqueued));
        assert!(legal_step(StepState::InProgress, StepState::Cancelled));
        assert_eq!(TaskState::StepsInProcess.name(), "steps_in_process");
    }

    #[test]
    fn every_unfinished_or_failed_task_and_no_other_may_be_resolved_manually() {
        for &s in TaskState::ALL {
            let expected = !s.is_terminal() || s == TaskState::Error;
            assert_eq!(
                legal_task(s, TaskState::ResolvedManually),
                expected,
                "{s:?}"
            );
        }
        assert!(!legal_task(
            TaskState::ResolvedManually,
            TaskState::EvaluatingResults
        ));
    }
}
