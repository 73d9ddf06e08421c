//! Property test of the fold against untrusted log content. Any client that can publish
//! to the event topic can write any structurally valid event, so this test folds
//! sequences of events whose fields come from small pools (task ids, step names,
//! attempts, workers, terms, timestamps, positions, with the extremes: 0, `u32::MAX`,
//! `u64::MAX`, empty and huge strings), templates that never passed
//! `validate::check` among the registrations, mixed with realistic flows (claims and
//! results of the current attempts, the orchestrator's own decisions, lease bids). Each
//! event goes through `encode` and `decode` as it would through the log. It checks that
//! the fold never panics, that a refused event changes nothing but the count and audit
//! of refusals, and the promises of the fold's own comments after every event; and that
//! a snapshot of whatever state such a log folds to decodes to the same state.

mod common;
use common::{without_audit, without_refusals};
use embarcadero_workflow::decide::{decide, Clock};
use embarcadero_workflow::event::{self, Checkpoint, Expiry};
use embarcadero_workflow::machine::{legal_step, legal_task};
use embarcadero_workflow::settle::derive;
use embarcadero_workflow::snapshot;
use embarcadero_workflow::validate::load;
use embarcadero_workflow::{Envelope, Event, Outcome, State, StepRef, StepState, Task, Template};
use embarcadero_workflow::{Rejected, TaskState};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::sync::OnceLock;

/// A string longer than any field is meant to hold.
fn huge() -> String {
    "x".repeat(4096)
}

/// Tasks `t1` to `t6`, the empty id and a huge one.
fn task_id(i: usize) -> String {
    match i % TASK_IDS {
        6 => String::new(),
        7 => huge(),
        n => format!("t{}", n + 1),
    }
}
const TASK_IDS: usize = 8;

/// Steps of every template below, a name none has, the empty name and a huge one.
fn step_name(i: usize) -> String {
    const NAMES: [&str; 14] = [
        "a", "b", "c", "d", "b1", "an", "w", "w_001", "w_002", "agg", "j", "e", "zz", "",
    ];
    NAMES.get(i).map_or_else(huge, |s| s.to_string())
}
const STEP_NAMES: usize = 15;

const ATTEMPTS: [u32; 6] = [0, 1, 2, 3, 4, u32::MAX];
const WORKERS: [&str; 3] = ["w1", "w2", ""];
const TIMES: [u64; 5] = [0, 1, 60_000, u64::MAX - 1, u64::MAX];

/// Templates as the API checks them (`validate::load`).
const CHECKED: [&str; 3] = [
    "name: diamond\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: x}, retry: {max_attempts: 2, backoff: none}}
  - {name: b, dependencies: [a], handler: {callable: x}}
  - {name: c, dependencies: [a], handler: {callable: x}}
  - {name: d, dependencies: [b, c], handler: {callable: x}}
",
    "name: cond\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: x}}
  - {name: d, type: decision, dependencies: [a], handler: {callable: x}}
  - {name: b1, dependencies: [d], handler: {callable: x}}
  - {name: e, dependencies: [d], handler: {callable: x}}
  - {name: j, type: deferred_convergence, dependencies: [b1, e], handler: {callable: x}}
lifecycle: {max_duration_minutes: 1}
",
    "name: batch\nnamespace: p\nversion: '1'\nsteps:
  - {name: an, type: batchable, handler: {callable: x}, batch_config: {failure_strategy: fail_fast}}
  - {name: w, type: batch_worker, dependencies: [an], handler: {callable: x}, retry: {max_attempts: 1}}
  - {name: agg, type: deferred_convergence, dependencies: [w], handler: {callable: x}}
",
];

/// One step of an unchecked template, as JSON.
fn st(name: &str, kind: &str, deps: &[&str]) -> Value {
    json!({"name": name, "type": kind, "dependencies": deps, "handler": {"callable": "x"}})
}

