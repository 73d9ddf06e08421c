//! One topic's log on one replica's disk: a directory of segment files, each a run of
//! records (see [`crate::record`]). A segment is named by the GOI index and global
//! position of its first record, so even an empty segment says where the log resumes.
//!
//! Invariants:
//! - records are contiguous: each record's `seq` is the previous one's plus one and its
//!   `total_order` the previous one's end position;
//! - only the last segment is ever written; a segment is closed right after an
//!   `fdatasync` that covered all of it, so every closed segment is entirely durable;
//! - at most one sync is in flight ([`TopicStore::begin_sync`] to
//!   [`TopicStore::finish_sync`]); it covers what was appended before it began, and
//!   appends may go on meanwhile (the replica worker overlaps copying with syncing).
//! - a new segment's directory entry is made durable (directory fsync) before any
//!   record in it is reported durable.

use crate::record::{RecordError, RecordHeader, RECORD_HEADER_LEN};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

const SEGMENT_SUFFIX: &str = ".seg";
/// Where a start moves segment files that are not part of the log (see [`TopicStore::open`]).
pub const SET_ASIDE_DIR: &str = "set-aside";

/// A segment file as its name describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentFile {
    pub first_seq: u64,
    pub first_position: u64,
    pub path: PathBuf,
}

pub fn segment_name(first_seq: u64, first_position: u64) -> String {
    let name = format!("{first_seq:020}-{first_position:020}{SEGMENT_SUFFIX}");
    // What a start reads back from the name is where the segment was written to begin.
    assert_eq!(
        parse_segment_name(&name),
        Some((first_seq, first_position)),
        "segment name {name}"
    );
    name
}

fn parse_segment_name(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(SEGMENT_SUFFIX)?;
    let (seq, pos) = stem.split_once('-')?;
    Some((seq.parse().ok()?, pos.parse().ok()?))
}

/// The segment files in `dir`, oldest first. A missing directory has none.
pub fn list_segments(dir: &Path) -> io::Result<Vec<SegmentFile>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if let Some((first_seq, first_position)) = name.to_str().and_then(parse_segment_name) {
            out.push(SegmentFile {
                first_seq,
                first_position,
                path: entry.path(),
            });
        }
    }
    out.sort_by_key(|s| s.first_seq);
    Ok(out)
}

/// Reads the record header at `offset`; `Ok(None)` at the end of the file or when only
/// part of a header is there.
pub fn read_header_at(
    file: &File,
    offset: u64,
) -> io::Result<Option<Result<RecordHeader, RecordError>>> {
    let mut raw = [0u8; RECORD_HEADER_LEN];
    let mut got = 0;
    while got < raw.len() {
        match file.read_at(&mut raw[got..], offset + got as u64) {
            Ok(0) => return Ok(None),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(RecordHeader::decode(&raw)))
}

/// What an order-5 session looks like in the records seen so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SessionMark {
    pub epoch: u64,
    /// One above the highest `client_seq` seen.
    pub hwm: u64,
    /// GOI index of the session's latest batch: how recently it was active.
    pub last_seq: u64,
    /// The session key hash it is bound to, where the previous region still told it
    /// (disk records do not carry it); 0: the session binds again with its next batch.
    pub key_hash: u64,
}

/// Folds one committed batch (GOI index `seq`) into the session it belongs to (session
/// FIFO means the highest sequence seen is the session's committed high-water mark). A
/// batch flagged as a session's start begins a new session of its client id: the
/// earlier one ended, and its marks must not carry over.
pub fn fold_session(
    sessions: &mut BTreeMap<u64, SessionMark>,
    client_id: u64,
    epoch: u64,
    client_seq: u64,
    seq: u64,
    flags: u16,
    key_hash: u64,
) {
    if epoch == 0 {
        return;
    }
    let m = sessions.entry(client_id).or_default();
    if flags & embarcadero_region::GOI_SESSION_START != 0 {
        *m = SessionMark::default();
    }
    if m.key_hash == 0 {
        m.key_hash = key_hash;
    }
    m.epoch = m.epoch.max(epoch);
    // Saturating: the bytes come from disk, and a sequence of u64::MAX must not panic.
    m.hwm = m.hwm.max(client_seq.saturating_add(1));
    m.last_seq = m.last_seq.max(seq);
}

#[derive(Debug)]
struct Segment {
    file: SegmentFile,
    len: u64,
    end_seq: u64,
    end_position: u64,
    /// When its last record was written (file mtime for segments found at open).
    last_write: SystemTime,
}

/// Where the log stood at the last successful sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mark {
    seq: u64,
    position: u64,
    /// Length of the active segment.
    len: u64,
}

/// How long each sync waits while the slow-disk fault flag exists.
pub const SLOW_DISK_DELAY: std::time::Duration = std::time::Duration::from_millis(100);

/// A sync begun by [`TopicStore::begin_sync`]: what must reach stable storage for
/// everything appended before it began to be durable.
#[derive(Debug)]
pub struct PendingSync {
    file: Option<Arc<File>>,
    /// The directory, when a segment was created since its last fsync.
    dir: Option<Arc<File>>,
    fault_flag: Option<PathBuf>,
    slow_disk_flag: Option<PathBuf>,
    mark: Mark,
}

