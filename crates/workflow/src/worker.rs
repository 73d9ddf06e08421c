//! A worker: folds the event log like the orchestrator does, claims enqueued attempts
//! of its namespaces whose handler it has (a claim is an event; the first claim of an
//! attempt in log order wins, and every reader agrees which), runs the attempts it won
//! on threads of their own with the step's timeout, publishes their results, and
//! heartbeats while it holds any.

use crate::event::{Event, Outcome, StepRef};
use crate::handler::{BatchInput, CheckpointSink, Registry, StepContext, StepError};
use crate::ids::{new_uuid, now_ms};
use crate::log::{ensure_topic, Folded, Folder, LogConfig, Shared, Writer};
use crate::machine::StepState;
use crate::state::State;
use embarcadero_client::Error;
use parking_lot::{Condvar, Mutex};
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

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
    running: Arc<Running>,
    writer: Arc<Writer>,
}

/// The attempts running on step threads, with a condition variable signalled as each
/// ends (after its result is published), for [`Worker::stop_and_drain`].
#[derive(Default)]
struct Running {
    count: Mutex<usize>,
    ended: Condvar,
}

impl Running {
    fn count(&self) -> usize {
        *self.count.lock()
    }

    fn start(&self) {
        *self.count.lock() += 1;
    }

    fn end(&self) {
        let mut count = self.count.lock();
        assert!(*count > 0, "an attempt ended that was never started");
        *count -= 1;
        drop(count);
        self.ended.notify_all();
    }

    fn wait_idle(&self) {
        let mut count = self.count.lock();
        while *count > 0 {
            self.ended.wait(&mut count);
        }
    }
}

impl Worker {
    pub fn start(cfg: WorkerConfig, registry: Registry) -> Result<Self, Error> {
        let replay_end = ensure_topic(&cfg.log)?;
        let id = format!("worker-{}", &new_uuid()[..8]);
        let stop = Arc::new(AtomicBool::new(false));
        let writer = Arc::new(Writer::open(&cfg.log)?);
        let running = Arc::new(Running::default());
        let mut runtime = Runtime {
            id: id.clone(),
            folder: Folder::open(&cfg.log)?,
            shared: Arc::new(Shared::default()),
            writer: writer.clone(),
            registry,
            running: running.clone(),
            claims: HashSet::new(),
            last_heartbeat: 0,
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
            running,
            writer,
        })
    }

    /// Stops claiming and returns once the loop has ended (attempts running finish on
    /// their own threads).
    pub fn stop(&mut self) -> Result<(), Error> {
        self.stop.store(true, Ordering::SeqCst);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::Config("the worker thread panicked".into())),
            None => Ok(()),
        }
    }

    /// [`stop`](Self::stop), then waits until every attempt this worker started has
    /// published its result (each waits at most its step's `timeout_seconds` for its
    /// handler) and the log has acknowledged every event the worker published: once it
    /// returns, the process may exit without losing a result to a lease expiry. Returns
    /// the error that ended the loop if one did, else a failed flush's.
    pub fn stop_and_drain(&mut self) -> Result<(), Error> {
        let stopped = self.stop();
        self.running.wait_idle();
        let flushed = self.writer.flush();
        stopped.and(flushed)
    }

    /// Whether the loop has ended (it fails when the log does).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

struct Runtime {
    id: String,
    cfg: WorkerConfig,
    folder: Folder,
    shared: Arc<Shared>,
    writer: Arc<Writer>,
    registry: Registry,
    running: Arc<Running>,
    /// Claims published and not yet decided by the log.
    claims: HashSet<StepRef>,
    last_heartbeat: u64,
    replay_end: u64,
}

const POLL: Duration = Duration::from_millis(20);

impl Runtime {
    fn run(&mut self, stop: &AtomicBool) -> Result<(), Error> {
        while !stop.load(Ordering::SeqCst) {
            let folded = self.folder.pump(&self.shared, POLL)?;
            for f in &folded {
                self.settle_claim(f);
            }
            if self.shared.lock().next_position < self.replay_end {
                continue;
            }
            self.claim_more()?;
            self.heartbeat()?;
        }
        Ok(())
    }

