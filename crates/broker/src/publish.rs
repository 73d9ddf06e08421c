//! The publish path of one connection: header, reservation, payload straight into
//! the log, validation, PBR commit. Acknowledgements are sent by the service thread,
//! which this connection feeds through a single-producer queue. The same code serves
//! TCP connections and local shared-memory channels (`transport::Inbound` for what
//! comes in, `transport::Sink` for the acks).

use crate::fault::FaultDice;
use crate::log_writer::{LogWriter, Reservation, ReserveError};
use crate::net::{self, End, Refusal};
use crate::payload_wait::{Arrival, Staged};
use crate::session::{self, SessionStatus, SessionView};
use crate::transport::{Inbound, Sink};
use crate::{Shared, StageTimes};
use crossbeam_queue::ArrayQueue;
use embarcadero_region::backoff::Backoff;
use embarcadero_region::{unix_ms, TopicMeta};
use embarcadero_wire::{
    validate_batch_payload, BatchFlags, BatchHeader, ErrorCode, ErrorFrame, Hello, BATCH_HEADER_LEN,
};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Batches a connection may have written but not yet had acknowledged.
const MAX_UNACKED_BATCHES: usize = 4096;
/// Ack bytes a client may leave unread before it is disconnected.
const MAX_UNSENT_BYTES: usize = 64 * 1024;

/// What the service thread needs to acknowledge one publishing connection.
pub struct PublishConn {
    pub topic: u32,
    /// The topic's name, for the TopicDeleted frame (the region's meta goes with it).
    pub topic_name: String,
    pub session_epoch: u64,
    /// Order 5: `session_key_hash` of the hello's key, stamped into every PBR slot of
    /// the connection so the sequencer can tell the session's owner from a stranger.
    pub session_key_hash: u64,
    /// Order 5: the session as the hello found it, for the service thread's view.
    pub session: Option<SessionView>,
    pub order: u8,
    pub ack_level: u8,
    /// Committed batches, in order. Producer: the connection thread. Consumer: the
    /// service thread.
    pub pending: ArrayQueue<PendingAck>,
    pub out: Mutex<Outbox>,
    pub closed: AtomicBool,
}

/// A committed batch waiting for its acknowledgement.
#[derive(Clone, Copy, Debug)]
pub struct PendingAck {
    pub batch_seq: u64,
    pub pbr_index: u64,
    /// When the connection thread queued it, where its `ack_wait` stage starts.
    pub queued_at: Instant,
}

/// The write half of a connection, shared by acks (service thread) and retriable
/// error frames (connection thread). Per connection: never shared between connections.
pub struct Outbox {
    pub sink: Sink,
    /// Bytes of a frame a non-blocking send left unsent; they go out before anything else.
    pub unsent: Vec<u8>,
}

impl Outbox {
    /// Appends a frame and sends as much as the socket takes without blocking. A client
    /// that leaves too much unread is an error.
    pub fn send_nonblocking(&mut self, frame: &[u8]) -> io::Result<()> {
        if self.unsent.len() + frame.len() > MAX_UNSENT_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "client does not read its acknowledgements",
            ));
        }
        self.unsent.extend_from_slice(frame);
        while !self.unsent.is_empty() {
            match self.sink.send_some(&self.unsent)? {
                0 => break,
                n => {
                    self.unsent.drain(..n);
                }
            }
        }
        Ok(())
    }

    /// Closes the connection (both transports).
    pub fn shutdown(&self) {
        self.sink.shutdown();
    }
}

