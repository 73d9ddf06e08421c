//! Mapping the region file: creating it (and its header), attaching with the header
//! check, the bounds-checked word accessors every other module builds on, and the clocks
//! the region's time stamps use. What the words mean lives in the module of each part.

use crate::coherence::store_fence;
use crate::layout::*;
use crate::word::{MonotonicU64, OwnedWord, ReadWord};
use crate::{Doorbell, RegionError};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The mapped region. Cheap to share behind an `Arc`; all access is through atomics
/// on 8-byte words or through the BLog byte accessors.
pub struct Region {
    pub(crate) ptr: *mut u8,
    pub(crate) len: u64,
    pub(crate) layout: Layout,
    path: PathBuf,
    _file: File,
}

// SAFETY: the mapping is plain shared memory; every access from Rust code goes through
// atomics (metadata) or through BLog ranges whose exclusive ownership the broker
// protocol guarantees. Moving or sharing the handle across threads is therefore fine.
unsafe impl Send for Region {}
// SAFETY: see `Send`.
unsafe impl Sync for Region {}

impl Region {
    /// Creates (or replaces) the region file at `path`, sparse, and initialises its header.
    pub fn create(path: &Path, caps: Capacities) -> Result<Self, RegionError> {
        let layout = Layout::new(caps)?;
        let io = |source| RegionError::Io {
            path: path.to_path_buf(),
            source,
        };
        let _ = std::fs::remove_file(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io)?;
        file.set_len(layout.total_len).map_err(io)?;
        let region = Self::map(path, file, layout)?;
        let w = |off: u64, v: u64| region.word(off).store(v, Ordering::Relaxed);
        w(H_MAGIC, u64::from_le_bytes(REGION_MAGIC));
        w(H_VERSION, LAYOUT_VERSION as u64);
        for (i, v) in caps_words(&caps).iter().enumerate() {
            w(H_CAPS + WORD * i as u64, *v);
        }
        w(H_TOTAL_LEN, layout.total_len);
        w(H_CREATED_NS, now_ns());
        let boot = boot_id();
        w(H_BOOT_ID, boot[0]);
        w(H_BOOT_ID + WORD, boot[1]);
        store_fence();
        region
            .word(H_INIT_DONE)
            .store(INIT_DONE_TOKEN, Ordering::Release);
        region.assert_header_reads_back(&caps);
        Ok(region)
    }

    /// The header just written passes the check every attaching process makes, with
    /// these capacities and this length: the writer's and the readers' view of the
    /// header are one (a field written at the wrong offset fails here, at creation,
    /// rather than as a layout mismatch in another process).
    fn assert_header_reads_back(&self, caps: &Capacities) {
        let mut head = [0u8; ATTACH_HEAD_LEN];
        for (i, chunk) in head.chunks_exact_mut(WORD as usize).enumerate() {
            let word = self.word(WORD * i as u64).load(Ordering::Acquire);
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        let read = Self::check_header(&self.path, &head, self.len, Some(*caps))
            .unwrap_or_else(|e| panic!("a region just created fails its own header check: {e}"));
        assert_eq!(
            read.total_len, self.len,
            "the header states the mapped length"
        );
    }

    /// Attaches to an existing region, checking magic, version and, when given, that
    /// its capacities are the ones this process was configured with.
    pub fn attach(path: &Path, expected: Option<Capacities>) -> Result<Self, RegionError> {
        let io = |source| RegionError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let mut head = [0u8; ATTACH_HEAD_LEN];
        if file_len < head.len() as u64 {
            return Err(RegionError::BadMagic {
                path: path.to_path_buf(),
            });
        }
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0).map_err(io)?;
        let layout = Self::check_header(path, &head, file_len, expected)?;
        Self::map(path, file, layout)
    }

    /// The header check of [`Region::attach`], on the first bytes of a region file of
    /// `file_len` bytes: magic, version, initialisation, the capacities (against
    /// `expected` when given) and the total length. Returns the layout to map. The
    /// bytes are untrusted (any file can be named as the region), so every failure is
    /// an error, never a panic.
    pub fn check_header(
        path: &Path,
        head: &[u8],
        file_len: u64,
        expected: Option<Capacities>,
    ) -> Result<Layout, RegionError> {
        if head.len() < ATTACH_HEAD_LEN || file_len < ATTACH_HEAD_LEN as u64 {
            return Err(RegionError::BadMagic {
                path: path.to_path_buf(),
            });
        }
        Self::check_identity(path, head)?;
        let caps = Self::header_capacities(path, head, expected)?;
        let layout = Layout::new(caps)?;
        let declared = header_word(head, H_TOTAL_LEN as usize);
        if declared != layout.total_len || file_len < layout.total_len {
            return Err(RegionError::Truncated {
                path: path.to_path_buf(),
                found: file_len,
                expected: layout.total_len,
            });
        }
        Ok(layout)
    }

