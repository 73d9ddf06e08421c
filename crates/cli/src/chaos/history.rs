//! The history of one chaos cycle, as JSON lines: what each publisher sent, which of
//! its messages were acknowledged or failed, what each reader delivered at which
//! position, and when the nemesis struck and healed. The order of the lines is the
//! real-time order of the events (one lock orders the writes, and an event is written
//! before the call it describes starts or after it returned), which the checker's
//! real-time check relies on.

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::sync::Mutex;

/// One line of a history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The topic of the cycle.
    Topic { order: u8, ack: u8 },
    /// Written before `publish` of message `id` is called.
    Send { publisher: usize, id: u64 },
    /// Written after a `flush` that covered `id` returned Ok. The client acknowledges
    /// batches, not positions: where the message landed is known from the readers.
    Ack { publisher: usize, id: u64 },
    /// Written after a `flush` that covered `id` failed: it may or may not be in the log
    /// (indeterminate), but at most once.
    Fail { publisher: usize, id: u64 },
    /// Reader `reader` was handed message `id` at `position`.
    Deliver {
        reader: usize,
        position: u64,
        id: u64,
    },
    /// A fault began (`start`) or was healed (`end`).
    Nemesis { what: String, phase: String },
    /// Reader `reader` stopped; the topic ended at `topic_end` (its next position)
    /// once publishing had stopped; `error` if it stopped before reaching it.
    ReaderEnd {
        reader: usize,
        topic_end: u64,
        error: Option<String>,
    },
}

/// Appends events to a history file, one JSON line each, in the order `record` is called.
pub struct Recorder {
    out: Mutex<BufWriter<File>>,
}

impl Recorder {
    pub fn create(path: &Path) -> Result<Self, String> {
        let file = File::create(path)
            .map_err(|e| format!("cannot create the history {}: {e}", path.display()))?;
        Ok(Self {
            out: Mutex::new(BufWriter::new(file)),
        })
    }

    pub fn record(&self, event: &Event) {
        self.record_all(std::slice::from_ref(event));
    }

    /// Records several events with nothing from another thread between them.
    pub fn record_all(&self, events: &[Event]) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        for event in events {
            let line = serde_json::to_string(event).expect("an event is JSON");
            // A failed write shows as a short history, which the checker reports.
            let _ = writeln!(out, "{line}");
        }
    }

    pub fn finish(self) -> Result<(), String> {
        let out = self.out.into_inner().unwrap_or_else(|e| e.into_inner());
        out.into_inner()
            .map_err(|e| format!("cannot write the history: {e}"))?
            .sync_all()
            .map_err(|e| format!("cannot write the history: {e}"))
    }
}

/// Reads a history file written by [`Recorder`].
pub fn read(path: &Path) -> Result<Vec<Event>, String> {
    let file =
        File::open(path).map_err(|e| format!("cannot open the history {}: {e}", path.display()))?;
    let mut events = Vec::new();
    for (number, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let event = serde_json::from_str(&line)
            .map_err(|e| format!("{} line {}: {e}", path.display(), number + 1))?;
        events.push(event);
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_history_reads_back_equal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.jsonl");
        let events = vec![
            Event::Topic { order: 5, ack: 2 },
            Event::Send {
                publisher: 1,
                id: 7,
            },
            Event::Ack {
                publisher: 1,
                id: 7,
            },
            Event::Deliver {
                reader: 0,
                position: 0,
                id: 7,
            },
            Event::ReaderEnd {
                reader: 0,
                topic_end: 1,
                error: None,
            },
        ];
        let recorder = Recorder::create(&path).unwrap();
        recorder.record_all(&events);
        recorder.finish().unwrap();
        assert_eq!(read(&path).unwrap(), events);
    }
}
