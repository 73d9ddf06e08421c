//! The client's end of a local shared-memory channel (issue 26; the layout and the
//! handshake are `embarcadero_shm`'s): used by a publisher connection, or a subscriber
//! ([`ShmFeed`]), instead of a TCP socket when the broker is on this host.
//!
//! Owns: the channel's memfd mapping on the client side, its data ring's producer (the
//! connection's sender thread) and its ack ring's consumer (the connection's ack reader
//! thread); for a subscriber its cursor page (writable) and its read-only view of the
//! broker's feed; and the Unix socket that carries the handshake and tells either side
//! that the other has gone. Touches: nothing else; never the region.

use embarcadero_shm::layout::{ack_ring, data_ring, feed_ring, C_SPACE_BELL, P_DATA_BELL};
use embarcadero_shm::ring::RingMaps;
use embarcadero_shm::{bell, socket, Consumer, Mapping, Producer, Span, Waited};
use embarcadero_wire::{FrameHeader, FrameKind, FRAME_HEADER_LEN, MAX_ERROR_TEXT_LEN};
use std::io::{self, Read};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a broker has to answer a channel's hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Which transport a publisher's connections use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Shared memory when the broker is on this host and the channel opens, else TCP.
    #[default]
    Auto,
    Tcp,
    Shm,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Transport::Auto),
            "tcp" => Ok(Transport::Tcp),
            "shm" => Ok(Transport::Shm),
            other => Err(format!("transport {other:?}: use auto, tcp or shm")),
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        })
    }
}

/// One open channel.
pub struct ShmLink {
    sock: UnixStream,
    map: Arc<Mapping>,
    data_capacity: usize,
    data: Mutex<DataRing>,
    acks: Mutex<Consumer>,
    /// Set by `shutdown`: the waits of this process end.
    closed: AtomicBool,
    /// The id of the span lent out of the data ring ([`ShmLink::lend`]), 0 for none: a
    /// hint the connection's sender reads without the ring's lock. Set when a span is
    /// lent, cleared (if still that id) when it is committed or dropped uncommitted.
    lent_id: AtomicU64,
    /// Batches built in place that a write copied out of the data ring for their room
    /// (`Producer::copied_out`), as of the last write.
    copied_out: AtomicU64,
}

/// The data ring's producer, and whether spans may be lent out of it.
struct DataRing {
    ring: Producer,
    /// Lending is off while the connection's sender writes several batches that nothing
    /// may come between (a resend, or an order-5 reopen's resends).
    held: bool,
    /// The id the next lent span gets.
    next_lend: u64,
}

/// Whether a batch went into the data ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    Done,
    /// Nothing written: a span of the ring is lent out to a batch being built in place,
    /// which must be committed (or dropped) first.
    SpanOut,
}

/// A span of a channel's data ring lent to a batch built in place, with its id.
pub struct LentSpan {
    pub span: Span,
    pub id: u64,
}

/// Why no channel was opened, when the broker did not refuse one.
pub struct Unavailable(pub String);

/// Connects to the channel socket of the broker at `target`, if it is on this host and
/// run by this process's uid or root (the only brokers trusted with our data).
fn connect_broker(target: SocketAddr) -> std::result::Result<UnixStream, Unavailable> {
    let names = socket::names_for(target);
    if names.is_empty() {
        return Err(Unavailable(format!(
            "{target} is not an address of this host"
        )));
    }
    let sock = names
        .iter()
        .find_map(|n| socket::connect(n).ok())
        .ok_or_else(|| Unavailable(format!("no broker listens on {names:?}")))?;
    let peer = socket::peer_uid(&sock).map_err(|e| Unavailable(e.to_string()))?;
    let own = socket::own_uid();
    if peer != own && peer != 0 {
        return Err(Unavailable(format!(
            "the socket {names:?} belongs to uid {peer}, neither this process's {own} nor root"
        )));
    }
    Ok(sock)
}

/// Whether the broker at the other end of `sock` is still there: it sends nothing on
/// the socket after its first answer, so bytes there are as bad as a close.
fn peer_alive(sock: &UnixStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit()];
    let s = socket2::SockRef::from(sock);
    match s.recv_with_flags(&mut byte, libc_flags()) {
        Ok(_) => false,
        Err(e) => matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ),
    }
}

