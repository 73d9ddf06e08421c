//! A client of the workflow API (what the CLI and the tests use): each call returns
//! the JSON document, or the API's `{"error":{"code","message"}}` as [`ApiError`].

use crate::api::MAX_WAIT_S;
use crate::machine::TaskState;
use embarcadero_client::{BUSY_RETRY_FOR, MAX_REQUEST_BODY};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// An answer of the workflow API that is an error, or no answer at all (`status` 0,
/// `code` `unreachable`: nothing listening, or not the API).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status {
            0 => write!(f, "{} ({})", self.message, self.code),
            status => write!(f, "{} ({}, HTTP {status})", self.message, self.code),
        }
    }
}

#[derive(Clone)]
pub struct ApiClient {
    base: String,
    agent: ureq::Agent,
    /// How long a request waits for its answer (a long poll: on top of its wait).
    answer_within: Duration,
}

/// What [`ApiClient::new`] waits for an answer beyond a long poll's own wait.
const DEFAULT_ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// Characters a path segment keeps as they are (RFC 3986's unreserved ones); every other
/// byte is percent-encoded, so an id or a name stays one segment (`/`, `?` and `#`
/// included).
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `value` as one path segment of a route: escaped; an empty one is refused (it would
/// name another route: `/v1/tasks/` is the task list).
fn segment(what: &str, value: &str) -> Result<String, ApiError> {
    if value.is_empty() {
        return Err(ApiError {
            status: 400,
            code: "bad_request".into(),
            message: format!("an empty {what}: give the {what}"),
        });
    }
    Ok(percent_encoding::utf8_percent_encode(value, SEGMENT).to_string())
}

impl ApiClient {
    /// `addr`: host:port of the workflow API (or a full http:// URL): the control port,
    /// which forwards it, or the orchestrator's own.
    pub fn new(addr: &str) -> Self {
        let agent = ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(5));
        Self::with_agent(addr, agent, DEFAULT_ANSWER_WITHIN)
    }

    /// [`Self::new`], each request waiting at most `timeout` for its answer (a long poll
    /// of [`Self::get_task`]: its wait, then `timeout`). At least a millisecond; at most
    /// a day, which is no limit in practice and keeps the clock arithmetic in range.
    pub fn with_timeout(addr: &str, timeout: Duration) -> Self {
        let timeout = timeout.clamp(Duration::from_millis(1), Duration::from_secs(86_400));
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5).min(timeout))
            .timeout(timeout);
        Self::with_agent(addr, agent, timeout)
    }

    fn with_agent(addr: &str, agent: ureq::AgentBuilder, answer_within: Duration) -> Self {
        Self {
            base: embarcadero_client::control_url(addr),
            agent: agent.build(),
            answer_within,
        }
    }

    /// The API's base URL (`http://host:port`).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    pub fn register_template(&self, yaml: &str) -> Result<Value, ApiError> {
        check_body(yaml.len(), "template")?;
        let req = self.agent.post(&format!("{}/v1/templates", self.base));
        self.send(req, Body::Yaml(yaml))
    }

    pub fn list_templates(&self) -> Result<Value, ApiError> {
        let req = self.agent.get(&format!("{}/v1/templates", self.base));
        self.send(req, Body::Empty)
    }

    /// The whole registered template `namespace/name` at `version`, or its newest
    /// version.
    pub fn get_template(
        &self,
        namespace: &str,
        name: &str,
        version: Option<&str>,
    ) -> Result<Value, ApiError> {
        let (ns, name) = (segment("namespace", namespace)?, segment("name", name)?);
        let mut url = format!("{}/v1/templates/{ns}/{name}", self.base);
        if let Some(v) = version {
            url = format!("{url}/{}", segment("version", v)?);
        }
        self.send(self.agent.get(&url), Body::Empty)
    }

    /// `POST /v1/tasks` with Tasker's body: the new task, or the existing one with the
    /// same identity.
    pub fn create_task(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
        context: Value,
        idempotency_key: Option<&str>,
    ) -> Result<Value, ApiError> {
        self.submit_task(namespace, name, version, context, idempotency_key)
            .map(|(task, _)| task)
    }

    /// [`Self::create_task`], and whether the task already existed (the API answers a
    /// submission with the identity of an existing task with that task, 200, where a new
    /// one is 201).
    pub fn submit_task(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
        context: Value,
        idempotency_key: Option<&str>,
    ) -> Result<(Value, bool), ApiError> {
        let mut body =
            json!({"namespace": namespace, "name": name, "version": version, "context": context});
        if let Some(k) = idempotency_key {
            body["idempotency_key"] = json!(k);
        }
        check_body(body.to_string().len(), "task, with its context,")?;
        let req = self.agent.post(&format!("{}/v1/tasks", self.base));
        let (status, task) = self.send_for_status(req, Body::Json(&body))?;
        Ok((task, status == 200))
    }

    /// `GET /v1/tasks/{uuid}`; with `wait_s` > 0, a long poll that answers once the
    /// task is finished or the wait is over. The answer must be a task: anything else is an error (code `not_a_task`).
    pub fn get_task(&self, uuid: &str, wait_s: u64) -> Result<Value, ApiError> {
        let url = format!(
            "{}/v1/tasks/{}?wait={wait_s}",
            self.base,
            segment("task id", uuid)?
        );
        let within = Duration::from_secs(wait_s) + self.answer_within;
        let task = self.send(self.agent.get(&url).timeout(within), Body::Empty)?;
        if task["task_uuid"].as_str() != Some(uuid) || !task["status"].is_string() {
            return Err(ApiError {
                status: 200,
                code: "not_a_task".into(),
                message: format!("{} answered GET {url} with something that is not task {uuid}: is it the workflow API?", self.base),
            });
        }
        Ok(task)
    }
}

