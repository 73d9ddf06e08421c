//! Reading a topic's log back from a replica's segment files, for subscribers whose
//! positions have left memory. Only records below the durable frontier are read: they
//! are complete and never rewritten. Retention may delete a segment at any time: it
//! renames the file and shortens it in steps (see `ExpiredSegments::remove`), so a
//! segment being deleted under a reading cursor is reported as not retained
//! (`NotFound`); a seek that meets one mid-scan finds the log ending early (`Beyond`).

use crate::record::{RecordHeader, RECORD_HEADER_LEN};
use crate::store::{list_segments, read_header_at, SegmentFile};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where a position is in the log on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskSeek {
    /// In record `seq`, `skip` messages into it; the reader now points at that record.
    At { seq: u64, skip: u32 },
    /// Retention removed it; the oldest position kept is `first_position`.
    Gone { first_position: u64 },
    /// Not (yet) durable on this replica.
    Beyond,
}

struct Cursor {
    file: File,
    /// The segment's name in the log; gone once retention has begun deleting it.
    path: PathBuf,
    offset: u64,
    seq: u64,
}

impl Cursor {
    /// `err`, or `NotFound` if retention took the segment meanwhile: a deletion shortens
    /// the file under an open reader, which then looks cut short.
    fn unless_removed(&self, err: io::Error) -> io::Error {
        match self.path.try_exists() {
            Ok(false) => removed_by_retention(),
            // Still there, or cannot tell (permissions, I/O): the error stands.
            Ok(true) | Err(_) => err,
        }
    }
}

fn removed_by_retention() -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, "segment removed by retention")
}

/// A sequential reader over one replica's copy of a topic.
pub struct DiskReader {
    dir: PathBuf,
    cursor: Option<Cursor>,
}

