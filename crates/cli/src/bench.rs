//! `embarcadero bench`: publish-only, publish+subscribe and subscribe-only runs against
//! an embedded server (or a running one), and broker-failure runs against a cluster of
//! processes (`failure`), with the machine's ceilings measured in the same run. Lists of
//! orders and rates run a sweep, one fresh server per run, summarised in a table and
//! drawn by `plot`.

mod canvas;
pub(crate) mod failure;
mod font;
mod plot;
mod workflow;

use crate::publish::report;
use crate::CliResult;
use embarcadero_bench::ceilings::{measure_all, CeilingPlan};
use embarcadero_cli::local_cluster::shm_or;
use embarcadero_client::{
    Admin, LatencySummary, Publisher, PublisherConfig, PublisherStats, Subscriber,
    SubscriberConfig, TopicSpec, Transport,
};
use embarcadero_server::{cpu, Server, ServerConfig};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// `publish`: publish-only; `e2e`: publish while one subscriber reads in order;
    /// `subscribe`: fill the topic, then time one subscriber reading it all from the
    /// start; `failure`: broker failure: start a cluster of processes (a head and
    /// follower brokers run from this executable), SIGKILL one follower partway
    /// (--kill-after-secs), report throughput before and after, how long
    /// acknowledgements stalled, and check with a subscriber that every acknowledged
    /// message is delivered exactly once in one order (exit status 1 if not);
    /// `workflow`: start a server, an orchestrator and a worker (processes of this
    /// executable, events durable: RF 2, ack 2), time --workflow-tasks tasks of each of
    /// Tasker's shapes one at a time (POST to complete, long poll), then --clients
    /// closed-loop clients of linear tasks for --duration seconds (default 10) or
    /// --workflow-sustained-tasks tasks; one table (or --json), every process stopped.
    #[arg(long, default_value = "publish", value_parser = ["publish", "e2e", "subscribe", "failure", "workflow"])]
    pub mode: String,
    /// Publishers running in parallel (each its own client, connections and
    /// batches); the total and the rate are split between them.
    #[arg(long, default_value_t = 1)]
    pub publishers: usize,
    /// Order level of the benchmark topic (`failure`: 2 or 5). A comma-separated list
    /// runs a sweep, one run per order, transport and rate, each on a fresh server:
    /// `--order 0,2,5`.
    #[arg(long, value_delimiter = ',', default_value = "2")]
    pub order: Vec<u8>,
    /// Acknowledgement level: 0 fire and forget, 1 ordered (written, order 0), 2 durable
    /// (needs --rf 2 or more).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub ack: u8,
    /// Replication factor of the benchmark topic (2 or more: disk replicas).
    #[arg(long, default_value_t = 1)]
    pub rf: u8,
    /// Directory of a disk replica of the embedded server (repeat for each replica).
    /// Default: two replicas under a scratch directory on the temporary disk.
    #[arg(long)]
    pub replica_dir: Vec<PathBuf>,
    /// Message payload size in bytes.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// How the publishers and subscribers reach the brokers: `auto` (shared memory to a
    /// broker on this host, else TCP), `tcp` or `shm`. A comma-separated list runs each
    /// in turn: `--transport tcp,shm`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "auto",
        value_name = "auto|tcp|shm"
    )]
    pub transport: Vec<Transport>,
    /// Total payload bytes to publish.
    #[arg(long, default_value_t = 1 << 30)]
    pub total_bytes: u64,
    /// Publish for this many seconds instead of a fixed --total-bytes (the two exclude
    /// each other).
    #[arg(long, value_name = "SECS", conflicts_with = "total_bytes")]
    pub duration: Option<f64>,
    /// Brokers of the embedded server (`failure`: of the cluster, at least 2).
    #[arg(long, default_value_t = 4)]
    pub brokers: u32,
    /// Connections (and publishing queues) per broker, per publisher.
    #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
    pub threads_per_broker: usize,
    /// Seal a batch once it holds this many bytes.
    #[arg(long, default_value_t = 512 * 1024, value_parser = crate::at_least_one)]
    pub batch_bytes: usize,
    /// Seal a non-empty batch at the latest this many microseconds after its first
    /// message; 0: as soon as its connection's sender is free (lowest latency).
    #[arg(long, default_value_t = 1000)]
    pub linger_us: u64,
    /// Sequencer epoch of the embedded server, microseconds.
    #[arg(long, default_value_t = 500)]
    pub epoch_us: u64,
    /// Bytes of each subscriber's shared-memory feed ring in the embedded server
    /// (`broker.shm_feed_bytes` of `serve`; a power of two, 64 KiB to 1 GiB)
    /// [default: 8 MiB].
    #[arg(long)]
    pub shm_feed_bytes: Option<u64>,
    /// Bytes of each publishing connection's shared-memory data ring (the publisher's
    /// `shm_ring_bytes`; a power of two, 64 KiB to 1 GiB) [default: 8 MiB].
    #[arg(long)]
    pub shm_ring_bytes: Option<usize>,
    /// Directory for the embedded server's region file; tmpfs keeps the kernel from
    /// writing the region back to disk. Default: /dev/shm when it exists.
    #[arg(long)]
    pub region_dir: Option<PathBuf>,
    /// Wait for the round-robin queue instead of deflecting to the next when it is full.
    #[arg(long)]
    pub no_deflect: bool,
    /// Leave the embedded server's region sparse (`region.prefault = false`, the server's
    /// default) instead of allocating it all at start: every first touch of a page then
    /// faults on the data path.
    #[arg(long)]
    pub no_prefault: bool,
    /// Publish at this fixed rate (MB/s of payload) instead of as fast as possible, on a
    /// schedule fixed in advance (a late message is not excused by the lateness of the
    /// ones before it), to measure latency below saturation. A comma-separated list
    /// runs a sweep (`max`: as fast as possible): `--rate 100,200,400,800`. The
    /// schedule starts once every publisher has connected; append-to-ack latency runs
    /// from each message's due time.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate, value_name = "MB/s")]
    pub rate: Vec<Rate>,
    /// With --rate (modes publish and e2e): first publish this many messages on a
    /// schedule of their own at the same rate, wait for their acknowledgements, and leave
    /// them out of every figure (counts, throughput, latency); the measured schedule
    /// starts after them. The e2e subscriber reads them too but times only later messages.
    #[arg(long, default_value_t = 0, requires = "rate")]
    pub warmup_messages: u64,
    /// `e2e` mode, orders 2 and 5: stamp every message with an id and check that the
    /// subscriber receives each acknowledged message exactly once, at consecutive
    /// positions from 0 (order 5: each publisher's in publish order); exit status 1 if
    /// not. For long runs (`scripts/soak.sh`).
    #[arg(long)]
    pub verify: bool,
    /// `failure` mode: SIGKILL the follower this many seconds after publishing starts
    /// [default: a third of --duration, or once a third of --total-bytes is published].
    #[arg(long, value_name = "SECS")]
    pub kill_after_secs: Option<f64>,
    /// `workflow` mode: tasks of each shape, run one at a time.
    #[arg(long, default_value_t = 200, value_parser = crate::at_least_one)]
    pub workflow_tasks: usize,
    /// `workflow` mode: closed-loop clients of the sustained run.
    #[arg(long, default_value_t = 16, value_parser = crate::at_least_one)]
    pub clients: usize,
    /// `workflow` mode: end the sustained run after this many tasks instead of after
    /// --duration seconds.
    #[arg(long, conflicts_with = "duration", value_parser = crate::at_least_one)]
    pub workflow_sustained_tasks: Option<usize>,
    /// Use a running server instead of starting an embedded one.
    #[arg(long)]
    pub control: Option<String>,
    /// Skip the machine's ceilings, which every run measures right after itself
    /// (about 4 s): loopback TCP throughput and round trips, memcpy, fdatasync.
    #[arg(long)]
    pub no_ceilings: bool,
    /// Measure the ceilings: the default, accepted for older scripts.
    #[arg(long, hide = true)]
    pub ceilings: bool,
    /// Print every figure as JSON on stdout (an array when there are several runs).
    #[arg(long)]
    pub json: bool,
    /// Write a PNG with two panels: (a) MB/s of every run, (b) append-to-ack p50 and
    /// p99 against the offered load of the --rate runs, one line per order.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Plot saved `bench --json` outputs instead of running anything (with --plot).
    #[arg(long, value_name = "FILE.json", num_args = 1.., requires = "plot")]
    pub from_json: Vec<PathBuf>,
}

