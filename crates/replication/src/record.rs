//! The on-disk record: one batch of the global order, a fixed header then the batch's
//! payload exactly as the publisher wrote it (so a subscriber can be served verbatim).
//!
//! ```text
//! offset size field
//!  0     4   magic "EREC"
//!  4     4   header_crc   CRC-32 of bytes 8..80
//!  8     8   seq          index in the topic's GOI
//! 16     8   total_order  global position of the first message
//! 24     8   batch_id
//! 32     8   client_id
//! 40     8   client_seq   the publisher's batch_seq
//! 48     8   session_epoch
//! 56     4   payload_len
//! 60     4   num_msg
//! 64     4   payload_crc  CRC-32 of the payload
//! 68     2   broker_id
//! 70     2   flags        the GOI entry's (GOI_SESSION_START); zero before it existed
//! 72     8   pbr_index    where the batch sat in its broker's ring (diagnostics)
//! ```
//!
//! Both checksums let recovery tell a record that reached the disk from one torn by a
//! crash, and let readers refuse bytes the disk corrupted.

use embarcadero_region::GoiEntry;

pub const RECORD_HEADER_LEN: usize = 80;
pub const RECORD_MAGIC: [u8; 4] = *b"EREC";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecordHeader {
    pub seq: u64,
    pub total_order: u64,
    pub batch_id: u64,
    pub client_id: u64,
    pub client_seq: u64,
    pub session_epoch: u64,
    pub payload_len: u32,
    pub num_msg: u32,
    pub payload_crc: u32,
    pub broker_id: u16,
    pub flags: u16,
    pub pbr_index: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("bad record magic")]
    BadMagic,
    #[error("record header checksum mismatch")]
    HeaderChecksum,
    #[error("record payload checksum mismatch")]
    PayloadChecksum,
}

impl RecordHeader {
    /// The record for GOI entry `seq`, whose payload is `payload`.
    pub fn of(seq: u64, e: &GoiEntry, payload: &[u8]) -> Self {
        debug_assert_eq!(payload.len(), e.payload_size as usize);
        Self {
            seq,
            total_order: e.total_order,
            batch_id: e.batch_id,
            client_id: e.client_id,
            client_seq: e.client_seq,
            session_epoch: e.session_epoch,
            payload_len: e.payload_size,
            num_msg: e.num_msg,
            payload_crc: crc32fast::hash(payload),
            broker_id: e.broker_id,
            flags: e.flags,
            pbr_index: e.pbr_index,
        }
    }

    /// Bytes the record takes on disk, header included.
    pub fn record_len(&self) -> u64 {
        RECORD_HEADER_LEN as u64 + self.payload_len as u64
    }

    /// Position just after this record's last message.
    pub fn end_position(&self) -> u64 {
        self.total_order + self.num_msg as u64
    }

    pub fn encode(&self) -> [u8; RECORD_HEADER_LEN] {
        let mut b = [0u8; RECORD_HEADER_LEN];
        b[0..4].copy_from_slice(&RECORD_MAGIC);
        let w8 = |b: &mut [u8], at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        let w4 = |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        w8(&mut b, 8, self.seq);
        w8(&mut b, 16, self.total_order);
        w8(&mut b, 24, self.batch_id);
        w8(&mut b, 32, self.client_id);
        w8(&mut b, 40, self.client_seq);
        w8(&mut b, 48, self.session_epoch);
        w4(&mut b, 56, self.payload_len);
        w4(&mut b, 60, self.num_msg);
        w4(&mut b, 64, self.payload_crc);
        b[68..70].copy_from_slice(&self.broker_id.to_le_bytes());
        b[70..72].copy_from_slice(&self.flags.to_le_bytes());
        w8(&mut b, 72, self.pbr_index);
        let crc = crc32fast::hash(&b[8..]);
        w4(&mut b, 4, crc);
        // What recovery and readers decode is what was written (a field at an offset
        // the other side does not read it from would pass both checksums).
        debug_assert_eq!(
            Self::decode(&b),
            Ok(*self),
            "a record header decodes as encoded"
        );
        b
    }

    /// Decodes and checks a header; the payload is checked with [`Self::check_payload`].
    pub fn decode(b: &[u8; RECORD_HEADER_LEN]) -> Result<Self, RecordError> {
        if b[0..4] != RECORD_MAGIC {
            return Err(RecordError::BadMagic);
        }
        let r8 = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let r4 = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        if r4(4) != crc32fast::hash(&b[8..]) {
            return Err(RecordError::HeaderChecksum);
        }
        Ok(Self {
            seq: r8(8),
            total_order: r8(16),
            batch_id: r8(24),
            client_id: r8(32),
            client_seq: r8(40),
            session_epoch: r8(48),
            payload_len: r4(56),
            num_msg: r4(60),
            payload_crc: r4(64),
            broker_id: u16::from_le_bytes([b[68], b[69]]),
            flags: u16::from_le_bytes([b[70], b[71]]),
            pbr_index: r8(72),
        })
    }

    pub fn check_payload(&self, payload: &[u8]) -> Result<(), RecordError> {
        if payload.len() != self.payload_len as usize
            || crc32fast::hash(payload) != self.payload_crc
        {
            return Err(RecordError::PayloadChecksum);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RecordHeader {
        RecordHeader {
            seq: 7,
            total_order: 1000,
            batch_id: 3,
            client_id: 0xfeed,
            client_seq: 12,
            session_epoch: 2,
            payload_len: 5,
            num_msg: 1,
            payload_crc: crc32fast::hash(b"hello"),
            broker_id: 3,
            flags: embarcadero_region::GOI_SESSION_START,
            pbr_index: 99,
        }
    }

    #[test]
    fn header_roundtrips_and_detects_every_flipped_byte() {
        let h = sample();
        let bytes = h.encode();
        assert_eq!(RecordHeader::decode(&bytes).unwrap(), h);
        for i in 0..RECORD_HEADER_LEN {
            let mut bad = bytes;
            bad[i] ^= 0x40;
            assert!(
                RecordHeader::decode(&bad).is_err(),
                "flip at byte {i} accepted"
            );
        }
    }

    #[test]
    fn payload_checksum_catches_corruption_and_wrong_length() {
        let h = sample();
        assert!(h.check_payload(b"hello").is_ok());
        assert_eq!(h.check_payload(b"hellp"), Err(RecordError::PayloadChecksum));
        assert_eq!(h.check_payload(b"hell"), Err(RecordError::PayloadChecksum));
    }
}
