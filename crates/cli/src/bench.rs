//! `embarcadero bench`: publish-only and publish+subscribe runs against an embedded
//! server (or a running one), with the machine's ceilings measured in the same run.

use crate::publish::report;
use crate::CliResult;
use embarcadero_bench::ceilings::{measure_all, CeilingPlan};
use embarcadero_client::{
    Admin, LatencySummary, Publisher, PublisherConfig, PublisherStats, Subscriber,
    SubscriberConfig, TopicSpec,
};
use embarcadero_server::{Server, ServerConfig};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// `publish`: publish-only; `e2e`: publish while one subscriber reads in order;
    /// `subscribe`: fill the topic, then time one subscriber reading it all from the
    /// start.
    #[arg(long, default_value = "publish", value_parser = ["publish", "e2e", "subscribe"])]
    pub mode: String,
    /// Publishers running in parallel (each its own client, connections and
    /// batches); the total and the rate are split between them.
    #[arg(long, default_value_t = 1)]
    pub publishers: usize,
    /// Order level of the benchmark topic.
    #[arg(long, default_value_t = 2)]
    pub order: u8,
    #[arg(long, default_value_t = 1)]
    pub ack: u8,
    /// Replication factor of the benchmark topic (2 or more: disk replicas).
    #[arg(long, default_value_t = 1)]
    pub rf: u8,
    /// Directory of a disk replica of the embedded server (repeat for each replica).
    /// Default: two replicas under a scratch directory on the temporary disk.
    #[arg(long)]
    pub replica_dir: Vec<std::path::PathBuf>,
    /// Message payload size in bytes.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Total payload bytes to publish.
    #[arg(long, default_value_t = 1 << 30)]
    pub total_bytes: u64,
    /// Brokers of the embedded server.
    #[arg(long, default_value_t = 4)]
    pub brokers: u32,
    #[arg(long, default_value_t = 1)]
    pub threads_per_broker: usize,
    #[arg(long, default_value_t = 512 * 1024)]
    pub batch_bytes: usize,
    #[arg(long, default_value_t = 1000)]
    pub linger_us: u64,
    /// Sequencer epoch of the embedded server, microseconds.
    #[arg(long, default_value_t = 500)]
    pub epoch_us: u64,
    /// Directory for the embedded server's region file; tmpfs keeps the kernel from
    /// writing the region back to disk. Default: /dev/shm when it exists.
    #[arg(long)]
    pub region_dir: Option<std::path::PathBuf>,
    /// Wait for the round-robin queue instead of deflecting to the next when it is full.
    #[arg(long)]
    pub no_deflect: bool,
    /// Publish at this fixed rate (MB/s of payload) instead of as fast as possible, on a
    /// schedule fixed in advance (a late message is not excused by the lateness of the
    /// ones before it), to measure latency below saturation. The schedule starts once
    /// every publisher has connected; append-to-ack latency runs from the due time of a
    /// batch's first message.
    #[arg(long)]
    pub rate: Option<f64>,
    /// With --rate: first publish this many messages on a schedule of their own at the
    /// same rate, wait for their acknowledgements, and leave them out of every figure
    /// (counts, throughput, latency); the measured schedule starts after them.
    #[arg(long, default_value_t = 0, requires = "rate")]
    pub warmup_messages: u64,
    /// Use a running server instead of starting an embedded one.
    #[arg(long)]
    pub control: Option<String>,
    /// Also measure loopback TCP, memcpy and fdatasync ceilings in this run.
    #[arg(long)]
    pub ceilings: bool,
    /// Print every figure as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: BenchArgs) -> CliResult {
    if args.warmup_messages > 0 && args.mode != "publish" {
        return Err("--warmup-messages is for --mode publish".into());
    }
    let count = (args.total_bytes / args.size.max(1) as u64).max(1);
    let scratch = tempdir()?;
    let mut server = None;
    let mut region_file = None;
    let control = match &args.control {
        Some(c) => c.clone(),
        None => {
            let mut config = ServerConfig {
                data_dir: scratch.join("data"),
                base_port: 0,
                control_port: 0,
                brokers: args.brokers,
                ..ServerConfig::default()
            };
            config.sequencer.epoch_us = args.epoch_us;
            config.replication.dirs = args.replica_dir.clone();
            let region_dir = args.region_dir.clone().unwrap_or_else(|| {
                let shm = std::path::PathBuf::from("/dev/shm");
                if shm.is_dir() {
                    shm
                } else {
                    scratch.clone()
                }
            });
            config.region.path =
                region_dir.join(format!("embarcadero-bench-{}.region", std::process::id()));
            region_file = Some(config.region.path.clone());
            let s = Server::start(config).map_err(|e| e.to_string())?;
            let addr = s.control_addr().to_string();
            server = Some(s);
            addr
        }
    };
    let topic = format!("bench-{}-{}", args.order, std::process::id());
    Admin::new(&control)
        .create_topic(&TopicSpec::new(&topic, args.order).replicated(args.rf))
        .map_err(|e| e.to_string())?;
    let subscriber = if args.mode == "e2e" {
        let mut sub = Subscriber::connect(&control, &topic, SubscriberConfig::default())
            .map_err(|e| e.to_string())?;
        Some(std::thread::spawn(
            move || -> Result<(u64, Instant, Histogram<u64>), String> {
                let mut received = 0u64;
                let mut e2e = Histogram::<u64>::new(3).expect("histogram");
                while received < count {
                    sub.poll_with(Duration::from_secs(30), |m| {
                        if received.is_multiple_of(64) {
                            let now = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .map(|d| d.as_nanos() as u64)
                                .unwrap_or(0);
                            let _ = e2e.record(now.saturating_sub(m.publish_ts_ns) / 1000 + 1);
                        }
                        received += 1;
                    })
                    .map_err(|e| e.to_string())?;
                }
                Ok((received, Instant::now(), e2e))
            },
        ))
    } else {
        None
    };
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(count).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} messages {per_sec} eta {eta}")
                .expect("template"),
        )
    } else {
        ProgressBar::hidden()
    };
    let publisher_config = PublisherConfig {
        ack_level: args.ack,
        batch_bytes: args.batch_bytes,
        linger: Duration::from_micros(args.linger_us),
        threads_per_broker: args.threads_per_broker,
        deflect: !args.no_deflect,
        ..PublisherConfig::default()
    };
    let publishers = args.publishers.max(1);
    // With --rate, the publishers connect first and the schedule starts when all have.
    let ready = std::sync::Barrier::new(publishers);
    let schedule_start = std::sync::OnceLock::new();
    let warmup_start = std::sync::OnceLock::new();
    let progress = AtomicU64::new(0);
    let cpu_before = process_cpu_seconds();
    let start = Instant::now();
    let results: Vec<Result<PublisherRun, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..publishers)
            .map(|p| {
                // Publisher p takes every publishers-th message of the schedule.
                let split =
                    |n: u64| n / publishers as u64 + u64::from((p as u64) < n % publishers as u64);
                let share = split(count);
                let (control, topic, config) = (&control, &topic, publisher_config.clone());
                let (progress, args) = (&progress, &args);
                let plan = Share {
                    index: p,
                    of: publishers,
                    messages: share,
                    warmup: split(args.warmup_messages),
                    ready: &ready,
                    schedule_start: &schedule_start,
                    warmup_start: &warmup_start,
                };
                scope.spawn(move || run_publisher(control, topic, config, args, plan, progress))
            })
            .collect();
        while handles.iter().any(|h| !h.is_finished()) {
            bar.set_position(progress.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(100));
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a publisher thread panicked".into()))
            })
            .collect()
    });
    let runs = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    // A fixed-rate run's throughput is over its schedule (connecting is not part of it).
    let start = schedule_start.get().copied().unwrap_or(start);
    // Up to the last acknowledgement, not to when the loop above (which polls every
    // 100 ms) saw the publishers finish.
    let publish_elapsed = runs
        .iter()
        .map(|r| r.flushed_at)
        .max()
        .unwrap_or_else(Instant::now)
        .saturating_duration_since(start);
    let stats = merge_stats(&runs);
    let behind_max = runs.iter().map(|r| r.behind_max).max().unwrap_or_default();
    // Subscribe-only: the topic is full now; one subscriber reads it all from the start.
    let subscribe_only = if args.mode == "subscribe" {
        let mut sub = Subscriber::connect(&control, &topic, SubscriberConfig::default())
            .map_err(|e| e.to_string())?;
        let sub_start = Instant::now();
        let mut received = 0u64;
        while received < count {
            sub.poll_with(Duration::from_secs(30), |_| received += 1)
                .map_err(|e| {
                    format!("{e} (a memory-only topic keeps about the region's log memory: lower --total-bytes, or read from disk with --rf 2)")
                })?;
        }
        Some((received, sub_start.elapsed()))
    } else {
        None
    };
    let e2e = match subscriber {
        Some(handle) => {
            let (received, done, hist) = handle
                .join()
                .map_err(|_| "subscriber thread panicked".to_string())??;
            Some((received, done.duration_since(start), hist))
        }
        None => None,
    };
    bar.finish_and_clear();
    let cpu = process_cpu_seconds() - cpu_before;
    let elapsed = match (&e2e, &subscribe_only) {
        (Some(e), _) => e.1,
        (_, Some((_, t))) => *t,
        _ => publish_elapsed,
    };
    let bytes = stats.bytes as f64;
    let ceilings = if args.ceilings {
        // TCP in the publisher's batch size; fdatasync on the replicas' disk, in 1 MiB
        // writes and in the replicas' group-commit size.
        let mut plan = CeilingPlan::new(args.replica_dir.first().unwrap_or(&scratch), false);
        plan.tcp_chunk_bytes = args.batch_bytes;
        let group_commit = ServerConfig::default().replication.group_commit_bytes as usize;
        if args.rf >= 2 && !plan.sync_write_bytes.contains(&group_commit) {
            plan.sync_write_bytes.push(group_commit);
        }
        measure_all(&plan).map_err(|e| format!("cannot measure the machine's ceilings: {e}"))?
    } else {
        Vec::new()
    };
    let mb_s = bytes / elapsed.as_secs_f64() / 1e6;
    let embedded = server.is_some();
    // Per-stage time from the server's counters (cumulative: exact for an embedded
    // server, which served only this run).
    let stage_ms_per_gb: std::collections::BTreeMap<String, f64> = stage_nanos(&control)
        .into_iter()
        .map(|(stage, ns)| (stage, ns as f64 / 1e6 / (bytes / 1e9)))
        .collect();
    let figures = serde_json::json!({
        "mode": args.mode,
        "publishers": publishers,
        "order": args.order,
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
        "deflect": !args.no_deflect,
        "slow_queue": std::env::var("EMBARCADERO_SLOW_CONSUMER_QUEUE").ok(),
        "slow_queue_ms": std::env::var("EMBARCADERO_SLOW_CONSUMER_MS").ok(),
        "region_file": region_file.as_ref().map(|p| p.display().to_string()),
        "seconds": elapsed.as_secs_f64(),
        "publish_seconds": publish_elapsed.as_secs_f64(),
        "publish_mb_per_s": bytes / publish_elapsed.as_secs_f64() / 1e6,
        "per_publisher_append_to_ack_us": runs.iter().map(|r| &r.stats.append_to_ack_us).collect::<Vec<_>>(),
        "mb_per_s": mb_s,
        "messages_per_s": stats.messages as f64 / elapsed.as_secs_f64(),
        "ack_latency_us": stats.ack_latency_us,
        "append_to_ack_us": stats.append_to_ack_us,
        "rate_mb_per_s": args.rate,
        "warmup_messages": args.warmup_messages,
        "schedule_max_lateness_us": args.rate.map(|_| behind_max.as_micros() as u64),
        "subscribe_only_seconds": subscribe_only.as_ref().map(|(_, t)| t.as_secs_f64()),
        "e2e_latency_us": e2e.as_ref().map(|(_, _, h)| serde_json::json!({
            "p50": h.value_at_quantile(0.5),
            "p99": h.value_at_quantile(0.99),
            "p999": h.value_at_quantile(0.999),
            "max": h.max(),
            "samples": h.len(),
        })),
        "process_cpu_seconds_per_gb": embedded.then(|| cpu / (bytes / 1e9)),
        "queues": stats.queues,
        "stage_ms_per_gb": stage_ms_per_gb,
        "ceilings": ceilings,
    });
    drop(server);
    let _ = std::fs::remove_dir_all(&scratch);
    if let Some(f) = &region_file {
        let _ = std::fs::remove_file(f);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&figures).expect("json"));
        return Ok(());
    }
    println!(
        "mode {}  order {}  ack {}  rf {}  {} B messages  {} brokers x {} connections  {} publisher(s)",
        args.mode,
        args.order,
        args.ack,
        args.rf,
        args.size,
        args.brokers,
        args.threads_per_broker,
        publishers
    );
    report(&stats, publish_elapsed, false, args.ack);
    if let Some((received, t, h)) = &e2e {
        println!(
            "subscriber received {received} messages in {:.3} s: {:.1} MB/s; end-to-end latency p50 {} us, p99 {} us",
            t.as_secs_f64(),
            mb_s,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99)
        );
    }
    if let Some((received, t)) = &subscribe_only {
        println!(
            "subscriber read {received} messages from position 0 in {:.3} s: {:.1} MB/s",
            t.as_secs_f64(),
            mb_s
        );
    }
    if embedded {
        println!(
            "process CPU (server and client): {:.2} s per GB",
            cpu / (bytes / 1e9)
        );
    }
    if !stage_ms_per_gb.is_empty() {
        println!("time per stage, ms per GB of payload (summed over brokers):");
        for (stage, ms) in &stage_ms_per_gb {
            println!("  {stage:<16} {ms:>9.1}");
        }
    }
    for c in figures["ceilings"].as_array().into_iter().flatten() {
        let ceiling = c["mb_per_s"].as_f64().unwrap_or(0.0);
        println!(
            "ceiling {:<28} {:>9.1} MB/s   this run = {:.0}% of it",
            c["name"].as_str().unwrap_or("?"),
            ceiling,
            100.0 * mb_s / ceiling.max(1e-9)
        );
    }
    Ok(())
}

