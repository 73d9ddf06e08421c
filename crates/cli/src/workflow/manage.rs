//! `embarcadero task list|cancel|rerun|resolve|steps|reset-step|resolve-step|stats|dlq`: the task
//! management commands, clients of the workflow API's routes over existing tasks.

use super::commands::{api_error, percent, show_task, step_line, text, TaskCommand};
use crate::CliResult;
use embarcadero_workflow::client::ApiClient;
use serde_json::{json, Value};

pub fn run(cmd: TaskCommand) -> CliResult {
    match cmd {
        TaskCommand::List {
            namespace,
            status,
            page,
            per_page,
            api,
            json,
        } => list(api.addr(), [namespace, status], [page, per_page], json),
        TaskCommand::Cancel { uuid, api, json } => cancel(api.addr(), &uuid, json),
        TaskCommand::Steps {
            uuid,
            step,
            audit,
            api,
            json,
        } => steps(api.addr(), &uuid, step.as_deref(), audit, json),
        TaskCommand::Rerun {
            uuid,
            reason,
            api,
            json,
        } => rerun(api.addr(), &uuid, &reason, json),
        TaskCommand::Resolve {
            uuid,
            reason,
            by,
            api,
            json,
        } => resolve(api.addr(), &uuid, &reason, by.as_deref(), json),
        TaskCommand::Stats { api, json } => print_stats(api.addr(), json),
        TaskCommand::ResetStep {
            uuid,
            step,
            reason,
            api,
            json,
        } => {
            let action = json!({"action_type": "reset_for_retry", "reason": reason});
            act(api.addr(), &uuid, &step, action, json)
        }
        TaskCommand::ResolveStep {
            uuid,
            step,
            complete,
            result,
            reason,
            api,
            json,
        } => {
            let action = resolve_action(complete, result, reason)?;
            act(api.addr(), &uuid, &step, action, json)
        }
        TaskCommand::Dlq {
            page,
            per_page,
            api,
            json,
        } => dlq(api.addr(), [page, per_page], json),
        _ => unreachable!("not a task management command"),
    }
}

/// The summary of a /metrics text: the states that have tasks or steps, and the lag.
pub fn stats(metrics: &str) -> String {
    let mut lines = Vec::new();
    for kind in ["tasks", "steps"] {
        let counts: Vec<String> = state_counts(metrics, kind)
            .iter()
            .map(|(state, n)| format!("{state} {n}"))
            .collect();
        let counts = match counts.is_empty() {
            true => "none yet".to_string(),
            false => counts.join(", "),
        };
        lines.push(format!("{kind}: {counts}"));
    }
    let lag = queue_lag(metrics).map_or("unknown".to_string(), |n| {
        crate::count_of(n, "event", "events")
    });
    lines.push(format!("queue lag: {lag}"));
    if let Some((active, term, quiet)) = role(metrics) {
        let role = if active { "active" } else { "standby" };
        let quiet = if quiet {
            ", lease quiet (no task open)"
        } else {
            ""
        };
        lines.push(format!("orchestrator: {role} (term {term}){quiet}"));
    }
    lines.join("\n")
}

/// `task stats --json`: `{"tasks": {state: count}, "steps": {state: count},
/// "queue_lag_events": count or null}`, from the same figures as [`stats`].
pub fn stats_json(metrics: &str) -> Value {
    let counts = |kind| {
        let pairs = state_counts(metrics, kind).into_iter();
        Value::Object(pairs.map(|(state, n)| (state, json!(n))).collect())
    };
    let role = role(metrics).map(
        |(active, term, quiet)| json!({ "active": active, "term": term, "lease_quiet": quiet }),
    );
    json!({
        "tasks": counts("tasks"),
        "steps": counts("steps"),
        "queue_lag_events": queue_lag(metrics),
        "orchestrator": role,
    })
}

/// The orchestrator's `embarcadero_workflow_{kind}{state="S"} N` samples in the order
/// it exposes them, the states at 0 left out.
fn state_counts(metrics: &str, kind: &str) -> Vec<(String, u64)> {
    let prefix = format!("embarcadero_workflow_{kind}{{state=\"");
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix)?.split_once("\"} "))
        .filter_map(|(state, n)| Some((state.to_string(), n.trim().parse::<u64>().ok()?)))
        .filter(|(_, n)| *n != 0)
        .collect()
}

