//! Allocating the region file's blocks before anything writes to them.
//!
//! The region is a sparse, memory-mapped file. A write to a page its filesystem has no
//! room for kills the process with SIGBUS (`room.rs` says why nothing can catch it), and
//! the start-up check (`room::check_region_room`) only knows the space free at start: a
//! shared tmpfs that others fill later would still kill the server. So every range is
//! allocated (`fallocate`) before the first write to it can happen, where a failure is an
//! ordinary error: the fixed part (header, control block) and every broker's log segments
//! at start, which then refuses to start; a topic's tables when the topic is created (or
//! restored at start), which refuses that creation with HTTP 507 and changes nothing else.
//! Topic slots never used stay sparse, so an idle server still takes little memory.
//!
//! Owns: a second descriptor of the region file, used only for `fallocate`. Touches no
//! byte of the mapping.

use embarcadero_region::{Layout, Region};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The region file's allocator of blocks (see the module comment).
pub(crate) struct Reservation {
    file: File,
    path: PathBuf,
    layout: Layout,
}

/// A range of the region its filesystem could not allocate.
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate {what} ({bytes}) in the region file {path}: {source}; {advice}")]
pub struct ReserveError {
    pub what: String,
    pub bytes: String,
    pub path: PathBuf,
    pub source: std::io::Error,
    pub advice: &'static str,
}

impl ReserveError {
    /// Whether the filesystem was full (as opposed to a fault of the file itself).
    pub fn is_no_room(&self) -> bool {
        self.source.raw_os_error() == Some(libc::ENOSPC)
    }
}

impl Reservation {
    /// Opens the file `region` maps, for allocating its blocks.
    pub(crate) fn open(region: &Region) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(region.path())?;
        Ok(Self {
            file,
            path: region.path().to_path_buf(),
            layout: *region.layout(),
        })
    }

    /// Allocates what every server writes whether or not it has topics: the header and
    /// control block, and every broker's pool of log segments.
    pub(crate) fn fixed(&self) -> Result<(), ReserveError> {
        let l = &self.layout;
        assert!(l.topics_off <= l.segments_off && l.segments_off <= l.total_len);
        self.allocate(0..l.topics_off, "the header and control block")?;
        self.allocate(l.segments_off..l.total_len, "the brokers' log segments")
    }

    /// Allocates topic slot `slot`'s lines and rings, before the topic's metadata makes
    /// it visible to any process that would write there.
    pub(crate) fn topic(&self, slot: u32) -> Result<(), ReserveError> {
        let range = topic_range(&self.layout, slot);
        self.allocate(range, &format!("topic slot {slot}'s tables"))
    }

    fn allocate(&self, range: Range<u64>, what: &str) -> Result<(), ReserveError> {
        assert!(range.start <= range.end && range.end <= self.layout.total_len);
        allocate_blocks(&self.file, range.clone()).map_err(|source| ReserveError {
            what: what.to_string(),
            bytes: crate::room::human_bytes(range.end - range.start),
            path: self.path.clone(),
            source,
            advice: advice(&self.path),
        })
    }
}

/// The bytes of topic slot `slot`: from its start to the next slot's.
fn topic_range(layout: &Layout, slot: u32) -> Range<u64> {
    assert!(slot < layout.caps.max_topics, "slot {slot} out of range");
    let start = layout.topic_off(slot);
    let end = start + layout.topic_stride;
    assert!(
        end <= layout.segments_off,
        "topic slots end before the segments"
    );
    start..end
}

/// `fallocate` mode 0 on `range` of `file`: the blocks are allocated (zeros to readers)
/// and the file's length is unchanged, as the range lies inside it. glibc's
/// `posix_fallocate` writes zeros on filesystems without `fallocate`, which is correct
/// for a region (its new pages are zeros anyway).
fn allocate_blocks(file: &File, range: Range<u64>) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let len = range.end - range.start;
    if len == 0 {
        return Ok(());
    }
    let (Ok(offset), Ok(len)) = (
        libc::off_t::try_from(range.start),
        libc::off_t::try_from(len),
    ) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    // SAFETY: a plain system call on a descriptor this struct owns; it reads no memory
    // of ours. It returns the error number instead of setting errno.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), offset, len) };
    match rc {
        0 => Ok(()),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

/// What to do about a failed allocation, for the file at `path`.
fn advice(path: &Path) -> &'static str {
    if path.starts_with("/dev/shm") {
        "free memory on that tmpfs (or grow it with mount -o remount,size=), delete topics \
         that are no longer needed, or lower the region's sizes (see `serve --help`)"
    } else {
        "free space on that filesystem, delete topics that are no longer needed, or move \
         region.path to a filesystem with more room"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::Capacities;
    use std::os::unix::fs::MetadataExt;

    fn small_region(dir: &Path) -> Region {
        let caps = Capacities {
            max_topics: 4,
            brokers: 2,
            goi_slots: 1024,
            pbr_slots: 256,
            segment_bytes: 1 << 20,
            segments_per_broker: 4,
            seg_map_slots: 8,
        };
        Region::create(&dir.join("region"), caps).unwrap()
    }

    fn allocated(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().blocks() * 512
    }

    #[test]
    fn the_fixed_part_and_a_created_topic_are_allocated_and_other_slots_stay_sparse() {
        let dir = tempfile::tempdir().unwrap();
        let region = small_region(dir.path());
        let r = Reservation::open(&region).unwrap();
        let l = *region.layout();
        let before = allocated(region.path());
        r.fixed().unwrap();
        let fixed = l.topics_off + (l.total_len - l.segments_off);
        let after_fixed = allocated(region.path());
        assert!(
            after_fixed >= before + fixed - 8192,
            "{before} -> {after_fixed}"
        );
        r.topic(2).unwrap();
        let after_topic = allocated(region.path());
        assert!(
            after_topic >= after_fixed + l.topic_stride - 8192,
            "{after_fixed} -> {after_topic}"
        );
        // Three slots were never reserved: the file holds less than the whole region.
        assert!(after_topic + 3 * l.topic_stride <= l.total_len + 3 * 8192);
        assert_eq!(std::fs::metadata(region.path()).unwrap().len(), l.total_len);
    }

    #[test]
    fn a_topic_range_is_its_slot_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let region = small_region(dir.path());
        let l = region.layout();
        let last = topic_range(l, 3);
        assert_eq!(topic_range(l, 0).start, l.topics_off);
        assert_eq!(topic_range(l, 0).end, topic_range(l, 1).start);
        assert!(last.end <= l.segments_off);
    }

    #[test]
    fn a_failed_allocation_names_the_range_the_file_and_what_to_do() {
        let e = ReserveError {
            what: "topic slot 3's tables".into(),
            bytes: "8.4 MiB".into(),
            path: "/dev/shm/embarcadero/region".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            advice: advice(Path::new("/dev/shm/embarcadero/region")),
        };
        assert!(e.is_no_room());
        let text = e.to_string();
        for part in [
            "topic slot 3's tables",
            "8.4 MiB",
            "/dev/shm/embarcadero/region",
            "tmpfs",
        ] {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
    }
}
