//! An optional latency trace of the event log, for finding where a task's time goes.
//! With `EMBARCADERO_WORKFLOW_TRACE=FILE` in its environment, every process that folds
//! the log (orchestrator, worker) appends one line per event it reads:
//! `role position kind task step attempt publish_ns read_ns`, where `publish_ns` is the
//! publisher's wall clock when it appended the message (the message header's
//! `publish_ts_ns`) and `read_ns` this process's wall clock when the fold got it. All
//! processes of one host share the clock, so `scripts/workflow_trace.py` can put every
//! trip through the log (publish to read) and every reaction (read to the next publish)
//! of a task side by side. Off (no file) it costs one branch per batch of events; on,
//! one `write` per batch, after the fold and before the process reacts (so reactions in
//! a trace include it). It touches nothing but the file it is given.

use crate::event::Envelope;
use parking_lot::Mutex;
use std::fs::File;
use std::io::Write;
use std::sync::OnceLock;

static SINK: OnceLock<Option<Mutex<File>>> = OnceLock::new();

fn sink() -> Option<&'static Mutex<File>> {
    SINK.get_or_init(|| {
        let path = std::env::var_os("EMBARCADERO_WORKFLOW_TRACE")?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        match file {
            Ok(f) => Some(Mutex::new(f)),
            Err(e) => {
                tracing::warn!("cannot open the trace file {path:?}: {e}");
                None
            }
        }
    })
    .as_ref()
}

/// Whether tracing is on (so callers can skip gathering what it needs).
pub fn enabled() -> bool {
    sink().is_some()
}

/// One event read by `role`: its position, the publisher's clock and ours.
pub struct Read<'a> {
    pub position: u64,
    pub publish_ns: u64,
    pub read_ns: u64,
    pub envelope: Option<&'a Envelope>,
}

/// Appends the lines of one batch of events read, in one write (lines of processes
/// sharing the file do not interleave within a line).
pub fn record(role: &str, reads: &[Read<'_>]) {
    let Some(sink) = sink() else { return };
    let mut text = String::new();
    for r in reads {
        let (kind, task, step, attempt) = match r.envelope.map(|e| &e.event) {
            Some(event) => {
                let kind = event.kind();
                match event.step_ref() {
                    Some(at) => (kind, at.task.as_str(), at.step.as_str(), at.attempt),
                    None => (kind, event.task().unwrap_or("-"), "-", 0),
                }
            }
            None => ("undecodable", "-", "-", 0),
        };
        text.push_str(&format!(
            "{role} {} {kind} {task} {step} {attempt} {} {}\n",
            r.position, r.publish_ns, r.read_ns
        ));
    }
    if let Err(e) = sink.lock().write_all(text.as_bytes()) {
        tracing::warn!("cannot write the trace: {e}");
    }
}
