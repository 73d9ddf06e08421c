//! Mapping the region file and typed access to its fields.

use crate::coherence::{flush_range, store_fence};
use crate::layout::*;
use crate::slots::{GoiEntry, SessionRecord, SessionState, TopicMeta, TopicState};
use crate::{Doorbell, OwnerRecord, RegionError};
use embarcadero_wire::{batch::offsets as bo, BatchHeader};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

// Header words.
const H_MAGIC: u64 = 0;
const H_VERSION: u64 = 8;
const H_CAPS: u64 = 16; // 7 words of capacities
const H_TOTAL_LEN: u64 = 72;
const H_CREATED_NS: u64 = 80;
const H_INIT_DONE: u64 = 88;
const H_BOOT_ID: u64 = 96; // 2 words: the kernel boot id when the region was created
const H_RETIRED: u64 = 112; // nonzero once a restarted head has replaced this region
const INIT_DONE_TOKEN: u64 = 0x454d_4244_5245_4459; // "EMBDREDY"
/// Bytes of the header that [`Region::check_header`] reads.
pub const ATTACH_HEAD_LEN: usize = 96;

// Control block: fencing epoch and sequencer lease, then doorbells on their own lines.
const C_FENCING_EPOCH: u64 = 0;
const C_SEQUENCER_ID: u64 = 8;
const C_LEASE_DEADLINE_NS: u64 = 16;
const C_SEQUENCER_OWNER: u64 = 32; // 4 words: the lease holder's process
const C_BROKER_OWNERS: u64 = 3072; // 4 words per broker: the process serving its logs
const C_SEQUENCER_BELL: u64 = 512;
const C_REPLICATION_BELL: u64 = 768;
const C_BROKER_BELLS: u64 = 1024;

// Topic meta words.
const T_STATE: u64 = 0;
const T_GENERATION: u64 = 8;
const T_PACKED: u64 = 16; // order | rf << 8 | default_ack << 16 | name_len << 24
const T_NAME: u64 = 24; // 64 bytes = 8 words
const T_CREATED_MS: u64 = 88;
const T_RETENTION_BYTES: u64 = 96;
const T_RETENTION_MS: u64 = 104;
/// The position ceiling of a memory-only topic, on a line of its own: the sequencer
/// (orders 2, 5) and every broker (orders 0, 1) read it once per epoch or service round,
/// while the other meta words are read only when a topic is looked up. Written by the
/// control plane only (one writer per field), and only raised once the new value is on
/// disk: see [`Region::position_ceiling`].
const T_POSITION_CEILING: u64 = 128;
const _: () = assert!(T_RETENTION_MS + 8 <= T_POSITION_CEILING);
const _: () = assert!(T_POSITION_CEILING + 64 <= crate::layout::TOPIC_META_LEN);

// Replica line words.
const R_DURABLE_SEQ: u64 = 0;
const R_OWN_DURABLE_SEQ: u64 = 8;
const R_ERROR: u64 = 16;
const R_DURABLE_POSITION: u64 = 24;

// Session slot words. The durable mark is written by the replication chain (and reset by
// the sequencer when it hands the slot to another session); the rest is the sequencer's.
const S_DURABLE_HWM: u64 = 32;
const S_LAST_ACTIVE_MS: u64 = 40;
const S_OPENED_AT: u64 = 48;
const S_KEY_HASH: u64 = 56;
const _: () = assert!(S_KEY_HASH + 8 <= crate::layout::SESSION_SLOT_LEN);

/// The mapped region. Cheap to share behind an `Arc`; all access is through atomics
/// on 8-byte words or through the BLog byte accessors.
pub struct Region {
    ptr: *mut u8,
    len: u64,
    layout: Layout,
    path: PathBuf,
    _file: File,
}

// SAFETY: the mapping is plain shared memory; every access from Rust code goes through
// atomics (metadata) or through BLog ranges whose exclusive ownership the broker
// protocol guarantees. Moving or sharing the handle across threads is therefore fine.
unsafe impl Send for Region {}
// SAFETY: see `Send`.
unsafe impl Sync for Region {}

/// Progress of one disk replica of a topic; written only by that replica's worker.
pub struct ReplicaProgress<'a> {
    /// GOI entries below this index are on this replica's disk *and* on every earlier
    /// replica's (the chain token): the last replica's value is the topic's durable
    /// frontier.
    pub durable_seq: &'a AtomicU64,
    /// GOI entries below this index are on this replica's disk (fdatasync'd).
    pub own_durable_seq: &'a AtomicU64,
    /// 0 while healthy; otherwise the OS error number of the last failed write/sync.
    pub error: &'a AtomicU64,
    /// The global position that follows the entries below `durable_seq`.
    pub durable_position: &'a AtomicU64,
}

/// A live reader that holds memory back ([`Region::slowest_reader`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlowestReader {
    /// Its reader slot in the topic.
    pub slot: u32,
    /// The position it still needs (0 while the slot is being claimed).
    pub position: u64,
    /// The broker serving it, when recorded.
    pub broker: Option<u32>,
    /// How long ago its broker last beat for it.
    pub heartbeat_age_ns: u64,
}

/// Per (topic, broker) frontiers. Each line has exactly one writer.
pub struct LogControl<'a> {
    // --- written by the broker that owns the log ---
    /// PBR slots below this index are committed (valid or void).
    pub written_frontier: &'a AtomicU64,
    /// Messages in the valid slots below `written_frontier`: the per-broker position.
    pub frontier_msgs: &'a AtomicU64,
    /// PBR slots below this index have been reclaimed and may be overwritten.
    pub reclaimed_pbr: &'a AtomicU64,
    /// Log bytes below this logical offset have been reclaimed.
    pub reclaimed_blog: &'a AtomicU64,
    /// 0, or 1 + the PBR index from which the broker's slots are never ordered: set by
    /// the control plane once it has declared the broker dead (the line's owner is then
    /// the control plane), so a broker that only seemed dead cannot add to the order.
    pub fence_pbr: &'a AtomicU64,
    /// A restarted broker resumes a fenced log here: the sequencer treats the slots from
    /// the fence up to this index as void (their publishers were told they were not
    /// ordered) and orders again from it. Written by the resuming broker before
    /// `resumed_fence`.
    pub resume_pbr: &'a AtomicU64,
    /// The `fence_pbr` value that `resume_pbr` lifts; while it differs from
    /// `fence_pbr`, the fence holds.
    pub resumed_fence: &'a AtomicU64,
    // --- written by the sequencer ---
    /// PBR slots below this index are in the committed GOI prefix (orders 2, 5).
    pub ordered_pbr: &'a AtomicU64,
    /// The sequencer needs slots below this index reclaimed to reuse GOI slots.
    pub reclaim_request: &'a AtomicU64,
    /// Equals `fence_pbr` once the sequencer has ordered every slot it will ever order
    /// from this log: the GOI then says exactly which of the broker's batches made it.
    pub fence_ack: &'a AtomicU64,
    // --- written by the replication chain ---
    /// PBR slots below this index are on every replica's disk.
    pub durable_pbr: &'a AtomicU64,
}