impl ApiClient {
    /// The newest registered version of template `namespace/name` (by the API's
    /// version order), for a task created without naming one.
    pub fn newest_version(&self, namespace: &str, name: &str) -> Result<String, ApiError> {
        let template = self.get_template(namespace, name, None)?;
        match template["version"].as_str() {
            Some(v) => Ok(v.to_string()),
            None => Err(ApiError {
                status: 200,
                code: "no_version".into(),
                message: format!(
                    "the API described template {namespace}/{name} without a version; name the version"
                ),
            }),
        }
    }

    /// The task once it is finished (complete, error, cancelled or resolved by hand), or
    /// as it stands when `timeout` (none: no limit) is over: one long poll after
    /// another, each at most the API's [`MAX_WAIT_S`], the last rounded up to a second.
    /// The caller tells the two apart by [`task_is_finished`].
    pub fn wait_task(&self, uuid: &str, timeout: Option<Duration>) -> Result<Value, ApiError> {
        // A limit past the clock's range is none.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let (wait_s, last) = next_long_poll(left);
            let asked = Instant::now();
            let task = self.get_task(uuid, wait_s)?;
            if last || task_is_finished(&task) {
                return Ok(task);
            }
            // The API answers a long poll early only for a finished task; should one
            // answer early anyway, the next poll waits a little rather than spin.
            if asked.elapsed() < Duration::from_secs(wait_s) / 2 {
                std::thread::sleep(EARLY_ANSWER_PAUSE);
            }
        }
    }
}

/// How long [`ApiClient::wait_task`] pauses after a long poll answered early with a task
/// not finished (which the API does not do): a bound on its rate, not a wait for anything.
const EARLY_ANSWER_PAUSE: Duration = Duration::from_millis(100);

/// The next long poll of a wait with `left` to go (none: no limit): its `?wait=` in
/// whole seconds (rounded up, at most [`MAX_WAIT_S`]), and whether it is the last.
fn next_long_poll(left: Option<Duration>) -> (u64, bool) {
    match left {
        None => (MAX_WAIT_S, false),
        Some(l) => {
            let s = l.as_secs_f64().ceil() as u64;
            (s.min(MAX_WAIT_S), s <= MAX_WAIT_S)
        }
    }
}

/// Whether a task document of the API is in a state it never leaves by itself
/// (`complete`, `error`, `cancelled`, `resolved_manually`; an operator may still reopen
/// a failed one). A task `blocked_by_failures` is not: it waits for an operator or a
/// retry.
pub fn task_is_finished(task: &Value) -> bool {
    serde_json::from_value::<TaskState>(task["status"].clone()).is_ok_and(TaskState::is_terminal)
}

