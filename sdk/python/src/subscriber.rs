//! `embarcadero.Subscriber` and `embarcadero.Message`: reads a topic in order through the
//! Rust subscriber, which a thread of its own polls ahead (`read_ahead`). Waits happen with
//! the GIL released, in slices short enough for Ctrl-C to interrupt a blocking call. Each
//! poll's messages come as their fields and the delivery buffers the Rust subscriber lent
//! (one reference per delivery, none per message); each payload becomes a `bytes`, copied
//! straight from its delivery, when its message is taken.

use crate::batch::MessageBatch;
use crate::errors::{config, sub_to_py};
use crate::options::{millis, whole};
use crate::read_ahead::{Messages, Meta, ReadAhead, POLL_BYTES, READ_AHEAD};
use embarcadero_client::{Admin, Cursor, Error, SubscriberConfig};
use parking_lot::Mutex;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Longest wait with the GIL released before signals (Ctrl-C) are checked.
const SLICE: Duration = Duration::from_millis(100);
/// The shortest read: a poll with timeout 0 still reads what has already arrived.
const MIN_WAIT: Duration = Duration::from_millis(1);

/// One delivered message.
#[pyclass(module = "embarcadero._native", frozen, get_all)]
pub struct Message {
    /// Orders 2 and 5: the position in the topic's total order; orders 0 and 1: the
    /// position in its broker's log.
    position: u64,
    /// Orders 2 and 5: ``position``; ``None`` for orders 0 and 1.
    global_seq: Option<u64>,
    broker_id: u16,
    /// Orders 0 and 1: ``position`` (in broker ``broker_id``'s log); ``None`` for 2 and 5.
    broker_seq: Option<u64>,
    client_id: u64,
    batch_seq: u64,
    index_in_batch: u32,
    /// When the publisher appended it (nanoseconds since the Unix epoch).
    publish_ts_ns: u64,
    payload: Py<PyBytes>,
}

#[pymethods]
impl Message {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Message(position={}, broker_id={}, client_id={}, batch_seq={}, payload=<{} bytes>)",
            self.position,
            self.broker_id,
            self.client_id,
            self.batch_seq,
            self.payload.bind(py).as_bytes().len()
        )
    }
}

/// Messages polled and not yet taken by Python. Locked only for moments that run no Python
/// code and wait for nothing (a fill queues a poll into it with the GIL released), so it
/// never waits long.
#[derive(Default)]
struct Ready {
    /// Oldest first; none is empty (a poll leaves once its last message is taken).
    polls: VecDeque<Messages>,
    /// Messages of the front poll already taken.
    taken: usize,
}

impl Ready {
    fn is_empty(&self) -> bool {
        self.polls.is_empty()
    }

    fn push(&mut self, polled: Messages) {
        if !polled.metas.is_empty() {
            self.polls.push_back(polled);
        }
    }

    fn clear(&mut self) {
        self.polls.clear();
        self.taken = 0;
    }

    /// The messages not taken yet, oldest first.
    fn pending(&self) -> impl Iterator<Item = &Meta> {
        let skip = self.taken;
        let front = self.polls.front().into_iter();
        let front = front.flat_map(move |p| p.metas[skip..].iter());
        front.chain(self.polls.iter().skip(1).flat_map(|p| p.metas.iter()))
    }

    /// The next message's fields and payload (as a new `bytes`), or `None`.
    fn take<'py>(&mut self, py: Python<'py>) -> Option<(Fields, Bound<'py, PyBytes>)> {
        let poll = self.polls.front()?;
        let meta = &poll.metas[self.taken];
        // Allocating a bytes object runs no Python code, so the lock is held briefly.
        let payload = PyBytes::new(py, poll.payload(meta));
        let fields = Fields::of(meta);
        self.taken += 1;
        if self.taken == poll.metas.len() {
            self.polls.pop_front();
            self.taken = 0;
        }
        Some((fields, payload))
    }

    /// The front poll, with how many of its messages were taken already.
    fn take_rest(&mut self) -> Option<(Messages, usize)> {
        let poll = self.polls.pop_front()?;
        Some((poll, std::mem::take(&mut self.taken)))
    }
}

/// A message's fields, copied out of the queue so the `Message` is built without its lock.
pub(crate) struct Fields {
    position: u64,
    broker_id: u16,
    client_id: u64,
    batch_seq: u64,
    index_in_batch: u32,
    publish_ts_ns: u64,
}

