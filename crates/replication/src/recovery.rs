//! Start-up recovery. The server always starts on a fresh region and refills it from
//! what survived:
//!
//! - each replicated topic's replica logs are opened (torn tails cut), brought to one
//!   common end (a shorter log copies what it lacks from the longest one), then extended
//!   with whatever the previous region had committed beyond that, when that region is
//!   trustworthy (created since the last boot: a process crash leaves it intact);
//! - the new region's GOI continues where the log ends, so positions never go back, and
//!   the order-5 session table is rebuilt from the records;
//! - a memory-only topic (RF 1) keeps its positions (and sessions) if the previous region
//!   is trustworthy, but not its data: it only ever lived in memory.

use crate::reader::{DiskReader, DiskSeek};
use crate::record::RecordHeader;
use crate::store::{fold_session, SessionMark, TopicStore};
use embarcadero_region::{GoiEntry, Region, SessionRecord, SessionState, SESSION_SLOTS};
use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

/// Where a topic continues in the new region.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resume {
    /// The next GOI index.
    pub next_seq: u64,
    /// The next global position.
    pub next_position: u64,
    /// Order 5: each session's epoch and committed high-water mark.
    pub sessions: BTreeMap<u64, SessionMark>,
    /// Orders 0 and 1: where each broker's positions continue (its log's message
    /// count), by broker id; empty for ordered topics.
    pub broker_positions: Vec<u64>,
}

/// A topic of the previous region: the region and the topic's slot in it.
pub type OldTopic<'a> = (&'a Region, u32);

/// Recovers a replicated topic from its replica logs (`topic_dirs[r - 1]` for replica
/// `r`) and, if given, the previous region. Returns the opened logs, all ending at
/// [`Resume::next_seq`] and all durable.
pub fn recover_replicated(
    topic_dirs: &[PathBuf],
    segment_bytes: u64,
    old: Option<OldTopic<'_>>,
) -> io::Result<(Vec<TopicStore>, Resume)> {
    let mut stores = topic_dirs
        .iter()
        .map(|d| TopicStore::open(d, segment_bytes))
        .collect::<io::Result<Vec<_>>>()?;
    let longest = (0..stores.len())
        .max_by_key(|i| stores[*i].next_seq())
        .expect("a replicated topic has at least one replica");
    let mut sessions = stores[longest].sessions().clone();
    for i in 0..stores.len() {
        if i != longest && stores[i].next_seq() < stores[longest].next_seq() {
            let (source, target) = if i < longest {
                let (a, b) = stores.split_at_mut(longest);
                (&b[0], &mut a[i])
            } else {
                let (a, b) = stores.split_at_mut(i);
                (&a[longest], &mut b[0])
            };
            repair(source, target)?;
        }
    }
    // The replica workers copy from the new region's GOI, which starts at the common
    // end: a log left short here could never catch up. (Checked before the previous
    // region's batches are appended, which `drain` does to every log alike.)
    if let Some(short) = stores.iter().find(|s| s.next_seq() != stores[0].next_seq()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} ends at record {} and could not be brought to {}, where the other replicas end; check its segments",
                short.dir().display(),
                short.next_seq(),
                stores[0].next_seq()
            ),
        ));
    }
    if let Some((region, slot)) = old {
        drain(region, slot, &mut stores, &mut sessions)?;
        adopt_session_keys(region, slot, &mut sessions);
    }
    for s in &mut stores {
        s.sync()?;
    }
    let resume = Resume {
        next_seq: stores[0].next_seq(),
        next_position: stores[0].next_position(),
        sessions,
        broker_positions: Vec::new(),
    };
    // What the seed starts the new region's GOI at: every log ends there, durable.
    assert!(
        stores.iter().all(|s| s.durable_seq() == resume.next_seq
            && s.next_seq() == resume.next_seq
            && s.next_position() == resume.next_position),
        "the recovered replica logs of {:?} end at different places",
        topic_dirs
    );
    // Folded from records below that end.
    debug_assert!(
        resume
            .sessions
            .values()
            .all(|m| m.last_seq < resume.next_seq),
        "a session mark beyond the recovered log"
    );
    Ok((stores, resume))
}

/// Takes each session's key binding from the previous region's table, where the
/// disk records (which do not carry it) left it unknown: a restart on the same host's
/// region keeps every session its owner's. Without a previous region, sessions bind
/// again with their next batch (`docs/DESIGN.md`, "Order-5 session keys").
fn adopt_session_keys(region: &Region, slot: u32, sessions: &mut BTreeMap<u64, SessionMark>) {
    for s in 0..SESSION_SLOTS {
        let Some(r) = region.session_read(slot, s) else {
            continue;
        };
        // The same session as the marks: opened no later than their latest batch (a
        // newer session of the id, opened after it, has a key of its own).
        if let Some(m) = sessions.get_mut(&r.client_id) {
            if m.key_hash == 0 && m.epoch <= r.session_epoch && r.opened_at <= m.last_seq {
                m.key_hash = r.key_hash;
            }
        }
    }
}

