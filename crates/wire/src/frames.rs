//! Handshake and control frames.
//!
//! Client to broker: one [`Hello`] (128 bytes), then for a publisher a stream of
//! `[BatchHeader][messages]`; a subscriber sends nothing after its hello (and its
//! per-broker cursors, for orders 0 and 1).
//! Broker to client: frames that start with a 16-byte [`FrameHeader`].

use crate::le::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::{
    need, validate_topic_name, WireError, DELIVERY_HEADER_LEN, FRAME_HEADER_LEN, HELLO_LEN,
    HELLO_OK_LEN, MAX_ERROR_TEXT_LEN, MAX_TOPIC_NAME_LEN, PROTOCOL_MAGIC, PROTOCOL_VERSION,
    SESSION_KEY_LEN,
};

/// What a connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Publish = 1,
    Subscribe = 2,
}

/// First frame on every connection, client to broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    /// Requested acknowledgement level (publish only, 0..=2).
    pub ack_level: u8,
    pub client_id: u64,
    /// Order-5 session epoch, 0 otherwise.
    pub session_epoch: u64,
    /// Subscribe: first message position wanted (orders 2 and 5).
    pub start_position: u64,
    /// Publish: index of this connection among the client's connections to the broker.
    pub connection_index: u32,
    /// Subscribe, orders 0 and 1: number of little-endian u64 per-broker start positions
    /// that follow the hello (0 means "every broker from 0").
    pub cursor_count: u32,
    pub topic: String,
    /// Order 5: the session's secret, chosen at random by the client when it opens the
    /// session and presented on every connection and reopen of it. Never sent back nor
    /// delivered to subscribers; the broker keeps only [`crate::session_key_hash`] of it, and a
    /// hello for a session bound to another key is refused (SessionKeyMismatch). Zero
    /// for other orders.
    pub session_key: [u8; SESSION_KEY_LEN],
    /// Subscribe: [`SUBSCRIBE_FROM_FIRST_RETAINED`] or 0. Publish: [`PUBLISH_OPENS_EPOCH`]
    /// or 0.
    pub flags: u8,
    /// Order-5 publish: 32 random bits the publisher draws when it starts, the same on
    /// every hello it sends, so that a broker can tell the publisher that opened an
    /// epoch from another one of the same session (PROTOCOL.md section 8). 0: unknown
    /// (an older client), which matches any. 0 for other orders and roles.
    pub opener: u32,
}

/// [`Hello::flags`] of an order-5 publish hello: this publisher opens `session_epoch` as
/// its own epoch of the session, at start or when it reopens after a fence. The broker
/// has the sequencer switch the session to it (an epoch-open PBR slot) before answering,
/// so the epoch belongs to one publisher (its [`Hello::opener`]) from the HelloOk on,
/// whose `next_batch_seq` is then the session's committed mark: where the opener's
/// numbering starts, past every batch of the epochs before. A session already at a newer
/// epoch refuses the hello with SessionFenced, one whose `session_epoch` another
/// publisher opened with SessionTakenOver, each carrying the session's current epoch:
/// two publishers numbering batches in one epoch would have deduplication drop
/// acknowledged ones.
pub const PUBLISH_OPENS_EPOCH: u8 = 1;

/// [`Hello::flags`]: where a start position (or a per-broker cursor) is no
/// longer retained, start at the first retained one instead of refusing with
/// PositionNotRetained. For a subscriber that has read nothing yet and asked for "the
/// beginning", which is the oldest message still there; never for one resuming from
/// where it was, which must learn that it skipped something.
pub const SUBSCRIBE_FROM_FIRST_RETAINED: u8 = 1;
/// Offset of [`Hello::flags`]: the first byte after the session key.
pub const HELLO_FLAGS_OFFSET: usize = HELLO_SESSION_KEY_OFFSET + SESSION_KEY_LEN;
const _: () = assert!(HELLO_FLAGS_OFFSET < HELLO_LEN);
/// Offset of [`Hello::opener`]: the last four bytes of the hello.
pub const HELLO_OPENER_OFFSET: usize = HELLO_LEN - 4;
const _: () = assert!(HELLO_OPENER_OFFSET > HELLO_FLAGS_OFFSET);