/// An offered load: MB/s, or `None` for as fast as possible.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate(pub Option<f64>);

fn parse_rate(text: &str) -> Result<Rate, String> {
    if text == "max" {
        return Ok(Rate(None));
    }
    match text.parse::<f64>() {
        Ok(mb_s) if mb_s.is_finite() && mb_s > 0.0 => Ok(Rate(Some(mb_s))),
        _ => Err(format!(
            "{text:?} is not a rate: MB/s above 0, or `max` for as fast as possible"
        )),
    }
}

/// What a sweep varies from one run to the next.
#[derive(Debug, Clone, Copy)]
pub struct RunConfig {
    pub order: u8,
    /// How the run's publishers reach the brokers.
    pub transport: Transport,
    /// MB/s of payload on a fixed schedule; `None`: as fast as possible.
    pub rate: Option<f64>,
}

/// Every combination of the listed orders, transports and rates, orders outermost.
fn configurations(args: &BenchArgs) -> Vec<RunConfig> {
    let rates = if args.rate.is_empty() {
        vec![Rate(None)]
    } else {
        args.rate.clone()
    };
    let mut runs = Vec::new();
    for &order in &args.order {
        for &transport in &args.transport {
            for rate in &rates {
                runs.push(RunConfig {
                    order,
                    transport,
                    rate: rate.0,
                });
            }
        }
    }
    runs
}

/// Refuses combinations that cannot run, before anything starts.
fn check_args(args: &BenchArgs) -> CliResult {
    if args.duration.is_some_and(|d| !(d.is_finite() && d > 0.0)) {
        return Err("--duration takes a number of seconds above 0".into());
    }
    if args.warmup_messages > 0 && args.mode != "publish" && args.mode != "e2e" {
        return Err("--warmup-messages is for --mode publish and --mode e2e".into());
    }
    if args.kill_after_secs.is_some() && args.mode != "failure" {
        return Err("--kill-after-secs is for --mode failure".into());
    }
    if args.mode == "failure" {
        failure::check_args(args)?;
    }
    if args.mode == "workflow" {
        workflow::check_args(args)?;
    }
    if args.verify {
        if args.mode != "e2e" {
            return Err("--verify is for --mode e2e (--mode failure always checks)".into());
        }
        if args.order.iter().any(|&o| o != 2 && o != 5) {
            return Err("--verify needs a total order to check: --order 2 or 5".into());
        }
        if args.warmup_messages > 0 {
            return Err("--verify checks every message: leave out --warmup-messages".into());
        }
        if args.size < 8 {
            return Err("--verify stamps an 8-byte id into every message: --size 8 or more".into());
        }
    }
    Ok(())
}

pub fn run(args: BenchArgs) -> CliResult {
    if !args.from_json.is_empty() {
        let runs = load_results(&args.from_json)?;
        let path = args.plot.as_ref().expect("clap requires --plot");
        plot::write_png(path, &runs)?;
        say!("plotted {} runs to {}", runs.len(), path.display());
        return Ok(());
    }
    check_args(&args)?;
    if args.mode == "workflow" {
        return workflow::run(&args);
    }
    let configs = configurations(&args);
    let mut results = Vec::with_capacity(configs.len());
    let mut failed_checks = Vec::new();
    for (i, config) in configs.iter().enumerate() {
        if configs.len() > 1 && !args.json {
            let rate = config
                .rate
                .map_or("as fast as possible".to_string(), |r| format!("{r} MB/s"));
            say!(
                "== run {} of {}: order {}, {}, {rate}",
                i + 1,
                configs.len(),
                config.order,
                config.transport
            );
        }
        let figures = if args.mode == "failure" {
            failure::run(&args, *config)?
        } else {
            run_one(&args, *config)?
        };
        if figures["failure"]["check"]["passed"] == false || figures["check"]["passed"] == false {
            failed_checks.push(plot::label(&figures));
        }
        results.push(figures);
    }
    if args.json {
        let out = match results.as_slice() {
            [single] => single.clone(),
            _ => Value::Array(results.clone()),
        };
        say!("{}", serde_json::to_string_pretty(&out).expect("json"));
    } else if results.len() > 1 {
        print_summary(&results);
    }
    if let Some(path) = &args.plot {
        plot::write_png(path, &results)?;
        eprintln!("plot written to {}", path.display());
    }
    if !failed_checks.is_empty() {
        return Err(format!(
            "the exactly-once check failed in: {}",
            failed_checks.join(", ")
        ));
    }
    Ok(())
}

/// The runs in saved `bench --json` outputs: one object per file, or an array of them.
fn load_results(files: &[PathBuf]) -> Result<Vec<Value>, String> {
    let mut runs = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| {
            format!(
                "{} is not the JSON `bench --json` prints: {e}",
                file.display()
            )
        })?;
        let found = match value {
            Value::Array(items) => items,
            object @ Value::Object(_) => vec![object],
            _ => Vec::new(),
        };
        if found.is_empty() || found.iter().any(|r| r["mb_per_s"].as_f64().is_none()) {
            return Err(format!(
                "{} holds no `bench --json` run (an object with mb_per_s, or a list of them)",
                file.display()
            ));
        }
        runs.extend(found);
    }
    Ok(runs)
}

/// One line per run after a sweep.
fn print_summary(results: &[Value]) {
    say!();
    say!(
        "{:<28} {:>9} {:>7} {:>12} {:>12} {:>12} {:>9}",
        "RUN",
        "MB/S",
        "% LOOP",
        "A2A P50 US",
        "A2A P99 US",
        "A2A P99.9 US",
        "CPU S/GB"
    );
    for r in results {
        let latency = |p: &str| {
            r["append_to_ack_us"][p]
                .as_u64()
                .map_or("-".to_string(), |us| us.to_string())
        };
        say!(
            "{:<28} {:>9.1} {:>7} {:>12} {:>12} {:>12} {:>9}",
            plot::label(r),
            r["mb_per_s"].as_f64().unwrap_or(0.0),
            r["ceiling_ratios"]["mb_per_s_to_loopback_tcp"]
                .as_f64()
                .map_or("-".to_string(), |x| format!("{:.1}", 100.0 * x)),
            latency("p50"),
            latency("p99"),
            latency("p999"),
            r["process_cpu_seconds_per_gb"]
                .as_f64()
                .map_or("-".to_string(), |c| format!("{c:.2}"))
        );
    }
    say!(
        "(% LOOP: of the same run's loopback TCP ceiling, one stream; A2A: append to ack; at a fixed rate per message from its due time, flat out per batch from its first message's publish)"
    );
}

/// Messages to publish: `None` when publishing runs for --duration instead.
fn message_count(args: &BenchArgs) -> Option<u64> {
    match args.duration {
        Some(_) => None,
        None => Some((args.total_bytes / args.size.max(1) as u64).max(1)),
    }
}

/// What the e2e subscriber returns: messages received, when the last arrived, the
/// end-to-end latencies, and the exactly-once verifier (with --verify).
type E2eResult = Result<(u64, Instant, Histogram<u64>, Option<failure::Verifier>), String>;

