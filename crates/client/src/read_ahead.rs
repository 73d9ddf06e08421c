//! Reading ahead for the language bindings: a thread of its own polls a [`Subscriber`]
//! while the caller (Python, JavaScript) handles the messages of an earlier poll, so the
//! network read and the per-message work in the other language overlap instead of adding
//! up, and a caller that finds a poll ready takes it without waiting for any thread. A
//! caller that does little per message (the TypeScript `pollBatch`) may instead read on its
//! own thread what a shared-memory feed already holds ([`ReadAhead::try_read_here`]); the
//! thread then polls only for a caller that waits, so a busy reader runs on one thread, as
//! a Rust reader does.
//!
//! Owns the subscriber while it reads ahead, and the queue of what it read: at most
//! `depth` polls wait; then the thread waits for the caller to take one. Each poll lends
//! whole batches ([`Subscriber::poll_shared_upto`]) to a collector of the caller's kind
//! ([`Collect`]), which keeps them alive for as long as it needs; and what the
//! subscriber last said of itself ([`SubscriberStatus`]), for callers that must not
//! wait for a poll under way to ask. Touches nothing else.

use crate::{Cursor, Error, MessageRef, SharedBatch, Subscriber};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest poll: seek, position and close wait at most this long for the thread.
const POLL: Duration = Duration::from_millis(100);

/// What a binding makes of one poll's messages, in order.
pub trait Collect: Default + Send + 'static {
    /// One message, in the batch it lies in (clone the batch to keep its bytes).
    fn collect(&mut self, batch: &SharedBatch, m: MessageRef<'_>);
    /// How many messages were collected.
    fn count(&self) -> usize;
    /// The broker and position of each message collected, in order (for
    /// [`ReadAhead::position`]).
    fn positions(&self) -> Vec<(u16, u64)>;
}

/// What the subscriber said of itself after its latest poll or seek: read without
/// waiting for the subscriber, which the thread holds for up to a poll ([`POLL`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubscriberStatus {
    /// [`Subscriber::skipped`].
    pub skipped: Option<(u64, u64)>,
    /// [`Subscriber::transport`].
    pub transport: &'static str,
}

impl SubscriberStatus {
    fn of(sub: &Subscriber) -> Self {
        Self {
            skipped: sub.skipped(),
            transport: sub.transport(),
        }
    }
}

/// One poll's messages and the subscriber's position after the last of them.
pub struct Polled<C> {
    pub messages: C,
    pub next: Cursor,
}

/// Called once, outside every lock, when the next poll (or its error) is queued (by the
/// reading thread) or the read-ahead stops (by the thread that stops it: `close`, or a
/// drop) ([`ReadAhead::wake_when_ready`]).
type Wake = Box<dyn FnOnce() + Send>;

struct Queue<C> {
    polls: VecDeque<Result<Polled<C>, Error>>,
    stop: bool,
    /// Set by a caller that found nothing to take and waits without blocking; taken (and
    /// called) by whoever queues the next poll or stops the read-ahead.
    wake: Option<Wake>,
}

impl<C> Default for Queue<C> {
    fn default() -> Self {
        Self {
            polls: VecDeque::new(),
            stop: false,
            wake: None,
        }
    }
}

struct Shared<C> {
    /// `None` once closed. The thread holds it for one poll at a time, and queues what it
    /// read before letting go, so whoever holds it sees the cursor and the queue agree.
    sub: Mutex<Option<Subscriber>>,
    queue: Mutex<Queue<C>>,
    /// Rung when a poll is queued or taken, and on stop.
    changed: Condvar,
    /// Written with `sub` held, after each poll and seek; never held across either.
    status: Mutex<SubscriberStatus>,
    /// Most polls waiting to be taken.
    depth: usize,
    /// Most bytes of batches one poll lends (whole batches; at least one); the caller may
    /// change it between polls ([`ReadAhead::set_poll_bytes`]). Never 0.
    poll_bytes: AtomicUsize,
    /// Set while the caller reads on its own thread ([`ReadAhead::try_read_here`]): over a
    /// shared-memory feed the thread then polls only for a caller waiting to be woken
    /// ([`ReadAhead::wake_when_ready`]); over TCP, where the caller reads nothing, it
    /// still reads ahead.
    caller_reads: AtomicBool,
}

