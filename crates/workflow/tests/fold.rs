//! Property tests of the fold: random event sequences (commands, claims, results,
//! expiries, decisions, with stale attempts and rival workers mixed in, and the
//! orchestrator's own decisions interleaved) against the invariants of the design.

use embarcadero_workflow::decide::{decide, Clock};
use embarcadero_workflow::machine::{legal_step, legal_task};
use embarcadero_workflow::validate::load;
use embarcadero_workflow::{Envelope, Event, Outcome, State, StepRef};
use proptest::prelude::*;
use serde_json::json;
use std::collections::BTreeMap;

const DIAMOND: &str = "name: diamond\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: x}, retry: {max_attempts: 2, backoff: none}}
  - {name: b, dependencies: [a], handler: {callable: x}}
  - {name: c, dependencies: [a], handler: {callable: x}}
  - {name: d, dependencies: [b, c], handler: {callable: x}}
";
const TASKS: [&str; 2] = ["t1", "t2"];
const STEPS: [&str; 4] = ["a", "b", "c", "d"];
const WORKERS: [&str; 2] = ["w1", "w2"];

/// One move of the generated history.
#[derive(Debug, Clone)]
enum Op {
    /// Whatever the orchestrator would decide now (at `now_ms`; with `expire`, every
    /// claim and worker was last seen at 0, so leases of 100 ms run out).
    Decide {
        now_ms: u64,
        expire: bool,
    },
    Claim {
        task: usize,
        step: usize,
        attempt: u32,
        worker: usize,
    },
    Result {
        task: usize,
        step: usize,
        attempt: u32,
        worker: usize,
        ok: bool,
    },
    Raw(Box<Event>),
}

fn at(task: usize, step: usize, attempt: u32) -> StepRef {
    StepRef {
        task: TASKS[task].into(),
        step: STEPS[step].into(),
        attempt,
    }
}

fn op() -> impl Strategy<Value = Op> {
    let t = 0..TASKS.len();
    let s = 0..STEPS.len();
    let a = 1u32..4;
    let w = 0..WORKERS.len();
    prop_oneof![
        4 => (0u64..1000, any::<bool>()).prop_map(|(now_ms, e)| Op::Decide { now_ms, expire: e }),
        4 => (t.clone(), s.clone(), a.clone(), w.clone()).prop_map(|(task, step, attempt, worker)| Op::Claim { task, step, attempt, worker }),
        4 => (t.clone(), s.clone(), a.clone(), w, any::<bool>()).prop_map(|(task, step, attempt, worker, ok)| Op::Result { task, step, attempt, worker, ok }),
        1 => (t.clone(), s.clone(), a.clone()).prop_map(|(task, step, attempt)| Op::Raw(Box::new(Event::StepCompleted(at(task, step, attempt))))),
        1 => (t.clone(), s, a).prop_map(|(task, step, attempt)| Op::Raw(Box::new(Event::StepEnqueued(at(task, step, attempt))))),
        1 => t.prop_map(|task| Op::Raw(Box::new(Event::TaskCancelled { task: TASKS[task].into(), reason: "test".into() }))),
    ]
}

/// The events a history stands for, each computed against the state before it (so the
/// orchestrator's decisions are those it would make at that point).
fn events(ops: &[Op]) -> Vec<Envelope> {
    let template = load(DIAMOND, None).unwrap();
    let mut out = vec![Event::TemplateRegistered { template }];
    for t in TASKS {
        out.push(Event::TaskCreated {
            task: t.into(),
            namespace: "p".into(),
            name: "diamond".into(),
            version: "1".into(),
            context: json!({}),
            idempotency_key: None,
        });
    }
    let mut state = State::default();
    let mut envs: Vec<Envelope> = Vec::new();
    let push = |state: &mut State, envs: &mut Vec<Envelope>, event: Event| {
        let env = Envelope {
            ts_ms: envs.len() as u64,
            event,
        };
        let _ = state.apply(envs.len() as u64, &env);
        envs.push(env);
    };
    for e in out {
        push(&mut state, &mut envs, e);
    }
    for op in ops {
        for e in op_events(&state, op) {
            push(&mut state, &mut envs, e);
        }
    }
    envs
}

fn op_events(state: &State, op: &Op) -> Vec<Event> {
    match op.clone() {
        Op::Decide { now_ms, expire } => {
            let seen = if expire { Some(0) } else { Some(now_ms) };
            let clock = Clock {
                now_ms,
                lease_ms: 100,
                claimed_at: &|_| seen,
                worker_seen: &|_| seen,
            };
            decide(state, &clock).0
        }
        Op::Claim {
            task,
            step,
            attempt,
            worker,
        } => vec![Event::StepClaimed {
            at: at(task, step, attempt),
            worker: WORKERS[worker].into(),
        }],
        Op::Result {
            task,
            step,
            attempt,
            worker,
            ok,
        } => {
            let outcome = match ok {
                true => Outcome::Success {
                    result: json!(attempt),
                },
                false => Outcome::Failure {
                    message: "no".into(),
                    retryable: true,
                    retry_after_ms: None,
                },
            };
            vec![Event::StepResult {
                at: at(task, step, attempt),
                worker: WORKERS[worker].into(),
                outcome,
            }]
        }
        Op::Raw(e) => vec![*e],
    }
}

