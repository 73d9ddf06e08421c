//! Order 5: a publisher's hello that opens an epoch (`PUBLISH_OPENS_EPOCH`) is answered
//! only once the sequencer has switched the session to that epoch, for that publisher.
//!
//! The broker commits an epoch-open slot to its PBR (void, flagged `EPOCH_OPEN`: client
//! id, epoch, the hello's opener, its key hash) and waits until the session table shows
//! the epoch. The sequencer switches the session on that slot, stops admitting the
//! epoch before, and shows the new epoch in the table only once everything the epoch
//! before admitted is committed; so the committed mark the HelloOk reports is where the
//! opener's numbering starts, past every batch of the old epoch. Without this, a second
//! publisher of a session (a restarted program whose first run still lives) numbered
//! batches the first one still had ordered, and deduplication dropped acknowledged ones.
//!
//! Owns: the slot's header and the wait. Touches the broker's log writer (one slot) and
//! reads the session table and the log's ordered frontier.

use crate::log_writer::Reservation;
use crate::net::Refusal;
use crate::session::{self, SessionStatus, SessionView};
use crate::Shared;
use embarcadero_region::backoff::Backoff;
use embarcadero_wire::{BatchFlags, BatchHeader, ErrorCode, Hello};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long a hello waits for the sequencer to open its epoch: far above an ordering
/// epoch, below the client's 10 s wait for a HelloOk.
const OPEN_WAIT: Duration = Duration::from_secs(5);

/// Opens the hello's epoch of its session, or joins it when this publisher (by its
/// opener) opened it on another connection. Returns the HelloOk's mark: for an opening
/// hello the session's committed mark, the batch the publisher numbers from; for one
/// that only joins (a publisher adding a broker after a fence raised its epoch) the
/// acknowledged mark, as any join. A session at a newer epoch, or at this one opened by
/// another publisher, refuses the hello.
/// `status`: the session as the hello found it.
pub(crate) fn open(
    shared: &Shared,
    hello: &Hello,
    topic: u32,
    session: &mut SessionView,
    status: &SessionStatus,
) -> Result<u64, Refusal> {
    if let Some(verdict) = settled(hello, status) {
        return verdict;
    }
    let slot = commit_open_slot(shared, hello, topic)?;
    shared.region.sequencer_bell().ring();
    let status = wait_for_table(shared, hello, topic, session, slot)?;
    settled(hello, &status).expect("the table holds the epoch or a newer one")
}

/// What the table says of the hello's epoch once it is at or past it: joined (the
/// committed mark), or refused. `None` while the table is below it.
fn settled(hello: &Hello, status: &SessionStatus) -> Option<Result<u64, Refusal>> {
    let epoch = hello.session_epoch;
    if status.epoch < epoch {
        return None;
    }
    let hwm = status.acked_hwm(hello.ack_level);
    let opens = hello.flags & embarcadero_wire::PUBLISH_OPENS_EPOCH != 0;
    // An opening hello joins only its own opener's epoch: one the table does not know
    // the opener of (opener 0: a restarted server's, or opened by an older client) may
    // be another live publisher's, so it opens the next one instead.
    let owner = if opens && hello.opener != 0 {
        status.opener == hello.opener
    } else {
        status.opened_by(hello.opener)
    };
    Some(if status.epoch > epoch {
        Err(session::fenced(epoch, hwm, status.epoch))
    } else if !owner {
        Err(taken_over(hello, status))
    } else if status.epoch_fenced {
        Err(session::fenced(epoch, hwm, status.epoch))
    } else if opens {
        Ok(status.committed_hwm)
    } else {
        Ok(hwm)
    })
}

/// The refusal of a hello for an epoch another publisher of the session opened.
pub(crate) fn taken_over(hello: &Hello, status: &SessionStatus) -> Refusal {
    Refusal {
        code: ErrorCode::SessionTakenOver,
        batch_seq: status.acked_hwm(hello.ack_level),
        session_epoch: status.epoch,
        message: format!(
            "epoch {} of the order-5 session of client id {} was opened by another publisher with this client id and session key: it owns the session now; a publisher starting up opens a newer epoch, one that was publishing stops",
            status.epoch, hello.client_id
        ),
    }
}

/// Commits the epoch-open slot (a void marker slot) and returns its PBR index.
fn commit_open_slot(shared: &Shared, hello: &Hello, topic: u32) -> Result<u64, Refusal> {
    use crate::publish::MarkerNotCommitted;
    crate::publish::commit_marker(shared, topic, |r| open_slot_header(shared, hello, topic, r))
        .map_err(|why| match why {
            MarkerNotCommitted::NoRoom => Refusal::new(
                ErrorCode::Backpressure,
                "the broker has no room in its log to open the session's epoch; retry",
            ),
            MarkerNotCommitted::Replaced => Refusal::new(
                ErrorCode::ShuttingDown,
                "this broker was replaced; connect to its successor",
            ),
        })
}

fn open_slot_header(shared: &Shared, hello: &Hello, topic: u32, r: &Reservation) -> BatchHeader {
    BatchHeader {
        client_id: hello.client_id,
        broker_id: shared.config.broker_id as u16,
        flags: BatchFlags::VOID | BatchFlags::EPOCH_OPEN,
        session_epoch: hello.session_epoch,
        batch_id: hello.opener as u64,
        pbr_index: r.pbr_index,
        log_offset: r.log_offset,
        total_size: r.len,
        topic_id: topic,
        session_key_hash: embarcadero_wire::session_key_hash(&hello.session_key),
        ..Default::default()
    }
}

/// Waits until the table is at or past the hello's epoch. The sequencer writes the
/// table before it moves the ordered frontier, so a frontier read past `slot` before a
/// table still below the epoch means it took the slot without switching: the session
/// found no table slot, or is bound to another key.
fn wait_for_table(
    shared: &Shared,
    hello: &Hello,
    topic: u32,
    session: &mut SessionView,
    slot: u64,
) -> Result<SessionStatus, Refusal> {
    let deadline = Instant::now() + OPEN_WAIT;
    let mut backoff = Backoff::new(Duration::from_millis(1));
    let log = shared.region.log(topic, shared.config.broker_id);
    loop {
        let ordered = log.ordered_pbr.load(Ordering::Acquire);
        let status = session.status(&shared.region);
        if status.foreign_key {
            return Err(crate::publish::refuse_foreign_key(shared, hello.client_id));
        }
        if status.epoch >= hello.session_epoch {
            return Ok(status);
        }
        if ordered > slot {
            return Err(not_opened(shared, topic, &status));
        }
        if Instant::now() >= deadline || shared.shutdown.load(Ordering::Relaxed) {
            return Err(Refusal::new(
                ErrorCode::Internal,
                format!(
                    "the sequencer did not open the session's epoch within {} s (is it running, or failing over?); retry",
                    OPEN_WAIT.as_secs()
                ),
            ));
        }
        backoff.idle(None);
    }
}

/// The refusal of an epoch open the sequencer passed without switching the session.
fn not_opened(shared: &Shared, topic: u32, status: &SessionStatus) -> Refusal {
    if status.epoch == 0 {
        let name = shared
            .region
            .topic_meta(topic)
            .map_or_else(String::new, |m| m.name);
        return Refusal::new(
            ErrorCode::SessionsExhausted,
            session::exhausted_message(&name, shared.config.session_idle_evict),
        );
    }
    Refusal::new(
        ErrorCode::Internal,
        format!(
            "the sequencer passed this hello's epoch open and left the session at epoch {}; retry",
            status.epoch
        ),
    )
}
