//! `embarcadero pub`.

mod source;

use crate::{CliResult, ControlArg};
use embarcadero_client::{Admin, Publisher, PublisherConfig, PublisherStats, TopicInfo, Transport};
use indicatif::{ProgressBar, ProgressState, ProgressStyle};
use source::Source;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone)]
pub struct PubArgs {
    /// Topic to publish to.
    pub topic: String,
    #[command(flatten)]
    pub control: ControlArg,
    /// 0: fire and forget; 1: acknowledged once ordered (or written, order 0); 2: durable.
    /// [default: the topic's default ack, set by `topic create --default-ack`]
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub ack: Option<u8>,
    /// Seal a batch once it holds this many bytes.
    #[arg(long, default_value_t = 512 * 1024, value_parser = crate::at_least_one)]
    pub batch_bytes: usize,
    /// Seal a non-empty batch at the latest this many microseconds after its first
    /// message; 0: as soon as its connection's sender is free (lowest latency).
    #[arg(long, default_value_t = 1000)]
    pub linger_us: u64,
    /// Connections (and publishing queues) per broker.
    #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
    pub threads_per_broker: usize,
    /// Generate this many messages instead of reading stdin (a load run: its summary adds
    /// the latencies and how the queues fared).
    #[arg(long)]
    pub count: Option<u64>,
    /// Payload size of generated messages, in bytes.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Print the final summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// When the server goes away (a restart), keep trying to reconnect for this many
    /// seconds, then publish every message not yet acknowledged (those whose
    /// acknowledgement was lost with the server are sent again); 0: fail at once.
    #[arg(long, default_value_t = 60)]
    pub retry_for: u64,
    /// How to reach the brokers: `auto` uses a shared-memory channel to each broker on
    /// this host (when the broker allows this user), TCP to the others; `tcp`; `shm`
    /// (an error where shared memory cannot be used).
    #[arg(
        long,
        default_value = "auto",
        env = "EMBARCADERO_TRANSPORT",
        value_name = "auto|tcp|shm"
    )]
    pub transport: Transport,
}

pub fn config_of(args: &PubArgs, ack_level: u8) -> PublisherConfig {
    PublisherConfig {
        ack_level,
        batch_bytes: args.batch_bytes,
        linger: Duration::from_micros(args.linger_us),
        threads_per_broker: args.threads_per_broker,
        transport: args.transport,
        ..PublisherConfig::default()
    }
}

pub fn run(args: PubArgs) -> CliResult {
    let topic = Admin::new(&args.control.control)
        .describe_topic(&args.topic)
        .map_err(|e| e.to_string())?;
    let ack = args.ack.unwrap_or(topic.default_ack);
    check_ack_level(&topic, ack)?;
    let mut publisher =
        Publisher::connect(&args.control.control, &args.topic, config_of(&args, ack))
            .map_err(|e| e.to_string())?;
    let mut source = source_of(&args, &publisher)?;
    let start = Instant::now();
    let bar = progress(args.count);
    let tally = Arc::new(Tally::default());
    report_when_interrupted(&args, tally.clone())?;
    let mut reconnects = 0u64;
    loop {
        let base = source.position();
        let mut ledger = AckLedger::default();
        let outcome = publish_all(&publisher, &mut source, &bar, &mut ledger, &tally, ack);
        let acked = base + ledger.acked_messages(publisher.acked_prefix());
        if tally.interrupted() {
            let published = base + ledger.published;
            let acked = if outcome.is_ok() { published } else { acked };
            bar.finish_and_clear();
            tally.exit_interrupted(&args, acked, published);
        }
        match outcome {
            Ok(()) => break,
            Err(Failure::Server(e)) if e.server_gone() && args.retry_for > 0 => {
                bar.suspend(|| -> CliResult {
                    publisher = reconnect(&args, ack, acked, &e).map_err(|why| {
                        failure_report(&args, &why, acked, base + ledger.published)
                    })?;
                    Ok(())
                })?;
                source.rewind(acked);
                reconnects += 1;
            }
            Err(f) => {
                bar.finish_and_clear();
                return Err(failure_report(
                    &args,
                    &f.to_string(),
                    acked,
                    base + ledger.published,
                ));
            }
        }
    }
    bar.finish_and_clear();
    let stats = publisher.close().map_err(|e| {
        format!("{e}; not every message was acknowledged, so the publish did not complete")
    })?;
    // Every message read is acknowledged now; the stats are the last connection's only.
    summarise(
        &args,
        &stats,
        start.elapsed(),
        ack,
        source.position(),
        reconnects,
    );
    Ok(())
}

