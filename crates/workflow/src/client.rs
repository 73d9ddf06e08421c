//! A client of the workflow API (what the CLI and the tests use): each call returns
//! the JSON document, or the API's `{"error":{"code","message"}}` as [`ApiError`].

use embarcadero_client::MAX_REQUEST_BODY;
use serde_json::{json, Value};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message} ({code}, HTTP {status})")]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
}

pub struct ApiClient {
    base: String,
    agent: ureq::Agent,
}

impl ApiClient {
    /// `addr`: host:port of the workflow API (or a full http:// URL): the control port,
    /// which forwards it, or the orchestrator's own.
    pub fn new(addr: &str) -> Self {
        let base = if addr.starts_with("http://") {
            addr.trim_end_matches('/').to_string()
        } else {
            format!("http://{addr}")
        };
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .build();
        Self { base, agent }
    }

    pub fn register_template(&self, yaml: &str) -> Result<Value, ApiError> {
        check_body(yaml.len(), "template")?;
        let req = self.agent.post(&format!("{}/v1/templates", self.base));
        answer(
            req.set("Content-Type", "application/yaml")
                .send_string(yaml),
        )
    }

    pub fn list_templates(&self) -> Result<Value, ApiError> {
        answer(
            self.agent
                .get(&format!("{}/v1/templates", self.base))
                .call(),
        )
    }

    /// The whole registered template `namespace/name` at `version`, or its newest
    /// version.
    pub fn get_template(
        &self,
        namespace: &str,
        name: &str,
        version: Option<&str>,
    ) -> Result<Value, ApiError> {
        let mut url = format!("{}/v1/templates/{namespace}/{name}", self.base);
        if let Some(v) = version {
            url = format!("{url}/{v}");
        }
        answer(self.agent.get(&url).call())
    }

    /// `POST /v1/tasks` with Tasker's body.
    pub fn create_task(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
        context: Value,
        idempotency_key: Option<&str>,
    ) -> Result<Value, ApiError> {
        let mut body =
            json!({"namespace": namespace, "name": name, "version": version, "context": context});
        if let Some(k) = idempotency_key {
            body["idempotency_key"] = json!(k);
        }
        check_body(body.to_string().len(), "task, with its context,")?;
        answer(
            self.agent
                .post(&format!("{}/v1/tasks", self.base))
                .send_json(body),
        )
    }

    /// `GET /v1/tasks/{uuid}`; with `wait_s` > 0, a long poll that answers once the
    /// task is finished or the wait is over.
    pub fn get_task(&self, uuid: &str, wait_s: u64) -> Result<Value, ApiError> {
        let url = format!("{}/v1/tasks/{uuid}?wait={wait_s}", self.base);
        let req = self
            .agent
            .get(&url)
            .timeout(Duration::from_secs(wait_s + 30));
        answer(req.call())
    }
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
        answer(match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        })
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
        self.request("DELETE", &format!("/v1/tasks/{uuid}"), None)
    }

    /// `PATCH /v1/tasks/{uuid}/workflow_steps/{step}` with Tasker's action body.
    pub fn step_action(&self, uuid: &str, step: &str, action: Value) -> Result<Value, ApiError> {
        self.request(
            "PATCH",
            &format!("/v1/tasks/{uuid}/workflow_steps/{step}"),
            Some(action),
        )
    }
}

fn answer(r: Result<ureq::Response, ureq::Error>) -> Result<Value, ApiError> {
    match r {
        Ok(resp) => resp
            .into_json()
            .map_err(|e| transport(format!("unreadable answer: {e}"))),
        Err(ureq::Error::Status(status, resp)) => {
            let body: Value = resp.into_json().unwrap_or(Value::Null);
            Err(api_error(status, &body))
        }
        Err(e) => Err(transport(e.to_string())),
    }
}

/// The error of an answer with `status` and `body`: the workflow API's
/// `{"error":{"code","message"}}`, or the `{"error": message}` the HTTP layer itself
/// answers with (a body over its limit, a malformed request) before the API sees it.
fn api_error(status: u16, body: &Value) -> ApiError {
    let error = &body["error"];
    if let Some(message) = error.as_str() {
        return ApiError {
            status,
            code: format!("http_{status}"),
            message: message.to_string(),
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
        let e = api_error(404, &api);
        assert_eq!(
            (e.code.as_str(), e.message.as_str()),
            ("not_found", "no task x")
        );
        let http = json!({"error": "request body of 70000 bytes; at most 65536 are accepted"});
        let e = api_error(413, &http);
        assert_eq!(e.code, "http_413");
        assert!(e.message.contains("at most 65536"), "{e}");
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