impl Fields {
    pub(crate) fn of(m: &Meta) -> Self {
        Self {
            position: m.position,
            broker_id: m.broker_id,
            client_id: m.client_id,
            batch_seq: m.batch_seq,
            index_in_batch: m.index_in_batch,
            publish_ts_ns: m.publish_ts_ns,
        }
    }
}

/// A `Message` of a topic of order `order`, with `payload` (already copied).
pub(crate) fn new_message(
    py: Python<'_>,
    order: u8,
    meta: Fields,
    payload: Bound<'_, PyBytes>,
) -> PyResult<Py<Message>> {
    let ordered = order >= 2;
    let message = Message {
        position: meta.position,
        global_seq: ordered.then_some(meta.position),
        broker_id: meta.broker_id,
        broker_seq: (!ordered).then_some(meta.position),
        client_id: meta.client_id,
        batch_seq: meta.batch_seq,
        index_in_batch: meta.index_in_batch,
        publish_ts_ns: meta.publish_ts_ns,
        payload: payload.unbind(),
    };
    Py::new(py, message)
}

/// Reads topic ``topic`` in order from any broker of the cluster whose control plane is at
/// ``control`` (``None``: ``EMBARCADERO_CONTROL``, else ``127.0.0.1:12140``), or from the
/// given ``brokers``.
///
/// ``start``: ``None`` (the beginning: the first message still retained), a position, a list with one position per broker
/// (orders 0 and 1) or ``"end"`` (only what is published from now on). A lost connection
/// is retried ``max_reconnects`` times in a row before the error is raised. ``for m in
/// sub`` blocks for each message (Ctrl-C interrupts it); ``async for m in sub`` waits
/// without blocking the event loop. ``transport``: ``"auto"`` (a shared-memory feed from a
/// broker on this host that gives one, else TCP), ``"tcp"`` or ``"shm"`` (an error where no
/// feed can be had).
#[pyclass(module = "embarcadero._native", frozen, subclass)]
pub struct Subscriber {
    /// Used only with the GIL released (its calls wait for the reading thread).
    reader: ReadAhead,
    ready: Mutex<Ready>,
    /// Held (GIL released) by a fill from taking a poll until it is in `ready`, and by a
    /// seek: polls reach `ready` in the order they were read.
    filling: Mutex<()>,
    /// Set by `close`: checked on every `__next__` without waiting for the reader.
    closed: AtomicBool,
    control: Option<String>,
    topic: String,
    order: u8,
    /// Made with ``start=None``, or last sought to the start. (It connects from the
    /// beginning either way and then seeks to a given start, so only this says whether
    /// what it skipped on connecting was asked for.)
    from_beginning: AtomicBool,
}

/// A start position from Python: an int (a global position, or 0 for every broker), a
/// list of ints (one per broker, orders 0 and 1), or "end".
enum Start {
    /// The first message still retained (`None` or `"start"`).
    First,
    End,
    At(Cursor),
}

fn parse_start(start: &Bound<'_, PyAny>) -> PyResult<Start> {
    if start.is_none() {
        return Ok(Start::First);
    }
    if let Ok(s) = start.downcast::<PyString>() {
        let text = s.to_cow()?;
        if text.eq_ignore_ascii_case("end") {
            return Ok(Start::End);
        }
        if text.eq_ignore_ascii_case("start") {
            return Ok(Start::First);
        }
        return Err(config(format!(
            "start={text:?}: give a position like 42, one per broker like [0, 0, 10, 3], \"start\" or \"end\""
        )));
    }
    if let Ok(p) = start.extract::<i128>() {
        return match u64::try_from(p) {
            Ok(p) => Ok(Start::At(Cursor::Global(p))),
            Err(_) if p > 0 => Err(config(format!(
                "start={p}: beyond any topic's end (positions are below 2**64)"
            ))),
            Err(_) => Err(config(format!(
                "start={p}: positions count from 0 at the start of the topic and cannot be negative; to read only messages published from now on, use start=\"end\""
            ))),
        };
    }
    if start.downcast::<PyList>().is_ok() || start.downcast::<pyo3::types::PyTuple>().is_ok() {
        return Ok(Start::At(Cursor::PerBroker(start.extract()?)));
    }
    Err(PyTypeError::new_err(
        "start is None or \"start\", a position (int >= 0), a list of positions (one per broker) or \"end\"",
    ))
}

/// A deadline `timeout` seconds from now; `None` waits for ever.
fn deadline(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    timeout
        .map(|t| crate::options::seconds("timeout", t).map(|d| Instant::now() + d))
        .transpose()
}