/// What `pub` publishes: `--count` generated messages, else the lines of stdin.
fn source_of(args: &PubArgs, publisher: &Publisher) -> Result<Source, String> {
    Ok(match args.count {
        Some(count) => {
            check_size(args.size, publisher.max_message_bytes())?;
            Source::generated(args.size, count)
        }
        None => {
            if std::io::stdin().is_terminal() {
                eprintln!("reading messages from the terminal, one per line; Ctrl-D ends");
            }
            Source::lines(Box::new(std::io::stdin().lock()))
        }
    })
}

/// Prints the summary of a publish that ended well: `stats` of the last connection,
/// `acked` messages of the whole input, after `reconnects` reconnections.
fn summarise(
    args: &PubArgs,
    stats: &PublisherStats,
    elapsed: Duration,
    ack: u8,
    acked: u64,
    reconnects: u64,
) {
    if args.json {
        let mut v = summary_json(stats, elapsed, ack);
        v["acked_messages"] = acked.into();
        v["reconnects"] = reconnects.into();
        say!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return;
    }
    // Lines piped in get the headline; a load run (`--count`) its latencies and queues.
    match args.count {
        Some(_) => report(stats, elapsed, false, ack),
        None => headline(stats, elapsed),
    }
    if reconnects > 0 {
        say!(
            "{} acknowledged in all; reconnected {} after losing the server, and the figures above count from the last reconnection",
            crate::count_of(acked, "message", "messages"),
            crate::count_of(reconnects, "time", "times")
        );
    }
}

/// Why publishing stopped: the publisher's error (which may mean the server is gone),
/// or anything else (unreadable input), already worded.
enum Failure {
    Server(embarcadero_client::Error),
    Other(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Server(e) => write!(f, "{e}"),
            Failure::Other(text) => f.write_str(text),
        }
    }
}

/// Publishes every message `source` still has, then waits for their acknowledgements.
/// Everything published before a failure is still waited for (a bad line fails only
/// itself), so that the count of acknowledged messages is as high as it truly is.
/// What `pub` has acknowledged and appended so far, kept for the report a SIGINT or
/// SIGTERM prints (the acknowledged count may be up to a batch low, as a failure's is),
/// and whether it was interrupted.
#[derive(Default)]
struct Tally {
    acked: AtomicU64,
    published: AtomicU64,
    /// Set by the first SIGINT or SIGTERM: read no more input, wait for what was sent.
    interrupted: AtomicBool,
    /// Held while the one report of an interrupted run is printed and the process exits
    /// (by the main thread once everything sent is acknowledged, or by the handler).
    exiting: Mutex<()>,
}

impl Tally {
    fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::Acquire)
    }

    /// Exits as [`Self::exit_interrupted`] with the counts as last recorded (the
    /// acknowledged one may be a batch low).
    fn exit_as_recorded(&self, args: &PubArgs) -> ! {
        let acked = self.acked.load(Ordering::Acquire);
        self.exit_interrupted(args, acked, self.published.load(Ordering::Acquire))
    }

    /// Prints the report of an interrupted run and exits 130.
    fn exit_interrupted(&self, args: &PubArgs, acked: u64, published: u64) -> ! {
        let _one = self.exiting.lock().unwrap_or_else(|p| p.into_inner());
        let text = failure_report(args, "interrupted", acked, published.max(acked));
        crate::logging::note_line("ERROR", format_args!("error: {text}"));
        std::process::exit(130);
    }
}

/// How long an interrupted `pub` waits for the acknowledgements of what it sent.
const INTERRUPT_GRACE: Duration = Duration::from_secs(3);

