//! The region header check on attach (`Region::check_header`, the pure part of
//! `Region::attach`): any file can be named as the region. Input: the header bytes
//! (at least 96), optionally followed by 8 bytes of file length (else the length the
//! header declares). When the check passes for a small region, the bytes are also
//! written as a sparse file and really attached.
use embarcadero_fuzz::{scratch_dir, u64_at, ScratchFile};
use embarcadero_region::{Capacities, Region, ATTACH_HEAD_LEN};

fn main() {
    let dir = scratch_dir("region");
    // One file, truncated and rewritten for each header that passes (cheaper than
    // removing it and writing a new one); `Region::attach` opens it by path.
    let mut file = ScratchFile::create(dir.join("region"));
    let path = file.path().to_path_buf();
    afl::fuzz!(|data: &[u8]| {
        let head = &data[..data.len().min(ATTACH_HEAD_LEN)];
        let file_len = if data.len() >= ATTACH_HEAD_LEN + 8 {
            u64_at(data, ATTACH_HEAD_LEN)
        } else {
            u64_at(head, 72)
        };
        let _ = Region::check_header(&path, head, file_len, Some(Capacities::default()));
        let Ok(layout) = Region::check_header(&path, head, file_len, None) else {
            return;
        };
        assert!(file_len >= layout.total_len);
        if layout.total_len <= 64 << 20 {
            file.set(head);
            file.set_len(layout.total_len);
            let region = Region::attach(&path, None).expect("a checked header attaches");
            assert_eq!(region.len(), layout.total_len);
            assert_eq!(region.capacities(), layout.caps);
        }
    });
    let _ = std::fs::remove_dir_all(dir);
}
