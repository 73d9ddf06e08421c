//! The native half of `embarcadero.workflow`: Python step handlers run by the engine's own
//! worker loop (`embarcadero_workflow::Worker`: claims, heartbeats, timeouts, results),
//! restarted by the engine's own supervisor when its log is lost
//! (`embarcadero_workflow::SupervisedWorker`), so there is one implementation of the
//! worker protocol and of its restart policy. Owns the crossing: a [`StepHandler`] that
//! calls a Python function with the GIL held only for the call, the context it is given
//! ([`StepContext`], [`BatchInput`]), a raised exception turned into a step failure, and
//! the supervisor's reports handed to Python (which logs them).

use crate::errors::{config, to_py};
use crate::options::whole;
use crate::to_python;
use embarcadero_workflow::event::Checkpoint;
use embarcadero_workflow::handler::{self, CheckpointSink, Registry, StepError, StepHandler};
use embarcadero_workflow::log::LogConfig;
use embarcadero_workflow::supervisor::{Report, SupervisorHandle};
use embarcadero_workflow::{RestartPolicy, SupervisedWorker, WorkerConfig, WorkerEvent};
use parking_lot::Mutex;
use pyo3::prelude::pyfunction;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyDict;
use serde_json::Value;
use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

thread_local! {
    /// Set on a thread while it runs a Python handler: `stop` there must not wait for the
    /// attempts to end, one of which is the caller's own.
    static IN_HANDLER: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread, for good, as one that runs handlers: the process's event loop
/// of `async` handlers (`embarcadero.workflow`), whose coroutines run there while their
/// attempt threads wait, so that a `stop` from one of them begins the drain and returns
/// instead of waiting for its own attempt until the step's deadline.
#[pyfunction]
pub fn mark_handler_thread() {
    IN_HANDLER.with(|h| h.set(true));
}

/// Marks the current thread as running a handler until dropped.
struct InHandler;

impl InHandler {
    fn enter() -> Self {
        IN_HANDLER.with(|h| h.set(true));
        InHandler
    }
}

impl Drop for InHandler {
    fn drop(&mut self) {
        IN_HANDLER.with(|h| h.set(false));
    }
}

/// What a Python handler is given: the same as a Rust handler's `StepContext`.
#[pyclass(module = "embarcadero._native", frozen)]
pub struct StepContext {
    /// The task's id.
    #[pyo3(get)]
    task_uuid: String,
    /// This step's name (a batch worker instance's: ``process_001``...).
    #[pyo3(get)]
    step_name: String,
    /// 1 for the first attempt.
    #[pyo3(get)]
    attempt: u32,
    /// The task's input.
    #[pyo3(get)]
    context: PyObject,
    /// The step's ``handler.initialization`` (``None`` when absent).
    #[pyo3(get)]
    initialization: PyObject,
    /// The results of every ancestor step (direct and indirect), by step name.
    #[pyo3(get)]
    ancestors: PyObject,
    /// The step's direct dependencies that exist, in the template's order.
    #[pyo3(get)]
    dependencies: Vec<String>,
    /// The results of the direct dependencies, by step name, in that order.
    #[pyo3(get)]
    dependency_results: PyObject,
    /// For an instance of a batch worker step, its cursor and checkpoint; else ``None``.
    #[pyo3(get)]
    batch: Option<Py<BatchInput>>,
    /// When the worker reports this attempt timed out, on the clock of
    /// :func:`time.monotonic` (the step's ``timeout_seconds`` from when the attempt
    /// started); its outcome is dropped from then on. See :meth:`time_left`.
    #[pyo3(get)]
    deadline: f64,
    /// Set by the worker when the attempt is called off before its deadline.
    cancellation: handler::Cancellation,
}

#[pymethods]
impl StepContext {
    /// Seconds until :attr:`deadline`, 0.0 once it has passed: a handler that may run long
    /// checks it (or passes it on as a timeout) and returns, for a timed-out attempt's
    /// outcome is dropped and its thread cannot be stopped from outside.
    fn time_left(&self, py: Python<'_>) -> PyResult<f64> {
        Ok((self.deadline - monotonic(py)?).max(0.0))
    }

    /// Whether the attempt was called off before its deadline: its task was cancelled or
    /// resolved by hand, or the attempt was taken back. Its outcome is no longer wanted
    /// (nothing publishes it), so a handler that may run long checks it too and returns.
    /// An ``async`` handler is cancelled by the worker then.
    #[getter]
    fn cancelled(&self) -> bool {
        self.cancellation.is_cancelled()
    }

    /// Whether the handler should stop: past its deadline, or :attr:`cancelled`.
    fn should_stop(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.cancelled() || self.time_left(py)? <= 0.0)
    }
}

