//! `BatchHeader`: the 128-byte header a publisher sends before each batch, and the
//! format of a pending-batch-ring (PBR) slot in the shared region.

use crate::le::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::{need, WireError, BATCH_HEADER_LEN, MESSAGE_HEADER_LEN};

/// Bits of [`BatchHeader::flags`]. Publishers send 0, or [`Self::END_SESSION`] alone
/// on a header with no messages; the broker sets the others in the PBR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchFlags;

impl BatchFlags {
    /// The slot holds a batch whose payload was fully received and validated.
    pub const VALID: u16 = 1;
    /// The slot was reserved but its batch was abandoned (connection died mid-batch,
    /// backpressure timeout). Readers skip it; it still advances the ring.
    pub const VOID: u16 = 2;
    /// With [`Self::VOID`]: the slot opens epoch `session_epoch` of client `client_id`'s
    /// order-5 session for the publisher whose hello's opener is the low 32 bits of
    /// `batch_id`, presenting `session_key_hash`. The broker writes it for a hello with
    /// `PUBLISH_OPENS_EPOCH` and waits until the session table holds the epoch; the
    /// sequencer switches the session on it. Readers skip it as any void slot.
    pub const EPOCH_OPEN: u16 = 4;
    /// Sent by an order-5 publisher that closes, on a header with `num_msg` 0 and
    /// `total_size` 0 whose `batch_seq` is the next one it would have numbered: it is
    /// done with its session, every batch it sent is acknowledged, and it sends no more
    /// in this epoch. The broker writes it to the PBR with [`Self::VOID`] and the
    /// connection's client id, epoch, opener (low 32 bits of `batch_id`) and key hash;
    /// the sequencer may then give the session's table slot to a new session at once
    /// instead of after `session_idle_evict`. Readers skip it as any void slot.
    pub const END_SESSION: u16 = 8;
}

/// Byte offsets inside a [`BatchHeader`]; the PBR accessors in the region crate use
/// the same constants so the two views can never drift apart.
pub mod offsets {
    pub const BATCH_SEQ: usize = 0;
    pub const CLIENT_ID: usize = 8;
    pub const NUM_MSG: usize = 16;
    pub const BROKER_ID: usize = 20;
    pub const FLAGS: usize = 22;
    pub const EPOCH_CREATED: usize = 24;
    pub const SESSION_EPOCH: usize = 32;
    pub const BATCH_ID: usize = 40;
    pub const PBR_INDEX: usize = 48;
    pub const TOTAL_SIZE: usize = 56;
    pub const START_LOGICAL_OFFSET: usize = 64;
    pub const LOG_OFFSET: usize = 72;
    pub const TOTAL_ORDER: usize = 80;
    pub const TOPIC_ID: usize = 88;
    pub const COMMITTED_NS: usize = 96;
    pub const SESSION_KEY_HASH: usize = 104;
    pub const PUBLISH_COMMIT: usize = 120;
}

/// Header of one batch. Fields marked *broker* are ignored on the wire and filled in
/// by the broker when the header becomes a PBR slot; *sequencer* likewise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchHeader {
    /// Per-connection (orders 0-2) or per-session (order 5) sequence number of the batch.
    pub batch_seq: u64,
    pub client_id: u64,
    /// Number of messages in the batch, at least 1.
    pub num_msg: u32,
    /// *broker*: id of the broker that wrote the batch.
    pub broker_id: u16,
    /// *broker*: [`BatchFlags`].
    pub flags: u16,
    /// Client-side epoch or timestamp (nanoseconds since the Unix epoch) at which the batch was sealed.
    pub epoch_created: u64,
    /// Order-5 session epoch; 0 otherwise.
    pub session_epoch: u64,
    /// Client-chosen id, unique per client; carried into the GOI for tracing.
    pub batch_id: u64,
    /// *broker*: absolute index of the batch's PBR slot.
    pub pbr_index: u64,
    /// Bytes of messages following the header: the sum of the message strides.
    pub total_size: u64,
    /// *broker*: per-broker position of the first message (orders 0 and 1).
    pub start_logical_offset: u64,
    /// *broker*: logical offset of the payload in the broker's log.
    pub log_offset: u64,
    /// *sequencer*: global position of the first message (orders 2 and 5).
    pub total_order: u64,
    /// *broker*: id of the topic slot in the region.
    pub topic_id: u32,
    /// *broker*: `CLOCK_MONOTONIC`, in nanoseconds, when the broker committed the slot;
    /// 0 from a broker that is not on the host that created the region (another clock).
    /// Informative: the sequencer's epoch-wait figure.
    pub committed_ns: u64,
    /// *broker*: order 5, [`crate::session_key_hash`] of the key the connection's hello
    /// presented; the sequencer binds a session to the first batch's and drops batches
    /// with another. 0 for other orders.
    pub session_key_hash: u64,
    /// *broker*: commit token, `pbr_index + 1`, written last.
    pub publish_commit: u64,
}

