//! Order 5: the publisher's session, fences and the reopen of a connection with the
//! next epoch.

use super::*;

/// Order 5: the publisher's session.
pub(super) struct Session {
    pub(super) next_seq: AtomicU64,
    /// The epoch (re)opened connections use; raised after a fence.
    pub(super) epoch: AtomicU64,
    /// Bumped on every fence; each sender reopens its connection when it changes.
    pub(super) fences: AtomicU64,
    /// The highest acknowledged mark a fence reported (at the publisher's ack level)
    /// while the session was at an epoch this publisher opened: a reopen counts the
    /// batches below it as acknowledged.
    pub(super) fenced_hwm: AtomicU64,
    /// The newest epoch this publisher has opened (a broker answered its opening
    /// hello); `epoch` may be one above while a reopen is under way.
    pub(super) opened: AtomicU64,
    /// The publisher's opener (`Hello::opener`), on every hello it sends.
    pub(super) opener: u32,
    /// The publisher drew its client id: no other process ever used the session, so
    /// no copy of a batch of it can sit anywhere this publisher does not know of.
    pub(super) own_id: bool,
}

impl Inner {
    /// Order 5: the session's epoch `fenced_epoch` was fenced with everything below `hwm`
    /// committed, and the broker read the session at epoch `current`. The first report
    /// opens the next epoch; every sender then reopens its connection and resends what
    /// is not committed. An epoch beyond any this publisher opened was opened by another
    /// publisher of the session (one that shares its client id and key, such as a
    /// restart of this program): that one owns the session now, and this one must stop,
    /// for two publishers numbering batches in one epoch would have acknowledged batches
    /// dropped as duplicates. Returns that error.
    pub(super) fn fence(
        &self,
        broker: &str,
        fenced_epoch: u64,
        hwm: u64,
        current: u64,
    ) -> Result<(), Error> {
        let Some(session) = &self.session else {
            return Ok(());
        };
        if current > session.epoch.load(Ordering::Acquire) {
            return Err(self.taken_over(broker, current));
        }
        // A mark read at an epoch this publisher has not opened (yet) may count another
        // publisher's batches: only a reopen that succeeds can tell, so it is not kept.
        if current <= session.opened.load(Ordering::Acquire) {
            session.fenced_hwm.fetch_max(hwm, Ordering::AcqRel);
        }
        if session
            .epoch
            .compare_exchange(
                fenced_epoch,
                fenced_epoch + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            tracing::info!(
                client = self.client_id,
                epoch = fenced_epoch + 1,
                hwm,
                "order-5 session fenced; reopening with the next epoch"
            );
            session.fences.fetch_add(1, Ordering::AcqRel);
        }
        self.notify_progress();
        Ok(())
    }

    /// The error of a publisher whose session another publisher opened epoch `current`
    /// of, as broker `broker` reported it.
    fn taken_over(&self, broker: &str, current: u64) -> Error {
        Error::Broker {
            broker: broker.to_string(),
            code: ErrorCode::SessionTakenOver,
            message: format!(
                "another publisher took this order-5 session over: client id {} is at session epoch {current}, which this publisher never opened (two live publishers share the client id and session key, or a restart of this program opened it while this one still ran); this publisher stops, and its batches not yet acknowledged may or may not be in the log",
                self.client_id
            ),
        }
    }

