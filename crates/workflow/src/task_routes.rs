//! The API's routes over existing tasks: the list with filters and pagination, cancel,
//! the steps and a step's audit trail, an operator's reset or resolution of a failed
//! step, and the dead-letter list. Reads come from the folded state; changes are
//! events, answered once the fold has applied (or refused) them.

use crate::api::Reply;
use crate::event::{Event, StepRef};
use crate::log::Shared;
use crate::machine::{StepState, TaskState};
use crate::state::{State, Task};
use crate::view::{step_view, task_summary};
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Tasker's default and largest page.
const PER_PAGE: usize = 25;
const MAX_PER_PAGE: usize = 100;

/// `page` and `per_page` of a query (1-based pages, as Tasker's).
pub(crate) fn page_of(query: &[(String, String)]) -> Result<(usize, usize), Reply> {
    let number = |name: &str, default: usize| match find(query, name) {
        None => Ok(default),
        Some(v) => v.parse::<usize>().ok().filter(|n| *n >= 1).ok_or_else(|| {
            Reply::error(
                400,
                "bad_request",
                format!("{name} must be a whole number >= 1, not `{v}`"),
            )
        }),
    };
    Ok((
        number("page", 1)?,
        number("per_page", PER_PAGE)?.min(MAX_PER_PAGE),
    ))
}

fn find<'a>(query: &'a [(String, String)], name: &str) -> Option<&'a str> {
    query
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// One page of `items`, with Tasker's pagination block.
fn paginate(key: &str, items: Vec<Value>, (page, per_page): (usize, usize)) -> Reply {
    let total = items.len();
    let pages = total.div_ceil(per_page);
    let slice: Vec<Value> = items
        .into_iter()
        .skip((page - 1) * per_page)
        .take(per_page)
        .collect();
    let mut body = json!({
        "pagination": {
            "page": page, "per_page": per_page, "total_count": total, "total_pages": pages,
            "has_next": page < pages, "has_previous": page > 1,
        }
    });
    body[key] = Value::Array(slice);
    Reply::ok(200, body)
}

/// `GET /v1/tasks?namespace=&name=&status=&page=&per_page=`, oldest first.
pub(crate) fn list_tasks(state: &State, query: &[(String, String)]) -> Reply {
    let page = match page_of(query) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let status = find(query, "status").or_else(|| find(query, "state"));
    if let Some(s) = status {
        if serde_json::from_value::<TaskState>(json!(s)).is_err() {
            let states: Vec<String> = TaskState::ALL.iter().map(|t| t.name()).collect();
            return Reply::error(
                400,
                "bad_request",
                format!("no task state `{s}`; the states are {}", states.join(", ")),
            );
        }
    }
    let wanted = |t: &&Task| {
        find(query, "namespace").is_none_or(|n| t.template.namespace == n)
            && find(query, "name").is_none_or(|n| t.template.name == n)
            && status.is_none_or(|s| t.state.name() == s)
    };
    let all = state.tasks.values().map(|t| &**t);
    let mut tasks: Vec<&Task> = all.filter(wanted).collect();
    tasks.sort_by(|a, b| (a.created_ms, &a.uuid).cmp(&(b.created_ms, &b.uuid)));
    paginate("tasks", tasks.into_iter().map(task_summary).collect(), page)
}

/// The dead-letter list: every failed step of a task that is blocked or failed, with
/// the reason in Tasker's words.
pub(crate) fn dlq(state: &State, query: &[(String, String)]) -> Reply {
    let page = match page_of(query) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let mut entries = Vec::new();
    let stuck = |t: &&Task| matches!(t.state, TaskState::Error | TaskState::BlockedByFailures);
    for task in state.tasks.values().map(|t| &**t).filter(stuck) {
        for s in task.created_steps().filter(|s| s.state == StepState::Error) {
            let error = s.last_error.clone().unwrap_or_default();
            let at_ms = s.history.last().map(|h| h.ts_ms);
            entries.push(json!({
                "task_uuid": task.uuid, "namespace": task.template.namespace,
                "name": task.template.name, "task_status": task.state,
                "step": s.name, "reason": dlq_reason(&error), "error": error,
                "attempts": s.attempt, "failed_at_ms": at_ms,
            }));
        }
    }
    paginate("entries", entries, page)
}

/// The DLQ reason a step's error stands for.
fn dlq_reason(error: &str) -> &'static str {
    if error.starts_with(crate::staleness::STALE) {
        "staleness"
    } else if error.starts_with("max attempts") {
        "max_retries"
    } else if error.starts_with("worker unavailable") {
        "worker_unavailable"
    } else if error.starts_with("failed, not retryable") {
        "permanent_failure"
    } else {
        "invalid_result"
    }
}

/// `GET /v1/tasks/{uuid}/workflow_steps[/{step}[/audit]]`.
pub(crate) fn get_steps(state: &State, uuid: &str, step: Option<&str>, audit: bool) -> Reply {
    let Some(task) = state.tasks.get(uuid) else {
        return Reply::error(404, "not_found", format!("no task {uuid}"));
    };
    let Some(name) = step else {
        let steps: Vec<Value> = task.created_steps().map(step_view).collect();
        return Reply::ok(200, json!({"task_uuid": uuid, "steps": steps}));
    };
    let Some(s) = task.step(name).filter(|s| s.created) else {
        return Reply::error(404, "not_found", format!("task {uuid} has no step {name}"));
    };
    let body = match audit {
        false => step_view(s),
        true => json!({
            "task_uuid": uuid, "step_uuid": s.name,
            "transitions": s.history, "refused_events": s.refused,
        }),
    };
    Reply::ok(200, body)
}

