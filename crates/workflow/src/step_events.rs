//! How one step event changes one step: the precondition each event needs (state and
//! attempt), checked before anything changes, and the step transition it causes. The
//! fencing rules live here: the first claim of an attempt wins, and a result, expiry or
//! decision about any attempt but the current one in the state it expects is refused.

use crate::event::{Event, StepRef};
use crate::machine::StepState;
use crate::state::{expired, Rejected, Returned, Step};

/// Where an event lands: whether the step's dependencies are complete, its timeout,
/// and the event's position and timestamp.
pub(crate) struct At {
    pub ready: bool,
    pub timeout_s: u64,
    pub position: u64,
    pub ts: u64,
}

pub(crate) fn apply(step: &mut Step, event: &Event, at: At) -> Result<(), Rejected> {
    use StepState::*;
    match event {
        Event::StepEnqueued(r) => enqueue(step, r, &at),
        Event::StepClaimed { at: r, worker } => claim(step, r, worker, &at),
        Event::StepResult {
            at: r,
            worker,
            outcome,
        } => {
            expect(step, r, "result", InProgress)?;
            if step.worker.as_deref() != Some(worker) {
                return Err(lost(step, r, worker));
            }
            returned(step, outcome.into(), &at);
            Ok(())
        }
        Event::StepCheckpoint {
            at: r,
            worker,
            checkpoint,
        } => {
            expect(step, r, "checkpoint", InProgress)?;
            if step.worker.as_deref() != Some(worker) {
                return Err(lost(step, r, worker));
            }
            step.checkpoint = Some(checkpoint.clone());
            Ok(())
        }
        Event::StepExpired { at: r, reason } => {
            expect(step, r, "expiry", InProgress)?;
            returned(step, expired(*reason, at.timeout_s), &at);
            Ok(())
        }
        Event::StepCompleted(r) => {
            expect(step, r, "completion", EnqueuedForOrchestration)?;
            // Checked before the returned attempt is taken: a refused completion must
            // leave it for the orchestrator (taking it first dropped a lost lease or a
            // failure, and the step was dead-lettered instead of retried).
            if !matches!(step.returned, Some(Returned::Success(_))) {
                return Err(superseded(
                    step,
                    r,
                    "completion of an attempt that did not succeed",
                ));
            }
            let Some(Returned::Success(value)) = step.returned.take() else {
                unreachable!("checked above")
            };
            step.result = Some(value);
            step.enter(Complete, at.position, at.ts);
            Ok(())
        }
        Event::RetryScheduled { at: r, due_ms } => {
            expect(step, r, "retry", EnqueuedForOrchestration)?;
            if matches!(step.returned, Some(Returned::Success(_))) {
                return Err(superseded(step, r, "retry of an attempt that succeeded"));
            }
            step.returned = None;
            step.retry_due_ms = Some(*due_ms);
            step.enter(WaitingForRetry, at.position, at.ts);
            Ok(())
        }
        Event::StepErrored { at: r, reason } => {
            expect(step, r, "error", EnqueuedForOrchestration)?;
            step.returned = None;
            step.last_error = Some(reason.clone());
            step.enter(Error, at.position, at.ts);
            Ok(())
        }
        Event::StepStale {
            at: r,
            state,
            reason,
        } => stale(step, r, *state, reason, &at),
        other => unreachable!("not a step event: {other:?}"),
    }
}

/// A `lifecycle` threshold passed: the attempt fails for good, if it is still where
/// the orchestrator saw it (else something that came first in the log moved it on).
fn stale(
    step: &mut Step,
    r: &StepRef,
    seen: StepState,
    reason: &str,
    at: &At,
) -> Result<(), Rejected> {
    expect(step, r, "staleness", seen)?;
    step.returned = None;
    step.retry_due_ms = None;
    step.last_error = Some(reason.to_string());
    step.enter(StepState::Error, at.position, at.ts);
    Ok(())
}

fn enqueue(step: &mut Step, r: &StepRef, at: &At) -> Result<(), Rejected> {
    let fits = match step.state {
        // After a reset the step is pending again, at the attempt that failed.
        StepState::Pending => r.attempt == step.attempt + 1,
        StepState::WaitingForRetry => r.attempt == step.attempt + 1,
        _ => false,
    };
    if !fits {
        return Err(superseded(step, r, "enqueue"));
    }
    if !at.ready {
        return Err(Rejected::NotReady { at: r.clone() });
    }
    step.attempt = r.attempt;
    step.worker = None;
    step.retry_due_ms = None;
    step.enter(StepState::Enqueued, at.position, at.ts);
    Ok(())
}

fn claim(step: &mut Step, r: &StepRef, worker: &str, at: &At) -> Result<(), Rejected> {
    if step.attempt == r.attempt && step.state == StepState::InProgress {
        return Err(lost(step, r, worker));
    }
    expect(step, r, "claim", StepState::Enqueued)?;
    step.worker = Some(worker.to_string());
    step.enter(StepState::InProgress, at.position, at.ts);
    Ok(())
}

/// An attempt came back (a result or an expiry): the orchestrator decides what next.
fn returned(step: &mut Step, what: Returned, at: &At) {
    match &what {
        Returned::Failure { message, .. } => {
            step.failures += 1;
            step.last_error = Some(message.clone());
        }
        Returned::LeaseLost => step.lease_losses += 1,
        Returned::Success(_) => {}
    }
    step.returned = Some(what);
    step.enter(StepState::EnqueuedForOrchestration, at.position, at.ts);
}

fn expect(step: &Step, r: &StepRef, event: &'static str, state: StepState) -> Result<(), Rejected> {
    if step.attempt == r.attempt && step.state == state {
        Ok(())
    } else {
        Err(superseded(step, r, event))
    }
}

fn superseded(step: &Step, r: &StepRef, event: &'static str) -> Rejected {
    Rejected::Superseded {
        event,
        at: r.clone(),
        current: step.attempt,
        state: step.state,
    }
}

fn lost(step: &Step, r: &StepRef, worker: &str) -> Rejected {
    Rejected::ClaimLost {
        at: r.clone(),
        worker: worker.to_string(),
        winner: step.worker.clone().unwrap_or_default(),
    }
}
