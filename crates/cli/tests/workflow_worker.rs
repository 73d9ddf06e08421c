//! The worker's way out, end to end: a real `embarcadero serve` and `embarcadero
//! orchestrator`, and workers either in this process (`embarcadero_workflow::Worker` with
//! handlers of the test's own, which it can hold and release) or `embarcadero worker`
//! processes. A draining worker keeps heartbeating until its handlers have returned and
//! claims nothing more; a result too large for the log fails its step at once; a stop
//! during a supervised worker's backoff returns at once.

mod common;

use common::{Proc, Serve};
use embarcadero_workflow::client::ApiClient;
use embarcadero_workflow::log::LogConfig;
use embarcadero_workflow::supervisor::Report;
use embarcadero_workflow::{
    Registry, RestartPolicy, StepContext, StepError, SupervisedWorker, Worker, WorkerConfig,
    WorkerEvent,
};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The lease of every process here: short, so that a lost heartbeat shows within the
/// test, long enough for a loaded machine's worker to heartbeat in time.
const LEASE_MS: u64 = 2000;

/// A held step, then a quick one after it.
const TWO_STEPS: &str = "name: held
namespace: demo
version: 1.0.0
steps:
  - {name: held, handler: {callable: t.held}}
  - {name: next, dependencies: [held], handler: {callable: t.quick}}
";

/// One step returning as many bytes as its context's `size` says, retried up to three
/// times if it fails retryably.
const BIG: &str = "name: big
namespace: demo
version: 1.0.0
steps:
  - name: make
    handler: {callable: t.big}
    retry: {max_attempts: 3, backoff: none}
";

/// A built-in handler sleeping 4 s (two leases), then a quick step.
const NAP: &str = "name: nap
namespace: demo
version: 1.0.0
steps:
  - {name: nap, handler: {callable: test.sleep, initialization: {ms: 4000}}}
  - {name: after, dependencies: [nap], handler: {callable: test.sleep}}
";

/// A server and an orchestrator accepting any handler name (the test's are not built in).
struct Engine {
    _orchestrator: Proc,
    api: ApiClient,
    serve: Serve,
    _dir: tempfile::TempDir,
}

impl Engine {
    fn start(templates: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let serve = Serve::start(dir.path());
        let lease = LEASE_MS.to_string();
        let args = [
            "orchestrator",
            "--control",
            &serve.control,
            "--listen",
            "127.0.0.1:0",
            "--lease-ms",
            &lease,
            "--any-handler",
        ];
        let (orchestrator, line) = Proc::ready(&args, &[], "workflow orchestrator is serving");
        let api = ApiClient::new(line.rsplit("http://").next().unwrap().trim());
        for t in templates {
            api.register_template(t).unwrap();
        }
        Self {
            _orchestrator: orchestrator,
            api,
            serve,
            _dir: dir,
        }
    }

    /// A worker in this process running `registry`, one attempt at a time.
    fn worker(&self, registry: Registry) -> Worker {
        Worker::start(worker_config(&self.serve.control), registry).unwrap()
    }

    /// An `embarcadero worker` process (built-in handlers); returns it and its id.
    fn worker_process(&self) -> (Proc, String) {
        let lease = LEASE_MS.to_string();
        let args = [
            "worker",
            "--control",
            &self.serve.control,
            "--lease-ms",
            &lease,
        ];
        let (p, line) = Proc::ready(&args, &[], "is running");
        let id = line.split("workflow worker ").nth(1).unwrap();
        (p, id.split(' ').next().unwrap().to_string())
    }

    fn create(&self, name: &str, context: Value) -> String {
        let t = self.api.create_task("demo", name, "1.0.0", context, None);
        t.unwrap()["task_uuid"].as_str().unwrap().to_string()
    }

