//! `embarcadero.Publisher`: every option of `PublisherConfig` as a keyword argument, and
//! publishing with the GIL released (a publish waits when every queue is full).

use crate::errors::{config, to_py};
use crate::options::{millis, whole};
use crate::to_python;
use embarcadero_client::{Error, PublisherConfig, PublisherStats};
use embarcadero_wire::SESSION_KEY_LEN;
use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pybacked::{PyBackedBytes, PyBackedStr};
use pyo3::types::{PyByteArray, PyBytes, PyList, PyString};

/// One message's bytes, borrowed from the Python object where it can be (``bytes``, and
/// ``str`` once encoded), so nothing is copied before the client's batch buffer.
enum Payload {
    Bytes(PyBackedBytes),
    Str(PyBackedStr),
}

impl Payload {
    fn extract(item: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(b) = item.downcast::<PyBytes>() {
            return Ok(Self::Bytes(b.clone().into()));
        }
        if let Ok(s) = item.downcast::<PyString>() {
            return Ok(Self::Str(s.clone().try_into()?));
        }
        if let Ok(b) = item.downcast::<PyByteArray>() {
            // A bytearray can change while the GIL is released: publish a copy.
            return Ok(Self::Bytes(b.clone().into()));
        }
        Err(PyTypeError::new_err(format!(
            "a message is bytes, bytearray or str, not {}",
            item.get_type().name()?
        )))
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Bytes(b) => b,
            Self::Str(s) => s.as_bytes(),
        }
    }
}

/// A ``str``, ``bytes`` or ``bytearray`` given to ``publish_many`` is one message, not
/// many: iterated, it would publish each character or byte as a message of its own.
fn refuse_one_message(messages: &Bound<'_, PyAny>) -> PyResult<()> {
    let one = messages.is_instance_of::<PyString>()
        || messages.is_instance_of::<PyBytes>()
        || messages.is_instance_of::<PyByteArray>();
    if !one {
        return Ok(());
    }
    Err(PyTypeError::new_err(format!(
        "publish_many takes an iterable of messages, not one {}: use publish(message), \
         or publish_many([message])",
        messages.get_type().name()?
    )))
}

/// Publishes to topic ``topic`` through every broker of the cluster whose control plane is
/// at ``control`` (``None``: ``EMBARCADERO_CONTROL``, else ``127.0.0.1:12140``), or, with
/// ``brokers``, straight to those broker addresses, no failover.
///
/// Keyword options, those of the Rust ``PublisherConfig``: ``ack_level`` (0 fire and
/// forget, 1 acknowledged once ordered, 2 durable: needs rf 2 or more; default: the
/// topic's ``default_ack``, or 1 with ``brokers``), ``batch_bytes``,
/// ``linger_ms``, ``linger_backstop_ms``, ``threads_per_broker`` (connections per broker),
/// ``queue_depth``, ``max_inflight_batches``, ``deflect`` (try the next queue when the due
/// one is full), ``client_id``, ``session_key`` (16 bytes) and ``session_epoch`` (order 5:
/// pass the same client id and key to resume a session; the publisher opens an epoch above
/// the session's current one, at least ``session_epoch``, and the one it supersedes fails
/// with ``BrokerError`` code ``"SessionTakenOver"``), ``flush_timeout_ms``,
/// ``failover`` (move a dead broker's unacknowledged batches to the live ones, resending
/// exactly those not in the order), ``membership_refresh_ms``, ``max_joined_brokers``,
/// ``slow_queue`` (fault injection: ``(queue, ms)``), ``transport`` (``"auto"``: shared
/// memory to brokers on this host when a channel opens, else TCP; ``"tcp"``; ``"shm"``:
/// shared memory or an error; each queue's ``transport`` in :meth:`stats` says which).
///
/// Use it as a context manager, ``with Publisher(...) as p:``, to flush and close it at
/// the end.
#[pyclass(module = "embarcadero._native", frozen, subclass)]
pub struct Publisher {
    /// `None` once closed. Taken only inside `allow_threads`, never with the GIL held.
    inner: RwLock<Option<embarcadero_client::Publisher>>,
    /// The statistics `close` returned, for `stats()` afterwards.
    last_stats: Mutex<Option<PublisherStats>>,
    client_id: u64,
    max_message_bytes: usize,
    topic: String,
}