/// Tasker's `PATCH .../workflow_steps/{step}` body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StepAction {
    action_type: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    completion_data: Option<Value>,
    /// Who did it (Tasker's `reset_by`, `resolved_by`, `completed_by`): recorded in the reason.
    #[serde(
        default,
        alias = "reset_by",
        alias = "resolved_by",
        alias = "completed_by"
    )]
    by: Option<String>,
}

/// The event an action stands for, against the step as it is now.
pub(crate) fn step_action(
    state: &State,
    uuid: &str,
    name: &str,
    body: &[u8],
) -> Result<Event, Reply> {
    if let Some(wide) = crate::wide_ints::first_wide_integer(body) {
        let message = crate::wide_ints::wide_integer_message("the step action", wide);
        return Err(Reply::error(400, "integer_too_wide", message));
    }
    let action: StepAction = serde_json::from_slice(body)
        .map_err(|e| Reply::error(400, "bad_request", format!("not a step action: {e}")))?;
    let task = state
        .tasks
        .get(uuid)
        .ok_or_else(|| Reply::error(404, "not_found", format!("no task {uuid}")))?;
    let step = task
        .step(name)
        .filter(|s| s.created)
        .ok_or_else(|| Reply::error(404, "not_found", format!("task {uuid} has no step {name}")))?;
    if step.state != StepState::Error
        || !matches!(task.state, TaskState::Error | TaskState::BlockedByFailures)
    {
        let m = format!(
            "step {name} is {} in a task that is {}; only a failed step can be reset or resolved",
            step.state.name(),
            task.state.name()
        );
        return Err(Reply::error(409, "invalid_state", m));
    }
    let at = StepRef {
        task: uuid.to_string(),
        step: name.to_string(),
        attempt: step.attempt,
    };
    let reason = match (&action.reason, &action.by) {
        (r, Some(by)) => format!("{} (by {by})", r.as_deref().unwrap_or("")),
        (r, None) => r.clone().unwrap_or_default(),
    };
    match action.action_type.as_str() {
        "reset_for_retry" => Ok(Event::StepReset { at, reason }),
        "resolve_manually" => Ok(Event::StepResolved {
            at,
            reason,
            complete: false,
            result: None,
        }),
        "complete_manually" => Ok(Event::StepResolved {
            at,
            reason,
            complete: true,
            result: action.completion_data,
        }),
        other => Err(Reply::error(
            400,
            "bad_request",
            format!(
                "action_type `{other}`: reset_for_retry, resolve_manually or complete_manually"
            ),
        )),
    }
}

/// Waits until `done` says the fold has applied what was published (an event about
/// `task`, if it names one: then only such events wake the wait).
pub(crate) fn await_fold(
    shared: &Shared,
    task: Option<&str>,
    timeout: Duration,
    done: impl FnMut(&State) -> Option<Reply>,
) -> Reply {
    let deadline = Instant::now() + timeout;
    let found = match task {
        Some(uuid) => shared.wait_for_task(uuid, deadline, done),
        None => shared.wait_for(deadline, done),
    };
    found.unwrap_or_else(|| {
        Reply::error(
            504,
            "not_applied",
            "the command was published but not applied in time",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::{decide, Clock, MAX_LEASE_LOSSES};
    use crate::event::Envelope;

    /// One step that may fail only once: lease losses must not count against that.
    const ONE_STEP: &str = "name: gone\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, retry: {max_attempts: 1}, handler: {callable: h}}";

    fn apply(state: &mut State, ts_ms: u64, event: Event) {
        let position = state.next_position;
        let env = Envelope {
            ts_ms,
            term: None,
            event,
        };
        let applied = state.apply(position, &env);
        assert!(applied.is_ok(), "{:?}: {applied:?}", env.event);
    }

    #[test]
    fn a_step_whose_workers_keep_vanishing_is_dead_lettered_as_worker_unavailable() {
        let mut state = State::default();
        let template = crate::validate::load(ONE_STEP, None).unwrap();
        apply(&mut state, 0, Event::TemplateRegistered { template });
        let created = Event::TaskCreated {
            task: "t".into(),
            namespace: "p".into(),
            name: "gone".into(),
            version: "1".into(),
            context: json!({}),
            idempotency_key: None,
            identity: None,
            protocol: None,
        };
        apply(&mut state, 0, created);
        // Each round a second later: the orchestrator decides, and a worker claims
        // what is enqueued and is never heard from again, so its lease (100 ms) has
        // run out by the next round.
        for round in 1..=40 {
            let now_ms = round * 1_000;
            let clock = Clock {
                now_ms,
                lease_ms: 100,
                claimed_at: &|_| Some(now_ms - 1_000),
                worker_seen: &|_| None,
            };
            for event in decide(&state, &clock).0 {
                apply(&mut state, now_ms, event);
            }
            let step = &state.tasks["t"].steps[0];
            if step.state == StepState::Enqueued {
                let at = StepRef {
                    task: "t".into(),
                    step: "a".into(),
                    attempt: step.attempt,
                };
                let worker = format!("w{round}");
                apply(&mut state, now_ms, Event::StepClaimed { at, worker });
            }
        }
        let task = &state.tasks["t"];
        let step = &task.steps[0];
        assert_eq!(
            (task.state, step.state, step.failures),
            (TaskState::Error, StepState::Error, 0),
            "{step:?}"
        );
        assert_eq!(
            (step.lease_losses, step.attempt),
            (MAX_LEASE_LOSSES, MAX_LEASE_LOSSES)
        );
        let dlq = dlq(&state, &[]).body;
        let entries = dlq["entries"].as_array().unwrap();
        assert_eq!(entries.len(), 1, "{dlq:#}");
        assert_eq!(
            (&entries[0]["step"], &entries[0]["reason"]),
            (&json!("a"), &json!("worker_unavailable")),
            "{dlq:#}"
        );
    }
}