    /// A claim of ours came back through the log: run it if it won.
    fn settle_claim(&mut self, f: &Folded) {
        let Some(Event::StepClaimed { at, worker }) = f.envelope.as_ref().map(|e| &e.event) else {
            return;
        };
        if *worker != self.id || !self.claims.remove(at) {
            return;
        }
        if f.outcome.is_err() {
            return; // another worker's claim came first
        }
        match self.prepare(at) {
            Some(job) => self.spawn(job),
            None => tracing::warn!("won {at:?} but cannot prepare it"),
        }
    }

    fn claim_more(&mut self) -> Result<(), Error> {
        let free = self
            .cfg
            .concurrency
            .saturating_sub(self.running.count() + self.claims.len());
        if free == 0 {
            return Ok(());
        }
        let wanted: Vec<StepRef> =
            claimable(&self.shared.lock(), &self.cfg.namespaces, &self.registry)
                .filter(|at| !self.claims.contains(at))
                .take(free)
                .collect();
        for at in wanted {
            self.claims.insert(at.clone());
            let worker = self.id.clone();
            self.writer.publish(Event::StepClaimed { at, worker })?;
        }
        Ok(())
    }

    fn heartbeat(&mut self) -> Result<(), Error> {
        let now = now_ms();
        let busy = self.running.count() > 0 || !self.claims.is_empty();
        if busy && now.saturating_sub(self.last_heartbeat) >= self.cfg.lease_ms / 3 {
            self.last_heartbeat = now;
            self.writer.publish(Event::Heartbeat {
                worker: self.id.clone(),
            })?;
        }
        Ok(())
    }

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
            timeout: Duration::from_secs(spec.timeout_seconds),
            ctx: StepContext {
                task_uuid: at.task.clone(),
                step_name: at.step.clone(),
                attempt: at.attempt,
                context: task.context.clone(),
                initialization: spec.handler.initialization.clone().unwrap_or(Value::Null),
                ancestors,
                dependencies,
                batch,
            },
        })
    }

    /// Publishes a handler's checkpoints for the attempt `at` of this worker.
    fn checkpoint_sink(&self, at: &StepRef) -> CheckpointSink {
        let (writer, at, worker) = (self.writer.clone(), at.clone(), self.id.clone());
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

    fn spawn(&self, job: Job) {
        let Some(handler) = self.registry.get(&job.callable) else {
            return;
        };
        let (writer, running, worker) =
            (self.writer.clone(), self.running.clone(), self.id.clone());
        let run_log = self.cfg.run_log.clone();
        running.start();
        let started = std::thread::Builder::new()
            .name("step".into())
            .spawn(move || {
                if let Some(path) = &run_log {
                    record_run(path, &job.at, &worker);
                }
                let outcome = run_with_timeout(handler, job.ctx, job.timeout);
                let event = Event::StepResult {
                    at: job.at,
                    worker,
                    outcome,
                };
                if let Err(e) = writer.publish(event) {
                    tracing::error!("cannot publish a step result: {e}");
                }
                running.end();
            });
        if let Err(e) = started {
            tracing::error!("cannot start a step thread: {e}");
            self.running.end();
        }
    }
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
        .tasks
        .values()
        .filter(|t| !t.state.is_terminal())
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

/// Runs the handler on a thread of its own and stops waiting at the timeout (the
/// thread is left to finish; its late result is never published).
fn run_with_timeout(
    handler: Arc<dyn crate::handler::StepHandler>,
    ctx: StepContext,
    timeout: Duration,
) -> Outcome {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("handler".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.call(&ctx)));
            let _ =
                tx.send(r.unwrap_or_else(|_| Err(StepError::retryable("the handler panicked"))));
        });
    if let Err(e) = spawned {
        return failure(StepError::retryable(format!(
            "cannot start the handler: {e}"
        )));
    }
    match rx.recv_timeout(timeout) {
        Ok(Ok(result)) => Outcome::Success { result },
        Ok(Err(e)) => failure(e),
        Err(_) => failure(StepError::retryable(format!(
            "timed out after {} s",
            timeout.as_secs()
        ))),
    }
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
