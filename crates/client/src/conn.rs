//! Connection set-up and frame reading shared by publishers and subscribers; a
//! publisher's connection is a [`Link`], a subscriber's a [`SubStream`]: a TCP socket or
//! a local shared-memory channel (`crate::shm`), chosen by its [`Transport`].

use crate::shm::{FeedAnswer, ShmFeed, ShmLink, Transport, Unavailable, Written};
use crate::{Error, Result};
use embarcadero_wire::{
    BatchOk, ErrorCode, ErrorFrame, FrameHeader, FrameKind, Hello, HelloOk, FRAME_HEADER_LEN,
    MAX_ERROR_TEXT_LEN,
};
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a handshake ended: accepted, or refused with the broker's error frame (whose
/// fields, such as a fenced session's high-water mark, the caller may need).
pub enum Handshake<S = TcpStream> {
    Accepted(S, HelloOk),
    Refused(ErrorFrame),
}

/// A publisher connection: a TCP socket or a shared-memory channel. Clones share the
/// connection; a channel's data ring has one writer (the sender) and its ack ring one
/// reader (the ack reader), as a socket's halves do.
pub enum Link {
    Tcp(TcpStream),
    Shm(Arc<ShmLink>),
}

impl Link {
    pub fn try_clone(&self) -> std::io::Result<Link> {
        Ok(match self {
            Link::Tcp(s) => Link::Tcp(s.try_clone()?),
            Link::Shm(l) => Link::Shm(l.clone()),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        match self {
            Link::Tcp(s) => s.shutdown(how),
            Link::Shm(l) => {
                l.shutdown();
                Ok(())
            }
        }
    }

    pub fn is_shm(&self) -> bool {
        matches!(self, Link::Shm(_))
    }

    /// Writes `[header][payload]` in full; over a channel, nothing while a span of its
    /// ring is lent out ([`Written::SpanOut`]).
    pub fn write_batch(&mut self, header: &[u8], payload: &[u8]) -> std::io::Result<Written> {
        match self {
            Link::Tcp(stream) => {
                let mut slices = [IoSlice::new(header), IoSlice::new(payload)];
                let mut bufs = &mut slices[..];
                while !bufs.is_empty() {
                    let n = stream.write_vectored(bufs)?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::WriteZero.into());
                    }
                    IoSlice::advance_slices(&mut bufs, n);
                }
                Ok(Written::Done)
            }
            Link::Shm(l) => l.write_batch(header, payload),
        }
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => s.read(buf),
            Link::Shm(l) => l.as_ref().read(buf),
        }
    }
}

/// Opens a publisher connection over `transport` (`ring_bytes`: a shared-memory
/// channel's data ring). `Auto` takes shared memory when the broker is on this host and
/// lets this process open a channel, else TCP, and logs which.
pub fn handshake_link(
    addr: &str,
    hello: &Hello,
    transport: Transport,
    ring_bytes: usize,
) -> Result<Handshake<Link>> {
    embarcadero_wire::validate_topic_name(&hello.topic)
        .map_err(|e| Error::Config(e.to_string()))?;
    if transport != Transport::Tcp {
        let target = resolve(addr)?;
        match open_shm(addr, target, hello, ring_bytes)? {
            Ok(Handshake::Refused(e))
                if transport == Transport::Auto && e.code == ErrorCode::ShmRefused =>
            {
                tracing::info!(
                    broker = addr,
                    "publishing over TCP: the broker refused a shared-memory channel: {}",
                    e.message
                );
            }
            Ok(answer) => {
                if transport == Transport::Auto {
                    tracing::info!(broker = addr, "publishing over shared memory");
                }
                return Ok(answer);
            }
            Err(Unavailable(why)) if transport == Transport::Auto => {
                tracing::info!(
                    broker = addr,
                    "publishing over TCP: no shared-memory channel ({why})"
                );
            }
            Err(Unavailable(why)) => {
                return Err(Error::Connect {
                    what: "broker (shared memory)",
                    addr: addr.to_string(),
                    message: why,
                })
            }
        }
    }
    Ok(match handshake(addr, hello, &[])? {
        Handshake::Accepted(stream, ok) => Handshake::Accepted(Link::Tcp(stream), ok),
        Handshake::Refused(e) => Handshake::Refused(e),
    })
}

/// A subscriber's connection: a TCP socket, or a shared-memory feed that carries the
/// same frames.
pub enum SubStream {
    Tcp(TcpStream),
    Shm(ShmFeed),
}

/// How a feed's violations (positions out of range, `InvalidData`) begin, so that they
/// read as the broken protocol they are, not as a lost connection to reconnect.
pub const RING_VIOLATION: &str = "shared-memory feed: ";

