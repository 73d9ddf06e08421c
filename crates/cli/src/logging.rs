//! The log of the long-running commands (`serve`, `broker`, `sequencer`, `orchestrator`,
//! `worker`): `tracing` to stderr, filtered by `EMBARCADERO_LOG`, and the lifecycle lines
//! they print for people (`note!`). `--log-format json` (`EMBARCADERO_LOG_FORMAT`) makes
//! every line, the lifecycle lines too, one JSON object for a log shipper.
//!
//! Nothing a log writes may stop the program. A log piped into a reader that went away
//! (`serve 2>&1 | head`, a log shipper restarting) made every write fail with EPIPE;
//! `tracing-subscriber` then reported the failure with `eprintln!`, which panics, so
//! whichever thread logged next died: the sequencer, a broker's service thread, while
//! `/healthz` still answered ok (an operator's first days, session 34). Lines that cannot
//! be written are dropped instead.
//!
//! Owns: the subscriber's set-up, its writer and the chosen format. Touches stderr only.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people: time, level, target, message.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields.message`, and
    /// the event's other fields), lifecycle lines included.
    Json,
}

/// Set once, by `main`, before any command runs.
static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Chooses the format for the rest of the process (the first choice stands).
pub fn set_log_format(format: LogFormat) {
    let _ = FORMAT.set(format);
}

fn log_format() -> LogFormat {
    FORMAT.get().copied().unwrap_or_default()
}

/// `init_logging` ran: only then do lifecycle lines go through the log (a short command
/// such as `topic create` has no log, and its error line stays text).
static LOGGING: AtomicBool = AtomicBool::new(false);

/// Writes to stderr; a failed write drops the line instead of returning the error, which
/// `tracing-subscriber` would report with a panicking `eprintln!`.
struct LossyStderr;

impl Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

/// Logs to stderr at `EMBARCADERO_LOG`'s filter (default `info`); a filter that does not
/// parse is said, and `info` used.
pub fn init_logging() {
    let (filter, bad) = match std::env::var("EMBARCADERO_LOG") {
        Err(_) => (tracing_subscriber::EnvFilter::new("info"), None),
        Ok(text) => match tracing_subscriber::EnvFilter::try_new(&text) {
            Ok(filter) => (filter, None),
            Err(e) => (tracing_subscriber::EnvFilter::new("info"), Some((text, e))),
        },
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LossyStderr);
    let _ = match log_format() {
        // Colour only on a terminal: escape codes would clutter a log file.
        LogFormat::Text => builder
            .with_ansi(io::IsTerminal::is_terminal(&io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().with_current_span(false).try_init(),
    };
    LOGGING.store(true, Ordering::Release);
    if let Some((text, e)) = bad {
        tracing::warn!(
            "EMBARCADERO_LOG={text:?} is not a log filter ({e}); logging at info. Write a level \
             (error, warn, info, debug, trace) or per target, e.g. info,embarcadero_broker=debug"
        );
    }
}

/// `eprintln!` for a lifecycle line meant for people ("serving", "shutting down"): a
/// stderr that cannot take it drops it rather than panic. In the JSON format it is one
/// object of level `INFO` and target `embarcadero`, so a log stays one object per line.
/// Neither format filters it: `EMBARCADERO_LOG=warn` still shows that a server started.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::logging::note_line("INFO", format_args!($($arg)*))
    };
}
pub(crate) use note;

/// What `note!` writes, at `level` in the JSON format (a command's last word, the error
/// it exits with, is `ERROR`).
pub fn note_line(level: &str, line: std::fmt::Arguments<'_>) {
    if log_format() == LogFormat::Json && LOGGING.load(Ordering::Acquire) {
        // One write of the whole line: `writeln!` would write the object and its newline
        // separately, and another thread's event could land between them.
        let whole = json_line(level, &line.to_string()) + "\n";
        let _ = LossyStderr.write(whole.as_bytes());
    } else {
        let _ = writeln!(io::stderr(), "{line}");
    }
}

/// One line as `tracing-subscriber`'s JSON format writes an event: the same fields, the
/// same timestamp format.
fn json_line(level: &str, message: &str) -> String {
    use tracing_subscriber::fmt::{format::Writer, time::FormatTime};
    let mut timestamp = String::new();
    let _ = tracing_subscriber::fmt::time::SystemTime.format_time(&mut Writer::new(&mut timestamp));
    serde_json::json!({
        "timestamp": timestamp,
        "level": level,
        "fields": { "message": message },
        "target": "embarcadero",
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_to_a_closed_stderr_is_dropped_not_an_error() {
        // The writer's contract, whatever stderr is in the test harness: never an error,
        // the whole line taken.
        let mut w = LossyStderr;
        assert_eq!(w.write(b"a line\n").unwrap(), 7);
        assert!(w.flush().is_ok());
    }

    #[test]
    fn a_json_lifecycle_line_has_the_fields_of_a_logged_event() {
        let line: serde_json::Value =
            serde_json::from_str(&json_line("ERROR", "error: \"quoted\"\nline")).unwrap();
        assert_eq!(line["level"], "ERROR");
        assert_eq!(line["target"], "embarcadero");
        assert_eq!(line["fields"]["message"], "error: \"quoted\"\nline");
        let timestamp = line["timestamp"].as_str().unwrap();
        assert!(
            timestamp.len() >= 20 && timestamp.ends_with('Z'),
            "{timestamp}"
        );
    }
}
