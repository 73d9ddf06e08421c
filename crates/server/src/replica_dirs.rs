//! The start-up check that every disk replica's directory can be written.
//!
//! A replica directory that cannot be used (a path through a file, a directory owned by
//! another user, a read-only mount) was found only when a topic's replica log was first
//! opened: `topic create` said the topic survives restarts, `pub` at ack 1 succeeded,
//! and its readers, who read a durable topic only below what the replicas hold, waited
//! for ever, with the log repeating an error that named no path (an operator's first
//! days, session 34). The server now refuses to start instead, naming the directory.

use crate::ServerError;
use std::path::Path;

/// A file made and removed in each directory to show that it can be written.
const PROBE: &str = ".embarcadero-write-probe";

/// Makes each replica directory (replica 1 first) if missing, and checks that a file can
/// be made in it.
pub(crate) fn check_replica_dirs(dirs: &[impl AsRef<Path>]) -> Result<(), ServerError> {
    for (index, dir) in dirs.iter().enumerate() {
        let dir = dir.as_ref();
        let replica = index as u32 + 1;
        let refused = |source: std::io::Error| ServerError::ReplicaDir {
            replica,
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(refused)?;
        let probe = dir.join(PROBE);
        std::fs::File::create(&probe).map_err(refused)?;
        std::fs::remove_file(&probe).map_err(refused)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_dir_that_cannot_be_made_is_refused_with_its_path() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let good = tmp.path().join("r1");
        let bad = file.join("r2");
        let e = check_replica_dirs(&[&good, &bad]).unwrap_err().to_string();
        assert!(
            e.contains("replica 2") && e.contains(&bad.display().to_string()),
            "{e}"
        );
        assert!(good.is_dir(), "replica 1's directory was made");
        assert!(!good.join(PROBE).exists(), "the probe is removed");
        check_replica_dirs(&[&good]).unwrap();
    }
}