/// One run against an embedded server (or --control).
fn run_one(args: &BenchArgs, config: RunConfig) -> Result<Value, String> {
    let mut scratch = Scratch {
        dir: tempdir()?,
        region_file: None,
    };
    // Declared after `scratch`, so dropped before it on every way out: the server lets
    // go of its region before the file is removed.
    let (server, region_file, control) = start_server(args, &scratch.dir)?;
    scratch.region_file = region_file.clone();
    let topic = create_topic(args, &control, config.order)?;
    // How many messages the subscriber waits for: known once publishing has ended.
    let published = Arc::new(AtomicU64::new(u64::MAX));
    // Wall-clock start of the measured schedule (0 until then): messages due before it
    // are the warm-up's, read but not timed.
    let measured_from_ns = Arc::new(AtomicU64::new(0));
    let subscriber = if args.mode == "e2e" {
        let shared = (published.clone(), measured_from_ns.clone());
        Some(spawn_e2e_subscriber(
            &control, &topic, args, config, shared,
        )?)
    } else {
        None
    };
    let embedded = server.is_some();
    let server_cpu_before = (!embedded).then(|| server_cpu_seconds(&control));
    let mut cpu = CpuSplit::start();
    let bar = progress_bar(message_count(args));
    let publishing = publish_measured(
        &control,
        &topic,
        args,
        config,
        &bar,
        &measured_from_ns,
        &mut cpu,
    );
    let outcome = match publishing {
        Ok(outcome) => outcome,
        Err(e) => {
            published.store(0, Ordering::Release);
            return Err(e);
        }
    };
    // The warm-up's messages are in the topic too, ahead of the measured ones.
    let warmed_up = config.rate.map_or(0, |_| args.warmup_messages);
    published.store(outcome.stats.messages + warmed_up, Ordering::Release);
    let reads = read_back(args, (&control, config), &topic, subscriber, &outcome)?;
    bar.finish_and_clear();
    let cpu = CpuFigures::of(cpu, server_cpu_before, &control);
    let elapsed = reads.elapsed().unwrap_or(outcome.elapsed);
    let stages = stage_figures(&control, &outcome, args, config);
    // The server is done and its counters read: the ceilings get the machine to
    // themselves, and nothing the server does meanwhile shows in the figures.
    drop(server);
    let ceilings = measure_ceilings(args, &scratch.dir)?;
    let mut figures = common_figures(args, config, &outcome, elapsed);
    let bytes = outcome.stats.bytes as f64;
    let extra = extra_figures(region_file.as_ref(), &reads, &cpu, bytes, &stages, ceilings);
    merge(&mut figures, extra);
    add_ceiling_ratios(&mut figures);
    if !args.json {
        print_run_header(args, config, outcome.runs.len());
        report(&outcome.stats, outcome.elapsed, false, args.ack);
        let mb_s = bytes / elapsed.as_secs_f64() / 1e6;
        print_reads(&reads, mb_s, config.order);
        print_cpu_and_stages(&cpu, bytes, &stages);
        print_ceilings(&figures);
    }
    Ok(figures)
}

/// Creates the run's topic (of `order`, replicated as `--rf` says) and returns its name.
fn create_topic(args: &BenchArgs, control: &str, order: u8) -> Result<String, String> {
    let topic = format!("bench-{}-{}", order, std::process::id());
    Admin::new(control)
        .create_topic(&TopicSpec::new(&topic, order).replicated(args.rf))
        .map_err(|e| e.to_string())?;
    Ok(topic)
}

/// What a measured run leaves on disk, removed when the run ends, whether it succeeded
/// or failed partway (a failed run's region can be gigabytes of /dev/shm): its scratch
/// directory, and the embedded server's region file, which is outside it in
/// --region-dir or /dev/shm (if any).
struct Scratch {
    dir: PathBuf,
    region_file: Option<PathBuf>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(f) = &self.region_file {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Publishes the run, sampling CPU meanwhile; stores in `measured_from_ns` the
/// wall-clock start of the measured schedule.
fn publish_measured(
    control: &str,
    topic: &str,
    args: &BenchArgs,
    config: RunConfig,
    bar: &ProgressBar,
    measured_from_ns: &AtomicU64,
    cpu: &mut CpuSplit,
) -> Result<PublishOutcome, String> {
    let (outcome, ()) = publish_all(control, topic, args, config, args.verify, |p| {
        let since_start = p.start.elapsed().as_nanos() as u64;
        measured_from_ns.store(
            embarcadero_client::now_ns().saturating_sub(since_start),
            Ordering::Relaxed,
        );
        while !p.finished() {
            bar.set_position(p.progress());
            cpu.sample();
            std::thread::sleep(Duration::from_millis(100));
        }
        // Before the publishers close, which ends the brokers' connection threads.
        cpu.sample();
        Ok(())
    })?;
    Ok(outcome)
}

/// What the subscribers of a run read: the e2e subscriber's count, time and latencies,
/// its exactly-once verdict (--verify), and the subscribe-only reader's figures.
struct Reads {
    e2e: Option<(u64, Duration, Histogram<u64>)>,
    check: Option<failure::Check>,
    subscribe_only: Option<SubscribeOnly>,
}

/// What the subscribe-only reader did.
struct SubscribeOnly {
    received: u64,
    elapsed: Duration,
    /// This process's CPU seconds while it read: the reader's alone with --control (the
    /// publishers are done by then), the reader's and the embedded server's otherwise.
    cpu_seconds: f64,
}

impl Reads {
    /// How long the subscriber took to read everything (none: publishing is the run).
    fn elapsed(&self) -> Option<Duration> {
        match (&self.e2e, &self.subscribe_only) {
            (Some(e), _) => Some(e.1),
            (_, Some(s)) => Some(s.elapsed),
            _ => None,
        }
    }
}

/// CPU seconds of a run: this process's (embedded only), the server's, the client's.
struct CpuFigures {
    process: Option<f64>,
    server: Option<f64>,
    client: f64,
}

impl CpuFigures {
    /// From the run's CPU samples and, for a server of its own (not embedded), the
    /// server's CPU seconds before the run.
    fn of(cpu: CpuSplit, server_cpu_before: Option<Option<f64>>, control: &str) -> Self {
        let (process_cpu, server_threads_cpu) = cpu.finish();
        // Embedded: the server's threads; else the server process's own count, which
        // covers whatever else it served meanwhile.
        match server_cpu_before {
            None => CpuFigures {
                process: Some(process_cpu),
                server: Some(server_threads_cpu),
                client: process_cpu - server_threads_cpu,
            },
            Some(before) => CpuFigures {
                process: None,
                server: before.zip(server_cpu_seconds(control)).map(|(b, a)| a - b),
                client: process_cpu,
            },
        }
    }
}

/// The figures `run_one` adds to the common ones.
fn extra_figures(
    region_file: Option<&PathBuf>,
    reads: &Reads,
    cpu: &CpuFigures,
    bytes: f64,
    stages: &StageFigures,
    ceilings: Value,
) -> Value {
    let per_gb = |seconds: f64| seconds / (bytes / 1e9);
    serde_json::json!({
        "region_file": region_file.map(|p| p.display().to_string()),
        "subscribe_only_seconds": reads.subscribe_only.as_ref().map(|s| s.elapsed.as_secs_f64()),
        "subscribe_only_cpu_seconds": reads.subscribe_only.as_ref().map(|s| s.cpu_seconds),
        "e2e_latency_us": reads.e2e.as_ref().map(|(_, _, h)| serde_json::json!({
            "p50": h.value_at_quantile(0.5),
            "p99": h.value_at_quantile(0.99),
            "p999": h.value_at_quantile(0.999),
            "max": h.max(),
            "samples": h.len(),
        })),
        "process_cpu_seconds_per_gb": cpu.process.map(per_gb),
        "server_cpu_seconds_per_gb": cpu.server.map(per_gb),
        "client_cpu_seconds_per_gb": per_gb(cpu.client),
        "stage_ms_per_gb": stages.ms_per_gb,
        "ack_wait_us_per_batch": stages.ack_wait_us_per_batch,
        "epoch_wait_us_per_batch": stages.epoch_wait_us_per_batch,
        "check": reads.check,
        "ceilings": ceilings,
    })
}

/// The embedded server of a run (none with --control): the server, its region file
/// and the control address to use.
fn start_server(
    args: &BenchArgs,
    scratch: &std::path::Path,
) -> Result<(Option<Server>, Option<PathBuf>, String), String> {
    if let Some(control) = &args.control {
        return Ok((None, None, control.clone()));
    }
    let mut server_config = ServerConfig {
        data_dir: scratch.join("data"),
        base_port: 0,
        control_port: 0,
        brokers: args.brokers,
        ..ServerConfig::default()
    };
    server_config.sequencer.epoch_us = args.epoch_us;
    if let Some(bytes) = args.shm_feed_bytes {
        server_config.broker.shm_feed_bytes = bytes;
    }
    server_config.replication.dirs = args.replica_dir.clone();
    let region_dir = args.region_dir.clone().unwrap_or_else(|| shm_or(scratch));
    server_config.region.path =
        region_dir.join(format!("embarcadero-bench-{}.region", std::process::id()));
    let region_file = server_config.region.path.clone();
    server_config.region.prefault = !args.no_prefault;
    // A run makes one topic: the old default of 16 slots keeps the prefaulted
    // region (and its start) the size earlier runs measured with, not 2.9 GiB.
    server_config.region.max_topics = 16;
    let server = Server::start(server_config).map_err(|e| e.to_string())?;
    let control = server.control_addr().to_string();
    Ok((Some(server), Some(region_file), control))
}

/// A run's subscribers read over the run's transport, as its publishers write.
fn subscriber_config(transport: Transport) -> SubscriberConfig {
    SubscriberConfig {
        transport,
        ..SubscriberConfig::default()
    }
}

/// The e2e subscriber: reads until it has as many messages as `published` says (u64::MAX
/// until publishing ends), timing every 64th message measured (published after
/// `measured_from_ns`), and feeding the exactly-once verifier with --verify.
fn spawn_e2e_subscriber(
    control: &str,
    topic: &str,
    args: &BenchArgs,
    config: RunConfig,
    (published, measured_from_ns): (Arc<AtomicU64>, Arc<AtomicU64>),
) -> Result<std::thread::JoinHandle<E2eResult>, String> {
    let mut sub = Subscriber::connect(control, topic, subscriber_config(config.transport))
        .map_err(|e| e.to_string())?;
    let warming_up = args.warmup_messages > 0;
    let mut verifier = args
        .verify
        .then(|| failure::Verifier::new(config.order, args.publishers.max(1)));
    Ok(std::thread::spawn(move || -> E2eResult {
        let mut received = 0u64;
        let mut last_at = Instant::now();
        let mut e2e = Histogram::<u64>::new(3).expect("histogram");
        while received < published.load(Ordering::Acquire) {
            let n = sub
                .poll_with(Duration::from_millis(100), |m| {
                    let timed = !warming_up || {
                        let from = measured_from_ns.load(Ordering::Relaxed);
                        from != 0 && m.publish_ts_ns >= from
                    };
                    if timed && received.is_multiple_of(64) {
                        let _ = e2e.record(
                            embarcadero_client::now_ns().saturating_sub(m.publish_ts_ns) / 1000 + 1,
                        );
                    }
                    if let Some(v) = verifier.as_mut() {
                        v.observe(m.position, m.payload);
                    }
                    received += 1;
                })
                .map_err(|e| e.to_string())?;
            if n > 0 {
                last_at = Instant::now();
            } else if last_at.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "the subscriber received nothing for 30 s after {received} messages"
                ));
            }
        }
        Ok((received, last_at, e2e, verifier))
    }))
}

