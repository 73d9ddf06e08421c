//! A worker: folds the event log like the orchestrator does, claims enqueued attempts
//! of its namespaces whose handler it has (a claim is an event; the first claim of an
//! attempt in log order wins, and every reader agrees which), runs the attempts it won
//! each on a thread of its own ([`crate::threads`]) with the step's timeout, publishes their results, and
//! heartbeats while it holds any.
//!
//! Claiming ahead (tasks of protocol 2): when a handler succeeds, the worker works out
//! on a copy of the task which steps the fold will enqueue at its result (the fold
//! completes the step and enqueues what became ready, [`crate::settle`]) and publishes
//! its claims of those it can run right behind the result, in the same session, so they
//! follow it in the log. A claim is an ordinary claim: the fold accepts it only if the
//! attempt is enqueued when it arrives (else refuses it, and the worker claims as usual
//! once it sees the step), and the worker runs an attempt only after reading its own
//! winning claim. What it saves is the trip of the enqueue to the worker.
//!
//! Draining ([`Worker::stop_and_drain`], [`DrainSwitch`]): the worker claims nothing more
//! (neither in the loop nor ahead), but its loop runs on, reading the log and
//! heartbeating, until every attempt it holds has published its result; then the loop
//! ends by itself. Heartbeats must go on: the orchestrator takes back an attempt whose
//! worker is silent for a lease, and refuses the result that comes after.

use crate::event::Envelope;
use crate::event::{Event, Outcome, StepRef};
use crate::handler::{BatchInput, Cancellation, CheckpointSink, Registry, StepContext, StepError};
use crate::ids::{new_uuid, now_ms};
use crate::log::{ensure_topic, Folded, Folder, LogConfig, Shared, Writer};
use crate::machine::StepState;
use crate::state::State;
use crate::threads::Threads;
use embarcadero_client::Error;
use parking_lot::{Condvar, Mutex};
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Step attempts a worker runs at once unless told otherwise (`--concurrency`, and the
/// SDK workers' `concurrency`, which repeat the number). A slot is held from the claim
/// until the result is in the log, and a task's next step is claimed while its last
/// result goes out, so a worker holds about this many tasks in flight: at 8, one worker
/// topped out near 800 linear tasks/s with its handlers idle (docs/PERFORMANCE.md,
/// session 21); 32 idle threads cost little, and handlers that wait on I/O want them.
pub const DEFAULT_CONCURRENCY: usize = 32;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub log: LogConfig,
    /// Namespaces served; empty: all.
    pub namespaces: Vec<String>,
    /// Attempts run at once.
    pub concurrency: usize,
    /// The orchestrator's lease; heartbeats go out three times per lease.
    pub lease_ms: u64,
    /// Where to append `task step attempt worker` before each handler run (the chaos
    /// test counts runs against the audit trail); `None`: nowhere.
    pub run_log: Option<PathBuf>,
}

pub struct Worker {
    pub id: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), Error>>>,
    /// Shared with the loop and the attempts' threads, for [`Worker::stop_and_drain`].
    steps: Arc<Steps>,
}

/// Begins a worker's drain without waiting for it and without holding the [`Worker`]
/// (a handler may begin it: waiting there would mean waiting for itself). The worker
/// claims nothing more; its loop heartbeats until every attempt it holds has published
/// its result, then ends ([`Worker::is_finished`]).
#[derive(Clone)]
pub struct DrainSwitch(Arc<AtomicBool>);