/// Offset of [`Hello::session_key`]: after the longest topic name, so it never overlaps it.
pub const HELLO_SESSION_KEY_OFFSET: usize = 104;
const _: () = assert!(HELLO_SESSION_KEY_OFFSET >= 41 + MAX_TOPIC_NAME_LEN);
const _: () = assert!(HELLO_SESSION_KEY_OFFSET + SESSION_KEY_LEN <= HELLO_LEN);

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&PROTOCOL_MAGIC);
        put_u16(&mut b, 4, PROTOCOL_VERSION);
        b[6] = self.role as u8;
        b[7] = self.ack_level;
        put_u64(&mut b, 8, self.client_id);
        put_u64(&mut b, 16, self.session_epoch);
        put_u64(&mut b, 24, self.start_position);
        put_u32(&mut b, 32, self.connection_index);
        put_u32(&mut b, 36, self.cursor_count);
        let name = self.topic.as_bytes();
        let n = name.len().min(MAX_TOPIC_NAME_LEN);
        b[40] = n as u8;
        b[41..41 + n].copy_from_slice(&name[..n]);
        b[HELLO_SESSION_KEY_OFFSET..HELLO_SESSION_KEY_OFFSET + SESSION_KEY_LEN]
            .copy_from_slice(&self.session_key);
        b[HELLO_FLAGS_OFFSET] = self.flags;
        put_u32(&mut b, HELLO_OPENER_OFFSET, self.opener);
        b
    }

    /// Decodes and validates a hello: magic, version, role, ack level, topic name.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        need(b, HELLO_LEN)?;
        let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if magic != PROTOCOL_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = u16_at(b, 4);
        if version != PROTOCOL_VERSION {
            return Err(WireError::UnsupportedVersion(version));
        }
        let role = match b[6] {
            1 => Role::Publish,
            2 => Role::Subscribe,
            other => {
                return Err(WireError::InvalidField {
                    field: "role",
                    value: other as u64,
                })
            }
        };
        let ack_level = b[7];
        // A subscriber acknowledges nothing: its level is 0 (PROTOCOL.md section 2.1).
        if ack_level > 2 || (role == Role::Subscribe && ack_level != 0) {
            return Err(WireError::InvalidField {
                field: "ack_level",
                value: ack_level as u64,
            });
        }
        let name_len = b[40] as usize;
        if name_len > MAX_TOPIC_NAME_LEN {
            return Err(WireError::InvalidField {
                field: "topic_len",
                value: name_len as u64,
            });
        }
        let topic = std::str::from_utf8(&b[41..41 + name_len])
            .map_err(|_| WireError::InvalidTopicName("topic name is not UTF-8".into()))?
            .to_string();
        validate_topic_name(&topic)?;
        let flags = b[HELLO_FLAGS_OFFSET];
        let allowed = match role {
            Role::Subscribe => SUBSCRIBE_FROM_FIRST_RETAINED,
            Role::Publish => PUBLISH_OPENS_EPOCH,
        };
        let opens_without_session = role == Role::Publish && u64_at(b, 16) == 0 && flags != 0;
        if flags & !allowed != 0 || opens_without_session {
            return Err(WireError::InvalidField {
                field: "flags",
                value: flags as u64,
            });
        }
        Ok(Self {
            role,
            ack_level,
            client_id: u64_at(b, 8),
            session_epoch: u64_at(b, 16),
            start_position: u64_at(b, 24),
            connection_index: u32_at(b, 32),
            cursor_count: u32_at(b, 36),
            topic,
            session_key: b[HELLO_SESSION_KEY_OFFSET..HELLO_SESSION_KEY_OFFSET + SESSION_KEY_LEN]
                .try_into()
                .expect("16 bytes"),
            flags,
            opener: u32_at(b, HELLO_OPENER_OFFSET),
        })
    }
}

/// Kind byte of a broker-to-client frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Handshake accepted; body is a [`HelloOk`].
    HelloOk = 1,
    /// Cumulative acknowledgement; `arg` is the number of batches acknowledged.
    Ack = 2,
    /// An error; body is an [`ErrorFrame`]; `arg` is the batch sequence it concerns.
    Error = 3,
    /// A batch for a subscriber; body is a [`DeliveryHeader`] then the messages.
    Delivery = 4,
    /// The `arg` oldest unconfirmed deliveries are intact.
    BatchOk = 5,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => Self::HelloOk,
            2 => Self::Ack,
            3 => Self::Error,
            4 => Self::Delivery,
            5 => Self::BatchOk,
            other => {
                return Err(WireError::InvalidField {
                    field: "frame kind",
                    value: other as u64,
                })
            }
        })
    }
}