/// Copies the records `target` lacks from `source` (both of the same topic).
fn repair(source: &TopicStore, target: &mut TopicStore) -> io::Result<()> {
    let mut reader = DiskReader::new(source.dir());
    let end = source.durable_seq();
    let mut seek = reader.seek_seq(target.next_seq(), end)?;
    if let DiskSeek::Gone { .. } = seek {
        // The target ends before the source's oldest record: start it over there.
        target.remove_all()?;
        target.start_at(source.first_seq(), source.first_position())?;
        seek = reader.seek_seq(target.next_seq(), end)?;
    }
    if !matches!(seek, DiskSeek::At { .. }) {
        return Ok(());
    }
    tracing::info!(
        from = %source.dir().display(),
        to = %target.dir().display(),
        records = end - target.next_seq(),
        "repairing a replica log that is behind"
    );
    let mut payload = Vec::new();
    while let Some(h) = reader.next(end, &mut payload)? {
        target.append(&h, &payload)?;
    }
    target.sync()?;
    // The reader stops only at the source's durable end (a missing record is an error),
    // so the target now ends where the source does.
    assert!(
        target.next_seq() == end && target.next_position() == source.next_position(),
        "{} was repaired up to ({}, {}), {} ends at ({end}, {})",
        target.dir().display(),
        target.next_seq(),
        target.next_position(),
        source.dir().display(),
        source.next_position()
    );
    Ok(())
}

/// Appends what the previous region committed beyond the logs' end.
fn drain(
    region: &Region,
    slot: u32,
    stores: &mut [TopicStore],
    sessions: &mut BTreeMap<u64, SessionMark>,
) -> io::Result<()> {
    let committed = region.topic_seq(slot).committed_seq.load(Ordering::Acquire);
    let start = stores[0].next_seq();
    // Every record below goes to every log: they must end at one place already.
    assert!(
        stores.iter().all(|s| s.next_seq() == start),
        "the replica logs are drained from one common end"
    );
    let mut g = start;
    while g < committed {
        let Some((e, payload)) = old_batch(region, slot, g, committed) else {
            break;
        };
        if e.total_order != stores[0].next_position() {
            tracing::warn!(
                slot,
                g,
                "GOI entry {g} does not continue the replica log; recovery stops there"
            );
            break;
        }
        let h = RecordHeader::of(g, &e, payload);
        for s in stores.iter_mut() {
            s.append(&h, payload)?;
        }
        fold_session(
            sessions,
            e.client_id,
            e.session_epoch,
            e.client_seq,
            g,
            e.flags,
            e.session_key_hash,
        );
        g += 1;
    }
    if g > start {
        tracing::info!(
            slot,
            batches = g - start,
            "recovered batches from the previous region into the replicas"
        );
    }
    Ok(())
}

/// The previous region's committed batch `g` of topic `slot`: its GOI entry and its
/// payload, for [`drain`]. `None` (with the reason logged) where recovery must stop: the
/// entry is gone, its batch was reclaimed, or it points outside its log.
fn old_batch(region: &Region, slot: u32, g: u64, committed: u64) -> Option<(GoiEntry, &[u8])> {
    let Some(e) = region.goi_read(slot, g) else {
        tracing::warn!(
            slot,
            g,
            committed,
            "the previous region no longer holds GOI entry {g}; recovery stops there"
        );
        return None;
    };
    let log = region.log(slot, e.broker_id as u32);
    if log.reclaimed_blog.load(Ordering::Acquire) > e.blog_offset {
        tracing::warn!(
            slot,
            g,
            "the previous region reclaimed batch {g}; recovery stops there"
        );
        return None;
    }
    // SAFETY: the previous region has no other user (the server holds the data
    // directory's lock, and its previous owner is gone), so nothing reclaims or
    // rewrites this committed range while it is read.
    let Some(payload) = (unsafe {
        region.blog_bytes(
            slot,
            e.broker_id as u32,
            e.blog_offset,
            e.payload_size as u64,
        )
    }) else {
        tracing::warn!(
            slot,
            g,
            "GOI entry {g} of the previous region points outside its log; recovery stops there"
        );
        return None;
    };
    Some((e, payload))
}