/// Python's `time.monotonic()`.
fn monotonic(py: Python<'_>) -> PyResult<f64> {
    py.import("time")?.call_method0("monotonic")?.extract()
}

/// What an instance of a batch worker step is given.
#[pyclass(module = "embarcadero._native", frozen)]
pub struct BatchInput {
    /// The cursor the batchable step gave this instance.
    #[pyo3(get)]
    cursor: PyObject,
    /// 1-based, of ``count``.
    #[pyo3(get)]
    index: u32,
    #[pyo3(get)]
    count: u32,
    /// The last checkpoint an earlier attempt saved (``cursor``, ``items_done``,
    /// ``partial``), or ``None``.
    #[pyo3(get)]
    resume: PyObject,
    sink: CheckpointSink,
}

#[pymethods]
impl BatchInput {
    /// Saves a checkpoint for the next attempt of this instance to resume from (an event in
    /// the log, applied only while this attempt holds the step).
    #[pyo3(signature = (cursor, items_done, partial = None))]
    fn checkpoint(
        &self,
        py: Python<'_>,
        cursor: &Bound<'_, PyAny>,
        items_done: u64,
        partial: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let checkpoint = Checkpoint {
            cursor: to_json(py, cursor)?,
            items_done,
            partial: partial
                .map(|p| to_json(py, p))
                .transpose()?
                .unwrap_or(Value::Null),
        };
        let sink = self.sink.clone();
        crate::gil::released(py, || sink.save(checkpoint));
        Ok(())
    }
}

impl StepContext {
    fn build(py: Python<'_>, ctx: &handler::StepContext) -> PyResult<Self> {
        let dependency_results = PyDict::new(py);
        for name in &ctx.dependencies {
            let result = ctx.ancestors.get(name).unwrap_or(&Value::Null);
            dependency_results.set_item(name, to_python(py, result)?)?;
        }
        let batch = match &ctx.batch {
            None => None,
            Some(b) => Some(Py::new(
                py,
                BatchInput {
                    cursor: to_python(py, &b.cursor)?,
                    index: b.index,
                    count: b.count,
                    resume: to_python(py, &b.resume)?,
                    sink: b.checkpoints.clone(),
                },
            )?),
        };
        Ok(Self {
            task_uuid: ctx.task_uuid.clone(),
            step_name: ctx.step_name.clone(),
            attempt: ctx.attempt,
            context: to_python(py, &ctx.context)?,
            initialization: to_python(py, &ctx.initialization)?,
            ancestors: to_python(py, &ctx.ancestors)?,
            dependencies: ctx.dependencies.clone(),
            dependency_results: dependency_results.into_any().unbind(),
            batch,
            deadline: monotonic(py)? + ctx.time_left().as_secs_f64(),
            cancellation: ctx.cancellation.clone(),
        })
    }
}