/// 16-byte header of every broker-to-client frame:
/// `kind u8 | flags u8 | reserved u16 | body_len u32 | arg u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub flags: u8,
    pub body_len: u32,
    pub arg: u64,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0] = self.kind as u8;
        b[1] = self.flags;
        put_u32(&mut b, 4, self.body_len);
        put_u64(&mut b, 8, self.arg);
        b
    }

    /// Decodes a frame header, refusing bodies longer than `max_body` bytes.
    pub fn decode(b: &[u8], max_body: u32) -> Result<Self, WireError> {
        need(b, FRAME_HEADER_LEN)?;
        let kind = FrameKind::from_u8(b[0])?;
        let body_len = u32_at(b, 4);
        if body_len > max_body {
            return Err(WireError::InvalidField {
                field: "body_len",
                value: body_len as u64,
            });
        }
        Ok(Self {
            kind,
            flags: b[1],
            body_len,
            arg: u64_at(b, 8),
        })
    }
}

/// Body of a [`FrameKind::HelloOk`] frame: what the broker accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HelloOk {
    pub broker_id: u16,
    pub num_brokers: u16,
    pub order: u8,
    pub ack_level: u8,
    pub replication_factor: u8,
    pub topic_id: u32,
    pub max_message_bytes: u32,
    pub max_batch_bytes: u32,
    /// Publish: the batch sequence number the broker expects next on this connection.
    pub next_batch_seq: u64,
    /// Subscribe: a floor of the first position still retained; 0 when unknown
    /// (docs/PROTOCOL.md).
    pub first_retained: u64,
}

impl HelloOk {
    /// The whole frame, header and body, as a broker sends it (the one place it is built).
    pub fn encode_frame(&self) -> Vec<u8> {
        let header = FrameHeader {
            kind: FrameKind::HelloOk,
            flags: 0,
            body_len: HELLO_OK_LEN as u32,
            arg: 0,
        };
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + HELLO_OK_LEN);
        frame.extend_from_slice(&header.encode());
        frame.extend_from_slice(&self.encode());
        frame
    }

    pub fn encode(&self) -> [u8; HELLO_OK_LEN] {
        let mut b = [0u8; HELLO_OK_LEN];
        put_u16(&mut b, 0, PROTOCOL_VERSION);
        put_u16(&mut b, 2, self.broker_id);
        put_u16(&mut b, 4, self.num_brokers);
        b[6] = self.order;
        b[7] = self.ack_level;
        b[8] = self.replication_factor;
        put_u32(&mut b, 12, self.topic_id);
        put_u32(&mut b, 16, self.max_message_bytes);
        put_u32(&mut b, 20, self.max_batch_bytes);
        put_u64(&mut b, 24, self.next_batch_seq);
        put_u64(&mut b, 32, self.first_retained);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        need(b, HELLO_OK_LEN)?;
        let version = u16_at(b, 0);
        if version != PROTOCOL_VERSION {
            return Err(WireError::UnsupportedVersion(version));
        }
        Ok(Self {
            broker_id: u16_at(b, 2),
            num_brokers: u16_at(b, 4),
            order: b[6],
            ack_level: b[7],
            replication_factor: b[8],
            topic_id: u32_at(b, 12),
            max_message_bytes: u32_at(b, 16),
            max_batch_bytes: u32_at(b, 20),
            next_batch_seq: u64_at(b, 24),
            first_retained: u64_at(b, 32),
        })
    }
}

/// A cumulative acknowledgement: batches `0..count` of the connection reached `level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub level: u8,
    pub count: u64,
}

impl Ack {
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        FrameHeader {
            kind: FrameKind::Ack,
            flags: self.level,
            body_len: 0,
            arg: self.count,
        }
        .encode()
    }
}

