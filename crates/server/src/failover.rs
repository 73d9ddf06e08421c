//! What a publisher needs to fail over from a dead broker without duplicates: which of
//! its batches on that broker made it into the global order.
//!
//! Once membership has declared a broker dead, the control plane owns the broker's
//! line of each log and fences it: `fence_pbr` = 1 + the first PBR index that was not
//! committed when the fence was set. The sequencer never orders a slot at or above the
//! fence (so a broker that only seemed dead cannot add to the order) and confirms with
//! `fence_ack` once every slot it will ever order from that log is in the GOI. From
//! then on the GOI answers "was batch `s` of client `c` through broker `b` ordered?"
//! exactly, and a publisher resends precisely the others.

use embarcadero_region::Region;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FailoverError {
    #[error("the sequencer has not confirmed the fence of broker {broker} within {waited_ms} ms; is a sequencer running? (`embarcadero status`)")]
    FenceNotConfirmed { broker: u32, waited_ms: u64 },
    #[error("the replicas have not made broker {broker}'s ordered batches durable within {waited_ms} ms; check `embarcadero_replica_error` on /metrics")]
    NotDurable { broker: u32, waited_ms: u64 },
}

/// Whether the log has a fence that no restarted broker has lifted yet.
fn holds_fence(log: &embarcadero_region::LogControl<'_>) -> bool {
    let fence = log.fence_pbr.load(Ordering::Acquire);
    fence != 0 && log.resumed_fence.load(Ordering::Acquire) != fence
}

/// Whether any log of `broker` is fenced (it was declared dead and failed over) and
/// not resumed by a new process since.
pub fn is_fenced(region: &Region, broker: u32) -> bool {
    (0..region.capacities().max_topics).any(|topic| holds_fence(&region.log(topic, broker)))
}

/// Fences every log of `broker` that has no fence yet (or only one a restarted
/// broker has lifted: a fence per incarnation); returns how many it fenced.
pub fn fence_broker(region: &Region, broker: u32) -> usize {
    let mut fenced = 0;
    for topic in 0..region.capacities().max_topics {
        if region.topic_meta(topic).is_none() {
            continue;
        }
        let log = region.log(topic, broker);
        if holds_fence(&log) {
            continue;
        }
        // Everything below `ordered_pbr` is committed; walk the committed run above it.
        let mut first_hole = log.ordered_pbr.load(Ordering::Acquire);
        while region.pbr_holds(topic, broker, first_hole) {
            first_hole += 1;
        }
        region
            .control_plane()
            .fence_pbr(topic, broker)
            .store(first_hole + 1, Ordering::Release);
        fenced += 1;
    }
    if fenced > 0 {
        region.sequencer_bell().ring();
    }
    fenced
}

/// What a publisher asks about its batches through a dead broker.
#[derive(Debug, Clone)]
pub struct FailoverQuery {
    pub topic: u32,
    pub replication_factor: u8,
    pub broker: u32,
    pub client_id: u64,
    /// The publisher's ids of the batches it has no acknowledgement for (unique per
    /// publisher, unlike per-connection batch sequences).
    pub batch_ids: Vec<u64>,
    /// Ack level 2: report a batch only once it is durable as well.
    pub durable: bool,
}