    /// The task once `cond` holds (polled; at most 60 s).
    fn until(&self, uuid: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + HANG_GUARD;
        loop {
            let t = self.api.get_task(uuid, 0).unwrap();
            if cond(&t) {
                return t;
            }
            assert!(Instant::now() < deadline, "waited for {what}: {t:#}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// How long a poll waits before it fails the test: a hang guard, not a timing.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// Polls `cond` until it holds; fails the test after [`HANG_GUARD`].
fn poll(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + HANG_GUARD;
    while !cond() {
        assert!(Instant::now() < deadline, "waited for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn step<'a>(task: &'a Value, name: &str) -> &'a Value {
    let steps = task["steps"].as_array().unwrap();
    steps.iter().find(|s| s["name"] == name).unwrap()
}

/// A handler that counts its runs and returns only once released, and whether it has.
#[derive(Clone, Default)]
struct Held {
    runs: Arc<AtomicU32>,
    release_at: Arc<Mutex<Option<Instant>>>,
    returned: Arc<AtomicBool>,
}

impl Held {
    fn handler(&self) -> impl Fn(&StepContext) -> Result<Value, StepError> + Send + Sync {
        let held = self.clone();
        move |ctx: &StepContext| {
            held.runs.fetch_add(1, Ordering::SeqCst);
            // The handler's own running time (until the test's moment), not a wait for
            // another thread to be ready.
            while !held
                .release_at
                .lock()
                .unwrap()
                .is_some_and(|at| Instant::now() >= at)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            held.returned.store(true, Ordering::SeqCst);
            Ok(json!({"attempt": ctx.attempt}))
        }
    }

    fn release_at(&self, at: Instant) {
        *self.release_at.lock().unwrap() = Some(at);
    }

    fn runs(&self) -> u32 {
        self.runs.load(Ordering::SeqCst)
    }
}

/// A quick handler counting its runs and naming its worker in its result.
fn quick(
    runs: &Arc<AtomicU32>,
    who: &str,
) -> impl Fn(&StepContext) -> Result<Value, StepError> + Send + Sync {
    let (runs, who) = (runs.clone(), who.to_string());
    move |ctx: &StepContext| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(json!({"attempt": ctx.attempt, "by": who}))
    }
}

/// One attempt, accepted, no lease lost and nothing refused.
fn accepted_at_attempt_1(s: &Value) {
    assert_eq!(s["current_state"], "complete", "{s:#}");
    assert_eq!(
        (&s["attempts"], &s["lease_losses"]),
        (&json!(1), &json!(0)),
        "{s:#}"
    );
    assert_eq!(s["result"]["attempt"], 1, "{s:#}");
    assert_eq!(s["refused_events"], json!([]), "{s:#}");
}

#[test]
fn a_draining_worker_heartbeats_until_its_handler_returns_two_leases_later_and_its_result_is_accepted_at_attempt_1(
) {
    let engine = Engine::start(&[TWO_STEPS]);
    let held = Held::default();
    let mut registry = Registry::new();
    registry.register("t.held", held.handler());
    let mut worker = engine.worker(registry);
    let uuid = engine.create("held", json!({}));
    poll("the handler to start", || held.runs() == 1);
    // The drain begins while the handler runs, which then runs on for two and a half
    // leases: a worker that stopped heartbeating at the drain would lose its attempt.
    worker.drain_switch().begin();
    held.release_at(Instant::now() + Duration::from_millis(LEASE_MS * 5 / 2));
    worker.stop_and_drain().unwrap();
    assert!(
        held.returned.load(Ordering::SeqCst),
        "the drain waits for the handler"
    );
    let t = engine.until(&uuid, "the held step to complete", |t| {
        step(t, "held")["current_state"] == "complete"
    });
    accepted_at_attempt_1(step(&t, "held"));
    assert_eq!(held.runs(), 1, "run once: {t:#}");
    assert_eq!(step(&t, "held")["worker"], json!(worker.id));
}

#[test]
fn a_draining_worker_claims_nothing_more_and_another_worker_runs_the_next_step_at_attempt_1() {
    let engine = Engine::start(&[TWO_STEPS]);
    let (held, first_quick) = (Held::default(), Arc::new(AtomicU32::new(0)));
    let mut registry = Registry::new();
    registry.register("t.held", held.handler());
    registry.register("t.quick", quick(&first_quick, "first"));
    // The first worker has the next step's handler and a free slot once the held step's
    // result goes out: undrained, it would claim the next step with that result.
    let mut first = engine.worker(registry);
    let uuid = engine.create("held", json!({}));
    poll("the handler to start", || held.runs() == 1);
    first.drain_switch().begin();
    held.release_at(Instant::now());
    first.stop_and_drain().unwrap();
    // A claim ahead travels in the result's append, so it is folded by the time the
    // result is: the next step, enqueued by the result, is still unclaimed after it.
    let t = engine.until(&uuid, "the held step to complete", |t| {
        step(t, "held")["current_state"] == "complete"
    });
    let next = step(&t, "next");
    assert_eq!(next["current_state"], "enqueued", "{next:#}");
    assert_eq!(next["worker"], Value::Null, "{next:#}");

    let second_quick = Arc::new(AtomicU32::new(0));
    let mut registry = Registry::new();
    registry.register("t.quick", quick(&second_quick, "second"));
    let mut second = engine.worker(registry);
    let t = engine.api.get_task(&uuid, 60).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let next = step(&t, "next");
    accepted_at_attempt_1(next);
    assert_eq!(
        (&next["worker"], &next["result"]["by"]),
        (&json!(second.id), &json!("second"))
    );
    assert_eq!(first_quick.load(Ordering::SeqCst), 0);
    assert_eq!(second_quick.load(Ordering::SeqCst), 1);
    second.stop_and_drain().unwrap();
}

#[test]
fn a_result_too_large_for_the_log_fails_its_step_at_once_naming_the_limit_and_frees_its_slot() {
    let engine = Engine::start(&[BIG]);
    let runs = Arc::new(AtomicU32::new(0));
    let counted = runs.clone();
    let mut registry = Registry::new();
    registry.register("t.big", move |ctx: &StepContext| {
        counted.fetch_add(1, Ordering::SeqCst);
        let size = ctx.context["size"].as_u64().unwrap() as usize;
        Ok(json!({"blob": "x".repeat(size)}))
    });
    // One slot: a leaked one would leave the second task below unclaimed.
    let mut worker = engine.worker(registry);
    let uuid = engine.create("big", json!({"size": 1_100_000}));
    let t = engine.api.get_task(&uuid, 60).unwrap();
    assert_eq!(t["status"], "error", "{t:#}");
    let make = step(&t, "make");
    // Not retried (the same input gives the same result) though the policy allows 3.
    assert_eq!(
        (&make["attempts"], &make["failures"], &make["lease_losses"]),
        (&json!(1), &json!(1), &json!(0)),
        "{make:#}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let error = make["last_error"].as_str().unwrap();
    assert!(
        error.starts_with("failed, not retryable: the handler's result is too large for the log")
            && error.contains("over the maximum message size of 1048576 bytes"),
        "{error}"
    );
    let dlq = engine.api.request("GET", "/v1/dlq", None).unwrap();
    let entry = &dlq["entries"][0];
    assert_eq!(
        (&entry["reason"], &entry["error"], &entry["attempts"]),
        (&json!("permanent_failure"), &json!(error), &json!(1)),
        "{dlq:#}"
    );

    let small = engine.create("big", json!({"size": 10}));
    let t = engine.api.get_task(&small, 60).unwrap();
    assert_eq!(t["status"], "complete", "the slot was freed: {t:#}");
    assert_eq!(worker.running(), 0);
    worker.stop_and_drain().unwrap();
}

#[test]
fn sigterm_drains_an_embarcadero_worker_whose_result_is_then_accepted_and_which_claims_nothing_more(
) {
    let engine = Engine::start(&[NAP]);
    let (mut first, first_id) = engine.worker_process();
    let uuid = engine.create("nap", json!({}));
    engine.until(&uuid, "the first worker's claim", |t| {
        step(t, "nap")["worker"] == first_id.as_str()
    });
    // The handler sleeps four leases from its start; the worker is told to stop well
    // before it returns.
    first.signal("TERM");
    first.wait_line("is draining");
    first.wait_line("drained");
    assert!(first.wait().success(), "a drained worker exits 0");
    let t = engine.until(&uuid, "the nap to complete", |t| {
        step(t, "nap")["current_state"] == "complete"
    });
    accepted_at_attempt_1(step(&t, "nap"));
    let after = step(&t, "after");
    assert_eq!(after["current_state"], "enqueued", "{after:#}");

    let (_second, second_id) = engine.worker_process();
    let t = engine.api.get_task(&uuid, 60).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let after = step(&t, "after");
    accepted_at_attempt_1(after);
    assert_eq!(after["worker"], json!(second_id));
}

/// The configuration of the tests' workers: namespace `demo` on the durable
/// `workflow.events` of the server at `control`, one attempt at a time.
fn worker_config(control: &str) -> WorkerConfig {
    let mut log = LogConfig::new(control, "workflow.events");
    (log.ack, log.replication_factor) = (2, 2);
    WorkerConfig {
        log,
        namespaces: vec!["demo".into()],
        concurrency: 1,
        lease_ms: LEASE_MS,
        run_log: None,
    }
}

/// A supervised worker stopped while its worker runs drains that worker and names it
/// (`embarcadero worker` says so on SIGTERM); one stopped during a backoff names none
/// (below).
#[test]
fn a_supervised_worker_stopped_while_it_runs_names_the_worker_it_drained() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start_with(dir.path(), &["--brokers", "1"]);
    let report: Report = Arc::new(|_: &WorkerEvent| {});
    let cfg = worker_config(&serve.control);
    let policy = RestartPolicy::default();
    let mut worker = SupervisedWorker::start(cfg, Registry::builtin(), policy, report).unwrap();
    let id = worker.id();
    worker.stop_and_drain().unwrap();
    assert_eq!(worker.handle().drained(), Some(id));
}

/// A supervised worker whose server is SIGKILLed reports that it lost the log, then waits
/// out its backoff (here ten minutes, longer than the hang guard: only a stop that does not
/// wait for it lets the test end); a drain asked meanwhile returns without starting a new
/// worker, and the supervision has ended for good.
#[test]
fn a_stop_during_a_supervised_workers_backoff_returns_at_once_and_starts_no_new_worker() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start_with(dir.path(), &["--brokers", "1"]);
    let cfg = worker_config(&serve.control);
    let policy = RestartPolicy {
        first_backoff: Duration::from_secs(600),
        max_backoff: Duration::from_secs(600),
        ..RestartPolicy::default()
    };
    let (tx, reports) = std::sync::mpsc::channel::<(&'static str, String)>();
    let tx = Mutex::new(tx);
    let report: Report = Arc::new(move |e: &WorkerEvent| {
        let _ = tx.lock().unwrap().send((e.kind(), e.to_string()));
    });
    let mut worker = SupervisedWorker::start(cfg, Registry::builtin(), policy, report).unwrap();
    let first = worker.id();
    serve.kill();
    let (kind, said) = reports.recv_timeout(HANG_GUARD).unwrap();
    assert_eq!(kind, "failed", "{said}");
    assert!(
        said.contains(&first) && said.contains("600000 ms"),
        "{said}"
    );
    assert!(!worker.is_finished(), "a lost log is waited out");
    worker.stop_and_drain().unwrap();
    assert!(worker.is_finished());
    assert_eq!(worker.id(), first, "no new worker");
    assert_eq!(worker.handle().drained(), None, "no worker ran to drain");
    let after: Vec<_> = reports.try_iter().collect();
    assert!(after.is_empty(), "nothing started or drained: {after:?}");
}