/// Error codes carried by [`ErrorFrame`]. Only [`ErrorCode::Backpressure`] is retriable
/// on the same connection; the broker closes the connection after any other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    BadMagic = 1,
    UnsupportedVersion = 2,
    UnknownTopic = 3,
    InvalidRole = 4,
    AckNotAllowed = 5,
    MalformedBatch = 6,
    MessageTooLarge = 7,
    BatchTooLarge = 8,
    Backpressure = 9,
    OutOfSequence = 10,
    PositionNotRetained = 11,
    InvalidTopicName = 12,
    Internal = 13,
    ShuttingDown = 14,
    BadCursor = 15,
    /// Order 5: the session's epoch is fenced (or superseded); the frame's `arg` is the
    /// committed high-water mark N ([`ErrorFrame::fenced_hwm`]). Reopen with a higher
    /// epoch and resend the batches from N on.
    SessionFenced = 16,
    /// A session epoch on a topic that is not order 5, or none on one that is.
    BadSession = 17,
    /// A batch's payload did not arrive within the broker's payload timeout of its header.
    SlowPayload = 18,
    /// Order 5: every session slot of the topic holds another client's session.
    SessionsExhausted = 19,
    /// The broker already has as many connections as it accepts; sent instead of
    /// HelloOk. Retry later or through another broker.
    TooManyConnections = 20,
    /// Order 5: the session ended while the connection was open (it was idle and its
    /// slot in the session table went to another session); its marks are gone.
    SessionExpired = 21,
    /// Order 5: the session (client id) is bound to another session key: the connection
    /// is not the session's owner. A hijack attempt, or a restarted client that lost its
    /// key; such a client must use a new client id.
    SessionKeyMismatch = 22,
    /// A subscriber sent bytes after its hello (and cursors); a subscriber sends nothing.
    UnexpectedData = 23,
    /// The topic was deleted while the connection was open (or between a lookup and
    /// the hello): the connection is closed. Not retriable, and no other broker serves
    /// it either; a topic created later with the same name is another topic.
    TopicDeleted = 24,
    /// A local shared-memory channel was refused before its hello was read: the
    /// client's uid may not open one (`broker.shm_allowed_uids`), or its memfd is not
    /// a channel the broker maps (unsealed, wrong size or layout). Not retriable over
    /// shared memory; the same client may publish over TCP.
    ShmRefused = 25,
    /// Order 5: another publisher of the session (same client id and key) opened the
    /// epoch this hello asked for, or a newer one: it owns the session now. A publisher
    /// starting up opens the next epoch above it; one that was publishing stops, for two
    /// publishers numbering batches in one epoch would have acknowledged ones dropped as
    /// duplicates. The frame's `session_epoch` is the session's current epoch.
    SessionTakenOver = 26,
}

impl ErrorCode {
    pub fn from_u16(v: u16) -> Option<Self> {
        use ErrorCode::*;
        Some(match v {
            1 => BadMagic,
            2 => UnsupportedVersion,
            3 => UnknownTopic,
            4 => InvalidRole,
            5 => AckNotAllowed,
            6 => MalformedBatch,
            7 => MessageTooLarge,
            8 => BatchTooLarge,
            9 => Backpressure,
            10 => OutOfSequence,
            11 => PositionNotRetained,
            12 => InvalidTopicName,
            13 => Internal,
            14 => ShuttingDown,
            15 => BadCursor,
            16 => SessionFenced,
            17 => BadSession,
            18 => SlowPayload,
            19 => SessionsExhausted,
            20 => TooManyConnections,
            21 => SessionExpired,
            22 => SessionKeyMismatch,
            23 => UnexpectedData,
            24 => TopicDeleted,
            25 => ShmRefused,
            26 => SessionTakenOver,
            _ => return None,
        })
    }

    pub fn is_retriable(self) -> bool {
        matches!(self, ErrorCode::Backpressure)
    }

    /// The code a validation failure of peer input maps to.
    pub fn for_wire_error(e: &WireError) -> Self {
        match e {
            WireError::BadMagic(_) => ErrorCode::BadMagic,
            WireError::UnsupportedVersion(_) => ErrorCode::UnsupportedVersion,
            WireError::InvalidTopicName(_) => ErrorCode::InvalidTopicName,
            WireError::MessageTooLarge { .. } => ErrorCode::MessageTooLarge,
            WireError::BatchTooLarge { .. } => ErrorCode::BatchTooLarge,
            WireError::InvalidField { field: "role", .. } => ErrorCode::InvalidRole,
            WireError::InvalidField {
                field: "ack_level", ..
            } => ErrorCode::AckNotAllowed,
            WireError::InvalidField {
                field: "topic_len", ..
            } => ErrorCode::InvalidTopicName,
            WireError::Short { .. }
            | WireError::InvalidField { .. }
            | WireError::MalformedBatch(_) => ErrorCode::MalformedBatch,
        }
    }
}