    /// The first part of [`Region::check_header`]: whether `head` (at least
    /// `ATTACH_HEAD_LEN` bytes) is a region at all, of this layout version, and fully
    /// initialised, so that its capacities are worth reading.
    fn check_identity(path: &Path, head: &[u8]) -> Result<(), RegionError> {
        if head[0..8] != REGION_MAGIC {
            return Err(RegionError::BadMagic {
                path: path.to_path_buf(),
            });
        }
        let version = header_word(head, H_VERSION as usize) as u32;
        if version != LAYOUT_VERSION {
            return Err(RegionError::VersionMismatch {
                path: path.to_path_buf(),
                found: version,
                expected: LAYOUT_VERSION,
            });
        }
        if header_word(head, H_INIT_DONE as usize) != INIT_DONE_TOKEN {
            return Err(RegionError::Uninitialised {
                path: path.to_path_buf(),
            });
        }
        Ok(())
    }

    /// The capacities stored in `head`, checked against `expected` when given (the
    /// first field that differs is the error) and against their own fields' widths.
    fn header_capacities(
        path: &Path,
        head: &[u8],
        expected: Option<Capacities>,
    ) -> Result<Capacities, RegionError> {
        let found: Vec<u64> = (0..H_CAPS_WORDS as usize)
            .map(|i| header_word(head, H_CAPS as usize + 8 * i))
            .collect();
        if let Some(exp) = expected {
            let names = [
                "max_topics",
                "brokers",
                "goi_slots",
                "pbr_slots",
                "segment_bytes",
                "segments_per_broker",
                "seg_map_slots",
            ];
            for ((name, f), e) in names.iter().zip(&found).zip(caps_words(&exp)) {
                if *f != e {
                    return Err(RegionError::LayoutMismatch {
                        path: path.to_path_buf(),
                        field: name,
                        found: *f,
                        expected: e,
                    });
                }
            }
        }
        let caps = Capacities {
            max_topics: found[0] as u32,
            brokers: found[1] as u32,
            goi_slots: found[2],
            pbr_slots: found[3],
            segment_bytes: found[4],
            segments_per_broker: found[5] as u32,
            seg_map_slots: found[6],
        };
        // A 32-bit capacity stored as a larger word would be cut short above.
        if caps_words(&caps)[..] != found[..] {
            return Err(RegionError::BadCapacities(format!(
                "{} holds capacities {found:?} that do not fit their fields",
                path.display()
            )));
        }
        Ok(caps)
    }

