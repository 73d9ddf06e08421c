//! The orchestrator's decisions: given the folded state and the clock, the events to
//! publish next (enqueue ready steps, accept or retry or fail returned attempts,
//! enqueue due retries, take back attempts whose worker's lease or whose timeout ran
//! out). Pure: time and liveness come in through [`Clock`], so a standby that takes
//! over decides the same from the same log.

use crate::batch::FailureStrategy;
use crate::event::{Event, Expiry, StepRef};
use crate::machine::{StepState, TaskState};
use crate::state::{Returned, State, Step, Task};
use crate::template::{StepTemplate, StepType, MAX_RETRY_DELAY_MS};
use serde_json::Value;

/// Lease losses of one step after which it errors ("worker unavailable").
pub const MAX_LEASE_LOSSES: u32 = 5;

/// What the orchestrator knows about time and workers, outside the log.
pub struct Clock<'a> {
    pub now_ms: u64,
    pub lease_ms: u64,
    /// When the orchestrator saw the claim of this attempt (its own clock).
    pub claimed_at: &'a dyn Fn(&StepRef) -> Option<u64>,
    /// When the orchestrator last saw this worker (claim, heartbeat or result).
    pub worker_seen: &'a dyn Fn(&str) -> Option<u64>,
}

/// The events to publish, and the earliest time something comes due (a retry).
pub fn decide(state: &State, clock: &Clock) -> (Vec<Event>, Option<u64>) {
    let mut out = Vec::new();
    let mut wake: Option<u64> = None;
    for task in state.open_task_iter() {
        let stale = crate::staleness::stale_steps(task, clock.now_ms);
        if !stale.is_empty() {
            // Failing them comes first; what else to do follows from the failures.
            out.extend(stale);
            continue;
        }
        let blocked = task.state == TaskState::BlockedByFailures;
        if !blocked {
            for i in task.ready_steps() {
                // 1 for a new step; after a reset, the attempt after the one that failed.
                out.push(Event::StepEnqueued(at(task, i, task.steps[i].attempt + 1)));
            }
        }
        for (i, step) in task.steps.iter().enumerate() {
            let spec = task.spec(i);
            // An `isolate` batch's other instances still retry while the task is blocked.
            let isolated = crate::batch::strategy(task, i) == Some(FailureStrategy::Isolate);
            let blocked = blocked && !isolated;
            if let Some(e) = decide_step(task, i, step, spec, clock, blocked, &mut wake) {
                out.push(e);
            }
        }
    }
    (out, wake)
}

fn decide_step(
    task: &Task,
    i: usize,
    step: &Step,
    spec: &StepTemplate,
    clock: &Clock,
    blocked: bool,
    wake: &mut Option<u64>,
) -> Option<Event> {
    match step.state {
        StepState::EnqueuedForOrchestration => Some(decide_returned(task, i, step, spec, clock)),
        StepState::WaitingForRetry if !blocked => {
            let due = step.retry_due_ms.unwrap_or(0);
            if due <= clock.now_ms {
                return Some(Event::StepEnqueued(at(task, i, step.attempt + 1)));
            }
            *wake = Some(wake.map_or(due, |w| w.min(due)));
            None
        }
        StepState::InProgress => {
            expiry(task, i, step, spec, clock).map(|reason| Event::StepExpired {
                at: at(task, i, step.attempt),
                reason,
            })
        }
        _ => None,
    }
}

/// Success is accepted; a failure is retried while the policy allows; a lost lease is
/// retried at once, up to [`MAX_LEASE_LOSSES`].
fn decide_returned(
    task: &Task,
    i: usize,
    step: &Step,
    spec: &StepTemplate,
    clock: &Clock,
) -> Event {
    let here = at(task, i, step.attempt);
    // A handler's `retry_after_ms` is any u64: capped as the policy's delays are.
    let retry = |delay: u64| Event::RetryScheduled {
        at: here.clone(),
        due_ms: clock.now_ms.saturating_add(delay.min(MAX_RETRY_DELAY_MS)),
    };
    let error = |reason: String| Event::StepErrored {
        at: here.clone(),
        reason,
    };
    match step.returned.as_ref() {
        Some(Returned::Success(result)) => match check_result(task, i, spec, result) {
            Ok(()) => Event::StepCompleted(here.clone()),
            Err(why) => error(why),
        },
        Some(Returned::LeaseLost) if step.lease_losses < MAX_LEASE_LOSSES => retry(0),
        Some(Returned::LeaseLost) => error(format!(
            "worker unavailable: the lease of its worker ran out {} times",
            step.lease_losses
        )),
        // The fold keeps a returned attempt until a decision takes it (a refused event
        // leaves it), so only a snapshot written by a fold from before that was fixed
        // can hold a step returned without one. Retrying could rerun a failure that was
        // not retryable; the operator decides (a reset retries it).
        None => error("the returned attempt's outcome was lost (an old snapshot)".into()),
        Some(Returned::Failure {
            message,
            retryable,
            retry_after_ms,
        }) => {
            let policy = &spec.retry;
            if !(*retryable && policy.retryable) {
                error(format!("failed, not retryable: {message}"))
            } else if step.failures >= policy.max_attempts {
                error(format!(
                    "max attempts ({}) reached: {message}",
                    policy.max_attempts
                ))
            } else {
                retry(retry_after_ms.unwrap_or_else(|| policy.delay_ms(step.failures)))
            }
        }
    }
}

/// A decision's result must name some of its branches (the fold creates them when it
/// applies the completion); other steps' results are not checked.
pub(crate) fn check_result(
    task: &Task,
    i: usize,
    spec: &StepTemplate,
    result: &Value,
) -> Result<(), String> {
    match spec.step_type {
        StepType::Decision => crate::branch::check_decision(task, i, result),
        StepType::Batchable => crate::batch::instance_cursors(task, i, result).map(|_| ()),
        _ => Ok(()),
    }
}

/// Whether an attempt in progress must be taken back, and why.
fn expiry(
    task: &Task,
    i: usize,
    step: &Step,
    spec: &StepTemplate,
    clock: &Clock,
) -> Option<Expiry> {
    let here = at(task, i, step.attempt);
    let claimed = (clock.claimed_at)(&here).unwrap_or(clock.now_ms);
    let seen = step
        .worker
        .as_deref()
        .and_then(|w| (clock.worker_seen)(w))
        .unwrap_or(claimed)
        .max(claimed);
    if clock.now_ms.saturating_sub(seen) > clock.lease_ms {
        return Some(Expiry::LeaseLost);
    }
    // The worker reports its own timeout; this is the backstop, a lease later.
    let limit = (spec.timeout().as_millis() as u64).saturating_add(clock.lease_ms);
    (clock.now_ms.saturating_sub(claimed) > limit).then_some(Expiry::Timeout)
}

fn at(task: &Task, i: usize, attempt: u32) -> StepRef {
    StepRef {
        task: task.uuid.clone(),
        step: task.steps[i].name.clone(),
        attempt,
    }
}
