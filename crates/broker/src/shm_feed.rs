//! Subscriptions over a local shared-memory feed (issue 26, stage 2).
//!
//! A subscriber on this host opens a channel as a publisher does (`shm_conn`: the abstract
//! Unix socket, SO_PEERCRED, a sealed memfd with the hello), but its memfd is only its
//! cursor page: the consumer line of the feed's ring, which this broker maps read-only.
//! The broker makes the feed, a ring in a memfd of its own, maps it writable, seals it
//! against any further writable mapping (`F_SEAL_FUTURE_WRITE`) and hands it over with
//! HelloOk. From then on the subscription is `subscribe::run`, as over TCP, with the
//! frames (Delivery, BatchOk, Error) copied once from the region into the ring instead of
//! written to a socket. The subscriber maps nothing of the region: it reads only what
//! was copied for it, so it can neither see another topic's bytes (segments are reused
//! across topics) nor write the control block, and it can write nothing the broker reads
//! but its own ring position, which the ring checks.
//!
//! Owns: the feed of each such subscription and [`ShmOutlet`]. Touches: the feed, the
//! subscriber's cursor page (read-only) and its socket; the region only through
//! `subscribe` (read, and the reader pin).

use crate::net::{self, End, Peer, Refusal};
use crate::shm_conn::{log_refusal, peer_alive, FINAL_WRITE, HELLO_TIMEOUT};
use crate::subscribe::{self, address_hash, Outlet, MAX_BYTES_PER_WRITE};
use crate::Shared;
use embarcadero_region::TopicMeta;
use embarcadero_shm::layout::feed_ring;
use embarcadero_shm::ring::RingMaps;
use embarcadero_shm::{socket, Producer, Waited};
use embarcadero_wire::{ErrorCode, Hello, HelloOk};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The broker's end of a feed: the ring's producer.
pub(crate) struct ShmOutlet<'s> {
    shared: &'s Shared,
    sock: UnixStream,
    ring: Producer,
    /// The feed's memfd until it is handed over with HelloOk.
    feed: Option<OwnedFd>,
    /// How long a subscriber may leave the ring full before it is disconnected.
    stall: Duration,
}

impl ShmOutlet<'_> {
    /// Waits for room for `want` bytes (after publishing what is written). Returns early,
    /// with less room, once the subscriber has taken anything and a quarter of the
    /// stall timeout has passed, so the caller beats the reader pin and writes what
    /// fits: a subscriber is stalled only if it takes nothing for the whole timeout (as
    /// over TCP, where any progress restarts it), not if it frees less than `want`.
    fn wait_room(&mut self, want: usize, stall: Duration) -> Result<(), End> {
        self.ring.publish();
        let room_before = self.ring.room()?;
        let deadline = Instant::now() + stall;
        let sock = &self.sock;
        let shutdown = &self.shared.shutdown;
        let mut alive = || !shutdown.load(Ordering::Relaxed) && peer_alive(sock);
        loop {
            let slice = (Instant::now() + stall / 4).min(deadline);
            match self.ring.wait_room(want, Some(slice), &mut alive)? {
                Waited::Ready => return Ok(()),
                Waited::Gone => return Err(End::Gone),
                Waited::TimedOut if self.ring.room()? > room_before => return Ok(()),
                Waited::TimedOut if Instant::now() >= deadline => return Err(End::Gone),
                Waited::TimedOut => {}
            }
        }
    }

    /// Copies `len` bytes from `src` into the ring, waiting for room as needed;
    /// `progress` after each [`MAX_BYTES_PER_WRITE`] taken and whenever the subscriber
    /// made room.
    ///
    /// # Safety
    /// `src` is valid for reads of `len` bytes for the whole call (its contents may
    /// change: the region's bytes are re-checked by the caller after the round).
    unsafe fn copy_in(
        &mut self,
        src: *const u8,
        len: usize,
        unbeaten: &mut usize,
        progress: &mut dyn FnMut() -> Result<(), End>,
    ) -> Result<(), End> {
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(MAX_BYTES_PER_WRITE);
            // SAFETY: `src + done .. + chunk` lies inside what the caller vouched for.
            let n = unsafe { self.ring.write_ptr(src.add(done), chunk)? };
            assert!(n <= chunk, "the ring took {n} of {chunk} bytes");
            done += n;
            *unbeaten += n;
            if n == 0 {
                // A quarter of the ring, however little of this iovec is left: the ring
                // is full, so the subscriber has all of it to read before it reaches what
                // comes next, and waiting for more costs it nothing. Woken for each few
                // KiB it took instead, this thread took the CPU from it for as many small
                // copies (docs/PERFORMANCE.md, "Session 25").
                let want = (self.ring.capacity() / 4).max(1);
                self.wait_room(want, self.stall)?;
                progress()?;
                *unbeaten = 0;
            } else if *unbeaten >= MAX_BYTES_PER_WRITE {
                self.ring.publish();
                progress()?;
                *unbeaten = 0;
            }
        }
        Ok(())
    }

    /// Writes one whole frame into the ring, waiting for the subscriber to make room as
    /// [`Self::wait_room`] does for `stall` (a frame of the subscription: the stall
    /// timeout; the connection's last, a refusal: a couple of seconds). A subscriber that
    /// makes no room in time is `TimedOut`.
    fn write_frame(&mut self, bytes: &[u8], stall: Duration) -> io::Result<()> {
        assert!(
            self.feed.is_none(),
            "frames go into a feed once it is handed over"
        );
        let mut done = 0;
        while done < bytes.len() {
            done += self.ring.write(&bytes[done..])?;
            if done < bytes.len() {
                self.wait_room(bytes.len() - done, stall)
                    .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?;
            }
        }
        self.ring.publish();
        Ok(())
    }
}

