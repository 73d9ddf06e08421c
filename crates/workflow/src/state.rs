//! The fold: the engine's whole state as a pure, deterministic function of the event
//! sequence. [`State::apply`] takes the next event (with its log position) and either
//! applies it or rejects it with a typed [`Rejected`], leaving the state unchanged;
//! every reader of the log (orchestrator, standby, workers) computes the same state,
//! the same claim winners and the same rejections. Step events are checked before any
//! change; task states are derived from the steps ([`crate::settle`]).

use crate::batch::BatchSlot;
use crate::event::{Checkpoint, Envelope, Event, Expiry, Outcome, StepRef};
use crate::machine::{legal_step, StepState, TaskState};
use crate::template::{IdentityStrategy, StepTemplate, StepType, Template, TemplateKey};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One move of a state machine, with the event that caused it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition<S> {
    pub from: S,
    pub to: S,
    pub position: u64,
    pub ts_ms: u64,
}

/// An attempt's result waiting for the orchestrator's decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Returned {
    Success(Value),
    Failure {
        message: String,
        retryable: bool,
        retry_after_ms: Option<u64>,
    },
    LeaseLost,
}

/// (Deserialize is for [`crate::snapshot`], which restores the fields the serialized
/// form skips.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub name: String,
    /// The index of the template step this step is an instance of.
    #[serde(skip)]
    pub spec: usize,
    /// Whether the step exists: a step behind a decision is created only when the
    /// decision names it (see [`crate::branch`]); one never created never runs.
    pub created: bool,
    pub state: StepState,
    /// The current attempt (0 before the first is enqueued).
    pub attempt: u32,
    /// The worker whose claim of the current attempt won.
    pub worker: Option<String>,
    /// Failed attempts (handler failures and timeouts), counted against `max_attempts`.
    pub failures: u32,
    /// Attempts taken back because their worker's lease ran out.
    pub lease_losses: u32,
    pub result: Option<Value>,
    pub last_error: Option<String>,
    pub returned: Option<Returned>,
    pub retry_due_ms: Option<u64>,
    /// For an instance of a batch worker step: its cursor and place in the batch.
    pub batch: Option<BatchSlot>,
    /// The last checkpoint an attempt of this step saved.
    pub checkpoint: Option<Checkpoint>,
    pub history: Vec<Transition<StepState>>,
    /// Events about this step the fold refused (late results, lost claims), for audit.
    pub refused: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub uuid: String,
    #[serde(skip, default = "crate::snapshot::unset_template")]
    pub template: Arc<Template>,
    pub context: Value,
    pub state: TaskState,
    pub steps: Vec<Step>,
    /// Per step, the indices of its direct dependencies.
    #[serde(skip)]
    pub deps: Vec<Vec<usize>>,
    pub idempotency_key: Option<String>,
    /// 1: the orchestrator enqueues ready steps and completes successes by events; 2:
    /// the fold does both itself (see [`crate::settle`]).
    pub protocol: u8,
    pub cancelled: bool,
    /// Why an operator resolved the task by hand (`task_resolved`): set, the task is
    /// `resolved_manually` for good. (Default: snapshots from before it have none.)
    #[serde(default)]
    pub resolution: Option<String>,
    pub created_ms: u64,
    pub updated_ms: u64,
    pub completed_ms: Option<u64>,
    pub history: Vec<Transition<TaskState>>,
}

/// Why an event was not applied. Deterministic: every reader rejects the same events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("undecodable event: {0}")]
    Undecodable(String),
    #[error("template {0} is already registered with other content")]
    TemplateConflict(TemplateKey),
    #[error("no template {0}")]
    UnknownTemplate(TemplateKey),
    #[error("task {0} exists already")]
    DuplicateTask(String),
    #[error("a task with the same identity exists: {existing}")]
    DuplicateKey { existing: String },
    #[error("no task {0}")]
    UnknownTask(String),
    #[error("task {task} has no step {step}")]
    UnknownStep { task: String, step: String },
    #[error("task {task} is {state:?}")]
    TaskClosed { task: String, state: TaskState },
    #[error("{event} for attempt {} of {}: the step is at attempt {current}, {state:?}", at.attempt, at.step)]
    Superseded {
        event: &'static str,
        at: StepRef,
        current: u32,
        state: StepState,
    },
    #[error("claim of attempt {} of {} by {worker} lost to {winner}", at.attempt, at.step)]
    ClaimLost {
        at: StepRef,
        worker: String,
        winner: String,
    },
    #[error("task {task} is {state:?}; only a failed task can be rerun")]
    NotFailed { task: String, state: TaskState },
    #[error("step {} is not ready: a dependency is not complete", at.step)]
    NotReady { at: StepRef },
    #[error("task protocol {0} is not one this reader knows (1 to {max})", max = LATEST_PROTOCOL)]
    UnknownProtocol(u8),
    #[error("{event} written in orchestrator term {term}, but term {current} is current: its writer was deposed")]
    Fenced {
        event: &'static str,
        term: u64,
        current: u64,
    },
    #[error("lease bid, renewal or release of term {term} by {holder} refused: term {current} is held by {current_holder:?}")]
    LeaseRefused {
        term: u64,
        holder: String,
        current: u64,
        current_holder: String,
    },
}

