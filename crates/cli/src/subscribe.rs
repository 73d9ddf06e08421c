//! `embarcadero sub`.

use crate::{CliResult, ControlArg};
use base64::Engine;
use embarcadero_client::{
    check_topic_name, Admin, Cursor, MessageRef, Subscriber, SubscriberConfig, Transport,
};
use std::io::Write;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct SubArgs {
    /// Topic to read.
    pub topic: String,
    #[command(flatten)]
    pub control: ControlArg,
    /// Start position: a global position (orders 2, 5), one position per broker
    /// separated by commas (orders 0, 1), `end` for only the messages published from
    /// now on, or `start` (the default): the beginning, that is the first message still
    /// retained.
    #[arg(long, allow_hyphen_values = true)]
    pub from: Option<String>,
    /// Exit after printing this many messages.
    #[arg(long)]
    pub count: Option<u64>,
    /// `text`: the payload, one per line; `jsonl`: one JSON object per message.
    #[arg(long, default_value = "text", value_parser = ["text", "jsonl"])]
    pub format: String,
    /// Give up if no message arrives for this many seconds (default: wait forever).
    #[arg(long)]
    pub idle_timeout_s: Option<u64>,
    /// When the server goes away (a restart), keep trying to reconnect for this many
    /// seconds, then continue from the next message not yet printed; 0: fail at once.
    #[arg(long, default_value_t = 60)]
    pub retry_for: u64,
    /// How to reach the brokers: `auto` reads a shared-memory feed from a broker on this
    /// host (when the broker allows this user), TCP otherwise; `tcp`; `shm` (an error
    /// where shared memory cannot be used).
    #[arg(
        long,
        default_value = "auto",
        env = "EMBARCADERO_TRANSPORT",
        value_name = "auto|tcp|shm"
    )]
    pub transport: Transport,
}

/// Where `--from` starts.
enum Start {
    /// The first message still retained (`--from start`, as the SDKs' `"start"`).
    First,
    Position(Cursor),
    /// The end of the topic when the subscriber starts.
    End,
}

/// How long to wait for more messages right after printing some before flushing the
/// output: short enough that each message shows as it arrives, yet while messages keep
/// coming they are written in large blocks.
const MORE_NOW: Duration = Duration::from_millis(1);

/// How long one poll waits when there is nothing to flush.
const IDLE_POLL: Duration = Duration::from_millis(200);

fn parse_from(from: &str) -> Result<Start, String> {
    let text = from.trim();
    if text.eq_ignore_ascii_case("end") {
        return Ok(Start::End);
    }
    if text.eq_ignore_ascii_case("start") {
        return Ok(Start::First);
    }
    if text.starts_with('-') {
        return Err(format!(
            "--from {from}: positions count from 0 at the start of the topic and cannot be negative; to read only messages published from now on, use --from end"
        ));
    }
    let parts: Result<Vec<u64>, _> = text.split(',').map(|p| p.trim().parse::<u64>()).collect();
    let parts = parts.map_err(|e| {
        format!(
            "--from {from:?}: {e}; give a position like 42, one per broker like 0,0,10,3, start or end"
        )
    })?;
    Ok(Start::Position(if parts.len() == 1 {
        Cursor::Global(parts[0])
    } else {
        Cursor::PerBroker(parts)
    }))
}

