//! A worker that rides out its log's outages: owns the one restart policy that
//! `embarcadero worker` and the Python and TypeScript SDK workers share, and the one
//! classification of errors it waits out.
//!
//! A [`Worker`]'s loop ends with an error when the log goes away under it (the server
//! killed and restarted, its brokers not back yet, the worker's order-5 session fenced
//! or forgotten). Its attempts then go back to the orchestrator a lease later, and
//! nothing of the worker is worth keeping: its fold is refolded, its session is new. So
//! a [`SupervisedWorker`] starts a new [`Worker`] (a new id, a new session) with the same
//! handlers after a backoff ([`RestartPolicy`]: 250 ms doubling to 10 s, back to 250 ms
//! after a worker that ran for twice the cap), for as long as it lives or up to
//! `retry_for`, and says so through its report ([`WorkerEvent`]). An error that a new
//! worker cannot mend (a topic of the wrong order, a configuration the server refuses)
//! ends it at once, as it ends a [`Worker`].
//!
//! Stopping drains the current worker ([`Worker::stop_and_drain`]); a stop that comes
//! while no worker runs (during a backoff) ends it at once without starting another.

use crate::handler::Registry;
use crate::worker::{Worker, WorkerConfig};
use embarcadero_client::Error;
use embarcadero_wire::ErrorCode;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Whether `e` says the server is not there, or not ready yet (its control port up
/// before its brokers: 502-504): worth waiting for, unlike a refusal such as a topic of
/// the wrong order. What `embarcadero orchestrator` and `embarcadero worker` wait out
/// when they start before their server.
pub fn server_not_there(e: &Error) -> bool {
    e.server_gone()
        || matches!(
            e,
            Error::Admin {
                status: 502..=504,
                ..
            }
        )
}

/// Whether `e`, ending a worker's loop or failing a new worker's start, means the log
/// was lost or refused the worker's session, which a new worker (with a new session,
/// folding the log afresh) mends once the server answers: the server not there
/// ([`server_not_there`]), the session fenced, forgotten or bound to another key (a
/// restarted server's session table), the brokers shutting down, full or pushing back,
/// or a memory-only log that restarted without the events the worker had read.
/// Anything else (a configuration refused, a topic deleted or of the wrong order, a
/// protocol violation) a new worker would meet again.
pub fn log_lost(e: &Error) -> bool {
    use ErrorCode::*;
    server_not_there(e)
        || matches!(
            e.code(),
            Some(
                SessionFenced
                    | SessionExpired
                    | SessionKeyMismatch
                    | SessionsExhausted
                    | ShuttingDown
                    | TooManyConnections
                    | Backpressure
                    | SlowPayload
                    | PositionNotRetained
            )
        )
}

/// How a [`SupervisedWorker`] replaces a worker whose log was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// How long a lost log is waited for before giving up (the error then ends the
    /// supervised worker); `None`: for as long as it lives (`--retry-for`'s default).
    pub retry_for: Option<Duration>,
    /// The first wait before a new worker, doubled after each failure up to `max_backoff`,
    /// and back to the first once a worker ran for twice `max_backoff`.
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

/// The first wait before a failed worker is replaced.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// The longest wait between two tries.
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            retry_for: None,
            first_backoff: FIRST_BACKOFF,
            max_backoff: MAX_BACKOFF,
        }
    }
}

/// The waits between tries: `first`, doubling up to `cap`.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(first: Duration, cap: Duration) -> Self {
        assert!(first <= cap, "a first backoff above its cap");
        Self {
            first,
            cap,
            next: first,
        }
    }

    /// The next wait, without taking it.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// The next wait; the one after is twice as long, up to the cap.
    pub fn take(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.cap);
        wait
    }

    /// A worker failed after running for `ran`: one that ran for twice the cap was a
    /// success, and the next failure starts again from the first wait.
    pub fn worker_ran(&mut self, ran: Duration) {
        if ran > self.cap * 2 {
            self.next = self.first;
        }
    }
}