impl DrainSwitch {
    pub fn begin(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Worker {
    pub fn start(cfg: WorkerConfig, registry: Registry) -> Result<Self, Error> {
        let replay_end = ensure_topic(&cfg.log)?;
        let id = format!("worker-{}", &new_uuid()[..8]);
        let stop = Arc::new(AtomicBool::new(false));
        let steps = Arc::new(Steps {
            worker: id.clone(),
            shared: Arc::new(Shared::default()),
            writer: Arc::new(Writer::open(&cfg.log)?),
            registry,
            namespaces: cfg.namespaces.clone(),
            concurrency: cfg.concurrency,
            draining: Arc::new(AtomicBool::new(false)),
            running: AtomicUsize::new(0),
            ended_lock: Mutex::new(()),
            ended: Condvar::new(),
            claims: Mutex::new(HashSet::new()),
            attempts: Mutex::new(Vec::new()),
            run_log: cfg.run_log.clone(),
            threads: Threads::new("step", THREAD_LINGER),
        });
        let mut runtime = Runtime {
            folder: Folder::open(&cfg.log, &id)?,
            steps: steps.clone(),
            last_heartbeat: 0,
            lease_ms: cfg.lease_ms,
            replay_end,
            cfg,
        };
        let stop_flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("worker".into())
            .spawn(move || runtime.run(&stop_flag))
            .map_err(|e| Error::Config(format!("cannot start the worker thread: {e}")))?;
        Ok(Self {
            id,
            stop,
            thread: Some(thread),
            steps,
        })
    }

    /// Stops claiming and heartbeating and returns once the loop has ended (attempts
    /// running finish on their own threads and publish their results, but nothing keeps
    /// their lease: one that outlives it is taken back). For a graceful stop, see
    /// [`Worker::stop_and_drain`].
    pub fn stop(&mut self) -> Result<(), Error> {
        self.stop.store(true, Ordering::SeqCst);
        self.join()
    }

    fn join(&mut self) -> Result<(), Error> {
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::Config("the worker thread panicked".into())),
            None => Ok(()),
        }
    }

    /// What begins this worker's drain from anywhere; see [`DrainSwitch`].
    pub fn drain_switch(&self) -> DrainSwitch {
        DrainSwitch(self.steps.draining.clone())
    }

    /// Attempts whose handler runs now (or whose result is being published).
    pub fn running(&self) -> usize {
        self.steps.running.load(Ordering::SeqCst)
    }

    /// Drains the worker ([`DrainSwitch`]: no new claim, heartbeats until every attempt
    /// it holds has published its result; an attempt past its step's timeout is reported
    /// as timed out), waits for the loop to end, then until the log has acknowledged
    /// every event the worker published: once it returns, the process may exit without
    /// leaving a result to a lease expiry. A claim published before the drain began that
    /// wins is run like the others (there is no event to give an attempt back, and
    /// leaving it would cost a lease expiry). Returns the error that ended the loop if
    /// one did, else a failed flush's.
    pub fn stop_and_drain(&mut self) -> Result<(), Error> {
        self.drain_switch().begin();
        let ended = self.join();
        let steps = &self.steps;
        loop {
            // Nothing runs once the loop ended by draining; if it failed instead (the log
            // did), it neither heartbeats nor times attempts out: the latter is done here.
            steps.time_out_overdue();
            let mut ended = steps.ended_lock.lock();
            if steps.running.load(Ordering::SeqCst) == 0 {
                break;
            }
            steps.ended.wait_for(&mut ended, POLL);
        }
        let flushed = steps.writer.flush();
        ended.and(flushed)
    }