/// Body of a [`FrameKind::Error`] frame: `code u16 | retriable u8 | reserved u8 |
/// text_len u32 | text (UTF-8) | session_epoch u64`. The trailing epoch came later (a
/// receiver that reads only up to the text ignores it; a body without it reads 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    pub code: ErrorCode,
    /// The batch sequence number the error concerns, or `u64::MAX`; for SessionFenced,
    /// the session's committed high-water mark (the batch to resend from).
    pub batch_seq: u64,
    /// SessionFenced: the session's current epoch as the broker read it, the fenced one
    /// or the newer one that superseded it (a publisher that never opened that newer
    /// epoch was taken over); 0 otherwise.
    pub session_epoch: u64,
    pub message: String,
}

/// Bytes of an Error frame's body before its text.
const ERROR_PREFIX_LEN: usize = 8;
/// Bytes of an Error frame's body after its text: the session epoch.
const ERROR_SUFFIX_LEN: usize = 8;

impl ErrorFrame {
    /// Order 5: a SessionFenced error for the connection's `epoch`, everything below
    /// `hwm` committed, the session now at epoch `current` (at least `epoch`).
    pub fn session_fenced(epoch: u64, hwm: u64, current: u64) -> Self {
        assert!(
            current >= epoch,
            "a fence reports the session at or past the fenced epoch"
        );
        let message = if current > epoch {
            format!(
                "session epoch {epoch} is fenced: the session is at epoch {current} now; the publisher that opened epoch {current} reopens with it and resends from batch {hwm}, any other was taken over by that one"
            )
        } else {
            format!(
                "session epoch {epoch} is fenced: a gap at its head outlived the session lease; reopen with epoch {} and resend from batch {hwm}",
                epoch + 1
            )
        };
        Self {
            code: ErrorCode::SessionFenced,
            batch_seq: hwm,
            session_epoch: current,
            message,
        }
    }

    /// The committed high-water mark a SessionFenced error carries; `None` for others.
    pub fn fenced_hwm(&self) -> Option<u64> {
        (self.code == ErrorCode::SessionFenced).then_some(self.batch_seq)
    }

    /// Encodes header and body into one buffer, truncating over-long text.
    pub fn encode(&self) -> Vec<u8> {
        let mut text = self.message.as_bytes();
        if text.len() > MAX_ERROR_TEXT_LEN {
            let mut cut = MAX_ERROR_TEXT_LEN;
            while !self.message.is_char_boundary(cut) {
                cut -= 1;
            }
            text = &text[..cut];
        }
        let body_len = ERROR_PREFIX_LEN + text.len() + ERROR_SUFFIX_LEN;
        let mut b = Vec::with_capacity(FRAME_HEADER_LEN + body_len);
        b.extend_from_slice(
            &FrameHeader {
                kind: FrameKind::Error,
                flags: 0,
                body_len: body_len as u32,
                arg: self.batch_seq,
            }
            .encode(),
        );
        b.extend_from_slice(&(self.code as u16).to_le_bytes());
        b.push(self.code.is_retriable() as u8);
        b.push(0);
        b.extend_from_slice(&(text.len() as u32).to_le_bytes());
        b.extend_from_slice(text);
        b.extend_from_slice(&self.session_epoch.to_le_bytes());
        b
    }

