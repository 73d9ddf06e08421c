//! Human renderings of what the admin API reports: `status`, `topic list` and `topic
//! describe`. Each function turns the API's answer into text and prints nothing, so
//! the layouts are unit-tested; `--json` output bypasses this module entirely.

use embarcadero_client::{
    BrokerLogInfo, BrokerRates, LocalBrokerStats, SequencerLease, SequencerStats, StatusReport,
    TopicHealth, TopicInfo,
};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// `status`: the server, its brokers with rates, its topics with positions, then
/// anything that needs a person's attention.
pub fn status_text(s: &StatusReport, control: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "embarcadero {}   up {}   control {control}",
        s.version,
        duration(s.uptime_s),
    );
    let _ = writeln!(out, "sequencer   {}", sequencer_line(s));
    out.push('\n');
    out.push_str(&broker_table(s));
    out.push('\n');
    out.push_str(&topic_table(&s.topics, Some(&s.rates.topics)));
    let problems = problems(s);
    if !problems.is_empty() {
        let _ = writeln!(out, "\nneeds attention:");
        for p in problems {
            let _ = writeln!(out, "  - {p}");
        }
    }
    out
}

fn sequencer_line(s: &StatusReport) -> String {
    let unknown = SequencerLease {
        mode: "?".into(),
        holder: "?".into(),
        fencing_epoch: 0,
        lease_remaining_ms: 0,
    };
    let lease = s.cluster.sequencer.as_ref().unwrap_or(&unknown);
    match &s.sequencer {
        SequencerStats::Embedded { epochs, batches_ordered, .. } => format!(
            "embedded, active   epochs {epochs}   batches ordered {batches_ordered}   fencing epoch {}",
            lease.fencing_epoch
        ),
        SequencerStats::External => format!(
            "external   holder {}   fencing epoch {}   lease {} ms left",
            lease.holder, lease.fencing_epoch, lease.lease_remaining_ms
        ),
    }
}

/// One row per cluster member; counters and rates for the head's own brokers (a
/// follower keeps its own, shown as `-`).
fn broker_table(s: &StatusReport) -> String {
    let row = |c: [&str; 8]| {
        format!(
            "{:<6} {:<21} {:<6} {:>10} {:>13} {:>11} {:>11} {:>5}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
        )
    };
    let header = [
        "BROKER",
        "ADDRESS",
        "STATE",
        "PUBLISHED",
        "MESSAGES",
        "PUB/S",
        "SUB/S",
        "CONNS",
    ];
    let mut out = format!("{}  FREE SEGMENTS\n", row(header));
    for m in &s.cluster.members {
        let counters = s.brokers.iter().find(|b| b.id == m.id);
        let rate = s.rates.brokers.iter().find(|b| b.id == m.id);
        let field = |f: &dyn Fn(&LocalBrokerStats) -> String| counters.map_or("-".into(), f);
        let per_s =
            |f: fn(&BrokerRates) -> u64| rate.map_or("-".into(), |r| format!("{}/s", bytes(f(r))));
        let line = row([
            &m.id.to_string(),
            m.addr.as_deref().unwrap_or("-"),
            &serde_json::to_value(m.state)
                .map_or("?".into(), |v| v.as_str().unwrap_or("?").to_string()),
            &field(&|b| bytes(b.publish_bytes)),
            &field(&|b| count(b.publish_messages)),
            &per_s(|r| r.publish_bytes_per_s),
            &per_s(|r| r.subscribe_bytes_per_s),
            &field(&|b| b.connections.to_string()),
        ]);
        let _ = writeln!(
            out,
            "{}  {:>13}",
            line.trim_end(),
            field(&|b| b.free_segments.to_string())
        );
    }
    out
}

/// `topic list` (and the topics part of `status`, with `rates`: messages per second
/// by topic name).
pub fn topic_table(topics: &[TopicInfo], rates: Option<&BTreeMap<String, u64>>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>5} {:>3} {:>3} {:>8} {:>7}  NEXT POSITION",
        "TOPIC", "ORDER", "RF", "ACK", "MSG/S", "READERS"
    );
    for t in topics {
        let rate = rates
            .and_then(|r| r.get(&t.name).copied())
            .map_or("-".into(), count);
        let _ = writeln!(
            out,
            "{:<24} {:>5} {:>3} {:>3} {:>8} {:>7}  {}",
            t.name,
            t.order,
            t.replication_factor,
            t.default_ack,
            rate,
            t.health.readers,
            next_position(t)
        );
    }
    out
}

/// Orders 2 and 5 have one global position; orders 0 and 1 one per broker log.
fn next_position(t: &TopicInfo) -> String {
    if t.order >= 2 {
        return count(t.next_position);
    }
    let per_broker: Vec<String> = t
        .brokers
        .iter()
        .map(|b| format!("b{}:{}", b.broker, count(b.messages)))
        .collect();
    per_broker.join(" ")
}