/// Keyword options of `Publisher(...)`, as `PublisherConfig`.
#[allow(clippy::too_many_arguments)]
fn publisher_config(
    ack_level: i128,
    batch_bytes: i128,
    linger_ms: f64,
    linger_backstop_ms: f64,
    threads_per_broker: i128,
    queue_depth: i128,
    max_inflight_batches: i128,
    client_id: Option<i128>,
    session_key: Option<&[u8]>,
    session_epoch: i128,
    flush_timeout_ms: f64,
    deflect: bool,
    failover: bool,
    membership_refresh_ms: f64,
    max_joined_brokers: i128,
    slow_queue: Option<(i128, f64)>,
    transport: &str,
) -> PyResult<PublisherConfig> {
    let session_key = match session_key {
        None => None,
        Some(k) => Some(<[u8; SESSION_KEY_LEN]>::try_from(k).map_err(|_| {
            config(format!(
                "session_key is {} bytes; a session key is {SESSION_KEY_LEN} bytes",
                k.len()
            ))
        })?),
    };
    let slow_queue = match slow_queue {
        None => None,
        Some((queue, ms)) => Some((whole("slow_queue", queue)?, millis("slow_queue", ms)?)),
    };
    Ok(PublisherConfig {
        ack_level: whole("ack_level", ack_level)?,
        batch_bytes: whole("batch_bytes", batch_bytes)?,
        linger: millis("linger_ms", linger_ms)?,
        linger_backstop: millis("linger_backstop_ms", linger_backstop_ms)?,
        threads_per_broker: whole("threads_per_broker", threads_per_broker)?,
        queue_depth: whole("queue_depth", queue_depth)?,
        max_inflight_batches: whole("max_inflight_batches", max_inflight_batches)?,
        client_id: client_id.map(|c| whole("client_id", c)).transpose()?,
        session_key,
        flush_timeout: millis("flush_timeout_ms", flush_timeout_ms)?,
        session_epoch: whole("session_epoch", session_epoch)?,
        deflect,
        slow_queue,
        failover,
        membership_refresh: millis("membership_refresh_ms", membership_refresh_ms)?,
        max_joined_brokers: whole("max_joined_brokers", max_joined_brokers)?,
        transport: crate::transport(transport)?,
        // The shared-memory ring's size keeps the Rust client's default.
        ..PublisherConfig::default()
    })
}

/// A publisher collected without `close()` (a function's local, a `del`): what it had
/// accepted is still sent, flushed and closed with the GIL released, as a buffered file is
/// flushed when collected, and a warning names the fix. Before, the Rust client's drop
/// discarded what `publish` had accepted and not yet sealed, without a word.
impl Drop for Publisher {
    fn drop(&mut self) {
        let Some(publisher) = self.inner.get_mut().take() else {
            return;
        };
        let topic = self.topic.clone();
        Python::with_gil(|py| {
            let closed = py.allow_threads(move || publisher.close());
            let (kind, text) = match closed {
                Ok(_) => (
                    py.get_type::<pyo3::exceptions::PyResourceWarning>(),
                    format!("Publisher of topic {topic:?} was collected open: flushed and closed then; use `with Publisher(...)` or call close()"),
                ),
                Err(e) => (
                    py.get_type::<pyo3::exceptions::PyRuntimeWarning>(),
                    format!("Publisher of topic {topic:?} was collected open, and flushing it then failed ({e}): messages it had accepted may be lost; use `with Publisher(...)` or call close()"),
                ),
            };
            let text = std::ffi::CString::new(text.replace('\0', " ")).expect("no NUL left");
            if let Err(e) = PyErr::warn(py, &kind, &text, 1) {
                e.write_unraisable(py, None);
            }
        });
    }
}

