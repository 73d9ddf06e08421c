//! `NativeTaskClient`: the workflow engine's API (templates and tasks) through the Rust
//! `ApiClient` the CLI uses, each request on the blocking pool. The TypeScript class
//! `TaskClient` (`ts/tasks.ts`) builds the routes on top of it; what is here is what both
//! SDKs share with the CLI (the newest version of a template, a wait across several long
//! polls).

use crate::error::api_to_js;
use embarcadero_workflow::client::{task_is_finished, ApiClient, ApiError};
use napi_derive::napi;
use serde_json::Value;

/// A task and whether it finished (`waitTask`), or whether it existed already
/// (`createTask`).
#[napi(object)]
pub struct NativeTaskAnswer {
    pub task: Value,
    pub flag: bool,
}

#[napi]
pub struct NativeTaskClient {
    client: ApiClient,
}

/// Runs a request on the blocking pool; its `ApiError` as the typed JavaScript error.
async fn off_thread<T, F>(f: F) -> napi::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    crate::blocking_as(f, api_to_js).await
}

#[napi]
impl NativeTaskClient {
    /// `control` is `host:port` or an `http://` URL; `timeout_ms` bounds each request
    /// (a long poll's own wait comes on top).
    #[napi(constructor)]
    pub fn new(control: String, timeout_ms: f64) -> Self {
        Self {
            client: ApiClient::with_timeout(&control, crate::millis(timeout_ms)),
        }
    }

    #[napi(getter)]
    pub fn url(&self) -> String {
        self.client.base_url().to_string()
    }

    #[napi]
    pub async fn register_template(&self, yaml: String) -> napi::Result<Value> {
        let client = self.client.clone();
        off_thread(move || client.register_template(&yaml)).await
    }

    #[napi]
    pub async fn newest_version(&self, namespace: String, name: String) -> napi::Result<String> {
        let client = self.client.clone();
        off_thread(move || client.newest_version(&namespace, &name)).await
    }

    /// The task, and whether it existed already (same identity).
    #[napi]
    pub async fn create_task(
        &self,
        namespace: String,
        name: String,
        version: String,
        context: Value,
        idempotency_key: Option<String>,
    ) -> napi::Result<NativeTaskAnswer> {
        let client = self.client.clone();
        off_thread(move || {
            let key = idempotency_key.as_deref();
            client.submit_task(&namespace, &name, &version, context, key)
        })
        .await
        .map(|(task, flag)| NativeTaskAnswer { task, flag })
    }

    /// The task once finished or after `timeout_ms` (none: no limit), and whether it
    /// finished.
    #[napi]
    pub async fn wait_task(
        &self,
        uuid: String,
        timeout_ms: Option<f64>,
    ) -> napi::Result<NativeTaskAnswer> {
        let client = self.client.clone();
        let timeout = timeout_ms.map(crate::millis);
        off_thread(move || client.wait_task(&uuid, timeout))
            .await
            .map(|task| NativeTaskAnswer {
                flag: task_is_finished(&task),
                task,
            })
    }

    /// Any route: `method` on `path` (its query included), with a JSON body or none.
    #[napi]
    pub async fn request(
        &self,
        method: String,
        path: String,
        body: Option<Value>,
    ) -> napi::Result<Value> {
        let client = self.client.clone();
        off_thread(move || client.request(&method, &path, body)).await
    }
}