/// `topic describe`.
pub fn topic_text(t: &TopicInfo) -> String {
    let mut out = String::new();
    let durability = if t.replication_factor >= 2 {
        format!(
            "{} disk replica(s), survives restarts",
            t.replication_factor - 1
        )
    } else {
        "memory only: data lost at a restart, positions never reused".into()
    };
    let limit = |v: u64, f: fn(u64) -> String| if v == 0 { "no limit".into() } else { f(v) };
    let lines = [
        ("topic", t.name.clone()),
        ("order", format!("{} ({})", t.order, order_meaning(t.order))),
        (
            "replication",
            format!("rf {} ({durability})", t.replication_factor),
        ),
        ("default ack", t.default_ack.to_string()),
        (
            "retention",
            format!(
                "{} / {}",
                limit(t.retention_bytes, bytes),
                limit(t.retention_ms, |ms| duration(ms / 1000))
            ),
        ),
        ("next position", next_position(t)),
    ];
    for (k, v) in lines {
        let _ = writeln!(out, "{k:<16}{v}");
    }
    if t.order >= 2 {
        let _ = writeln!(
            out,
            "{:<16}{}",
            "ordered batches",
            count(t.committed_batches)
        );
    }
    if t.replication_factor >= 2 {
        let _ = writeln!(
            out,
            "{:<16}{} batches, readable below position {}",
            "durable",
            count(t.durable_batches),
            count(t.durable_position)
        );
    }
    let _ = writeln!(out, "{:<16}{}", "readers", readers_line(&t.health));
    out.push('\n');
    // The brokers' logs are the region's, which each start of the server begins again
    // (the totals above carry over from the disk replicas).
    out.push_str("broker logs since the server started:\n");
    out.push_str(&log_table(t));
    for p in topic_problems(t) {
        let _ = writeln!(out, "needs attention: {p}");
    }
    out
}

fn order_meaning(order: u8) -> &'static str {
    match order {
        0 => "no order",
        1 => "FIFO per broker",
        2 => "total order",
        5 => "total order, per-session FIFO",
        _ => "?",
    }
}

fn readers_line(health: &TopicHealth) -> String {
    let readers = health.readers;
    match &health.slowest_reader {
        Some(r) if readers > 0 => format!(
            "{readers} connected; slowest is {} {} behind (at position {})",
            count(r.behind),
            if r.behind == 1 { "message" } else { "messages" },
            count(r.position)
        ),
        _ => format!("{readers} connected"),
    }
}

