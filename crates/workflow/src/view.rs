//! The API's JSON documents of tasks and templates: Tasker's task response (counts,
//! `execution_status`, `recommended_action`, `completion_percentage`, `health_status`)
//! with the steps, their results and their audit trail.

use crate::machine::{StepState, TaskState};
use crate::state::{Step, Task};
use crate::template::Template;
use serde_json::{json, Value};

/// Steps by where they are, as Tasker counts them.
struct Counts {
    total: usize,
    pending: usize,
    in_progress: usize,
    completed: usize,
    failed: usize,
    ready: usize,
}

fn counts(task: &Task) -> Counts {
    let n = |f: &dyn Fn(StepState) -> bool| task.created_steps().filter(|s| f(s.state)).count();
    Counts {
        total: task.created_steps().count(),
        pending: n(&|s| matches!(s, StepState::Pending | StepState::WaitingForRetry)),
        in_progress: n(&|s| s.is_active()),
        completed: n(&|s| matches!(s, StepState::Complete | StepState::ResolvedManually)),
        failed: n(&|s| s == StepState::Error),
        ready: task.ready_steps().count(),
    }
}

/// Tasker's `execution_status`, `recommended_action` and `health_status`.
fn status_words(task: &Task, c: &Counts) -> (&'static str, &'static str, &'static str) {
    if task.state == TaskState::Cancelled {
        return ("cancelled", "none", "unknown");
    }
    if task.state == TaskState::ResolvedManually {
        return ("resolved_manually", "none", "unknown");
    }
    if c.completed == c.total || task.state == TaskState::Complete {
        return ("all_complete", "finalize_task", "healthy");
    }
    if c.failed > 0 {
        return ("blocked_by_failures", "handle_failures", "blocked");
    }
    if c.ready > 0 {
        return ("has_ready_steps", "execute_ready_steps", "healthy");
    }
    let retrying = task
        .steps
        .iter()
        .any(|s| s.state == StepState::WaitingForRetry);
    let health = if retrying { "recovering" } else { "healthy" };
    // A task whose only unfinished steps wait for their retry is still processing;
    // one with steps waiting behind them waits for dependencies (as its state says).
    let waiting = task.state == TaskState::WaitingForDependencies;
    if c.in_progress > 0 || (retrying && !waiting) {
        return ("processing", "wait_for_completion", health);
    }
    ("waiting_for_dependencies", "wait_for_dependencies", health)
}

pub fn task_view(task: &Task) -> Value {
    let c = counts(task);
    let (execution_status, recommended_action, health_status) = status_words(task, &c);
    let t = &task.template;
    let not_created: Vec<&str> = task
        .steps
        .iter()
        .filter(|s| !s.created)
        .map(|s| s.name.as_str())
        .collect();
    let steps: Vec<Value> = task.created_steps().map(step_view).collect();
    json!({
        "task_uuid": task.uuid,
        "name": t.name,
        "namespace": t.namespace,
        "version": t.version,
        "status": task.state,
        "context": task.context,
        "idempotency_key": task.idempotency_key,
        "protocol": task.protocol,
        "created_at_ms": task.created_ms,
        "updated_at_ms": task.updated_ms,
        "completed_at_ms": task.completed_ms,
        "resolution": task.resolution,
        "total_steps": c.total,
        "pending_steps": c.pending,
        "in_progress_steps": c.in_progress,
        "completed_steps": c.completed,
        "failed_steps": c.failed,
        "ready_steps": c.ready,
        "execution_status": execution_status,
        "recommended_action": recommended_action,
        "health_status": health_status,
        "completion_percentage": (c.completed as f64) * 100.0 / (c.total.max(1) as f64),
        "transitions": task.history,
        "steps": steps,
        "not_created_steps": not_created,
    })
}

/// A step as the API shows it; its `step_uuid` is its name (unique in its task).
pub fn step_view(s: &Step) -> Value {
    json!({
        "step_uuid": s.name,
        "name": s.name,
        "current_state": s.state,
        "attempts": s.attempt,
        "failures": s.failures,
        "lease_losses": s.lease_losses,
        "worker": s.worker,
        "result": s.result,
        "last_error": s.last_error,
        "retry_due_ms": s.retry_due_ms,
        "batch": s.batch,
        "checkpoint": s.checkpoint,
        "transitions": s.history,
        "refused_events": s.refused,
    })
}

/// A task in a list: its identity, state and counts, without its steps.
pub fn task_summary(task: &Task) -> Value {
    let mut v = task_view(task);
    if let Some(o) = v.as_object_mut() {
        for heavy in ["steps", "transitions", "context", "not_created_steps"] {
            o.remove(heavy);
        }
    }
    v
}

pub fn template_view(t: &Template) -> Value {
    json!({
        "namespace": t.namespace,
        "name": t.name,
        "version": t.version,
        "description": t.description,
        "steps": t.steps.iter().map(|s| json!({
            "name": s.name,
            "type": s.step_type,
            "handler": s.handler.callable,
            "dependencies": s.dependencies,
        })).collect::<Vec<_>>(),
    })
}
