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

/// Opens the `threads_per_broker` connections of one broker with the publisher's hello,
/// the same at start and when a broker joins later: their queues (not started yet), each
/// with the broker's HelloOk. `session_epoch`: order 5, the epoch the session is at.
pub(super) fn connect_broker(
    config: &PublisherConfig,
    client_id: u64,
    topic: &str,
    session_epoch: u64,
    process: Option<BrokerProcess>,
    addr: &str,
) -> Result<Vec<(Queue, HelloOk)>> {
    (0..config.threads_per_broker)
        .map(|connection| {
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
                subscribe_flags: 0,
            };
            let (stream, ok) = open_link(config, addr, &hello)?;
            let epoch = if ok.order == 5 { session_epoch } else { 0 };
            let queue = Queue::new(stream, addr, process, connection, config.queue_depth, epoch);
            Ok((queue, ok))
        })
        .collect()
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

/// Opens one connection over the configured transport; a refusal is an error.
pub(super) fn open_link(
    config: &PublisherConfig,
    addr: &str,
    hello: &Hello,
) -> Result<(Link, HelloOk)> {
    match conn::handshake_link(addr, hello, config.transport, config.shm_ring_bytes)? {
        conn::Handshake::Accepted(link, ok) => Ok((link, ok)),
        conn::Handshake::Refused(e) => Err(conn::broker_error(addr, e)),
    }
}