impl Subscriber {
    /// Runs `f` on the open subscriber with the GIL released.
    fn with_sub<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut embarcadero_client::Subscriber) -> Result<R, Error> + Send,
    ) -> PyResult<R> {
        crate::gil::released(py, || self.reader.with_sub(f)).map_err(sub_to_py)
    }

    /// Waits up to `wait` (GIL released) for the next poll and appends its messages to
    /// `ready`.
    ///
    /// The wait holds no lock of ours; taking the poll and queueing it is one step under
    /// `filling`, so that fills on several threads at once (an `async` read cancelled while
    /// its fill still runs in the executor, then called again) queue polls in the order they
    /// were read. Nothing is queued once the subscriber is closed.
    fn fill(&self, py: Python<'_>, wait: Duration) -> PyResult<()> {
        crate::gil::released(py, || {
            if !self.reader.wait_until_ready(wait) {
                return Ok(());
            }
            let _one_at_a_time = self.filling.lock();
            let Some(polled) = self.reader.try_next() else {
                return Ok(()); // Another fill took it.
            };
            let messages = polled?.messages;
            let mut ready = self.ready.lock();
            if !self.closed.load(Ordering::Acquire) {
                // After any messages of earlier polls that are not taken yet.
                ready.push(messages);
            }
            Ok(())
        })
        .map_err(sub_to_py)
    }

    /// Takes with `take` (the check and the take are one step, so a seek or another
    /// reader between them cannot make a wait without a deadline come back empty), polling
    /// in slices until it gives something or `timeout` seconds pass (`None`: for ever),
    /// checking for signals between slices.
    fn wait_take<R>(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        mut take: impl FnMut(&Self, Python<'_>) -> PyResult<Option<R>>,
    ) -> PyResult<Option<R>> {
        let deadline = deadline(timeout)?;
        let mut first = true;
        loop {
            if let Some(taken) = take(self, py)? {
                return Ok(Some(taken));
            }
            let wait = match deadline {
                None => SLICE,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() && !first {
                        return Ok(None);
                    }
                    left.clamp(MIN_WAIT, SLICE)
                }
            };
            first = false;
            self.fill(py, wait)?;
            py.check_signals()?;
        }
    }

    /// The next ready message, without waiting.
    fn take_one(&self, py: Python<'_>) -> PyResult<Option<Py<Message>>> {
        let Some((fields, payload)) = self.ready.lock().take(py) else {
            return Ok(None);
        };
        new_message(py, self.order, fields, payload).map(Some)
    }

    /// The rest of the next ready poll as one batch, without waiting.
    fn take_batch(&self) -> Option<MessageBatch> {
        let (messages, first) = self.ready.lock().take_rest()?;
        Some(MessageBatch::new(messages, first, self.order))
    }

    fn broker_count(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_sub(py, |s| {
            Ok(match embarcadero_client::Subscriber::position(s) {
                Cursor::PerBroker(v) => v.len(),
                Cursor::Global(_) => 1,
            })
        })
    }

    /// The position after the last message of the topic now: the next global position
    /// (orders 2, 5), or each broker's count of messages written (orders 0, 1).
    fn end_of_topic(&self, py: Python<'_>) -> PyResult<Cursor> {
        let control = self.control.as_deref().ok_or_else(|| {
            config("start=\"end\" asks the control plane where the end is, and a subscriber made with brokers= has none; give a position")
        })?;
        let topic = crate::gil::released(py, || Admin::new(control).describe_topic(&self.topic))
            .map_err(sub_to_py)?;
        if self.order >= 2 {
            return Ok(Cursor::Global(topic.next_position));
        }
        let ends: Vec<u64> = topic.brokers.iter().map(|b| b.messages).collect();
        match ends {
            ends if ends.len() == self.broker_count(py)? => Ok(Cursor::PerBroker(ends)),
            _ => Err(config(format!(
                "the server did not describe the end of each broker's log of topic {}; give start with one position per broker instead",
                self.topic
            ))),
        }
    }

    /// `cursor` in the form the topic's order needs, or a `ConfigError` that says which
    /// (the same rules and words as the CLI's `--from`, in Python's syntax).
    fn fitted(&self, py: Python<'_>, cursor: Cursor) -> PyResult<Cursor> {
        self.with_sub(py, |s| Ok(s.fit(cursor)))?
            .map_err(|m| config(m.explain(&self.topic, "start", start_kwarg)))
    }

    fn seek_to(&self, py: Python<'_>, start: Start) -> PyResult<()> {
        let cursor = match start {
            Start::First => None,
            Start::End => Some(self.end_of_topic(py)?),
            Start::At(c) => Some(self.fitted(py, c)?),
        };
        self.from_beginning
            .store(cursor.is_none(), Ordering::Release);
        // No fill between taking a poll and queueing it: one from before the seek would
        // be queued after the clear.
        crate::gil::released(py, || {
            let _no_fill = self.filling.lock();
            self.ready.lock().clear();
            match cursor {
                Some(cursor) => self.reader.seek(cursor),
                None => self.reader.seek_start(),
            }
        })
        .map(|_| ())
        .map_err(sub_to_py)
    }
}