impl PendingSync {
    /// `fdatasync` of the active segment, then the directory if a segment was created.
    pub fn run(&self) -> io::Result<()> {
        if let Some(flag) = &self.fault_flag {
            if flag.exists() {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        if self.slow_disk_flag.as_ref().is_some_and(|f| f.exists()) {
            std::thread::sleep(SLOW_DISK_DELAY);
        }
        if let Some(file) = &self.file {
            file.sync_data()?;
        }
        if let Some(dir) = &self.dir {
            dir.sync_all()?;
        }
        Ok(())
    }

    /// Records below this GOI index are durable once the sync succeeds.
    pub fn seq(&self) -> u64 {
        self.mark.seq
    }
}

/// The writer of one topic's log on one replica.
pub struct TopicStore {
    dir: PathBuf,
    dir_handle: Arc<File>,
    /// Close the active segment once it reaches this many bytes.
    segment_target: u64,
    closed: Vec<Segment>,
    active: Option<(Segment, Arc<File>)>,
    /// The active segment was created since the last directory fsync.
    dir_dirty: bool,
    /// A sync was begun and its outcome not applied yet (at most one: module comment).
    sync_in_flight: bool,
    next_seq: u64,
    next_position: u64,
    synced: Mark,
    sessions: BTreeMap<u64, SessionMark>,
    fault_flag: Option<PathBuf>,
    slow_disk_flag: Option<PathBuf>,
}

impl TopicStore {
    /// Opens (creating if needed) the log in `dir`, checks every record header, checks
    /// the payloads of the last segment, and cuts off a torn tail left by a crash. The
    /// log is its oldest contiguous run of whole records; segment files after a gap or
    /// a damaged record are moved into [`SET_ASIDE_DIR`], never deleted.
    pub fn open(dir: &Path, segment_target: u64) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let dir_handle = Arc::new(File::open(dir)?);
        remove_leftover_deletions(dir)?;
        let files = list_segments(dir)?;
        let mut store = Self::empty(dir, dir_handle, segment_target);
        let count = files.len();
        let mut payload = Vec::new();
        for (i, f) in files.iter().enumerate() {
            if i > 0 && (f.first_seq != store.next_seq || f.first_position != store.next_position) {
                set_aside(dir, &files[i..], None, store.next_seq)?;
                break;
            }
            let last = i + 1 == count;
            let (file, scan) = store.scan_at_open(f, last, &mut payload)?;
            if scan.torn {
                cut_torn_tail(dir, &files, i, &file, &scan, last)?;
            }
            let segment = Segment {
                len: scan.valid_len,
                end_seq: scan.end_seq,
                end_position: scan.end_position,
                last_write: file
                    .metadata()?
                    .modified()
                    .unwrap_or_else(|_| SystemTime::now()),
                file: f.clone(),
            };
            store.next_seq = scan.end_seq;
            store.next_position = scan.end_position;
            if last || scan.torn {
                store.active = Some((segment, Arc::new(file)));
                break;
            }
            store.closed.push(segment);
        }
        let len = store.active.as_ref().map_or(0, |(s, _)| s.len);
        store.synced = Mark {
            seq: store.next_seq,
            position: store.next_position,
            len,
        };
        store.assert_contiguous();
        Ok(store)
    }

    /// A store of `dir` holding no segments yet, where [`TopicStore::open`] starts
    /// before taking in the segment files it finds.
    fn empty(dir: &Path, dir_handle: Arc<File>, segment_target: u64) -> Self {
        Self {
            dir: dir.to_path_buf(),
            dir_handle,
            segment_target: segment_target.max(RECORD_HEADER_LEN as u64),
            closed: Vec::new(),
            active: None,
            dir_dirty: false,
            sync_in_flight: false,
            next_seq: 0,
            next_position: 0,
            synced: Mark {
                seq: 0,
                position: 0,
                len: 0,
            },
            sessions: BTreeMap::new(),
            fault_flag: None,
            slow_disk_flag: None,
        }
    }

    /// Scans segment `f` at open, folding its sessions into the store's. A damaged
    /// closed segment is scanned again as the `last` one (payloads checked), since it
    /// is about to become the active segment; its sessions are folded once, from that
    /// second scan.
    fn scan_at_open(
        &mut self,
        f: &SegmentFile,
        last: bool,
        payload: &mut Vec<u8>,
    ) -> io::Result<(File, SegmentScan)> {
        let sessions_before = self.sessions.clone();
        let (mut file, mut scan) = scan_segment(f, last, payload, &mut self.sessions)?;
        if scan.torn && !last {
            // A damaged closed segment becomes the active one: its payloads were not
            // checked (a closed segment was synced whole), but records will be
            // appended after them, and the next start checks them as the last
            // segment's; a bad one found then would cut the records appended since.
            self.sessions = sessions_before;
            (file, scan) = scan_segment(f, true, payload, &mut self.sessions)?;
        }
        Ok((file, scan))
    }

    /// The log's segments as this store keeps them are one run of records: each
    /// segment's records end where the next segment begins, and the last one ends at
    /// `next_seq`/`next_position`. Walks the segments: for a start (where the run was
    /// just cut from the files found), not for every append.
    fn assert_contiguous(&self) {
        let segments = self
            .closed
            .iter()
            .chain(self.active.as_ref().map(|(s, _)| s));
        let mut end: Option<(u64, u64)> = None;
        for seg in segments {
            assert!(
                end.is_none_or(|e| e == (seg.file.first_seq, seg.file.first_position))
                    && seg.file.first_seq <= seg.end_seq
                    && seg.file.first_position <= seg.end_position,
                "{}: segment {:?} does not continue the log ending at {end:?}",
                self.dir.display(),
                seg.file.path
            );
            end = Some((seg.end_seq, seg.end_position));
        }
        assert!(
            end.is_none_or(|e| e == (self.next_seq, self.next_position)),
            "{}: the segments end at {end:?}, the log at ({}, {})",
            self.dir.display(),
            self.next_seq,
            self.next_position
        );
    }

    /// Makes an empty log start at `seq` / `position` instead of 0 (a replica that joins
    /// a log whose beginning is gone).
    pub fn start_at(&mut self, seq: u64, position: u64) -> io::Result<()> {
        assert!(self.is_empty(), "start_at on a log that has records");
        self.remove_all()?;
        self.next_seq = seq;
        self.next_position = position;
        self.synced = Mark {
            seq,
            position,
            len: 0,
        };
        // An empty segment records where the log starts, even across a crash.
        self.create_active()?;
        self.dir_handle.sync_all()?;
        self.dir_dirty = false;
        Ok(())
    }

    /// Deletes every segment (the log becomes empty at its current end).
    pub fn remove_all(&mut self) -> io::Result<()> {
        self.active = None;
        self.closed.clear();
        remove_from(&self.dir, 0)?;
        self.dir_handle.sync_all()
    }

    /// Every write fails with ENOSPC while this file exists (fault injection).
    pub fn set_fault_flag(&mut self, flag: Option<PathBuf>) {
        self.fault_flag = flag;
    }

    /// Every sync waits [`SLOW_DISK_DELAY`] first while this file exists (fault injection).
    pub fn set_slow_disk_flag(&mut self, flag: Option<PathBuf>) {
        self.slow_disk_flag = flag;
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn is_empty(&self) -> bool {
        self.closed.is_empty() && self.active.as_ref().is_none_or(|(s, _)| s.len == 0)
    }

    /// GOI index of the next record to append.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    pub fn next_position(&self) -> u64 {
        self.next_position
    }

    /// Records below this index are on stable storage.
    pub fn durable_seq(&self) -> u64 {
        self.synced.seq
    }

    /// The oldest record still kept.
    pub fn first_seq(&self) -> u64 {
        self.closed
            .first()
            .or(self.active.as_ref().map(|(s, _)| s))
            .map_or(self.next_seq, |s| s.file.first_seq)
    }

    pub fn first_position(&self) -> u64 {
        self.closed
            .first()
            .or(self.active.as_ref().map(|(s, _)| s))
            .map_or(self.next_position, |s| s.file.first_position)
    }

    /// Bytes of records kept.
    pub fn bytes(&self) -> u64 {
        self.closed.iter().map(|s| s.len).sum::<u64>()
            + self.active.as_ref().map_or(0, |(s, _)| s.len)
    }

    /// Order-5 sessions as of the records found when the store was opened.
    pub fn sessions(&self) -> &BTreeMap<u64, SessionMark> {
        &self.sessions
    }

    /// Appends one record. It is durable only after the next successful [`Self::sync`].
    pub fn append(&mut self, h: &RecordHeader, payload: &[u8]) -> io::Result<()> {
        assert_eq!(h.seq, self.next_seq, "records are appended in GOI order");
        assert_eq!(
            h.total_order, self.next_position,
            "positions are contiguous"
        );
        assert_eq!(h.payload_len as usize, payload.len());
        if let Some(flag) = &self.fault_flag {
            if flag.exists() {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        if self
            .active
            .as_ref()
            .is_some_and(|(s, _)| s.len >= self.segment_target && s.len == self.synced.len)
        {
            // Full and entirely durable (as found at open): close it.
            let (seg, _) = self.active.take().expect("checked");
            self.closed.push(seg);
            self.synced.len = 0;
        }
        if self.active.is_none() {
            self.create_active()?;
        }
        let (seg, file) = self.active.as_mut().expect("opened above");
        // The segment written to ends where the log does (a write at `seg.len` of a
        // segment that ended elsewhere would put the record at the wrong place).
        assert!(
            seg.end_seq == self.next_seq && seg.end_position == self.next_position,
            "the active segment ends at ({}, {}), the log at ({}, {})",
            seg.end_seq,
            seg.end_position,
            self.next_seq,
            self.next_position
        );
        file.write_all_at(&h.encode(), seg.len)?;
        file.write_all_at(payload, seg.len + RECORD_HEADER_LEN as u64)?;
        seg.len += h.record_len();
        seg.end_seq = h.seq + 1;
        seg.end_position = h.end_position();
        self.next_seq = h.seq + 1;
        self.next_position = h.end_position();
        Ok(())
    }

    /// Starts a new, empty active segment at the current end of the log.
    fn create_active(&mut self) -> io::Result<()> {
        assert!(self.active.is_none(), "a log has one active segment");
        // Its name says where it starts: where the newest closed one ends.
        assert!(
            self.closed
                .last()
                .is_none_or(|s| (s.end_seq, s.end_position) == (self.next_seq, self.next_position)),
            "a new segment at ({}, {}) does not continue the closed ones",
            self.next_seq,
            self.next_position
        );
        let file = SegmentFile {
            first_seq: self.next_seq,
            first_position: self.next_position,
            path: self
                .dir
                .join(segment_name(self.next_seq, self.next_position)),
        };
        let handle = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&file.path)?;
        self.dir_dirty = true;
        self.active = Some((
            Segment {
                file,
                len: 0,
                end_seq: self.next_seq,
                end_position: self.next_position,
                last_write: SystemTime::now(),
            },
            Arc::new(handle),
        ));
        Ok(())
    }

    /// The active segment has reached its size and holds unsynced records: the worker
    /// stops appending to it until a sync has covered all of it (which closes it).
    pub fn is_full(&self) -> bool {
        self.active
            .as_ref()
            .is_some_and(|(s, _)| s.len >= self.segment_target && s.len > self.synced.len)
    }

    /// Makes everything appended so far durable (`fdatasync`, and the directory when a
    /// segment was created), then closes the active segment if it is full.
    pub fn sync(&mut self) -> io::Result<()> {
        let pending = self.begin_sync();
        let result = pending.run();
        self.finish_sync(pending, result)
    }

    /// Starts a sync of everything appended so far. [`PendingSync::run`] may then run
    /// on another thread while appends go on; hand its result to
    /// [`Self::finish_sync`] before beginning the next one.
    pub fn begin_sync(&mut self) -> PendingSync {
        assert!(
            !std::mem::replace(&mut self.sync_in_flight, true),
            "{}: a sync begun while another is in flight",
            self.dir.display()
        );
        let dir = std::mem::take(&mut self.dir_dirty).then(|| self.dir_handle.clone());
        PendingSync {
            file: self.active.as_ref().map(|(_, f)| f.clone()),
            dir,
            fault_flag: self.fault_flag.clone(),
            slow_disk_flag: self.slow_disk_flag.clone(),
            mark: Mark {
                seq: self.next_seq,
                position: self.next_position,
                len: self.active.as_ref().map_or(0, |(s, _)| s.len),
            },
        }
    }

    /// A sync begun with [`Self::begin_sync`] was lost without an outcome (its thread
    /// died): nothing it covered counts as durable, and the directory is synced again.
    pub fn sync_lost(&mut self) {
        assert!(
            std::mem::take(&mut self.sync_in_flight),
            "a sync lost that was not begun"
        );
        self.dir_dirty = true;
    }

    /// Applies the outcome of a sync from [`Self::begin_sync`]: on success everything
    /// it covered is durable, and a full active segment it covered entirely is closed.
    pub fn finish_sync(&mut self, pending: PendingSync, result: io::Result<()>) -> io::Result<()> {
        assert!(
            std::mem::take(&mut self.sync_in_flight),
            "{}: a sync finished that was not begun",
            self.dir.display()
        );
        if let Err(e) = result {
            self.dir_dirty |= pending.dir.is_some();
            return Err(e);
        }
        assert!(
            pending.mark.seq >= self.synced.seq && pending.mark.seq <= self.next_seq,
            "syncs finish in order and cover only appended records"
        );
        self.synced = pending.mark;
        let Some((seg, _)) = self.active.as_mut() else {
            return Ok(());
        };
        seg.last_write = SystemTime::now();
        if seg.len == pending.mark.len && seg.len >= self.segment_target {
            let (seg, _) = self.active.take().expect("checked");
            self.closed.push(seg);
            self.synced.len = 0;
        }
        Ok(())
    }

    /// After a failed write or sync: forget everything since the last successful sync
    /// (after a failed fsync the page cache cannot be trusted), so it is written again.
    pub fn rewind(&mut self) -> io::Result<()> {
        assert!(
            self.synced.seq <= self.next_seq && self.synced.position <= self.next_position,
            "nothing beyond the appended records is durable"
        );
        self.next_seq = self.synced.seq;
        self.next_position = self.synced.position;
        let Some((seg, file)) = self.active.as_mut() else {
            return Ok(());
        };
        // The last sync lies within the active segment: cutting it there only shortens
        // it (a longer length would make a hole of zeros in the log).
        assert!(
            self.synced.len <= seg.len
                && seg.file.first_seq <= self.synced.seq
                && seg.file.first_position <= self.synced.position,
            "the durable mark {:?} lies outside the active segment {:?} of {} bytes",
            self.synced,
            seg.file,
            seg.len
        );
        seg.len = self.synced.len;
        seg.end_seq = self.synced.seq;
        seg.end_position = self.synced.position;
        file.set_len(self.synced.len)
    }

    /// Takes out of the log the oldest closed segments while it is larger than
    /// `max_bytes` or their newest record is older than `max_age` (0 and `None`: no
    /// limit). The active segment (or, if none, the newest closed one) always stays.
    /// Their files stay on disk until [`ExpiredSegments::remove`], which the replica
    /// worker leaves to another thread. A file that is never removed (a crash, an error)
    /// is taken out again by the next start's retention.
    pub fn take_expired(&mut self, max_bytes: u64, max_age: Option<Duration>) -> ExpiredSegments {
        let mut total = self.bytes();
        let now = SystemTime::now();
        let mut expired = ExpiredSegments {
            dir: self.dir_handle.clone(),
            dir_path: self.dir.clone(),
            paths: Vec::new(),
        };
        // The newest segment always stays: its name says where the log continues.
        let keep = usize::from(self.active.is_none());
        while self.closed.len() > keep {
            let oldest = &self.closed[0];
            let too_big = max_bytes > 0 && total > max_bytes;
            let too_old = max_age
                .is_some_and(|age| now.duration_since(oldest.last_write).unwrap_or_default() > age);
            if !too_big && !too_old {
                break;
            }
            total -= oldest.len;
            expired.paths.push(self.closed.remove(0).file.path);
        }
        debug_assert_eq!(total, self.bytes(), "the bytes kept are counted as they go");
        expired
    }

    /// [`Self::take_expired`] and their removal at once. Returns how many segments were
    /// removed.
    pub fn apply_retention(
        &mut self,
        max_bytes: u64,
        max_age: Option<Duration>,
    ) -> io::Result<usize> {
        let mut expired = self.take_expired(max_bytes, max_age);
        let n = expired.len();
        expired.remove()?;
        Ok(n)
    }
}

/// Segment files retention has taken out of a log and not yet deleted, oldest first.
#[must_use = "the files stay on disk until removed"]
pub struct ExpiredSegments {
    dir: Arc<File>,
    dir_path: PathBuf,
    paths: Vec<PathBuf>,
}

impl ExpiredSegments {
    pub fn len(&self) -> usize {
        self.paths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// The log's directory: which log these segments were taken from.
    pub fn dir(&self) -> &Path {
        &self.dir_path
    }

    /// Appends the segments of `later`, taken from the same log after these.
    pub fn extend(&mut self, later: ExpiredSegments) {
        debug_assert_eq!(self.dir_path, later.dir_path, "segments of one log");
        self.paths.extend(later.paths);
    }

    /// Deletes the files in steps: each is renamed out of the log's names (`.del`, which
    /// no reader or start takes for a segment), the renames are made durable, and then
    /// each file is shortened 4 MiB at a time with a 1 ms pause before it is unlinked.
    /// Unlinking a 64 MiB segment at once took 31-37 ms on ext4 here, and every
    /// `fdatasync` of the replica waited behind it: acknowledgements at level 2 had a
    /// p99 of 28-38 ms with retention deleting (50-63 ms while the deletion ran on the
    /// replica worker itself) against 3.8-4.6 ms deleting in steps
    /// (`docs/PERFORMANCE.md`, session 7). A reader inside a file being shortened gets
    /// `NotFound`, as for a deleted one; a start removes any `.del` file an interrupted
    /// deletion left.
    ///
    /// Segments are renamed oldest first, and on an error those not renamed stay here,
    /// to be tried again before any newer segment of the log: renaming a newer one while
    /// an older one keeps its name would leave a hole in the log on disk, and a start
    /// would set everything after the hole aside.
    pub fn remove(&mut self) -> io::Result<()> {
        self.remove_in_steps(DELETE_STEP_BYTES)
    }

    pub(crate) fn remove_in_steps(&mut self, step: u64) -> io::Result<()> {
        let mut renamed = Vec::with_capacity(self.paths.len());
        let mut failed = None;
        for path in &self.paths {
            let doomed = path.with_extension(DELETING_EXTENSION);
            if let Err(e) = std::fs::rename(path, &doomed) {
                failed = Some(e);
                break;
            }
            renamed.push(doomed);
        }
        self.paths.drain(..renamed.len());
        if !renamed.is_empty() {
            self.dir.sync_all()?;
            for path in &renamed {
                delete_in_steps(path, step)?;
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Extension of a segment file while it is being deleted.
const DELETING_EXTENSION: &str = "del";
/// How much a deletion step frees, and the pause after it (see [`ExpiredSegments::remove`]).
const DELETE_STEP_BYTES: u64 = 4 << 20;
const DELETE_STEP_PAUSE: Duration = Duration::from_millis(1);

/// Shortens the file to nothing `step` bytes at a time, then unlinks it.
fn delete_in_steps(path: &Path, step: u64) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    let mut len = file.metadata()?.len();
    while len > 0 {
        len = len.saturating_sub(step);
        file.set_len(len)?;
        std::thread::sleep(DELETE_STEP_PAUSE);
    }
    std::fs::remove_file(path)
}

/// Cuts the torn or damaged tail off `files[i]` (opened as `file`, scanned as `scan`)
/// at open: durably, and after setting aside the segments that follow it when it is
/// not the `last` one.
fn cut_torn_tail(
    dir: &Path,
    files: &[SegmentFile],
    i: usize,
    file: &File,
    scan: &SegmentScan,
    last: bool,
) -> io::Result<()> {
    let f = &files[i];
    tracing::warn!(
        path = %f.path.display(),
        valid_bytes = scan.valid_len,
        file_bytes = scan.file_len,
        "cutting a torn or corrupt tail off a replica segment"
    );
    // Only the last segment may hold unsynced records (a crash's torn tail);
    // a closed one was synced whole, so what follows the damage is kept aside.
    if !last {
        set_aside(dir, &files[i + 1..], Some(f), scan.end_seq)?;
    }
    file.set_len(scan.valid_len)?;
    file.sync_all()?;
    Ok(())
}

/// What a start found in one segment file.
struct SegmentScan {
    /// Bytes up to the end of its last whole, consecutive record.
    valid_len: u64,
    file_len: u64,
    end_seq: u64,
    end_position: u64,
    /// Something other than whole consecutive records follows `valid_len`.
    torn: bool,
}

/// Checks every record header of a segment, and the payloads too in the `last` one
/// (the only one written since its last sync), folding order-5 sessions as it goes.
/// Returns the file opened for writing, so a torn tail can be cut.
fn scan_segment(
    f: &SegmentFile,
    last: bool,
    payload: &mut Vec<u8>,
    sessions: &mut BTreeMap<u64, SessionMark>,
) -> io::Result<(File, SegmentScan)> {
    let file = OpenOptions::new().read(true).write(true).open(&f.path)?;
    let file_len = file.metadata()?.len();
    let (mut next_seq, mut next_position, mut off) = (f.first_seq, f.first_position, 0u64);
    let torn = loop {
        let h = match read_header_at(&file, off)? {
            None => break off < file_len,
            Some(Err(_)) => break true,
            Some(Ok(h)) => h,
        };
        if h.seq != next_seq
            || h.total_order != next_position
            || off + h.record_len() > file_len
            // Positions and indices past 2^64 are damage, never a log.
            || h.seq == u64::MAX
            || h.total_order.checked_add(h.num_msg as u64).is_none()
        {
            break true;
        }
        if last {
            payload.resize(h.payload_len as usize, 0);
            file.read_exact_at(payload, off + RECORD_HEADER_LEN as u64)?;
            if h.check_payload(payload).is_err() {
                break true;
            }
        }
        fold_session(
            sessions,
            h.client_id,
            h.session_epoch,
            h.client_seq,
            h.seq,
            h.flags,
            0,
        );
        next_seq += 1;
        next_position = h.end_position();
        off += h.record_len();
    };
    // Cutting at `off` only shortens the file; a segment read to its end is whole.
    assert!(
        off <= file_len && (torn || off == file_len),
        "{}: scanned {off} bytes of {file_len}, torn: {torn}",
        f.path.display()
    );
    let scan = SegmentScan {
        valid_len: off,
        file_len,
        end_seq: next_seq,
        end_position: next_position,
        torn,
    };
    Ok((file, scan))
}

/// Bytes in the aside directories of every topic log under `replica_dir`: what starts
/// set aside and nobody has looked at yet (exported as a metric, so an operator sees it
/// after the one error line). Unreadable entries count as nothing.
pub fn set_aside_bytes(replica_dir: &Path) -> u64 {
    let files_in = |dir: PathBuf| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(|entry| entry.ok()?.metadata().ok())
            .filter(|meta| meta.is_file())
            .map(|meta| meta.len())
            .sum::<u64>()
    };
    std::fs::read_dir(replica_dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok())
        .map(|topic_log| files_in(topic_log.path().join(SET_ASIDE_DIR)))
        .sum()
}

/// Moves segment files that no longer continue the log into `dir/SET_ASIDE_DIR`, with a
/// copy of `damaged` (a closed segment about to be cut at a damaged record) first: a
/// start deletes nothing but a crash's torn tail. The log keeps its oldest contiguous
/// run, up to `log_end`; recovery then refills what it lacks from the other replicas
/// (`crate::recovery`). Both directories are fsynced before the log is used.
fn set_aside(
    dir: &Path,
    moved: &[SegmentFile],
    damaged: Option<&SegmentFile>,
    log_end: u64,
) -> io::Result<()> {
    let aside = dir.join(SET_ASIDE_DIR);
    std::fs::create_dir_all(&aside)?;
    // The new directory's entry, before anything is put in it.
    File::open(dir)?.sync_all()?;
    let stamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let fresh = |f: &SegmentFile| {
        unused_aside_path(&aside, stamp, &segment_name(f.first_seq, f.first_position))
    };
    if let Some(f) = damaged {
        // Copied under a temporary name and made durable before anything is renamed or
        // cut: a crash never leaves a partial copy under a whole one's name, nor a cut
        // segment without its copy.
        let to = fresh(f);
        let partial = to.with_extension("partial");
        std::fs::copy(&f.path, &partial)?;
        File::open(&partial)?.sync_all()?;
        std::fs::rename(&partial, &to)?;
        File::open(&aside)?.sync_all()?;
    }
    for f in moved {
        std::fs::rename(&f.path, fresh(f))?;
    }
    File::open(&aside)?.sync_all()?;
    File::open(dir)?.sync_all()?;
    let kept = match damaged {
        Some(_) => format!(
            "a copy of the damaged segment and the {} segment file(s) after it",
            moved.len()
        ),
        None => format!("the {} segment file(s) after the gap", moved.len()),
    };
    tracing::error!(
        log = %dir.display(),
        continues_at_seq = log_end,
        damaged = ?damaged.map(|f| &f.path),
        first_moved = ?moved.first().map(|f| &f.path),
        aside = %aside.display(),
        "the replica log on disk had a gap or a damaged record, so it now continues at seq \
         {log_end}; {kept} are in the aside directory, not deleted. Recovery refills the log \
         from the other replicas where they have it. Inspect the files aside, then delete \
         them or restore them by hand"
    );
    Ok(())
}

/// `aside/<stamp>-<name>`, or with a counter after the stamp if an earlier start (in
/// the same millisecond, or before the clock was set back) took that name: a rename
/// would replace that file silently.
fn unused_aside_path(aside: &Path, stamp: u128, name: &str) -> PathBuf {
    (0u32..)
        .map(|n| match n {
            0 => aside.join(format!("{stamp}-{name}")),
            n => aside.join(format!("{stamp}.{n}-{name}")),
        })
        .find(|p| !p.exists())
        .expect("some counter is free")
}

/// Deletes what interrupted deletions left in `dir`.
fn remove_leftover_deletions(dir: &Path) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == DELETING_EXTENSION) {
            match std::fs::remove_file(&path) {
                // Finished meanwhile by a retention thread still running.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                other => other?,
            }
        }
    }
    Ok(())
}

/// Removes every segment file whose first record is at or after `from_seq`.
fn remove_from(dir: &Path, from_seq: u64) -> io::Result<()> {
    for f in list_segments(dir)? {
        if f.first_seq >= from_seq {
            std::fs::remove_file(&f.path)?;
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn record(seq: u64, position: u64, payload: &[u8]) -> RecordHeader {
        RecordHeader {
            seq,
            total_order: position,
            num_msg: 2,
            payload_len: payload.len() as u32,
            payload_crc: crc32fast::hash(payload),
            client_id: 5,
            client_seq: seq,
            session_epoch: 1,
            ..Default::default()
        }
    }

    fn fill(store: &mut TopicStore, n: u64) {
        for _ in 0..n {
            let payload = vec![store.next_seq() as u8; 100];
            let h = record(store.next_seq(), store.next_position(), &payload);
            store.append(&h, &payload).unwrap();
        }
    }

    #[test]
    fn a_sync_waits_while_the_slow_disk_flag_exists_and_still_makes_records_durable() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("slow");
        let mut s = TopicStore::open(&dir.path().join("log"), 500).unwrap();
        s.set_slow_disk_flag(Some(flag.clone()));
        std::fs::write(&flag, b"").unwrap();
        fill(&mut s, 2);
        let started = std::time::Instant::now();
        s.sync().unwrap();
        assert!(
            started.elapsed() >= SLOW_DISK_DELAY,
            "the flag slows the sync"
        );
        assert_eq!(s.durable_seq(), 2);
        std::fs::remove_file(&flag).unwrap();
        fill(&mut s, 1);
        s.sync().unwrap();
        assert_eq!(s.durable_seq(), 3);
    }

    #[test]
    fn reopening_finds_every_synced_record_and_rolls_segments() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TopicStore::open(dir.path(), 500).unwrap();
        fill(&mut s, 3);
        s.sync().unwrap();
        fill(&mut s, 3);
        s.sync().unwrap();
        assert_eq!(s.durable_seq(), 6);
        assert_eq!(
            list_segments(dir.path()).unwrap().len(),
            2,
            "rolled once past 500 B"
        );
        drop(s);
        let s = TopicStore::open(dir.path(), 500).unwrap();
        assert_eq!((s.next_seq(), s.next_position()), (6, 12));
        assert_eq!(
            s.sessions()[&5],
            SessionMark {
                epoch: 1,
                hwm: 6,
                last_seq: 5,
                key_hash: 0,
            }
        );
    }

    /// A client id's session ended and the id came back: the new session's marks are
    /// its own, not the old one's (which are higher, and would make its new batches
    /// look like duplicates).
    #[test]
    fn a_session_start_folds_into_fresh_marks() {
        let mut sessions = BTreeMap::new();
        for (g, seq) in (0..5).enumerate() {
            fold_session(&mut sessions, 5, 3, seq, g as u64, 0, 0);
        }
        fold_session(&mut sessions, 9, 1, 0, 5, 0, 0);
        assert_eq!(sessions[&5].hwm, 5);
        let start = embarcadero_region::GOI_SESSION_START;
        fold_session(&mut sessions, 5, 1, 0, 6, start, 0xbeef);
        fold_session(&mut sessions, 5, 1, 1, 7, 0, 0xbeef);
        let expected = SessionMark {
            epoch: 1,
            hwm: 2,
            last_seq: 7,
            key_hash: 0xbeef,
        };
        assert_eq!(sessions[&5], expected);
        assert_eq!(sessions[&9].hwm, 1, "other sessions untouched");
    }

    #[test]
    fn a_sync_covers_what_was_appended_before_it_began() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TopicStore::open(dir.path(), 500).unwrap();
        fill(&mut s, 2);
        let pending = s.begin_sync();
        assert_eq!(pending.seq(), 2);
        // Appends go on while the sync runs (here: before it runs at all), past the
        // segment's size: the segment is full but may not close yet.
        fill(&mut s, 2);
        assert!(s.is_full());
        let result = std::thread::scope(|scope| scope.spawn(|| pending.run()).join().unwrap());
        s.finish_sync(pending, result).unwrap();
        assert_eq!(s.durable_seq(), 2, "only what preceded the sync");
        assert!(s.is_full(), "records 2 and 3 are not durable yet");
        assert_eq!(list_segments(dir.path()).unwrap().len(), 1);
        s.sync().unwrap();
        assert_eq!(s.durable_seq(), 4);
        assert!(!s.is_full(), "the covering sync closed the segment");
        fill(&mut s, 1);
        assert_eq!(list_segments(dir.path()).unwrap().len(), 2);
    }

    #[test]
    fn a_failed_sync_is_retried_with_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("full");
        let mut s = TopicStore::open(&dir.path().join("log"), 1 << 20).unwrap();
        s.set_fault_flag(Some(flag.clone()));
        fill(&mut s, 1);
        std::fs::write(&flag, b"").unwrap();
        let pending = s.begin_sync();
        let result = pending.run();
        assert!(s.finish_sync(pending, result).is_err());
        assert_eq!(s.durable_seq(), 0);
        std::fs::remove_file(&flag).unwrap();
        let pending = s.begin_sync();
        assert!(
            pending.dir.is_some(),
            "the new segment's directory entry is still due"
        );
        let result = pending.run();
        s.finish_sync(pending, result).unwrap();
        assert_eq!(s.durable_seq(), 1);
    }

