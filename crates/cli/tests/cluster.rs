//! Cluster mode with real processes: a head, follower brokers and external sequencers,
//! each its own `embarcadero` process on one shared region file; followers and the
//! active sequencer are SIGKILLed.

mod common;

use common::{control_address, free_port, run_bin, sample, scrape, Proc};
use embarcadero_client::{
    Admin, Cursor, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec, Transport,
};
use std::collections::HashSet;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Fast failure detection for tests: dead after 3 x 100 ms, lease of 400 ms.
const FAST: &[(&str, &str)] = &[
    ("EMBARCADERO_CLUSTER_HEARTBEAT_INTERVAL_MS", "100"),
    ("EMBARCADERO_CLUSTER_SEQUENCER_LEASE_MS", "400"),
];

struct Head {
    proc: Proc,
    control: String,
    _dir: tempfile::TempDir,
}

fn start_head(brokers: u32) -> Head {
    start_head_with(brokers, &["--external-sequencer"])
}

fn start_head_with(brokers: u32, extra: &[&str]) -> Head {
    let dir = tempfile::tempdir().unwrap();
    let (proc, control) = head_process(dir.path(), 0, brokers, extra);
    Head {
        proc,
        control,
        _dir: dir,
    }
}

/// A head serving its control API on `port` (0: a free one) with its data under `dir`
/// (the same two again for a restart), and its control address.
fn head_process(dir: &std::path::Path, port: u16, brokers: u32, extra: &[&str]) -> (Proc, String) {
    let port = port.to_string();
    let data = dir.join("head").display().to_string();
    let brokers = brokers.to_string();
    let (proc, line) = Proc::ready(
        &[
            &["broker", "--head"],
            extra,
            &[
                "--brokers",
                &brokers,
                "--base-port",
                "0",
                "--control-port",
                &port,
                "--data-dir",
                &data,
            ],
        ]
        .concat(),
        FAST,
        "embarcadero is serving",
    );
    (proc, control_address(&line))
}

fn follower(control: &str, id: u32) -> Proc {
    follower_with_metrics(control, id).0
}

/// A follower and the address of its /metrics.
fn follower_with_metrics(control: &str, id: u32) -> (Proc, String) {
    let id = id.to_string();
    let (proc, line) = Proc::ready(
        &[
            "broker",
            "--follower",
            "--head-addr",
            control,
            "--broker-id",
            &id,
        ],
        &[],
        "is serving at",
    );
    (proc, metrics_address(&line))
}

/// The address of a follower's /metrics, from its "is serving at" line.
fn metrics_address(serving: &str) -> String {
    serving
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("the ready line names the metrics address")
        .to_string()
}

fn sequencer(control: &str) -> Proc {
    sequencer_with_metrics(control).0
}

/// An external sequencer and the address of its /metrics.
fn sequencer_with_metrics(control: &str) -> (Proc, String) {
    let (proc, line) = Proc::ready(
        &["sequencer", "--head-addr", control],
        &[],
        "sequencer is active",
    );
    (proc, metrics_address(&line))
}

/// (id, state) of every member, from the head's status document.
fn members(control: &str) -> Vec<(u64, String)> {
    let s = Admin::new(control).status().unwrap();
    s.cluster
        .members
        .iter()
        .map(|m| {
            (
                m.id as u64,
                serde_json::to_value(m.state)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .into(),
            )
        })
        .collect()
}