/// A memory-only topic: where it stood in the previous region (its data is gone).
pub fn resume_memory_only((region, slot): OldTopic<'_>) -> Resume {
    // Not the stored `next_position` alone: a sequencer killed between publishing an
    // epoch and its positions left it behind the last committed entry.
    let (committed, next_position) = region.sequence_end(slot);
    let mut sessions = BTreeMap::new();
    // The table holds each client id's latest session; GOI entries of the id from before
    // that session was opened belong to an earlier one, which ended.
    let mut table = BTreeMap::new();
    for s in 0..SESSION_SLOTS {
        if let Some(r) = region.session_read(slot, s) {
            table.insert(r.client_id, r);
            sessions.insert(
                r.client_id,
                SessionMark {
                    epoch: r.session_epoch,
                    hwm: r.committed_hwm,
                    last_seq: r.opened_at,
                    key_hash: r.key_hash,
                },
            );
        }
    }
    // The table may lag the GOI by the last epoch.
    let from = committed.saturating_sub(region.capacities().goi_slots);
    for g in from..committed {
        if let Some(e) = region.goi_read(slot, g) {
            if table.get(&e.client_id).is_some_and(|r| g < r.opened_at) {
                continue;
            }
            fold_session(
                &mut sessions,
                e.client_id,
                e.session_epoch,
                e.client_seq,
                g,
                e.flags,
                e.session_key_hash,
            );
        }
    }
    // A start in the ring resets the epoch too; the table's may be above it (a session
    // reopened after a fence and committed nothing since).
    for (client, r) in &table {
        if let Some(m) = sessions.get_mut(client) {
            m.epoch = m.epoch.max(r.session_epoch);
        }
    }
    Resume {
        next_seq: committed,
        next_position,
        sessions,
        broker_positions: Vec::new(),
    }
}

/// Orders 0 and 1 of a memory-only topic: each broker's message count in the previous
/// region (its next per-broker position), by broker id. `frontier_msgs` is stored before
/// the written frontier, so it covers every position a subscriber could have seen.
pub fn broker_positions_of((region, slot): OldTopic<'_>) -> Vec<u64> {
    (0..region.capacities().brokers)
        .map(|b| region.log(slot, b).frontier_msgs.load(Ordering::Acquire))
        .collect()
}

/// Writes a recovered topic into a fresh region before any broker, sequencer or
/// replica starts: its sequence line, its brokers' positions (orders 0 and 1), its
/// replicas' progress, its session table.
pub fn seed(region: &Region, topic: u32, replication_factor: u8, resume: &Resume) {
    // The owners' handles: the seed writes on behalf of owners that do not run yet.
    let seq = region.sequencer_topic(topic);
    // Once, into a fresh region: a line that moved was written by a running owner.
    assert!(
        seq.committed_seq.load(Ordering::Acquire) == 0
            && seq.next_position.load(Ordering::Acquire) == 0,
        "topic {topic}'s sequence line is seeded once, before any sequencer"
    );
    seq.start_position
        .store(resume.next_position, Ordering::Release);
    seq.next_position
        .advance(resume.next_position, Ordering::Release);
    seq.committed_seq
        .advance(resume.next_seq, Ordering::Release);
    // Broker-owned, but no broker runs yet; each one's service thread numbers its log's
    // next batch from here (`written_prefix` of an empty log).
    let brokers = region.capacities().brokers as usize;
    for (b, p) in resume.broker_positions.iter().take(brokers).enumerate() {
        region
            .broker_line(topic, b as u32)
            .frontier_msgs
            .store(*p, Ordering::Release);
    }
    for r in 1..replication_factor as u32 {
        let p = region.replica_line(topic, r);
        p.own_durable_seq
            .advance(resume.next_seq, Ordering::Release);
        p.durable_seq.advance(resume.next_seq, Ordering::Release);
        p.durable_position
            .advance(resume.next_position, Ordering::Release);
    }
    seed_sessions(region, topic, replication_factor, resume);
}