    /// Order 5, once everything this publisher sent is acknowledged and it is closing:
    /// tells one broker it is done with its session (a header of no messages with
    /// `END_SESSION`, numbered as the next batch would have been), so that the session's
    /// table slot can go to a new session at once instead of after the server's
    /// `sequencer.session_idle_evict_secs`. Best effort, nothing is answered: a session
    /// whose end is lost ends once idle, as before. Taking the queue's hand keeps its
    /// sender from writing meanwhile (it has nothing to write after a flush).
    ///
    /// Sent only when every batch went out on one connection and was acknowledged
    /// there: after a failover or a reopen, a copy of a batch may still sit on the
    /// connection given up (behind a slot its broker has not finished, or in its socket),
    /// and ordered after the slot went to another session it would be taken for a new
    /// session's batch and delivered twice. For the same reason not by a publisher given
    /// its client id: an earlier process with that id (a restart resuming the session)
    /// may have left such copies. At ack 0 the flush saw nothing ordered.
    pub(super) fn end_session(&self) {
        let Some(session) = &self.session else {
            return;
        };
        let resent =
            session.fences.load(Ordering::Acquire) != 0 || self.queues.iter().any(|q| !q.is_live());
        if self.config.ack_level == 0 || resent || !session.own_id {
            return;
        }
        let Some(q) = self.queues.iter().find(|q| q.is_live()) else {
            return;
        };
        let header = BatchHeader {
            batch_seq: session.next_seq.load(Ordering::Acquire),
            client_id: self.client_id,
            flags: embarcadero_wire::BatchFlags::END_SESSION,
            epoch_created: now_ns(),
            session_epoch: q.epoch.load(Ordering::Acquire),
            ..Default::default()
        }
        .encode();
        let _hand = q.hand.lock();
        let written = q.stream.lock().write_batch(&header, &[]);
        if !matches!(written, Ok(Written::Done)) {
            tracing::debug!(
                broker = %q.broker,
                ?written,
                "the order-5 session's end was not sent; the server ends it once idle"
            );
        }
    }
}

/// Order 5, after a fence: opens the connection again with the session's new epoch,
/// counts what the fences reported acknowledged as such, and resends the rest of
/// this connection's unacknowledged batches in order (the sequencer drops any that turn
/// out to be committed already, so each is delivered exactly once).
pub(super) fn reopen(inner: &Inner, index: usize) -> Result<Link, Error> {
    let q = &inner.queues[index];
    let conn = &q.conn;
    let (mut stream, epoch, hwm) = open_next_epoch(inner, q)?;
    // No batch is built in the new channel's ring before the resends below are written
    // (the sender lets it lend once this returns).
    if let Link::Shm(link) = &stream {
        assert!(link.hold_lending(), "a new channel has nothing lent");
    }
    let lost = |e: std::io::Error| Error::ConnectionLost {
        broker: q.broker.clone(),
        message: e.to_string(),
    };
    {
        let mut current = q.stream.lock();
        let _ = current.shutdown(std::net::Shutdown::Both);
        *current = stream.try_clone().map_err(lost)?;
    }
    q.epoch.store(epoch, Ordering::Release);
    q.stream_gen.fetch_add(1, Ordering::AcqRel);
    conn.resend_from.store(u64::MAX, Ordering::Release);
    inner.notify_progress();
    let pending: Vec<InFlight> = conn.unacked.lock().drain(..).collect();
    let mut resent = Vec::new();
    for mut f in pending {
        if f.seq < hwm {
            inner.settle(conn, f);
        } else {
            // The new channel lends nothing yet (held above), so the old channel's
            // batches are copied in unhindered.
            let header = batch_header(inner, f.seq, &f.batch, epoch);
            let written = write_sealed(&mut stream, &header, &mut f.batch).map_err(lost)?;
            assert_eq!(
                written,
                Written::Done,
                "a reopened channel lends nothing yet"
            );
            resent.push(f);
        }
    }
    conn.acked.fetch_max(hwm, Ordering::AcqRel);
    inner.requeue(conn, resent);
    inner.notify_progress();
    Ok(stream)
}

