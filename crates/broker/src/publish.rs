//! The publish path of one connection: header, reservation, payload straight into
//! the log, validation, PBR commit. Acknowledgements are sent by the service thread,
//! which this connection feeds through a single-producer queue.

use crate::log_writer::{Reservation, ReserveError};
use crate::net::{self, End, Refusal};
use crate::Shared;
use crossbeam_queue::ArrayQueue;
use embarcadero_region::backoff::Backoff;
use embarcadero_region::TopicMeta;
use embarcadero_wire::{
    validate_batch_payload, BatchFlags, BatchHeader, ErrorCode, ErrorFrame, Hello, BATCH_HEADER_LEN,
};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Batches a connection may have written but not yet had acknowledged.
const MAX_UNACKED_BATCHES: usize = 1 << 16;

/// What the service thread needs to acknowledge one publishing connection.
pub struct PublishConn {
    pub topic: u32,
    pub order: u8,
    pub ack_level: u8,
    /// `(batch_seq, pbr_index)` of committed batches, in order. Producer: the
    /// connection thread. Consumer: the service thread.
    pub pending: ArrayQueue<(u64, u64)>,
    pub out: Mutex<Outbox>,
    pub closed: AtomicBool,
}

/// The write half of a connection, shared by acks (service thread) and retriable
/// error frames (connection thread). Per connection: never shared between connections.
pub struct Outbox {
    pub stream: TcpStream,
    /// Bytes of a frame a non-blocking send left unsent; they go out before anything else.
    pub unsent: Vec<u8>,
}

