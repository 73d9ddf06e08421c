//! The native half of the workflow `Worker` (ts/workflow.ts): TypeScript step handlers run
//! by the engine's own worker loop (`embarcadero_workflow::Worker`: claims, heartbeats,
//! leases, timeouts, results), so there is one implementation of the worker protocol.
//!
//! Owns the crossing. Each handler name becomes a [`JsHandler`] in the loop's
//! `Registry`; the loop calls it on an attempt thread of its own, which hands the step's
//! context (as JSON) to JavaScript through one `ThreadsafeFunction` (queued on the event
//! loop, never waited for there) and then blocks, off the JavaScript thread, until the
//! TypeScript layer calls [`NativeWorker::complete`] with the handler's settled value.
//! Pending calls live in [`Calls`], by a call id, with their checkpoint sink. Everything
//! that may wait on the network (start, checkpoints, stop) runs on the blocking pool and
//! answers a Promise. The loop is supervised (`embarcadero_workflow::SupervisedWorker`): a
//! worker whose log is lost is replaced by a new one with the same handlers, and each
//! failure and restart is handed to JavaScript as a JSON document through a second
//! `ThreadsafeFunction` ([`report_to`]).

use crate::error::config;
use crate::{blocking, millis};
use embarcadero_workflow::event::Checkpoint;
use embarcadero_workflow::handler::{self, CheckpointSink, Registry, StepError, StepHandler};
use embarcadero_workflow::log::LogConfig;
use embarcadero_workflow::supervisor::{Report, SupervisorHandle};
use embarcadero_workflow::{RestartPolicy, SupervisedWorker, WorkerConfig, WorkerEvent};
use napi::bindgen_prelude::FnArgs;
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};
use napi::Status;
use napi_derive::napi;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// `(callId, contextJson) => void`, called on the JavaScript thread; it must not throw
/// (a throw from a threadsafe call is fatal to the process), which ts/workflow.ts ensures.
type Dispatch = ThreadsafeFunction<FnArgs<(u32, String)>, (), FnArgs<(u32, String)>, Status, false>;

/// `(eventJson) => void`, called on the JavaScript thread for each failure and restart the
/// supervisor reports; it must not throw either.
type ReportFn = ThreadsafeFunction<String, (), String, Status, false>;

/// `(callId) => void`, called on the JavaScript thread when a pending call's attempt is
/// called off (its task cancelled, say): ts/workflow.ts aborts the call's `signal`. It
/// must not throw either.
type CallOffFn = ThreadsafeFunction<u32, (), u32, Status, false>;

/// The worker's options, as JavaScript passes them.
#[napi(object)]
pub struct NativeWorkerConfig {
    /// Namespaces served; empty: all.
    pub namespaces: Vec<String>,
    pub concurrency: u32,
    pub lease_ms: f64,
    pub topic: String,
    /// Acknowledgement level of the worker's events (`embarcadero worker --ack`): 1 or 2.
    pub ack: u32,
    /// Replication factor of the topic if the worker creates it (`--rf`).
    pub rf: u32,
    /// How long a lost log is waited for before the worker ends with the last error;
    /// none: for as long as it lives.
    pub retry_for_ms: Option<f64>,
}

/// A handler's failure, as the TypeScript layer reports it.
#[napi(object)]
pub struct NativeStepError {
    pub message: String,
    pub retryable: bool,
    pub retry_after_ms: Option<f64>,
}

/// A call handed to JavaScript and not yet completed.
struct Pending {
    /// Which call this is, across the wrap of the 32-bit ids ([`Calls::call_off`]).
    serial: u64,
    reply: mpsc::SyncSender<Result<Value, StepError>>,
    /// The attempt's checkpoint sink (batch worker instances only).
    checkpoints: Option<CheckpointSink>,
}

/// The calls in flight and the way to JavaScript. `dispatch` is `None` once the worker is
/// closed: dropping it releases the threadsafe function, so Node may exit.
struct Calls {
    state: Mutex<CallsState>,
}

struct CallsState {
    dispatch: Option<Dispatch>,
    /// `None` once the worker is closed, as `dispatch`.
    call_off: Option<CallOffFn>,
    pending: HashMap<u32, Pending>,
    next_id: u32,
    /// Calls started so far: the next call's `serial`.
    started: u64,
}

/// A call handed to JavaScript: its id there, its serial, and where its outcome comes.
struct Started {
    id: u32,
    serial: u64,
    outcome: mpsc::Receiver<Result<Value, StepError>>,
}

