//! Property tests of the fold: random event sequences (commands, claims, results,
//! expiries, decisions, with stale attempts and rival workers mixed in, and the
//! orchestrator's own decisions interleaved) against the invariants of the design.

mod common;
use common::{without_audit, without_refusals};
use embarcadero_workflow::decide::{decide, Clock};
use embarcadero_workflow::event::Expiry;
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
/// A decision creating some of three branches, a step after one branch, and a
/// deferred convergence of that step and the other two branches.
const CONDITIONAL: &str = "name: cond\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: x}}
  - {name: d, type: decision, dependencies: [a], handler: {callable: x}, retry: {max_attempts: 2, backoff: none}}
  - {name: b1, dependencies: [d], handler: {callable: x}}
  - {name: b2, dependencies: [d], handler: {callable: x}}
  - {name: b3, dependencies: [d], handler: {callable: x}}
  - {name: e, dependencies: [b1], handler: {callable: x}}
  - {name: j, type: deferred_convergence, dependencies: [e, b2, b3], handler: {callable: x}}
";
/// A batchable step, its worker step (instances `w_001`...) and their convergence;
/// `STRATEGY` is replaced by each batch template's failure strategy.
const BATCH: &str = "name: NAME\nnamespace: p\nversion: '1'\nsteps:
  - {name: an, type: batchable, handler: {callable: x}, batch_config: {failure_strategy: STRATEGY}}
  - {name: w, type: batch_worker, dependencies: [an], handler: {callable: x}, retry: {max_attempts: 1}}
  - {name: agg, type: deferred_convergence, dependencies: [w], handler: {callable: x}}
";
/// Tasks, their templates and their protocols (1: the orchestrator enqueues and
/// completes by events; 2: the fold does).
const TASKS: [(&str, &str, u8); 9] = [
    ("t1", "diamond", 1),
    ("t2", "diamond", 1),
    ("t3", "cond", 1),
    ("t4", "batch_fail_fast", 1),
    ("t5", "batch_continue_on_failure", 1),
    ("t6", "diamond", 2),
    ("t7", "cond", 2),
    ("t8", "batch_fail_fast", 2),
    ("t9", "batch_continue_on_failure", 2),
];
const BATCH_STEPS: &[&str] = &["an", "w_001", "w_002", "w_003", "agg", "w"];
const DIAMOND_STEPS: &[&str] = &["a", "b", "c", "d"];
const COND_STEPS: &[&str] = &["a", "d", "b1", "b2", "b3", "e", "j"];
/// What a decision may name (`zz` is no step: such a decision is refused).
const BRANCHES: [&str; 4] = ["b1", "b2", "b3", "zz"];
const WORKERS: [&str; 2] = ["w1", "w2"];
/// The states a `step_stale` event may say it saw its step in.
const STALE_STATES: [embarcadero_workflow::StepState; 4] = {
    use embarcadero_workflow::StepState::*;
    [Pending, Enqueued, InProgress, WaitingForRetry]
};

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
        /// For a decision step: which of [`BRANCHES`] it names (a bit each).
        branches: u8,
    },
    Checkpoint {
        task: usize,
        step: usize,
        attempt: u32,
        worker: usize,
        done: u64,
    },
    Raw(Box<Event>),
}

fn steps_of(task: usize) -> &'static [&'static str] {
    match TASKS[task].1 {
        "cond" => COND_STEPS,
        "diamond" => DIAMOND_STEPS,
        _ => BATCH_STEPS,
    }
}

/// `step` is taken modulo the task's number of steps, so one generator fits both.
fn at(task: usize, step: usize, attempt: u32) -> StepRef {
    let steps = steps_of(task);
    StepRef {
        task: TASKS[task].0.into(),
        step: steps[step % steps.len()].into(),
        attempt,
    }
}

fn op() -> impl Strategy<Value = Op> {
    let t = 0..TASKS.len();
    let s = 0..COND_STEPS.len();
    let a = 1u32..4;
    let w = 0..WORKERS.len();
    prop_oneof![
        4 => (0u64..1000, any::<bool>()).prop_map(|(now_ms, e)| Op::Decide { now_ms, expire: e }),
        4 => (t.clone(), s.clone(), a.clone(), w.clone()).prop_map(|(task, step, attempt, worker)| Op::Claim { task, step, attempt, worker }),
        4 => (t.clone(), s.clone(), a.clone(), w, any::<bool>(), 0u8..16).prop_map(|(task, step, attempt, worker, ok, branches)| Op::Result { task, step, attempt, worker, ok, branches }),
        1 => (t.clone(), s.clone(), a.clone()).prop_map(|(task, step, attempt)| Op::Raw(Box::new(Event::StepCompleted(at(task, step, attempt))))),
        1 => (t.clone(), s.clone(), a.clone()).prop_map(|(task, step, attempt)| Op::Raw(Box::new(Event::StepEnqueued(at(task, step, attempt))))),
        2 => (t.clone(), s.clone(), a.clone(), 0..WORKERS.len(), 0u64..100).prop_map(|(task, step, attempt, worker, done)| Op::Checkpoint { task, step, attempt, worker, done }),
        1 => (t.clone(), s.clone(), a.clone()).prop_map(|(task, step, attempt)| Op::Raw(Box::new(Event::StepReset { at: at(task, step, attempt), reason: "test".into() }))),
        1 => (t.clone(), s.clone(), a.clone(), any::<bool>()).prop_map(|(task, step, attempt, complete)| Op::Raw(Box::new(Event::StepResolved { at: at(task, step, attempt), reason: "test".into(), complete, result: Some(json!(0)) }))),
        1 => t.clone().prop_map(|task| Op::Raw(Box::new(Event::TaskCancelled { task: TASKS[task].0.into(), reason: "test".into() }))),
        1 => (t.clone(), s.clone(), 0u32..4, 0..STALE_STATES.len()).prop_map(|(task, step, attempt, seen)| Op::Raw(Box::new(Event::StepStale { at: at(task, step, attempt), state: STALE_STATES[seen], reason: "stale: test".into() }))),
        1 => t.clone().prop_map(|task| Op::Raw(Box::new(Event::TaskRerun { task: TASKS[task].0.into(), reason: "test".into() }))),
        1 => t.prop_map(|task| Op::Raw(Box::new(Event::TaskResolved { task: TASKS[task].0.into(), reason: "test".into() }))),
    ]
}

/// `task_created` of task `task` of template `p/name@1`, with an empty context and no
/// key or identity; `protocol` absent means protocol 1, as in events written before
/// protocols.
fn task_created(task: &str, name: &str, protocol: Option<u8>) -> Event {
    Event::TaskCreated {
        task: task.into(),
        namespace: "p".into(),
        name: name.into(),
        version: "1".into(),
        context: json!({}),
        idempotency_key: None,
        identity: None,
        protocol,
    }
}

