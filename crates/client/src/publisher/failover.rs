//! Failover and membership: moving a dead broker's batches to the live ones (asking the
//! head which were ordered), and connecting to brokers that join later.

use super::*;

/// Longest wait for the head's answer when the membership watcher reads it: `close`
/// waits for the watcher, so it must not hang on a head that stopped answering.
pub(super) const MEMBERSHIP_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

impl Inner {
    /// Whether a lost connection to `q`'s broker is failed over rather than fatal.
    pub(super) fn can_fail_over(&self, q: &Queue) -> bool {
        self.config.failover
            && self.order >= 2
            && self.control.is_some()
            && q.process.is_some()
            && !self.closed.load(Ordering::Relaxed)
    }
}

/// Moves the batches of queue `index`, whose broker is gone, to the live brokers:
/// every unacknowledged batch that is not in the global order is dispatched again, and
/// those that are (the head answers from the GOI once it has fenced the dead broker)
/// count as acknowledged. Order 5 resends them all: the sequencer drops any session
/// sequence it already has, so each is delivered exactly once.
pub(super) fn fail_over(inner: &Inner, index: usize, cause: Error) {
    let q = &inner.queues[index];
    let conn = &q.conn;
    inner.failovers.fetch_add(1, Ordering::AcqRel);
    cut_off_process(inner, q);
    tracing::warn!(broker = %q.broker, "lost the broker ({cause}); moving its batches to the live brokers");
    let result = move_batches(inner, index);
    match result {
        Ok(count) => tracing::info!(broker = %q.broker, batches = count, "failover done"),
        Err(e) => inner.fail(conn, e),
    }
    q.life.mark_moved_out();
    inner.failovers.fetch_sub(1, Ordering::AcqRel);
    inner.notify_progress();
    // The broker may come back (restarted) or others may have joined: look now rather
    // than at the next refresh.
    let _ = inner.membership_wake.try_send(());
}

/// Marks `q` dead and shuts its stream down, and so every live connection to the same
/// broker process, ahead of the head fencing that process.
fn cut_off_process(inner: &Inner, q: &Queue) {
    q.mark_dead();
    let _ = q.stream.lock().shutdown(std::net::Shutdown::Both);
    // The head is about to fence the broker: its other connections will get no more
    // acknowledgements, so they fail over too (their readers see the shutdown). Those to
    // another process of the same id (a restart) are not affected.
    for other in inner.queues.iter().filter(|o| o.process == q.process) {
        if other.is_live() {
            other.mark_dead();
            let _ = other.stream.lock().shutdown(std::net::Shutdown::Both);
        }
    }
}

/// The work of [`fail_over`] once queue `index` is cut off: waits for its sender to
/// stop, settles the batches the head says were ordered, and moves the others to the
/// live queues. Returns how many batches it moved.
fn move_batches(inner: &Inner, index: usize) -> Result<usize> {
    let q = &inner.queues[index];
    let conn = &q.conn;
    if !inner.wait_until(Duration::from_secs(30), || q.life.sender_stopped()) {
        return Err(Error::Timeout(Duration::from_secs(30)));
    }
    // Marked dead: nothing enters the channel any more, so this empties it for good.
    let mut moved: Vec<Sealed> = q.moved.lock().drain(..).collect();
    moved.extend(q.rx.try_iter());
    let unacked: Vec<InFlight> = conn.unacked.lock().drain(..).collect();
    let acked = conn.acked.load(Ordering::Acquire);
    let unknown: Vec<u64> = unacked
        .iter()
        .filter(|f| f.seq >= acked)
        .map(|f| f.batch.batch_id)
        .collect();
    let ordered = if inner.order == 2 && !unknown.is_empty() {
        ordered_on_dead_broker(inner, q, &unknown)?
    } else {
        Vec::new()
    };
    for f in unacked {
        if f.seq < acked || ordered.contains(&f.batch.batch_id) {
            inner.settle(conn, f);
        } else {
            moved.push(f.batch);
        }
    }
    let count = moved.len();
    spread_over_queues(inner, index, moved)?;
    Ok(count)
}

