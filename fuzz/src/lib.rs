//! Helpers shared by the fuzz targets in `src/bin/`: scratch space for targets whose
//! decoder reads files, and byte readers. They touch only the scratch directory.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A scratch directory for targets whose decoder reads files: under `$EMBD_FUZZ_TMP`, or
/// `/dev/shm` (tmpfs, so each execution costs no disk I/O), or the system temp dir.
/// One per process; the caller empties it as it needs. afl-fuzz ends its targets with
/// SIGKILL, so nothing removes the directory at exit: the ones of this target whose
/// process is gone are removed here instead.
pub fn scratch_dir(target: &str) -> PathBuf {
    let base = std::env::var_os("EMBD_FUZZ_TMP")
        .map(PathBuf::from)
        .or_else(|| {
            let shm = PathBuf::from("/dev/shm");
            shm.is_dir().then_some(shm)
        })
        .unwrap_or_else(std::env::temp_dir);
    remove_stale(&base, &format!("embd-fuzz-{target}-"));
    let dir = base.join(format!("embd-fuzz-{target}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Removes `base/PREFIX<pid>` for every pid that is no longer a process.
fn remove_stale(base: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let gone = pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists();
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// One file the target rewrites for every input, opened once: truncating and writing it
/// costs two system calls, where `fs::write` (open with truncation, write, close) costs
/// three and a path lookup, on every execution. What the decoder then reads from the
/// path is the same bytes either way.
pub struct ScratchFile {
    path: PathBuf,
    file: File,
}

impl ScratchFile {
    pub fn create(path: PathBuf) -> Self {
        let file = File::create(&path).expect("scratch file");
        Self { path, file }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes the file hold exactly `bytes`.
    pub fn set(&mut self, bytes: &[u8]) {
        self.file.set_len(0).expect("truncate the scratch file");
        self.file
            .write_all_at(bytes, 0)
            .expect("write the scratch file");
    }

    /// Extends (with zeros, sparse) or cuts the file to `len` bytes.
    pub fn set_len(&mut self, len: u64) {
        self.file.set_len(len).expect("resize the scratch file");
    }
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
