//! The events of the workflow log and their encoding. Every command and every decision
//! is one message of the order-5 event topic: one version byte (`1`), then the event as
//! compact JSON (`{"ts_ms":..,"kind":"step_claimed",...}`). A reader refuses a version
//! it does not know with [`DecodeError`] instead of guessing.

use crate::machine::StepState;
use crate::template::Template;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The encoding's version, the first byte of every message.
pub const ENCODING_VERSION: u8 = 1;

/// An event with the wall-clock time its publisher stamped it with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    pub ts_ms: u64,
    /// The orchestrator's term (see [`crate::leadership`]) on its decisions; a decision
    /// whose term is not the current one in log order is refused. Absent on every other
    /// event, and on decisions written before terms existed (term 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<u64>,
    #[serde(flatten)]
    pub event: Event,
}

/// Identifies one attempt of one step of one task.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StepRef {
    pub task: String,
    pub step: String,
    pub attempt: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// The API registered a (checked) template.
    TemplateRegistered { template: Template },
    /// The API accepted a task.
    TaskCreated {
        task: String,
        namespace: String,
        name: String,
        version: String,
        context: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        idempotency_key: Option<String>,
        /// The task's identity under its template's strategy ([`crate::identity`]); a
        /// second task with the same identity is refused. Absent in events written
        /// before identities (then the idempotency key, scoped by template, is it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        identity: Option<String>,
        /// Who moves the task's steps where no clock is needed ([`crate::settle`]):
        /// absent or 1, the orchestrator, by `step_enqueued` and `step_completed` events
        /// of its own; 2, the fold itself, at the position of the event that made a step
        /// ready or returned its success. Another value is refused.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        protocol: Option<u8>,
    },
    /// The orchestrator made attempt `attempt` of a step available to workers.
    StepEnqueued(StepRef),
    /// A worker asks for an attempt; the first claim in log order wins.
    StepClaimed {
        #[serde(flatten)]
        at: StepRef,
        worker: String,
    },
    /// A worker is alive (it holds claims).
    Heartbeat { worker: String },
    /// A batch worker's handler saved how far it got, for a later attempt to resume.
    StepCheckpoint {
        #[serde(flatten)]
        at: StepRef,
        worker: String,
        checkpoint: Checkpoint,
    },
    /// A worker's handler finished an attempt.
    StepResult {
        #[serde(flatten)]
        at: StepRef,
        worker: String,
        outcome: Outcome,
    },
    /// The orchestrator took an attempt back: its worker's lease ran out, or it ran
    /// past the step's timeout.
    StepExpired {
        #[serde(flatten)]
        at: StepRef,
        reason: Expiry,
    },
    /// The orchestrator accepted an attempt's success.
    StepCompleted(StepRef),
    /// The orchestrator will enqueue the next attempt at `due_ms` (wall clock).
    RetryScheduled {
        #[serde(flatten)]
        at: StepRef,
        due_ms: u64,
    },
    /// The orchestrator gave up on the step.
    StepErrored {
        #[serde(flatten)]
        at: StepRef,
        reason: String,
    },
    /// The orchestrator failed a step stuck in `state` past a `lifecycle` threshold
    /// (reason: which one).
    StepStale {
        #[serde(flatten)]
        at: StepRef,
        state: StepState,
        reason: String,
    },
    /// An operator reran a failed task: its failed steps start again.
    TaskRerun { task: String, reason: String },
    /// Someone cancelled the task.
    TaskCancelled { task: String, reason: String },
    /// An operator resolved the whole task by hand (Tasker's `resolve_manually` of a
    /// task): it ends `resolved_manually`, its unfinished steps are cancelled.
    TaskResolved { task: String, reason: String },
    /// An operator reset a failed step for retry (attempt: the failed one).
    StepReset {
        #[serde(flatten)]
        at: StepRef,
        reason: String,
    },
    /// An operator resolved a failed step: `resolve_manually` (dependents run, with no
    /// result from it) or `complete_manually` (with `result`).
    StepResolved {
        #[serde(flatten)]
        at: StepRef,
        reason: String,
        complete: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
    },
    /// An orchestrator bids for term `term` (the one after the current: the first bid
    /// in log order wins) or, holding it, renews it ([`crate::leadership`]). Encoded as
    /// `lease_term`: `term` is the envelope's (a decision's term), flattened beside it.
    OrchestratorLease {
        #[serde(rename = "lease_term")]
        term: u64,
        holder: String,
        /// The holder's lease of a worker's claim (its `--lease-ms`): a worker heartbeats
        /// at least every third of it, whatever its own `lease_ms` says. 0 (absent) from
        /// an orchestrator from before the field.
        #[serde(default, skip_serializing_if = "is_zero")]
        worker_lease_ms: u64,
        /// A renewal written with no task open: the lease it renews runs this long (the
        /// holder renews every third of it), unless another event follows it in the
        /// log, from which a standby counts the normal lease again. 0 (absent): the
        /// normal lease ([`crate::leadership`], "Quiet renewals").
        #[serde(default, skip_serializing_if = "is_zero")]
        quiet_lease_ms: u64,
    },
    /// The holder of term `term` gives its lease up (it is stopping): the term stays
    /// current with no holder, and any candidate may bid for the next one at once
    /// instead of waiting for the lease to lapse ([`crate::leadership`]).
    OrchestratorRelease {
        #[serde(rename = "lease_term")]
        term: u64,
        holder: String,
    },
}

/// Whether a number is 0: such a field is left out of an event's JSON.
fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How far a batch worker got: the cursor to resume at, the items done so far and
/// the partial results up to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub cursor: Value,
    pub items_done: u64,
    #[serde(default)]
    pub partial: Value,
}

