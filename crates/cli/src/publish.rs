//! `embarcadero pub`.

use crate::{CliResult, ControlArg};
use embarcadero_client::{Admin, Publisher, PublisherConfig, PublisherStats, TopicInfo};
use indicatif::{ProgressBar, ProgressState, ProgressStyle};
use std::io::{BufRead, IsTerminal};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
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
    /// Generate this many messages instead of reading stdin.
    #[arg(long)]
    pub count: Option<u64>,
    /// Payload size of generated messages, in bytes.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Print the final summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn config_of(args: &PubArgs, ack_level: u8) -> PublisherConfig {
    PublisherConfig {
        ack_level,
        batch_bytes: args.batch_bytes,
        linger: Duration::from_micros(args.linger_us),
        threads_per_broker: args.threads_per_broker,
        ..PublisherConfig::default()
    }
}

pub fn run(args: PubArgs) -> CliResult {
    let topic = Admin::new(&args.control.control)
        .describe_topic(&args.topic)
        .map_err(|e| e.to_string())?;
    let ack = args.ack.unwrap_or(topic.default_ack);
    check_ack_level(&topic, ack)?;
    let publisher = Publisher::connect(&args.control.control, &args.topic, config_of(&args, ack))
        .map_err(|e| e.to_string())?;
    if args.count.is_some() {
        check_size(args.size, publisher.max_message_bytes())?;
    }
    let start = Instant::now();
    let bar = progress(args.count);
    let mut ledger = AckLedger::default();
    let sent = match args.count {
        Some(count) => publish_generated(&publisher, args.size, count, &bar, &mut ledger),
        None => publish_stdin(&publisher, &bar, &mut ledger),
    };
    // Everything published before a failure is still waited for (a bad line fails only
    // itself), so that the count of acknowledged messages is as high as it truly is.
    let flushed = publisher.flush().map_err(|e| e.to_string());
    bar.finish_and_clear();
    if let Err(cause) = sent.and(flushed) {
        let acked = ledger.acked_messages(publisher.acked_prefix());
        return Err(failure_report(&args, &cause, acked, ledger.published));
    }
    let stats = publisher.close().map_err(|e| {
        format!("{e}; not every message was acknowledged, so the publish did not complete")
    })?;
    report(&stats, start.elapsed(), args.json, ack);
    Ok(())
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

fn publish_generated(
    publisher: &Publisher,
    size: usize,
    count: u64,
    bar: &ProgressBar,
    ledger: &mut AckLedger,
) -> Result<(), String> {
    let payload: Vec<u8> = (0..size).map(|i| b'a' + (i % 26) as u8).collect();
    for i in 0..count {
        publisher.publish(&payload).map_err(|e| e.to_string())?;
        ledger.record(publisher.batches_sealed());
        if i % 4096 == 0 {
            bar.set_position(i);
        }
    }
    Ok(())
}

/// One message per line of stdin (without its line ending).
fn publish_stdin(
    publisher: &Publisher,
    bar: &ProgressBar,
    ledger: &mut AckLedger,
) -> Result<(), String> {
    let stdin = std::io::stdin();
    let mut lock = stdin.lock();
    let mut line = Vec::new();
    loop {
        line.clear();
        let line_number = ledger.published + 1;
        let read = lock
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("cannot read line {line_number} of stdin: {e}"))?;
        if read == 0 {
            return Ok(());
        }
        while matches!(line.last(), Some(b'\n' | b'\r')) {
            line.pop();
        }
        publisher
            .publish(&line)
            .map_err(|e| format!("line {line_number} was not published: {e}"))?;
        ledger.record(publisher.batches_sealed());
        bar.set_position(ledger.published);
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

pub fn report(stats: &PublisherStats, elapsed: Duration, json: bool, ack: u8) {
    let secs = elapsed.as_secs_f64();
    let mb_s = stats.bytes as f64 / secs / 1e6;
    if json {
        let v = serde_json::json!({
            "messages": stats.messages,
            "bytes": stats.bytes,
            "batches": stats.batches,
            "acked_batches": stats.acked_batches,
            "seconds": secs,
            "mb_per_s": mb_s,
            "messages_per_s": stats.messages as f64 / secs,
            "ack_level": ack,
            "ack_latency_us": stats.ack_latency_us,
            "append_to_ack_us": stats.append_to_ack_us,
            "queues": stats.queues,
            "client_id": stats.client_id,
        });
        say!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return;
    }
    say!(
        "published {}, {} bytes in {:.3} s: {:.1} MB/s, {:.0} msg/s",
        crate::count_of(stats.messages, "message", "messages"),
        stats.bytes,
        secs,
        mb_s,
        stats.messages as f64 / secs
    );
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
    let waits: u64 = stats.queues.iter().map(|q| q.producer_waits).sum();
    let deflected: u64 = stats.queues.iter().map(|q| q.deflected).sum();
    say!(
        "producer waited {} (all queues full), deflected {}",
        crate::count_of(waits, "time", "times"),
        crate::count_of(deflected, "batch", "batches")
    );
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
