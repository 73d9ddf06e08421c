//! Memory-only topics never reuse a position (issue 22): after a restart without the
//! previous region (deleted here; a reboot does the same), every order level continues
//! past every position handed out before, the topic's description shows it, and the
//! lost range answers PositionNotRetained naming the first available position. With
//! the region kept, positions continue where they were.

mod common;

use common::config;
use embarcadero_client::{
    Admin, Cursor, Error, Message, Publisher, PublisherConfig, Subscriber, SubscriberConfig,
    TopicSpec,
};
use embarcadero_server::positions::CEILING_STEP;
use embarcadero_server::Server;
use std::path::Path;
use std::time::{Duration, Instant};

fn start_in(dir: &Path) -> Server {
    Server::start(config(dir)).expect("server starts")
}

fn publish(server: &Server, topic: &str, count: u64) {
    let p = Publisher::connect(
        &server.control_addr().to_string(),
        topic,
        PublisherConfig {
            batch_bytes: 1024,
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    for i in 0..count {
        p.publish(&i.to_le_bytes()).unwrap();
    }
    p.close().unwrap();
}

fn subscriber(server: &Server, topic: &str, start: Cursor) -> Subscriber {
    Subscriber::connect(
        &server.control_addr().to_string(),
        topic,
        SubscriberConfig {
            start: Some(start),
            ..SubscriberConfig::default()
        },
    )
    .unwrap()
}

/// Reads `count` messages from `start`.
fn read(server: &Server, topic: &str, start: Cursor, count: usize) -> Vec<Message> {
    let mut s = subscriber(server, topic, start);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < count {
        assert!(Instant::now() < deadline, "only {} of {count}", out.len());
        if let Some(m) = s.poll(Duration::from_millis(200)).unwrap() {
            out.push(m);
        }
    }
    out
}

/// The first error a subscriber from `start` gets (after any number of empty polls).
fn first_error(server: &Server, topic: &str, start: Cursor) -> Error {
    let mut s = subscriber(server, topic, start);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "no error");
        match s.poll(Duration::from_millis(200)) {
            Err(e) => return e,
            Ok(m) => assert!(m.is_none(), "an old position was delivered: {m:?}"),
        }
    }
}

/// Where the topic's positions stand per `topic describe`: the next global position
/// (orders 2, 5), or each broker's message count (orders 0, 1).
fn described(server: &Server, topic: &str) -> Vec<u64> {
    let info = Admin::new(&server.control_addr().to_string())
        .describe_topic(topic)
        .unwrap();
    if info.order >= 2 {
        return vec![info.next_position];
    }
    info.brokers.iter().map(|b| b.messages).collect()
}

const COUNT: u64 = 200;

/// Publishes, loses the region, restarts, publishes again: checks every new position
/// is past every old one, the description, and the refusal of the lost range.
fn positions_move_forward_after_the_region_is_lost(order: u8) {
    let dir = tempfile::tempdir().unwrap();
    let topic = format!("mem{order}");
    let server = start_in(dir.path());
    Admin::new(&server.control_addr().to_string())
        .create_topic(&TopicSpec::new(&topic, order))
        .unwrap();
    let brokers = server.broker_addrs().len();
    let from_zero = || match order {
        0 | 1 => Cursor::PerBroker(vec![0; brokers]),
        _ => Cursor::Global(0),
    };
    publish(&server, &topic, COUNT);
    let old = read(&server, &topic, from_zero(), COUNT as usize);
    let old_max = old.iter().map(|m| m.position).max().unwrap();
    drop(server);
    std::fs::remove_file(dir.path().join("region")).unwrap();

    let server = start_in(dir.path());
    let start = described(&server, &topic);
    assert!(
        start.iter().all(|p| *p > old_max && *p >= CEILING_STEP),
        "order {order}: the topic continues at {start:?}, past {old_max}"
    );
    let err = first_error(&server, &topic, from_zero());
    let first = common::first_available(&err);
    publish(&server, &topic, COUNT);
    let new = match order {
        0 | 1 => read(
            &server,
            &topic,
            Cursor::PerBroker(start.clone()),
            COUNT as usize,
        ),
        _ => read(&server, &topic, Cursor::Global(start[0]), COUNT as usize),
    };
    assert!(
        new.iter()
            .all(|m| m.position >= first && m.position > old_max),
        "order {order}: new positions {:?} are past the old ones (up to {old_max})",
        new.iter().map(|m| m.position).collect::<Vec<_>>()
    );
    assert!(
        start.contains(&first),
        "order {order}: {first} in {start:?}"
    );
    // Once there is new data, the old range still answers the same way.
    assert_eq!(
        common::first_available(&first_error(&server, &topic, from_zero())),
        first
    );
    let moved = described(&server, &topic);
    assert!(
        moved.iter().zip(&start).all(|(m, s)| m >= s)
            && moved.iter().sum::<u64>() > start.iter().sum(),
        "order {order}: {moved:?} after {start:?}"
    );
}