/// What a handler's attempt produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Success {
        result: Value,
    },
    Failure {
        message: String,
        retryable: bool,
        /// The handler's own pause before a retry, overriding the backoff.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expiry {
    /// The claiming worker stopped heartbeating: retried, not counted as a failure.
    LeaseLost,
    /// The attempt ran past `timeout_seconds`: a failure, retried by the policy.
    Timeout,
}

impl Event {
    /// The attempt a step event is about.
    pub fn step_ref(&self) -> Option<&StepRef> {
        match self {
            Event::StepEnqueued(at) | Event::StepCompleted(at) => Some(at),
            Event::StepClaimed { at, .. }
            | Event::StepResult { at, .. }
            | Event::StepCheckpoint { at, .. }
            | Event::StepExpired { at, .. }
            | Event::RetryScheduled { at, .. }
            | Event::StepErrored { at, .. }
            | Event::StepStale { at, .. }
            | Event::StepReset { at, .. }
            | Event::StepResolved { at, .. } => Some(at),
            _ => None,
        }
    }

    /// The task a task-level event is about (step events: see [`Event::step_ref`]).
    pub fn task(&self) -> Option<&str> {
        match self {
            Event::TaskCreated { task, .. }
            | Event::TaskRerun { task, .. }
            | Event::TaskCancelled { task, .. }
            | Event::TaskResolved { task, .. } => Some(task),
            other => other.step_ref().map(|at| at.task.as_str()),
        }
    }

    /// The event's kind, as in its encoding.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::TemplateRegistered { .. } => "template_registered",
            Event::TaskCreated { .. } => "task_created",
            Event::StepEnqueued(_) => "step_enqueued",
            Event::StepClaimed { .. } => "step_claimed",
            Event::Heartbeat { .. } => "heartbeat",
            Event::StepResult { .. } => "step_result",
            Event::StepCheckpoint { .. } => "step_checkpoint",
            Event::StepExpired { .. } => "step_expired",
            Event::StepCompleted(_) => "step_completed",
            Event::RetryScheduled { .. } => "retry_scheduled",
            Event::StepErrored { .. } => "step_errored",
            Event::StepStale { .. } => "step_stale",
            Event::TaskRerun { .. } => "task_rerun",
            Event::TaskCancelled { .. } => "task_cancelled",
            Event::TaskResolved { .. } => "task_resolved",
            Event::StepReset { .. } => "step_reset",
            Event::StepResolved { .. } => "step_resolved",
            Event::OrchestratorLease { .. } => "orchestrator_lease",
            Event::OrchestratorRelease { .. } => "orchestrator_release",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty message")]
    Empty,
    #[error("encoding version {0} is not one this reader knows (it knows {ENCODING_VERSION})")]
    UnknownVersion(u8),
    #[error("not a workflow event: {0}")]
    Malformed(String),
}

pub fn encode(e: &Envelope) -> Vec<u8> {
    let mut out = vec![ENCODING_VERSION];
    // Serializing these types cannot fail: every map key is a string.
    serde_json::to_writer(&mut out, e).expect("events serialize");
    out
}

pub fn decode(bytes: &[u8]) -> Result<Envelope, DecodeError> {
    match bytes.split_first() {
        None => Err(DecodeError::Empty),
        Some((&ENCODING_VERSION, rest)) => {
            serde_json::from_slice(rest).map_err(|e| DecodeError::Malformed(e.to_string()))
        }
        Some((&v, _)) => Err(DecodeError::UnknownVersion(v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_unknown_versions_are_refused() {
        let e = Envelope {
            ts_ms: 7,
            term: None,
            event: Event::StepClaimed {
                at: StepRef {
                    task: "t".into(),
                    step: "s".into(),
                    attempt: 2,
                },
                worker: "w".into(),
            },
        };
        let bytes = encode(&e);
        assert_eq!(bytes[0], 1);
        assert!(std::str::from_utf8(&bytes[1..])
            .unwrap()
            .contains(r#""kind":"step_claimed""#));
        assert_eq!(decode(&bytes).unwrap(), e);
        let mut v2 = bytes.clone();
        v2[0] = 2;
        assert_eq!(decode(&v2), Err(DecodeError::UnknownVersion(2)));
        assert!(matches!(decode(b"\x01{}"), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn a_lease_event_and_a_decision_with_its_term_round_trip() {
        let lease = Envelope {
            ts_ms: 7,
            term: None,
            event: Event::OrchestratorLease {
                term: 3,
                holder: "o".into(),
                worker_lease_ms: 3000,
                quiet_lease_ms: 30_000,
            },
        };
        let decision = Envelope {
            ts_ms: 8,
            term: Some(3),
            event: Event::StepCompleted(StepRef {
                task: "t".into(),
                step: "s".into(),
                attempt: 1,
            }),
        };
        let release = Envelope {
            ts_ms: 9,
            term: None,
            event: Event::OrchestratorRelease {
                term: 3,
                holder: "o".into(),
            },
        };
        let text = String::from_utf8(encode(&release)[1..].to_vec()).unwrap();
        assert!(
            text.contains(r#""kind":"orchestrator_release""#) && text.contains(r#""lease_term":3"#),
            "{text}"
        );
        for e in [lease, decision, release] {
            assert_eq!(decode(&encode(&e)).unwrap(), e);
        }
        // A lease event from before `worker_lease_ms` reads as 0 (not told).
        let old = br#"{"ts_ms":1,"kind":"orchestrator_lease","lease_term":2,"holder":"o"}"#;
        let event = decode(&[&[1u8][..], &old[..]].concat()).unwrap().event;
        assert!(matches!(
            event,
            Event::OrchestratorLease {
                term: 2,
                worker_lease_ms: 0,
                quiet_lease_ms: 0,
                ..
            }
        ));
    }
}
