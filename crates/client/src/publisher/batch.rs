//! Batch building: messages appended in their final wire form into the open batch,
//! sealed by size, by their queue's sender when the linger runs out, or by the backstop.
//! Over a shared-memory channel the open batch is built in place, in a span of the
//! channel's ring ([`RingBatch`]), so its bytes are written once; elsewhere in a pooled
//! buffer that the sender copies into a socket or ring.

use super::*;
use crate::shm::{LentSpan, ShmLink};

/// Room past `batch_bytes` in a lent span: a batch seals once it reaches `batch_bytes`,
/// so its last message may run past by up to its own size; a message that does not fit
/// seals the batch early (and one larger than this never opens a span).
const LEND_SLACK: usize = 64 * 1024;

/// Where a batch's bytes (its messages; the batch header is written when it is sent)
/// are.
pub(super) enum Bytes {
    Heap(Vec<u8>),
    /// Boxed: a span's bookkeeping would make every `Sealed` three times larger.
    Ring(Box<RingBatch>),
}

impl Bytes {
    pub(super) fn len(&self) -> usize {
        match self {
            Bytes::Heap(v) => v.len(),
            Bytes::Ring(r) => r.len,
        }
    }

    /// Copies a ring batch out into a buffer of its own, giving its span back: for a
    /// batch that goes out through another connection, or again (a resend).
    pub(super) fn detach(&mut self) {
        if let Bytes::Ring(r) = self {
            *self = Bytes::Heap(r.read_out());
        }
    }
}

/// A batch built in place in a span of a channel's data ring: `BATCH_HEADER_LEN` bytes
/// left for its header, then `len` bytes of messages. Committed by its connection's
/// sender (the header written, the ring's tail moved past it); kept unoverwritten until
/// dropped (acknowledged), so a resend can copy it; dropped uncommitted, cancelled.
pub(super) struct RingBatch {
    pub(super) link: Arc<ShmLink>,
    /// `None` only while being dropped.
    lent: Option<LentSpan>,
    pub(super) len: usize,
}

/// Most bytes ahead of the message just written that [`RingBatch::push`] asks the CPU
/// to fetch for writing: a few lines more than a message of 1 KiB, so that a large
/// message does not issue a prefetch per line of its successor (the hardware's own
/// prefetcher follows a long copy).
const PREFETCH_AHEAD_MAX: usize = 2048;

impl RingBatch {
    /// Appends one message: its encoded header, its payload, zeros up to `stride`.
    fn push(&mut self, header: &[u8; MESSAGE_HEADER_LEN], payload: &[u8], stride: usize) {
        const ZEROS: [u8; 64] = [0; 64];
        let span = &mut self.lent.as_mut().expect("a live ring batch").span;
        let at = BATCH_HEADER_LEN + self.len;
        span.write_at(at, header);
        span.write_at(at + MESSAGE_HEADER_LEN, payload);
        let pad = stride - MESSAGE_HEADER_LEN - payload.len();
        span.write_at(at + MESSAGE_HEADER_LEN + payload.len(), &ZEROS[..pad]);
        // The next message of this size goes right after: its lines are fetched while
        // the caller makes it, not at its copy (+19% publish over shm, session 30).
        span.prefetch_for_write(at + stride, stride.min(PREFETCH_AHEAD_MAX));
        self.len += stride;
    }

    /// Room for messages in the span.
    fn capacity(&self) -> usize {
        self.lent.as_ref().expect("a live ring batch").span.limit() - BATCH_HEADER_LEN
    }

    /// Publishes the batch through `link` with `header` if it is the link's span lent
    /// out now; `false` otherwise (the caller copies it).
    pub(super) fn commit(&mut self, link: &Arc<ShmLink>, header: &[u8]) -> bool {
        let lent = self.lent.as_mut().expect("a live ring batch");
        Arc::ptr_eq(link, &self.link) && link.commit(lent, BATCH_HEADER_LEN + self.len, header)
    }

    fn read_out(&self) -> Vec<u8> {
        let lent = self.lent.as_ref().expect("a live ring batch");
        lent.span.read_out(BATCH_HEADER_LEN, self.len)
    }
}

impl Drop for RingBatch {
    fn drop(&mut self) {
        if let Some(lent) = self.lent.take() {
            let id = lent.id;
            // Given back first, so a sender that sees the hint cleared finds it so.
            drop(lent);
            self.link.clear_lent(id);
        }
    }
}

