//! Taking over a broker id's logs from a previous process (a restarted follower).
//!
//! The region outlives broker processes, so a new process serving the same broker id
//! finds its logs as the old one left them: committed PBR slots, possibly with holes
//! (slots reserved by connections that died before committing), a frontier the old
//! service thread had not yet moved over every committed slot, segments mapped to its
//! logs, and, if publishers failed over while it was dead, a fence per log.
//!
//! Before the new process accepts a connection it
//! 1. makes sure the old process writes nothing more ([`ProcessIdentity::fence_off`])
//!    and records itself as the owner;
//! 2. commits every hole as a void slot, so the frontier and the sequencer can pass;
//! 3. lifts a fence by naming where its own slots start (`resume_pbr`): the slots from
//!    the fence up to there keep the answer publishers got ("not ordered") because the
//!    sequencer treats them as void;
//! 4. continues each log after its last committed slot, with the segment pool rebuilt
//!    from the segments its logs still map.
//!
//! On a fresh region every log is empty and all of this is a no-op, so every broker
//! start takes this path.

use crate::log_writer::{LogWriter, SegmentPool};
use embarcadero_region::{Fenced, LogControl, ProcessIdentity, Region};
use embarcadero_wire::{BatchFlags, BatchHeader};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Where one (topic, broker) log continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LogResume {
    /// Next PBR index to reserve: every slot below it is committed (valid or void).
    pub next_pbr: u64,
    /// End of the reserved log bytes.
    pub tail: u64,
    /// Holes committed as void.
    pub voided: u64,
    /// Slots from a fence to `next_pbr` that will never be ordered.
    pub skipped: u64,
}

/// Longest wait for a killed predecessor to exit.
const PREDECESSOR_EXIT: Duration = Duration::from_secs(10);

/// Step 1: fences off the process recorded as serving `broker`, then records this one.
pub fn take_ownership(region: &Region, broker: u32, incarnation: u64) -> std::io::Result<()> {
    let owner = region.broker_owner(broker);
    if let Some((old, who)) = owner.read() {
        match who.fence_off(PREDECESSOR_EXIT)? {
            Fenced::Killed => tracing::warn!(
                broker,
                pid = who.pid,
                old_incarnation = old,
                "the previous process of this broker was still running (paused?); killed it before taking over its logs"
            ),
            Fenced::OtherHost => tracing::warn!(
                broker,
                pid = who.pid,
                "the previous process of this broker ran on another host; it stops on its own once it sees this incarnation in the region"
            ),
            Fenced::NotRunning | Fenced::Itself => {}
        }
    }
    owner.write(incarnation, &ProcessIdentity::current());
    Ok(())
}

/// Steps 2 and 3 for one log; returns where it continues.
pub fn resume_log(region: &Region, topic: u32, broker: u32) -> LogResume {
    let caps = region.capacities();
    let log = region.log(topic, broker);
    let frontier = log.written_frontier.load(Ordering::Acquire);
    let reclaimed_pbr = log.reclaimed_pbr.load(Ordering::Acquire);
    let end = written_prefix(region, topic, broker, frontier).0;
    // The last committed slot: committed slots lie within one ring's length of the
    // reclaimed frontier, and a slot's token names its absolute index, so a token left
    // from an earlier lap never matches.
    let window_end = reclaimed_pbr + caps.pbr_slots;
    let last = (frontier..window_end)
        .rev()
        .find(|&i| region.pbr_holds(topic, broker, i));
    let next_pbr = last.map_or(frontier, |l| l + 1);
    let (end, voided) = void_holes(
        region,
        topic,
        broker,
        frontier,
        next_pbr,
        end,
        reclaimed_pbr,
    );
    // A predecessor that died during a reclamation pass left it open: no pass of its
    // runs any more, so readers need not wait for it.
    let pass = region.broker_line(topic, broker).reclaim_pass;
    if !pass.load(Ordering::Acquire).is_multiple_of(2) {
        pass.add(1, Ordering::Release);
    }
    let skipped = lift_fence(region, &log, topic, broker, next_pbr);
    if voided > 0 || skipped > 0 {
        region.sequencer_bell().ring();
    }
    assert!(
        next_pbr >= reclaimed_pbr && end >= log.reclaimed_blog.load(Ordering::Acquire),
        "log ({topic}, {broker}) continues at or after what it reclaimed"
    );
    LogResume {
        next_pbr,
        tail: end,
        voided,
        skipped,
    }
}

