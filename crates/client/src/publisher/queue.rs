//! Dispatch and deflection: one queue per connection; a sealed batch goes to the queue
//! round-robin names, or the next live one with room, blocking only when all are full.

use super::*;

/// A broker id and the process serving it, as the head named them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct BrokerProcess {
    pub(super) id: u32,
    pub(super) incarnation: u64,
}

pub(super) struct Queue {
    pub(super) tx: Sender<Sealed>,
    /// The receiving end too, so a failover can take back what the sender never took.
    pub(super) rx: Receiver<Sealed>,
    /// The broker's id in the cluster and the process serving it when this queue
    /// connected (known when discovered through the head): failover questions name the
    /// process, so a restarted broker's answer covers the old one.
    pub(super) process: Option<BrokerProcess>,
    /// Dead, sender stopped, moved out: see [`Lifecycle`].
    pub(super) life: Lifecycle,
    /// Batches a failover moved here from a dead broker's queue.
    pub(super) moved: Mutex<VecDeque<Sealed>>,
    /// Held by the sender from taking a batch (out of `moved`, the channel, or the
    /// lingering open batch) until it is written or set aside, and let go while it waits.
    /// The builder lends a span of this connection's ring only when it gets the hand at
    /// once: a batch in the sender's hands is in neither `moved` nor the channel, where
    /// `lend_from` looks, and the span's batch would otherwise be written before it.
    pub(super) hand: Mutex<()>,
    /// Held to check that the queue lives and hand a batch to `tx` as one step, and to
    /// mark it dead: once dead nothing more enters the channel, so a failover can empty it.
    pub(super) gate: Mutex<()>,
    pub(super) conn: Arc<ConnShared>,
    pub(super) broker: String,
    pub(super) connection: usize,
    pub(super) dispatched: AtomicU64,
    pub(super) deflected: AtomicU64,
    pub(super) producer_waits: AtomicU64,
    /// Batches the sender sealed itself (see [`PublisherConfig::linger`]).
    pub(super) lingered: AtomicU64,
    /// Batches built in place in this connection's shared-memory ring.
    pub(super) in_place: AtomicU64,
    /// Wakes this queue's idle sender (a token; one pending is enough): a batch was
    /// handed to its channel, or a batch due on it opened (the sender times the linger).
    /// The sender waits on this alone (with `select!`, which blocks at once), not for the
    /// channel to be ready: a batch is taken only in hand ([`Queue::hand`]), and
    /// `Select::ready` spins and yields before it sleeps, some microseconds of CPU per
    /// idle wait (measured: 1.5% of all samples at 330 MB/s).
    pub(super) wake: (Sender<()>, Receiver<()>),
    /// The connection's current socket; replaced when an order-5 session reopens.
    pub(super) stream: Mutex<Link>,
    /// Bumped each time `stream` is replaced, so the reader follows.
    pub(super) stream_gen: AtomicU64,
    /// Session epoch the current socket was opened with (0 without a session).
    pub(super) epoch: AtomicU64,
}

impl Queue {
    /// A queue for a connection just opened to `broker` (not started yet).
    pub(super) fn new(
        stream: Link,
        broker: &str,
        process: Option<BrokerProcess>,
        connection: usize,
        depth: usize,
        epoch: u64,
    ) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(depth);
        Self {
            tx,
            rx,
            process,
            life: Lifecycle::default(),
            moved: Mutex::new(VecDeque::new()),
            hand: Mutex::new(()),
            gate: Mutex::new(()),
            conn: Arc::new(ConnShared {
                unacked: Mutex::new(VecDeque::new()),
                sent: AtomicU64::new(0),
                acked: AtomicU64::new(0),
                acked_batches: AtomicU64::new(0),
                resend_from: AtomicU64::new(u64::MAX),
                backpressure_retries: AtomicU64::new(0),
                failed: Mutex::new(None),
                latency: Mutex::new(Histogram::new(3).expect("valid histogram")),
                append_latency: Mutex::new(Histogram::new(3).expect("valid histogram")),
            }),
            broker: broker.to_string(),
            connection,
            dispatched: AtomicU64::new(0),
            deflected: AtomicU64::new(0),
            producer_waits: AtomicU64::new(0),
            lingered: AtomicU64::new(0),
            in_place: AtomicU64::new(0),
            wake: crossbeam_channel::bounded(1),
            stream: Mutex::new(stream),
            stream_gen: AtomicU64::new(0),
            epoch: AtomicU64::new(epoch),
        }
    }

    pub(super) fn is_live(&self) -> bool {
        self.life.is_live()
    }

    /// Stops dispatching to this queue (its broker is gone).
    pub(super) fn mark_dead(&self) {
        let _gate = self.gate.lock();
        self.life.mark_dead();
    }

    /// Takes a batch a failover moved from a dead queue, unless this one is dead too.
    pub(super) fn try_take_moved(&self, batch: Sealed) -> Result<(), Sealed> {
        let _gate = self.gate.lock();
        if !self.is_live() {
            return Err(batch);
        }
        self.moved.lock().push_back(batch);
        self.dispatched.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Hands `sealed` to the channel unless the queue is dead or full.
    pub(super) fn try_hand(&self, sealed: Sealed) -> Result<(), Sealed> {
        let _gate = self.gate.lock();
        if !self.is_live() {
            return Err(sealed);
        }
        match self.tx.try_send(sealed) {
            Ok(()) => {
                self.dispatched.fetch_add(1, Ordering::Release);
                let _ = self.wake.0.try_send(());
                Ok(())
            }
            Err(TrySendError::Full(s)) | Err(TrySendError::Disconnected(s)) => Err(s),
        }
    }
}

