//! The orchestrator process's engine: one thread that folds the event log from its
//! start, and once it has caught up with the end it found on start (replay), publishes
//! what [`crate::decide`] says after every batch of events and whenever a retry or a
//! lease comes due. It also remembers, outside the log, when it saw each claim and each
//! worker (for leases) and which of its own decisions are still on their way through
//! the log (so it does not publish them twice).

use crate::decide::{decide, Clock};
use crate::event::{Event, StepRef};
use crate::ids::now_ms;
use crate::log::{ensure_topic, Folded, Folder, LogConfig, Shared, Writer};
use crate::machine::StepState;
use embarcadero_client::Error;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    pub log: LogConfig,
    /// A worker not heard from for this long loses its claims.
    pub lease_ms: u64,
    /// Backpressure: new tasks are refused (503) while this many are open.
    pub max_open_tasks: usize,
    /// The protocol new tasks are created with ([`crate::state::Task::protocol`]).
    pub task_protocol: u8,
}

/// What the API and the CLI see of a running orchestrator.
pub struct Engine {
    pub shared: Arc<Shared>,
    pub writer: Arc<Writer>,
    /// Set once the fold has reached the end of the log as it was on start.
    pub caught_up: AtomicBool,
    /// Why the engine thread stopped, if it failed.
    pub failure: Mutex<Option<String>>,
    /// See [`OrchestratorConfig::max_open_tasks`].
    pub max_open_tasks: usize,
    /// See [`OrchestratorConfig::task_protocol`].
    pub task_protocol: u8,
    /// Where the event log is (the metrics ask for its end).
    pub log: LogConfig,
    stop: AtomicBool,
}

pub struct Orchestrator {
    pub engine: Arc<Engine>,
    thread: Option<JoinHandle<()>>,
}

/// Longest the engine waits for events before looking at the clock again.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// A decision not seen back in the log after this long may be published again.
const INFLIGHT_MS: u64 = 5_000;