    /// Whether the loop has ended (it fails when the log does).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

struct Runtime {
    cfg: WorkerConfig,
    folder: Folder,
    steps: Arc<Steps>,
    last_heartbeat: u64,
    /// The lease heartbeats keep: the shorter of `cfg.lease_ms` and the one the
    /// orchestrator tells in its lease events (a worker configured with a longer lease
    /// heartbeated too seldom, and had its steps taken back and run again while they ran).
    lease_ms: u64,
    replay_end: u64,
}

/// What the worker loop and the threads running attempts share.
struct Steps {
    worker: String,
    shared: Arc<Shared>,
    writer: Arc<Writer>,
    registry: Registry,
    namespaces: Vec<String>,
    concurrency: usize,
    /// Set once a drain began ([`DrainSwitch`]): nothing more is claimed.
    draining: Arc<AtomicBool>,
    /// Attempts whose handler is running (or whose result is being published).
    running: AtomicUsize,
    /// Notified (under `ended_lock`) each time an attempt's result is out and `running`
    /// went down, for [`Worker::stop_and_drain`].
    ended_lock: Mutex<()>,
    ended: Condvar,
    /// Claims published (or about to be) and not yet decided by the log.
    claims: Mutex<HashSet<StepRef>>,
    /// The attempts whose handler runs, for the loop to time out.
    attempts: Mutex<Vec<Arc<Running>>>,
    run_log: Option<PathBuf>,
    /// The threads attempts run on.
    threads: Threads,
}

/// An attempt whose handler runs on a thread of its own. Whoever reports it first
/// publishes its result: the thread with the handler's outcome, or the worker loop
/// with a timeout once `deadline` has passed (the thread is then left to finish, and
/// its late outcome is dropped). One thread per attempt, none to wait for it.
struct Running {
    at: StepRef,
    deadline: Instant,
    timeout: Duration,
    reported: AtomicBool,
    /// The handler's [`Cancellation`], set when the log no longer wants the outcome.
    cancellation: Cancellation,
}

impl Running {
    /// The outcome of an attempt past its deadline: a retryable failure.
    fn timed_out(&self) -> Outcome {
        let why = format!("timed out after {} s", self.timeout.as_secs());
        failure(StepError::retryable(why))
    }
}

const POLL: Duration = Duration::from_millis(20);
/// How long a thread that ran an attempt waits for another before it ends.
const THREAD_LINGER: Duration = Duration::from_secs(10);

impl Runtime {
    fn run(&mut self, stop: &AtomicBool) -> Result<(), Error> {
        let mut drain_began = None;
        while !stop.load(Ordering::SeqCst) {
            let folded = self.folder.pump(&self.steps.shared, POLL)?;
            // While draining too: a claim published before the drain may still win, and
            // is then run (see `Worker::stop_and_drain`).
            for f in &folded {
                self.settle_claim(f);
                self.learn_lease(f);
            }
            self.steps.time_out_overdue();
            if !folded.is_empty() {
                self.steps.call_off_unwanted();
            }
            let draining = self.steps.draining.load(Ordering::SeqCst);
            if draining && self.drained(*drain_began.get_or_insert_with(Instant::now)) {
                return Ok(());
            }
            if !self.folder.replayed(&self.steps.shared, self.replay_end) {
                continue;
            }
            if !draining {
                self.claim_more()?;
            }
            self.heartbeat()?;
        }
        Ok(())
    }

    /// Whether a drain that began at `began` is over: no attempt runs and no claim of
    /// this worker awaits its verdict from the log. A claim not read back a lease after
    /// the drain began is given up, so that a claim the log lost cannot hold the drain
    /// for ever (claims come back within milliseconds; should one that late still win,
    /// its attempt goes back after a lease, as any attempt of a vanished worker).
    fn drained(&self, began: Instant) -> bool {
        if self.steps.running.load(Ordering::SeqCst) > 0 {
            return false;
        }
        let undecided = self.steps.claims.lock().len();
        let lease = Duration::from_millis(self.cfg.lease_ms);
        if undecided > 0 && began.elapsed() >= lease {
            tracing::warn!("drained with {undecided} claim(s) never read back from the log");
            return true;
        }
        undecided == 0
    }

    /// A claim of ours came back through the log: run it if it won.
    fn settle_claim(&mut self, f: &Folded) {
        let Some(Event::StepClaimed { at, worker }) = f.envelope.as_ref().map(|e| &e.event) else {
            return;
        };
        if *worker != self.steps.worker || !self.steps.claims.lock().remove(at) {
            return;
        }
        if f.outcome.is_err() {
            return; // another worker's claim came first, or the attempt is not enqueued
        }
        match self.steps.prepare(at) {
            Some(job) => Steps::spawn(&self.steps, job),
            None => tracing::warn!("won {at:?} but cannot prepare it"),
        }
    }