/// The newest task protocol ([`Task::protocol`]) this fold knows.
pub const LATEST_PROTOCOL: u8 = 2;

/// The tasks by uuid: a persistent (copy-on-write) ordered map of shared tasks, so that
/// a clone of the state (a snapshot's) costs a few pointer copies however many tasks
/// there are, and the fold afterwards copies only the tree nodes and the tasks it
/// changes while the clone still holds them ([`State::task_mut`]). Ordered by uuid, as
/// a `BTreeMap`.
pub type TaskMap = imbl::OrdMap<String, Arc<Task>>;

/// The engine's state. Iteration orders are those of ordered maps, so that everything
/// derived from a state (decisions included) is the same on every reader. Every
/// collection that grows with the tasks is persistent ([`TaskMap`]): cloning a state is
/// O(1) in the tasks, which is what lets a snapshot be taken without stalling the fold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct State {
    pub templates: BTreeMap<TemplateKey, Arc<Template>>,
    pub tasks: TaskMap,
    /// A task's identity (see [`crate::identity`]; in older events
    /// `namespace/name@version/key`) to the task that has it.
    pub idempotency: imbl::OrdMap<String, String>,
    /// The position after the last event applied or rejected.
    pub next_position: u64,
    pub rejected: u64,
    /// The uuids of the tasks not finished: derived from `tasks`, kept by [`State::apply`]
    /// for the task each event names, so that the engine's loops and the backlog check
    /// visit the open tasks only, not every task the log ever held (a scan of all of
    /// them per batch of events made the engine slower the longer it ran). Whoever
    /// fills `tasks` by other means calls [`State::reindex`].
    pub open: imbl::OrdSet<String>,
    /// Which orchestrator's decisions are accepted ([`crate::leadership`]).
    pub leader: crate::leadership::Leader,
}

/// The identity of a task created by an event that records none (written before
/// identities): its idempotency key, scoped by template.
fn idempotency_scope(key: &TemplateKey, idempotency_key: &str) -> String {
    format!("{key}/{idempotency_key}")
}

impl State {
    /// Applies the event at `position` (or refuses it; the state is then unchanged).
    pub fn apply(&mut self, position: u64, env: &Envelope) -> Result<(), Rejected> {
        self.next_position = position + 1;
        let result = self.dispatch(position, env);
        match (&result, env.event.task()) {
            (Err(_), _) => self.rejected += 1,
            // An event changes only the task it names (a refused one changes nothing).
            (Ok(()), Some(uuid)) => self.reindex_task(uuid),
            (Ok(()), None) => {}
        }
        result
    }

    /// Tasks not finished (complete, error, cancelled or resolved): the engine's backlog.
    pub fn open_tasks(&self) -> usize {
        self.open.len()
    }