pub(super) struct Sealed {
    /// Order 5: the session sequence, assigned at seal; otherwise the sender numbers
    /// batches per connection.
    pub(super) seq: Option<u64>,
    pub(super) buf: Bytes,
    pub(super) num_msg: u32,
    pub(super) sealed_at: Instant,
    /// When the batch's first message was published (its due time, if it was published
    /// with [`Publisher::publish_due`]): the start of its append-to-ack latency.
    pub(super) first_at: Instant,
    /// Each message's due time, when every message was published with
    /// [`Publisher::publish_due`]: each message's append-to-ack latency runs from its own
    /// due time, as the peers' load generators count it. Empty otherwise.
    pub(super) dues: Vec<Instant>,
    pub(super) batch_id: u64,
    /// Position in seal order (0 for the first batch this publisher sealed).
    pub(super) index: u64,
}

pub(super) struct InFlight {
    pub(super) seq: u64,
    pub(super) batch: Sealed,
}

pub(super) struct Builder {
    /// The open batch's messages, unless it is built in a ring (`ring`).
    pub(super) buf: Vec<u8>,
    /// The open batch, when it is built in place in a channel's ring.
    pub(super) ring: Option<Box<RingBatch>>,
    pub(super) num_msg: u32,
    /// When the open batch's first message was appended (the linger runs from here).
    pub(super) first_at: Option<Instant>,
    /// The wall clock at that moment: every message of the batch carries it.
    pub(super) opened_ns: u64,
    /// The due time its first message was published with, if any (latency only).
    pub(super) first_due: Option<Instant>,
    /// Every message's due time while all of them have one (see [`Sealed::dues`]).
    pub(super) dues: Vec<Instant>,
    /// The last batch was sealed when its linger ran out, not by size: the load is
    /// light, so the next batch's sender is woken to time its linger.
    pub(super) lingered_last: bool,
    pub(super) round_robin: usize,
    /// Messages appended so far: the next message's `counter`, and the publisher's
    /// `messages` statistic (one count for both). Plain fields under the builder's lock,
    /// which every append holds anyway, rather than three atomic adds per message.
    pub(super) messages: u64,
    /// Payload bytes appended so far (the `bytes` statistic).
    pub(super) bytes: u64,
}

impl Builder {
    /// Bytes of messages in the open batch.
    pub(super) fn len(&self) -> usize {
        self.ring.as_ref().map_or(self.buf.len(), |r| r.len)
    }

    /// Appends one message to the open batch, written once in its final form (no
    /// zero-fill first): in its ring span, or its buffer.
    fn push(&mut self, header: &[u8; MESSAGE_HEADER_LEN], payload: &[u8], stride: usize) {
        if let Some(ring) = &mut self.ring {
            ring.push(header, payload, stride);
        } else {
            let end = self.buf.len() + stride;
            self.buf.extend_from_slice(header);
            self.buf.extend_from_slice(payload);
            self.buf.resize(end, 0);
        }
    }

    /// Most bytes of messages the open batch can hold.
    fn capacity(&self, max_batch: usize) -> usize {
        self.ring.as_ref().map_or(max_batch, |r| r.capacity())
    }

    /// An empty builder whose buffer holds a batch of `batch_bytes` without growing.
    pub(super) fn new(batch_bytes: usize) -> Self {
        Self {
            buf: Vec::with_capacity(batch_bytes + MESSAGE_HEADER_LEN * 2),
            ring: None,
            num_msg: 0,
            first_at: None,
            opened_ns: 0,
            first_due: None,
            dues: Vec::new(),
            lingered_last: true,
            round_robin: 0,
            messages: 0,
            bytes: 0,
        }
    }
}

impl Publisher {
    pub(super) fn append(&self, payload: &[u8], due: Option<Instant>) -> Result<()> {
        let inner = &self.inner;
        inner.check_append(payload)?;
        let mut b = inner.builder.lock();
        inner.append_locked(&mut b, payload, due)
    }