/// A Python value as JSON, through `json.dumps` (so what a handler may return is exactly
/// what the standard library can encode), without `NaN` and the infinities: `json.dumps`
/// writes them by default, JSON has no such numbers, and the parse here then failed with
/// "expected value at line 1 column 1", naming neither the value nor the cause.
pub(crate) fn to_json(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<Value> {
    let strict = pyo3::types::PyDict::new(py);
    strict.set_item("allow_nan", false)?;
    let text: String = py
        .import("json")?
        .call_method("dumps", (value,), Some(&strict))?
        .extract()?;
    if let Some(wide) = embarcadero_workflow::wide_ints::first_wide_integer(text.as_bytes()) {
        let message = embarcadero_workflow::wide_ints::wide_integer_message("it", wide);
        return Err(pyo3::exceptions::PyValueError::new_err(message));
    }
    serde_json::from_str(&text).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

/// A Python function as a step handler.
struct PyHandler(PyObject);

impl StepHandler for PyHandler {
    fn call(&self, ctx: &handler::StepContext) -> Result<Value, StepError> {
        // The worker calls this on a thread of its own: the GIL is taken here, for the
        // call only, and the worker's loop (claims, heartbeats) never waits for it.
        let _in_handler = InHandler::enter();
        crate::gil::attached(|py| {
            let ctx = StepContext::build(py, ctx)
                .map_err(|e| StepError::retryable(format!("cannot pass the context: {e}")))?;
            let value = self.0.call1(py, (ctx,)).map_err(|e| step_error(py, e))?;
            // A result that is not JSON is a bug in the handler: retrying cannot fix it.
            to_json(py, value.bind(py))
                .map_err(|e| StepError::permanent(format!("the handler's result is not JSON: {e}")))
        })
    }
}

static STEP_ERROR: GILOnceCell<PyObject> = GILOnceCell::new();

/// A raised exception as a step failure: `embarcadero.workflow.StepError` says whether to
/// retry and after how long; any other exception is a retryable failure whose message is
/// ``Type: text``.
fn step_error(py: Python<'_>, e: PyErr) -> StepError {
    let value = e.value(py);
    let class = STEP_ERROR.get_or_try_init(py, || {
        PyResult::Ok(
            py.import("embarcadero.workflow")?
                .getattr("StepError")?
                .unbind(),
        )
    });
    if let Ok(class) = class {
        if value.is_instance(class.bind(py)).unwrap_or(false) {
            let attr = |name: &str| value.getattr(name).ok();
            return StepError {
                message: value.to_string(),
                retryable: attr("retryable")
                    .and_then(|r| r.is_truthy().ok())
                    .unwrap_or(true),
                retry_after_ms: attr("retry_after_ms").and_then(|r| r.extract().ok()),
            };
        }
    }
    let kind = value.get_type().name().map(|n| n.to_string());
    StepError::retryable(format!(
        "{}: {value}",
        kind.as_deref().unwrap_or("Exception")
    ))
}

/// The engine's worker loop running Python handlers, supervised: a worker whose log is
/// lost (a server restart) is replaced by a new one with the same handlers
/// (`SupervisedWorker`). `embarcadero.workflow.Worker` wraps it.
#[pyclass(module = "embarcadero._native", frozen)]
pub struct NativeWorker {
    /// `None` once stopped. Taken only inside `allow_threads`.
    inner: Mutex<Option<SupervisedWorker>>,
    /// The current id, and the drain begun without `inner`'s lock, which a `stop` from
    /// another thread holds while it waits for the handlers: a handler calling `stop`
    /// must not wait for it.
    handle: SupervisorHandle,
}

#[pymethods]
impl NativeWorker {
    #[new]
    #[pyo3(signature = (
        handlers, control = None, *, namespaces = Vec::new(), concurrency = 32,
        lease_ms = 3000, topic = "workflow.events", ack = 2, rf = 2, retry_for_ms = None,
        report = None,
    ))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one per option
    fn new(
        py: Python<'_>,
        handlers: &Bound<'_, PyDict>,
        control: Option<&str>,
        namespaces: Vec<String>,
        concurrency: i128,
        lease_ms: i128,
        topic: &str,
        ack: i128,
        rf: i128,
        retry_for_ms: Option<i128>,
        report: Option<PyObject>,
    ) -> PyResult<Self> {
        let cfg = worker_config(
            &crate::control_or_default(control),
            namespaces,
            whole("concurrency", concurrency)?,
            whole("lease_ms", lease_ms)?,
            topic,
            whole("ack", ack)?,
            whole("rf", rf)?,
        )?;
        let retry_for_ms = retry_for_ms
            .map(|ms| whole::<u64>("retry_for_ms", ms))
            .transpose()?;
        let policy = RestartPolicy {
            retry_for: retry_for_ms.map(Duration::from_millis),
            ..RestartPolicy::default()
        };
        let mut registry = Registry::new();
        for (name, function) in handlers.iter() {
            registry.register(name.extract::<String>()?, PyHandler(function.unbind()));
        }
        let report = reporter(report);
        let worker = crate::gil::released(py, || {
            SupervisedWorker::start(cfg, registry, policy, report)
        })
        .map_err(to_py)?;
        Ok(Self {
            handle: worker.handle(),
            inner: Mutex::new(Some(worker)),
        })
    }

    /// The current worker's id, as its claims and results name it in the log; a new one
    /// after each restart.
    #[getter]
    fn id(&self) -> String {
        self.handle.id()
    }

    /// Waits until the supervised loop has ended for good (stopped, or failed with an
    /// error no new worker mends, or a lost log past `retry_for`) or `timeout` seconds have
    /// passed; returns whether it has ended. Ctrl-C interrupts it.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = match timeout {
            Some(t) => Some(Instant::now() + crate::options::seconds("timeout", t)?),
            None => None,
        };
        // The supervised worker has no blocking wait but `stop`; waiting in slices lets Python
        // deliver signals (Ctrl-C) within one slice.
        const SLICE: Duration = Duration::from_millis(50);
        loop {
            if self.is_finished(py) {
                return Ok(true);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(false);
            }
            let nap = left.map_or(SLICE, |l| l.min(SLICE));
            crate::gil::released(py, || std::thread::sleep(nap));
            py.check_signals()?;
        }
    }

    /// Whether the supervised loop has ended for good (not while a worker is replaced).
    fn is_finished(&self, py: Python<'_>) -> bool {
        crate::gil::released(py, || {
            self.inner.lock().as_ref().is_none_or(|w| w.is_finished())
        })
    }

    /// Starts no new worker and stops the current one claiming, then waits until every
    /// attempt it started has published its result and the log has acknowledged every
    /// event the worker published (`SupervisedWorker::stop_and_drain`, heartbeating
    /// meanwhile so that no attempt loses its lease): once it returns, the process may
    /// exit without losing a finished result. During a restart's backoff it returns at
    /// once. Raises the error that ended the loop for good if one did, else a failed
    /// flush's.
    /// Idempotent; a second call waits for the first. Called from inside a handler, it
    /// begins the drain and returns at once (waiting would mean waiting for itself): the
    /// loop ends once every attempt, the caller's among them, has published its result.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        if IN_HANDLER.with(Cell::get) {
            self.handle.begin_drain();
            return Ok(());
        }
        crate::gil::released(py, || {
            // Held while draining, so that a second `stop` (and `is_finished`, which
            // `wait` asks) returns only once the first has drained.
            let mut inner = self.inner.lock();
            let stopped = inner
                .as_mut()
                .map_or(Ok(()), SupervisedWorker::stop_and_drain);
            *inner = None;
            stopped
        })
        .map_err(to_py)
    }
}