/// What the run's subscribers read: subscribe-only, one subscriber reads the full topic
/// from the start now; e2e, the subscriber that read along is waited for.
fn read_back(
    args: &BenchArgs,
    (control, config): (&str, RunConfig),
    topic: &str,
    subscriber: Option<std::thread::JoinHandle<E2eResult>>,
    outcome: &PublishOutcome,
) -> Result<Reads, String> {
    let subscribe_only = if args.mode == "subscribe" {
        let count = outcome.stats.messages;
        Some(read_all_from_start(
            control,
            topic,
            count,
            config.transport,
        )?)
    } else {
        None
    };
    let (e2e, check) = finish_e2e(subscriber, control, topic, outcome)?;
    Ok(Reads {
        e2e,
        check,
        subscribe_only,
    })
}

/// Subscribe-only: one subscriber reads the `count` messages of the full topic from the
/// start; returns how many it read and how long that took.
fn read_all_from_start(
    control: &str,
    topic: &str,
    count: u64,
    transport: Transport,
) -> Result<SubscribeOnly, String> {
    let mut sub = Subscriber::connect(control, topic, subscriber_config(transport))
        .map_err(|e| e.to_string())?;
    const KEEP: &str = "a memory-only topic keeps about three quarters of each broker's log \
        memory: lower --total-bytes or --duration, or read from disk with --rf 2";
    let sub_start = Instant::now();
    let cpu_start = cpu::process_cpu_seconds();
    let mut last_progress = sub_start;
    let mut received = 0u64;
    while received < count {
        let got = sub
            .poll_with(Duration::from_secs(30), |_| received += 1)
            .map_err(|e| format!("{e} ({KEEP})"))?;
        // Reclaimed messages never come: waiting for them would hang the run.
        if let Some((from, to)) = sub.skipped() {
            return Err(format!(
                "positions {from}..{to} were reclaimed before the subscriber started ({KEEP})"
            ));
        }
        // A poll may end early with nothing to hand out (a reconnection, a batch already
        // seen), so only time without a message ends the run.
        if got > 0 {
            last_progress = Instant::now();
        } else if last_progress.elapsed() >= Duration::from_secs(30) {
            return Err(format!(
                "the subscriber received nothing for 30 s after {received} of {count} messages"
            ));
        }
    }
    Ok(SubscribeOnly {
        received,
        elapsed: sub_start.elapsed(),
        cpu_seconds: cpu::process_cpu_seconds() - cpu_start,
    })
}

/// Waits for the e2e subscriber (if any): messages received, time from the start of
/// publishing to the last, the latencies; and the exactly-once verdict with --verify.
#[allow(clippy::type_complexity)]
fn finish_e2e(
    subscriber: Option<std::thread::JoinHandle<E2eResult>>,
    control: &str,
    topic: &str,
    outcome: &PublishOutcome,
) -> Result<
    (
        Option<(u64, Duration, Histogram<u64>)>,
        Option<failure::Check>,
    ),
    String,
> {
    let Some(handle) = subscriber else {
        return Ok((None, None));
    };
    let (received, done, hist, verifier) = handle
        .join()
        .map_err(|_| "subscriber thread panicked".to_string())??;
    let mut check = None;
    if let Some(verifier) = verifier {
        let topic_end = Admin::new(control)
            .describe_topic(topic)
            .map_err(|e| e.to_string())?
            .next_position;
        let published: Vec<u64> = outcome.runs.iter().map(|r| r.stats.messages).collect();
        check = Some(verifier.finish(&published, topic_end));
    }
    Ok((
        Some((received, done.duration_since(outcome.start), hist)),
        check,
    ))
}

/// Per-stage figures of a run from the server's counters.
struct StageFigures {
    ms_per_gb: std::collections::BTreeMap<String, f64>,
    ack_wait_us_per_batch: Option<f64>,
    epoch_wait_us_per_batch: Option<f64>,
}

/// Per-stage time from the server's counters, less what they held when the measured
/// schedule began (exact for an embedded server, which served only this run).
fn stage_figures(
    control: &str,
    outcome: &PublishOutcome,
    args: &BenchArgs,
    config: RunConfig,
) -> StageFigures {
    let stats = &outcome.stats;
    let bytes = stats.bytes as f64;
    let stage_run_nanos: std::collections::BTreeMap<String, u64> = stage_nanos(control)
        .into_iter()
        .map(|(stage, ns)| {
            let before = outcome.stages_at_start.get(&stage).copied().unwrap_or(0);
            (stage, ns.saturating_sub(before))
        })
        .collect();
    let ms_per_gb = stage_run_nanos
        .iter()
        .map(|(stage, &ns)| (stage.clone(), ns as f64 / 1e6 / (bytes / 1e9)))
        .collect();
    // The mean batch's wait from commit to acknowledgeable (the epoch wait for orders
    // 2 and 5): a per-batch figure, unlike the per-GB thread time above.
    let per_batch_us = |stage: &str| {
        stage_run_nanos
            .get(stage)
            .filter(|_| stats.batches > 0)
            .map(|&ns| ns as f64 / 1e3 / stats.batches as f64)
    };
    StageFigures {
        ms_per_gb,
        ack_wait_us_per_batch: per_batch_us("ack_wait").filter(|_| args.ack > 0),
        // Orders 2 and 5: the part of that wait spent in the sequencer until the epoch closed.
        epoch_wait_us_per_batch: per_batch_us("sequencer_epoch_wait").filter(|_| config.order >= 2),
    }
}

