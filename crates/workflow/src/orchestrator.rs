//! The orchestrator process's engine: one thread that folds the event log from its
//! start, and once it has caught up with the end it found on start (replay), publishes
//! what [`crate::decide`] says after every batch of events and whenever a retry or a
//! lease comes due. It also remembers, outside the log, when it saw each claim and each
//! worker (for leases) and which of its own decisions are still on their way through
//! the log (so it does not publish them twice).
//!
//! Every orchestrator is a candidate for the lease of [`crate::leadership`]: it folds
//! the log warm all the time, and decides only while it holds the current term (its
//! decisions carry the term; the fold refuses them once another holds a newer one). It
//! starts from the newest snapshot in its data directory, if any ([`crate::snapshot`]),
//! and replays only the log after it. It rides out the log's outages (a server restart)
//! and hands its lease over when stopped ([`continuity`]).

mod continuity;

use crate::decide::{decide, Clock};
use crate::event::{Event, StepRef};
use crate::ids::now_ms;
use crate::leadership::{Candidate, Leader};
use crate::log::{ensure_topic, Folded, Folder, LogConfig, Shared, Writer};
use crate::machine::StepState;
use crate::snapshot::{SnapshotConfig, SnapshotStats, Snapshotter};
use crate::state::State;
use crate::unclaimed::UNCLAIMED_WARN_MS;
use embarcadero_client::Error;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// Where and how often to snapshot the fold; `None`: never (every start replays the
    /// whole log).
    pub snapshots: Option<SnapshotConfig>,
    /// The orchestrator lease ([`crate::leadership`]): a standby takes over this long
    /// after the active orchestrator's last renewal.
    pub failover_ms: u64,
    /// How long the engine keeps trying to reach its log again after losing it before
    /// it stops with an error; `None`: for as long as the process lives.
    pub retry_for: Option<Duration>,
}

/// Where the last start's replay began and ended (for `/metrics` and the tests).
#[derive(Debug, Default)]
pub struct Recovery {
    /// The snapshot's position (0: no snapshot, the whole log was replayed).
    pub from: u64,
    /// The log's end when the orchestrator started.
    pub to: u64,
    /// Events folded before the replay reached `to`.
    pub replayed: AtomicU64,
}

/// This orchestrator's standing in the lease, as last seen by its engine thread.
#[derive(Debug, Default)]
pub struct Role {
    pub active: AtomicBool,
    /// The current term, whoever holds it.
    pub term: AtomicU64,
    /// The lease as this one last read it is a quiet one ([`crate::leadership`]).
    pub quiet: AtomicBool,
}

/// What the API and the CLI see of a running orchestrator.
pub struct Engine {
    pub shared: Arc<Shared>,
    /// Replaced by a new session when the engine comes back from an outage.
    writer: Mutex<Arc<Writer>>,
    /// Set once the fold has reached the end of the log as it was on start (and again
    /// as it was when the log came back after an outage).
    pub caught_up: AtomicBool,
    /// Why the engine thread stopped, if it failed.
    pub failure: Mutex<Option<String>>,
    /// Why the log is out of reach while it is (the engine retries meanwhile and
    /// neither decides nor serves).
    pub outage: Mutex<Option<String>>,
    /// See [`OrchestratorConfig::max_open_tasks`].
    pub max_open_tasks: usize,
    /// See [`OrchestratorConfig::task_protocol`].
    pub task_protocol: u8,
    /// Where the event log is (the metrics ask for its end).
    pub log: LogConfig,
    pub recovery: Recovery,
    pub role: Role,
    /// This orchestrator's name in the lease.
    pub id: String,
    snapshots: Option<Arc<SnapshotStats>>,
    stop: AtomicBool,
}

pub struct Orchestrator {
    pub engine: Arc<Engine>,
    /// The topic this engine folds, as it found it at start: what it tells the head it
    /// serves, so a head without that very topic refuses to list it.
    pub folds: embarcadero_client::ServiceLog,
    thread: Option<JoinHandle<()>>,
    // Stopped after the engine thread (field order is drop order; `stop` joins first).
    _snapshotter: Option<Snapshotter>,
}

