//! What a snapshot costs as the state grows (a benchmark, not a test): folds N finished
//! linear 4-step tasks (protocol 2: created, then a claim and a result per step, as
//! the engine writes them), then times the clone under the lock (the only part the fold
//! waits for), what folding 1,000 more tasks costs with and without a clone sharing
//! the state (copy on write), encoding, the durable write, and loading it back.
//!
//! `cargo run --release -p embarcadero-workflow --example snapshot_cost -- 1000 10000`

use embarcadero_workflow::event::{Envelope, Event, Outcome, StepRef};
use embarcadero_workflow::{snapshot, State};
use serde_json::json;
use std::time::Instant;

const LINEAR: &str = "name: linear\nnamespace: bench\nversion: '1'\nsteps:
  - {name: one, handler: {callable: x}}
  - {name: two, dependencies: [one], handler: {callable: x}}
  - {name: three, dependencies: [two], handler: {callable: x}}
  - {name: four, dependencies: [three], handler: {callable: x}}
";

fn apply(state: &mut State, event: Event) {
    let env = Envelope {
        ts_ms: state.next_position,
        term: None,
        event,
    };
    let position = state.next_position;
    state.apply(position, &env).expect("every event applies");
}

/// A state holding `n` finished linear tasks.
fn state_of(n: usize) -> State {
    let mut state = State::default();
    let template = embarcadero_workflow::validate::load(LINEAR, None).unwrap();
    apply(&mut state, Event::TemplateRegistered { template });
    add_tasks(&mut state, 0..n);
    state
}

/// Folds the linear tasks numbered `range` to their end.
fn add_tasks(state: &mut State, range: std::ops::Range<usize>) {
    for i in range {
        let task = format!("task-{i:08}");
        apply(
            state,
            Event::TaskCreated {
                task: task.clone(),
                namespace: "bench".into(),
                name: "linear".into(),
                version: "1".into(),
                context: json!({"even_number": 2}),
                idempotency_key: None,
                identity: Some(format!("sha256:{i:064x}")),
                protocol: Some(2),
            },
        );
        for step in ["one", "two", "three", "four"] {
            let at = StepRef {
                task: task.clone(),
                step: step.into(),
                attempt: 1,
            };
            let worker = "worker-1".to_string();
            apply(
                state,
                Event::StepClaimed {
                    at: at.clone(),
                    worker: worker.clone(),
                },
            );
            let outcome = Outcome::Success {
                result: json!({"value": 65536, "attempt": 1}),
            };
            apply(
                state,
                Event::StepResult {
                    at,
                    worker,
                    outcome,
                },
            );
        }
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("task counts"))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    println!("tasks  events  clone_ms  encode_ms  bytes  write_ms  load_ms  fold_1000_shared_ms  fold_1000_ms");
    for n in sizes {
        let state = state_of(n);
        let t = Instant::now();
        let copy = state.clone();
        let clone_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let bytes = snapshot::encode("wf", copy.clone()).len();
        let encode_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let path = snapshot::write(dir.path(), "wf", copy).unwrap();
        let write_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let (back, _) = snapshot::load_newest(dir.path(), "wf", u64::MAX).unwrap();
        let load_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(back, state, "the snapshot reads back as the state");
        std::fs::remove_file(path).unwrap();
        drop(back);
        // What the fold pays while a snapshot's clone shares the state (copy on write):
        // 1,000 more tasks folded into the shared state, then into one of its own (built
        // afresh; last, so that no timing includes the allocator's clean-up of it).
        let fold_ms = |mut s: State| {
            let t = Instant::now();
            add_tasks(&mut s, n..n + 1000);
            t.elapsed().as_secs_f64() * 1e3
        };
        let shared = state.clone();
        let fold_1000_shared_ms = fold_ms(shared);
        let fresh = state_of(n);
        let fold_1000_ms = fold_ms(fresh);
        println!(
            "{n}  {}  {clone_ms:.3}  {encode_ms:.2}  {bytes}  {write_ms:.2}  {load_ms:.2}  {fold_1000_shared_ms:.2}  {fold_1000_ms:.2}",
            state.next_position
        );
    }
}
