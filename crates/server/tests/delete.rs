//! Topic delete through the admin API and the client library: connected publishers and
//! subscribers are told `TopicDeleted` (and do not fail over), every broker's segments
//! come back, a deleted topic stays deleted across a restart, its slot is reused only
//! by the next start, and a restart with too few slots names the setting to raise.

mod common;

use common::config;
use embarcadero_client::{
    Error, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec,
};
use embarcadero_server::{Server, ServerConfig};
use embarcadero_wire::ErrorCode;
use std::path::Path;
use std::time::{Duration, Instant};

/// A hang guard for waits on the server, far above any normal delay.
const GUARD: Duration = Duration::from_secs(30);

fn start_in(dir: &Path, tweak: impl Fn(&mut ServerConfig)) -> Server {
    let mut c = config(dir);
    tweak(&mut c);
    Server::start(c).expect("server starts")
}

fn free_segments(control: &str) -> Vec<u64> {
    let status = embarcadero_client::Admin::new(control).status().unwrap();
    status.brokers.iter().map(|b| b.free_segments).collect()
}

/// A subscriber from the beginning (position 0, or 0 on every broker).
fn subscriber(control: &str, topic: &str) -> Subscriber {
    Subscriber::connect(control, topic, SubscriberConfig::default()).unwrap()
}

/// Polls until the subscriber fails; returns its error (messages read meanwhile are
/// those published before the deletion).
fn subscriber_error(s: &mut Subscriber) -> Error {
    let deadline = Instant::now() + GUARD;
    loop {
        assert!(Instant::now() < deadline, "the subscriber was never told");
        if let Err(e) = s.poll(Duration::from_millis(100)) {
            return e;
        }
    }
}

fn assert_deleted(e: &Error, who: &str) {
    assert!(
        matches!(
            e,
            Error::Broker {
                code: ErrorCode::TopicDeleted,
                ..
            }
        ),
        "{who}: {e}"
    );
}