/// The human report of what the subscribers read.
fn print_reads(reads: &Reads, mb_s: f64, order: u8) {
    if let Some((received, t, h)) = &reads.e2e {
        say!(
            "subscriber received {received} messages in {:.3} s: {:.1} MB/s; end-to-end latency p50 {} us, p99 {} us",
            t.as_secs_f64(),
            mb_s,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99)
        );
    }
    if let Some(check) = &reads.check {
        failure::print_check(check, order);
    }
    if let Some(s) = &reads.subscribe_only {
        say!(
            "subscriber read {} messages from position 0 in {:.3} s: {:.1} MB/s",
            s.received,
            s.elapsed.as_secs_f64(),
            mb_s
        );
    }
}

/// The human report of CPU per GB (server, client) and thread time per stage.
fn print_cpu_and_stages(cpu: &CpuFigures, bytes: f64, stages: &StageFigures) {
    let per_gb = |seconds: f64| seconds / (bytes / 1e9);
    let server_cpu = cpu
        .server
        .map_or("-".to_string(), |s| format!("{:.2}", per_gb(s)));
    let whole = if cpu.process.is_some() {
        " of one process"
    } else {
        ""
    };
    say!(
        "CPU per GB: server {server_cpu} s, client {:.2} s{whole}",
        per_gb(cpu.client)
    );
    if !stages.ms_per_gb.is_empty() {
        say!("thread time per stage, ms per GB of payload (summed over brokers):");
        // The two waits are time batches spent waiting, not time a thread spent: below.
        let waits = ["ack_wait", "sequencer_epoch_wait"];
        for (stage, ms) in stages
            .ms_per_gb
            .iter()
            .filter(|(s, _)| !waits.contains(&s.as_str()))
        {
            say!("  {stage:<20} {ms:>9.1}");
        }
    }
    if let Some(us) = stages.ack_wait_us_per_batch {
        say!("mean wait per batch from commit to acknowledgeable (ack_wait): {us:.0} us");
    }
    if let Some(us) = stages.epoch_wait_us_per_batch {
        say!("  of which in the sequencer, waiting for the epoch to close: {us:.0} us");
    }
}

/// The first line of a run's human report.
fn print_run_header(args: &BenchArgs, config: RunConfig, publishers: usize) {
    say!(
        "mode {}  order {}  transport {}  ack {}  rf {}  {} B messages  {} brokers x {} connections  {} publisher(s){}",
        args.mode,
        config.order,
        config.transport,
        args.ack,
        args.rf,
        args.size,
        args.brokers,
        args.threads_per_broker,
        publishers,
        config
            .rate
            .map_or(String::new(), |r| format!("  offered {r} MB/s"))
    );
}

/// Loopback TCP in the publisher's batch size (also one stream per broker into a ring
/// the size of its log in the embedded server's region), loopback round trips of one
/// message and an ack, memcpy, and fdatasync on the replicas' disk (1 MiB writes and the
/// replicas' group-commit size), unless --no-ceilings.
fn measure_ceilings(args: &BenchArgs, scratch: &std::path::Path) -> Result<Value, String> {
    if args.no_ceilings {
        return Ok(Value::Array(Vec::new()));
    }
    let mut plan = CeilingPlan::new(
        args.replica_dir.first().map_or(scratch, |d| d.as_path()),
        false,
    );
    plan.tcp_chunk_bytes = args.batch_bytes;
    plan.round_trip_request_bytes = args.size;
    let defaults = ServerConfig::default();
    // One stream per broker into a ring of one broker's segments in the region.
    plan.ring_streams = args.brokers as usize;
    plan.ring_bytes =
        defaults.region.segments_per_broker as usize * defaults.region.segment_bytes as usize;
    let group_commit = defaults.replication.group_commit_bytes as usize;
    if args.rf >= 2 && !plan.sync_write_bytes.contains(&group_commit) {
        plan.sync_write_bytes.push(group_commit);
    }
    let ceilings =
        measure_all(&plan).map_err(|e| format!("cannot measure the machine's ceilings: {e}"))?;
    Ok(serde_json::to_value(ceilings).expect("json"))
}