/// The publisher's queues, one per connection. They are only ever appended (at start,
/// and when a broker joins) and never removed, so an index stays valid for the threads
/// and failovers that hold it. Reading takes no lock: a slot is set before the count that
/// covers it is published (Release), and readers load the count with Acquire.
pub(super) struct Queues {
    pub(super) slots: Box<[OnceLock<Queue>]>,
    pub(super) len: AtomicUsize,
    /// Serialises appends (start, then the membership watcher).
    pub(super) appending: Mutex<()>,
}

impl Queues {
    /// The queues of `start`, with room for `more` later.
    pub(super) fn new(initial: Vec<Queue>, more: usize) -> Self {
        let queues = Self {
            slots: (0..initial.len() + more).map(|_| OnceLock::new()).collect(),
            len: AtomicUsize::new(0),
            appending: Mutex::new(()),
        };
        if queues.append(initial).is_err() {
            unreachable!("sized for the initial queues");
        }
        queues
    }

    pub(super) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub(super) fn has_room_for(&self, count: usize) -> bool {
        self.len() + count <= self.slots.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Queue> {
        self.slots[..self.len()]
            .iter()
            .map(|slot| slot.get().expect("slots below the count are set"))
    }

    /// Appends `queues` and returns the index of the first one, or hands them back when
    /// they do not fit.
    pub(super) fn append(&self, queues: Vec<Queue>) -> Result<usize, Vec<Queue>> {
        let _appending = self.appending.lock();
        let first = self.len.load(Ordering::Relaxed);
        if first + queues.len() > self.slots.len() {
            return Err(queues);
        }
        let count = queues.len();
        for (slot, queue) in self.slots[first..].iter().zip(queues) {
            if slot.set(queue).is_err() {
                unreachable!("slots above the count are empty");
            }
        }
        self.len.store(first + count, Ordering::Release);
        Ok(first)
    }
}

impl std::ops::Index<usize> for Queues {
    type Output = Queue;

    fn index(&self, index: usize) -> &Queue {
        self.slots[index].get().expect("an appended queue")
    }
}

impl Inner {
    /// The live queue a batch due on queue `due` goes to: `due` itself, or the next
    /// live one after it.
    pub(super) fn live_queue_from(&self, due: usize) -> Option<usize> {
        let n = self.queues.len();
        (0..n)
            .map(|i| (due + i) % n)
            .find(|&i| self.queues[i].is_live())
    }

    /// A live queue from `due` on, or, when there is none (every broker was lost), the
    /// publisher fails: every later call and `flush` say so. The sealed batch in hand
    /// cannot be sent, and it is not dropped quietly: its messages were accepted (and
    /// may have been flushed for), and at order 5 its session sequence is taken, so a
    /// publisher that went on after dropping it would leave a gap that stalls its
    /// session for good (session 29). Brokers that come back join a publisher that
    /// sealed nothing meanwhile; one that did is replaced (`pub --retry-for` does).
    fn live_queue_or_fail(&self, due: usize) -> Result<usize> {
        if let Some(live) = self.live_queue_from(due) {
            return Ok(live);
        }
        self.first_error()?;
        self.fail(&self.queues[due].conn, Error::NoLiveBroker);
        Err(Error::NoLiveBroker)
    }

    /// Whether [`Self::dispatch`] would hand a batch due on queue `due` over at once: the
    /// queue it goes to (the first live one from `due`, or deflecting any live one after)
    /// has room. Only the builder's holder sends into the queues (a failover moves batches
    /// aside), so room seen under the builder's lock stays, but for the queue being marked
    /// dead meanwhile: dispatch then turns to the next live one, which may be full.
    pub(super) fn may_dispatch_now(&self, due: usize) -> bool {
        let Some(due) = self.live_queue_from(due) else {
            return false;
        };
        let n = self.queues.len();
        let tries = if self.config.deflect { n } else { 1 };
        (0..tries)
            .map(|i| &self.queues[(due + i) % n])
            .any(|q| q.is_live() && !q.tx.is_full())
    }

    /// Hands a sealed batch to queue `due` or, deflecting, the next live one with room;
    /// blocks only when every live queue is full (see [`Self::live_queue_or_fail`] for
    /// none live).
    pub(super) fn dispatch(&self, mut sealed: Sealed, due: usize) -> Result<()> {
        let due = self.live_queue_or_fail(due)?;
        let n = self.queues.len();
        let tries = if self.config.deflect { n } else { 1 };
        for i in 0..tries {
            match self.queues[(due + i) % n].try_hand(sealed) {
                Ok(()) => {
                    if i > 0 {
                        self.queues[due].deflected.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(());
                }
                Err(s) => sealed = s,
            }
        }
        self.queues[due]
            .producer_waits
            .fetch_add(1, Ordering::Relaxed);
        loop {
            self.first_error()?;
            if self.closed.load(Ordering::Relaxed) {
                return Err(Error::Closed);
            }
            // Only the round-robin queue will do without deflection, while it lives.
            let targets: Vec<usize> = if self.config.deflect || !self.queues[due].is_live() {
                let n = self.queues.len();
                (0..n).filter(|&i| self.queues[i].is_live()).collect()
            } else {
                vec![due]
            };
            if targets.is_empty() {
                self.live_queue_or_fail(due)?;
                continue;
            }
            let mut select = Select::new();
            for &i in &targets {
                select.send(&self.queues[i].tx);
            }
            // Ready, then handed through the gate: the queue may have died meanwhile.
            if let Ok(ready) = select.ready_timeout(Duration::from_millis(100)) {
                match self.queues[targets[ready]].try_hand(sealed) {
                    Ok(()) => return Ok(()),
                    Err(s) => sealed = s,
                }
            }
        }
    }
}
