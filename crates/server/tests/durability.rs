//! Disk replicas and ack 2: acknowledged data survives restarts and the loss of the
//! region file, old data is read back from disk, retention names the first position
//! kept, a failing disk holds back acknowledgements without losing anything, and a
//! raised topic limit keeps the topics.

mod common;

use common::{config, TestServer};
use embarcadero_client::{
    Cursor, Error, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec,
};
use embarcadero_replication::store::{list_segments, SegmentFile};
use embarcadero_server::{Server, ServerConfig};
use std::path::Path;
use std::time::{Duration, Instant};

fn start_in(dir: &Path, tweak: impl Fn(&mut ServerConfig)) -> Server {
    let mut c = config(dir);
    tweak(&mut c);
    Server::start(c).expect("server starts")
}

fn publish(control: &str, topic: &str, ack: u8, from: u64, count: u64, size: usize) {
    let p = Publisher::connect(
        control,
        topic,
        PublisherConfig {
            ack_level: ack,
            batch_bytes: 64 * 1024,
            flush_timeout: Duration::from_secs(60),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let mut payload = vec![0u8; size.max(8)];
    for i in from..from + count {
        payload[..8].copy_from_slice(&i.to_le_bytes());
        p.publish(&payload).unwrap();
    }
    if let Err(e) = p.close() {
        let text = TestServer::metric_text(control);
        let interesting: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("embarcadero_replica") || l.starts_with("embarcadero_topic"))
            .filter(|l| !l.contains("bucket"))
            .collect();
        panic!(
            "publishing to {topic} failed: {e}\n{}",
            interesting.join("\n")
        );
    }
}

/// Reads `count` messages from `start` and returns their (position, id) pairs.
fn read(control: &str, topic: &str, start: u64, count: u64) -> Vec<(u64, u64)> {
    let mut s = Subscriber::connect(
        control,
        topic,
        SubscriberConfig {
            start: Some(Cursor::Global(start)),
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut out = Vec::with_capacity(count as usize);
    while (out.len() as u64) < count {
        assert!(
            Instant::now() < deadline,
            "only {} of {count} read",
            out.len()
        );
        if let Some(m) = s.poll(Duration::from_millis(200)).unwrap() {
            let id = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
            out.push((m.position, id));
        }
    }
    out
}

/// Order 5 (one session): positions contiguous and messages in publish order.
fn assert_in_order(got: &[(u64, u64)], first_position: u64, first_id: u64) {
    for (i, (position, id)) in got.iter().enumerate() {
        assert_eq!(
            *position,
            first_position + i as u64,
            "positions are contiguous"
        );
        assert_eq!(*id, first_id + i as u64, "message {i} out of order");
    }
}

/// Order 2 (batches spread over brokers): positions contiguous from `first_position`
/// and every id of `ids` exactly once.
fn assert_exactly_once(got: &[(u64, u64)], first_position: u64, ids: std::ops::Range<u64>) {
    for (i, (position, _)) in got.iter().enumerate() {
        assert_eq!(
            *position,
            first_position + i as u64,
            "positions are contiguous"
        );
    }
    let mut seen: Vec<u64> = got.iter().map(|(_, id)| *id).collect();
    seen.sort_unstable();
    assert_eq!(seen, ids.collect::<Vec<_>>(), "every message exactly once");
}

#[test]
fn ack2_data_survives_a_restart_without_the_region_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_in(dir.path(), |_| {});
    let control = server.control_addr().to_string();
    server
        .create_topic(embarcadero_server::TopicSpec {
            name: "durable".into(),
            order: 2,
            replication_factor: 2,
            default_ack: 2,
            retention_bytes: None,
            retention_ms: None,
        })
        .unwrap();
    publish(&control, "durable", 2, 0, 5000, 200);
    let order_before = read(&control, "durable", 0, 5000);
    assert_exactly_once(&order_before, 0, 0..5000);
    let before = server.topic("durable").unwrap();
    assert_eq!(before.next_position, 5000);
    assert_eq!(
        before.durable_batches, before.committed_batches,
        "ack 2 returned only once everything was durable"
    );
    server.stop();
    drop(server);
    std::fs::remove_file(dir.path().join("region")).unwrap();

    let server = start_in(dir.path(), |_| {});
    let control = server.control_addr().to_string();
    let after = server.topic("durable").unwrap();
    assert_eq!(
        after.next_position, 5000,
        "positions continue, never reused"
    );
    assert_eq!(after.committed_batches, before.committed_batches);
    assert_eq!(
        read(&control, "durable", 0, 5000),
        order_before,
        "the same order"
    );
    // New data continues the log, and old and new read as one log.
    publish(&control, "durable", 2, 5000, 1000, 200);
    let all = read(&control, "durable", 0, 6000);
    assert_exactly_once(&all, 0, 0..6000);
    assert_eq!(all[..5000], order_before[..]);
}

#[test]
fn a_lost_replica_is_repaired_from_the_other_and_rf_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_in(dir.path(), |_| {});
    let control = server.control_addr().to_string();
    let admin = embarcadero_client::Admin::new(&control);
    let e = admin
        .create_topic(&TopicSpec::new("unordered", 0).replicated(2))
        .unwrap_err();
    assert!(e.to_string().contains("order 2 or 5"), "{e}");
    let e = admin
        .create_topic(&TopicSpec::new("too-many", 2).replicated(4))
        .unwrap_err();
    assert!(e.to_string().contains("replication.dirs"), "{e}");
    admin
        .create_topic(&TopicSpec::new("three", 2).replicated(3))
        .unwrap();
    publish(&control, "three", 2, 0, 3000, 300);
    let order_before = read(&control, "three", 0, 3000);
    server.stop();
    drop(server);
    // Replica 1 loses its disk; the region is gone too.
    std::fs::remove_dir_all(dir.path().join("replica-1")).unwrap();
    std::fs::remove_file(dir.path().join("region")).unwrap();
    let server = start_in(dir.path(), |_| {});
    let control = server.control_addr().to_string();
    assert_eq!(read(&control, "three", 0, 3000), order_before);
    assert!(
        std::fs::read_dir(dir.path().join("replica-1"))
            .unwrap()
            .next()
            .is_some(),
        "replica 1 was rebuilt"
    );
    // Ack 2 on a memory-only topic is refused at publish time.
    admin_memory_topic(&control);
}

fn admin_memory_topic(control: &str) {
    embarcadero_client::Admin::new(control)
        .create_topic(&TopicSpec::new("memory", 2))
        .unwrap();
    let p = Publisher::connect(
        control,
        "memory",
        PublisherConfig {
            ack_level: 2,
            ..PublisherConfig::default()
        },
    );
    let err = match p {
        Err(e) => e,
        Ok(p) => {
            p.publish(b"x").unwrap();
            p.flush().unwrap_err()
        }
    };
    assert!(err.to_string().contains("replication"), "{err}");
}

/// 4 brokers x 4 segments x 1 MiB: 16 MiB of log memory, so data leaves it quickly.
fn small_log_memory(c: &mut ServerConfig) {
    c.region.segment_bytes = 1 << 20;
    c.region.segments_per_broker = 4;
    c.broker.max_batch_bytes = 512 * 1024;
    c.broker.max_message_bytes = 64 * 1024;
}

/// Several times the region's log memory goes through a replicated topic; a subscriber
/// then reads all of it back from position 0 (most of it from disk).
#[test]
fn several_regions_worth_of_data_read_back_from_position_zero() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(dir.path(), |c| {
        small_log_memory(c);
        c.replication.segment_bytes = 4 << 20;
    });
    let control = server.control_addr().to_string();
    embarcadero_client::Admin::new(&control)
        .create_topic(&TopicSpec::new("long", 2).replicated(2))
        .unwrap();
    // Four times the 16 MiB of log memory.
    let count = 64 * 1024;
    publish(&control, "long", 1, 0, count, 1000);
    assert!(reclaimed_batches(&server, "long") > 0, "memory was reused");
    assert_exactly_once(&read(&control, "long", 0, count), 0, 0..count);
}