impl ApiClient {
    /// Any route: `method` on `path` (with its query), with a JSON body or none.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, ApiError> {
        if let Some(b) = &body {
            check_body(b.to_string().len(), "request")?;
        }
        let req = self.agent.request(method, &format!("{}{path}", self.base));
        self.send(req, body.as_ref().map_or(Body::Empty, Body::Json))
    }

    /// `GET /v1/workflow/metrics`: the engine's Prometheus text (its `/metrics`, under a
    /// path the control port forwards to the engine).
    pub fn metrics(&self) -> Result<String, ApiError> {
        let url = format!("{}/v1/workflow/metrics", self.base);
        match self.agent.get(&url).call() {
            Ok(resp) => resp
                .into_string()
                .map_err(|e| transport(format!("unreadable answer: {e}"))),
            Err(e) => answer(Err(e)).map(|_| String::new()),
        }
    }

    /// `DELETE /v1/tasks/{uuid}`.
    pub fn cancel_task(&self, uuid: &str) -> Result<Value, ApiError> {
        let uuid = segment("task id", uuid)?;
        self.request("DELETE", &format!("/v1/tasks/{uuid}"), None)
    }

    /// `PATCH /v1/tasks/{uuid}/workflow_steps/{step}` with Tasker's action body.
    pub fn step_action(&self, uuid: &str, step: &str, action: Value) -> Result<Value, ApiError> {
        let (uuid, step) = (segment("task id", uuid)?, segment("step name", step)?);
        self.request(
            "PATCH",
            &format!("/v1/tasks/{uuid}/workflow_steps/{step}"),
            Some(action),
        )
    }
}

impl ApiClient {
    /// The JSON answer to `req` with `body`, retried as [`Self::send_for_status`] says.
    fn send(&self, req: ureq::Request, body: Body) -> Result<Value, ApiError> {
        self.send_for_status(req, body).map(|(_, answer)| answer)
    }

    /// The status and JSON of the answer to `req` with `body`. An answer saying the
    /// head did not forward it (no orchestrator announced itself yet, none could be
    /// reached, every forwarding place or connection busy) is retried for up to
    /// [`BUSY_RETRY_FOR`], as the admin client retries a 503: nothing acted on it, and an
    /// orchestrator announces itself within a second of serving (a task created right
    /// after `embarcadero orchestrator` started got 503), a standby takes over within its
    /// failover time.
    fn send_for_status(&self, req: ureq::Request, body: Body) -> Result<(u16, Value), ApiError> {
        let give_up = Instant::now() + BUSY_RETRY_FOR;
        let mut pause = Duration::from_millis(50);
        loop {
            let sent = match body {
                Body::Empty => req.clone().call(),
                Body::Json(v) => req.clone().send_json(v),
                Body::Yaml(text) => req
                    .clone()
                    .set("Content-Type", "application/yaml")
                    .send_string(text),
            };
            match answer_with_status(sent) {
                Err(e) if not_forwarded(&e) && Instant::now() + pause < give_up => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                answered => return answered,
            }
        }
    }
}

/// A request as ureq sends it.
type Sent = Result<ureq::Response, ureq::Error>;