impl Calls {
    /// Registers a call and queues it on the event loop; the receiver gets its outcome,
    /// or disconnects if the worker closes first.
    fn start(
        &self,
        ctx_json: String,
        checkpoints: Option<CheckpointSink>,
    ) -> Result<Started, StepError> {
        let mut st = self.state.lock();
        let CallsState {
            dispatch,
            pending,
            next_id,
            started,
            ..
        } = &mut *st;
        let Some(dispatch) = dispatch.as_ref() else {
            return Err(StepError::retryable("the worker is closed"));
        };
        // Ids wrap after 2^32 calls; one still pending then (a handler that never
        // settled) keeps its id, and the next free one is taken.
        while pending.contains_key(next_id) {
            *next_id = next_id.wrapping_add(1);
        }
        let id = *next_id;
        *next_id = next_id.wrapping_add(1);
        let (reply, outcome) = mpsc::sync_channel(1);
        let status = dispatch.call(
            FnArgs::from((id, ctx_json)),
            ThreadsafeFunctionCallMode::NonBlocking,
        );
        if status != Status::Ok {
            return Err(StepError::retryable(format!(
                "cannot call into JavaScript ({status})"
            )));
        }
        let serial = *started;
        *started += 1;
        let call = Pending {
            serial,
            reply,
            checkpoints,
        };
        pending.insert(id, call);
        Ok(Started {
            id,
            serial,
            outcome,
        })
    }

    /// Tells JavaScript that call `id` (the one numbered `serial`, not a later call that
    /// reuses the id) was called off, if it is still pending.
    fn call_off(&self, id: u32, serial: u64) {
        let st = self.state.lock();
        let (Some(f), Some(p)) = (st.call_off.as_ref(), st.pending.get(&id)) else {
            return;
        };
        if p.serial == serial {
            f.call(id, ThreadsafeFunctionCallMode::NonBlocking);
        }
    }

    /// Ends the call `id` with `outcome`; false if it is not pending (already completed,
    /// or the worker closed).
    fn finish(&self, id: u32, outcome: Result<Value, StepError>) -> bool {
        let Some(p) = self.state.lock().pending.remove(&id) else {
            return false;
        };
        // The attempt thread may have stopped waiting (the step's timeout): the outcome
        // is then dropped, as the Rust worker drops a late result.
        let _ = p.reply.send(outcome);
        true
    }

    fn sink(&self, id: u32) -> Option<CheckpointSink> {
        self.state
            .lock()
            .pending
            .get(&id)
            .and_then(|p| p.checkpoints.clone())
    }

    /// Releases the threadsafe function and wakes every attempt thread still waiting (a
    /// handler that never settled), which then reports a retryable failure nobody
    /// publishes (the loop is over).
    fn close(&self) {
        let mut st = self.state.lock();
        st.dispatch = None;
        st.call_off = None;
        st.pending.clear();
    }
}

/// A JavaScript handler as a step handler of the Rust worker loop.
struct JsHandler {
    callable: String,
    calls: Arc<Calls>,
}

impl StepHandler for JsHandler {
    fn call(&self, ctx: &handler::StepContext) -> Result<Value, StepError> {
        // This is the attempt's own thread: blocking here holds neither the loop that
        // claims and heartbeats nor the JavaScript thread.
        let text = context_json(&self.callable, ctx).to_string();
        let sink = ctx.batch.as_ref().map(|b| b.checkpoints.clone());
        let call = self.calls.start(text, sink)?;
        // Runs on the worker loop's thread, at once if already called off: only queues
        // a call into JavaScript, which aborts the handler's `signal`.
        let (calls, id, serial) = (self.calls.clone(), call.id, call.serial);
        ctx.cancellation
            .on_cancel(move || calls.call_off(id, serial));
        call.outcome
            .recv()
            .unwrap_or_else(|_| Err(StepError::retryable("the worker closed during the step")))
    }
}

/// When `left` from now is, in milliseconds since the Unix epoch (JavaScript's clock),
/// rounded up: the handler's signal must not abort before the worker's deadline, or the
/// handler's rejection would be reported instead of the worker's timeout.
fn deadline_unix_ms(left: Duration) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    ((now + left).as_micros().div_ceil(1000)) as f64
}

/// What a handler is given, as ts/workflow.ts reads it.
fn context_json(callable: &str, ctx: &handler::StepContext) -> Value {
    let batch = ctx.batch.as_ref().map(|b| {
        json!({
            "cursor": b.cursor,
            "index": b.index,
            "count": b.count,
            "resume": b.resume.as_ref().map(|c| json!({
                "cursor": c.cursor,
                "itemsDone": c.items_done,
                "partial": c.partial,
            })),
        })
    });
    json!({
        "callable": callable,
        "taskUuid": ctx.task_uuid,
        "stepName": ctx.step_name,
        "attempt": ctx.attempt,
        "context": ctx.context,
        "initialization": ctx.initialization,
        "ancestors": ctx.ancestors,
        "dependencies": ctx.dependencies,
        "batch": batch,
        // A wall-clock time, not a duration: the call waits its turn on the JavaScript
        // thread, and a duration would start late by that wait.
        "deadlineUnixMs": deadline_unix_ms(ctx.time_left()),
    })
}