/// One row per broker log of the topic; the ordered and durable columns only where
/// the topic has a global order and disk replicas.
fn log_table(t: &TopicInfo) -> String {
    type Column = (&'static str, fn(&BrokerLogInfo) -> u64);
    let mut columns: Vec<Column> = vec![
        ("BATCHES", |b| b.written_batches),
        ("MESSAGES", |b| b.messages),
    ];
    if t.order >= 2 {
        columns.push(("ORDERED", |b| b.ordered_batches));
    }
    if t.replication_factor >= 2 {
        columns.push(("DURABLE", |b| b.durable_batches));
    }
    columns.push(("RECLAIMED", |b| b.reclaimed_batches));
    let mut out = format!("{:<6}", "BROKER");
    for (title, _) in &columns {
        let _ = write!(out, " {title:>14}");
    }
    out.push('\n');
    for b in &t.brokers {
        let _ = write!(out, "{:<6}", b.broker);
        for (_, value) in &columns {
            let _ = write!(out, " {:>14}", count(value(b)));
        }
        out.push('\n');
    }
    out
}

/// What in the status needs a person: failing replica disks, subscribers holding
/// memory back, publishers waiting for room.
fn problems(s: &StatusReport) -> Vec<String> {
    let mut out: Vec<String> = s
        .topics
        .iter()
        .flat_map(|t| {
            topic_problems(t)
                .into_iter()
                .map(move |p| format!("topic {}: {p}", t.name))
        })
        .collect();
    for b in s
        .rates
        .brokers
        .iter()
        .filter(|b| b.backpressure_waits_per_s > 0)
    {
        out.push(format!(
            "broker {}: publishers wait for room ({}/s over the last seconds): a subscriber or a disk replica is behind (see the topics above)",
            b.id, b.backpressure_waits_per_s
        ));
    }
    out.extend(no_sequencer(&s.sequencer, s.cluster.sequencer.as_ref()));
    out
}

/// An external sequencer's lease that has lapsed: nothing is being ordered, and every
/// publish to an order 2 or 5 topic waits for its acknowledgement.
fn no_sequencer(stats: &SequencerStats, lease: Option<&SequencerLease>) -> Option<String> {
    let lapsed = lease.is_some_and(|l| l.lease_remaining_ms == 0);
    (matches!(stats, SequencerStats::External) && lapsed).then(|| {
        "sequencer: no sequencer holds the region's lease, so nothing is ordered and publishes to order 2 and 5 topics wait; start one (`embarcadero sequencer --head-addr HEAD`) or see why the running one stopped".to_string()
    })
}

fn topic_problems(t: &TopicInfo) -> Vec<String> {
    let mut out = Vec::new();
    for e in &t.health.replica_errors {
        out.push(format!(
            "disk replica {} cannot write: {}; nothing new becomes durable and ack-2 publishers wait until the disk recovers (free space or fix the disk)",
            e.replica, e.message
        ));
    }
    let Some(r) = &t.health.slowest_reader else {
        return out;
    };
    // A memory-only topic's subscribers hold memory; replicated ones read from disk.
    let stuck = r.heartbeat_age_ms > 1000;
    if t.replication_factor < 2 && stuck && r.behind > 0 {
        out.push(format!(
            "a subscriber (reader slot {}) has not moved for {} s and holds back memory from position {}; publishers stall once memory is full, until it is dropped (broker.reader_stall_timeout_ms)",
            r.slot,
            r.heartbeat_age_ms / 1000,
            count(r.position)
        ));
    }
    out
}

/// `1234567` → `1,234,567`.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes with a binary unit: `1536` → `1.5 KiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Seconds as `3h 02m`, `4m 05s` or `12s`.
fn duration(secs: u64) -> String {
    match secs {
        s if s >= 3600 => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
        s if s >= 60 => format!("{}m {:02}s", s / 60, s % 60),
        s => format!("{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn topic(order: u8, rf: u8, health: Value) -> TopicInfo {
        serde_json::from_value(json!({
            "name": "t", "id": 0, "order": order, "replication_factor": rf, "default_ack": 1,
            "created_unix_ms": 0, "committed_batches": 3, "next_position": 30,
            "brokers": [
                {"broker": 0, "written_batches": 2, "messages": 1500, "ordered_batches": 2, "durable_batches": 0, "reclaimed_batches": 0},
                {"broker": 1, "written_batches": 1, "messages": 20, "ordered_batches": 1, "durable_batches": 0, "reclaimed_batches": 0}
            ],
            "health": health
        }))
        .expect("a topic as the server reports it")
    }

    #[test]
    fn orders_0_and_1_show_a_position_per_broker_and_2_one_global() {
        let table = topic_table(&[topic(1, 1, json!({}))], None);
        assert!(table.contains("b0:1,500 b1:20"), "{table}");
        let table = topic_table(&[topic(2, 2, json!({}))], None);
        assert!(table.lines().nth(1).unwrap().ends_with(" 30"), "{table}");
        assert!(table.starts_with("TOPIC"), "columns are labeled: {table}");
    }

    #[test]
    fn a_failing_replica_and_a_stuck_reader_need_attention() {
        let t = topic(
            2,
            2,
            json!({"readers": 1, "replica_errors": [{"replica": 1, "errno": 28, "message": "No space left on device (os error 28)"}]}),
        );
        let text = topic_text(&t);
        assert!(
            text.contains("needs attention: disk replica 1 cannot write: No space left"),
            "{text}"
        );
        let t = topic(
            1,
            1,
            json!({"readers": 1, "slowest_reader": {"slot": 4, "position": 7, "behind": 1513, "heartbeat_age_ms": 9000}}),
        );
        let text = topic_text(&t);
        assert!(
            text.contains("1 connected; slowest is 1,513 messages behind"),
            "{text}"
        );
        assert!(
            text.contains("reader slot 4) has not moved for 9 s"),
            "{text}"
        );
        assert!(topic_problems(&topic(1, 1, json!({"readers": 0}))).is_empty());
    }

    #[test]
    fn an_external_sequencer_whose_lease_lapsed_needs_attention() {
        let lease = |ms| SequencerLease {
            mode: "external".into(),
            holder: "s1".into(),
            fencing_epoch: 3,
            lease_remaining_ms: ms,
        };
        let lapsed = no_sequencer(&SequencerStats::External, Some(&lease(0))).unwrap();
        assert!(
            lapsed.contains("embarcadero sequencer --head-addr"),
            "{lapsed}"
        );
        assert_eq!(
            no_sequencer(&SequencerStats::External, Some(&lease(250))),
            None
        );
    }

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1_000), "1,000");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(duration(59), "59s");
        assert_eq!(duration(125), "2m 05s");
        assert_eq!(duration(7320), "2h 02m");
    }
}