    pub fn decode(header: &FrameHeader, body: &[u8]) -> Result<Self, WireError> {
        need(body, ERROR_PREFIX_LEN)?;
        let raw = u16_at(body, 0);
        let code = ErrorCode::from_u16(raw).ok_or(WireError::InvalidField {
            field: "error code",
            value: raw as u64,
        })?;
        let len = u32_at(body, 4) as usize;
        if len > MAX_ERROR_TEXT_LEN || ERROR_PREFIX_LEN + len > body.len() {
            return Err(WireError::InvalidField {
                field: "error text length",
                value: len as u64,
            });
        }
        // Bytes that are not UTF-8 become U+FFFD, three bytes each: text of up to
        // MAX_ERROR_TEXT_LEN raw bytes could grow past what `encode` writes (found by the
        // wire_frames fuzz target). Cut it there, on a character boundary, so that what a
        // peer decodes is what it would send on.
        let text = &body[ERROR_PREFIX_LEN..ERROR_PREFIX_LEN + len];
        let mut message = String::from_utf8_lossy(text).into_owned();
        if message.len() > MAX_ERROR_TEXT_LEN {
            let mut cut = MAX_ERROR_TEXT_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        // Absent from a broker that predates it: 0, "not said".
        let after_text = ERROR_PREFIX_LEN + len;
        let session_epoch = if body.len() >= after_text + ERROR_SUFFIX_LEN {
            u64_at(body, after_text)
        } else {
            0
        };
        Ok(Self {
            code,
            batch_seq: header.arg,
            session_epoch,
            message,
        })
    }
}

/// Header of a delivered batch, inside a [`FrameKind::Delivery`] frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeliveryHeader {
    /// GOI index (orders 2, 5) or PBR index (orders 0, 1) of the batch.
    pub batch_position: u64,
    /// Position of the batch's first message: global (orders 2, 5) or per broker (0, 1).
    pub first_position: u64,
    pub client_id: u64,
    pub batch_seq: u64,
    pub num_msg: u32,
    /// Messages at the front of the batch that the subscriber already has (resume).
    pub skip: u32,
    pub broker_id: u16,
    pub order: u8,
    pub payload_len: u32,
    pub session_epoch: u64,
}

impl DeliveryHeader {
    pub fn encode(&self) -> [u8; DELIVERY_HEADER_LEN] {
        let mut b = [0u8; DELIVERY_HEADER_LEN];
        put_u64(&mut b, 0, self.batch_position);
        put_u64(&mut b, 8, self.first_position);
        put_u64(&mut b, 16, self.client_id);
        put_u64(&mut b, 24, self.batch_seq);
        put_u32(&mut b, 32, self.num_msg);
        put_u32(&mut b, 36, self.skip);
        put_u16(&mut b, 40, self.broker_id);
        b[42] = self.order;
        put_u32(&mut b, 44, self.payload_len);
        put_u64(&mut b, 48, self.session_epoch);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        need(b, DELIVERY_HEADER_LEN)?;
        let h = Self {
            batch_position: u64_at(b, 0),
            first_position: u64_at(b, 8),
            client_id: u64_at(b, 16),
            batch_seq: u64_at(b, 24),
            num_msg: u32_at(b, 32),
            skip: u32_at(b, 36),
            broker_id: u16_at(b, 40),
            order: b[42],
            payload_len: u32_at(b, 44),
            session_epoch: u64_at(b, 48),
        };
        if h.skip > h.num_msg {
            return Err(WireError::InvalidField {
                field: "skip",
                value: h.skip as u64,
            });
        }
        if !h.payload_len.is_multiple_of(64) || (h.payload_len as u64) < 64 * h.num_msg as u64 {
            return Err(WireError::InvalidField {
                field: "payload_len",
                value: h.payload_len as u64,
            });
        }
        Ok(h)
    }

    /// The complete frame header announcing this delivery.
    pub fn frame_header(&self) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Delivery,
            flags: 0,
            body_len: (DELIVERY_HEADER_LEN as u32).saturating_add(self.payload_len),
            arg: self.batch_position,
        }
    }
}

/// Validation trailer for subscribers: the `count` oldest unconfirmed deliveries are
/// intact (the server re-checked, after sending them, that none was reclaimed). With
/// `discard_rest`, the unconfirmed deliveries after those were reclaimed while being
/// sent: the client drops them and the broker sends them again (from disk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOk {
    pub count: u64,
    pub discard_rest: bool,
}