/// Hands the `moved` batches of queue `index` out round robin, from the queue after it
/// on: each to the first queue that takes it (a dead one does not). Fails when none
/// does.
fn spread_over_queues(inner: &Inner, index: usize, moved: Vec<Sealed>) -> Result<()> {
    // Spread over the live queues, in order (order 5 resends by session sequence).
    let n = inner.queues.len();
    let mut next = index + 1;
    for mut batch in moved {
        if inner.order != 5 {
            // Order 2: the new connection numbers it.
            batch.seq = None;
        }
        let mut tried = 0;
        loop {
            if tried == n {
                return Err(Error::NoLiveBroker);
            }
            let target = &inner.queues[next % n];
            next += 1;
            tried += 1;
            match target.try_take_moved(batch) {
                Ok(()) => break,
                Err(b) => batch = b,
            }
        }
    }
    Ok(())
}

/// Asks the head which of `batch_ids` (this connection's unacknowledged batches) made
/// it into the order; waits (at most 30 s) until the head has declared the broker dead.
/// A head that cannot be reached fails them at once (were it restarting, it could not
/// answer either), and so does one that restarted since they were sent (410).
pub(super) fn ordered_on_dead_broker(
    inner: &Inner,
    q: &Queue,
    batch_ids: &[u64],
) -> Result<Vec<u64>> {
    let admin = Admin::new(inner.control.as_deref().expect("checked by can_fail_over"));
    let broker = q.process.expect("checked by can_fail_over");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match admin.failover(
            &inner.topic,
            broker.id,
            broker.incarnation,
            inner.client_id,
            batch_ids,
            inner.config.ack_level,
        ) {
            Err(Error::Admin { status: 409, .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// Follows membership for a publisher made with `connect`: every `membership_refresh`,
/// and when woken (after a failover), reads the live brokers from the head and connects
/// to each broker process it has never had a queue for: a restarted broker (a new
/// incarnation of an id) or a new one. A process whose connections it lost is not
/// reconnected: its failover fences it. Returns the threads it started, for `shutdown`.
pub(super) fn follow_membership(inner: Arc<Inner>, woken: Receiver<()>) -> Vec<JoinHandle<()>> {
    let admin = Admin::with_timeout(
        inner.control.as_deref().expect("watched through the head"),
        MEMBERSHIP_REQUEST_TIMEOUT,
    );
    let per_broker = inner.config.threads_per_broker;
    let mut threads = Vec::new();
    // Processes an attempt failed for: reported once, not at every refresh.
    let mut reported = HashSet::new();
    // Processes that do not match this publisher (order, limits): they will not start
    // matching, so they are not tried again. One that did not answer is.
    let mut mismatched = HashSet::new();
    loop {
        let _ = woken.recv_timeout(inner.config.membership_refresh);
        if inner.closed.load(Ordering::Relaxed) {
            return threads;
        }
        let brokers = match admin.cluster() {
            Ok(cluster) => cluster.brokers,
            Err(e) => {
                tracing::debug!("cannot read the cluster's brokers: {e}");
                continue;
            }
        };
        for b in brokers {
            let process = BrokerProcess {
                id: b.id,
                incarnation: b.incarnation,
            };
            if inner.closed.load(Ordering::Relaxed) {
                return threads;
            }
            if mismatched.contains(&process)
                || inner.queues.iter().any(|q| q.process == Some(process))
            {
                continue;
            }
            if !inner.queues.has_room_for(per_broker) {
                tracing::warn!(
                    limit = inner.config.max_joined_brokers,
                    "added as many joined brokers as max_joined_brokers allows; \
                     publishing to the brokers this publisher has from now on"
                );
                return threads;
            }
            match add_broker(&inner, process, &b.addr, &mut threads) {
                Ok(()) => tracing::info!(
                    broker = %b.addr,
                    id = b.id,
                    incarnation = b.incarnation,
                    "a broker joined; publishing to it too"
                ),
                Err(e) => {
                    if matches!(e, Error::Config(_)) {
                        mismatched.insert(process);
                    }
                    if reported.insert(process) {
                        tracing::warn!(broker = %b.addr, "cannot use a broker that joined: {e}");
                    }
                }
            }
        }
    }
}

/// Batches are sealed for the order and limits of the brokers found at start: a broker
/// that joins must take them.
fn check_joined_limits(inner: &Inner, connected: &[(Queue, HelloOk)]) -> Result<()> {
    let Some((_, ok)) = connected.iter().find(|(_, ok)| {
        ok.order != inner.order
            || (ok.max_message_bytes as usize) < inner.max_message
            || (ok.max_batch_bytes as usize) < inner.max_batch
    }) else {
        return Ok(());
    };
    Err(Error::Config(format!(
        "order {} and limits of {} / {} bytes (message / batch) do not match this \
         publisher's order {} and {} / {} bytes",
        ok.order,
        ok.max_message_bytes,
        ok.max_batch_bytes,
        inner.order,
        inner.max_message,
        inner.max_batch
    )))
}

/// Connects to a broker that joined after `start` and, once its threads run, dispatches
/// to it like to any other queue.
pub(super) fn add_broker(
    inner: &Arc<Inner>,
    process: BrokerProcess,
    addr: &str,
    threads: &mut Vec<JoinHandle<()>>,
) -> Result<()> {
    // Order 5: join the session at its current epoch. The fence count is read first: a
    // fence after it (even one whose epoch the hello already carries) makes the new
    // senders reopen, which is harmless.
    let (fences_seen, session_epoch) = match &inner.session {
        Some(session) => (
            session.fences.load(Ordering::Acquire),
            session.epoch.load(Ordering::Acquire),
        ),
        None => (0, inner.config.session_epoch),
    };
    // Read before the hello: the broker answers with the session's mark as it reads it
    // then, while the other brokers go on acknowledging. Every ack read here came from
    // the table before the hello, and the table's mark only grows, so the answer is at
    // least this; an ack that arrives during the handshake may be past it.
    let acked_before = session_acked(inner);
    let Opened::Connected(connected) = connect_broker(
        &inner.config,
        inner.client_id,
        &inner.topic,
        SessionHello {
            epoch: session_epoch,
            opens: false,
            opener: inner.session.as_ref().map_or(0, |s| s.opener),
        },
        Some(process),
        addr,
    )?
    else {
        unreachable!("a publisher that joins an epoch is never told to open another");
    };
    check_joined_limits(inner, &connected)?;
    if inner.order == 5 {
        if let Some(Err(error)) = connected
            .iter()
            .map(|(_, ok)| super::session::check_session_marks(inner, addr, acked_before, ok))
            .find(Result::is_err)
        {
            // Its next batches could never be ordered: the session would wait for ever on
            // the ones the broker lost.
            inner.fail(&inner.queues[0].conn, error.clone());
            return Err(error);
        }
    }
    let first_seqs: Vec<u64> = connected.iter().map(|(_, ok)| ok.next_batch_seq).collect();
    let queues = connected.into_iter().map(|(queue, _)| queue).collect();
    let Ok(first) = inner.queues.append(queues) else {
        return Err(Error::Config("no room for more queues".into()));
    };
    for (offset, first_seq) in first_seqs.into_iter().enumerate() {
        let index = first + offset;
        if let Err(e) = start_connection(inner, index, first_seq, fences_seen, threads) {
            // The queue takes batches already: without its threads the publisher fails,
            // as `start` does.
            inner.fail(&inner.queues[index].conn, e.clone());
            return Err(e);
        }
    }
    Ok(())
}

/// Order 5: the session's batches below this were acknowledged (each connection's ack
/// carries the session's committed high-water mark).
fn session_acked(inner: &Inner) -> u64 {
    inner
        .queues
        .iter()
        .map(|q| q.conn.acked.load(Ordering::Acquire))
        .max()
        .unwrap_or(0)
}
