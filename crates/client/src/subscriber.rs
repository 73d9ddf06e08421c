//! The subscriber: reads a topic in order from any broker, reconstructs each
//! message's position (batch position + index in batch), and resumes after a lost
//! connection from the next position it has not delivered.
//!
//! Owns its connection and its delivery buffers: each delivery is read into a buffer of
//! its own, reused once its messages are handed out ([`Subscriber::poll_with`]), or lent
//! whole to the caller ([`Subscriber::poll_shared`], [`SharedBatch`]) and reused only once
//! the caller has dropped every clone of it.

use crate::admin::Admin;
use crate::conn::{self, Frame, SubStream};
use crate::delivery::{DeliveryBuf, SharedBatch};
use crate::shm::Transport;
use crate::{Error, Result};
use embarcadero_wire::{
    message_stride, DeliveryHeader, FrameHeader, Hello, MessageIter, Role, DELIVERY_HEADER_LEN,
    SUBSCRIBE_FROM_FIRST_RETAINED,
};
use std::collections::VecDeque;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest delivery body accepted from a broker.
const MAX_DELIVERY_BYTES: u32 = 256 << 20;

/// Where a subscriber is in a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cursor {
    /// Orders 2 and 5: the next global position.
    Global(u64),
    /// Orders 0 and 1: the next position in each broker's log.
    PerBroker(Vec<u64>),
}

#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// Where to start; `None` means from the beginning: the first message still
    /// retained (older ones may have been reclaimed, or lost with a memory-only topic's
    /// region). A position given here that is no longer retained is an error
    /// (PositionNotRetained, naming the first available position).
    pub start: Option<Cursor>,
    pub client_id: Option<u64>,
    /// How many times in a row to reconnect after a lost connection (or a broker that
    /// does not answer), pausing 10-100 ms in between, before reporting the error.
    pub max_reconnects: u32,
    /// How to reach the brokers: `Auto` reads a shared-memory feed from a broker on
    /// this host that gives one, else TCP (and logs which); `Tcp`; `Shm` (an error
    /// where no feed can be had).
    pub transport: Transport,
    /// How long to go on reconnecting once the server is gone (see
    /// [`Error::server_gone`]), counted from the first failed attempt, beyond
    /// `max_reconnects`: a server that restarts within it is found again (through the
    /// head) and delivery continues from the position reached. `None`: only
    /// `max_reconnects` attempts, about half a second.
    pub retry_for: Option<Duration>,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        Self {
            start: None,
            client_id: None,
            max_reconnects: 10,
            transport: Transport::Auto,
            retry_for: None,
        }
    }
}

/// One delivered message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Global position (orders 2, 5) or position in its broker's log (orders 0, 1).
    pub position: u64,
    pub broker_id: u16,
    pub client_id: u64,
    pub batch_seq: u64,
    pub index_in_batch: u32,
    pub publish_ts_ns: u64,
    pub counter: u64,
    pub payload: Vec<u8>,
}

/// A message borrowed from the subscriber's buffers (no copy).
#[derive(Debug, Clone, Copy)]
pub struct MessageRef<'a> {
    pub position: u64,
    pub broker_id: u16,
    pub client_id: u64,
    pub batch_seq: u64,
    pub index_in_batch: u32,
    pub publish_ts_ns: u64,
    pub counter: u64,
    pub payload: &'a [u8],
}

impl MessageRef<'_> {
    pub fn to_owned(&self) -> Message {
        Message {
            position: self.position,
            broker_id: self.broker_id,
            client_id: self.client_id,
            batch_seq: self.batch_seq,
            index_in_batch: self.index_in_batch,
            publish_ts_ns: self.publish_ts_ns,
            counter: self.counter,
            payload: self.payload.to_vec(),
        }
    }
}

/// Lent batches the subscriber still watches for reuse; past this many, it forgets the
/// oldest (the caller keeps it alive as long as it likes, and it is freed after). A
/// garbage-collected caller (the Node SDK) drops them in waves, when its collector runs,
/// which V8 does after some tens of MiB of external memory: watched for less long than
/// that, a batch was freed instead of reused, and every delivery paid for fresh pages
/// (page faults, zeroing, and the allocator handing them back to the kernel). 256
/// batches of the usual 512 KiB are 128 MiB; checking them costs 256 loads per delivery.
const LENT_WATCHED: usize = 256;

struct Batch {
    header: DeliveryHeader,
    /// Not shared while the batch is unconfirmed or ready (the subscriber reads into it).
    payload: Arc<DeliveryBuf>,
    /// Where reading stopped: next message index and its byte offset.
    next_index: u32,
    next_offset: usize,
}

