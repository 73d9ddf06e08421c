//! Recovery of a replica's log from its segment files (`TopicStore::open`: record
//! headers, checksums, torn tails, gaps) and reading it back (`DiskReader`), on bytes
//! written as segment files in a scratch directory (tmpfs when there is one).
//!
//! Input: `ctl u8 | split u8 | first_seq u64 | first_position u64 | segment bytes`.
//! `ctl` bits: 1 = repair magic and checksums of every record (so mutations get past
//! them), 2 = cut the bytes into two segment files at a record boundary, 4 = after the
//! open, append a record and reopen (it must be found), 8 = renumber the records
//! contiguously from the file name.
use embarcadero_fuzz::{scratch_dir, u32_at, u64_at};
use embarcadero_replication::record::{RecordHeader, RECORD_HEADER_LEN};
use embarcadero_replication::store::segment_name;
use embarcadero_replication::{DiskReader, DiskSeek, TopicStore};

const FIX_CHECKSUMS: u8 = 1;
const SPLIT: u8 = 2;
const APPEND: u8 = 4;
const RENUMBER: u8 = 8;

/// The header at the front of `b` as written, checksums not checked.
fn raw_header(b: &[u8]) -> RecordHeader {
    RecordHeader {
        seq: u64_at(b, 8),
        total_order: u64_at(b, 16),
        batch_id: u64_at(b, 24),
        client_id: u64_at(b, 32),
        client_seq: u64_at(b, 40),
        session_epoch: u64_at(b, 48),
        payload_len: u32_at(b, 56),
        num_msg: u32_at(b, 60),
        payload_crc: u32_at(b, 64),
        broker_id: u32_at(b, 68) as u16,
        flags: (u32_at(b, 68) >> 16) as u16,
        pbr_index: u64_at(b, 72),
    }
}

/// Walks the records of `bytes` by their lengths, optionally repairing them; returns
/// the offsets where records start.
fn walk(bytes: &mut [u8], ctl: u8, mut seq: u64, mut position: u64) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut off = 0usize;
    while off + RECORD_HEADER_LEN <= bytes.len() {
        starts.push(off);
        let mut h = raw_header(&bytes[off..]);
        if ctl & RENUMBER != 0 {
            h.seq = seq;
            h.total_order = position;
        }
        let end = off + RECORD_HEADER_LEN + h.payload_len as usize;
        if ctl & FIX_CHECKSUMS != 0 {
            if let Some(payload) = bytes.get(off + RECORD_HEADER_LEN..end) {
                h.payload_crc = crc32fast::hash(payload);
            }
            bytes[off..off + RECORD_HEADER_LEN].copy_from_slice(&h.encode());
        }
        seq = h.seq.wrapping_add(1);
        position = h.total_order.wrapping_add(h.num_msg as u64);
        off = end;
    }
    starts
}

fn main() {
    let dir = scratch_dir("replication");
    afl::fuzz!(|data: &[u8]| {
        if data.len() < 18 {
            return;
        }
        let (ctl, split) = (data[0], data[1]);
        let (first_seq, first_position) = (u64_at(data, 2), u64_at(data, 10));
        let mut bytes = data[18..].to_vec();
        let starts = walk(&mut bytes, ctl, first_seq, first_position);

        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut files = vec![(first_seq, first_position, &bytes[..])];
        if ctl & SPLIT != 0 && starts.len() > 1 {
            let at = starts[1 + split as usize % (starts.len() - 1)];
            let h = raw_header(&bytes[at..]);
            files = vec![
                (first_seq, first_position, &bytes[..at]),
                (h.seq, h.total_order, &bytes[at..]),
            ];
        }
        for (seq, position, content) in files {
            std::fs::write(dir.join(segment_name(seq, position)), content).unwrap();
        }

        let Ok(mut store) = TopicStore::open(&dir, 4096) else {
            return;
        };
        let (first, next) = (store.first_seq(), store.next_seq());
        assert!(first <= next);
        assert!(store.first_position() <= store.next_position());

        // Every record the open kept reads back in order (a closed segment's payloads
        // are not checked at open: a bad one is an error, not data).
        let mut reader = DiskReader::new(&dir);
        let mut payload = Vec::new();
        if let Ok(DiskSeek::At { seq, skip: 0 }) = reader.seek_seq(first, next) {
            assert_eq!(seq, first);
            let mut expect = first;
            while let Ok(Some(h)) = reader.next(next, &mut payload) {
                assert_eq!(h.seq, expect);
                assert_eq!(payload.len(), h.payload_len as usize);
                expect += 1;
                assert!(expect <= next);
            }
        }
        let _ = reader.seek_position(u64_at(data, 10).wrapping_add(split as u64), next);

        // A GOI index or position of 2^64 - 1 is never reached: no append there.
        if ctl & APPEND != 0 && next < u64::MAX && store.next_position() < u64::MAX - 1 {
            let body = b"after recovery";
            let h = RecordHeader {
                seq: next,
                total_order: store.next_position(),
                num_msg: 1,
                payload_len: body.len() as u32,
                payload_crc: crc32fast::hash(body),
                client_id: 7,
                client_seq: 0,
                session_epoch: 1,
                ..Default::default()
            };
            store.append(&h, body).unwrap();
            store.sync().unwrap();
            drop(store);
            let again = TopicStore::open(&dir, 4096).expect("reopen after an append");
            assert_eq!(again.next_seq(), next + 1);
            assert_eq!(again.next_position(), h.end_position());
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}
