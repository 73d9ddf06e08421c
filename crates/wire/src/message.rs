//! `BlogMessageHeader`: the 64-byte header in front of every message. The publisher
//! writes it in its final form; the broker only validates it and never rewrites it.

use crate::le::{put_u32, put_u64, u32_at, u64_at};
use crate::{align64, need, BatchHeader, WireError, MESSAGE_HEADER_LEN};

/// Bytes one message with a payload of `payload_len` bytes occupies in a batch.
#[inline]
pub const fn message_stride(payload_len: u64) -> u64 {
    align64(MESSAGE_HEADER_LEN as u64 + payload_len)
}

/// Header of one message. Fields the sequencer or broker would fill in the original
/// (`processed_ts`, `total_order`, `ordered_ts`) stay zero: a subscriber reconstructs a
/// message's position from its batch's position and its index in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlogMessageHeader {
    /// Payload bytes that follow the header.
    pub size: u32,
    /// Reserved flag bits, 0.
    pub flags: u32,
    /// Publisher's wall clock at `publish()`, nanoseconds since the Unix epoch.
    pub publish_ts_ns: u64,
    /// Publisher's running message counter (0, 1, 2, ... per publisher).
    pub counter: u64,
    pub processed_ts: u64,
    pub total_order: u64,
    pub ordered_ts: u64,
    pub client_id: u64,
    // Bytes 56..64 are reserved: written as zero, ignored on receipt. The batch's
    // `batch_seq` travels in its batch header; a copy in every message header cost the
    // publisher a pass over the whole batch on the sending thread.
}

impl BlogMessageHeader {
    pub fn encode_into(&self, b: &mut [u8]) {
        put_u32(b, 0, self.size);
        put_u32(b, 4, self.flags);
        put_u64(b, 8, self.publish_ts_ns);
        put_u64(b, 16, self.counter);
        put_u64(b, 24, self.processed_ts);
        put_u64(b, 32, self.total_order);
        put_u64(b, 40, self.ordered_ts);
        put_u64(b, 48, self.client_id);
        put_u64(b, 56, 0);
    }

    pub fn encode(&self) -> [u8; MESSAGE_HEADER_LEN] {
        let mut b = [0u8; MESSAGE_HEADER_LEN];
        self.encode_into(&mut b);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        need(b, MESSAGE_HEADER_LEN)?;
        Ok(Self {
            size: u32_at(b, 0),
            flags: u32_at(b, 4),
            publish_ts_ns: u64_at(b, 8),
            counter: u64_at(b, 16),
            processed_ts: u64_at(b, 24),
            total_order: u64_at(b, 32),
            ordered_ts: u64_at(b, 40),
            client_id: u64_at(b, 48),
        })
    }
}

/// Walks the messages of a received batch and checks that they tile its payload
/// exactly: `num_msg` headers, each payload within `max_message_bytes`, each stride
/// inside the batch, the strides summing to `total_size`, and every header naming the
/// batch's client. Reads headers only; touches no payload bytes.
pub fn validate_batch_payload(
    header: &BatchHeader,
    payload: &[u8],
    max_message_bytes: u64,
) -> Result<(), WireError> {
    let total = payload.len() as u64;
    if total != header.total_size {
        return Err(WireError::MalformedBatch(format!(
            "payload is {} bytes but the header says {}",
            total, header.total_size
        )));
    }
    let mut at = 0u64;
    for index in 0..header.num_msg {
        if at + MESSAGE_HEADER_LEN as u64 > total {
            return Err(WireError::MalformedBatch(format!(
                "message {index} header starts at {at}, past the end of the {total}-byte batch"
            )));
        }
        let h = &payload[at as usize..];
        let size = u32_at(h, 0) as u64;
        if size > max_message_bytes {
            return Err(WireError::MessageTooLarge {
                size,
                max: max_message_bytes,
            });
        }
        let stride = message_stride(size);
        if at + stride > total {
            return Err(WireError::MalformedBatch(format!(
                "message {index} of {size} bytes overruns the {total}-byte batch"
            )));
        }
        let client_id = u64_at(h, 48);
        if client_id != header.client_id {
            return Err(WireError::MalformedBatch(format!(
                "message {index} names client {client_id}, the batch header names client {}",
                header.client_id
            )));
        }
        at += stride;
    }
    if at != total {
        return Err(WireError::MalformedBatch(format!(
            "{} messages use {at} bytes but the batch has {total}",
            header.num_msg
        )));
    }
    Ok(())
}

/// One message inside a validated batch payload.
#[derive(Debug, Clone, Copy)]
pub struct MessageView<'a> {
    pub header: BlogMessageHeader,
    pub payload: &'a [u8],
}

