//! `embarcadero task ...` and `embarcadero template ...`: clients of the workflow API
//! (`template validate` works offline), human output or `--json`.

use super::measure::{measure, Until};
use super::ApiArg;
use crate::CliResult;
use clap::Subcommand;
use embarcadero_workflow::client::{ApiClient, ApiError};
use embarcadero_workflow::{validate, Registry, Template};
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Subcommand)]
pub enum TaskCommand {
    /// Start a task from a registered template.
    Create {
        /// The template's namespace.
        #[arg(long)]
        namespace: String,
        /// The template's name.
        #[arg(long)]
        name: String,
        /// The template's version (default: its newest registered version, as
        /// `template show NAMESPACE/NAME` shows it).
        #[arg(long)]
        version: Option<String>,
        /// The task's input, a JSON object.
        #[arg(long, default_value = "{}")]
        context: String,
        /// A second create with the same key returns the first task. Without a key, a
        /// second create with the same context does (the template's identity_strategy,
        /// `strict` by default; `always_unique` makes every create a new task).
        #[arg(long)]
        idempotency_key: Option<String>,
        /// Wait up to this many seconds for the task to finish (exit codes as `task
        /// wait`: 124 when still running, 1 when it ended other than complete).
        #[arg(long, default_value_t = 0)]
        wait: u64,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Show a task, its steps and their results.
    Get {
        /// The task's id, as `task create` printed it.
        uuid: String,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Measure latency: create COUNT tasks one after another, each awaited by long poll,
    /// and print POST-to-complete percentiles (docs/PERFORMANCE.md).
    Bench {
        /// The template's namespace.
        #[arg(long)]
        namespace: String,
        /// The template's name.
        #[arg(long)]
        name: String,
        /// The template's version (default: its newest registered version, as
        /// `template show NAMESPACE/NAME` shows it).
        #[arg(long)]
        version: Option<String>,
        /// Each task's input, a JSON object.
        #[arg(long, default_value = "{}")]
        context: String,
        /// How many tasks to run, one after another.
        #[arg(long, default_value_t = 200, value_parser = crate::at_least_one)]
        count: usize,
        /// Closed-loop clients, each with its own connection, running COUNT tasks
        /// between them (each its next task once its last one completed); more than one
        /// also prints the tasks completed per second.
        #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
        clients: usize,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// List tasks, oldest first, a page at a time.
    List {
        /// Only tasks of this namespace.
        #[arg(long)]
        namespace: Option<String>,
        /// Only tasks in this state (pending, steps_in_process, complete, error, ...).
        #[arg(long)]
        status: Option<String>,
        /// The page to show (1 is the first).
        #[arg(long, default_value_t = 1)]
        page: usize,
        /// Tasks per page (at most 100).
        #[arg(long, default_value_t = 25)]
        per_page: usize,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a task: its unfinished steps are cancelled, late results refused.
    Cancel {
        /// The task's id, as `task create` printed it.
        uuid: String,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Show a task's steps, or one step, or one step's audit trail.
    Steps {
        /// The task's id, as `task create` printed it.
        uuid: String,
        /// One step's name (its step_uuid); all steps when absent.
        step: Option<String>,
        /// Show the step's audit trail: every transition and every refused event.
        #[arg(long, requires = "step")]
        audit: bool,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Rerun a failed task: each of its failed steps runs again with a fresh retry budget.
    Rerun {
        /// The task's id, as `task create` printed it.
        uuid: String,
        /// Why, for the audit trail.
        #[arg(long, default_value = "")]
        reason: String,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Resolve a whole task by hand (Tasker's resolve_manually): it ends
    /// resolved_manually and its unfinished steps are cancelled. For a task that has
    /// not finished, or failed; refused for one that completed or was cancelled.
    Resolve {
        /// The task's id, as `task create` printed it.
        uuid: String,
        /// Why, for the audit trail.
        #[arg(long, default_value = "")]
        reason: String,
        /// Who resolved it (Tasker's resolved_by), recorded with the reason.
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Reset a failed step for retry: it runs again with a fresh retry budget.
    ResetStep {
        /// The task's id, as `task create` printed it.
        uuid: String,
        /// The failed step's name.
        step: String,
        /// Why, for the audit trail.
        #[arg(long, default_value = "")]
        reason: String,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Resolve a failed step by hand: its dependents then run (with --complete or
    /// --result, the step counts as complete with that result).
    ResolveStep {
        /// The task's id, as `task create` printed it.
        uuid: String,
        /// The failed step's name.
        step: String,
        /// Complete the step manually (Tasker's complete_manually) rather than resolve it.
        #[arg(long)]
        complete: bool,
        /// The step's result, a JSON value (implies --complete).
        #[arg(long)]
        result: Option<String>,
        /// Why, for the audit trail.
        #[arg(long, default_value = "")]
        reason: String,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// The engine's summary: tasks and steps by state, and how far it is behind the log
    /// (from the orchestrator's /metrics).
    Stats {
        #[command(flatten)]
        api: ApiArg,
        /// Print the summary as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// The dead-letter list: failed steps of blocked or failed tasks, with the reason.
    Dlq {
        /// The page to show (1 is the first).
        #[arg(long, default_value_t = 1)]
        page: usize,
        /// Entries per page (at most 100).
        #[arg(long, default_value_t = 25)]
        per_page: usize,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Wait for a task to finish. Exits 0 when it completed, 124 (as `timeout` does) when
    /// the wait ran out with the task still running, 1 when it ended otherwise (error,
    /// cancelled, resolved by hand, blocked) or the wait failed.
    Wait {
        /// The task's id, as `task create` printed it.
        uuid: String,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Register a YAML template.
    Register {
        /// The template's YAML file.
        file: PathBuf,
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// List registered templates.
    List {
        #[command(flatten)]
        api: ApiArg,
        /// Print the result as JSON, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Show a template's DAG: its steps by stage, or Graphviz DOT with --dot.
    Show {
        /// A registered template, `NAMESPACE/NAME` (its newest version, by numeric
        /// version parts: 1.10.0 after 1.9.0) or `NAMESPACE/NAME@VERSION`; or a YAML
        /// file with --file.
        template: Option<String>,
        /// Show this YAML file instead of a registered template (checked as by
        /// `template validate --any-handler`).
        #[arg(long, conflicts_with = "template")]
        file: Option<PathBuf>,
        /// Print the DAG as Graphviz DOT (`| dot -Tsvg > dag.svg`).
        #[arg(long, conflicts_with = "json")]
        dot: bool,
        /// Print the whole template as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArg,
    },
    /// Check a YAML template without registering it (handlers: the built-in ones).
    Validate {
        /// The template's YAML file.
        file: PathBuf,
        /// Accept any handler name.
        #[arg(long)]
        any_handler: bool,
        /// Print the outcome as JSON (`valid`, `template`, `steps`, or `error`), for
        /// scripts; exits non-zero for an invalid template either way.
        #[arg(long)]
        json: bool,
    },
}

/// `--context`: a JSON object, as a task's input is.
fn context_object(text: &str) -> Result<Value, String> {
    let context: Value =
        serde_json::from_str(text).map_err(|e| format!("--context is not JSON: {e}"))?;
    if !context.is_object() {
        return Err(format!(
            "--context is a JSON object (the task's input, e.g. '{{\"n\": 2}}'), not {text}"
        ));
    }
    Ok(context)
}

/// `version`, or the newest registered version of `namespace/name` (the API takes a
/// version with every task; a user means the template as it stands).
fn version_or_newest(
    client: &ApiClient,
    namespace: &str,
    name: &str,
    version: Option<String>,
) -> Result<String, String> {
    match version {
        Some(v) => Ok(v),
        None => client.newest_version(namespace, name).map_err(api_error),
    }
}

/// `task create`: starts a task of the template's given (or newest) version, waiting for
/// it with `--wait`.
fn create(cmd: TaskCommand) -> CliResult {
    let TaskCommand::Create {
        namespace,
        name,
        version,
        context,
        idempotency_key,
        wait,
        api,
        json,
    } = cmd
    else {
        unreachable!("called with a create command")
    };
    let context = context_object(&context)?;
    let client = ApiClient::new(api.addr());
    let version = version_or_newest(&client, &namespace, &name, version)?;
    let (created, existing) = client
        .submit_task(
            &namespace,
            &name,
            &version,
            context,
            idempotency_key.as_deref(),
        )
        .map_err(api_error)?;
    if existing {
        // Said on stderr, so `--json` stays one document.
        eprintln!(
            "note: task {} already existed with this template and context (its template's identity_strategy; use --idempotency-key with a new key, or identity_strategy: always_unique, for a new task)",
            text(&created["task_uuid"])
        );
    }
    let task = match (wait, created["task_uuid"].as_str()) {
        (0, _) | (_, None) => created,
        (s, Some(uuid)) => client
            .wait_task(uuid, Some(Duration::from_secs(s)))
            .map_err(api_error)?,
    };
    show_task(&task, json);
    finished_ok(&task, wait > 0)
}

pub fn task(cmd: TaskCommand) -> CliResult {
    match cmd {
        cmd @ TaskCommand::Create { .. } => create(cmd),
        TaskCommand::Get { uuid, api, json } => {
            show_task(
                &ApiClient::new(api.addr())
                    .get_task(&uuid, 0)
                    .map_err(api_error)?,
                json,
            );
            Ok(())
        }
        TaskCommand::Bench {
            namespace,
            name,
            version,
            context,
            count,
            clients,
            api,
            json,
        } => {
            let context = context_object(&context)?;
            let version =
                version_or_newest(&ApiClient::new(api.addr()), &namespace, &name, version)?;
            let template = [namespace.as_str(), &name, &version];
            bench(api.addr(), template, &context, [count, clients], json)
        }
        TaskCommand::Wait {
            uuid,
            timeout,
            api,
            json,
        } => {
            let task = ApiClient::new(api.addr())
                .wait_task(&uuid, Some(Duration::from_secs(timeout)))
                .map_err(api_error)?;
            show_task(&task, json);
            finished_ok(&task, true)
        }
        other => super::manage::run(other),
    }
}

pub fn template(cmd: TemplateCommand) -> CliResult {
    match cmd {
        TemplateCommand::Register { file, api, json } => {
            let t = ApiClient::new(api.addr())
                .register_template(&read(&file)?)
                .map_err(api_error)?;
            match json {
                true => say!("{t}"),
                false => say!(
                    "registered {}/{}@{}",
                    text(&t["namespace"]),
                    text(&t["name"]),
                    text(&t["version"])
                ),
            }
            Ok(())
        }
        TemplateCommand::List { api, json } => {
            let list = ApiClient::new(api.addr())
                .list_templates()
                .map_err(api_error)?;
            if json {
                say!("{list}");
                return Ok(());
            }
            for t in list["templates"].as_array().into_iter().flatten() {
                let steps = t["steps"].as_array().map_or(0, |s| s.len());
                say!(
                    "{}/{}@{}  {}",
                    text(&t["namespace"]),
                    text(&t["name"]),
                    text(&t["version"]),
                    crate::count_of(steps as u64, "step", "steps")
                );
            }
            Ok(())
        }
        TemplateCommand::Show {
            template,
            file,
            dot,
            json,
            api,
        } => {
            let t = match (template, file) {
                (_, Some(file)) => {
                    validate::load(&read(&file)?, None).map_err(|e| e.to_string())?
                }
                (Some(key), None) => registered_template(api.addr(), &key)?,
                (None, None) => {
                    return Err("name a template (NAMESPACE/NAME[@VERSION]) or give --file".into())
                }
            };
            let shown = match (dot, json) {
                (true, _) => embarcadero_workflow::render::dot(&t),
                (_, true) => serde_json::to_string_pretty(&t).expect("a template is JSON"),
                _ => embarcadero_workflow::render::text(&t),
            };
            say!("{}", shown.trim_end());
            Ok(())
        }
        TemplateCommand::Validate {
            file,
            any_handler,
            json,
        } => validate_file(&file, any_handler, json),
    }
}

/// `template validate`: the template in `file` loads (and, unless `any_handler`, names
/// only built-in handlers). With `json`, the outcome is printed as JSON in both cases
/// and an invalid template still fails the command, so scripts may use either.
fn validate_file(file: &std::path::Path, any_handler: bool, json: bool) -> CliResult {
    let known = Registry::builtin().names();
    let loaded = validate::load(&read(file)?, (!any_handler).then_some(&known));
    match (loaded, json) {
        (Ok(t), false) => say!(
            "{} is valid: {}",
            t.key(),
            crate::count_of(t.steps.len() as u64, "step", "steps")
        ),
        (Ok(t), true) => say!(
            "{}",
            serde_json::json!({"valid": true, "template": t.key().to_string(), "steps": t.steps.len()})
        ),
        (Err(e), false) => return Err(e.to_string()),
        (Err(e), true) => {
            let shown = serde_json::json!({"valid": false, "error": e.to_string(),
                "template": e.template, "step": e.step, "field": e.field});
            say!("{shown}");
            return Err(e.to_string());
        }
    }
    Ok(())
}

/// `task bench`: the measurement, printed for a person or as JSON.
fn bench(
    api: &str,
    template: [&str; 3],
    context: &Value,
    [count, clients]: [usize; 2],
    json: bool,
) -> CliResult {
    let m = measure(api, template, context, Until::Tasks(count), clients)?;
    let ([p50, p95, p99], [create_p50, _, create_p99]) = (m.total, m.create);
    let per_s = m.tasks_per_s;
    let [ns, name, version] = template;
    let of = format!("{count} tasks of {ns}/{name}@{version}");
    let create = format!("(POST alone p50 {create_p50:.2} ms  p99 {create_p99:.2} ms)");
    match json {
        true => say!("{}", m.to_json()),
        false if clients == 1 => say!("{of}: POST to complete p50 {p50:.2} ms  p95 {p95:.2} ms  p99 {p99:.2} ms {create}"),
        false => say!("{of} by {clients} clients: {per_s:.1} tasks/s, POST to complete p50 {p50:.2} ms  p95 {p95:.2} ms  p99 {p99:.2} ms {create}"),
    }
    Ok(())
}

/// The registered template `key` names (`NAMESPACE/NAME[@VERSION]`; without a version,
/// its newest).
fn registered_template(api: &str, key: &str) -> Result<Template, String> {
    let (path, version) = match key.split_once('@') {
        Some((p, v)) => (p, Some(v)),
        None => (key, None),
    };
    let Some((namespace, name)) = path.split_once('/') else {
        return Err(format!("{key:?} is not NAMESPACE/NAME[@VERSION]"));
    };
    let found = ApiClient::new(api)
        .get_template(namespace, name, version)
        .map_err(|e| match e.status {
            404 => format!("{}; see `embarcadero template list`", e.message),
            _ => api_error(e),
        })?;
    serde_json::from_value(found).map_err(|e| format!("template {key}: {e}"))
}

fn read(file: &std::path::Path) -> Result<String, String> {
    std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))
}

pub(super) fn api_error(e: ApiError) -> String {
    e.to_string()
}

pub(super) fn text(v: &Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_string)
}

pub(super) fn show_task(t: &Value, json: bool) {
    if json {
        say!("{t}");
        return;
    }
    say!(
        "task {}  {}  {} complete",
        text(&t["task_uuid"]),
        text(&t["status"]),
        percent(&t["completion_percentage"])
    );
    for s in t["steps"].as_array().into_iter().flatten() {
        say!("  {}", step_line(s));
    }
}

/// A step as `task get` and `task steps` print it: name, state, attempt, and its result
/// or its last error (nothing while it has neither): `error:` in state error, `last
/// error:` while it runs again (retried, or enqueued again by a rerun or a reset).
pub(super) fn step_line(s: &Value) -> String {
    let detail = match (&s["result"], &s["last_error"]) {
        (Value::Null, Value::Null) => String::new(),
        (Value::Null, e) if s["current_state"] == "error" => format!("error: {}", text(e)),
        (Value::Null, e) => format!("last error: {}", text(e)),
        (r, _) => format!("result: {r}"),
    };
    format!(
        "{:<20} {:<28} attempt {}  {detail}",
        text(&s["name"]),
        text(&s["current_state"]),
        s["attempts"]
    )
}

/// A completion percentage as a person reads it: `33.3%`, `100%` (the API's number
/// is a float: `33.333333333333336`).
pub(super) fn percent(v: &Value) -> String {
    match v.as_f64() {
        Some(p) if p.fract() == 0.0 => format!("{p:.0}%"),
        Some(p) => format!("{p:.1}%"),
        None => format!("{v}%"),
    }
}

/// The exit code of a wait that ran out with its task still running: `timeout`'s
/// (2 is clap's for a usage error, which a script must not take for "still running").
pub(super) const STILL_RUNNING: u8 = 124;

/// What a wait that ran out adds when steps wait for a worker none has claimed them for
/// (a handler no running worker serves, a misspelt one under `--any-handler`).
fn unclaimed_hint(t: &Value) -> String {
    let unclaimed: Vec<&str> = t["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["current_state"] == "enqueued" && s["worker"].is_null())
        .filter_map(|s| s["name"].as_str())
        .collect();
    if unclaimed.is_empty() {
        return String::new();
    }
    format!(
        "; no worker has claimed {} {} yet: is a worker running that serves {} handler in \
         namespace {}? (`template show` names the handlers; the orchestrator warns of an \
         attempt left unclaimed for a minute)",
        if unclaimed.len() == 1 {
            "step"
        } else {
            "steps"
        },
        unclaimed.join(", "),
        if unclaimed.len() == 1 {
            "its"
        } else {
            "each one's"
        },
        text(&t["namespace"])
    )
}

/// With `must_finish`, a task that did not complete is a failure of the command.
pub(super) fn finished_ok(t: &Value, must_finish: bool) -> CliResult {
    match (must_finish, t["status"].as_str()) {
        (false, _) | (true, Some("complete")) => Ok(()),
        // Not finished: the wait ran out (a step may have no worker with its handler).
        (true, Some(status))
            if !matches!(
                status,
                "error" | "cancelled" | "resolved_manually" | "blocked_by_failures"
            ) =>
        {
            crate::fail_with(
                STILL_RUNNING,
                format!(
                "task {} is {status}: the wait ran out before it finished (`task wait {}` waits \
                 more; `task steps {}` shows which step it waits for){}",
                text(&t["task_uuid"]),
                text(&t["task_uuid"]),
                text(&t["task_uuid"]),
                unclaimed_hint(t)
            ),
            )
        }
        (true, status) => Err(format!(
            "task {} ended {}",
            text(&t["task_uuid"]),
            match status {
                Some("error") => "in error",
                Some("resolved_manually") => "resolved by hand",
                Some("blocked_by_failures") => "blocked by failures",
                Some(other) => other,
                None => "in a state the answer did not give",
            }
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn percentages_read_as_a_person_writes_them() {
        assert_eq!(percent(&json!(33.333333333333336)), "33.3%");
        assert_eq!(percent(&json!(100.0)), "100%");
        assert_eq!(percent(&json!(0)), "0%");
    }

    #[test]
    fn a_step_running_again_shows_its_previous_error_as_the_last_one() {
        let failed = json!({"name": "one", "current_state": "error", "attempts": 3,
            "result": null, "last_error": "ValueError: no luck"});
        assert!(step_line(&failed).ends_with("  error: ValueError: no luck"));
        let again = json!({"name": "one", "current_state": "enqueued", "attempts": 4,
            "result": null, "last_error": "ValueError: no luck"});
        assert!(step_line(&again).ends_with("  last error: ValueError: no luck"));
    }

    #[test]
    fn a_wait_that_ran_out_says_so_and_what_to_run_next() {
        let open = json!({"task_uuid": "t1", "status": "steps_in_process"});
        let e = finished_ok(&open, true).unwrap_err();
        assert!(
            e.contains("the wait ran out") && e.contains("task wait t1"),
            "{e}"
        );
        let waiting = json!({"task_uuid": "t1", "status": "steps_in_process", "namespace": "demo",
            "steps": [{"name": "one", "current_state": "enqueued", "worker": null},
                      {"name": "two", "current_state": "in_progress", "worker": "w"}]});
        let e = finished_ok(&waiting, true).unwrap_err();
        assert!(
            e.contains("no worker has claimed step one yet") && e.contains("namespace demo"),
            "{e}"
        );
        assert!(!e.contains("two"), "{e}");
        let failed = json!({"task_uuid": "t1", "status": "error"});
        assert_eq!(
            finished_ok(&failed, true).unwrap_err(),
            "task t1 ended in error"
        );
        let done = json!({"task_uuid": "t1", "status": "complete"});
        assert!(finished_ok(&done, true).is_ok() && finished_ok(&open, false).is_ok());
    }
}
