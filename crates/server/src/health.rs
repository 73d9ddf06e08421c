//! What `status` and `topic describe` say about a topic's trouble: disk replicas that
//! cannot write, and the subscriber that holds memory back (the one a paused reader
//! would be, stalling publishers until it is dropped).
//!
//! Owns nothing: it only reads the region's replica lines, reader slots and frontiers,
//! each of which has one writer elsewhere (replica workers, brokers).

pub use embarcadero_api::{ReaderLag, ReplicaError, TopicHealth};
use embarcadero_region::Region;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The health of the topic in `slot`.
pub fn topic_health(
    region: &Region,
    slot: u32,
    order: u8,
    replication_factor: u8,
    stall: Duration,
) -> TopicHealth {
    assert!(slot < region.capacities().max_topics, "topic slot {slot}");
    TopicHealth {
        readers: live_readers(region, slot, stall),
        slowest_reader: slowest_reader(region, slot, order, stall),
        replica_errors: replica_errors(region, slot, replication_factor),
    }
}

fn live_readers(region: &Region, slot: u32, stall: Duration) -> u32 {
    let now = embarcadero_region::monotonic_ns();
    let stall_ns = stall.as_nanos() as u64;
    (0..region.reader_slots_high(slot))
        .filter(|&s| {
            let hb = region.reader_heartbeat(slot, s).load(Ordering::Acquire);
            hb != 0 && now.saturating_sub(hb) <= stall_ns
        })
        .count() as u32
}

/// Orders 2 and 5 have one global position per reader; orders 0 and 1 one per broker
/// log, so the slowest is the one furthest behind in any log.
fn slowest_reader(region: &Region, slot: u32, order: u8, stall: Duration) -> Option<ReaderLag> {
    let logs: Vec<(u32, u64)> = if order >= 2 {
        let next = region.topic_seq(slot).next_position.load(Ordering::Acquire);
        vec![(0, next)]
    } else {
        (0..region.capacities().brokers)
            .map(|b| (b, region.log(slot, b).frontier_msgs.load(Ordering::Acquire)))
            .collect()
    };
    logs.into_iter()
        .filter_map(|(index, written)| {
            let r = region.slowest_reader(slot, index, stall)?;
            Some(ReaderLag {
                slot: r.slot,
                broker: r.broker,
                position: r.position,
                log_broker: (order < 2).then_some(index),
                behind: written.saturating_sub(r.position),
                heartbeat_age_ms: r.heartbeat_age_ns / 1_000_000,
            })
        })
        .max_by_key(|lag| lag.behind)
}

fn replica_errors(region: &Region, slot: u32, replication_factor: u8) -> Vec<ReplicaError> {
    let replicas = (replication_factor as u32).saturating_sub(1);
    let replicas = replicas.min(embarcadero_region::MAX_REPLICAS);
    (1..=replicas)
        .filter_map(|replica| {
            let errno = region.replica(slot, replica).error.load(Ordering::Acquire);
            (errno != 0).then(|| ReplicaError {
                replica,
                errno,
                message: std::io::Error::from_raw_os_error(errno as i32).to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::Capacities;

    fn region(dir: &std::path::Path) -> Region {
        let caps = Capacities {
            max_topics: 1,
            brokers: 2,
            goi_slots: 64,
            pbr_slots: 64,
            segment_bytes: 1 << 16,
            segments_per_broker: 2,
            seg_map_slots: 8,
        };
        Region::create(&dir.join("region"), caps).unwrap()
    }

    const STALL: Duration = Duration::from_secs(30);

    #[test]
    fn a_failing_disk_replica_is_reported_with_its_os_error() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(dir.path());
        assert!(topic_health(&r, 0, 2, 3, STALL).replica_errors.is_empty());
        r.replica_line(0, 2).error.store(28, Ordering::Release);
        let errors = topic_health(&r, 0, 2, 3, STALL).replica_errors;
        assert_eq!(errors.len(), 1);
        assert_eq!((errors[0].replica, errors[0].errno), (2, 28));
        assert!(errors[0].message.contains("No space left"), "{errors:?}");
        // A replica the topic does not have is not its trouble.
        assert!(topic_health(&r, 0, 2, 2, STALL).replica_errors.is_empty());
    }

    #[test]
    fn the_slowest_live_reader_is_the_one_furthest_behind() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(dir.path());
        assert_eq!(topic_health(&r, 0, 1, 1, STALL), TopicHealth::default());
        r.broker_line(0, 0)
            .frontier_msgs
            .store(100, Ordering::Release);
        r.broker_line(0, 1)
            .frontier_msgs
            .store(500, Ordering::Release);
        // Reader 0 is 10 behind in broker 0's log and 400 behind in broker 1's.
        for slot in [0, 1] {
            let pin = r.reader_slot(0, slot);
            pin.mark_claimed();
            pin.position(0).store(90, Ordering::Release);
            pin.position(1)
                .store(100 + 300 * slot as u64, Ordering::Release);
            pin.owner.store(2, Ordering::Release);
            let now = embarcadero_region::monotonic_ns();
            pin.heartbeat.store(now, Ordering::Release);
        }
        let health = topic_health(&r, 0, 1, 1, STALL);
        assert_eq!(health.readers, 2);
        let slowest = health.slowest_reader.unwrap();
        assert_eq!((slowest.slot, slowest.log_broker), (0, Some(1)));
        assert_eq!((slowest.position, slowest.behind), (100, 400));
        assert_eq!(slowest.broker, Some(1));
        // One whose broker stopped beating long ago holds nothing and is not counted.
        r.reader_slot(0, 0).heartbeat.store(2, Ordering::Release);
        let health = topic_health(&r, 0, 1, 1, STALL);
        assert_eq!(health.readers, 1);
        assert_eq!(health.slowest_reader.unwrap().slot, 1);
    }
}