    /// The orchestrator tells its lease of a claim in its lease events (those the log
    /// accepted: the current term's bid and renewals): heartbeats keep the shorter of it
    /// and this worker's own, following the current orchestrator (a later one with a
    /// longer lease lengthens it again, up to the worker's own); a shortening is said.
    fn learn_lease(&mut self, f: &Folded) {
        let Some(Event::OrchestratorLease {
            worker_lease_ms, ..
        }) = f.envelope.as_ref().map(|e| &e.event)
        else {
            return;
        };
        let told = *worker_lease_ms;
        if f.outcome.is_err() || told == 0 {
            return;
        }
        let lease = told.min(self.cfg.lease_ms);
        if lease < self.cfg.lease_ms && lease != self.lease_ms {
            tracing::warn!(
                "the orchestrator's lease of a claim is {told} ms, below this worker's lease_ms of {} ms: heartbeating every {} ms instead (give the worker the orchestrator's --lease-ms)",
                self.cfg.lease_ms,
                told / 3
            );
        }
        self.lease_ms = lease;
    }

    fn claim_more(&mut self) -> Result<(), Error> {
        let steps = &self.steps;
        // Under the claims' lock, so that a thread claiming ahead and this loop never
        // claim the same attempt twice.
        let mut claims = steps.claims.lock();
        let free = steps
            .concurrency
            .saturating_sub(steps.running.load(Ordering::SeqCst) + claims.len());
        if free == 0 {
            return Ok(());
        }
        let wanted: Vec<StepRef> =
            claimable(&steps.shared.lock(), &steps.namespaces, &steps.registry)
                .filter(|at| !claims.contains(at))
                .take(free)
                .collect();
        // One append for all of them: one batch through the log, not one per claim.
        claims.extend(wanted.iter().cloned());
        let worker = &steps.worker;
        let events = wanted.into_iter().map(|at| Event::StepClaimed {
            at,
            worker: worker.clone(),
        });
        steps.writer.publish_all(events.collect(), None)
    }

    fn heartbeat(&mut self) -> Result<(), Error> {
        let now = now_ms();
        let steps = &self.steps;
        let busy = steps.running.load(Ordering::SeqCst) > 0 || !steps.claims.lock().is_empty();
        if busy && now.saturating_sub(self.last_heartbeat) >= self.lease_ms / 3 {
            self.last_heartbeat = now;
            steps.writer.publish(Event::Heartbeat {
                worker: steps.worker.clone(),
            })?;
        }
        Ok(())
    }
}

impl Steps {
    /// The context a won attempt runs with.
    fn prepare(&self, at: &StepRef) -> Option<Job> {
        let state = self.shared.lock();
        let task = state.tasks.get(&at.task)?;
        let index = task.index_of(&at.step)?;
        let spec = task.spec(index);
        let ancestors: Map<String, Value> = task
            .ancestors(index)
            .into_iter()
            .filter(|&i| task.steps[i].created)
            .map(|i| {
                (
                    task.steps[i].name.clone(),
                    task.steps[i].result.clone().unwrap_or(Value::Null),
                )
            })
            .collect();
        let dependencies = task.deps[index]
            .iter()
            .filter(|&&d| task.steps[d].created)
            .map(|&d| task.steps[d].name.clone())
            .collect();
        let batch = task.steps[index].batch.as_ref().map(|slot| BatchInput {
            cursor: slot.cursor.clone(),
            index: slot.index,
            count: slot.count,
            resume: task.steps[index].checkpoint.clone(),
            checkpoints: self.checkpoint_sink(at),
        });
        Some(Job {
            at: at.clone(),
            callable: spec.handler.callable.clone(),
            timeout: spec.timeout(),
            ctx: StepContext {
                task_uuid: at.task.clone(),
                step_name: at.step.clone(),
                attempt: at.attempt,
                context: task.context.clone(),
                initialization: spec.handler.initialization.clone().unwrap_or(Value::Null),
                ancestors,
                dependencies,
                batch,
                // Set again when the attempt starts (`spawn`).
                deadline: Instant::now() + spec.timeout(),
                cancellation: Default::default(),
            },
        })
    }

