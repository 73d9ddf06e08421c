//! Order 5: a publisher that closes ends its session (`BatchFlags::END_SESSION`), so
//! that the session's table slot can go to a new session at once rather than after
//! `sequencer.session_idle_evict_secs`. Without it, 256 short-lived publishers of one
//! topic (a script that runs `embarcadero pub` in a loop, a web handler that makes a
//! publisher per request) took every slot for ten minutes.
//!
//! The publisher sends a header with no messages once every batch it sent is
//! acknowledged; the broker commits a void marker slot naming the connection's own
//! session (client id, epoch, opener and key hash from the hello it accepted, never
//! from the header, so a connection can end only its own session) and the next batch
//! the publisher would have numbered. The sequencer decides: it ends nothing while the
//! session holds or expects a batch. Nothing is answered; a marker that cannot be
//! written (no room, a replaced broker) is dropped, and the session ends by idleness
//! as before.
//!
//! Owns: the marker slot's header. Touches the broker's log writer (one slot).

use crate::net::Refusal;
use crate::publish::{self, PublishConn};
use crate::Shared;
use embarcadero_wire::{BatchFlags, BatchHeader, ErrorCode, Hello};

/// Takes a publisher's end of its session (`end`, a header that passed
/// `validate_incoming` with `END_SESSION` set), on connection `conn` opened by `hello`.
pub(crate) fn end(
    shared: &Shared,
    hello: &Hello,
    conn: &PublishConn,
    end: &BatchHeader,
) -> Result<(), Refusal> {
    debug_assert!(end.ends_session() && end.num_msg == 0 && end.total_size == 0);
    if conn.order != 5 {
        return Err(Refusal {
            code: ErrorCode::MalformedBatch,
            batch_seq: end.batch_seq,
            session_epoch: 0,
            message: format!(
                "only an order-5 publisher ends a session (flags END_SESSION); this topic is order {}",
                conn.order
            ),
        });
    }
    let committed = publish::commit_marker(shared, conn.topic, |r| BatchHeader {
        batch_seq: end.batch_seq,
        client_id: hello.client_id,
        broker_id: shared.config.broker_id as u16,
        flags: BatchFlags::VOID | BatchFlags::END_SESSION,
        session_epoch: conn.session_epoch,
        batch_id: hello.opener as u64,
        pbr_index: r.pbr_index,
        log_offset: r.log_offset,
        total_size: r.len,
        topic_id: conn.topic,
        session_key_hash: conn.session_key_hash,
        ..Default::default()
    });
    match committed {
        Ok(_) => shared.region.sequencer_bell().ring(),
        Err(why) => {
            tracing::debug!(
                client = hello.client_id,
                ?why,
                "an order-5 session's end was not written; the session ends once idle"
            );
        }
    }
    Ok(())
}
