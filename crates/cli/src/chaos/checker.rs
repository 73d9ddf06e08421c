//! The checker of a chaos history ([`super::history`]): it reads what the publishers
//! sent and had acknowledged and what every reader delivered, and reports each anomaly
//! by class, with the first few occurrences spelled out.

use super::history::Event;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// Occurrences of one class spelled out in a report; the rest are only counted.
const EXAMPLES: usize = 10;

/// The classes of anomaly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// An acknowledged message a reader never delivered.
    LostAck,
    /// A message a reader delivered twice.
    Duplicate,
    /// A delivery of no message any publisher sent.
    Unknown,
    /// A message sent after another was acknowledged, placed before it in the order.
    Reorder,
    /// Two readers delivered different messages at the same position.
    ReadersDisagree,
    /// Order 5: a publisher's message delivered after one it sent later.
    SessionFifo,
    /// A reader's position that does not rise (went back or was used again).
    PositionBackwards,
    /// A reader skipped positions (or did not start at 0).
    PositionGap,
    /// A reader stopped before the end of the topic.
    IncompleteRead,
}

/// The verdict over one history.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub sent: u64,
    pub acked: u64,
    pub failed: u64,
    /// Messages delivered, per reader.
    pub delivered: Vec<u64>,
    /// Acknowledgements recorded while the fault was on (between the nemesis's start
    /// and end): how much the fault held the publishers back.
    pub acked_during_fault: u64,
    pub counts: BTreeMap<Kind, u64>,
    pub examples: Vec<(Kind, String)>,
}

impl Report {
    pub fn anomalies(&self) -> u64 {
        self.counts.values().sum()
    }

    fn report(&mut self, kind: Kind, what: impl FnOnce() -> String) {
        let count = self.counts.entry(kind).or_insert(0);
        *count += 1;
        if *count as usize <= EXAMPLES {
            self.examples.push((kind, what()));
        }
    }
}

/// What the publishers did to one message; line numbers order events in real time.
#[derive(Debug, Clone, Copy)]
struct Sent {
    publisher: usize,
    send_line: usize,
    ack_line: Option<usize>,
}

/// What one reader delivered, in delivery order, and where it said the topic ended.
#[derive(Debug, Default)]
struct Reader {
    deliveries: Vec<(u64, u64)>,
    end: Option<(u64, Option<String>)>,
}

/// Checks a history.
pub fn check(events: &[Event]) -> Report {
    let mut report = Report::default();
    let mut order = 0;
    let mut sent: HashMap<u64, Sent> = HashMap::new();
    let mut readers: BTreeMap<usize, Reader> = BTreeMap::new();
    let mut fault_on = false;
    for (line, event) in events.iter().enumerate() {
        match event {
            Event::Topic { order: o, .. } => order = *o,
            Event::Send { publisher, id } => {
                report.sent += 1;
                sent.insert(
                    *id,
                    Sent {
                        publisher: *publisher,
                        send_line: line,
                        ack_line: None,
                    },
                );
            }
            Event::Ack { id, .. } => {
                report.acked += 1;
                report.acked_during_fault += u64::from(fault_on);
                if let Some(s) = sent.get_mut(id) {
                    s.ack_line = Some(line);
                }
            }
            Event::Fail { .. } => report.failed += 1,
            Event::Deliver {
                reader,
                position,
                id,
            } => readers
                .entry(*reader)
                .or_default()
                .deliveries
                .push((*position, *id)),
            Event::ReaderEnd {
                reader,
                topic_end,
                error,
            } => readers.entry(*reader).or_default().end = Some((*topic_end, error.clone())),
            Event::Nemesis { phase, .. } => fault_on = phase == "start",
        }
    }
    let mut order_seen: BTreeMap<u64, (usize, u64)> = BTreeMap::new();
    for (&r, reader) in &readers {
        report.delivered.push(reader.deliveries.len() as u64);
        check_reader(&mut report, r, reader, &sent, order == 5);
        check_agreement(&mut report, r, reader, &mut order_seen);
    }
    check_lost(&mut report, &readers, &sent);
    check_real_time(&mut report, &order_seen, &sent);
    report
}