/// The first ceiling whose name starts with `prefix`.
fn ceiling<'a>(figures: &'a Value, prefix: &str) -> Option<&'a Value> {
    figures["ceilings"]
        .as_array()?
        .iter()
        .find(|c| c["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
}

/// Adds `ceiling_ratios` (see [`ceiling_ratios`]) to a run's figures.
fn add_ceiling_ratios(figures: &mut Value) {
    let ratios = ceiling_ratios(figures);
    merge(figures, serde_json::json!({ "ceiling_ratios": ratios }));
}

/// Each headline figure against the ceiling that bounds it: throughput as a fraction
/// of loopback TCP (one hot stream, the bar's ceiling; and a stream per broker into
/// log-sized rings, the system's shape) and, with ack 2, of fdatasync at the replicas'
/// group-commit size; latencies as multiples of a loopback round trip of one message
/// and an ack. Empty without ceilings.
fn ceiling_ratios(figures: &Value) -> Value {
    let mut ratios = serde_json::Map::new();
    let mb_s = figures["mb_per_s"].as_f64().unwrap_or(0.0);
    let mut throughput = |key: &str, c: Option<&Value>| {
        if let Some(ceiling) = c.and_then(|c| c["mb_per_s"].as_f64()).filter(|&c| c > 0.0) {
            ratios.insert(key.into(), (mb_s / ceiling).into());
        }
    };
    throughput(
        "mb_per_s_to_loopback_tcp",
        ceiling(figures, "loopback_tcp streams=1 "),
    );
    throughput(
        "mb_per_s_to_loopback_tcp_ring",
        ceiling(figures, "loopback_tcp_ring"),
    );
    // The bar of the shared-memory transport (issue 26).
    throughput("mb_per_s_to_memcpy", ceiling(figures, "memcpy "));
    if figures["ack"].as_u64() == Some(2) {
        // The last fdatasync ceiling is the replicas' group-commit size.
        let sync = figures["ceilings"].as_array().and_then(|all| {
            all.iter().rev().find(|c| {
                c["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("fdatasync"))
            })
        });
        throughput("mb_per_s_to_fdatasync", sync);
    }
    if let Some(rtt) = ceiling(figures, "loopback_round_trip") {
        for (latency, key) in [
            ("append_to_ack_us", "append_to_ack"),
            ("e2e_latency_us", "e2e"),
        ] {
            for p in ["p50", "p99"] {
                let (Some(ours), Some(floor)) = (
                    figures[latency][p].as_f64(),
                    rtt[format!("{p}_us")].as_f64().filter(|&f| f > 0.0),
                ) else {
                    continue;
                };
                ratios.insert(
                    format!("{key}_{p}_over_loopback_round_trip"),
                    (ours / floor).into(),
                );
            }
        }
    }
    Value::Object(ratios)
}

fn print_ceilings(figures: &Value) {
    for c in figures["ceilings"].as_array().into_iter().flatten() {
        let latency = match (c["p50_us"].as_f64(), c["p99_us"].as_f64()) {
            (Some(p50), Some(p99)) => format!("   p50 {p50:.0} us, p99 {p99:.0} us"),
            _ => String::new(),
        };
        say!(
            "ceiling {:<52} {:>9.1} MB/s{latency}",
            c["name"].as_str().unwrap_or("?"),
            c["mb_per_s"].as_f64().unwrap_or(0.0),
        );
    }
    let ratios = &figures["ceiling_ratios"];
    let percent = |key: &str| ratios[key].as_f64().map(|r| format!("{:.1}%", 100.0 * r));
    let times = |key: &str| ratios[key].as_f64().map(|r| format!("{r:.1}x"));
    let lines = [
        (
            percent("mb_per_s_to_loopback_tcp"),
            "of loopback TCP, one stream (the bar's ceiling)",
        ),
        (
            percent("mb_per_s_to_loopback_tcp_ring"),
            "of loopback TCP into log-sized rings, a stream per broker",
        ),
        (
            percent("mb_per_s_to_fdatasync"),
            "of fdatasync at the replicas' group-commit size",
        ),
        (
            times("append_to_ack_p50_over_loopback_round_trip"),
            "a loopback round trip: append-to-ack p50",
        ),
        (
            times("append_to_ack_p99_over_loopback_round_trip"),
            "a loopback round trip: append-to-ack p99",
        ),
        (
            times("e2e_p50_over_loopback_round_trip"),
            "a loopback round trip: end-to-end p50",
        ),
        (
            times("e2e_p99_over_loopback_round_trip"),
            "a loopback round trip: end-to-end p99",
        ),
    ];
    for (value, what) in lines {
        if let Some(value) = value {
            say!("  this run: {value:>7} {what}");
        }
    }
}

/// The figures every mode reports, from the publishers' side.
fn common_figures(
    args: &BenchArgs,
    config: RunConfig,
    outcome: &PublishOutcome,
    elapsed: Duration,
) -> Value {
    let stats = &outcome.stats;
    let bytes = stats.bytes as f64;
    serde_json::json!({
        "mode": args.mode,
        "publishers": outcome.runs.len(),
        "order": config.order,
        "transport": config.transport.to_string(),
        "ack": args.ack,
        "rf": args.rf,
        "message_bytes": args.size,
        "messages": stats.messages,
        "payload_bytes": stats.bytes,
        "brokers": args.brokers,
        "threads_per_broker": args.threads_per_broker,
        "batch_bytes": args.batch_bytes,
        "linger_us": args.linger_us,
        "epoch_us": args.epoch_us,
        "shm_feed_bytes": args.shm_feed_bytes,
        "shm_ring_bytes": args.shm_ring_bytes,
        "deflect": !args.no_deflect,
        "prefault": !args.no_prefault,
        "slow_queue": std::env::var("EMBARCADERO_SLOW_CONSUMER_QUEUE").ok(),
        "slow_queue_ms": std::env::var("EMBARCADERO_SLOW_CONSUMER_MS").ok(),
        "duration_s": args.duration,
        "seconds": elapsed.as_secs_f64(),
        "publish_seconds": outcome.elapsed.as_secs_f64(),
        "publish_mb_per_s": bytes / outcome.elapsed.as_secs_f64() / 1e6,
        "per_publisher_append_to_ack_us": outcome.runs.iter().map(|r| &r.stats.append_to_ack_us).collect::<Vec<_>>(),
        "mb_per_s": bytes / elapsed.as_secs_f64() / 1e6,
        "messages_per_s": stats.messages as f64 / elapsed.as_secs_f64(),
        "ack_latency_us": stats.ack_latency_us,
        "append_to_ack_us": stats.append_to_ack_us,
        "rate_mb_per_s": config.rate,
        "warmup_messages": args.warmup_messages,
        "schedule_max_lateness_us": config.rate.map(|_| outcome.behind_max.as_micros() as u64),
        "queues": stats.queues,
    })
}

/// Adds the fields of object `extra` to object `figures`.
fn merge(figures: &mut Value, extra: Value) {
    if let (Value::Object(into), Value::Object(from)) = (figures, extra) {
        into.extend(from);
    }
}

fn progress_bar(count: Option<u64>) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    match count {
        Some(count) => ProgressBar::new(count).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} messages {per_sec} eta {eta}")
                .expect("template"),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} {pos} messages {per_sec} {elapsed}")
                .expect("template"),
        ),
    }
}

/// What one publisher of the benchmark did.
struct PublisherRun {
    stats: PublisherStats,
    sealed: Histogram<u64>,
    appended: Histogram<u64>,
    /// Worst lateness against the fixed schedule (`--rate`).
    behind_max: Duration,
}

/// All publishers of one run, once they are done.
struct PublishOutcome {
    runs: Vec<PublisherRun>,
    /// The publishers' figures merged.
    stats: PublisherStats,
    start: Instant,
    /// From the start until the last publisher's last acknowledgement.
    elapsed: Duration,
    behind_max: Duration,
    /// The server's per-stage totals at the start, after any warm-up: the run's own
    /// are the difference at the end.
    stages_at_start: std::collections::BTreeMap<String, u64>,
}

/// The publishers of a run while they publish, as the main thread sees them.
struct Publishing<'a> {
    publishers: &'a [Publisher],
    progress: &'a AtomicU64,
    start: Instant,
    finished: &'a dyn Fn() -> bool,
}

impl Publishing<'_> {
    /// Messages published so far by all publishers (counted in steps of 64).
    fn progress(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }

    /// Every publisher has published its share and had it acknowledged (or failed).
    fn finished(&self) -> bool {
        (self.finished)()
    }
}

/// Connects `args.publishers` publishers, runs them (each on its own thread, on its part
/// of the schedule) and, on this thread meanwhile, `monitor`; a monitor error stops the
/// publishers. Returns the merged outcome and what the monitor returned.
fn publish_all<T>(
    control: &str,
    topic: &str,
    args: &BenchArgs,
    config: RunConfig,
    stamp_ids: bool,
    monitor: impl FnOnce(&Publishing) -> Result<T, String>,
) -> Result<(PublishOutcome, T), String> {
    let publishers = connect_publishers(control, topic, args, config.transport)?;
    let count = publishers.len();
    let messages = message_count(args);
    let progress = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let warmed = match config.rate {
        Some(_) if args.warmup_messages > 0 => Some(warm_up(&publishers, args, config)?),
        _ => None,
    };
    // After connecting (and warming up): neither is part of the measured schedule.
    let stages_at_start = stage_nanos(control);
    let start = Instant::now();
    let deadline = args.duration.map(|d| start + Duration::from_secs_f64(d));
    let share = |index| Share {
        index,
        of: count,
        messages: messages.map(|m| share_of(m, count, index)),
        deadline,
        start,
        stamp_ids,
    };
    let (results, watched) = run_shares(
        &publishers,
        args.size,
        config.rate,
        share,
        &stop,
        &progress,
        |finished| {
            let watched = monitor(&Publishing {
                publishers: &publishers,
                progress: &progress,
                start,
                finished,
            });
            if watched.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            watched
        },
    );
    // A monitor that saw publishing end early is explained by the publisher that failed.
    if let (Err(seen), Some(Err(failed))) = (&watched, results.iter().find(|r| r.is_err())) {
        return Err(format!("{seen}; a publisher failed: {failed}"));
    }
    let watched = watched?;
    let finished = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let outcome = publish_outcome(publishers, finished, warmed, start, stages_at_start)?;
    Ok((outcome, watched))
}

/// The outcome of a run whose publishers all finished (`finished`: each one's worst
/// lateness and when its last acknowledgement came): closes the publishers and merges
/// their figures, timed from `start` to the last acknowledgement.
fn publish_outcome(
    publishers: Vec<Publisher>,
    finished: Vec<(Duration, Instant)>,
    warmed: Option<Vec<PublisherRun>>,
    start: Instant,
    stages_at_start: std::collections::BTreeMap<String, u64>,
) -> Result<PublishOutcome, String> {
    // Up to the last acknowledgement, not to when the monitor (which polls every 100 ms)
    // saw the publishers finish.
    let (behind, flushed_at): (Vec<Duration>, Vec<Instant>) = finished.into_iter().unzip();
    let last_ack = flushed_at.into_iter().max().unwrap_or_else(Instant::now);
    let elapsed = last_ack.saturating_duration_since(start);
    let runs = close_publishers(publishers, &behind, warmed)?;
    Ok(PublishOutcome {
        stats: merge_stats(&runs),
        behind_max: runs.iter().map(|r| r.behind_max).max().unwrap_or_default(),
        runs,
        start,
        elapsed,
        stages_at_start,
    })
}