/// What a [`SupervisedWorker`] reports as it goes (from its own thread): the CLI prints
/// it, the SDKs log it or hand it to the caller's callback.
#[derive(Debug)]
pub enum WorkerEvent<'a> {
    /// Worker `worker`'s loop ended with `error`, a lost log: its attempts go back after
    /// their lease, and a new worker starts in `retry_in`.
    Failed {
        worker: &'a str,
        error: &'a Error,
        retry_in: Duration,
    },
    /// A new worker could not start yet (`error`, a lost log); next try in `retry_in`.
    StartFailed {
        error: &'a Error,
        retry_in: Duration,
    },
    /// New worker `worker` runs, `after` the loss of its predecessor.
    Restarted { worker: &'a str, after: Duration },
    /// The log stayed lost for the policy's `retry_for`: the supervised worker ends with
    /// `error`, the last one.
    GaveUp { error: &'a Error, after: Duration },
    /// A stop began draining worker `worker`, with `running` attempts still running.
    Draining { worker: &'a str, running: usize },
}

/// Where a [`SupervisedWorker`] reports its [`WorkerEvent`]s.
pub type Report = Arc<dyn Fn(&WorkerEvent) + Send + Sync>;

impl WorkerEvent<'_> {
    /// The event's name in the SDKs: `failed`, `startFailed`, `restarted`, `gaveUp`,
    /// `draining`.
    pub fn kind(&self) -> &'static str {
        match self {
            WorkerEvent::Failed { .. } => "failed",
            WorkerEvent::StartFailed { .. } => "startFailed",
            WorkerEvent::Restarted { .. } => "restarted",
            WorkerEvent::GaveUp { .. } => "gaveUp",
            WorkerEvent::Draining { .. } => "draining",
        }
    }
}

/// The sentence the SDKs log (`embarcadero worker` prints its own, as it always has).
impl std::fmt::Display for WorkerEvent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerEvent::Failed {
                worker,
                error,
                retry_in,
            } => write!(
                f,
                "workflow worker {worker} lost the log ({error}); its attempts go back after \
                 their lease; a new worker starts in {} ms",
                retry_in.as_millis()
            ),
            WorkerEvent::StartFailed { error, retry_in } => write!(
                f,
                "cannot start a new workflow worker yet ({error}); trying again in {} ms",
                retry_in.as_millis()
            ),
            WorkerEvent::Restarted { worker, after } => write!(
                f,
                "workflow worker {worker} is running, {} ms after its predecessor lost the log",
                after.as_millis()
            ),
            WorkerEvent::GaveUp { error, after } => write!(
                f,
                "gave up on the log after {} ms without a workflow worker (retry_for): {error}",
                after.as_millis()
            ),
            WorkerEvent::Draining { worker, running } => write!(
                f,
                "workflow worker {worker} is draining ({running} attempt(s) running)"
            ),
        }
    }
}

/// Logs `event` through `tracing` (a warning, but the drain): a report for a program
/// with nothing better to do with them.
pub fn trace_event(event: &WorkerEvent) {
    match event {
        WorkerEvent::Draining { .. } => tracing::info!("{event}"),
        _ => tracing::warn!("{event}"),
    }
}

/// A [`Worker`] replaced by a new one whenever its log was lost ([`log_lost`]), per a
/// [`RestartPolicy`]; see the module's opening comment. The handlers survive restarts:
/// each new worker gets a clone of the [`Registry`] (its handlers are shared, not
/// copied). Dropping it leaves it running, as dropping a [`Worker`] does: stop it.
pub struct SupervisedWorker {
    control: Arc<Control>,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

/// What the handle and the supervising thread share.
struct Control {
    state: Mutex<ControlState>,
    /// Notified when a stop is asked.
    changed: Condvar,
}

struct ControlState {
    stop: Option<Stop>,
    /// The current worker's id (the last one's while none runs).
    id: String,
    /// The worker a drain stopped, once its drain has completed; `None` while none has,
    /// and for good when the stop came while no worker ran (a restart's backoff).
    drained: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// [`Worker::stop_and_drain`].
    Drain,
    /// [`Worker::stop`].
    Now,
}

/// A handle on a [`SupervisedWorker`] that does not hold it, for what must not wait
/// for a stop in progress (which holds the worker): its current id, and beginning its
/// drain from anywhere (a handler may: waiting there would mean waiting for itself).
#[derive(Clone)]
pub struct SupervisorHandle(Arc<Control>);

impl SupervisorHandle {
    /// See [`SupervisedWorker::id`].
    pub fn id(&self) -> String {
        self.0.state.lock().id.clone()
    }

    /// The worker whose drain completed (every result of the attempts it held is in
    /// the log), if one did: `None` after a stop that came while no worker ran, as
    /// during a restart's backoff (the lost worker's attempts go back after their lease).
    pub fn drained(&self) -> Option<String> {
        self.0.state.lock().drained.clone()
    }

    /// Begins the drain without waiting for it: no new worker starts, and the current
    /// one drains ([`crate::worker::DrainSwitch`]); [`SupervisedWorker::is_finished`]
    /// once it has.
    pub fn begin_drain(&self) {
        self.0.ask(Stop::Drain);
    }
}

impl Control {
    fn ask(&self, stop: Stop) {
        let mut state = self.state.lock();
        // A drain asked first stays a drain: `stop` after it must not cut it short.
        state.stop.get_or_insert(stop);
        self.changed.notify_all();
    }

