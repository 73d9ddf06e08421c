//! Serving a subscriber: batches go from the region to the socket with `writev`, no
//! copy in user space, or, for a local subscriber, copied once into its shared-memory
//! feed (`shm_feed`); both behind [`Outlet`]. Memory may be reclaimed while a batch is
//! in flight (retention), so after each write the server re-checks the tokens and
//! reclaimed frontiers it relied on, and only then confirms the deliveries with a
//! BatchOk frame.
//!
//! Owns: the subscription loop, the subscriber's reader pin, and the TCP outlet.
//! Touches: the region (read-only, apart from the pin's reader slot) and the outlet.

use crate::net::{self, End, Peer, Refusal};
use crate::Shared;
use embarcadero_region::backoff::Backoff;
use embarcadero_region::{
    monotonic_ns, Doorbell, GoiEntry, Region, TopicMeta, TopicSeq, READER_CLAIMING, READER_SLOTS,
};
use embarcadero_replication::{DiskReader, DiskSeek, RecordHeader};
use embarcadero_wire::{
    BatchFlags, BatchOk, DeliveryHeader, ErrorCode, Hello, HelloOk, DELIVERY_HEADER_LEN,
    FRAME_HEADER_LEN, SUBSCRIBE_FROM_FIRST_RETAINED,
};
use std::cell::Cell;
use std::io::{self, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Most batches and bytes sent per round (one `writev` series and its BatchOk).
const MAX_BATCHES_PER_ROUND: usize = 64;
/// A subscriber may hand out a round's messages only once its BatchOk has come, so it
/// keeps the whole round in its buffers first, and its reader waits while a round
/// arrives. Rounds of 16 MiB made a reader that keeps up alternate with the subscriber
/// instead of overlapping, and spread over cold buffers; rounds of 2 MiB read a topic
/// over shared memory 1.4-1.7x faster, over TCP about 1.1x (docs/PERFORMANCE.md,
/// "Session 25"). A round still takes at least one batch, whatever its size.
const MAX_BYTES_PER_ROUND: u64 = 2 << 20;
const FRAME_AND_DELIVERY: usize = FRAME_HEADER_LEN + DELIVERY_HEADER_LEN;
/// A disk replica that failed a read is read again after this long: an error may pass
/// (a full file table, a flaky device), and a subscription can outlive one.
const REPLICA_RETRY_AFTER: Duration = Duration::from_secs(10);
/// How often an idle subscription checks that its subscriber is still connected.
const PEER_PROBE_EVERY: Duration = Duration::from_millis(50);

/// Where a subscription's frames go: a TCP socket or a local shared-memory feed. The
/// bytes are the same either way (Delivery frames, BatchOk, Error; PROTOCOL.md).
pub(crate) trait Outlet {
    fn send_hello_ok(&mut self, ok: &HelloOk) -> io::Result<()>;
    /// A subscriber that takes nothing for this long is disconnected.
    fn set_stall(&mut self, stall: Duration) -> io::Result<()>;
    /// Sends every byte the iovecs describe (header buffers of the caller, or payload
    /// ranges of the region), in order; `progress` runs after each part sent (at most
    /// [`MAX_BYTES_PER_WRITE`] apart).
    fn send_all(
        &mut self,
        iov: &mut [libc::iovec],
        progress: &mut dyn FnMut() -> Result<(), End>,
    ) -> Result<(), End>;
    /// Sends a small frame (BatchOk) in full.
    fn send_frame(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Looks, without blocking, whether the subscriber is still there.
    fn probe(&self) -> Peer;
    /// [`address_hash`] of the subscriber's address, 0 when unknown.
    fn address(&self) -> u64;
}

impl Outlet for TcpStream {
    fn send_hello_ok(&mut self, ok: &HelloOk) -> io::Result<()> {
        net::send_hello_ok(self, ok)
    }

    fn set_stall(&mut self, stall: Duration) -> io::Result<()> {
        self.set_write_timeout(Some(stall))
    }

    fn send_all(
        &mut self,
        iov: &mut [libc::iovec],
        progress: &mut dyn FnMut() -> Result<(), End>,
    ) -> Result<(), End> {
        writev_all(self, iov, progress)
    }

    fn send_frame(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.write_all(bytes)
    }

    fn probe(&self) -> Peer {
        net::probe_subscriber(self)
    }

    fn address(&self) -> u64 {
        self.peer_addr().map_or(0, |a| address_hash(a.ip()))
    }
}

pub(crate) fn run(
    shared: &Shared,
    stream: &mut impl Outlet,
    hello: Hello,
    topic: u32,
    meta: TopicMeta,
    cursors: Vec<u64>,
) -> End {
    let mut ok = net::hello_ok(shared, &hello, topic, &meta);
    ok.first_retained = first_retained(&shared.region, topic, &meta);
    if let Err(e) = stream.send_hello_ok(&ok) {
        return e.into();
    }
    // A subscriber that stops reading its socket for this long is disconnected, which
    // frees its thread and its reader slot.
    let stall = shared
        .config
        .reader_stall_timeout
        .max(Duration::from_secs(1))
        * 2;
    if let Err(e) = stream.set_stall(stall) {
        return e.into();
    }
    let from_first = hello.flags & SUBSCRIBE_FROM_FIRST_RETAINED != 0;
    let result = if meta.order >= 2 {
        let start = Start {
            position: hello.start_position,
            from_first,
        };
        serve_global(shared, stream, topic, &meta, start)
    } else {
        let brokers = shared.region.capacities().brokers as usize;
        let cursors = if cursors.is_empty() {
            vec![0; brokers]
        } else {
            cursors
        };
        serve_per_broker(shared, stream, topic, &meta, cursors, from_first)
    };
    match result {
        Ok(()) => End::Gone,
        // A read that failed because the deletion took the data from under it (memory
        // released, replica files removed) is told as what it is.
        Err(End::Refused(_)) if shared.region.topic_deleted(topic) => deleted(&meta),
        Err(end) => end,
    }
}

/// Ends a subscription whose topic is deleted; checked once per round (one load).
fn still_there(region: &Region, topic: u32, meta: &TopicMeta) -> Result<(), End> {
    if region.topic_deleted(topic) {
        return Err(deleted(meta));
    }
    Ok(())
}

fn deleted(meta: &TopicMeta) -> End {
    let frame = net::topic_deleted(&meta.name);
    Refusal::new(frame.code, frame.message).into()
}

/// A reader slot in the region: while held, the brokers keep everything from the
/// pinned positions on in memory (unless the pin goes stale; see
/// `BrokerConfig::reader_stall_timeout`). The control plane frees the slots of a broker
/// it declares dead once they stop beating; a pin that finds its slot freed while its
/// subscriber is still being served claims a slot again.
struct Pin<'a> {
    region: &'a Region,
    topic: u32,
    who: Claimant,
    /// What the pin holds at each index, as last set: a new claim pins the same.
    positions: std::cell::RefCell<Vec<u64>>,
    slot: Cell<Option<u32>>,
    /// The heartbeat this pin last wrote: beats are compare-and-swaps from it.
    last_beat: Cell<u64>,
}

/// Who is claiming a reader slot: for which broker, and from which client address.
#[derive(Clone)]
struct Claimant {
    broker: u32,
    /// [`address_hash`] of the subscriber's address; 0 when the socket no longer has a
    /// peer (it left already; the idle probe ends it, and it counts against no one).
    address: u64,
    /// Slots of the topic its address may hold (`max_subscribers_per_address`).
    limit: u32,
    /// Pins older than this hold nothing, and do not count.
    stall: Duration,
}

impl Claimant {
    fn of(shared: &Shared, stream: &impl Outlet) -> Self {
        Self {
            broker: shared.config.broker_id,
            address: stream.address(),
            limit: shared.config.max_subscribers_per_address,
            stall: shared.config.reader_stall_timeout,
        }
    }
}

/// A stable, non-zero hash of a client address (FNV-1a over its bytes): the same in
/// every broker process, so one address's pins can be counted region-wide.
pub(crate) fn address_hash(ip: std::net::IpAddr) -> u64 {
    let bytes = match ip.to_canonical() {
        std::net::IpAddr::V4(v4) => v4.octets().to_vec(),
        std::net::IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    hash | 1
}

/// How long a new pin waits for a reclamation pass that may not have seen it (a pass
/// lasts microseconds; one whose broker died or is paused mid-pass is not waited for).
const RECLAIM_PASS_PATIENCE: Duration = Duration::from_millis(100);

impl<'a> Pin<'a> {
    /// Claims a free slot for `who`, pinning `positions[i]` at index `i`; refused when
    /// its address already holds its limit of the topic's slots.
    fn claim(
        region: &'a Region,
        topic: u32,
        who: Claimant,
        positions: &[u64],
    ) -> Result<Self, End> {
        let pin = Self {
            region,
            topic,
            who,
            positions: std::cell::RefCell::new(positions.to_vec()),
            slot: Cell::new(None),
            last_beat: Cell::new(0),
        };
        pin.take_slot()?;
        Ok(pin)
    }

    /// Takes a free slot and pins the positions in it, then waits out any reclamation
    /// pass that may have read the pins before it (`Region::await_reclaim_passes`), so
    /// that what the reader finds retained from now on stays so.
    fn take_slot(&self) -> Result<(), End> {
        for slot in 0..READER_SLOTS {
            let hb = self.region.reader_slot(self.topic, slot).heartbeat;
            if hb.load(Ordering::Relaxed) == 0
                && hb
                    .compare_exchange(0, READER_CLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                && self.fill(slot)?
            {
                if !self
                    .region
                    .await_reclaim_passes(self.topic, RECLAIM_PASS_PATIENCE)
                {
                    tracing::debug!(
                        topic = self.topic,
                        "a reclamation pass did not end within {RECLAIM_PASS_PATIENCE:?}; its broker may be paused"
                    );
                }
                return Ok(());
            }
        }
        tracing::warn!(
            topic = self.topic,
            "all {READER_SLOTS} reader slots are in use; this subscriber does not hold back reclamation"
        );
        Ok(())
    }

    /// Completes the claim of `slot` (its heartbeat is [`READER_CLAIMING`], so only
    /// this broker writes it), or gives it back if the address is over its limit.
    /// `Ok(false)`: the control plane freed the slot during the claim (its last owner
    /// was declared dead), so it may be someone else's: look for another.
    fn fill(&self, slot: u32) -> Result<bool, End> {
        let (region, topic, who) = (self.region, self.topic, &self.who);
        let pin = region.reader_slot(topic, slot);
        let hb = pin.heartbeat;
        // Before anything else of the claim: a scan that sees the claiming heartbeat
        // must reach this slot.
        pin.mark_claimed();
        // SeqCst with the count's loads: of two claims from one address at once, at
        // least one sees the other, so together they never pass the limit.
        pin.address.store(who.address, Ordering::SeqCst);
        let held = match who.address {
            0 => 0,
            address => region.readers_from(topic, address, who.stall),
        };
        if held > who.limit {
            let _ = hb.compare_exchange(READER_CLAIMING, 0, Ordering::AcqRel, Ordering::Relaxed);
            let message = format!(
                "this client address already has {} subscribers of the topic holding memory (broker.max_subscribers_per_address = {}); close some, or raise the setting",
                held - 1,
                who.limit
            );
            return Err(Refusal::new(ErrorCode::TooManyConnections, message).into());
        }
        pin.owner.store(who.broker as u64 + 1, Ordering::Release);
        for (i, p) in self.positions.borrow().iter().enumerate() {
            pin.position(i as u32).store(*p, Ordering::Release);
        }
        let now = monotonic_ns();
        // A compare-and-swap, not a store: a claim freed meanwhile must not come back
        // to life beside the next claimant's.
        if hb
            .compare_exchange(READER_CLAIMING, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return Ok(false);
        }
        self.slot.set(Some(slot));
        self.last_beat.set(now);
        Ok(true)
    }

    /// Pins `position` at `index` if it is above what is pinned there: a start from the
    /// beginning located at the first retained position pins that, not the 0 it asked
    /// for, so that a reclaimer passing readers stuck at old positions
    /// (`service::held_too_long`) does not take it for one of them.
    fn raise(&self, index: u32, position: u64) {
        if self.positions.borrow()[index as usize] < position {
            self.set(index, position);
        }
        assert!(
            self.positions.borrow()[index as usize] >= position,
            "a raised pin"
        );
    }

    /// Pins `position` at `index`; returns what was pinned there before.
    fn set(&self, index: u32, position: u64) -> u64 {
        let previous =
            std::mem::replace(&mut self.positions.borrow_mut()[index as usize], position);
        if let Some(slot) = self.slot.get() {
            self.region
                .reader_slot(self.topic, slot)
                .position(index)
                .store(position, Ordering::Release);
        }
        previous
    }

    /// Proves the reader is alive; call at least once per round, while idle, and as a
    /// round's bytes go out. A slot freed by the control plane (this broker was
    /// declared dead while the subscriber still made no progress, then went on) is
    /// claimed again: the subscriber is still being served, so it must hold memory.
    fn beat(&self) -> Result<(), End> {
        let Some(slot) = self.slot.get() else {
            return Ok(());
        };
        let now = monotonic_ns();
        let beaten = self
            .region
            .reader_slot(self.topic, slot)
            .heartbeat
            .compare_exchange(
                self.last_beat.get(),
                now,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        if beaten.is_ok() {
            self.last_beat.set(now);
            return Ok(());
        }
        // The slot may be someone else's now.
        self.slot.set(None);
        tracing::warn!(
            topic = self.topic,
            "this subscriber's reader slot was released (its broker was declared dead); it claims one again"
        );
        self.take_slot()
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.get() {
            let _ = self
                .region
                .reader_slot(self.topic, slot)
                .heartbeat
                .compare_exchange(self.last_beat.get(), 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

/// One batch chosen for a round, with what must be re-checked after sending it.
struct Planned {
    header: DeliveryHeader,
    ptr: *const u8,
    broker: u32,
    log_offset: u64,
    /// GOI index (orders 2, 5) or PBR index (orders 0, 1) whose token is re-checked.
    token_index: u64,
    /// A batch read from disk: `ptr` points into this buffer, nothing to re-check.
    owned: Option<Vec<u8>>,
}

/// Sends the planned batches, re-validates them, then confirms them. Returns how many
/// were confirmed: all of them, or (with `resend_reclaimed`) those before the first one
/// reclaimed while being sent, the rest being voided for the client to drop.
fn send_round(
    shared: &Shared,
    stream: &mut impl Outlet,
    topic: u32,
    global: bool,
    plan: &[Planned],
    resend_reclaimed: bool,
    pin: &Pin<'_>,
) -> Result<usize, End> {
    // An empty round would confirm nothing with a BatchOk the client takes for one.
    assert!(!plan.is_empty(), "a round sends at least one batch");
    let mut headers = vec![0u8; plan.len() * FRAME_AND_DELIVERY];
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(plan.len() * 2);
    encode_headers(plan, &mut headers);
    push_iovecs(plan, &headers, &mut iov);
    // The subscriber is taking bytes: that is progress, which keeps its pin fresh.
    stream.send_all(&mut iov, &mut || pin.beat())?;
    let region = &shared.region;
    let confirmed = still_held(region, topic, global, plan, resend_reclaimed)?;
    // A restarted head replaced this region: what was just read from it may be missing
    // from the new one (or hold other batches at these positions), so it is not
    // confirmed. The subscriber reconnects to a broker of the new region.
    if region.is_retired() {
        return Err(End::Gone);
    }
    confirm_round(shared, stream, plan, confirmed)?;
    Ok(confirmed)
}

/// Writes each planned batch's frame and delivery headers into its slot of `headers`
/// (`FRAME_AND_DELIVERY` bytes per batch).
#[inline]
fn encode_headers(plan: &[Planned], headers: &mut [u8]) {
    for (i, p) in plan.iter().enumerate() {
        let h = &mut headers[i * FRAME_AND_DELIVERY..(i + 1) * FRAME_AND_DELIVERY];
        h[..FRAME_HEADER_LEN].copy_from_slice(&p.header.frame_header().encode());
        h[FRAME_HEADER_LEN..].copy_from_slice(&p.header.encode());
    }
}

/// Describes the round for `writev`: each batch's headers (in `headers`, see
/// [`encode_headers`]), then its payload.
#[inline]
fn push_iovecs(plan: &[Planned], headers: &[u8], iov: &mut Vec<libc::iovec>) {
    for (i, p) in plan.iter().enumerate() {
        iov.push(libc::iovec {
            iov_base: headers[i * FRAME_AND_DELIVERY..].as_ptr() as *mut libc::c_void,
            iov_len: FRAME_AND_DELIVERY,
        });
        iov.push(libc::iovec {
            iov_base: p.ptr as *mut libc::c_void,
            iov_len: p.header.payload_len as usize,
        });
    }
}

/// Re-checks, after sending, that the sent batches were not reclaimed meanwhile (their
/// tokens still hold, their log offsets are still retained). Returns how many batches
/// before the first reclaimed one there are (all if none was); with `resend_reclaimed`
/// false, a reclaimed batch ends the subscription instead.
#[inline]
fn still_held(
    region: &Region,
    topic: u32,
    global: bool,
    plan: &[Planned],
    resend_reclaimed: bool,
) -> Result<usize, End> {
    let mut confirmed = plan.len();
    for (i, p) in plan.iter().enumerate() {
        if p.owned.is_some() {
            continue;
        }
        let token_ok = if global {
            region.goi_holds(topic, p.token_index)
        } else {
            region.pbr_holds(topic, p.broker, p.token_index)
        };
        let reclaimed = region
            .log(topic, p.broker)
            .reclaimed_blog
            .load(Ordering::Acquire);
        if !token_ok || reclaimed > p.log_offset {
            if !resend_reclaimed {
                return Err(not_retained(p.header.first_position, None));
            }
            confirmed = i;
            break;
        }
    }
    Ok(confirmed)
}

/// Confirms the first `confirmed` batches of the round with a BatchOk (voiding the rest)
/// and counts them.
#[inline]
fn confirm_round(
    shared: &Shared,
    stream: &mut impl Outlet,
    plan: &[Planned],
    confirmed: usize,
) -> Result<(), End> {
    stream.send_frame(
        &BatchOk {
            count: confirmed as u64,
            discard_rest: confirmed < plan.len(),
        }
        .encode(),
    )?;
    let bytes: u64 = plan[..confirmed]
        .iter()
        .map(|p| p.header.payload_len as u64)
        .sum();
    shared
        .metrics
        .subscribe_batches
        .fetch_add(confirmed as u64, Ordering::Relaxed);
    shared
        .metrics
        .subscribe_bytes
        .fetch_add(bytes, Ordering::Relaxed);
    Ok(())
}

fn not_retained(position: u64, first: Option<u64>) -> End {
    let message = match first {
        Some(first) => format!(
            "position {position} is no longer retained; the first available position is {first}; subscribe again with --from {first}"
        ),
        None => format!(
            "the subscriber fell behind: batch at position {position} was reclaimed while being sent; subscribe again from the first message still retained (`--from start`, the SDKs' \"start\") or a later position"
        ),
    };
    Refusal::new(ErrorCode::PositionNotRetained, message).into()
}

/// Most bytes handed to one `writev`: between two, the reader's pin is beaten, so a
/// subscriber that reads slowly but steadily keeps its pin fresh through a long round
/// (a round is up to [`MAX_BYTES_PER_ROUND`]). One more system call per MiB.
pub(crate) const MAX_BYTES_PER_WRITE: usize = 1 << 20;

/// Writes every byte the iovecs describe, resuming after partial writes, at most
/// [`MAX_BYTES_PER_WRITE`] per call; `progress` runs after each call that wrote.
fn writev_all(
    stream: &TcpStream,
    iov: &mut [libc::iovec],
    progress: &mut dyn FnMut() -> Result<(), End>,
) -> Result<(), End> {
    let fd = stream.as_raw_fd();
    let mut first = 0;
    while first < iov.len() {
        // The iovecs of this call: whole ones up to the byte bound, or the first cut
        // short (restored after the call) if it alone is over it.
        let mut count = 0;
        let mut bytes = 0;
        while first + count < iov.len() && count < 1024 {
            let len = iov[first + count].iov_len;
            if count > 0 && bytes + len > MAX_BYTES_PER_WRITE {
                break;
            }
            bytes += len;
            count += 1;
        }
        let whole = iov[first].iov_len;
        if count == 1 {
            iov[first].iov_len = whole.min(MAX_BYTES_PER_WRITE);
        }
        // SAFETY: every iovec points into live memory: header buffers owned by the
        // caller, or region payload ranges inside the mapping (which lives as long as
        // `shared`); a shortened one covers a prefix of its range. The kernel only
        // reads them.
        let n = unsafe { libc::writev(fd, iov[first..].as_ptr(), count as libc::c_int) };
        iov[first].iov_len = whole;
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        let mut n = n as usize;
        // The kernel writes at most what this call was given (the first iovec possibly
        // cut short): more would move the cursor past bytes never sent.
        assert!(n <= bytes, "writev wrote {n} of {bytes} bytes");
        while first < iov.len() && n >= iov[first].iov_len {
            n -= iov[first].iov_len;
            first += 1;
        }
        if n > 0 {
            let v = &mut iov[first];
            // SAFETY: advancing within the same buffer by fewer bytes than its length.
            v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
            v.iov_len -= n;
        }
        while first < iov.len() && iov[first].iov_len == 0 {
            first += 1;
        }
        progress()?;
    }
    Ok(())
}

/// For the HelloOk: the first global position a memory-only order 2 or 5 topic still
/// holds (what a subscription from the beginning starts at), so that a subscriber whose
/// start is gone learns it at once, even if nothing retained is left to deliver. Gone
/// are the positions before this region's start (they went with the previous region, as
/// after a restart, and never come back: a reader waiting for them, such as the
/// workflow engine's replay, would wait for ever) and those reclaimed since. 0 where it
/// is not told: orders 0 and 1 (positions per broker), and replicated topics, whose
/// older positions are read from disk.
fn first_retained(region: &Region, topic: u32, meta: &TopicMeta) -> u64 {
    if meta.order < 2 || meta.replication_factor >= 2 {
        return 0;
    }
    let region_start = region
        .topic_seq(topic)
        .start_position
        .load(Ordering::Acquire);
    let reclaimed = match locate_global(region, topic, 0) {
        Locate::Gone { first } => first,
        Locate::At { .. } | Locate::NotYet | Locate::Ahead => 0,
    };
    region_start.max(reclaimed)
}

fn retained(region: &Region, topic: u32, broker: u32, log_offset: u64) -> bool {
    region
        .log(topic, broker)
        .reclaimed_blog
        .load(Ordering::Acquire)
        <= log_offset
}

#[derive(Debug, PartialEq, Eq)]
enum Locate {
    At {
        index: u64,
        skip: u32,
    },
    NotYet,
    /// Past everything committed: not on disk either.
    Ahead,
    Gone {
        first: u64,
    },
}

// ------------------------------------------------------------------ orders 2 and 5

/// Finds the GOI entry holding global position `pos`.
fn locate_global(region: &Region, topic: u32, pos: u64) -> Locate {
    let seq = region.topic_seq(topic);
    let committed = seq.committed_seq.load(Ordering::Acquire);
    if committed == 0 {
        return nothing_readable(&seq, pos);
    }
    let Some(last) = region.goi_read(topic, committed - 1) else {
        return nothing_readable(&seq, pos);
    };
    if pos >= last.total_order + last.num_msg as u64 {
        return Locate::Ahead;
    }
    let lo = first_usable(region, topic, committed);
    let Some(first) = usable_entry(region, topic, lo) else {
        return Locate::Gone {
            first: last.total_order + last.num_msg as u64,
        };
    };
    if pos < first.total_order {
        return Locate::Gone {
            first: first.total_order,
        };
    }
    search_goi(region, topic, pos, lo, committed)
}

/// Nothing readable in the GOI (none committed in this region yet, or a race with a
/// wrap): a position below the region's first one is not coming back (memory-only
/// topics; a replicated topic's is looked for on disk), so the subscriber need not
/// wait for new data to learn it. Every entry is at or above that first position,
/// so naming it never skips a message.
fn nothing_readable(seq: &TopicSeq<'_>, pos: u64) -> Locate {
    let start = seq.start_position.load(Ordering::Acquire);
    if pos < start {
        Locate::Gone { first: start }
    } else {
        Locate::NotYet
    }
}

/// GOI entry `g`, if it is still there and its batch is still retained by its broker.
fn usable_entry(region: &Region, topic: u32, g: u64) -> Option<GoiEntry> {
    region
        .goi_read(topic, g)
        .filter(|e| retained(region, topic, e.broker_id as u32, e.blog_offset))
}

/// The start of the GOI's readable suffix below `committed`. Brokers reclaim
/// independently, so the readable suffix of the GOI starts above the newest entry that
/// is no longer usable, not at the oldest usable one.
fn first_usable(region: &Region, topic: u32, committed: u64) -> u64 {
    let goi_slots = region.capacities().goi_slots;
    let floor = committed.saturating_sub(goi_slots);
    let mut lo = committed;
    while lo > floor && usable_entry(region, topic, lo - 1).is_some() {
        lo -= 1;
    }
    lo
}

/// Binary-searches GOI entries `[lo, committed)` for the one holding `pos` (which is
/// at or past entry `lo`'s first position and below the last entry's end).
fn search_goi(region: &Region, topic: u32, pos: u64, lo: u64, committed: u64) -> Locate {
    // Largest g in [lo, committed) whose first position is <= pos.
    let (mut a, mut b) = (lo, committed - 1);
    while a < b {
        let mid = a + (b - a).div_ceil(2);
        match region.goi_read(topic, mid) {
            Some(e) if e.total_order <= pos => a = mid,
            Some(_) => b = mid - 1,
            None => return Locate::NotYet, // overwritten meanwhile: try again
        }
    }
    match region.goi_read(topic, a) {
        Some(e) => {
            // Entries are consecutive and `pos` is below the last one's end.
            debug_assert!(
                pos >= e.total_order && pos - e.total_order < e.num_msg as u64,
                "GOI entry {a} holds position {pos}"
            );
            Locate::At {
                index: a,
                skip: (pos - e.total_order) as u32,
            }
        }
        None => Locate::NotYet,
    }
}

/// Waiting for data on a subscriber's behalf. A subscriber sends nothing after its
/// hello, so one that left is otherwise noticed only at the next write: on a topic
/// that stays idle that would hold its thread, socket and reader slot indefinitely.
struct IdleWait {
    backoff: Backoff,
    next_probe: Instant,
    /// Where a subscription ended by the probe is counted.
    dropped: std::sync::Arc<crate::BrokerMetrics>,
}

impl IdleWait {
    fn new(shared: &Shared) -> Self {
        Self {
            backoff: Backoff::new(shared.config.idle_sleep_max),
            next_probe: Instant::now() + PEER_PROBE_EVERY,
            dropped: shared.metrics.clone(),
        }
    }

    fn reset(&mut self) {
        self.backoff.reset();
    }

    /// Waits for the bell (or a back-off step); `Err(End::Gone)` once the subscriber
    /// has closed its connection.
    fn wait(&mut self, bell: &Doorbell<'_>, seen: u32, stream: &impl Outlet) -> Result<(), End> {
        let now = Instant::now();
        if now >= self.next_probe {
            self.next_probe = now + PEER_PROBE_EVERY;
            match stream.probe() {
                Peer::There => {}
                Peer::Gone => {
                    self.dropped
                        .subscribers_dropped
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(End::Gone);
                }
                Peer::Talked => {
                    self.dropped
                        .subscribers_dropped
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(Refusal::new(
                        ErrorCode::UnexpectedData,
                        "a subscriber sends nothing after its hello (and cursors); \
                         closing the subscription",
                    )
                    .into());
                }
            }
        }
        self.backoff.idle(Some((bell, seen)));
        Ok(())
    }
}

/// Where a subscription to an order 2 or 5 topic starts.
struct Start {
    /// The global position of the first message wanted.
    position: u64,
    /// [`SUBSCRIBE_FROM_FIRST_RETAINED`]: a position that is gone moves up to the first
    /// retained one instead of ending the subscription.
    from_first: bool,
}

impl Start {
    /// `position` is gone and `first` is the first retained position: where to look
    /// next, or the refusal the subscriber gets.
    fn gone(&mut self, first: u64) -> Result<(), End> {
        // Reclamation only moves forward, so the first retained position is past the
        // one that is gone; a `first` at or below it would mean looking again forever.
        if !self.from_first || first <= self.position {
            return Err(not_retained(self.position, Some(first)));
        }
        self.position = first;
        Ok(())
    }
}

fn serve_global(
    shared: &Shared,
    stream: &mut impl Outlet,
    topic: u32,
    meta: &TopicMeta,
    mut start: Start,
) -> Result<(), End> {
    let region = &shared.region;
    let bell = region.topic_bell(topic);
    let mut idle = IdleWait::new(shared);
    let mut cursor: Option<(u64, u32)> = None;
    let mut disk = DiskLog::new(shared, meta);
    let pin = Pin::claim(
        region,
        topic,
        Claimant::of(shared, stream),
        &[start.position],
    )?;
    while !shared.shutdown.load(Ordering::Relaxed) {
        let seen = bell.seen();
        still_there(region, topic, meta)?;
        pin.beat()?;
        if cursor.is_none() {
            match locate_start(region, topic, meta, &mut start, disk.as_mut())? {
                StartAt::Found(at) => cursor = at,
                StartAt::Moved => {
                    // Up to the first retained position (`Start::gone` only moves up).
                    pin.raise(0, start.position);
                    continue;
                }
            }
        }
        let readable = readable_seq(region, topic, meta);
        let Some(from) = cursor.filter(|(g, _)| *g < readable) else {
            idle.wait(&bell, seen, stream)?;
            continue;
        };
        idle.reset();
        let (plan, g) = plan_global_round(region, topic, meta, from, readable, disk.as_mut())?;
        if plan.is_empty() {
            idle.wait(&bell, seen, stream)?;
            continue;
        }
        let confirmed = send_round(shared, stream, topic, true, &plan, disk.is_some(), &pin)?;
        if confirmed > 0 {
            advance_pin(&pin, topic, &plan, confirmed);
        }
        cursor = Some(next_cursor(topic, &plan, confirmed, from, g));
        if let Some(d) = disk.as_mut() {
            d.recycle(plan);
        }
    }
    Ok(())
}

/// The GOI index below which a subscriber of an order 2 or 5 topic may read: a
/// replicated topic is read up to its durable frontier only, so that what a subscriber
/// has seen survives the loss of the region.
#[inline]
fn readable_seq(region: &Region, topic: u32, meta: &TopicMeta) -> u64 {
    match meta.replication_factor {
        0 | 1 => region
            .topic_seq(topic)
            .committed_seq
            .load(Ordering::Acquire),
        rf => region.durable_seq(topic, rf),
    }
}

/// Moves the pin past the first `confirmed` (at least one) batches of a global round.
#[inline]
fn advance_pin(pin: &Pin<'_>, topic: u32, plan: &[Planned], confirmed: usize) {
    let last = &plan[confirmed - 1].header;
    let pinned = last.first_position + last.num_msg as u64;
    // The pin never passes what was sent: the first batch not confirmed (sent
    // again) starts where the confirmed ones end.
    assert!(
        plan.get(confirmed)
            .is_none_or(|p| p.header.first_position >= pinned),
        "topic {topic}: pin {pinned} passes the unconfirmed batch at GOI {}",
        plan[confirmed].header.batch_position
    );
    let previous = pin.set(0, pinned);
    // A pin moves only past what was sent and confirmed: the round started at or
    // after it (in the batch holding the start position, on the first round).
    // Back, it would let a reclamation pass that read the higher pin free what
    // it now names.
    assert!(
        pinned >= previous,
        "topic {topic}: the pin would go back from {previous} to {pinned}"
    );
}

/// Where a global subscription reads next after a round from `from` that planned up to
/// GOI index `g` and had `confirmed` batches confirmed: the GOI index and the messages
/// to skip in its batch.
#[inline]
fn next_cursor(
    topic: u32,
    plan: &[Planned],
    confirmed: usize,
    from: (u64, u32),
    g: u64,
) -> (u64, u32) {
    let next = match plan.get(confirmed) {
        // Reclaimed while being sent: send it again, from disk.
        Some(p) => (p.header.batch_position, p.header.skip),
        None => (g, 0),
    };
    // The cursor moves on by what was confirmed, and back to nothing already sent.
    assert!(
        next.0 == from.0 + confirmed as u64,
        "topic {topic}: the cursor would go from GOI {} to {} after {confirmed} batches",
        from.0,
        next.0
    );
    next
}

/// What looking for a global subscription's start found.
enum StartAt {
    /// The GOI index to read from and the messages to skip in its batch; `None`: not
    /// committed yet.
    Found(Option<(u64, u32)>),
    /// The position is gone and the start moved up to the first retained one: look
    /// again.
    Moved,
}

/// Finds `start` in memory, else on disk.
fn locate_start(
    region: &Region,
    topic: u32,
    meta: &TopicMeta,
    start: &mut Start,
    disk: Option<&mut DiskLog>,
) -> Result<StartAt, End> {
    let memory = locate_global(region, topic, start.position);
    let durable = region.durable_seq(topic, meta.replication_factor);
    Ok(StartAt::Found(match (memory, disk) {
        (Locate::At { index, skip }, _) => Some((index, skip)),
        (Locate::Ahead, _) => None,
        (_, Some(disk)) => match disk.seek_position(start.position, durable)? {
            DiskSeek::At { seq, skip } => Some((seq, skip)),
            DiskSeek::Gone { first_position } => {
                start.gone(first_position)?;
                return Ok(StartAt::Moved);
            }
            DiskSeek::Beyond => None,
        },
        (Locate::Gone { first }, None) => {
            start.gone(first)?;
            return Ok(StartAt::Moved);
        }
        (Locate::NotYet, None) => None,
    }))
}

/// Plans one round of a global subscription from `(g, skip)`, below `readable`: from
/// memory while a batch is retained there, else from disk. Returns the plan and the
/// GOI index after it.
fn plan_global_round(
    region: &Region,
    topic: u32,
    meta: &TopicMeta,
    (mut g, mut skip): (u64, u32),
    readable: u64,
    mut disk: Option<&mut DiskLog>,
) -> Result<(Vec<Planned>, u64), End> {
    let mut plan: Vec<Planned> = Vec::new();
    let mut bytes = 0u64;
    while g < readable && plan.len() < MAX_BATCHES_PER_ROUND && bytes < MAX_BYTES_PER_ROUND {
        let entry = region.goi_read(topic, g);
        let in_memory = entry.and_then(|e| plan_in_memory(region, topic, meta, g, skip, &e));
        let planned = match (in_memory, disk.as_deref_mut()) {
            (Some(p), _) => p,
            (None, Some(disk)) => {
                let durable = region.durable_seq(topic, meta.replication_factor);
                match disk.read(g, durable, meta.order)? {
                    Some(mut p) => {
                        p.header.skip = skip.min(p.header.num_msg);
                        p
                    }
                    None => break,
                }
            }
            (None, None) => {
                let pos = entry.map_or(0, |e| e.total_order);
                return Err(not_retained(pos, None));
            }
        };
        // Memory and every replica hold the global order without gaps; a record on disk
        // that breaks it (written by something else) is refused, never served.
        if let Some(previous) = plan.last() {
            let h = &previous.header;
            let expected = h.first_position + h.num_msg as u64;
            if planned.header.first_position != expected {
                return Err(Refusal::new(
                    ErrorCode::Internal,
                    format!(
                        "batch {g} starts at position {} where {expected} belongs",
                        planned.header.first_position
                    ),
                )
                .into());
            }
        }
        bytes += planned.header.payload_len as u64;
        plan.push(planned);
        skip = 0;
        g += 1;
    }
    Ok((plan, g))
}

/// Plans GOI entry `g` (`e`) from its broker's log, if its batch is still there.
fn plan_in_memory(
    region: &Region,
    topic: u32,
    meta: &TopicMeta,
    g: u64,
    skip: u32,
    e: &GoiEntry,
) -> Option<Planned> {
    let broker = e.broker_id as u32;
    if !retained(region, topic, broker, e.blog_offset) {
        return None;
    }
    let ptr = region.blog_ptr(topic, broker, e.blog_offset, e.payload_size as u64)?;
    Some(Planned {
        header: DeliveryHeader {
            batch_position: g,
            first_position: e.total_order,
            client_id: e.client_id,
            batch_seq: e.client_seq,
            num_msg: e.num_msg,
            skip: skip.min(e.num_msg),
            broker_id: e.broker_id,
            order: meta.order,
            payload_len: e.payload_size,
            session_epoch: e.session_epoch,
        },
        ptr,
        broker,
        log_offset: e.blog_offset,
        token_index: g,
        owned: None,
    })
}

/// The delivery of disk record `h`, whose payload was read into `buf` (kept with it, so
/// `ptr` stays valid): nothing to re-check after sending it.
fn disk_planned(h: &RecordHeader, buf: Vec<u8>, order: u8) -> Planned {
    Planned {
        header: DeliveryHeader {
            batch_position: h.seq,
            first_position: h.total_order,
            client_id: h.client_id,
            batch_seq: h.client_seq,
            num_msg: h.num_msg,
            skip: 0,
            broker_id: h.broker_id,
            order,
            payload_len: h.payload_len,
            session_epoch: h.session_epoch,
        },
        ptr: buf.as_ptr(),
        broker: h.broker_id as u32,
        log_offset: 0,
        token_index: h.seq,
        owned: Some(buf),
    }
}

/// A replicated topic's log on disk, for positions that have left memory. Reads one
/// replica at a time, and looks at the others whenever the one it reads no longer holds
/// a position: retention runs on each replica on its own schedule, so a position one of
/// them has removed another may still hold. A replica that fails with an error other
/// than a removed segment is passed over for [`REPLICA_RETRY_AFTER`].
struct DiskLog {
    readers: Vec<DiskReader>,
    /// When each replica last failed a read, while it is passed over.
    failed_at: Vec<Option<Instant>>,
    current: usize,
    /// The record the current reader's cursor points at.
    next_seq: Option<u64>,
    spare: Vec<Vec<u8>>,
}

impl DiskLog {
    fn new(shared: &Shared, meta: &TopicMeta) -> Option<Self> {
        let copies = (meta.replication_factor as usize).saturating_sub(1);
        let readers: Vec<DiskReader> = shared
            .config
            .replica_dirs
            .iter()
            .take(copies)
            .map(|d| {
                DiskReader::new(&embarcadero_replication::topic_dir(
                    d,
                    &meta.name,
                    meta.created_unix_ms,
                ))
            })
            .collect();
        (meta.order >= 2 && !readers.is_empty()).then_some(Self {
            failed_at: vec![None; readers.len()],
            readers,
            current: 0,
            next_seq: None,
            spare: Vec::new(),
        })
    }

    fn fail(&mut self, replica: usize, e: &io::Error) {
        tracing::warn!(
            replica = replica + 1,
            "cannot read the replica log: {e}; reading the other replicas, this one again in {}s",
            REPLICA_RETRY_AFTER.as_secs()
        );
        self.failed_at[replica] = Some(Instant::now());
    }

    /// Passed over: it failed a read less than [`REPLICA_RETRY_AFTER`] ago.
    fn passed_over(&self, replica: usize) -> bool {
        self.failed_at[replica].is_some_and(|at| at.elapsed() < REPLICA_RETRY_AFTER)
    }

    /// Seeks with `op` on the current replica, then on the others in turn, and reads
    /// from the first that holds the record. Else: `Gone` with the oldest position a
    /// replica keeps if any has removed it, `Beyond` (wait) if none has. Only positions
    /// the memory has reclaimed are looked for here, and memory reclaims only what every
    /// replica has made durable: a replica that lacks such a position without having
    /// removed it (an emptied directory, say) is not one to wait for.
    fn seek(
        &mut self,
        mut op: impl FnMut(&mut DiskReader) -> io::Result<DiskSeek>,
    ) -> Result<DiskSeek, End> {
        self.next_seq = None;
        let (count, first) = (self.readers.len(), self.current);
        let (mut oldest, mut beyond, mut removed) = (None::<u64>, false, None);
        for replica in (0..count).map(|k| (first + k) % count) {
            if self.passed_over(replica) {
                continue;
            }
            match op(&mut self.readers[replica]) {
                Ok(DiskSeek::At { seq, skip }) => {
                    self.failed_at[replica] = None;
                    self.current = replica;
                    self.next_seq = Some(seq);
                    return Ok(DiskSeek::At { seq, skip });
                }
                Ok(DiskSeek::Gone { first_position }) => {
                    oldest = Some(oldest.map_or(first_position, |o: u64| o.min(first_position)));
                }
                Ok(DiskSeek::Beyond) => beyond = true,
                // Retention took the segment between listing and reading it.
                Err(e) if e.kind() == io::ErrorKind::NotFound => removed = Some(e),
                Err(e) => self.fail(replica, &e),
            }
        }
        if let Some(first_position) = oldest {
            return Ok(DiskSeek::Gone { first_position });
        }
        if beyond {
            return Ok(DiskSeek::Beyond);
        }
        Err(match removed {
            Some(e) => Refusal::new(
                ErrorCode::PositionNotRetained,
                format!("the subscriber fell behind: retention removed the part of the log it was reading ({e}); subscribe again from a later position"),
            ),
            None => Refusal::new(
                ErrorCode::Internal,
                "no replica of the topic's log on disk can be read; the broker's log says why",
            ),
        }
        .into())
    }

    fn seek_position(&mut self, position: u64, durable: u64) -> Result<DiskSeek, End> {
        self.seek(|r| r.seek_position(position, durable))
    }

    /// Reads record `seq` as a delivery; `None` when it is not durable yet, or when the
    /// replica being read lost it and the next call is to look again.
    fn read(&mut self, seq: u64, durable: u64, order: u8) -> Result<Option<Planned>, End> {
        if seq >= durable {
            return Ok(None);
        }
        if self.next_seq != Some(seq) && !self.seek_record(seq, durable)? {
            return Ok(None);
        }
        let mut buf = self.spare.pop().unwrap_or_default();
        let h = match self.readers[self.current].next(durable, &mut buf) {
            Ok(Some(h)) => h,
            Ok(None) => {
                self.spare.push(buf);
                return Ok(None);
            }
            Err(e) => {
                // Removed by retention under the cursor (NotFound), or a failing
                // replica: seek again, on whichever replica still holds it.
                if e.kind() != io::ErrorKind::NotFound {
                    self.fail(self.current, &e);
                }
                self.next_seq = None;
                self.spare.push(buf);
                return Ok(None);
            }
        };
        if h.seq != seq {
            return Err(Refusal::new(
                ErrorCode::Internal,
                format!(
                    "replica {} returned record {} where {seq} was asked for",
                    self.current + 1,
                    h.seq
                ),
            )
            .into());
        }
        self.next_seq = Some(seq + 1);
        // `send_round` hands the kernel `payload_len` bytes from `ptr`: the buffer must
        // hold them all (the reader sized it from the record it checked).
        assert_eq!(
            buf.len(),
            h.payload_len as usize,
            "record {seq} read into a buffer of another length"
        );
        Ok(Some(disk_planned(&h, buf, order)))
    }

    /// Puts a replica's cursor on record `seq`; false when no replica has it yet (wait).
    /// A record no replica retains any more ends the subscription.
    fn seek_record(&mut self, seq: u64, durable: u64) -> Result<bool, End> {
        match self.seek(|r| r.seek_seq(seq, durable))? {
            DiskSeek::At { .. } => Ok(true),
            DiskSeek::Gone { first_position } => {
                Err(Refusal::new(
                    ErrorCode::PositionNotRetained,
                    format!("the subscriber fell behind: batch {seq} of the log is no longer retained; the first available position is {first_position}; subscribe again with --from {first_position}"),
                )
                .into())
            }
            DiskSeek::Beyond => Ok(false),
        }
    }

    /// Keeps the buffers of a sent round for the next disk reads.
    fn recycle(&mut self, plan: Vec<Planned>) {
        self.spare.extend(
            plan.into_iter()
                .filter_map(|p| p.owned)
                .take(MAX_BATCHES_PER_ROUND),
        );
        self.spare.truncate(MAX_BATCHES_PER_ROUND);
    }
}

// ------------------------------------------------------------------ orders 0 and 1

/// Finds the PBR slot of `broker` holding per-broker position `pos`.
fn locate_in_broker(region: &Region, topic: u32, broker: u32, pos: u64) -> Locate {
    let log = region.log(topic, broker);
    let frontier = log.written_frontier.load(Ordering::Acquire);
    let lo = log.reclaimed_pbr.load(Ordering::Acquire);
    if lo >= frontier {
        return locate_in_reclaimed_log(region, topic, broker, frontier, pos);
    }
    let start_of = |i: u64| {
        region
            .pbr_read(topic, broker, i)
            .map(|h| h.start_logical_offset)
    };
    let Some(first) = start_of(lo) else {
        return Locate::NotYet;
    };
    if pos < first {
        return Locate::Gone { first };
    }
    let (mut a, mut b) = (lo, frontier - 1);
    while a < b {
        let mid = a + (b - a).div_ceil(2);
        match start_of(mid) {
            Some(s) if s <= pos => a = mid,
            Some(_) => b = mid - 1,
            None => return Locate::NotYet,
        }
    }
    let Some(h) = region.pbr_read(topic, broker, a) else {
        return Locate::NotYet;
    };
    let n = if h.flags & BatchFlags::VALID != 0 {
        h.num_msg as u64
    } else {
        0
    };
    let start = h.start_logical_offset;
    if pos < start + n {
        Locate::At {
            index: a,
            skip: (pos - start) as u32,
        }
    } else if pos == start + n {
        Locate::At {
            index: a + 1,
            skip: 0,
        }
    } else {
        Locate::NotYet
    }
}

/// [`locate_in_broker`] for a log whose every written slot is reclaimed (`frontier`
/// is its written frontier): `pos` is gone, at the frontier, or not written yet.
fn locate_in_reclaimed_log(
    region: &Region,
    topic: u32,
    broker: u32,
    frontier: u64,
    pos: u64,
) -> Locate {
    let log = region.log(topic, broker);
    let msgs = log.frontier_msgs.load(Ordering::Acquire);
    // The service thread stores `frontier_msgs` before `written_frontier`, after the
    // slots it counts are committed. A committed slot at the frontier means `msgs`
    // may already count it: neither "gone below msgs" nor "starts at the frontier"
    // would hold then. The frontier moves over it shortly; look again then.
    if region.pbr_holds(topic, broker, frontier)
        || log.written_frontier.load(Ordering::Acquire) != frontier
    {
        return Locate::NotYet;
    }
    match pos.cmp(&msgs) {
        std::cmp::Ordering::Less => Locate::Gone { first: msgs },
        std::cmp::Ordering::Equal => Locate::At {
            index: frontier,
            skip: 0,
        },
        std::cmp::Ordering::Greater => Locate::NotYet,
    }
}

/// Where a subscription to an order 0 or 1 topic starts in `broker`'s log: the batch
/// index and messages to skip, `None` if the log has not reached `position` yet. A
/// position that is gone moves up to the first retained one where the subscriber asked
/// for that (`from_first`), else ends the subscription with PositionNotRetained.
fn locate_broker_start(
    region: &Region,
    topic: u32,
    broker: u32,
    positions: &mut [u64],
    from_first: bool,
) -> Result<Option<(u64, u32)>, End> {
    let b = broker as usize;
    loop {
        match locate_in_broker(region, topic, broker, positions[b]) {
            Locate::At { index, skip } => return Ok(Some((index, skip))),
            Locate::NotYet | Locate::Ahead => return Ok(None),
            Locate::Gone { first } => {
                let mut start = Start {
                    position: positions[b],
                    from_first,
                };
                if start.gone(first).is_err() {
                    return Err(not_retained_in_broker(
                        region, topic, broker, positions, first,
                    ));
                }
                positions[b] = start.position;
            }
        }
    }
}

/// The refusal of a per-broker start (orders 0 and 1) whose position in `broker`'s log
/// is gone: it names that log (the broker serving the subscription may be another) and
/// the `--from` to use, one position per broker, each log's gone one replaced by its
/// first retained one.
fn not_retained_in_broker(
    region: &Region,
    topic: u32,
    broker: u32,
    positions: &[u64],
    first: u64,
) -> End {
    let position = positions[broker as usize];
    let from: Vec<String> = (0..positions.len() as u32)
        .map(
            |b| match locate_in_broker(region, topic, b, positions[b as usize]) {
                _ if b == broker => first,
                Locate::Gone { first } => first,
                _ => positions[b as usize],
            },
        )
        .map(|p| p.to_string())
        .collect();
    let message = format!(
        "position {position} of broker {broker}'s log is no longer retained; that log's first available position is {first}; subscribe again with --from {} (one position per broker)",
        from.join(",")
    );
    Refusal::new(ErrorCode::PositionNotRetained, message).into()
}

/// Plans up to `limit` valid batches of `broker`'s log from `(i, skip)` into `plan`,
/// below its written frontier; returns where the next round continues. `position`
/// names the subscriber's place in that log for a refusal.
fn plan_broker_round(
    region: &Region,
    topic: u32,
    meta: &TopicMeta,
    (broker, (mut i, mut skip)): (u32, (u64, u32)),
    limit: usize,
    position: u64,
    plan: &mut Vec<Planned>,
) -> Result<(u64, u32), End> {
    let frontier = region
        .log(topic, broker)
        .written_frontier
        .load(Ordering::Acquire);
    let mut taken = 0;
    let mut next_position: Option<u64> = None;
    while i < frontier && taken < limit {
        let Some(h) = region.pbr_read(topic, broker, i) else {
            return Err(not_retained(position, None));
        };
        if h.flags & BatchFlags::VALID == 0 {
            i += 1;
            continue;
        }
        // The service thread numbers a log's valid batches one after another
        // (`advance_frontier`): a gap or an overlap here would skip or repeat messages
        // the subscriber's per-broker position counts.
        assert!(
            next_position.is_none_or(|p| p == h.start_logical_offset),
            "log ({topic}, {broker}): slot {i} starts at position {} where {next_position:?} follows",
            h.start_logical_offset
        );
        next_position = Some(h.start_logical_offset + h.num_msg as u64);
        if !retained(region, topic, broker, h.log_offset) {
            return Err(not_retained(h.start_logical_offset, None));
        }
        let Some(ptr) = region.blog_ptr(topic, broker, h.log_offset, h.total_size) else {
            return Err(not_retained(h.start_logical_offset, None));
        };
        plan.push(Planned {
            header: DeliveryHeader {
                batch_position: i,
                first_position: h.start_logical_offset,
                client_id: h.client_id,
                batch_seq: h.batch_seq,
                num_msg: h.num_msg,
                skip: skip.min(h.num_msg),
                broker_id: broker as u16,
                order: meta.order,
                payload_len: h.total_size as u32,
                session_epoch: h.session_epoch,
            },
            ptr,
            broker,
            log_offset: h.log_offset,
            token_index: i,
            owned: None,
        });
        skip = 0;
        taken += 1;
        i += 1;
    }
    Ok((i, skip))
}

/// The logs an order 0 or 1 subscription reads, one per broker.
struct PerBrokerLogs<'a> {
    region: &'a Region,
    topic: u32,
    meta: &'a TopicMeta,
    /// The subscriber asked for the beginning: a gone start moves up to the first
    /// retained position instead of being refused.
    from_first: bool,
}

impl PerBrokerLogs<'_> {
    /// The next round: up to `limit` batches of each broker's log from its cursor
    /// (`cursors`, located first from `positions` where not yet), cursors moved past them.
    fn plan_round(
        &self,
        cursors: &mut [Option<(u64, u32)>],
        positions: &mut [u64],
        limit: usize,
    ) -> Result<Vec<Planned>, End> {
        let (region, topic) = (self.region, self.topic);
        let mut plan = Vec::new();
        for broker in 0..cursors.len() as u32 {
            let c = &mut cursors[broker as usize];
            if c.is_none() {
                match locate_broker_start(region, topic, broker, positions, self.from_first)? {
                    Some(at) => *c = Some(at),
                    None => continue,
                }
            }
            let at = (broker, c.expect("located"));
            let position = positions[broker as usize];
            *c = Some(plan_broker_round(
                region, topic, self.meta, at, limit, position, &mut plan,
            )?);
        }
        Ok(plan)
    }
}

fn serve_per_broker(
    shared: &Shared,
    stream: &mut impl Outlet,
    topic: u32,
    meta: &TopicMeta,
    mut positions: Vec<u64>,
    from_first: bool,
) -> Result<(), End> {
    let region = &shared.region;
    let bell = region.topic_bell(topic);
    let mut idle = IdleWait::new(shared);
    let brokers = positions.len() as u32;
    // The hello's cursors were checked against the region's brokers (`read_cursors`):
    // a pin and a cursor per log, indexed by broker id below.
    assert_eq!(
        brokers,
        region.capacities().brokers,
        "one cursor per broker of the region"
    );
    let mut cursors: Vec<Option<(u64, u32)>> = vec![None; brokers as usize];
    let per_broker_limit = (MAX_BATCHES_PER_ROUND / brokers as usize).max(1);
    let pin = Pin::claim(region, topic, Claimant::of(shared, stream), &positions)?;
    while !shared.shutdown.load(Ordering::Relaxed) {
        let seen = bell.seen();
        still_there(region, topic, meta)?;
        pin.beat()?;
        let logs = PerBrokerLogs {
            region,
            topic,
            meta,
            from_first,
        };
        let plan = logs.plan_round(&mut cursors, &mut positions, per_broker_limit)?;
        // A start located higher than asked (the first retained position) is pinned.
        for (broker, &located) in positions.iter().enumerate() {
            pin.raise(broker as u32, located);
        }
        if plan.is_empty() {
            idle.wait(&bell, seen, stream)?;
            continue;
        }
        idle.reset();
        let confirmed = send_round(shared, stream, topic, false, &plan, false, &pin)?;
        // Without `resend_reclaimed` a round is confirmed whole or refused: the pins
        // below move past every batch of the plan, which must all have been sent.
        assert_eq!(
            confirmed,
            plan.len(),
            "a per-broker round is confirmed whole"
        );
        for p in &plan {
            let h = &p.header;
            // Not asserted to grow, unlike the global pin. It could once start behind
            // the subscriber's start (a start at the very end of a log paired with the
            // next round's count, fixed in `locate_in_broker`); asserting it is left
            // for a change that runs the fault campaign with the assertion on.
            pin.set(h.broker_id as u32, h.first_position + h.num_msg as u64);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_replication::store::{list_segments, SegmentFile};
    use embarcadero_replication::{RecordHeader, TopicStore};
    use std::path::Path;

    /// The service thread stores `frontier_msgs` before `written_frontier`. A start at
    /// the very end of a log whose written slots are all reclaimed, read between those
    /// two stores, must neither take the new count for where the log starts (refusing,
    /// or for a reader from the first retained position skipping, a batch that is still
    /// there) nor begin in that batch, before its start: it is not located until the
    /// frontier has moved, and then it is located in the batch.
    #[test]
    fn a_start_at_the_end_of_a_reclaimed_log_is_not_located_between_the_frontier_stores() {
        use embarcadero_region::{Capacities, TopicMeta};
        use embarcadero_wire::BatchHeader;
        let caps = Capacities {
            max_topics: 2,
            brokers: 1,
            goi_slots: 64,
            pbr_slots: 16,
            segment_bytes: 4096,
            segments_per_broker: 8,
            seg_map_slots: 16,
        };
        let dir = tempfile::tempdir().unwrap();
        let region = Region::create(&dir.path().join("r"), caps).unwrap();
        region.write_topic_meta(1, &TopicMeta::new("t", 0));
        let commit = |index: u64, num_msg: u32, start: u64| {
            let h = BatchHeader {
                flags: BatchFlags::VALID,
                pbr_index: index,
                log_offset: index * 64,
                total_size: 64,
                num_msg,
                topic_id: 1,
                ..Default::default()
            };
            region.pbr_commit(1, 0, index, &h);
            region.pbr_set_start_offset(1, 0, index, start);
        };
        let line = region.broker_line(1, 0);
        commit(0, 3, 0);
        line.frontier_msgs.store(3, Ordering::Release);
        line.written_frontier.advance(1, Ordering::Release);
        line.reclaimed_pbr.advance(1, Ordering::Release);
        assert_eq!(
            locate_in_broker(&region, 1, 0, 3),
            Locate::At { index: 1, skip: 0 }
        );
        assert_eq!(
            locate_in_broker(&region, 1, 0, 2),
            Locate::Gone { first: 3 }
        );
        // The next pass: slot 1 (positions 3 and 4) is counted, the frontier not moved.
        commit(1, 2, 3);
        line.frontier_msgs.store(5, Ordering::Release);
        assert_eq!(locate_in_broker(&region, 1, 0, 3), Locate::NotYet);
        assert_eq!(locate_in_broker(&region, 1, 0, 2), Locate::NotYet);
        line.written_frontier.advance(2, Ordering::Release);
        assert_eq!(
            locate_in_broker(&region, 1, 0, 3),
            Locate::At { index: 1, skip: 0 }
        );
        assert_eq!(
            locate_in_broker(&region, 1, 0, 4),
            Locate::At { index: 1, skip: 1 }
        );
        assert_eq!(
            locate_in_broker(&region, 1, 0, 2),
            Locate::Gone { first: 3 }
        );
    }

    /// A round's bytes go out at most a MiB per `writev`, with the pin beaten after
    /// each, so a subscriber that reads slowly but steadily never looks stalled in the
    /// middle of a long round; and every byte arrives, in order.
    #[test]
    fn a_long_write_reports_progress_at_least_every_mib() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            client.read_to_end(&mut got).unwrap();
            got
        });
        let head = [1u8; 10];
        let payload: Vec<u8> = (0..3 * MAX_BYTES_PER_WRITE + 5)
            .map(|i| (i % 251) as u8)
            .collect();
        let tail = [2u8; 7];
        let mut iov: Vec<libc::iovec> = [&head[..], &payload[..], &tail[..]]
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.as_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        let mut calls = 0;
        let mut progress = || {
            calls += 1;
            Ok(())
        };
        assert!(writev_all(&server, &mut iov, &mut progress).is_ok());
        drop(server);
        let got = reader.join().unwrap();
        let want: Vec<u8> = [&head[..], &payload[..], &tail[..]].concat();
        assert!(got == want, "every byte, in order");
        assert!(calls >= 4, "{calls} beats for 3 MiB and a bit");
    }

    /// The same `records` records (100 bytes of the record's index each) in every
    /// directory, in segments of about 400 bytes; returns the durable frontier.
    fn write_replicas(dirs: &[&Path], records: u64) -> u64 {
        let mut durable = 0;
        for dir in dirs {
            let mut store = TopicStore::open(dir, 400).unwrap();
            for i in 0..records {
                let payload = vec![i as u8; 100];
                let h = RecordHeader {
                    seq: store.next_seq(),
                    total_order: store.next_position(),
                    num_msg: 1,
                    payload_len: payload.len() as u32,
                    payload_crc: crc32fast::hash(&payload),
                    ..Default::default()
                };
                store.append(&h, &payload).unwrap();
                // A segment is closed at a sync once it holds its target size.
                store.sync().unwrap();
            }
            durable = store.durable_seq();
        }
        assert_eq!(durable, records);
        durable
    }

    fn disk_log(dirs: &[&Path]) -> DiskLog {
        DiskLog {
            readers: dirs.iter().map(|d| DiskReader::new(d)).collect(),
            failed_at: vec![None; dirs.len()],
            current: 0,
            next_seq: None,
            spare: Vec::new(),
        }
    }

    /// The first payload byte of record `seq`, `None` if the log says "look again".
    fn read(log: &mut DiskLog, seq: u64, durable: u64) -> Option<u8> {
        let planned = log
            .read(seq, durable, 2)
            .unwrap_or_else(|_| panic!("record {seq} refused"));
        planned.map(|p| p.owned.expect("read from disk")[0])
    }

    fn segments(dir: &Path) -> Vec<SegmentFile> {
        list_segments(dir).unwrap()
    }

    /// Retention's deletion of a segment: renamed out of the log's names, then shortened
    /// (then unlinked, which changes nothing for a reader that has it open).
    fn retention_takes(segment: &Path) {
        let deleting = segment.with_extension("del");
        std::fs::rename(segment, &deleting).unwrap();
        let file = std::fs::File::options()
            .write(true)
            .open(&deleting)
            .unwrap();
        file.set_len(0).unwrap();
    }

    /// `read`, once more if the log says to look again.
    fn read_on(log: &mut DiskLog, seq: u64, durable: u64) -> Option<u8> {
        read(log, seq, durable).or_else(|| read(log, seq, durable))
    }

    #[test]
    fn a_segment_retention_takes_from_under_the_reader_is_read_from_another_replica() {
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dirs = [one.path(), two.path()];
        let durable = write_replicas(&dirs, 12);
        let (of_one, of_two) = (segments(one.path()), segments(two.path()));
        assert!(of_one.len() > 3, "{of_one:?}");
        let mut log = disk_log(&dirs);
        assert_eq!(read(&mut log, 0, durable), Some(0));
        assert_eq!(log.current, 0, "replica 1 first");
        // Replica 1's retention takes the segment being read: on to replica 2.
        retention_takes(&of_one[0].path);
        assert_eq!(read_on(&mut log, 1, durable), Some(1));
        assert_eq!(log.current, 1);
        // On from replica 2, up to the first record of its second segment.
        let in_second = (2..durable)
            .find(|&seq| {
                assert_eq!(read(&mut log, seq, durable), Some(seq as u8));
                segment_of(&of_two, seq) == 1
            })
            .expect("replica 2 has a second segment");
        assert_eq!(segment_of(&of_two, in_second + 1), 1, "{of_two:?}");
        // Replica 2's retention takes its two oldest segments, the second while it is
        // read: back to replica 1, which still holds that one.
        std::fs::remove_file(&of_two[0].path).unwrap();
        retention_takes(&of_two[1].path);
        assert_eq!(
            read_on(&mut log, in_second + 1, durable),
            Some(in_second as u8 + 1)
        );
        assert_eq!(log.current, 0);
        for seq in in_second + 2..durable {
            assert_eq!(read(&mut log, seq, durable), Some(seq as u8));
        }
        assert!(
            log.failed_at.iter().all(Option::is_none),
            "retention is not a failure"
        );
    }

    #[test]
    fn a_replica_that_failed_a_read_is_read_again_after_a_while() {
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dirs = [one.path(), two.path()];
        let durable = write_replicas(&dirs, 12);
        let of_one = segments(one.path());
        // The last byte of replica 1's first segment: its last record's payload.
        let last = of_one[1].first_seq - 1;
        let flip_last_byte = |path: &Path| {
            let mut bytes = std::fs::read(path).unwrap();
            *bytes.last_mut().unwrap() ^= 0xff;
            std::fs::write(path, bytes).unwrap();
        };
        flip_last_byte(&of_one[0].path);
        let mut log = disk_log(&dirs);
        for seq in 0..last {
            assert_eq!(read(&mut log, seq, durable), Some(seq as u8));
        }
        // A checksum failure: replica 2 serves the record.
        assert_eq!(read_on(&mut log, last, durable), Some(last as u8));
        assert_eq!(log.current, 1);
        assert!(log.passed_over(0));
        // The fault passes, and later replica 2 loses everything past its open segment.
        flip_last_byte(&of_one[0].path);
        for segment in segments(two.path()) {
            std::fs::remove_file(&segment.path).unwrap();
        }
        log.failed_at[0] = Some(Instant::now() - REPLICA_RETRY_AFTER);
        assert!(!log.passed_over(0), "its time is up");
        for seq in last + 1..durable {
            assert_eq!(read_on(&mut log, seq, durable), Some(seq as u8));
        }
        assert_eq!(log.current, 0, "replica 1 is read again");
        assert_eq!(log.failed_at[0], None);
    }

    /// Which of `segments` (oldest first) holds record `seq`.
    fn segment_of(segments: &[SegmentFile], seq: u64) -> usize {
        segments.iter().rposition(|s| s.first_seq <= seq).unwrap()
    }

    #[test]
    fn a_replica_that_lacks_a_reclaimed_position_is_not_waited_for() {
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dirs = [one.path(), two.path()];
        let durable = write_replicas(&dirs, 12);
        // Replica 1's retention took its oldest segments; replica 2 was emptied by hand.
        for segment in segments(one.path())[..2]
            .iter()
            .chain(&segments(two.path()))
        {
            std::fs::remove_file(&segment.path).unwrap();
        }
        let mut log = disk_log(&dirs);
        assert!(matches!(
            log.seek_position(0, durable),
            Ok(DiskSeek::Gone { .. })
        ));
        assert!(log.read(0, durable, 2).is_err(), "refused, not waited for");
    }

    #[test]
    fn a_position_no_replica_keeps_names_the_oldest_any_replica_keeps() {
        let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dirs = [one.path(), two.path()];
        let durable = write_replicas(&dirs, 12);
        let (of_one, of_two) = (segments(one.path()), segments(two.path()));
        for segment in of_one[..3].iter().chain(&of_two[..1]) {
            std::fs::remove_file(&segment.path).unwrap();
        }
        let mut log = disk_log(&dirs);
        let Ok(DiskSeek::Gone { first_position }) = log.seek_position(0, durable) else {
            panic!("position 0 is on neither replica");
        };
        let oldest = of_two[1].first_position;
        assert_eq!(first_position, oldest, "replica 2 keeps more");
        // And from there replica 2 serves it.
        assert!(matches!(
            log.seek_position(oldest, durable),
            Ok(DiskSeek::At { skip: 0, .. })
        ));
        assert_eq!(log.current, 1);
    }
}
