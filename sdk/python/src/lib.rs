//! The native half of the `embarcadero` Python package: a thin PyO3 binding of the Rust
//! client (`crates/client`), so publishing, ordering, failover and acknowledgements behave
//! exactly as in Rust; and of the workflow engine's worker (`crates/workflow`), so Python
//! step handlers run under the same worker loop as Rust ones. Owns only the crossing of the
//! language boundary: argument conversion, releasing the GIL around every wait, and turning
//! errors into exceptions.

mod admin;
mod batch;
mod errors;
mod gil;
mod options;
mod publisher;
mod read_ahead;
mod subscriber;
mod tasks;
mod workflow;

use pyo3::prelude::*;

/// The control plane address `embarcadero serve` listens on by default.
pub(crate) const DEFAULT_CONTROL: &str = "127.0.0.1:12140";

/// The control plane address a call names, else `EMBARCADERO_CONTROL`, else the server's
/// default: as the CLI and the TypeScript package take it.
pub(crate) fn control_or_default(control: Option<&str>) -> String {
    control
        .map(str::to_owned)
        .or_else(|| std::env::var("EMBARCADERO_CONTROL").ok())
        .unwrap_or_else(|| DEFAULT_CONTROL.to_owned())
}

/// A transport as Python names it: ``"auto"``, ``"tcp"`` or ``"shm"`` (the CLI's
/// ``--transport``); anything else is a ``ConfigError`` naming the choices.
pub(crate) fn transport(name: &str) -> PyResult<embarcadero_client::Transport> {
    name.parse().map_err(errors::config)
}

/// `value` as a Python object, through its JSON form (the admin API's documents and the
/// publisher's statistics are JSON-shaped: dicts, lists, numbers, strings).
pub(crate) fn to_python<T: serde::Serialize>(py: Python<'_>, value: &T) -> PyResult<PyObject> {
    let text = serde_json::to_string(value)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("DEFAULT_CONTROL", DEFAULT_CONTROL)?;
    m.add_class::<admin::Admin>()?;
    m.add_class::<publisher::Publisher>()?;
    m.add_class::<subscriber::Subscriber>()?;
    m.add_class::<subscriber::Message>()?;
    m.add_class::<batch::MessageBatch>()?;
    m.add_class::<tasks::NativeTaskClient>()?;
    m.add_class::<workflow::NativeWorker>()?;
    m.add_class::<workflow::StepContext>()?;
    m.add_class::<workflow::BatchInput>()?;
    m.add_function(wrap_pyfunction!(random_session_key, m)?)?;
    m.add_function(wrap_pyfunction!(workflow::mark_handler_thread, m)?)?;
    gil::register_exit_hook(m)?;
    Ok(())
}

/// A fresh order-5 session key (16 bytes from the operating system's random source): pass
/// the same key again (with the same ``client_id``) to resume a session after a restart.
#[pyfunction]
fn random_session_key(py: Python<'_>) -> PyResult<Py<pyo3::types::PyBytes>> {
    let key = embarcadero_client::random_session_key().map_err(errors::to_py)?;
    Ok(pyo3::types::PyBytes::new(py, &key).unbind())
}
