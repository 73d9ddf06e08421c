//! `embarcadero orchestrator` (the engine, its API and its `/metrics` on a port of its
//! own, phase 1) and `embarcadero worker` (the built-in Rust handlers), both until
//! SIGINT/SIGTERM. Both wait for a server that is not there when they start, as they
//! ride out one that goes away while they run (`--retry-for` bounds both; the worker
//! through `embarcadero_workflow::SupervisedWorker`, the policy the SDK workers share).

use super::LogArgs;
use crate::CliResult;
use embarcadero_server::http_server::{HttpServer, Limits, Request, Response, StreamBody};
use embarcadero_workflow::orchestrator::Engine;
use embarcadero_workflow::supervisor::{
    log_lost, server_not_there, Backoff, Report, FIRST_BACKOFF, MAX_BACKOFF,
};
use embarcadero_workflow::{
    Api, Orchestrator, OrchestratorConfig, Registry, RestartPolicy, SupervisedWorker, WorkerConfig,
    WorkerEvent,
};
use std::net::TcpListener;
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct OrchestratorArgs {
    #[command(flatten)]
    log: LogArgs,
    /// Address the API listens on (port 0: an ephemeral one, named in the "serving" line).
    /// [default: 127.0.0.1:12150, or an ephemeral port when another orchestrator has it:
    /// a standby started the same way; the head forwards the API to whichever decides]
    #[arg(long)]
    listen: Option<String>,
    /// Accept templates naming any handler (default: only the built-in handlers that
    /// `embarcadero worker` runs).
    #[arg(long)]
    any_handler: bool,
    /// Backpressure: `POST /v1/tasks` answers 503 with Retry-After while this many
    /// tasks are open (not finished).
    #[arg(long, default_value_t = 10_000, value_parser = crate::at_least_one)]
    max_open_tasks: usize,
    /// Protocol of new tasks: 2, the fold enqueues ready steps and completes successes
    /// itself (two trips through the log fewer per step); 1, the orchestrator does, by
    /// events (as before protocol 2; kept for comparison and for old readers).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    task_protocol: u8,
    /// Directory for snapshots of the engine's state: a start loads the newest valid one
    /// and replays only the log after it. Without it, every start replays the whole log.
    #[arg(long)]
    data_dir: Option<std::path::PathBuf>,
    /// With --data-dir: snapshot once this many events were folded since the last one.
    #[arg(long, default_value_t = 100_000, value_parser = crate::at_least_one)]
    snapshot_every: usize,
    /// The orchestrator lease: several orchestrators may run on one log; the one holding
    /// the lease decides, the others follow the log and serve the API, and one of them
    /// takes over this long after the active one's last renewal (renewed every third).
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(30..))]
    failover_ms: u64,
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    log: LogArgs,
    /// Namespace to serve (repeat for several); none: every namespace.
    #[arg(long = "namespace")]
    namespaces: Vec<String>,
    /// Step attempts run at once.
    #[arg(long, default_value_t = embarcadero_workflow::worker::DEFAULT_CONCURRENCY, value_parser = crate::at_least_one)]
    concurrency: usize,
    /// Append a line `task step attempt worker` to this file before each handler run
    /// (for the chaos test, which compares the runs with the audit trail).
    #[arg(long, env = "EMBARCADERO_WORKFLOW_RUN_LOG")]
    run_log: Option<std::path::PathBuf>,
}

// The control port caps the long polls it forwards at the API's own limit.
const _: () = assert!(
    embarcadero_server::workflow_proxy::MAX_WAIT_S == embarcadero_workflow::api::MAX_WAIT_S
);

/// Where the API listens by default.
const DEFAULT_LISTEN: &str = "127.0.0.1:12150";