fn corrupt(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl DiskReader {
    pub fn new(topic_dir: &Path) -> Self {
        Self {
            dir: topic_dir.to_path_buf(),
            cursor: None,
        }
    }

    /// The oldest position kept on disk, if any segment exists.
    pub fn first_position(&self) -> io::Result<Option<u64>> {
        Ok(list_segments(&self.dir)?.first().map(|s| s.first_position))
    }

    /// Points the reader at the record that holds global position `position`, looking
    /// only at records below `durable_seq`.
    pub fn seek_position(&mut self, position: u64, durable_seq: u64) -> io::Result<DiskSeek> {
        self.cursor = None;
        let segments = list_segments(&self.dir)?;
        let Some(first) = segments.first() else {
            return Ok(DiskSeek::Beyond);
        };
        if position < first.first_position {
            return Ok(DiskSeek::Gone {
                first_position: first.first_position,
            });
        }
        let at = segments.partition_point(|s| s.first_position <= position) - 1;
        let seg = &segments[at];
        let Some(file) = open_segment(seg)? else {
            return self.seek_position(position, durable_seq);
        };
        let (mut offset, mut seq) = (0, seg.first_seq);
        while seq < durable_seq {
            let Some(h) = read_header_at(&file, offset)? else {
                // Past this segment's end: the position starts the next segment, which
                // is not there yet.
                return Ok(DiskSeek::Beyond);
            };
            let h = h.map_err(|e| corrupt(format!("{}: {e}", seg.path.display())))?;
            if h.seq != seq {
                return Err(corrupt(format!(
                    "{}: record {} where {seq} belongs",
                    seg.path.display(),
                    h.seq
                )));
            }
            if position < h.total_order {
                // The segment's name or an earlier record promised this position.
                return Err(corrupt(format!(
                    "{}: record {seq} starts at position {}, past {position} it should hold",
                    seg.path.display(),
                    h.total_order
                )));
            }
            if position < h.end_position() {
                self.cursor = Some(Cursor {
                    file,
                    path: seg.path.clone(),
                    offset,
                    seq,
                });
                return Ok(DiskSeek::At {
                    seq,
                    skip: (position - h.total_order) as u32,
                });
            }
            offset += h.record_len();
            seq += 1;
        }
        Ok(DiskSeek::Beyond)
    }

    /// Points the reader at record `seq`.
    pub fn seek_seq(&mut self, seq: u64, durable_seq: u64) -> io::Result<DiskSeek> {
        self.cursor = None;
        let segments = list_segments(&self.dir)?;
        let Some(first) = segments.first() else {
            return Ok(DiskSeek::Beyond);
        };
        if seq < first.first_seq {
            return Ok(DiskSeek::Gone {
                first_position: first.first_position,
            });
        }
        if seq >= durable_seq {
            return Ok(DiskSeek::Beyond);
        }
        let at = segments.partition_point(|s| s.first_seq <= seq) - 1;
        let seg = &segments[at];
        let Some(file) = open_segment(seg)? else {
            return self.seek_seq(seq, durable_seq);
        };
        let (mut offset, mut s) = (0, seg.first_seq);
        while s < seq {
            let Some(h) = read_header_at(&file, offset)? else {
                return Ok(DiskSeek::Beyond);
            };
            let h = h.map_err(|e| corrupt(format!("{}: {e}", seg.path.display())))?;
            offset += h.record_len();
            s += 1;
        }
        self.cursor = Some(Cursor {
            file,
            path: seg.path.clone(),
            offset,
            seq,
        });
        Ok(DiskSeek::At { seq, skip: 0 })
    }

    /// Reads the record at the cursor into `payload` and moves past it; `None` when the
    /// next record is not below `durable_seq` (or no seek was made).
    pub fn next(
        &mut self,
        durable_seq: u64,
        payload: &mut Vec<u8>,
    ) -> io::Result<Option<RecordHeader>> {
        let Some(c) = self.cursor.as_mut() else {
            return Ok(None);
        };
        if c.seq >= durable_seq {
            return Ok(None);
        }
        let h = match read_header_at(&c.file, c.offset)? {
            Some(h) => {
                h.map_err(|e| corrupt(format!("{}: record {}: {e}", self.dir.display(), c.seq)))?
            }
            None => {
                // The record starts the next segment.
                let seq = c.seq;
                let next = list_segments(&self.dir)?
                    .into_iter()
                    .find(|s| s.first_seq == seq)
                    .ok_or_else(|| {
                        c.unless_removed(corrupt(format!(
                            "{}: no segment starts at record {seq}",
                            self.dir.display()
                        )))
                    })?;
                let file = open_segment(&next)?.ok_or_else(removed_by_retention)?;
                *c = Cursor {
                    file,
                    path: next.path,
                    offset: 0,
                    seq,
                };
                return self.next(durable_seq, payload);
            }
        };
        if h.seq != c.seq {
            return Err(corrupt(format!(
                "{}: record {} where {} belongs",
                self.dir.display(),
                h.seq,
                c.seq
            )));
        }
        // The length comes from the disk: it must fit the file before it sizes a buffer.
        let file_len = c.file.metadata().map_err(|e| c.unless_removed(e))?.len();
        if c.offset + h.record_len() > file_len {
            // Retention may have cut the file short under us: that is not corruption.
            return Err(c.unless_removed(corrupt(format!(
                "{}: record {} of {} bytes runs past the end of its segment ({file_len} bytes)",
                self.dir.display(),
                c.seq,
                h.record_len()
            ))));
        }
        payload.resize(h.payload_len as usize, 0);
        c.file
            .read_exact_at(payload, c.offset + RECORD_HEADER_LEN as u64)
            .map_err(|e| c.unless_removed(e))?;
        h.check_payload(payload)
            .map_err(|e| corrupt(format!("{}: record {}: {e}", self.dir.display(), c.seq)))?;
        c.offset += h.record_len();
        c.seq += 1;
        Ok(Some(h))
    }
}

/// Opens a segment; `None` if retention removed it meanwhile.
fn open_segment(seg: &SegmentFile) -> io::Result<Option<File>> {
    match File::open(&seg.path) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::TopicStore;

    /// A log of `records` synced records with payloads of 50 + i bytes, in segments of
    /// about 400 bytes (3-4 records each).
    pub(crate) fn write_log(dir: &Path, records: u64) -> TopicStore {
        let mut s = TopicStore::open(dir, 400).unwrap();
        for i in 0..records {
            let payload = vec![i as u8; 50 + i as usize];
            let h = RecordHeader {
                seq: s.next_seq(),
                total_order: s.next_position(),
                num_msg: 3,
                payload_len: payload.len() as u32,
                payload_crc: crc32fast::hash(&payload),
                ..Default::default()
            };
            s.append(&h, &payload).unwrap();
            s.sync().unwrap();
        }
        s
    }

    #[test]
    fn reads_every_record_across_segments_from_any_position() {
        let dir = tempfile::tempdir().unwrap();
        let s = write_log(dir.path(), 20);
        assert!(list_segments(dir.path()).unwrap().len() > 3);
        let durable = s.durable_seq();
        let mut r = DiskReader::new(dir.path());
        for position in [0u64, 1, 2, 3, 31, 59] {
            let seek = r.seek_position(position, durable).unwrap();
            let seq = position / 3;
            assert_eq!(
                seek,
                DiskSeek::At {
                    seq,
                    skip: (position % 3) as u32
                }
            );
            let mut buf = Vec::new();
            let mut expected = seq;
            while let Some(h) = r.next(durable, &mut buf).unwrap() {
                assert_eq!(h.seq, expected);
                assert_eq!(buf, vec![expected as u8; 50 + expected as usize]);
                expected += 1;
            }
            assert_eq!(expected, 20);
        }
        assert_eq!(r.seek_position(60, durable).unwrap(), DiskSeek::Beyond);
        assert_eq!(
            r.seek_seq(7, durable).unwrap(),
            DiskSeek::At { seq: 7, skip: 0 }
        );
        let mut buf = Vec::new();
        assert_eq!(r.next(durable, &mut buf).unwrap().unwrap().seq, 7);
    }

    #[test]
    fn stops_at_the_durable_frontier_and_reports_retention() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = write_log(dir.path(), 20);
        let mut r = DiskReader::new(dir.path());
        assert!(matches!(r.seek_seq(0, 5).unwrap(), DiskSeek::At { .. }));
        let mut buf = Vec::new();
        let mut n = 0;
        while r.next(5, &mut buf).unwrap().is_some() {
            n += 1;
        }
        assert_eq!(n, 5);
        s.apply_retention(800, None).unwrap();
        let first = r.first_position().unwrap().unwrap();
        assert!(first > 0);
        assert_eq!(
            r.seek_position(0, 20).unwrap(),
            DiskSeek::Gone {
                first_position: first
            }
        );
    }

    /// Retention shortens a segment under a reader that has it open: the reader reports
    /// it as removed (`NotFound`), never as corrupt and never with cut-short data.
    #[test]
    fn a_segment_deleted_under_an_open_reader_reads_as_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = write_log(dir.path(), 20);
        let mut r = DiskReader::new(dir.path());
        assert!(matches!(r.seek_seq(1, 20).unwrap(), DiskSeek::At { .. }));
        let mut buf = Vec::new();
        assert_eq!(r.next(20, &mut buf).unwrap().unwrap().seq, 1);
        let mut expired = s.take_expired(1, None);
        assert!(!expired.is_empty());
        expired.remove_in_steps(16).unwrap();
        let err = r.next(20, &mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }

    /// A record whose length runs past the end of its segment (a torn or forged file)
    /// is reported as corrupt before its length sizes any buffer.
    #[test]
    fn a_record_longer_than_its_file_is_corrupt_before_anything_is_allocated() {
        let dir = tempfile::tempdir().unwrap();
        let s = write_log(dir.path(), 2);
        let seg = &list_segments(dir.path()).unwrap()[0].path;
        let len = std::fs::metadata(seg).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(seg)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        let mut r = DiskReader::new(dir.path());
        assert!(matches!(
            r.seek_seq(1, s.durable_seq()).unwrap(),
            DiskSeek::At { .. }
        ));
        let mut buf = Vec::new();
        let err = r.next(s.durable_seq(), &mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains("past the end"), "{err}");
        assert!(buf.is_empty(), "nothing was read into the buffer");
    }

    #[test]
    fn a_corrupt_payload_is_an_error_not_data() {
        let dir = tempfile::tempdir().unwrap();
        let s = write_log(dir.path(), 2);
        let seg = &list_segments(dir.path()).unwrap()[0].path;
        let f = std::fs::OpenOptions::new().write(true).open(seg).unwrap();
        f.write_all_at(b"X", RECORD_HEADER_LEN as u64 + 3).unwrap();
        let mut r = DiskReader::new(dir.path());
        r.seek_seq(0, s.durable_seq()).unwrap();
        let err = r.next(s.durable_seq(), &mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
