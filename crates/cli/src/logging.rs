//! The log of the long-running commands (`serve`, `broker`, `sequencer`, `orchestrator`,
//! `worker`): `tracing` to stderr, filtered by `EMBARCADERO_LOG`, and the lifecycle lines
//! they print for people (`note!`).
//!
//! Nothing a log writes may stop the program. A log piped into a reader that went away
//! (`serve 2>&1 | head`, a log shipper restarting) made every write fail with EPIPE;
//! `tracing-subscriber` then reported the failure with `eprintln!`, which panics, so
//! whichever thread logged next died: the sequencer, a broker's service thread, while
//! `/healthz` still answered ok (an operator's first days, session 34). Lines that cannot
//! be written are dropped instead.
//!
//! Owns: the subscriber's set-up and its writer. Touches stderr only.

use std::io::{self, Write};

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
    // Colour only on a terminal: escape codes would clutter a log file.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LossyStderr)
        .with_ansi(io::IsTerminal::is_terminal(&io::stderr()))
        .try_init();
    if let Some((text, e)) = bad {
        tracing::warn!(
            "EMBARCADERO_LOG={text:?} is not a log filter ({e}); logging at info. Write a level \
             (error, warn, info, debug, trace) or per target, e.g. info,embarcadero_broker=debug"
        );
    }
}

/// `eprintln!` for a lifecycle line meant for people ("serving", "shutting down"): a
/// stderr that cannot take it drops it rather than panic.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
pub(crate) use note;

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
}
