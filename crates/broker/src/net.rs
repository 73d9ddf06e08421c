//! Connection set-up: socket options, the handshake, and the error path every
//! connection shares (error frame, then close).

use crate::session::{self, SessionView};
use crate::{publish, subscribe, Shared};
use embarcadero_region::backoff::Backoff;
use embarcadero_region::TopicMeta;
use embarcadero_wire::{
    ErrorCode, ErrorFrame, Hello, HelloOk, Role, WireError, HELLO_LEN, SESSION_KEY_LEN,
};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Socket buffer size for data connections: large enough for several batches in flight.
pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;
/// How long a new connection has to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

pub fn tune_socket(stream: &TcpStream) {
    let sock = socket2::SockRef::from(stream);
    let _ = sock.set_nodelay(true);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    // Half-open connections (a client host that vanished) are found and closed.
    let _ = sock.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(5)),
    );
}

/// A refusal: sent as an error frame before the connection is closed.
#[derive(Debug)]
pub struct Refusal {
    pub code: ErrorCode,
    pub batch_seq: u64,
    /// SessionFenced: the session's current epoch (see [`ErrorFrame::session_epoch`]).
    pub session_epoch: u64,
    pub message: String,
}

impl Refusal {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            batch_seq: u64::MAX,
            session_epoch: 0,
            message: message.into(),
        }
    }

    pub fn from_wire(e: &WireError, batch_seq: u64) -> Self {
        Self {
            code: ErrorCode::for_wire_error(e),
            batch_seq,
            session_epoch: 0,
            message: e.to_string(),
        }
    }

    pub fn frame(&self) -> Vec<u8> {
        ErrorFrame {
            code: self.code,
            batch_seq: self.batch_seq,
            session_epoch: self.session_epoch,
            message: self.message.clone(),
        }
        .encode()
    }
}

/// Why a connection ended.
pub enum End {
    /// The peer closed or the socket failed: nothing to tell it.
    Gone,
    /// Tell the peer why, then close.
    Refused(Refusal),
}

impl From<io::Error> for End {
    /// A failed socket is the client gone; `InvalidData` is what a shared-memory channel
    /// reports when its client wrote garbage into its ring (a position out of range):
    /// the client is told why, then disconnected.
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::InvalidData {
            return End::Refused(Refusal::new(ErrorCode::MalformedBatch, e.to_string()));
        }
        End::Gone
    }
}

impl From<Refusal> for End {
    fn from(r: Refusal) -> Self {
        End::Refused(r)
    }
}

pub fn handle_connection(shared: &Shared, mut stream: TcpStream) {
    tune_socket(&stream);
    let result = handshake(shared, &mut stream);
    let end = match result {
        Ok((hello, topic, meta, cursors)) => match crate::TopicConn::hold(shared, topic) {
            // Deleted since the hello found it: to this client it never existed.
            None => unknown_topic(&hello.topic).into(),
            Some(_held) => match hello.role {
                Role::Publish => {
                    let sink = stream.try_clone().map(crate::transport::Sink::Tcp);
                    publish::run(shared, sink, &mut stream, hello, topic, meta)
                }
                Role::Subscribe => subscribe::run(shared, &mut stream, hello, topic, meta, cursors),
            },
        },
        Err(end) => end,
    };
    if let End::Refused(refusal) = end {
        shared.metrics.errors_sent.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            broker = shared.config.broker_id,
            code = ?refusal.code,
            "closing connection: {}",
            refusal.message
        );
        let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
        let _ = stream.write_all(&refusal.frame());
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Which connection limit a refused connection met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// `broker.max_connections`, over all clients.
    Broker,
    /// `broker.max_connections_per_address`, from the connection's client address.
    PerAddress,
}