/// Which of `q.batch_ids` are in the topic's global order, once the fence is
/// confirmed. Waits at most `limit` for the sequencer (and the replicas).
pub fn ordered_batches(
    region: &Region,
    q: &FailoverQuery,
    limit: Duration,
) -> Result<Vec<u64>, FailoverError> {
    let (topic, broker) = (q.topic, q.broker);
    let start = Instant::now();
    let waited_ms = || start.elapsed().as_millis() as u64;
    let log = region.log(topic, broker);
    let bell = region.sequencer_bell();
    loop {
        let fence = log.fence_pbr.load(Ordering::Acquire);
        if fence != 0 && log.fence_ack.load(Ordering::Acquire) == fence {
            break;
        }
        if start.elapsed() >= limit {
            return Err(FailoverError::FenceNotConfirmed {
                broker,
                waited_ms: waited_ms(),
            });
        }
        bell.ring();
        std::thread::sleep(Duration::from_millis(2));
    }
    let committed = region
        .topic_seq(topic)
        .committed_seq
        .load(Ordering::Acquire);
    let goi_slots = region.capacities().goi_slots;
    let mut found = Vec::new();
    let mut newest = None;
    for g in (committed.saturating_sub(goi_slots)..committed).rev() {
        let Some(e) = region.goi_read(topic, g) else {
            break;
        };
        if e.broker_id as u32 == broker
            && e.client_id == q.client_id
            && q.batch_ids.contains(&e.batch_id)
        {
            found.push(e.batch_id);
            newest.get_or_insert(g);
        }
    }
    if q.durable {
        if let Some(g) = newest {
            while region.durable_seq(topic, q.replication_factor) <= g {
                if start.elapsed() >= limit {
                    return Err(FailoverError::NotDurable {
                        broker,
                        waited_ms: waited_ms(),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
    found.sort_unstable();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::{Capacities, GoiEntry, TopicMeta};
    use embarcadero_wire::{BatchFlags, BatchHeader};

    fn region() -> (tempfile::TempDir, Region) {
        let dir = tempfile::tempdir().unwrap();
        let caps = Capacities {
            max_topics: 2,
            brokers: 2,
            goi_slots: 64,
            pbr_slots: 64,
            segment_bytes: 4096,
            segments_per_broker: 4,
            seg_map_slots: 8,
        };
        let r = Region::create(&dir.path().join("r"), caps).unwrap();
        r.write_topic_meta(0, &TopicMeta::new("t", 2));
        (dir, r)
    }

    #[test]
    fn the_fence_sits_at_the_first_hole_and_the_goi_names_what_made_it() {
        let (_d, r) = region();
        for index in [0, 1, 3] {
            r.pbr_commit(
                0,
                1,
                index,
                &BatchHeader {
                    flags: BatchFlags::VALID,
                    pbr_index: index,
                    ..Default::default()
                },
            );
        }
        assert_eq!(fence_broker(&r, 1), 1);
        let log = r.log(0, 1);
        assert_eq!(
            log.fence_pbr.load(Ordering::Acquire),
            2 + 1,
            "slot 2 is the hole"
        );
        assert_eq!(fence_broker(&r, 1), 0, "a fence is set once");
        // Unconfirmed: the sequencer (not running here) never acknowledged it.
        let query = FailoverQuery {
            topic: 0,
            replication_factor: 1,
            broker: 1,
            client_id: 9,
            batch_ids: vec![100, 101, 102, 103],
            durable: false,
        };
        let err = ordered_batches(&r, &query, Duration::from_millis(20));
        assert!(matches!(
            err,
            Err(FailoverError::FenceNotConfirmed { broker: 1, .. })
        ));
        // As the sequencer would: slots 0 and 1 ordered, the fence confirmed.
        for (g, id) in [(0u64, 101u64), (1, 102)] {
            r.goi_write(
                0,
                g,
                &GoiEntry {
                    broker_id: 1,
                    client_id: 9,
                    batch_id: id,
                    pbr_index: g,
                    num_msg: 1,
                    ..Default::default()
                },
            );
        }
        r.goi_write(
            0,
            2,
            &GoiEntry {
                broker_id: 0,
                client_id: 9,
                batch_id: 103,
                num_msg: 1,
                ..Default::default()
            },
        );
        r.sequencer_topic(0)
            .committed_seq
            .advance(3, Ordering::Release);
        r.sequencer_line(0, 1).fence_ack.store(3, Ordering::Release);
        let got = ordered_batches(&r, &query, Duration::from_secs(1)).unwrap();
        assert_eq!(
            got,
            vec![101, 102],
            "client 9's batches through broker 1 (103 went through broker 0)"
        );
    }
}