impl Batch {
    /// The next message the subscriber wants (not among the `skip` it already has, at or
    /// after `cursor`), advancing the batch's place; `None` at the end of the batch.
    fn next_wanted(&mut self, cursor: &Option<Cursor>) -> Result<Option<MessageRef<'_>>> {
        let h = self.header;
        while self.next_index < h.num_msg {
            let bytes = self.payload.bytes();
            let at = self.next_offset.min(bytes.len());
            let Some(m) = MessageIter::new(&bytes[at..], 1).next() else {
                break;
            };
            let m = m.map_err(|e| Error::Protocol {
                peer: "broker".into(),
                message: e.to_string(),
            })?;
            let stride = message_stride(m.header.size as u64) as usize;
            let index = self.next_index;
            self.next_index += 1;
            self.next_offset += stride;
            let position = h.first_position + index as u64;
            if index < h.skip || !wanted(cursor, h.broker_id, position) {
                continue;
            }
            let payload_at = at + embarcadero_wire::MESSAGE_HEADER_LEN;
            return Ok(Some(MessageRef {
                position,
                broker_id: h.broker_id,
                client_id: h.client_id,
                batch_seq: h.batch_seq,
                index_in_batch: index,
                publish_ts_ns: m.header.publish_ts_ns,
                counter: m.header.counter,
                payload: &self.payload.bytes()[payload_at..payload_at + m.header.size as usize],
            }));
        }
        Ok(None)
    }
}

pub struct Subscriber {
    brokers: Vec<String>,
    /// The head it was made through: asked for the brokers again when none it knows
    /// answers (they restarted on other addresses). `None` for `connect_brokers`.
    control: Option<String>,
    /// Reconnections since the last read that succeeded (see `fill`).
    failed_reconnects: u32,
    /// When the first of those failed: `retry_for` counts from here.
    lost_since: Option<Instant>,
    topic: String,
    client_id: u64,
    config: SubscriberConfig,
    next_broker: usize,
    stream: Option<(SubStream, String)>,
    order: Option<u8>,
    num_brokers: usize,
    cursor: Option<Cursor>,
    /// Asked for "the beginning" and delivered nothing yet: the broker may start at the
    /// first retained position ([`SUBSCRIBE_FROM_FIRST_RETAINED`]). Cleared by the first
    /// delivery, after which a position that is gone is an error the user must see.
    from_first_retained: bool,
    /// Positions `[from, to)` that a subscription from the beginning found reclaimed
    /// and started after (see [`Subscriber::skipped`]).
    skipped: Option<(u64, u64)>,
    unconfirmed: VecDeque<Batch>,
    ready: VecDeque<Batch>,
    /// Buffers free for the next delivery.
    spare: Vec<Arc<DeliveryBuf>>,
    /// Buffers lent by `poll_shared`, oldest first: back to `spare` once the caller has
    /// dropped every clone.
    lent: VecDeque<Arc<DeliveryBuf>>,
}

impl Subscriber {
    pub fn connect(control: &str, topic: &str, config: SubscriberConfig) -> Result<Self> {
        // Before any request, and the same error however the subscriber is made.
        crate::check_topic_name(topic)?;
        let addrs = live_brokers(&Admin::new(control))?;
        Self::start(&addrs, Some(control), topic, config)
    }

    pub fn connect_brokers(
        brokers: &[String],
        topic: &str,
        config: SubscriberConfig,
    ) -> Result<Self> {
        Self::start(brokers, None, topic, config)
    }

    fn start(
        brokers: &[String],
        control: Option<&str>,
        topic: &str,
        config: SubscriberConfig,
    ) -> Result<Self> {
        crate::check_topic_name(topic)?;
        if brokers.is_empty() {
            return Err(Error::Config("no brokers to subscribe from".into()));
        }
        let client_id = config.client_id.unwrap_or_else(crate::random_client_id);
        let mut s = Self {
            brokers: brokers.to_vec(),
            control: control.map(str::to_string),
            failed_reconnects: 0,
            lost_since: None,
            topic: topic.to_string(),
            client_id,
            next_broker: (client_id as usize) % brokers.len(),
            stream: None,
            order: None,
            num_brokers: brokers.len(),
            cursor: config.start.clone(),
            from_first_retained: config.start.is_none(),
            skipped: None,
            config,
            unconfirmed: VecDeque::new(),
            ready: VecDeque::new(),
            spare: Vec::new(),
            lent: VecDeque::new(),
        };
        s.reconnect()?;
        Ok(s)
    }