/// What one publisher of the benchmark did.
struct PublisherRun {
    stats: PublisherStats,
    sealed: Histogram<u64>,
    appended: Histogram<u64>,
    /// Worst lateness against the fixed schedule (`--rate`).
    behind_max: Duration,
    /// When everything it published was acknowledged.
    flushed_at: Instant,
}

/// One publisher's part of the run.
#[derive(Clone, Copy)]
struct Share<'a> {
    index: usize,
    of: usize,
    messages: u64,
    /// Its part of the warm-up (`--warmup-messages`).
    warmup: u64,
    /// Every publisher waits here once connected (or failed to) ...
    ready: &'a std::sync::Barrier,
    /// ... and the schedule starts at the instant the last one to arrive sets here
    /// (the warm-up's in `warmup_start`).
    schedule_start: &'a std::sync::OnceLock<Instant>,
    warmup_start: &'a std::sync::OnceLock<Instant>,
}

impl Share<'_> {
    /// Waits for every publisher, then returns the common start of a schedule.
    fn start(&self, at: &std::sync::OnceLock<Instant>) -> Instant {
        if self.ready.wait().is_leader() {
            let _ = at.set(Instant::now());
        }
        self.ready.wait();
        *at.get().expect("set by the barrier's leader")
    }
}

/// Publishes this publisher's share on its part of the schedule: with `--rate`,
/// message i of publisher p is due at start + (i * publishers + p) * interval (fixed in
/// advance: a late message is not excused by the lateness of the ones before it), and
/// is published with that due time, which its batch's append-to-ack latency starts from.
/// With `--warmup-messages`, a warm-up on a schedule of its own comes first; everything it
/// published is acknowledged before the measured schedule starts, and taken out of the
/// figures.
fn run_publisher(
    control: &str,
    topic: &str,
    config: PublisherConfig,
    args: &BenchArgs,
    share: Share,
    progress: &AtomicU64,
) -> Result<PublisherRun, String> {
    let publisher = Publisher::connect(control, topic, config).map_err(|e| e.to_string());
    let payload: Vec<u8> = (0..args.size).map(|i| (i % 251) as u8).collect();
    let interval = args
        .rate
        .map(|mb_s| Duration::from_secs_f64(args.size as f64 / (mb_s * 1e6)));
    // Every publisher, even one that failed to connect or to warm up, takes its place at
    // each barrier, so none waits forever.
    let warmed = match interval {
        Some(interval) if args.warmup_messages > 0 => {
            let start = share.start(share.warmup_start);
            Some(publisher.as_ref().map_err(Clone::clone).and_then(|p| {
                pace(
                    p,
                    &payload,
                    &share,
                    share.warmup,
                    Some((interval, start)),
                    None,
                )?;
                p.flush().map_err(|e| e.to_string())?;
                let (sealed, appended) = p.latency_histograms();
                Ok((p.stats(), sealed, appended))
            }))
        }
        _ => None,
    };
    let start = interval.map(|interval| (interval, share.start(share.schedule_start)));
    let publisher = publisher?;
    let warmed = warmed.transpose()?;
    let behind_max = pace(
        &publisher,
        &payload,
        &share,
        share.messages,
        start,
        Some(progress),
    )?;
    publisher.flush().map_err(|e| e.to_string())?;
    let flushed_at = Instant::now();
    let (mut sealed, mut appended) = publisher.latency_histograms();
    let mut stats = publisher.close().map_err(|e| e.to_string())?;
    if let Some((before, sealed0, appended0)) = warmed {
        // The warm-up's batches were all acknowledged before the measured ones started.
        let _ = sealed.subtract(&sealed0);
        let _ = appended.subtract(&appended0);
        stats.messages -= before.messages;
        stats.bytes -= before.bytes;
        stats.batches -= before.batches;
        stats.acked_batches -= before.acked_batches;
        stats.ack_latency_us = LatencySummary::of(&sealed);
        stats.append_to_ack_us = LatencySummary::of(&appended);
    }
    Ok(PublisherRun {
        stats,
        sealed,
        appended,
        behind_max,
        flushed_at,
    })
}

