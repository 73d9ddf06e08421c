//! The client's end of a local shared-memory channel (issue 26; the layout and the
//! handshake are `embarcadero_shm`'s): used by a publisher connection instead of a TCP
//! socket when the broker is on this host.
//!
//! Owns: the channel's memfd mapping on the client side, its data ring's producer (the
//! connection's sender thread) and its ack ring's consumer (the connection's ack reader
//! thread), and the Unix socket that carries the handshake and tells either side that
//! the other has gone. Touches: nothing else; never the region.

use embarcadero_shm::layout::{ack_ring, data_ring, C_SPACE_BELL, P_DATA_BELL};
use embarcadero_shm::{bell, socket, Consumer, Mapping, Producer, Waited};
use std::io::{self, Read};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    data: Mutex<Producer>,
    acks: Mutex<Consumer>,
    /// Set by `shutdown`: the waits of this process end.
    closed: AtomicBool,
}

/// Why no channel was opened, when the broker did not refuse one.
pub struct Unavailable(pub String);

impl ShmLink {
    /// Opens a channel to the broker at `target` with a data ring of `ring_bytes`: sends
    /// `hello` with the channel's memfd and returns the socket, positioned at the
    /// broker's first answer frame (HelloOk or an error), to read with `read_frame`.
    pub fn open(
        target: SocketAddr,
        hello: &[u8],
        ring_bytes: usize,
    ) -> std::result::Result<(Arc<ShmLink>, UnixStream), Unavailable> {
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
        let why = |e: io::Error| Unavailable(e.to_string());
        // The other end must be a broker we trust with our batches: ourselves or root.
        let peer = socket::peer_uid(&sock).map_err(why)?;
        let own = socket::own_uid();
        if peer != own && peer != 0 {
            return Err(Unavailable(format!(
                "the socket {names:?} belongs to uid {peer}, neither this process's {own} nor root"
            )));
        }
        let (fd, map) = socket::create_channel(ring_bytes).map_err(why)?;
        socket::send_hello(&sock, hello, &fd).map_err(why)?;
        drop(fd);
        sock.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(why)?;
        let map = Arc::new(map);
        let link = Arc::new(ShmLink {
            sock: sock.try_clone().map_err(why)?,
            data: Mutex::new(Producer::new(map.clone(), data_ring(ring_bytes))),
            acks: Mutex::new(Consumer::new(map.clone(), ack_ring(ring_bytes))),
            data_capacity: ring_bytes,
            map,
            closed: AtomicBool::new(false),
        });
        Ok((link, sock))
    }

    /// Whether the broker is still there and this end is not shut down.
    fn alive(&self) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        let mut byte = [std::mem::MaybeUninit::<u8>::uninit()];
        let s = socket2::SockRef::from(&self.sock);
        match s.recv_with_flags(&mut byte, libc_flags()) {
            Ok(_) => false,
            Err(e) => matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        }
    }

    /// Writes one batch, header then messages, into the data ring (waiting for room).
    pub fn write_batch(&self, header: &[u8], payload: &[u8]) -> io::Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let mut data = self.data.lock().unwrap_or_else(|p| p.into_inner());
        data.write_all(&[header, payload], || self.alive())
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
