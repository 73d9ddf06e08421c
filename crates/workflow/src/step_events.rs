//! How one step event changes one step: the precondition each event needs (state and
//! attempt), checked before anything changes, and the step transition it causes. The
//! fencing rules live here: the first claim of an attempt wins, and a result, expiry or
//! decision about any attempt but the current one in the state it expects is refused.

use crate::event::{Checkpoint, Event, Outcome, StepRef};
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
    match event {
        Event::StepEnqueued(r) => enqueue(step, r, &at),
        Event::StepClaimed { at: r, worker } => claim(step, r, worker, &at),
        Event::StepResult {
            at: r,
            worker,
            outcome,
        } => record_result(step, r, worker, outcome, &at),
        Event::StepCheckpoint {
            at: r,
            worker,
            checkpoint,
        } => save_checkpoint(step, r, worker, checkpoint),
        Event::StepExpired { at: r, reason } => {
            expect(step, r, "expiry", StepState::InProgress)?;
            returned(step, expired(*reason, at.timeout_s), &at);
            Ok(())
        }
        Event::StepCompleted(r) => complete(step, r, &at),
        Event::RetryScheduled { at: r, due_ms } => schedule_retry(step, r, *due_ms, &at),
        Event::StepErrored { at: r, reason } => {
            expect(step, r, "error", StepState::EnqueuedForOrchestration)?;
            step.returned = None;
            step.last_error = Some(reason.clone());
            step.enter(StepState::Error, at.position, at.ts);
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

/// A worker's handler finished the attempt it holds the claim of.
fn record_result(
    step: &mut Step,
    r: &StepRef,
    worker: &str,
    outcome: &Outcome,
    at: &At,
) -> Result<(), Rejected> {
    expect(step, r, "result", StepState::InProgress)?;
    claim_held(step, r, worker)?;
    returned(step, outcome.into(), at);
    Ok(())
}

/// A worker's handler saved how far it got in the attempt it holds the claim of.
fn save_checkpoint(
    step: &mut Step,
    r: &StepRef,
    worker: &str,
    checkpoint: &Checkpoint,
) -> Result<(), Rejected> {
    expect(step, r, "checkpoint", StepState::InProgress)?;
    claim_held(step, r, worker)?;
    step.checkpoint = Some(checkpoint.clone());
    Ok(())
}

/// The orchestrator accepted the attempt's success: the step is complete with its value.
fn complete(step: &mut Step, r: &StepRef, at: &At) -> Result<(), Rejected> {
    expect(step, r, "completion", StepState::EnqueuedForOrchestration)?;
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
    step.enter(StepState::Complete, at.position, at.ts);
    Ok(())
}

/// The orchestrator will enqueue the next attempt at `due_ms`; an attempt that
/// succeeded is not retried.
fn schedule_retry(step: &mut Step, r: &StepRef, due_ms: u64, at: &At) -> Result<(), Rejected> {
    expect(step, r, "retry", StepState::EnqueuedForOrchestration)?;
    if matches!(step.returned, Some(Returned::Success(_))) {
        return Err(superseded(step, r, "retry of an attempt that succeeded"));
    }
    step.returned = None;
    step.retry_due_ms = Some(due_ms);
    step.enter(StepState::WaitingForRetry, at.position, at.ts);
    Ok(())
}

/// Only the worker whose claim won may report on the attempt.
fn claim_held(step: &Step, r: &StepRef, worker: &str) -> Result<(), Rejected> {
    if step.worker.as_deref() != Some(worker) {
        return Err(lost(step, r, worker));
    }
    Ok(())
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
    // Staleness fails unfinished steps only (`staleness::stale_steps` names no other
    // state): a `step_stale` naming the finished state its step is in would move it
    // out of it, along no legal edge (the fold asserted, and panicked, on it).
    if seen.is_terminal() {
        return Err(superseded(step, r, "staleness of a finished step"));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_event_naming_a_finished_state_is_refused_and_leaves_the_step_as_it_was() {
        // A `step_stale` seeing its step `complete` at its current attempt passed the
        // check of state and attempt, and the move complete -> error panicked the fold:
        // a poison event for every reader of the log.
        for &finished in StepState::ALL.iter().filter(|s| s.is_terminal()) {
            let mut step = Step::new("a", 0);
            step.created = true;
            step.attempt = 1;
            step.state = finished;
            let before = step.clone();
            let r = StepRef {
                task: "t".into(),
                step: "a".into(),
                attempt: 1,
            };
            let event = Event::StepStale {
                at: r,
                state: finished,
                reason: "stale: forged".into(),
            };
            let at = At {
                ready: true,
                timeout_s: 30,
                position: 9,
                ts: 9,
            };
            let refused = apply(&mut step, &event, at).unwrap_err();
            assert!(
                refused.to_string().contains("staleness of a finished step"),
                "{refused}"
            );
            assert_eq!(step, before, "{finished:?}");
        }
    }
}