/// Sends a frame from the connection thread without holding the outbox lock while
/// blocked, so the service thread (which acks everyone) never waits on one client.
fn send_from_connection(conn: &PublishConn, frame: &[u8]) -> io::Result<()> {
    conn.out.lock().unwrap().send_nonblocking(frame)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        {
            let mut out = conn.out.lock().unwrap();
            out.send_nonblocking(&[])?;
            if out.unsent.is_empty() {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            return Err(io::ErrorKind::TimedOut.into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub(crate) fn run<I: Inbound>(
    shared: &Shared,
    write_half: io::Result<Sink>,
    stream: &mut I,
    hello: Hello,
    topic: u32,
    meta: TopicMeta,
) -> End {
    let write_half = match write_half {
        Ok(w) => w,
        Err(_) => return End::Gone,
    };
    let mut ok = net::hello_ok(shared, &hello, topic, &meta);
    // Order 5: the connection's threads start from this view, which knows the session's
    // slot from the hello on (so an ending of the session is noticed), and the session
    // counts as active from now.
    let key_hash = if meta.order == 5 {
        embarcadero_wire::session_key_hash(&hello.session_key)
    } else {
        0
    };
    let mut session = SessionView::new(topic, hello.client_id, hello.session_epoch, key_hash);
    if meta.order == 5 {
        match join_session(shared, &hello, topic, &mut session) {
            Ok(next_batch_seq) => ok.next_batch_seq = next_batch_seq,
            Err(refusal) => return refusal.into(),
        }
    }
    if let Err(e) = stream.send_hello_ok(&ok) {
        return e.into();
    }
    let conn = std::sync::Arc::new(PublishConn {
        topic,
        topic_name: meta.name.clone(),
        session_epoch: hello.session_epoch,
        session_key_hash: key_hash,
        session: (meta.order == 5).then(|| session.clone()),
        order: meta.order,
        ack_level: hello.ack_level,
        pending: ArrayQueue::new(MAX_UNACKED_BATCHES),
        out: Mutex::new(Outbox {
            sink: write_half,
            unsent: Vec::new(),
        }),
        closed: AtomicBool::new(false),
    });
    // The service thread acknowledges; for an order-5 session it also keeps the session's
    // last-active stamp fresh while the client is connected, acks or not; and it tells
    // every publisher, ack 0 too, when its topic is deleted.
    if shared.new_publishers.send(conn.clone()).is_err() {
        return End::Gone;
    }
    let end = receive_batches(shared, stream, &hello, topic, &conn, session);
    // Stop the service thread from writing, and finish any frame it left half sent,
    // so an error frame that follows starts on a frame boundary.
    let unsent = {
        let mut out = conn.out.lock().unwrap();
        conn.closed.store(true, Ordering::SeqCst);
        std::mem::take(&mut out.unsent)
    };
    if !unsent.is_empty() {
        let _ = stream.write_final(&unsent);
    }
    end
}

/// Order 5: whether the hello's connection may publish in its session, seen through
/// `session`; if so, marks the session active and returns the batch to resend from (the
/// HelloOk's `next_batch_seq`). A publisher that opens an epoch has the sequencer switch
/// the session to it first (`epoch_open`); one that joins an epoch must be its opener
/// (PROTOCOL.md section 8).
fn join_session(
    shared: &Shared,
    hello: &Hello,
    topic: u32,
    session: &mut SessionView,
) -> Result<u64, Refusal> {
    if hello.session_epoch > u32::MAX as u64 {
        return Err(Refusal::new(
            ErrorCode::BadSession,
            format!(
                "session epoch {} is above {}, the largest the session table holds; configure a smaller one (a publisher opens an epoch above the session's current one by itself)",
                hello.session_epoch,
                u32::MAX
            ),
        ));
    }
    let status = session.status(&shared.region);
    if status.foreign_key {
        return Err(refuse_foreign_key(shared, hello.client_id));
    }
    session.touch(&shared.region, unix_ms());
    // An epoch the table does not show yet is opened whatever the hello says: one that
    // joined it unopened could publish beside another publisher that opens it.
    let opens = hello.flags & embarcadero_wire::PUBLISH_OPENS_EPOCH != 0;
    if opens || hello.session_epoch > status.epoch {
        return crate::epoch_open::open(shared, hello, topic, session, &status);
    }
    if status.fenced {
        let hwm = status.acked_hwm(hello.ack_level);
        return Err(session::fenced(hello.session_epoch, hwm, status.epoch));
    }
    if status.epoch == hello.session_epoch && !status.opened_by(hello.opener) {
        return Err(crate::epoch_open::taken_over(hello, &status));
    }
    Ok(status.acked_hwm(hello.ack_level))
}

fn receive_batches<I: Inbound>(
    shared: &Shared,
    stream: &mut I,
    hello: &Hello,
    topic: u32,
    conn: &PublishConn,
    session: SessionView,
) -> End {
    let mut receiver = Receiver {
        shared,
        stream,
        hello,
        topic,
        conn,
        session,
        writer: shared.writer(topic),
        expected_seq: 0,
        discard_until: None,
        ended: false,
        faults: FaultDice::new(
            shared.config.fault.as_ref(),
            hello.client_id,
            hello.connection_index,
        ),
    };
    loop {
        if let Err(end) = receiver.next_batch() {
            return end;
        }
    }
}

/// One connection's receive loop: each batch is admitted (header checks, sequence,
/// order-5 session), received (once its payload is all there: a reservation in the log,
/// the payload straight into it, validation), then committed to the PBR.
struct Receiver<'a, I: Inbound> {
    shared: &'a Shared,
    stream: &'a mut I,
    hello: &'a Hello,
    topic: u32,
    conn: &'a PublishConn,
    session: SessionView,
    writer: &'a LogWriter,
    /// Orders 0-2: batches of a connection are numbered 0, 1, 2, ...
    expected_seq: u64,
    /// After a BACKPRESSURE error: batches are dropped until this one is resent.
    discard_until: Option<u64>,
    /// Order 5: the publisher sent its session's end, the last thing it may send.
    ended: bool,
    faults: FaultDice<'a>,
}

/// What admission decided about a batch whose header was read.
enum Admitted {
    /// Write it.
    Write,
    /// Its payload was read and dropped (discarded after BACKPRESSURE, or an order-5
    /// retransmit that is committed already and was acknowledged again).
    Done,
}

impl<'a, I: Inbound> Receiver<'a, I> {
    fn next_batch(&mut self) -> Result<(), End> {
        let header = self.read_header()?;
        if self.ended {
            return Err(Refusal {
                code: ErrorCode::MalformedBatch,
                batch_seq: header.batch_seq,
                session_epoch: 0,
                message: "nothing may follow a session's end (flags END_SESSION) on its connection"
                    .into(),
            }
            .into());
        }
        if header.ends_session() {
            self.ended = true;
            return crate::session_end::end(self.shared, self.hello, self.conn, &header)
                .map_err(End::from);
        }
        if let Admitted::Done = self.admit(&header)? {
            return Ok(());
        }
        if !self.shared.owns_logs() || !wait_for_ack_room(self.shared, self.conn) {
            return Err(End::Gone);
        }
        let stages = &self.shared.metrics.stages;
        let waiting = Instant::now();
        let staged = self.await_payload(&header)?;
        let started = StageTimes::lap(&stages.receive, waiting);
        let Some(reservation) = self.reserve(&header, staged.is_some())? else {
            return Ok(());
        };
        let reserved = StageTimes::lap(&stages.reserve, started);
        let validated = self.receive_into(&header, &reservation, staged, reserved)?;
        if self.faults.delay_then_drop(&self.shared.fault_drops) {
            commit_void(self.shared, self.topic, &reservation);
            self.expected_seq += 1;
            return Ok(());
        }
        self.commit(&header, &reservation, validated)
    }

    /// Reads and checks a batch header: its own fields, and that it is this client's.
    fn read_header(&mut self) -> Result<BatchHeader, End> {
        let mut raw = [0u8; BATCH_HEADER_LEN];
        self.stream.read_exact(&mut raw)?;
        let header = BatchHeader::decode(&raw).expect("128 bytes");
        if let Err(e) = header.validate_incoming(self.shared.config.max_batch_bytes) {
            return Err(Refusal::from_wire(&e, header.batch_seq).into());
        }
        if header.client_id != self.hello.client_id {
            return Err(Refusal {
                code: ErrorCode::MalformedBatch,
                batch_seq: header.batch_seq,
                session_epoch: 0,
                message: format!(
                    "batch names client {} but the connection belongs to client {}",
                    header.client_id, self.hello.client_id
                ),
            }
            .into());
        }
        Ok(header)
    }

    /// Whether to write the batch: discarded while a BACKPRESSURE resend is awaited;
    /// orders 0-2 in connection sequence; order 5 through the session's admission.
    fn admit(&mut self, header: &BatchHeader) -> Result<Admitted, End> {
        if self.discard_until.is_some_and(|k| header.batch_seq != k) {
            self.stream.drain(header.total_size)?;
            return Ok(Admitted::Done);
        }
        // Go-back-N: the batch resent after BACKPRESSURE is the refused one, which was
        // never committed, so orders 0-2 still expect it (a window that moved on would
        // take the resend for out of sequence, or accept a gap).
        assert!(
            self.conn.order == 5 || self.discard_until.is_none_or(|k| k == self.expected_seq),
            "the refused batch {:?} is the one expected next, {}",
            self.discard_until,
            self.expected_seq
        );
        self.discard_until = None;
        if self.conn.order == 5 {
            if admit_session_batch(self.shared, &mut self.session, self.hello, header)? {
                return Ok(Admitted::Write);
            }
            // Already committed (a retransmit): acknowledge, do not write again.
            self.stream.drain(header.total_size)?;
            push_pending(self.conn, header.batch_seq, 0, Instant::now());
            let broker = self.shared.config.broker_id;
            self.shared.region.broker_bell(broker).ring();
            return Ok(Admitted::Done);
        }
        if header.batch_seq != self.expected_seq {
            return Err(Refusal {
                code: ErrorCode::OutOfSequence,
                batch_seq: header.batch_seq,
                session_epoch: 0,
                message: format!(
                    "batch sequence {} arrived, {} was expected",
                    header.batch_seq, self.expected_seq
                ),
            }
            .into());
        }
        Ok(Admitted::Write)
    }

    /// Waits until the whole payload can be received without waiting on the client
    /// (`payload_wait`): nothing is reserved before, so one slow client cannot hold back
    /// the log. A payload larger than the socket can buffer is staged in memory.
    fn await_payload(&mut self, header: &BatchHeader) -> Result<Option<Staged<'a>>, End> {
        let limit = self.shared.config.payload_timeout;
        let deadline = Instant::now() + limit;
        let len = header.total_size as usize;
        match self.stream.await_payload(len, limit)? {
            Arrival::InSocket => Ok(None),
            Arrival::TooLargeForSocket => {
                match self
                    .stream
                    .stage(len, deadline, &self.shared.staged_bytes)?
                {
                    Some(staged) => Ok(Some(staged)),
                    None => Err(slow_payload(header, limit).into()),
                }
            }
            Arrival::TimedOut => Err(slow_payload(header, limit).into()),
        }
    }

    /// Reserves the batch's place in the log; `None` when the log had no room within
    /// the backpressure timeout and the batch was refused with BACKPRESSURE (its
    /// payload dropped; later batches are discarded until it is sent again).
    fn reserve(&mut self, header: &BatchHeader, staged: bool) -> Result<Option<Reservation>, End> {
        let (shared, topic) = (self.shared, self.topic);
        let may_refuse = self.conn.ack_level > 0;
        if let Some(r) =
            reserve_with_backpressure(shared, self.writer, header.total_size, may_refuse)
        {
            assert_eq!(r.len, header.total_size, "reserved what the header says");
            return Ok(Some(r));
        }
        if shared.region.topic_deleted(topic) {
            // The service thread has sent TopicDeleted and closed the connection.
            return Err(End::Gone);
        }
        if !staged {
            self.stream.drain(header.total_size)?;
        }
        if refuse_backpressure(shared, self.conn, header).is_err() {
            return Err(End::Gone);
        }
        self.discard_until = Some(header.batch_seq);
        Ok(None)
    }

    /// Receives the payload into its reservation and validates it; a failure voids the
    /// reservation. Returns when validation finished (the ack-wait stage starts there).
    fn receive_into(
        &mut self,
        header: &BatchHeader,
        reservation: &Reservation,
        staged: Option<Staged<'a>>,
        reserved: Instant,
    ) -> Result<Instant, End> {
        let (shared, topic) = (self.shared, self.topic);
        let broker = shared.config.broker_id;
        let limit = shared.config.payload_timeout;
        // SAFETY: the reservation gives this connection exclusive ownership of the
        // range until its PBR slot is committed (or voided on error).
        let dest = unsafe {
            shared
                .region
                .blog_bytes_mut(topic, broker, reservation.log_offset, reservation.len)
        }
        .expect("reserved range is mapped and inside one segment");
        let received = match staged {
            Some(staged) => {
                dest.copy_from_slice(&staged.bytes);
                Ok(true)
            }
            // Whole in the socket already: this read does not wait on the client.
            None => self.stream.read_exact_within(dest, limit),
        };
        let void = |end: End| {
            commit_void(shared, topic, reservation);
            end
        };
        match received {
            Ok(true) => {}
            Ok(false) => return Err(void(slow_payload(header, limit).into())),
            Err(e) => return Err(void(e.into())),
        }
        let stages = &shared.metrics.stages;
        let arrived = StageTimes::lap(&stages.receive, reserved);
        if let Err(e) = validate_batch_payload(header, dest, shared.config.max_message_bytes) {
            return Err(void(Refusal::from_wire(&e, header.batch_seq).into()));
        }
        embarcadero_region::coherence::flush_range(dest.as_ptr(), dest.len());
        Ok(StageTimes::lap(&stages.validate, arrived))
    }

    /// Commits the batch to its PBR slot and queues its acknowledgement.
    fn commit(
        &mut self,
        header: &BatchHeader,
        reservation: &Reservation,
        validated: Instant,
    ) -> Result<(), End> {
        let (shared, topic, conn) = (self.shared, self.topic, self.conn);
        let region = &shared.region;
        let broker = shared.config.broker_id;
        // Orders 0-2 acknowledge by count: a batch committed out of its connection's
        // sequence would be acknowledged as another one.
        assert!(
            conn.order == 5 || header.batch_seq == self.expected_seq,
            "batch {} committed where {} is expected",
            header.batch_seq,
            self.expected_seq
        );
        let committed = BatchHeader {
            broker_id: broker as u16,
            flags: BatchFlags::VALID,
            pbr_index: reservation.pbr_index,
            log_offset: reservation.log_offset,
            start_logical_offset: 0,
            total_order: 0,
            topic_id: topic,
            committed_ns: if shared.stamp_commits {
                embarcadero_region::monotonic_ns()
            } else {
                0
            },
            session_key_hash: conn.session_key_hash,
            publish_commit: 0,
            ..*header
        };
        // Counted before the commit, so no acknowledgement can get ahead of the counters.
        let m = &shared.metrics;
        m.publish_batches.fetch_add(1, Ordering::Relaxed);
        m.publish_messages
            .fetch_add(header.num_msg as u64, Ordering::Relaxed);
        m.publish_bytes
            .fetch_add(header.total_size, Ordering::Relaxed);
        // A process declared dead and replaced must not commit over its successor's
        // slots (a paused process resumes here; see `resume`).
        if !shared.owns_logs() {
            return Err(End::Gone);
        }
        if conn.order >= 2 {
            // The service thread acknowledges these once they are ordered, woken by the
            // sequencer: waking it for the commit as well would double its wake-ups. So
            // the entry is queued before the commit: the sequencer may order the batch
            // and ring the bell as soon as it is committed, and an entry queued after
            // that ring would wait for the next epoch's (or the sleep's timeout).
            push_pending(conn, header.batch_seq, reservation.pbr_index, validated);
            commit_reserved(shared, topic, reservation, &committed);
            region.sequencer_bell().ring();
        } else {
            // Order 0 acknowledges whatever is queued: only after the commit.
            commit_reserved(shared, topic, reservation, &committed);
            push_pending(conn, header.batch_seq, reservation.pbr_index, validated);
            region.broker_bell(broker).ring();
        }
        StageTimes::lap(&shared.metrics.stages.commit, validated);
        self.expected_seq += 1;
        Ok(())
    }
}

/// The refusal of a batch whose payload did not arrive within `limit` of its header.
fn slow_payload(header: &BatchHeader, limit: Duration) -> Refusal {
    Refusal {
        code: ErrorCode::SlowPayload,
        batch_seq: header.batch_seq,
        session_epoch: 0,
        message: format!(
            "the payload of batch {} ({} bytes) did not arrive within {} ms of its \
             header; reconnect and resend it (smaller batches on a slow link)",
            header.batch_seq,
            header.total_size,
            limit.as_millis()
        ),
    }
}

/// Tells the client its batch is refused for lack of log memory (it resends from it,
/// go-back-N), and counts it.
fn refuse_backpressure(
    shared: &Shared,
    conn: &PublishConn,
    header: &BatchHeader,
) -> io::Result<()> {
    shared
        .metrics
        .backpressure_errors
        .fetch_add(1, Ordering::Relaxed);
    let frame = ErrorFrame {
        code: ErrorCode::Backpressure,
        batch_seq: header.batch_seq,
        session_epoch: 0,
        message: format!(
            "broker {} is out of log memory for {} ms; resend from batch {}",
            shared.config.broker_id,
            shared.config.backpressure_timeout.as_millis(),
            header.batch_seq
        ),
    }
    .encode();
    send_from_connection(conn, &frame)
}

/// Waits until the connection's ack queue has room for one more batch, before the batch
/// reserves anything: a connection thread that waited for room while holding a reserved
/// slot would hold up every later batch of its log, and an order-5 client whose session
/// gap is never filled would never give that room back. Only this thread pushes, so the
/// room is still there when the batch is queued after its commit. False when the
/// connection was closed meanwhile (its session fenced, its client gone) or the broker stops.
fn wait_for_ack_room(shared: &Shared, conn: &PublishConn) -> bool {
    if conn.ack_level == 0 {
        return true;
    }
    while conn.pending.is_full() {
        if conn.closed.load(Ordering::Acquire) || shared.shutdown.load(Ordering::Relaxed) {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    true
}

/// Queues a committed batch for acknowledgement by the service thread.
fn push_pending(conn: &PublishConn, batch_seq: u64, pbr_index: u64, queued_at: Instant) {
    if conn.ack_level == 0 {
        return;
    }
    let mut item = PendingAck {
        batch_seq,
        pbr_index,
        queued_at,
    };
    while let Err(back) = conn.pending.push(item) {
        // The client has thousands of batches unacknowledged; wait for the acks.
        if conn.closed.load(Ordering::Relaxed) {
            return;
        }
        item = back;
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Order 5 ingest checks. `Ok(false)` means the batch is already committed (a
/// retransmit) and must not be written again.
fn admit_session_batch(
    shared: &Shared,
    session: &mut SessionView,
    hello: &Hello,
    header: &BatchHeader,
) -> Result<bool, Refusal> {
    if header.session_epoch != hello.session_epoch {
        return Err(Refusal {
            code: ErrorCode::MalformedBatch,
            batch_seq: header.batch_seq,
            session_epoch: 0,
            message: format!(
                "batch names session epoch {} but the connection was opened for epoch {}",
                header.session_epoch, hello.session_epoch
            ),
        });
    }
    let window = shared.config.session_window;
    let status = wait_for_session_window(shared, session, header, window);
    if status.foreign_key {
        return Err(refuse_foreign_key(shared, hello.client_id));
    }
    if status.fenced {
        return Err(session::fenced(
            hello.session_epoch,
            status.acked_hwm(hello.ack_level),
            status.epoch,
        ));
    }
    if header.batch_seq < status.committed_hwm {
        return Ok(false);
    }
    if status.expired {
        return Err(Refusal {
            code: ErrorCode::SessionExpired,
            batch_seq: header.batch_seq,
            session_epoch: 0,
            message: session::expired_message(shared.config.session_idle_evict),
        });
    }
    session.touch(&shared.region, unix_ms());
    if header.batch_seq >= status.committed_hwm + window {
        return Err(beyond_window(shared, header, status.committed_hwm, window));
    }
    Ok(true)
}

/// The session's status once the batch is within `window` batches of its committed
/// high-water mark, or once it is fenced or expired, the broker stops, or the
/// backpressure timeout passes. A batch beyond the window waits (the connection stops
/// reading: backpressure) for the session's head to move, and is refused only after
/// the backpressure timeout.
fn wait_for_session_window(
    shared: &Shared,
    session: &mut SessionView,
    header: &BatchHeader,
    window: u64,
) -> SessionStatus {
    let deadline = Instant::now() + shared.config.backpressure_timeout;
    let mut backoff = Backoff::new(Duration::from_millis(1));
    let mut waited = false;
    loop {
        let status = session.status(&shared.region);
        if status.fenced
            || status.expired
            || header.batch_seq < status.committed_hwm + window
            || Instant::now() >= deadline
            || shared.shutdown.load(Ordering::Relaxed)
        {
            break status;
        }
        if !waited {
            waited = true;
            shared
                .metrics
                .session_window_waits
                .fetch_add(1, Ordering::Relaxed);
        }
        backoff.idle(None);
    }
}

/// The refusal of a batch still beyond the session window after the backpressure
/// timeout (`committed_hwm`: where the session has committed up to).
fn beyond_window(
    shared: &Shared,
    header: &BatchHeader,
    committed_hwm: u64,
    window: u64,
) -> Refusal {
    Refusal {
        code: ErrorCode::OutOfSequence,
        batch_seq: header.batch_seq,
        session_epoch: 0,
        message: format!(
            "batch sequence {} is beyond the session window: the session has committed up to {} and accepts at most {window} batches above that; waited {} ms for it to move",
            header.batch_seq,
            committed_hwm,
            shared.config.backpressure_timeout.as_millis()
        ),
    }
}

/// Refuses a connection whose session is bound to another key, and counts it.
pub(crate) fn refuse_foreign_key(shared: &Shared, client_id: u64) -> Refusal {
    let before = shared
        .metrics
        .session_key_refusals
        .fetch_add(1, Ordering::Relaxed);
    // The 1st, 2nd, 4th, ... refusal: a client that retries must not flood the log.
    if (before + 1).is_power_of_two() {
        tracing::warn!(
            client_id,
            refusals = before + 1,
            "order-5 connection refused: its session is bound to another key (a hijack \
             attempt?); embarcadero_session_key_refusals_total counts them"
        );
    }
    Refusal::new(
        ErrorCode::SessionKeyMismatch,
        session::foreign_key_message(client_id),
    )
}

/// Waits while the broker is above its high watermark or the log has no room, up to
/// the backpressure timeout (or, when `may_refuse` is false, until memory frees up).
/// `None` means the batch must be refused with BACKPRESSURE.
pub(crate) fn reserve_with_backpressure(
    shared: &Shared,
    writer: &crate::LogWriter,
    len: u64,
    may_refuse: bool,
) -> Option<Reservation> {
    let mut deadline: Option<Instant> = None;
    let mut backoff = Backoff::new(Duration::from_millis(1));
    loop {
        if !shared.paused.load(Ordering::Acquire) {
            match writer.reserve(len) {
                Ok(r) => return Some(r),
                Err(ReserveError::RingFull | ReserveError::NoSegment) => {}
            }
        }
        let now = Instant::now();
        let deadline = *deadline.get_or_insert_with(|| {
            shared
                .metrics
                .backpressure_waits
                .fetch_add(1, Ordering::Relaxed);
            now + shared.config.backpressure_timeout
        });
        // Ack-0 publishers cannot resend (they keep no copies), so they only ever get
        // TCP backpressure: the broker waits for memory instead of refusing.
        // A deleted topic's memory is released only once this connection has gone.
        if (may_refuse && now >= deadline)
            || shared.shutdown.load(Ordering::Relaxed)
            || shared.region.topic_deleted(writer.topic)
        {
            return None;
        }
        // Ask the service thread to reclaim, then wait a little.
        shared.region.broker_bell(shared.config.broker_id).ring();
        backoff.idle(None);
    }
}

/// Why a marker slot (an epoch open, a session's end) was not committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MarkerNotCommitted {
    /// The log had no room within the backpressure timeout.
    NoRoom,
    /// This broker was replaced: its successor owns the log.
    Replaced,
}

/// Commits a void marker slot of `topic` (one message header's bytes, which no reader
/// reads) whose header `make` writes for its reservation; returns its PBR index.
pub(crate) fn commit_marker(
    shared: &Shared,
    topic: u32,
    make: impl FnOnce(&Reservation) -> BatchHeader,
) -> Result<u64, MarkerNotCommitted> {
    let writer = shared.writer(topic);
    let len = embarcadero_wire::MESSAGE_HEADER_LEN as u64;
    let r =
        reserve_with_backpressure(shared, writer, len, true).ok_or(MarkerNotCommitted::NoRoom)?;
    if !shared.owns_logs() {
        return Err(MarkerNotCommitted::Replaced);
    }
    let header = make(&r);
    assert!(
        header.flags & BatchFlags::VOID != 0 && header.flags & BatchFlags::VALID == 0,
        "a marker slot is void: no reader reads its bytes"
    );
    commit_reserved(shared, topic, &r, &header);
    Ok(r.pbr_index)
}

/// Commits a reserved slot as void: its space is skipped by every reader.
fn commit_void(shared: &Shared, topic: u32, r: &Reservation) {
    // As in `Receiver::commit`: a process declared dead and replaced leaves the slot to
    // its successor, which voided it already (`resume`) and may have reused it.
    if !shared.owns_logs() {
        return;
    }
    let broker = shared.config.broker_id;
    let void = BatchHeader {
        broker_id: broker as u16,
        flags: BatchFlags::VOID,
        pbr_index: r.pbr_index,
        log_offset: r.log_offset,
        total_size: r.len,
        topic_id: topic,
        ..Default::default()
    };
    commit_reserved(shared, topic, r, &void);
    shared.region.sequencer_bell().ring();
    shared.region.broker_bell(broker).ring();
}

/// Commits a reservation's PBR slot: the pair of `LogWriter::reserve`. Each reservation
/// is committed exactly once (valid, or void on any failure), and while it is open
/// nothing may reclaim its slot: reclamation stops at the written frontier, which
/// cannot pass an uncommitted slot. One load of the broker's own line and one of the
/// slot's token, which the commit writes next.
pub(crate) fn commit_reserved(shared: &Shared, topic: u32, r: &Reservation, h: &BatchHeader) {
    let (region, broker) = (&shared.region, shared.config.broker_id);
    let reclaimed = region
        .log(topic, broker)
        .reclaimed_pbr
        .load(Ordering::Acquire);
    assert!(
        r.pbr_index >= reclaimed,
        "log ({topic}, {broker}): reserved slot {} reclaimed (up to {reclaimed}) before its commit",
        r.pbr_index
    );
    assert!(
        !region.pbr_holds(topic, broker, r.pbr_index),
        "log ({topic}, {broker}): reserved slot {} committed twice",
        r.pbr_index
    );
    assert!(
        h.pbr_index == r.pbr_index && h.log_offset == r.log_offset && h.total_size == r.len,
        "the slot's header describes its reservation {r:?}"
    );
    region.pbr_commit(topic, broker, r.pbr_index, h);
}
