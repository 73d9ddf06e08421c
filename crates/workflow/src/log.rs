//! The event topic through the client library: creating it (order 5), a [`Writer`]
//! that stamps and encodes events into one order-5 session (so a writer's events keep
//! their order), and a [`Folder`] that reads the topic from the start and folds every
//! event into a shared [`State`], waking whoever waits on it.

use crate::event::{decode, encode, DecodeError, Envelope, Event};
use crate::ids::now_ms;
use crate::state::{Rejected, State};
use embarcadero_client::{
    Admin, Cursor, Error, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec,
};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where the event log is and how it is written.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// The server's control address (host:port).
    pub control: String,
    pub topic: String,
    /// Acknowledgement level of every event (2: durable, needs `replication_factor` 2).
    pub ack: u8,
    /// Used when the topic is created here.
    pub replication_factor: u8,
    /// How long an event may wait for others to join its batch (the publisher's
    /// linger); zero: sent as soon as a sender is free.
    pub linger: Duration,
}

impl LogConfig {
    pub fn new(control: &str, topic: &str) -> Self {
        Self {
            control: control.to_string(),
            topic: topic.to_string(),
            ack: 1,
            replication_factor: 1,
            linger: Duration::ZERO,
        }
    }
}

/// Creates the order-5 topic unless it exists; returns the position after its end.
pub fn ensure_topic(cfg: &LogConfig) -> Result<u64, Error> {
    let admin = Admin::new(&cfg.control);
    match admin.describe_topic(&cfg.topic) {
        Ok(info) if info.order != 5 => Err(Error::Config(format!(
            "topic {} has order {}; the workflow log needs order 5",
            cfg.topic, info.order
        ))),
        Ok(info) => {
            if info.replication_factor != cfg.replication_factor && first_rf_warning(cfg) {
                // The flag only applies to a topic the engine creates; an operator who
                // asked for another durability must hear that the log keeps its own.
                tracing::warn!(
                    "topic {} exists with replication factor {}, not the {} asked for: it \
                     keeps its own (the factor applies only when the engine creates the \
                     topic; `embarcadero topic delete {}` drops it and every event in it)",
                    cfg.topic,
                    info.replication_factor,
                    cfg.replication_factor,
                    cfg.topic
                );
            }
            Ok(info.next_position)
        }
        Err(Error::Admin { status: 404, .. }) => {
            let mut spec = TopicSpec::new(cfg.topic.clone(), 5).replicated(cfg.replication_factor);
            spec.default_ack = cfg.ack;
            match admin.create_topic(&spec) {
                Ok(info) => Ok(info.next_position),
                // Someone else created it meanwhile.
                Err(Error::Admin { status: 409, .. }) => {
                    Ok(admin.describe_topic(&cfg.topic)?.next_position)
                }
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

/// Whether this is the first time this process finds `cfg`'s topic with another
/// replication factor than asked for: the warning is said once, not at every supervised
/// restart of a worker that opens the log again.
fn first_rf_warning(cfg: &LogConfig) -> bool {
    static WARNED: std::sync::Mutex<std::collections::BTreeSet<(String, String, u8)>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let key = (
        cfg.control.clone(),
        cfg.topic.clone(),
        cfg.replication_factor,
    );
    WARNED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(key)
}

/// Publishes events, each stamped with the wall clock.
pub struct Writer {
    publisher: Publisher,
}

impl Writer {
    pub fn open(cfg: &LogConfig) -> Result<Self, Error> {
        let config = PublisherConfig {
            ack_level: cfg.ack,
            // Events are small and latency matters: by default each is sent as soon as a
            // sender is free.
            linger: cfg.linger,
            ..PublisherConfig::default()
        };
        Ok(Self {
            publisher: Publisher::connect(&cfg.control, &cfg.topic, config)?,
        })
    }

    pub fn publish(&self, event: Event) -> Result<(), Error> {
        self.publish_in_term(event, None)
    }

    /// Publishes a decision stamped with the orchestrator's term ([`crate::leadership`]).
    pub fn publish_in_term(&self, event: Event, term: Option<u64>) -> Result<(), Error> {
        let env = Envelope {
            ts_ms: now_ms(),
            term,
            event,
        };
        self.publisher.publish(&encode(&env))
    }

    /// Publishes `events` together, in order, each stamped with `term` (`None` for
    /// events that are not decisions): one append, so one batch through the log (one
    /// sequencing, one replication, one delivery to each reader) instead of up to one
    /// per event ([`Publisher::publish_all`]). Nothing is published for no events.
    pub fn publish_all(&self, events: Vec<Event>, term: Option<u64>) -> Result<(), Error> {
        self.publish_all_at(events, term, now_ms())
    }

    /// As [`Self::publish_all`], stamped `ts_ms`: the orchestrator stamps its decisions
    /// with the clock it made them by, so that the audit trail's times agree with the
    /// due times it computed from that clock (a retry `delay` after a failure shows as
    /// entered `waiting_for_retry` at `t` and `enqueued` at `t + delay` or later, not a
    /// millisecond early because the stamp was read after the decision).
    pub fn publish_all_at(
        &self,
        events: Vec<Event>,
        term: Option<u64>,
        ts_ms: u64,
    ) -> Result<(), Error> {
        if events.is_empty() {
            return Ok(());
        }
        let encoded: Vec<Vec<u8>> = events
            .into_iter()
            .map(|event| encode(&Envelope { ts_ms, term, event }))
            .collect();
        let payloads: Vec<&[u8]> = encoded.iter().map(Vec::as_slice).collect();
        self.publisher.publish_all(&payloads)
    }

    /// Waits until every event published so far is acknowledged.
    pub fn flush(&self) -> Result<(), Error> {
        self.publisher.flush()
    }
}

/// The folded state, a condition variable signalled after every batch of events, and
/// the waits on one task each, woken only by a batch with an event about their task
/// (so that a long poll costs nothing while other tasks' events are folded).
#[derive(Default)]
pub struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// Task uuid to the waits on it. Registered and removed under the state's lock
    /// (taken before this one, never after), so a batch folded after a wait checked the
    /// state finds the wait here.
    watchers: Mutex<HashMap<String, Vec<Watcher>>>,
}

/// One wait on one task.
struct Watcher {
    wake: Arc<Condvar>,
    /// Woken only by a batch after which the task is finished (a long poll for the
    /// end), not by every batch about it.
    finished_only: bool,
}

/// A task a batch of events touched, and whether it was finished after the batch.
struct Touched<'a> {
    uuid: &'a str,
    finished: bool,
}

impl Shared {
    /// Starts from a state folded earlier (a snapshot's).
    pub fn with_state(state: State) -> Self {
        Self {
            state: Mutex::new(state),
            ..Self::default()
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Replaces the state with `state` (an engine starting over from what its log still
    /// holds) and wakes the waits, which find their tasks as the new state has them.
    pub fn reset(&self, state: State) {
        *self.state.lock() = state;
        self.changed.notify_all();
        for w in self.watchers.lock().values().flatten() {
            w.wake.notify_one();
        }
    }

    /// Waits (until `deadline`) for `found` to return something; re-checks after every
    /// batch of events.
    pub fn wait_for<T>(
        &self,
        deadline: Instant,
        mut found: impl FnMut(&State) -> Option<T>,
    ) -> Option<T> {
        let mut state = self.state.lock();
        loop {
            if let Some(t) = found(&state) {
                return Some(t);
            }
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return found(&state);
            }
        }
    }

    /// [`Shared::wait_for`] for a `found` that only an event about task `uuid` can
    /// change: re-checks only after a batch holding one.
    pub fn wait_for_task<T>(
        &self,
        uuid: &str,
        deadline: Instant,
        found: impl FnMut(&State) -> Option<T>,
    ) -> Option<T> {
        self.wait_on_task(uuid, false, deadline, found)
    }

    /// [`Shared::wait_for_task`] for a `found` that only the task's finishing can
    /// satisfy (a long poll for its end): re-checks only after a batch that left the
    /// task finished, so a wait costs no wake-up per step of its task.
    pub fn wait_for_task_finished<T>(
        &self,
        uuid: &str,
        deadline: Instant,
        found: impl FnMut(&State) -> Option<T>,
    ) -> Option<T> {
        self.wait_on_task(uuid, true, deadline, found)
    }

    fn wait_on_task<T>(
        &self,
        uuid: &str,
        finished_only: bool,
        deadline: Instant,
        mut found: impl FnMut(&State) -> Option<T>,
    ) -> Option<T> {
        let mut state = self.state.lock();
        if let Some(t) = found(&state) {
            return Some(t);
        }
        let mine = Arc::new(Condvar::new());
        let watcher = Watcher {
            wake: mine.clone(),
            finished_only,
        };
        self.watchers
            .lock()
            .entry(uuid.to_string())
            .or_default()
            .push(watcher);
        let got = loop {
            if mine.wait_until(&mut state, deadline).timed_out() {
                break found(&state);
            }
            if let Some(t) = found(&state) {
                break Some(t);
            }
        };
        let mut watchers = self.watchers.lock();
        if let Some(list) = watchers.get_mut(uuid) {
            list.retain(|w| !Arc::ptr_eq(&w.wake, &mine));
            if list.is_empty() {
                watchers.remove(uuid);
            }
        }
        got
    }

    /// Wakes the waits on anything, and those on the tasks `touched` names (a wait for
    /// a task's end only if the task is finished).
    /// Returns how many waits on one task it woke.
    fn notify(&self, touched: &[Touched]) -> usize {
        self.changed.notify_all();
        let watchers = self.watchers.lock();
        let mut woken = 0;
        for t in touched {
            let waiting = watchers.get(t.uuid).into_iter().flatten();
            for w in waiting.filter(|w| t.finished || !w.finished_only) {
                woken += usize::from(w.wake.notify_one());
            }
        }
        woken
    }
}

/// One event read and what the fold made of it.
pub struct Folded {
    pub position: u64,
    /// `None` for a message that did not decode.
    pub envelope: Option<Envelope>,
    pub outcome: Result<(), Rejected>,
}

/// Reads the event topic from the start into a [`Shared`] state.
pub struct Folder {
    subscriber: Subscriber,
    /// Who reads, in the latency trace ([`crate::trace`]).
    role: String,
}

impl Folder {
    pub fn open(cfg: &LogConfig, role: &str) -> Result<Self, Error> {
        Self::open_at(cfg, role, 0)
    }

    /// Reads from position `start` on (0: from the first message retained).
    pub fn open_at(cfg: &LogConfig, role: &str, start: u64) -> Result<Self, Error> {
        let config = SubscriberConfig {
            start: (start > 0).then_some(Cursor::Global(start)),
            ..SubscriberConfig::default()
        };
        let subscriber = Subscriber::connect(&cfg.control, &cfg.topic, config)?;
        Ok(Self {
            subscriber,
            role: role.to_string(),
        })
    }

    /// The position after the last event read; before any, where the topic's readable
    /// part starts (past 0 when a memory-only topic lost its events to a server restart:
    /// those positions never come back, and the replay must not wait for them).
    pub fn position(&self) -> u64 {
        match self.subscriber.position() {
            embarcadero_client::Cursor::Global(p) => p,
            // An order-5 topic has global positions only (checked by `ensure_topic`).
            embarcadero_client::Cursor::PerBroker(_) => 0,
        }
    }

    /// Whether everything below `end` that the log still has is folded.
    pub fn replayed(&self, shared: &Shared, end: u64) -> bool {
        shared.lock().next_position.max(self.position()) >= end
    }

    /// Waits at most `timeout` for events and folds all that have arrived.
    pub fn pump(&mut self, shared: &Shared, timeout: Duration) -> Result<Vec<Folded>, Error> {
        // Decoded as they are read, outside the state's lock and without a copy.
        let mut read = Vec::new();
        let mut stamps = Vec::new();
        let polled = self.subscriber.poll_with(timeout, |m| {
            read.push((m.position, decode(m.payload)));
            stamps.push(m.publish_ts_ns);
        });
        if read.is_empty() {
            return polled.map(|_| Vec::new());
        }
        if let Err(e) = polled {
            // Delivered before the read failed, so past the subscriber's position: fold
            // them, or a reader that resumes from its position would never see them.
            shared.fold_batch(read);
            return Err(e);
        }
        // Read before the fold, so that a trip in the trace does not include it.
        let read_ns = crate::trace::enabled().then(embarcadero_client::now_ns);
        let (out, _) = shared.fold_batch(read);
        if let Some(read_ns) = read_ns {
            let reads: Vec<_> = stamps
                .iter()
                .zip(&out)
                .map(|(publish_ns, f)| crate::trace::Read {
                    position: f.position,
                    publish_ns: *publish_ns,
                    read_ns,
                    envelope: f.envelope.as_ref(),
                })
                .collect();
            crate::trace::record(&self.role, &reads);
        }
        Ok(out)
    }
}

impl Shared {
    /// Folds one batch of decoded events (in log order) under one hold of the state's
    /// lock, then wakes the waits it concerns. Returns what the fold made of each event,
    /// and how many waits on one task were woken.
    pub fn fold_batch(
        &self,
        read: Vec<(u64, Result<Envelope, DecodeError>)>,
    ) -> (Vec<Folded>, usize) {
        let mut state = self.state.lock();
        let out: Vec<Folded> = read
            .into_iter()
            .map(|(position, decoded)| fold_one(&mut state, position, decoded))
            .collect();
        let touched: Vec<Touched> = out
            .iter()
            .filter_map(|f| f.envelope.as_ref()?.event.task())
            .map(|uuid| Touched {
                uuid,
                finished: state.tasks.get(uuid).is_some_and(|t| t.state.is_terminal()),
            })
            .collect();
        drop(state);
        let woken = self.notify(&touched);
        (out, woken)
    }
}

fn fold_one(state: &mut State, position: u64, decoded: Result<Envelope, DecodeError>) -> Folded {
    match decoded {
        Ok(env) => {
            let outcome = state.apply(position, &env);
            if let Err(e) = &outcome {
                tracing::debug!("event at {position} refused: {e}");
            }
            Folded {
                position,
                envelope: Some(env),
                outcome,
            }
        }
        Err(e) => {
            tracing::warn!("message at {position} is not a workflow event: {e}");
            Folded {
                position,
                envelope: None,
                outcome: Err(state.refuse(position, e.to_string())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Outcome, StepRef};
    use crate::machine::TaskState;

    const ONE_STEP: &str = "name: one\nnamespace: n\nversion: '1'\nsteps:
  - {name: a, handler: {callable: math.square}}
";

    #[test]
    fn a_replication_factor_mismatch_is_reported_once_per_topic() {
        let cfg = LogConfig::new("127.0.0.1:1", "rf.once");
        assert!(first_rf_warning(&cfg), "the first time");
        assert!(!first_rf_warning(&cfg), "not at a supervised restart");
        assert!(first_rf_warning(&LogConfig::new("127.0.0.1:1", "rf.other")));
    }

    fn batch(first: u64, events: Vec<Event>) -> Vec<(u64, Result<Envelope, DecodeError>)> {
        let envelope = |event| Envelope {
            ts_ms: 0,
            term: None,
            event,
        };
        (first..)
            .zip(events.into_iter().map(|e| Ok(envelope(e))))
            .collect()
    }

    #[test]
    fn a_wait_for_a_tasks_end_is_woken_by_its_end_and_by_no_step_before_it() {
        let shared = Arc::new(Shared::default());
        let template = crate::validate::load(ONE_STEP, None).unwrap();
        let created = crate::fixtures::task_created("t", Some(2));
        shared.fold_batch(batch(
            0,
            vec![Event::TemplateRegistered { template }, created],
        ));
        let waiter = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(600);
                shared.wait_for_task_finished("t", deadline, |s| {
                    let t = s.tasks.get("t")?;
                    t.state.is_terminal().then_some(t.state)
                })
            })
        };
        // Registered under the state's lock, which the wait holds until it sleeps: once
        // the watcher is there, a fold (which takes that lock) finds the wait asleep.
        while !shared.watchers.lock().contains_key("t") {
            std::thread::yield_now();
        }
        let at = StepRef {
            task: "t".into(),
            step: "a".into(),
            attempt: 1,
        };
        let worker = "w".to_string();
        let claim = Event::StepClaimed {
            at: at.clone(),
            worker: worker.clone(),
        };
        let (folded, woken) = shared.fold_batch(batch(2, vec![claim]));
        assert_eq!(folded[0].outcome, Ok(()));
        assert_eq!(
            woken, 0,
            "a step of the task does not wake a wait for its end"
        );
        let outcome = Outcome::Success {
            result: serde_json::json!(4),
        };
        let result = Event::StepResult {
            at,
            worker,
            outcome,
        };
        let (_, woken) = shared.fold_batch(batch(3, vec![result]));
        assert_eq!(woken, 1, "the task's end does");
        assert_eq!(waiter.join().unwrap(), Some(TaskState::Complete));
        assert!(shared.watchers.lock().is_empty(), "the wait removed itself");
    }
}