    /// Publishes a handler's checkpoints for the attempt `at` of this worker.
    fn checkpoint_sink(&self, at: &StepRef) -> CheckpointSink {
        let (writer, at) = (self.writer.clone(), at.clone());
        let worker = self.worker.clone();
        CheckpointSink::new(move |checkpoint| {
            let event = Event::StepCheckpoint {
                at: at.clone(),
                worker: worker.clone(),
                checkpoint,
            };
            if let Err(e) = writer.publish(event) {
                tracing::warn!("cannot publish a checkpoint: {e}");
            }
        })
    }

    /// Runs a won attempt's handler on a thread of its own (see [`Running`]).
    fn spawn(this: &Arc<Self>, mut job: Job) {
        let Some(handler) = this.registry.get(&job.callable) else {
            return;
        };
        job.ctx.deadline = Instant::now() + job.timeout;
        let attempt = Arc::new(Running {
            at: job.at.clone(),
            deadline: job.ctx.deadline,
            timeout: job.timeout,
            reported: AtomicBool::new(false),
            cancellation: job.ctx.cancellation.clone(),
        });
        this.running.fetch_add(1, Ordering::SeqCst);
        this.attempts.lock().push(attempt.clone());
        let (steps, mine) = (this.clone(), attempt.clone());
        let started = this.threads.run(move || {
            if let Some(path) = &steps.run_log {
                record_run(path, &job.at, &steps.worker);
            }
            let ctx = job.ctx;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.call(&ctx)));
            let outcome = match r {
                Ok(Ok(result)) => Outcome::Success { result },
                // A handler that stopped at its deadline (`StepContext::past_deadline`)
                // may beat the loop's report of it: the failure says the same either way.
                Ok(Err(_)) if mine.deadline <= Instant::now() => mine.timed_out(),
                Ok(Err(e)) => failure(e),
                Err(_) => failure(StepError::retryable("the handler panicked")),
            };
            steps.report(&mine, outcome);
        });
        if let Err(e) = started {
            let why = format!("cannot start the handler: {e}");
            this.report(&attempt, failure(StepError::retryable(why)));
        }
    }

    /// Publishes an attempt's outcome unless it was reported already, and frees its slot.
    fn report(&self, attempt: &Arc<Running>, outcome: Outcome) {
        if attempt.reported.swap(true, Ordering::SeqCst) {
            return; // timed out (or finished) first: this outcome is dropped
        }
        if let Outcome::Failure {
            message, retryable, ..
        } = &outcome
        {
            // The task keeps only its last error: each failure is in the worker's log.
            let at = &attempt.at;
            tracing::warn!(
                task = %at.task,
                step = %at.step,
                attempt = at.attempt,
                retryable,
                "attempt failed: {message}"
            );
        }
        self.finish(attempt.at.clone(), outcome);
        self.release(attempt);
    }

    /// Frees an ended attempt's slot (its outcome published, or not wanted).
    fn release(&self, attempt: &Arc<Running>) {
        self.attempts.lock().retain(|a| !Arc::ptr_eq(a, attempt));
        let before = self.running.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "an attempt ended that was never started");
        let _ended = self.ended_lock.lock();
        self.ended.notify_all();
    }

    /// Calls off every running attempt whose outcome the log no longer wants: its step is
    /// not in progress under this attempt of this worker any more (the task was cancelled
    /// or resolved by hand, or the attempt was taken back after a lost lease). Its
    /// handler is told ([`Cancellation`]) and its slot freed at once, as for a timeout
    /// (the thread is left to finish); nothing is published for it, since the fold
    /// would refuse it. Called by the loop after each batch of events it folded.
    fn call_off_unwanted(&self) {
        let running: Vec<Arc<Running>> = self.attempts.lock().clone();
        let unwanted: Vec<Arc<Running>> = {
            let state = self.shared.lock();
            running
                .into_iter()
                .filter(|a| !self.still_wanted(&state, &a.at))
                .collect()
        };
        for a in unwanted {
            if a.reported.swap(true, Ordering::SeqCst) {
                continue; // its outcome went out first: the fold has moved past it
            }
            tracing::info!(
                task = %a.at.task,
                step = %a.at.step,
                attempt = a.at.attempt,
                "attempt called off: the log no longer wants its outcome"
            );
            a.cancellation.cancel();
            self.release(&a);
        }
    }

    /// Whether the fold still has attempt `at` in progress under this worker's claim. A
    /// task or step the fold does not know is left running (it cannot be told apart
    /// from one not folded yet).
    fn still_wanted(&self, state: &State, at: &StepRef) -> bool {
        let Some(task) = state.tasks.get(&at.task) else {
            return true;
        };
        let Some(step) = task.index_of(&at.step).map(|i| &task.steps[i]) else {
            return true;
        };
        step.attempt == at.attempt
            && step.state == StepState::InProgress
            && step.worker.as_deref() == Some(self.worker.as_str())
    }

    /// Reports every attempt past its deadline as a retryable failure. Called by the
    /// worker loop, which wakes at least every [`POLL`]: a timeout is reported at most
    /// that late.
    fn time_out_overdue(&self) {
        let now = Instant::now();
        let overdue: Vec<Arc<Running>> = self
            .attempts
            .lock()
            .iter()
            .filter(|a| a.deadline <= now)
            .cloned()
            .collect();
        for a in overdue {
            self.report(&a, a.timed_out());
        }
    }

    /// Publishes an attempt's result and, right behind it in the same append (so in the
    /// same batch through the log), the claims ahead it allows (noted among the claims
    /// before the result goes out, so the loop, which may see those steps enqueued as
    /// soon as the result is in the log, does not claim them too). Runs while the
    /// attempt still counts as running, so its slot is one of the free ones. A result
    /// too large for the log is replaced by a failure ([`Steps::publish_oversized`]).
    fn finish(&self, at: StepRef, outcome: Outcome) {
        // Kept in case the result is too large: the append consumes the event.
        let attempt = at.clone();
        let failure = match &outcome {
            Outcome::Success { .. } => None,
            Outcome::Failure {
                retryable,
                retry_after_ms,
                ..
            } => Some((*retryable, *retry_after_ms)),
        };
        let event = Event::StepResult {
            at,
            worker: self.worker.clone(),
            outcome,
        };
        let ahead = match failure {
            None => self.reserve_ahead(&event),
            Some(_) => Vec::new(),
        };
        let mut events = Vec::with_capacity(1 + ahead.len());
        events.push(event);
        events.extend(ahead.iter().map(|at| Event::StepClaimed {
            at: at.clone(),
            worker: self.worker.clone(),
        }));
        let Err(e) = self.writer.publish_all(events, None) else {
            return;
        };
        // Nothing of the append went out (every payload is checked first): the claims
        // ahead are not pending, and their slots are free again.
        let mut claims = self.claims.lock();
        ahead.iter().for_each(|at| {
            claims.remove(at);
        });
        drop(claims);
        match e {
            Error::MessageTooLarge { size, max } => {
                self.publish_oversized(attempt, failure, size, max)
            }
            // The loop's next publish reports the log's failure.
            e => tracing::error!("cannot publish a step result: {e}"),
        }
    }

    /// Fails attempt `at`, whose result event (`size` bytes) is over the log's largest
    /// message (`max`), with a failure that says so (else the attempt would sit in
    /// progress until its lease ran out, and be retried as if its worker had vanished).
    /// A success fails for good: the same input would give the same result again. A
    /// handler's failure too large (its message) keeps its retry semantics (`failure`:
    /// whether it was retryable, and after how long), its message replaced.
    fn publish_oversized(
        &self,
        at: StepRef,
        failure: Option<(bool, Option<u64>)>,
        size: usize,
        max: usize,
    ) {
        let what = match failure {
            None => "result",
            Some(_) => "failure (its message)",
        };
        let message = format!(
            "the handler's {what} is too large for the log: its step_result event is {size} \
             bytes, over the maximum message size of {max} bytes (broker.max_message_bytes)"
        );
        tracing::warn!("{at:?}: {message}");
        let (retryable, retry_after_ms) = failure.unwrap_or((false, None));
        let event = Event::StepResult {
            at,
            worker: self.worker.clone(),
            outcome: Outcome::Failure {
                message,
                retryable,
                retry_after_ms,
            },
        };
        if let Err(e) = self.writer.publish(event) {
            tracing::error!("cannot publish a step result: {e}");
        }
    }

    /// The attempts the fold will enqueue at `result` that this worker can run, as many
    /// as its free slots (counting the one `result` frees), noted among the claims. None
    /// once a drain began: a draining worker claims nothing new, so another worker takes
    /// the next steps as soon as they are enqueued (a claim ahead here would win and
    /// either hold the drain or, unrun, sit until its lease ran out).
    fn reserve_ahead(&self, result: &Event) -> Vec<StepRef> {
        let mut claims = self.claims.lock();
        if self.draining.load(Ordering::SeqCst) {
            return Vec::new();
        }
        let running = self.running.load(Ordering::SeqCst);
        let free = (self.concurrency + 1).saturating_sub(running + claims.len());
        let wanted: Vec<StepRef> = self
            .enqueued_by(result)
            .into_iter()
            .filter(|at| !claims.contains(at))
            .take(free)
            .collect();
        claims.extend(wanted.iter().cloned());
        wanted
    }

    /// See [`enqueued_by`]: on the task as this worker knows it now.
    fn enqueued_by(&self, result: &Event) -> Vec<StepRef> {
        let state = self.shared.lock();
        enqueued_by(&state, result, &self.namespaces, &self.registry)
    }
}

