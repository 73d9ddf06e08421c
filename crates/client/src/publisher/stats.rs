//! What a publisher reports: per-queue counters and latency summaries.

use super::*;

/// Per-queue counters, reported at the end of a run.
#[derive(Debug, Clone, Serialize)]
pub struct QueueStats {
    pub broker: String,
    pub connection: usize,
    /// `"shm"` or `"tcp"`: how this connection reaches its broker now.
    pub transport: &'static str,
    pub batches: u64,
    /// Batches acknowledged on this connection (those a failover found in the order count
    /// on the dead broker's queue).
    pub acked_batches: u64,
    /// Batches round-robin chose for this queue that went elsewhere because it was full.
    pub deflected: u64,
    /// Times the producer blocked because every queue was full when this one was due.
    pub producer_waits: u64,
    pub backpressure_retries: u64,
    /// Batches this queue's sender sealed itself when their linger ran out.
    pub lingered: u64,
    /// Batches built in place in this connection's shared-memory ring (the others were
    /// built in a buffer and copied into the socket or ring).
    pub in_place: u64,
    /// Of those, batches copied out of the ring of the connection's current channel
    /// before their acknowledgement, because a write needed their room (a channel's room
    /// never waits for acknowledgements; see `embarcadero_shm::lend`).
    pub copied_out: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PublisherStats {
    pub client_id: u64,
    /// The acknowledgement level the publisher waits for.
    pub ack_level: u8,
    /// Order 5: the session epoch the publisher publishes in now (it opened it; a fence
    /// moves it on); 0 for other orders.
    pub session_epoch: u64,
    pub messages: u64,
    pub bytes: u64,
    pub batches: u64,
    pub acked_batches: u64,
    /// Seal-to-acknowledgement latency of batches, microseconds.
    pub ack_latency_us: LatencySummary,
    /// From publish to acknowledgement, microseconds: includes the linger wait,
    /// queueing, the network and the ordering. One figure per message, from its due time,
    /// for batches whose messages all came through [`Publisher::publish_due`]; otherwise
    /// one per batch, from its first message's publish (an upper bound for the rest,
    /// which saves a clock read per message).
    pub append_to_ack_us: LatencySummary,
    pub queues: Vec<QueueStats>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

impl LatencySummary {
    pub fn of(h: &Histogram<u64>) -> Self {
        Self {
            count: h.len(),
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        }
    }
}

impl Publisher {
    pub fn stats(&self) -> PublisherStats {
        let inner = &self.inner;
        let (all, appended) = self.latency_histograms();
        let messages = inner.appended[0].load(Ordering::Relaxed);
        let bytes = inner.appended[1].load(Ordering::Relaxed);
        PublisherStats {
            client_id: inner.client_id,
            ack_level: inner.config.ack_level,
            session_epoch: inner
                .session
                .as_ref()
                .map_or(0, |s| s.epoch.load(Ordering::Acquire)),
            messages,
            bytes,
            batches: inner.batches.load(Ordering::Relaxed),
            acked_batches: inner
                .queues
                .iter()
                .map(|q| q.conn.acked_batches.load(Ordering::Relaxed))
                .sum(),
            ack_latency_us: LatencySummary::of(&all),
            append_to_ack_us: LatencySummary::of(&appended),
            queues: inner
                .queues
                .iter()
                .map(|q| QueueStats {
                    broker: q.broker.clone(),
                    connection: q.connection,
                    transport: if q.stream.lock().is_shm() {
                        "shm"
                    } else {
                        "tcp"
                    },
                    batches: q.dispatched.load(Ordering::Relaxed),
                    acked_batches: q.conn.acked_batches.load(Ordering::Relaxed),
                    deflected: q.deflected.load(Ordering::Relaxed),
                    producer_waits: q.producer_waits.load(Ordering::Relaxed),
                    backpressure_retries: q.conn.backpressure_retries.load(Ordering::Relaxed),
                    lingered: q.lingered.load(Ordering::Relaxed),
                    in_place: q.in_place.load(Ordering::Relaxed),
                    copied_out: match &*q.stream.lock() {
                        Link::Shm(link) => link.copied_out(),
                        Link::Tcp(_) => 0,
                    },
                })
                .collect(),
        }
    }

    /// The raw latency histograms behind [`PublisherStats`] (seal to ack, and append
    /// to ack, in microseconds), so several publishers' figures can be merged exactly.
    pub fn latency_histograms(&self) -> (Histogram<u64>, Histogram<u64>) {
        let mut sealed = Histogram::<u64>::new(3).expect("valid histogram");
        let mut appended = Histogram::<u64>::new(3).expect("valid histogram");
        for q in self.inner.queues.iter() {
            let _ = sealed.add(&*q.conn.latency.lock());
            let _ = appended.add(&*q.conn.append_latency.lock());
        }
        (sealed, appended)
    }
}