    /// How the current connection reaches its broker: "tcp", "shm", or "none" between
    /// connections.
    pub fn transport(&self) -> &'static str {
        self.stream.as_ref().map_or("none", |(s, _)| s.transport())
    }

    /// Orders 2 and 5: the positions `[from, to)` this subscription, asked to start at
    /// the beginning, found no longer retained (a memory-only topic reclaims what every
    /// reader had passed) and so started after. Known from the broker's HelloOk
    /// (`first_retained`) before anything is delivered, and from the first delivery;
    /// `None` when nothing was skipped. A subscription from an explicit position (given
    /// at the start or by [`Self::seek`]) never skips: it gets `PositionNotRetained`
    /// instead.
    pub fn skipped(&self) -> Option<(u64, u64)> {
        self.skipped
    }

    /// While the subscription asked for the beginning and has delivered nothing: the
    /// next thing it gets starts at global position `first`, so what lies below it, from
    /// the cursor up, was skipped. Said once in the log and kept for [`Self::skipped`].
    fn note_start(&mut self, first: u64) {
        let Some(Cursor::Global(from)) = self.cursor else {
            return;
        };
        if !self.from_first_retained || first <= from {
            return;
        }
        tracing::warn!(
            topic = %self.topic,
            from,
            to = first,
            "positions below the first retained one were reclaimed before this \
             subscription from the beginning; it starts at the first retained position"
        );
        self.skipped = Some((self.skipped.map_or(from, |(a, _)| a), first));
    }

    /// The topic's order level, as the broker reported it.
    pub fn order(&self) -> u8 {
        self.order.unwrap_or(2)
    }

    /// The position of the next message this subscriber will deliver.
    pub fn position(&self) -> Cursor {
        self.cursor.clone().unwrap_or_else(|| self.default_cursor())
    }

    fn default_cursor(&self) -> Cursor {
        if self.order() >= 2 {
            Cursor::Global(0)
        } else {
            Cursor::PerBroker(vec![0; self.num_brokers])
        }
    }

    /// Continues from `cursor`, discarding anything buffered.
    pub fn seek(&mut self, cursor: Cursor) -> Result<()> {
        // An explicit position: if it is gone, the caller must hear so, and nothing is
        // skipped from it (what an earlier start from the beginning skipped no longer
        // describes this subscription).
        self.from_first_retained = false;
        self.skipped = None;
        self.restart_at(cursor)
    }

    /// Continues from the beginning, as a subscriber made without a start position: the
    /// first message still retained (what was reclaimed is reported by [`Self::skipped`]).
    pub fn seek_start(&mut self) -> Result<()> {
        self.from_first_retained = true;
        let start = self.default_cursor();
        self.restart_at(start)
    }

    /// Drops everything buffered and connects again, to deliver from `cursor`.
    fn restart_at(&mut self, cursor: Cursor) -> Result<()> {
        self.cursor = Some(cursor);
        self.ready.clear();
        self.unconfirmed.clear();
        self.stream = None;
        self.reconnect()
    }

    /// Connects to the next broker that answers; through the head, asks it for the
    /// brokers again if none of those known does.
    fn reconnect(&mut self) -> Result<()> {
        match self.try_known_brokers() {
            Err(e @ Error::Broker { .. }) => Err(e),
            Err(e) => {
                // Briefly: a head that does not answer must not hold up the poll.
                let head = self
                    .control
                    .as_deref()
                    .map(|c| Admin::with_timeout(c, HEAD_WAIT));
                let Some(fresh) = head.and_then(|h| live_brokers(&h).ok()) else {
                    return Err(e);
                };
                if fresh.is_empty() || fresh == self.brokers {
                    return Err(e);
                }
                self.brokers = fresh;
                self.try_known_brokers()
            }
            ok => ok,
        }
    }

    fn try_known_brokers(&mut self) -> Result<()> {
        self.unconfirmed.clear();
        let mut last_err = None;
        for _ in 0..self.brokers.len() {
            let addr = self.brokers[self.next_broker % self.brokers.len()].clone();
            self.next_broker += 1;
            let cursor = Self::position(self);
            let (start, extra) = match &cursor {
                Cursor::Global(p) => (*p, Vec::new()),
                Cursor::PerBroker(v) => (0, v.iter().flat_map(|p| p.to_le_bytes()).collect()),
            };
            let hello = Hello {
                role: Role::Subscribe,
                ack_level: 0,
                client_id: self.client_id,
                session_epoch: 0,
                start_position: start,
                connection_index: 0,
                cursor_count: (extra.len() / 8) as u32,
                topic: self.topic.clone(),
                session_key: [0; 16],
                flags: if self.from_first_retained {
                    SUBSCRIBE_FROM_FIRST_RETAINED
                } else {
                    0
                },
                opener: 0,
            };
            match conn::open_sub(&addr, &hello, &extra, self.config.transport) {
                Ok((stream, ok)) => {
                    self.order = Some(ok.order);
                    self.num_brokers = ok.num_brokers as usize;
                    if self.cursor.is_none() {
                        self.cursor = Some(self.default_cursor());
                    }
                    if ok.order >= 2 {
                        // Said before the cursor moves: what lies below is skipped.
                        self.note_start(ok.first_retained);
                    }
                    self.skip_to_first_retained(ok.first_retained);
                    self.stream = Some((stream, addr));
                    return Ok(());
                }
                Err(e @ Error::Broker { .. }) => return Err(e),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or(Error::Closed))
    }

    /// Asked for "the beginning" and nothing delivered yet: moves the cursor up to the
    /// first position the broker still has (it starts there anyway), so that
    /// [`Self::position`] says where the topic's readable part starts before anything
    /// arrives. Only forward: a broker that does not know (0) changes nothing.
    fn skip_to_first_retained(&mut self, first_retained: u64) {
        if !self.from_first_retained {
            return;
        }
        if let Some(Cursor::Global(p)) = &mut self.cursor {
            *p = (*p).max(first_retained);
        }
    }

    /// Waits up to `timeout` for confirmed batches, then hands each of their messages
    /// to `f` without copying. Returns how many messages were delivered.
    pub fn poll_with(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(MessageRef<'_>),
    ) -> Result<usize> {
        if self.ready.is_empty() {
            self.fill(timeout)?;
        }
        let mut delivered = 0;
        while let Some(mut batch) = self.ready.pop_front() {
            while let Some(m) = batch.next_wanted(&self.cursor)? {
                let (broker, position) = (m.broker_id, m.position);
                f(m);
                self.advance(broker, position);
                delivered += 1;
            }
            self.spare.push(batch.payload);
        }
        Ok(delivered)
    }

    /// As [`Self::poll_with`], but lends each batch whole: `f` gets the message and the
    /// batch its payload lies in ([`SharedBatch::range_of`] says where), which stays
    /// valid and unchanged for as long as the caller keeps a clone. Costs one reference
    /// count per batch; the buffer is reused once every clone is dropped.
    pub fn poll_shared(
        &mut self,
        timeout: Duration,
        f: impl FnMut(&SharedBatch, MessageRef<'_>),
    ) -> Result<usize> {
        self.poll_shared_upto(timeout, usize::MAX, f)
    }

    /// As [`Self::poll_shared`], but lends batches only until they hold `max_bytes` or
    /// more (whole batches, at least one when any is ready); the others stay ready for the
    /// next call, which takes them without waiting. For a garbage-collected caller: a
    /// batch handed over with a few others is dropped soon after its messages are read,
    /// and its buffer comes back for reuse, where one handed over with many stays alive
    /// (and away from the subscriber) until the last of them is read (docs/PERFORMANCE.md,
    /// "Session 22").
    pub fn poll_shared_upto(
        &mut self,
        timeout: Duration,
        max_bytes: usize,
        f: impl FnMut(&SharedBatch, MessageRef<'_>),
    ) -> Result<usize> {
        if self.ready.is_empty() {
            self.fill(timeout)?;
        }
        self.lend_ready(max_bytes, f)
    }

    /// As [`Self::poll_shared_upto`], but never waits: it reads only whole frames a
    /// shared-memory feed holds already, and reads nothing over TCP, between connections
    /// or once the connection is lost, leaving waiting and reconnecting to the waiting
    /// polls. For a caller on an event loop, which may copy what has arrived but must not
    /// wait (the Node SDK's `pollBatch`, docs/DESIGN.md "Reading on the caller's thread").
    pub fn poll_shared_now(
        &mut self,
        max_bytes: usize,
        f: impl FnMut(&SharedBatch, MessageRef<'_>),
    ) -> Result<usize> {
        if self.ready.is_empty() {
            self.fill_now()?;
        }
        self.lend_ready(max_bytes, f)
    }

    /// Lends ready batches until they hold `max_bytes` or more (whole batches), handing
    /// `f` each of their wanted messages in order.
    fn lend_ready(
        &mut self,
        max_bytes: usize,
        mut f: impl FnMut(&SharedBatch, MessageRef<'_>),
    ) -> Result<usize> {
        let (mut delivered, mut lent_bytes) = (0, 0usize);
        while lent_bytes < max_bytes {
            let Some(mut batch) = self.ready.pop_front() else {
                break;
            };
            lent_bytes = lent_bytes.saturating_add(batch.payload.len());
            let shared = SharedBatch(batch.payload.clone());
            while let Some(m) = batch.next_wanted(&self.cursor)? {
                let (broker, position) = (m.broker_id, m.position);
                f(&shared, m);
                self.advance(broker, position);
                delivered += 1;
            }
            drop(batch);
            self.lend(shared.0);
        }
        Ok(delivered)
    }

    /// Bytes of the batches lent by the `poll_shared` calls that a caller still holds
    /// (of the most recent [`LENT_WATCHED`]).
    pub fn lent_bytes(&self) -> usize {
        let held = self.lent.iter().filter(|b| Arc::strong_count(b) > 1);
        held.map(|b| b.len()).sum()
    }

    fn lend(&mut self, buffer: Arc<DeliveryBuf>) {
        if Arc::strong_count(&buffer) == 1 {
            // The caller kept no message of it.
            self.spare.push(buffer);
            return;
        }
        if self.lent.len() >= LENT_WATCHED {
            self.lent.pop_front();
        }
        self.lent.push_back(buffer);
    }

    /// The next message, waiting at most `timeout`.
    pub fn poll(&mut self, timeout: Duration) -> Result<Option<Message>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.pop_one()? {
                return Ok(Some(m));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            self.fill(deadline - now)?;
        }
    }

    /// Takes one message off the front batch (owned copy), resuming where the last
    /// call stopped inside that batch.
    fn pop_one(&mut self) -> Result<Option<Message>> {
        while let Some(batch) = self.ready.front_mut() {
            if let Some(m) = batch.next_wanted(&self.cursor)? {
                let message = m.to_owned();
                self.advance(message.broker_id, message.position);
                return Ok(Some(message));
            }
            let b = self.ready.pop_front().expect("front exists");
            self.spare.push(b.payload);
        }
        Ok(None)
    }

    /// Past a delivered message. Every way of delivering comes here: once anything is
    /// delivered, a position that is gone must be refused, not skipped (a reconnection
    /// after `poll_with` used to ask for the first retained position still, and could
    /// skip a reclaimed range in silence).
    fn advance(&mut self, broker: u16, position: u64) {
        if self.from_first_retained {
            self.note_start(position);
            self.from_first_retained = false;
        }
        advance(&mut self.cursor, broker, position);
    }

    /// Reads frames until at least one batch is confirmed or `timeout` passes. A lost
    /// server (a lost connection, brokers that do not answer when reconnecting) is
    /// retried up to `max_reconnects` times in a row, and beyond for `retry_for` (the
    /// count and the clock survive across calls until a read on a connection
    /// succeeds), each after a pause growing to 100 ms.
    fn fill(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while self.ready.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            match self.read_one(deadline - now) {
                Ok(()) => (self.failed_reconnects, self.lost_since) = (0, None),
                Err(e) if e.server_gone() && self.may_reconnect(now) => {
                    self.failed_reconnects = self.failed_reconnects.saturating_add(1);
                    self.lost_since.get_or_insert(now);
                    self.stream = None;
                    let pause = Duration::from_millis(10 * self.failed_reconnects.min(10) as u64);
                    std::thread::sleep(pause.min(deadline.saturating_duration_since(now)));
                    // The next read reconnects.
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads the whole frames a shared-memory feed holds already, until a round is
    /// confirmed or none is left (see [`Self::poll_shared_now`]). A lost connection is let go
    /// of, without an error: the next waiting poll reconnects, or says it cannot.
    fn fill_now(&mut self) -> Result<()> {
        while self.ready.is_empty() {
            let Some((stream, addr)) = self.stream.as_mut() else {
                return Ok(());
            };
            match stream.whole_frame_here() {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(e) => {
                    let e = lost_or_broken(addr, e);
                    return self.let_go_if_lost(e);
                }
            }
            let read = self.read_started_frame();
            if matches!(read, Err(Error::Broker { .. })) {
                self.stream = None;
            }
            match read {
                Ok(()) => (self.failed_reconnects, self.lost_since) = (0, None),
                Err(e) => return self.let_go_if_lost(e),
            }
        }
        Ok(())
    }

    /// After a read failed without waiting: a lost server is no error yet (the
    /// connection is dropped for the next waiting poll to reconnect); anything else is.
    fn let_go_if_lost(&mut self, e: Error) -> Result<()> {
        if !e.server_gone() {
            return Err(e);
        }
        self.stream = None;
        Ok(())
    }

    /// Whether a lost server is tried again at `now`: within `max_reconnects` failed
    /// attempts, or within `retry_for` of the first.
    fn may_reconnect(&self, now: Instant) -> bool {
        let within_time = self.config.retry_for.is_some_and(|retry_for| {
            self.lost_since
                .is_none_or(|since| now.saturating_duration_since(since) < retry_for)
        });
        self.failed_reconnects < self.config.max_reconnects || within_time
    }

    /// Reads one frame if one starts within `wait`; a broker error ends the connection.
    fn read_one(&mut self, wait: Duration) -> Result<()> {
        let result = self.read_frame_within(wait);
        if matches!(result, Err(Error::Broker { .. })) {
            self.stream = None;
        }
        result
    }

    fn read_frame_within(&mut self, wait: Duration) -> Result<()> {
        if self.stream.is_none() {
            self.reconnect()?;
        }
        let (stream, addr) = self.stream.as_mut().expect("connected");
        // Wait for the start of a frame with a timeout, then read it whole, blocking.
        if !stream
            .wait_readable(wait)
            .map_err(|e| lost_or_broken(addr, e))?
        {
            return Ok(());
        }
        self.read_started_frame()
    }

    /// Reads the frame whose first byte has come, whole (blocking for the rest).
    fn read_started_frame(&mut self) -> Result<()> {
        let (stream, addr) = self.stream.as_mut().expect("connected");
        let frame = conn::read_frame(stream, addr, 64).map_err(|e| match e {
            // A feed's ring positions out of range: the broker broke the protocol.
            Error::ConnectionLost { message, .. } if message.starts_with(conn::RING_VIOLATION) => {
                Error::Protocol {
                    peer: addr.clone(),
                    message,
                }
            }
            e => e,
        })?;
        match frame {
            Frame::Delivery(fh) => {
                let buffer = free_buffer(&mut self.spare, &mut self.lent);
                let batch = read_delivery(stream, addr, fh, buffer)?;
                self.unconfirmed.push_back(batch);
                Ok(())
            }
            Frame::BatchOk {
                count,
                discard_rest,
            } => {
                if count as usize > self.unconfirmed.len() {
                    return Err(Error::Protocol {
                        peer: addr.clone(),
                        message: format!(
                            "BatchOk confirms {count} deliveries but {} are pending",
                            self.unconfirmed.len()
                        ),
                    });
                }
                for _ in 0..count {
                    let b = self.unconfirmed.pop_front().expect("counted");
                    self.ready.push_back(b);
                }
                if discard_rest {
                    // Reclaimed while being sent; the broker sends them again.
                    for b in self.unconfirmed.drain(..) {
                        self.spare.push(b.payload);
                    }
                }
                Ok(())
            }
            Frame::Error(e) => Err(conn::broker_error(addr, e)),
            other => Err(Error::Protocol {
                peer: addr.clone(),
                message: format!("unexpected frame on a subscription: {other:?}"),
            }),
        }
    }
}

/// Reads the body of a delivery whose frame header is `fh` into `payload` (a free
/// buffer), checking its lengths against each other and the limit.
fn read_delivery(
    stream: &mut SubStream,
    addr: &str,
    fh: FrameHeader,
    mut payload: Arc<DeliveryBuf>,
) -> Result<Batch> {
    let protocol = |message: String| Error::Protocol {
        peer: addr.to_string(),
        message,
    };
    let lost = |e: std::io::Error| lost_or_broken(addr, e);
    if fh.body_len < DELIVERY_HEADER_LEN as u32 || fh.body_len > MAX_DELIVERY_BYTES {
        return Err(protocol(format!("delivery of {} bytes", fh.body_len)));
    }
    let mut raw = [0u8; DELIVERY_HEADER_LEN];
    stream.read_exact(&mut raw).map_err(lost)?;
    let header = DeliveryHeader::decode(&raw).map_err(|e| protocol(e.to_string()))?;
    if header.payload_len != fh.body_len - DELIVERY_HEADER_LEN as u32 {
        return Err(protocol(
            "delivery header and frame disagree on the payload length".into(),
        ));
    }
    // Only the subscriber holds it: a spare one, or lent and since dropped.
    let bytes = Arc::get_mut(&mut payload).expect("a free buffer is not shared");
    stream
        .read_exact(bytes.fill(header.payload_len as usize))
        .map_err(lost)?;
    Ok(Batch {
        header,
        payload,
        next_index: 0,
        next_offset: 0,
    })
}

/// A read that failed: the connection was lost (the subscriber reconnects), or, for a
/// shared-memory feed whose broker published positions out of range (`InvalidData`),
/// the protocol was broken, which reconnecting would not mend.
fn lost_or_broken(addr: &str, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::InvalidData {
        return Error::Protocol {
            peer: addr.to_string(),
            message: e.to_string(),
        };
    }
    Error::ConnectionLost {
        broker: addr.to_string(),
        message: e.to_string(),
    }
}

/// A buffer for the next delivery: a spare one, else a lent one every clone of which is
/// gone, else a new one.
fn free_buffer(
    spare: &mut Vec<Arc<DeliveryBuf>>,
    lent: &mut VecDeque<Arc<DeliveryBuf>>,
) -> Arc<DeliveryBuf> {
    if let Some(b) = spare.pop() {
        return b;
    }
    // A count of 1 stays 1: nobody else holds it, so nobody can clone it.
    let returned = lent.iter().position(|b| Arc::strong_count(b) == 1);
    returned.and_then(|i| lent.remove(i)).unwrap_or_default()
}

/// Longest wait for the head's broker list while reconnecting.
const HEAD_WAIT: Duration = Duration::from_secs(2);

/// The data addresses of the brokers the head lists as serving.
fn live_brokers(head: &Admin) -> Result<Vec<String>> {
    let cluster = head.cluster()?;
    Ok(cluster.brokers.into_iter().map(|b| b.addr).collect())
}

/// Moves the cursor past a delivered message.
fn advance(cursor: &mut Option<Cursor>, broker: u16, position: u64) {
    match cursor {
        Some(Cursor::Global(next)) => *next = position + 1,
        Some(Cursor::PerBroker(v)) => {
            if let Some(n) = v.get_mut(broker as usize) {
                *n = position + 1;
            }
        }
        None => {}
    }
}

fn wanted(cursor: &Option<Cursor>, broker: u16, position: u64) -> bool {
    match cursor {
        Some(Cursor::Global(next)) => position >= *next,
        Some(Cursor::PerBroker(v)) => v.get(broker as usize).is_some_and(|n| position >= *n),
        None => true,
    }
}

impl Iterator for Subscriber {
    type Item = Result<Message>;

    /// Blocks until the next message (or an error).
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.poll(Duration::from_secs(3600)) {
                Ok(Some(m)) => return Some(Ok(m)),
                Ok(None) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_shm::layout::{self, MIN_DATA_CAPACITY};
    use embarcadero_shm::Producer;
    use embarcadero_wire::{BatchOk, BlogMessageHeader, FrameHeader, FrameKind};
    use std::sync::atomic::Ordering;

    /// A subscriber reading the client end of a feed a test plays the broker of.
    fn over_feed() -> (
        Subscriber,
        Producer,
        Arc<embarcadero_shm::Mapping>,
        std::os::unix::net::UnixStream,
    ) {
        let (feed, broker, map, sock) = crate::shm::test_feed::pair(MIN_DATA_CAPACITY);
        let s = Subscriber {
            brokers: vec!["127.0.0.1:1".into()],
            control: None,
            failed_reconnects: 0,
            lost_since: None,
            topic: "t".into(),
            client_id: 1,
            config: SubscriberConfig {
                max_reconnects: 0,
                ..SubscriberConfig::default()
            },
            next_broker: 0,
            stream: Some((SubStream::Shm(feed), "127.0.0.1:1".into())),
            order: Some(2),
            num_brokers: 1,
            cursor: Some(Cursor::Global(0)),
            from_first_retained: false,
            skipped: None,
            unconfirmed: VecDeque::new(),
            ready: VecDeque::new(),
            spare: Vec::new(),
            lent: VecDeque::new(),
        };
        (s, broker, map, sock)
    }

    /// One delivery of `count` messages of 3 bytes at position 0, as a broker sends it.
    fn delivery(count: u32) -> (DeliveryHeader, Vec<u8>) {
        let stride = message_stride(3) as usize;
        let mut payload = vec![0u8; stride * count as usize];
        for m in 0..count as usize {
            BlogMessageHeader {
                size: 3,
                client_id: 7,
                ..Default::default()
            }
            .encode_into(&mut payload[m * stride..]);
        }
        let h = DeliveryHeader {
            num_msg: count,
            client_id: 7,
            order: 2,
            payload_len: payload.len() as u32,
            ..Default::default()
        };
        (h, payload)
    }

    fn send(broker: &mut Producer, parts: &[&[u8]]) {
        broker.write_all(parts, || true).unwrap();
    }

    /// What a poll of the subscriber gives after the broker wrote `garbage`: it must be
    /// a protocol error (never a panic, never a read out of bounds).
    fn refused_after(garbage: impl FnOnce(&mut Producer, &embarcadero_shm::Mapping)) -> String {
        let (mut s, mut broker, map, _sock) = over_feed();
        garbage(&mut broker, map.as_ref());
        match s.poll(Duration::from_secs(5)) {
            Err(Error::Protocol { message, .. }) => message,
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }

    #[test]
    fn a_well_formed_feed_delivers_its_messages() {
        let (mut s, mut broker, _map, _sock) = over_feed();
        let (h, payload) = delivery(3);
        let ok = BatchOk {
            count: 1,
            discard_rest: false,
        };
        send(
            &mut broker,
            &[
                &h.frame_header().encode()[..],
                &h.encode()[..],
                &payload[..],
                &ok.encode()[..],
            ],
        );
        for i in 0..3 {
            let m = s.poll(Duration::from_secs(5)).unwrap().expect("a message");
            assert_eq!((m.position, m.client_id, m.payload.len()), (i, 7, 3));
        }
        assert_eq!(s.transport(), "shm");
    }

    /// What an event loop's read (`poll_shared_now`) takes: only whole frames, so that it
    /// never waits, even for a broker stopped half-way through a frame; confirmed rounds,
    /// as every poll; and garbage is the same error as for a waiting poll. It runs on a
    /// thread of its own, so that a read that waited fails the test instead of hanging it.
    #[test]
    fn a_read_that_never_waits_takes_only_whole_frames_of_a_feed() {
        let (s, mut broker, _map, _sock) = over_feed();
        let (h, payload) = delivery(3);
        let frame = h.frame_header().encode();
        let ok = BatchOk {
            count: 1,
            discard_rest: false,
        }
        .encode();
        let (to_reader, steps) = std::sync::mpsc::channel::<u8>();
        let (to_test, read) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut s = s;
            while steps.recv().is_ok() {
                to_test
                    .send(s.poll_shared_now(usize::MAX, |_, _| {}))
                    .unwrap();
            }
        });
        let read_now = || {
            to_reader.send(0).unwrap();
            // A hang guard, not a timing: a read that waited for the rest never answers.
            read.recv_timeout(Duration::from_secs(60))
                .expect("a read that never waits answered")
        };
        send(&mut broker, &[&frame[..], &h.encode()[..]]);
        assert_eq!(read_now().unwrap(), 0, "half a delivery");
        send(&mut broker, &[&payload[..]]);
        assert_eq!(read_now().unwrap(), 0, "a whole delivery, not confirmed");
        send(&mut broker, &[&ok[..4]]);
        assert_eq!(read_now().unwrap(), 0, "half a confirmation");
        send(&mut broker, &[&ok[4..]]);
        assert_eq!(read_now().unwrap(), 3, "the confirmed round");
        send(&mut broker, &[&[0xee; 16][..]]);
        assert!(matches!(read_now(), Err(Error::Protocol { .. })));
        drop(to_reader);
        reader.join().unwrap();
    }

    /// Garbage a broker (a bug, or a hostile process of the broker's uid) can put into
    /// a subscriber's feed: ring positions that go back or run ahead of the ring, frame
    /// headers, delivery headers and messages that do not add up, confirmations of
    /// deliveries never sent. Each is an error the caller sees.
    #[test]
    fn garbage_in_the_feed_is_a_protocol_error_not_a_crash() {
        fn tail(map: &embarcadero_shm::Mapping) -> &std::sync::atomic::AtomicU64 {
            map.u64_at(layout::FEED_PRODUCER + layout::P_TAIL)
        }
        let m = refused_after(|_, map| {
            tail(map).store(3 * MIN_DATA_CAPACITY as u64, Ordering::Release);
        });
        assert!(m.contains("past the consumer"), "{m}");
        // A position that goes back below one the subscriber has seen.
        let (mut s, mut broker, map, _sock) = over_feed();
        let (h, payload) = delivery(1);
        send(
            &mut broker,
            &[
                &h.frame_header().encode()[..],
                &h.encode()[..],
                &payload[..],
            ],
        );
        assert_eq!(
            s.poll(Duration::from_millis(50)).unwrap(),
            None,
            "unconfirmed"
        );
        tail(&map).store(8, Ordering::Release);
        match s.poll(Duration::from_secs(5)) {
            Err(Error::Protocol { message, .. }) => {
                assert!(message.contains("went back"), "{message}")
            }
            other => panic!("expected a protocol error, got {other:?}"),
        }
        let m = refused_after(|broker, _| send(broker, &[&[0xee; 16][..]]));
        assert!(!m.is_empty());
        let m = refused_after(|broker, _| {
            let short = FrameHeader {
                kind: FrameKind::Delivery,
                flags: 0,
                body_len: 8,
                arg: 0,
            };
            send(broker, &[&short.encode()[..], &[0; 8][..]]);
        });
        assert!(m.contains("delivery of 8 bytes"), "{m}");
        let m = refused_after(|broker, _| {
            let (h, payload) = delivery(2);
            let mut frame = h.frame_header();
            frame.body_len += 64;
            send(
                broker,
                &[
                    &frame.encode()[..],
                    &h.encode()[..],
                    &payload[..],
                    &[0; 64][..],
                ],
            );
        });
        assert!(m.contains("disagree"), "{m}");
        let m = refused_after(|broker, _| {
            let (h, mut payload) = delivery(2);
            BlogMessageHeader {
                size: 1 << 20,
                client_id: 7,
                ..Default::default()
            }
            .encode_into(&mut payload);
            let ok = BatchOk {
                count: 1,
                discard_rest: false,
            };
            send(
                broker,
                &[
                    &h.frame_header().encode()[..],
                    &h.encode()[..],
                    &payload[..],
                    &ok.encode()[..],
                ],
            );
        });
        assert!(!m.is_empty());
        let m = refused_after(|broker, _| {
            let ok = BatchOk {
                count: 5,
                discard_rest: false,
            };
            send(broker, &[&ok.encode()[..]]);
        });
        assert!(m.contains("confirms 5"), "{m}");
    }

    #[test]
    fn a_lent_buffer_is_reused_only_once_every_clone_is_dropped() {
        let (mut spare, mut lent) = (Vec::new(), VecDeque::new());
        let mut buffer = DeliveryBuf::default();
        buffer.fill(16).fill(7);
        let buffer = Arc::new(buffer);
        let kept = SharedBatch(buffer.clone());
        lent.push_back(buffer);
        let fresh = free_buffer(&mut spare, &mut lent);
        assert_ne!(
            fresh.bytes().as_ptr(),
            kept.bytes().as_ptr(),
            "a kept batch is not reused"
        );
        assert_eq!(lent.len(), 1);
        let at = kept.bytes().as_ptr();
        drop(kept);
        let reused = free_buffer(&mut spare, &mut lent);
        assert_eq!(reused.bytes().as_ptr(), at, "a dropped batch is reused");
        assert!(lent.is_empty());
    }
}