#[test]
fn retention_removes_old_segments_and_names_the_first_position_kept() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(dir.path(), |c| {
        small_log_memory(c);
        c.replication.segment_bytes = 1 << 20;
        c.replication.retention_bytes = 4 << 20;
    });
    let control = server.control_addr().to_string();
    embarcadero_client::Admin::new(&control)
        .create_topic(&TopicSpec::new("short", 2).replicated(2))
        .unwrap();
    publish(&control, "short", 2, 0, 40_000, 1000);
    // Retention runs about once a second; wait for it through the metric, not a sleep.
    let deadline = Instant::now() + Duration::from_secs(30);
    while TestServer::sum_in(
        &TestServer::metric_text(&control),
        "embarcadero_replica_segments_removed_total",
    ) == 0
    {
        assert!(Instant::now() < deadline, "retention never ran");
        std::thread::sleep(Duration::from_millis(50));
    }
    let err = first_error(&control, "short", 0);
    let first = common::first_available(&err);
    assert!(first > 0 && first < 40_000, "{first}");
    // From there on, everything is there.
    let rest = read(&control, "short", first, 40_000 - first);
    assert_eq!(rest.len() as u64, 40_000 - first);
    assert_eq!(rest[0].0, first);
}

/// The first error a subscriber from `start` gets, after any number of empty polls.
fn first_error(control: &str, topic: &str, start: u64) -> Error {
    let mut s = Subscriber::connect(
        control,
        topic,
        SubscriberConfig {
            start: Some(Cursor::Global(start)),
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "no error for position {start}");
        match s.poll(Duration::from_millis(200)) {
            Err(e) => return e,
            Ok(m) => assert!(m.is_none(), "position {start} was delivered: {m:?}"),
        }
    }
}

