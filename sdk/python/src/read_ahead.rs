//! Reading ahead for `embarcadero.Subscriber`: a thread of its own polls the Rust subscriber
//! while Python handles the messages of the previous poll, so the network read and the
//! per-message work in Python overlap instead of adding up. At most `READ_AHEAD` polls'
//! messages wait; then the thread waits for Python to take some.

use embarcadero_client::{Cursor, Error, MessageRef, SharedBatch, Subscriber};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Polls waiting to be taken before the thread stops reading.
const READ_AHEAD: usize = 8;
/// Most bytes of batches one poll takes (whole batches; at least one): the batches of
/// a poll are freed only when Python has taken its last message, so a poll of
/// everything ready (up to the subscriber's whole read-ahead) kept tens of MiB away from
/// the subscriber's buffer reuse, and the reader faulted in fresh memory instead.
const POLL_BYTES: usize = 1 << 20;
/// Longest poll: seek, position and close wait at most this long for the thread.
const POLL: Duration = Duration::from_millis(100);

/// A message's fields, and where its payload lies: in batch `batch` of its poll.
pub struct Meta {
    pub position: u64,
    pub broker_id: u16,
    pub client_id: u64,
    pub batch_seq: u64,
    pub index_in_batch: u32,
    pub publish_ts_ns: u64,
    /// Index into [`Polled::batches`].
    batch: u32,
    payload_at: u32,
    payload_len: u32,
}

/// What one poll brought: each message's fields and where its payload is, in the
/// batches the Rust subscriber lent (kept alive, and unchanged, while this is:
/// [`Subscriber::poll_shared`]). One reference per batch, none per message. No payload
/// is copied here: Python copies each once, into its `bytes`, from the batch it came in.
#[derive(Default)]
pub struct Polled {
    batches: Vec<SharedBatch>,
    pub metas: Vec<Meta>,
}

impl Polled {
    fn collect(&mut self, batch: &SharedBatch, m: MessageRef<'_>) {
        let same = |b: &SharedBatch| b.as_mut_ptr() == batch.as_mut_ptr();
        if !self.batches.last().is_some_and(same) {
            self.batches.push(batch.clone());
        }
        let range = batch.range_of(m.payload);
        // A delivery is at most 256 MiB (the client refuses larger), so offsets fit.
        let (payload_at, payload_len) = (u32::try_from(range.start), u32::try_from(range.len()));
        self.metas.push(Meta {
            position: m.position,
            broker_id: m.broker_id,
            client_id: m.client_id,
            batch_seq: m.batch_seq,
            index_in_batch: m.index_in_batch,
            publish_ts_ns: m.publish_ts_ns,
            batch: (self.batches.len() - 1) as u32,
            payload_at: payload_at.expect("a delivery is under 4 GiB"),
            payload_len: payload_len.expect("a delivery is under 4 GiB"),
        });
    }

    /// The payload of `meta`, one of this poll's messages.
    pub fn payload(&self, meta: &Meta) -> &[u8] {
        let at = meta.payload_at as usize;
        &self.batches[meta.batch as usize].bytes()[at..at + meta.payload_len as usize]
    }
}

#[derive(Default)]
struct Queue {
    polls: VecDeque<Result<Polled, Error>>,
    stop: bool,
}

struct Shared {
    /// `None` once closed. The thread holds it for one poll at a time, and pushes what it
    /// read before letting go, so whoever holds it sees the cursor and the queue agree.
    sub: Mutex<Option<Subscriber>>,
    queue: Mutex<Queue>,
    changed: Condvar,
}

/// The Rust subscriber and the thread that reads ahead from it (started by the first
/// `next_poll`). Every method may wait up to one poll: call them without the GIL.
pub struct ReadAhead {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl ReadAhead {
    pub fn new(sub: Subscriber) -> Self {
        Self {
            shared: Arc::new(Shared {
                sub: Mutex::new(Some(sub)),
                queue: Mutex::default(),
                changed: Condvar::new(),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Runs `f` on the subscriber while the thread is not polling.
    pub fn with_sub<R>(
        &self,
        f: impl FnOnce(&mut Subscriber) -> Result<R, Error>,
    ) -> Result<R, Error> {
        match &mut *self.shared.sub.lock() {
            Some(s) => f(s),
            None => Err(Error::Closed),
        }
    }

    /// Continues from `cursor`, dropping what was read ahead.
    pub fn seek(&self, cursor: Cursor) -> Result<(), Error> {
        self.with_sub(|s| {
            self.shared.queue.lock().polls.clear();
            // The thread may be waiting for room, which there is now.
            self.shared.changed.notify_all();
            s.seek(cursor)
        })
    }

    /// The subscriber's cursor (after everything read ahead), and the broker and position
    /// of each message read ahead and not taken yet, oldest first.
    pub fn position(&self) -> Result<(Cursor, Vec<(u16, u64)>), Error> {
        self.with_sub(|s| {
            let queue = self.shared.queue.lock();
            let pending = queue.polls.iter().flatten().flat_map(|p| &p.metas);
            Ok((
                Subscriber::position(s),
                pending.map(|m| (m.broker_id, m.position)).collect(),
            ))
        })
    }

    /// The next poll's messages (or its error), waiting at most `wait`; `None` if none
    /// came in time.
    pub fn next_poll(&self, wait: Duration) -> Option<Result<Polled, Error>> {
        self.start();
        let mut queue = self.shared.queue.lock();
        if queue.stop {
            return Some(Err(Error::Closed));
        }
        if queue.polls.is_empty() {
            self.shared.changed.wait_for(&mut queue, wait);
        }
        let next = queue.polls.pop_front();
        if next.is_some() {
            self.shared.changed.notify_all();
        }
        next
    }

    fn start(&self) {
        let mut thread = self.thread.lock();
        if thread.is_none() {
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new()
                .name("embarcadero-subscriber".into())
                .spawn(move || read(&shared));
            // Without a thread, `next_poll` times out and the caller's deadline applies.
            *thread = spawned.ok();
        }
    }

    /// Stops the thread and closes the connection.
    pub fn close(&self) {
        self.stop();
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
        drop(self.shared.sub.lock().take());
    }

    fn stop(&self) {
        self.shared.queue.lock().stop = true;
        self.shared.changed.notify_all();
    }
}

impl Drop for ReadAhead {
    /// The thread ends after its current poll; the connection closes with it.
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: polls while there is room in the queue, until stopped or closed.
fn read(shared: &Shared) {
    loop {
        {
            let mut queue = shared.queue.lock();
            while !queue.stop && queue.polls.len() >= READ_AHEAD {
                shared.changed.wait(&mut queue);
            }
            if queue.stop {
                return;
            }
        }
        let mut sub = shared.sub.lock();
        let Some(s) = sub.as_mut() else {
            return;
        };
        let mut polled = Polled::default();
        let result = s.poll_shared_upto(POLL, POLL_BYTES, |batch, m| polled.collect(batch, m));
        let mut queue = shared.queue.lock();
        match result {
            Ok(_) if polled.metas.is_empty() => {}
            Ok(_) => queue.polls.push_back(Ok(polled)),
            Err(e) => queue.polls.push_back(Err(e)),
        }
        drop(queue);
        drop(sub);
        shared.changed.notify_all();
    }
}