/// Longest the engine waits for events before looking at the clock again.
const IDLE_POLL: Duration = Duration::from_millis(20);
/// A decision not seen back in the log after this long may be published again.
const INFLIGHT_MS: u64 = 5_000;

impl Orchestrator {
    pub fn start(cfg: OrchestratorConfig) -> Result<Self, Error> {
        let replay_end = ensure_topic(&cfg.log)?;
        let info =
            embarcadero_client::Admin::new(&cfg.log.control).describe_topic(&cfg.log.topic)?;
        let log_id = identity_of(&info);
        let folds = embarcadero_client::ServiceLog {
            topic: info.name,
            created_unix_ms: info.created_unix_ms,
        };
        let (state, folder) = open_fold(&cfg, &log_id, replay_end)?;
        let from = state.next_position;
        assert!(
            from <= replay_end,
            "a snapshot past the log's end was loaded"
        );
        // Where the state's events begin: the snapshot's position, or the first event
        // the log still holds.
        let origin = from.max(folder.position());
        let shared = Arc::new(Shared::with_state(state));
        let snapshotter = start_snapshots(&cfg, &log_id, &shared, from)?;
        let id = format!("orchestrator-{}", &crate::ids::new_uuid()[..8]);
        let engine = Arc::new(Engine {
            shared,
            writer: Mutex::new(Arc::new(Writer::open(&cfg.log)?)),
            caught_up: AtomicBool::new(replay_end <= from),
            failure: Mutex::new(None),
            outage: Mutex::new(None),
            max_open_tasks: cfg.max_open_tasks,
            task_protocol: cfg.task_protocol,
            log: cfg.log.clone(),
            recovery: Recovery {
                from,
                to: replay_end,
                replayed: AtomicU64::new(0),
            },
            role: Role::default(),
            id: id.clone(),
            snapshots: snapshotter.as_ref().map(|s| s.stats.clone()),
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
            candidate: Candidate::new(id, cfg.failover_ms).telling_workers(cfg.lease_ms),
            active: false,
            standby_said: 0,
            origin,
            log_id,
            resumed: false,
            retry_for: cfg.retry_for,
            failover_ms: cfg.failover_ms,
            warned_unclaimed: HashSet::new(),
            unclaimed_scanned_ms: 0,
        };
        let thread = std::thread::Builder::new()
            .name("orchestrator".into())
            .spawn(move || runtime.run())
            .map_err(|e| Error::Config(format!("cannot start the orchestrator thread: {e}")))?;
        Ok(Self {
            engine,
            folds,
            thread: Some(thread),
            _snapshotter: snapshotter,
        })
    }

    /// Stops the engine thread; the holder of the lease releases it first, so that a
    /// standby takes over at once.
    pub fn stop(&mut self) {
        self.engine.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // It may be waiting out a pause between attempts to reach its log.
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// The snapshot thread, if `cfg` asks for snapshots; `from`: the state's position.
fn start_snapshots(
    cfg: &OrchestratorConfig,
    log_id: &str,
    shared: &Arc<Shared>,
    from: u64,
) -> Result<Option<Snapshotter>, Error> {
    let Some(s) = &cfg.snapshots else {
        return Ok(None);
    };
    let started = Snapshotter::start(s.clone(), log_id.to_string(), shared.clone(), from);
    let snapshotter = started.map_err(|e| {
        Error::Config(format!(
            "cannot start snapshots in {}: {e}",
            s.dir.display()
        ))
    })?;
    Ok(Some(snapshotter))
}

/// What names this log in snapshots: the topic and its creation time (a topic deleted and
/// created again under the same name is another log, whose positions mean other events).
fn identity_of(info: &embarcadero_client::TopicInfo) -> String {
    format!("{}@{}", info.name, info.created_unix_ms)
}

/// The state to start from and the subscription that continues it: the newest snapshot
/// and the log after it, or an empty state and the log from the first event it holds.
/// Warns only when events the fold needs are gone: those before the snapshot are not
/// needed, whatever the log still holds of them.
fn open_fold(
    cfg: &OrchestratorConfig,
    log_id: &str,
    log_end: u64,
) -> Result<(State, Folder), Error> {
    // Before anything is delivered, its position is where the log's readable part
    // starts (past 0 when a memory-only topic lost its first events).
    let from_first = Folder::open(&cfg.log, "orchestrator")?;
    let first = from_first.position();
    let state = restore(cfg, log_id, log_end);
    let from = state.next_position;
    // A log that holds nothing before the snapshot's position lost what the snapshot
    // was folded from (a memory-only topic whose server restarted; a durable log starts
    // at 0): no other reader has that state, and workers would refuse what it allows.
    if from > first {
        drop(from_first);
        return Ok((state, Folder::open_at(&cfg.log, "orchestrator", from)?));
    }
    if from > 0 {
        tracing::warn!(
            "the snapshot covers the event log {} up to position {from}, but the log now starts at position {first}: the events it was folded from are gone, so no other reader has its state; starting without the snapshot",
            cfg.log.topic
        );
    }
    warn_if_events_lost(first, &cfg.log);
    Ok((State::default(), from_first))
}

/// The newest valid snapshot's state, or an empty one (the whole log is replayed).
fn restore(cfg: &OrchestratorConfig, log_id: &str, log_end: u64) -> State {
    let Some(s) = &cfg.snapshots else {
        return State::default();
    };
    match crate::snapshot::load_newest(&s.dir, log_id, log_end) {
        Some((state, path)) => {
            tracing::info!(
                "loaded snapshot {} (log up to position {}); replaying the {} events after it",
                path.display(),
                state.next_position,
                log_end - state.next_position
            );
            state
        }
        None => State::default(),
    }
}

impl Engine {
    /// The session the API's commands and the engine's decisions are published in.
    pub fn writer(&self) -> Arc<Writer> {
        self.writer.lock().clone()
    }

    /// The Prometheus metrics text, with the queue lag when the log's end can be read.
    pub fn metrics(&self) -> String {
        let admin = embarcadero_client::Admin::new(&self.log.control);
        let log_end = admin.describe_topic(&self.log.topic).ok();
        let state = self.shared.lock();
        let log_end = log_end.map(|info| info.next_position);
        let mut text = crate::metrics::render(&state, log_end, now_ms());
        drop(state);
        text.push_str(&self.durability_metrics());
        text
    }

    /// Replay, snapshot and lease figures.
    fn durability_metrics(&self) -> String {
        let r = &self.recovery;
        let mut gauges = vec![
            (
                "replay_from_position",
                "where the last start's replay began (a snapshot's position, or 0)",
                r.from,
            ),
            (
                "replay_to_position",
                "the log's end when this orchestrator started",
                r.to,
            ),
            (
                "replayed_events",
                "events folded by the replay on start",
                r.replayed.load(Ordering::Acquire),
            ),
            (
                "orchestrator_active",
                "1 while this orchestrator holds the lease and decides",
                self.role.active.load(Ordering::Acquire) as u64,
            ),
            (
                "orchestrator_term",
                "the current orchestrator term in the log",
                self.role.term.load(Ordering::Acquire),
            ),
            (
                "orchestrator_lease_quiet",
                "1 while the lease runs quiet: renewed with no task open, nothing since",
                self.role.quiet.load(Ordering::Acquire) as u64,
            ),
        ];
        if let Some(s) = &self.snapshots {
            gauges.push((
                "snapshot_position",
                "position of the last snapshot this process wrote (0: none)",
                s.position.load(Ordering::Acquire),
            ));
            gauges.push((
                "snapshots_written",
                "snapshots written by this process",
                s.written.load(Ordering::Acquire),
            ));
            gauges.push((
                "snapshot_lock_microseconds",
                "how long the last snapshot held the state's lock to clone it",
                s.lock_us.load(Ordering::Acquire),
            ));
        }
        let mut out = String::new();
        for (name, help, value) in gauges {
            out.push_str(&format!(
                "# HELP embarcadero_workflow_{name} {help}\n# TYPE embarcadero_workflow_{name} gauge\nembarcadero_workflow_{name} {value}\n"
            ));
        }
        out
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
    candidate: Candidate,
    /// Whether this one held the current term when it last decided.
    active: bool,
    /// The last term whose holder this one, a standby, named in its log (0: none).
    standby_said: u64,
    /// Where the state's events begin in the log: if the log no longer holds them, a
    /// reader starting now could not have them ([`continuity`]).
    origin: u64,
    /// The log's identity on start ([`identity_of`]).
    log_id: String,
    /// Catching up with the log's end after an outage, not replaying on start.
    resumed: bool,
    retry_for: Option<Duration>,
    failover_ms: u64,
    /// Enqueued attempts whose long wait for a worker was reported (once each).
    warned_unclaimed: HashSet<StepRef>,
    /// When open tasks were last scanned for unclaimed attempts (at most once a second:
    /// the scan walks every open task, as `decide` does, on the orchestrator's loop).
    unclaimed_scanned_ms: u64,
}

impl Runtime {
    fn run(mut self) {
        if self.engine.caught_up.load(Ordering::SeqCst) {
            // Nothing to replay (an empty log, or a snapshot at its end).
            self.replayed(now_ms());
        }
        match self.follow() {
            Ok(()) => self.release_lease(),
            Err(e) => {
                tracing::error!("the orchestrator stopped: {e}");
                *self.engine.failure.lock() = Some(e);
            }
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
            if !self.caught_up(&folded, now) {
                continue;
            }
            wait = match self.lead(now)? {
                true => self.decide_and_publish(now)?,
                false => IDLE_POLL,
            };
        }
        Ok(())
    }

    /// Whether the fold has reached the end the engine waits for before it decides (the
    /// log's end on start, or when the log came back after an outage); says so once.
    fn caught_up(&mut self, folded: &[Folded], now: u64) -> bool {
        if self.engine.caught_up.load(Ordering::SeqCst) {
            return true;
        }
        if !self.resumed {
            let replayed = &self.engine.recovery.replayed;
            let before_end = folded.iter().filter(|f| f.position < self.replay_end);
            replayed.fetch_add(before_end.count() as u64, Ordering::AcqRel);
        }
        if !self.folder.replayed(&self.engine.shared, self.replay_end) {
            return false;
        }
        match self.resumed {
            true => self.back(now),
            false => self.replayed(now),
        }
        true
    }

    /// The replay reached the log's end as it was on start: serve, and date the lease.
    fn replayed(&mut self, now: u64) {
        let r = &self.engine.recovery;
        tracing::info!(
            "replayed {} events of the log, positions {} to {}",
            r.replayed.load(Ordering::Acquire),
            r.from,
            r.to
        );
        let state = self.engine.shared.lock();
        self.candidate
            .replayed(&state.leader, now, state.open_tasks() > 0);
        drop(state);
        self.engine.caught_up.store(true, Ordering::SeqCst);
    }

    /// Renews or bids for the lease as due; returns whether this one decides now. On
    /// becoming active it gives every attempt in progress a fresh lease (as after a
    /// replay) and forgets decisions in flight (the predecessor's are not its own).
    fn lead(&mut self, now: u64) -> Result<bool, Error> {
        let (leader, quiet) = {
            let state = self.engine.shared.lock();
            (state.leader.clone(), state.open_tasks() == 0)
        };
        let active = self.candidate.is_active(&leader);
        if active != self.active {
            if active {
                tracing::info!(term = leader.term, id = %self.candidate.id, "orchestrator active: deciding");
                self.inflight.clear();
                self.start_leases(now);
            } else {
                tracing::warn!(term = leader.term, holder = %leader.holder, "orchestrator standby: another holds the lease");
                self.standby_said = leader.term;
            }
            self.active = active;
        }
        self.say_standby(&leader);
        let role = &self.engine.role;
        role.active.store(active, Ordering::Release);
        role.term.store(leader.term, Ordering::Release);
        role.quiet
            .store(self.candidate.is_quiet(), Ordering::Release);
        if let Some(e) = self.candidate.due(&leader, now, quiet) {
            self.engine.writer().publish(e)?;
        }
        Ok(active)
    }

    /// A standby says so once per term it sees another hold (a fresh one found the lease
    /// taken; another took over from the holder it knew).
    fn say_standby(&mut self, leader: &Leader) {
        let held = leader.term > 0 && !leader.holder.is_empty();
        if self.active || !held || self.standby_said == leader.term {
            return;
        }
        tracing::info!(
            term = leader.term,
            holder = %leader.holder,
            "orchestrator standby: another holds the lease; this one decides if that lease lapses (after the first thing to decide, when the holder renews quietly)"
        );
        self.standby_said = leader.term;
    }

    /// After the replay: every attempt in progress gets a lease from now (its worker,
    /// if alive, heartbeats; if not, the attempt is taken back a lease later).
    fn start_leases(&mut self, now: u64) {
        let state = self.engine.shared.lock();
        for task in state.open_task_iter() {
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
        // Every position but a lease event's stirs a quiet lease, one that does not
        // decode too (a newer writer's event: a newer standby reads it as activity).
        let Some(env) = &f.envelope else {
            self.candidate.stirred(now);
            return;
        };
        // Most events are not its own (none are, for a running task of protocol 2):
        // no key to build then.
        if !self.inflight.is_empty() {
            self.inflight.remove(&key(&env.event));
        }
        if !matches!(env.event, Event::OrchestratorLease { .. }) {
            self.candidate.stirred(now);
        }
        match &env.event {
            Event::OrchestratorLease { .. } if f.outcome.is_ok() => {
                self.candidate
                    .renewed(&self.engine.shared.lock().leader, now);
            }
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
        forget_settled_claims(&mut self.claimed_at, &self.engine.shared.lock());
        let (claimed_at, seen) = (&self.claimed_at, &self.seen);
        let clock = Clock {
            now_ms: now,
            lease_ms: self.lease_ms,
            claimed_at: &|at| claimed_at.get(at).copied(),
            worker_seen: &|w| seen.get(w).copied(),
        };
        let (events, wake) = decide(&self.engine.shared.lock(), &clock);
        self.warn_unclaimed(now);
        let term = Some(self.engine.role.term.load(Ordering::Acquire));
        self.inflight
            .retain(|_, at| now.saturating_sub(*at) < INFLIGHT_MS);
        // Every new decision of this round in one append: one batch through the log.
        let fresh: Vec<Event> = events
            .into_iter()
            .filter(|e| self.inflight.insert(key(e), now).is_none())
            .collect();
        self.engine.writer().publish_all_at(fresh, term, now)?;
        let until_wake = wake.map_or(IDLE_POLL, |w| Duration::from_millis(w.saturating_sub(now)));
        Ok(until_wake.min(IDLE_POLL))
    }
}

impl Runtime {
    /// Warns once of each enqueued attempt no worker has claimed for
    /// [`UNCLAIMED_WARN_MS`], and forgets those claimed (or gone) since.
    fn warn_unclaimed(&mut self, now: u64) {
        if now.saturating_sub(self.unclaimed_scanned_ms) < UNCLAIMED_SCAN_MS {
            return;
        }
        self.unclaimed_scanned_ms = now;
        let state = self.engine.shared.lock();
        let waiting = crate::unclaimed::unclaimed(&state, now, UNCLAIMED_WARN_MS);
        let still: HashSet<&StepRef> = waiting.iter().map(|u| &u.at).collect();
        self.warned_unclaimed.retain(|at| still.contains(at));
        for u in &waiting {
            if self.warned_unclaimed.insert(u.at.clone()) {
                tracing::warn!("{}", crate::unclaimed::warning(u));
            }
        }
    }
}

/// How often [`Runtime::warn_unclaimed`] scans the open tasks.
const UNCLAIMED_SCAN_MS: u64 = 1_000;

/// Keeps the claim times of attempts still in progress only. An attempt leaves the table
/// when its result, completion or expiry is folded (`observe`); one whose task ended
/// under it (cancelled, resolved by hand, failed by another step or by staleness) has
/// none of those, and without this its entry would stay for the process's life.
fn forget_settled_claims(claimed_at: &mut HashMap<StepRef, u64>, state: &State) {
    claimed_at.retain(|at, _| {
        state.open.contains(&at.task)
            && state.tasks[&at.task]
                .step(&at.step)
                .is_some_and(|s| s.state == StepState::InProgress && s.attempt == at.attempt)
    });
}

/// A log that starts past 0 (`first`, for a fold that needs it from 0) lost its first
/// events (a memory-only topic, `--rf 1`, whose server restarted): the templates and
/// tasks in them are gone, which the operator must hear, not find out from 404s.
fn warn_if_events_lost(first: u64, log: &LogConfig) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Envelope;
    use serde_json::json;

    const TWO_STEPS: &str = "name: two\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: h}}
  - {name: b, handler: {callable: h}}";

    fn apply(state: &mut State, event: Event) {
        let env = Envelope {
            ts_ms: 1,
            term: None,
            event,
        };
        let applied = state.apply(state.next_position, &env);
        assert!(applied.is_ok(), "{:?}: {applied:?}", env.event);
    }

    fn at(task: &str, step: &str) -> StepRef {
        StepRef {
            task: task.into(),
            step: step.into(),
            attempt: 1,
        }
    }

    /// Two tasks whose two steps are both claimed (attempt 1).
    fn two_tasks_in_progress() -> State {
        let mut state = State::default();
        let template = crate::validate::load(TWO_STEPS, None).unwrap();
        apply(&mut state, Event::TemplateRegistered { template });
        for task in ["t1", "t2"] {
            apply(
                &mut state,
                Event::TaskCreated {
                    task: task.into(),
                    namespace: "p".into(),
                    name: "two".into(),
                    version: "1".into(),
                    context: json!({}),
                    idempotency_key: Some(task.into()),
                    identity: None,
                    // The fold enqueues both steps (no decision needed to claim them).
                    protocol: Some(2),
                },
            );
            for step in ["a", "b"] {
                let worker = "w".to_string();
                apply(
                    &mut state,
                    Event::StepClaimed {
                        at: at(task, step),
                        worker,
                    },
                );
            }
        }
        state
    }

    #[test]
    fn the_claims_of_a_task_that_ended_under_its_running_steps_are_forgotten() {
        let mut state = two_tasks_in_progress();
        let mut claimed: HashMap<StepRef, u64> = ["t1", "t2"]
            .iter()
            .flat_map(|t| [(at(t, "a"), 5), (at(t, "b"), 5)])
            .collect();
        // A claim of an attempt that is not the step's current one is stale too.
        claimed.insert(
            StepRef {
                attempt: 7,
                ..at("t2", "a")
            },
            5,
        );
        forget_settled_claims(&mut claimed, &state);
        assert_eq!(
            claimed.len(),
            4,
            "every running attempt keeps its claim: {claimed:?}"
        );

        let reason = "operator".to_string();
        apply(
            &mut state,
            Event::TaskCancelled {
                task: "t1".into(),
                reason,
            },
        );
        forget_settled_claims(&mut claimed, &state);
        let mut left: Vec<&StepRef> = claimed.keys().collect();
        left.sort_by_key(|r| (r.task.clone(), r.step.clone()));
        assert_eq!(left, [&at("t2", "a"), &at("t2", "b")]);
    }
}