fn tagged(e: std::io::Error) -> std::io::Error {
    if e.kind() != std::io::ErrorKind::InvalidData {
        return e;
    }
    std::io::Error::new(e.kind(), format!("{RING_VIOLATION}{e}"))
}

impl SubStream {
    pub fn transport(&self) -> &'static str {
        match self {
            SubStream::Tcp(_) => "tcp",
            SubStream::Shm(_) => "shm",
        }
    }

    /// Whether a whole frame is here to read without waiting, found without a system
    /// call: in a shared-memory feed (`ShmFeed::whole_frame_here`); never over TCP, where
    /// seeing that would take a system call per look (see `Subscriber::poll_shared_now`).
    pub fn whole_frame_here(&mut self) -> std::io::Result<bool> {
        match self {
            SubStream::Shm(feed) => feed.whole_frame_here().map_err(tagged),
            SubStream::Tcp(_) => Ok(false),
        }
    }

    /// Waits up to `wait` for the first byte of a frame: `Ok(false)` when none came, an
    /// error once the broker has closed the connection.
    pub fn wait_readable(&mut self, wait: Duration) -> std::io::Result<bool> {
        match self {
            SubStream::Shm(feed) => feed.wait_readable(wait).map_err(tagged),
            SubStream::Tcp(stream) => {
                stream.set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
                let mut probe = [0u8; 1];
                match stream.peek(&mut probe) {
                    Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok(_) => {
                        // The frame is then read whole, blocking.
                        stream.set_read_timeout(None)?;
                        Ok(true)
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        Ok(false)
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }
}

impl Read for SubStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            SubStream::Tcp(s) => s.read(buf),
            SubStream::Shm(f) => f.read(buf).map_err(tagged),
        }
    }
}

/// Opens a subscriber connection over `transport`, sending `extra` (per-broker cursors)
/// after the hello; a refusal is an error. `Auto` takes a shared-memory feed when the
/// broker is on this host and gives this process one, else TCP, and logs which.
pub fn open_sub(
    addr: &str,
    hello: &Hello,
    extra: &[u8],
    transport: Transport,
) -> Result<(SubStream, HelloOk)> {
    embarcadero_wire::validate_topic_name(&hello.topic)
        .map_err(|e| Error::Config(e.to_string()))?;
    if transport != Transport::Tcp {
        let target = resolve(addr)?;
        let protocol = |message: String| Error::Protocol {
            peer: addr.to_string(),
            message,
        };
        match ShmFeed::open(target, &hello.encode(), extra) {
            Ok(Err(message)) => return Err(protocol(message)),
            Ok(Ok(FeedAnswer::Accepted(feed, ok))) => {
                if transport == Transport::Auto {
                    tracing::info!(broker = addr, "subscribing over shared memory");
                }
                return Ok((SubStream::Shm(feed), ok));
            }
            // InvalidRole: a broker from before subscriptions over shared memory.
            Ok(Ok(FeedAnswer::Refused(e)))
                if transport == Transport::Auto
                    && matches!(e.code, ErrorCode::ShmRefused | ErrorCode::InvalidRole) =>
            {
                tracing::info!(
                    broker = addr,
                    "subscribing over TCP: the broker refused a shared-memory feed: {}",
                    e.message
                );
            }
            Ok(Ok(FeedAnswer::Refused(e))) => return Err(broker_error(addr, e)),
            Err(Unavailable(why)) if transport == Transport::Auto => {
                tracing::info!(
                    broker = addr,
                    "subscribing over TCP: no shared-memory feed ({why})"
                );
            }
            Err(Unavailable(why)) => {
                return Err(Error::Connect {
                    what: "broker (shared memory)",
                    addr: addr.to_string(),
                    message: why,
                })
            }
        }
    }
    let (stream, ok) = open(addr, hello, extra)?;
    Ok((SubStream::Tcp(stream), ok))
}

/// The channel's handshake: the broker's answer comes on the Unix socket.
fn open_shm(
    addr: &str,
    target: SocketAddr,
    hello: &Hello,
    ring_bytes: usize,
) -> Result<std::result::Result<Handshake<Link>, Unavailable>> {
    let (link, mut sock) = match ShmLink::open(target, &hello.encode(), ring_bytes) {
        Ok(opened) => opened,
        Err(u) => return Ok(Err(u)),
    };
    let frame = read_frame(&mut sock, addr, 1024)?;
    Ok(Ok(match frame {
        Frame::HelloOk(ok) => Handshake::Accepted(Link::Shm(link), ok),
        Frame::Error(e) => Handshake::Refused(e),
        other => {
            return Err(Error::Protocol {
                peer: addr.to_string(),
                message: format!("expected HelloOk, got {other:?}"),
            })
        }
    }))
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    let connect_err = |message: String| Error::Connect {
        what: "broker",
        addr: addr.to_string(),
        message,
    };
    addr.to_socket_addrs()
        .map_err(|e| connect_err(e.to_string()))?
        .next()
        .ok_or_else(|| connect_err("address resolves to nothing".into()))
}