/// The API's listener: on `--listen`; else on the default port, or, when another process
/// (most often the active orchestrator, this one being its standby) has it, on an
/// ephemeral port of the same host, said in the log.
fn listen(given: Option<&str>) -> Result<TcpListener, String> {
    let addr = given.unwrap_or(DEFAULT_LISTEN);
    match TcpListener::bind(addr) {
        Ok(listener) => Ok(listener),
        Err(e) if given.is_none() && e.kind() == std::io::ErrorKind::AddrInUse => {
            let listener = TcpListener::bind("127.0.0.1:0")
                .map_err(|e| format!("cannot listen on 127.0.0.1:0: {e}"))?;
            tracing::info!(
                taken = DEFAULT_LISTEN,
                "the default API port is taken (another orchestrator: this one is its standby), so the API listens on an ephemeral port; `--listen` names one"
            );
            Ok(listener)
        }
        Err(e) => Err(format!(
            "cannot listen on {addr}: {e} (`--listen HOST:PORT` names another; port 0 an ephemeral one)"
        )),
    }
}

/// How long a kept-alive API connection waits for its next request.
const KEEP_ALIVE: Duration = Duration::from_secs(30);

pub fn orchestrator(args: OrchestratorArgs) -> CliResult {
    crate::init_logging();
    let stop = crate::stop_signal()?;
    let listener = listen(args.listen.as_deref())?;
    let config = OrchestratorConfig {
        log: args.log.log_config()?,
        lease_ms: args.log.lease_ms,
        max_open_tasks: args.max_open_tasks,
        task_protocol: args.task_protocol,
        snapshots: args
            .data_dir
            .map(|dir| embarcadero_workflow::snapshot::SnapshotConfig {
                dir,
                every_events: args.snapshot_every as u64,
            }),
        failover_ms: args.failover_ms,
        retry_for: args.log.retry_for(),
    };
    let started = start_when_served("orchestrator", &args.log, &stop, || {
        Orchestrator::start(config.clone())
    })?;
    let Some(mut orchestrator) = started else {
        return Ok(());
    };
    let known = (!args.any_handler).then(|| Registry::builtin().names());
    let api = Arc::new(Api::new(orchestrator.engine.clone(), known));
    let limits = Limits {
        // Long polls hold their connection up to the longest wait.
        request_deadline: Duration::from_secs(10),
        max_connections: 1024,
        // A client creating and awaiting tasks in a loop keeps one connection (and the
        // thread serving it) instead of opening two per task.
        keep_alive: Some(KEEP_ALIVE),
    };
    let handler = api_handler(api, orchestrator.engine.clone());
    if !wait_for_replay(&orchestrator, &stop)? {
        orchestrator.stop();
        return Ok(());
    }
    let mut http = HttpServer::start(
        listener,
        "workflow-api",
        limits,
        Arc::new(AtomicUsize::new(0)),
        handler,
    )
    .map_err(|e| format!("cannot serve the API: {e}"))?;
    let announcer = super::announce::Announcer::start(
        &args.log.control.control,
        http.local_addr().to_string(),
        orchestrator.folds.clone(),
    )
    .map_err(|e| format!("cannot start the announcer thread: {e}"))?;
    crate::note!(
        "workflow orchestrator is serving: API http://{}",
        http.local_addr()
    );
    let ended = wait_for_stop(&stop, || orchestrator.engine.failure.lock().clone());
    if ended.is_ok() {
        crate::note!("workflow orchestrator: stop signal received; stopping");
    }
    // No new requests; then the engine, which hands its lease over (the announcer's
    // last call could hold that up by a second).
    http.stop();
    orchestrator.stop();
    drop(announcer);
    ended
}