/// A subscriber and the thread that reads ahead from it (started by the first
/// [`ReadAhead::next_poll`] or [`ReadAhead::try_next`]). Every method but `try_next` may
/// wait up to one poll: call them off an event loop, and without a language's lock.
pub struct ReadAhead<C: Collect> {
    shared: Arc<Shared<C>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<C: Collect> ReadAhead<C> {
    /// Reads ahead from `sub`, at most `depth` polls of at most `poll_bytes` each.
    pub fn new(sub: Subscriber, depth: usize, poll_bytes: usize) -> Self {
        assert!(depth > 0 && poll_bytes > 0, "room for at least one poll");
        Self {
            shared: Arc::new(Shared {
                status: Mutex::new(SubscriberStatus::of(&sub)),
                sub: Mutex::new(Some(sub)),
                queue: Mutex::default(),
                changed: Condvar::new(),
                depth,
                poll_bytes: AtomicUsize::new(poll_bytes),
                caller_reads: AtomicBool::new(false),
            }),
            thread: Mutex::new(None),
        }
    }

    /// From the next poll on, polls lend at most `poll_bytes` (whole batches; at least
    /// one). Polls already read keep their size.
    pub fn set_poll_bytes(&self, poll_bytes: usize) {
        assert!(poll_bytes > 0, "room for at least one batch");
        self.shared.poll_bytes.store(poll_bytes, Ordering::Relaxed);
    }

    /// Whether the caller reads on its own thread ([`Self::try_read_here`]): over a
    /// shared-memory feed the thread then reads ahead no more, and polls only for a caller
    /// that waits to be woken.
    pub fn set_caller_reads(&self, on: bool) {
        self.shared.caller_reads.store(on, Ordering::Relaxed);
        // Taken under the queue's lock, so that the thread cannot miss the change between
        // looking at the flag and waiting.
        drop(self.shared.queue.lock());
        self.shared.changed.notify_all();
    }

    /// The next poll: one read ahead if there is one, else what the subscriber holds
    /// already, read on this thread without waiting ([`Subscriber::poll_shared_now`]: over
    /// a shared-memory feed only). `None` when nothing is there, when the thread is polling,
    /// or while callers hold more than `max_held` bytes of earlier polls: a caller that
    /// keeps them (and, on an event loop, never yields to let them go) then waits for the
    /// thread's polls instead of making the subscriber read into ever more new buffers.
    /// Never blocks but for the queue's and status' locks, which nobody holds across a poll.
    pub fn try_read_here(&self, max_held: usize) -> Option<Result<Polled<C>, Error>> {
        self.start();
        // The thread queues polls holding `sub`: while this holds it, nothing is queued,
        // so what is read here comes after everything queued before.
        let Some(mut sub) = self.shared.sub.try_lock() else {
            return self.try_next();
        };
        if let Some(queued) = self.try_next() {
            return Some(queued);
        }
        let Some(s) = sub.as_mut() else {
            return Some(Err(Error::Closed));
        };
        if s.lent_bytes() > max_held {
            return None;
        }
        let mut messages = C::default();
        let poll_bytes = self.shared.poll_bytes.load(Ordering::Relaxed);
        let result = s.poll_shared_now(poll_bytes, |b, m| messages.collect(b, m));
        *self.shared.status.lock() = SubscriberStatus::of(s);
        match result {
            Ok(_) if messages.count() == 0 => None,
            Ok(_) => {
                let next = Subscriber::position(s);
                Some(Ok(Polled { messages, next }))
            }
            Err(e) => Some(Err(e)),
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

    /// Continues from `cursor`, dropping what was read ahead. Returns where the next
    /// message will come from (the cursor as the subscriber took it).
    pub fn seek(&self, cursor: Cursor) -> Result<Cursor, Error> {
        self.seek_with(|s| s.seek(cursor))
    }

    /// Continues from the first message still retained (`Subscriber::seek_start`),
    /// dropping what was read ahead. Returns where the next message will come from.
    pub fn seek_start(&self) -> Result<Cursor, Error> {
        self.seek_with(Subscriber::seek_start)
    }

    fn seek_with(
        &self,
        seek: impl FnOnce(&mut Subscriber) -> Result<(), Error>,
    ) -> Result<Cursor, Error> {
        self.with_sub(|s| {
            self.shared.queue.lock().polls.clear();
            // The thread may be waiting for room, which there is now.
            self.shared.changed.notify_all();
            let sought = seek(s);
            *self.shared.status.lock() = SubscriberStatus::of(s);
            sought?;
            Ok(Subscriber::position(s))
        })
    }

    /// What the subscriber said of itself after its latest poll or seek (as of
    /// connecting, before any); never waits for a poll under way.
    pub fn status(&self) -> SubscriberStatus {
        *self.shared.status.lock()
    }

    /// The subscriber's cursor (after everything read ahead), and the broker and position
    /// of each message read ahead and not taken yet, oldest first.
    pub fn position(&self) -> Result<(Cursor, Vec<(u16, u64)>), Error> {
        self.with_sub(|s| {
            let queue = self.shared.queue.lock();
            let pending = queue
                .polls
                .iter()
                .flatten()
                .flat_map(|p| p.messages.positions());
            Ok((Subscriber::position(s), pending.collect()))
        })
    }

    /// The next poll's messages (or its error), waiting at most `wait`; `None` if none
    /// came in time.
    pub fn next_poll(&self, wait: Duration) -> Option<Result<Polled<C>, Error>> {
        self.start();
        let mut queue = self.shared.queue.lock();
        if queue.stop {
            return Some(Err(Error::Closed));
        }
        if queue.polls.is_empty() {
            self.shared.changed.wait_for(&mut queue, wait);
        }
        self.pop(&mut queue)
    }

    /// Waits at most `wait` for a poll (or its error) to be queued, or for the read-ahead to
    /// stop; takes nothing. Whether there is one to take (or it stopped). For callers that
    /// take under a lock of their own: they wait without it, then take with
    /// [`Self::try_next`], which may find the poll gone to another caller.
    pub fn wait_until_ready(&self, wait: Duration) -> bool {
        self.start();
        let mut queue = self.shared.queue.lock();
        if queue.polls.is_empty() && !queue.stop {
            self.shared.changed.wait_for(&mut queue, wait);
        }
        queue.stop || !queue.polls.is_empty()
    }

    /// The next poll's messages (or its error) if one is ready now; never waits (but for
    /// the queue's lock, which nobody holds across a poll).
    pub fn try_next(&self) -> Option<Result<Polled<C>, Error>> {
        self.start();
        let mut queue = self.shared.queue.lock();
        if queue.stop {
            return Some(Err(Error::Closed));
        }
        self.pop(&mut queue)
    }

    /// Has `wake` called (once, outside every lock) when the next poll or its error is
    /// queued (on the reading thread), or when the read-ahead stops (on the stopping one);
    /// a `wake` set before and not called yet is dropped uncalled. Returns false, keeping
    /// nothing, when a poll is ready already or the read-ahead stopped: take it
    /// ([`Self::try_next`]) instead. For a caller on an event loop, which must not block to
    /// wait ([`Self::next_poll`] does).
    pub fn wake_when_ready(&self, wake: impl FnOnce() + Send + 'static) -> bool {
        self.start();
        let mut queue = self.shared.queue.lock();
        if queue.stop || !queue.polls.is_empty() {
            return false;
        }
        queue.wake = Some(Box::new(wake));
        drop(queue);
        // A thread that polls only for waiting callers may be waiting for this one.
        self.shared.changed.notify_all();
        true
    }

    fn pop(&self, queue: &mut Queue<C>) -> Option<Result<Polled<C>, Error>> {
        let next = queue.polls.pop_front();
        if next.is_some() {
            // The thread may be waiting for room.
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
        let wake = {
            let mut queue = self.shared.queue.lock();
            queue.stop = true;
            queue.wake.take()
        };
        self.shared.changed.notify_all();
        if let Some(wake) = wake {
            wake();
        }
    }
}

impl<C: Collect> Drop for ReadAhead<C> {
    /// The thread ends after its current poll; the connection closes with it.
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether the thread should poll now: there is room in the queue, and while the caller
/// reads on its own thread (which it can over a shared-memory feed only), a caller waits
/// to be woken by the next poll.
fn wanted<C>(shared: &Shared<C>, queue: &Queue<C>) -> bool {
    let room = queue.polls.len() < shared.depth;
    let caller_reads =
        shared.caller_reads.load(Ordering::Relaxed) && shared.status.lock().transport == "shm";
    room && (queue.wake.is_some() || !caller_reads)
}

/// The thread: polls while there is room in the queue, until stopped or closed.
fn read<C: Collect>(shared: &Shared<C>) {
    loop {
        {
            let mut queue = shared.queue.lock();
            while !queue.stop && !wanted(shared, &queue) {
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
        let mut messages = C::default();
        let poll_bytes = shared.poll_bytes.load(Ordering::Relaxed);
        let result = s.poll_shared_upto(POLL, poll_bytes, |b, m| messages.collect(b, m));
        *shared.status.lock() = SubscriberStatus::of(s);
        let mut queue = shared.queue.lock();
        let queued = match result {
            Ok(_) if messages.count() == 0 => false,
            Ok(_) => {
                let next = Subscriber::position(s);
                queue.polls.push_back(Ok(Polled { messages, next }));
                true
            }
            Err(e) => {
                queue.polls.push_back(Err(e));
                true
            }
        };
        assert!(queue.polls.len() <= shared.depth, "the queue stays bounded");
        let wake = if queued { queue.wake.take() } else { None };
        drop(queue);
        drop(sub);
        shared.changed.notify_all();
        if let Some(wake) = wake {
            wake();
        }
    }
}