impl ShmLink {
    /// Opens a channel to the broker at `target` with a data ring of `ring_bytes`: sends
    /// `hello` with the channel's memfd and returns the socket, positioned at the
    /// broker's first answer frame (HelloOk or an error), to read with `read_frame`.
    pub fn open(
        target: SocketAddr,
        hello: &[u8],
        ring_bytes: usize,
    ) -> std::result::Result<(Arc<ShmLink>, UnixStream), Unavailable> {
        let sock = connect_broker(target)?;
        let why = |e: io::Error| Unavailable(e.to_string());
        let (fd, map) = socket::create_channel(ring_bytes).map_err(why)?;
        socket::send_hello(&sock, hello, &fd).map_err(why)?;
        drop(fd);
        sock.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(why)?;
        let map = Arc::new(map);
        let link = Arc::new(ShmLink {
            sock: sock.try_clone().map_err(why)?,
            data: Mutex::new(DataRing {
                ring: Producer::new(map.clone(), data_ring(ring_bytes)),
                held: false,
                next_lend: 1,
            }),
            acks: Mutex::new(Consumer::new(map.clone(), ack_ring(ring_bytes))),
            data_capacity: ring_bytes,
            map,
            closed: AtomicBool::new(false),
            lent_id: AtomicU64::new(0),
            copied_out: AtomicU64::new(0),
        });
        Ok((link, sock))
    }

    /// Whether the broker is still there and this end is not shut down.
    fn alive(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && peer_alive(&self.sock)
    }

    /// Writes one batch, header then messages, into the data ring (waiting for room);
    /// nothing while a span is lent out (it would come before these bytes).
    pub fn write_batch(&self, header: &[u8], payload: &[u8]) -> io::Result<Written> {
        if self.closed.load(Ordering::Acquire) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let mut data = self.data.lock().unwrap_or_else(|p| p.into_inner());
        if data.ring.is_lent() {
            return Ok(Written::SpanOut);
        }
        let written = data.ring.write_all(&[header, payload], || self.alive());
        let copied_out = data.ring.copied_out();
        self.copied_out.store(copied_out, Ordering::Relaxed);
        written.map(|()| Written::Done)
    }

    /// Lends `limit` bytes of the data ring to a batch built in place, unless lending
    /// is held, a span is out already, the ring lacks the room, or another thread holds
    /// the ring right now (the builder must not wait for a sender that waits for room).
    pub fn lend(&self, limit: usize) -> Option<LentSpan> {
        let mut data = self.data.try_lock().ok()?;
        if data.held || self.closed.load(Ordering::Acquire) {
            return None;
        }
        // An error here (a broker that broke the ring's rules) shows at the next write.
        let span = data.ring.lend(limit).ok().flatten()?;
        let id = data.next_lend;
        data.next_lend += 1;
        self.lent_id.store(id, Ordering::Release);
        Some(LentSpan { span, id })
    }

    /// Publishes a span lent by this channel as a batch of `len` bytes (header
    /// included); `false` when it is not this channel's span lent out now.
    pub fn commit(&self, lent: &mut LentSpan, len: usize, header: &[u8]) -> bool {
        let mut data = self.data.lock().unwrap_or_else(|p| p.into_inner());
        let done = data.ring.commit(&mut lent.span, len, header);
        if done {
            self.clear_lent(lent.id);
        }
        done
    }

    /// The span with this id is no longer out (committed, or dropped uncommitted).
    pub fn clear_lent(&self, id: u64) {
        let _ = self
            .lent_id
            .compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Batches built in place that a write copied out of the data ring because their
    /// room was needed before they were acknowledged.
    pub fn copied_out(&self) -> u64 {
        self.copied_out.load(Ordering::Relaxed)
    }

    /// Whether a span is lent out (a hint: without the ring's lock).
    pub fn span_out(&self) -> bool {
        self.lent_id.load(Ordering::Acquire) != 0
    }

    /// Stops lending, unless a span is out (`false`): the caller then writes batches
    /// that nothing may come between, and calls [`Self::allow_lending`] after.
    pub fn hold_lending(&self) -> bool {
        let mut data = self.data.lock().unwrap_or_else(|p| p.into_inner());
        if data.ring.is_lent() {
            return false;
        }
        data.held = true;
        true
    }

    /// Lets spans be lent again.
    pub fn allow_lending(&self) {
        self.data.lock().unwrap_or_else(|p| p.into_inner()).held = false;
    }

    /// Reads broker frames from the ack ring; 0 once the broker has gone (or this end
    /// was shut down) and the ring is empty.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut acks = self.acks.lock().unwrap_or_else(|p| p.into_inner());
        if acks.wait_available(1, None, || self.alive())? != Waited::Ready {
            return Ok(0);
        }
        let n = acks.available()?.min(buf.len());
        acks.copy_out(&mut buf[..n]);
        acks.consume(n);
        Ok(n)
    }