/// One reader on its own: positions rise by one from 0 up to the topic's end, every
/// message once, every message one that was sent, order 5 in each publisher's order.
fn check_reader(
    report: &mut Report,
    r: usize,
    reader: &Reader,
    sent: &HashMap<u64, Sent>,
    sessions: bool,
) {
    let mut next = 0u64;
    let mut seen: HashMap<u64, u64> = HashMap::new();
    let mut session_last: HashMap<usize, u64> = HashMap::new();
    for &(position, id) in &reader.deliveries {
        if position < next {
            report.report(Kind::PositionBackwards, || {
                format!("reader {r}: position {position} after {}", next - 1)
            });
        } else if position > next {
            report.report(Kind::PositionGap, || {
                format!("reader {r}: position {position} where {next} was due")
            });
        }
        next = next.max(position + 1);
        if let Some(first) = seen.insert(id, position) {
            report.report(Kind::Duplicate, || {
                format!("reader {r}: message {id:#x} at positions {first} and {position}")
            });
        }
        let Some(s) = sent.get(&id) else {
            report.report(Kind::Unknown, || {
                format!("reader {r}: message {id:#x} at position {position} was never sent")
            });
            continue;
        };
        if sessions {
            let last = session_last.entry(s.publisher).or_insert(id);
            if id < *last {
                report.report(Kind::SessionFifo, || {
                    format!(
                        "reader {r}: publisher {}'s message {id:#x} at position {position} after its later {:#x}",
                        s.publisher, *last
                    )
                });
            }
            *last = (*last).max(id);
        }
    }
    match &reader.end {
        Some((end, None)) if next >= *end => {}
        Some((end, error)) => report.report(Kind::IncompleteRead, || {
            format!("reader {r}: stopped at position {next}, the topic ends at {end}: {error:?}")
        }),
        None => report.report(Kind::IncompleteRead, || {
            format!("reader {r}: no end recorded after position {next}")
        }),
    }
}

/// Every position holds one message, whichever reader delivered it.
fn check_agreement(
    report: &mut Report,
    r: usize,
    reader: &Reader,
    order_seen: &mut BTreeMap<u64, (usize, u64)>,
) {
    for &(position, id) in &reader.deliveries {
        let (first_reader, first_id) = *order_seen.entry(position).or_insert((r, id));
        if first_id != id {
            report.report(Kind::ReadersDisagree, || {
                format!(
                    "position {position}: reader {first_reader} delivered {first_id:#x}, reader {r} {id:#x}"
                )
            });
        }
    }
}

/// Every acknowledged message reached every reader.
fn check_lost(report: &mut Report, readers: &BTreeMap<usize, Reader>, sent: &HashMap<u64, Sent>) {
    let mut acked: Vec<(&u64, &Sent)> = sent.iter().filter(|(_, s)| s.ack_line.is_some()).collect();
    acked.sort_by_key(|(id, _)| **id);
    for (&r, reader) in readers {
        let delivered: std::collections::HashSet<u64> =
            reader.deliveries.iter().map(|&(_, id)| id).collect();
        for (&id, s) in &acked {
            if !delivered.contains(&id) {
                report.report(Kind::LostAck, || {
                    format!(
                        "reader {r}: publisher {}'s acknowledged {id:#x} never delivered",
                        s.publisher
                    )
                });
            }
        }
    }
}