/// Templates that `validate::check` refuses, or that it accepts only in other
/// combinations, written straight into the log: the fold must survive them.
fn unchecked() -> Vec<Value> {
    let s = "standard";
    let with = |name: &str, steps: Vec<Value>| json!({"name": name, "namespace": "p", "version": "1", "steps": steps});
    let mut extreme = st("a", s, &[]);
    extreme["timeout_seconds"] = json!(u64::MAX);
    extreme["retry"] =
        json!({"max_attempts": 0, "backoff_base_ms": u64::MAX, "max_backoff_ms": u64::MAX});
    let mut bad_batch = st("an", "batchable", &[]);
    bad_batch["batch_config"] = json!({"failure_strategy": "shrug"});
    let mut long = with("extreme", vec![extreme, st("b", s, &["a", "a", "zz"])]);
    long["lifecycle"] = json!({"max_duration_minutes": -1.0, "max_steps_in_process_minutes": 0.0,
        "max_waiting_for_retry_minutes": 1e300, "max_waiting_for_dependencies_minutes": 5e-324});
    long["identity_strategy"] = json!("caller_provided");
    long["input_schema"] = json!({"type": 12});
    vec![
        with(
            "cycle",
            vec![st("a", s, &["b"]), st("b", s, &["a"]), st("c", s, &[])],
        ),
        with(
            "selfdep",
            vec![
                st("a", s, &["a"]),
                st("b", s, &["zz"]),
                st("c", "deferred_convergence", &["a", "b", "c"]),
            ],
        ),
        with(
            "dups",
            vec![st("a", s, &[]), st("a", s, &["a"]), st("b", s, &["a"])],
        ),
        with("empty", vec![]),
        with(
            "batchmess",
            vec![
                bad_batch,
                st("w", "batch_worker", &["an"]),
                st("w_001", s, &[]),
                st("agg", s, &["w"]),
                st("j", "deferred_convergence", &[]),
                st("b", "batch_worker", &[]),
            ],
        ),
        with(
            "decisions",
            vec![
                st("d", "decision", &[]),
                st("b1", "batch_worker", &["d"]),
                st("e", "decision", &["d", "b1"]),
                st("j", "deferred_convergence", &["e", "d"]),
                st("an", "batchable", &["d"]),
                st("w", "batch_worker", &["an", "d"]),
            ],
        ),
        long,
        // The same key as a checked template, other content: a conflict.
        with("diamond", vec![st("a", s, &[])]),
    ]
}

/// The checked templates, then the unchecked ones (built once).
fn templates() -> &'static [Template] {
    static ALL: OnceLock<Vec<Template>> = OnceLock::new();
    ALL.get_or_init(|| {
        let checked = CHECKED.iter().map(|t| load(t, None).unwrap());
        let raw = unchecked().into_iter();
        checked
            .chain(raw.map(|v| serde_json::from_value(v).unwrap()))
            .collect()
    })
}

const TEMPLATE_NAMES: [&str; 12] = [
    "diamond",
    "cond",
    "batch",
    "cycle",
    "selfdep",
    "dups",
    "empty",
    "batchmess",
    "decisions",
    "extreme",
    "nope",
    "",
];

/// What a step's handler may return: decisions naming branches or not, batch results
/// in and out of bounds, and values of no particular shape.
fn result(i: usize) -> Value {
    match i % 8 {
        0 => json!({"step_names": ["b1"]}),
        1 => json!({"step_names": ["e", "zz", "b1"]}),
        2 => json!({"cursors": [1, 2], "worker_count": 2}),
        3 => json!({"cursors": vec![0; 1001]}),
        4 => json!({"type": "no_batches"}),
        5 => json!({"cursors": [1], "worker_count": u64::MAX}),
        6 => Value::Null,
        _ => json!({"step_names": "b1", "cursors": 7}),
    }
}

fn outcome(ok: bool, i: usize) -> Outcome {
    match ok {
        true => Outcome::Success { result: result(i) },
        false => Outcome::Failure {
            message: if i.is_multiple_of(2) {
                "no".into()
            } else {
                huge()
            },
            retryable: !i.is_multiple_of(3),
            retry_after_ms: [None, Some(0), Some(u64::MAX)][i % 3],
        },
    }
}

/// The fields a generated event is made of, each an index into its pool.
#[derive(Debug, Clone, Copy)]
struct Pick {
    task: usize,
    step: usize,
    attempt: usize,
    worker: usize,
    n: usize,
    ok: bool,
}

fn pick() -> impl Strategy<Value = Pick> {
    (
        0..TASK_IDS,
        0..STEP_NAMES,
        0..ATTEMPTS.len(),
        0..WORKERS.len(),
        0..64usize,
        any::<bool>(),
    )
        .prop_map(|(task, step, attempt, worker, n, ok)| Pick {
            task,
            step,
            attempt,
            worker,
            n,
            ok,
        })
}

/// The envelope's term: absent, a fixed one, or the current term (a decision of the
/// leader).
#[derive(Debug, Clone, Copy)]
enum Term {
    Absent,
    Fixed(u64),
    Current,
}

fn term() -> impl Strategy<Value = Term> {
    prop_oneof![
        3 => Just(Term::Current),
        2 => Just(Term::Absent),
        1 => prop::sample::select(vec![0, 1, 2, u64::MAX]).prop_map(Term::Fixed),
    ]
}