/// What a request carries.
#[derive(Clone, Copy)]
enum Body<'a> {
    Empty,
    Json(&'a Value),
    Yaml(&'a str),
}

/// Whether the head answered without forwarding the request to an orchestrator (its
/// proxy's refusals, and its HTTP layer's when every connection is taken): a retry is
/// safe.
fn not_forwarded(e: &ApiError) -> bool {
    matches!(
        (e.status, e.code.as_str()),
        (
            503,
            "no_workflow_engine" | "workflow_proxy_busy" | "http_503"
        ) | (502, "workflow_engine_unreachable")
    )
}

fn answer(r: Sent) -> Result<Value, ApiError> {
    answer_with_status(r).map(|(_, body)| body)
}

fn answer_with_status(r: Sent) -> Result<(u16, Value), ApiError> {
    match r {
        Ok(resp) => {
            let status = resp.status();
            let body = resp
                .into_json()
                .map_err(|e| transport(format!("unreadable answer: {e}")))?;
            Ok((status, body))
        }
        Err(ureq::Error::Status(status, resp)) => {
            let origin = origin(resp.get_url()).to_string();
            let body: Value = resp.into_json().unwrap_or(Value::Null);
            Err(api_error(status, &body, &origin))
        }
        Err(e) if timed_out(&e) => Err(ApiError {
            status: 0,
            code: "timeout".into(),
            message: format!(
                "no answer in time ({e}): the request may still have been carried out; look before repeating it"
            ),
        }),
        Err(e) => Err(transport(format!(
            "{e}; {}",
            embarcadero_client::unreachable_hint(&e)
        ))),
    }
}

/// Whether a request failed because its answer did not come in time (it was sent, so it
/// may have been acted on), not because nothing could be reached.
fn timed_out(e: &ureq::Error) -> bool {
    let ureq::Error::Transport(t) = e else {
        return false;
    };
    let io = std::error::Error::source(t).and_then(|s| s.downcast_ref::<std::io::Error>());
    io.is_some_and(|io| {
        matches!(
            io.kind(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
        )
    })
}

/// The error of an answer from `origin` with `status` and `body`: the workflow API's
/// `{"error":{"code","message"}}`, or the `{"error": message}` the HTTP layer itself
/// answers with (a body over its limit, a malformed request) before the API sees it, or
/// neither (something else answered).
fn api_error(status: u16, body: &Value, origin: &str) -> ApiError {
    let error = &body["error"];
    if let Some(message) = error.as_str() {
        return ApiError {
            status,
            code: format!("http_{status}"),
            message: message.to_string(),
        };
    }
    if !error.is_object() {
        return ApiError {
            status,
            code: format!("http_{status}"),
            message: embarcadero_client::not_the_admin_api(origin),
        };
    }
    let field = |k: &str| error[k].as_str().unwrap_or("").to_string();
    ApiError {
        status,
        code: field("code"),
        message: field("message"),
    }
}

/// A body over the API's limit, refused before sending: the server would answer 413
/// without reading it, and a client still writing it would only see the connection
/// close (a broken pipe).
fn check_body(len: usize, what: &str) -> Result<(), ApiError> {
    if len <= MAX_REQUEST_BODY {
        return Ok(());
    }
    Err(ApiError {
        status: 413,
        code: "too_large".into(),
        message: format!(
            "the {what} is {len} bytes; the workflow API accepts request bodies of at most {MAX_REQUEST_BODY} bytes: keep large data elsewhere and pass a reference to it"
        ),
    })
}

/// `http://host:port` of a URL (all of it if it has no path).
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(i) => &url[..after_scheme + i],
        None => url,
    }
}

