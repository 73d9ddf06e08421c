//! Steps nobody claims. An enqueued attempt waits for a worker that runs its handler in
//! its task's namespace; with none running, it waits for ever, in silence unless the
//! template's `lifecycle` fails it. The orchestrator warns of each attempt once it has
//! waited [`UNCLAIMED_WARN_MS`], and the metrics count them. Pure: the clock comes in.

use crate::event::StepRef;
use crate::machine::StepState;
use crate::state::State;

/// How long an enqueued attempt waits unclaimed before the orchestrator warns of it:
/// far beyond a busy worker's claim delay (its next poll of the log), short enough for
/// an operator who started no worker for a handler to hear it within the minute.
pub const UNCLAIMED_WARN_MS: u64 = 60_000;

/// An enqueued attempt no worker has claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unclaimed<'a> {
    pub at: StepRef,
    pub namespace: &'a str,
    pub handler: &'a str,
    /// How long it has waited, in milliseconds.
    pub waited_ms: u64,
}

/// Every enqueued attempt of an open task that has waited `after_ms` or more at `now_ms`
/// (since its step entered `enqueued`).
pub fn unclaimed(state: &State, now_ms: u64, after_ms: u64) -> Vec<Unclaimed<'_>> {
    let mut out = Vec::new();
    for task in state.open_task_iter() {
        for (i, step) in task.steps.iter().enumerate() {
            if !step.created || step.state != StepState::Enqueued {
                continue;
            }
            let entered = step.history.last().map_or(task.created_ms, |t| t.ts_ms);
            let waited_ms = now_ms.saturating_sub(entered);
            if waited_ms < after_ms {
                continue;
            }
            out.push(Unclaimed {
                at: StepRef {
                    task: task.uuid.clone(),
                    step: step.name.clone(),
                    attempt: step.attempt,
                },
                namespace: &task.template.namespace,
                handler: &task.spec(i).handler.callable,
                waited_ms,
            });
        }
    }
    out
}

/// The warning for `u`: what waits, for how long, and what would claim it.
pub fn warning(u: &Unclaimed<'_>) -> String {
    format!(
        "step {} of task {} (attempt {}) has waited {} s and no worker claimed it: none runs \
         handler {:?} in namespace {:?} (a worker claims only in the namespaces it serves, \
         with the handlers it registered: the built-in ones with `embarcadero worker \
         --namespace {}`, others with an SDK Worker)",
        u.at.step,
        u.at.task,
        u.at.attempt,
        u.waited_ms / 1000,
        u.handler,
        u.namespace,
        u.namespace
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Envelope, Event};
    use serde_json::json;

    const TWO_STEPS: &str = "name: two\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: \"odd \\\"name\\\"\"}}
  - {name: b, handler: {callable: h}}";

    /// Applies `event` as the log would have it at wall-clock `ts_ms`.
    fn apply(state: &mut State, ts_ms: u64, event: Event) {
        let env = Envelope {
            ts_ms,
            term: None,
            event,
        };
        let applied = state.apply(state.next_position, &env);
        assert!(applied.is_ok(), "{:?}: {applied:?}", env.event);
    }

    /// Task `t` created at 1000 ms, both steps enqueued by the fold then; step `b`
    /// claimed at `b_claimed_ms`.
    fn task_with_two_enqueued_steps(b_claimed_ms: u64) -> State {
        let mut state = State::default();
        let template = crate::validate::load(TWO_STEPS, None).unwrap();
        apply(&mut state, 1000, Event::TemplateRegistered { template });
        let created = Event::TaskCreated {
            task: "t".into(),
            namespace: "p".into(),
            name: "two".into(),
            version: "1".into(),
            context: json!({}),
            idempotency_key: None,
            identity: None,
            protocol: Some(2),
        };
        apply(&mut state, 1000, created);
        let at = StepRef {
            task: "t".into(),
            step: "b".into(),
            attempt: 1,
        };
        let claim = Event::StepClaimed {
            at,
            worker: "w".into(),
        };
        apply(&mut state, b_claimed_ms, claim);
        state
    }

    #[test]
    fn an_enqueued_attempt_counts_as_unclaimed_once_it_has_waited_long_enough() {
        let state = task_with_two_enqueued_steps(2000);
        assert!(unclaimed(&state, 1000 + UNCLAIMED_WARN_MS - 1, UNCLAIMED_WARN_MS).is_empty());
        let waiting = unclaimed(&state, 1000 + UNCLAIMED_WARN_MS, UNCLAIMED_WARN_MS);
        assert_eq!(
            waiting.len(),
            1,
            "the claimed step is not waiting: {waiting:?}"
        );
        let u = &waiting[0];
        assert_eq!((u.at.step.as_str(), u.at.attempt), ("a", 1));
        assert_eq!(
            (u.namespace, u.handler, u.waited_ms),
            ("p", "odd \"name\"", UNCLAIMED_WARN_MS)
        );
        let text = warning(u);
        assert!(text.contains("has waited 60 s"), "{text}");
        assert!(text.contains("namespace \"p\""), "{text}");
    }

    #[test]
    fn the_metrics_count_unclaimed_attempts_by_namespace_and_handler_with_labels_escaped() {
        let state = task_with_two_enqueued_steps(2000);
        let now = 1000 + UNCLAIMED_WARN_MS;
        let text = crate::metrics::render(&state, None, now);
        assert!(
            text.contains(
                "embarcadero_workflow_unclaimed_steps{namespace=\"p\",handler=\"odd \\\"name\\\"\"} 1"
            ),
            "{text}"
        );
        let early = crate::metrics::render(&state, None, now - 1);
        assert!(
            early.contains("embarcadero_workflow_unclaimed_steps 0"),
            "{early}"
        );
    }
}