    fn map(path: &Path, file: File, layout: Layout) -> Result<Self, RegionError> {
        // SAFETY: mapping a file we hold open, read/write, shared; the kernel picks the
        // address. The result is checked against MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                layout.total_len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(RegionError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::last_os_error(),
            });
        }
        // The topic tables are read a page here and there (each slot's state word by
        // every scan of the slots): on a disk filesystem, a fault in a hole of the sparse
        // file otherwise reads ahead, zeroing megabytes of page cache per slot, which
        // made a start with 512 slots take 3.5 s (`docs/DESIGN.md`, "Topic delete").
        // Only advice: a filesystem without readahead (tmpfs) ignores it.
        assert!(
            layout.topics_off.is_multiple_of(PAGE) && layout.segments_off <= layout.total_len,
            "the topic tables are whole pages inside the mapping"
        );
        let tables = (layout.segments_off - layout.topics_off) as usize;
        // SAFETY: the range lies inside the mapping just made (topics_off is page-aligned
        // and segments_off <= total_len); MADV_RANDOM changes no contents.
        unsafe {
            libc::madvise(
                (ptr as *mut u8).add(layout.topics_off as usize) as *mut libc::c_void,
                tables,
                libc::MADV_RANDOM,
            );
        }
        Ok(Self {
            ptr: ptr as *mut u8,
            len: layout.total_len,
            layout,
            path: path.to_path_buf(),
            _file: file,
        })
    }

    /// Allocates every page of the region and maps it writable in this process, so
    /// the data path never faults (each first touch of a page otherwise costs a fault
    /// and zeroing it on the writer's time).
    pub fn prefault(&self) -> Result<(), RegionError> {
        // Linux 5.14+; the libc crate does not name it yet.
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        // SAFETY: the range is exactly this mapping; MADV_POPULATE_WRITE faults pages in
        // as a write would, without changing their contents (zeros in a new region).
        let rc = unsafe {
            libc::madvise(
                self.ptr as *mut libc::c_void,
                self.len as usize,
                MADV_POPULATE_WRITE,
            )
        };
        if rc != 0 {
            return Err(RegionError::Io {
                path: self.path.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn capacities(&self) -> Capacities {
        self.layout.caps
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The word at `off`, for reading only (what every process but its writer gets).
    #[inline]
    pub(crate) fn read_word(&self, off: u64) -> ReadWord<'_> {
        ReadWord::new(self.word(off))
    }

    /// The word at `off`, for its owner's stores (write handles only).
    #[inline]
    pub(crate) fn owned_word(&self, off: u64) -> OwnedWord<'_> {
        OwnedWord::new(self.word(off))
    }

    /// The counter at `off`, which only grows (write handles only).
    #[inline]
    pub(crate) fn monotonic(&self, off: u64, name: &'static str) -> MonotonicU64<'_> {
        MonotonicU64::new(self.word(off), name)
    }

    /// The 8-byte word at byte offset `off`. Panics if `off` is unaligned or outside
    /// the mapping: offsets come from [`Layout`], never from the network.
    #[inline]
    pub(crate) fn word(&self, off: u64) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "region word offset {off} out of bounds"
        );
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned); AtomicU64 has
        // the size and alignment of u64; the mapping lives as long as `self`.
        unsafe { &*(self.ptr.add(off as usize) as *const AtomicU64) }
    }

    #[inline]
    pub(crate) fn word32(&self, off: u64) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "region word offset {off} out of bounds"
        );
        // SAFETY: as in `word`, for a 4-byte aligned u32.
        unsafe { &*(self.ptr.add(off as usize) as *const AtomicU32) }
    }

    /// First step of rewriting a ring slot for the record of absolute `index` (a ring of
    /// `slots`, its token at `token_off`, `index + 1` of the record it holds): clear the
    /// token so that a reader that checks the token before and after reading can never
    /// accept a half-rewritten slot (the seqlock writer side). The fence keeps the data
    /// stores after the clear.
    ///
    /// Before that, asserts the slot moves on to `index`: the token it held names the
    /// same ring slot (so nothing else wrote into this one) and the same or an earlier
    /// lap (a slot never goes back to an older record). `what` names the slot.
    pub(crate) fn begin_rewrite(
        &self,
        token_off: u64,
        index: u64,
        slots: u64,
        what: impl Fn() -> String,
    ) {
        let token = self.word(token_off);
        if let Some(held) = token.load(Ordering::Relaxed).checked_sub(1) {
            assert!(
                held <= index && (index - held).is_multiple_of(slots),
                "{} holds record {held} and would take {index}",
                what()
            );
        }
        token.store(0, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
    }

    pub(crate) fn bell_at(&self, off: u64) -> Doorbell<'_> {
        // A bell is alone on its line: a neighbour's stores would wake its sleepers.
        debug_assert!(off.is_multiple_of(BELL_LINE_LEN), "doorbell at {off}");
        Doorbell {
            count: self.word32(off),
            waiters: self.word32(off + BELL_WAITERS_REL),
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `map`; no references into
        // it outlive `self` (all accessors borrow `self`).
        let rc = unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len as usize) };
        // Fails only for an address or length that is not this mapping's.
        debug_assert_eq!(
            rc,
            0,
            "munmap of the region: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The little-endian header word at byte `off` of `head`, which the caller has checked
/// holds it (every offset read is below `ATTACH_HEAD_LEN`).
fn header_word(head: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(head[off..off + 8].try_into().unwrap())
}

fn caps_words(c: &Capacities) -> [u64; 7] {
    [
        c.max_topics as u64,
        c.brokers as u64,
        c.goi_slots,
        c.pbr_slots,
        c.segment_bytes,
        c.segments_per_broker as u64,
        c.seg_map_slots,
    ]
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process on the host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_MONOTONIC always exists.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // A failure would leave 0: every lease and stall deadline would read as long past.
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The kernel's boot id as two words, or zeros when it cannot be read.
pub(crate) fn boot_id() -> [u64; 2] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hex: String = text.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    if hex.len() != 32 {
        return [0, 0];
    }
    let word = |s: &str| u64::from_str_radix(s, 16).unwrap_or(0);
    [word(&hex[..16]), word(&hex[16..])]
}

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before it): the
/// time stamps the region keeps for idleness and creation times.
pub fn unix_ms() -> u64 {
    now_ns() / 1_000_000
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