/// On the first SIGINT or SIGTERM `pub` reads no more input and waits (up to
/// [`INTERRUPT_GRACE`]) for the acknowledgements of what it sent, so that the line to
/// resume from is exact and a resume repeats nothing; the main thread then reports and
/// exits 130. If that takes longer (a server gone, a read of input that waits), on a
/// second signal, or reading a terminal, it says what it knows at once (the count may
/// then be a batch low) and exits 130, rather than vanishing.
fn report_when_interrupted(args: &PubArgs, tally: Arc<Tally>) -> CliResult {
    let args = args.clone();
    // Someone typing at a terminal has nothing in flight, and `pub` waits in its read.
    let at_once = args.count.is_none() && std::io::stdin().is_terminal();
    ctrlc::set_handler(move || {
        if tally.interrupted.swap(true, Ordering::AcqRel) || at_once {
            tally.exit_as_recorded(&args);
        }
        eprintln!(
            "interrupted: waiting up to {} s for the acknowledgements of what was sent (again to stop now)",
            INTERRUPT_GRACE.as_secs()
        );
        let (args, tally) = (args.clone(), tally.clone());
        std::thread::spawn(move || {
            std::thread::sleep(INTERRUPT_GRACE);
            tally.exit_as_recorded(&args);
        });
    })
    .map_err(|e| format!("cannot install the signal handler: {e}"))
}

fn publish_all(
    publisher: &Publisher,
    source: &mut Source,
    bar: &ProgressBar,
    ledger: &mut AckLedger,
    tally: &Tally,
    ack: u8,
) -> Result<(), Failure> {
    let base = source.position();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let watcher =
            (ack > 0).then(|| scope.spawn(|| warn_while_unacknowledged(publisher, bar, &done)));
        let sent = publish_from(publisher, source, bar, ledger, tally, base);
        let flushed = publisher.flush().map_err(Failure::Server);
        done.store(true, std::sync::atomic::Ordering::Release);
        if let Some(w) = watcher {
            w.thread().unpark();
        }
        sent.and(flushed)
    })
}

fn publish_from(
    publisher: &Publisher,
    source: &mut Source,
    bar: &ProgressBar,
    ledger: &mut AckLedger,
    tally: &Tally,
    base: u64,
) -> Result<(), Failure> {
    let lines = source.is_lines();
    loop {
        if tally.interrupted() {
            return Ok(());
        }
        let number = source.position() + 1;
        let Some(message) = source.next().map_err(Failure::Other)? else {
            return Ok(());
        };
        publisher.publish(message).map_err(|e| match &e {
            e if e.server_gone() => Failure::Server(e.clone()),
            e if lines => Failure::Other(format!("line {number} was not published: {e}")),
            _ => Failure::Server(e),
        })?;
        ledger.record(publisher.batches_sealed());
        if lines || number.is_multiple_of(4096) {
            bar.set_position(number);
            // Copies of acknowledged lines are no longer needed for a resend.
            let acked = base + ledger.acked_messages(publisher.acked_prefix());
            source.acknowledged(acked);
            tally.acked.store(acked, Ordering::Release);
            tally
                .published
                .store(base + ledger.published, Ordering::Release);
        }
    }
}