/// The worker's configuration from `NativeWorker`'s arguments, checked.
fn worker_config(
    control: &str,
    namespaces: Vec<String>,
    concurrency: usize,
    lease_ms: u64,
    topic: &str,
    ack: u8,
    rf: u8,
) -> PyResult<WorkerConfig> {
    if concurrency == 0 || lease_ms == 0 {
        return Err(config("concurrency and lease_ms must be at least 1"));
    }
    // `embarcadero worker --ack/--rf`: 1 ordered, 2 durable (which needs rf 2).
    if !(1..=2).contains(&ack) || rf == 0 {
        return Err(config(format!(
            "ack must be 1 or 2 and rf at least 1, not ack {ack}, rf {rf}"
        )));
    }
    let mut log = LogConfig::new(control, topic);
    (log.ack, log.replication_factor) = (ack, rf);
    Ok(WorkerConfig {
        log,
        namespaces,
        concurrency,
        lease_ms,
        // The chaos test's record of handler runs; `embarcadero worker --run-log` has it.
        run_log: None,
    })
}

/// What the supervisor reports goes to `report(kind, worker, message)` (workflow.py's,
/// which logs it), called with the GIL from the supervisor's thread; without one, to
/// `tracing`. A raised exception is reported as unraisable: the worker goes on.
fn reporter(report: Option<PyObject>) -> Report {
    let Some(report) = report else {
        return Arc::new(embarcadero_workflow::supervisor::trace_event);
    };
    Arc::new(move |event: &WorkerEvent| {
        let worker = match event {
            WorkerEvent::Failed { worker, .. }
            | WorkerEvent::Restarted { worker, .. }
            | WorkerEvent::Draining { worker, .. } => Some(worker.to_string()),
            _ => None,
        };
        let message = event.to_string();
        crate::gil::attached(|py| {
            if let Err(e) = report.call1(py, (event.kind(), worker, message)) {
                e.write_unraisable(py, None);
            }
        });
    })
}
