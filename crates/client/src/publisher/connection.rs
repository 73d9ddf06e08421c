//! One connection to a broker: the state its sender and ack reader share, opening it
//! with the publisher's hello, and starting its two threads.

use super::*;

/// State of one connection shared by its sender and reader threads (never by others).
pub(super) struct ConnShared {
    pub(super) unacked: Mutex<VecDeque<InFlight>>,
    pub(super) sent: AtomicU64,
    /// Highest cumulative count the broker acknowledged (a connection count for orders
    /// 0-2, the session's high-water mark for order 5).
    pub(super) acked: AtomicU64,
    /// Distinct batches of this connection acknowledged so far.
    pub(super) acked_batches: AtomicU64,
    /// Batch sequence to resend from after BACKPRESSURE, `u64::MAX` for none.
    pub(super) resend_from: AtomicU64,
    pub(super) backpressure_retries: AtomicU64,
    pub(super) failed: Mutex<Option<Error>>,
    pub(super) latency: Mutex<Histogram<u64>>,
    /// Append (first message of the batch published) to acknowledgement, microseconds.
    pub(super) append_latency: Mutex<Histogram<u64>>,
}

impl ConnShared {
    /// Records the latencies of batches acknowledged at `now`: seal to ack per batch,
    /// append to ack per message (from each message's due time where it has one).
    pub(super) fn record_latency(&self, batches: &[InFlight], now: Instant) {
        if batches.is_empty() {
            return;
        }
        let mut sealed = self.latency.lock();
        let mut appended = self.append_latency.lock();
        let micros = |since: Instant| (now.duration_since(since).as_micros() as u64).max(1);
        for f in batches {
            let _ = sealed.record(micros(f.batch.sealed_at));
            if f.batch.dues.is_empty() {
                let _ = appended.record(micros(f.batch.first_at));
            }
            for &due in &f.batch.dues {
                let _ = appended.record(micros(due));
            }
        }
    }
}

/// What opening one broker's connections gave.
pub(super) enum Opened {
    /// Its queues (not started yet), each with the broker's HelloOk.
    Connected(Vec<(Queue, HelloOk)>),
    /// Order 5, a publisher opening a new epoch: the broker found the session at this
    /// epoch, not below the one asked for; the publisher must open a newer one.
    SessionAt(u64),
}

/// Order 5: what a publisher's hello says of its session. Zero for other orders.
#[derive(Debug, Clone, Copy)]
pub(super) struct SessionHello {
    /// The epoch the session is at for this publisher.
    pub epoch: u64,
    /// This publisher opens `epoch` (at start, or reopening after a fence), so a broker
    /// that finds the session at or past it refuses (see [`Opened::SessionAt`]).
    pub opens: bool,
    /// The publisher's opener (`Hello::opener`).
    pub opener: u32,
}

/// Opens the `threads_per_broker` connections of one broker with the publisher's hello,
/// the same at start and when a broker joins later.
pub(super) fn connect_broker(
    config: &PublisherConfig,
    client_id: u64,
    topic: &str,
    session: SessionHello,
    process: Option<BrokerProcess>,
    addr: &str,
) -> Result<Opened> {
    let SessionHello {
        epoch: session_epoch,
        opens,
        opener,
    } = session;
    assert!(
        !opens || session_epoch > 0,
        "only an order-5 session opens an epoch"
    );
    let mut queues = Vec::with_capacity(config.threads_per_broker);
    for connection in 0..config.threads_per_broker {
        let hello = Hello {
            role: Role::Publish,
            ack_level: config.ack_level,
            client_id,
            session_epoch,
            start_position: 0,
            connection_index: connection as u32,
            cursor_count: 0,
            topic: topic.to_string(),
            session_key: config.session_key.expect("drawn when the publisher starts"),
            flags: if opens { PUBLISH_OPENS_EPOCH } else { 0 },
            opener,
        };
        let (stream, ok) =
            match conn::handshake_link(addr, &hello, config.transport, config.shm_ring_bytes)? {
                conn::Handshake::Accepted(link, ok) => (link, ok),
                conn::Handshake::Refused(e)
                    if opens
                        && matches!(
                            e.code,
                            ErrorCode::SessionFenced | ErrorCode::SessionTakenOver
                        ) =>
                {
                    return Ok(Opened::SessionAt(e.session_epoch.max(session_epoch)));
                }
                conn::Handshake::Refused(e) => return Err(conn::broker_error(addr, e)),
            };
        let epoch = if ok.order == 5 { session_epoch } else { 0 };
        let queue = Queue::new(stream, addr, process, connection, config.queue_depth, epoch);
        queues.push((queue, ok));
    }
    Ok(Opened::Connected(queues))
}

/// Starts the sender and the ack reader of queue `index`. `first_seq`: its HelloOk's
/// `next_batch_seq`, where orders 0-2 number the connection's batches from;
/// `fences_seen`: order 5, the session's fence count when the connection was opened (a
/// later fence makes the sender reopen it, as every other).
pub(super) fn start_connection(
    inner: &Arc<Inner>,
    index: usize,
    first_seq: u64,
    fences_seen: u64,
    threads: &mut Vec<JoinHandle<()>>,
) -> Result<()> {
    let a = inner.clone();
    threads.push(spawn(format!("pub-send-{index}"), move || {
        sender(a, index, first_seq, fences_seen)
    })?);
    let b = inner.clone();
    threads.push(spawn(format!("pub-acks-{index}"), move || {
        reader(b, index)
    })?);
    Ok(())
}