/// One move of the generated history.
#[derive(Debug, Clone)]
enum Op {
    /// An event of kind `kind` (an index into [`raw_event`]'s kinds) from the pools.
    Raw { kind: u8, pick: Pick, term: Term },
    /// A claim, result or checkpoint of the step's current attempt (`pick.n % 3`).
    Follow { pick: Pick },
    /// Whatever the orchestrator decides at `TIMES[now]`, stamped with the current term.
    Decide { now: usize, expire: bool },
    /// A bid for the next term, or a renewal of the current one (by whoever).
    Lease {
        next: bool,
        holder: usize,
        quiet: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..22, pick(), term()).prop_map(|(kind, pick, term)| Op::Raw { kind, pick, term }),
        6 => pick().prop_map(|pick| Op::Follow { pick }),
        4 => (0..TIMES.len(), any::<bool>()).prop_map(|(now, expire)| Op::Decide { now, expire }),
        1 => (any::<bool>(), 0..WORKERS.len(), prop::sample::select(vec![0, 30_000, u64::MAX]))
            .prop_map(|(next, holder, quiet)| Op::Lease { next, holder, quiet }),
    ]
}

fn at(p: &Pick) -> StepRef {
    StepRef {
        task: task_id(p.task),
        step: step_name(p.step),
        attempt: ATTEMPTS[p.attempt],
    }
}

fn reason(p: &Pick) -> String {
    if p.ok {
        "test".into()
    } else {
        huge()
    }
}

/// Commands and registrations: templates (checked or not) and tasks.
fn command(kind: u8, p: &Pick) -> Event {
    let task = task_id(p.task);
    match kind {
        0 => Event::TemplateRegistered {
            template: templates()[p.n % templates().len()].clone(),
        },
        1 | 2 => Event::TaskCreated {
            task,
            namespace: "p".into(),
            name: TEMPLATE_NAMES[p.n % TEMPLATE_NAMES.len()].into(),
            version: "1".into(),
            context: [json!({}), Value::Null, json!({"k": huge()})][p.attempt % 3].clone(),
            idempotency_key: [None, Some("k".into()), Some(String::new())][p.worker].clone(),
            identity: (!p.ok).then(|| "same".into()),
            protocol: [None, Some(0), Some(1), Some(2), Some(u8::MAX), Some(2)][p.attempt],
        },
        3 => Event::TaskCancelled {
            task,
            reason: reason(p),
        },
        4 => Event::TaskResolved {
            task,
            reason: reason(p),
        },
        5 => Event::TaskRerun {
            task,
            reason: reason(p),
        },
        _ => Event::Heartbeat {
            worker: WORKERS[p.worker].into(),
        },
    }
}

/// Any event, from the pools.
fn raw_event(kind: u8, p: &Pick) -> Event {
    let (at, worker) = (at(p), WORKERS[p.worker].to_string());
    match kind {
        0..=6 => command(kind, p),
        7 => Event::StepEnqueued(at),
        8 => Event::StepClaimed { at, worker },
        9 | 10 => Event::StepResult {
            at,
            worker,
            outcome: outcome(p.ok, p.n),
        },
        11 => Event::StepCheckpoint {
            at,
            worker,
            checkpoint: Checkpoint {
                cursor: result(p.n),
                items_done: TIMES[p.n % TIMES.len()],
                partial: json!({"k": huge()}),
            },
        },
        12 => Event::StepExpired {
            at,
            reason: [Expiry::LeaseLost, Expiry::Timeout][p.n % 2],
        },
        13 => Event::StepCompleted(at),
        14 => Event::RetryScheduled {
            at,
            due_ms: TIMES[p.n % TIMES.len()],
        },
        15 => Event::StepErrored {
            at,
            reason: reason(p),
        },
        16 => Event::StepStale {
            at,
            state: StepState::ALL[p.n % StepState::ALL.len()],
            reason: reason(p),
        },
        17 => Event::StepReset {
            at,
            reason: reason(p),
        },
        18 | 19 => Event::StepResolved {
            at,
            reason: reason(p),
            complete: p.ok,
            result: p.n.is_multiple_of(2).then(|| result(p.n)),
        },
        20 => Event::OrchestratorRelease {
            term: [0, 1, u64::MAX][p.n % 3],
            holder: worker,
        },
        _ => Event::OrchestratorLease {
            term: [0, 1, 2, u64::MAX][p.n % 4],
            holder: worker,
            worker_lease_ms: TIMES[p.n % TIMES.len()],
            quiet_lease_ms: TIMES[p.attempt % TIMES.len()],
        },
    }
}