    /// Ends the channel: the broker sees the socket close; this process's threads
    /// waiting on either ring wake and see it too.
    pub fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        let data = data_ring(self.data_capacity);
        bell::wake(self.map.u32_at(data.consumer_line + C_SPACE_BELL));
        let acks = ack_ring(self.data_capacity);
        bell::wake(self.map.u32_at(acks.producer_line + P_DATA_BELL));
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

fn libc_flags() -> libc::c_int {
    libc::MSG_PEEK | libc::MSG_DONTWAIT
}

impl Read for &ShmLink {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        ShmLink::read(self, buf)
    }
}

/// A subscriber's end of a feed: its cursor page (the ring's consumer line, the only
/// shared memory it writes) and its read-only view of the broker's ring, which holds
/// the subscription's frames exactly as a TCP socket would carry them. Bytes are copied
/// out into the subscriber's own buffers before anything in them is looked at, and
/// every position the broker publishes is checked by the ring: a broker that writes
/// garbage gives an error (`InvalidData`), never a read outside the mapping.
pub struct ShmFeed {
    sock: UnixStream,
    ring: Consumer,
}

/// How a feed's handshake ended.
pub enum FeedAnswer {
    Accepted(ShmFeed, embarcadero_wire::HelloOk),
    Refused(embarcadero_wire::ErrorFrame),
}

impl ShmFeed {
    /// Opens a feed from the broker at `target`: sends `hello` with a fresh cursor page,
    /// then `extra` (per-broker cursors) on the socket, and reads the broker's answer:
    /// HelloOk with the feed's memfd, or an error frame. `Err(Unavailable)` when no
    /// feed could be set up (the caller may use TCP); `Ok(Err(_))` when the broker's
    /// answer broke the protocol.
    pub fn open(
        target: SocketAddr,
        hello: &[u8],
        extra: &[u8],
    ) -> std::result::Result<std::result::Result<FeedAnswer, String>, Unavailable> {
        let sock = connect_broker(target)?;
        let why = |e: io::Error| Unavailable(e.to_string());
        let (page_fd, page) = socket::create_cursor_page().map_err(why)?;
        socket::send_hello(&sock, hello, &page_fd).map_err(why)?;
        drop(page_fd);
        io::Write::write_all(&mut &sock, extra).map_err(why)?;
        let mut raw = [0u8; FRAME_HEADER_LEN];
        let fd = socket::recv_with_fd(&sock, &mut raw, HELLO_TIMEOUT).map_err(why)?;
        let header = match FrameHeader::decode(&raw, 8 + MAX_ERROR_TEXT_LEN as u32) {
            Ok(h) => h,
            Err(e) => return Ok(Err(format!("the broker's answer: {e}"))),
        };
        let mut body = vec![0u8; header.body_len as usize];
        sock.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(why)?;
        (&sock).read_exact(&mut body).map_err(why)?;
        sock.set_read_timeout(None).map_err(why)?;
        Ok(Self::answer(sock, page, fd, &header, &body))
    }