fn transport(message: String) -> ApiError {
    ApiError {
        status: 0,
        code: "unreachable".into(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_shapes_of_error_body_keep_their_message() {
        let api = json!({"error": {"code": "not_found", "message": "no task x"}});
        let e = api_error(404, &api, "http://h:1");
        assert_eq!(
            (e.code.as_str(), e.message.as_str()),
            ("not_found", "no task x")
        );
        let http = json!({"error": "request body of 70000 bytes; at most 65536 are accepted"});
        let e = api_error(413, &http, "http://h:1");
        assert_eq!(e.code, "http_413");
        assert!(e.message.contains("at most 65536"), "{e}");
        // Something else answered (no body, or another shape): say so, naming the address.
        let e = api_error(404, &Value::Null, "http://h:1");
        assert_eq!(e.code, "http_404");
        assert!(e.message.contains("is http://h:1 the admin API"), "{e}");
    }

    #[test]
    fn a_wait_is_long_polls_of_at_most_the_apis_longest_the_last_rounded_up() {
        assert_eq!(next_long_poll(None), (MAX_WAIT_S, false));
        let secs = |s: f64| Some(Duration::from_secs_f64(s));
        assert_eq!(next_long_poll(secs(1000.0)), (MAX_WAIT_S, false));
        assert_eq!(next_long_poll(secs(MAX_WAIT_S as f64)), (MAX_WAIT_S, true));
        assert_eq!(next_long_poll(secs(2.5)), (3, true));
        assert_eq!(next_long_poll(secs(0.0)), (0, true));
    }

    #[test]
    fn only_the_states_a_task_never_leaves_by_itself_are_finished() {
        for state in TaskState::ALL {
            let task = json!({ "status": state });
            assert_eq!(task_is_finished(&task), state.is_terminal(), "{state:?}");
        }
        assert!(!task_is_finished(&json!({ "status": "no_such_state" })));
        assert!(!task_is_finished(&json!({})));
    }

    #[test]
    fn ids_and_names_stay_one_path_segment_and_an_empty_one_is_refused() {
        assert_eq!(segment("task id", "a-b_c.d~e").unwrap(), "a-b_c.d~e");
        assert_eq!(
            segment("task id", "a/b?c#d e").unwrap(),
            "a%2Fb%3Fc%23d%20e"
        );
        let e = segment("task id", "").unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (400, "bad_request"));
        // Refused before anything is sent: an address nobody listens on is never tried.
        let client = ApiClient::new("127.0.0.1:1");
        assert_eq!(client.get_task("", 0).unwrap_err().code, "bad_request");
        assert_eq!(client.wait_task("", None).unwrap_err().code, "bad_request");
    }

    /// A listener that answers each of `answers` connections with `body` (200, JSON).
    fn answering(body: &'static str, answers: usize) -> String {
        answering_in_turn(vec![(200, body); answers])
    }

    /// A listener that answers its connections with `answers` in turn (status, JSON).
    fn answering_in_turn(answers: Vec<(u16, &'static str)>) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for ((status, body), stream) in answers.into_iter().zip(listener.incoming()) {
                let mut stream = stream.unwrap();
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request);
                let head = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(body.as_bytes());
            }
        });
        addr
    }

    #[test]
    fn a_request_the_head_did_not_forward_is_retried_and_one_the_engine_refused_is_not() {
        let no_engine = r#"{"error": {"code": "no_workflow_engine", "message": "none yet"}}"#;
        let busy = r#"{"error": {"code": "workflow_proxy_busy", "message": "busy"}}"#;
        let listed = r#"{"templates": []}"#;
        let addr = answering_in_turn(vec![(503, no_engine), (503, busy), (200, listed)]);
        let templates = ApiClient::new(&addr).list_templates().unwrap();
        assert_eq!(templates, json!({"templates": []}));
        // The engine's own 503 (it may have acted, or it is the caller's to wait out).
        let backpressure = r#"{"error": {"code": "backpressure", "message": "full"}}"#;
        let addr = answering_in_turn(vec![(503, backpressure), (200, listed)]);
        let e = ApiClient::new(&addr).list_templates().unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (503, "backpressure"));
    }

    #[test]
    fn an_answer_that_is_not_the_task_asked_for_is_an_error_not_a_task_left_unfinished() {
        // The task list (what `/v1/tasks/` names) has no status: a wait that took it for
        // an unfinished task polled again at once, for ever.
        let addr = answering(r#"{"tasks": [], "pagination": {}}"#, 2);
        let client = ApiClient::new(&addr);
        assert_eq!(client.get_task("t1", 0).unwrap_err().code, "not_a_task");
        // A limit past the clock's range is no limit, not a panic.
        let e = client.wait_task("t1", Some(Duration::MAX)).unwrap_err();
        assert_eq!(e.code, "not_a_task");
    }

    #[test]
    fn a_request_whose_answer_does_not_come_in_time_says_so_not_unreachable() {
        // Connections complete in the listener's backlog; nothing ever answers.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let client = ApiClient::with_timeout(&addr, Duration::from_millis(200));
        let e = client.get_task("t1", 0).unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (0, "timeout"), "{e}");
        assert!(e.message.contains("may still have been carried out"), "{e}");
        drop(listener);
    }

    #[test]
    fn the_origin_of_a_url_is_its_scheme_host_and_port() {
        assert_eq!(origin("http://h:1/v1/tasks?page=1"), "http://h:1");
        assert_eq!(origin("http://h:1"), "http://h:1");
    }

    #[test]
    fn no_answer_says_so_without_an_http_status() {
        let e = transport("connection refused".into());
        assert_eq!(e.to_string(), "connection refused (unreachable)");
        let e = ApiError {
            status: 409,
            code: "conflict".into(),
            message: "m".into(),
        };
        assert_eq!(e.to_string(), "m (conflict, HTTP 409)");
    }

    #[test]
    fn a_body_over_the_limit_is_refused_before_sending_naming_the_limit() {
        assert!(check_body(MAX_REQUEST_BODY, "template").is_ok());
        let e = check_body(MAX_REQUEST_BODY + 1, "template").unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (413, "too_large"));
        assert!(e.message.contains(&MAX_REQUEST_BODY.to_string()), "{e}");
        // Checked before any connection: an address nobody listens on is never tried.
        let client = ApiClient::new("127.0.0.1:1");
        let big = "x".repeat(MAX_REQUEST_BODY + 1);
        assert_eq!(
            client.register_template(&big).unwrap_err().code,
            "too_large"
        );
    }
}
