//! The REST API as a function from (method, target, body) to (status, JSON body, or a
//! task's event stream; and headers such as a 503's Retry-After), with no HTTP server
//! of its own: `embarcadero orchestrator` serves it on its own port in
//! phase 1, and the control plane can route `/v1/tasks` and `/v1/templates` to it
//! later. Commands are published to the log and answered once the fold has applied
//! them, so a `GET` right after a `POST` sees what the `POST` made.

use crate::event::Event;
use crate::identity::identity;
use crate::machine::{StepState, TaskState};
use crate::orchestrator::Engine;
use crate::schema::InputSchema;
use crate::state::State;
use crate::task_events::TaskEvents;
use crate::task_routes;
use crate::template::{version_order, TemplateKey};
use crate::validate;
use crate::view::{step_view, task_view, template_view};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An answer: HTTP status, JSON body and headers beyond the content's type and length;
/// or, for `GET /v1/tasks/{uuid}/events`, a stream of server-sent events instead of
/// the body.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub headers: Vec<(&'static str, String)>,
    pub events: Option<TaskEvents>,
}

impl Reply {
    pub(crate) fn ok(status: u16, body: Value) -> Self {
        Self {
            status,
            body,
            headers: Vec::new(),
            events: None,
        }
    }

    /// `{"error":{"code","message"}}`.
    pub fn error(status: u16, code: &str, message: impl Into<String>) -> Self {
        Self::ok(
            status,
            json!({"error": {"code": code, "message": message.into()}}),
        )
    }

    /// This reply for a request that carried `last_event_id` (the `Last-Event-ID`
    /// header): an event stream then resumes after the position it names (the `id:` the
    /// stream gave); 400 if it names none. Other replies are unchanged.
    pub fn resuming(mut self, last_event_id: Option<&str>) -> Self {
        let Some(id) = last_event_id else {
            return self;
        };
        let Some(events) = self.events.take() else {
            return self;
        };
        match id.parse::<u64>() {
            Ok(position) => {
                self.events = Some(events.after(position));
                self
            }
            Err(_) => Reply::error(
                400,
                "bad_request",
                format!("Last-Event-ID {id:?} is not a log position (the stream's ids are)"),
            ),
        }
    }
}

/// How long a command waits for the fold to apply it.
const APPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// The `Retry-After` of a 503 for backpressure: about as long as a short task takes.
const BACKPRESSURE_RETRY_S: u64 = 1;
/// The longest long poll (`?wait=`).
pub const MAX_WAIT_S: u64 = 300;