/// The API's request handler: the engine's metrics, or the API's answer (JSON, or a
/// stream of server-sent events).
fn api_handler(
    api: Arc<Api>,
    engine: Arc<Engine>,
) -> impl Fn(&Request) -> Response + Send + Sync + 'static {
    move |r: &Request| {
        // `/v1/workflow/metrics` too: the control port forwards that path (its own
        // `/metrics` is the head's), so `task stats` works with either address.
        if r.method == "GET" && matches!(r.path(), "/metrics" | "/v1/workflow/metrics") {
            return Response::new(200, "text/plain; version=0.0.4", engine.metrics());
        }
        let reply = api
            .handle(&r.method, &r.url, &r.body)
            .resuming(r.last_event_id.as_deref());
        let mut response = match reply.events {
            None => Response::new(reply.status, "application/json", reply.body.to_string()),
            Some(events) => {
                let mut r = Response::new(reply.status, "text/event-stream", String::new());
                r.stream = Some(StreamBody(Arc::new(move |out| events.write_to(out))));
                r.headers
                    .push(("Cache-Control".into(), "no-cache".to_string()));
                r
            }
        };
        let headers = reply.headers.into_iter().map(|(n, v)| (n.into(), v));
        response.headers.extend(headers);
        response
    }
}

pub fn worker(args: WorkerArgs) -> CliResult {
    crate::init_logging();
    let stop = crate::stop_signal()?;
    let config = WorkerConfig {
        log: args.log.log_config()?,
        namespaces: args.namespaces,
        concurrency: args.concurrency,
        lease_ms: args.log.lease_ms,
        run_log: args.run_log,
    };
    let registry = Registry::builtin();
    let handlers: Vec<String> = registry.names().into_iter().collect();
    let handlers = handlers.join(" ");
    let names = handlers.clone();
    let policy = RestartPolicy {
        retry_for: args.log.retry_for(),
        ..RestartPolicy::default()
    };
    let report: Report = Arc::new(move |event: &WorkerEvent| report_worker(event, &names));
    let started = start_when_served("worker", &args.log, &stop, || {
        SupervisedWorker::start(config.clone(), registry.clone(), policy, report.clone())
    })?;
    let Some(mut worker) = started else {
        return Ok(());
    };
    crate::note!(
        "workflow worker {} is running: handlers {handlers}",
        worker.id()
    );
    let ended = wait_for_stop(&stop, || {
        worker
            .is_finished()
            .then(|| "the worker's supervision ended".to_string())
    });
    if ended.is_ok() {
        return drain(worker, &stop);
    }
    match worker.stop() {
        // Only a lost log that outlasted --retry-for ends it with an error it waits out.
        Err(e) if log_lost(&e) => Err(format!("no new worker within --retry-for: {e}")),
        Err(e) => Err(format!("the worker failed: {e}")),
        Ok(()) => Ok(()),
    }
}

/// Prints what the supervised worker reports, as `embarcadero worker` always has
/// (`handlers`: the names its workers run).
fn report_worker(event: &WorkerEvent, handlers: &str) {
    match event {
        WorkerEvent::Failed {
            worker,
            error,
            retry_in,
        } => crate::note!(
            "workflow worker {worker} failed (the worker loop ended: {error}); its attempts go back after their lease; a new worker starts in {} ms",
            retry_in.as_millis()
        ),
        WorkerEvent::StartFailed { error, retry_in } => crate::note!(
            "cannot start a new worker yet ({error}); trying again in {} ms",
            retry_in.as_millis()
        ),
        WorkerEvent::Restarted { worker, .. } => {
            crate::note!("workflow worker {worker} is running: handlers {handlers}")
        }
        // The process's exit says it, with the error.
        WorkerEvent::GaveUp { .. } => {}
        WorkerEvent::Draining { worker, running } => crate::note!(
            "workflow worker {worker} is draining: it claims nothing more and waits for its \
             {running} running attempt(s) to publish their results (a second signal exits at once)"
        ),
    }
}