/// Polls `cond` until it holds; fails the test after 20 s.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(20), "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Publishes ids `range` (8-byte payload prefix) and waits for every acknowledgement;
/// returns how many brokers the publisher used.
fn publish(control: &str, topic: &str, range: std::ops::Range<u64>) -> usize {
    let p = Publisher::connect(
        control,
        topic,
        PublisherConfig {
            batch_bytes: 4096,
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let mut payload = [7u8; 100];
    for id in range.clone() {
        payload[..8].copy_from_slice(&id.to_le_bytes());
        p.publish(&payload).unwrap();
    }
    p.flush().unwrap();
    let stats = p.close().unwrap();
    assert_eq!(stats.messages, range.end - range.start);
    stats.queues.len()
}

/// Reads `count` messages from `start`: (position, id, broker) each.
fn read(control: &str, topic: &str, start: u64, count: u64) -> Vec<(u64, u64, u16)> {
    let mut s = Subscriber::connect(
        control,
        topic,
        SubscriberConfig {
            start: Some(Cursor::Global(start)),
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    let mut out = Vec::new();
    while (out.len() as u64) < count {
        s.poll_with(Duration::from_secs(20), |m| {
            let id = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
            out.push((m.position, id, m.broker_id));
        })
        .unwrap();
    }
    // A poll delivers whole batches: drop what lies beyond the range asked for.
    out.truncate(count as usize);
    out
}

/// The data address the head lists for broker `id`.
fn broker_addr(control: &str, id: u32) -> String {
    Admin::new(control)
        .cluster()
        .unwrap()
        .brokers
        .into_iter()
        .find(|b| b.id == id)
        .unwrap_or_else(|| panic!("broker {id} is not listed"))
        .addr
}

/// A log line without its terminal colours.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ parameters final-byte
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Every id of `ids` exactly once, at contiguous positions from `start`.
fn assert_exactly_once(got: &[(u64, u64, u16)], start: u64, ids: std::ops::Range<u64>) {
    let positions: Vec<u64> = got.iter().map(|m| m.0).collect();
    let expected: Vec<u64> = (start..start + got.len() as u64).collect();
    assert_eq!(positions, expected, "contiguous positions");
    let seen: HashSet<u64> = got.iter().map(|m| m.1).collect();
    assert_eq!(seen.len(), got.len(), "no duplicates");
    assert_eq!(seen, ids.collect::<HashSet<_>>(), "every id");
}

#[test]
fn followers_in_their_own_processes_serve_one_total_order() {
    let head = start_head(3);
    let control = head.control.clone();
    let (f1, f1_metrics) = follower_with_metrics(&control, 1);
    let f2 = follower(&control, 2);
    let (seq, seq_metrics) = sequencer_with_metrics(&control);
    assert_eq!(
        members(&control),
        [
            (0, "local".into()),
            (1, "alive".into()),
            (2, "alive".into())
        ]
    );
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", 2))
        .unwrap();

    assert_eq!(publish(&control, "t", 0..3000), 3, "all three brokers used");
    let a = read(&control, "t", 0, 3000);
    let b = read(&control, "t", 0, 3000);
    assert_exactly_once(&a, 0, 0..3000);
    assert_eq!(a, b, "two subscribers, one order");
    let brokers: HashSet<u16> = a.iter().map(|m| m.2).collect();
    assert_eq!(
        brokers,
        HashSet::from([0, 1, 2]),
        "every process took batches"
    );
    // Each follower exports its own broker's counters, the sequencer its own.
    let batches = sample(
        &scrape(&f1_metrics),
        "embarcadero_publish_batches_total{broker=\"1\"}",
    );
    let text = scrape(&seq_metrics);
    let ordered = sample(&text, "embarcadero_sequencer_batches_ordered_total");
    assert!(
        ordered >= batches,
        "{ordered} batches ordered of all brokers"
    );
    for stage in ["scan", "epoch_wait", "sequence", "goi_write"] {
        let name = format!("embarcadero_stage_nanoseconds_total{{stage=\"sequencer_{stage}\"}}");
        assert!(sample(&text, &name) > 0, "{name}");
    }
    let mine = a.iter().filter(|m| m.2 == 1).count() as u64;
    assert!(
        batches > 0 && batches <= mine,
        "{batches} batches for {mine} messages"
    );

    // A follower dies: the head declares it dead and clients stop using it.
    f2.kill();
    wait_for("broker 2 declared dead", || {
        members(&control)[2].1 == "dead"
            && Admin::new(&control)
                .cluster()
                .unwrap()
                .brokers
                .iter()
                .all(|b| b.id != 2)
    });
    assert_eq!(
        publish(&control, "t", 3000..4000),
        2,
        "the live brokers only"
    );
    let after = read(&control, "t", 3000, 1000);
    assert_exactly_once(&after, 3000, 3000..4000);
    // What it had written before it died stays readable, in the same order.
    assert_eq!(read(&control, "t", 0, 3000), a);

    f1.stop();
    seq.stop();
    head.proc.stop();
}

/// A head that did not run for five death timeouts (stopped here; a paused VM or a head
/// starved of CPU alike) finds its live follower alive when it runs again: the heartbeats
/// that waited in its sockets are taken, and the follower is neither told it was declared
/// dead nor made to rejoin (its clients would have failed over away from it for nothing).
/// A follower killed during the pause is still declared dead once the head runs again.
#[test]
fn a_head_stopped_past_the_death_timeout_declares_no_follower_dead() {
    let head = start_head_with(3, &[]);
    let mut live = follower(&head.control, 1);
    let dying = follower(&head.control, 2);
    wait_for("both followers alive", || {
        members(&head.control)[1..] == [(1, "alive".into()), (2, "alive".into())]
    });
    head.proc.signal("STOP");
    // Follower 2 dies while the head is stopped: the pause must not hide its death.
    dying.kill();
    // The stimulus, not a wait for an event: five death timeouts (3 x 100 ms) stopped.
    std::thread::sleep(Duration::from_millis(1500));
    head.proc.signal("CONT");
    live.wait_line("the head answers heartbeats again");
    assert!(
        !live.printed("declared this broker dead"),
        "the live follower was told it was dead"
    );
    wait_for("the killed follower declared dead", || {
        members(&head.control)[2] == (2, "dead".into())
    });
    let status = Admin::new(&head.control).status().unwrap();
    let member = &status.cluster.members[1];
    assert_eq!(
        (member.state, member.joins),
        (embarcadero_client::MemberState::Alive, 1),
        "alive, never rejoined"
    );
}

/// A follower that dies and stays dead is fenced by the head itself once it has been
/// dead for the reader stall timeout: an order-5 topic (whose publishers fail over
/// without asking the head) goes on for more than a GOI's length of batches after the
/// death. Before, its logs were fenced only when an order-2 publisher asked or a new
/// process claimed the id, the sequencer waited for the dead broker to reclaim the
/// batches its GOI slots held, and every publisher of the topic stalled for good once
/// the GOI wrapped to them.
#[test]
fn a_topic_goes_on_past_a_goi_length_of_batches_after_a_broker_died_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("small-goi.toml");
    // A follower dead for the reader stall timeout is fenced: 1 s here, 30 s by default.
    let toml = "[region]\ngoi_slots = 1024\n[broker]\nreader_stall_timeout_ms = 1000\n";
    std::fs::write(&config, toml).unwrap();
    let config = config.display().to_string();
    let head = start_head_with(3, &["--config", &config]);
    let control = head.control.clone();
    let (f1, f2) = (follower(&control, 1), follower(&control, 2));
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", 5))
        .unwrap();
    assert_eq!(
        publish(&control, "t", 0..4000),
        3,
        "every broker holds batches"
    );
    f2.kill();
    wait_for("broker 2 declared dead", || {
        members(&control)
            .iter()
            .any(|(id, state)| *id == 2 && state == "dead")
    });
    // 100-byte messages in 4 KiB batches: about 36 a batch, so 3 GOIs' length. On its
    // own thread: a stalled topic blocks `publish` for good once every queue is full.
    let (done, published) = std::sync::mpsc::channel();
    let to = control.clone();
    std::thread::spawn(move || done.send(publish(&to, "t", 4000..120_000)));
    published
        .recv_timeout(Duration::from_secs(120))
        .expect("the topic stalled after broker 2's death");
    let info = Admin::new(&control).describe_topic("t").unwrap();
    assert_eq!(info.next_position, 120_000);
    drop(f1);
}

/// Topic delete in cluster mode: the follower's broker (another process on the region)
/// lets go of the topic's log on its own and its segments come back, as do the head's;
/// the external sequencer drops the topic; the name then makes a new topic that every
/// process serves from position 0.
#[test]
fn a_deleted_topic_is_let_go_by_followers_and_the_external_sequencer() {
    let head = start_head(2);
    let control = head.control.clone();
    let (f1, f1_metrics) = follower_with_metrics(&control, 1);
    let seq = sequencer(&control);
    let admin = Admin::new(&control);
    let free = |text: &str, broker: u32| {
        sample(
            text,
            &format!("embarcadero_free_segments{{broker=\"{broker}\"}}"),
        )
    };
    let all_free = (free(&scrape(&control), 0), free(&scrape(&f1_metrics), 1));
    admin.create_topic(&TopicSpec::new("t", 2)).unwrap();
    assert_eq!(publish(&control, "t", 0..2000), 2, "both brokers used");
    assert!(
        free(&scrape(&f1_metrics), 1) < all_free.1,
        "the follower took segments"
    );

    admin.delete_topic("t").unwrap();
    wait_for("every segment back, on the head and the follower", || {
        (free(&scrape(&control), 0), free(&scrape(&f1_metrics), 1)) == all_free
    });
    admin.create_topic(&TopicSpec::new("t", 2)).unwrap();
    assert_eq!(publish(&control, "t", 0..500), 2);
    assert_exactly_once(&read(&control, "t", 0, 500), 0, 0..500);

    f1.stop();
    seq.stop();
    head.proc.stop();
}

#[test]
fn a_standby_sequencer_takes_over_when_the_active_one_dies() {
    let head = start_head(2);
    let control = head.control.clone();
    let f1 = follower(&control, 1);
    let active = sequencer(&control);
    let (mut standby, _) = Proc::ready(
        &["sequencer", "--head-addr", &control, "--standby"],
        &[],
        "standby: waiting",
    );
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", 2))
        .unwrap();
    publish(&control, "t", 0..500);
    let epoch = |control: &str| {
        Admin::new(control)
            .status()
            .unwrap()
            .cluster
            .sequencer
            .expect("a head reports its sequencer's lease")
            .fencing_epoch
    };
    assert_eq!(epoch(&control), 1);

    active.kill();
    standby.wait_line("sequencer is active");
    assert_eq!(
        epoch(&control),
        2,
        "the new holder has the next fencing epoch"
    );
    // Ordering resumes: new batches are acknowledged and follow the old ones.
    publish(&control, "t", 500..1000);
    let all = read(&control, "t", 0, 1000);
    assert_exactly_once(&all, 0, 0..1000);

    standby.stop();
    f1.stop();
    head.proc.stop();
}

#[test]
fn bad_cluster_input_is_refused_with_clear_errors() {
    let head = start_head(2);
    let control = head.control.clone();
    let f1 = follower(&control, 1);
    let seq = sequencer(&control);
    let refused = |args: &[&str], expect: &str| {
        let out = run_bin(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(
            err.contains(expect),
            "{args:?}: expected {expect:?} in {err}"
        );
    };
    let follower_args = |id: &'static str| {
        vec![
            "broker",
            "--follower",
            "--head-addr",
            control.as_str(),
            "--broker-id",
            id,
        ]
    };
    refused(&follower_args("1"), "is in use by");
    refused(&follower_args("0"), "served by the head itself");
    refused(&follower_args("7"), "out of range");
    refused(
        &["sequencer", "--head-addr", &control],
        "holds this region's lease",
    );

    // A region file that is not the head's: zeros, and a real region of another layout.
    let dir = tempfile::tempdir().unwrap();
    let zeros = dir.path().join("zeros");
    std::fs::write(&zeros, vec![0u8; 1 << 20]).unwrap();
    let mut args = follower_args("1");
    args.extend(["--region", zeros.to_str().unwrap()]);
    refused(&args, "is not the head's region");
    let other = common::Serve::start_with(dir.path(), &["--brokers", "3"]);
    other.stop();
    let other_region = dir.path().join("region");
    let mut args = follower_args("1");
    args.extend(["--region", other_region.to_str().unwrap()]);
    refused(&args, "is not the head's region");

    let nowhere = format!("127.0.0.1:{}", free_port());
    refused(
        &[
            "broker",
            "--follower",
            "--head-addr",
            &nowhere,
            "--broker-id",
            "1",
        ],
        "cannot reach the head",
    );
    refused(
        &["sequencer", "--head-addr", &nowhere],
        "cannot reach the head",
    );

    // None of it disturbed the cluster.
    assert_eq!(
        members(&control),
        [(0, "local".into()), (1, "alive".into())]
    );
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", 2))
        .unwrap();
    publish(&control, "t", 0..100);
    assert_exactly_once(&read(&control, "t", 0, 100), 0, 0..100);
    seq.stop();
    f1.stop();
    head.proc.stop();
}

/// One publisher publishes through the SIGKILL of a follower and its restart under the
/// same id: ids 0..COUNT, with broker 2 killed a third of the way and restarted at once,
/// then more, a flushed round at a time, until the restarted process has acknowledged
/// batches of that same publisher. Checks exactly-once and one order for two
/// subscribers, then that a new publisher uses the restarted broker too. Returns the
/// ids in delivery order and how many the first publisher published.
fn publish_through_a_broker_death_and_restart(order: u8) -> (Vec<u64>, usize) {
    const COUNT: u64 = 60_000;
    let mut head = start_head_with(3, &[]);
    let control = head.control.clone();
    let f1 = follower(&control, 1);
    let f2 = follower(&control, 2);
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", order))
        .unwrap();
    let published = Arc::new(AtomicU64::new(0));
    let (restarted_tx, restarted_rx) = std::sync::mpsc::channel::<String>();
    let publisher = {
        let (control, published) = (control.clone(), published.clone());
        std::thread::spawn(move || {
            let p = Publisher::connect(
                &control,
                "t",
                PublisherConfig {
                    batch_bytes: 8192,
                    flush_timeout: Duration::from_secs(60),
                    ..PublisherConfig::default()
                },
            )
            .unwrap();
            let mut payload = [7u8; 100];
            let mut publish = |count: u64| {
                for _ in 0..count {
                    let id = published.load(Ordering::Acquire);
                    payload[..8].copy_from_slice(&id.to_le_bytes());
                    p.publish(&payload).unwrap();
                    published.store(id + 1, Ordering::Release);
                }
            };
            publish(COUNT);
            // Broker 2 died meanwhile and is coming back as a new process.
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut restarted = None;
            loop {
                // Small rounds: each waits for its acknowledgements, which paces them.
                publish(10);
                p.flush().unwrap();
                restarted = restarted.or_else(|| restarted_rx.try_recv().ok());
                let through_restarted = |addr: &String| {
                    p.stats()
                        .queues
                        .iter()
                        .any(|q| &q.broker == addr && q.acked_batches > 0)
                };
                if restarted.as_ref().is_some_and(through_restarted) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the publisher never got an acknowledgement through the restarted broker"
                );
            }
            p.close().unwrap()
        })
    };
    // The kill lands in the middle of the stream, with batches in flight on broker 2.
    wait_for("a third of the messages published", || {
        published.load(Ordering::Acquire) >= COUNT / 3
    });
    let victim = broker_addr(&control, 2);
    // A subscriber served by broker 2 pins what it has not read yet.
    let mut pinned = Subscriber::connect_brokers(
        std::slice::from_ref(&victim),
        "t",
        SubscriberConfig {
            max_reconnects: 0,
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    let mut got = 0;
    while got == 0 {
        got = pinned.poll_with(Duration::from_secs(20), |_| {}).unwrap();
    }
    let killed_at = Instant::now();
    f2.kill();
    // Once the head declares broker 2 dead, it frees that subscriber's reader slot, so
    // the pin stops holding memory now rather than after the 30 s stall timeout.
    let released = strip_ansi(
        &head
            .proc
            .wait_line("released its subscribers' reader slots"),
    );
    assert!(released.contains("broker=2 released=1"), "{released}");
    drop(pinned);

    // A new process for broker 2, while the publisher keeps going: it waits until the
    // head has declared the killed one dead, resumes its logs (the holes the kill left
    // are voided, the fenced slots stay unordered) and serves again.
    let mut f2 = Proc::spawn(
        &[
            "broker",
            "--follower",
            "--head-addr",
            &control,
            "--broker-id",
            "2",
        ],
        &[],
    );
    let resumed = f2.wait_line("resumed the log");
    assert!(resumed.contains("next_pbr"), "{resumed}");
    let f2_metrics = metrics_address(&f2.wait_line("is serving at"));
    assert_eq!(
        members(&control),
        [
            (0, "local".into()),
            (1, "alive".into()),
            (2, "alive".into())
        ]
    );
    let restarted = broker_addr(&control, 2);
    assert_ne!(restarted, victim, "a new process on a new port");
    restarted_tx.send(restarted.clone()).unwrap();

    let stats = publisher.join().unwrap();
    let count = published.load(Ordering::Acquire);
    eprintln!(
        "order {order}: {count} messages; the publisher finished {:.2} s after the kill",
        killed_at.elapsed().as_secs_f64()
    );
    assert_eq!(stats.messages, count);
    assert_eq!(
        stats.acked_batches, stats.batches,
        "every batch acknowledged (moved to the live brokers or found in the order)"
    );
    let through = |addr: &str| stats.queues.iter().find(|q| q.broker == addr).unwrap();
    assert!(
        through(&victim).batches > 0,
        "broker 2 had been given batches before it died"
    );
    assert!(
        through(&restarted).acked_batches > 0,
        "the restarted broker acknowledged batches of the publisher that saw it die"
    );
    // The restarted process's own counter: it received them.
    let received: u64 = scrape(&f2_metrics)
        .lines()
        .find_map(|l| l.strip_prefix("embarcadero_publish_batches_total{broker=\"2\"} "))
        .expect("broker 2's batch counter")
        .parse()
        .unwrap();
    assert!(received > 0, "the restarted process received batches");
    let a = read(&control, "t", 0, count);
    let b = read(&control, "t", 0, count);
    assert_exactly_once(&a, 0, 0..count);
    assert_eq!(a, b, "two subscribers, one order");

    // A publisher that connects now uses the restarted broker from the start.
    assert_eq!(
        publish(&control, "t", count..count + 10_000),
        3,
        "new publishers use the restarted broker"
    );
    let all = read(&control, "t", 0, count + 10_000);
    assert_eq!(
        &all[..count as usize],
        &a[..],
        "the order of the first publisher's messages stands"
    );
    assert_exactly_once(&all, 0, 0..count + 10_000);
    assert!(
        all[count as usize..].iter().any(|m| m.2 == 2),
        "the restarted broker's batches are in the order"
    );
    assert_eq!(read(&control, "t", 0, count + 10_000), all, "one order");
    f2.stop();
    f1.stop();
    head.proc.stop();
    (all.iter().map(|m| m.1).collect(), count as usize)
}

#[test]
fn order2_publishers_fail_over_from_a_killed_broker_exactly_once_and_use_it_again_once_restarted() {
    publish_through_a_broker_death_and_restart(2);
}

#[test]
fn order5_sessions_fail_over_from_a_killed_broker_in_session_order_and_use_it_again_once_restarted()
{
    let (ids, first) = publish_through_a_broker_death_and_restart(5);
    assert!(
        ids[..first].windows(2).all(|w| w[0] < w[1]),
        "one session across the kill and the restart: delivered in publish order"
    );
    assert!(
        ids[first..].windows(2).all(|w| w[0] < w[1]),
        "the second session too"
    );
}

/// Issue 26's revert, at its smallest: an order-5 session over shared memory whose
/// channels' rings are full of batches built in place (each kept in its ring until
/// acknowledged, to resend from) when a follower is SIGKILLed. The failover moves the
/// dead broker's batches, which carry the session's lowest unordered sequences, into
/// the live channels' rings; the batches kept there are acknowledged only once those are
/// ordered. A channel whose room waited for acknowledgements deadlocked there (its
/// broker refused SlowPayload 30 s later); its writes now copy kept batches out of the
/// ring instead. Every message is delivered exactly once, in publish order.
#[test]
fn an_order5_session_over_shm_fails_over_while_its_rings_hold_batches_built_in_place() {
    const COUNT: u64 = 40_000;
    let head = start_head_with(3, &[]);
    let control = head.control.clone();
    let f1 = follower(&control, 1);
    let f2 = follower(&control, 2);
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", 5))
        .unwrap();
    let published = Arc::new(AtomicU64::new(0));
    let publisher = {
        let (control, published) = (control.clone(), published.clone());
        std::thread::spawn(move || {
            // Sixteen batches of 64 KiB may be in flight per channel; its ring holds
            // seven or eight of them.
            let config = PublisherConfig {
                batch_bytes: 64 * 1024,
                shm_ring_bytes: 512 * 1024,
                transport: Transport::Shm,
                flush_timeout: Duration::from_secs(60),
                ..PublisherConfig::default()
            };
            let p = Publisher::connect(&control, "t", config).unwrap();
            let mut payload = [3u8; 1000];
            for id in 0..COUNT {
                payload[..8].copy_from_slice(&id.to_le_bytes());
                p.publish(&payload).unwrap();
                published.store(id + 1, Ordering::Release);
            }
            p.close().unwrap()
        })
    };
    wait_for("a third of the messages published", || {
        published.load(Ordering::Acquire) >= COUNT / 3
    });
    let victim = broker_addr(&control, 2);
    f2.kill();
    let stats = publisher.join().unwrap();
    assert_eq!(stats.messages, COUNT);
    assert!(
        stats
            .queues
            .iter()
            .any(|q| q.broker == victim && q.batches > 0),
        "the killed broker had batches"
    );
    assert_eq!(
        stats.acked_batches, stats.batches,
        "every batch acknowledged"
    );
    let in_place: u64 = stats.queues.iter().map(|q| q.in_place).sum();
    let copied_out: u64 = stats.queues.iter().map(|q| q.copied_out).sum();
    assert!(in_place > 0, "batches were built in the rings");
    assert!(
        copied_out > 0,
        "a live ring's room was needed while batches built in it awaited their acks"
    );
    let got = read(&control, "t", 0, COUNT);
    assert_exactly_once(&got, 0, 0..COUNT);
    assert!(
        got.windows(2).all(|w| w[0].1 < w[1].1),
        "one session: delivered in publish order"
    );
    // The failover sent batches a second time: a copy may still sit in the dead
    // broker's log, and ordered once the session's slot had gone to a new session it
    // would be taken for that session's batch. So closing did not end the session.
    let ended = "embarcadero_sequencer_sessions_ended_by_publisher_total";
    assert_eq!(sample(&scrape(&control), ended), 0);
    f1.stop();
    head.proc.stop();
}

/// A real etcd on loopback ports of its own, or `None` (with a notice) when the
/// machine has no `etcd` (Debian: `apt-get install etcd-server`; `.ci/run` installs it).
fn etcd() -> Option<(Proc, String, tempfile::TempDir)> {
    if Command::new("etcd").arg("--version").output().is_err() {
        eprintln!("NOTICE: etcd is not installed; skipping the etcd election test (apt-get install etcd-server)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let (client, peer) = (free_port(), free_port());
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let data = dir.path().display().to_string();
    let cluster = format!("default={peer_url}");
    let (proc, _) = Proc::ready_program(
        "etcd",
        &[
            "--data-dir",
            &data,
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &cluster,
        ],
        "ready to serve client requests",
    );
    Some((proc, client_url, dir))
}

#[test]
fn sequencers_elected_in_etcd_take_over_and_refuse_a_second_leader() {
    let Some((etcd, url, _etcd_dir)) = etcd() else {
        return;
    };
    let head = start_head(2);
    let control = head.control.clone();
    let f1 = follower(&control, 1);
    let (active, _) = Proc::ready(
        &["sequencer", "--head-addr", &control, "--etcd", &url],
        &[],
        "sequencer is active",
    );
    // A second sequencer that is not a standby is refused, naming the leader.
    let out = run_bin(&["sequencer", "--head-addr", &control, "--etcd", &url]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("leads this cluster in etcd"), "{err}");
    let (mut standby, _) = Proc::ready(
        &[
            "sequencer",
            "--head-addr",
            &control,
            "--etcd",
            &url,
            "--standby",
        ],
        &[],
        "standby: waiting to be elected",
    );
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", 2))
        .unwrap();
    publish(&control, "t", 0..300);

    active.kill();
    standby.wait_line("sequencer is active");
    publish(&control, "t", 300..600);
    assert_exactly_once(&read(&control, "t", 0, 600), 0, 0..600);

    // An etcd nobody listens on: a clear error, nothing started.
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let out = run_bin(&["sequencer", "--head-addr", &control, "--etcd", &nowhere]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd"), "{err}");

    standby.stop();
    f1.stop();
    head.proc.stop();
    etcd.kill();
}

/// One call to etcd's JSON gateway at `url`.
fn etcd_call(url: &str, path: &str, body: serde_json::Value) -> serde_json::Value {
    ureq::post(&format!("{url}/v3/{path}"))
        .send_json(body)
        .unwrap()
        .into_json()
        .unwrap()
}

/// The IDs of every lease etcd holds now.
fn etcd_leases(url: &str) -> Vec<String> {
    let v = etcd_call(url, "lease/leases", serde_json::json!({}));
    v["leases"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|l| l["ID"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Polls `what` until it holds, for at most 30 s.
fn eventually(what: &str, mut holds: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !holds() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_candidate_whose_lease_expired_while_waiting_still_wins_when_the_leader_goes() {
    use embarcadero_server::election::{campaign, current_leader, election_key};
    let Some((etcd, url, _etcd_dir)) = etcd() else {
        return;
    };
    let key = election_key("lease-expiry");
    let ttl = Duration::from_secs(2);
    let leader = campaign(&url, &key, "a", ttl, &AtomicBool::new(false))
        .unwrap()
        .expect("the first candidate wins");
    let kv = etcd_call(
        &url,
        "kv/range",
        serde_json::json!({ "key": base64_of(&key) }),
    );
    let leader_lease = kv["kvs"][0]["lease"].as_str().unwrap().to_string();
    let give_up = Arc::new(AtomicBool::new(false));
    let candidate = {
        let (url, key, give_up) = (url.clone(), key.clone(), give_up.clone());
        std::thread::spawn(move || campaign(&url, &key, "b", ttl, &give_up))
    };
    eventually("the second candidate holds a lease", || {
        etcd_leases(&url).len() == 2
    });
    // What etcd does when a lease expires: the waiting candidate's lease is gone.
    let first = etcd_leases(&url);
    let waiting = first.iter().find(|l| **l != leader_lease).unwrap().clone();
    etcd_call(&url, "lease/revoke", serde_json::json!({ "ID": waiting }));
    eventually("the candidate granted itself another lease", || {
        let now = etcd_leases(&url);
        now.len() == 2 && !now.contains(&waiting)
    });
    drop(leader); // resigns: revokes its lease, so the key goes
    let won = candidate.join().unwrap().unwrap();
    assert!(won.is_some(), "the candidate won once the leader went");
    assert_eq!(current_leader(&url, &key).unwrap().as_deref(), Some("b"));
    // A candidate that gives up takes its lease with it, at once.
    let quitter = {
        let (url, key, give_up) = (url.clone(), key.clone(), give_up.clone());
        std::thread::spawn(move || campaign(&url, &key, "c", ttl, &give_up))
    };
    eventually("the third candidate holds a lease", || {
        etcd_leases(&url).len() == 2
    });
    give_up.store(true, Ordering::Release);
    assert!(quitter.join().unwrap().unwrap().is_none());
    assert_eq!(
        etcd_leases(&url).len(),
        1,
        "only the leader's lease is left"
    );
    drop(won);
    etcd.kill();
}

/// `s` as etcd's JSON gateway takes keys (base64).
fn base64_of(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[test]
fn a_paused_sequencer_is_killed_by_its_successor_before_it_writes() {
    let head = start_head(2);
    let control = head.control.clone();
    let f1 = follower(&control, 1);
    let (mut old, _) = Proc::ready(
        &["sequencer", "--head-addr", &control],
        &[],
        "sequencer is active",
    );
    let (mut standby, _) = Proc::ready(
        &["sequencer", "--head-addr", &control, "--standby"],
        &[],
        "standby: waiting",
    );
    Admin::new(&control)
        .create_topic(&TopicSpec::new("t", 2))
        .unwrap();
    publish(&control, "t", 0..300);
    old.signal("STOP");
    // Its lease runs out; the standby, on the same host, kills it (a stopped process
    // cannot defer SIGKILL) before it writes anything, so the paused one never resumes
    // in the middle of an epoch's writes.
    standby.wait_line("killed it before taking over");
    standby.wait_line("sequencer is active");
    let exit = old.wait();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(exit.signal(), Some(9), "the paused sequencer was SIGKILLed");
    publish(&control, "t", 300..600);
    assert_exactly_once(&read(&control, "t", 0, 600), 0, 0..600);
    standby.stop();
    f1.stop();
    head.proc.stop();
}

/// A head that restarts builds a fresh region from the old one (and from its disk
/// replicas), while a follower and an external sequencer may still be attached to the old
/// one, ordering and acknowledging. They must acknowledge nothing the new head did not read
/// from the old region: that would live only in a region nobody reads again. A publisher
/// writes to the follower the whole time (order 2, rf 2, ack 1); every batch it got an
/// acknowledgement for must be in the new region's order, once.
fn restart_the_head_under_a_publisher(through_head: bool, kill_after_acked: usize) {
    let dir = tempfile::tempdir().unwrap();
    let (head, control) = head_process(dir.path(), 0, 2, &["--external-sequencer"]);
    let port: u16 = control.rsplit(':').next().unwrap().parse().unwrap();
    let mut old_sequencer = sequencer(&control);
    let mut f1 = follower(&control, 1);
    Admin::new(&control)
        .create_topic(&TopicSpec::new("z", 2).replicated(2))
        .unwrap();
    let victim_addr = broker_addr(&control, 1);

    // Groups of 100 ids, each flushed: a group counts once its flush succeeded.
    let acked = Arc::new(std::sync::Mutex::new(Vec::<u64>::new()));
    let head_restarted = Arc::new(AtomicBool::new(false));
    let publisher = {
        let (acked, head_restarted) = (acked.clone(), head_restarted.clone());
        let control_for_publisher = control.clone();
        std::thread::spawn(move || {
            let config = PublisherConfig {
                batch_bytes: 4096,
                flush_timeout: Duration::from_secs(10),
                ..PublisherConfig::default()
            };
            let p = if through_head {
                Publisher::connect(&control_for_publisher, "z", config)
            } else {
                Publisher::connect_brokers(&[victim_addr], "z", config)
            }
            .unwrap();
            let mut payload = [7u8; 100];
            let mut after_restart = 0;
            for group in 0u64.. {
                let ids = group * 100..(group + 1) * 100;
                for id in ids.clone() {
                    payload[..8].copy_from_slice(&id.to_le_bytes());
                    if let Err(e) = p.publish(&payload) {
                        eprintln!("the publisher stops: {e}");
                        return;
                    }
                }
                if let Err(e) = p.flush() {
                    eprintln!("the publisher stops: {e}");
                    return;
                }
                acked.lock().unwrap().extend(ids);
                // A follower that never stopped would keep acknowledging: give up well
                // after the restart, with its acknowledgements in hand.
                if head_restarted.load(Ordering::Acquire) {
                    after_restart += 1;
                    if after_restart == 100 {
                        return;
                    }
                }
            }
        })
    };
    wait_for("acknowledgements before the head dies", || {
        acked.lock().unwrap().len() >= kill_after_acked
    });
    // A subscriber of the follower reads through the restart, until it is cut off. The
    // head dies only once it has read something: otherwise a head that restarts within
    // ~100 ms (a quick machine) cut it off before its first round (CI, session 28).
    let old_reader_read = Arc::new(AtomicU64::new(0));
    let old_reader = {
        let read_count = old_reader_read.clone();
        let mut sub = Subscriber::connect_brokers(
            &[broker_addr(&control, 1)],
            "z",
            SubscriberConfig {
                max_reconnects: 0,
                ..SubscriberConfig::default()
            },
        )
        .unwrap();
        std::thread::spawn(move || {
            let mut got = Vec::new();
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(30) {
                let polled = sub.poll_with(Duration::from_millis(200), |m| {
                    let id = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
                    got.push((m.position, id));
                });
                read_count.store(got.len() as u64, Ordering::Release);
                if polled.is_err() {
                    break;
                }
            }
            got
        })
    };
    // And one made through the head reads on through the restart, whichever broker it is
    // on: it asks the head for the brokers again once none it knows answers (here every
    // address changes: ephemeral ports). It stops at `through_head_target` messages.
    let through_head_target = Arc::new(AtomicU64::new(u64::MAX));
    let through_head_reader = {
        let mut sub = Subscriber::connect(
            &control,
            "z",
            SubscriberConfig {
                max_reconnects: 100,
                ..SubscriberConfig::default()
            },
        )
        .unwrap();
        let target = through_head_target.clone();
        std::thread::spawn(move || {
            let mut got = Vec::new();
            let started = Instant::now();
            while (got.len() as u64) < target.load(Ordering::Acquire) {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "the subscriber through the head stalled at {} messages",
                    got.len()
                );
                sub.poll_with(Duration::from_millis(200), |m| {
                    let id = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
                    got.push((m.position, id));
                })
                .expect("the subscriber through the head rides out the restart");
            }
            got
        })
    };
    wait_for("the old region's subscriber to read", || {
        old_reader_read.load(Ordering::Acquire) > 0
    });
    head.kill();
    let (head, _) = head_process(dir.path(), port, 2, &["--external-sequencer"]);
    head_restarted.store(true, Ordering::Release);
    // The old region's processes exit saying why.
    let line = f1.wait_line("replaced the region this process was attached to");
    assert!(line.contains("broker 1"), "{line}");
    assert!(!f1.wait().success(), "the follower exits with an error");
    old_sequencer.wait_line("replaced the region this sequencer ordered");
    assert!(!old_sequencer.wait().success());
    publisher.join().unwrap();
    let acked = acked.lock().unwrap().clone();
    let old_reader = old_reader.join().unwrap();
    assert!(!old_reader.is_empty());
    let old_reader_end = old_reader.iter().map(|m| m.0 + 1).max().unwrap();
    eprintln!(
        "{} ids acknowledged; the old region's subscriber read up to position {old_reader_end}",
        acked.len()
    );

    // Started again, they attach to the new region.
    let new_sequencer = sequencer(&control);
    let f1 = follower(&control, 1);
    let wanted: HashSet<u64> = acked.iter().copied().collect();
    let read_all = || {
        let mut sub = Subscriber::connect(&control, "z", SubscriberConfig::default()).unwrap();
        let mut got = Vec::new();
        let mut seen = HashSet::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !wanted.is_subset(&seen) || (got.len() as u64) < old_reader_end {
            assert!(
                Instant::now() < deadline,
                "{} acknowledged ids are missing, e.g. {:?}",
                wanted.difference(&seen).count(),
                wanted.difference(&seen).min()
            );
            sub.poll_with(Duration::from_millis(200), |m| {
                let id = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
                assert!(seen.insert(id), "id {id} delivered twice");
                got.push((m.position, id));
            })
            .unwrap();
        }
        got
    };
    let a = read_all();
    let positions: Vec<u64> = a.iter().map(|m| m.0).collect();
    assert_eq!(
        positions,
        (0..a.len() as u64).collect::<Vec<_>>(),
        "contiguous positions"
    );
    let b = read_all();
    assert_eq!(
        a[..b.len().min(a.len())],
        b[..b.len().min(a.len())],
        "one order"
    );
    through_head_target.store(a.len() as u64, Ordering::Release);
    let through_head = through_head_reader.join().unwrap();
    assert_eq!(
        through_head[..a.len()],
        a[..],
        "the subscriber through the head saw the same order, across the restart"
    );
    // What the old region's subscriber was given agrees with the new region's order.
    let order: std::collections::HashMap<u64, u64> = a.iter().copied().collect();
    for (position, id) in &old_reader {
        assert_eq!(
            order.get(position),
            Some(id),
            "position {position} was delivered with id {id} from the old region"
        );
    }
    new_sequencer.stop();
    f1.stop();
    head.stop();
}

#[test]
fn a_restarted_head_stops_the_followers_of_the_region_it_replaced() {
    restart_the_head_under_a_publisher(false, 5_000);
}

#[test]
fn publishers_through_a_restarted_head_lose_and_repeat_nothing() {
    restart_the_head_under_a_publisher(true, 5_000);
}

/// Soak, not in the default suite (`scripts/chaos-head-restart.sh` runs it): the restart
/// above `HEAD_RESTART_ROUNDS` times (default 50), alternating the publisher's way in and
/// moving the kill between 300 and 20 000 acknowledged ids.
#[test]
#[ignore]
fn head_restart_soak() {
    let rounds: u64 = std::env::var("HEAD_RESTART_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    for round in 0..rounds {
        // A spread of kill points without a random source: a multiplicative walk.
        let kill_after = 300 + (round * 7919 % 197) as usize * 100;
        eprintln!("round {round}: kill after {kill_after} acknowledged ids");
        restart_the_head_under_a_publisher(round % 2 == 1, kill_after);
    }
}
