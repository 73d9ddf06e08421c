//! Waiting for a batch's payload before anything is reserved for it.
//!
//! A reservation (PBR slot and log range) holds back every later batch of the broker's
//! log until it is committed, so a connection must never wait on its client while it
//! holds one: a client that sent a header and then trickled its payload would stall
//! every publisher of the log (issue 28). So a connection first waits, holding nothing,
//! until the whole payload is in its socket's receive buffer — the kernel wakes it once
//! (`SO_RCVLOWAT`), not per segment — and only then reserves and receives straight into
//! the region, which cannot block. A payload larger than the socket can buffer is read
//! into the connection's own staging buffer first, and copied into the log once whole:
//! one more copy, for batches beyond about half of `net.ipv4.tcp_rmem`'s maximum only.
//!
//! Owns: the socket calls for this wait. Touches: the connection's socket only.

use embarcadero_region::backoff::Backoff;
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of payloads one broker stages at once, over all its connections: what clients
/// that send large batches slowly (or not at all) can make it hold.
pub const STAGING_BUDGET: u64 = 256 << 20;

/// A payload received into memory of its own, charged to the broker's staging budget
/// until dropped.
pub struct Staged<'a> {
    pub bytes: Vec<u8>,
    in_use: &'a AtomicU64,
}

impl<'a> Staged<'a> {
    /// An empty buffer with room for `len` bytes, charged to the broker's budget
    /// (`in_use`, at most [`STAGING_BUDGET`]), waiting for room until `deadline`.
    pub fn charged(len: usize, deadline: Instant, in_use: &'a AtomicU64) -> Option<Self> {
        if !charge(in_use, len as u64, deadline) {
            return None;
        }
        let staged = Staged {
            bytes: Vec::with_capacity(len),
            in_use,
        };
        // The charge is the capacity, which is what `Drop` gives back.
        let extra = staged.bytes.capacity() - len;
        in_use.fetch_add(extra as u64, Ordering::AcqRel);
        Some(staged)
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        let len = self.bytes.capacity() as u64;
        let before = self.in_use.fetch_sub(len, Ordering::AcqRel);
        debug_assert!(before >= len, "staged bytes never go below zero");
    }
}

/// Receives a payload the socket cannot hold whole into memory of its own, by
/// `deadline`. Memory is taken from the broker's budget (`in_use`, at most
/// [`STAGING_BUDGET`]) before anything is read, and is touched only as bytes arrive.
/// `None`: the payload, or room in the budget, did not come in time.
pub fn stage<'a>(
    stream: &TcpStream,
    len: usize,
    deadline: Instant,
    in_use: &'a AtomicU64,
) -> io::Result<Option<Staged<'a>>> {
    let Some(mut staged) = Staged::charged(len, deadline, in_use) else {
        return Ok(None);
    };
    while staged.bytes.len() < len {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        stream.set_read_timeout(Some(left))?;
        let want = (len - staged.bytes.len()) as u64;
        match stream.take(want).read_to_end(&mut staged.bytes) {
            Ok(_) if staged.bytes.len() < len => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {}
            Err(e) if is_wait(&e) => {}
            Err(e) => return Err(e),
        }
    }
    stream.set_read_timeout(None)?;
    debug_assert_eq!(staged.bytes.len(), len);
    Ok(Some(staged))
}

fn is_wait(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Takes `len` bytes of the staging budget, waiting for room until `deadline`.
fn charge(in_use: &AtomicU64, len: u64, deadline: Instant) -> bool {
    let mut backoff = Backoff::new(Duration::from_millis(5));
    loop {
        let now = in_use.load(Ordering::Acquire);
        if now + len <= STAGING_BUDGET {
            if in_use
                .compare_exchange(now, now + len, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return true;
            }
            continue;
        }
        if Instant::now() >= deadline {
            return false;
        }
        backoff.idle(None);
    }
}

/// Where a batch's payload is once [`await_payload`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// All of it is in the socket's receive buffer: reading it cannot block.
    InSocket,
    /// The socket cannot buffer all of it; read it into a staging buffer first.
    TooLargeForSocket,
    /// It did not arrive within the limit.
    TimedOut,
}

/// Waits, up to `limit`, until `len` payload bytes are in the socket's receive buffer.
/// Consumes nothing. A closed or failed connection is an error.
pub fn await_payload(stream: &TcpStream, len: usize, limit: Duration) -> io::Result<Arrival> {
    if bytes_waiting(stream)? >= len {
        return Ok(Arrival::InSocket);
    }
    // The kernel caps the low-water mark at what the socket can buffer (half its largest
    // receive buffer); below `len`, the payload can never all be waiting.
    let raised = set_recv_lowat(stream, len)?;
    let arrival = wait_for_lowat(stream, len, raised, limit);
    // Back to 1 whatever happened: the kernel wakes a reader blocked in `recv` only once
    // the mark is reached, whatever the read's own length, so a mark left high would
    // leave the next header's blocking read asleep beside the bytes it waits for.
    set_recv_lowat(stream, 1)?;
    arrival
}

/// The wait of [`await_payload`] once `SO_RCVLOWAT` is raised to `raised`.
fn wait_for_lowat(
    stream: &TcpStream,
    len: usize,
    raised: usize,
    limit: Duration,
) -> io::Result<Arrival> {
    if raised < len {
        return Ok(Arrival::TooLargeForSocket);
    }
    let deadline = Instant::now() + limit;
    let mut last_seen = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(Arrival::TimedOut);
        }
        let events = poll_readable(stream, left)?;
        let waiting = bytes_waiting(stream)?;
        if waiting >= len {
            return Ok(Arrival::InSocket);
        }
        if events & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            // The peer will send nothing more: the payload can never be whole.
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if events != 0 && waiting == last_seen {
            // Woken with nothing new and the peer still there: the kernel woke the
            // reader below the mark (memory pressure). Stage rather than spin.
            return Ok(Arrival::TooLargeForSocket);
        }
        last_seen = waiting;
    }
}