impl BatchHeader {
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        use offsets::*;
        let mut b = [0u8; BATCH_HEADER_LEN];
        put_u64(&mut b, BATCH_SEQ, self.batch_seq);
        put_u64(&mut b, CLIENT_ID, self.client_id);
        put_u32(&mut b, NUM_MSG, self.num_msg);
        put_u16(&mut b, BROKER_ID, self.broker_id);
        put_u16(&mut b, FLAGS, self.flags);
        put_u64(&mut b, EPOCH_CREATED, self.epoch_created);
        put_u64(&mut b, SESSION_EPOCH, self.session_epoch);
        put_u64(&mut b, BATCH_ID, self.batch_id);
        put_u64(&mut b, PBR_INDEX, self.pbr_index);
        put_u64(&mut b, TOTAL_SIZE, self.total_size);
        put_u64(&mut b, START_LOGICAL_OFFSET, self.start_logical_offset);
        put_u64(&mut b, LOG_OFFSET, self.log_offset);
        put_u64(&mut b, TOTAL_ORDER, self.total_order);
        put_u32(&mut b, TOPIC_ID, self.topic_id);
        put_u64(&mut b, COMMITTED_NS, self.committed_ns);
        put_u64(&mut b, SESSION_KEY_HASH, self.session_key_hash);
        put_u64(&mut b, PUBLISH_COMMIT, self.publish_commit);
        b
    }

    /// Decodes the raw fields without judging them; see [`BatchHeader::validate_incoming`].
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        use offsets::*;
        need(b, BATCH_HEADER_LEN)?;
        Ok(Self {
            batch_seq: u64_at(b, BATCH_SEQ),
            client_id: u64_at(b, CLIENT_ID),
            num_msg: u32_at(b, NUM_MSG),
            broker_id: u16_at(b, BROKER_ID),
            flags: u16_at(b, FLAGS),
            epoch_created: u64_at(b, EPOCH_CREATED),
            session_epoch: u64_at(b, SESSION_EPOCH),
            batch_id: u64_at(b, BATCH_ID),
            pbr_index: u64_at(b, PBR_INDEX),
            total_size: u64_at(b, TOTAL_SIZE),
            start_logical_offset: u64_at(b, START_LOGICAL_OFFSET),
            log_offset: u64_at(b, LOG_OFFSET),
            total_order: u64_at(b, TOTAL_ORDER),
            topic_id: u32_at(b, TOPIC_ID),
            committed_ns: u64_at(b, COMMITTED_NS),
            session_key_hash: u64_at(b, SESSION_KEY_HASH),
            publish_commit: u64_at(b, PUBLISH_COMMIT),
        })
    }

    /// Whether a publisher sent this header to end its order-5 session
    /// ([`BatchFlags::END_SESSION`]) rather than with a batch.
    pub fn ends_session(&self) -> bool {
        self.flags & BatchFlags::END_SESSION != 0
    }

    /// Checks the fields a publisher controls before the broker trusts any of them:
    /// the payload length must be a whole number of 64-byte lines, within the batch
    /// limit, and large enough for `num_msg` message headers.
    pub fn validate_incoming(&self, max_batch_bytes: u64) -> Result<(), WireError> {
        if self.ends_session() {
            if self.num_msg != 0 || self.total_size != 0 {
                return Err(WireError::MalformedBatch(format!(
                    "a session's end carries no messages, but this one says {} in {} bytes",
                    self.num_msg, self.total_size
                )));
            }
            return Ok(());
        }
        if self.num_msg == 0 {
            return Err(WireError::MalformedBatch("batch has zero messages".into()));
        }
        if self.total_size > max_batch_bytes {
            return Err(WireError::BatchTooLarge {
                size: self.total_size,
                max: max_batch_bytes,
            });
        }
        if !self.total_size.is_multiple_of(64) {
            return Err(WireError::MalformedBatch(format!(
                "total_size {} is not a multiple of 64",
                self.total_size
            )));
        }
        if (self.num_msg as u64) * (MESSAGE_HEADER_LEN as u64) > self.total_size {
            return Err(WireError::MalformedBatch(format!(
                "{} messages cannot fit in {} bytes",
                self.num_msg, self.total_size
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_roundtrip() {
        let h = BatchHeader {
            batch_seq: 7,
            client_id: 42,
            num_msg: 3,
            broker_id: 2,
            flags: BatchFlags::VALID,
            epoch_created: 99,
            session_epoch: 1,
            batch_id: 1234,
            pbr_index: 5,
            total_size: 192,
            start_logical_offset: 11,
            log_offset: 4096,
            total_order: 77,
            topic_id: 3,
            committed_ns: 88,
            session_key_hash: 0xfeed,
            publish_commit: 6,
        };
        assert_eq!(BatchHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn incoming_sizes_are_validated() {
        let ok = BatchHeader {
            num_msg: 2,
            total_size: 128,
            ..Default::default()
        };
        assert!(ok.validate_incoming(1 << 20).is_ok());
        let zero = BatchHeader { num_msg: 0, ..ok };
        assert!(zero.validate_incoming(1 << 20).is_err());
        let too_many = BatchHeader { num_msg: 3, ..ok };
        assert!(too_many.validate_incoming(1 << 20).is_err());
        let unaligned = BatchHeader {
            total_size: 130,
            ..ok
        };
        assert!(unaligned.validate_incoming(1 << 20).is_err());
        assert!(matches!(
            ok.validate_incoming(64),
            Err(WireError::BatchTooLarge { .. })
        ));
    }

    #[test]
    fn a_sessions_end_carries_no_messages() {
        let end = BatchHeader {
            batch_seq: 9,
            flags: BatchFlags::END_SESSION,
            ..Default::default()
        };
        assert!(end.ends_session());
        assert!(end.validate_incoming(1 << 20).is_ok());
        for (num_msg, total_size) in [(1, 64), (0, 64), (1, 0)] {
            let carrying = BatchHeader {
                num_msg,
                total_size,
                ..end
            };
            assert!(
                matches!(
                    carrying.validate_incoming(1 << 20),
                    Err(WireError::MalformedBatch(_))
                ),
                "{num_msg} messages in {total_size} bytes"
            );
        }
    }

    #[test]
    fn short_input_is_an_error() {
        assert!(matches!(
            BatchHeader::decode(&[0u8; 127]),
            Err(WireError::Short {
                need: 128,
                have: 127
            })
        ));
    }
}