/// A replica's segment files of `topic`, oldest first.
fn segment_files(replica: &Path, topic: &str) -> Vec<SegmentFile> {
    let prefix = format!("{topic}.");
    let topic_dir = std::fs::read_dir(replica)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&prefix)
        })
        .unwrap_or_else(|| panic!("no directory of {topic} in {}", replica.display()));
    list_segments(&topic_dir).unwrap()
}

/// Batches reclaimed from `topic`'s logs in memory, over all brokers.
fn reclaimed_batches(server: &Server, topic: &str) -> u64 {
    let info = server.topic(topic).unwrap();
    info.brokers.iter().map(|b| b.reclaimed_batches).sum()
}

/// Retention runs on each replica on its own schedule, so one replica may have removed
/// what another still holds: a subscriber is served from whichever holds the position,
/// and only a position no replica keeps is refused, naming the oldest any replica keeps.
#[test]
fn a_position_one_replica_removed_is_read_from_another() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(dir.path(), |c| {
        small_log_memory(c);
        c.replication.segment_bytes = 1 << 20;
    });
    let control = server.control_addr().to_string();
    embarcadero_client::Admin::new(&control)
        .create_topic(&TopicSpec::new("split", 2).replicated(3))
        .unwrap();
    let count = 40_000;
    publish(&control, "split", 2, 0, count, 1000);
    assert!(
        reclaimed_batches(&server, "split") > 0,
        "position 0 has left memory"
    );
    let one = segment_files(&dir.path().join("replica-1"), "split");
    let two = segment_files(&dir.path().join("replica-2"), "split");
    assert!(
        one.len() > 8 && two.len() > 8,
        "{} and {} segments",
        one.len(),
        two.len()
    );

    // Replica 1 removes its five oldest segments, as its retention would.
    for segment in &one[..5] {
        std::fs::remove_file(&segment.path).unwrap();
    }
    assert_exactly_once(&read(&control, "split", 0, count), 0, 0..count);

    // Replica 2 removes its two oldest: position 0 is now on no replica.
    for segment in &two[..2] {
        std::fs::remove_file(&segment.path).unwrap();
    }
    let first = common::first_available(&first_error(&control, "split", 0));
    assert_eq!(
        first,
        one[5].first_position.min(two[2].first_position),
        "the oldest position any replica keeps"
    );
    let rest = read(&control, "split", first, count - first);
    for (i, (position, _)) in rest.iter().enumerate() {
        assert_eq!(*position, first + i as u64, "positions are contiguous");
    }
    let mut ids: Vec<u64> = rest.iter().map(|(_, id)| *id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len() as u64, count - first, "every message once");
}

/// A replica log that a start finds with a hole: the files after the hole are set aside,
/// not deleted, and counted in `embarcadero_replica_set_aside_bytes`; recovery refills
/// the log from the other replica, so that replica alone can later rebuild everything.
#[test]
fn a_hole_in_a_replica_log_is_set_aside_counted_and_refilled() {
    let dir = tempfile::tempdir().unwrap();
    let small_segments = |c: &mut ServerConfig| c.replication.segment_bytes = 1 << 20;
    let mut server = start_in(dir.path(), small_segments);
    let control = server.control_addr().to_string();
    embarcadero_client::Admin::new(&control)
        .create_topic(&TopicSpec::new("holed", 2).replicated(3))
        .unwrap();
    let count = 10_000;
    publish(&control, "holed", 2, 0, count, 1000);
    let order_before = read(&control, "holed", 0, count);
    server.stop();
    drop(server);

    let one = segment_files(&dir.path().join("replica-1"), "holed");
    assert!(one.len() > 4, "{} segments", one.len());
    std::fs::remove_file(&one[2].path).unwrap();
    let after_hole: u64 = one[3..]
        .iter()
        .map(|s| std::fs::metadata(&s.path).unwrap().len())
        .sum();
    let mut server = start_in(dir.path(), small_segments);
    let control = server.control_addr().to_string();
    let text = TestServer::metric_text(&control);
    assert_eq!(
        TestServer::sum_in(&text, "embarcadero_replica_set_aside_bytes{replica=\"1\"}"),
        after_hole,
        "every file after the hole, counted"
    );
    assert_eq!(
        TestServer::sum_in(&text, "embarcadero_replica_set_aside_bytes{replica=\"2\"}"),
        0
    );
    server.stop();
    drop(server);

    // Replica 2 and the region are lost: replica 1, refilled, has to hold everything.
    std::fs::remove_dir_all(dir.path().join("replica-2")).unwrap();
    std::fs::remove_file(dir.path().join("region")).unwrap();
    let server = start_in(dir.path(), small_segments);
    let control = server.control_addr().to_string();
    assert_eq!(read(&control, "holed", 0, count), order_before);
}

