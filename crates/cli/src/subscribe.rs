//! `embarcadero sub`.

use crate::{CliResult, ControlArg};
use base64::Engine;
use embarcadero_client::{Admin, Cursor, MessageRef, Subscriber, SubscriberConfig};
use std::io::Write;
use std::time::Duration;

#[derive(clap::Args)]
pub struct SubArgs {
    /// Topic to read.
    pub topic: String,
    #[command(flatten)]
    pub control: ControlArg,
    /// Start position: a global position (orders 2, 5), or one position per broker
    /// separated by commas (orders 0, 1). Default: the beginning.
    #[arg(long)]
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
}

fn parse_from(from: &str) -> Result<Cursor, String> {
    let parts: Result<Vec<u64>, _> = from.split(',').map(|p| p.trim().parse::<u64>()).collect();
    let parts = parts.map_err(|e| {
        format!("--from {from:?}: {e}; give a position like 42, or one per broker like 0,0,10,3")
    })?;
    Ok(if parts.len() == 1 {
        Cursor::Global(parts[0])
    } else {
        Cursor::PerBroker(parts)
    })
}

pub fn run(args: SubArgs) -> CliResult {
    let start = args.from.as_deref().map(parse_from).transpose()?;
    let mut sub = Subscriber::connect(
        &args.control.control,
        &args.topic,
        SubscriberConfig {
            start: None,
            ..SubscriberConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let ordered = sub.order() >= 2;
    if let Some(start) = start {
        let start = match (start, ordered) {
            (Cursor::Global(0), false) => Cursor::PerBroker(vec![0; broker_count(&sub)]),
            (Cursor::Global(p), false) if broker_count(&sub) == 1 => Cursor::PerBroker(vec![p]),
            (Cursor::Global(p), false) => {
                return Err(format!(
                    "topic {} has order {}: positions are per broker; use --from with one position per broker, e.g. --from {}",
                    args.topic,
                    sub.order(),
                    vec![p.to_string(); broker_count(&sub)].join(",")
                ))
            }
            (Cursor::PerBroker(v), true) => {
                return Err(format!(
                    "topic {} has order {}: positions are global; use --from with one position, e.g. --from {}",
                    args.topic,
                    sub.order(),
                    v.first().copied().unwrap_or(0)
                ))
            }
            (Cursor::PerBroker(v), false) if v.len() != broker_count(&sub) => {
                return Err(format!(
                    "--from gives {} positions; topic {} has {} brokers: give one position per broker, e.g. --from {}",
                    v.len(),
                    args.topic,
                    broker_count(&sub),
                    vec!["0"; broker_count(&sub)].join(",")
                ))
            }
            (c, _) => c,
        };
        if let Cursor::Global(from) = start {
            warn_if_beyond_the_end(&args, from);
        }
        sub.seek(start).map_err(|e| e.to_string())?;
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut printed = 0u64;
    let limit = args.count.unwrap_or(u64::MAX);
    let jsonl = args.format == "jsonl";
    let mut idle = Duration::ZERO;
    let step = Duration::from_millis(200);
    let mut write_error = None;
    while printed < limit {
        let n = sub
            .poll_with(step, |m| {
                if printed >= limit || write_error.is_some() {
                    return;
                }
                if let Err(e) = print_message(&mut out, &m, jsonl, ordered) {
                    write_error = Some(e);
                }
                printed += 1;
            })
            .map_err(|e| e.to_string())?;
        if let Some(e) = write_error {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(());
            }
            return Err(format!("cannot write to stdout: {e}"));
        }
        if n == 0 {
            let _ = out.flush();
            idle += step;
            if let Some(t) = args.idle_timeout_s {
                if idle >= Duration::from_secs(t) {
                    return Err(format!(
                        "no message for {t} s after {printed} messages (next {})",
                        describe(&sub.position())
                    ));
                }
            }
        } else {
            idle = Duration::ZERO;
        }
    }
    out.flush()
        .map_err(|e| format!("cannot write to stdout: {e}"))?;
    Ok(())
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
        Cursor::PerBroker(v) => {
            let v: Vec<String> = v.iter().map(u64::to_string).collect();
            format!("per-broker positions {}", v.join(","))
        }
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