/// A worker's or operator's event about the current attempt of a step of a task there
/// is: its claim if the attempt is enqueued, its result if it runs (mostly by the worker
/// that holds its claim), its reset or resolution if it failed, else a claim, result or
/// checkpoint all the same.
fn follow(state: &State, p: &Pick) -> Option<Event> {
    let task = state
        .tasks
        .values()
        .nth(p.task % state.tasks.len().max(1))?;
    let busy: Vec<&embarcadero_workflow::state::Step> = task
        .steps
        .iter()
        .filter(|s| s.created)
        .filter(|s| {
            matches!(
                s.state,
                StepState::Enqueued | StepState::InProgress | StepState::Error
            )
        })
        .collect();
    let step = match busy.is_empty() || p.n % 8 == 7 {
        true => task.steps.get(p.step % task.steps.len().max(1))?,
        false => busy[p.step % busy.len()],
    };
    let at = StepRef {
        task: task.uuid.clone(),
        step: step.name.clone(),
        attempt: step.attempt,
    };
    let worker = step
        .worker
        .clone()
        .filter(|_| !p.n.is_multiple_of(8))
        .unwrap_or_else(|| WORKERS[p.worker].to_string());
    let kind = match step.state {
        StepState::Enqueued => 0,
        StepState::InProgress => 1 + p.n.is_multiple_of(5) as usize,
        StepState::Error => 3 + p.n % 3,
        _ => p.n % 3,
    };
    let reason = "operator".to_string();
    Some(match kind {
        3 => Event::StepReset { at, reason },
        4 | 5 => Event::StepResolved {
            at,
            reason,
            complete: kind == 4,
            result: p.n.is_multiple_of(2).then(|| result(p.n)),
        },
        0 => Event::StepClaimed { at, worker },
        1 => Event::StepResult {
            at,
            worker,
            outcome: outcome(!p.n.is_multiple_of(4), p.n),
        },
        _ => Event::StepCheckpoint {
            at,
            worker,
            checkpoint: Checkpoint {
                cursor: result(p.n),
                items_done: TIMES[p.n % TIMES.len()],
                partial: Value::Null,
            },
        },
    })
}

/// The events an op stands for against `state`, each with its envelope's term.
fn op_events(state: &State, op: &Op) -> Vec<(Event, Term)> {
    match op {
        Op::Raw { kind, pick, term } => vec![(raw_event(*kind, pick), *term)],
        Op::Follow { pick } => follow(state, pick)
            .map(|e| (e, Term::Absent))
            .into_iter()
            .collect(),
        Op::Decide { now, expire } => {
            let now_ms = TIMES[*now];
            let seen = Some(if *expire { 0 } else { now_ms });
            let clock = Clock {
                now_ms,
                lease_ms: 100,
                claimed_at: &|_| seen,
                worker_seen: &|_| seen,
            };
            let events = decide(state, &clock).0;
            events.into_iter().map(|e| (e, Term::Current)).collect()
        }
        Op::Lease {
            next,
            holder,
            quiet,
        } => {
            let term = state.leader.term.saturating_add(*next as u64);
            let lease = Event::OrchestratorLease {
                term,
                holder: WORKERS[*holder].into(),
                worker_lease_ms: 0,
                quiet_lease_ms: *quiet,
            };
            vec![(lease, Term::Absent)]
        }
    }
}

/// What holds after any event, refused or not, given the state before it.
fn check_any(before: &State, after: &State, position: u64) -> Result<(), TestCaseError> {
    prop_assert_eq!(after.next_position, position + 1);
    prop_assert!(
        after.rejected >= before.rejected,
        "the refusal count only grows"
    );
    prop_assert!(after.leader.term >= before.leader.term, "terms only rise");
    let open: Vec<&String> = after
        .tasks
        .values()
        .filter(|t| !t.state.is_terminal())
        .map(|t| &t.uuid)
        .collect();
    prop_assert_eq!(
        after.open.iter().collect::<Vec<_>>(),
        open,
        "the open index is the tasks not finished"
    );
    for (key, t) in &before.templates {
        prop_assert_eq!(
            after.templates.get(key),
            Some(t),
            "a registered template never changes"
        );
    }
    for (key, uuid) in &before.idempotency {
        prop_assert_eq!(
            after.idempotency.get(key),
            Some(uuid),
            "an identity stays its task's"
        );
    }
    for (uuid, was) in &before.tasks {
        let Some(now) = after.tasks.get(uuid) else {
            return Err(TestCaseError::fail(format!("task {uuid} vanished")));
        };
        check_task(was, now)?;
    }
    Ok(())
}