/// The attempts of steps of `namespaces` with a handler in `registry` that the fold
/// enqueues when it applies `result` to its task in `state` (none for a task of
/// protocol 1, or a result `state` would refuse). Works on a copy of that one task.
fn enqueued_by(
    state: &State,
    result: &Event,
    namespaces: &[String],
    registry: &Registry,
) -> Vec<StepRef> {
    let Some(at) = result.step_ref() else {
        return Vec::new();
    };
    let Some(before) = state.tasks.get(&at.task).filter(|t| t.protocol >= 2) else {
        return Vec::new();
    };
    let mut scratch = State {
        next_position: state.next_position,
        ..State::default()
    };
    let template = before.template.clone();
    scratch.templates.insert(template.key(), template);
    scratch.tasks.insert(before.uuid.clone(), before.clone());
    scratch.reindex();
    let env = Envelope {
        ts_ms: now_ms(),
        term: None,
        event: result.clone(),
    };
    if scratch.apply(scratch.next_position, &env).is_err() {
        return Vec::new();
    }
    let was_enqueued = |at: &StepRef| {
        before
            .step(&at.step)
            .is_some_and(|s| s.state == StepState::Enqueued && s.attempt == at.attempt)
    };
    claimable(&scratch, namespaces, registry)
        .filter(|at| !was_enqueued(at))
        .collect()
}