impl Outbox {
    /// Appends a frame and sends as much as the socket takes without blocking.
    pub fn send_nonblocking(&mut self, frame: &[u8]) -> io::Result<()> {
        self.unsent.extend_from_slice(frame);
        let sock = socket2::SockRef::from(&self.stream);
        while !self.unsent.is_empty() {
            match sock.send_with_flags(&self.unsent, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
                Ok(n) => {
                    self.unsent.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Sends everything pending plus `frame`, blocking (bounded by a write timeout).
    pub fn send_blocking(&mut self, frame: &[u8]) -> io::Result<()> {
        let _ = self.stream.set_write_timeout(Some(Duration::from_secs(5)));
        let mut all = std::mem::take(&mut self.unsent);
        all.extend_from_slice(frame);
        self.stream.write_all(&all)
    }
}

pub fn run(
    shared: &Shared,
    write_half: io::Result<TcpStream>,
    stream: &mut TcpStream,
    hello: Hello,
    topic: u32,
    meta: TopicMeta,
) -> End {
    let write_half = match write_half {
        Ok(w) => w,
        Err(_) => return End::Gone,
    };
    if let Err(e) = net::send_hello_ok(stream, &net::hello_ok(shared, &hello, topic, &meta)) {
        return e.into();
    }
    let conn = std::sync::Arc::new(PublishConn {
        topic,
        order: meta.order,
        ack_level: hello.ack_level,
        pending: ArrayQueue::new(MAX_UNACKED_BATCHES),
        out: Mutex::new(Outbox {
            stream: write_half,
            unsent: Vec::new(),
        }),
        closed: AtomicBool::new(false),
    });
    if hello.ack_level > 0 && shared.new_publishers.send(conn.clone()).is_err() {
        return End::Gone;
    }
    let end = receive_batches(shared, stream, &hello, topic, &conn);
    // Stop the service thread from writing, and finish any frame it left half sent,
    // so an error frame that follows starts on a frame boundary.
    let mut out = conn.out.lock().unwrap();
    conn.closed.store(true, Ordering::SeqCst);
    if !out.unsent.is_empty() {
        let _ = out.send_blocking(&[]);
    }
    end
}

fn receive_batches(
    shared: &Shared,
    stream: &mut TcpStream,
    hello: &Hello,
    topic: u32,
    conn: &PublishConn,
) -> End {
    let writer = shared.writer(topic);
    let broker = shared.config.broker_id;
    let region = &shared.region;
    let max_batch = shared.config.max_batch_bytes;
    let mut expected_seq = 0u64;
    // After a BACKPRESSURE error: batches are dropped until `expected_seq` is resent.
    let mut discarding = false;
    let mut raw = [0u8; BATCH_HEADER_LEN];
    loop {
        if let Err(e) = stream.read_exact(&mut raw) {
            return e.into();
        }
        let header = BatchHeader::decode(&raw).expect("128 bytes");
        if let Err(e) = header.validate_incoming(max_batch) {
            return Refusal::from_wire(&e, header.batch_seq).into();
        }
        if header.client_id != hello.client_id {
            return Refusal {
                code: ErrorCode::MalformedBatch,
                batch_seq: header.batch_seq,
                message: format!(
                    "batch names client {} but the connection belongs to client {}",
                    header.client_id, hello.client_id
                ),
            }
            .into();
        }
        if discarding && header.batch_seq != expected_seq {
            if let Err(e) = net::drain(stream, header.total_size) {
                return e.into();
            }
            continue;
        }
        discarding = false;
        if header.batch_seq != expected_seq {
            return Refusal {
                code: ErrorCode::OutOfSequence,
                batch_seq: header.batch_seq,
                message: format!(
                    "batch sequence {} arrived, {} was expected",
                    header.batch_seq, expected_seq
                ),
            }
            .into();
        }
        let reservation = match reserve_with_backpressure(shared, writer, header.total_size) {
            Some(r) => r,
            None => {
                if let Err(e) = net::drain(stream, header.total_size) {
                    return e.into();
                }
                shared
                    .metrics
                    .backpressure_errors
                    .fetch_add(1, Ordering::Relaxed);
                let frame = ErrorFrame {
                    code: ErrorCode::Backpressure,
                    batch_seq: header.batch_seq,
                    message: format!(
                        "broker {broker} is out of log memory for {} ms; resend from batch {}",
                        shared.config.backpressure_timeout.as_millis(),
                        header.batch_seq
                    ),
                }
                .encode();
                if conn.out.lock().unwrap().send_blocking(&frame).is_err() {
                    return End::Gone;
                }
                discarding = true;
                continue;
            }
        };
        // SAFETY: the reservation gives this connection exclusive ownership of the
        // range until its PBR slot is committed below (or voided on error).
        let dest = unsafe {
            region.blog_bytes_mut(topic, broker, reservation.log_offset, reservation.len)
        }
        .expect("reserved range is mapped and inside one segment");
        if let Err(e) = stream.read_exact(dest) {
            commit_void(shared, topic, &reservation);
            return e.into();
        }
        if let Err(e) = validate_batch_payload(&header, dest, shared.config.max_message_bytes) {
            commit_void(shared, topic, &reservation);
            return Refusal::from_wire(&e, header.batch_seq).into();
        }
        embarcadero_region::coherence::flush_range(dest.as_ptr(), dest.len());
        let committed = BatchHeader {
            broker_id: broker as u16,
            flags: BatchFlags::VALID,
            pbr_index: reservation.pbr_index,
            log_offset: reservation.log_offset,
            start_logical_offset: 0,
            total_order: 0,
            topic_id: topic,
            publish_commit: 0,
            ..header
        };
        region.pbr_commit(topic, broker, reservation.pbr_index, &committed);
        if conn.ack_level > 0 {
            let mut item = (header.batch_seq, reservation.pbr_index);
            while let Err(back) = conn.pending.push(item) {
                // The client has 64Ki batches unacknowledged; wait for the acks.
                item = back;
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        if conn.order >= 2 {
            region.sequencer_bell().ring();
        }
        region.broker_bell(broker).ring();
        expected_seq += 1;
        let m = &shared.metrics;
        m.publish_batches.fetch_add(1, Ordering::Relaxed);
        m.publish_messages
            .fetch_add(header.num_msg as u64, Ordering::Relaxed);
        m.publish_bytes
            .fetch_add(header.total_size, Ordering::Relaxed);
    }
}

/// Waits while the broker is above its high watermark or the log has no room, up to
/// the backpressure timeout. `None` means the batch must be refused with BACKPRESSURE.
fn reserve_with_backpressure(
    shared: &Shared,
    writer: &crate::LogWriter,
    len: u64,
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
        if now >= deadline || shared.shutdown.load(Ordering::Relaxed) {
            return None;
        }
        // Ask the service thread to reclaim, then wait a little.
        shared.region.broker_bell(shared.config.broker_id).ring();
        backoff.idle(None);
    }
}

/// Commits a reserved slot as void: its space is skipped by every reader.
fn commit_void(shared: &Shared, topic: u32, r: &Reservation) {
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
    shared.region.pbr_commit(topic, broker, r.pbr_index, &void);
    shared.region.sequencer_bell().ring();
    shared.region.broker_bell(broker).ring();
}