impl Publisher {
    /// The final statistics once closed; `None` while open (or when the close failed).
    fn closed_stats(&self, py: Python<'_>) -> Option<embarcadero_client::PublisherStats> {
        let closed = crate::gil::released(py, || self.inner.read().is_none());
        closed.then(|| self.last_stats.lock().clone()).flatten()
    }

    /// Runs `f` on the open publisher with the GIL released.
    fn with_open<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&embarcadero_client::Publisher) -> Result<R, Error> + Send,
    ) -> PyResult<R> {
        crate::gil::released(py, || match &*self.inner.read() {
            Some(p) => f(p),
            None => Err(Error::Closed),
        })
        .map_err(to_py)
    }
}

#[pymethods]
impl Publisher {
    #[new]
    #[pyo3(signature = (control, topic, *, ack_level = None, batch_bytes = 512 * 1024,
        linger_ms = 1.0, linger_backstop_ms = 5.0, threads_per_broker = 1, queue_depth = 4,
        max_inflight_batches = 16, client_id = None, session_key = None, session_epoch = 0,
        flush_timeout_ms = 60_000.0, deflect = true, failover = true,
        membership_refresh_ms = 1000.0, max_joined_brokers = 64, slow_queue = None,
        brokers = None, transport = "auto"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        control: Option<&str>,
        topic: &str,
        ack_level: Option<i128>,
        batch_bytes: i128,
        linger_ms: f64,
        linger_backstop_ms: f64,
        threads_per_broker: i128,
        queue_depth: i128,
        max_inflight_batches: i128,
        client_id: Option<i128>,
        session_key: Option<&[u8]>,
        session_epoch: i128,
        flush_timeout_ms: f64,
        deflect: bool,
        failover: bool,
        membership_refresh_ms: f64,
        max_joined_brokers: i128,
        slow_queue: Option<(i128, f64)>,
        brokers: Option<Vec<String>>,
        transport: &str,
    ) -> PyResult<Self> {
        let control = &crate::control_or_default(control);
        let config = publisher_config(
            ack_level.unwrap_or(1),
            batch_bytes,
            linger_ms,
            linger_backstop_ms,
            threads_per_broker,
            queue_depth,
            max_inflight_batches,
            client_id,
            session_key,
            session_epoch,
            flush_timeout_ms,
            deflect,
            failover,
            membership_refresh_ms,
            max_joined_brokers,
            slow_queue,
            transport,
        )?;
        let publisher = crate::gil::released(py, || match &brokers {
            Some(addrs) => embarcadero_client::Publisher::connect_brokers(addrs, topic, config),
            None => {
                let mut config = config;
                if ack_level.is_none() {
                    config.ack_level =
                        embarcadero_client::Admin::new(control).default_ack(topic)?;
                }
                embarcadero_client::Publisher::connect(control, topic, config)
            }
        })
        .map_err(to_py)?;
        Ok(Self {
            client_id: publisher.client_id(),
            max_message_bytes: publisher.max_message_bytes(),
            inner: RwLock::new(Some(publisher)),
            last_stats: Mutex::new(None),
            topic: topic.to_string(),
        })
    }

    /// Appends one message (``bytes``, ``bytearray`` or ``str``, sent as UTF-8) to the
    /// open batch. Returns once it is in a batch, not once it is acknowledged: see
    /// :meth:`flush`. Waits (with the GIL released) while every queue is full.
    fn publish(&self, py: Python<'_>, message: &Bound<'_, PyAny>) -> PyResult<()> {
        let payload = Payload::extract(message)?;
        let bytes = payload.as_bytes();
        self.with_open(py, |p| p.publish(bytes))
    }

    /// Publishes every message of ``messages`` (an iterable of ``bytes``, ``bytearray``
    /// or ``str``) in order, crossing into the client once for all of them. Returns how
    /// many were published. Nothing is published when one of them is larger than
    /// :attr:`max_message_bytes` (``MessageTooLargeError``); on a later error (the
    /// publisher failed or was closed meanwhile) the messages before it were published.
    /// A single ``str``, ``bytes`` or ``bytearray`` raises ``TypeError``: it is one
    /// message (see :meth:`publish`), not an iterable of them.
    fn publish_many(&self, py: Python<'_>, messages: &Bound<'_, PyAny>) -> PyResult<usize> {
        refuse_one_message(messages)?;
        let payloads: Vec<Payload> = match messages.downcast::<PyList>() {
            Ok(list) => list
                .iter()
                .map(|m| Payload::extract(&m))
                .collect::<PyResult<_>>(),
            Err(_) => messages
                .try_iter()?
                .map(|m| Payload::extract(&m?))
                .collect(),
        }?;
        let max = self.max_message_bytes;
        if let Some(big) = payloads.iter().find(|m| m.as_bytes().len() > max) {
            let size = big.as_bytes().len();
            return Err(to_py(Error::MessageTooLarge { size, max }));
        }
        let payloads = &payloads;
        self.with_open(py, move |p| {
            for m in payloads {
                p.publish(m.as_bytes())?;
            }
            Ok(payloads.len())
        })
    }

    /// Seals the open batch and waits until everything published so far is acknowledged
    /// at the publisher's ``ack_level`` (for ack 0: written to the sockets), at most
    /// ``flush_timeout_ms``.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.with_open(py, |p| p.flush())
    }

    /// Flushes, closes every connection and returns the final :meth:`stats`. Closing
    /// again returns them again; other calls (but :meth:`stats`) raise ``ClosedError``.
    /// On an order-5 topic it also ends the session, so that the server gives its slot to
    /// a new session at once (a publisher never closed holds it until idle for
    /// ``sequencer.session_idle_evict_secs``).
    fn close(&self, py: Python<'_>) -> PyResult<PyObject> {
        if let Some(stats) = self.closed_stats(py) {
            return to_python(py, &stats);
        }
        let stats = crate::gil::released(py, || {
            let publisher = self.inner.write().take().ok_or(Error::Closed)?;
            publisher.close()
        })
        .map_err(to_py)?;
        let dict = to_python(py, &stats)?;
        *self.last_stats.lock() = Some(stats);
        Ok(dict)
    }

    /// Counters so far: ``messages``, ``bytes``, ``batches``, ``acked_batches``, latency
    /// summaries (µs) and one entry per connection under ``queues``.
    fn stats(&self, py: Python<'_>) -> PyResult<PyObject> {
        let live = crate::gil::released(py, || self.inner.read().as_ref().map(|p| p.stats()));
        match live.or_else(|| self.last_stats.lock().clone()) {
            Some(stats) => to_python(py, &stats),
            None => Err(to_py(Error::Closed)),
        }
    }

    /// The client id batches carry (order 5: the session's id).
    #[getter]
    fn client_id(&self) -> u64 {
        self.client_id
    }

    /// The largest message the brokers accept, in bytes.
    #[getter]
    fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    #[getter]
    fn topic(&self) -> &str {
        &self.topic
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        crate::gil::released(py, || self.inner.read().is_none())
    }

    /// How many batches every one of which is acknowledged, counting in the order they
    /// were sealed (it stops at the oldest batch still waiting).
    #[getter]
    fn acked_prefix(&self, py: Python<'_>) -> PyResult<u64> {
        self.with_open(py, |p| Ok(p.acked_prefix()))
    }

    /// Batches sealed so far.
    #[getter]
    fn batches_sealed(&self, py: Python<'_>) -> PyResult<u64> {
        self.with_open(py, |p| Ok(p.batches_sealed()))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Closes the publisher (flushing it). When the block raised, a failure to close does
    /// not hide that exception.
    #[pyo3(signature = (exc_type, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.closed(py) {
            return Ok(false);
        }
        let closed = self.close(py);
        if exc_type.is_none_or(|t| t.is_none()) {
            closed?;
        }
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let state = if self.closed(py) { "closed" } else { "open" };
        format!(
            "Publisher(topic={:?}, client_id={}, {state})",
            self.topic, self.client_id
        )
    }
}