struct Job {
    at: StepRef,
    callable: String,
    timeout: Duration,
    ctx: StepContext,
}

/// Enqueued attempts of the namespaces served whose handler this worker has.
fn claimable<'a>(
    state: &'a State,
    namespaces: &'a [String],
    registry: &'a Registry,
) -> impl Iterator<Item = StepRef> + 'a {
    state
        .open_task_iter()
        .filter(move |t| namespaces.is_empty() || namespaces.contains(&t.template.namespace))
        .flat_map(move |t| {
            t.steps.iter().enumerate().filter_map(move |(i, s)| {
                let has = registry.get(&t.spec(i).handler.callable).is_some();
                (s.state == StepState::Enqueued && has).then(|| StepRef {
                    task: t.uuid.clone(),
                    step: s.name.clone(),
                    attempt: s.attempt,
                })
            })
        })
}

/// Appends one line `task step attempt worker` for a handler run about to start. One
/// `write` of a short line to a file opened for appending, so that lines of concurrent
/// runs and processes do not interleave, and a line written survives a SIGKILL.
fn record_run(path: &Path, at: &StepRef, worker: &str) {
    let line = format!("{} {} {} {worker}\n", at.task, at.step, at.attempt);
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = appended {
        tracing::error!("cannot record a run in {}: {e}", path.display());
    }
}

