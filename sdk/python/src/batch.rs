//! `embarcadero.MessageBatch`: the messages of one poll, handed to Python whole by
//! `Subscriber.poll_batch`. What the read-ahead thread collected for the poll (each message's
//! fields and where its payload lies in the deliveries the Rust subscriber lent) moves into
//! the batch unchanged; nothing is made per message until Python asks for it, so a reader
//! that works a poll at a time (sizes, totals, a payload here and there) pays for one Python
//! object per poll instead of a `Message` and a `bytes` per message (docs/PERFORMANCE.md,
//! "Session 35"). Owns only that hand-over; the messages' fields and payload copies are
//! made as `Subscriber.poll` makes them (`subscriber::new_message`).

use crate::read_ahead::{Messages, Meta};
use crate::subscriber::{new_message, Fields, Message};
use pyo3::exceptions::{PyIndexError, PyOverflowError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySlice};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Messages delivered together, in order: ``len(batch)``, ``batch[i]`` (a :class:`Message`,
/// negative indexes count from the end; a slice gives a ``list``), ``for m in batch``, and
/// without making a
/// ``Message``: ``batch.size(i)``, ``batch.payload(i)``, ``batch.payloads()`` and
/// ``batch.payload_bytes``. The subscriber's position is already past every message of
/// it. Holding a batch keeps its deliveries' memory in use (about 1 MiB at most).
#[pyclass(module = "embarcadero._native", frozen, sequence)]
pub struct MessageBatch {
    /// The poll the batch was taken from; messages before `first` were taken one at a
    /// time (`poll`, `for m in sub`) before the rest came as this batch.
    messages: Messages,
    first: usize,
    /// The topic's order level: says whether positions are global.
    order: u8,
}

impl MessageBatch {
    /// The messages of `messages` from `first` on.
    pub fn new(messages: Messages, first: usize, order: u8) -> Self {
        assert!(
            first <= messages.metas.len(),
            "a batch starts inside its poll"
        );
        Self {
            messages,
            first,
            order,
        }
    }

    /// An empty batch: what a poll whose time ran out returns.
    pub fn empty(order: u8) -> Self {
        Self::new(Messages::default(), 0, order)
    }

    fn metas(&self) -> &[Meta] {
        &self.messages.metas[self.first..]
    }

    /// Message `index` (Python's: negative counts from the end), or IndexError.
    fn meta(&self, index: isize) -> PyResult<&Meta> {
        let metas = self.metas();
        let at = if index < 0 {
            metas.len().checked_sub(index.unsigned_abs())
        } else {
            Some(index.unsigned_abs())
        };
        at.and_then(|i| metas.get(i)).ok_or_else(|| {
            PyIndexError::new_err(format!(
                "message {index} of a batch of {} messages",
                metas.len()
            ))
        })
    }

    fn message_at(&self, py: Python<'_>, meta: &Meta) -> PyResult<Py<Message>> {
        let payload = PyBytes::new(py, self.messages.payload(meta));
        new_message(py, self.order, Fields::of(meta), payload)
    }
}

/// An index as Python gives one (any integer, or an object with `__index__`): one too
/// large for any sequence is an IndexError, as a list says, not an OverflowError.
fn index_of(key: &Bound<'_, PyAny>) -> PyResult<isize> {
    key.extract::<isize>().map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(key.py()) {
            PyIndexError::new_err(format!("cannot fit {key} into an index-sized integer"))
        } else {
            e
        }
    })
}

#[pymethods]
impl MessageBatch {
    fn __len__(&self) -> usize {
        self.metas().len()
    }

    /// Message ``index`` (its payload copied into a new ``bytes``), or for a slice a
    /// ``list`` of those messages, as a ``list`` slices.
    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        if let Ok(slice) = key.downcast::<PySlice>() {
            let at = slice.indices(self.metas().len() as isize)?;
            let picked = (0..at.slicelength as isize).map(|k| at.start + k * at.step);
            let messages: PyResult<Vec<Py<Message>>> = picked
                .map(|i| self.message_at(py, &self.metas()[i as usize]))
                .collect();
            return Ok(PyList::new(py, messages?)?.into_any().unbind());
        }
        let meta = self.meta(index_of(key)?)?;
        Ok(self.message_at(py, meta)?.into_any())
    }

    fn __iter__(slf: Py<Self>) -> BatchIter {
        BatchIter {
            batch: slf,
            next: AtomicUsize::new(0),
        }
    }

    /// The payload of message ``index``, copied into a new ``bytes``.
    fn payload<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let meta = self.meta(index_of(index)?)?;
        Ok(PyBytes::new(py, self.messages.payload(meta)))
    }

    /// The payload length of message ``index``, in bytes (nothing copied).
    fn size(&self, index: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.messages.payload(self.meta(index_of(index)?)?).len())
    }

    /// Every payload, in order, each copied into a new ``bytes``: no ``Message`` made.
    fn payloads<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let payload = |m: &Meta| PyBytes::new(py, self.messages.payload(m));
        self.metas().iter().map(payload).collect()
    }

    /// The payload bytes of all the messages together.
    #[getter]
    fn payload_bytes(&self) -> u64 {
        let size = |m: &Meta| self.messages.payload(m).len() as u64;
        self.metas().iter().map(size).sum()
    }

    fn __repr__(&self) -> String {
        match (self.metas().first(), self.metas().last()) {
            (Some(a), Some(z)) if self.order >= 2 => format!(
                "MessageBatch({} messages, positions {}..={})",
                self.__len__(),
                a.position,
                z.position
            ),
            _ => format!("MessageBatch({} messages)", self.__len__()),
        }
    }
}

/// ``iter(batch)``: the batch's messages in order.
#[pyclass(module = "embarcadero._native", frozen)]
pub struct BatchIter {
    batch: Py<MessageBatch>,
    /// The next message's index in the batch; only grows.
    next: AtomicUsize,
}

#[pymethods]
impl BatchIter {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<Message>>> {
        let batch = self.batch.get();
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        match batch.metas().get(i) {
            Some(meta) => batch.message_at(py, meta).map(Some),
            None => {
                // Stays past the end however often it is called again.
                self.next.store(batch.metas().len(), Ordering::Relaxed);
                Ok(None)
            }
        }
    }
}