/// Writes the recovered sessions into the fresh region's session table (see [`seed`]).
fn seed_sessions(region: &Region, topic: u32, replication_factor: u8, resume: &Resume) {
    // The table keeps the most recently active sessions; the others ended (a client id
    // that comes back starts a new session, and one that reconnects is told).
    let mut recent: Vec<(&u64, &SessionMark)> = resume.sessions.iter().collect();
    recent.sort_by_key(|(_, m)| std::cmp::Reverse(m.last_seq));
    if recent.len() > SESSION_SLOTS as usize {
        tracing::info!(
            topic,
            sessions = recent.len(),
            "more recovered sessions than session slots; the least recently active ended"
        );
    }
    let now_ms = embarcadero_region::unix_ms();
    for (slot, (client_id, m)) in recent.into_iter().take(SESSION_SLOTS as usize).enumerate() {
        tracing::debug!(
            topic,
            client = client_id,
            epoch = m.epoch,
            hwm = m.hwm,
            last_seq = m.last_seq,
            "order-5 session recovered"
        );
        region.session_write(
            topic,
            slot as u32,
            &SessionRecord {
                state: SessionState::Open,
                client_id: *client_id,
                session_epoch: m.epoch,
                opener: 0,
                committed_hwm: m.hwm,
                // Not on disk: idle counts from the recovery.
                last_active_ms: now_ms,
                // The new region's GOI starts empty.
                opened_at: 0,
                key_hash: m.key_hash,
            },
        );
        region
            .chain_marks(topic)
            .session_durable_hwm(slot as u32)
            .advance(
                if replication_factor >= 2 { m.hwm } else { 0 },
                Ordering::Release,
            );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::tests::write_log;
    use crate::store::tests::{files_set_aside, segment_names};
    use crate::store::{list_segments, SET_ASIDE_DIR};
    use std::fs::OpenOptions;
    use std::os::unix::fs::{FileExt, MetadataExt};

    /// A memory-only topic restarted with its previous region continues its positions
    /// after the last committed GOI entry, also when that region's sequencer was killed
    /// between publishing `committed_seq` and adding the epoch's positions: continuing
    /// from the stored word would hand out positions the entry already had.
    #[test]
    fn a_memory_only_topic_continues_after_the_last_committed_entry() {
        let dir = tempfile::tempdir().unwrap();
        let caps = embarcadero_region::Capacities {
            max_topics: 1,
            brokers: 1,
            goi_slots: 64,
            pbr_slots: 64,
            segment_bytes: 4096,
            segments_per_broker: 2,
            seg_map_slots: 8,
        };
        let region = Region::create(&dir.path().join("region"), caps).unwrap();
        region.write_topic_meta(0, &embarcadero_region::TopicMeta::new("t", 2));
        for (g, (first, n)) in [(0u64, 3u32), (3, 2)].into_iter().enumerate() {
            let e = embarcadero_region::GoiEntry {
                total_order: first,
                num_msg: n,
                pbr_index: g as u64,
                ..Default::default()
            };
            region.goi_write(0, g as u64, &e);
        }
        let seq = region.sequencer_topic(0);
        seq.committed_seq.advance(2, Ordering::Release);
        // The kill: the first epoch's positions are stored, the second's are not.
        seq.next_position.advance(3, Ordering::Release);
        let resume = resume_memory_only((&region, 0));
        assert_eq!((resume.next_seq, resume.next_position), (2, 5));
        // A whole publication: the two agree.
        seq.next_position.advance(5, Ordering::Release);
        assert_eq!(resume_memory_only((&region, 0)).next_position, 5);
    }

    #[test]
    fn a_replica_with_a_damaged_segment_is_refilled_from_another_and_keeps_its_files_aside() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        drop(write_log(a.path(), 20));
        drop(write_log(b.path(), 20));
        let segments = list_segments(a.path()).unwrap();
        assert!(segments.len() > 3);
        // Bit rot in the first record header of replica A's second segment.
        let f = OpenOptions::new()
            .write(true)
            .open(&segments[1].path)
            .unwrap();
        f.write_all_at(&[0xff; 8], 0).unwrap();
        // The part before the damage must be kept in place, not rebuilt from B.
        let first = &segments[0].path;
        let (first_inode, first_bytes) = (
            std::fs::metadata(first).unwrap().ino(),
            std::fs::read(first).unwrap(),
        );
        let dirs = vec![a.path().to_path_buf(), b.path().to_path_buf()];
        let (stores, resume) = recover_replicated(&dirs, 400, None).unwrap();
        assert_eq!(resume.next_seq, 20);
        for s in &stores {
            assert_eq!((s.first_seq(), s.durable_seq()), (0, 20));
        }
        let (mut from_a, mut from_b) = (DiskReader::new(a.path()), DiskReader::new(b.path()));
        assert!(matches!(
            from_a.seek_seq(0, 20).unwrap(),
            DiskSeek::At { .. }
        ));
        assert!(matches!(
            from_b.seek_seq(0, 20).unwrap(),
            DiskSeek::At { .. }
        ));
        let (mut pa, mut pb) = (Vec::new(), Vec::new());
        for seq in 0..20 {
            let ha = from_a
                .next(20, &mut pa)
                .unwrap()
                .expect("replica A has every record");
            let hb = from_b
                .next(20, &mut pb)
                .unwrap()
                .expect("replica B has every record");
            assert_eq!((ha.seq, &ha, &pa), (seq, &hb, &pb));
        }
        assert_eq!(std::fs::metadata(first).unwrap().ino(), first_inode);
        assert_eq!(std::fs::read(first).unwrap(), first_bytes);
        // Nothing replica A had was deleted: a copy of the damaged segment and every
        // segment after it are aside; replica B, whole, set nothing aside.
        let aside: Vec<String> = files_set_aside(a.path())
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(aside, segment_names(&segments[1..]));
        assert!(!b.path().join(SET_ASIDE_DIR).exists());
    }
}