/// A new publisher as soon as the server answers again, within `--retry-for` seconds.
fn reconnect(
    args: &PubArgs,
    ack: u8,
    acked: u64,
    cause: &embarcadero_client::Error,
) -> Result<Publisher, String> {
    eprintln!(
        "note: lost the server ({cause}) with {} acknowledged; reconnecting for up to {} s to publish the rest (any whose acknowledgement was lost with the server are sent again)",
        crate::count_of(acked, "message", "messages"),
        args.retry_for
    );
    let deadline = Instant::now() + Duration::from_secs(args.retry_for);
    let mut pause = Duration::from_millis(50);
    loop {
        match Publisher::connect(&args.control.control, &args.topic, config_of(args, ack)) {
            Ok(p) => {
                eprintln!(
                    "note: reconnected; publishing again from message {}",
                    acked + 1
                );
                return Ok(p);
            }
            Err(e) if e.server_gone() && Instant::now() < deadline => {
                crate::retry_pause(&mut pause)
            }
            Err(e) if e.server_gone() => {
                return Err(format!(
                    "the server did not come back within {} s ({e})",
                    args.retry_for
                ))
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Ack level 2 waits for disk replicas: refused up front with the remedy that fits the
/// topic (orders 0 and 1 cannot have replicas at all, so `--rf 2` would not help).
fn check_ack_level(topic: &TopicInfo, ack: u8) -> CliResult {
    if ack < 2 || topic.replication_factor >= 2 {
        return Ok(());
    }
    if topic.order < 2 {
        return Err(format!(
            "ack level 2 (durable) needs disk replicas, and topic {} has order {}, which cannot have them (disk replicas copy the global order); publish with --ack 1, or to a topic created with --order 2 --rf 2",
            topic.name, topic.order
        ));
    }
    Err(format!(
        "ack level 2 (durable) needs disk replicas, but topic {} has replication factor 1 (memory only); publish with --ack 1, or to a topic created with --rf 2 or more",
        topic.name
    ))
}

/// Refuses a generated payload the brokers would refuse anyway, before allocating it
/// (`--size 100000000000` would otherwise abort on the allocation).
fn check_size(size: usize, max_message_bytes: usize) -> CliResult {
    if size > max_message_bytes {
        return Err(format!(
            "--size {size} is larger than the largest message the brokers accept ({max_message_bytes} bytes, broker.max_message_bytes)"
        ));
    }
    Ok(())
}

/// How long sealed batches may go without any acknowledgement before `pub` says so.
const ACK_SILENCE: Duration = Duration::from_secs(3);

/// Warns on stderr while sealed batches wait for acknowledgements that do not come (a
/// broker holding publishers back), and says when they resume, until `done`.
fn warn_while_unacknowledged(
    publisher: &Publisher,
    bar: &ProgressBar,
    done: &std::sync::atomic::AtomicBool,
) {
    let mut acked = publisher.acked_prefix();
    let mut since = Instant::now();
    let mut warned = false;
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        std::thread::park_timeout(Duration::from_millis(200));
        let now_acked = publisher.acked_prefix();
        let waiting = publisher.batches_sealed().saturating_sub(now_acked);
        if now_acked != acked || waiting == 0 {
            if warned {
                bar.suspend(|| eprintln!("note: acknowledgements resumed"));
            }
            (acked, since, warned) = (now_acked, Instant::now(), false);
        } else if !warned && since.elapsed() >= ACK_SILENCE {
            bar.suspend(|| eprintln!(
                "warning: no acknowledgement for {} s ({} waiting): the brokers are holding publishers back, usually for a subscriber of a memory-only topic that does not read, or a disk replica that cannot write (ack 2); `embarcadero status` says which",
                ACK_SILENCE.as_secs(),
                crate::count_of(waiting, "batch", "batches")
            ));
            warned = true;
        }
    }
}

/// Which messages are certainly in which sealed batch, seen from outside the publisher,
/// so that its acknowledged prefix of batches converts to a count of messages.
///
/// After message i is appended, the publisher has sealed `s` batches; message i is in
/// batch `s` (still open) or an earlier one, so it is acknowledged once the first
/// `s + 1` batches are. A batch sealed by the linger thread while i was appended can
/// make the count lower than the truth by the messages of one batch (resuming then
/// sends those again), never higher.
#[derive(Default)]
struct AckLedger {
    /// `first_beyond[b]`: the first message that may be in batch `b` or later.
    first_beyond: Vec<u64>,
    /// Messages appended.
    published: u64,
}

impl AckLedger {
    /// Message number `published` was appended when `sealed` batches were sealed.
    fn record(&mut self, sealed: u64) {
        while self.first_beyond.len() as u64 <= sealed {
            self.first_beyond.push(self.published);
        }
        self.published += 1;
    }

    /// Messages certainly acknowledged when the first `acked_batches` batches are.
    fn acked_messages(&self, acked_batches: u64) -> u64 {
        usize::try_from(acked_batches)
            .ok()
            .and_then(|b| self.first_beyond.get(b).copied())
            .unwrap_or(self.published)
    }
}

/// The error of a failed run: what went wrong, how many messages are acknowledged, and
/// (reading stdin) the line to resume from; with `--json` also a summary on stdout.
fn failure_report(args: &PubArgs, cause: &str, acked: u64, published: u64) -> String {
    assert!(acked <= published, "{acked} acknowledged of {published}");
    let from_stdin = args.count.is_none();
    let resume = acked + 1;
    if args.json {
        let v = serde_json::json!({
            "error": cause,
            "acked_messages": acked,
            "published_messages": published,
            "resume_line": from_stdin.then_some(resume),
        });
        say!("{}", serde_json::to_string_pretty(&v).expect("json"));
    }
    let mut text = format!(
        "{cause}\n{} of {published} acknowledged",
        crate::count_of(acked, "message", "messages")
    );
    if from_stdin {
        text += &format!(
            "; resume from line {resume}: tail -n +{resume} FILE | embarcadero pub {}",
            args.topic
        );
    }
    text
}

fn progress(total: Option<u64>) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let template = match total {
        Some(_) => "{bar:40} {pos}/{len} {messages} {rate} eta {eta}",
        None => "{spinner} {pos} {messages} {rate}",
    };
    let style = ProgressStyle::with_template(template)
        .expect("valid template")
        .with_key(
            "messages",
            |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(if s.pos() == 1 { "message" } else { "messages" });
            },
        )
        // indicatif's own {per_sec} shows four decimals; a whole number reads better.
        .with_key("rate", |s: &ProgressState, w: &mut dyn std::fmt::Write| {
            let _ = write!(w, "{:.0} msg/s", s.per_sec());
        });
    match total {
        Some(n) => ProgressBar::new(n).with_style(style),
        None => ProgressBar::new_spinner().with_style(style),
    }
}

/// A publisher's figures as the JSON `pub --json` prints (one connection's: `messages`
/// and the rates count from its start).
fn summary_json(stats: &PublisherStats, elapsed: Duration, ack: u8) -> serde_json::Value {
    let secs = elapsed.as_secs_f64();
    serde_json::json!({
        "messages": stats.messages,
        "bytes": stats.bytes,
        "batches": stats.batches,
        "acked_batches": stats.acked_batches,
        "seconds": secs,
        "mb_per_s": stats.bytes as f64 / secs / 1e6,
        "messages_per_s": stats.messages as f64 / secs,
        "ack_level": ack,
        "ack_latency_us": stats.ack_latency_us,
        "append_to_ack_us": stats.append_to_ack_us,
        "queues": stats.queues,
        "client_id": stats.client_id,
    })
}

pub fn report(stats: &PublisherStats, elapsed: Duration, json: bool, ack: u8) {
    if json {
        let v = summary_json(stats, elapsed, ack);
        say!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return;
    }
    headline(stats, elapsed);
    if ack > 0 {
        say!(
            "ack latency (seal to ack): p50 {} us, p99 {} us, max {} us over {}",
            stats.ack_latency_us.p50,
            stats.ack_latency_us.p99,
            stats.ack_latency_us.max,
            crate::count_of(stats.ack_latency_us.count, "batch", "batches")
        );
        say!(
            "append to ack (first message of a batch to its ack): p50 {} us, p99 {} us, p99.9 {} us",
            stats.append_to_ack_us.p50, stats.append_to_ack_us.p99, stats.append_to_ack_us.p999
        );
    }
    report_queues(stats);
}

/// The first line of a summary: what was published, how fast.
fn headline(stats: &PublisherStats, elapsed: Duration) {
    let secs = elapsed.as_secs_f64();
    say!(
        "published {}, {} bytes in {:.3} s: {:.1} MB/s, {:.0} msg/s",
        crate::count_of(stats.messages, "message", "messages"),
        stats.bytes,
        secs,
        stats.bytes as f64 / secs / 1e6,
        stats.messages as f64 / secs
    );
}

/// How the publisher's queues fared: producer waits and deflections in all, batches
/// built in place in shared memory, and each queue that waited, deflected or retried
/// after backpressure.
fn report_queues(stats: &PublisherStats) {
    let waits: u64 = stats.queues.iter().map(|q| q.producer_waits).sum();
    let deflected: u64 = stats.queues.iter().map(|q| q.deflected).sum();
    say!(
        "producer waited {} (all queues full), deflected {}",
        crate::count_of(waits, "time", "times"),
        crate::count_of(deflected, "batch", "batches")
    );
    let in_place: u64 = stats.queues.iter().map(|q| q.in_place).sum();
    if in_place > 0 {
        let copied_out: u64 = stats.queues.iter().map(|q| q.copied_out).sum();
        say!(
            "{} of {} built in place in shared-memory rings ({} copied out for room before their ack)",
            in_place,
            crate::count_of(stats.batches, "batch", "batches"),
            copied_out
        );
    }
    for q in &stats.queues {
        if q.producer_waits > 0 || q.deflected > 0 || q.backpressure_retries > 0 {
            say!(
                "  queue {}#{}: {} batches, {} deflected, {} waits, {} backpressure retries",
                q.broker,
                q.connection,
                q.batches,
                q.deflected,
                q.producer_waits,
                q.backpressure_retries
            );
        }
    }
}
