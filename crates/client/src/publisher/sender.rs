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

/// A batch from queue `index`'s channel, or the open batch once its linger runs out if it
/// is due on this queue; else waits for either (a batch opening wakes this sender).
pub(super) fn next_batch(inner: &Inner, index: usize) -> Next {
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
    crossbeam_channel::select! {
        recv(q.rx) -> r => match r {
            Ok(b) => Next::Batch(b),
            Err(_) => Next::Stop,
        },
        recv(q.batch_opened.1) -> _ => Next::Again,
        default(wait) => {
            if inner.closed.load(Ordering::Relaxed) {
                Next::Stop
            } else {
                Next::Again
            }
        }
    }
}

pub(super) fn write_batch(
    stream: &mut TcpStream,
    header: &[u8],
    payload: &[u8],
) -> std::io::Result<()> {
    let mut slices = [IoSlice::new(header), IoSlice::new(payload)];
    let mut bufs = &mut slices[..];
    while !bufs.is_empty() {
        let n = stream.write_vectored(bufs)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Writes the batches of one queue; resends from the refused batch after BACKPRESSURE.
pub(super) fn sender(inner: Arc<Inner>, index: usize, first_seq: u64, fences_seen: u64) {
    let q = &inner.queues[index];
    let conn = &q.conn;
    let Ok(mut stream) = q.stream.lock().try_clone() else {
        return;
    };
    let mut next_seq = first_seq;
    let mut fences_handled = fences_seen;
    let mut backoff = Duration::from_millis(5);
    // A failed write: with failover, the reader (whose read fails too once the socket
    // is shut) moves this queue's batches to the live brokers.
    let fail = |e: std::io::Error| {
        if inner.closed.load(Ordering::Relaxed) {
            return;
        }
        if inner.can_fail_over(q) {
            q.mark_dead();
            let _ = q.stream.lock().shutdown(std::net::Shutdown::Both);
        } else {
            inner.fail(
                conn,
                Error::ConnectionLost {
                    broker: q.broker.clone(),
                    message: e.to_string(),
                },
            );
        }
    };
    // Whatever ends the sender, the failover waits for it before collecting `unacked`.
    struct Done<'a>(&'a AtomicBool, &'a Inner);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            self.1.notify_progress();
        }
    }
    let _done = Done(&q.sender_done, &inner);
    // A write error on an order-5 connection may be the broker closing a fenced epoch:
    // give the reader a moment to report the fence before calling it a failure.
    // A reader that already started a failover (the broker is gone) ends the wait.
    let fenced_meanwhile = |handled: u64| {
        inner.session.as_ref().is_some_and(|session| {
            inner.wait_until(Duration::from_secs(2), || {
                session.fences.load(Ordering::Acquire) != handled || !q.is_live()
            }) && q.is_live()
        })
    };
    loop {
        if conn.failed.lock().is_some() || q.dead.load(Ordering::Acquire) {
            return;
        }
        if let Some(session) = &inner.session {
            let fences = session.fences.load(Ordering::Acquire);
            if fences != fences_handled {
                fences_handled = fences;
                match reopen(&inner, index) {
                    Ok(new) => stream = new,
                    Err(e) => return inner.fail(conn, e),
                }
                continue;
            }
        }
        let resend_from = conn.resend_from.swap(u64::MAX, Ordering::AcqRel);
        if resend_from != u64::MAX {
            conn.backpressure_retries.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(backoff);
            if inner.closed.load(Ordering::Relaxed) {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_millis(500));
            let tail: Vec<InFlight> = {
                let mut unacked = conn.unacked.lock();
                let keep = unacked.iter().take_while(|f| f.seq < resend_from).count();
                unacked.drain(keep..).collect()
            };
            let epoch = q.epoch.load(Ordering::Acquire);
            let mut written = true;
            for f in &tail {
                let header = batch_header(&inner, f.seq, &f.batch, epoch);
                if let Err(e) = write_batch(&mut stream, &header, &f.batch.buf) {
                    if !fenced_meanwhile(fences_handled) {
                        // Back with the unacknowledged ones, for the failover.
                        conn.unacked.lock().extend(tail);
                        return fail(e);
                    }
                    written = false;
                    break;
                }
            }
            if !written {
                // Put them back; the reopen resends them.
                let mut unacked = conn.unacked.lock();
                for f in tail {
                    unacked.push_back(f);
                }
                continue;
            }
            inner.requeue(conn, tail);
            continue;
        }
        // Batches moved here from a dead broker go first and past the in-flight limit:
        // for order 5 the acknowledgements of what is in flight may wait for them.
        let moved = q.moved.lock().pop_front();
        let batch = match moved {
            Some(b) => b,
            None => {
                if inner.config.ack_level > 0
                    && conn.unacked.lock().len() >= inner.config.max_inflight_batches
                {
                    if inner.closed.load(Ordering::Relaxed) {
                        return;
                    }
                    inner.arm_backstop_if_owner(index);
                    let mut g = inner.progress.0.lock();
                    inner.progress.1.wait_for(&mut g, Duration::from_millis(5));
                    continue;
                }
                match next_batch(&inner, index) {
                    Next::Batch(b) => b,
                    Next::Again => continue,
                    Next::Stop => return,
                }
            }
        };
        if let Some((slow, pause)) = inner.slow_queue {
            if slow == index {
                std::thread::sleep(pause);
            }
        }
        let seq = match batch.seq {
            Some(seq) => seq,
            None => {
                let seq = next_seq;
                next_seq += 1;
                seq
            }
        };
        let header = batch_header(&inner, seq, &batch, q.epoch.load(Ordering::Acquire));
        if let Err(e) = write_batch(&mut stream, &header, &batch.buf) {
            if !fenced_meanwhile(fences_handled) {
                // Kept with the unacknowledged batches, for the failover.
                conn.unacked.lock().push_back(InFlight { seq, batch });
                conn.sent.fetch_add(1, Ordering::Release);
                return fail(e);
            }
            // Keep it with the unacknowledged batches: the reopen resends it.
        }
        backoff = Duration::from_millis(5);
        if inner.config.ack_level > 0 {
            inner.requeue(conn, [InFlight { seq, batch }]);
        } else {
            inner.acknowledged([batch.index]);
            inner.recycle(batch.buf);
        }
        conn.sent.fetch_add(1, Ordering::Release);
        inner.notify_progress();
    }
}