    /// Waits at most `wait` for a stop; the stop, if one was asked.
    fn stop_within(&self, wait: Duration) -> Option<Stop> {
        let deadline = Instant::now() + wait;
        let mut state = self.state.lock();
        while state.stop.is_none() {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        state.stop
    }
}

/// How often the supervising thread looks whether its worker's loop has ended (the
/// [`Worker`] has no wait for that; a stop wakes it at once).
const WATCH: Duration = Duration::from_millis(50);

impl SupervisedWorker {
    /// Starts the first worker on the calling thread (whatever its error, it is returned:
    /// a caller that wants to wait for a server not there yet retries on
    /// [`server_not_there`]), then supervises it on a thread of its own, reporting to
    /// `report` ([`trace_event`] logs).
    pub fn start(
        config: WorkerConfig,
        registry: Registry,
        policy: RestartPolicy,
        report: Report,
    ) -> Result<Self, Error> {
        let control = Arc::new(Control {
            state: Mutex::new(ControlState {
                stop: None,
                id: String::new(),
                drained: None,
            }),
            changed: Condvar::new(),
        });
        let supervision = Supervision {
            config: config.clone(),
            registry: registry.clone(),
            backoff: Backoff::new(policy.first_backoff, policy.max_backoff),
            policy,
            report,
            control: control.clone(),
        };
        // The supervising thread first, so that no worker runs unsupervised when it
        // cannot be had: it waits for the first worker, and ends if none comes.
        let (hand_over, first_worker) = std::sync::mpsc::sync_channel::<Worker>(1);
        let thread = std::thread::Builder::new()
            .name("worker-supervisor".into())
            .spawn(move || match first_worker.recv() {
                Ok(first) => supervision.run(first),
                Err(_) => Ok(()),
            })
            .map_err(|e| Error::Config(format!("cannot start the supervisor thread: {e}")))?;
        let first = match Worker::start(config, registry) {
            Ok(first) => first,
            Err(e) => {
                drop(hand_over);
                let _ = thread.join();
                return Err(e);
            }
        };
        control.state.lock().id = first.id.clone();
        hand_over
            .send(first)
            .expect("the supervising thread waits for its first worker");
        Ok(Self {
            control,
            thread: Some(thread),
        })
    }

    /// The current worker's id, as its claims and results name it in the log. It
    /// changes at each restart (a new worker is a new id); while none runs, the last one's.
    pub fn id(&self) -> String {
        self.handle().id()
    }

    /// See [`SupervisorHandle`].
    pub fn handle(&self) -> SupervisorHandle {
        SupervisorHandle(self.control.clone())
    }

    /// Starts no new worker, drains the current one ([`Worker::stop_and_drain`]: once it
    /// returns, every result of the attempts it held is in the log) and returns once the
    /// supervision has ended. During a backoff it returns at once. Returns the error
    /// that ended the supervision, if one did (the last lost log's once `retry_for` ran
    /// out, or one a new worker cannot mend), else the drain's. Idempotent.
    pub fn stop_and_drain(&mut self) -> Result<(), Error> {
        self.end(Stop::Drain)
    }

    /// As [`Self::stop_and_drain`], but the current worker stops at once
    /// ([`Worker::stop`]).
    pub fn stop(&mut self) -> Result<(), Error> {
        self.end(Stop::Now)
    }

    fn end(&mut self, stop: Stop) -> Result<(), Error> {
        self.control.ask(stop);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(ended)) => ended,
            Some(Err(_)) => Err(Error::Config("the worker's supervisor panicked".into())),
            None => Ok(()),
        }
    }

    /// Whether the supervision has ended for good: stopped, or ended by an error (which
    /// [`Self::stop`] and [`Self::stop_and_drain`] then return). Not while a worker is
    /// being replaced.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

/// The supervising thread's side.
struct Supervision {
    config: WorkerConfig,
    registry: Registry,
    policy: RestartPolicy,
    backoff: Backoff,
    report: Report,
    control: Arc<Control>,
}

impl Supervision {
    /// Watches `worker`, replaces it each time its log is lost, until a stop or an error
    /// that ends it for good.
    fn run(mut self, first: Worker) -> Result<(), Error> {
        let mut worker = first;
        loop {
            let started = Instant::now();
            if let Some(stop) = self.watch(&worker) {
                return self.stop_worker(worker, stop);
            }
            // The loop ended by itself: by a drain begun from a handler (`Ok`), or by
            // the error `stop` returns.
            let error = match worker.stop() {
                Ok(()) => return Ok(()),
                Err(e) if !log_lost(&e) => return Err(e),
                Err(e) => e,
            };
            self.backoff.worker_ran(started.elapsed());
            (self.report)(&WorkerEvent::Failed {
                worker: &worker.id,
                error: &error,
                retry_in: self.backoff.peek(),
            });
            match self.replace()? {
                Some(new) => worker = new,
                None => return Ok(()),
            }
        }
    }

