//! Positions of memory-only topics never go back, not even when their data does.
//!
//! A memory-only topic (replication factor 1) loses its data with the region, and when
//! the region is lost too (deleted, or from before a reboot) nothing would say where its
//! positions had got to: it would start again at 0, and a subscriber resuming from a
//! saved position would silently read other messages. So the control plane keeps, per
//! memory-only topic, a position *ceiling* in `topics.json`: no position at or above it
//! is ever handed out (the sequencer checks each batch against it for orders 2 and 5,
//! each broker's service thread for orders 0 and 1, per broker), and the control plane
//! raises it by [`CEILING_STEP`] once the topic is within half a step of it, persisting
//! the new value before publishing it in the region. A start without the previous
//! region puts the topic at its persisted ceiling, past every position handed out
//! before; subscribers asking for an earlier one get PositionNotRetained naming it.
//!
//! *Cost:* one load per epoch (sequencer) or service round (broker) and one compare per
//! batch; a `topics.json` write every 2^31 messages of a topic; a look at the topics'
//! positions every [`CEILING_CHECK`]. A topic that reached its ceiling would wait
//! (backpressure) for the next raise; at a step of 2^32 positions that needs 2^31
//! messages within one check, far beyond any machine's rate.

use crate::control::PersistedTopic;
use embarcadero_region::{Region, NO_POSITION_CEILING};
use embarcadero_replication::recovery::{self, OldTopic, Resume};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How far above a memory-only topic's positions its ceiling is set.
pub const CEILING_STEP: u64 = 1 << 32;

/// How often the control plane looks whether a ceiling needs raising.
pub const CEILING_CHECK: Duration = Duration::from_millis(100);

/// The ceiling to raise to, if `used` (the next position the topic would hand out) has
/// come within half a step of `ceiling`: `used + step`. `None` while there is room, and
/// for topics without a ceiling. Never lower than `ceiling`, never the "no ceiling"
/// value itself.
pub fn raised_ceiling(used: u64, ceiling: u64, step: u64) -> Option<u64> {
    if ceiling == NO_POSITION_CEILING || ceiling.saturating_sub(used) >= step / 2 {
        return None;
    }
    Some(
        used.saturating_add(step)
            .min(NO_POSITION_CEILING - 1)
            .max(ceiling),
    )
}

/// The next position a topic would hand out, as the region says: the sequencer's
/// `next_position` for orders 2 and 5, the highest broker's message count for orders 0
/// and 1 (positions are per broker, and one ceiling bounds them all).
pub fn used_positions(region: &Region, slot: u32, order: u8) -> u64 {
    if order >= 2 {
        return region.topic_seq(slot).next_position.load(Ordering::Acquire);
    }
    (0..region.capacities().brokers)
        .map(|b| region.log(slot, b).frontier_msgs.load(Ordering::Acquire))
        .max()
        .unwrap_or(0)
}

/// Where a memory-only topic continues: where the previous region left it when there
/// is one (its data is gone, its positions are not), else at its persisted ceiling,
/// which every position handed out before is below. For orders 0 and 1 per broker: a
/// broker the previous region did not have starts at the ceiling too (an earlier region
/// with more brokers may have given it positions).
pub(crate) fn memory_only_resume(
    t: &PersistedTopic,
    old: Option<OldTopic<'_>>,
    brokers: u32,
) -> Resume {
    let ceiling = t.position_ceiling;
    if t.spec.order >= 2 {
        return match old {
            Some(o) => recovery::resume_memory_only(o),
            None => Resume {
                next_position: ceiling,
                ..Resume::default()
            },
        };
    }
    let previous = old.map(recovery::broker_positions_of).unwrap_or_default();
    Resume {
        broker_positions: (0..brokers as usize)
            .map(|b| previous.get(b).copied().unwrap_or(ceiling))
            .collect(),
        ..Resume::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ceiling_is_raised_only_within_half_a_step_and_then_a_full_step_ahead() {
        let step = 100;
        assert_eq!(raised_ceiling(0, 100, step), None, "a new topic has room");
        assert_eq!(
            raised_ceiling(50, 100, step),
            None,
            "exactly half a step left"
        );
        assert_eq!(raised_ceiling(51, 100, step), Some(151));
        assert_eq!(raised_ceiling(100, 100, step), Some(200), "at the ceiling");
        // A start without the previous region: the topic starts at the ceiling.
        assert_eq!(raised_ceiling(1000, 1000, step), Some(1100));
        // topics.json from before ceilings (0) with the previous region's positions.
        assert_eq!(raised_ceiling(70, 0, step), Some(170));
    }

    #[test]
    fn topics_without_a_ceiling_and_the_top_of_the_range_are_left_alone() {
        assert_eq!(raised_ceiling(5, NO_POSITION_CEILING, 100), None);
        let top = NO_POSITION_CEILING - 1;
        assert_eq!(raised_ceiling(top - 10, top - 5, 100), Some(top));
        assert_eq!(
            raised_ceiling(top, top, 100),
            Some(top),
            "never the no-limit value"
        );
    }

    #[test]
    fn the_default_step_leaves_room_for_billions_of_messages_per_check() {
        let c = raised_ceiling(0, 0, CEILING_STEP).unwrap();
        assert_eq!(c, CEILING_STEP);
        assert_eq!(raised_ceiling(CEILING_STEP / 2, c, CEILING_STEP), None);
        assert_eq!(
            raised_ceiling(CEILING_STEP / 2 + 1, c, CEILING_STEP),
            Some(CEILING_STEP / 2 + 1 + CEILING_STEP)
        );
    }
}