    /// Appends `payloads` in order under one hold of the builder's lock: no sender can
    /// seal the open batch between two of them, so they travel in one batch (and one
    /// append at the broker) unless they do not fit in one. Each is checked before any
    /// is appended, so a payload that is too large appends none.
    pub(super) fn append_all(&self, payloads: &[&[u8]]) -> Result<()> {
        let inner = &self.inner;
        for payload in payloads {
            inner.check_append(payload)?;
        }
        let mut b = inner.builder.lock();
        for payload in payloads {
            inner.append_locked(&mut b, payload, None)?;
        }
        Ok(())
    }

    /// As [`Self::append_all`], but never waits: appends `payloads` in order until the
    /// next would have to wait (for a queue with room to seal the full open batch into,
    /// or for the builder, which a thread sealing may hold while it waits), and returns
    /// how many it appended; the caller hands the rest to a call that may wait. For an
    /// event loop (the Node binding's `publish` and `publishMany`): it copies messages
    /// into their batch itself instead of into a staging area for a thread to copy again.
    pub(super) fn try_append_all(&self, payloads: &[&[u8]]) -> Result<usize> {
        let inner = &self.inner;
        for payload in payloads {
            inner.check_append(payload)?;
        }
        let Some(mut b) = inner.builder.try_lock() else {
            return Ok(0);
        };
        let mut appended = 0;
        for payload in payloads {
            if !inner.try_append_locked(&mut b, payload)? {
                break;
            }
            appended += 1;
        }
        assert!(appended <= payloads.len());
        Ok(appended)
    }
}

