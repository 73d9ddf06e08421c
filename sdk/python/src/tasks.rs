//! `embarcadero._native.NativeTaskClient`: the workflow engine's API (templates and
//! tasks) through the Rust `ApiClient` the CLI uses, every request with the GIL
//! released. The Python class `embarcadero.workflow.TaskClient` builds the routes on
//! top of it; what is here is what both SDKs share with the CLI (the newest version
//! of a template, a wait across several long polls).

use crate::errors::{api_to_py, config};
use crate::to_python;
use crate::workflow::to_json;
use embarcadero_workflow::client::{task_is_finished, ApiClient};
use pyo3::prelude::*;
use serde_json::Value;

/// A client of the workflow API at ``control`` (the control port, which forwards it,
/// or an orchestrator's own address). Each request waits at most ``timeout`` seconds
/// for its answer (a long poll longer, by its own wait).
#[pyclass(module = "embarcadero._native", frozen)]
pub struct NativeTaskClient {
    client: ApiClient,
}

use crate::options::seconds;

#[pymethods]
impl NativeTaskClient {
    #[new]
    #[pyo3(signature = (control = None, timeout = 20.0))]
    fn new(control: Option<&str>, timeout: f64) -> PyResult<Self> {
        let control = crate::control_or_default(control);
        if timeout.is_nan() || timeout <= 0.0 {
            return Err(config(format!(
                "timeout {timeout}: want seconds above 0 (each request's longest wait for its answer)"
            )));
        }
        let timeout = seconds("timeout", timeout)?;
        Ok(Self {
            client: ApiClient::with_timeout(&control, timeout),
        })
    }

    /// The API's base URL.
    #[getter]
    fn url(&self) -> &str {
        self.client.base_url()
    }

    /// ``POST /v1/templates`` with a template's YAML: the registered template.
    fn register_template(&self, py: Python<'_>, yaml: &str) -> PyResult<PyObject> {
        let t = crate::gil::released(py, || self.client.register_template(yaml));
        to_python(py, &t.map_err(api_to_py)?)
    }

    /// The newest registered version of ``namespace/name``.
    fn newest_version(&self, py: Python<'_>, namespace: &str, name: &str) -> PyResult<String> {
        crate::gil::released(py, || self.client.newest_version(namespace, name)).map_err(api_to_py)
    }

    /// ``POST /v1/tasks``: the new task, or the existing one with the same identity, and
    /// whether it existed.
    #[pyo3(signature = (namespace, name, version, context, idempotency_key = None))]
    fn create_task(
        &self,
        py: Python<'_>,
        namespace: &str,
        name: &str,
        version: &str,
        context: &Bound<'_, PyAny>,
        idempotency_key: Option<&str>,
    ) -> PyResult<(PyObject, bool)> {
        let context = to_json(py, context)?;
        let (task, existed) = crate::gil::released(py, || {
            self.client
                .submit_task(namespace, name, version, context, idempotency_key)
        })
        .map_err(api_to_py)?;
        Ok((to_python(py, &task)?, existed))
    }

    /// The task once finished, or as it stands after ``timeout`` seconds (``None``: no
    /// limit; rounded up to whole seconds), and whether it finished. ``TaskClient.wait``
    /// calls it for a second at a time, so that Ctrl-C and cancellation come through.
    #[pyo3(signature = (uuid, timeout = None))]
    fn wait_task(
        &self,
        py: Python<'_>,
        uuid: &str,
        timeout: Option<f64>,
    ) -> PyResult<(PyObject, bool)> {
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        let task =
            crate::gil::released(py, || self.client.wait_task(uuid, timeout)).map_err(api_to_py)?;
        Ok((to_python(py, &task)?, task_is_finished(&task)))
    }

    /// Any route: ``method`` on ``path`` (its query included), with a JSON body or none.
    #[pyo3(signature = (method, path, body = None))]
    fn request(
        &self,
        py: Python<'_>,
        method: &str,
        path: &str,
        body: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyObject> {
        let body: Option<Value> = body.map(|b| to_json(py, b)).transpose()?;
        let answer = crate::gil::released(py, || self.client.request(method, path, body));
        to_python(py, &answer.map_err(api_to_py)?)
    }

    fn __repr__(&self) -> String {
        format!("TaskClient({:?})", self.client.base_url())
    }
}
