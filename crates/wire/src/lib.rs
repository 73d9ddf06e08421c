//! Byte-exact frame formats of the Embarcadero protocol.
//!
//! Owns: every structure that crosses a socket or lives in the shared region as bytes
//! (`BatchHeader`, `BlogMessageHeader`, handshake, ack, error and delivery frames) and
//! the validation of everything a peer sends. It touches no sockets and no memory
//! maps: callers hand it byte slices. `docs/PROTOCOL.md` is the prose twin of this
//! crate and `testdata/wire/` holds vectors that this crate encodes and decodes in tests.
//!
//! All integers are little-endian. Every decoder validates lengths and counts before
//! they are used, so a hostile peer can only ever produce an [`WireError`].

pub mod batch;
mod frames;
mod message;

pub use batch::{BatchFlags, BatchHeader};
pub use frames::{
    Ack, BatchOk, DeliveryHeader, ErrorCode, ErrorFrame, FrameHeader, FrameKind, Hello, HelloOk,
    Role, HELLO_FLAGS_OFFSET, PUBLISH_OPENS_EPOCH, SUBSCRIBE_FROM_FIRST_RETAINED,
};
pub use message::{
    message_stride, validate_batch_payload, BlogMessageHeader, MessageIter, MessageView,
};

/// First bytes of every handshake, `b"EMBD"`.
pub const PROTOCOL_MAGIC: [u8; 4] = *b"EMBD";
/// Version of the frame formats in this crate; a peer with another version is refused.
pub const PROTOCOL_VERSION: u16 = 1;
/// Size of a [`BatchHeader`], on the wire and as a PBR slot.
pub const BATCH_HEADER_LEN: usize = 128;
/// Size of a [`BlogMessageHeader`].
pub const MESSAGE_HEADER_LEN: usize = 64;

/// The largest integer every JSON reader keeps exact (2^53 - 1: JavaScript's numbers,
/// jq 1.6). Identifiers drawn at random that are shown as JSON numbers (incarnations,
/// client ids) are drawn at or below it.
pub const MAX_JSON_SAFE: u64 = (1 << 53) - 1;
/// Size of a [`Hello`] frame.
pub const HELLO_LEN: usize = 128;
/// Size of a [`FrameHeader`].
pub const FRAME_HEADER_LEN: usize = 16;
/// Size of the body of a [`HelloOk`] frame.
pub const HELLO_OK_LEN: usize = 48;
/// Size of a [`DeliveryHeader`].
pub const DELIVERY_HEADER_LEN: usize = 64;
/// Longest topic name, in bytes.
pub const MAX_TOPIC_NAME_LEN: usize = 63;
/// Size of an order-5 session key ([`Hello::session_key`]).
pub const SESSION_KEY_LEN: usize = 16;

/// What the broker and the region keep of an order-5 session key: the first 8 bytes of
/// its SHA-256, never 0 (0 means "no key bound"). A one-way hash, so a reader of the
/// region or of a PBR slot learns nothing that lets it present the key.
pub fn session_key_hash(key: &[u8; SESSION_KEY_LEN]) -> u64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key);
    let hash = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    hash.max(1)
}

/// Longest human-readable text in an error frame, in bytes.
pub const MAX_ERROR_TEXT_LEN: usize = 4096;

/// Everything that can be wrong with bytes received from a peer.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("bad magic {0:02x?}: the peer does not speak the Embarcadero protocol")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0} (this build speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion(u16),
    #[error("frame too short: need {need} bytes, have {have}")]
    Short { need: usize, have: usize },
    #[error("invalid value for {field}: {value}")]
    InvalidField { field: &'static str, value: u64 },
    #[error("invalid topic name: {0}")]
    InvalidTopicName(String),
    #[error("malformed batch: {0}")]
    MalformedBatch(String),
    #[error("message of {size} bytes exceeds the maximum of {max} bytes")]
    MessageTooLarge { size: u64, max: u64 },
    #[error("batch of {size} bytes exceeds the maximum of {max} bytes")]
    BatchTooLarge { size: u64, max: u64 },
}

/// Rounds `n` up to the next multiple of 64, the cache-line stride of the log.
#[inline]
pub const fn align64(n: u64) -> u64 {
    (n + 63) & !63
}

/// Checks a topic name: 1 to 63 bytes of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_topic_name(name: &str) -> Result<(), WireError> {
    let bad = |why: &str| Err(WireError::InvalidTopicName(format!("{name:?}: {why}")));
    if name.is_empty() {
        return bad("must not be empty");
    }
    if name.len() > MAX_TOPIC_NAME_LEN {
        return bad("longer than 63 bytes");
    }
    if name.starts_with('.') || name.starts_with('-') {
        return bad("must not start with '.' or '-'");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    {
        return bad("only letters, digits, '.', '_' and '-' are allowed");
    }
    Ok(())
}

/// Little-endian field access on fixed-size frames. Callers check the slice length once.
pub(crate) mod le {
    #[inline]
    pub fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }
    #[inline]
    pub fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
    }
    #[inline]
    pub fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
    }
    #[inline]
    pub fn put_u16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    #[inline]
    pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    #[inline]
    pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

pub(crate) fn need(b: &[u8], n: usize) -> Result<(), WireError> {
    if b.len() < n {
        Err(WireError::Short {
            need: n,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align64_rounds_up_to_cache_lines() {
        assert_eq!(align64(0), 0);
        assert_eq!(align64(1), 64);
        assert_eq!(align64(64), 64);
        assert_eq!(align64(65), 128);
    }

    #[test]
    fn topic_names_are_checked() {
        assert!(validate_topic_name("orders.v1_eu-west").is_ok());
        for bad in ["", ".hidden", "-x", "a b", "é", &"x".repeat(64)] {
            assert!(validate_topic_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(validate_topic_name(&"x".repeat(63)).is_ok());
    }
}