impl Inner {
    /// Whether a message may be appended now: open, no connection failed, not too large.
    fn check_append(&self, payload: &[u8]) -> Result<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        if self.any_failed.load(Ordering::Relaxed) {
            self.first_error()?;
        }
        if payload.len() > self.max_message {
            return Err(Error::MessageTooLarge {
                size: payload.len(),
                max: self.max_message,
            });
        }
        Ok(())
    }

    /// Appends one checked message to the open batch (see [`Inner::check_append`]).
    fn append_locked(&self, b: &mut Builder, payload: &[u8], due: Option<Instant>) -> Result<()> {
        let stride = message_stride(payload.len() as u64) as usize;
        if b.num_msg > 0 && b.len() + stride > b.capacity(self.max_batch) {
            self.seal(b)?;
        }
        if b.num_msg == 0 {
            let ring = self.lend_for(&mut b.round_robin, stride);
            self.start_batch(b, ring, due);
        }
        self.write_message(b, payload, stride, due)?;
        if b.len() >= self.config.batch_bytes {
            self.seal(b)?;
        }
        Ok(())
    }

    /// As [`Inner::append_locked`] (no schedule), but never waits: `false`, appending
    /// nothing, when the open batch is due to be sealed and no queue it may go to has room
    /// now. A batch is opened in a span only if one is lent at once, else in a buffer; one
    /// that reaches its size while no queue has room stays open for the next append (or
    /// its sender's linger) to seal.
    fn try_append_locked(&self, b: &mut Builder, payload: &[u8]) -> Result<bool> {
        let stride = message_stride(payload.len() as u64) as usize;
        let full =
            b.len() >= self.config.batch_bytes || b.len() + stride > b.capacity(self.max_batch);
        if b.num_msg > 0 && full {
            if !self.may_dispatch_now(b.round_robin) {
                return Ok(false);
            }
            self.seal(b)?;
        }
        if b.num_msg == 0 {
            let payload_room = self.max_batch.min(self.config.batch_bytes + LEND_SLACK);
            let ring = (self.config.transport != Transport::Tcp && stride <= payload_room)
                .then(|| self.lend_round(&mut b.round_robin, payload_room).ok())
                .flatten();
            self.start_batch(b, ring, None);
        }
        self.write_message(b, payload, stride, None)?;
        if b.len() >= self.config.batch_bytes && self.may_dispatch_now(b.round_robin) {
            self.seal(b)?;
        }
        Ok(true)
    }

    /// Writes one message (header and payload) into the open batch.
    fn write_message(
        &self,
        b: &mut Builder,
        payload: &[u8],
        stride: usize,
        due: Option<Instant>,
    ) -> Result<()> {
        let header = BlogMessageHeader {
            size: payload.len() as u32,
            publish_ts_ns: publish_ts_ns(b, due),
            counter: b.messages,
            client_id: self.client_id,
            ..Default::default()
        };
        let mut encoded = [0u8; MESSAGE_HEADER_LEN];
        header.encode_into(&mut encoded);
        b.push(&encoded, payload, stride);
        b.num_msg += 1;
        if b.num_msg == 1 {
            self.start_linger(b, due);
        }
        track_due(b, due);
        b.messages += 1;
        b.bytes += payload.len() as u64;
        // One writer (the builder's holder): plain stores, read by `stats`.
        self.appended[0].store(b.messages, Ordering::Relaxed);
        self.appended[1].store(b.bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Opens a batch for a first message: in `ring`, a span of a channel's ring, if one
    /// was lent, and with the opening time every message of it carries.
    #[inline]
    fn start_batch(&self, b: &mut Builder, ring: Option<Box<RingBatch>>, due: Option<Instant>) {
        debug_assert!(b.ring.is_none() && b.buf.is_empty() && b.num_msg == 0);
        b.ring = ring;
        // One clock read per batch, not per message: a read costs 100+ ns where the
        // kernel cannot serve it from the vDSO (this project's VMs), which was 9% of
        // a publish-only run. Every message carries its batch's opening time, which
        // overstates its end-to-end latency by at most the batch's linger; on a fixed
        // schedule, the first message's due time, so end-to-end latency does not
        // excuse a late publish either.
        let late = due.map_or(0, |d| d.elapsed().as_nanos() as u64);
        b.opened_ns = now_ns().saturating_sub(late);
    }

    /// The batch's first message was appended: its linger starts now, and the sender of
    /// the queue it is due on learns its deadline.
    #[inline]
    fn start_linger(&self, b: &mut Builder, due: Option<Instant>) {
        let now = Instant::now();
        b.first_at = Some(now);
        b.first_due = due.map(|d| d.min(now));
        b.dues.clear();
        // The sender of the queue this batch is due on times its linger.
        // (Past `OpenBatch`'s 16 bits of queue index, only the backstop seals.)
        if let Some(owner) = self
            .live_queue_from(b.round_robin)
            .filter(|&o| o < OpenBatch::MAX_OWNER)
        {
            let open = OpenBatch {
                owner,
                deadline: now + self.config.linger,
            };
            self.open_batch
                .store(open.encode(self.created), Ordering::Release);
            // Under load batches fill before their linger runs out and the wake-up
            // would be wasted: each idle sender looks at the open batch anyway
            // before it waits, and at least every `SENDER_IDLE_WAIT`.
            if b.lingered_last {
                let _ = self.queues[owner].wake.0.try_send(());
            }
        }
    }
}

/// The publish timestamp of the message being appended to the open batch: the batch's
/// opening time. On a schedule, each message carries its own due time (the batch's
/// opening time plus its offset in the schedule, so still no clock read).
#[inline]
fn publish_ts_ns(b: &Builder, due: Option<Instant>) -> u64 {
    match (due, b.first_due) {
        (Some(due), Some(first)) if b.num_msg > 0 => {
            b.opened_ns + due.saturating_duration_since(first).as_nanos() as u64
        }
        _ => b.opened_ns,
    }
}

/// Keeps [`Builder::dues`] for the message just appended (`b.num_msg` counts it): its
/// due time while every message of the batch has one.
#[inline]
fn track_due(b: &mut Builder, due: Option<Instant>) {
    match due {
        Some(due) if b.dues.len() + 1 == b.num_msg as usize => {
            let due = due.max(b.first_due.expect("set by the batch's first message"));
            b.dues.push(due);
        }
        // A message without a due time: the batch falls back to its first message's.
        _ => b.dues.clear(),
    }
}

/// Longest a batch opening waits for a sender to catch up so that it can be built in
/// place (never longer than the publisher's linger, so a linger of 0 never waits). A
/// batch built in a buffer instead costs one more copy of every byte (the sender's),
/// and under load it keeps that sender busy copying, so the next batches cannot be lent
/// a span either (PERFORMANCE "Session 24": 29-48% of batches built in place at full
/// speed without waiting). A sender commits a batch in place in microseconds; a wait
/// this long covers a buffer batch's copy or a sender's wake-up.
pub(super) const LEND_PATIENCE: Duration = Duration::from_micros(200);

/// Why a queue lent no span for the batch opening now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoSpan {
    /// Its sender holds a batch sealed before, or one waits in its channel: it may lend
    /// once the sender has written that.
    SenderBusy,
    /// Not a channel, or it cannot lend for a while (a resend, moved batches, the
    /// in-flight limit, no room, lending held).
    Unavailable,
}