/// The run's `--publishers` publishers, connected.
fn connect_publishers(
    control: &str,
    topic: &str,
    args: &BenchArgs,
    transport: Transport,
) -> Result<Vec<Publisher>, String> {
    let publisher_config = PublisherConfig {
        transport,
        ack_level: args.ack,
        batch_bytes: args.batch_bytes,
        linger: Duration::from_micros(args.linger_us),
        threads_per_broker: args.threads_per_broker,
        deflect: !args.no_deflect,
        shm_ring_bytes: args
            .shm_ring_bytes
            .unwrap_or(PublisherConfig::default().shm_ring_bytes),
        ..PublisherConfig::default()
    };
    (0..args.publishers.max(1))
        .map(|_| Publisher::connect(control, topic, publisher_config.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

/// Closes the publishers once they are done, each with its worst lateness, and takes
/// out of its figures what the warm-up (if any) had counted.
fn close_publishers(
    publishers: Vec<Publisher>,
    behind: &[Duration],
    warmed: Option<Vec<PublisherRun>>,
) -> Result<Vec<PublisherRun>, String> {
    let count = publishers.len();
    let mut runs = Vec::with_capacity(count);
    let warmed = warmed.map(|w| w.into_iter().map(Some).collect::<Vec<_>>());
    let mut warmed = warmed.unwrap_or_else(|| (0..count).map(|_| None).collect());
    for ((publisher, &behind_max), warm) in
        publishers.into_iter().zip(behind).zip(warmed.iter_mut())
    {
        let (mut sealed, mut appended) = publisher.latency_histograms();
        let mut stats = publisher.close().map_err(|e| e.to_string())?;
        if let Some(warm) = warm.take() {
            // The warm-up's batches were all acknowledged before the measured ones began.
            let _ = sealed.subtract(&warm.sealed);
            let _ = appended.subtract(&warm.appended);
            stats.messages -= warm.stats.messages;
            stats.bytes -= warm.stats.bytes;
            stats.batches -= warm.stats.batches;
            stats.acked_batches -= warm.stats.acked_batches;
            stats.ack_latency_us = LatencySummary::of(&sealed);
            stats.append_to_ack_us = LatencySummary::of(&appended);
        }
        runs.push(PublisherRun {
            stats,
            sealed,
            appended,
            behind_max,
        });
    }
    Ok(runs)
}

/// Publishes `--warmup-messages` on a schedule of their own at the run's rate, waits
/// for their acknowledgements, and returns what each publisher had counted by then.
fn warm_up(
    publishers: &[Publisher],
    args: &BenchArgs,
    config: RunConfig,
) -> Result<Vec<PublisherRun>, String> {
    let count = publishers.len();
    let start = Instant::now();
    let (stop, progress) = (AtomicBool::new(false), AtomicU64::new(0));
    let share = |index| Share {
        index,
        of: count,
        messages: Some(share_of(args.warmup_messages, count, index)),
        deadline: None,
        start,
        stamp_ids: false,
    };
    let (results, ()) = run_shares(
        publishers,
        args.size,
        config.rate,
        share,
        &stop,
        &progress,
        |_| (),
    );
    results.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(publishers
        .iter()
        .map(|p| {
            let (sealed, appended) = p.latency_histograms();
            PublisherRun {
                stats: p.stats(),
                sealed,
                appended,
                behind_max: Duration::ZERO,
            }
        })
        .collect())
}

/// How one publisher's share ended: its worst lateness against the schedule and when its
/// last acknowledgement arrived, or why it failed.
type ShareOutcome = Result<(Duration, Instant), String>;

/// Runs every publisher's share of a schedule (`share(index)`) on a thread of its own
/// while `watch` runs on this thread, given a check that every publisher has finished.
/// Returns each publisher's outcome ([`run_publisher`]) and what `watch` returned.
fn run_shares<T>(
    publishers: &[Publisher],
    size: usize,
    rate: Option<f64>,
    share: impl Fn(usize) -> Share,
    stop: &AtomicBool,
    progress: &AtomicU64,
    watch: impl FnOnce(&dyn Fn() -> bool) -> T,
) -> (Vec<ShareOutcome>, T) {
    std::thread::scope(|scope| {
        let handles: Vec<_> = publishers
            .iter()
            .enumerate()
            .map(|(index, publisher)| {
                let share = share(index);
                scope.spawn(move || run_publisher(publisher, size, rate, share, stop, progress))
            })
            .collect();
        let watched = watch(&|| handles.iter().all(|h| h.is_finished()));
        let results = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a publisher thread panicked".into()))
            })
            .collect();
        (results, watched)
    })
}

/// How many of `total` messages publisher `index` of `of` publishes: it takes every
/// `of`-th message of the schedule, from its own index on.
fn share_of(total: u64, of: usize, index: usize) -> u64 {
    total / of as u64 + u64::from((index as u64) < total % of as u64)
}

/// One publisher's part of the run.
#[derive(Clone, Copy)]
struct Share {
    index: usize,
    of: usize,
    /// Messages to publish; `None`: until the deadline.
    messages: Option<u64>,
    deadline: Option<Instant>,
    start: Instant,
    /// Write the message's id ([`failure::message_id`]) into its first 8 bytes.
    stamp_ids: bool,
}

impl Share {
    /// When message `i` of this publisher is due on a schedule of one message every
    /// `interval` across all publishers.
    /// In whole nanoseconds (at least one), so that [`Self::due_by`] agrees exactly.
    fn due(&self, i: u64, interval: Duration) -> Instant {
        let slot = i * self.of as u64 + self.index as u64;
        self.start + Duration::from_nanos(slot * interval_ns(interval))
    }

    /// How many of this publisher's messages are due at `now` (at most `cap` past `i`,
    /// so that the stop and deadline checks still come round).
    fn due_by(&self, now: Instant, interval: Duration, i: u64, cap: u64) -> u64 {
        let elapsed = now.saturating_duration_since(self.start).as_nanos() as u64;
        let slots = elapsed / interval_ns(interval);
        let mine = if slots < self.index as u64 {
            0
        } else {
            (slots - self.index as u64) / self.of as u64 + 1
        };
        mine.min(i + cap)
    }
}

/// The schedule's interval in whole nanoseconds, at least one.
fn interval_ns(interval: Duration) -> u64 {
    (interval.as_nanos() as u64).max(1)
}

/// Messages published between two clock reads at most, on a schedule that has fallen
/// behind.
const DUE_GROUP: u64 = 1024;

/// Publishes this publisher's share on its part of the schedule, then waits for every
/// acknowledgement: with a rate, message i of publisher p is due at
/// start + (i * publishers + p) * interval (fixed in advance: a late message is not
/// excused by the lateness of the ones before it), and is published with that due time,
/// which its append-to-ack latency starts from. The clock is read once for every
/// message due by then, not once per message: at 2 GB/s of 1 KiB messages two clock
/// reads and a sleep per message were a cost of the bench, the same over every
/// transport, that flattened the comparison of theirs. Returns the worst lateness (of
/// the first message of each group, the most overdue of it) and when the last
/// acknowledgement arrived.
fn run_publisher(
    publisher: &Publisher,
    size: usize,
    rate: Option<f64>,
    share: Share,
    stop: &AtomicBool,
    progress: &AtomicU64,
) -> ShareOutcome {
    let mut payload: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let interval = rate.map(|mb_s| Duration::from_secs_f64(size as f64 / (mb_s * 1e6)));
    let mut behind_max = Duration::ZERO;
    let mut i = 0u64;
    // With a rate: messages before this one were due at the last clock read.
    let mut due_end = 0u64;
    loop {
        if share.messages.is_some_and(|m| i >= m) {
            break;
        }
        // Checked every 16 messages: a clock read per message would show in the figures.
        if i.is_multiple_of(16)
            && (stop.load(Ordering::Relaxed) || share.deadline.is_some_and(|d| Instant::now() >= d))
        {
            break;
        }
        if share.stamp_ids {
            payload[..8].copy_from_slice(&failure::message_id(share.index, i).to_le_bytes());
        }
        if let Some(interval) = interval {
            let due = share.due(i, interval);
            if i >= due_end {
                let now = Instant::now();
                if due > now {
                    // Sleep, do not spin: a spinning publisher would take one of the
                    // two cores from the system being measured. Messages that fall due
                    // while it sleeps go out together when it wakes.
                    std::thread::sleep(due - now);
                }
                // Lateness at the publish, wake-up delay included (as the peers'
                // generators report it).
                let now = Instant::now();
                behind_max = behind_max.max(now.saturating_duration_since(due));
                due_end = share.due_by(now, interval, i, DUE_GROUP).max(i + 1);
            }
            publisher
                .publish_due(&payload, due)
                .map_err(|e| e.to_string())?;
        } else {
            publisher.publish(&payload).map_err(|e| e.to_string())?;
        }
        i += 1;
        if i.is_multiple_of(64) {
            progress.fetch_add(64, Ordering::Relaxed);
        }
    }
    progress.fetch_add(i % 64, Ordering::Relaxed);
    publisher.flush().map_err(|e| e.to_string())?;
    Ok((behind_max, Instant::now()))
}

/// One set of figures for all publishers: sums, and percentiles of the merged
/// histograms.
fn merge_stats(runs: &[PublisherRun]) -> PublisherStats {
    let mut sealed = Histogram::<u64>::new(3).expect("histogram");
    let mut appended = Histogram::<u64>::new(3).expect("histogram");
    for r in runs {
        let _ = sealed.add(&r.sealed);
        let _ = appended.add(&r.appended);
    }
    let sum = |f: fn(&PublisherStats) -> u64| runs.iter().map(|r| f(&r.stats)).sum();
    let first = runs.first().map(|r| &r.stats);
    PublisherStats {
        client_id: first.map_or(0, |s| s.client_id),
        ack_level: first.map_or(0, |s| s.ack_level),
        session_epoch: first.map_or(0, |s| s.session_epoch),
        messages: sum(|s| s.messages),
        bytes: sum(|s| s.bytes),
        batches: sum(|s| s.batches),
        acked_batches: sum(|s| s.acked_batches),
        ack_latency_us: LatencySummary::of(&sealed),
        append_to_ack_us: LatencySummary::of(&appended),
        queues: runs.iter().flat_map(|r| r.stats.queues.clone()).collect(),
    }
}

/// The server's /metrics text (empty if it cannot be read).
fn metrics_text(control: &str) -> String {
    use std::io::{Read, Write};
    let mut text = String::new();
    let Ok(mut s) = std::net::TcpStream::connect(control) else {
        return text;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").is_ok() {
        let _ = s.read_to_string(&mut text);
    }
    text
}

/// The server process's `process_cpu_seconds_total`, if it exports one.
fn server_cpu_seconds(control: &str) -> Option<f64> {
    metrics_text(control)
        .lines()
        .find_map(|l| l.strip_prefix("process_cpu_seconds_total ")?.parse().ok())
}

/// Splits this process's CPU time between an embedded server's threads and the rest
/// (publishers, subscribers, the bench itself), by thread name. Threads are sampled as
/// the run goes: one that exits (a broker's connection thread when its client closes)
/// keeps its last sample.
struct CpuSplit {
    process_start: f64,
    start: std::collections::HashMap<u64, (String, f64)>,
    last: std::collections::HashMap<u64, (String, f64)>,
}

impl CpuSplit {
    fn start() -> Self {
        let start = cpu::thread_cpu_seconds();
        Self {
            process_start: cpu::process_cpu_seconds(),
            last: start.clone(),
            start,
        }
    }

    fn sample(&mut self) {
        self.last.extend(cpu::thread_cpu_seconds());
    }

    /// This process's CPU seconds since the start, and its server threads' share.
    fn finish(mut self) -> (f64, f64) {
        self.sample();
        let server = self
            .last
            .iter()
            .filter(|(_, (name, _))| cpu::is_server_thread(name))
            .map(|(tid, (_, now))| now - self.start.get(tid).map_or(0.0, |(_, then)| *then))
            .sum();
        (cpu::process_cpu_seconds() - self.process_start, server)
    }
}

/// Sums `embarcadero_stage_nanoseconds_total` per stage from the server's /metrics.
fn stage_nanos(control: &str) -> std::collections::BTreeMap<String, u64> {
    let mut totals = std::collections::BTreeMap::new();
    for line in metrics_text(control).lines() {
        let Some(rest) = line.strip_prefix("embarcadero_stage_nanoseconds_total{") else {
            continue;
        };
        let stage = rest
            .split("stage=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("?")
            .to_string();
        let value = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        *totals.entry(stage).or_insert(0) += value;
    }
    totals
}

fn tempdir() -> Result<std::path::PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("embarcadero-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run's scratch goes with it however the run ends (`run_one` returns early on an
    /// error with its `Scratch` in scope): the directory with what is in it, and the
    /// region file outside it.
    #[test]
    fn a_runs_scratch_and_region_file_are_removed_when_it_ends() {
        let base = std::env::temp_dir().join(format!("bench-scratch-test-{}", std::process::id()));
        let dir = base.join("scratch");
        std::fs::create_dir_all(dir.join("data")).unwrap();
        std::fs::write(dir.join("data/segment"), b"x").unwrap();
        let region = base.join("run.region");
        std::fs::write(&region, b"region").unwrap();
        drop(Scratch {
            dir: dir.clone(),
            region_file: Some(region.clone()),
        });
        assert!(!dir.exists() && !region.exists());
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// `due_by` counts exactly the messages of a publisher due by a given time: the
    /// last one counted is due then or before, the next one after (unless capped).
    #[test]
    fn a_publisher_counts_exactly_its_messages_due_by_a_time() {
        let start = Instant::now();
        let interval = Duration::from_nanos(733);
        for (of, index) in [(1, 0), (3, 0), (3, 2), (4, 1)] {
            let share = Share {
                index,
                of,
                messages: None,
                deadline: None,
                start,
                stamp_ids: false,
            };
            for offset_ns in (0..200_000u64).step_by(997) {
                let now = start + Duration::from_nanos(offset_ns);
                let n = share.due_by(now, interval, 0, u64::MAX);
                if n > 0 {
                    assert!(
                        share.due(n - 1, interval) <= now,
                        "{of}/{index} {offset_ns}"
                    );
                }
                assert!(share.due(n, interval) > now, "{of}/{index} {offset_ns}");
                assert_eq!(share.due_by(now, interval, 5, 2), n.min(7), "capped");
            }
        }
    }

    #[test]
    fn ack_2_throughput_is_also_measured_against_the_group_commit_fdatasync() {
        let figures = serde_json::json!({
            "ack": 2,
            "mb_per_s": 100.0,
            "append_to_ack_us": {"p50": 3000, "p99": 6000},
            "ceilings": [
                {"name": "loopback_tcp streams=1 chunk=524288", "mb_per_s": 1000.0},
                {"name": "loopback_tcp streams=2 chunk=524288", "mb_per_s": 9999.0},
                {"name": "loopback_round_trip request=1024 reply=16", "mb_per_s": 9.0, "p50_us": 60.0, "p99_us": 100.0},
                {"name": "fdatasync write=1048576", "mb_per_s": 400.0},
                {"name": "fdatasync write=4194304", "mb_per_s": 500.0},
            ],
        });
        let r = ceiling_ratios(&figures);
        assert_eq!(r["mb_per_s_to_loopback_tcp"], 0.1, "the one-stream ceiling");
        assert_eq!(
            r["mb_per_s_to_fdatasync"], 0.2,
            "the group-commit size, last"
        );
        assert_eq!(r["append_to_ack_p50_over_loopback_round_trip"], 50.0);
        assert_eq!(r["append_to_ack_p99_over_loopback_round_trip"], 60.0);
        assert!(r.get("mb_per_s_to_loopback_tcp_ring").is_none());
        assert!(r.get("e2e_p50_over_loopback_round_trip").is_none());
        // Without ceilings there is nothing to compare with.
        let bare = serde_json::json!({"ack": 1, "mb_per_s": 1.0, "ceilings": []});
        assert_eq!(ceiling_ratios(&bare), serde_json::json!({}));
    }
}
