//! `embarcadero orchestrator` (the engine, its API and its `/metrics` on a port of its
//! own, phase 1) and `embarcadero worker` (the built-in Rust handlers), both until
//! SIGINT/SIGTERM. Both wait for a server that is not there when they start, as they
//! ride out one that goes away while they run (`--retry-for` bounds both).

use super::LogArgs;
use crate::CliResult;
use embarcadero_server::http_server::{HttpServer, Limits, Request, Response, StreamBody};
use embarcadero_workflow::orchestrator::Engine;
use embarcadero_workflow::{Api, Orchestrator, OrchestratorConfig, Registry, Worker, WorkerConfig};
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
    #[arg(long, default_value = "127.0.0.1:12150")]
    listen: String,
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

/// How long a kept-alive API connection waits for its next request.
const KEEP_ALIVE: Duration = Duration::from_secs(30);

pub fn orchestrator(args: OrchestratorArgs) -> CliResult {
    crate::init_logging();
    let stop = crate::stop_signal()?;
    let listener = TcpListener::bind(&args.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let config = OrchestratorConfig {
        log: args.log.log_config(),
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
    let announcer =
        super::announce::Announcer::start(&args.log.control.control, http.local_addr().to_string())
            .map_err(|e| format!("cannot start the announcer thread: {e}"))?;
    eprintln!(
        "workflow orchestrator is serving: API http://{}",
        http.local_addr()
    );
    let ended = wait_for_stop(&stop, || orchestrator.engine.failure.lock().clone());
    if ended.is_ok() {
        eprintln!("workflow orchestrator: stop signal received; stopping");
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
        log: args.log.log_config(),
        namespaces: args.namespaces,
        concurrency: args.concurrency,
        lease_ms: args.log.lease_ms,
        run_log: args.run_log,
    };
    let mut backoff = RESTART_FIRST;
    let started = start_when_served("worker", &args.log, &stop, || start_worker(&config))?;
    let Some(mut worker) = started else {
        return Ok(());
    };
    loop {
        let started = Instant::now();
        let ended = wait_for_stop(&stop, || {
            worker
                .is_finished()
                .then(|| "the worker loop ended".to_string())
        });
        let why = match ended {
            Ok(()) => return drain(worker, &stop),
            Err(ended) => match worker.stop() {
                Err(why) => format!("{ended}: {why}"),
                Ok(()) => ended,
            },
        };
        if started.elapsed() > RESTART_CAP * 2 {
            backoff = RESTART_FIRST;
        }
        // A log that refused or lost the worker (a fenced session, a server restart):
        // the attempts it held go back after their lease, and a new worker, with a new
        // session, carries on once the log answers again.
        eprintln!(
            "workflow worker {} failed ({why}); its attempts go back after their lease; a new worker starts in {} ms",
            worker.id,
            backoff.as_millis()
        );
        let lost = Instant::now();
        worker = loop {
            if stopped_within(&stop, backoff) {
                return Ok(());
            }
            backoff = (backoff * 2).min(RESTART_CAP);
            match start_worker(&config) {
                Ok(w) => break w,
                Err(e) if args.log.retry_for().is_some_and(|l| lost.elapsed() >= l) => {
                    return Err(format!("no new worker within --retry-for: {e}"))
                }
                Err(e) => eprintln!(
                    "cannot start a new worker yet ({e}); trying again in {} ms",
                    backoff.as_millis()
                ),
            }
        };
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
    let mut pause = RESTART_FIRST;
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
        eprintln!(
            "waiting for the server at {} ({e}); the {what} starts once it answers; next try in {} ms",
            log.control.control,
            pause.as_millis()
        );
        if stopped_within(stop, pause) {
            return Ok(None);
        }
        pause = (pause * 2).min(RESTART_CAP);
    }
}

/// Errors that mean the server is not there, or not ready yet (its control port up
/// before its brokers): worth waiting for, unlike a refusal such as a topic of the
/// wrong order.
fn server_not_there(e: &embarcadero_client::Error) -> bool {
    crate::server_gone(e)
        || matches!(
            e,
            embarcadero_client::Error::Admin {
                status: 502..=504,
                ..
            }
        )
}

/// Stops `worker` on a signal as the SDK workers stop: it claims nothing more and
/// heartbeats until every attempt it holds has published its result
/// (`Worker::stop_and_drain`), so that no finished result is lost to a lease expiry. A
/// second signal exits at once (the attempts still running then go back after their
/// lease): a handler may run for as long as its step's timeout.
fn drain(mut worker: Worker, stop: &std::sync::mpsc::Receiver<()>) -> CliResult {
    let id = worker.id.clone();
    eprintln!(
        "workflow worker {id} is draining: it claims nothing more and waits for its {} running \
         attempt(s) to publish their results (a second signal exits at once)",
        worker.running()
    );
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
                eprintln!("workflow worker {id} drained: every result is in the log");
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

/// The first wait before a failed worker is replaced, doubled after each failure up to
/// `RESTART_CAP`, and back to the first once a worker ran for twice the cap.
const RESTART_FIRST: Duration = Duration::from_millis(250);
const RESTART_CAP: Duration = Duration::from_secs(10);

/// Starts a worker with the built-in handlers and says so.
fn start_worker(config: &WorkerConfig) -> Result<Worker, embarcadero_client::Error> {
    let registry = Registry::builtin();
    let handlers: Vec<String> = registry.names().into_iter().collect();
    let worker = Worker::start(config.clone(), registry)?;
    eprintln!(
        "workflow worker {} is running: handlers {}",
        worker.id,
        handlers.join(" ")
    );
    Ok(worker)
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