/// The orchestrator's queue lag in events, if it exposes one.
fn queue_lag(metrics: &str) -> Option<u64> {
    gauge(metrics, "queue_lag_events")
}

/// Whether the orchestrator decides, the current term, and whether its lease runs quiet
/// (docs/WORKFLOW.md "Quiet renewals"); `None` from an orchestrator without the gauges.
fn role(metrics: &str) -> Option<(bool, u64, bool)> {
    let active = gauge(metrics, "orchestrator_active")? == 1;
    let term = gauge(metrics, "orchestrator_term")?;
    let quiet = gauge(metrics, "orchestrator_lease_quiet") == Some(1);
    Some((active, term, quiet))
}

/// The value of the gauge `embarcadero_workflow_{name}` (no labels).
fn gauge(metrics: &str, name: &str) -> Option<u64> {
    let prefix = format!("embarcadero_workflow_{name} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|n| n.trim().parse().ok())
}

/// `DELETE /v1/tasks/{uuid}`: the cancelled task.
fn cancel(api: &str, uuid: &str, json: bool) -> CliResult {
    let t = ApiClient::new(api).cancel_task(uuid).map_err(api_error)?;
    show_task(&t, json);
    Ok(())
}

/// `POST /v1/tasks/{uuid}/resolve`: the task, resolved by hand.
fn resolve(api: &str, uuid: &str, reason: &str, by: Option<&str>, json: bool) -> CliResult {
    let body = json!({ "reason": reason, "resolved_by": by });
    let t = ApiClient::new(api)
        .request("POST", &format!("/v1/tasks/{uuid}/resolve"), Some(body))
        .map_err(api_error)?;
    show_task(&t, json);
    Ok(())
}

/// `GET /v1/workflow/metrics`, summed up by [`stats`].
fn print_stats(api: &str, json: bool) -> CliResult {
    let metrics = ApiClient::new(api).metrics().map_err(api_error)?;
    match json {
        true => say!("{}", stats_json(&metrics)),
        false => say!("{}", stats(&metrics)),
    }
    Ok(())
}

/// `GET /v1/dlq`: one page of the dead-letter list.
fn dlq(api: &str, [page, per_page]: [usize; 2], json: bool) -> CliResult {
    let list = get(api, &format!("/v1/dlq?page={page}&per_page={per_page}"))?;
    let what = ("entries", "the dead-letter queue is empty");
    show_list(&list, what, json, |e| {
        format!(
            "{}  step {}  {}: {}",
            text(&e["task_uuid"]),
            text(&e["step"]),
            text(&e["reason"]),
            text(&e["error"])
        )
    });
    Ok(())
}

/// `POST /v1/tasks/{uuid}/rerun`: the reopened task.
fn rerun(api: &str, uuid: &str, reason: &str, json: bool) -> CliResult {
    let t = ApiClient::new(api)
        .request(
            "POST",
            &format!("/v1/tasks/{uuid}/rerun"),
            Some(json!({ "reason": reason })),
        )
        .map_err(api_error)?;
    show_task(&t, json);
    Ok(())
}

/// `GET /v1/tasks` with the filters given.
fn list(
    api: &str,
    [namespace, status]: [Option<String>; 2],
    [page, per_page]: [usize; 2],
    json: bool,
) -> CliResult {
    let mut query = format!("?page={page}&per_page={per_page}");
    for (k, v) in [("namespace", namespace), ("status", status)] {
        if let Some(v) = v {
            query.push_str(&format!("&{k}={v}"));
        }
    }
    let list = get(api, &format!("/v1/tasks{query}"))?;
    show_list(&list, ("tasks", "no tasks"), json, |t| {
        format!(
            "{}  {}/{}@{}  {}  {}",
            text(&t["task_uuid"]),
            text(&t["namespace"]),
            text(&t["name"]),
            text(&t["version"]),
            text(&t["status"]),
            percent(&t["completion_percentage"])
        )
    });
    Ok(())
}

/// All steps, one step, or one step's audit trail.
fn steps(api: &str, uuid: &str, step: Option<&str>, audit: bool, json: bool) -> CliResult {
    let path = match (step, audit) {
        (None, _) => format!("/v1/tasks/{uuid}/workflow_steps"),
        (Some(s), false) => format!("/v1/tasks/{uuid}/workflow_steps/{s}"),
        (Some(s), true) => format!("/v1/tasks/{uuid}/workflow_steps/{s}/audit"),
    };
    show_steps(&get(api, &path)?, json);
    Ok(())
}

/// Tasker's resolve_manually, or complete_manually when there is a result.
fn resolve_action(complete: bool, result: Option<String>, reason: String) -> Result<Value, String> {
    let result: Option<Value> = match result {
        Some(r) => {
            Some(serde_json::from_str(&r).map_err(|e| format!("--result is not JSON: {e}"))?)
        }
        None => None,
    };
    let kind = match complete || result.is_some() {
        true => "complete_manually",
        false => "resolve_manually",
    };
    Ok(json!({"action_type": kind, "reason": reason, "completion_data": result}))
}

fn get(api: &str, path: &str) -> Result<Value, String> {
    ApiClient::new(api)
        .request("GET", path, None)
        .map_err(api_error)
}

fn act(api: &str, uuid: &str, step: &str, action: Value, json: bool) -> CliResult {
    let s = ApiClient::new(api)
        .step_action(uuid, step, action)
        .map_err(api_error)?;
    match json {
        true => say!("{s}"),
        false => say!(
            "step {} of task {uuid} is {}",
            text(&s["name"]),
            text(&s["current_state"])
        ),
    }
    Ok(())
}

/// Prints `list[key]` one `line` each and the page it is, or `nothing` for an empty list.
fn show_list(
    list: &Value,
    (key, nothing): (&str, &str),
    json: bool,
    line: impl Fn(&Value) -> String,
) {
    if json {
        say!("{list}");
        return;
    }
    for item in list[key].as_array().into_iter().flatten() {
        say!("{}", line(item));
    }
    let p = &list["pagination"];
    if p["total_count"] == 0 {
        say!("{nothing}");
        return;
    }
    say!(
        "page {} of {} ({} in all)",
        p["page"],
        p["total_pages"],
        p["total_count"]
    );
}

fn show_steps(v: &Value, json: bool) {
    if json {
        say!("{v}");
        return;
    }
    let one = [v.clone()];
    let steps = v["steps"].as_array().map_or(&one[..], |s| &s[..]);
    for s in steps {
        if s.get("current_state").is_some() {
            say!("{}", step_line(s));
        }
        for t in s["transitions"].as_array().into_iter().flatten() {
            say!(
                "  {} -> {}  at position {} ({} ms)",
                text(&t["from"]),
                text(&t["to"]),
                t["position"],
                t["ts_ms"]
            );
        }
        for r in s["refused_events"].as_array().into_iter().flatten() {
            say!("  refused: {}", text(r));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_orchestrators_role_and_quiet_lease_are_shown_when_it_reports_them() {
        let metrics = "embarcadero_workflow_orchestrator_active 1\n\
                       embarcadero_workflow_orchestrator_term 3\n\
                       embarcadero_workflow_orchestrator_lease_quiet 1\n";
        assert!(
            stats(metrics).ends_with("\norchestrator: active (term 3), lease quiet (no task open)")
        );
        let standby = "embarcadero_workflow_orchestrator_active 0\n\
                       embarcadero_workflow_orchestrator_term 4\n";
        assert!(stats(standby).ends_with("\norchestrator: standby (term 4)"));
        assert_eq!(
            stats_json(standby)["orchestrator"],
            json!({"active": false, "term": 4, "lease_quiet": false})
        );
    }

    #[test]
    fn an_engine_with_nothing_yet_says_so_rather_than_print_empty_counts() {
        let metrics = "embarcadero_workflow_tasks{state=\"complete\"} 0\n";
        assert_eq!(
            stats(metrics),
            "tasks: none yet\nsteps: none yet\nqueue lag: unknown"
        );
    }
}