impl Outlet for ShmOutlet<'_> {
    /// HelloOk goes on the socket, with the feed's memfd attached to its first byte.
    fn send_hello_ok(&mut self, ok: &HelloOk) -> io::Result<()> {
        let feed = self.feed.take().expect("HelloOk is sent once");
        socket::send_with_fd(&self.sock, &ok.encode_frame(), &feed)
    }

    fn set_stall(&mut self, stall: Duration) -> io::Result<()> {
        self.stall = stall;
        Ok(())
    }

    fn send_all(
        &mut self,
        iov: &mut [libc::iovec],
        progress: &mut dyn FnMut() -> Result<(), End>,
    ) -> Result<(), End> {
        assert!(
            self.feed.is_none(),
            "frames go into a feed once it is handed over"
        );
        let mut unbeaten = 0;
        for v in iov.iter() {
            // SAFETY: every iovec points into live memory: the caller's header buffers,
            // or payload ranges inside the region's mapping, which lives as long as
            // `shared` (as for `writev`); only read here.
            unsafe { self.copy_in(v.iov_base as *const u8, v.iov_len, &mut unbeaten, progress)? };
        }
        self.ring.publish();
        progress()
    }

    fn send_frame(&mut self, bytes: &[u8]) -> io::Result<()> {
        let stall = self.stall;
        self.write_frame(bytes, stall)
    }

    fn probe(&self) -> Peer {
        net::probe_subscriber(&self.sock)
    }

    /// A local subscriber counts as the loopback address, with local TCP subscribers,
    /// against `broker.max_subscribers_per_address`.
    fn address(&self) -> u64 {
        address_hash(std::net::Ipv4Addr::LOCALHOST.into())
    }
}

/// Serves a subscription whose hello (`hello`, for `topic`) came with the cursor page
/// `page`: reads the per-broker cursors from the socket, makes the feed, then runs the
/// subscription. A refusal before HelloOk is returned for the caller to send on the
/// socket; one after it goes into the feed here, and `End::Gone` is returned.
pub(crate) fn serve(
    shared: &Shared,
    sock: &UnixStream,
    page: &OwnedFd,
    hello: Hello,
    topic: u32,
    meta: TopicMeta,
) -> End {
    let (mut out, cursors) = match open(shared, sock, page, &hello, &meta) {
        Ok(opened) => opened,
        Err(end) => return end,
    };
    let end = match crate::TopicConn::hold(shared, topic) {
        None => net::unknown_topic(&hello.topic).into(),
        Some(_held) => subscribe::run(shared, &mut out, hello, topic, meta, cursors),
    };
    match end {
        // Handed over: the subscriber reads the refusal from the feed.
        End::Refused(refusal) if out.feed.is_none() => {
            log_refusal(shared, &refusal);
            let _ = out.write_frame(&refusal.frame(), FINAL_WRITE);
            End::Gone
        }
        end => end,
    }
}

/// The handshake's second half: cursors, the cursor page checked and mapped read-only,
/// the feed made.
fn open<'s>(
    shared: &'s Shared,
    sock: &UnixStream,
    page: &OwnedFd,
    hello: &Hello,
    meta: &TopicMeta,
) -> Result<(ShmOutlet<'s>, Vec<u64>), End> {
    sock.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let cursors = net::read_cursors(shared, &mut &*sock, hello, meta)?;
    sock.set_read_timeout(None)?;
    let refused = |e: String| Refusal::new(ErrorCode::ShmRefused, e);
    let page = socket::map_cursor_page(page).map_err(refused)?;
    let capacity = shared.config.shm_feed_bytes;
    // Checked with the configuration; the ring masks positions with it.
    assert!(
        embarcadero_shm::layout::check_data_capacity(capacity as u64) == Ok(capacity),
        "a feed of {capacity} bytes passed the configuration check"
    );
    let (feed, map) = socket::create_feed(capacity)
        .map_err(|e| refused(format!("cannot make a shared-memory feed: {e}")))?;
    let maps = RingMaps {
        producer: Arc::new(map),
        consumer: Arc::new(page),
    };
    let out = ShmOutlet {
        shared,
        sock: sock.try_clone()?,
        ring: Producer::split(maps, feed_ring(capacity)),
        feed: Some(feed),
        stall: shared.config.reader_stall_timeout,
    };
    Ok((out, cursors))
}