/// JSON text from JavaScript (`JSON.stringify`'s output, so it parses unless a caller
/// bypassed the TypeScript layer).
fn parse(what: &str, text: &str) -> napi::Result<Value> {
    serde_json::from_str(text).map_err(|e| config(format!("{what} is not JSON: {e}")))
}

/// A non-negative whole number of JavaScript as a u64.
fn whole(what: &str, v: f64) -> napi::Result<u64> {
    if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= 2f64.powi(53) {
        Ok(v as u64)
    } else {
        Err(config(format!(
            "{what} must be a non-negative integer, not {v}"
        )))
    }
}

/// The engine's worker loop running JavaScript handlers, replaced by a new one when its
/// log is lost.
#[napi]
pub struct NativeWorker {
    /// The current worker's id, without `inner`'s lock (which a stop holds).
    handle: SupervisorHandle,
    /// `None` once stopped.
    inner: Arc<Mutex<Option<SupervisedWorker>>>,
    calls: Arc<Calls>,
}

/// Starts a worker loop for `callables` (the handlers' names), whose calls go to
/// `dispatch` (and word of a call called off to `call_off`), supervised: `report` gets
/// each failure and restart ([`report_to`]); resolves once the first worker has
/// connected to the log.
#[napi]
// The threadsafe functions' types are spelled out: napi's type generator does not follow
// aliases, and `Dispatch` would reach native.d.ts as an unknown name.
#[allow(clippy::type_complexity)]
pub async fn start_worker(
    dispatch: ThreadsafeFunction<FnArgs<(u32, String)>, (), FnArgs<(u32, String)>, Status, false>,
    report: ThreadsafeFunction<String, (), String, Status, false>,
    call_off: ThreadsafeFunction<u32, (), u32, Status, false>,
    callables: Vec<String>,
    control: String,
    options: NativeWorkerConfig,
) -> napi::Result<NativeWorker> {
    let (cfg, policy) = worker_config(&control, options)?;
    let calls = Arc::new(Calls {
        state: Mutex::new(CallsState {
            dispatch: Some(dispatch),
            call_off: Some(call_off),
            pending: HashMap::new(),
            next_id: 0,
            started: 0,
        }),
    });
    let mut registry = Registry::new();
    for callable in callables {
        let calls = calls.clone();
        registry.register(callable.clone(), JsHandler { callable, calls });
    }
    let report = report_to(report);
    let started = blocking(move || SupervisedWorker::start(cfg, registry, policy, report)).await;
    let worker = match started {
        Ok(w) => w,
        Err(e) => {
            calls.close();
            return Err(e);
        }
    };
    Ok(NativeWorker {
        handle: worker.handle(),
        inner: Arc::new(Mutex::new(Some(worker))),
        calls,
    })
}

/// The worker's configuration and restart policy from JavaScript's options, checked.
fn worker_config(
    control: &str,
    options: NativeWorkerConfig,
) -> napi::Result<(WorkerConfig, RestartPolicy)> {
    if options.concurrency == 0 || options.lease_ms.is_nan() || options.lease_ms < 1.0 {
        return Err(config("concurrency and leaseMs must be at least 1"));
    }
    // 1 ordered, 2 durable (which needs rf 2), as `embarcadero worker`.
    let (ack, rf) = match (u8::try_from(options.ack), u8::try_from(options.rf)) {
        (Ok(ack @ 1..=2), Ok(rf @ 1..)) => (ack, rf),
        _ => {
            return Err(config(format!(
                "ack must be 1 or 2 and rf at least 1, not ack {}, rf {}",
                options.ack, options.rf
            )))
        }
    };
    let retry_for = options
        .retry_for_ms
        .map(|ms| whole("retryForMs", ms).map(Duration::from_millis))
        .transpose()?;
    let mut log = LogConfig::new(control, &options.topic);
    (log.ack, log.replication_factor) = (ack, rf);
    let cfg = WorkerConfig {
        log,
        namespaces: options.namespaces,
        concurrency: options.concurrency as usize,
        lease_ms: millis(options.lease_ms).as_millis() as u64,
        run_log: None,
    };
    let policy = RestartPolicy {
        retry_for,
        ..RestartPolicy::default()
    };
    Ok((cfg, policy))
}