/// Publishes `messages` messages: on the schedule `(interval, start)` if given, else as
/// fast as the publisher takes them. Returns the worst lateness against the schedule.
fn pace(
    publisher: &Publisher,
    payload: &[u8],
    share: &Share,
    messages: u64,
    schedule: Option<(Duration, Instant)>,
    progress: Option<&AtomicU64>,
) -> Result<Duration, String> {
    let mut behind_max = Duration::ZERO;
    for i in 0..messages {
        if let Some((interval, start)) = schedule {
            let slot = i * share.of as u64 + share.index as u64;
            let due = start + interval.mul_f64(slot as f64);
            let now = Instant::now();
            if due > now {
                // Sleep, do not spin: a spinning publisher would take one of the two
                // cores from the system being measured. Messages that fall due while
                // it sleeps go out together when it wakes.
                std::thread::sleep(due - now);
            }
            // Lateness at the publish, wake-up delay included (as the peers' generators
            // report it).
            behind_max = behind_max.max(Instant::now().saturating_duration_since(due));
            publisher
                .publish_due(payload, due)
                .map_err(|e| e.to_string())?;
        } else {
            publisher.publish(payload).map_err(|e| e.to_string())?;
        }
        if let Some(progress) = progress.filter(|_| i % 1024 == 1023) {
            progress.fetch_add(1024, Ordering::Relaxed);
        }
    }
    Ok(behind_max)
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
    PublisherStats {
        client_id: runs.first().map_or(0, |r| r.stats.client_id),
        messages: sum(|s| s.messages),
        bytes: sum(|s| s.bytes),
        batches: sum(|s| s.batches),
        acked_batches: sum(|s| s.acked_batches),
        ack_latency_us: LatencySummary::of(&sealed),
        append_to_ack_us: LatencySummary::of(&appended),
        queues: runs.iter().flat_map(|r| r.stats.queues.clone()).collect(),
    }
}

/// Sums `embarcadero_stage_nanoseconds_total` per stage from the server's /metrics.
fn stage_nanos(control: &str) -> std::collections::BTreeMap<String, u64> {
    use std::io::{Read, Write};
    let mut totals = std::collections::BTreeMap::new();
    let Ok(mut s) = std::net::TcpStream::connect(control) else {
        return totals;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").is_err() {
        return totals;
    }
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    for line in text.lines() {
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

/// User + system CPU time of this process (server and client together when embedded).
fn process_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of /proc/pid/stat: 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}