/// Step 2: commits every hole among the slots `frontier..next_pbr` as a void slot at
/// the log's end so far (`end`: the end of the slots below `frontier`). Returns the end
/// of the last slot and how many holes were voided.
fn void_holes(
    region: &Region,
    topic: u32,
    broker: u32,
    frontier: u64,
    next_pbr: u64,
    mut end: u64,
    reclaimed_pbr: u64,
) -> (u64, u64) {
    let mut voided = 0;
    for index in frontier..next_pbr {
        match region.pbr_read(topic, broker, index) {
            Some(h) => {
                // Slots take their bytes in index order (one compare-and-swap reserves
                // both), so the tail this log continues at is the last slot's end. A
                // deleted topic's log, released whole, is reclaimed past its frontier.
                assert!(
                    h.log_offset >= end || reclaimed_pbr > frontier,
                    "log ({topic}, {broker}): slot {index} at byte {}, before the end {end} of the slots below it",
                    h.log_offset
                );
                end = h.log_offset + h.total_size;
            }
            None => {
                let void = BatchHeader {
                    broker_id: broker as u16,
                    flags: BatchFlags::VOID,
                    pbr_index: index,
                    log_offset: end,
                    total_size: 0,
                    topic_id: topic,
                    ..Default::default()
                };
                region.pbr_commit(topic, broker, index, &void);
                voided += 1;
            }
        }
    }
    (end, voided)
}

/// Step 3: lifts a fence not lifted yet by naming where this process's slots start
/// (`next_pbr`). Returns how many slots from the fence on will never be ordered.
fn lift_fence(
    region: &Region,
    log: &LogControl<'_>,
    topic: u32,
    broker: u32,
    next_pbr: u64,
) -> u64 {
    let mut skipped = 0;
    let fence = log.fence_pbr.load(Ordering::Acquire);
    if fence != 0 && log.resumed_fence.load(Ordering::Acquire) != fence {
        // Every slot below the first hole at fence time was committed then, so the
        // committed run reaches the fence.
        assert!(
            next_pbr + 1 >= fence,
            "log ({topic}, {broker}) ends at {next_pbr}, below its fence {fence}"
        );
        skipped = next_pbr + 1 - fence;
        let line = region.broker_line(topic, broker);
        line.resume_pbr.store(next_pbr, Ordering::Release);
        line.resumed_fence.store(fence, Ordering::Release);
    }
    skipped
}

/// End of the log bytes of the slots below `frontier` (the committed prefix), and the
/// messages in its valid slots (the next per-broker position).
///
/// Both come from the last slot of the prefix when it is still in memory: its start
/// offset was numbered before the frontier moved over it, whereas `frontier_msgs` may
/// already count slots beyond `written_frontier` if the previous process died between
/// the two stores.
pub fn written_prefix(region: &Region, topic: u32, broker: u32, frontier: u64) -> (u64, u64) {
    let log = region.log(topic, broker);
    let reclaimed_pbr = log.reclaimed_pbr.load(Ordering::Acquire);
    if frontier > reclaimed_pbr {
        let h = region
            .pbr_read(topic, broker, frontier - 1)
            .expect("a committed, unreclaimed slot below the frontier is readable");
        let valid = if h.flags & BatchFlags::VALID != 0 {
            h.num_msg as u64
        } else {
            0
        };
        (h.log_offset + h.total_size, h.start_logical_offset + valid)
    } else {
        // Everything written is reclaimed: reclamation leaves the frontier there.
        (
            log.reclaimed_blog.load(Ordering::Acquire),
            log.frontier_msgs.load(Ordering::Acquire),
        )
    }
}

/// Step 4: the broker's segment pool, without the segments that hold (or are being
/// filled with) the live part of a log, `[reclaimed_blog, tail)`.
pub fn rebuild_pool(region: &Region, broker: u32, tails: &[(u32, u64)]) -> SegmentPool {
    let caps = region.capacities();
    let seg = caps.segment_bytes;
    let mut used = vec![false; caps.segments_per_broker as usize];
    for &(topic, tail) in tails {
        let reclaimed = region
            .log(topic, broker)
            .reclaimed_blog
            .load(Ordering::Acquire);
        for logical in reclaimed / seg..tail.div_ceil(seg) {
            let physical = region
                .seg_map_lookup(topic, broker, logical)
                .expect("a live logical segment of a log is mapped");
            assert!(
                !std::mem::replace(&mut used[physical as usize], true),
                "physical segment {physical} of broker {broker} is mapped twice"
            );
        }
    }
    SegmentPool::with_used(&used)
}