/// The events a history stands for, each computed against the state before it (so the
/// orchestrator's decisions are those it would make at that point).
fn events(ops: &[Op]) -> Vec<Envelope> {
    let batches = ["fail_fast", "continue_on_failure"].map(|strategy| {
        BATCH
            .replace("NAME", &format!("batch_{strategy}"))
            .replace("STRATEGY", strategy)
    });
    let mut out: Vec<Event> = [DIAMOND, CONDITIONAL, &batches[0], &batches[1]]
        .iter()
        .map(|t| Event::TemplateRegistered {
            template: load(t, None).unwrap(),
        })
        .collect();
    for (t, name, protocol) in TASKS {
        out.push(task_created(t, name, (protocol > 1).then_some(protocol)));
    }
    let mut state = State::default();
    let mut envs: Vec<Envelope> = Vec::new();
    let push = |state: &mut State, envs: &mut Vec<Envelope>, event: Event| {
        let env = Envelope {
            ts_ms: envs.len() as u64,
            term: None,
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
            branches,
        } => {
            let at = at(task, step, attempt);
            let result = match at.step.as_str() {
                "d" if TASKS[task].1 == "cond" => decision(branches),
                "an" => {
                    let n = (branches % 4) as usize;
                    json!({"cursors": (0..n).collect::<Vec<_>>(), "worker_count": n})
                }
                _ => json!(attempt),
            };
            let outcome = match ok {
                true => Outcome::Success { result },
                false => Outcome::Failure {
                    message: "no".into(),
                    retryable: true,
                    retry_after_ms: None,
                },
            };
            vec![Event::StepResult {
                at,
                worker: WORKERS[worker].into(),
                outcome,
            }]
        }
        Op::Checkpoint {
            task,
            step,
            attempt,
            worker,
            done,
        } => vec![Event::StepCheckpoint {
            at: at(task, step, attempt),
            worker: WORKERS[worker].into(),
            checkpoint: embarcadero_workflow::event::Checkpoint {
                cursor: json!(done),
                items_done: done,
                partial: json!({}),
            },
        }],
        Op::Raw(e) => vec![*e],
    }
}