/// Bytes waiting in the socket's receive buffer (`FIONREAD`).
fn bytes_waiting(stream: &TcpStream) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `n`; the
    // descriptor is a live socket owned by `stream`.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    debug_assert!(n >= 0, "FIONREAD is a count");
    Ok(n.max(0) as usize)
}

/// Sets `SO_RCVLOWAT` (poll reports readable only from this many bytes on) and returns
/// the value the kernel kept, which it caps at what the socket can buffer.
fn set_recv_lowat(stream: &TcpStream, len: usize) -> io::Result<usize> {
    let fd = stream.as_raw_fd();
    let want = libc::c_int::try_from(len).unwrap_or(libc::c_int::MAX);
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the option value is one c_int read from `want`, with its size given.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&want as *const libc::c_int).cast(),
            size,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut kept: libc::c_int = 0;
    let mut kept_size = size;
    // SAFETY: the kernel writes at most `kept_size` bytes into `kept`, a c_int.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&mut kept as *mut libc::c_int).cast(),
            &mut kept_size,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(kept.max(0) as usize)
}

/// Waits up to `timeout` for the socket to report readable or closed; returns the
/// events it reported (0 on timeout).
fn poll_readable(stream: &TcpStream, timeout: Duration) -> io::Result<libc::c_short> {
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int;
    // SAFETY: one pollfd, valid for the call.
    let rc = unsafe { libc::poll(&mut fd, 1, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(if rc == 0 { 0 } else { fd.revents })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        (client, server)
    }

    #[test]
    fn a_payload_counts_as_arrived_only_when_all_of_it_is_in_the_socket() {
        let (mut client, server) = pair();
        client.write_all(&[7; 1000]).unwrap();
        assert_eq!(
            await_payload(&server, 4000, Duration::from_millis(50)).unwrap(),
            Arrival::TimedOut,
            "a quarter of it"
        );
        let writer = std::thread::spawn(move || {
            for _ in 0..3 {
                client.write_all(&[7; 1000]).unwrap();
            }
            client
        });
        assert_eq!(
            await_payload(&server, 4000, Duration::from_secs(30)).unwrap(),
            Arrival::InSocket
        );
        let _client = writer.join().unwrap();
        let mut got = vec![0u8; 4000];
        let mut server = server;
        server.set_nonblocking(true).unwrap();
        server.read_exact(&mut got).unwrap();
        assert!(
            got.iter().all(|&b| b == 7),
            "nothing was consumed by the wait"
        );
    }

    /// The low-water mark raised for a payload must not outlive the wait: the kernel
    /// would not wake a blocking read of the next (small) header until that many bytes
    /// were there, and a client that waits for its acknowledgement sends no more.
    #[test]
    fn a_blocking_read_after_the_wait_wakes_for_a_small_frame() {
        let (mut client, server) = pair();
        client.write_all(&[1; 50]).unwrap();
        // Half of it: the wait raises the mark, and gives up.
        assert_eq!(
            await_payload(&server, 100, Duration::from_millis(20)).unwrap(),
            Arrival::TimedOut
        );
        let mut server = server;
        let mut payload = [0u8; 50];
        server.read_exact(&mut payload).unwrap();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            let mut header = [0u8; 16];
            server.read_exact(&mut header).map(|_| header)
        });
        // The bug shows only when the read is already asleep as the bytes arrive.
        let tid = tid_rx.recv().unwrap();
        let stat = format!("/proc/self/task/{tid}/stat");
        while !std::fs::read_to_string(&stat)
            .unwrap()
            .rsplit(')')
            .next()
            .unwrap()
            .starts_with(" S")
        {
            std::thread::yield_now();
        }
        client.write_all(&[2; 16]).unwrap();
        assert_eq!(reader.join().unwrap().unwrap(), [2; 16]);
    }

    #[test]
    fn staging_takes_memory_from_the_budget_and_gives_it_back() {
        let (mut client, server) = pair();
        let in_use = AtomicU64::new(0);
        let deadline = Instant::now() + Duration::from_secs(30);
        client.write_all(&[3; 5000]).unwrap();
        let staged = stage(&server, 5000, deadline, &in_use).unwrap().unwrap();
        assert_eq!(staged.bytes, vec![3; 5000]);
        assert!(in_use.load(Ordering::Relaxed) >= 5000);
        drop(staged);
        assert_eq!(in_use.load(Ordering::Relaxed), 0);
        // A payload that does not arrive gives its charge back too.
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(stage(&server, 100, soon, &in_use).unwrap().is_none());
        assert_eq!(in_use.load(Ordering::Relaxed), 0);
        // No room in the budget: refused by the deadline, nothing read.
        in_use.store(STAGING_BUDGET, Ordering::Relaxed);
        client.write_all(&[4; 10]).unwrap();
        assert!(stage(&server, 10, soon, &in_use).unwrap().is_none());
    }

    #[test]
    fn a_payload_larger_than_the_socket_can_hold_is_staged() {
        let (_client, server) = pair();
        assert_eq!(
            await_payload(&server, 1 << 30, Duration::from_secs(30)).unwrap(),
            Arrival::TooLargeForSocket
        );
    }

    #[test]
    fn a_peer_that_leaves_mid_payload_is_an_error() {
        let (mut client, server) = pair();
        client.write_all(&[1; 10]).unwrap();
        drop(client);
        let e = await_payload(&server, 100, Duration::from_secs(30)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