pub fn run(args: SubArgs) -> CliResult {
    check_topic_name(&args.topic).map_err(|e| e.to_string())?;
    let start = args.from.as_deref().map(parse_from).transpose()?;
    let mut sub = Subscriber::connect(
        &args.control.control,
        &args.topic,
        SubscriberConfig {
            start: None,
            transport: args.transport,
            ..SubscriberConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let cursor = match start {
        None | Some(Start::First) => None,
        Some(Start::End) => {
            let end = end_of_topic(&args, &sub)?;
            // Says where "now" was: what is published after this line is printed.
            eprintln!(
                "note: starting at the end of topic {} ({})",
                args.topic,
                describe(&end)
            );
            Some(end)
        }
        Some(Start::Position(cursor)) => {
            let cursor = fitted_cursor(&args, &sub, cursor)?;
            if let Cursor::Global(from) = cursor {
                warn_if_beyond_the_end(&args, from);
            }
            Some(cursor)
        }
    };
    if let Some(cursor) = cursor {
        sub.seek(cursor).map_err(|e| e.to_string())?;
    }
    print_messages(&args, &mut sub)
}

/// The position after the last message of the topic now: the next global position
/// (orders 2, 5), or each broker's count of messages written (orders 0, 1).
fn end_of_topic(args: &SubArgs, sub: &Subscriber) -> Result<Cursor, String> {
    let topic = Admin::new(&args.control.control)
        .describe_topic(&args.topic)
        .map_err(|e| e.to_string())?;
    if sub.order() >= 2 {
        return Ok(Cursor::Global(topic.next_position));
    }
    let ends: Vec<u64> = topic.brokers.iter().map(|b| b.messages).collect();
    match ends {
        ends if ends.len() == broker_count(sub) => Ok(Cursor::PerBroker(ends)),
        _ => Err(format!(
            "the server did not describe the end of each broker's log of topic {}; give --from with one position per broker instead",
            args.topic
        )),
    }
}

/// `cursor` in the form the topic's order needs, or an error that says which.
fn fitted_cursor(args: &SubArgs, sub: &Subscriber, cursor: Cursor) -> Result<Cursor, String> {
    sub.fit(cursor)
        .map_err(|m| m.explain(&args.topic, "--from", from_flag))
}

/// Per-broker positions as `--from` takes them and the CLI prints them: `3,0,7`.
fn comma_list(positions: &[u64]) -> String {
    let v: Vec<String> = positions.iter().map(u64::to_string).collect();
    v.join(",")
}

/// `cursor` as the `--from` flag, written out: `--from 3,0,7`.
fn from_flag(cursor: &Cursor) -> String {
    format!("--from {}", cursor_arg(cursor))
}

/// Prints messages until `--count` or the idle timeout. Output is buffered, and flushed
/// as soon as no more messages are immediately available, so a message that arrives
/// alone is printed at once (`sub` behaves like `tail -f`), while a stream of them is
/// written in large blocks.
fn print_messages(args: &SubArgs, sub: &mut Subscriber) -> CliResult {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let (jsonl, ordered) = (args.format == "jsonl", sub.order() >= 2);
    let limit = args.count.unwrap_or(u64::MAX);
    let mut printed = 0u64;
    let mut unflushed = false;
    let mut last_message = Instant::now();
    let mut write_error = None;
    while printed < limit {
        let wait = if unflushed { MORE_NOW } else { IDLE_POLL };
        let polled = sub.poll_with(wait, |m| {
            if printed >= limit || write_error.is_some() {
                return;
            }
            if let Err(e) = print_message(&mut out, &m, jsonl, ordered) {
                write_error = Some(e);
            }
            printed += 1;
        });
        let n = match polled {
            Ok(n) => n,
            Err(e) if e.server_gone() && args.retry_for > 0 => {
                out.flush().or_else(stdout_failed)?;
                *sub = reconnect(args, sub, &e)?;
                continue;
            }
            Err(e) => return Err(e.to_string()),
        };
        if let Some(e) = write_error {
            return stdout_failed(e);
        }
        if n > 0 {
            unflushed = true;
            last_message = Instant::now();
        } else if unflushed {
            if let Err(e) = out.flush() {
                return stdout_failed(e);
            }
            unflushed = false;
        } else if let Some(t) = args.idle_timeout_s {
            if last_message.elapsed() >= Duration::from_secs(t) {
                // Nothing read from the start: the subscriber's cursor is still its
                // default (0), which is not where the topic continues (a memory-only
                // topic's positions go on past a restart), so none is named.
                let from_start = printed == 0 && args.from.is_none();
                let next = match from_start {
                    true => "the topic has nothing retained to read yet".to_string(),
                    false => format!("next {}", describe(&Subscriber::position(sub))),
                };
                return Err(format!(
                    "no message for {t} s after {} ({next})",
                    crate::count_of(printed, "message", "messages"),
                ));
            }
        }
    }
    out.flush().or_else(stdout_failed)
}

/// A new subscriber at the position after the last message printed, made as soon as
/// the server answers again, within `--retry-for` seconds of losing it.
fn reconnect(
    args: &SubArgs,
    lost: &Subscriber,
    cause: &embarcadero_client::Error,
) -> Result<Subscriber, String> {
    let from = Subscriber::position(lost);
    eprintln!(
        "note: lost the server ({cause}); reconnecting for up to {} s to continue from {}",
        args.retry_for,
        describe(&from)
    );
    let deadline = Instant::now() + Duration::from_secs(args.retry_for);
    let mut pause = Duration::from_millis(50);
    loop {
        let config = SubscriberConfig {
            start: Some(from.clone()),
            transport: args.transport,
            ..SubscriberConfig::default()
        };
        match Subscriber::connect(&args.control.control, &args.topic, config) {
            Ok(sub) => {
                eprintln!("note: reconnected; continuing from {}", describe(&from));
                return Ok(sub);
            }
            Err(e) if e.server_gone() => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "the server did not come back within {} s ({e}); to continue later: embarcadero sub {} --from {}",
                        args.retry_for,
                        args.topic,
                        cursor_arg(&from)
                    ));
                }
                crate::retry_pause(&mut pause);
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// `cursor` as `--from` takes it.
fn cursor_arg(cursor: &Cursor) -> String {
    match cursor {
        Cursor::Global(p) => p.to_string(),
        Cursor::PerBroker(v) => comma_list(v),
    }
}

/// A reader that went away (`sub | head`) ends the command quietly, like any Unix tool.
fn stdout_failed(e: std::io::Error) -> CliResult {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        return Ok(());
    }
    Err(format!("cannot write to stdout: {e}"))
}

/// A subscriber that starts past the end waits for the log to get there: say so, since
/// otherwise nothing distinguishes that from a slow server.
fn warn_if_beyond_the_end(args: &SubArgs, from: u64) {
    let Ok(topic) = Admin::new(&args.control.control).describe_topic(&args.topic) else {
        return;
    };
    if from > topic.next_position {
        eprintln!(
            "note: position {from} is beyond the end of topic {} (next position {}); waiting until the log reaches it",
            args.topic, topic.next_position
        );
    }
}

fn describe(cursor: &Cursor) -> String {
    match cursor {
        Cursor::Global(p) => format!("position {p}"),
        Cursor::PerBroker(v) => format!("per-broker positions {}", comma_list(v)),
    }
}

fn broker_count(sub: &Subscriber) -> usize {
    match sub.position() {
        Cursor::PerBroker(v) => v.len(),
        Cursor::Global(_) => 1,
    }
}

fn print_message(
    out: &mut impl Write,
    m: &MessageRef<'_>,
    jsonl: bool,
    ordered: bool,
) -> std::io::Result<()> {
    if !jsonl {
        out.write_all(m.payload)?;
        return out.write_all(b"\n");
    }
    let mut v = serde_json::json!({
        "broker_id": m.broker_id,
        "client_id": m.client_id,
        "batch_seq": m.batch_seq,
        "index_in_batch": m.index_in_batch,
        "publish_ts_ns": m.publish_ts_ns,
    });
    if ordered {
        v["global_seq"] = m.position.into();
    } else {
        v["global_seq"] = serde_json::Value::Null;
        v["broker_seq"] = m.position.into();
    }
    match std::str::from_utf8(m.payload) {
        Ok(s) => v["payload"] = s.into(),
        Err(_) => {
            v["payload_b64"] = base64::engine::general_purpose::STANDARD
                .encode(m.payload)
                .into()
        }
    }
    serde_json::to_writer(&mut *out, &v)?;
    out.write_all(b"\n")
}