#[test]
fn order0_positions_move_forward_after_the_region_is_lost() {
    positions_move_forward_after_the_region_is_lost(0);
}

#[test]
fn order1_positions_move_forward_after_the_region_is_lost() {
    positions_move_forward_after_the_region_is_lost(1);
}

#[test]
fn order2_positions_move_forward_after_the_region_is_lost() {
    positions_move_forward_after_the_region_is_lost(2);
}

#[test]
fn order5_positions_move_forward_after_the_region_is_lost() {
    positions_move_forward_after_the_region_is_lost(5);
}

/// Every start without the region moves past the previous one's positions too (the
/// ceiling was raised, and persisted, by the start before), and a restart with the
/// region keeps counting where it was, for orders 0 and 1 as well.
#[test]
fn every_lost_region_moves_positions_forward_and_a_kept_one_continues_them() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(dir.path());
    let admin = Admin::new(&server.control_addr().to_string());
    admin.create_topic(&TopicSpec::new("fifo", 1)).unwrap();
    admin.create_topic(&TopicSpec::new("total", 2)).unwrap();
    publish(&server, "fifo", COUNT);
    publish(&server, "total", COUNT);
    let (fifo, total) = (described(&server, "fifo"), described(&server, "total"));
    assert_eq!(fifo.iter().sum::<u64>(), COUNT);
    assert_eq!(total, vec![COUNT]);
    drop(server);

    // The region is kept: the positions continue.
    let server = start_in(dir.path());
    assert_eq!(described(&server, "fifo"), fifo);
    assert_eq!(described(&server, "total"), total);
    drop(server);

    let mut before = (0, 0);
    for round in 1..=2u64 {
        std::fs::remove_file(dir.path().join("region")).unwrap();
        let server = start_in(dir.path());
        let (fifo, total) = (described(&server, "fifo"), described(&server, "total"));
        assert!(fifo
            .iter()
            .all(|p| *p >= round * CEILING_STEP && *p > before.0));
        assert!(total[0] >= round * CEILING_STEP && total[0] > before.1);
        publish(&server, "fifo", COUNT);
        publish(&server, "total", COUNT);
        before = (
            *described(&server, "fifo").iter().max().unwrap(),
            described(&server, "total")[0],
        );
    }
}

/// A subscriber from "the beginning" of a memory-only topic whose server restarted
/// knows at connect, before anything arrives, that the readable log starts where the
/// restart left it: the positions before went with the previous region. A reader that
/// waits to reach the `next_position` it was told (the workflow engine's replay) would
/// otherwise wait for ever on an empty topic (issue 27). With the region kept (a killed
/// server) and with it lost (a reboot); a replicated topic still starts at 0.
#[test]
fn a_subscriber_from_the_beginning_knows_where_a_restarted_memory_only_topic_starts() {
    for lose_region in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let server = start_in(dir.path());
        let admin = Admin::new(&server.control_addr().to_string());
        admin
            .create_topic(&TopicSpec::new("mem5", 5).replicated(1))
            .unwrap();
        admin
            .create_topic(&TopicSpec::new("disk5", 5).replicated(2))
            .unwrap();
        publish(&server, "mem5", COUNT);
        // Durable (ack 2) before the stop, so that the restarted server has it on disk.
        let durable = PublisherConfig {
            ack_level: 2,
            ..PublisherConfig::default()
        };
        let p = Publisher::connect(&server.control_addr().to_string(), "disk5", durable).unwrap();
        p.publish(b"kept").unwrap();
        p.close().unwrap();
        drop(server);
        if lose_region {
            std::fs::remove_file(dir.path().join("region")).unwrap();
        }

        let server = start_in(dir.path());
        let from_start = |topic| {
            let control = server.control_addr().to_string();
            Subscriber::connect(&control, topic, SubscriberConfig::default()).unwrap()
        };
        let next = described(&server, "mem5")[0];
        assert!(next >= COUNT, "lose_region {lose_region}: next {next}");
        assert_eq!(
            from_start("mem5").position(),
            Cursor::Global(next),
            "lose_region {lose_region}"
        );
        let mut disk = from_start("disk5");
        assert_eq!(
            disk.position(),
            Cursor::Global(0),
            "lose_region {lose_region}"
        );
        let first = disk
            .poll(Duration::from_secs(30))
            .unwrap()
            .expect("a message");
        assert_eq!(first.position, 0, "lose_region {lose_region}");
    }
}