/// Iterates the messages of a batch payload. Stops (returning an error once) at the
/// first header that does not fit, so it is safe on untrusted bytes too.
pub struct MessageIter<'a> {
    bytes: &'a [u8],
    at: usize,
    remaining: u32,
}

impl<'a> MessageIter<'a> {
    pub fn new(bytes: &'a [u8], num_msg: u32) -> Self {
        Self {
            bytes,
            at: 0,
            remaining: num_msg,
        }
    }
}

impl<'a> Iterator for MessageIter<'a> {
    type Item = Result<MessageView<'a>, WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let rest = &self.bytes[self.at.min(self.bytes.len())..];
        let header = match BlogMessageHeader::decode(rest) {
            Ok(h) => h,
            Err(e) => {
                self.remaining = 0;
                return Some(Err(e));
            }
        };
        let stride = message_stride(header.size as u64) as usize;
        if stride > rest.len() {
            self.remaining = 0;
            return Some(Err(WireError::MalformedBatch(format!(
                "message of {} bytes overruns the batch",
                header.size
            ))));
        }
        let payload = &rest[MESSAGE_HEADER_LEN..MESSAGE_HEADER_LEN + header.size as usize];
        self.at += stride;
        Some(Ok(MessageView { header, payload }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn build(client_id: u64, batch_seq: u64, sizes: &[u32]) -> (BatchHeader, Vec<u8>) {
        let mut payload = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let h = BlogMessageHeader {
                size,
                counter: i as u64,
                client_id,
                ..Default::default()
            };
            let start = payload.len();
            payload.resize(start + message_stride(size as u64) as usize, 0);
            h.encode_into(&mut payload[start..]);
            payload[start + 64..start + 64 + size as usize].fill(i as u8);
        }
        let header = BatchHeader {
            batch_seq,
            client_id,
            num_msg: sizes.len() as u32,
            total_size: payload.len() as u64,
            ..Default::default()
        };
        (header, payload)
    }

    #[test]
    fn stride_is_header_plus_payload_rounded_to_64() {
        assert_eq!(message_stride(0), 64);
        assert_eq!(message_stride(1), 128);
        assert_eq!(message_stride(1024), 1088);
    }

    #[test]
    fn well_formed_batch_validates_and_iterates() {
        let (h, p) = build(9, 4, &[0, 1, 100, 1024]);
        validate_batch_payload(&h, &p, 1 << 20).unwrap();
        let sizes: Vec<usize> = MessageIter::new(&p, h.num_msg)
            .map(|m| m.unwrap().payload.len())
            .collect();
        assert_eq!(sizes, vec![0, 1, 100, 1024]);
    }

    #[test]
    fn message_over_limit_is_rejected() {
        let (h, p) = build(1, 0, &[2000]);
        assert!(matches!(
            validate_batch_payload(&h, &p, 1024),
            Err(WireError::MessageTooLarge {
                size: 2000,
                max: 1024
            })
        ));
    }

    #[test]
    fn count_or_size_disagreement_is_rejected() {
        let (mut h, p) = build(1, 0, &[10, 10]);
        h.num_msg = 1;
        assert!(validate_batch_payload(&h, &p, 1 << 20).is_err());
        h.num_msg = 3;
        assert!(validate_batch_payload(&h, &p, 1 << 20).is_err());
    }

    #[test]
    fn foreign_client_is_rejected() {
        let (mut h, p) = build(1, 0, &[10]);
        h.client_id = 2;
        assert!(validate_batch_payload(&h, &p, 1 << 20).is_err());
    }

    #[test]
    fn reserved_bytes_of_message_headers_are_ignored() {
        // Clients built before bytes 56..64 were reserved wrote the batch's sequence there.
        let (h, mut p) = build(1, 7, &[10, 0]);
        for at in [0, 128] {
            p[at + 56..at + 64].copy_from_slice(&7u64.to_le_bytes());
        }
        validate_batch_payload(&h, &p, 1 << 20).unwrap();
    }

    proptest! {
        /// Whatever bytes arrive, validation and iteration never panic or read out of
        /// bounds, and a batch that validates iterates exactly `num_msg` messages.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048),
                                       num_msg in 0u32..40) {
            let h = BatchHeader { num_msg, total_size: bytes.len() as u64, ..Default::default() };
            let ok = validate_batch_payload(&h, &bytes, 1 << 20).is_ok();
            let items: Vec<_> = MessageIter::new(&bytes, num_msg).collect();
            if ok {
                prop_assert_eq!(items.len(), num_msg as usize);
                prop_assert!(items.iter().all(|m| m.is_ok()));
            }
        }

        #[test]
        fn built_batches_always_validate(sizes in proptest::collection::vec(0u32..3000, 1..20)) {
            let (h, p) = build(5, 6, &sizes);
            prop_assert!(validate_batch_payload(&h, &p, 4096).is_ok());
        }
    }
}
