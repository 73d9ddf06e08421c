//! The engine's Prometheus metrics (`GET /metrics` on the orchestrator's API port), in
//! the text exposition format: tasks and steps by state (gauges), the latency of
//! completed steps by handler (a histogram) and how far the fold is behind the log's
//! end. All derived from the folded state at scrape time, so they cost nothing between
//! scrapes and agree with the API.

use crate::machine::{StepState, TaskState};
use crate::state::State;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Upper bounds (seconds) of the step latency histogram's buckets.
pub const LATENCY_BUCKETS_S: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 300.0,
];

/// The metrics text at `now_ms`; `log_end`: the position after the log's last event,
/// when known.
pub fn render(state: &State, log_end: Option<u64>, now_ms: u64) -> String {
    let mut out = String::new();
    let tasks = count_by(state.tasks.values().map(|t| t.state.name()));
    let names: Vec<String> = TaskState::ALL.iter().map(|s| s.name()).collect();
    gauge_by_state(&mut out, "tasks", "Tasks by state.", &names, &tasks);
    let steps = state
        .tasks
        .values()
        .flat_map(|t| t.created_steps().map(|s| s.state.name()));
    let names: Vec<String> = StepState::ALL.iter().map(|s| s.name()).collect();
    gauge_by_state(
        &mut out,
        "steps",
        "Created steps by state.",
        &names,
        &count_by(steps),
    );
    latency_histogram(&mut out, state);
    unclaimed_gauge(&mut out, state, now_ms);
    let folded = state.next_position;
    family(
        &mut out,
        "events_folded",
        "counter",
        "Events read and folded (applied or refused).",
    );
    let _ = writeln!(out, "embarcadero_workflow_events_folded {folded}");
    family(
        &mut out,
        "events_refused",
        "counter",
        "Events the fold refused (lost claims, late results, ...).",
    );
    let _ = writeln!(
        out,
        "embarcadero_workflow_events_refused {}",
        state.rejected
    );
    if let Some(end) = log_end {
        let help = "Events in the log the orchestrator has not folded yet (queue lag).";
        family(&mut out, "queue_lag_events", "gauge", help);
        let lag = end.saturating_sub(folded);
        let _ = writeln!(out, "embarcadero_workflow_queue_lag_events {lag}");
    }
    out
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP embarcadero_workflow_{name} {help}");
    let _ = writeln!(out, "# TYPE embarcadero_workflow_{name} {kind}");
}

/// `value` as a label value of the text format: backslash, double quote and line feed
/// escaped (a handler's name is any string a template gives).
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn count_by(names: impl Iterator<Item = String>) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for n in names {
        *counts.entry(n).or_insert(0) += 1;
    }
    counts
}

/// One sample per state, zero included, so that a state's series never disappears.
fn gauge_by_state(
    out: &mut String,
    name: &str,
    help: &str,
    states: &[String],
    counts: &BTreeMap<String, u64>,
) {
    family(out, name, "gauge", help);
    for s in states {
        let n = counts.get(s).copied().unwrap_or(0);
        let _ = writeln!(out, "embarcadero_workflow_{name}{{state=\"{s}\"}} {n}");
    }
}

/// Each completed step's latency, from the claim of its successful attempt
/// (`in_progress`) to its completion, by the handler it ran.
fn latency_histogram(out: &mut String, state: &State) {
    let mut by_handler: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for task in state.tasks.values() {
        for (i, step) in task.steps.iter().enumerate() {
            let Some(seconds) = step_latency_s(step) else {
                continue;
            };
            let handler = task.spec(i).handler.callable.as_str();
            by_handler.entry(handler).or_default().push(seconds);
        }
    }
    let name = "embarcadero_workflow_step_duration_seconds";
    family(
        out,
        "step_duration_seconds",
        "histogram",
        "Completed steps' latency, claim to completion, by handler.",
    );
    for (handler, samples) in by_handler {
        let handler = label(handler);
        for bound in LATENCY_BUCKETS_S {
            let n = samples.iter().filter(|s| **s <= bound).count();
            let _ = writeln!(
                out,
                "{name}_bucket{{handler=\"{handler}\",le=\"{bound}\"}} {n}"
            );
        }
        let n = samples.len();
        let _ = writeln!(
            out,
            "{name}_bucket{{handler=\"{handler}\",le=\"+Inf\"}} {n}"
        );
        let sum: f64 = samples.iter().sum();
        let _ = writeln!(out, "{name}_sum{{handler=\"{handler}\"}} {sum}");
        let _ = writeln!(out, "{name}_count{{handler=\"{handler}\"}} {n}");
    }
}

fn step_latency_s(step: &crate::state::Step) -> Option<f64> {
    if step.state != StepState::Complete {
        return None;
    }
    let done = step.history.last()?;
    let claimed = step
        .history
        .iter()
        .rev()
        .find(|t| t.to == StepState::InProgress)?;
    Some(done.ts_ms.saturating_sub(claimed.ts_ms) as f64 / 1000.0)
}
/// Enqueued attempts no worker has claimed for a minute, by namespace and handler (0
/// when there are none: the family is always there, for an alert to watch).
fn unclaimed_gauge(out: &mut String, state: &State, now_ms: u64) {
    use crate::unclaimed::{unclaimed, UNCLAIMED_WARN_MS};
    let help = "Enqueued attempts no worker has claimed for 60 s or more (no worker runs their handler in their namespace?).";
    family(out, "unclaimed_steps", "gauge", help);
    let waiting = unclaimed(state, now_ms, UNCLAIMED_WARN_MS);
    let by = count_by(waiting.iter().map(|u| {
        let (namespace, handler) = (label(u.namespace), label(u.handler));
        format!("namespace=\"{namespace}\",handler=\"{handler}\"")
    }));
    if by.is_empty() {
        let _ = writeln!(out, "embarcadero_workflow_unclaimed_steps 0");
    }
    for (labels, n) in by {
        let _ = writeln!(out, "embarcadero_workflow_unclaimed_steps{{{labels}}} {n}");
    }
}