#[pymethods]
impl Subscriber {
    #[new]
    #[pyo3(signature = (control, topic, *, start = None, client_id = None, max_reconnects = 10,
                        brokers = None, transport = "auto", retry_for_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        control: Option<&str>,
        topic: &str,
        start: Option<&Bound<'_, PyAny>>,
        client_id: Option<i128>,
        max_reconnects: i128,
        brokers: Option<Vec<String>>,
        transport: &str,
        retry_for_ms: Option<f64>,
    ) -> PyResult<Self> {
        let control = &crate::control_or_default(control);
        // The beginning (None or "start") is where a new subscriber starts anyway.
        let start = start
            .map(parse_start)
            .transpose()?
            .filter(|s| !matches!(s, Start::First));
        let config = SubscriberConfig {
            start: None,
            client_id: client_id.map(|c| whole("client_id", c)).transpose()?,
            max_reconnects: whole("max_reconnects", max_reconnects)?,
            transport: crate::transport(transport)?,
            retry_for: retry_for_ms
                .map(|ms| millis("retry_for_ms", ms))
                .transpose()?,
        };
        let sub = crate::gil::released(py, || match &brokers {
            Some(addrs) => embarcadero_client::Subscriber::connect_brokers(addrs, topic, config),
            None => embarcadero_client::Subscriber::connect(control, topic, config),
        })
        .map_err(sub_to_py)?;
        let this = Self {
            order: sub.order(),
            reader: ReadAhead::new(sub, READ_AHEAD, POLL_BYTES),
            ready: Mutex::default(),
            filling: Mutex::new(()),
            closed: AtomicBool::new(false),
            control: brokers.is_none().then(|| control.to_string()),
            topic: topic.to_string(),
            from_beginning: AtomicBool::new(start.is_none()),
        };
        if let Some(start) = start {
            this.seek_to(py, start)?;
        }
        Ok(this)
    }

    /// The next message, waiting at most ``timeout`` seconds (``None``: until one comes;
    /// 0: only what has already arrived). ``None`` when the time runs out.
    #[pyo3(signature = (timeout = None))]
    fn poll(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<Message>>> {
        self.wait_take(py, timeout, |s, py| s.take_one(py))
    }

    /// Every message that is ready (at most ``max_messages``), waiting at most ``timeout``
    /// seconds for the first (``None``: until one comes). An empty list when the time
    /// runs out. Cheaper per message than :meth:`poll` for a stream.
    #[pyo3(signature = (timeout = None, max_messages = None))]
    fn poll_many(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        max_messages: Option<i128>,
    ) -> PyResult<Vec<Py<Message>>> {
        let max_messages = max_messages
            .map(|m| whole::<usize>("max_messages", m))
            .transpose()?;
        let max_messages = max_messages.unwrap_or(usize::MAX);
        if max_messages == 0 {
            return Ok(Vec::new());
        }
        let Some(first) = self.wait_take(py, timeout, |s, py| s.take_one(py))? else {
            return Ok(Vec::new());
        };
        let mut out = vec![first];
        while out.len() < max_messages {
            match self.take_one(py)? {
                Some(m) => out.push(m),
                None => break,
            }
        }
        Ok(out)
    }

    /// The messages of the next poll as one :class:`MessageBatch`, waiting at most
    /// ``timeout`` seconds (``None``: until one comes; 0: only what has already arrived);
    /// an empty batch when the time runs out. A poll brings up to about 1 MiB of messages
    /// (those left of one :meth:`poll` or ``for m in sub`` took from, if any). Nothing is
    /// made per message until asked for: the cheapest way to read a stream.
    #[pyo3(signature = (timeout = None))]
    fn poll_batch(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<MessageBatch> {
        let taken = self.wait_take(py, timeout, |s, _| Ok(s.take_batch()))?;
        Ok(taken.unwrap_or_else(|| MessageBatch::empty(self.order)))
    }

    /// Continues from ``position``: an int (orders 2 and 5; 0 also for 0 and 1), a list
    /// with one position per broker (orders 0 and 1), ``None`` or ``"start"`` (the first
    /// message still retained), or ``"end"`` (only messages published from now on).
    /// Messages already polled but not taken are dropped.
    fn seek(&self, py: Python<'_>, position: &Bound<'_, PyAny>) -> PyResult<()> {
        let start = parse_start(position)?;
        self.seek_to(py, start)
    }

    /// The position of the next message :meth:`poll` returns: an int (orders 2 and 5)
    /// or a list with one position per broker (orders 0 and 1). Pass it to :meth:`seek`
    /// or as ``start`` to resume.
    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<PyObject> {
        // Messages polled but not taken yet (in `ready`, then read ahead) come before the
        // Rust subscriber's cursor. The read-ahead first, `ready` second: a poll a fill
        // moves from one to the other between the two reads is then seen twice (harmless
        // to a minimum), never missed.
        let (cursor, ahead) =
            crate::gil::released(py, || self.reader.position()).map_err(sub_to_py)?;
        let mut pending: Vec<(u16, u64)> = {
            let ready = self.ready.lock();
            let taken = ready.pending();
            taken.map(|m| (m.broker_id, m.position)).collect()
        };
        pending.extend(ahead);
        match cursor {
            Cursor::Global(p) => {
                let first = pending.first().map_or(p, |m| m.1);
                Ok(first.into_pyobject(py)?.into_any().unbind())
            }
            Cursor::PerBroker(mut v) => {
                for (broker, position) in pending {
                    if let Some(next) = v.get_mut(broker as usize) {
                        *next = (*next).min(position);
                    }
                }
                Ok(v.into_pyobject(py)?.into_any().unbind())
            }
        }
    }

    /// Orders 2 and 5, a subscriber from the beginning (``start=None``): the positions
    /// ``(from, to)`` (``to`` excluded) that were reclaimed before it started (a
    /// memory-only topic drops what every reader has passed once its memory fills), so
    /// that its first message is at ``to``; ``None`` when nothing was skipped. Known on
    /// connecting, before any message. A subscriber given a position never skips: a
    /// position no longer retained raises ``BrokerError`` (``PositionNotRetained``).
    #[getter]
    fn skipped(&self) -> Option<(u64, u64)> {
        // As of the read-ahead's latest poll: never waits for one under way.
        let from_beginning = self.from_beginning.load(Ordering::Acquire);
        self.reader.status().skipped.filter(|_| from_beginning)
    }

    /// How the current connection reaches its broker: ``"tcp"``, ``"shm"``, or
    /// ``"none"`` between connections (as of the latest poll read ahead).
    #[getter]
    fn transport(&self) -> &'static str {
        self.reader.status().transport
    }

    /// The topic's order level (0, 1, 2 or 5), as the broker reported it.
    #[getter]
    fn order(&self) -> u8 {
        self.order
    }

    #[getter]
    fn topic(&self) -> &str {
        &self.topic
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Closes the connection. Iteration then stops; other calls raise ``ClosedError``.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Release);
        crate::gil::released(py, || self.reader.close());
        self.ready.lock().clear();
    }

    /// For ``async for``: polls once for up to ``timeout`` seconds (run it off the event
    /// loop's thread). Whether a message is ready for :meth:`_take`.
    fn _fill(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        if self.ready.lock().is_empty() {
            let wait = crate::options::seconds("timeout", timeout)?;
            self.fill(py, wait.max(MIN_WAIT))?;
        }
        Ok(!self.ready.lock().is_empty())
    }

    /// For ``async for``: the next ready message, never waiting.
    fn _take(&self, py: Python<'_>) -> PyResult<Option<Py<Message>>> {
        self.take_one(py)
    }

    /// For ``poll_batch_async``: the rest of the next ready poll, never waiting (an
    /// empty batch when none is ready).
    fn _take_batch(&self) -> MessageBatch {
        self.take_batch()
            .unwrap_or_else(|| MessageBatch::empty(self.order))
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Blocks until the next message; Ctrl-C interrupts it. Ends once closed, also by
    /// a `close` from another thread while this one waits (whose poll then fails with
    /// ``ClosedError``: for the iterating thread that is the end of the iteration).
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<Message>>> {
        if self.closed() {
            return Ok(None);
        }
        match self.poll(py, None) {
            Err(_) if self.closed() => Ok(None),
            polled => polled,
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("Subscriber(topic={:?}, order={})", self.topic, self.order)
    }
}

/// `cursor` as the ``start`` keyword takes it.
fn start_kwarg(cursor: &Cursor) -> String {
    match cursor {
        Cursor::Global(p) => format!("start={p}"),
        Cursor::PerBroker(v) => format!("start={v:?}"),
    }
}
