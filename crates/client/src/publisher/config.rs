//! The publisher's settings: every knob of batching, queues, acknowledgements, order-5
//! sessions and failover, with their defaults.

use super::*;

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// 0: fire and forget; 1: ordered/visible; 2: durable.
    pub ack_level: u8,
    /// A batch is sealed once it holds this many bytes of messages.
    pub batch_bytes: usize,
    /// A non-empty batch is sealed this long after its first message, by the sender of
    /// the queue it is due on, which then writes it itself (no hand-off to another
    /// thread). When that sender is busy (writing, or waiting for acknowledgements), a
    /// backstop thread seals it `linger_backstop` later still. Zero sets no timer: the
    /// sender seals the batch as soon as it is free, so the batch holds what was
    /// appended while that sender woke up or finished its previous write (the lowest
    /// latency; below saturation it makes more, smaller batches).
    pub linger: Duration,
    /// See `linger`. Default 5 ms.
    pub linger_backstop: Duration,
    /// Connections (and queues) per broker.
    pub threads_per_broker: usize,
    /// Sealed batches each queue holds before the producer deflects to the next.
    pub queue_depth: usize,
    /// Batches a connection may have unacknowledged before its sender waits.
    pub max_inflight_batches: usize,
    pub client_id: Option<u64>,
    /// Order 5: the session's secret key, presented in every hello of the session so no
    /// one else (a subscriber sees the client id and epoch) can publish as it. `None`:
    /// 16 random bytes drawn when the publisher starts. A program that restarts and
    /// resumes a session under the same `client_id` must pass the key it used before.
    pub session_key: Option<[u8; SESSION_KEY_LEN]>,
    /// Longest `flush` wait.
    pub flush_timeout: Duration,
    /// Order 5: the least session epoch to open, 1 or more; 0 (no session) for other
    /// orders. [`Publisher::connect`] picks 1 for order-5 topics when this is 0. The
    /// publisher opens an epoch above the session's current one (PROTOCOL.md section 8):
    /// resuming a session supersedes its previous publisher, which fails with
    /// SessionFenced instead of publishing beside this one.
    pub session_epoch: u64,
    /// Try the next queue when the round-robin one is full (default). Off: wait for the
    /// round-robin queue, as the original did (for experiments).
    pub deflect: bool,
    /// Fault injection for experiments: make queue `.0` sleep `.1` before each batch it
    /// sends. `EMBARCADERO_SLOW_CONSUMER_QUEUE` and `EMBARCADERO_SLOW_CONSUMER_MS` set it.
    pub slow_queue: Option<(usize, Duration)>,
    /// Orders 2 and 5, publishers made with [`Publisher::connect`]: when a broker's
    /// connection fails, stop using that broker and move its unacknowledged batches to
    /// the live ones, resending exactly those that did not make it into the order
    /// (the head says which). Off: a lost connection fails the publisher.
    pub failover: bool,
    /// Publishers made with [`Publisher::connect`]: how often to re-read the live brokers
    /// from the head (also right after a failover) and connect to every broker process
    /// that joined since (a restarted broker, a new one). Zero: only the brokers
    /// `connect` found.
    pub membership_refresh: Duration,
    /// At most this many brokers are added after `connect` (each restart counts once):
    /// the queues live in slots reserved at start. Past it the publisher stops watching
    /// membership and keeps publishing to the brokers it has.
    pub max_joined_brokers: usize,
    /// How connections reach their brokers: `Auto` (the default) opens a local
    /// shared-memory channel to a broker on this host when it may, else TCP; `Tcp`
    /// always TCP; `Shm` shared memory or an error. `EMBARCADERO_TRANSPORT` sets it
    /// for the CLI.
    pub transport: Transport,
    /// Bytes of a shared-memory channel's data ring (a power of two, 64 KiB to 1 GiB;
    /// the broker may accept less, `broker.shm_max_ring_bytes`). A batch larger than
    /// the ring still goes through, staged by the broker.
    pub shm_ring_bytes: usize,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            ack_level: 1,
            batch_bytes: 512 * 1024,
            linger: Duration::from_millis(1),
            linger_backstop: Duration::from_millis(5),
            threads_per_broker: 1,
            queue_depth: 4,
            max_inflight_batches: 16,
            client_id: None,
            session_key: None,
            flush_timeout: Duration::from_secs(60),
            session_epoch: 0,
            deflect: true,
            slow_queue: None,
            failover: true,
            membership_refresh: Duration::from_secs(1),
            max_joined_brokers: 64,
            transport: Transport::Auto,
            shm_ring_bytes: 8 << 20,
        }
    }
}

/// Longest linger (and backstop) a publisher honours.
pub(super) const LONGEST_LINGER: Duration = Duration::from_secs(3600);

/// `EMBARCADERO_SLOW_CONSUMER_QUEUE=N` and `EMBARCADERO_SLOW_CONSUMER_MS=M` (default 1).
pub(super) fn slow_queue_from_env() -> Option<(usize, Duration)> {
    let queue = std::env::var("EMBARCADERO_SLOW_CONSUMER_QUEUE")
        .ok()?
        .parse::<i64>()
        .ok()?;
    let ms = std::env::var("EMBARCADERO_SLOW_CONSUMER_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    (queue >= 0).then(|| (queue as usize, Duration::from_millis(ms)))
}
