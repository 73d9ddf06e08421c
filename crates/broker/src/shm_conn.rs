//! Publishing connections over a local shared-memory channel (issue 26), and the
//! listener and handshake subscribers' feeds share with them (`shm_feed`).
//!
//! Beside its TCP port a broker listens on an abstract Unix socket
//! (`embarcadero_shm::socket::broker_name`). A client on this host connects, the broker
//! checks its uid (SO_PEERCRED: this process's own, or one of
//! `broker.shm_allowed_uids`), receives its hello with a sealed memfd (SCM_RIGHTS),
//! checks and maps the memfd, and answers HelloOk on the socket. From then on batches
//! arrive in the channel's data ring and acknowledgements leave through its ack ring;
//! the socket only tells either side that the other has gone. The publish path itself is
//! `publish::run`, the same as over TCP ([`crate::transport::Inbound`]).
//!
//! Owns: the listener, the channel of each such connection, the checks above.
//! Touches: the channel's memory, through `embarcadero_shm` (never trusting what the
//! client wrote there: positions are checked by the ring, batches are validated in the
//! log after the copy, as over TCP).

use crate::net::{End, Refusal};
use crate::payload_wait::{Arrival, Staged};
use crate::transport::{Inbound, Sink};
use crate::{publish, Shared};
use embarcadero_shm::layout::{ack_ring, data_ring, P_DATA_BELL};
use embarcadero_shm::{socket, Consumer, Mapping, Producer, Waited};
use embarcadero_wire::{ErrorCode, HelloOk, Role, HELLO_LEN};
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a new channel has to send its hello and memfd.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the last frames of a connection may wait for room in the ack ring.
pub(crate) const FINAL_WRITE: Duration = Duration::from_secs(2);

/// Whether the client at the other end of `sock` is still there. The client sends
/// nothing on the socket after its hello, so bytes there are as bad as a close.
pub(crate) fn peer_alive(sock: &UnixStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit()];
    let s = socket2::SockRef::from(sock);
    match s.recv_with_flags(&mut byte, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
        Ok(_) => false,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted,
    }
}

/// The connection thread's side of a channel: the data ring's consumer.
pub(crate) struct ShmInbound<'s> {
    shared: &'s Shared,
    sock: UnixStream,
    data: Consumer,
    acks: Arc<Mutex<Producer>>,
    /// Until HelloOk is sent the client reads the socket, afterwards the ack ring.
    hello_sent: bool,
}

impl ShmInbound<'_> {
    fn alive<'x>(shared: &'x Shared, sock: &'x UnixStream) -> impl FnMut() -> bool + 'x {
        move || !shared.shutdown.load(Ordering::Relaxed) && peer_alive(sock)
    }

    /// Waits for `want` bytes; `Ok(false)` at the deadline, an error once the client is gone.
    fn wait(&mut self, want: usize, deadline: Option<Instant>) -> io::Result<bool> {
        let alive = Self::alive(self.shared, &self.sock);
        match self.data.wait_available(want, deadline, alive)? {
            Waited::Ready => Ok(true),
            Waited::TimedOut => Ok(false),
            Waited::Gone => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }

    /// Copies `dest.len()` bytes out as they arrive, until `deadline`.
    fn copy_within(&mut self, dest: &mut [u8], deadline: Option<Instant>) -> io::Result<bool> {
        let mut filled = 0;
        while filled < dest.len() {
            if !self.wait(1, deadline)? {
                return Ok(false);
            }
            let n = self.data.available()?.min(dest.len() - filled);
            // The wait returned for at least a byte: a ring that then shows none would
            // spin here without ever sleeping again.
            assert!(
                n > 0,
                "the data ring woke its consumer with nothing available"
            );
            self.data.copy_out(&mut dest[filled..filled + n]);
            self.data.consume(n);
            filled += n;
        }
        Ok(true)
    }
}

