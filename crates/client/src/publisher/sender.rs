//! A connection's sender thread: takes batches from its queue (or seals the open batch
//! when its linger runs out), writes them, and resends after BACKPRESSURE.

use super::*;

/// The next batch for an idle sender.
pub(super) enum Next {
    Batch(Sealed),
    /// Nothing yet: go round the sender's loop again.
    Again,
    Stop,
}

/// Longest an idle sender waits before going round its loop again.
pub(super) const SENDER_IDLE_WAIT: Duration = Duration::from_millis(5);

/// The sender's hold on its queue's hand ([`Queue::hand`]): taken before it takes a
/// batch, let go while it waits for one.
pub(super) type Hand<'a> = MutexGuard<'a, ()>;

/// A batch from queue `index`'s channel, or the open batch once its linger runs out if it
/// is due on this queue; else waits, with `hand` let go, to be woken ([`Queue::wake`]: a
/// batch handed or opened) and returns [`Next::Again`]: a batch is only ever taken in hand.
pub(super) fn next_batch(inner: &Inner, index: usize, hand: &mut Hand<'_>) -> Next {
    let q = &inner.queues[index];
    match q.rx.try_recv() {
        Ok(b) => return Next::Batch(b),
        Err(TryRecvError::Disconnected) => return Next::Stop,
        Err(TryRecvError::Empty) => {}
    }
    let wait = match inner.linger_for(index) {
        Linger::Sealed(b) => return Next::Batch(b),
        Linger::Until(deadline) => deadline
            .saturating_duration_since(Instant::now())
            .min(SENDER_IDLE_WAIT),
        Linger::NotDue => SENDER_IDLE_WAIT,
        Linger::Busy => BUILDER_WAIT,
    };
    // `select!` blocks at once; `recv_timeout` and `Select::ready` spin and yield first.
    let woken = MutexGuard::unlocked(hand, || {
        crossbeam_channel::select! {
            recv(q.wake.1) -> _ => true,
            default(wait) => false,
        }
    });
    if !woken && inner.closed.load(Ordering::Relaxed) {
        Next::Stop
    } else {
        Next::Again
    }
}

/// Writes `batch` with `header` through `stream`: a batch built in place in this
/// channel's ring is committed there (its header written, the ring's tail moved past
/// it); any other is copied (a ring batch of another connection, or one going out again,
/// is detached into a buffer of its own first). [`Written::SpanOut`]: nothing written,
/// because the batch would have to be copied into a ring whose span is lent out.
pub(super) fn write_sealed(
    stream: &mut Link,
    header: &[u8],
    batch: &mut Sealed,
) -> std::io::Result<Written> {
    if let (Link::Shm(link), Bytes::Ring(ring)) = (&*stream, &mut batch.buf) {
        if ring.commit(link, header) {
            return Ok(Written::Done);
        }
    }
    if let (Link::Shm(link), Bytes::Ring(_)) = (&*stream, &batch.buf) {
        if link.span_out() {
            // Not copied yet: the lent span goes first, then this one as it is.
            return Ok(Written::SpanOut);
        }
    }
    batch.buf.detach();
    let Bytes::Heap(bytes) = &batch.buf else {
        unreachable!("detached above");
    };
    stream.write_batch(header, bytes)
}

/// The connection's channel has a span of its ring lent out to a batch being built.
pub(super) fn span_out(stream: &Link) -> bool {
    matches!(stream, Link::Shm(link) if link.span_out())
}

/// First pause before resending after BACKPRESSURE; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Writes the batches of one queue; resends from the refused batch after BACKPRESSURE.
pub(super) fn sender(inner: Arc<Inner>, index: usize, first_seq: u64, fences_seen: u64) {
    let q = &inner.queues[index];
    let Ok(stream) = q.stream.lock().try_clone() else {
        return;
    };
    // Whatever ends the sender, the failover waits for it before collecting `unacked`.
    let _stopped = MarkStoppedOnDrop(q, &inner);
    let mut sender = SenderLoop {
        inner: &inner,
        index,
        q,
        stream,
        next_seq: first_seq,
        fences_handled: fences_seen,
        backoff: FIRST_BACKOFF,
    };
    while let Step::Again = sender.step() {}
}

/// Marks the queue's sender stopped when dropped, however the sender ends.
struct MarkStoppedOnDrop<'a>(&'a Queue, &'a Inner);