impl Inner {
    /// A span of a channel's ring for the batch opening now to be built in place: of
    /// the queue round-robin names (`due`), or, with deflection, of the next live one
    /// that can lend, which the batch is then due on (`due` is moved there, and the
    /// named queue counts it deflected). When the only obstacle is a sender still busy
    /// with an earlier batch, waits for the senders' progress, for at most
    /// [`LEND_PATIENCE`] and never longer than the linger. `None` when none can: the
    /// batch is built in a buffer. `stride`: its first message's.
    pub(super) fn lend_for(&self, due: &mut usize, stride: usize) -> Option<Box<RingBatch>> {
        if self.config.transport == Transport::Tcp {
            return None;
        }
        let payload = self.max_batch.min(self.config.batch_bytes + LEND_SLACK);
        if stride > payload {
            return None;
        }
        let deadline = Instant::now() + LEND_PATIENCE.min(self.config.linger);
        loop {
            let busy = match self.lend_round(due, payload) {
                Ok(ring) => return Some(ring),
                Err(NoSpan::SenderBusy) => true,
                Err(NoSpan::Unavailable) => false,
            };
            let now = Instant::now();
            if !busy || now >= deadline || self.closed.load(Ordering::Relaxed) {
                return None;
            }
            // Woken by every batch a sender writes (and every ack). A notice that came
            // between the round and this wait is missed: the next one, or the deadline,
            // ends the wait.
            let mut g = self.progress.0.lock();
            self.progress.1.wait_for(&mut g, deadline - now);
        }
    }

    /// One look at the queues for a span, from the one `due` names (only that one
    /// without deflection). The error is [`NoSpan::SenderBusy`] if any queue refused
    /// only for that.
    fn lend_round(&self, due: &mut usize, payload: usize) -> Result<Box<RingBatch>, NoSpan> {
        let n = self.queues.len();
        let tries = if self.config.deflect { n } else { 1 };
        let mut why = NoSpan::Unavailable;
        for i in 0..tries {
            let index = (*due + i) % n;
            if !self.queues[index].is_live() {
                continue;
            }
            match self.lend_from(index, payload) {
                Ok(ring) => {
                    if index != *due && self.queues[*due].is_live() {
                        self.queues[*due].deflected.fetch_add(1, Ordering::Relaxed);
                    }
                    *due = index;
                    return Ok(ring);
                }
                Err(NoSpan::SenderBusy) => why = NoSpan::SenderBusy,
                Err(NoSpan::Unavailable) => {}
            }
        }
        Err(why)
    }

    /// A span of `BATCH_HEADER_LEN + payload` bytes of queue `index`'s ring, when its
    /// connection is a channel whose sender has nothing else to write first (a batch in
    /// its hands, its channel, its moved batches, a resend) and may take one more batch
    /// in flight. The hand is held while the span is lent, so the sender takes nothing
    /// between the look and the lending.
    fn lend_from(&self, index: usize, payload: usize) -> Result<Box<RingBatch>, NoSpan> {
        let q = &self.queues[index];
        let link = match &*q.stream.lock() {
            Link::Shm(link) => link.clone(),
            Link::Tcp(_) => return Err(NoSpan::Unavailable),
        };
        let Some(_hand) = q.hand.try_lock() else {
            return Err(NoSpan::SenderBusy);
        };
        if !q.rx.is_empty() {
            return Err(NoSpan::SenderBusy);
        }
        if q.conn.resend_from.load(Ordering::Acquire) != u64::MAX
            || !q.moved.lock().is_empty()
            || (self.config.ack_level > 0
                && q.conn.unacked.lock().len() >= self.config.max_inflight_batches)
        {
            return Err(NoSpan::Unavailable);
        }
        let lent = link
            .lend(BATCH_HEADER_LEN + payload)
            .ok_or(NoSpan::Unavailable)?;
        q.in_place.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(RingBatch {
            link,
            lent: Some(lent),
            len: 0,
        }))
    }
}

