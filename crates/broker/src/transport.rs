//! The two transports a publishing connection runs over, behind one interface, so the
//! publish path (validation, go-back-N, order-5 admission and fencing, backpressure,
//! acknowledgements) is one piece of code for both: a TCP socket, or a local
//! shared-memory channel (`shm_conn`).
//!
//! Owns: the [`Inbound`] trait (the connection thread's side: batches in, the handshake
//! answer and the last frame out) and [`Sink`] (the acknowledgement side, written by the
//! service thread through the connection's `Outbox`). Touches: the connection's socket
//! or channel only.

use crate::net;
use crate::payload_wait::{self, Arrival, Staged};
use crate::shm_conn::AckSink;
use embarcadero_wire::HelloOk;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// What the publish path reads batches from.
pub(crate) trait Inbound {
    /// Reads exactly `buf.len()` bytes, waiting as long as the client is connected.
    fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()>;
    /// Waits, holding nothing, until `len` bytes can be read without waiting on the
    /// client (`payload_wait`).
    fn await_payload(&mut self, len: usize, limit: Duration) -> io::Result<Arrival>;
    /// Reads `len` bytes into a staging buffer charged to `in_use`, by `deadline`.
    fn stage<'a>(
        &mut self,
        len: usize,
        deadline: Instant,
        in_use: &'a AtomicU64,
    ) -> io::Result<Option<Staged<'a>>>;
    /// Fills `dest` within `limit`; `Ok(false)` when the time ran out.
    fn read_exact_within(&mut self, dest: &mut [u8], limit: Duration) -> io::Result<bool>;
    /// Reads and discards `len` bytes.
    fn drain(&mut self, len: u64) -> io::Result<()>;
    /// Sends the handshake's answer.
    fn send_hello_ok(&mut self, ok: &HelloOk) -> io::Result<()>;
    /// Sends the connection's last bytes (after its `Outbox` is closed), waiting at
    /// most a couple of seconds for the client to take them.
    fn write_final(&mut self, bytes: &[u8]) -> io::Result<()>;
}

impl Inbound for TcpStream {
    fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        Read::read_exact(self, buf)
    }

    fn await_payload(&mut self, len: usize, limit: Duration) -> io::Result<Arrival> {
        payload_wait::await_payload(self, len, limit)
    }

    fn stage<'a>(
        &mut self,
        len: usize,
        deadline: Instant,
        in_use: &'a AtomicU64,
    ) -> io::Result<Option<Staged<'a>>> {
        payload_wait::stage(self, len, deadline, in_use)
    }

    fn read_exact_within(&mut self, dest: &mut [u8], limit: Duration) -> io::Result<bool> {
        net::read_exact_within(self, dest, limit)
    }

    fn drain(&mut self, len: u64) -> io::Result<()> {
        net::drain(self, len)
    }

    fn send_hello_ok(&mut self, ok: &HelloOk) -> io::Result<()> {
        net::send_hello_ok(self, ok)
    }

    fn write_final(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.set_write_timeout(Some(Duration::from_secs(2)))?;
        self.write_all(bytes)
    }
}

/// Where a connection's acknowledgements and errors go.
pub enum Sink {
    Tcp(TcpStream),
    Shm(AckSink),
}

impl Sink {
    /// Sends what the client takes without blocking; returns how many bytes.
    pub fn send_some(&mut self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            Sink::Tcp(stream) => {
                let sock = socket2::SockRef::from(&*stream);
                loop {
                    match sock.send_with_flags(bytes, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
                        Ok(n) => return Ok(n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
            Sink::Shm(sink) => sink.send_some(bytes),
        }
    }

    /// Closes the connection: the client and the connection thread see it end.
    pub fn shutdown(&self) {
        match self {
            Sink::Tcp(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Sink::Shm(sink) => sink.shutdown(),
        }
    }
}
