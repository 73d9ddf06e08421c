//! `embarcadero_client::Error` as the exception classes of `embarcadero.errors` (defined in
//! Python, so they can also subclass the built-in `ValueError`, `TimeoutError`...). Each
//! exception's text is the error's `Display`, the text the CLI prints after `error:`.

use embarcadero_client::Error;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyDict;

static ERRORS: GILOnceCell<Py<PyModule>> = GILOnceCell::new();

/// The exception class `name` of `embarcadero.errors`.
fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let module =
        ERRORS.get_or_try_init(py, || py.import("embarcadero.errors").map(Bound::unbind))?;
    module.bind(py).getattr(name)
}

/// The exception for a client error.
pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| build(py, &e).unwrap_or_else(|failed| failed))
}

/// A subscriber's error: the client's `Closed` says "the publisher is closed", which
/// is its publisher's wording; a closed subscriber says so of itself.
pub fn sub_to_py(e: Error) -> PyErr {
    match e {
        Error::Closed => Python::with_gil(|py| {
            class(py, "ClosedError")
                .and_then(|c| c.call1(("the subscriber is closed",)))
                .map(PyErr::from_value)
                .unwrap_or_else(|failed| failed)
        }),
        e => to_py(e),
    }
}

/// The exception for an error answer of the workflow API (or none at all: status 0,
/// code ``unreachable``): a `WorkflowApiError` with the API's status and code.
pub fn api_to_py(e: embarcadero_workflow::client::ApiError) -> PyErr {
    Python::with_gil(|py| {
        let kw = PyDict::new(py);
        kw.set_item("status", e.status)?;
        kw.set_item("code", &e.code)?;
        let value = class(py, "WorkflowApiError")?.call((e.to_string(),), Some(&kw))?;
        Ok(PyErr::from_value(value))
    })
    .unwrap_or_else(|failed: PyErr| failed)
}

/// A `ConfigError` (an argument the binding itself refuses) with `message`.
pub fn config(message: impl Into<String>) -> PyErr {
    to_py(Error::Config(message.into()))
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let kw = PyDict::new(py);
    let name = match e {
        Error::Connect { what, addr, .. } => {
            kw.set_item("what", what)?;
            kw.set_item("addr", addr)?;
            "ConnectError"
        }
        Error::Admin { status, .. } => {
            kw.set_item("status", status)?;
            "AdminError"
        }
        Error::Broker { broker, code, .. } => {
            kw.set_item("broker", broker)?;
            kw.set_item("code", format!("{code:?}"))?;
            kw.set_item("code_number", *code as u16)?;
            "BrokerError"
        }
        Error::ConnectionLost { broker, .. } => {
            kw.set_item("broker", broker)?;
            "ConnectionLostError"
        }
        Error::Protocol { peer, .. } => {
            kw.set_item("peer", peer)?;
            "ProtocolError"
        }
        Error::MessageTooLarge { size, max } => {
            kw.set_item("size", size)?;
            kw.set_item("max", max)?;
            "MessageTooLargeError"
        }
        Error::Config(_) => "ConfigError",
        Error::InvalidName(_) => "InvalidNameError",
        Error::Timeout(after) => {
            kw.set_item("timeout", after.as_secs_f64())?;
            "TimeoutError"
        }
        Error::Closed => "ClosedError",
        Error::NoLiveBroker => "NoLiveBrokerError",
    };
    let value = class(py, name)?.call((e.to_string(),), Some(&kw))?;
    Ok(PyErr::from_value(value))
}