impl Inner {
    /// Hands the open batch to a queue: round-robin, deflecting past full queues,
    /// blocking only when every queue is full.
    pub(super) fn seal(&self, b: &mut Builder) -> Result<()> {
        let (sealed, due) = self.take_sealed(b);
        self.dispatch(sealed, due)
    }

    /// Takes the open batch out of the builder as a sealed batch, with the queue it is
    /// due on (round-robin).
    pub(super) fn take_sealed(&self, b: &mut Builder) -> (Sealed, usize) {
        let now = Instant::now();
        b.lingered_last = b.first_at.is_some_and(|f| now >= f + self.config.linger);
        let buf = match b.ring.take() {
            Some(ring) => Bytes::Ring(ring),
            None => {
                let fresh = self.pool.1.try_recv().unwrap_or_else(|_| {
                    Vec::with_capacity(self.config.batch_bytes + MESSAGE_HEADER_LEN * 2)
                });
                Bytes::Heap(std::mem::replace(&mut b.buf, fresh))
            }
        };
        let seq = self
            .session
            .as_ref()
            .map(|session| session.next_seq.fetch_add(1, Ordering::Relaxed));
        let index = {
            let mut outstanding = self.outstanding.lock();
            let index = self.batches.fetch_add(1, Ordering::AcqRel);
            outstanding.insert(index);
            index
        };
        let sealed = Sealed {
            seq,
            buf,
            num_msg: b.num_msg,
            sealed_at: now,
            first_at: b.first_due.or(b.first_at).unwrap_or_else(Instant::now),
            dues: {
                let capacity = b.dues.len();
                std::mem::replace(&mut b.dues, Vec::with_capacity(capacity))
            },
            batch_id: self.next_batch_id.fetch_add(1, Ordering::Relaxed),
            index,
        };
        b.num_msg = 0;
        b.first_at = None;
        self.open_batch.store(0, Ordering::Release);
        self.backstop_armed.store(false, Ordering::Relaxed);
        b.first_due = None;
        let due = b.round_robin;
        b.round_robin = (due + 1) % self.queues.len();
        (sealed, due)
    }

    /// For queue `index`'s idle sender: the open batch, sealed, if it is due on this
    /// queue and its linger has run out (counted as dispatched here under the builder's
    /// lock, so `flush` never sees it nowhere); else when to look again.
    pub(super) fn linger_for(&self, index: usize) -> Linger {
        // Most calls end here, without the lock the producer takes for every message.
        match OpenBatch::decode(self.open_batch.load(Ordering::Acquire), self.created) {
            Some(open) if open.owner == index => {
                if Instant::now() < open.deadline {
                    return Linger::Until(open.deadline);
                }
            }
            // Its owner died after it opened: the next live queue takes it over (below).
            Some(open) if !self.queues[open.owner].is_live() => {}
            _ => return Linger::NotDue,
        }
        // Never wait long for the builder: a producer blocked in `dispatch` (every queue
        // full) holds it until a sender makes room, so a sender that waited here would
        // deadlock with it.
        let Some(mut b) = self.builder.try_lock_for(BUILDER_WAIT) else {
            return Linger::Busy;
        };
        let Some(first) = b.first_at else {
            return Linger::NotDue;
        };
        if self.live_queue_from(b.round_robin) != Some(index) {
            return Linger::NotDue;
        }
        let deadline = first + self.config.linger;
        if Instant::now() < deadline {
            return Linger::Until(deadline);
        }
        // A batch sealed earlier waits in this queue's channel (every dispatch happens
        // under the builder's lock, so this cannot change while it is held): written
        // now, this one would overtake it. Take that one first.
        if !self.queues[index].rx.is_empty() {
            return Linger::Busy;
        }
        let (sealed, _) = self.take_sealed(&mut b);
        let q = &self.queues[index];
        q.dispatched.fetch_add(1, Ordering::Release);
        q.lingered.fetch_add(1, Ordering::Relaxed);
        Linger::Sealed(sealed)
    }

    /// For a sender about to wait at its in-flight limit: if the open batch is due on
    /// its queue, the backstop seals it on time instead (and dispatch deflects it from a
    /// full queue), so a slow broker's batches do not grow past their linger.
    pub(super) fn arm_backstop_if_owner(&self, index: usize) {
        let open = OpenBatch::decode(self.open_batch.load(Ordering::Acquire), self.created);
        if open.is_some_and(|o| o.owner == index)
            && !self.backstop_armed.swap(true, Ordering::Relaxed)
        {
            self.backstop_wake.notify_all();
        }
    }
}