    /// The tasks not finished, in uuid order (as `tasks`).
    pub fn open_task_iter(&self) -> impl Iterator<Item = &Task> + '_ {
        self.open.iter().map(|uuid| match self.tasks.get(uuid) {
            Some(task) => task.as_ref(),
            None => unreachable!("open task {uuid} is not among the tasks"),
        })
    }

    /// The task `uuid` to change: copied first if a clone of the state (a snapshot
    /// being written) still shares it, so the clone never sees the change.
    pub fn task_mut(&mut self, uuid: &str) -> Option<&mut Task> {
        self.tasks.get_mut(uuid).map(Arc::make_mut)
    }

    /// Rebuilds [`State::open`] from `tasks` (after filling `tasks` without `apply`).
    pub fn reindex(&mut self) {
        let open = self.tasks.values().filter(|t| !t.state.is_terminal());
        self.open = open.map(|t| t.uuid.clone()).collect();
    }

    /// Puts one task in or out of [`State::open`] by its state now.
    fn reindex_task(&mut self, uuid: &str) {
        match self.tasks.get(uuid) {
            Some(t) if !t.state.is_terminal() => {
                if !self.open.contains(uuid) {
                    self.open.insert(uuid.to_string());
                }
            }
            _ => {
                self.open.remove(uuid);
            }
        }
    }

    /// The same for a message that did not decode: counted, refused.
    pub fn refuse(&mut self, position: u64, why: String) -> Rejected {
        self.next_position = position + 1;
        self.rejected += 1;
        Rejected::Undecodable(why)
    }

    fn dispatch(&mut self, position: u64, env: &Envelope) -> Result<(), Rejected> {
        let ts = env.ts_ms;
        // A deposed orchestrator's decisions are refused before they touch anything but
        // the audit trail of the step they name.
        if let Err(fenced) = self.leader.admits(env) {
            self.note_refused(&env.event, position, &fenced);
            return Err(fenced);
        }
        match &env.event {
            Event::TemplateRegistered { template } => self.register(template),
            Event::TaskCreated {
                task,
                namespace,
                name,
                version,
                context,
                idempotency_key,
                identity,
                protocol,
            } => {
                let key = TemplateKey {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    version: version.clone(),
                };
                let new = NewTask {
                    uuid: task,
                    key,
                    context,
                    idempotency_key: idempotency_key.as_deref(),
                    identity: identity.as_deref(),
                    protocol: protocol.unwrap_or(1),
                };
                self.create(new, position, ts)
            }
            Event::Heartbeat { .. } => Ok(()),
            Event::OrchestratorLease {
                term,
                holder,
                quiet_lease_ms,
                ..
            } => {
                // Quiet only if no task is open at this position, whatever the holder
                // saw when it wrote the renewal ([`crate::leadership`]).
                let quiet = if self.open.is_empty() {
                    *quiet_lease_ms
                } else {
                    0
                };
                self.leader.bid(*term, holder, ts, quiet)
            }
            Event::OrchestratorRelease { term, holder } => self.leader.release(*term, holder, ts),
            Event::TaskCancelled { task, .. } => self.cancel(task, position, ts),
            Event::TaskResolved { task, reason } => self.resolve(task, reason, position, ts),
            Event::TaskRerun { task, .. } => crate::manual::rerun(self, task, position, ts),
            Event::StepReset { .. } | Event::StepResolved { .. } => {
                crate::manual::apply(self, &env.event, position, ts)
            }
            step_event => self.step_event(step_event, position, ts),
        }
    }

    /// Records a refused step event in its step's audit trail (`refused`), if the task
    /// has that step and it was created (for other events, and unknown steps, nothing).
    fn note_refused(&mut self, event: &Event, position: u64, why: &Rejected) {
        let Some(at) = event.step_ref() else { return };
        let Some(task) = self.task_mut(&at.task) else {
            return;
        };
        if let Some(i) = task.index_of(&at.step).filter(|&i| task.steps[i].created) {
            let note = refusal_note(event, at, position, why);
            task.steps[i].refused.push(note);
        }
    }

    fn register(&mut self, template: &Template) -> Result<(), Rejected> {
        let key = template.key();
        match self.templates.get(&key) {
            Some(t) if **t == *template => Ok(()),
            Some(_) => Err(Rejected::TemplateConflict(key)),
            None => {
                self.templates.insert(key, Arc::new(template.clone()));
                Ok(())
            }
        }
    }

    fn create(&mut self, new: NewTask, position: u64, ts: u64) -> Result<(), Rejected> {
        let template = self
            .templates
            .get(&new.key)
            .cloned()
            .ok_or_else(|| Rejected::UnknownTemplate(new.key.clone()))?;
        if self.tasks.contains_key(new.uuid) {
            return Err(Rejected::DuplicateTask(new.uuid.to_string()));
        }
        if !(1..=LATEST_PROTOCOL).contains(&new.protocol) {
            return Err(Rejected::UnknownProtocol(new.protocol));
        }
        let unique = template.identity_strategy == IdentityStrategy::AlwaysUnique;
        let scope = match (new.identity, new.idempotency_key) {
            (Some(identity), _) => Some(identity.to_string()),
            (None, Some(k)) if !unique => Some(idempotency_scope(&new.key, k)),
            (None, _) => None,
        };
        if let Some(existing) = scope.as_ref().and_then(|s| self.idempotency.get(s)) {
            return Err(Rejected::DuplicateKey {
                existing: existing.clone(),
            });
        }
        let mut task = Task::new(new.uuid, template, new.context.clone(), ts);
        task.idempotency_key = new.idempotency_key.map(str::to_string);
        task.protocol = new.protocol;
        crate::settle::settle(&mut task, position, ts);
        if let Some(scope) = scope {
            self.idempotency.insert(scope, new.uuid.to_string());
        }
        self.tasks.insert(new.uuid.to_string(), Arc::new(task));
        Ok(())
    }

    fn cancel(&mut self, uuid: &str, position: u64, ts: u64) -> Result<(), Rejected> {
        let task = open_task(self, uuid)?;
        for step in &mut task.steps {
            if step.created && !step.state.is_terminal() {
                step.enter(StepState::Cancelled, position, ts);
            }
        }
        task.cancelled = true;
        crate::settle::settle(task, position, ts);
        Ok(())
    }

    /// `task_resolved`: an operator settled the task by hand. Allowed while it is
    /// unfinished or failed (a failed task is the one an operator most often settles;
    /// see `machine::legal_task`); refused once it completed, was cancelled or was
    /// resolved. Its unfinished steps are cancelled (nothing more of it runs, and late
    /// results are refused); failed and completed steps keep their state and results.
    fn resolve(
        &mut self,
        uuid: &str,
        reason: &str,
        position: u64,
        ts: u64,
    ) -> Result<(), Rejected> {
        let task = self
            .task_mut(uuid)
            .ok_or_else(|| Rejected::UnknownTask(uuid.to_string()))?;
        if task.state.is_terminal() && task.state != TaskState::Error {
            return Err(Rejected::TaskClosed {
                task: uuid.to_string(),
                state: task.state,
            });
        }
        for step in &mut task.steps {
            if step.created && !step.state.is_terminal() {
                step.enter(StepState::Cancelled, position, ts);
            }
        }
        task.resolution = Some(reason.to_string());
        task.completed_ms = None;
        crate::settle::settle(task, position, ts);
        assert_eq!(task.state, TaskState::ResolvedManually, "a resolved task");
        Ok(())
    }

    fn step_event(&mut self, event: &Event, position: u64, ts: u64) -> Result<(), Rejected> {
        let at = step_ref(event);
        let task = self
            .task_mut(&at.task)
            .ok_or_else(|| Rejected::UnknownTask(at.task.clone()))?;
        // A step not created (yet, or ever) does not exist for events: nothing moves it
        // (a `step_stale` seeing it `pending` at attempt 0 would otherwise match).
        let index = task
            .index_of(&at.step)
            .filter(|&i| task.steps[i].created)
            .ok_or_else(|| Rejected::UnknownStep {
                task: at.task.clone(),
                step: at.step.clone(),
            })?;
        let outcome = if task.state.is_terminal() {
            Err(Rejected::TaskClosed {
                task: at.task.clone(),
                state: task.state,
            })
        } else {
            apply_to_step(task, index, event, position, ts)
        };
        if let Err(e) = &outcome {
            let note = refusal_note(event, at, position, e);
            task.steps[index].refused.push(note);
        }
        outcome
    }
}