/// The supervisor's reports as JSON documents queued on the event loop (never waited
/// for): `kind` (`failed`, `startFailed`, `restarted`, `gaveUp`), `worker` (the failed or
/// the new worker's id), `message` (the sentence to log), `error` (the error's message as
/// `translate` reads it), `retryInMs`, `afterMs`. Drains are not reported: `close()`
/// asked for them. The threadsafe function goes with the supervision, once it ends.
fn report_to(report: ReportFn) -> Report {
    Arc::new(move |event: &WorkerEvent| {
        let (worker, error, retry_in, after) = match event {
            WorkerEvent::Failed {
                worker,
                error,
                retry_in,
            } => (Some(*worker), Some(*error), Some(*retry_in), None),
            WorkerEvent::StartFailed { error, retry_in } => {
                (None, Some(*error), Some(*retry_in), None)
            }
            WorkerEvent::Restarted { worker, after } => (Some(*worker), None, None, Some(*after)),
            WorkerEvent::GaveUp { error, after } => (None, Some(*error), None, Some(*after)),
            WorkerEvent::Draining { .. } => return,
        };
        let doc = json!({
            "kind": event.kind(),
            "worker": worker,
            "message": event.to_string(),
            "error": error.map(crate::error::marked),
            "retryInMs": retry_in.map(|d| d.as_millis() as u64),
            "afterMs": after.map(|d| d.as_millis() as u64),
        });
        report.call(doc.to_string(), ThreadsafeFunctionCallMode::NonBlocking);
    })
}

#[napi]
impl NativeWorker {
    /// The current worker's id, as its claims and results name it in the log; a new one
    /// after each restart.
    #[napi(getter)]
    pub fn id(&self) -> String {
        self.handle.id()
    }

    /// Ends call `id` with the handler's result (JSON text) or its failure; false if the
    /// call is no longer pending.
    #[napi]
    pub fn complete(
        &self,
        id: u32,
        result: Option<String>,
        error: Option<NativeStepError>,
    ) -> napi::Result<bool> {
        let outcome = match (result, error) {
            (Some(text), None) => Ok(parse("the result", &text)?),
            (None, Some(e)) => Err(StepError {
                message: e.message,
                retryable: e.retryable,
                retry_after_ms: e
                    .retry_after_ms
                    .map(|ms| whole("retryAfterMs", ms))
                    .transpose()?,
            }),
            _ => return Err(config("complete takes a result or an error, not both")),
        };
        Ok(self.calls.finish(id, outcome))
    }

    /// Saves a checkpoint of the batch worker attempt of call `id` (an event in the log);
    /// resolves once it is published.
    #[napi]
    pub async fn checkpoint(
        &self,
        id: u32,
        cursor: String,
        items_done: f64,
        partial: Option<String>,
    ) -> napi::Result<()> {
        let checkpoint = Checkpoint {
            cursor: parse("the cursor", &cursor)?,
            items_done: whole("itemsDone", items_done)?,
            partial: partial
                .map(|p| parse("the partial result", &p))
                .transpose()?
                .unwrap_or(Value::Null),
        };
        let Some(sink) = self.calls.sink(id) else {
            return Err(config(
                "checkpoint after the attempt ended (its handler settled, or the worker closed), \
                 or outside a batch worker step",
            ));
        };
        blocking(move || {
            sink.save(checkpoint);
            Ok(())
        })
        .await
    }

    /// Waits at most `timeout_ms` for the supervised loop to end for good (stopped, or
    /// failed with an error no new worker mends, or a log lost past `retryForMs`; not
    /// while a worker is replaced); resolves whether it has.
    #[napi]
    pub async fn wait(&self, timeout_ms: f64) -> napi::Result<bool> {
        let (inner, deadline) = (self.inner.clone(), Instant::now() + millis(timeout_ms));
        // The supervised worker has no timed join: waiting in short slices on the blocking pool
        // (as the Python binding does) keeps the event loop free.
        const SLICE: Duration = Duration::from_millis(50);
        blocking(move || loop {
            if inner.lock().as_ref().is_none_or(|w| w.is_finished()) {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            std::thread::sleep(left.min(SLICE));
        })
        .await
    }

    /// Starts no new worker and stops the current one claiming, waits until every attempt
    /// started has published its result and the log acknowledged it (heartbeating
    /// meanwhile: `SupervisedWorker::stop_and_drain`; during a restart's backoff it returns
    /// at once), then releases the JavaScript handlers; rejects with the error that ended
    /// the loop for good, if one did. Idempotent.
    #[napi]
    pub async fn stop(&self) -> napi::Result<()> {
        let (inner, calls) = (self.inner.clone(), self.calls.clone());
        blocking(move || {
            let taken = inner.lock().take();
            let stopped = match taken {
                Some(mut worker) => worker.stop_and_drain(),
                None => Ok(()),
            };
            calls.close();
            stopped
        })
        .await
    }
}