/// Seals a batch that its queue's sender did not take when its linger ran out (the
/// sender was writing, waiting for acknowledgements, or gone), `linger_backstop` later.
/// Normally a batch is sealed by that sender itself ([`Inner::linger_for`]).
pub(super) fn linger_backstop(inner: Arc<Inner>) {
    let mut b = inner.builder.lock();
    while !inner.closed.load(Ordering::Relaxed) {
        let late = if inner.backstop_armed.load(Ordering::Relaxed) {
            inner.config.linger
        } else {
            inner.config.linger + inner.config.linger_backstop
        };
        match b.first_at {
            Some(first) if Instant::now() >= first + late => {
                if inner.seal(&mut b).is_err() {
                    return;
                }
            }
            Some(first) => {
                let wait = (first + late).saturating_duration_since(Instant::now());
                inner.backstop_wake.wait_for(&mut b, wait);
            }
            // Not woken when a batch opens (its sender is): looks again this often.
            None => {
                inner
                    .backstop_wake
                    .wait_for(&mut b, inner.config.linger_backstop);
            }
        }
    }
}

/// What an idle sender does about the open batch (see [`Inner::linger_for`]).
pub(super) enum Linger {
    /// Due on this queue and lingered out: the sender writes it.
    Sealed(Sealed),
    /// Due on this queue; its linger runs out then.
    Until(Instant),
    /// No open batch, or it is due on another queue.
    NotDue,
    /// The builder is held (by the producer, appending or waiting for room), or a batch
    /// sealed earlier waits in this queue's channel: look again soon, meanwhile taking
    /// what the channel brings.
    Busy,
}

/// The open batch as the senders see it: packed into one `u64` (the deadline in whole
/// microseconds since the publisher was created, rounded up, above 16 bits of queue
/// index + 1), so a sender can read it without the builder's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OpenBatch {
    pub(super) owner: usize,
    pub(super) deadline: Instant,
}

impl OpenBatch {
    /// Queue indexes from here on do not fit.
    const MAX_OWNER: usize = 0xffff;

    pub(super) fn encode(&self, base: Instant) -> u64 {
        let since = self.deadline.saturating_duration_since(base);
        let micros = since.as_micros() + u128::from(!since.subsec_nanos().is_multiple_of(1000));
        let micros = u64::try_from(micros)
            .unwrap_or(u64::MAX)
            .min(u64::MAX >> 16);
        assert!(
            self.owner < Self::MAX_OWNER,
            "queue index {} does not fit",
            self.owner
        );
        (micros << 16) | (self.owner as u64 + 1)
    }

    pub(super) fn decode(packed: u64, base: Instant) -> Option<Self> {
        let owner = (packed & 0xffff).checked_sub(1)? as usize;
        Some(Self {
            owner,
            deadline: base + Duration::from_micros(packed >> 16),
        })
    }
}

/// Longest a sender waits for the builder's lock.
pub(super) const BUILDER_WAIT: Duration = Duration::from_micros(50);

pub(super) fn batch_header(
    inner: &Inner,
    seq: u64,
    batch: &Sealed,
    session_epoch: u64,
) -> [u8; 128] {
    BatchHeader {
        batch_seq: seq,
        client_id: inner.client_id,
        num_msg: batch.num_msg,
        epoch_created: now_ns(),
        batch_id: batch.batch_id,
        session_epoch,
        total_size: batch.buf.len() as u64,
        ..Default::default()
    }
    .encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn an_open_batch_packs_its_owner_and_a_deadline_never_earlier_than_its_own() {
        let base = Instant::now();
        assert_eq!(OpenBatch::decode(0, base), None, "0: no batch open");
        for (owner, nanos) in [(0, 0), (3, 1), (3, 999), (7, 1000), (65534, 123_456_789)] {
            let open = OpenBatch {
                owner,
                deadline: base + Duration::from_nanos(nanos),
            };
            let back = OpenBatch::decode(open.encode(base), base).unwrap();
            assert_eq!(back.owner, owner);
            assert!(back.deadline >= open.deadline, "rounded up, never early");
            assert!(back.deadline - open.deadline < Duration::from_micros(1));
        }
    }
}
