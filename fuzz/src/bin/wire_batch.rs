//! A publisher's batch as a broker validates it: `BatchHeader::decode`,
//! `validate_incoming`, then `validate_batch_payload` over the payload, and a subscriber's
//! `MessageIter` over a validated batch. Input: `max_message_bytes u32 | max_batch_bytes
//! u32 | BatchHeader (128) | payload`.
use embarcadero_fuzz::u32_at;
use embarcadero_wire::{
    message_stride, validate_batch_payload, BatchHeader, MessageIter, BATCH_HEADER_LEN,
};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let max_message = u32_at(data, 0) as u64;
        let max_batch = u32_at(data, 4) as u64;
        let rest = data.get(8..).unwrap_or_default();
        let Ok(header) = BatchHeader::decode(rest) else {
            return;
        };
        assert_eq!(BatchHeader::decode(&header.encode()).unwrap(), header);
        if header.validate_incoming(max_batch).is_err() {
            return;
        }
        // What the broker reads next: exactly total_size bytes (fewer if the input ends).
        let payload = &rest[BATCH_HEADER_LEN..];
        let payload = &payload[..payload.len().min(header.total_size as usize)];
        if validate_batch_payload(&header, payload, max_message).is_ok() {
            let mut used = 0u64;
            let mut n = 0u32;
            for m in MessageIter::new(payload, header.num_msg) {
                let m = m.expect("a validated batch iterates");
                assert!(m.header.size as u64 <= max_message);
                assert_eq!(m.header.client_id, header.client_id);
                used += message_stride(m.header.size as u64);
                n += 1;
            }
            assert_eq!(n, header.num_msg);
            assert_eq!(used, header.total_size);
        }
    });
}