impl Drop for MarkStoppedOnDrop<'_> {
    fn drop(&mut self) {
        self.0.life.mark_sender_stopped();
        self.1.notify_progress();
    }
}

/// Whether the sender goes round its loop again.
enum Step {
    Again,
    Stop,
}

/// One connection's sender: its socket and the numbering of its batches.
struct SenderLoop<'a> {
    inner: &'a Inner,
    index: usize,
    q: &'a Queue,
    stream: Link,
    /// Orders 0-2: the sequence number the connection's next batch gets.
    next_seq: u64,
    /// Order 5: the session's fence count this connection has reopened for.
    fences_handled: u64,
    /// Pause before the next resend after BACKPRESSURE; reset by a successful write.
    backoff: Duration,
}

impl SenderLoop<'_> {
    fn step(&mut self) -> Step {
        let (inner, q) = (self.inner, self.q);
        if q.conn.failed.lock().is_some() || !q.is_live() {
            return Step::Stop;
        }
        if let Some(session) = &inner.session {
            let fences = session.fences.load(Ordering::Acquire);
            if fences != self.fences_handled {
                self.fences_handled = fences;
                return match reopen(inner, self.index) {
                    Ok(new) => {
                        if let Link::Shm(link) = &new {
                            link.allow_lending();
                        }
                        self.stream = new;
                        Step::Again
                    }
                    Err(e) => {
                        inner.fail(&q.conn, e);
                        Step::Stop
                    }
                };
            }
        }
        if q.conn.resend_from.load(Ordering::Acquire) != u64::MAX {
            return self.resend_when_ready();
        }
        let mut hand = q.hand.lock();
        let next = self.next(&mut hand);
        self.act(next)
    }

    /// Sends the batch taken (the hand still held by the caller), or goes round again,
    /// or stops.
    fn act(&mut self, next: Next) -> Step {
        match next {
            Next::Batch(batch) => self.send(batch),
            Next::Again => Step::Again,
            Next::Stop => Step::Stop,
        }
    }

    /// After BACKPRESSURE: a span of this channel's ring lent out goes first (its batch
    /// comes after every batch sent, so the broker drops it while it waits for the
    /// refused one, and it is resent with the rest); then, with lending held so that
    /// nothing comes between, the resend.
    fn resend_when_ready(&mut self) -> Step {
        let q = self.q;
        if span_out(&self.stream) {
            let mut hand = q.hand.lock();
            let next = next_batch(self.inner, self.index, &mut hand);
            return self.act(next);
        }
        let link = match &self.stream {
            Link::Shm(link) => Some(link.clone()),
            Link::Tcp(_) => None,
        };
        if link.as_ref().is_some_and(|l| !l.hold_lending()) {
            return Step::Again;
        }
        let from = q.conn.resend_from.swap(u64::MAX, Ordering::AcqRel);
        let step = self.resend(from);
        if let Some(link) = link {
            link.allow_lending();
        }
        step
    }

    /// After BACKPRESSURE for batch `from`: pauses, then writes every unacknowledged
    /// batch from `from` on again, in order.
    fn resend(&mut self, from: u64) -> Step {
        let (inner, conn) = (self.inner, &self.q.conn);
        conn.backpressure_retries.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(self.backoff);
        if inner.closed.load(Ordering::Relaxed) {
            return Step::Stop;
        }
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        let mut tail: Vec<InFlight> = {
            let mut unacked = conn.unacked.lock();
            let keep = unacked.iter().take_while(|f| f.seq < from).count();
            unacked.drain(keep..).collect()
        };
        // Every one copied out first: their spans given back, the ring has room for the
        // copies even when these batches filled it (the older ones' acks free the rest).
        for f in &mut tail {
            f.batch.buf.detach();
        }
        let epoch = self.q.epoch.load(Ordering::Acquire);
        for f in &mut tail {
            let header = batch_header(inner, f.seq, &f.batch, epoch);
            let written = write_sealed(&mut self.stream, &header, &mut f.batch);
            assert!(
                !matches!(written, Ok(Written::SpanOut)),
                "no span is lent while a resend holds lending"
            );
            if let Err(e) = written {
                // Back with the unacknowledged ones: for the failover, or for the reopen
                // to resend if the write failed because the session was fenced.
                conn.unacked.lock().extend(tail);
                return if self.fenced_meanwhile() {
                    Step::Again
                } else {
                    self.fail(e)
                };
            }
        }
        inner.requeue(conn, tail);
        Step::Again
    }

    /// The next batch to write: one a failover moved here first (past the in-flight
    /// limit: for order 5 the acknowledgements of what is in flight may wait for it),
    /// else one from the queue once the in-flight limit allows.
    fn next(&mut self, hand: &mut Hand<'_>) -> Next {
        let (inner, q) = (self.inner, self.q);
        // A span lent out of this ring holds every copy back: its batch goes first,
        // past the in-flight limit (by that one batch: a span is lent only below it).
        if span_out(&self.stream) {
            return next_batch(inner, self.index, hand);
        }
        if let Some(moved) = q.moved.lock().pop_front() {
            return Next::Batch(moved);
        }
        if inner.config.ack_level > 0
            && q.conn.unacked.lock().len() >= inner.config.max_inflight_batches
        {
            if inner.closed.load(Ordering::Relaxed) {
                return Next::Stop;
            }
            inner.arm_backstop_if_owner(self.index);
            MutexGuard::unlocked(hand, || {
                let mut g = inner.progress.0.lock();
                inner.progress.1.wait_for(&mut g, Duration::from_millis(5));
            });
            return Next::Again;
        }
        next_batch(inner, self.index, hand)
    }

    /// Numbers `batch` (orders 0-2), writes it and queues it for its acknowledgement.
    /// Called with the queue's hand held (see [`Queue::hand`]), so no span of this ring
    /// is lent between taking the batch and writing it.
    fn send(&mut self, mut batch: Sealed) -> Step {
        let (inner, q, conn) = (self.inner, self.q, &self.q.conn);
        if let Some((slow, pause)) = inner.slow_queue {
            if slow == self.index {
                std::thread::sleep(pause);
            }
        }
        let seq = batch.seq.unwrap_or(self.next_seq);
        let header = batch_header(inner, seq, &batch, q.epoch.load(Ordering::Acquire));
        let written = write_sealed(&mut self.stream, &header, &mut batch);
        if let Ok(Written::SpanOut) = written {
            // Unreachable: no span is lent while the sender holds the hand, and a batch
            // taken while one is out is that span's own (`next`). Were it reached, this
            // batch would go out after the span's, a later one; tests stop there, a
            // release build sets it aside and carries on rather than lose it.
            debug_assert!(
                false,
                "a batch in the sender's hands met a span lent after it"
            );
            q.moved.lock().push_front(batch);
            return Step::Again;
        }
        if batch.seq.is_none() {
            self.next_seq += 1;
        }
        if let Err(e) = written {
            if !self.fenced_meanwhile() {
                // Kept with the unacknowledged batches, for the failover.
                conn.unacked.lock().push_back(InFlight { seq, batch });
                conn.sent.fetch_add(1, Ordering::Release);
                return self.fail(e);
            }
            // Kept with the unacknowledged batches (below): the reopen resends it.
        }
        self.backoff = FIRST_BACKOFF;
        if inner.config.ack_level > 0 {
            inner.requeue(conn, [InFlight { seq, batch }]);
        } else {
            inner.acknowledged([batch.index]);
            inner.recycle(batch.buf);
        }
        conn.sent.fetch_add(1, Ordering::Release);
        inner.notify_progress();
        Step::Again
    }

    /// A write error on an order-5 connection may be the broker closing a fenced epoch:
    /// gives the reader a moment to report the fence before calling it a failure. A
    /// reader that already started a failover (the broker is gone) ends the wait.
    fn fenced_meanwhile(&self) -> bool {
        let (inner, q, handled) = (self.inner, self.q, self.fences_handled);
        inner.session.as_ref().is_some_and(|session| {
            inner.wait_until(Duration::from_secs(2), || {
                session.fences.load(Ordering::Acquire) != handled || !q.is_live()
            }) && q.is_live()
        })
    }

    /// A failed write: with failover, the reader (whose read fails too once the socket
    /// is shut) moves this queue's batches to the live brokers; without, the publisher
    /// fails.
    fn fail(&self, e: std::io::Error) -> Step {
        let (inner, q) = (self.inner, self.q);
        if inner.closed.load(Ordering::Relaxed) {
            return Step::Stop;
        }
        if inner.can_fail_over(q) {
            q.mark_dead();
            let _ = q.stream.lock().shutdown(std::net::Shutdown::Both);
        } else {
            let lost = Error::ConnectionLost {
                broker: q.broker.clone(),
                message: e.to_string(),
            };
            inner.fail(&q.conn, lost);
        }
        Step::Stop
    }
}