impl BatchOk {
    /// FrameHeader flag of a BatchOk whose remaining unconfirmed deliveries are void.
    pub const DISCARD_REST: u8 = 1;

    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        FrameHeader {
            kind: FrameKind::BatchOk,
            flags: if self.discard_rest {
                Self::DISCARD_REST
            } else {
                0
            },
            body_len: 0,
            arg: self.count,
        }
        .encode()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            role: Role::Publish,
            ack_level: 1,
            client_id: 77,
            session_epoch: 0,
            start_position: 0,
            connection_index: 2,
            cursor_count: 0,
            topic: "orders".into(),
            session_key: [0; 16],
            flags: 0,
            opener: 0,
        }
    }

    #[test]
    fn hello_roundtrip() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let keyed = Hello {
            topic: "t".repeat(MAX_TOPIC_NAME_LEN),
            session_key: [0xa5; SESSION_KEY_LEN],
            ..hello()
        };
        assert_eq!(
            Hello::decode(&keyed.encode()).unwrap(),
            keyed,
            "the key never overlaps the longest topic name"
        );
    }

    #[test]
    fn only_a_subscriber_may_ask_to_start_from_the_first_retained_position() {
        let subscriber = Hello {
            role: Role::Subscribe,
            ack_level: 0,
            flags: SUBSCRIBE_FROM_FIRST_RETAINED,
            ..hello()
        };
        assert_eq!(Hello::decode(&subscriber.encode()).unwrap(), subscriber);
        let publisher = Hello {
            flags: SUBSCRIBE_FROM_FIRST_RETAINED,
            ..hello()
        };
        let unknown_bit = Hello {
            flags: 2,
            ..subscriber.clone()
        };
        for bad in [publisher, unknown_bit] {
            assert!(matches!(
                Hello::decode(&bad.encode()),
                Err(WireError::InvalidField { field: "flags", .. })
            ));
        }
    }

    #[test]
    fn only_an_order_5_publisher_may_open_an_epoch() {
        let opens = Hello {
            session_epoch: 4,
            flags: PUBLISH_OPENS_EPOCH,
            ..hello()
        };
        assert_eq!(Hello::decode(&opens.encode()).unwrap(), opens);
        let no_session = Hello {
            session_epoch: 0,
            ..opens
        };
        assert!(matches!(
            Hello::decode(&no_session.encode()),
            Err(WireError::InvalidField { field: "flags", .. })
        ));
    }

    #[test]
    fn an_error_body_that_ends_after_its_text_reads_session_epoch_0() {
        let fence = ErrorFrame::session_fenced(3, 41, 5);
        let mut bytes = fence.encode();
        bytes.truncate(bytes.len() - ERROR_SUFFIX_LEN);
        let body_len = (bytes.len() - FRAME_HEADER_LEN) as u32;
        bytes[4..8].copy_from_slice(&body_len.to_le_bytes());
        let h = FrameHeader::decode(&bytes, 1 << 16).unwrap();
        let old = ErrorFrame::decode(&h, &bytes[FRAME_HEADER_LEN..]).unwrap();
        assert_eq!(
            old,
            ErrorFrame {
                session_epoch: 0,
                ..fence
            },
            "a broker from before the field"
        );
    }

    #[test]
    fn a_fence_carries_the_sessions_current_epoch() {
        for current in [3, 9] {
            let fence = ErrorFrame::session_fenced(3, 41, current);
            let bytes = fence.encode();
            let h = FrameHeader::decode(&bytes, 1 << 16).unwrap();
            let back = ErrorFrame::decode(&h, &bytes[FRAME_HEADER_LEN..]).unwrap();
            assert_eq!((back.fenced_hwm(), back.session_epoch), (Some(41), current));
            assert_eq!(back, fence);
        }
    }

    #[test]
    fn session_key_hashes_differ_by_key_and_are_never_zero() {
        let a = crate::session_key_hash(&[1; SESSION_KEY_LEN]);
        let b = crate::session_key_hash(&[2; SESSION_KEY_LEN]);
        assert_ne!(a, b);
        assert_ne!(a, 0);
        assert_eq!(a, crate::session_key_hash(&[1; SESSION_KEY_LEN]));
    }

    #[test]
    fn hello_rejects_bad_magic_version_role_ack_and_name() {
        let good = hello().encode();
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Hello::decode(&b), Err(WireError::BadMagic(_))));
        let mut b = good;
        b[4] = 9;
        assert!(matches!(
            Hello::decode(&b),
            Err(WireError::UnsupportedVersion(9))
        ));
        let mut b = good;
        b[6] = 3;
        assert!(Hello::decode(&b).is_err());
        let mut b = good;
        b[7] = 3;
        assert!(Hello::decode(&b).is_err());
        let mut b = good;
        b[40] = 64;
        assert!(Hello::decode(&b).is_err());
        let mut b = good;
        b[41] = b' ';
        assert!(matches!(
            Hello::decode(&b),
            Err(WireError::InvalidTopicName(_))
        ));
    }

    #[test]
    fn hello_errors_map_to_their_own_codes() {
        let code = |mutate: fn(&mut [u8; HELLO_LEN])| {
            let mut b = hello().encode();
            mutate(&mut b);
            ErrorCode::for_wire_error(&Hello::decode(&b).unwrap_err())
        };
        assert_eq!(code(|b| b[6] = 9), ErrorCode::InvalidRole);
        assert_eq!(code(|b| b[7] = 3), ErrorCode::AckNotAllowed);
        assert_eq!(code(|b| b[40] = 64), ErrorCode::InvalidTopicName);
        assert_eq!(code(|b| b[0] = 0), ErrorCode::BadMagic);
    }

    #[test]
    fn error_frame_roundtrip_and_truncation() {
        let e = ErrorFrame {
            code: ErrorCode::Backpressure,
            batch_seq: 5,
            session_epoch: 0,
            message: "slow down".into(),
        };
        let bytes = e.encode();
        let h = FrameHeader::decode(&bytes, 1 << 16).unwrap();
        assert_eq!(h.kind, FrameKind::Error);
        assert_eq!(ErrorFrame::decode(&h, &bytes[16..]).unwrap(), e);
        let long = ErrorFrame {
            message: "é".repeat(5000),
            ..e
        };
        let bytes = long.encode();
        let h = FrameHeader::decode(&bytes, 1 << 16).unwrap();
        assert!(ErrorFrame::decode(&h, &bytes[16..]).unwrap().message.len() <= 4096);
    }

    /// Fuzz find (wire_frames): 4096 bytes of text that are not UTF-8 decoded to three
    /// times as many (U+FFFD each), which `encode` then cut short, so decode -> encode ->
    /// decode was not equal. The decoded text is held to what a frame can carry.
    #[test]
    fn error_text_that_is_not_utf8_decodes_to_what_encodes_back_equal() {
        let mut frame = ErrorFrame {
            code: ErrorCode::BadMagic,
            batch_seq: 7,
            session_epoch: 0,
            message: "x".repeat(MAX_ERROR_TEXT_LEN),
        }
        .encode();
        let text_end = frame.len() - ERROR_SUFFIX_LEN;
        frame[FRAME_HEADER_LEN + ERROR_PREFIX_LEN..text_end].fill(0xff);
        let h = FrameHeader::decode(&frame, u32::MAX).unwrap();
        let e = ErrorFrame::decode(&h, &frame[FRAME_HEADER_LEN..]).unwrap();
        assert!(e.message.len() <= MAX_ERROR_TEXT_LEN, "{}", e.message.len());
        assert!(e.message.chars().all(|c| c == char::REPLACEMENT_CHARACTER));
        let again = e.encode();
        let h2 = FrameHeader::decode(&again, u32::MAX).unwrap();
        assert_eq!(
            ErrorFrame::decode(&h2, &again[FRAME_HEADER_LEN..]).unwrap(),
            e
        );
    }

    #[test]
    fn frame_header_rejects_oversized_body_and_unknown_kind() {
        let mut b = Ack { level: 1, count: 3 }.encode();
        assert_eq!(FrameHeader::decode(&b, 0).unwrap().arg, 3);
        b[6] = 0x01;
        assert!(FrameHeader::decode(&b, 1024).is_err());
        b[0] = 99;
        assert!(FrameHeader::decode(&b, u32::MAX).is_err());
    }

    #[test]
    fn delivery_roundtrip_and_skip_check() {
        let d = DeliveryHeader {
            batch_position: 3,
            first_position: 100,
            client_id: 1,
            batch_seq: 2,
            num_msg: 10,
            skip: 4,
            broker_id: 3,
            order: 2,
            payload_len: 640,
            session_epoch: 0,
        };
        assert_eq!(DeliveryHeader::decode(&d.encode()).unwrap(), d);
        let bad = DeliveryHeader { skip: 11, ..d };
        assert!(DeliveryHeader::decode(&bad.encode()).is_err());
    }
}