impl Orchestrator {
    pub fn start(cfg: OrchestratorConfig) -> Result<Self, Error> {
        let replay_end = ensure_topic(&cfg.log)?;
        let folder = Folder::open(&cfg.log, "orchestrator")?;
        warn_if_events_lost(&folder, &cfg.log);
        let engine = Arc::new(Engine {
            shared: Arc::new(Shared::default()),
            writer: Arc::new(Writer::open(&cfg.log)?),
            caught_up: AtomicBool::new(replay_end == 0),
            failure: Mutex::new(None),
            max_open_tasks: cfg.max_open_tasks,
            task_protocol: cfg.task_protocol,
            log: cfg.log.clone(),
            stop: AtomicBool::new(false),
        });
        let runtime = Runtime {
            engine: engine.clone(),
            folder,
            lease_ms: cfg.lease_ms,
            replay_end,
            inflight: HashMap::new(),
            claimed_at: HashMap::new(),
            seen: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name("orchestrator".into())
            .spawn(move || runtime.run())
            .map_err(|e| Error::Config(format!("cannot start the orchestrator thread: {e}")))?;
        Ok(Self {
            engine,
            thread: Some(thread),
        })
    }

    pub fn stop(&mut self) {
        self.engine.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Engine {
    /// The Prometheus metrics text, with the queue lag when the log's end can be read.
    pub fn metrics(&self) -> String {
        let admin = embarcadero_client::Admin::new(&self.log.control);
        let log_end = admin.describe_topic(&self.log.topic).ok();
        let state = self.shared.lock();
        crate::metrics::render(&state, log_end.map(|info| info.next_position))
    }
}

impl Drop for Orchestrator {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Runtime {
    engine: Arc<Engine>,
    folder: Folder,
    lease_ms: u64,
    replay_end: u64,
    /// Own decisions published and not yet read back, by their encoding.
    inflight: HashMap<String, u64>,
    claimed_at: HashMap<StepRef, u64>,
    seen: HashMap<String, u64>,
}

impl Runtime {
    fn run(mut self) {
        if let Err(e) = self.run_loop() {
            tracing::error!("the orchestrator stopped: {e}");
            *self.engine.failure.lock() = Some(e.to_string());
        }
    }

    fn run_loop(&mut self) -> Result<(), Error> {
        let mut wait = IDLE_POLL;
        while !self.engine.stop.load(Ordering::SeqCst) {
            let folded = self.folder.pump(&self.engine.shared, wait)?;
            let now = now_ms();
            for f in &folded {
                self.observe(f, now);
            }
            if !self.engine.caught_up.load(Ordering::SeqCst) {
                if !self.folder.replayed(&self.engine.shared, self.replay_end) {
                    continue;
                }
                tracing::info!("replayed {} events of the log", self.replay_end);
                self.start_leases(now);
                self.engine.caught_up.store(true, Ordering::SeqCst);
            }
            wait = self.decide_and_publish(now)?;
        }
        Ok(())
    }

    /// After the replay: every attempt in progress gets a lease from now (its worker,
    /// if alive, heartbeats; if not, the attempt is taken back a lease later).
    fn start_leases(&mut self, now: u64) {
        let state = self.engine.shared.lock();
        for task in state.tasks.values().filter(|t| !t.state.is_terminal()) {
            for s in task
                .steps
                .iter()
                .filter(|s| s.state == StepState::InProgress)
            {
                let at = StepRef {
                    task: task.uuid.clone(),
                    step: s.name.clone(),
                    attempt: s.attempt,
                };
                self.claimed_at.entry(at).or_insert(now);
            }
        }
    }

    /// Notes what the lease checks need and which of its own decisions came back.
    fn observe(&mut self, f: &Folded, now: u64) {
        let Some(env) = &f.envelope else { return };
        self.inflight.remove(&key(&env.event));
        match &env.event {
            Event::StepClaimed { at, worker } => {
                if f.outcome.is_ok() {
                    self.claimed_at.insert(at.clone(), now);
                }
                self.seen.insert(worker.clone(), now);
            }
            Event::Heartbeat { worker } => {
                self.seen.insert(worker.clone(), now);
            }
            Event::StepExpired { at, .. }
            | Event::StepCompleted(at)
            | Event::StepResult { at, .. }
                if f.outcome.is_ok() =>
            {
                self.claimed_at.remove(at);
            }
            _ => {}
        }
    }

    /// Publishes the decisions not already on their way; returns how long to wait.
    fn decide_and_publish(&mut self, now: u64) -> Result<Duration, Error> {
        let (claimed_at, seen) = (&self.claimed_at, &self.seen);
        let clock = Clock {
            now_ms: now,
            lease_ms: self.lease_ms,
            claimed_at: &|at| claimed_at.get(at).copied(),
            worker_seen: &|w| seen.get(w).copied(),
        };
        let (events, wake) = decide(&self.engine.shared.lock(), &clock);
        self.inflight
            .retain(|_, at| now.saturating_sub(*at) < INFLIGHT_MS);
        for e in events {
            if self.inflight.insert(key(&e), now).is_none() {
                self.engine.writer.publish(e)?;
            }
        }
        let until_wake = wake.map_or(IDLE_POLL, |w| Duration::from_millis(w.saturating_sub(now)));
        Ok(until_wake.min(IDLE_POLL))
    }
}

/// A log that starts past 0 lost its first events (a memory-only topic, `--rf 1`, whose
/// server restarted): the templates and tasks in them are gone, which the operator must
/// hear, not find out from 404s.
fn warn_if_events_lost(folder: &Folder, log: &LogConfig) {
    let first = folder.position();
    if first > 0 {
        tracing::warn!(
            "the event log {} starts at position {first}: the events before it are gone (a memory-only topic lost them to a server restart; use --rf 2 --ack 2 to keep them); the engine starts without them",
            log.topic
        );
    }
}

/// What makes a decision the same decision: its kind and the attempt it is about (not
/// its timestamp or due time, which differ each time it is computed).
fn key(e: &Event) -> String {
    match e.step_ref() {
        Some(at) => format!("{} {} {} {}", e.kind(), at.task, at.step, at.attempt),
        None => String::new(),
    }
}