/// For a total order and for per-broker positions: a connected publisher and subscriber
/// get TopicDeleted as `Error::Broker`, the publisher does not fail over to another
/// broker (which would refuse it too, but as an unknown topic), and every broker's
/// segments are back in its pool.
#[test]
fn connected_clients_are_told_and_every_segment_comes_back() {
    let t = common::start();
    let control = t.control();
    let all_free = free_segments(&control);
    for (name, order) in [("total", 2), ("fifo", 1)] {
        t.create_topic(name, order);
        let config = PublisherConfig {
            ack_level: 1,
            flush_timeout: GUARD,
            ..PublisherConfig::default()
        };
        let p = Publisher::connect(&control, name, config).unwrap();
        let mut s = subscriber(&control, name);
        for i in 0u64..200 {
            p.publish(&i.to_le_bytes()).unwrap();
        }
        p.flush().unwrap();
        let first = s
            .poll(GUARD)
            .unwrap()
            .expect("a message before the deletion");
        assert_eq!(first.payload.len(), 8);
        assert!(free_segments(&control) < all_free, "{name} took segments");

        t.admin().delete_topic(name).unwrap();
        assert_deleted(&subscriber_error(&mut s), "subscriber");
        let deadline = Instant::now() + GUARD;
        let told = loop {
            assert!(Instant::now() < deadline, "the publisher was never told");
            match p.publish(b"after").and_then(|()| p.flush()) {
                Ok(()) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => break e,
            }
        };
        assert_deleted(&told, "publisher");
        drop(p);
        let deadline = Instant::now() + GUARD;
        while free_segments(&control) != all_free {
            assert!(
                Instant::now() < deadline,
                "{name}'s segments never came back"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let err = t.admin().describe_topic(name).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
        let hello = Subscriber::connect(&control, name, SubscriberConfig::default())
            .err()
            .expect("a deleted topic is not served");
        assert_eq!(hello.code(), Some(ErrorCode::UnknownTopic), "{hello}");
    }
}

/// The name is free at once and makes a new topic: positions from 0, and a subscriber
/// from 0 reads only the new topic's messages.
#[test]
fn a_topic_created_again_under_the_name_is_a_new_topic() {
    let t = common::start();
    let control = t.control();
    t.create_topic("again", 2);
    let p = Publisher::connect(&control, "again", PublisherConfig::default()).unwrap();
    for _ in 0..50 {
        p.publish(b"old").unwrap();
    }
    p.close().unwrap();
    let before = t.admin().delete_topic("again").unwrap();
    assert_eq!(
        before.next_position, 50,
        "the reply is the topic just before"
    );
    t.create_topic("again", 2);
    let p = Publisher::connect(&control, "again", PublisherConfig::default()).unwrap();
    p.publish(b"new").unwrap();
    p.close().unwrap();
    let mut s = subscriber(&control, "again");
    let m = s.poll(GUARD).unwrap().expect("the new message");
    assert_eq!((m.position, &m.payload[..]), (0, &b"new"[..]));
    assert!(s.poll(Duration::from_millis(200)).unwrap().is_none());
}

/// A deleted topic's slot is not reused while this region lives (processes may still
/// be letting go of it): with every slot taken or deleted, creation says a restart frees
/// them. After the restart (with the previous region file there to be read), the topic
/// is still gone, its disk replica too, and its slot takes a new topic, which starts
/// empty; the other topic kept its data.
#[test]
fn a_deleted_topic_stays_deleted_and_its_slot_is_reused_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let two = |c: &mut ServerConfig| c.region.max_topics = 2;
    let server = start_in(dir.path(), two);
    let control = server.control_addr().to_string();
    let admin = embarcadero_client::Admin::new(&control);
    for name in ["gone", "kept"] {
        admin
            .create_topic(&TopicSpec::new(name, 2).replicated(2))
            .unwrap();
        let config = PublisherConfig {
            ack_level: 2,
            ..PublisherConfig::default()
        };
        let p = Publisher::connect(&control, name, config).unwrap();
        p.publish(name.as_bytes()).unwrap();
        p.close().unwrap();
    }
    let gone = admin.delete_topic("gone").unwrap();
    let full = admin
        .create_topic(&TopicSpec::new("new", 2))
        .unwrap_err()
        .to_string();
    assert!(full.contains("next start"), "{full}");
    drop(server);

    let server = start_in(dir.path(), two);
    let control = server.control_addr().to_string();
    let admin = embarcadero_client::Admin::new(&control);
    let names: Vec<String> = admin
        .list_topics()
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["kept"]);
    let replica = dir.path().join("replica-1");
    let gone_dir = embarcadero_replication::topic_dir(&replica, "gone", gone.created_unix_ms);
    assert!(!gone_dir.exists(), "{} is still there", gone_dir.display());
    let new = admin.create_topic(&TopicSpec::new("new", 2)).unwrap();
    assert_eq!(
        (new.id, new.next_position),
        (gone.id, 0),
        "the slot, afresh"
    );
    let mut s = subscriber(&control, "kept");
    assert_eq!(&s.poll(GUARD).unwrap().unwrap().payload[..], b"kept");
    let mut s = subscriber(&control, "new");
    assert!(s.poll(Duration::from_millis(200)).unwrap().is_none());
}

/// A restart with fewer topic slots than the topics use names the setting and the
/// value it needs, and keeps the data dir for a start with enough.
#[test]
fn a_restart_with_too_few_slots_says_which_setting_to_raise() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_in(dir.path(), |c| c.region.max_topics = 3);
    for name in ["a", "b", "c"] {
        server
            .create_topic(embarcadero_server::TopicSpec {
                name: name.into(),
                order: 2,
                replication_factor: 1,
                default_ack: 1,
                retention_bytes: None,
                retention_ms: None,
            })
            .unwrap();
    }
    drop(server);
    let refused = Server::start({
        let mut c = config(dir.path());
        c.region.max_topics = 2;
        c
    })
    .err()
    .expect("too few slots")
    .to_string();
    assert!(
        refused.contains("region.max_topics") && refused.contains("at least 3"),
        "{refused}"
    );
    let server = start_in(dir.path(), |c| c.region.max_topics = 3);
    assert_eq!(server.topic("c").unwrap().name, "c");
}