/// A step event on an open task; the task settles if it applied.
fn apply_to_step(
    task: &mut Task,
    index: usize,
    event: &Event,
    position: u64,
    ts: u64,
) -> Result<(), Rejected> {
    let ready = task.steps[index].created && crate::branch::dependencies_met(task, index);
    let timeout_s = task.spec(index).timeout_seconds;
    let how = crate::step_events::At {
        ready,
        timeout_s,
        position,
        ts,
    };
    crate::step_events::apply(&mut task.steps[index], event, how)?;
    consequences(task, index, position, ts);
    crate::settle::settle(task, position, ts);
    Ok(())
}

/// What a step's completion or failure does to other steps: a decision or a batchable
/// step creates steps; a batch instance's failure may cancel its siblings.
pub(crate) fn consequences(task: &mut Task, index: usize, position: u64, ts: u64) {
    match (task.spec(index).step_type, task.steps[index].state) {
        (StepType::Decision, StepState::Complete) => {
            crate::branch::create_steps(task);
        }
        (StepType::Batchable, StepState::Complete) => {
            crate::batch::create_instances(task, index);
            crate::branch::create_steps(task);
        }
        (_, StepState::Error) => crate::batch::on_error(task, index, position, ts),
        _ => {}
    }
}

struct NewTask<'a> {
    uuid: &'a str,
    key: TemplateKey,
    context: &'a Value,
    idempotency_key: Option<&'a str>,
    identity: Option<&'a str>,
    protocol: u8,
}

