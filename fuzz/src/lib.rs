//! Helpers shared by the fuzz targets in `src/bin/`.

use std::path::PathBuf;

/// A scratch directory for targets whose decoder reads files: under `$EMBD_FUZZ_TMP`, or
/// `/dev/shm` (tmpfs, so each execution costs no disk I/O), or the system temp dir.
/// One per process; the caller empties it as it needs.
pub fn scratch_dir(target: &str) -> PathBuf {
    let base = std::env::var_os("EMBD_FUZZ_TMP")
        .map(PathBuf::from)
        .or_else(|| {
            let shm = PathBuf::from("/dev/shm");
            shm.is_dir().then_some(shm)
        })
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("embd-fuzz-{target}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Little-endian reads that return 0 past the end of `b`.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    for (i, x) in w.iter_mut().enumerate() {
        *x = b.get(at + i).copied().unwrap_or(0);
    }
    u32::from_le_bytes(w)
}

pub fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    for (i, x) in w.iter_mut().enumerate() {
        *x = b.get(at + i).copied().unwrap_or(0);
    }
    u64::from_le_bytes(w)
}