fn fold(envs: &[Envelope]) -> (State, Vec<bool>) {
    let mut s = State::default();
    let applied = envs
        .iter()
        .enumerate()
        .map(|(i, e)| s.apply(i as u64, e).is_ok())
        .collect();
    (s, applied)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn replaying_any_prefix_twice_gives_the_same_state(ops in prop::collection::vec(op(), 0..60), cut in 0usize..200) {
        let envs = events(&ops);
        let prefix = &envs[..cut.min(envs.len())];
        prop_assert_eq!(fold(prefix), fold(prefix));
    }

    #[test]
    fn states_move_only_along_legal_edges_and_results_are_accepted_once(ops in prop::collection::vec(op(), 0..60)) {
        let envs = events(&ops);
        let (state, applied) = fold(&envs);
        for task in state.tasks.values() {
            for t in &task.history {
                prop_assert!(legal_task(t.from, t.to), "{:?} -> {:?}", t.from, t.to);
            }
            for step in &task.steps {
                for t in &step.history {
                    prop_assert!(legal_step(t.from, t.to), "{:?} -> {:?}", t.from, t.to);
                }
            }
        }
        let mut accepted: BTreeMap<(String, String, &str, u32), u32> = BTreeMap::new();
        for (env, ok) in envs.iter().zip(&applied) {
            let kind = env.event.kind();
            if let (true, Some(r)) = (*ok, env.event.step_ref()) {
                let attempt = if kind == "step_completed" { 0 } else { r.attempt };
                *accepted.entry((r.task.clone(), r.step.clone(), kind, attempt)).or_default() += 1;
            }
        }
        for ((task, step, kind, attempt), n) in accepted {
            if matches!(kind, "step_claimed" | "step_result" | "step_completed") {
                prop_assert_eq!(n, 1, "{} {}/{} attempt {} accepted {} times", kind, task, step, attempt, n);
            }
        }
    }

    #[test]
    fn a_finished_task_never_changes_again_but_for_its_refusals(ops in prop::collection::vec(op(), 0..60)) {
        let envs = events(&ops);
        let mut s = State::default();
        let mut finished: BTreeMap<String, embarcadero_workflow::Task> = BTreeMap::new();
        for (i, e) in envs.iter().enumerate() {
            let _ = s.apply(i as u64, e);
            for (uuid, t) in &finished {
                prop_assert_eq!(&without_refusals(&s.tasks[uuid]), t);
            }
            for t in s.tasks.values().filter(|t| t.state.is_terminal()) {
                finished.entry(t.uuid.clone()).or_insert_with(|| without_refusals(t));
            }
        }
    }
}

/// A task without its steps' audit of refused events (which a finished task keeps
/// collecting: late results are recorded, not applied).
fn without_refusals(t: &embarcadero_workflow::Task) -> embarcadero_workflow::Task {
    let mut t = t.clone();
    for s in &mut t.steps {
        s.refused.clear();
    }
    t
}

#[test]
fn the_first_claim_wins_and_a_late_result_of_a_superseded_attempt_is_refused() {
    let envs = events(&[
        Op::Decide {
            now_ms: 0,
            expire: false,
        },
        Op::Claim {
            task: 0,
            step: 0,
            attempt: 1,
            worker: 0,
        },
        Op::Claim {
            task: 0,
            step: 0,
            attempt: 1,
            worker: 1,
        },
        Op::Decide {
            now_ms: 500,
            expire: true,
        },
        Op::Decide {
            now_ms: 500,
            expire: true,
        },
        Op::Decide {
            now_ms: 500,
            expire: true,
        },
        Op::Claim {
            task: 0,
            step: 0,
            attempt: 2,
            worker: 1,
        },
        Op::Result {
            task: 0,
            step: 0,
            attempt: 1,
            worker: 0,
            ok: true,
        },
        Op::Result {
            task: 0,
            step: 0,
            attempt: 2,
            worker: 1,
            ok: true,
        },
        Op::Decide {
            now_ms: 600,
            expire: false,
        },
    ]);
    let (state, _) = fold(&envs);
    let a = state.tasks["t1"].step("a").unwrap();
    assert_eq!(a.state, embarcadero_workflow::StepState::Complete);
    assert_eq!(
        (a.attempt, a.lease_losses, a.result.clone()),
        (2, 1, Some(json!(2)))
    );
    assert_eq!(a.worker.as_deref(), Some("w2"));
    assert!(
        a.refused.iter().any(|r| r.contains("lost to w1")),
        "{:?}",
        a.refused
    );
    assert!(
        a.refused
            .iter()
            .any(|r| r.contains("step_result of attempt 1")),
        "{:?}",
        a.refused
    );
}