/// A message sent after another was acknowledged comes after it in the order: walking
/// the order from its end, the earliest acknowledgement of anything placed later must
/// not come before this message was sent.
fn check_real_time(
    report: &mut Report,
    order_seen: &BTreeMap<u64, (usize, u64)>,
    sent: &HashMap<u64, Sent>,
) {
    let mut earliest_later_ack: Option<(usize, u64, u64)> = None;
    for (&position, &(_, id)) in order_seen.iter().rev() {
        let Some(s) = sent.get(&id) else { continue };
        if let Some((ack_line, later_id, later_position)) = earliest_later_ack {
            if ack_line < s.send_line {
                report.report(Kind::Reorder, || {
                    format!(
                        "{id:#x} at position {position} was sent (line {}) after {later_id:#x} was acknowledged (line {}), yet {later_id:#x} is at the later position {later_position}",
                        s.send_line + 1,
                        ack_line + 1
                    )
                });
            }
        }
        if let Some(ack_line) = s.ack_line {
            if earliest_later_ack.is_none_or(|(line, _, _)| ack_line < line) {
                earliest_later_ack = Some((ack_line, id, position));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(publisher: usize, id: u64) -> Event {
        Event::Send { publisher, id }
    }
    fn ack(publisher: usize, id: u64) -> Event {
        Event::Ack { publisher, id }
    }
    fn deliver(reader: usize, position: u64, id: u64) -> Event {
        Event::Deliver {
            reader,
            position,
            id,
        }
    }
    fn end(reader: usize, topic_end: u64) -> Event {
        Event::ReaderEnd {
            reader,
            topic_end,
            error: None,
        }
    }

    /// Two publishers, three messages (the third failed), two readers that agree.
    fn good(order: u8) -> Vec<Event> {
        let mut h = vec![
            Event::Topic { order, ack: 1 },
            send(0, 0),
            send(1, 100),
            ack(0, 0),
            ack(1, 100),
            send(0, 1),
            Event::Fail {
                publisher: 0,
                id: 1,
            },
        ];
        for r in 0..2 {
            h.extend([
                deliver(r, 0, 100),
                deliver(r, 1, 0),
                deliver(r, 2, 1),
                end(r, 3),
            ]);
        }
        h
    }

    /// Removes reader `reader`'s delivery at `position`.
    fn drop_delivery(h: &mut Vec<Event>, reader: usize, position: u64) {
        h.retain(|e| match e {
            Event::Deliver {
                reader: r,
                position: p,
                ..
            } => (*r, *p) != (reader, position),
            _ => true,
        });
    }

    fn kinds(events: &[Event]) -> Vec<Kind> {
        check(events).counts.into_keys().collect()
    }

    #[test]
    fn a_good_history_passes() {
        for order in [2, 5] {
            let mut h = good(order);
            let fault = |phase: &str| Event::Nemesis {
                what: "pause-head".into(),
                phase: phase.into(),
            };
            h.insert(3, fault("start"));
            h.insert(5, fault("end"));
            let report = check(&h);
            assert_eq!(report.acked_during_fault, 1, "{report:?}");
            assert_eq!(report.anomalies(), 0, "{report:?}");
            assert_eq!((report.sent, report.acked, report.failed), (3, 2, 1));
            assert_eq!(report.delivered, [3, 3]);
        }
    }

    #[test]
    fn a_failed_message_may_be_missing() {
        let mut h = good(2);
        drop_delivery(&mut h, 0, 2);
        drop_delivery(&mut h, 1, 2);
        for e in &mut h {
            if let Event::ReaderEnd { topic_end, .. } = e {
                *topic_end = 2;
            }
        }
        assert_eq!(kinds(&h), []);
    }

    #[test]
    fn an_acknowledged_message_missing_is_lost() {
        let mut h = good(2);
        drop_delivery(&mut h, 1, 1);
        assert!(kinds(&h).contains(&Kind::LostAck));
    }

    #[test]
    fn a_message_delivered_twice_is_a_duplicate() {
        let mut h = good(2);
        h.push(deliver(0, 3, 0));
        h.push(end(0, 4));
        assert!(kinds(&h).contains(&Kind::Duplicate));
    }

    #[test]
    fn a_message_never_sent_is_unknown() {
        let mut h = good(2);
        h.push(deliver(1, 3, 555));
        assert!(kinds(&h).contains(&Kind::Unknown));
    }

    /// Messages 0 (by `first`) and 1 (by `second`), delivered as 1 then 0; with
    /// `serial`, 0 is acknowledged before 1 is sent.
    fn swapped(order: u8, (first, second): (usize, usize), serial: bool) -> Vec<Event> {
        let mut h = vec![Event::Topic { order, ack: 1 }, send(first, 0)];
        if serial {
            h.extend([ack(first, 0), send(second, 1)]);
        } else {
            h.extend([send(second, 1), ack(first, 0)]);
        }
        h.extend([
            ack(second, 1),
            deliver(0, 0, 1),
            deliver(0, 1, 0),
            end(0, 2),
        ]);
        h
    }

    #[test]
    fn a_message_sent_after_an_ack_but_placed_before_it_is_a_reorder() {
        // 0 is acknowledged before 1 is sent, yet 1 takes the earlier position.
        assert_eq!(kinds(&swapped(2, (0, 1), true)), [Kind::Reorder]);
        // Concurrent sends may land in either order.
        assert_eq!(kinds(&swapped(2, (0, 1), false)), []);
    }

    #[test]
    fn readers_that_see_different_messages_at_a_position_disagree() {
        let mut h = good(2);
        for e in &mut h {
            if let Event::Deliver {
                reader: 1,
                position,
                id,
            } = e
            {
                *id = [0, 100, 1][*position as usize];
            }
        }
        assert!(kinds(&h).contains(&Kind::ReadersDisagree));
    }

    #[test]
    fn order5_fails_a_publisher_delivered_out_of_its_order() {
        // Both sent before either was acknowledged: only the session order binds them.
        assert_eq!(kinds(&swapped(5, (0, 0), false)), [Kind::SessionFifo]);
        // The same deliveries in order 2 are no anomaly: it keeps no session order.
        assert_eq!(kinds(&swapped(2, (0, 0), false)), []);
    }

    #[test]
    fn a_position_used_again_goes_backwards() {
        let mut h = good(2);
        drop_delivery(&mut h, 0, 2);
        h.push(deliver(0, 1, 1));
        assert!(kinds(&h).contains(&Kind::PositionBackwards));
    }

    #[test]
    fn a_skipped_position_is_a_gap() {
        let mut h = good(2);
        drop_delivery(&mut h, 0, 1);
        let found = kinds(&h);
        assert!(found.contains(&Kind::PositionGap), "{found:?}");
        assert!(found.contains(&Kind::LostAck), "{found:?}");
    }

    #[test]
    fn a_reader_that_stops_short_or_fails_is_incomplete() {
        let mut h = good(2);
        for e in &mut h {
            if let Event::ReaderEnd { topic_end, .. } = e {
                *topic_end = 4;
            }
        }
        assert_eq!(kinds(&h), [Kind::IncompleteRead]);
        let mut h = good(2);
        h.retain(|e| !matches!(e, Event::ReaderEnd { reader: 1, .. }));
        assert_eq!(kinds(&h), [Kind::IncompleteRead]);
    }
}
