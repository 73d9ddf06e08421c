//! The start-up check that the region file's filesystem has room for the whole region.
//!
//! The region is a memory-mapped file. A page the filesystem has no room for is not an
//! error anywhere a program can catch it: the first write to it kills the process with
//! SIGBUS, without a word (a 64 MiB Docker `/dev/shm` under the default 2.9 GiB region
//! does exactly that). So `serve` refuses to start unless the filesystem could hold
//! every byte of the region, prefaulted or not, and says which settings make it smaller.

use crate::{ServerConfig, ServerError};
use std::path::Path;

/// Refuses to create the region of `config` on a filesystem without room for all of it.
pub(crate) fn check_region_room(config: &ServerConfig) -> Result<(), ServerError> {
    let path = config.region_path();
    let need = embarcadero_region::Layout::new(config.capacities())?.total_len;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // A directory that cannot be examined fails the region's creation right after,
    // with the reason: nothing to add here.
    let Ok(free) = free_bytes(dir) else {
        return Ok(());
    };
    // The previous region file is removed before the new one is created.
    let available = free.saturating_add(allocated_bytes(&path));
    refusal(need, available, &path, config).map_or(Ok(()), |e| Err(ServerError::Start(e)))
}

/// Bytes an unprivileged process may still allocate on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a NUL-terminated path and `stat` is a valid out-pointer that
    // statvfs fills in full when it returns 0.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful call above.
    let stat = unsafe { stat.assume_init() };
    // The fields are narrower than u64 on some platforms.
    #[allow(clippy::unnecessary_cast)]
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Disk space the file at `path` holds now (0 if there is none).
fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map_or(0, |m| m.blocks().saturating_mul(512))
}

/// The error for a region of `need` bytes where `available` bytes are free, or `None`
/// if it fits. It names the settings that make the region smaller, with their share.
fn refusal(need: u64, available: u64, path: &Path, config: &ServerConfig) -> Option<String> {
    if need <= available {
        return None;
    }
    let r = &config.region;
    let logs = u64::from(config.brokers)
        .saturating_mul(u64::from(r.segments_per_broker))
        .saturating_mul(r.segment_bytes);
    Some(format!(
        "the region file {} needs {} but its filesystem has only {} free; the server would be killed (SIGBUS) once it wrote past that. \
         Lower region.segments_per_broker ({}), region.segment_bytes ({}) or brokers ({}): the brokers' logs take {}; \
         or region.max_topics ({}), region.goi_slots ({}) or region.pbr_slots ({}): the topic tables take {}; \
         or put region.path on a filesystem with more room (a tmpfs such as /dev/shm is sized with mount -o size=)",
        path.display(),
        human_bytes(need),
        human_bytes(available),
        r.segments_per_broker,
        human_bytes(r.segment_bytes),
        config.brokers,
        human_bytes(logs.min(need)),
        r.max_topics,
        r.goi_slots,
        r.pbr_slots,
        human_bytes(need.saturating_sub(logs)),
    ))
}

/// `bytes` in the largest binary unit that keeps a whole part: "8 MiB", "0.9 GiB".
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default_region_bytes(config: &ServerConfig) -> u64 {
        embarcadero_region::Layout::new(config.capacities())
            .unwrap()
            .total_len
    }

    /// A 64 MiB tmpfs (Docker's default /dev/shm) under the default region.
    #[test]
    fn a_region_larger_than_the_free_space_is_refused_with_the_settings_to_lower() {
        let config = ServerConfig::default();
        let need = default_region_bytes(&config);
        let path = Path::new("/dev/shm/embarcadero");
        let e = refusal(need, 64 << 20, path, &config).expect("refused");
        for part in [
            "/dev/shm/embarcadero",
            &human_bytes(need),
            "only 64 MiB free",
            "region.segments_per_broker (24)",
            "region.segment_bytes (8 MiB)",
            "brokers (4)",
            "the brokers' logs take 768 MiB",
            "region.max_topics (256)",
        ] {
            assert!(e.contains(part), "{part:?} missing from {e}");
        }
        assert_eq!(refusal(need, need, path, &config), None);
    }

    #[test]
    fn the_free_space_of_a_real_directory_is_read() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_bytes(dir.path()).unwrap() > 0);
        assert!(free_bytes(&dir.path().join("missing")).is_err());
        let file = dir.path().join("f");
        std::fs::write(&file, vec![1u8; 64 << 10]).unwrap();
        assert!(allocated_bytes(&file) >= 64 << 10);
        assert_eq!(allocated_bytes(&dir.path().join("missing")), 0);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human_bytes(512), "512 bytes");
        assert_eq!(human_bytes(8 << 20), "8 MiB");
        assert_eq!(human_bytes(1536 << 20), "1.5 GiB");
    }
}