/// A task after an event, against itself before: its state is the one its steps
/// derive, histories only grow along legal edges, attempts never go back, steps are
/// never removed, and a task finished but for `error` never changes but for refusals.
fn check_task(was: &Task, now: &Task) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        now.state,
        derive(now),
        "task {} is not in its derived state",
        now.uuid
    );
    prop_assert!(
        now.history.starts_with(&was.history),
        "task history rewritten"
    );
    for t in &now.history[was.history.len()..] {
        prop_assert!(legal_task(t.from, t.to), "{:?} -> {:?}", t.from, t.to);
    }
    prop_assert!(now.steps.len() >= was.steps.len(), "steps removed");
    for (w, n) in was.steps.iter().zip(&now.steps) {
        prop_assert_eq!(&w.name, &n.name);
        prop_assert!(n.attempt >= w.attempt, "attempt of {} went back", n.name);
        prop_assert!(n.history.starts_with(&w.history), "step history rewritten");
        prop_assert!(n.refused.starts_with(&w.refused), "refusal audit rewritten");
        for t in &n.history[w.history.len()..] {
            prop_assert!(
                legal_step(t.from, t.to),
                "{:?} -> {:?} of {}",
                t.from,
                t.to,
                n.name
            );
        }
    }
    if was.state.is_terminal() && was.state != TaskState::Error {
        prop_assert_eq!(
            without_refusals(now),
            without_refusals(was),
            "a finished task changed"
        );
    }
    Ok(())
}

/// Registers every template (the conflicting one is refused) and creates task `t<i+1>`
/// of template `TEMPLATE_NAMES[n]` for each `(n, protocol_2)` of `tasks`.
fn setup(tasks: &[(usize, bool)]) -> Vec<Op> {
    let p = |task, n, attempt| Pick {
        task,
        step: 0,
        attempt,
        worker: 0,
        n,
        ok: true,
    };
    let registered = (0..templates().len()).map(|n| (0, p(0, n, 0)));
    let created = tasks
        .iter()
        .enumerate()
        .map(|(i, &(n, two))| (1, p(i, n, if two { 3 } else { 0 })));
    registered
        .chain(created)
        .map(|(kind, pick)| Op::Raw {
            kind,
            pick,
            term: Term::Absent,
        })
        .collect()
}

/// Folds the ops' events from position `start` on, checking every event.
fn fold_checked(ops: &[Op], start: u64) -> Result<State, TestCaseError> {
    let mut state = State::default();
    let mut position = start;
    for op in ops {
        for (e, term) in op_events(&state, op) {
            let term = match term {
                Term::Absent => None,
                Term::Fixed(t) => Some(t),
                Term::Current => (state.leader.term > 0).then_some(state.leader.term),
            };
            let env = Envelope {
                ts_ms: TIMES[position as usize % TIMES.len()],
                term,
                event: e,
            };
            // Through the log's encoding (which reads a `result: null` back as none).
            let decoded = event::decode(&event::encode(&env)).expect("an encoded event decodes");
            let before = state.clone();
            let outcome = state.apply(position, &decoded);
            check_any(&before, &state, position)?;
            if let Err(why) = outcome {
                prop_assert!(!matches!(why, Rejected::Undecodable(_)));
                prop_assert_eq!(state.rejected, before.rejected + 1);
                prop_assert_eq!(
                    without_audit(&state),
                    without_audit(&before),
                    "refused ({}), yet it changed the state: {:?}",
                    why,
                    decoded.event.kind()
                );
            }
            position += 1;
        }
    }
    Ok(state)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn no_event_in_the_log_panics_the_fold_and_a_refused_one_changes_nothing(
        ops in prop::collection::vec(op(), 0..150),
        tasks in prop::collection::vec((0..10usize, any::<bool>()), 6),
        start in prop::sample::select(vec![0u64, 1 << 40, u64::MAX - 1000]),
    ) {
        // Every run registers every template and creates tasks `t1` to `t6` of some of
        // them first, so that the rest of the history has something to move.
        let mut all = setup(&tasks);
        all.extend(ops);
        fold_checked(&all, start)?;
    }

    #[test]
    fn a_snapshot_of_any_folded_state_decodes_to_the_same_state(
        ops in prop::collection::vec(op(), 0..150),
        tasks in prop::collection::vec((0..10usize, any::<bool>()), 6),
    ) {
        // An orchestrator restarted from a snapshot must fold on from exactly the state a
        // replay of the log reaches, whatever the log held (or readers diverge).
        let mut all = setup(&tasks);
        all.extend(ops);
        let state = fold_checked(&all, 0)?;
        let bytes = snapshot::encode("wf", state.clone());
        prop_assert_eq!(snapshot::decode(&bytes, "wf"), Ok(state));
    }
}