/// Connects, tunes the socket and completes the handshake; a refusal is an error.
pub fn open(addr: &str, hello: &Hello, extra: &[u8]) -> Result<(TcpStream, HelloOk)> {
    match handshake(addr, hello, extra)? {
        Handshake::Accepted(stream, ok) => Ok((stream, ok)),
        Handshake::Refused(e) => Err(broker_error(addr, e)),
    }
}

/// Connects, tunes the socket and sends the hello; returns the broker's answer.
pub fn handshake(addr: &str, hello: &Hello, extra: &[u8]) -> Result<Handshake> {
    embarcadero_wire::validate_topic_name(&hello.topic)
        .map_err(|e| Error::Config(e.to_string()))?;
    let connect_err = |message: String| Error::Connect {
        what: "broker",
        addr: addr.to_string(),
        message,
    };
    let sock_addr = resolve(addr)?;
    let mut stream = TcpStream::connect_timeout(&sock_addr, CONNECT_TIMEOUT)
        .map_err(|e| connect_err(e.to_string()))?;
    let sock = socket2::SockRef::from(&stream);
    let _ = sock.set_nodelay(true);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let mut first = hello.encode().to_vec();
    first.extend_from_slice(extra);
    stream
        .write_all(&first)
        .map_err(|e| connect_err(e.to_string()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| connect_err(e.to_string()))?;
    let frame = read_frame(&mut stream, addr, 1024)?;
    stream
        .set_read_timeout(None)
        .map_err(|e| connect_err(e.to_string()))?;
    match frame {
        Frame::HelloOk(ok) => Ok(Handshake::Accepted(stream, ok)),
        Frame::Error(e) => Ok(Handshake::Refused(e)),
        other => Err(Error::Protocol {
            peer: addr.to_string(),
            message: format!("expected HelloOk, got {other:?}"),
        }),
    }
}

pub fn broker_error(addr: &str, e: ErrorFrame) -> Error {
    Error::Broker {
        broker: addr.to_string(),
        code: e.code,
        message: e.message,
    }
}

/// A control frame (deliveries are read by the subscriber itself).
#[derive(Debug)]
pub enum Frame {
    HelloOk(HelloOk),
    Ack {
        count: u64,
    },
    Error(ErrorFrame),
    BatchOk {
        count: u64,
        discard_rest: bool,
    },
    /// Header of a delivery whose body (`body_len` bytes) is still in the socket.
    Delivery(FrameHeader),
}

/// Reads one frame; bodies other than deliveries are limited to `max_body` bytes.
pub fn read_frame(stream: &mut impl Read, peer: &str, max_body: u32) -> Result<Frame> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        broker: peer.to_string(),
        message: e.to_string(),
    };
    let mut raw = [0u8; FRAME_HEADER_LEN];
    stream.read_exact(&mut raw).map_err(lost)?;
    let header = FrameHeader::decode(&raw, u32::MAX).map_err(|e| Error::Protocol {
        peer: peer.to_string(),
        message: e.to_string(),
    })?;
    if header.kind == FrameKind::Delivery {
        return Ok(Frame::Delivery(header));
    }
    let limit = max_body.max(8 + MAX_ERROR_TEXT_LEN as u32);
    if header.body_len > limit {
        return Err(Error::Protocol {
            peer: peer.to_string(),
            message: format!("{:?} frame body of {} bytes", header.kind, header.body_len),
        });
    }
    let mut body = vec![0u8; header.body_len as usize];
    stream.read_exact(&mut body).map_err(lost)?;
    let protocol = |e: embarcadero_wire::WireError| Error::Protocol {
        peer: peer.to_string(),
        message: e.to_string(),
    };
    Ok(match header.kind {
        FrameKind::HelloOk => Frame::HelloOk(HelloOk::decode(&body).map_err(protocol)?),
        FrameKind::Ack => Frame::Ack { count: header.arg },
        FrameKind::Error => Frame::Error(ErrorFrame::decode(&header, &body).map_err(protocol)?),
        FrameKind::BatchOk => Frame::BatchOk {
            count: header.arg,
            discard_rest: header.flags & BatchOk::DISCARD_REST != 0,
        },
        FrameKind::Delivery => unreachable!("returned above"),
    })
}