pub struct Api {
    engine: Arc<Engine>,
    /// Handler names templates may use; `None`: any.
    known_handlers: Option<BTreeSet<String>>,
    schemas: Mutex<HashMap<TemplateKey, Arc<InputSchema>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTask {
    name: String,
    namespace: String,
    version: String,
    #[serde(default)]
    context: Value,
    #[serde(default)]
    idempotency_key: Option<String>,
    /// Tasker's fields, accepted and not used in phase 1.
    #[serde(default)]
    initiator: Option<String>,
    #[serde(default)]
    source_system: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

impl Api {
    pub fn new(engine: Arc<Engine>, known_handlers: Option<BTreeSet<String>>) -> Self {
        Self {
            engine,
            known_handlers,
            schemas: Mutex::new(HashMap::new()),
        }
    }

    /// 503 while the engine cannot answer from the whole log: it stopped, it lost its
    /// log (it reconnects by itself), or it is still reading the log to its end.
    fn unavailable(&self) -> Option<Reply> {
        if let Some(why) = self.engine.failure.lock().clone() {
            return Some(Reply::error(
                503,
                "engine_stopped",
                format!("the orchestrator stopped: {why}"),
            ));
        }
        if let Some(why) = self.engine.outage.lock().clone() {
            let mut reply = Reply::error(
                503,
                "log_unavailable",
                format!("the orchestrator {why}; it reconnects by itself; retry shortly"),
            );
            reply.headers.push(("Retry-After", "1".to_string()));
            return Some(reply);
        }
        let replaying = !self.engine.caught_up.load(Ordering::SeqCst);
        replaying.then(|| {
            Reply::error(
                503,
                "replaying",
                "the orchestrator is replaying the log; retry shortly",
            )
        })
    }

    pub fn handle(&self, method: &str, target: &str, body: &[u8]) -> Reply {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        if let Some(reply) = self.unavailable() {
            return reply;
        }
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let pairs = query_pairs(query);
        let state = || self.engine.shared.lock();
        match (method, parts.as_slice()) {
            ("POST", ["v1", "tasks"]) => self.create_task(body),
            ("GET", ["v1", "tasks"]) => task_routes::list_tasks(&state(), &pairs),
            ("GET", ["v1", "tasks", uuid]) => self.get_task(uuid, query),
            ("DELETE", ["v1", "tasks", uuid]) => self.cancel_task(uuid),
            ("GET", ["v1", "tasks", uuid, "events"]) => self.task_events(uuid),
            ("POST", ["v1", "tasks", uuid, "rerun"]) => self.rerun_task(uuid, body),
            ("POST", ["v1", "tasks", uuid, "resolve"]) => self.resolve_task(uuid, body),
            ("GET", ["v1", "tasks", uuid, "workflow_steps"]) => {
                task_routes::get_steps(&state(), uuid, None, false)
            }
            ("GET", ["v1", "tasks", uuid, "workflow_steps", step]) => {
                task_routes::get_steps(&state(), uuid, Some(step), false)
            }
            ("GET", ["v1", "tasks", uuid, "workflow_steps", step, "audit"]) => {
                task_routes::get_steps(&state(), uuid, Some(step), true)
            }
            ("PATCH", ["v1", "tasks", uuid, "workflow_steps", step]) => {
                self.step_action(uuid, step, body)
            }
            ("GET", ["v1", "dlq"]) => task_routes::dlq(&state(), &pairs),
            ("POST", ["v1", "templates"]) => self.register_template(body),
            ("GET", ["v1", "templates"]) => self.list_templates(),
            ("GET", ["v1", "templates", namespace, name]) => {
                self.get_template(namespace, name, None)
            }
            ("GET", ["v1", "templates", namespace, name, version]) => {
                self.get_template(namespace, name, Some(version))
            }
            (
                _,
                ["v1", "tasks"]
                | ["v1", "tasks", _]
                | ["v1", "tasks", _, "events" | "rerun" | "resolve"]
                | ["v1", "tasks", _, "workflow_steps", ..]
                | ["v1", "templates", ..]
                | ["v1", "dlq"],
            ) => Reply::error(
                405,
                "method_not_allowed",
                format!("{method} is not allowed on {path}"),
            ),
            _ => Reply::error(404, "not_found", format!("no route {method} {path}")),
        }
    }

    fn create_task(&self, body: &[u8]) -> Reply {
        if let Some(wide) = crate::wide_ints::first_wide_integer(body) {
            let message = crate::wide_ints::wide_integer_message("the task request", wide);
            return Reply::error(400, "integer_too_wide", message);
        }
        let req: CreateTask = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return Reply::error(400, "bad_request", format!("not a task request: {e}")),
        };
        let _ = (&req.initiator, &req.source_system, &req.reason);
        if !matches!(req.context, Value::Object(_) | Value::Null) {
            return Reply::error(
                400,
                "invalid_context",
                format!(
                    "the context must be a JSON object (or left out), not {}",
                    json_kind(&req.context)
                ),
            );
        }
        let key = TemplateKey {
            namespace: req.namespace.clone(),
            name: req.name.clone(),
            version: req.version.clone(),
        };
        let identity = match self.check_task_request(&key, &req) {
            Ok(identity) => identity,
            Err(reply) => return reply,
        };
        let uuid = crate::ids::new_uuid();
        let (context, key) = (req.context.clone(), req.idempotency_key.clone());
        let event = Event::TaskCreated {
            task: uuid.clone(),
            namespace: req.namespace,
            name: req.name,
            version: req.version,
            context: req.context,
            idempotency_key: req.idempotency_key,
            identity: identity.clone(),
            protocol: Some(self.engine.task_protocol),
        };
        if let Err(e) = self.engine.writer().publish(event) {
            return Reply::error(
                503,
                "log_unavailable",
                format!("cannot publish the task: {e}"),
            );
        }
        // Another request with the same identity may have come first in the log: the
        // fold then refused ours, and the answer is that task.
        let found = self
            .engine
            .shared
            .wait_for_task(&uuid, Instant::now() + APPLY_TIMEOUT, |s| {
                if let Some(t) = s.tasks.get(&uuid) {
                    return Some(Reply::ok(201, task_view(t)));
                }
                let other = identity.as_ref().and_then(|k| s.idempotency.get(k))?;
                Some(duplicate(&s.tasks[other], &context, key.as_deref()))
            });
        found.unwrap_or_else(|| {
            Reply::error(
                504,
                "not_applied",
                "the task was published but not applied in time",
            )
        })
    }

    /// The template exists, the request has an identity under its strategy, no task
    /// has that identity yet (else `Err` with that task, 200), the input fits the
    /// schema. `Ok`: the identity to publish.
    fn check_task_request(
        &self,
        key: &TemplateKey,
        req: &CreateTask,
    ) -> Result<Option<String>, Reply> {
        let state = self.engine.shared.lock();
        let Some(template) = state.templates.get(key).cloned() else {
            return Err(Reply::error(
                404,
                "template_not_found",
                format!("no template {key} is registered"),
            ));
        };
        let identity = identity(&template, &req.context, req.idempotency_key.as_deref())
            .map_err(|e| Reply::error(400, "idempotency_key_required", e.to_string()))?;
        if let Some(existing) = identity.as_ref().and_then(|k| state.idempotency.get(k)) {
            let existing = &state.tasks[existing];
            return Err(duplicate(
                existing,
                &req.context,
                req.idempotency_key.as_deref(),
            ));
        }
        self.check_backlog(&state)?;
        drop(state);
        let Some(compiled) = template
            .input_schema
            .as_ref()
            .and_then(|schema| self.schema(key, schema))
        else {
            return Ok(identity);
        };
        let problems = compiled.problems(&req.context);
        if problems.is_empty() {
            return Ok(identity);
        }
        Err(Reply::error(
            400,
            "invalid_input",
            format!(
                "the context does not fit {key}'s input_schema: {}",
                problems.join("; ")
            ),
        ))
    }

    /// Backpressure: 503 with `Retry-After` while the engine has as many open (not
    /// finished) tasks as it is allowed. A duplicate is answered before this, as it
    /// adds no work.
    fn check_backlog(&self, state: &State) -> Result<(), Reply> {
        let limit = self.engine.max_open_tasks;
        let open = state.open_tasks();
        if open < limit {
            return Ok(());
        }
        let message = format!(
            "the engine has {open} open tasks, its limit is {limit}; retry after {BACKPRESSURE_RETRY_S} s"
        );
        let mut reply = Reply::error(503, "backpressure", message);
        reply
            .headers
            .push(("Retry-After", BACKPRESSURE_RETRY_S.to_string()));
        Err(reply)
    }

    fn schema(&self, key: &TemplateKey, schema: &Value) -> Option<Arc<InputSchema>> {
        let mut cache = self.schemas.lock();
        if let Some(s) = cache.get(key) {
            return Some(s.clone());
        }
        // Registration checked the schema; a failure here means no checking is possible.
        let compiled = Arc::new(InputSchema::compile(schema).ok()?);
        cache.insert(key.clone(), compiled.clone());
        Some(compiled)
    }

    fn get_task(&self, uuid: &str, query: &str) -> Reply {
        let wait_s = match query_param(query, "wait").map(str::parse::<u64>) {
            None => 0,
            Some(Ok(s)) => s.min(MAX_WAIT_S),
            Some(Err(_)) => return Reply::error(400, "bad_request", "wait must be whole seconds"),
        };
        let deadline = Instant::now() + Duration::from_secs(wait_s);
        // Only the task's end answers a long poll: woken by nothing before it. A task the
        // orchestrator does not know cannot end: that is answered at once (`Some(None)`),
        // not once the wait is over (a mistyped id held `task wait` for its whole timeout).
        let found = self
            .engine
            .shared
            .wait_for_task_finished(uuid, deadline, |s| match s.tasks.get(uuid) {
                None => Some(None),
                Some(t) => (wait_s == 0 || t.state.is_terminal()).then(|| Some(task_view(t))),
            });
        match found {
            Some(Some(view)) => Reply::ok(200, view),
            Some(None) => Reply::error(404, "not_found", format!("no task {uuid}")),
            None => match self.engine.shared.lock().tasks.get(uuid) {
                Some(t) => Reply::ok(200, task_view(t)),
                None => Reply::error(404, "not_found", format!("no task {uuid}")),
            },
        }
    }

    /// `GET /v1/tasks/{uuid}/events`: the task's transitions as server-sent events.
    fn task_events(&self, uuid: &str) -> Reply {
        if !self.engine.shared.lock().tasks.contains_key(uuid) {
            return Reply::error(404, "not_found", format!("no task {uuid}"));
        }
        let mut reply = Reply::ok(200, Value::Null);
        reply.events = Some(TaskEvents::new(self.engine.shared.clone(), uuid));
        reply
    }

    /// `DELETE /v1/tasks/{uuid}`: 200 with the cancelled task; 409 if it finished.
    fn cancel_task(&self, uuid: &str) -> Reply {
        match self.engine.shared.lock().tasks.get(uuid) {
            None => return Reply::error(404, "not_found", format!("no task {uuid}")),
            Some(t) if t.state.is_terminal() => return closed(t),
            Some(_) => {}
        }
        let reason = "cancelled through the API".to_string();
        let event = Event::TaskCancelled {
            task: uuid.to_string(),
            reason,
        };
        self.publish_then(event, |s| {
            let t = s.tasks.get(uuid)?;
            match t.state {
                TaskState::Cancelled => Some(Reply::ok(200, task_view(t))),
                other if other.is_terminal() => Some(closed(t)),
                _ => None,
            }
        })
    }

    /// `POST /v1/tasks/{uuid}/rerun` (`{"reason"}`, optional): every failed step of a
    /// failed task starts again; 200 with the reopened task, 409 unless it is `error`.
    fn rerun_task(&self, uuid: &str, body: &[u8]) -> Reply {
        let reason = match serde_json::from_slice::<Value>(body) {
            _ if body.is_empty() => String::new(),
            Ok(v) => v["reason"].as_str().unwrap_or("").to_string(),
            Err(e) => return Reply::error(400, "bad_request", format!("not JSON: {e}")),
        };
        let moves_before = match self.engine.shared.lock().tasks.get(uuid) {
            None => return Reply::error(404, "not_found", format!("no task {uuid}")),
            Some(t) if t.state != TaskState::Error => {
                let m = format!(
                    "task {uuid} is {}; only a failed task can be rerun",
                    t.state.name()
                );
                return Reply::error(409, "invalid_state", m);
            }
            Some(t) => t.history.len(),
        };
        let event = Event::TaskRerun {
            task: uuid.to_string(),
            reason,
        };
        self.publish_then(event, |s| {
            // Reopened: it left `error` (it may have failed again since).
            let t = s.tasks.get(uuid)?;
            let moves = t.history.get(moves_before..).unwrap_or_default();
            let reopened = moves.iter().any(|h| h.from == TaskState::Error);
            reopened.then(|| Reply::ok(200, task_view(t)))
        })
    }

    /// `POST /v1/tasks/{uuid}/resolve` (`{"reason", "resolved_by"}`, both optional):
    /// the operator settles the task by hand (Tasker's `resolve_manually` of a task);
    /// 200 with the task `resolved_manually`, 409 `task_closed` if it completed, was
    /// cancelled or was resolved already.
    fn resolve_task(&self, uuid: &str, body: &[u8]) -> Reply {
        let reason = match resolution(body) {
            Ok(r) => r,
            Err(reply) => return reply,
        };
        match self.engine.shared.lock().tasks.get(uuid) {
            None => return Reply::error(404, "not_found", format!("no task {uuid}")),
            Some(t) if t.state.is_terminal() && t.state != TaskState::Error => return closed(t),
            Some(_) => {}
        }
        let event = Event::TaskResolved {
            task: uuid.to_string(),
            reason,
        };
        self.publish_then(event, |s| {
            let t = s.tasks.get(uuid)?;
            match t.state {
                TaskState::ResolvedManually => Some(Reply::ok(200, task_view(t))),
                // Finished otherwise before the event came: the fold refused it.
                TaskState::Complete | TaskState::Cancelled => Some(closed(t)),
                _ => None,
            }
        })
    }

    /// Publishes `event` and answers once `done` says the fold has applied it.
    fn publish_then(&self, event: Event, done: impl FnMut(&State) -> Option<Reply>) -> Reply {
        let task = event.task().map(str::to_string);
        if let Err(e) = self.engine.writer().publish(event) {
            return Reply::error(503, "log_unavailable", format!("cannot publish: {e}"));
        }
        let shared = &self.engine.shared;
        task_routes::await_fold(shared, task.as_deref(), APPLY_TIMEOUT, done)
    }

    /// `PATCH /v1/tasks/{uuid}/workflow_steps/{step}`: reset, resolve or complete a
    /// failed step; 200 with the step once the fold has applied it.
    fn step_action(&self, uuid: &str, step: &str, body: &[u8]) -> Reply {
        let event = match task_routes::step_action(&self.engine.shared.lock(), uuid, step, body) {
            Ok(e) => e,
            Err(reply) => return reply,
        };
        let attempt = event.step_ref().map_or(0, |at| at.attempt);
        self.publish_then(event, |s| {
            let st = s.tasks.get(uuid)?.step(step)?;
            let changed = st.state != StepState::Error || st.attempt != attempt;
            changed.then(|| Reply::ok(200, step_view(st)))
        })
    }

    fn register_template(&self, body: &[u8]) -> Reply {
        let text = String::from_utf8_lossy(body);
        let template = match validate::load(&text, self.known_handlers.as_ref()) {
            Ok(t) => t,
            Err(e) => return template_error(&e),
        };
        let key = template.key();
        match self.engine.shared.lock().templates.get(&key) {
            Some(t) if **t == template => return Reply::ok(200, template_view(t)),
            Some(_) => return conflict(&key),
            None => {}
        }
        let expected = template.clone();
        if let Err(e) = self
            .engine
            .writer()
            .publish(Event::TemplateRegistered { template })
        {
            return Reply::error(
                503,
                "log_unavailable",
                format!("cannot publish the template: {e}"),
            );
        }
        let found = self
            .engine
            .shared
            .wait_for(Instant::now() + APPLY_TIMEOUT, |s: &State| {
                s.templates.get(&key).map(|t| **t == expected)
            });
        match found {
            Some(true) => Reply::ok(201, template_view(&expected)),
            Some(false) => conflict(&key),
            None => Reply::error(
                504,
                "not_applied",
                "the template was published but not applied in time",
            ),
        }
    }

    /// The whole template (as registered, every field) at `version`, or its newest
    /// version ([`version_order`]) when none is named.
    fn get_template(&self, namespace: &str, name: &str, version: Option<&str>) -> Reply {
        let state = self.engine.shared.lock();
        let found = state
            .templates
            .values()
            .filter(|t| t.namespace == namespace && t.name == name)
            .filter(|t| version.is_none_or(|v| t.version == v))
            .max_by(|a, b| version_order(&a.version, &b.version));
        match found {
            Some(t) => Reply::ok(200, serde_json::to_value(&**t).expect("a template is JSON")),
            None => {
                let at = version.map(|v| format!("@{v}")).unwrap_or_default();
                let m = format!("no template {namespace}/{name}{at} is registered");
                Reply::error(404, "template_not_found", m)
            }
        }
    }

    fn list_templates(&self) -> Reply {
        let state = self.engine.shared.lock();
        let list: Vec<Value> = state.templates.values().map(|t| template_view(t)).collect();
        Reply::ok(200, json!({ "templates": list }))
    }
}

fn template_error(e: &validate::TemplateError) -> Reply {
    let mut r = Reply::error(400, "invalid_template", e.to_string());
    r.body["error"]["template"] = json!(e.template);
    r.body["error"]["step"] = json!(e.step);
    r.body["error"]["field"] = json!(e.field);
    r
}

fn conflict(key: &TemplateKey) -> Reply {
    Reply::error(
        409,
        "template_conflict",
        format!("template {key} is registered already with other content; register a new version"),
    )
}

/// The answer to a request whose identity an earlier task has: that task (200), as a
/// retry after a lost answer needs its id. A caller's idempotency key sent again with
/// another context is a mistake the answer must not hide (the key makes the identity, so
/// the context would be dropped in silence): 409 naming the task. Without a key the
/// identity is the context itself, so the contexts agree.
fn duplicate(existing: &crate::state::Task, context: &Value, key: Option<&str>) -> Reply {
    let Some(key) = key.filter(|_| existing.context != *context) else {
        return Reply::ok(200, task_view(existing));
    };
    let mut reply = Reply::error(
        409,
        "idempotency_key_reused",
        format!(
            "idempotency key {key:?} was used for task {} with another context; send that \
             context to get the task, or use a new key for a new task",
            existing.uuid
        ),
    );
    reply.body["error"]["task_uuid"] = json!(existing.uuid);
    reply
}

/// How a JSON value that should have been an object is named in an error.
fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn closed(t: &crate::state::Task) -> Reply {
    let m = format!("task {} is {} already", t.uuid, t.state.name());
    Reply::error(409, "task_closed", m)
}

/// The reason a task resolution records: `reason`, and `(by NAME)` for `resolved_by`.
fn resolution(body: &[u8]) -> Result<String, Reply> {
    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct Resolve {
        #[serde(default)]
        reason: Option<String>,
        #[serde(default)]
        resolved_by: Option<String>,
    }
    let r: Resolve = match body.is_empty() {
        true => Resolve::default(),
        false => serde_json::from_slice(body)
            .map_err(|e| Reply::error(400, "bad_request", format!("not a resolution: {e}")))?,
    };
    let reason = r.reason.unwrap_or_default();
    Ok(match r.resolved_by {
        Some(by) => format!("{reason} (by {by})"),
        None => reason,
    })
}

/// A query string's pairs (no percent-decoding: the values are names and numbers).
fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The value of `name` in a query string (no percent-decoding: values are numbers).
fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}