fn failure(e: StepError) -> Outcome {
    Outcome::Failure {
        message: e.message,
        retryable: e.retryable,
        retry_after_ms: e.retry_after_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIAMOND: &str = "name: d\nnamespace: n\nversion: '1'\nsteps:
  - {name: a, handler: {callable: math.square}}
  - {name: b, dependencies: [a], handler: {callable: math.square}}
  - {name: c, dependencies: [a], handler: {callable: other.handler}}
  - {name: d, dependencies: [b, c], handler: {callable: math.square}}
";

    fn at(step: &str) -> StepRef {
        StepRef {
            task: "t".into(),
            step: step.into(),
            attempt: 1,
        }
    }

    fn apply(state: &mut State, event: Event) {
        let position = state.next_position;
        let applied = state.apply(
            position,
            &Envelope {
                ts_ms: 0,
                term: None,
                event,
            },
        );
        assert_eq!(applied, Ok(()));
    }

    fn success(step: &str) -> Event {
        Event::StepResult {
            at: at(step),
            worker: "w".into(),
            outcome: Outcome::Success {
                result: serde_json::json!(4),
            },
        }
    }

    /// A diamond task with `a` claimed by `w`, created under `protocol`.
    fn diamond(protocol: Option<u8>) -> State {
        let mut state = State::default();
        let template = crate::validate::load(DIAMOND, None).unwrap();
        apply(&mut state, Event::TemplateRegistered { template });
        let created = Event::TaskCreated {
            task: "t".into(),
            namespace: "n".into(),
            name: "d".into(),
            version: "1".into(),
            context: serde_json::json!({}),
            idempotency_key: None,
            identity: None,
            protocol,
        };
        apply(&mut state, created);
        if protocol.is_none() {
            apply(&mut state, Event::StepEnqueued(at("a")));
        }
        let worker = "w".to_string();
        apply(
            &mut state,
            Event::StepClaimed {
                at: at("a"),
                worker,
            },
        );
        state
    }

    #[test]
    fn claims_ahead_are_the_steps_the_fold_enqueues_at_the_result_that_the_worker_can_run() {
        let registry = Registry::builtin();
        let all: &[String] = &[];
        // Protocol 2: `a`'s success enqueues `b` and `c`; this worker has a handler
        // for `b` only. The state itself is not changed by the guess.
        let mut state = diamond(Some(2));
        let before = state.clone();
        assert_eq!(
            enqueued_by(&state, &success("a"), all, &registry),
            [at("b")]
        );
        assert_eq!(state, before);
        // Another namespace's worker claims nothing; nor does a failure, or a result
        // the fold would refuse (another worker's).
        let other = ["m".to_string()];
        assert!(enqueued_by(&state, &success("a"), &other, &registry).is_empty());
        let failed = Event::StepResult {
            at: at("a"),
            worker: "w".into(),
            outcome: Outcome::Failure {
                message: "no".into(),
                retryable: true,
                retry_after_ms: None,
            },
        };
        assert!(enqueued_by(&state, &failed, all, &registry).is_empty());
        let Event::StepResult { at: a, outcome, .. } = success("a") else {
            unreachable!()
        };
        let rival = Event::StepResult {
            at: a,
            worker: "v".into(),
            outcome,
        };
        assert!(enqueued_by(&state, &rival, all, &registry).is_empty());
        // `d` waits for `c` too: `b`'s success enqueues nothing.
        apply(&mut state, success("a"));
        let worker = "w".to_string();
        apply(
            &mut state,
            Event::StepClaimed {
                at: at("b"),
                worker,
            },
        );
        assert!(enqueued_by(&state, &success("b"), all, &registry).is_empty());
        // Protocol 1: the orchestrator enqueues, by events of its own; nothing to guess.
        let state = diamond(None);
        assert!(enqueued_by(&state, &success("a"), all, &registry).is_empty());
    }
}
