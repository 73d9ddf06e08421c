//! `embarcadero.Admin`: topics and cluster status through the control plane's HTTP API,
//! with the CLI's defaults (`embarcadero topic create`).

use crate::errors::{config, to_py};
use crate::to_python;
use embarcadero_client::TopicSpec;
use pyo3::prelude::*;

/// Client of the admin API of the control plane at ``control`` (``host:port``).
///
/// Every call waits at most ``timeout`` seconds (default 20, above the head's longest
/// wait). Results are plain dicts and lists, as the admin API returns them.
#[pyclass(module = "embarcadero._native", frozen)]
pub struct Admin {
    inner: embarcadero_client::Admin,
}

/// The replication factor `embarcadero topic create` picks: durable (2) by default where
/// the order allows disk replicas (orders 2 and 5), memory only (1) when asked for or for
/// orders 0 and 1, which have no global order to replicate.
fn replication_factor(order: u8, rf: Option<u8>, memory_only: bool) -> PyResult<u8> {
    match (rf, memory_only) {
        (Some(_), true) => Err(config(
            "rf and memory_only cannot both be given: memory_only means rf 1",
        )),
        (Some(rf), false) => Ok(rf),
        (None, true) => Ok(1),
        (None, false) => Ok(if order >= 2 { 2 } else { 1 }),
    }
}

#[pymethods]
impl Admin {
    #[new]
    #[pyo3(signature = (control = None, *, timeout = 20.0))]
    fn new(control: Option<&str>, timeout: f64) -> PyResult<Self> {
        let timeout = crate::options::seconds("timeout", timeout)?;
        let control = crate::control_or_default(control);
        Ok(Self {
            inner: embarcadero_client::Admin::with_timeout(&control, timeout),
        })
    }

    /// The control plane's base URL (``http://host:port``).
    #[getter]
    fn control_url(&self) -> &str {
        self.inner.control_url()
    }

    /// Creates topic ``name`` and returns its description.
    ///
    /// ``order``: 0 no order, 1 FIFO per broker, 2 total order, 5 total order plus FIFO per
    /// publisher session. ``rf`` counts the in-memory copy; by default 2 (one disk replica:
    /// the data survives restarts) for orders 2 and 5, 1 for orders 0 and 1.
    /// ``memory_only=True`` asks for rf 1. ``default_ack`` is the level ``embarcadero pub``
    /// uses when not told. ``retention_bytes`` / ``retention_ms``: disk retention (0 no
    /// limit, ``None`` the server's default).
    #[pyo3(signature = (name, order = 2, *, rf = None, memory_only = false, default_ack = 1,
                        retention_bytes = None, retention_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn create_topic(
        &self,
        py: Python<'_>,
        name: String,
        order: u8,
        rf: Option<u8>,
        memory_only: bool,
        default_ack: u8,
        retention_bytes: Option<u64>,
        retention_ms: Option<u64>,
    ) -> PyResult<PyObject> {
        let spec = TopicSpec {
            name,
            order,
            replication_factor: replication_factor(order, rf, memory_only)?,
            default_ack,
            retention_bytes,
            retention_ms,
        };
        let info = crate::gil::released(py, || self.inner.create_topic(&spec)).map_err(to_py)?;
        to_python(py, &info)
    }

    /// Every topic, each described as by :meth:`describe_topic`.
    fn list_topics(&self, py: Python<'_>) -> PyResult<PyObject> {
        let topics = crate::gil::released(py, || self.inner.list_topics()).map_err(to_py)?;
        to_python(py, &topics)
    }

    /// Topic ``name`` with its counters (``next_position``, ``committed_batches``, one
    /// entry per broker under ``brokers``...).
    fn describe_topic(&self, py: Python<'_>, name: &str) -> PyResult<PyObject> {
        let info = crate::gil::released(py, || self.inner.describe_topic(name)).map_err(to_py)?;
        to_python(py, &info)
    }

    /// The live brokers (``id``, ``addr``, ``incarnation``) and the message and batch
    /// size limits.
    fn cluster(&self, py: Python<'_>) -> PyResult<PyObject> {
        let cluster = crate::gil::released(py, || self.inner.cluster()).map_err(to_py)?;
        to_python(py, &cluster)
    }

    /// The ``/v1/status`` document (what ``embarcadero status`` prints).
    fn status(&self, py: Python<'_>) -> PyResult<PyObject> {
        let status = crate::gil::released(py, || self.inner.status()).map_err(to_py)?;
        to_python(py, &status)
    }

    /// Deletes topic ``name`` and returns it as it was just before (with its counters),
    /// with ``"deleted": True``, as the admin API answers. Connected publishers and
    /// subscribers get ``BrokerError`` with code ``TopicDeleted``; the name can be created
    /// again as a new topic at once.
    fn delete_topic(&self, py: Python<'_>, name: &str) -> PyResult<PyObject> {
        let info = crate::gil::released(py, || self.inner.delete_topic(name)).map_err(to_py)?;
        let mut answer = serde_json::to_value(&info)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        answer["deleted"] = serde_json::Value::Bool(true);
        to_python(py, &answer)
    }

    fn __repr__(&self) -> String {
        format!("Admin({:?})", self.inner.control_url())
    }
}