/// A decision's result naming the branches whose bit is set.
fn decision(bits: u8) -> serde_json::Value {
    let names: Vec<&str> = (0..BRANCHES.len())
        .filter(|i| bits & (1 << i) != 0)
        .map(|i| BRANCHES[i])
        .collect();
    json!({ "step_names": names })
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
        // Under protocol 2 completions are the fold's, not events: each step still
        // completes at most once, and only as the fold completes a returned success.
        for task in state.tasks.values() {
            for step in &task.steps {
                let completions = step.history.iter().filter(|h| h.to == embarcadero_workflow::StepState::Complete).count();
                prop_assert!(completions <= 1, "{}/{} completed {} times", task.uuid, step.name, completions);
            }
        }
    }

    #[test]
    fn decisions_create_only_the_branches_they_name_and_convergence_waits_for_them(ops in prop::collection::vec(op(), 0..80)) {
        let envs = events(&ops);
        let mut s = State::default();
        for (i, e) in envs.iter().enumerate() {
            let _ = s.apply(i as u64, e);
            for task in s.tasks.values() {
                check_branches(task)?;
            }
        }
    }

    #[test]
    fn batches_make_one_instance_per_cursor_and_follow_their_failure_strategy(ops in prop::collection::vec(op(), 0..100)) {
        let envs = events(&ops);
        let mut s = State::default();
        for (i, e) in envs.iter().enumerate() {
            let before = s.clone();
            if s.apply(i as u64, e).is_ok() {
                check_checkpoint(&before, e)?;
            }
            for task in s.tasks.values() {
                check_branches(task)?;
                if task.template.name.starts_with("batch") {
                    check_batch(task)?;
                }
            }
        }
    }

    #[test]
    fn the_open_tasks_index_is_the_tasks_not_finished_after_every_event(ops in prop::collection::vec(op(), 0..60)) {
        let envs = events(&ops);
        let mut s = State::default();
        for (i, e) in envs.iter().enumerate() {
            let _ = s.apply(i as u64, e);
            let open: Vec<&str> = s.tasks.values().filter(|t| !t.state.is_terminal()).map(|t| t.uuid.as_str()).collect();
            let indexed: Vec<&str> = s.open_task_iter().map(|t| t.uuid.as_str()).collect();
            prop_assert_eq!(&indexed, &open);
            prop_assert_eq!(s.open_tasks(), open.len());
            let mut rebuilt = s.clone();
            rebuilt.reindex();
            prop_assert_eq!(&rebuilt, &s);
        }
    }

    #[test]
    fn a_manual_resolution_ends_any_unfinished_or_failed_task_for_good_and_is_refused_for_others(ops in prop::collection::vec(op(), 0..60)) {
        use embarcadero_workflow::TaskState::{Cancelled, Complete, ResolvedManually};
        let envs = events(&ops);
        let mut s = State::default();
        for (i, e) in envs.iter().enumerate() {
            let Event::TaskResolved { task: uuid, .. } = &e.event else {
                let _ = s.apply(i as u64, e);
                continue;
            };
            let before = s.tasks[uuid].state;
            let applied = s.apply(i as u64, e).is_ok();
            let t = &s.tasks[uuid];
            let closed = matches!(before, Complete | Cancelled | ResolvedManually);
            prop_assert_eq!(applied, !closed, "resolving a task that was {:?}", before);
            if applied {
                prop_assert_eq!(t.state, ResolvedManually);
                prop_assert_eq!(t.history.last().map(|h| (h.from, h.position)), Some((before, i as u64)));
                prop_assert!(t.created_steps().all(|st| st.state.is_terminal()), "{:?}", t.steps);
                prop_assert!(!s.open_task_iter().any(|o| &o.uuid == uuid));
            } else {
                prop_assert_eq!(t.state, before);
            }
        }
    }

    #[test]
    fn a_task_is_in_the_state_its_steps_derive_and_waits_for_dependencies_only_with_nothing_to_run(ops in prop::collection::vec(op(), 0..60)) {
        use embarcadero_workflow::{StepState as S, TaskState as T};
        let envs = events(&ops);
        let mut s = State::default();
        for (i, e) in envs.iter().enumerate() {
            let _ = s.apply(i as u64, e);
            for t in s.tasks.values() {
                prop_assert_eq!(t.state, embarcadero_workflow::settle::derive(t), "{}", t.uuid);
                let any = |f: &dyn Fn(S) -> bool| t.created_steps().any(|st| f(st.state));
                match t.state {
                    T::WaitingForDependencies => {
                        prop_assert!(t.ready_steps().next().is_none());
                        prop_assert!(!any(&|st| st.is_active() || st == S::Error));
                        // Something waits that cannot run now: a pending step behind an
                        // unfinished dependency, or a live step cut short.
                        prop_assert!(any(&|st| matches!(st, S::Pending | S::Cancelled)), "{:?}", t.steps);
                    }
                    T::WaitingForRetry => {
                        let unfinished: Vec<_> = t.created_steps().filter(|st| !st.state.is_terminal()).collect();
                        prop_assert!(!unfinished.is_empty());
                        for st in unfinished {
                            prop_assert_eq!(st.state, S::WaitingForRetry, "{}", st.name);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn a_finished_task_never_changes_again_but_for_its_refusals(ops in prop::collection::vec(op(), 0..60)) {
        let envs = events(&ops);
        let mut s = State::default();
        let mut finished: BTreeMap<String, embarcadero_workflow::Task> = BTreeMap::new();
        for (i, e) in envs.iter().enumerate() {
            let applied = s.apply(i as u64, e).is_ok();
            // Only an operator's reset or resolution of a failed step, or a rerun or a
            // manual resolution of a failed task, changes a failed task.
            let reopening = match &e.event {
                Event::StepReset { at, .. } | Event::StepResolved { at, .. } => Some(&at.task),
                Event::TaskRerun { task, .. } | Event::TaskResolved { task, .. } => Some(task),
                _ => None,
            };
            if let (true, Some(uuid)) = (applied, reopening) {
                let was = finished.remove(uuid).map(|t| t.state);
                prop_assert!(was.is_none_or(|w| w == embarcadero_workflow::TaskState::Error), "{:?} reopened", was);
            }
            for (uuid, t) in &finished {
                prop_assert_eq!(&without_refusals(&s.tasks[uuid]), t);
            }
            for t in s.tasks.values().filter(|t| t.state.is_terminal()) {
                finished.entry(t.uuid.clone()).or_insert_with(|| without_refusals(t));
            }
        }
    }

    #[test]
    fn a_refused_event_changes_nothing_but_the_count_and_audit_of_refusals(
        ops in prop::collection::vec(op(), 0..60),
        leases in prop::collection::vec((0usize..200, 1u64..3, 0usize..4), 0..4),
    ) {
        // With orchestrator lease bids put in, refused bids and fenced decisions too.
        let envs = with_leases(events(&ops), &leases);
        let mut s = State::default();
        for (i, e) in envs.iter().enumerate() {
            let before = without_audit(&s);
            if s.apply(i as u64, e).is_err() {
                prop_assert_eq!(without_audit(&s), before, "refused, yet it changed the state: {:?}", e.event);
            }
        }
    }
}

/// The rules of decisions and deferred convergence, on one folded task: a step not
/// created never moved; a step that was enqueued had every dependency complete, but
/// a convergence's dependencies that were never created; the branches created are
/// those the completed decision named, and none before it completed; a complete task
/// has every created step complete.
fn check_branches(task: &embarcadero_workflow::Task) -> Result<(), TestCaseError> {
    use embarcadero_workflow::template::StepType;
    use embarcadero_workflow::StepState::{Complete, Pending};
    for (i, s) in task.steps.iter().enumerate() {
        if !s.created {
            prop_assert!(
                s.history.is_empty() && s.state == Pending,
                "{} moved uncreated",
                s.name
            );
        }
        if !s
            .history
            .iter()
            .any(|h| h.to == embarcadero_workflow::StepState::Enqueued)
        {
            continue; // never ran (a cancel moves pending steps too)
        }
        let convergence = task.spec(i).step_type == StepType::DeferredConvergence;
        for &d in &task.deps[i] {
            let dep = &task.steps[d];
            let tolerated = embarcadero_workflow::batch::tolerated(task, d);
            prop_assert!(
                matches!(
                    dep.state,
                    Complete | embarcadero_workflow::StepState::ResolvedManually
                ) || (convergence && (!dep.created || tolerated)),
                "{} ran while {} was {:?} (created: {})",
                s.name,
                dep.name,
                dep.state,
                dep.created
            );
        }
    }
    if let Some(d) = task.step("d").filter(|_| task.template.name == "cond") {
        let named: Vec<String> = match (&d.state, &d.result) {
            (Complete, Some(r)) => embarcadero_workflow::branch::decision_names(r).unwrap(),
            _ => Vec::new(),
        };
        for b in ["b1", "b2", "b3"] {
            let created = task.step(b).unwrap().created;
            prop_assert_eq!(
                created,
                named.iter().any(|n| n == b),
                "branch {} vs {:?}",
                b,
                named
            );
        }
    }
    if task.state == embarcadero_workflow::TaskState::Complete {
        // A step an operator resolved by hand counts as finished (`settle::derive`), as
        // in Tasker: its dependents run and the task completes.
        prop_assert!(task.created_steps().all(|s| matches!(
            s.state,
            Complete | embarcadero_workflow::StepState::ResolvedManually
        )));
    }
    Ok(())
}

/// The rules of batches, on one folded batch task: one instance per cursor once the
/// batchable step completed, none before; under `fail_fast` no instance completes
/// after a sibling failed, and those not finished are cancelled.
fn check_batch(task: &embarcadero_workflow::Task) -> Result<(), TestCaseError> {
    use embarcadero_workflow::StepState::{Cancelled, Complete, Error};
    let an = task.step("an").unwrap();
    let cursors = match (&an.state, &an.result) {
        (Complete, Some(r)) => embarcadero_workflow::batch::batch_cursors(r).unwrap().len(),
        _ => 0,
    };
    let instances: Vec<_> = task.steps.iter().filter(|s| s.batch.is_some()).collect();
    prop_assert_eq!(instances.len(), cursors);
    for (k, s) in instances.iter().enumerate() {
        prop_assert_eq!(
            &s.name,
            &embarcadero_workflow::batch::instance_name("w", k + 1)
        );
    }
    // (An operator's reset or resolution of a failed instance is outside fail_fast's rule.)
    let manual = task
        .steps
        .iter()
        .any(|s| s.history.iter().any(|h| h.from == Error));
    if task.template.name != "batch_fail_fast" || manual {
        return Ok(());
    }
    let failed_at = instances
        .iter()
        .flat_map(|s| s.history.iter().filter(|h| h.to == Error))
        .map(|h| h.position)
        .min();
    if let Some(p) = failed_at {
        for s in &instances {
            let completed = s.history.iter().find(|h| h.to == Complete);
            prop_assert!(
                completed.is_none_or(|h| h.position < p),
                "{} completed after a sibling failed",
                s.name
            );
            prop_assert!(
                matches!(s.state, Complete | Error | Cancelled),
                "{} is {:?}",
                s.name,
                s.state
            );
        }
    }
    Ok(())
}

/// A checkpoint is applied only for the attempt in progress, from the worker that won it.
fn check_checkpoint(before: &State, env: &Envelope) -> Result<(), TestCaseError> {
    if let Event::StepCheckpoint { at, worker, .. } = &env.event {
        let s = before.tasks[&at.task].step(&at.step).unwrap();
        prop_assert_eq!(s.state, embarcadero_workflow::StepState::InProgress);
        prop_assert_eq!(
            (s.attempt, s.worker.as_deref()),
            (at.attempt, Some(worker.as_str()))
        );
    }
    Ok(())
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
            branches: 0,
        },
        Op::Result {
            task: 0,
            step: 0,
            attempt: 2,
            worker: 1,
            ok: true,
            branches: 0,
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

/// An event aimed at step `a` of a task while the orchestrator has yet to decide on
/// its returned attempt: late, repeated or misdirected, for the attempt before, the
/// current one or the next (`offset` 0, 1, 2). Every reader must refuse it.
#[derive(Debug, Clone)]
struct Stray {
    kind: u8,
    offset: u32,
    worker: usize,
    seen: usize,
}

fn stray() -> impl Strategy<Value = Stray> {
    (0u8..9, 0u32..3, 0..WORKERS.len(), 0..STALE_STATES.len()).prop_map(
        |(kind, offset, worker, seen)| Stray {
            kind,
            offset,
            worker,
            seen,
        },
    )
}

fn stray_event(stray: &Stray, task: usize, attempt: u32) -> Event {
    let at = at(task, 0, (attempt + stray.offset).saturating_sub(1));
    let worker = WORKERS[stray.worker].to_string();
    let reason = "test".to_string();
    match stray.kind {
        0 => Event::StepCompleted(at),
        1 => Event::StepEnqueued(at),
        2 => Event::StepClaimed { at, worker },
        3 => Event::StepResult {
            at,
            worker,
            outcome: Outcome::Success { result: json!(0) },
        },
        4 => Event::StepCheckpoint {
            at,
            worker,
            checkpoint: embarcadero_workflow::event::Checkpoint {
                cursor: json!(1),
                items_done: 1,
                partial: json!({}),
            },
        },
        5 => Event::StepExpired {
            at,
            reason: Expiry::LeaseLost,
        },
        6 => Event::StepReset { at, reason },
        7 => Event::StepResolved {
            at,
            reason,
            complete: true,
            result: Some(json!(0)),
        },
        _ => Event::StepStale {
            at,
            state: STALE_STATES[stray.seen],
            reason: "stale: test".into(),
        },
    }
}

/// What the orchestrator decides at `now_ms` (every worker just seen) about step `a`
/// of task `task`.
fn decided_for_a(state: &State, now_ms: u64, task: usize) -> Vec<Event> {
    let clock = Clock {
        now_ms,
        lease_ms: 100,
        claimed_at: &|_| Some(now_ms),
        worker_seen: &|_| Some(now_ms),
    };
    let mine = |e: &Event| {
        e.step_ref()
            .is_some_and(|r| r.task == TASKS[task].0 && r.step == "a")
    };
    decide(state, &clock).0.into_iter().filter(mine).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Step `a` of a diamond task under protocol 1 (t1) or 2 (t6) is claimed and taken
    /// back again and again (its worker's lease ran out, or it timed out), with refused
    /// events in between: a lost lease is retried at once up to the
    /// `MAX_LEASE_LOSSES`-th, a timeout by the retry policy up to `max_attempts`
    /// failures, each counted only against its own limit; at its limit the step errors.
    #[test]
    fn a_step_taken_back_with_retries_left_is_retried_and_errors_only_at_its_limit(
        task in prop::sample::select(vec![0usize, 5]),
        reasons in prop::collection::vec(prop_oneof![Just(Expiry::LeaseLost), Just(Expiry::Timeout)], 1..8),
        strays in prop::collection::vec(stray(), 0..6),
    ) {
        use embarcadero_workflow::decide::MAX_LEASE_LOSSES;
        use embarcadero_workflow::StepState;
        let (mut state, _) = fold(&events(&[]));
        let max_attempts = state.tasks[TASKS[task].0].spec(0).retry.max_attempts;
        let (mut lost, mut timed_out) = (0, 0);
        let a = |state: &State| state.tasks[TASKS[task].0].steps[0].clone();
        for (n, (reason, now)) in (1..).zip(reasons.into_iter().zip(0u64..)) {
            // Attempt n is enqueued: by the orchestrator (protocol 1's first attempt,
            // and every retry) or by the fold (protocol 2's first).
            let enqueued = decided_for_a(&state, now, task);
            prop_assert!(apply_at(&mut state, now, enqueued).iter().all(|&ok| ok));
            prop_assert_eq!((a(&state).state, a(&state).attempt), (StepState::Enqueued, n));
            let claim = Event::StepClaimed { at: at(task, 0, n), worker: WORKERS[0].into() };
            let expired = Event::StepExpired { at: at(task, 0, n), reason };
            prop_assert_eq!(apply_at(&mut state, now, vec![claim, expired]), [true, true]);
            match reason {
                Expiry::LeaseLost => lost += 1,
                Expiry::Timeout => timed_out += 1,
            }
            let strays: Vec<Event> = strays.iter().map(|s| stray_event(s, task, n)).collect();
            let refused = apply_at(&mut state, now, strays.clone());
            prop_assert!(refused.iter().all(|&ok| !ok), "{:?} of {:?}", refused, strays);
            prop_assert_eq!((a(&state).lease_losses, a(&state).failures), (lost, timed_out));

            let decision = decided_for_a(&state, now, task);
            let retry = Event::RetryScheduled { at: at(task, 0, n), due_ms: now };
            let (retried, why) = match reason {
                Expiry::LeaseLost => (lost < MAX_LEASE_LOSSES, format!("ran out {lost} times")),
                Expiry::Timeout => (timed_out < max_attempts, format!("max attempts ({max_attempts}) reached")),
            };
            if retried {
                prop_assert_eq!(&decision, &[retry], "{:?} {}", reason, why);
            } else {
                let errored = matches!(&decision[..], [Event::StepErrored { at, reason }]
                    if at.attempt == n && reason.contains(&why));
                prop_assert!(errored, "{:?} at its limit: {:?}", reason, decision);
            }
            prop_assert_eq!(apply_at(&mut state, now, decision), [true]);
            if !retried {
                prop_assert_eq!(a(&state).state, StepState::Error);
                break;
            }
        }
    }
}

/// A step returned without its outcome, as only a snapshot from a fold before refused
/// completions kept it can hold: the orchestrator fails it (for an operator to reset)
/// rather than guess whether it may run again, and does not call it a lost lease.
#[test]
fn a_step_returned_without_its_outcome_errors_and_is_not_taken_for_a_lost_lease() {
    let (mut state, _) = fold(&events(&[]));
    let a = at(5, 0, 1);
    let claim = Event::StepClaimed {
        at: a.clone(),
        worker: WORKERS[0].into(),
    };
    let expired = Event::StepExpired {
        at: a.clone(),
        reason: Expiry::LeaseLost,
    };
    assert_eq!(apply_at(&mut state, 0, vec![claim, expired]), [true, true]);
    state.task_mut("t6").unwrap().steps[0].returned = None;
    let decided = decided_for_a(&state, 0, 5);
    assert!(
        matches!(&decided[..], [Event::StepErrored { at, reason }]
            if *at == a && reason.contains("outcome was lost")),
        "{decided:?}"
    );
}

/// Runs a history in which the workers do everything asked of them at once: each
/// enqueued attempt is claimed by w1 and succeeds with `result(step)`.
fn run_to_the_end(result: impl Fn(&str) -> serde_json::Value) -> State {
    run_with_events(result).0
}

/// [`run_to_the_end`], with the events of the history.
fn run_with_events(result: impl Fn(&str) -> serde_json::Value) -> (State, Vec<Envelope>) {
    let mut envs = events(&[]);
    let (mut state, _) = fold(&envs);
    for round in 0..40 {
        let clock_now = round * 10;
        let clock = Clock {
            now_ms: clock_now,
            lease_ms: 100,
            claimed_at: &|_| Some(clock_now),
            worker_seen: &|_| Some(clock_now),
        };
        let mut next = decide(&state, &clock).0;
        for t in state.tasks.values() {
            for s in t
                .steps
                .iter()
                .filter(|s| s.state == embarcadero_workflow::StepState::Enqueued)
            {
                let at = StepRef {
                    task: t.uuid.clone(),
                    step: s.name.clone(),
                    attempt: s.attempt,
                };
                next.push(Event::StepClaimed {
                    at: at.clone(),
                    worker: "w1".into(),
                });
                let outcome = Outcome::Success {
                    result: result(&s.name),
                };
                next.push(Event::StepResult {
                    at,
                    worker: "w1".into(),
                    outcome,
                });
            }
        }
        for event in next {
            let env = Envelope {
                ts_ms: envs.len() as u64,
                term: None,
                event,
            };
            let _ = state.apply(envs.len() as u64, &env);
            envs.push(env);
        }
    }
    (state, envs)
}

#[test]
fn a_decision_creating_two_of_three_branches_is_followed_by_its_convergence() {
    let state = run_to_the_end(|step| match step {
        "d" => json!({"type": "create_steps", "step_names": ["b1", "b3"]}),
        _ => json!(1),
    });
    // t3 under protocol 1, t7 under protocol 2 (where the fold enqueues the
    // convergence at the position where the last branch completes).
    for uuid in ["t3", "t7"] {
        let t = &state.tasks[uuid];
        assert_eq!(t.state, embarcadero_workflow::TaskState::Complete, "{t:#?}");
        let created: Vec<&str> = t.created_steps().map(|s| s.name.as_str()).collect();
        assert_eq!(created, ["a", "d", "b1", "b3", "e", "j"]);
        let j = t.step("j").unwrap();
        let e = t.step("e").unwrap();
        let b3 = t.step("b3").unwrap();
        // The convergence was enqueued once both of the created branches completed.
        let entered = |s: &embarcadero_workflow::state::Step, to| {
            s.history.iter().find(|h| h.to == to).unwrap().position
        };
        use embarcadero_workflow::StepState::{Complete, Enqueued};
        let last = entered(e, Complete).max(entered(b3, Complete));
        match t.protocol {
            1 => assert!(entered(j, Enqueued) > last),
            _ => assert_eq!(entered(j, Enqueued), last),
        }
    }

    let none = run_to_the_end(|step| match step {
        "d" => json!({"type": "no_branches"}),
        _ => json!(1),
    });
    for uuid in ["t3", "t7"] {
        let t = &none.tasks[uuid];
        assert_eq!(t.state, embarcadero_workflow::TaskState::Complete);
        assert_eq!(t.created_steps().count(), 2, "a and d only");
    }

    let refused = run_to_the_end(|step| match step {
        "d" => json!({"step_names": ["b1", "a"]}),
        _ => json!(1),
    });
    // Under protocol 2 too: a success that fails its check is left to the orchestrator,
    // which fails the step.
    for uuid in ["t3", "t7"] {
        let t = &refused.tasks[uuid];
        assert_eq!(t.state, embarcadero_workflow::TaskState::Error);
        let d = t.step("d").unwrap();
        assert!(d.last_error.as_deref().unwrap().contains("`a`"), "{d:#?}");
    }
}

/// What a step went through, without where in the log.
fn moves(t: &embarcadero_workflow::Task) -> Vec<(String, Vec<String>)> {
    let moves = t.steps.iter().map(|s| {
        let to = s.history.iter().map(|h| format!("{:?}", h.to));
        (s.name.clone(), to.collect())
    });
    moves.collect()
}

#[test]
fn protocol_2_makes_the_same_moves_as_protocol_1_with_two_events_fewer_per_step() {
    let (state, envs) = run_with_events(|step| match step {
        "d" => json!({"step_names": ["b1", "b3"]}),
        "an" => json!({"cursors": [0, 5], "worker_count": 2}),
        _ => json!(7),
    });
    let events_of = |uuid: &str| envs.iter().filter(|e| e.event.task() == Some(uuid)).count();
    for (p1, p2) in [("t1", "t6"), ("t3", "t7"), ("t4", "t8")] {
        let (one, two) = (&state.tasks[p1], &state.tasks[p2]);
        assert_eq!((one.protocol, two.protocol), (1, 2));
        assert_eq!(
            two.state,
            embarcadero_workflow::TaskState::Complete,
            "{two:#?}"
        );
        assert_eq!(moves(one), moves(two), "{p1} and {p2}");
        let results = |t: &embarcadero_workflow::Task| -> Vec<_> {
            t.steps.iter().map(|s| s.result.clone()).collect()
        };
        assert_eq!(results(one), results(two));
        // Per step run: enqueue, claim, result, completion under protocol 1; claim and
        // result under protocol 2.
        let ran = two.created_steps().count();
        assert_eq!(events_of(p1), 1 + 4 * ran, "{p1}");
        assert_eq!(events_of(p2), 1 + 2 * ran, "{p2}");
    }
    // A protocol this fold does not know is refused, and no task is made.
    let mut s = State::default();
    let template = Event::TemplateRegistered {
        template: load(DIAMOND, None).unwrap(),
    };
    let created = task_created("t", "diamond", Some(3));
    assert_eq!(apply_at(&mut s, 0, vec![template, created]), [true, false]);
    assert!(s.tasks.is_empty());
}

#[test]
fn a_batch_runs_one_instance_per_cursor_and_then_its_convergence() {
    let state = run_to_the_end(|step| match step {
        "an" => json!({"cursors": [{"start": 0}, {"start": 5}, {"start": 9}], "worker_count": 3}),
        _ => json!(1),
    });
    for uuid in ["t4", "t5", "t8", "t9"] {
        let t = &state.tasks[uuid];
        assert_eq!(t.state, embarcadero_workflow::TaskState::Complete, "{t:#?}");
        let created: Vec<&str> = t.created_steps().map(|s| s.name.as_str()).collect();
        assert_eq!(created, ["an", "agg", "w_001", "w_002", "w_003"]);
        let w2 = t.step("w_002").unwrap().batch.clone().unwrap();
        assert_eq!((w2.cursor, w2.index, w2.count), (json!({"start": 5}), 2, 3));
    }
}

/// One step under a one-minute in-process threshold.
const LIFECYCLE: &str = "name: life\nnamespace: p\nversion: '1'
lifecycle: {max_steps_in_process_minutes: 1}
steps:
  - {name: a, handler: {callable: h}}";

/// Applies `events` stamped at `ts_ms`, from the next position on; what each came to.
fn apply_at(state: &mut State, ts_ms: u64, events: Vec<Event>) -> Vec<bool> {
    let applied = events.into_iter().map(|event| {
        let position = state.next_position;
        state
            .apply(
                position,
                &Envelope {
                    ts_ms,
                    term: None,
                    event,
                },
            )
            .is_ok()
    });
    applied.collect()
}

#[test]
fn a_stale_attempt_errors_only_if_still_where_it_was_seen_and_a_rerun_starts_it_again() {
    use embarcadero_workflow::staleness::stale_steps;
    use embarcadero_workflow::{StepState, TaskState};
    let mut state = State::default();
    let created = task_created("t", "life", None);
    let template = Event::TemplateRegistered {
        template: load(LIFECYCLE, None).unwrap(),
    };
    let at = |attempt| StepRef {
        task: "t".into(),
        step: "a".into(),
        attempt,
    };
    let claimed = Event::StepClaimed {
        at: at(1),
        worker: "w".into(),
    };
    let setup = vec![template, created, Event::StepEnqueued(at(1)), claimed];
    assert_eq!(apply_at(&mut state, 0, setup), [true; 4]);
    assert!(stale_steps(&state.tasks["t"], 60_000).is_empty(), "not yet");
    let stale = stale_steps(&state.tasks["t"], 60_001);
    assert!(
        matches!(&stale[..], [Event::StepStale { state: StepState::InProgress, at, .. }] if at.attempt == 1),
        "{stale:?}"
    );

    // A result that comes first in the log wins: the stale event is then refused.
    let mut raced = state.clone();
    let result = Event::StepResult {
        at: at(1),
        worker: "w".into(),
        outcome: Outcome::Success { result: json!(1) },
    };
    assert_eq!(
        apply_at(&mut raced, 1, vec![result.clone(), stale[0].clone()]),
        [true, false]
    );
    assert_eq!(
        raced.tasks["t"].step("a").unwrap().state,
        StepState::EnqueuedForOrchestration
    );

    // Applied first, the stale event fails the step and the task; the late result is refused.
    assert_eq!(
        apply_at(&mut state, 60_001, vec![stale[0].clone(), result]),
        [true, false]
    );
    let task = &state.tasks["t"];
    assert_eq!(
        (task.state, task.steps[0].state),
        (TaskState::Error, StepState::Error)
    );
    assert!(task.steps[0]
        .last_error
        .as_deref()
        .unwrap()
        .starts_with("stale:"));

    let rerun = Event::TaskRerun {
        task: "t".into(),
        reason: "again".into(),
    };
    assert_eq!(
        apply_at(&mut state, 60_002, vec![rerun.clone(), rerun]),
        [true, false]
    );
    let task = &state.tasks["t"];
    assert_eq!(task.steps[0].state, StepState::Pending);
    assert!(!task.state.is_terminal(), "{:?}", task.state);
    assert_eq!(
        task.ready_steps().collect::<Vec<_>>(),
        [0],
        "attempt 2 may be enqueued"
    );
}

/// Two steps under a one-minute threshold for waiting for a retry and a five-minute one
/// for the whole task.
const LIFECYCLE_RETRY_AND_DURATION: &str = "name: life2\nnamespace: p\nversion: '1'
lifecycle: {max_waiting_for_retry_minutes: 1, max_duration_minutes: 5}
steps:
  - {name: a, handler: {callable: h}}
  - {name: b, dependencies: [a], handler: {callable: h}}";

/// The step and reason of each `step_stale` event.
fn stale_reasons(events: &[Event]) -> Vec<(String, String)> {
    let reason = |e: &Event| match e {
        Event::StepStale { at, reason, .. } => (at.step.clone(), reason.clone()),
        other => panic!("not a step_stale: {other:?}"),
    };
    events.iter().map(reason).collect()
}

#[test]
fn a_step_waiting_too_long_for_a_retry_or_a_task_past_its_duration_is_stale_and_fails_the_task() {
    use embarcadero_workflow::staleness::stale_steps;
    use embarcadero_workflow::{StepState, TaskState};
    let mut state = State::default();
    let template = Event::TemplateRegistered {
        template: load(LIFECYCLE_RETRY_AND_DURATION, None).unwrap(),
    };
    let created = task_created("t", "life2", None);
    let a = StepRef {
        task: "t".into(),
        step: "a".into(),
        attempt: 1,
    };
    let failed = Outcome::Failure {
        message: "busy".into(),
        retryable: true,
        retry_after_ms: None,
    };
    let setup = vec![
        template,
        created,
        Event::StepEnqueued(a.clone()),
        Event::StepClaimed {
            at: a.clone(),
            worker: "w".into(),
        },
        Event::StepResult {
            at: a.clone(),
            worker: "w".into(),
            outcome: failed,
        },
        // Due long after every threshold, so that only the thresholds act.
        Event::RetryScheduled {
            at: a.clone(),
            due_ms: 3_600_000,
        },
    ];
    assert_eq!(apply_at(&mut state, 1_000, setup), [true; 6]);
    let task = &state.tasks["t"];
    assert_eq!(task.step("a").unwrap().state, StepState::WaitingForRetry);

    // `a` began to wait at 1 s: stale only once a whole minute has passed since; `b`,
    // pending, is not covered by a threshold of waiting for a retry.
    assert!(stale_steps(task, 61_000).is_empty(), "not yet");
    let retry = stale_reasons(&stale_steps(task, 61_001));
    assert_eq!(retry.len(), 1, "{retry:?}");
    assert_eq!(retry[0].0, "a");
    assert!(
        retry[0].1.contains("max_waiting_for_retry_minutes"),
        "{retry:?}"
    );

    // Five minutes after the task's creation every unfinished step is stale, the
    // pending one too, for the task's duration.
    assert_eq!(stale_reasons(&stale_steps(task, 301_000)), retry[..]);
    let stale = stale_steps(task, 301_001);
    let named: Vec<(String, bool)> = stale_reasons(&stale)
        .into_iter()
        .map(|(step, reason)| (step, reason.contains("max_duration_minutes")))
        .collect();
    assert_eq!(named, [("a".into(), true), ("b".into(), true)]);
    // The first fails its step and, nothing else running, the task; the pending step's
    // then finds the task closed and is refused (noted in its audit trail).
    assert_eq!(apply_at(&mut state, 301_001, stale), [true, false]);
    let task = &state.tasks["t"];
    let (a, b) = (task.step("a").unwrap(), task.step("b").unwrap());
    assert_eq!(
        (task.state, a.state, b.state),
        (TaskState::Error, StepState::Error, StepState::Pending)
    );
    let error = a.last_error.as_deref().unwrap();
    assert!(
        error.starts_with("stale: the task ran past lifecycle.max_duration_minutes"),
        "{error}"
    );
    assert!(b.refused[0].contains("step_stale"), "{:?}", b.refused);
}

/// `envs` with orchestrator lease events put in at the given indices (bids for the
/// next term or one beyond, renewals, by two holders; `holder` 2 and 3: releases by
/// them), so that snapshots also carry a leader, released or not, and decisions are
/// fenced part of the way.
fn with_leases(mut envs: Vec<Envelope>, leases: &[(usize, u64, usize)]) -> Vec<Envelope> {
    for &(at, term, holder) in leases {
        let name = ["o1", "o2"][holder % 2].to_string();
        let event = match holder {
            0 | 1 => Event::OrchestratorLease {
                term,
                holder: name,
                worker_lease_ms: 0,
                quiet_lease_ms: if term % 2 == 0 { 30_000 } else { 0 },
            },
            _ => Event::OrchestratorRelease { term, holder: name },
        };
        let at = at.min(envs.len());
        envs.insert(
            at,
            Envelope {
                ts_ms: at as u64,
                term: None,
                event,
            },
        );
    }
    envs
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn a_snapshot_and_the_tail_after_it_fold_to_the_state_of_a_full_replay(
        ops in prop::collection::vec(op(), 0..60),
        leases in prop::collection::vec((0usize..200, 1u64..3, 0usize..4), 0..4),
        cut in 0usize..200,
    ) {
        use embarcadero_workflow::snapshot;
        let envs = with_leases(events(&ops), &leases);
        let cut = cut.min(envs.len());
        let (full, applied) = fold(&envs);
        let (head, _) = fold(&envs[..cut]);
        let bytes = snapshot::encode("wf", head);
        let mut restored = snapshot::decode(&bytes, "wf").map_err(TestCaseError::fail)?;
        prop_assert_eq!(restored.next_position, cut as u64);
        let tail: Vec<bool> = envs
            .iter()
            .enumerate()
            .skip(cut)
            .map(|(i, e)| restored.apply(i as u64, e).is_ok())
            .collect();
        prop_assert_eq!(&tail[..], &applied[cut..], "the tail's events are refused alike");
        prop_assert_eq!(restored, full);
    }
}

/// Task `t` of a `fail_fast` batch of three: `w_001` failed for good while `w_002` ran
/// and `w_003` waited, so both were cancelled and the task is in `error`.
fn a_failed_fail_fast_batch() -> State {
    use embarcadero_workflow::{StepState, TaskState};
    let template = BATCH
        .replace("NAME", "batch_fail_fast")
        .replace("STRATEGY", "fail_fast");
    let at = of_t;
    let (claim, ok) = (claim_by_w1, success_by_w1);
    let mut state = State::default();
    let setup = vec![
        Event::TemplateRegistered {
            template: load(&template, None).unwrap(),
        },
        task_created("t", "batch_fail_fast", Some(2)),
        claim("an", 1),
        ok("an", 1, json!({"cursors": [1, 2, 3], "worker_count": 3})),
        // w_001 fails for good while w_002 runs and w_003 waits: fail_fast cancels both.
        claim("w_001", 1),
        claim("w_002", 1),
        Event::StepResult {
            at: at("w_001", 1),
            worker: "w1".into(),
            outcome: Outcome::Failure {
                message: "bad row".into(),
                retryable: false,
                retry_after_ms: None,
            },
        },
        Event::StepErrored {
            at: at("w_001", 1),
            reason: "failed, not retryable: bad row".into(),
        },
        // w_002's late result: refused, it was cancelled.
        ok("w_002", 1, json!(2)),
    ];
    let applied = apply_at(&mut state, 0, setup);
    assert_eq!(
        applied,
        [true, true, true, true, true, true, true, true, false]
    );
    let task = &state.tasks["t"];
    assert_eq!(task.state, TaskState::Error);
    use StepState::{Cancelled, Error};
    assert_eq!(instance_states(&state), [Error, Cancelled, Cancelled]);
    state
}

/// The states of task `t`'s three batch instances.
fn instance_states(s: &State) -> Vec<embarcadero_workflow::StepState> {
    ["w_001", "w_002", "w_003"]
        .iter()
        .map(|n| s.tasks["t"].step(n).unwrap().state)
        .collect()
}

/// An operator who resets, resolves or completes the failed instance of a `fail_fast`
/// batch (rather than rerunning the task) gets the siblings its failure cancelled back:
/// without them the batch's convergence would wait for ever.
#[test]
fn settling_the_failed_fail_fast_instance_by_hand_restores_its_cancelled_siblings() {
    use embarcadero_workflow::StepState::{Enqueued, ResolvedManually};
    let at = |step: &str| StepRef {
        task: "t".into(),
        step: step.into(),
        attempt: 1,
    };
    let reset = |step: &str| Event::StepReset {
        at: at(step),
        reason: "fixed".into(),
    };
    let mut state = a_failed_fail_fast_batch();
    assert_eq!(apply_at(&mut state, 1, vec![reset("w_001")]), [true]);
    assert_eq!(instance_states(&state), [Enqueued, Enqueued, Enqueued]);

    let mut state = a_failed_fail_fast_batch();
    let resolve = Event::StepResolved {
        at: at("w_001"),
        reason: "row skipped".into(),
        complete: false,
        result: None,
    };
    assert_eq!(apply_at(&mut state, 1, vec![resolve]), [true]);
    assert_eq!(
        instance_states(&state),
        [ResolvedManually, Enqueued, Enqueued]
    );
}

#[test]
fn a_rerun_restores_the_batch_instances_fail_fast_cancelled_and_the_task_completes() {
    use embarcadero_workflow::{StepState, TaskState};
    let (claim, ok) = (claim_by_w1, success_by_w1);
    let mut state = a_failed_fail_fast_batch();
    let states = instance_states;
    use StepState::{Cancelled, Complete, Enqueued};
    let rerun = Event::TaskRerun {
        task: "t".into(),
        reason: "fixed the row".into(),
    };
    assert_eq!(apply_at(&mut state, 1, vec![rerun]), [true]);
    // Every instance is enqueued again (protocol 2: by the fold) at its next attempt.
    assert_eq!(states(&state), [Enqueued, Enqueued, Enqueued]);
    let attempts: Vec<u32> = ["w_001", "w_002", "w_003"]
        .iter()
        .map(|n| state.tasks["t"].step(n).unwrap().attempt)
        .collect();
    assert_eq!(attempts, [2, 2, 2]);
    let w2 = state.tasks["t"].step("w_002").unwrap();
    assert!(
        w2.history
            .iter()
            .any(|h| (h.from, h.to) == (Cancelled, StepState::Pending)),
        "{:?}",
        w2.history
    );
    // The cancelled attempt's late result is still refused; the new attempts run.
    let mut rest = vec![ok("w_002", 1, json!(2))];
    for n in ["w_001", "w_002", "w_003"] {
        rest.push(claim(n, 2));
        rest.push(ok(n, 2, json!(1)));
    }
    rest.push(claim("agg", 1));
    rest.push(ok("agg", 1, json!(3)));
    let applied = apply_at(&mut state, 2, rest);
    assert!(!applied[0], "a superseded attempt's result");
    assert!(applied[1..].iter().all(|&a| a), "{applied:?}");
    assert_eq!(states(&state), [Complete, Complete, Complete]);
    assert_eq!(state.tasks["t"].state, TaskState::Complete);
}

/// Two steps, the second after the first, under a one-minute threshold for the task
/// waiting for dependencies.
const LIFECYCLE_DEPENDENCIES: &str = "name: life3\nnamespace: p\nversion: '1'
lifecycle: {max_waiting_for_dependencies_minutes: 1}
steps:
  - {name: a, handler: {callable: h}}
  - {name: b, dependencies: [a], handler: {callable: h}}";

/// `template_text` registered and task `t` of it created (protocol 1), at `ts_ms`.
fn one_task(template_text: &str, name: &str, ts_ms: u64) -> State {
    let mut state = State::default();
    let template = Event::TemplateRegistered {
        template: load(template_text, None).unwrap(),
    };
    let created = task_created("t", name, None);
    assert_eq!(
        apply_at(&mut state, ts_ms, vec![template, created]),
        [true; 2]
    );
    state
}

/// Attempt `attempt` of step `step` of task `t`.
fn of_t(step: &str, attempt: u32) -> StepRef {
    StepRef {
        task: "t".into(),
        step: step.into(),
        attempt,
    }
}

/// Worker `w1` claims attempt `attempt` of task `t`'s `step`.
fn claim_by_w1(step: &str, attempt: u32) -> Event {
    Event::StepClaimed {
        at: of_t(step, attempt),
        worker: "w1".into(),
    }
}

/// Worker `w1` returns `result` for attempt `attempt` of task `t`'s `step`.
fn success_by_w1(step: &str, attempt: u32, result: serde_json::Value) -> Event {
    Event::StepResult {
        at: of_t(step, attempt),
        worker: "w1".into(),
        outcome: Outcome::Success { result },
    }
}

/// Attempt `attempt` of `step` enqueued, claimed by `w` and returned with `outcome`.
fn run_attempt(step: &str, attempt: u32, outcome: Outcome) -> Vec<Event> {
    let at = of_t(step, attempt);
    vec![
        Event::StepEnqueued(at.clone()),
        Event::StepClaimed {
            at: at.clone(),
            worker: "w".into(),
        },
        Event::StepResult {
            at,
            worker: "w".into(),
            outcome,
        },
    ]
}

fn busy() -> Outcome {
    Outcome::Failure {
        message: "busy".into(),
        retryable: true,
        retry_after_ms: None,
    }
}

#[test]
fn a_task_waiting_for_dependencies_past_its_threshold_is_stale_but_not_one_whose_steps_run() {
    use embarcadero_workflow::staleness::stale_steps;
    use embarcadero_workflow::{StepState, TaskState};
    let mut state = one_task(LIFECYCLE_DEPENDENCIES, "life3", 0);
    // `a` runs for ten minutes (no threshold on running steps here) while `b` waits
    // behind it: the task is in process, not waiting, and nothing is stale.
    let claimed = run_attempt("a", 1, busy());
    assert_eq!(apply_at(&mut state, 0, claimed[..2].to_vec()), [true; 2]);
    assert_eq!(state.tasks["t"].state, TaskState::StepsInProcess);
    assert!(stale_steps(&state.tasks["t"], 600_000).is_empty());

    // At 10 min `a` fails and waits for a retry due in an hour; `b` waits behind it,
    // so the task waits for dependencies from then on.
    let failed = vec![
        claimed[2].clone(),
        Event::RetryScheduled {
            at: of_t("a", 1),
            due_ms: 4_200_000,
        },
    ];
    assert_eq!(apply_at(&mut state, 600_000, failed), [true; 2]);
    let task = &state.tasks["t"];
    assert_eq!(task.state, TaskState::WaitingForDependencies);
    let entered = task.history.last().unwrap();
    assert_eq!(
        (entered.to, entered.ts_ms),
        (TaskState::WaitingForDependencies, 600_000)
    );
    assert!(stale_steps(task, 660_000).is_empty(), "a minute, not more");
    let stale = stale_steps(task, 660_001);
    let reasons = stale_reasons(&stale);
    let steps: Vec<&str> = reasons.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(steps, ["a", "b"], "every unfinished step");
    assert!(
        reasons
            .iter()
            .all(|(_, r)| r.contains("lifecycle.max_waiting_for_dependencies_minutes (1)")),
        "{reasons:?}"
    );

    // The first fails `a` and the task (nothing else runs); `b`'s is then refused.
    assert_eq!(apply_at(&mut state, 660_001, stale), [true, false]);
    let task = &state.tasks["t"];
    let (a, b) = (task.step("a").unwrap(), task.step("b").unwrap());
    assert_eq!(
        (task.state, a.state, b.state),
        (TaskState::Error, StepState::Error, StepState::Pending)
    );
    assert!(a
        .last_error
        .as_deref()
        .unwrap()
        .starts_with("stale: the task waited for dependencies"));
}

#[test]
fn a_task_whose_only_unfinished_step_waits_for_a_retry_waits_for_the_retry_not_for_dependencies() {
    use embarcadero_workflow::staleness::stale_steps;
    use embarcadero_workflow::TaskState;
    let mut state = one_task(LIFECYCLE_DEPENDENCIES, "life3", 0);
    let ok = Outcome::Success { result: json!(1) };
    let mut events = run_attempt("a", 1, ok);
    events.push(Event::StepCompleted(of_t("a", 1)));
    events.extend(run_attempt("b", 1, busy()));
    events.push(Event::RetryScheduled {
        at: of_t("b", 1),
        due_ms: 4_200_000,
    });
    assert!(apply_at(&mut state, 0, events).iter().all(|&ok| ok));
    let task = &state.tasks["t"];
    assert_eq!(task.state, TaskState::WaitingForRetry);
    // Only `max_waiting_for_retry_minutes` (not set here) covers it.
    assert!(stale_steps(task, 3_600_000).is_empty());
}

#[test]
fn a_task_resolved_by_hand_ends_resolved_manually_with_its_unfinished_steps_cancelled() {
    use embarcadero_workflow::{Rejected, StepState, TaskState};
    let resolve = || Event::TaskResolved {
        task: "t".into(),
        reason: "settled by hand".into(),
    };
    // A task with `a` in progress and `b` pending.
    let mut state = one_task(DIAMOND, "diamond", 0);
    let running = run_attempt("a", 1, Outcome::Success { result: json!(1) });
    assert_eq!(apply_at(&mut state, 1, running[..2].to_vec()), [true; 2]);
    assert_eq!(apply_at(&mut state, 2, vec![resolve()]), [true]);
    let task = &state.tasks["t"];
    assert_eq!(task.state, TaskState::ResolvedManually);
    assert_eq!(task.resolution.as_deref(), Some("settled by hand"));
    assert_eq!(task.completed_ms, Some(2));
    let last = task.history.last().unwrap();
    assert_eq!(
        (last.from, last.to),
        (TaskState::StepsInProcess, TaskState::ResolvedManually)
    );
    assert!(
        task.steps.iter().all(|s| s.state == StepState::Cancelled),
        "{:?}",
        task.steps
    );
    assert_eq!(state.open_tasks(), 0);
    // Nothing moves it again: the late result, a second resolution, a cancel, a rerun.
    let later = vec![
        running[2].clone(),
        resolve(),
        Event::TaskCancelled {
            task: "t".into(),
            reason: "x".into(),
        },
        Event::TaskRerun {
            task: "t".into(),
            reason: "x".into(),
        },
    ];
    let before = state.tasks["t"].clone();
    assert_eq!(apply_at(&mut state, 3, later), [false; 4]);
    assert_eq!(state.tasks["t"].history, before.history);
    let refused = Event::TaskResolved {
        task: "t".into(),
        reason: String::new(),
    };
    let env = Envelope {
        ts_ms: 4,
        term: None,
        event: refused,
    };
    let why = state.apply(state.next_position, &env);
    assert!(
        matches!(
            &why,
            Err(Rejected::TaskClosed {
                state: TaskState::ResolvedManually,
                ..
            })
        ),
        "{why:?}"
    );

    // A failed task may be resolved (its failed step keeps its error); a complete one not.
    let mut failed = one_task(PERMANENT_ONE, "once", 0);
    let fails = Outcome::Failure {
        message: "no".into(),
        retryable: false,
        retry_after_ms: None,
    };
    let mut events = run_attempt("a", 1, fails);
    events.push(Event::StepErrored {
        at: of_t("a", 1),
        reason: "failed, not retryable".into(),
    });
    assert!(apply_at(&mut failed, 0, events).iter().all(|&ok| ok));
    assert_eq!(failed.tasks["t"].state, TaskState::Error);
    assert_eq!(apply_at(&mut failed, 1, vec![resolve()]), [true]);
    let task = &failed.tasks["t"];
    assert_eq!(
        (task.state, task.steps[0].state),
        (TaskState::ResolvedManually, StepState::Error)
    );

    let mut complete = one_task(PERMANENT_ONE, "once", 0);
    let mut events = run_attempt("a", 1, Outcome::Success { result: json!(1) });
    events.push(Event::StepCompleted(of_t("a", 1)));
    assert!(apply_at(&mut complete, 0, events).iter().all(|&ok| ok));
    assert_eq!(complete.tasks["t"].state, TaskState::Complete);
    assert_eq!(apply_at(&mut complete, 1, vec![resolve()]), [false]);
    assert_eq!(complete.tasks["t"].state, TaskState::Complete);
}

/// One step, never retried.
const PERMANENT_ONE: &str = "name: once\nnamespace: p\nversion: '1'
steps:
  - {name: a, handler: {callable: h}, retry: {retryable: false}}";

/// A `fail_fast` batch of two instances and their convergence, under a one-minute
/// threshold for waiting for dependencies.
const LIFECYCLE_BATCH: &str = "name: life4\nnamespace: p\nversion: '1'
lifecycle: {max_waiting_for_dependencies_minutes: 1}
steps:
  - {name: an, type: batchable, handler: {callable: x}, batch_config: {failure_strategy: fail_fast}}
  - {name: w, type: batch_worker, dependencies: [an], handler: {callable: x}, retry: {max_attempts: 1}}
  - {name: agg, type: deferred_convergence, dependencies: [w], handler: {callable: x}}";

#[test]
fn a_fail_fast_batch_reset_by_hand_does_not_wait_for_its_cut_short_instance() {
    use embarcadero_workflow::staleness::stale_steps;
    use embarcadero_workflow::{StepState, TaskState};
    let mut state = one_task(LIFECYCLE_BATCH, "life4", 0);
    let cursors = json!({"cursors": [0, 1], "worker_count": 2});
    let mut events = run_attempt("an", 1, Outcome::Success { result: cursors });
    events.push(Event::StepCompleted(of_t("an", 1)));
    // The first instance fails for good: `fail_fast` cancels the second, the task fails.
    let no = Outcome::Failure {
        message: "no".into(),
        retryable: false,
        retry_after_ms: None,
    };
    events.extend(run_attempt("w_001", 1, no));
    events.push(Event::StepErrored {
        at: of_t("w_001", 1),
        reason: "failed, not retryable".into(),
    });
    assert!(apply_at(&mut state, 0, events).iter().all(|&ok| ok));
    assert_eq!(state.tasks["t"].state, TaskState::Error);
    assert_eq!(
        state.tasks["t"].step("w_002").unwrap().state,
        StepState::Cancelled
    );

    // An operator resets the failed instance (not a rerun of the task), which then
    // succeeds: its cancelled sibling comes back with it (`manual::restore_cut_short`),
    // so the task does not sit waiting for an instance that can never run, and its
    // threshold has nothing to fail a minute later.
    let mut events = vec![Event::StepReset {
        at: of_t("w_001", 1),
        reason: "try again".into(),
    }];
    events.extend(run_attempt(
        "w_001",
        2,
        Outcome::Success { result: json!(1) },
    ));
    events.push(Event::StepCompleted(of_t("w_001", 2)));
    assert!(apply_at(&mut state, 10_000, events).iter().all(|&ok| ok));
    let task = &state.tasks["t"];
    assert_eq!(task.step("w_002").unwrap().state, StepState::Pending);
    assert_ne!(task.state, TaskState::WaitingForDependencies);
    assert!(stale_steps(task, 70_001).is_empty());
}
