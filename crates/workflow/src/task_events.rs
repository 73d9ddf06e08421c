//! Server-sent events of one task (`GET /v1/tasks/{uuid}/events`): every transition
//! of the task and of its steps, in log order, each as one `data:` line of JSON, from
//! the task's creation (or, for a client resuming with `Last-Event-ID`, from after the
//! position it names) until it is finished; then the stream ends. The last event of
//! each log position carries `id: POSITION`, so a client that reconnects resumes after
//! the last position it received whole. Owns the order of transitions within one log
//! position and the stream's framing; the HTTP server writes the bytes.

use crate::log::Shared;
use crate::state::Task;
use serde_json::{json, Value};
use std::io::{self, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often an idle stream sends an SSE comment, so that a client that went away is
/// noticed (the write fails) and proxies do not close the connection.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// A task's transitions as a stream; cloned into the HTTP server's connection thread.
#[derive(Clone)]
pub struct TaskEvents {
    shared: Arc<Shared>,
    uuid: String,
    /// The first log position whose transitions are sent.
    from: u64,
}

impl std::fmt::Debug for TaskEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TaskEvents({})", self.uuid)
    }
}

impl PartialEq for TaskEvents {
    fn eq(&self, other: &Self) -> bool {
        self.uuid == other.uuid
            && self.from == other.from
            && Arc::ptr_eq(&self.shared, &other.shared)
    }
}

/// A batch of transitions read at once, and what follows it.
struct Batch {
    transitions: Vec<Value>,
    /// Every transition before this position has been read.
    next_position: u64,
    finished: bool,
}

impl TaskEvents {
    pub fn new(shared: Arc<Shared>, uuid: &str) -> Self {
        Self {
            shared,
            uuid: uuid.to_string(),
            from: 0,
        }
    }

    /// The stream for a client that received every transition up to `position` (its
    /// `Last-Event-ID`): it starts at the next position.
    pub fn after(mut self, position: u64) -> Self {
        self.from = position.saturating_add(1);
        self
    }

    /// Writes the task's transitions as they are applied, and returns once it is
    /// finished (or the task is gone, or a write fails: the client left).
    pub fn write_to(&self, out: &mut dyn Write) -> io::Result<()> {
        let mut from = self.from;
        loop {
            let Some(batch) = self.next_batch(from) else {
                out.write_all(b": keepalive\n\n")?;
                out.flush()?;
                continue;
            };
            write_batch(out, &batch.transitions)?;
            out.flush()?;
            if batch.finished {
                return Ok(());
            }
            from = batch.next_position;
        }
    }

    /// Waits (up to the keepalive) for the task's transitions at positions from `from`
    /// on (or its end). A position's events are applied under one lock, so
    /// every transition before `next_position` is there when it is read.
    fn next_batch(&self, from: u64) -> Option<Batch> {
        let deadline = Instant::now() + KEEPALIVE;
        self.shared.wait_for_task(&self.uuid, deadline, |state| {
            let Some(task) = state.tasks.get(&self.uuid) else {
                return Some(Batch {
                    transitions: Vec::new(),
                    next_position: state.next_position,
                    finished: true,
                });
            };
            let finished = task.state.is_terminal();
            // Other tasks' events move `next_position` too: wait for this task's.
            let transitions = transitions_since(task, from);
            (finished || !transitions.is_empty()).then_some(Batch {
                transitions,
                next_position: state.next_position,
                finished,
            })
        })
    }
}

/// Writes `transitions` (whole positions, in log order) as events, the last of each
/// position with `id: POSITION`: a client whose connection breaks inside a position
/// resumes from the last position it has whole, and gets the broken one again entire.
fn write_batch(out: &mut dyn Write, transitions: &[Value]) -> io::Result<()> {
    for (i, t) in transitions.iter().enumerate() {
        let position = &t["position"];
        assert!(position.is_u64(), "a transition without its position: {t}");
        writeln!(out, "data: {t}")?;
        if transitions
            .get(i + 1)
            .is_none_or(|next| next["position"] != *position)
        {
            writeln!(out, "id: {position}")?;
        }
        out.write_all(b"\n")?;
    }
    Ok(())
}

/// The task's and its steps' transitions at positions `from` and later, in log order;
/// within one position, by convention, the steps' moves (in step order) before the
/// task's (the fold derives a task's state after its steps moved).
pub fn transitions_since(task: &Task, from: u64) -> Vec<Value> {
    let mut out: Vec<(u64, Value)> = Vec::new();
    for step in task.created_steps() {
        for t in step.history.iter().filter(|t| t.position >= from) {
            let v = json!({"task_uuid": task.uuid, "step": step.name, "from": t.from,
                "to": t.to, "position": t.position, "ts_ms": t.ts_ms});
            out.push((t.position, v));
        }
    }
    for t in task.history.iter().filter(|t| t.position >= from) {
        let v = json!({"task_uuid": task.uuid, "step": null, "from": t.from, "to": t.to,
            "position": t.position, "ts_ms": t.ts_ms});
        out.push((t.position, v));
    }
    out.sort_by_key(|(position, _)| *position);
    out.into_iter().map(|(_, v)| v).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_event_of_each_position_carries_the_position_as_its_id() {
        let t = |position: u64, to: &str| json!({"position": position, "to": to});
        let mut out = Vec::new();
        write_batch(&mut out, &[t(3, "a"), t(3, "b"), t(5, "c")]).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "data: {\"position\":3,\"to\":\"a\"}\n\n\
             data: {\"position\":3,\"to\":\"b\"}\nid: 3\n\n\
             data: {\"position\":5,\"to\":\"c\"}\nid: 5\n\n"
        );
    }
}