/// Opens queue `q`'s connection with the session's current epoch (as its opener: the
/// broker has the sequencer switch the session before answering, so no batch of another
/// publisher can take this epoch's numbers), taking a newer one when the broker reports
/// this one fenced meanwhile (a few times at most). Returns the socket, its epoch and
/// the acknowledged mark to resend from. A session another publisher opened this epoch
/// of, or a newer one, was taken over: that is the error returned.
fn open_next_epoch(inner: &Inner, q: &Queue) -> Result<(Link, u64, u64), Error> {
    let session = inner.session.as_ref().expect("order-5 publisher");
    for _ in 0..=MAX_REFENCES {
        let epoch = session.epoch.load(Ordering::Acquire);
        let hello = Hello {
            role: Role::Publish,
            ack_level: inner.config.ack_level,
            client_id: inner.client_id,
            session_epoch: epoch,
            start_position: 0,
            connection_index: q.connection as u32,
            cursor_count: 0,
            topic: inner.topic.clone(),
            session_key: inner
                .config
                .session_key
                .expect("drawn when the publisher starts"),
            flags: PUBLISH_OPENS_EPOCH,
            opener: session.opener,
        };
        let (transport, ring) = (inner.config.transport, inner.config.shm_ring_bytes);
        // Read before the hello, which the broker answers with the mark it reads then.
        let acked_before = q.conn.acked.load(Ordering::Acquire);
        match conn::handshake_link(&q.broker, &hello, transport, ring)? {
            conn::Handshake::Accepted(stream, ok) => {
                check_session_marks(inner, &q.broker, acked_before, &ok)?;
                session.opened.fetch_max(epoch, Ordering::AcqRel);
                // The HelloOk of an opening hello says what is committed, which at ack 2
                // may be more than is acknowledged: the fences say that.
                return Ok((stream, epoch, session.fenced_hwm.load(Ordering::Acquire)));
            }
            conn::Handshake::Refused(e) if e.code == ErrorCode::SessionTakenOver => {
                return Err(inner.taken_over(&q.broker, e.session_epoch));
            }
            // Fenced again meanwhile: take the newer epoch and try again.
            conn::Handshake::Refused(e) if e.code == ErrorCode::SessionFenced => {
                let hwm = e.fenced_hwm().expect("a SessionFenced frame");
                inner.fence(&q.broker, epoch, hwm, e.session_epoch)?;
            }
            conn::Handshake::Refused(e) => return Err(conn::broker_error(&q.broker, e)),
        }
    }
    Err(Error::Broker {
        broker: q.broker.clone(),
        code: ErrorCode::SessionFenced,
        message: format!(
            "the order-5 session was fenced again at each of {} reopens in a row; another process may be publishing with this client id",
            MAX_REFENCES + 1
        ),
    })
}

/// Reopens that meet a newer fence each time before giving up.
const MAX_REFENCES: usize = 5;

/// Order 5: whether broker `broker`'s record of the session (`ok`) can be this
/// publisher's: it must not expect a batch below `acked` (what this connection, or for
/// a broker that joins, the session, was told is acknowledged before the hello was
/// sent: the answer is the table's mark when the broker read it, which later acks
/// may pass) nor beyond what was sent. Otherwise the session ended while idle (its
/// slot given away), or acknowledged batches were lost with the server's region
/// (ack 1): its next batches could never be ordered.
pub(super) fn check_session_marks(
    inner: &Inner,
    broker: &str,
    acked: u64,
    ok: &HelloOk,
) -> Result<(), Error> {
    let session = inner.session.as_ref().expect("order-5 publisher");
    let sent = session.next_seq.load(Ordering::Acquire);
    if ok.next_batch_seq >= acked && ok.next_batch_seq <= sent {
        return Ok(());
    }
    Err(Error::Broker {
        broker: broker.to_string(),
        code: ErrorCode::SessionExpired,
        message: format!(
            "the broker's record of this order-5 session is not this publisher's (it acknowledged up to batch {acked} and sent up to {sent}; the broker now expects batch {}): the session ended while idle and its slot went to another session, or acknowledged batches were lost (at ack 1, a server that lost its region file loses what had not reached the disk replicas); batches not yet acknowledged may or may not be in the log: start a new publisher and resend them (publish at ack 2 to keep acknowledged batches through such a loss)",
            ok.next_batch_seq
        ),
    })
}