    #[test]
    fn a_torn_tail_is_cut_at_the_last_whole_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        fill(&mut s, 4);
        s.sync().unwrap();
        drop(s);
        let seg = &list_segments(dir.path()).unwrap()[0].path;
        let len = std::fs::metadata(seg).unwrap().len();
        let f = OpenOptions::new().write(true).open(seg).unwrap();
        // A crash in the middle of the fourth record's payload...
        f.set_len(len - 10).unwrap();
        let s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(s.next_seq(), 3);
        // ...and a payload the disk never wrote (zeros where the bytes should be).
        drop(s);
        let record_len = 180;
        f.write_all_at(&[0u8; 20], 2 * record_len + 100).unwrap();
        let s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(s.next_seq(), 2);
        assert_eq!(std::fs::metadata(seg).unwrap().len(), 2 * record_len);
    }

    /// Four segments of two records each (seqs 0-7).
    fn four_segments(dir: &Path) -> Vec<SegmentFile> {
        let mut s = TopicStore::open(dir, 300).unwrap();
        for _ in 0..4 {
            fill(&mut s, 2);
            s.sync().unwrap();
        }
        drop(s);
        let segments = list_segments(dir).unwrap();
        let firsts: Vec<u64> = segments.iter().map(|f| f.first_seq).collect();
        assert_eq!(firsts, vec![0, 2, 4, 6]);
        segments
    }

    /// The names the segment files have in the log directory.
    pub(crate) fn segment_names(files: &[SegmentFile]) -> Vec<String> {
        files
            .iter()
            .map(|f| segment_name(f.first_seq, f.first_position))
            .collect()
    }

    /// The files a start set aside, oldest first, each with the segment name it had.
    pub(crate) fn files_set_aside(dir: &Path) -> Vec<(String, PathBuf)> {
        let mut found: Vec<(String, PathBuf)> = std::fs::read_dir(dir.join(SET_ASIDE_DIR))
            .unwrap()
            .map(|e| {
                let path = e.unwrap().path();
                let name = path.file_name().unwrap().to_str().unwrap();
                // The move's time stamp, then the segment's own name.
                (name.split_once('-').unwrap().1.to_string(), path)
            })
            .collect();
        found.sort();
        found
    }

    #[test]
    fn a_hole_sets_the_segments_after_it_aside_whole() {
        let dir = tempfile::tempdir().unwrap();
        let segments = four_segments(dir.path());
        let after: Vec<Vec<u8>> = segments[2..]
            .iter()
            .map(|f| std::fs::read(&f.path).unwrap())
            .collect();
        std::fs::remove_file(&segments[1].path).unwrap();
        let mut s = TopicStore::open(dir.path(), 300).unwrap();
        assert_eq!(
            (s.first_seq(), s.next_seq()),
            (0, 2),
            "the log ends at the hole"
        );
        let aside = files_set_aside(dir.path());
        let names: Vec<String> = aside.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, segment_names(&segments[2..]));
        for ((_, path), bytes) in aside.iter().zip(&after) {
            assert_eq!(&std::fs::read(path).unwrap(), bytes, "moved, not deleted");
        }
        // The log goes on from its end, and a second start finds it whole.
        fill(&mut s, 1);
        s.sync().unwrap();
        drop(s);
        let s = TopicStore::open(dir.path(), 300).unwrap();
        assert_eq!((s.first_seq(), s.next_seq()), (0, 3));
        assert_eq!(files_set_aside(dir.path()).len(), 2);
    }

    #[test]
    fn set_aside_bytes_counts_every_topic_logs_aside_files() {
        let replica = tempfile::tempdir().unwrap();
        assert_eq!(set_aside_bytes(replica.path()), 0);
        let mut expected = 0;
        for topic in ["a.1", "b.2"] {
            let dir = replica.path().join(topic);
            let segments = four_segments(&dir);
            expected += std::fs::metadata(&segments[3].path).unwrap().len();
            std::fs::remove_file(&segments[2].path).unwrap();
            drop(TopicStore::open(&dir, 300).unwrap());
        }
        assert_eq!(set_aside_bytes(replica.path()), expected);
        assert_eq!(set_aside_bytes(&replica.path().join("absent")), 0);
    }

    #[test]
    fn a_damaged_closed_segment_is_cut_with_a_copy_and_the_rest_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let segments = four_segments(dir.path());
        // Bit rot in the second record header of the second segment.
        let f = OpenOptions::new()
            .write(true)
            .open(&segments[1].path)
            .unwrap();
        f.write_all_at(&[0xff; 8], 180).unwrap();
        let damaged = std::fs::read(&segments[1].path).unwrap();
        let s = TopicStore::open(dir.path(), 300).unwrap();
        assert_eq!((s.first_seq(), s.next_seq()), (0, 3));
        assert_eq!(std::fs::metadata(&segments[1].path).unwrap().len(), 180);
        let aside = files_set_aside(dir.path());
        let names: Vec<String> = aside.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, segment_names(&segments[1..]));
        assert_eq!(
            std::fs::read(&aside[0].1).unwrap(),
            damaged,
            "the damaged segment is kept whole"
        );
        assert!(
            !aside.iter().any(|(n, _)| n.ends_with(".partial")),
            "no copy is left half-named"
        );
    }

    /// Found by fuzzing (`fuzz/`, target `replication_segment`): a closed segment with a
    /// damaged header became the active segment with its payloads unchecked; a bad
    /// payload before the damage then cut, at the next start, records appended and
    /// synced after this one (durable records deleted, with no copy kept).
    #[test]
    fn a_damaged_closed_segment_has_its_payloads_checked_before_appends_follow() {
        let dir = tempfile::tempdir().unwrap();
        let segments = four_segments(dir.path());
        let f = OpenOptions::new()
            .write(true)
            .open(&segments[1].path)
            .unwrap();
        // Bit rot in the first record's payload and the second record's header.
        f.write_all_at(&[0xff; 8], 100).unwrap();
        f.write_all_at(&[0xff; 8], 180).unwrap();
        let mut s = TopicStore::open(dir.path(), 300).unwrap();
        assert_eq!(s.next_seq(), 2, "the bad payload is found now");
        fill(&mut s, 1);
        s.sync().unwrap();
        drop(s);
        let s = TopicStore::open(dir.path(), 300).unwrap();
        assert_eq!(s.next_seq(), 3, "the synced record survives the next start");
    }

    /// Found by fuzzing: a record (whole, checksums right) whose session sequence is
    /// u64::MAX overflowed the session's high-water mark at open.
    #[test]
    fn a_session_sequence_of_u64_max_does_not_overflow_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        let payload = [1u8; 10];
        let h = RecordHeader {
            client_seq: u64::MAX,
            ..record(0, 0, &payload)
        };
        s.append(&h, &payload).unwrap();
        s.sync().unwrap();
        drop(s);
        let s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(s.next_seq(), 1);
        assert_eq!(s.sessions()[&5].hwm, u64::MAX);
    }

    /// Found by fuzzing: a segment named near the end of the position space, with a
    /// record whose messages run past 2^64, overflowed at open; it is damage, cut off.
    #[test]
    fn positions_past_2_pow_64_are_damage_not_a_log() {
        let dir = tempfile::tempdir().unwrap();
        let payload = [1u8; 10];
        let mut h = record(7, u64::MAX - 1, &payload);
        let mut bytes = h.encode().to_vec();
        bytes.extend_from_slice(&payload);
        std::fs::write(dir.path().join(segment_name(7, u64::MAX - 1)), &bytes).unwrap();
        let s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        assert_eq!((s.next_seq(), s.next_position()), (7, u64::MAX - 1));
        drop(s);
        h = record(u64::MAX, 0, &payload);
        let mut bytes = h.encode().to_vec();
        bytes.extend_from_slice(&payload);
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join(segment_name(u64::MAX, 0)), &bytes).unwrap();
        let s = TopicStore::open(other.path(), 1 << 20).unwrap();
        assert_eq!(s.next_seq(), u64::MAX);
    }

    #[test]
    fn set_aside_names_never_replace_an_earlier_file() {
        let dir = tempfile::tempdir().unwrap();
        let name = segment_name(6, 600);
        let first = unused_aside_path(dir.path(), 42, &name);
        std::fs::write(&first, b"earlier").unwrap();
        let second = unused_aside_path(dir.path(), 42, &name);
        assert_ne!(first, second);
        std::fs::write(&second, b"later").unwrap();
        let third = unused_aside_path(dir.path(), 42, &name);
        assert!(![&first, &second].contains(&&third));
        // The segment's own name stays last, after the first '-'.
        for p in [first, second, third] {
            let file = p.file_name().unwrap().to_str().unwrap().to_string();
            assert_eq!(file.split_once('-').unwrap().1, name);
        }
    }

    #[test]
    fn rewind_forgets_unsynced_records_and_writes_them_again() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("full");
        let mut s = TopicStore::open(&dir.path().join("log"), 1 << 20).unwrap();
        s.set_fault_flag(Some(flag.clone()));
        fill(&mut s, 2);
        s.sync().unwrap();
        fill(&mut s, 2);
        std::fs::write(&flag, b"").unwrap();
        assert_eq!(s.sync().unwrap_err().raw_os_error(), Some(libc::ENOSPC));
        s.rewind().unwrap();
        assert_eq!(s.next_seq(), 2);
        std::fs::remove_file(&flag).unwrap();
        fill(&mut s, 2);
        s.sync().unwrap();
        drop(s);
        let s = TopicStore::open(&dir.path().join("log"), 1 << 20).unwrap();
        assert_eq!(s.next_seq(), 4);
    }

    #[test]
    fn an_interrupted_deletion_is_finished_by_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TopicStore::open(dir.path(), 300).unwrap();
        for _ in 0..3 {
            fill(&mut s, 2);
            s.sync().unwrap();
        }
        let expired = s.take_expired(0, Some(Duration::ZERO));
        assert_eq!(expired.len(), 2);
        assert_eq!(s.first_seq(), 4, "taken out of the log at once");
        // A crash after the first rename: one segment is half-way to deletion.
        let first = &expired.paths[0];
        std::fs::rename(first, first.with_extension(DELETING_EXTENSION)).unwrap();
        drop((expired, s));
        let s = TopicStore::open(dir.path(), 300).unwrap();
        assert_eq!(
            s.first_seq(),
            2,
            "the segment not yet renamed is still the log's"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(
            names.iter().all(|n| n.ends_with(SEGMENT_SUFFIX)),
            "no .del file outlives a start: {names:?}"
        );
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn retention_removes_whole_old_segments_by_size_and_age() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TopicStore::open(dir.path(), 300).unwrap();
        for _ in 0..5 {
            fill(&mut s, 2);
            s.sync().unwrap();
        }
        assert_eq!(list_segments(dir.path()).unwrap().len(), 5);
        assert_eq!(s.apply_retention(3 * 360, None).unwrap(), 2);
        assert_eq!((s.first_seq(), s.first_position()), (4, 8));
        assert_eq!(
            s.apply_retention(0, Some(Duration::ZERO)).unwrap(),
            2,
            "all closed ones"
        );
        assert_eq!(s.first_seq(), 8, "the active segment stays");
        drop(s);
        let s = TopicStore::open(dir.path(), 300).unwrap();
        assert_eq!((s.first_seq(), s.next_seq()), (8, 10));
    }

    #[test]
    fn an_empty_log_can_start_mid_stream_and_remembers_where() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        s.start_at(40, 900).unwrap();
        fill(&mut s, 1);
        s.sync().unwrap();
        drop(s);
        let s = TopicStore::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(
            (s.first_seq(), s.first_position(), s.next_seq()),
            (40, 900, 41)
        );
    }
}