/// Turns away a connection that arrived while the broker (or its client's address) had
/// its limit of connections open, on the accepting thread and without waiting: whatever
/// hello has arrived is read (so the close does not reset the connection before the
/// error frame is read), the error frame is written into the empty send buffer, and
/// the connection is closed.
pub fn refuse_over_limit(shared: &Shared, mut stream: TcpStream, limit: Limit) {
    let m = &shared.metrics;
    let c = &shared.config;
    let (counter, setting, value) = match limit {
        Limit::Broker => (
            &m.connections_refused,
            "broker.max_connections",
            c.max_connections,
        ),
        Limit::PerAddress => (
            &m.connections_refused_per_address,
            "broker.max_connections_per_address",
            c.max_connections_per_address,
        ),
    };
    if counter.fetch_add(1, Ordering::Relaxed) == 0 {
        tracing::warn!(
            broker = c.broker_id,
            limit = value,
            "connections refused: the broker is at {setting} \
             (embarcadero_connections_refused_total counts them)"
        );
    }
    m.errors_sent.fetch_add(1, Ordering::Relaxed);
    let whose = match limit {
        Limit::Broker => "",
        Limit::PerAddress => " from this client address",
    };
    let refusal = Refusal::new(
        ErrorCode::TooManyConnections,
        format!(
            "broker {} already has {value} connections{whose}, its {setting}; retry later, \
             close idle clients, or raise the limit",
            c.broker_id
        ),
    );
    if stream.set_nonblocking(true).is_ok() {
        let mut hello = [0u8; HELLO_LEN];
        let _ = stream.read(&mut hello);
        let _ = stream.write_all(&refusal.frame());
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

type Accepted = (Hello, u32, TopicMeta, Vec<u64>);

/// The refusal of a hello for a topic that does not exist (or no longer does).
pub(crate) fn unknown_topic(name: &str) -> Refusal {
    Refusal::new(
        ErrorCode::UnknownTopic,
        format!("topic {name:?} does not exist; create it with `embarcadero topic create {name} --order 2` (an SDK's Admin create_topic / createTopic)"),
    )
}

/// The error frame a connection of a topic deleted while it was open ends with.
pub fn topic_deleted(name: &str) -> ErrorFrame {
    ErrorFrame {
        code: ErrorCode::TopicDeleted,
        batch_seq: u64::MAX,
        session_epoch: 0,
        message: format!(
            "topic {name:?} was deleted; the connection is closed (a topic created later with this name is another topic, whose positions start again at 0)"
        ),
    }
}

fn handshake(shared: &Shared, stream: &mut TcpStream) -> Result<Accepted, End> {
    let mut within = ByDeadline {
        stream,
        deadline: Instant::now() + HELLO_TIMEOUT,
    };
    let mut raw = [0u8; HELLO_LEN];
    within.read_exact(&mut raw[..HTTP_PREFIX])?;
    if looks_like_http(&raw[..HTTP_PREFIX]) {
        answer_http(shared, within.stream);
        return Err(End::Gone);
    }
    within.read_exact(&mut raw[HTTP_PREFIX..])?;
    let (hello, topic, meta) = accept_hello(shared, &raw)?;
    let cursors = match hello.role {
        Role::Publish => Vec::new(),
        Role::Subscribe => read_cursors(shared, &mut within, &hello, &meta)?,
    };
    within.stream.set_read_timeout(None)?;
    Ok((hello, topic, meta, cursors))
}

/// Bytes read before deciding whether a connection speaks HTTP instead of the protocol.
const HTTP_PREFIX: usize = 4;

/// The first bytes of an HTTP request (a method and its space), which no hello starts
/// with (a hello starts with the protocol's magic, `EMBD`).
fn looks_like_http(first: &[u8]) -> bool {
    const METHODS: [&[u8; 4]; 7] = [
        b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC",
    ];
    const _: () = assert!(embarcadero_wire::PROTOCOL_MAGIC.len() == HTTP_PREFIX);
    METHODS.iter().any(|m| first == &m[..])
}

/// Someone pointed an HTTP client (`curl`, `--control`, an SDK's control address) at a
/// broker's data port: it is told at once, in the admin API's error shape, instead of
/// waiting out the hello timeout. Best effort; the connection closes after.
fn answer_http(shared: &Shared, stream: &mut TcpStream) {
    // No character of the text needs escaping in JSON.
    let body = format!(
        "{{\"error\":\"this is broker {}'s data port, not the admin API: use the control port (the `control API` address of the server's serving line, default 127.0.0.1:12140)\"}}",
        shared.config.broker_id
    );
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.set_write_timeout(Some(HELLO_TIMEOUT));
    let _ = stream.write_all(answer.as_bytes());
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// A socket read that must be over by `deadline`: the whole hello (and a subscriber's
/// cursors) within `HELLO_TIMEOUT` of the accept, not each read of it, so a client
/// that sends a byte every few seconds cannot hold a connection before its hello.
struct ByDeadline<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
}

impl Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

/// Decodes a hello and finds its topic; a publisher's hello is checked against the
/// topic too. Shared by both transports.
pub(crate) fn accept_hello(
    shared: &Shared,
    raw: &[u8; HELLO_LEN],
) -> Result<(Hello, u32, TopicMeta), End> {
    let hello = Hello::decode(raw).map_err(|e| Refusal::from_wire(&e, u64::MAX))?;
    let (topic, meta) = shared
        .region
        .find_topic(&hello.topic)
        .ok_or_else(|| unknown_topic(&hello.topic))?;
    if hello.role == Role::Publish {
        check_publish_hello(shared, &hello, topic, &meta)?;
    }
    Ok((hello, topic, meta))
}

/// Refuses a publisher's hello the topic cannot take: a session on a topic of another
/// order (or none on order 5), no epoch left to reopen with, an order-5 hello without
/// a key, a full session table, ack 2 on a memory-only topic.
fn check_publish_hello(
    shared: &Shared,
    hello: &Hello,
    topic: u32,
    meta: &TopicMeta,
) -> Result<(), End> {
    if (meta.order == 5) != (hello.session_epoch > 0) {
        return Err(Refusal::new(
            ErrorCode::BadSession,
            if meta.order == 5 {
                format!(
                    "topic {:?} has order 5: publishers must open a session (session epoch 1 or more)",
                    meta.name
                )
            } else {
                format!(
                    "topic {:?} has order {}: sessions (session epoch {}) need an order-5 topic",
                    meta.name, meta.order, hello.session_epoch
                )
            },
        )
        .into());
    }
    // A fence tells the client to reopen with the next epoch, which must exist.
    if hello.session_epoch == u64::MAX {
        return Err(Refusal::new(
            ErrorCode::BadSession,
            format!(
                "session epoch {} leaves no epoch to reopen with; start from 1",
                u64::MAX
            ),
        )
        .into());
    }
    // Order 5: the key makes the session its opener's (PROTOCOL.md section 8).
    if meta.order == 5 && hello.session_key == [0; SESSION_KEY_LEN] {
        return Err(Refusal::new(
            ErrorCode::BadSession,
            "an order-5 hello must carry a session key (16 random bytes chosen when \
             the session is opened, kept for its life); this client is too old or \
             does not set one",
        )
        .into());
    }
    if meta.order == 5 && crowded_out(shared, topic, hello) {
        return Err(Refusal::new(
            ErrorCode::SessionsExhausted,
            session::exhausted_message(&meta.name, shared.config.session_idle_evict),
        )
        .into());
    }
    if hello.ack_level == 2 && meta.replication_factor < 2 {
        return Err(Refusal::new(
            ErrorCode::AckNotAllowed,
            format!(
                "ack level 2 needs a replicated topic, but {:?} has replication factor {}; publish with ack 1 (`pub --ack 1`, the SDKs' ack_level=1 / ackLevel: 1) or to a topic created with rf 2 or more (`topic create --rf 2`, create_topic(rf=2))",
                meta.name, meta.replication_factor
            ),
        )
        .into());
    }
    Ok(())
}

/// How long an order-5 hello that finds every session slot taken waits for one to be
/// given up before it is refused: a publisher that closed just before this one started
/// has its session's end on its way through the sequencer (one epoch and a scan).
const CROWDED_WAIT: Duration = Duration::from_millis(50);

/// Order 5: true when the hello's client has no session and, by the table's stamps and
/// states, none can be made for it, within [`CROWDED_WAIT`]. The hello's early refusal;
/// the sequencer may still refuse a session for more reasons (see `service`).
fn crowded_out(shared: &Shared, topic: u32, hello: &Hello) -> bool {
    let view = SessionView::new(topic, hello.client_id, hello.session_epoch, 0);
    let idle_evict = shared.config.session_idle_evict;
    let deadline = Instant::now() + CROWDED_WAIT;
    let mut backoff = Backoff::new(Duration::from_millis(2));
    while view.crowded_out(&shared.region, idle_evict) {
        if Instant::now() >= deadline || shared.shutdown.load(Ordering::Relaxed) {
            return true;
        }
        backoff.idle(None);
    }
    false
}

/// Reads a subscriber's per-broker cursors (orders 0 and 1: one per broker, or none).
pub(crate) fn read_cursors(
    shared: &Shared,
    stream: &mut impl Read,
    hello: &Hello,
    meta: &TopicMeta,
) -> Result<Vec<u64>, End> {
    let mut cursors = Vec::new();
    if hello.cursor_count != 0 {
        if meta.order >= 2 || hello.cursor_count != shared.region.capacities().brokers {
            let brokers = shared.region.capacities().brokers;
            let (sent, name, order) = (hello.cursor_count, &meta.name, meta.order);
            let message = if order >= 2 {
                format!(
                    "{sent} per-broker positions sent, but topic {name:?} (order {order}) is \
                     read from one global position: start from a single number"
                )
            } else {
                format!(
                    "{sent} per-broker positions sent; topic {name:?} (order {order}) takes \
                     one per broker, {brokers}"
                )
            };
            return Err(Refusal::new(ErrorCode::BadCursor, message).into());
        }
        let mut raw = vec![0u8; 8 * hello.cursor_count as usize];
        stream.read_exact(&mut raw)?;
        cursors = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
    }
    Ok(cursors)
}

/// Sends the HelloOk frame.
pub fn send_hello_ok(stream: &mut TcpStream, ok: &HelloOk) -> io::Result<()> {
    stream.write_all(&ok.encode_frame())
}

pub fn hello_ok(shared: &Shared, hello: &Hello, topic: u32, meta: &TopicMeta) -> HelloOk {
    HelloOk {
        broker_id: shared.config.broker_id as u16,
        num_brokers: shared.region.capacities().brokers as u16,
        order: meta.order,
        ack_level: hello.ack_level,
        replication_factor: meta.replication_factor,
        topic_id: topic,
        max_message_bytes: shared.config.max_message_bytes as u32,
        max_batch_bytes: shared.config.max_batch_bytes as u32,
        next_batch_seq: 0,
        first_retained: 0,
    }
}

/// Fills `dest` within `limit` from now, however the client spreads the bytes out: a
/// timeout per read alone would let a client that sends a byte now and then hold a
/// reserved slot of the log, and every later batch of the log with it, for as long as it
/// likes. Ends at most about a second after the deadline: the socket's read timeout is
/// shortened only when the time left falls a second below it, so a batch that arrives
/// at once costs no extra system calls. `Ok(false)`: the deadline passed.
pub fn read_exact_within(
    stream: &mut TcpStream,
    dest: &mut [u8],
    limit: Duration,
) -> io::Result<bool> {
    let deadline = Instant::now() + limit;
    let mut timeout = limit;
    stream.set_read_timeout(Some(timeout))?;
    let mut filled = 0;
    while filled < dest.len() {
        match stream.read(&mut dest[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(false)
            }
            Err(e) => return Err(e),
        }
        if filled < dest.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            if left + Duration::from_secs(1) < timeout {
                timeout = left;
                stream.set_read_timeout(Some(timeout))?;
            }
        }
    }
    stream.set_read_timeout(None)?;
    Ok(true)
}

/// What a look at a subscriber's socket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// Connected, and silent as a subscriber must be.
    There,
    /// Closed its connection, or the socket failed.
    Gone,
    /// Sent bytes after its hello: a subscriber sends nothing, so it is broken or
    /// hostile (and bytes waiting would hide its leaving from this probe for good).
    Talked,
}

/// Looks at a subscriber's socket without blocking and without consuming anything.
/// The broker only writes to subscriptions: while it has nothing to send, it would
/// otherwise not learn that the subscriber left until the next write.
pub fn probe_subscriber(stream: &impl std::os::fd::AsFd) -> Peer {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit()];
    let sock = socket2::SockRef::from(stream);
    match sock.recv_with_flags(&mut byte, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
        Ok(0) => Peer::Gone,
        Ok(_) => Peer::Talked,
        // Only errors that say the connection is over; a passing one (no memory for
        // the call) must not end a live subscription.
        Err(e) => match e.raw_os_error() {
            Some(libc::ECONNRESET | libc::ETIMEDOUT | libc::EPIPE | libc::ENOTCONN) => Peer::Gone,
            _ => Peer::There,
        },
    }
}

/// Reads and discards `len` bytes (a batch the broker will not keep).
pub fn drain(stream: &mut TcpStream, mut len: u64) -> io::Result<()> {
    let mut scratch = [0u8; 64 * 1024];
    while len > 0 {
        let n = (scratch.len() as u64).min(len) as usize;
        stream.read_exact(&mut scratch[..n])?;
        len -= n as u64;
    }
    Ok(())
}