/// Runs `start` until it succeeds while its error says the server is not there (yet): a
/// process started before its server, or while it restarts, waits for it as a running
/// one does when it loses it. `None` if a stop signal came first; an error if `start`
/// failed otherwise, or the server stayed away past `--retry-for`.
fn start_when_served<T>(
    what: &str,
    log: &LogArgs,
    stop: &std::sync::mpsc::Receiver<()>,
    mut start: impl FnMut() -> Result<T, embarcadero_client::Error>,
) -> Result<Option<T>, String> {
    let since = Instant::now();
    let mut pause = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
    loop {
        let e = match start() {
            Ok(started) => return Ok(Some(started)),
            Err(e) if server_not_there(&e) => e,
            Err(e) => return Err(format!("cannot start the {what}: {e}")),
        };
        if log
            .retry_for()
            .is_some_and(|limit| since.elapsed() >= limit)
        {
            return Err(format!(
                "cannot start the {what} (no server within --retry-for): {e}"
            ));
        }
        crate::note!(
            "waiting for the server at {} ({e}); the {what} starts once it answers; next try in {} ms",
            log.control.control,
            pause.peek().as_millis()
        );
        if stopped_within(stop, pause.take()) {
            return Ok(None);
        }
    }
}

/// Stops `worker` on a signal as the SDK workers stop: no new worker starts, and the
/// current one claims nothing more and heartbeats until every attempt it holds has
/// published its result (`SupervisedWorker::stop_and_drain`; the supervisor says it is
/// draining), so that no finished result is lost to a lease expiry. A second signal
/// exits at once (the attempts still running then go back after their lease): a
/// handler may run for as long as its step's timeout.
fn drain(mut worker: SupervisedWorker, stop: &std::sync::mpsc::Receiver<()>) -> CliResult {
    let (id, handle) = (worker.id(), worker.handle());
    let (tx, drained) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("drain".into())
        .spawn(move || {
            let _ = tx.send(worker.stop_and_drain());
        })
        .map_err(|e| format!("cannot start draining: {e}"))?;
    loop {
        match drained.recv_timeout(Duration::from_millis(100)) {
            Ok(Ok(())) => {
                match handle.drained() {
                    Some(id) => {
                        crate::note!("workflow worker {id} drained: every result is in the log")
                    }
                    None => crate::note!(
                        "workflow worker stopped while it waited to replace {id}, which had lost \
                         the log: no worker ran to drain (the lost one's attempts go back to other \
                         workers after their lease)"
                    ),
                }
                return Ok(());
            }
            Ok(Err(e)) => return Err(format!("the worker failed while draining: {e}")),
            Err(RecvTimeoutError::Disconnected) => return Err("the drain panicked".into()),
            Err(RecvTimeoutError::Timeout) if stop.try_recv().is_ok() => {
                return Err(format!(
                    "workflow worker {id} stopped by a second signal while draining; the \
                     attempts still running go back after their lease"
                ))
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

/// Waits `wait`; whether a stop signal came meanwhile.
fn stopped_within(stop: &std::sync::mpsc::Receiver<()>, wait: Duration) -> bool {
    !matches!(stop.recv_timeout(wait), Err(RecvTimeoutError::Timeout))
}

/// Waits until the engine has replayed the log, so that the API answers from the
/// whole state once the "serving" line is out: true then, false if a stop signal came
/// first (a replay can be long, and SIGTERM must end it).
fn wait_for_replay(o: &Orchestrator, stop: &std::sync::mpsc::Receiver<()>) -> Result<bool, String> {
    while !o.engine.caught_up.load(std::sync::atomic::Ordering::SeqCst) {
        if let Some(why) = o.engine.failure.lock().clone() {
            return Err(format!("the orchestrator stopped while replaying: {why}"));
        }
        if stopped_within(stop, Duration::from_millis(10)) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Waits for a signal (Ok) or for `failed` to say why the process must end (Err).
fn wait_for_stop(
    stop: &std::sync::mpsc::Receiver<()>,
    failed: impl Fn() -> Option<String>,
) -> CliResult {
    loop {
        match stop.recv_timeout(Duration::from_millis(100)) {
            Err(RecvTimeoutError::Timeout) => {
                if let Some(why) = failed() {
                    return Err(why);
                }
            }
            _ => return Ok(()),
        }
    }
}