fn open_task<'a>(state: &'a mut State, uuid: &str) -> Result<&'a mut Task, Rejected> {
    let task = state
        .task_mut(uuid)
        .ok_or_else(|| Rejected::UnknownTask(uuid.to_string()))?;
    if task.state.is_terminal() {
        return Err(Rejected::TaskClosed {
            task: uuid.to_string(),
            state: task.state,
        });
    }
    Ok(task)
}

/// How a refused step event reads in its step's audit trail.
fn refusal_note(event: &Event, at: &StepRef, position: u64, why: &Rejected) -> String {
    format!(
        "position {position}: {} of attempt {}: {why}",
        event.kind(),
        at.attempt
    )
}

/// The attempt a step event is about (every event `step_event` gets has one).
fn step_ref(event: &Event) -> &StepRef {
    match event.step_ref() {
        Some(at) => at,
        None => unreachable!("not a step event: {event:?}"),
    }
}

impl Task {
    fn new(uuid: &str, template: Arc<Template>, context: Value, ts: u64) -> Self {
        let deps = template
            .steps
            .iter()
            .map(|s| {
                let found = s.dependencies.iter().filter_map(|d| template.step_index(d));
                found.collect()
            })
            .collect();
        let steps = template
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| Step::new(&s.name, i))
            .collect();
        let mut task = Self {
            uuid: uuid.to_string(),
            template,
            context,
            state: TaskState::Pending,
            steps,
            deps,
            idempotency_key: None,
            protocol: 1,
            cancelled: false,
            resolution: None,
            created_ms: ts,
            updated_ms: ts,
            completed_ms: None,
            history: Vec::new(),
        };
        crate::branch::create_steps(&mut task);
        task
    }

    /// Created pending steps whose dependencies let them run.
    pub fn ready_steps(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.steps.len()).filter(|&i| {
            let s = &self.steps[i];
            s.created && s.state == StepState::Pending && crate::branch::dependencies_met(self, i)
        })
    }

    /// The steps that exist (see [`Step::created`]).
    pub fn created_steps(&self) -> impl Iterator<Item = &Step> + '_ {
        self.steps.iter().filter(|s| s.created)
    }

    /// The template step step `i` runs.
    pub fn spec(&self, i: usize) -> &StepTemplate {
        &self.template.steps[self.steps[i].spec]
    }

    /// The index of the step called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.name == name)
    }

    /// Every step `index` depends on, directly or not, in template order.
    pub fn ancestors(&self, index: usize) -> Vec<usize> {
        let mut seen = vec![false; self.steps.len()];
        let mut stack = self.deps[index].clone();
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut seen[i], true) {
                stack.extend(&self.deps[i]);
            }
        }
        (0..self.steps.len()).filter(|&i| seen[i]).collect()
    }

    pub fn step(&self, name: &str) -> Option<&Step> {
        self.steps.iter().find(|s| s.name == name)
    }
}

impl Step {
    pub(crate) fn new(name: &str, spec: usize) -> Self {
        Self {
            name: name.to_string(),
            spec,
            created: false,
            state: StepState::Pending,
            attempt: 0,
            worker: None,
            failures: 0,
            lease_losses: 0,
            result: None,
            last_error: None,
            returned: None,
            retry_due_ms: None,
            batch: None,
            checkpoint: None,
            history: Vec::new(),
            refused: Vec::new(),
        }
    }

    /// Moves along a legal edge; any other move is a bug in the fold.
    pub(crate) fn enter(&mut self, to: StepState, position: u64, ts_ms: u64) {
        let from = self.state;
        assert!(
            legal_step(from, to),
            "illegal step transition {from:?} -> {to:?} of {}",
            self.name
        );
        self.state = to;
        self.history.push(Transition {
            from,
            to,
            position,
            ts_ms,
        });
    }
}

/// How an expiry reads as a returned attempt.
pub(crate) fn expired(reason: Expiry, timeout_s: u64) -> Returned {
    match reason {
        Expiry::LeaseLost => Returned::LeaseLost,
        Expiry::Timeout => Returned::Failure {
            message: format!("timed out after {timeout_s} s"),
            retryable: true,
            retry_after_ms: None,
        },
    }
}

impl From<&Outcome> for Returned {
    fn from(o: &Outcome) -> Self {
        match o {
            Outcome::Success { result } => Returned::Success(result.clone()),
            Outcome::Failure {
                message,
                retryable,
                retry_after_ms,
            } => Returned::Failure {
                message: message.clone(),
                retryable: *retryable,
                retry_after_ms: *retry_after_ms,
            },
        }
    }
}