    /// The feed from the broker's answer frame (`header`, `body`) and the memfd that
    /// came with it.
    fn answer(
        sock: UnixStream,
        page: Mapping,
        fd: Option<OwnedFd>,
        header: &FrameHeader,
        body: &[u8],
    ) -> std::result::Result<FeedAnswer, String> {
        use embarcadero_wire::{ErrorFrame, HelloOk};
        match (header.kind, fd) {
            (FrameKind::Error, _) => ErrorFrame::decode(header, body)
                .map(FeedAnswer::Refused)
                .map_err(|e| e.to_string()),
            (FrameKind::HelloOk, Some(fd)) => {
                let ok = HelloOk::decode(body).map_err(|e| e.to_string())?;
                let (feed, capacity) = socket::map_feed(&fd)?;
                let maps = RingMaps {
                    producer: Arc::new(feed),
                    consumer: Arc::new(page),
                };
                let ring = Consumer::split(maps, feed_ring(capacity));
                Ok(FeedAnswer::Accepted(ShmFeed { sock, ring }, ok))
            }
            (FrameKind::HelloOk, None) => Err("HelloOk came without the feed's memfd".into()),
            (kind, _) => Err(format!("expected HelloOk, got a {kind:?} frame")),
        }
    }

    /// Whether a whole frame, header and body, is published and not read yet, so that
    /// reading it waits for nothing (not even for a broker stopped half-way through
    /// writing it); never waits itself. A header that does not decode counts as whole: the
    /// read that follows reports it. A frame larger than the ring never is: a waiting
    /// read takes it as it streams through. A broker gone is not seen here: the next wait
    /// sees it.
    pub fn whole_frame_here(&mut self) -> io::Result<bool> {
        let available = self.ring.available()?;
        if available < FRAME_HEADER_LEN {
            return Ok(false);
        }
        let mut raw = [0u8; FRAME_HEADER_LEN];
        self.ring.copy_out(&mut raw);
        let Ok(header) = FrameHeader::decode(&raw, u32::MAX) else {
            return Ok(true);
        };
        Ok(available as u64 >= FRAME_HEADER_LEN as u64 + u64::from(header.body_len))
    }

    /// Waits up to `wait` for the next byte: `Ok(false)` when none came, an error
    /// (`UnexpectedEof`) once the broker has gone and the ring is empty.
    pub fn wait_readable(&mut self, wait: Duration) -> io::Result<bool> {
        let deadline = Some(Instant::now() + wait);
        let sock = &self.sock;
        match self.ring.wait_available(1, deadline, || peer_alive(sock))? {
            Waited::Ready => Ok(true),
            Waited::TimedOut => Ok(false),
            Waited::Gone => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the broker closed the shared-memory feed",
            )),
        }
    }
}

impl Read for ShmFeed {
    /// Copies out what the broker has published, up to `buf.len()`, waiting for at
    /// least a byte; 0 once the broker has gone and the ring is empty.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let sock = &self.sock;
        if self.ring.wait_available(1, None, || peer_alive(sock))? != Waited::Ready {
            return Ok(0);
        }
        let n = self.ring.available()?.min(buf.len());
        self.ring.copy_out(&mut buf[..n]);
        self.ring.consume(n);
        Ok(n)
    }
}

impl Drop for ShmFeed {
    fn drop(&mut self) {
        // The broker's thread learns at once that the subscription is over.
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
pub(crate) mod test_feed {
    use super::*;

    /// A feed made and handed over as a broker does, in one process: the client's
    /// [`ShmFeed`], the broker's producer, the broker's writable mapping of the feed
    /// (for writing garbage where only a broker could) and the broker's socket end.
    pub(crate) fn pair(capacity: usize) -> (ShmFeed, Producer, Arc<Mapping>, UnixStream) {
        let (client_sock, broker_sock) = UnixStream::pair().unwrap();
        let (page_fd, page) = socket::create_cursor_page().unwrap();
        let (feed_fd, feed) = socket::create_feed(capacity).unwrap();
        let feed = Arc::new(feed);
        let broker = Producer::split(
            RingMaps {
                producer: feed.clone(),
                consumer: Arc::new(socket::map_cursor_page(&page_fd).unwrap()),
            },
            feed_ring(capacity),
        );
        let (view, cap) = socket::map_feed(&feed_fd).unwrap();
        assert_eq!(cap, capacity);
        assert!(!view.is_writable());
        let ring = Consumer::split(
            RingMaps {
                producer: Arc::new(view),
                consumer: Arc::new(page),
            },
            feed_ring(capacity),
        );
        let feed_end = ShmFeed {
            sock: client_sock,
            ring,
        };
        (feed_end, broker, feed, broker_sock)
    }
}
