//! A connection's ack reader thread: acknowledgements, broker errors, fences, and the
//! start of a failover when the connection is lost.

use super::*;

/// What the reader reads from: the stream generation it follows, the session epoch it
/// was opened at, and its socket.
type Followed = (u64, u64, Link);

/// Reads acks and errors of one connection.
pub(super) fn reader(inner: Arc<Inner>, index: usize) {
    let q = &inner.queues[index];
    let conn = &q.conn;
    let mut generation = q.stream_gen.load(Ordering::Acquire);
    let mut epoch = q.epoch.load(Ordering::Acquire);
    let Ok(mut stream) = q.stream.lock().try_clone() else {
        return;
    };
    loop {
        match conn::read_frame(&mut stream, &q.broker, 64) {
            Ok(Frame::Ack { count }) => on_ack(&inner, conn, count),
            Ok(Frame::Error(e)) if e.code == ErrorCode::Backpressure => {
                conn.resend_from.store(e.batch_seq, Ordering::Release);
            }
            Ok(Frame::Error(e))
                if e.code == ErrorCode::SessionFenced && inner.session.is_some() =>
            {
                let hwm = e.fenced_hwm().expect("a SessionFenced frame");
                if let Err(taken_over) = inner.fence(&q.broker, epoch, hwm, e.session_epoch) {
                    return inner.fail(conn, taken_over);
                }
                match next_stream(&inner, q, generation) {
                    Some((g, ep, s)) => (generation, epoch, stream) = (g, ep, s),
                    None => return inner.fail(conn, conn::broker_error(&q.broker, e)),
                }
            }
            Ok(Frame::Error(e)) => {
                return inner.fail(conn, conn::broker_error(&q.broker, e));
            }
            Ok(other) => {
                return inner.fail(
                    conn,
                    Error::Protocol {
                        peer: q.broker.clone(),
                        message: format!("unexpected frame on a publish connection: {other:?}"),
                    },
                );
            }
            Err(e) => match on_lost(&inner, index, generation, e) {
                Some((g, ep, s)) => (generation, epoch, stream) = (g, ep, s),
                None => return,
            },
        }
    }
}

/// An ack up to batch `count`: takes the acknowledged batches off the connection's
/// queue, records their latency, and gives their buffers back.
#[inline]
fn on_ack(inner: &Inner, conn: &ConnShared, count: u64) {
    let now = Instant::now();
    let mut done = Vec::new();
    {
        // `acked` moves under the queue lock: the sender checks it under the
        // same lock when it queues a batch the broker acknowledged before
        // the sender got to queue it.
        let mut unacked = conn.unacked.lock();
        while unacked.front().is_some_and(|f| f.seq < count) {
            done.push(unacked.pop_front().expect("front exists"));
        }
        conn.acked.fetch_max(count, Ordering::AcqRel);
    }
    conn.record_latency(&done, now);
    inner.acknowledged(done.iter().map(|f| f.batch.index));
    conn.acked_batches
        .fetch_add(done.len() as u64, Ordering::Release);
    for f in done {
        inner.recycle(f.batch.buf);
    }
    inner.notify_progress();
}

/// Order 5: after a fence the sender replaces the socket; follow it. `None` when there
/// is no session, or no new socket came within `REOPEN_WAIT` of stream generation
/// `generation`.
fn next_stream(inner: &Inner, q: &Queue, generation: u64) -> Option<Followed> {
    inner.session.as_ref()?;
    if !inner.wait_until(REOPEN_WAIT, || {
        q.stream_gen.load(Ordering::Acquire) != generation
    }) {
        return None;
    }
    let generation = q.stream_gen.load(Ordering::Acquire);
    let epoch = q.epoch.load(Ordering::Acquire);
    let stream = q.stream.lock().try_clone().ok()?;
    Some((generation, epoch, stream))
}

/// How long the ack reader waits for the sender to reopen its connection: a broker may
/// hold an opening hello up to 5 s while the sequencer switches the session's epoch,
/// and a reopen may meet a newer fence and open again, up to six times.
const REOPEN_WAIT: Duration = Duration::from_secs(40);

/// Reading from the connection failed with `e`: the socket to follow if it was replaced,
/// else `None` once the reader is done (the publisher closed, a failover started, or
/// the connection failed).
fn on_lost(inner: &Inner, index: usize, generation: u64, e: Error) -> Option<Followed> {
    let q = &inner.queues[index];
    if inner.closed.load(Ordering::Relaxed) {
        inner.notify_progress();
        return None;
    }
    let replaced = || {
        // Order 5: a fence reopen replaces the socket; give it a moment.
        inner.session.is_some()
            && inner.wait_until(Duration::from_millis(200), || {
                q.stream_gen.load(Ordering::Acquire) != generation
            })
    };
    if inner.can_fail_over(q) && !replaced() {
        fail_over(inner, index, e);
        return None;
    }
    // The socket may have been replaced (or closed by the broker for a
    // fence another connection reported): follow it if so.
    let followed = next_stream(inner, q, generation);
    if followed.is_none() {
        inner.fail(&q.conn, e);
    }
    followed
}