/// Resumes every log of `broker`; returns the pool and where each log continues.
pub fn resume_broker(
    region: &Arc<Region>,
    broker: u32,
) -> (Arc<SegmentPool>, Vec<(u32, LogResume)>) {
    let caps = region.capacities();
    // An empty log resumes at zero: resuming every log needs no test for "empty". A slot
    // that never held a topic is passed by: resuming reads its whole PBR ring, which
    // with hundreds of slots took seconds and a gigabyte of page cache at every start.
    let resumed: Vec<(u32, LogResume)> = (0..caps.max_topics)
        .map(|topic| match region.topic_slot_used(topic) {
            true => (topic, resume_log(region, topic, broker)),
            false => (topic, LogResume::default()),
        })
        .collect();
    let tails: Vec<(u32, u64)> = resumed.iter().map(|(t, r)| (*t, r.tail)).collect();
    let pool = Arc::new(rebuild_pool(region, broker, &tails));
    for (topic, r) in &resumed {
        if r.next_pbr > 0 {
            tracing::info!(
                broker,
                topic,
                next_pbr = r.next_pbr,
                voided = r.voided,
                skipped = r.skipped,
                "resumed the log a previous process of this broker left"
            );
        }
    }
    (pool, resumed)
}

/// A writer continuing a resumed log.
pub fn resumed_writer(
    region: Arc<Region>,
    pool: Arc<SegmentPool>,
    topic: u32,
    broker: u32,
    r: &LogResume,
) -> LogWriter {
    LogWriter::continuing(region, pool, topic, broker, r.next_pbr, r.tail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log_writer::Reservation;
    use embarcadero_region::Capacities;

    fn caps() -> Capacities {
        Capacities {
            max_topics: 2,
            brokers: 2,
            goi_slots: 64,
            pbr_slots: 16,
            segment_bytes: 4096,
            segments_per_broker: 8,
            seg_map_slots: 16,
        }
    }

    fn commit_valid(region: &Region, topic: u32, broker: u32, r: &Reservation) {
        let h = BatchHeader {
            broker_id: broker as u16,
            flags: BatchFlags::VALID,
            pbr_index: r.pbr_index,
            log_offset: r.log_offset,
            total_size: r.len,
            num_msg: 1,
            topic_id: topic,
            ..Default::default()
        };
        region.pbr_commit(topic, broker, r.pbr_index, &h);
    }

    /// A process that died mid-stream: slots 0, 1 and 3 committed, 2 and 4 reserved
    /// and never committed, the frontier moved over slot 0 only.
    fn crashed_log(region: &Arc<Region>, broker: u32) -> Vec<Reservation> {
        // Only a slot that holds a topic has logs to resume.
        region.write_topic_meta(1, &embarcadero_region::TopicMeta::new("t", 2));
        let pool = Arc::new(SegmentPool::new(caps().segments_per_broker));
        let w = LogWriter::new(region.clone(), pool, 1, broker);
        let r: Vec<Reservation> = (0..5).map(|_| w.reserve(1500).unwrap()).collect();
        for i in [0, 1, 3] {
            commit_valid(region, 1, broker, &r[i]);
        }
        region
            .broker_line(1, broker)
            .written_frontier
            .advance(1, Ordering::Release);
        r
    }

    #[test]
    fn holes_become_void_and_the_log_continues_after_its_last_committed_slot() {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(Region::create(&dir.path().join("r"), caps()).unwrap());
        let before = crashed_log(&region, 1);
        let (pool, resumed) = resume_broker(&region, 1);
        let (_, r) = resumed.iter().find(|(t, _)| *t == 1).copied().unwrap();
        assert_eq!((r.next_pbr, r.voided, r.skipped), (4, 1, 0));
        assert_eq!(r.tail, before[3].log_offset + before[3].len);
        let hole = region.pbr_read(1, 1, 2).expect("the hole is committed");
        assert_eq!(hole.flags, BatchFlags::VOID);
        assert_eq!(hole.log_offset, before[1].log_offset + before[1].len);
        assert!(
            region.pbr_read(1, 1, 4).is_none(),
            "above the last slot: free"
        );
        // Two 1500-byte batches fit one 4096-byte segment: slots 0-1 in logical 0,
        // 2-3 in logical 1 (the reservation of slot 4 opened logical 2 and died).
        assert_eq!(
            pool.free_count(),
            8 - 2,
            "segments of the live range stay used"
        );
        for (t, r) in &resumed {
            if *t != 1 {
                assert_eq!((r.next_pbr, r.tail), (0, 0), "untouched log");
            }
        }
        let w = resumed_writer(region.clone(), pool.clone(), 1, 1, &r);
        let next = w.reserve(1500).unwrap();
        assert_eq!(next.pbr_index, 4);
        assert!(next.log_offset >= r.tail);
        // The dead reservation had mapped logical 2; the successor maps it a second
        // time, and the first physical segment is not lost: it went back to the pool.
        assert_eq!(next.log_offset / caps().segment_bytes, 2);
        assert_eq!(
            pool.free_count(),
            8 - 3,
            "mapping logical 2 again takes one segment, and only one"
        );
        let p = region.blog_ptr(1, 1, next.log_offset, 1500).unwrap() as usize;
        let old = region
            .blog_ptr(1, 1, before[3].log_offset, before[3].len)
            .unwrap() as usize;
        assert!(
            p >= old + 1500 || p + 1500 <= old,
            "new bytes never overlap the last committed batch"
        );
        let again = resume_broker(&region, 1).1;
        assert_eq!(again[1].1.voided, 0, "resuming twice voids nothing more");
    }

    /// Free slots are passed by (their rings are never read at start); a deleted
    /// topic's log is resumed like a live one, so its segments stay counted as used
    /// until the service thread releases them.
    #[test]
    fn only_slots_that_held_a_topic_are_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(Region::create(&dir.path().join("r"), caps()).unwrap());
        crashed_log(&region, 1);
        region.delete_topic(1);
        let (pool, resumed) = resume_broker(&region, 1);
        assert_eq!(resumed[0].1, LogResume::default(), "never held a topic");
        assert_eq!(resumed[1].1.next_pbr, 4, "deleted, still resumed");
        assert_eq!(pool.free_count(), 8 - 2, "its segments are still held");
    }

    #[test]
    fn the_next_position_comes_from_the_prefix_not_a_counter_stored_ahead_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(Region::create(&dir.path().join("r"), caps()).unwrap());
        let before = crashed_log(&region, 1);
        // The old service thread numbered slots 1 and 3 (after the hole is voided) and
        // stored frontier_msgs, then died before storing written_frontier.
        region
            .broker_line(1, 1)
            .frontier_msgs
            .store(3, Ordering::Release);
        assert_eq!(
            written_prefix(&region, 1, 1, 1),
            (before[0].log_offset + before[0].len, 1),
            "one message below frontier 1, whatever the counter says"
        );
    }

    #[test]
    fn a_fenced_log_resumes_after_its_last_slot_and_lifts_the_fence_there() {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(Region::create(&dir.path().join("r"), caps()).unwrap());
        crashed_log(&region, 0);
        // The control plane fenced it at the first hole (slot 2) when it died.
        let log = region.log(1, 0);
        region
            .control_plane()
            .fence_pbr(1, 0)
            .store(2 + 1, Ordering::Release);
        let (_, resumed) = resume_broker(&region, 0);
        let r = resumed[1].1;
        assert_eq!((r.next_pbr, r.voided, r.skipped), (4, 1, 2));
        assert_eq!(log.resume_pbr.load(Ordering::Acquire), 4);
        assert_eq!(log.resumed_fence.load(Ordering::Acquire), 3);
        assert_eq!(
            resume_broker(&region, 0).1[1].1.skipped,
            0,
            "a lifted fence is not lifted twice"
        );
    }

    #[test]
    fn a_paused_predecessor_on_this_host_is_killed_before_the_takeover() {
        let dir = tempfile::tempdir().unwrap();
        let region = Arc::new(Region::create(&dir.path().join("r"), caps()).unwrap());
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
        let start_ticks: u64 = stat[stat.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .nth(19)
            .unwrap()
            .parse()
            .unwrap();
        let predecessor = ProcessIdentity {
            pid: child.id(),
            start_ticks,
            ..ProcessIdentity::current()
        };
        region.broker_owner(1).write(41, &predecessor);
        take_ownership(&region, 1, 42).unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        let (incarnation, me) = region.broker_owner(1).read().unwrap();
        assert_eq!((incarnation, me), (42, ProcessIdentity::current()));
    }
}