impl Inbound for ShmInbound<'_> {
    fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.copy_within(buf, None).map(|_| ())
    }

    fn await_payload(&mut self, len: usize, limit: Duration) -> io::Result<Arrival> {
        if len > self.data.capacity() {
            return Ok(Arrival::TooLargeForSocket);
        }
        Ok(match self.wait(len, Some(Instant::now() + limit))? {
            true => {
                // `InSocket` promises the receive cannot wait on the client while it
                // holds a reservation (one more check of the producer's line: debug).
                debug_assert!(self.data.available().is_ok_and(|n| n >= len));
                Arrival::InSocket
            }
            false => Arrival::TimedOut,
        })
    }

    fn stage<'a>(
        &mut self,
        len: usize,
        deadline: Instant,
        in_use: &'a AtomicU64,
    ) -> io::Result<Option<Staged<'a>>> {
        let Some(mut staged) = Staged::charged(len, deadline, in_use) else {
            return Ok(None);
        };
        staged.bytes.resize(len, 0);
        let complete = self.copy_within(&mut staged.bytes, Some(deadline))?;
        Ok(complete.then_some(staged))
    }

    fn read_exact_within(&mut self, dest: &mut [u8], limit: Duration) -> io::Result<bool> {
        self.copy_within(dest, Some(Instant::now() + limit))
    }

    fn drain(&mut self, mut len: u64) -> io::Result<()> {
        while len > 0 {
            self.wait(1, None)?;
            let n = (self.data.available()? as u64).min(len);
            assert!(
                n > 0,
                "the data ring woke its consumer with nothing available"
            );
            self.data.consume(n as usize);
            len -= n;
        }
        Ok(())
    }

    fn send_hello_ok(&mut self, ok: &HelloOk) -> io::Result<()> {
        (&self.sock).write_all(&ok.encode_frame())?;
        self.hello_sent = true;
        Ok(())
    }

    fn write_final(&mut self, bytes: &[u8]) -> io::Result<()> {
        if !self.hello_sent {
            self.sock.set_write_timeout(Some(FINAL_WRITE))?;
            return (&self.sock).write_all(bytes);
        }
        let deadline = Some(Instant::now() + FINAL_WRITE);
        let mut acks = self.acks.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = 0;
        while done < bytes.len() {
            done += acks.write(&bytes[done..])?;
            acks.publish();
            if done < bytes.len() {
                let alive = || peer_alive(&self.sock);
                if acks.wait_room(bytes.len() - done, deadline, alive)? != Waited::Ready {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
        }
        Ok(())
    }
}

/// The acknowledgement side of a channel, held by the connection's `Outbox`: the ack
/// ring's producer.
pub struct AckSink {
    sock: UnixStream,
    acks: Arc<Mutex<Producer>>,
    map: Arc<Mapping>,
    data_capacity: usize,
}

impl AckSink {
    /// Writes what fits into the ack ring (never waits on the client).
    pub fn send_some(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let mut acks = self.acks.lock().unwrap_or_else(|p| p.into_inner());
        let n = acks.write(bytes)?;
        acks.publish();
        Ok(n)
    }

    /// Closes the socket (the client sees the end) and wakes this broker's connection
    /// thread if it sleeps on the data ring.
    pub fn shutdown(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        let place = data_ring(self.data_capacity);
        embarcadero_shm::bell::wake(self.map.u32_at(place.producer_line + P_DATA_BELL));
    }
}

/// Accepts channels until the broker stops.
pub(crate) fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    for sock in listener.incoming() {
        if shared.shutdown.load(Ordering::SeqCst) {
            break;
        }
        let Ok(sock) = sock else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let open = &shared.metrics.connections_open;
        if open.fetch_add(1, Ordering::Relaxed) >= shared.config.max_connections {
            open.fetch_sub(1, Ordering::Relaxed);
            shared
                .metrics
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            let refusal = Refusal::new(
                ErrorCode::TooManyConnections,
                format!(
                    "broker {} already has {} connections, its broker.max_connections; retry later",
                    shared.config.broker_id, shared.config.max_connections
                ),
            );
            let _ = sock.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = (&sock).write_all(&refusal.frame());
            continue;
        }
        let Some(id) = sock
            .try_clone()
            .ok()
            .map(|c| shared.connections.add_unix(c))
        else {
            open.fetch_sub(1, Ordering::Relaxed);
            continue;
        };
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("broker{}-shm", shared.config.broker_id))
            .spawn(move || {
                s.metrics.connections_total.fetch_add(1, Ordering::Relaxed);
                let _registered = crate::Registered {
                    registry: &s.connections,
                    open: &s.metrics.connections_open,
                    id,
                };
                handle(&s, sock);
            });
        if let Err(e) = spawned {
            tracing::error!("cannot spawn a connection thread: {e}");
            shared.connections.remove(id);
            open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Serves one channel: the handshake, then the publish path, or a subscription over a
/// feed (`shm_feed`); tells the client why it ends when it is refused.
fn handle(shared: &Shared, sock: UnixStream) {
    let mut inbound = None;
    let end = match receive(shared, &sock) {
        Err(end) => end,
        Ok((raw, fd)) => match crate::net::accept_hello(shared, &raw) {
            Err(end) => end,
            Ok((hello, topic, meta)) if hello.role == Role::Subscribe => {
                crate::shm_feed::serve(shared, &sock, &fd, hello, topic, meta)
            }
            Ok((hello, topic, meta)) => match open(shared, &sock, &fd) {
                Err(end) => end,
                Ok((opened, sink)) => {
                    let opened = inbound.insert(opened);
                    match crate::TopicConn::hold(shared, topic) {
                        None => crate::net::unknown_topic(&hello.topic).into(),
                        Some(_held) => {
                            publish::run(shared, Ok(Sink::Shm(sink)), opened, hello, topic, meta)
                        }
                    }
                }
            },
        },
    };
    if let End::Refused(refusal) = end {
        log_refusal(shared, &refusal);
        let _ = match inbound {
            Some(mut inbound) => inbound.write_final(&refusal.frame()),
            None => {
                let _ = sock.set_write_timeout(Some(FINAL_WRITE));
                (&sock).write_all(&refusal.frame())
            }
        };
    }
    let _ = sock.shutdown(std::net::Shutdown::Both);
}

/// Counts and logs a refusal about to be sent on a channel or feed.
pub(crate) fn log_refusal(shared: &Shared, refusal: &Refusal) {
    shared.metrics.errors_sent.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(
        broker = shared.config.broker_id,
        code = ?refusal.code,
        "closing shared-memory connection: {}",
        refusal.message
    );
}

/// Receives the hello and its memfd, and checks the peer's uid.
fn receive(shared: &Shared, sock: &UnixStream) -> Result<([u8; HELLO_LEN], OwnedFd), End> {
    // The hello first, whoever sent it: a refusal written while the client is still
    // sending would meet a closed socket there instead of being read. The fd of a
    // refused client is closed unmapped.
    let mut raw = [0u8; HELLO_LEN];
    let fd = socket::recv_hello(sock, &mut raw, HELLO_TIMEOUT).map_err(|e| {
        Refusal::new(
            ErrorCode::ShmRefused,
            format!("shared-memory handshake: {e}"),
        )
    })?;
    let uid = socket::peer_uid(sock)?;
    let own = socket::own_uid();
    if uid != own && !shared.config.shm_allowed_uids.contains(&uid) {
        return Err(Refusal::new(
            ErrorCode::ShmRefused,
            format!(
                "uid {uid} may not open a shared-memory channel to broker {} (run as uid {own}, \
                 or the operator adds {uid} to broker.shm_allowed_uids); use TCP instead",
                shared.config.broker_id
            ),
        )
        .into());
    }
    Ok((raw, fd))
}

/// Checks and maps a publisher's memfd.
fn open<'s>(
    shared: &'s Shared,
    sock: &UnixStream,
    fd: &OwnedFd,
) -> Result<(ShmInbound<'s>, AckSink), End> {
    let (map, data_capacity) = socket::map_client_channel(fd, shared.config.shm_max_ring_bytes)
        .map_err(|e| Refusal::new(ErrorCode::ShmRefused, e))?;
    // Validated by the mapping: the rings' positions are masked with the capacity, and
    // the broker maps no more than it allows a client.
    assert!(
        data_capacity.is_power_of_two() && data_capacity <= shared.config.shm_max_ring_bytes,
        "a data ring of {data_capacity} bytes passed the channel check"
    );
    let map = Arc::new(map);
    let acks = Arc::new(Mutex::new(Producer::new(
        map.clone(),
        ack_ring(data_capacity),
    )));
    let inbound = ShmInbound {
        shared,
        sock: sock.try_clone()?,
        data: Consumer::new(map.clone(), data_ring(data_capacity)),
        acks: acks.clone(),
        hello_sent: false,
    };
    let sink = AckSink {
        sock: sock.try_clone()?,
        acks,
        map,
        data_capacity,
    };
    Ok((inbound, sink))
}