    /// Waits until `worker`'s loop ends (`None`) or a stop is asked.
    fn watch(&self, worker: &Worker) -> Option<Stop> {
        let mut state = self.control.state.lock();
        loop {
            if let Some(stop) = state.stop {
                return Some(stop);
            }
            if worker.is_finished() {
                return None;
            }
            self.control.changed.wait_for(&mut state, WATCH);
        }
    }

    fn stop_worker(&self, mut worker: Worker, stop: Stop) -> Result<(), Error> {
        match stop {
            Stop::Now => worker.stop(),
            Stop::Drain => {
                (self.report)(&WorkerEvent::Draining {
                    worker: &worker.id,
                    running: worker.running(),
                });
                worker.stop_and_drain()?;
                self.control.state.lock().drained = Some(worker.id.clone());
                Ok(())
            }
        }
    }

    /// A new worker once the log answers again: `None` if a stop came first; an error if
    /// a start failed with one a new worker cannot mend, or the log stayed lost for
    /// `retry_for` (checked after each failed start, so at least one is tried).
    fn replace(&mut self) -> Result<Option<Worker>, Error> {
        let lost = Instant::now();
        loop {
            if self.control.stop_within(self.backoff.take()).is_some() {
                return Ok(None);
            }
            let error = match Worker::start(self.config.clone(), self.registry.clone()) {
                Ok(worker) => return self.adopt(worker, lost.elapsed()),
                Err(e) if !log_lost(&e) => return Err(e),
                Err(e) => e,
            };
            if self.policy.retry_for.is_some_and(|l| lost.elapsed() >= l) {
                let after = lost.elapsed();
                (self.report)(&WorkerEvent::GaveUp {
                    error: &error,
                    after,
                });
                return Err(error);
            }
            (self.report)(&WorkerEvent::StartFailed {
                error: &error,
                retry_in: self.backoff.peek(),
            });
        }
    }

    /// Makes `worker` the current one, unless a stop came while it started: it is then
    /// stopped as asked, and `None` returned.
    fn adopt(&self, worker: Worker, after: Duration) -> Result<Option<Worker>, Error> {
        let mut state = self.control.state.lock();
        if let Some(stop) = state.stop {
            drop(state);
            return self.stop_worker(worker, stop).map(|()| None);
        }
        state.id = worker.id.clone();
        drop(state);
        (self.report)(&WorkerEvent::Restarted {
            worker: &worker.id,
            after,
        });
        // A stop asked from here on is seen by `watch`.
        Ok(Some(worker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_to_its_cap_and_starts_over_after_a_worker_that_ran_long() {
        let mut b = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        let waits: Vec<u128> = (0..8).map(|_| b.take().as_millis()).collect();
        assert_eq!(waits, [250, 500, 1000, 2000, 4000, 8000, 10_000, 10_000]);
        // A worker that ran for twice the cap or less failed soon: the backoff goes on.
        b.worker_ran(MAX_BACKOFF * 2);
        assert_eq!(b.peek(), MAX_BACKOFF);
        b.worker_ran(MAX_BACKOFF * 2 + Duration::from_millis(1));
        assert_eq!(b.peek(), FIRST_BACKOFF);
    }

    #[test]
    fn a_lost_log_is_waited_out_and_a_refusal_is_not() {
        let lost = [
            Error::Connect {
                what: "the control plane",
                addr: "a".into(),
                message: "refused".into(),
            },
            Error::ConnectionLost {
                broker: "b".into(),
                message: "eof".into(),
            },
            Error::NoLiveBroker,
            Error::Timeout(Duration::from_secs(1)),
            Error::Admin {
                status: 503,
                message: "brokers starting".into(),
            },
            broker(ErrorCode::SessionFenced),
            broker(ErrorCode::SessionExpired),
            broker(ErrorCode::PositionNotRetained),
        ];
        for e in &lost {
            assert!(log_lost(e), "{e}");
        }
        assert!(server_not_there(&lost[4]) && !server_not_there(&lost[5]));
        let refused = [
            Error::Config("topic t has order 2; the workflow log needs order 5".into()),
            Error::Admin {
                status: 400,
                message: "bad".into(),
            },
            Error::InvalidName("t t".into()),
            broker(ErrorCode::TopicDeleted),
            broker(ErrorCode::AckNotAllowed),
            Error::Protocol {
                peer: "b".into(),
                message: "bad frame".into(),
            },
        ];
        for e in &refused {
            assert!(!log_lost(e), "{e}");
        }
    }

    fn broker(code: ErrorCode) -> Error {
        Error::Broker {
            broker: "b".into(),
            code,
            message: "refused".into(),
        }
    }
}
