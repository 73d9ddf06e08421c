//! `embarcadero pub`.

use crate::{CliResult, ControlArg};
use embarcadero_client::{Admin, Publisher, PublisherConfig, PublisherStats};
use indicatif::{ProgressBar, ProgressStyle};
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
    let ack = match args.ack {
        Some(ack) => ack,
        None => {
            Admin::new(&args.control.control)
                .describe_topic(&args.topic)
                .map_err(|e| e.to_string())?
                .default_ack
        }
    };
    let publisher = Publisher::connect(&args.control.control, &args.topic, config_of(&args, ack))
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let bar = progress(args.count);
    match args.count {
        Some(count) => {
            let payload: Vec<u8> = (0..args.size).map(|i| b'a' + (i % 26) as u8).collect();
            for i in 0..count {
                publisher.publish(&payload).map_err(|e| e.to_string())?;
                if i % 4096 == 0 {
                    bar.set_position(i);
                }
            }
        }
        None => {
            let stdin = std::io::stdin();
            let mut lock = stdin.lock();
            let mut line = Vec::new();
            let mut n = 0u64;
            loop {
                line.clear();
                let read = lock
                    .read_until(b'\n', &mut line)
                    .map_err(|e| format!("cannot read stdin: {e}"))?;
                if read == 0 {
                    break;
                }
                while matches!(line.last(), Some(b'\n' | b'\r')) {
                    line.pop();
                }
                publisher.publish(&line).map_err(|e| e.to_string())?;
                n += 1;
                bar.set_position(n);
            }
        }
    }
    let stats = publisher.close().map_err(|e| {
        format!("{e}; not every message was acknowledged, so the publish did not complete")
    })?;
    bar.finish_and_clear();
    report(&stats, start.elapsed(), args.json, ack);
    Ok(())
}

fn progress(total: Option<u64>) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    match total {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} messages {per_sec} eta {eta}")
                .expect("valid template"),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} {pos} messages {per_sec}")
                .expect("valid template"),
        ),
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
        "published {} messages, {} bytes in {:.3} s: {:.1} MB/s, {:.0} msg/s",
        stats.messages,
        stats.bytes,
        secs,
        mb_s,
        stats.messages as f64 / secs
    );
    if ack > 0 {
        say!(
            "ack latency (seal to ack): p50 {} us, p99 {} us, max {} us over {} batches",
            stats.ack_latency_us.p50,
            stats.ack_latency_us.p99,
            stats.ack_latency_us.max,
            stats.ack_latency_us.count
        );
        say!(
            "append to ack (first message of a batch to its ack): p50 {} us, p99 {} us, p99.9 {} us",
            stats.append_to_ack_us.p50, stats.append_to_ack_us.p99, stats.append_to_ack_us.p999
        );
    }
    let waits: u64 = stats.queues.iter().map(|q| q.producer_waits).sum();
    let deflected: u64 = stats.queues.iter().map(|q| q.deflected).sum();
    say!("producer waited {waits} times (all queues full), deflected {deflected} batches");
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
