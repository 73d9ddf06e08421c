//! Which of a task's steps exist, and when a step may run. A step behind a decision
//! step is created only when the decision names it (or, for a step further down, when
//! the steps it depends on were created); a deferred convergence waits for those of
//! its dependencies that were created, once no pending decision can still create the
//! others. Pure functions of the task, used by the fold, the orchestrator and the API.

use crate::machine::StepState;
use crate::state::Task;
use crate::template::StepType;
use serde_json::Value;

/// The step names a decision's result names: `{"step_names": [...]}` (Tasker's
/// `create_steps`; an empty list or `{"type": "no_branches"}` creates none).
pub fn decision_names(result: &Value) -> Result<Vec<String>, String> {
    if result.get("type").and_then(Value::as_str) == Some("no_branches") {
        return Ok(Vec::new());
    }
    let Some(list) = result.get("step_names").and_then(Value::as_array) else {
        return Err(format!(
            "a decision step returns {{\"step_names\": [...]}}, not {result}"
        ));
    };
    list.iter()
        .map(|v| match v.as_str() {
            Some(s) => Ok(s.to_string()),
            None => Err(format!("step_names holds {v}, not a step name")),
        })
        .collect()
}

/// Checks a decision's result against its task: every name must be a step that
/// depends on the decision directly. Returns what is wrong, for the step's error.
pub fn check_decision(task: &Task, decision: usize, result: &Value) -> Result<(), String> {
    for name in decision_names(result)? {
        let candidate = task.index_of(&name);
        if !candidate.is_some_and(|c| task.deps[c].contains(&decision)) {
            let allowed: Vec<&str> = candidates(task, decision)
                .map(|c| task.steps[c].name.as_str())
                .collect();
            return Err(format!(
                "the decision named `{name}`, which is not one of its branches ({})",
                allowed.join(", ")
            ));
        }
    }
    Ok(())
}

/// The steps a decision may create: those that depend on it directly.
fn candidates(task: &Task, decision: usize) -> impl Iterator<Item = usize> + '_ {
    (0..task.steps.len()).filter(move |&c| task.deps[c].contains(&decision))
}

fn kind(task: &Task, i: usize) -> StepType {
    task.spec(i).step_type
}

/// Whether a decision step has completed and named step `i`.
fn named_by(task: &Task, decision: usize, i: usize) -> bool {
    let d = &task.steps[decision];
    d.state == StepState::Complete
        && d.result
            .as_ref()
            .and_then(|r| decision_names(r).ok())
            .is_some_and(|names| names.contains(&task.steps[i].name))
}

/// Whether step `i` (not created yet) is to be created now.
fn creatable(task: &Task, i: usize) -> bool {
    if kind(task, i) == StepType::BatchWorker {
        return false; // its instances are created by the batch, not the step itself
    }
    let deps = &task.deps[i];
    let gates: Vec<usize> = deps
        .iter()
        .copied()
        .filter(|&d| kind(task, d) == StepType::Decision)
        .collect();
    if !gates.is_empty() {
        return gates.iter().any(|&d| named_by(task, d, i));
    }
    let created = |&d: &usize| task.steps[d].created;
    match kind(task, i) {
        StepType::DeferredConvergence => deps.iter().any(created),
        _ => deps.iter().all(created),
    }
}

/// Creates every step that can be created now, until nothing changes. Returns the
/// names created, in template order.
pub(crate) fn create_steps(task: &mut Task) -> Vec<String> {
    let mut made = Vec::new();
    loop {
        let next = (0..task.steps.len()).find(|&i| !task.steps[i].created && creatable(task, i));
        let Some(i) = next else { return made };
        task.steps[i].created = true;
        made.push(task.steps[i].name.clone());
    }
}

/// Whether a dependency that was not created never will be: every decision (or
/// batchable step) above it has completed (or will never run).
fn settled_absent(task: &Task, d: usize) -> bool {
    !task.steps[d].created
        && task.ancestors(d).into_iter().all(|a| {
            !matches!(kind(task, a), StepType::Decision | StepType::Batchable)
                || !task.steps[a].created
                || task.steps[a].state == StepState::Complete
        })
}

/// Whether step `i`'s dependencies let it run: all complete; for a deferred
/// convergence, those created complete (or failed under `continue_on_failure`) and the
/// others settled absent.
pub fn dependencies_met(task: &Task, i: usize) -> bool {
    let convergence = kind(task, i) == StepType::DeferredConvergence;
    task.deps[i].iter().all(|&d| {
        matches!(
            task.steps[d].state,
            StepState::Complete | StepState::ResolvedManually
        ) || (convergence && (settled_absent(task, d) || crate::batch::tolerated(task, d)))
    })
}