/// A replica whose disk is full (injected ENOSPC): ack-2 publishers get no
/// acknowledgement, memory-only traffic carries on, the error shows in the metrics,
/// and once space returns everything is acknowledged and delivered exactly once.
#[test]
fn a_full_disk_holds_back_ack2_and_recovers_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("disk-full");
    let flag_for_config = flag.clone();
    let server = start_in(dir.path(), move |c| {
        c.replication.fault_enospc_flag = flag_for_config.clone();
        c.replication.retry_after_error_ms = 50;
    });
    let control = server.control_addr().to_string();
    let admin = embarcadero_client::Admin::new(&control);
    admin
        .create_topic(&TopicSpec::new("durable", 2).replicated(2))
        .unwrap();
    admin.create_topic(&TopicSpec::new("memory", 2)).unwrap();
    std::fs::write(&flag, b"").unwrap();

    let durable = Publisher::connect(
        &control,
        "durable",
        PublisherConfig {
            ack_level: 2,
            flush_timeout: Duration::from_secs(60),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    for i in 0u64..2000 {
        durable.publish(&i.to_le_bytes()).unwrap();
    }
    let waiter = std::thread::spawn(move || {
        durable.flush().unwrap();
        durable
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while TestServer::sum_in(
        &TestServer::metric_text(&control),
        "embarcadero_replica_disk_errors_total",
    ) < 2
    {
        assert!(Instant::now() < deadline, "the disk error never showed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = TestServer::metric_text(&control);
    assert!(
        TestServer::sum_in(&text, "embarcadero_replica_error{") != 0,
        "error gauge set"
    );
    // The API (and `status`, which shows it) names the failing replica and its error.
    let health = admin.describe_topic("durable").unwrap().health;
    let failing = health
        .replica_errors
        .first()
        .expect("the failing replica is named");
    assert_eq!(failing.replica, 1, "{health:?}");
    assert_eq!(failing.errno, libc::ENOSPC as u64, "{health:?}");
    let topic = server.topic("durable").unwrap();
    assert!(topic.committed_batches > 0, "the batches were ordered");
    assert_eq!(
        topic.durable_batches, 0,
        "nothing is durable while the disk is full"
    );
    assert!(
        !waiter.is_finished(),
        "no ack-2 acknowledgement without the fsync"
    );
    // Subscribers read a replicated topic below its durable frontier only: the
    // ordered batches stay invisible (a region loss now could not take back anything
    // a subscriber saw).
    let mut early = Subscriber::connect(
        &control,
        "durable",
        SubscriberConfig {
            start: Some(Cursor::Global(0)),
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    assert_eq!(
        early.poll(Duration::from_millis(300)).unwrap(),
        None,
        "nothing durable, nothing delivered"
    );
    // Memory-only traffic is unaffected.
    publish(&control, "memory", 1, 0, 3000, 100);
    assert_exactly_once(&read(&control, "memory", 0, 3000), 0, 0..3000);

    std::fs::remove_file(&flag).unwrap();
    let durable = waiter.join().unwrap();
    assert_eq!(durable.stats().acked_batches, durable.stats().batches);
    let topic = server.topic("durable").unwrap();
    assert_eq!(topic.durable_batches, topic.committed_batches);
    assert_eq!(
        TestServer::sum_in(
            &TestServer::metric_text(&control),
            "embarcadero_replica_error{"
        ),
        0,
        "error gauge cleared"
    );
    assert_exactly_once(&read(&control, "durable", 0, 2000), 0, 0..2000);
    assert_eq!(topic.durable_position, 2000);
    let health = admin.describe_topic("durable").unwrap().health;
    assert!(health.replica_errors.is_empty(), "cleared: {health:?}");
    let mut got = 0u64;
    while got < 2000 {
        early
            .poll_with(Duration::from_secs(20), |m| {
                assert_eq!(m.position, got);
                got += 1;
            })
            .unwrap();
    }
}

/// Order 5 with ack 2 across a restart: the session table is rebuilt from the replicas
/// and the same session continues, every message exactly once and in session order.
#[test]
fn order5_sessions_resume_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_in(dir.path(), |_| {});
    let control = server.control_addr().to_string();
    embarcadero_client::Admin::new(&control)
        .create_topic(&TopicSpec::new("sessions", 5).replicated(2))
        .unwrap();
    let session = |control: &str| {
        Publisher::connect(
            control,
            "sessions",
            PublisherConfig {
                ack_level: 2,
                client_id: Some(4242),
                session_epoch: 1,
                batch_bytes: 4096,
                ..PublisherConfig::default()
            },
        )
        .unwrap()
    };
    let p = session(&control);
    for i in 0u64..3000 {
        p.publish(&i.to_le_bytes()).unwrap();
    }
    p.close().unwrap();
    server.stop();
    drop(server);
    std::fs::remove_file(dir.path().join("region")).unwrap();
    let server = start_in(dir.path(), |_| {});
    let control = server.control_addr().to_string();
    let p = session(&control);
    for i in 3000u64..5000 {
        p.publish(&i.to_le_bytes()).unwrap();
    }
    p.close().unwrap();
    let got = read(&control, "sessions", 0, 5000);
    assert_in_order(&got, 0, 0);
    drop(server);
}

#[test]
fn the_topic_limit_names_its_setting_and_raising_it_keeps_topics_and_data() {
    let dir = tempfile::tempdir().unwrap();
    let spec = |name: &str| embarcadero_server::TopicSpec {
        name: name.into(),
        order: 2,
        replication_factor: 2,
        default_ack: 2,
        retention_bytes: None,
        retention_ms: None,
    };
    let mut server = start_in(dir.path(), |c| c.region.max_topics = 2);
    let control = server.control_addr().to_string();
    for name in ["t0", "t1"] {
        server.create_topic(spec(name)).unwrap();
        publish(&control, name, 2, 0, 100, 100);
    }
    let full = server.create_topic(spec("t2")).unwrap_err().to_string();
    assert!(full.contains("region.max_topics"), "{full}");
    assert!(!full.contains("fresh data dir"), "{full}");
    server.stop();
    drop(server);

    // What the error says to do: the same data dir, a higher limit.
    let server = start_in(dir.path(), |c| c.region.max_topics = 3);
    let control = server.control_addr().to_string();
    for name in ["t0", "t1"] {
        assert_exactly_once(&read(&control, name, 0, 100), 0, 0..100);
    }
    server.create_topic(spec("t2")).unwrap();
    publish(&control, "t2", 2, 0, 100, 100);
    assert_exactly_once(&read(&control, "t2", 0, 100), 0, 0..100);
}

/// Logs that gave their last segment back to the pool (more idle topics than segments)
/// continue after a restart on the same region where they ended: each topic's new
/// batches open a fresh segment, no segment is handed to two logs (`rebuild_pool`
/// asserts it), and old and new data read as one log, exactly once.
#[test]
fn logs_that_gave_back_their_last_segment_continue_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let tweak = |c: &mut ServerConfig| {
        small_log_memory(c);
        c.brokers = 1;
        c.region.max_topics = 16;
    };
    let topics: Vec<String> = (0..8).map(|i| format!("t{i}")).collect();
    let mut server = start_in(dir.path(), tweak);
    let control = server.control_addr().to_string();
    for name in &topics {
        server
            .create_topic(embarcadero_server::TopicSpec {
                replication_factor: 2,
                ..embarcadero_server::TopicSpec::new(name.as_str(), 2)
            })
            .unwrap();
        publish(&control, name, 1, 0, 100, 1000);
    }
    let retired = TestServer::sum_in(
        &TestServer::metric_text(&control),
        "embarcadero_retired_tail_segments_total",
    );
    assert!(retired >= 4, "8 topics on 4 segments: {retired} given back");
    server.stop();
    drop(server);

    let server = start_in(dir.path(), tweak);
    let control = server.control_addr().to_string();
    for name in &topics {
        publish(&control, name, 1, 100, 100, 1000);
    }
    for name in &topics {
        assert_exactly_once(&read(&control, name, 0, 200), 0, 0..200);
    }
}