/// The sequencer-owned line of a topic.
pub struct TopicSeq<'a> {
    /// GOI entries below this index are committed (the contiguous committed prefix).
    pub committed_seq: &'a AtomicU64,
    /// Messages covered by the committed prefix: the next global position.
    pub next_position: &'a AtomicU64,
    /// The position this region's GOI starts at: every entry it will hold is at or
    /// above it, and a memory-only topic's positions below it are gone. Written once,
    /// by the start-up that seeds the line (`recovery::seed`), before any sequencer.
    pub start_position: &'a AtomicU64,
}

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
            w(H_CAPS + 8 * i as u64, *v);
        }
        w(H_TOTAL_LEN, layout.total_len);
        w(H_CREATED_NS, now_ns());
        let boot = boot_id();
        w(H_BOOT_ID, boot[0]);
        w(H_BOOT_ID + 8, boot[1]);
        store_fence();
        region
            .word(H_INIT_DONE)
            .store(INIT_DONE_TOKEN, Ordering::Release);
        Ok(region)
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
        let word = |off: usize| u64::from_le_bytes(head[off..off + 8].try_into().unwrap());
        if head[0..8] != REGION_MAGIC {
            return Err(RegionError::BadMagic {
                path: path.to_path_buf(),
            });
        }
        let version = word(H_VERSION as usize) as u32;
        if version != LAYOUT_VERSION {
            return Err(RegionError::VersionMismatch {
                path: path.to_path_buf(),
                found: version,
                expected: LAYOUT_VERSION,
            });
        }
        if word(H_INIT_DONE as usize) != INIT_DONE_TOKEN {
            return Err(RegionError::Uninitialised {
                path: path.to_path_buf(),
            });
        }
        let found: Vec<u64> = (0..7).map(|i| word(H_CAPS as usize + 8 * i)).collect();
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
        let layout = Layout::new(caps)?;
        let declared = word(H_TOTAL_LEN as usize);
        if declared != layout.total_len || file_len < layout.total_len {
            return Err(RegionError::Truncated {
                path: path.to_path_buf(),
                found: file_len,
                expected: layout.total_len,
            });
        }
        Ok(layout)
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

    /// The 8-byte word at byte offset `off`. Panics if `off` is unaligned or outside
    /// the mapping: offsets come from [`Layout`], never from the network.
    #[inline]
    pub fn word(&self, off: u64) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "region word offset {off} out of bounds"
        );
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned); AtomicU64 has
        // the size and alignment of u64; the mapping lives as long as `self`.
        unsafe { &*(self.ptr.add(off as usize) as *const AtomicU64) }
    }

    #[inline]
    fn word32(&self, off: u64) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "region word offset {off} out of bounds"
        );
        // SAFETY: as in `word`, for a 4-byte aligned u32.
        unsafe { &*(self.ptr.add(off as usize) as *const AtomicU32) }
    }

    fn bell_at(&self, off: u64) -> Doorbell<'_> {
        Doorbell {
            count: self.word32(off),
            waiters: self.word32(off + 4),
        }
    }

    // ---------------------------------------------------------------- control block

    /// Rung by brokers when they commit a PBR slot; the sequencer sleeps on it.
    pub fn sequencer_bell(&self) -> Doorbell<'_> {
        self.bell_at(self.layout.control_off + C_SEQUENCER_BELL)
    }

    /// Rung when anything a broker's ack/service thread waits for moves.
    pub fn broker_bell(&self, broker: u32) -> Doorbell<'_> {
        assert!(broker < self.layout.caps.brokers);
        self.bell_at(self.layout.control_off + C_BROKER_BELLS + broker as u64 * 64)
    }

    /// Rung when a topic with disk replicas gets newly ordered batches, and when a
    /// replica's progress moves (the chain's next replica waits for it).
    pub fn replication_bell(&self) -> Doorbell<'_> {
        self.bell_at(self.layout.control_off + C_REPLICATION_BELL)
    }

    /// True when the region was created since the machine last booted. Only then can
    /// its contents be trusted after a crash: a process crash leaves every store in the
    /// page cache, a machine crash leaves whatever part happened to reach the disk.
    pub fn created_this_boot(&self) -> bool {
        let boot = boot_id();
        boot != [0, 0]
            && self.word(H_BOOT_ID).load(Ordering::Acquire) == boot[0]
            && self.word(H_BOOT_ID + 8).load(Ordering::Acquire) == boot[1]
    }

    /// Marks the region as replaced. A head that restarts builds a fresh region from what
    /// this one holds; processes still attached to this one (followers, sequencers) must
    /// stop acknowledging anything read from it, because what they read afterwards may be
    /// missing from the fresh region. Call before reading the region for recovery: the
    /// full fence pairs with the one in [`Region::is_retired`], so a process that still
    /// saw the region live read nothing the recovery misses.
    pub fn retire(&self) {
        self.word(H_RETIRED).store(1, Ordering::SeqCst);
        flush_range(self.word(H_RETIRED).as_ptr() as *const u8, 8);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// True once a restarted head replaced this region (see [`Region::retire`]). Call
    /// after reading what an acknowledgement or a delivery reports and before sending
    /// it: the fence orders those reads before this load.
    pub fn is_retired(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.word(H_RETIRED).load(Ordering::SeqCst) != 0
    }

    pub fn fencing_epoch(&self) -> &AtomicU64 {
        self.word(self.layout.control_off + C_FENCING_EPOCH)
    }

    pub fn sequencer_id(&self) -> &AtomicU64 {
        self.word(self.layout.control_off + C_SEQUENCER_ID)
    }

    pub fn lease_deadline_ns(&self) -> &AtomicU64 {
        self.word(self.layout.control_off + C_LEASE_DEADLINE_NS)
    }

    /// The process holding the sequencer lease (written by each new holder).
    pub fn sequencer_owner(&self) -> OwnerRecord<'_> {
        self.owner_at(self.layout.control_off + C_SEQUENCER_OWNER)
    }

    /// The process serving `broker`'s logs (written by each broker at start).
    pub fn broker_owner(&self, broker: u32) -> OwnerRecord<'_> {
        assert!(broker < self.layout.caps.brokers);
        self.owner_at(self.layout.control_off + C_BROKER_OWNERS + 32 * broker as u64)
    }

    fn owner_at(&self, off: u64) -> OwnerRecord<'_> {
        OwnerRecord {
            incarnation: self.word(off),
            boot: self.word(off + 8),
            pid: self.word(off + 16),
            start_ticks: self.word(off + 24),
        }
    }

    // ---------------------------------------------------------------- topics

    /// Writes a topic's metadata; the state word goes last. Control plane only.
    pub fn write_topic_meta(&self, topic: u32, meta: &TopicMeta) {
        let base = self.layout.topic_off(topic);
        let name = meta.name.as_bytes();
        assert!(name.len() <= 64);
        // A deleted topic's slot may still be held by processes letting go of it.
        assert!(
            !self.topic_deleted(topic),
            "topic slot {topic} held a deleted topic: it is reused only by a new region"
        );
        self.word(base + T_STATE)
            .store(TopicState::Free as u64, Ordering::Release);
        self.word(base + T_GENERATION)
            .store(meta.generation, Ordering::Relaxed);
        let packed = meta.order as u64
            | (meta.replication_factor as u64) << 8
            | (meta.default_ack as u64) << 16
            | (name.len() as u64) << 24;
        self.word(base + T_PACKED).store(packed, Ordering::Relaxed);
        let mut padded = [0u8; 64];
        padded[..name.len()].copy_from_slice(name);
        for i in 0..8 {
            let v = u64::from_le_bytes(padded[i * 8..i * 8 + 8].try_into().unwrap());
            self.word(base + T_NAME + 8 * i as u64)
                .store(v, Ordering::Relaxed);
        }
        self.word(base + T_CREATED_MS)
            .store(meta.created_unix_ms, Ordering::Relaxed);
        self.word(base + T_RETENTION_BYTES)
            .store(meta.retention_bytes, Ordering::Relaxed);
        self.word(base + T_RETENTION_MS)
            .store(meta.retention_ms, Ordering::Relaxed);
        self.word(base + T_POSITION_CEILING)
            .store(meta.position_ceiling, Ordering::Relaxed);
        store_fence();
        self.word(base + T_STATE)
            .store(TopicState::Active as u64, Ordering::Release);
    }

    /// Marks an active topic deleted (state word only; the rest of its slot stays as it
    /// was, for the processes still letting go of it). Control plane only, and only
    /// after the deletion is on disk. Rings every bell that a process holding state of
    /// the topic may be sleeping on, so each notices at once.
    pub fn delete_topic(&self, topic: u32) {
        let base = self.layout.topic_off(topic);
        self.word(base + T_STATE)
            .store(TopicState::Deleted as u64, Ordering::SeqCst);
        self.topic_bell(topic).ring();
        for b in 0..self.layout.caps.brokers {
            self.broker_bell(b).ring();
        }
        self.sequencer_bell().ring();
        self.replication_bell().ring();
    }

    /// Whether `topic`'s slot holds a deleted topic (see [`TopicState`]). One load: cheap
    /// enough for a connection's every round.
    pub fn topic_deleted(&self, topic: u32) -> bool {
        let base = self.layout.topic_off(topic);
        self.word(base + T_STATE).load(Ordering::SeqCst) == TopicState::Deleted as u64
    }

    /// Whether `topic`'s slot has ever held a topic in this region (active or deleted): a
    /// free slot has nothing in its lines and rings, so start-up scans pass it by (a
    /// scan reads every page of a slot's rings, megabytes per slot).
    pub fn topic_slot_used(&self, topic: u32) -> bool {
        let base = self.layout.topic_off(topic);
        self.word(base + T_STATE).load(Ordering::Acquire) != TopicState::Free as u64
    }

    /// Reads a topic's metadata if the slot is active.
    pub fn topic_meta(&self, topic: u32) -> Option<TopicMeta> {
        let base = self.layout.topic_off(topic);
        if self.word(base + T_STATE).load(Ordering::Acquire) != TopicState::Active as u64 {
            return None;
        }
        let packed = self.word(base + T_PACKED).load(Ordering::Relaxed);
        let name_len = ((packed >> 24) & 0xff).min(64) as usize;
        let mut bytes = [0u8; 64];
        for i in 0..8 {
            let v = self
                .word(base + T_NAME + 8 * i as u64)
                .load(Ordering::Relaxed);
            bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        Some(TopicMeta {
            name: String::from_utf8_lossy(&bytes[..name_len]).into_owned(),
            order: packed as u8,
            replication_factor: (packed >> 8) as u8,
            default_ack: (packed >> 16) as u8,
            generation: self.word(base + T_GENERATION).load(Ordering::Relaxed),
            created_unix_ms: self.word(base + T_CREATED_MS).load(Ordering::Relaxed),
            retention_bytes: self.word(base + T_RETENTION_BYTES).load(Ordering::Relaxed),
            retention_ms: self.word(base + T_RETENTION_MS).load(Ordering::Relaxed),
            position_ceiling: self.position_ceiling(topic).load(Ordering::Relaxed),
        })
    }

    /// No position of `topic` may be handed out at or above this value (a global
    /// position for orders 2 and 5, a per-broker one for orders 0 and 1):
    /// [`NO_POSITION_CEILING`](crate::NO_POSITION_CEILING) for replicated topics, whose positions the disk replicas
    /// keep. A memory-only topic restarted without its previous region starts at the
    /// ceiling persisted beside `topics.json`, so this bound is what makes a position
    /// never reused. Written by the control plane only (after persisting the value),
    /// and only raised; read by the sequencer once per epoch and by each broker's
    /// service thread once per round, never on a connection's data path.
    pub fn position_ceiling(&self, topic: u32) -> &AtomicU64 {
        self.word(self.layout.topic_off(topic) + T_POSITION_CEILING)
    }

    /// Finds an active topic by name: its slot id and metadata.
    pub fn find_topic(&self, name: &str) -> Option<(u32, TopicMeta)> {
        (0..self.layout.caps.max_topics)
            .filter_map(|t| self.topic_meta(t).map(|m| (t, m)))
            .find(|(_, m)| m.name == name)
    }

    pub fn topic_seq(&self, topic: u32) -> TopicSeq<'_> {
        let base = self.layout.topic_off(topic) + self.layout.topic_seq_rel;
        TopicSeq {
            committed_seq: self.word(base),
            next_position: self.word(base + 8),
            start_position: self.word(base + 16),
        }
    }

    /// Rung when a topic's readable frontier moves; subscribers sleep on it.
    pub fn topic_bell(&self, topic: u32) -> Doorbell<'_> {
        self.bell_at(self.layout.topic_off(topic) + self.layout.topic_bell_rel)
    }

    pub fn log(&self, topic: u32, broker: u32) -> LogControl<'_> {
        let base = self.layout.log_control_off(topic, broker);
        LogControl {
            written_frontier: self.word(base),
            frontier_msgs: self.word(base + 8),
            reclaimed_pbr: self.word(base + 16),
            reclaimed_blog: self.word(base + 24),
            fence_pbr: self.word(base + 32),
            resume_pbr: self.word(base + 40),
            resumed_fence: self.word(base + 48),
            ordered_pbr: self.word(base + 128),
            reclaim_request: self.word(base + 136),
            fence_ack: self.word(base + 144),
            durable_pbr: self.word(base + 256),
        }
    }

    /// Progress line of disk replica `replica` (1-based) of `topic`.
    pub fn replica(&self, topic: u32, replica: u32) -> ReplicaProgress<'_> {
        assert!((1..=MAX_REPLICAS).contains(&replica), "replica {replica}");
        let base = self.layout.replica_line_off(topic, replica);
        ReplicaProgress {
            durable_seq: self.word(base + R_DURABLE_SEQ),
            own_durable_seq: self.word(base + R_OWN_DURABLE_SEQ),
            error: self.word(base + R_ERROR),
            durable_position: self.word(base + R_DURABLE_POSITION),
        }
    }

    /// The topic's durable frontier: GOI entries below it are on every replica's disk.
    /// `replication_factor` counts the region copy; 1 means no disk replicas (0).
    pub fn durable_seq(&self, topic: u32, replication_factor: u8) -> u64 {
        self.last_replica(topic, replication_factor)
            .map_or(0, |r| r.durable_seq.load(Ordering::Acquire))
    }

    /// The last disk replica's line (the end of the chain), if the topic has replicas.
    fn last_replica(&self, topic: u32, replication_factor: u8) -> Option<ReplicaProgress<'_>> {
        match replication_factor as u32 {
            0 | 1 => None,
            rf => Some(self.replica(topic, (rf - 1).min(MAX_REPLICAS))),
        }
    }

    /// The position after the topic's durable frontier: subscribers of a replicated
    /// topic read below it. 0 without disk replicas.
    pub fn durable_position(&self, topic: u32, replication_factor: u8) -> u64 {
        self.last_replica(topic, replication_factor)
            .map_or(0, |r| r.durable_position.load(Ordering::Acquire))
    }

    // ---------------------------------------------------------------- reader pins

    /// Heartbeat of a topic's reader slot: 0 when free, [`READER_CLAIMING`] while its
    /// positions are being written, otherwise the owner's last [`monotonic_ns`].
    /// One above the highest reader slot of `topic` ever claimed: every slot at or above
    /// it is free, so scans stop there.
    pub fn reader_slots_high(&self, topic: u32) -> u32 {
        let high = self
            .word(self.layout.readers_line_off(topic))
            .load(Ordering::Acquire);
        assert!(
            high <= READER_SLOTS as u64,
            "readers line out of range: {high}"
        );
        high as u32
    }

    /// Records that `slot` of `topic` is being claimed, before its heartbeat is set, so
    /// scans that start after the claim look at it. Any claiming broker raises it; it
    /// never goes down.
    pub fn reader_slot_claimed(&self, topic: u32, slot: u32) {
        assert!(slot < READER_SLOTS);
        self.word(self.layout.readers_line_off(topic))
            .fetch_max(slot as u64 + 1, Ordering::AcqRel);
    }

    pub fn reader_heartbeat(&self, topic: u32, slot: u32) -> &AtomicU64 {
        self.word(self.layout.reader_slot_off(topic, slot))
    }

    /// The position a reader still needs: index 0 for orders 2 and 5 (a global
    /// position), index `broker` for orders 0 and 1 (a position in that broker's log).
    /// Written only by the slot's owner.
    pub fn reader_position(&self, topic: u32, slot: u32, index: u32) -> &AtomicU64 {
        assert!(index < MAX_BROKERS);
        self.word(self.layout.reader_slot_off(topic, slot) + 8 + 8 * index as u64)
    }

    /// 1 + the broker serving a reader slot (0: none recorded). Written by that broker
    /// when it claims the slot, before the slot's positions.
    pub fn reader_owner(&self, topic: u32, slot: u32) -> &AtomicU64 {
        self.word(self.layout.reader_slot_off(topic, slot) + crate::layout::READER_OWNER_REL)
    }

    /// A hash of the client address of the reader in `slot` (0: not recorded). Written
    /// by the claiming broker before the slot's heartbeat leaves [`READER_CLAIMING`].
    pub fn reader_address(&self, topic: u32, slot: u32) -> &AtomicU64 {
        self.word(self.layout.reader_slot_off(topic, slot) + crate::layout::READER_ADDRESS_REL)
    }

    /// How many slots of `topic` are held (claimed or live) by readers from the client
    /// address with hash `address`; stale ones (older than `stall`) are not counted.
    pub fn readers_from(&self, topic: u32, address: u64, stall: std::time::Duration) -> u32 {
        assert_ne!(address, 0, "0 means an address that was not recorded");
        let now = monotonic_ns();
        (0..self.reader_slots_high(topic))
            .filter(|&slot| {
                let hb = self.reader_heartbeat(topic, slot).load(Ordering::Acquire);
                let live = hb == READER_CLAIMING
                    || (hb != 0 && now.saturating_sub(hb) <= stall.as_nanos() as u64);
                live && self.reader_address(topic, slot).load(Ordering::Acquire) == address
            })
            .count() as u32
    }

    /// Frees every reader slot `broker` holds, so that its subscribers (who reconnect
    /// elsewhere) stop holding memory at once instead of after the stall timeout. Only
    /// for a broker that serves no more (declared dead or replaced); a slot is freed with
    /// a compare-and-swap of the heartbeat it showed, so a reader still beating keeps it
    /// and finds out from its next beat. Returns how many it freed.
    pub fn release_reader_slots(&self, broker: u32) -> usize {
        let mut freed = 0;
        for topic in 0..self.layout.caps.max_topics {
            for slot in 0..self.reader_slots_high(topic) {
                if self.reader_owner(topic, slot).load(Ordering::Acquire) != broker as u64 + 1 {
                    continue;
                }
                let heartbeat = self.reader_heartbeat(topic, slot);
                let seen = heartbeat.load(Ordering::Acquire);
                if seen != 0
                    && heartbeat
                        .compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    freed += 1;
                }
            }
        }
        freed
    }

    /// The lowest position any live reader of `topic` still needs at `index`, or
    /// `u64::MAX` when no reader holds anything. A slot being claimed counts as 0; a
    /// slot whose heartbeat is older than `stall` is ignored.
    pub fn reader_floor(&self, topic: u32, index: u32, stall: std::time::Duration) -> u64 {
        self.slowest_reader(topic, index, stall)
            .map_or(u64::MAX, |r| r.position)
    }

    /// The live reader of `topic` that holds back the most at `index` (the one
    /// [`Region::reader_floor`] is the position of), for reclamation and for telling
    /// people who holds memory back. A slot being claimed is the slowest possible.
    pub fn slowest_reader(
        &self,
        topic: u32,
        index: u32,
        stall: std::time::Duration,
    ) -> Option<SlowestReader> {
        let now = monotonic_ns();
        let mut slowest: Option<SlowestReader> = None;
        for slot in 0..self.reader_slots_high(topic) {
            let hb = self.reader_heartbeat(topic, slot).load(Ordering::Acquire);
            if hb == 0
                || (hb != READER_CLAIMING && now.saturating_sub(hb) > stall.as_nanos() as u64)
            {
                continue;
            }
            let position = if hb == READER_CLAIMING {
                0
            } else {
                self.reader_position(topic, slot, index)
                    .load(Ordering::Acquire)
            };
            if slowest.as_ref().is_some_and(|s| s.position <= position) {
                continue;
            }
            let owner = self.reader_owner(topic, slot).load(Ordering::Acquire);
            slowest = Some(SlowestReader {
                slot,
                position,
                broker: owner.checked_sub(1).map(|b| b as u32),
                heartbeat_age_ns: if hb == READER_CLAIMING {
                    0
                } else {
                    now.saturating_sub(hb)
                },
            });
            if position == 0 {
                break;
            }
        }
        slowest
    }

    // ---------------------------------------------------------------- order-5 sessions

    /// Writes a session slot, state word last. Sequencer only. The last-active stamp is
    /// only raised (brokers raise it too, `session_touch`); a slot given to another
    /// session keeps the previous holder's stamp, which is older than the new one's.
    ///
    /// The state word carries a write count above its low byte (a seqlock): a reader
    /// that slept through a whole rewrite sees the word change, so it can never take
    /// one client's id with another's marks when the slot goes to another session.
    pub fn session_write(&self, topic: u32, slot: u32, s: &SessionRecord) {
        let base = self.layout.session_slot_off(topic, slot);
        let writes = (self.word(base).load(Ordering::Relaxed) >> 8).wrapping_add(1);
        // State 0 with the count: being rewritten (a free slot's word is all zero).
        self.word(base).store(writes << 8, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        self.word(base + 8).store(s.client_id, Ordering::Relaxed);
        self.word(base + 16)
            .store(s.session_epoch, Ordering::Relaxed);
        self.word(base + 24)
            .store(s.committed_hwm, Ordering::Relaxed);
        self.word(base + S_LAST_ACTIVE_MS)
            .fetch_max(s.last_active_ms, Ordering::Relaxed);
        self.word(base + S_OPENED_AT)
            .store(s.opened_at, Ordering::Relaxed);
        self.word(base + S_KEY_HASH)
            .store(s.key_hash, Ordering::Relaxed);
        store_fence();
        self.word(base)
            .store(s.state as u64 | writes << 8, Ordering::Release);
    }

    /// Reads a session slot if it is in use. A slot being rewritten is waited for (a
    /// rewrite is a few stores), so a slot in use never reads as free; only a writer
    /// that stopped mid-rewrite (a crashed sequencer) leaves it reading as free.
    pub fn session_read(&self, topic: u32, slot: u32) -> Option<SessionRecord> {
        const SPINS: u32 = 10_000;
        let base = self.layout.session_slot_off(topic, slot);
        for _ in 0..SPINS {
            let word = self.word(base).load(Ordering::Acquire);
            if word == 0 {
                return None;
            }
            let Some(state) = SessionState::from_u64(word & 0xff) else {
                std::hint::spin_loop();
                continue;
            };
            let rec = SessionRecord {
                state,
                client_id: self.word(base + 8).load(Ordering::Acquire),
                session_epoch: self.word(base + 16).load(Ordering::Acquire),
                committed_hwm: self.word(base + 24).load(Ordering::Acquire),
                last_active_ms: self.word(base + S_LAST_ACTIVE_MS).load(Ordering::Acquire),
                opened_at: self.word(base + S_OPENED_AT).load(Ordering::Acquire),
                key_hash: self.word(base + S_KEY_HASH).load(Ordering::Acquire),
            };
            if self.word(base).load(Ordering::Acquire) == word {
                return Some(rec);
            }
        }
        None
    }

    /// Raises the last-active stamp of the session in `slot` to `now_ms`: a broker does
    /// while the session's client is connected, so that it is not taken for idle.
    pub fn session_touch(&self, topic: u32, slot: u32, now_ms: u64) {
        self.word(self.layout.session_slot_off(topic, slot) + S_LAST_ACTIVE_MS)
            .fetch_max(now_ms, Ordering::Relaxed);
    }

    /// Order 5, ack 2: every batch of the session in `slot` with `batch_seq` below
    /// this is on every replica's disk. Written only by the last replica's worker.
    pub fn session_durable_hwm(&self, topic: u32, slot: u32) -> &AtomicU64 {
        self.word(self.layout.session_slot_off(topic, slot) + S_DURABLE_HWM)
    }

    /// Finds the session slot of `client_id` in a topic's session table.
    pub fn session_find(&self, topic: u32, client_id: u64) -> Option<(u32, SessionRecord)> {
        (0..SESSION_SLOTS).find_map(|slot| {
            self.session_read(topic, slot)
                .filter(|r| r.client_id == client_id)
                .map(|r| (slot, r))
        })
    }

    /// True when a new session of `topic` can get a slot: one is free, or held by a
    /// session idle for at least `idle_ms` at `now_ms` (the sequencer evicts the longest
    /// idle of those for a new one). Only by the stamps: the sequencer may still find no
    /// session it can end (batches not yet on the replicas).
    pub fn session_table_has_room(&self, topic: u32, now_ms: u64, idle_ms: u64) -> bool {
        (0..SESSION_SLOTS).any(|slot| {
            self.session_read(topic, slot)
                .is_none_or(|r| r.idle_at(now_ms, idle_ms))
        })
    }

    // ---------------------------------------------------------------- PBR

    /// First step of rewriting a slot: clear its token so that a reader that checks
    /// the token before and after reading can never accept a half-rewritten slot
    /// (the seqlock writer side). The fence keeps the data stores after the clear.
    fn invalidate(&self, token_off: u64) {
        self.word(token_off).store(0, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
    }

    fn pbr_word(&self, topic: u32, broker: u32, index: u64, field: usize) -> &AtomicU64 {
        self.word(self.layout.pbr_slot_off(topic, broker, index) + field as u64)
    }

    /// Publishes a PBR slot: every field, then the commit token `index + 1` with
    /// `Release`. Only the broker connection that reserved `index` may call this.
    pub fn pbr_commit(&self, topic: u32, broker: u32, index: u64, h: &BatchHeader) {
        let bytes = h.encode();
        let base = self.layout.pbr_slot_off(topic, broker, index);
        self.invalidate(base + bo::PUBLISH_COMMIT as u64);
        for field in (0..bo::PUBLISH_COMMIT).step_by(8) {
            let v = u64::from_le_bytes(bytes[field..field + 8].try_into().unwrap());
            self.word(base + field as u64).store(v, Ordering::Relaxed);
        }
        flush_range(self.word(base).as_ptr() as *const u8, 128);
        store_fence();
        self.word(base + bo::PUBLISH_COMMIT as u64)
            .store(index + 1, Ordering::Release);
        flush_range(self.word(base + 120).as_ptr() as *const u8, 8);
    }

    /// Reads the PBR slot for absolute `index` if its token says it holds that index.
    pub fn pbr_read(&self, topic: u32, broker: u32, index: u64) -> Option<BatchHeader> {
        let commit = self.pbr_word(topic, broker, index, bo::PUBLISH_COMMIT);
        if commit.load(Ordering::Acquire) != index + 1 {
            return None;
        }
        let mut bytes = [0u8; 128];
        for field in (0..128).step_by(8) {
            let v = self
                .pbr_word(topic, broker, index, field)
                .load(Ordering::Acquire);
            bytes[field..field + 8].copy_from_slice(&v.to_le_bytes());
        }
        let h = BatchHeader::decode(&bytes).expect("128 bytes");
        (h.publish_commit == index + 1 && commit.load(Ordering::Acquire) == index + 1).then_some(h)
    }

    /// True while slot `index` still holds that index (a reader's seqlock re-check).
    pub fn pbr_holds(&self, topic: u32, broker: u32, index: u64) -> bool {
        self.pbr_word(topic, broker, index, bo::PUBLISH_COMMIT)
            .load(Ordering::Acquire)
            == index + 1
    }

    /// Per-broker position of the slot's first message; written by the owning broker's
    /// frontier pass after the commit, read by readers below `written_frontier`.
    pub fn pbr_set_start_offset(&self, topic: u32, broker: u32, index: u64, v: u64) {
        self.pbr_word(topic, broker, index, bo::START_LOGICAL_OFFSET)
            .store(v, Ordering::Release);
    }

    /// Global position of the slot's first message; written by the sequencer.
    pub fn pbr_set_total_order(&self, topic: u32, broker: u32, index: u64, v: u64) {
        self.pbr_word(topic, broker, index, bo::TOTAL_ORDER)
            .store(v, Ordering::Release);
    }

    // ---------------------------------------------------------------- GOI

    /// Writes GOI entry `index` with its token (`index + 1`) last. Sequencer only.
    pub fn goi_write(&self, topic: u32, index: u64, e: &GoiEntry) {
        let base = self.layout.goi_entry_off(topic, index);
        self.invalidate(base);
        for (i, v) in e.to_words().iter().enumerate() {
            self.word(base + 8 + 8 * i as u64)
                .store(*v, Ordering::Relaxed);
        }
        flush_range(self.word(base).as_ptr() as *const u8, 128);
        store_fence();
        self.word(base).store(index + 1, Ordering::Release);
        flush_range(self.word(base).as_ptr() as *const u8, 8);
    }

    /// Reads GOI entry `index` if the slot holds it; re-check with [`Region::goi_holds`]
    /// after using data it points to.
    pub fn goi_read(&self, topic: u32, index: u64) -> Option<GoiEntry> {
        let base = self.layout.goi_entry_off(topic, index);
        if self.word(base).load(Ordering::Acquire) != index + 1 {
            return None;
        }
        let mut w = [0u64; 15];
        for (i, slot) in w.iter_mut().enumerate() {
            *slot = self.word(base + 8 + 8 * i as u64).load(Ordering::Acquire);
        }
        let e = GoiEntry::from_words(&w);
        (self.word(base).load(Ordering::Acquire) == index + 1).then_some(e)
    }

    pub fn goi_holds(&self, topic: u32, index: u64) -> bool {
        self.word(self.layout.goi_entry_off(topic, index))
            .load(Ordering::Acquire)
            == index + 1
    }

    /// The GOI index currently stored in the slot `index` maps to, if any.
    pub fn goi_slot_occupant(&self, topic: u32, index: u64) -> Option<u64> {
        let token = self
            .word(self.layout.goi_entry_off(topic, index))
            .load(Ordering::Acquire);
        token.checked_sub(1)
    }

    // ---------------------------------------------------------------- BLog segments

    /// Records that logical segment `logical` of the (topic, broker) log lives in
    /// physical segment `physical` of that broker's pool. Owning broker only.
    pub fn seg_map_publish(&self, topic: u32, broker: u32, logical: u64, physical: u32) {
        assert!(physical < self.layout.caps.segments_per_broker);
        let off = self.layout.seg_map_off(topic, broker, logical);
        self.invalidate(off);
        self.word(off + 8).store(physical as u64, Ordering::Relaxed);
        self.word(off).store(logical + 1, Ordering::Release);
    }

    /// The physical segment holding logical segment `logical`, if mapped.
    pub fn seg_map_lookup(&self, topic: u32, broker: u32, logical: u64) -> Option<u32> {
        let off = self.layout.seg_map_off(topic, broker, logical);
        if self.word(off).load(Ordering::Acquire) != logical + 1 {
            return None;
        }
        let physical = self.word(off + 8).load(Ordering::Acquire);
        if self.word(off).load(Ordering::Acquire) != logical + 1 {
            return None;
        }
        (physical < self.layout.caps.segments_per_broker as u64).then_some(physical as u32)
    }

    /// Address of `len` log bytes at logical offset `at` of a (topic, broker) log, if
    /// the segment is mapped and the range lies inside it. The memory may be reclaimed
    /// and overwritten concurrently: use the pointer only for copies whose result is
    /// re-validated against [`LogControl::reclaimed_blog`], or for ranges the caller
    /// owns (see [`Region::blog_bytes_mut`]).
    pub fn blog_ptr(&self, topic: u32, broker: u32, at: u64, len: u64) -> Option<*mut u8> {
        let seg = self.layout.caps.segment_bytes;
        let logical = at / seg;
        let within = at % seg;
        if within.checked_add(len)? > seg {
            return None;
        }
        let physical = self.seg_map_lookup(topic, broker, logical)?;
        let off = self.layout.segment_off(broker, physical) + within;
        debug_assert!(off + len <= self.len);
        // SAFETY: `off + len` lies within the segment area of the mapping (checked via
        // the capacities above), so the pointer stays inside the mapping.
        Some(unsafe { self.ptr.add(off as usize) })
    }

    /// Mutable access to a log range the caller has reserved and not yet committed.
    ///
    /// # Safety
    /// The caller must own `[at, at + len)` of the (topic, broker) log: reserved by
    /// this broker process, not committed, not reclaimable. No other Rust code reads
    /// or writes that range until the caller commits the PBR slot that covers it.
    // Exclusivity comes from the reservation protocol, not from `&mut self`: many
    // connections write disjoint ranges of one region at once.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn blog_bytes_mut(
        &self,
        topic: u32,
        broker: u32,
        at: u64,
        len: u64,
    ) -> Option<&mut [u8]> {
        let p = self.blog_ptr(topic, broker, at, len)?;
        // SAFETY: in bounds (blog_ptr) and exclusively owned per the caller's contract.
        Some(unsafe { std::slice::from_raw_parts_mut(p, len as usize) })
    }

    /// Shared access to a committed log range that cannot be reclaimed while borrowed.
    ///
    /// # Safety
    /// The caller must hold back reclamation of `[at, at + len)` for the lifetime of
    /// the slice (the owning broker's own reads before it may reclaim).
    pub unsafe fn blog_bytes(&self, topic: u32, broker: u32, at: u64, len: u64) -> Option<&[u8]> {
        let p = self.blog_ptr(topic, broker, at, len)?;
        // SAFETY: in bounds (blog_ptr); no writer per the caller's contract.
        Some(unsafe { std::slice::from_raw_parts(p, len as usize) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `map`; no references into
        // it outlive `self` (all accessors borrow `self`).
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len as usize);
        }
    }
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

/// Heartbeat value of a reader slot whose positions are not written yet.
pub const READER_CLAIMING: u64 = 1;

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process on the host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_wire::BatchFlags;
    use std::sync::Arc;

    fn small() -> Capacities {
        Capacities {
            max_topics: 2,
            brokers: 2,
            goi_slots: 16,
            pbr_slots: 8,
            segment_bytes: 8192,
            segments_per_broker: 4,
            seg_map_slots: 8,
        }
    }

    #[test]
    fn releasing_a_brokers_reader_slots_frees_only_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::create(&dir.path().join("r"), small()).unwrap();
        for (slot, broker) in [(0u32, 1u64), (1, 0), (2, 1)] {
            r.reader_slot_claimed(1, slot);
            r.reader_owner(1, slot).store(broker + 1, Ordering::Release);
            r.reader_position(1, slot, 0).store(10, Ordering::Release);
            r.reader_heartbeat(1, slot)
                .store(monotonic_ns(), Ordering::Release);
        }
        let stall = std::time::Duration::from_secs(30);
        assert_eq!(r.reader_floor(1, 0, stall), 10);
        assert_eq!(r.release_reader_slots(1), 2);
        assert_eq!(r.reader_heartbeat(1, 0).load(Ordering::Acquire), 0);
        assert_ne!(
            r.reader_heartbeat(1, 1).load(Ordering::Acquire),
            0,
            "broker 0's"
        );
        assert_eq!(r.reader_heartbeat(1, 2).load(Ordering::Acquire), 0);
        assert_eq!(r.release_reader_slots(1), 0, "nothing left to free");
    }

    #[test]
    fn prefault_keeps_the_contents_and_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let r = Region::create(&path, small()).unwrap();
        r.topic_seq(1).committed_seq.store(7, Ordering::Release);
        r.prefault().unwrap();
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 7);
        assert_eq!(r.topic_seq(0).committed_seq.load(Ordering::Acquire), 0);
        let again = Region::attach(&path, Some(small())).unwrap();
        assert_eq!(again.topic_seq(1).committed_seq.load(Ordering::Acquire), 7);
    }

    #[test]
    fn create_then_attach_from_another_handle_shares_memory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let a = Region::create(&path, small()).unwrap();
        let b = Region::attach(&path, Some(small())).unwrap();
        a.topic_seq(1).committed_seq.store(42, Ordering::Release);
        assert_eq!(b.topic_seq(1).committed_seq.load(Ordering::Acquire), 42);
        // The file is sparse: far fewer blocks than its length.
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(&path).unwrap();
        assert!(md.blocks() * 512 < md.len());
    }

    #[test]
    fn attach_checks_magic_version_and_capacities() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        drop(Region::create(&path, small()).unwrap());
        let other = Capacities {
            pbr_slots: 16,
            ..small()
        };
        match Region::attach(&path, Some(other)) {
            Err(RegionError::LayoutMismatch { field, .. }) => assert_eq!(field, "pbr_slots"),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("mismatched capacities accepted"),
        }
        // Corrupt the version.
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &9u64.to_le_bytes(), H_VERSION).unwrap();
        assert!(matches!(
            Region::attach(&path, None),
            Err(RegionError::VersionMismatch { found: 9, .. })
        ));
        std::os::unix::fs::FileExt::write_all_at(&f, b"NOTAREGN", 0).unwrap();
        assert!(matches!(
            Region::attach(&path, None),
            Err(RegionError::BadMagic { .. })
        ));
        let garbage = dir.path().join("garbage");
        std::fs::write(&garbage, b"hello").unwrap();
        assert!(Region::attach(&garbage, None).is_err());
    }

    #[test]
    fn topic_meta_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::create(&dir.path().join("r"), small()).unwrap();
        assert!(r.topic_meta(0).is_none());
        let meta = TopicMeta {
            name: "orders".into(),
            order: 2,
            replication_factor: 1,
            default_ack: 1,
            generation: 3,
            created_unix_ms: 99,
            retention_bytes: 1 << 30,
            retention_ms: 3_600_000,
            position_ceiling: 1 << 40,
        };
        r.write_topic_meta(0, &meta);
        assert_eq!(r.topic_meta(0).unwrap(), meta);
    }

    #[test]
    fn a_deleted_topic_is_neither_described_nor_found_but_keeps_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let r = Region::create(&path, small()).unwrap();
        r.write_topic_meta(1, &TopicMeta::new("gone", 2));
        r.topic_seq(1).committed_seq.store(5, Ordering::Release);
        assert!(!r.topic_deleted(1) && !r.topic_deleted(0));
        assert!(r.topic_slot_used(1) && !r.topic_slot_used(0));
        r.delete_topic(1);
        assert!(r.topic_slot_used(1), "until a new region");
        assert!(r.topic_deleted(1), "a free slot is not a deleted one");
        assert!(r.topic_meta(1).is_none());
        assert!(r.find_topic("gone").is_none());
        // What processes still hold of it is left alone for them to let go of.
        assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 5);
        // Another mapping (a follower, a restart reading the previous region) agrees.
        let other = Region::attach(&path, None).unwrap();
        assert!(other.topic_deleted(1) && other.topic_meta(1).is_none());
    }

    #[test]
    fn retiring_shows_in_every_mapping_of_the_region() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r");
        let r = Region::create(&path, small()).unwrap();
        let other = Region::attach(&path, None).unwrap();
        assert!(
            !r.is_retired() && !other.is_retired(),
            "a new region is live"
        );
        other.retire();
        assert!(r.is_retired(), "the other mapping sees it");
        assert!(
            Region::attach(&path, None).unwrap().is_retired(),
            "and it stays"
        );
    }

    #[test]
    fn a_new_region_was_created_this_boot() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::create(&dir.path().join("r"), small()).unwrap();
        assert!(r.created_this_boot());
        r.word(H_BOOT_ID).fetch_xor(1, Ordering::Relaxed);
        assert!(
            !r.created_this_boot(),
            "a region from another boot is not trusted"
        );
    }

    #[test]
    fn pbr_token_guards_slot_and_detects_reuse() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::create(&dir.path().join("r"), small()).unwrap();
        assert!(r.pbr_read(0, 1, 3).is_none());
        let h = BatchHeader {
            batch_seq: 5,
            num_msg: 2,
            flags: BatchFlags::VALID,
            pbr_index: 3,
            total_size: 128,
            ..Default::default()
        };
        r.pbr_commit(0, 1, 3, &h);
        let got = r.pbr_read(0, 1, 3).unwrap();
        assert_eq!(got.batch_seq, 5);
        assert_eq!(got.publish_commit, 4);
        // Index 11 maps to the same slot (8 slots): the old token must not satisfy it.
        assert!(r.pbr_read(0, 1, 11).is_none());
        r.pbr_commit(0, 1, 11, &h);
        assert!(!r.pbr_holds(0, 1, 3));
        assert!(r.pbr_read(0, 1, 3).is_none());
    }

    #[test]
    fn goi_entry_roundtrip_and_wrap_detection() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::create(&dir.path().join("r"), small()).unwrap();
        let e = GoiEntry {
            batch_id: 1,
            total_order: 100,
            blog_offset: 4096,
            pbr_index: 7,
            client_id: 9,
            client_seq: 3,
            session_epoch: 0,
            payload_size: 640,
            num_msg: 10,
            broker_id: 1,
            flags: 0,
            replication_token: 0,
            session_key_hash: 0x5eed,
        };
        r.goi_write(1, 5, &e);
        assert_eq!(r.goi_read(1, 5).unwrap(), e);
        assert_eq!(r.goi_slot_occupant(1, 21), Some(5));
        r.goi_write(1, 21, &e);
        assert!(r.goi_read(1, 5).is_none());
    }

    #[test]
    fn blog_pointers_stay_inside_one_mapped_segment() {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::create(&dir.path().join("r"), small()).unwrap();
        assert!(r.blog_ptr(0, 0, 0, 64).is_none(), "unmapped segment");
        r.seg_map_publish(0, 0, 0, 2);
        assert!(r.blog_ptr(0, 0, 0, 8192).is_some());
        assert!(r.blog_ptr(0, 0, 8000, 200).is_none(), "straddles a segment");
        assert!(r.blog_ptr(0, 0, 0, u64::MAX).is_none(), "overflow");
        assert!(r.blog_ptr(0, 0, 8192, 1).is_none(), "next segment unmapped");
        // SAFETY: nothing else uses this log in the test.
        let bytes = unsafe { r.blog_bytes_mut(0, 0, 64, 4).unwrap() };
        bytes.copy_from_slice(b"abcd");
        let other = Region::attach(r.path(), None).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { other.blog_bytes(0, 0, 64, 4).unwrap() }, b"abcd");
    }

    /// A writer publishes PBR slots around a small ring while a reader follows with
    /// the token protocol and reclaims behind itself: the reader sees every index
    /// exactly once, in order, with the payload field the writer stored for it.
    #[test]
    fn pbr_ring_writer_reader_stress() {
        let dir = tempfile::tempdir().unwrap();
        let r = Arc::new(Region::create(&dir.path().join("r"), small()).unwrap());
        const N: u64 = 200_000;
        let w = r.clone();
        let writer = std::thread::spawn(move || {
            let log = w.log(0, 0);
            for i in 0..N {
                while i >= log.reclaimed_pbr.load(Ordering::Acquire) + 8 {
                    std::hint::spin_loop();
                }
                let h = BatchHeader {
                    batch_seq: i * 3,
                    num_msg: 1,
                    total_size: 64,
                    pbr_index: i,
                    ..Default::default()
                };
                w.pbr_commit(0, 0, i, &h);
            }
        });
        let log = r.log(0, 0);
        let mut next = 0;
        while next < N {
            match r.pbr_read(0, 0, next) {
                Some(h) => {
                    assert_eq!(h.batch_seq, next * 3);
                    assert_eq!(h.pbr_index, next);
                    next += 1;
                    log.reclaimed_pbr.store(next, Ordering::Release);
                }
                None => std::hint::spin_loop(),
            }
        }
        writer.join().unwrap();
    }

    /// The GOI seqlock: a writer laps a tiny ring many times while a reader samples
    /// arbitrary indices. Whatever `goi_read` returns must be exactly the entry the
    /// writer stored for that index, never a mix of two laps.
    #[test]
    fn goi_readers_never_accept_a_torn_entry() {
        let dir = tempfile::tempdir().unwrap();
        let r = Arc::new(Region::create(&dir.path().join("r"), small()).unwrap());
        let entry = |g: u64| GoiEntry {
            batch_id: g,
            total_order: g * 3,
            blog_offset: g * 5,
            pbr_index: g * 7,
            client_id: g * 11,
            client_seq: g * 13,
            session_epoch: g,
            payload_size: g as u32,
            num_msg: (g as u32).wrapping_mul(17),
            broker_id: g as u16,
            flags: 0,
            replication_token: 0,
            session_key_hash: g * 19,
        };
        const N: u64 = 300_000;
        let w = r.clone();
        let writer = std::thread::spawn(move || {
            for g in 0..N {
                w.goi_write(0, g, &entry(g));
            }
        });
        let mut accepted = 0u64;
        let mut probe = 0u64;
        while !writer.is_finished() {
            let g = probe % N;
            probe = probe
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if let Some(e) = r.goi_read(0, g) {
                assert_eq!(e, entry(g), "torn or foreign entry accepted for {g}");
                accepted += 1;
            }
            // Also follow the writer closely, where races are likeliest.
            if let Some(latest) = r.goi_slot_occupant(0, probe) {
                if let Some(e) = r.goi_read(0, latest) {
                    assert_eq!(e, entry(latest));
                    accepted += 1;
                }
            }
        }
        writer.join().unwrap();
        assert!(accepted > 0);
    }

    /// The sequencer rewrites one session slot over and over, alternating between two
    /// clients whose marks differ, while a reader reads it: every read it accepts is
    /// one whole record, never one client's id with the other's marks.
    #[test]
    fn a_session_slot_rewritten_for_another_client_never_reads_torn() {
        let dir = tempfile::tempdir().unwrap();
        let r = Arc::new(Region::create(&dir.path().join("r"), small()).unwrap());
        let record = |i: u64| {
            let client = i % 2;
            SessionRecord {
                state: SessionState::Open,
                client_id: client,
                session_epoch: 10 + client,
                committed_hwm: 100 * client + i,
                last_active_ms: 0,
                opened_at: client,
                key_hash: 1000 + client,
            }
        };
        const WRITES: u64 = 200_000;
        let writer = {
            let r = r.clone();
            std::thread::spawn(move || {
                for i in 0..WRITES {
                    r.session_write(0, 3, &record(i));
                }
            })
        };
        let mut accepted = 0u64;
        // Until the writer is done and at least one read got through (on a busy machine
        // the writer may finish before this thread first runs).
        while !writer.is_finished() || accepted == 0 {
            if let Some(rec) = r.session_read(0, 3) {
                let client = rec.client_id;
                assert_eq!(rec.session_epoch, 10 + client, "{rec:?}");
                assert_eq!(rec.key_hash, 1000 + client, "{rec:?}");
                assert_eq!(rec.committed_hwm % 2, client, "{rec:?}");
                if client == 1 {
                    assert!(rec.committed_hwm >= 100, "{rec:?}");
                }
                accepted += 1;
            }
        }
        writer.join().unwrap();
        assert!(accepted > 0);
        assert_eq!(r.session_read(0, 3), Some(record(WRITES - 1)));
    }
}
