//! Order 5: total order plus per-session FIFO across brokers.

mod common;

use embarcadero_client::{
    Message, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec,
};
use embarcadero_wire::{
    message_stride, BatchHeader, BlogMessageHeader, ErrorCode, ErrorFrame, FrameHeader, FrameKind,
    Hello, HelloOk, Role,
};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

fn session_config() -> PublisherConfig {
    PublisherConfig {
        batch_bytes: 4 * 1024,
        linger: Duration::from_micros(200),
        threads_per_broker: 2,
        session_epoch: 1,
        ..PublisherConfig::default()
    }
}

fn read(brokers: &[String], topic: &str, n: usize) -> Vec<Message> {
    let mut s = Subscriber::connect_brokers(brokers, topic, SubscriberConfig::default()).unwrap();
    (0..n)
        .map(|i| {
            s.poll(Duration::from_secs(30))
                .unwrap()
                .unwrap_or_else(|| panic!("stuck after {i} messages"))
        })
        .collect()
}

/// Many sessions striped over every broker and two connections per broker, while
/// broker 1 delays a third of its batches: in the global order every session's
/// messages appear exactly in the order they were published, with no gap and no
/// duplicate, and every subscriber sees the same sequence.
#[test]
fn every_session_keeps_its_send_order_across_brokers_under_random_delays() {
    session_fifo(4096, 4000);
}

/// With a window of 4 batches and 8 connections per session, sessions constantly have
/// more in flight than the window: brokers hold those batches back until the session's
/// head moves (backpressure), and nothing is refused, reordered or lost.
#[test]
fn a_full_session_window_is_backpressure_not_an_error() {
    let t = session_fifo(4, 1000);
    let waits = t.metric_sum("embarcadero_session_window_waits_total");
    assert!(waits > 0, "batches were held back by the window");
}

fn session_fifo(window: u64, per_session: u64) -> common::TestServer {
    let t = common::start_with(|c| {
        c.broker.fault_broker = 1;
        c.broker.fault_delay_fraction = 0.3;
        c.broker.fault_delay_us = 2000;
        c.sequencer.session_window = window;
    });
    t.admin().create_topic(&TopicSpec::new("s", 5)).unwrap();
    const SESSIONS: usize = 5;
    let publishers: Vec<_> = (0..SESSIONS)
        .map(|_| {
            let brokers = t.brokers();
            std::thread::spawn(move || {
                let p = Publisher::connect_brokers(&brokers, "s", session_config()).unwrap();
                for i in 0..per_session {
                    p.publish(format!("{i}").as_bytes()).unwrap();
                }
                let id = p.client_id();
                p.close().expect("all acknowledged");
                id
            })
        })
        .collect();
    let ids: Vec<u64> = publishers.into_iter().map(|h| h.join().unwrap()).collect();
    let total = SESSIONS * per_session as usize;
    let a = read(&t.brokers(), "s", total);
    let b = read(&t.brokers(), "s", total);
    assert_eq!(a, b, "subscribers agree");
    let mut next: BTreeMap<u64, u64> = ids.iter().map(|id| (*id, 0)).collect();
    for (i, m) in a.iter().enumerate() {
        assert_eq!(m.position, i as u64);
        let expected = next.get_mut(&m.client_id).expect("known session");
        assert_eq!(m.counter, *expected, "session {} out of order", m.client_id);
        assert_eq!(m.payload, expected.to_string().as_bytes());
        *expected += 1;
    }
    assert!(next.values().all(|n| *n == per_session));
    t
}

/// Broker 1 drops the first batch that reaches it, so the session striped over all
/// brokers has a gap at its head. After the (short) lease the session is fenced; the
/// client reopens with the next epoch by itself and resends what was not committed, and
/// every message is delivered exactly once, in session order. A session that only uses
/// the healthy brokers keeps flowing the whole time.
#[test]
fn a_fenced_session_reopens_by_itself_and_delivers_exactly_once() {
    let t = common::start_with(|c| {
        c.broker.fault_broker = 1;
        c.broker.fault_drop_fraction = 1.0;
        c.broker.fault_drop_limit = 1;
        c.sequencer.session_lease_ms = 300;
    });
    t.admin().create_topic(&TopicSpec::new("f", 5)).unwrap();
    let healthy: Vec<String> = t
        .brokers()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != 1)
        .map(|(_, a)| a)
        .collect();
    const N: u64 = 3000;
    let total = 2 * N as usize;
    // Reads from the start, so everything stays in memory until it has seen it.
    let brokers = t.brokers();
    let reader = std::thread::spawn(move || read(&brokers, "f", total));
    let untouched = {
        let healthy = healthy.clone();
        std::thread::spawn(move || {
            let p = Publisher::connect_brokers(&healthy, "f", session_config()).unwrap();
            let mut flushes = Vec::new();
            for i in 0..N {
                p.publish(format!("{i}").as_bytes()).unwrap();
                if i % 300 == 299 {
                    let started = std::time::Instant::now();
                    p.flush()
                        .expect("the untouched session is acknowledged throughout");
                    flushes.push(started.elapsed());
                    std::thread::sleep(Duration::from_millis(30));
                }
            }
            let id = p.client_id();
            p.close().unwrap();
            (id, flushes)
        })
    };
    let p = Publisher::connect_brokers(&t.brokers(), "f", session_config()).unwrap();
    for i in 0..N {
        p.publish(format!("{i}").as_bytes()).unwrap();
    }
    let fenced_id = p.client_id();
    p.close()
        .expect("reopened after the fence and acknowledged");
    let (untouched_id, flushes) = untouched.join().unwrap();
    // The untouched session never waited for the fenced one's lease.
    assert!(
        flushes.iter().all(|d| *d < Duration::from_millis(300)),
        "{flushes:?}"
    );
    let got = reader.join().unwrap();
    let mut next: BTreeMap<u64, u64> = [(fenced_id, 0), (untouched_id, 0)].into();
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.position, i as u64);
        let expected = next.get_mut(&m.client_id).expect("one of the two sessions");
        assert_eq!(
            m.counter, *expected,
            "session {} out of order or duplicated",
            m.client_id
        );
        *expected += 1;
    }
    assert_eq!(next[&fenced_id], N);
    assert_eq!(next[&untouched_id], N);
    let (_, rec) = t.server.region().session_find(0, fenced_id).unwrap();
    assert!(
        rec.session_epoch >= 2,
        "the session was fenced and reopened: {rec:?}"
    );
}

/// Two publishers share one session (client id and key): the second, a restart of a
/// program whose first run still lives, opens a newer epoch (not the first's, though
/// both were configured with epoch 1), and the first then fails with SessionTakenOver
/// instead of reopening into the second's epoch, where both would number batches from
/// one counter and acknowledged batches of each would be dropped as duplicates. Every
/// acknowledged message is in the log exactly once.
#[test]
fn a_second_publisher_of_a_session_takes_it_over_and_the_first_stops() {
    take_over(1);
}

/// As above, with the second publisher configured with the epoch the first would
/// reopen with after a fence: the first must not join it.
#[test]
fn a_publisher_fenced_by_a_newer_epoch_it_did_not_open_stops() {
    take_over(2);
}

/// A first publisher of session 4242 at epoch 1, then a second one configured with
/// `second_epoch`; see the tests above.
fn take_over(second_epoch: u64) {
    let t = common::start();
    t.admin()
        .create_topic(&TopicSpec::new("takeover", 5))
        .unwrap();
    let config = PublisherConfig {
        client_id: Some(4242),
        session_key: Some(key_of(4242)),
        ..session_config()
    };
    let first = Publisher::connect_brokers(&t.brokers(), "takeover", config.clone()).unwrap();
    let mut acknowledged = Vec::new();
    for i in 0..10 {
        first.publish(format!("first {i}").as_bytes()).unwrap();
        acknowledged.push(format!("first {i}"));
    }
    first.flush().unwrap();
    let config = PublisherConfig {
        session_epoch: second_epoch,
        ..config
    };
    let second = Publisher::connect_brokers(&t.brokers(), "takeover", config).unwrap();
    for i in 0..10 {
        second.publish(format!("second {i}").as_bytes()).unwrap();
        acknowledged.push(format!("second {i}"));
    }
    second.flush().unwrap();
    let (_, rec) = t.server.region().session_find(0, 4242).unwrap();
    assert_eq!(
        rec.session_epoch, 2,
        "the second publisher opened a new epoch"
    );
    // The second's acknowledged batches moved the session to its epoch: the first's
    // connections are fenced, and it must not reopen into that epoch.
    let late: Vec<_> = (0..10)
        .map(|i| first.publish(format!("late {i}").as_bytes()))
        .collect();
    let error = late
        .into_iter()
        .find_map(Result::err)
        .or_else(|| first.flush().err())
        .expect("the first publisher was taken over: nothing more of it is acknowledged");
    assert_eq!(error.code(), Some(ErrorCode::SessionTakenOver), "{error}");
    assert!(
        error.to_string().contains("took this order-5 session over"),
        "{error}"
    );
    for i in 10..20 {
        second.publish(format!("second {i}").as_bytes()).unwrap();
        acknowledged.push(format!("second {i}"));
    }
    second.close().unwrap();
    let _ = first.close();
    // Everything acknowledged, once each; of the first's late messages, none was
    // acknowledged, so none is looked for (none can be in the log either: the broker
    // refuses a fenced epoch's batches).
    let got: Vec<String> = read(&t.brokers(), "takeover", acknowledged.len())
        .into_iter()
        .map(|m| String::from_utf8(m.payload).unwrap())
        .collect();
    assert_eq!(got, acknowledged);
}

/// Two publishers of one session live at once: the first publishes without pause
/// while the second opens its epoch and publishes. The second's epoch is switched to
/// at its hello, after every batch the first had ordered, so no batch of the second
/// takes a number the first used (which deduplication would drop and acknowledge):
/// every message either acknowledged is in the log exactly once, in its publisher's
/// order; of the first's last round (published, not acknowledged when it was taken
/// over) each is there at most once; nothing else is.
#[test]
fn two_live_publishers_of_a_session_lose_no_acknowledged_message() {
    const ROUND: usize = 4;
    let t = common::start();
    t.admin().create_topic(&TopicSpec::new("live", 5)).unwrap();
    let config = PublisherConfig {
        client_id: Some(4343),
        session_key: Some(key_of(4343)),
        ..session_config()
    };
    let (running, started) = std::sync::mpsc::channel();
    let brokers = t.brokers();
    let first_config = config.clone();
    // Rounds of `ROUND` messages, each flushed: a round whose flush returned is
    // acknowledged; the round that meets the takeover is not.
    let first = std::thread::spawn(move || {
        let p = Publisher::connect_brokers(&brokers, "live", first_config).unwrap();
        let (mut acked, mut unsure) = (Vec::new(), Vec::new());
        for round in 0..200_000 {
            let batch: Vec<String> = (0..ROUND).map(|i| format!("first {round} {i}")).collect();
            let sent = batch.iter().try_for_each(|m| p.publish(m.as_bytes()));
            if sent.and_then(|()| p.flush()).is_err() {
                unsure = batch;
                break;
            }
            acked.extend(batch);
            if round == 20 {
                running.send(()).unwrap();
            }
        }
        let error = p.close().expect_err("the first publisher was taken over");
        assert_eq!(error.code(), Some(ErrorCode::SessionTakenOver), "{error}");
        (acked, unsure)
    });
    started.recv().expect("the first publisher runs");
    let second = Publisher::connect_brokers(&t.brokers(), "live", config).unwrap();
    let mut second_acked = Vec::new();
    for round in 0..50 {
        for i in 0..ROUND {
            let m = format!("second {round} {i}");
            second.publish(m.as_bytes()).unwrap();
            second_acked.push(m);
        }
        second.flush().unwrap();
    }
    second.close().unwrap();
    let (first_acked, first_unsure) = first.join().unwrap();
    let total = t.server.topic("live").unwrap().next_position as usize;
    let got: Vec<String> = read(&t.brokers(), "live", total)
        .into_iter()
        .map(|m| String::from_utf8(m.payload).unwrap())
        .collect();
    let of = |prefix: &str| -> Vec<String> {
        got.iter()
            .filter(|m| m.starts_with(prefix))
            .cloned()
            .collect()
    };
    assert_eq!(
        of("second "),
        second_acked,
        "the second publisher's messages"
    );
    let first_got = of("first ");
    assert_eq!(
        first_got[..first_acked.len().min(first_got.len())],
        first_acked[..],
        "the first publisher's acknowledged messages, in order and once each"
    );
    let rest = &first_got[first_acked.len()..];
    assert!(
        rest.len() <= first_unsure.len() && rest.iter().all(|m| first_unsure.contains(m)),
        "beyond its acknowledged messages the log holds only the first's last round, once each: {rest:?}"
    );
}

/// The sequencer is stopped and restarted again and again while sessions publish: no
/// committed batch is lost, reordered or duplicated, and the sessions continue.
#[test]
fn sessions_survive_sequencer_restarts_under_load() {
    let mut t = common::start();
    t.admin().create_topic(&TopicSpec::new("r", 5)).unwrap();
    const SESSIONS: usize = 3;
    const PER_SESSION: u64 = 6000;
    let total = SESSIONS * PER_SESSION as usize;
    // Reading from the start, so its pin keeps everything in the (small) region.
    let brokers = t.brokers();
    let reader = std::thread::spawn(move || read(&brokers, "r", total));
    let publishers: Vec<_> = (0..SESSIONS)
        .map(|_| {
            let brokers = t.brokers();
            std::thread::spawn(move || {
                let p = Publisher::connect_brokers(&brokers, "r", session_config()).unwrap();
                let pad = vec![b'.'; 900];
                for i in 0..PER_SESSION {
                    let mut payload = format!("{i}").into_bytes();
                    payload.extend_from_slice(&pad);
                    p.publish(&payload).unwrap();
                    if i % 200 == 0 {
                        p.flush().unwrap();
                    }
                }
                let id = p.client_id();
                p.close()
                    .expect("all acknowledged across sequencer restarts");
                id
            })
        })
        .collect();
    let mut restarts = 0;
    while !publishers.iter().all(|p| p.is_finished()) {
        std::thread::sleep(Duration::from_millis(10));
        t.server.restart_sequencer().unwrap();
        restarts += 1;
    }
    assert!(
        restarts >= 3,
        "only {restarts} restarts happened while publishing"
    );
    let ids: Vec<u64> = publishers.into_iter().map(|h| h.join().unwrap()).collect();
    let got = reader.join().unwrap();
    let mut next: BTreeMap<u64, u64> = ids.iter().map(|id| (*id, 0)).collect();
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.position, i as u64);
        let expected = next.get_mut(&m.client_id).unwrap();
        assert_eq!(m.counter, *expected);
        *expected += 1;
    }
    assert!(next.values().all(|n| *n == PER_SESSION));
    assert_eq!(t.server.topic("r").unwrap().next_position, total as u64);
}

fn raw_publish(t: &common::TestServer, topic: &str, epoch: u64) -> TcpStream {
    raw_session(t, topic, 99, epoch)
}

/// A publish connection to broker 0 for session `(client, epoch)`, hello sent.
fn raw_session(t: &common::TestServer, topic: &str, client: u64, epoch: u64) -> TcpStream {
    raw_session_at(t, topic, client, epoch, 1)
}

fn raw_session_at(
    t: &common::TestServer,
    topic: &str,
    client: u64,
    epoch: u64,
    ack_level: u8,
) -> TcpStream {
    let mut s = TcpStream::connect(&t.brokers()[0]).unwrap();
    s.write_all(
        &Hello {
            role: Role::Publish,
            ack_level,
            client_id: client,
            session_epoch: epoch,
            start_position: 0,
            connection_index: 0,
            cursor_count: 0,
            topic: topic.into(),
            session_key: key_of(client),
            flags: 0,
            opener: 0,
        }
        .encode(),
    )
    .unwrap();
    s
}

/// The session key the raw test clients use: one per client id, never zero.
fn key_of(client: u64) -> [u8; 16] {
    let mut key = [0x5au8; 16];
    key[..8].copy_from_slice(&client.to_le_bytes());
    key
}

/// A publish connection to broker `broker` for session `(client, 1)`, ack 1, that
/// presents `key`; hello sent.
fn raw_keyed(
    t: &common::TestServer,
    broker: usize,
    topic: &str,
    client: u64,
    key: [u8; 16],
) -> TcpStream {
    let mut s = TcpStream::connect(&t.brokers()[broker]).unwrap();
    s.write_all(
        &Hello {
            role: Role::Publish,
            ack_level: 1,
            client_id: client,
            session_epoch: 1,
            start_position: 0,
            connection_index: 0,
            cursor_count: 0,
            topic: topic.into(),
            session_key: key,
            flags: 0,
            opener: 0,
        }
        .encode(),
    )
    .unwrap();
    s
}

/// A publish hello of session `(client, epoch)` of topic "owned" on broker `broker`,
/// with `flags` and `opener`: the connection and its HelloOk, or the broker's refusal.
fn raw_open(
    t: &common::TestServer,
    broker: usize,
    (client, epoch): (u64, u64),
    flags: u8,
    opener: u32,
) -> Result<(TcpStream, HelloOk), ErrorFrame> {
    let mut s = TcpStream::connect(&t.brokers()[broker]).unwrap();
    let hello = Hello {
        role: Role::Publish,
        ack_level: 1,
        client_id: client,
        session_epoch: epoch,
        start_position: 0,
        connection_index: 0,
        cursor_count: 0,
        topic: "owned".into(),
        session_key: key_of(client),
        flags,
        opener,
    };
    s.write_all(&hello.encode()).unwrap();
    let (h, body) = common::next_frame(&mut s);
    match h.kind {
        FrameKind::HelloOk => Ok((s, HelloOk::decode(&body).unwrap())),
        FrameKind::Error => Err(ErrorFrame::decode(&h, &body).unwrap()),
        other => panic!("a {other:?} frame before the HelloOk"),
    }
}

/// An epoch belongs to the publisher that opened it (its opener): the opener's other
/// connections join it, anyone else's hello for it is refused with SessionTakenOver,
/// opening or not, so a publisher taken over cannot reopen into its successor's epoch;
/// a newer epoch opened by another publisher fences the first one's connection.
#[test]
fn an_epoch_belongs_to_the_publisher_that_opened_it() {
    const CLIENT: u64 = 5151;
    let (first, second) = (0x0000_a11e_u32, 0x0000_b0b0_u32);
    let opens = embarcadero_wire::PUBLISH_OPENS_EPOCH;
    let t = common::start();
    t.admin().create_topic(&TopicSpec::new("owned", 5)).unwrap();
    let (mut opened, ok) = raw_open(&t, 0, (CLIENT, 1), opens, first).expect("opens epoch 1");
    assert_eq!(ok.next_batch_seq, 0);
    let (_, rec) = t.server.region().session_find(0, CLIENT).unwrap();
    assert_eq!((rec.session_epoch, rec.opener), (1, first), "{rec:?}");
    raw_open(&t, 1, (CLIENT, 1), opens, first).expect("the opener's other connection joins");
    let refusal = raw_open(&t, 1, (CLIENT, 1), opens, second).expect_err("another opener");
    assert_eq!(
        (refusal.code, refusal.session_epoch),
        (ErrorCode::SessionTakenOver, 1),
        "{refusal:?}"
    );
    raw_open(&t, 1, (CLIENT, 2), opens, second).expect("the second opens epoch 2");
    for flags in [0, opens] {
        let refusal = raw_open(&t, 0, (CLIENT, 2), flags, first).expect_err("not its epoch");
        assert_eq!(
            (refusal.code, refusal.session_epoch),
            (ErrorCode::SessionTakenOver, 2),
            "flags {flags}: {refusal:?}"
        );
    }
    let fenced = error_frame(&mut opened);
    assert_eq!(
        (fenced.code, fenced.session_epoch),
        (ErrorCode::SessionFenced, 2),
        "{fenced:?}"
    );
    // A hello that does not say it opens, for an epoch above the table's (a publisher
    // adding a broker after a fence), opens it all the same: it cannot publish unopened.
    let third = 0x0000_c0c0_u32;
    raw_open(&t, 2, (CLIENT, 3), 0, third).expect("epoch 3 is opened");
    let (_, rec) = t.server.region().session_find(0, CLIENT).unwrap();
    assert_eq!((rec.session_epoch, rec.opener), (3, third), "{rec:?}");
    let refusal = raw_open(&t, 0, (CLIENT, 3), opens, second).expect_err("taken");
    assert_eq!(refusal.code, ErrorCode::SessionTakenOver, "{refusal:?}");
    // An epoch whose opener the table does not know (0: an older client's, or a
    // restarted server's) may be another live publisher's: a publisher starting up does
    // not join it but opens the next one.
    const OTHER: u64 = 5252;
    raw_open(&t, 0, (OTHER, 1), 0, 0).expect("an older client opens epoch 1");
    let refusal = raw_open(&t, 1, (OTHER, 1), opens, first).expect_err("unknown opener");
    assert_eq!(
        (refusal.code, refusal.session_epoch),
        (ErrorCode::SessionTakenOver, 1),
        "{refusal:?}"
    );
    raw_open(&t, 1, (OTHER, 2), opens, first).expect("opens the next epoch");
}

/// Reads frames until an error frame, which it returns.
fn error_frame(s: &mut TcpStream) -> ErrorFrame {
    loop {
        let (h, body) = common::next_frame(s);
        if h.kind == FrameKind::Error {
            return ErrorFrame::decode(&h, &body).unwrap();
        }
    }
}

fn batch(seq: u64, epoch: u64) -> Vec<u8> {
    session_batch(99, seq, epoch)
}

/// Batch `seq` of session `(client, epoch)`: one 3-byte message.
fn session_batch(client: u64, seq: u64, epoch: u64) -> Vec<u8> {
    let mut payload = vec![0u8; message_stride(3) as usize];
    BlogMessageHeader {
        size: 3,
        client_id: client,
        ..Default::default()
    }
    .encode_into(&mut payload);
    let h = BatchHeader {
        batch_seq: seq,
        client_id: client,
        num_msg: 1,
        session_epoch: epoch,
        total_size: payload.len() as u64,
        ..Default::default()
    };
    [h.encode().to_vec(), payload].concat()
}

#[test]
fn bad_session_input_gets_clear_errors() {
    // A batch beyond the window waits this long for the session to move, then is refused.
    let t = common::start_with(|c| c.broker.backpressure_timeout_ms = 200);
    t.admin().create_topic(&TopicSpec::new("s", 5)).unwrap();
    t.create_topic("plain", 2);

    // A session on a topic that is not order 5, and no session on one that is.
    let mut s = raw_publish(&t, "plain", 1);
    assert_eq!(error_frame(&mut s).code, ErrorCode::BadSession);
    let mut s = raw_publish(&t, "s", 0);
    assert_eq!(error_frame(&mut s).code, ErrorCode::BadSession);
    // A session without a key.
    let mut s = raw_keyed(&t, 0, "s", 5, [0; 16]);
    let e = error_frame(&mut s);
    assert_eq!(e.code, ErrorCode::BadSession);
    assert!(e.message.contains("session key"), "{}", e.message);

    // A batch sequence far beyond the window.
    let mut s = raw_publish(&t, "s", 1);
    s.write_all(&batch(1_000_000, 1)).unwrap();
    let e = error_frame(&mut s);
    assert_eq!(e.code, ErrorCode::OutOfSequence);
    assert!(e.message.contains("window"), "{}", e.message);

    // Epoch 2 commits batch 0; epoch 1 is then stale and refused at the handshake.
    let mut s = raw_publish(&t, "s", 2);
    s.write_all(&batch(0, 2)).unwrap();
    let (ack, _) = frame_after_hello(&mut s);
    assert_eq!((ack.kind, ack.arg), (FrameKind::Ack, 1));
    // A retransmit of batch 0 is acknowledged again without being written twice.
    s.write_all(&batch(0, 2)).unwrap();
    let (ack, _) = common::next_frame(&mut s);
    assert_eq!((ack.kind, ack.arg), (FrameKind::Ack, 1));
    assert_eq!(t.server.topic("s").unwrap().next_position, 1);
    let mut stale = raw_publish(&t, "s", 1);
    let e = error_frame(&mut stale);
    assert_eq!(e.code, ErrorCode::SessionFenced);
    assert_eq!(
        e.fenced_hwm(),
        Some(1),
        "the frame carries the high-water mark"
    );
}

/// The attack of issue 28: a client that has only read the topic learns a publisher's
/// client id and session epoch from a delivery, and publishes as that session with
/// batch numbers ahead of the victim's, so the victim's real batches would be dropped as
/// duplicates yet acknowledged. The session belongs to the key that opened it: the
/// attacker is refused at the hello (also with a higher epoch), and every one of the
/// victim's messages is delivered, in order, acknowledged.
#[test]
fn a_reader_cannot_publish_as_another_clients_session() {
    let t = common::start();
    t.admin().create_topic(&TopicSpec::new("pay", 5)).unwrap();
    let victim = Publisher::connect_brokers(&t.brokers(), "pay", session_config()).unwrap();
    victim.publish(b"victim 0").unwrap();
    victim.flush().unwrap();
    let seen = read(&t.brokers(), "pay", 1);
    let client = seen[0].client_id;
    assert_eq!(client, victim.client_id());
    for epoch in [1, 2] {
        let mut s = TcpStream::connect(&t.brokers()[1]).unwrap();
        s.write_all(
            &Hello {
                role: Role::Publish,
                ack_level: 1,
                client_id: client,
                session_epoch: epoch,
                start_position: 0,
                connection_index: 7,
                cursor_count: 0,
                topic: "pay".into(),
                session_key: [0xee; 16],
                flags: 0,
                opener: 0,
            }
            .encode(),
        )
        .unwrap();
        let e = error_frame(&mut s);
        assert_eq!(
            e.code,
            ErrorCode::SessionKeyMismatch,
            "epoch {epoch}: {e:?}"
        );
        assert!(e.message.contains("another session key"), "{}", e.message);
    }
    for i in 1..50 {
        victim.publish(format!("victim {i}").as_bytes()).unwrap();
    }
    victim.flush().unwrap();
    let all = read(&t.brokers(), "pay", 50);
    for (i, m) in all.iter().enumerate() {
        assert_eq!(m.payload, format!("victim {i}").as_bytes(), "position {i}");
    }
    assert_eq!(t.server.topic("pay").unwrap().next_position, 50);
    assert!(t.metric_sum("embarcadero_session_key_refusals_total") >= 2);
}

/// A session is bound to its owner's key from the owner's hello (which opens it), not
/// from its first batch: a stranger who claims the session (a client id a user chose,
/// guessed) after the owner's hello, before the owner has published anything, is
/// refused at its hello with SessionKeyMismatch, and the owner carries on.
#[test]
fn an_owners_hello_binds_its_session_before_its_first_batch() {
    let t = common::start();
    t.admin().create_topic(&TopicSpec::new("race", 5)).unwrap();
    let mut owner = raw_keyed(&t, 0, "race", 4242, [1; 16]);
    assert_eq!(common::next_frame(&mut owner).0.kind, FrameKind::HelloOk);
    let mut thief = raw_keyed(&t, 1, "race", 4242, [2; 16]);
    let e = error_frame(&mut thief);
    assert_eq!(e.code, ErrorCode::SessionKeyMismatch, "{e:?}");
    for seq in 0..2 {
        owner.write_all(&session_batch(4242, seq, 1)).unwrap();
        let (ack, _) = common::next_frame(&mut owner);
        assert_eq!((ack.kind, ack.arg), (FrameKind::Ack, seq + 1));
    }
    assert_eq!(t.server.topic("race").unwrap().next_position, 2);
    assert!(t.metric_sum("embarcadero_session_key_refusals_total") >= 1);
}

/// An order-5 client that sends thousands of batches after a gap it never fills (batch 0
/// never comes) fills its connection's ack queue. Its connection must stop reading
/// without holding a reserved slot of the log: another session publishing through the
/// same broker is acknowledged all along, and the stuck session is fenced once its lease
/// runs out.
#[test]
fn a_session_that_never_fills_its_gap_holds_up_no_other_session() {
    let t = common::start_with(|c| {
        c.sequencer.session_lease_ms = 500;
        // Room in the log's ring for all of them, so the ack queue is what fills.
        c.region.pbr_slots = 8192;
    });
    t.admin().create_topic(&TopicSpec::new("g", 5)).unwrap();
    let mut stuck = raw_publish(&t, "g", 1);
    // More batches than a connection may have unacknowledged (4096), all after the gap.
    let flood: Vec<u8> = (0..5000).flat_map(|_| batch(1, 1)).collect();
    let mut writer = stuck.try_clone().unwrap();
    let flooding = std::thread::spawn(move || {
        // The broker stops reading once the queue is full; the rest stays unsent.
        writer
            .set_write_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let _ = writer.write_all(&flood);
    });
    let broker0 = vec![t.brokers()[0].clone()];
    let p = Publisher::connect_brokers(
        &broker0,
        "g",
        PublisherConfig {
            flush_timeout: Duration::from_secs(20),
            ..session_config()
        },
    )
    .unwrap();
    for round in 0..5 {
        for i in 0..200 {
            p.publish(format!("{round}-{i}").as_bytes()).unwrap();
        }
        p.flush().expect("the other session is acknowledged");
    }
    p.close().unwrap();
    let e = error_frame(&mut stuck);
    assert_eq!(e.code, ErrorCode::SessionFenced, "{}", e.message);
    drop(stuck);
    flooding.join().unwrap();
    assert_eq!(t.server.topic("g").unwrap().next_position, 1000);
}

/// Reads the HelloOk and then the first frame after it.
fn frame_after_hello(s: &mut TcpStream) -> (FrameHeader, Vec<u8>) {
    assert_eq!(common::next_frame(s).0.kind, FrameKind::HelloOk);
    common::next_frame(s)
}

/// Opens a session for `client` (epoch 1, ack 1), publishes its batch 0 and waits for
/// the acknowledgement; returns the open connection.
fn publish_first_batch(t: &common::TestServer, topic: &str, client: u64) -> TcpStream {
    let mut s = raw_session(t, topic, client, 1);
    s.write_all(&session_batch(client, 0, 1)).unwrap();
    let (ack, body) = frame_after_hello(&mut s);
    assert_eq!(
        (ack.kind, ack.arg),
        (FrameKind::Ack, 1),
        "client {client}: {:?}",
        (ack.kind == FrameKind::Error).then(|| ErrorFrame::decode(&ack, &body))
    );
    s
}

/// A full session table is not the end of a topic: a new client takes the slot of a
/// session idle for `sequencer.session_idle_evict_secs`, and so on for as many clients
/// as come, each batch ordered exactly once.
#[test]
fn idle_sessions_give_their_slots_to_new_clients() {
    let t = common::start_with(|c| c.sequencer.session_idle_evict_secs = 2);
    t.admin().create_topic(&TopicSpec::new("churn", 5)).unwrap();
    for client in 0..256 {
        drop(publish_first_batch(&t, "churn", client));
    }
    // What is tested is idleness: every session must have been idle for the threshold
    // (with room for a loaded machine, where a broker may take a while to see a close).
    std::thread::sleep(Duration::from_millis(4000));
    for client in 1000..1100 {
        drop(publish_first_batch(&t, "churn", client));
    }
    assert_eq!(
        t.metric_sum("embarcadero_sequencer_sessions_evicted_total"),
        100
    );
    assert_eq!(t.server.topic("churn").unwrap().next_position, 356);
}

/// A connected client's session is never taken for idle, whether it waits for acks
/// or publishes at ack 0: its broker keeps the session's stamp fresh, so new clients
/// take the slots of the closed sessions, and the connected ones go on.
#[test]
fn a_connected_session_keeps_its_slot_however_long_it_is_quiet() {
    let t = common::start_with(|c| c.sequencer.session_idle_evict_secs = 3);
    t.admin().create_topic(&TopicSpec::new("kept", 5)).unwrap();
    let mut waiting = publish_first_batch(&t, "kept", 5000);
    let mut quiet = raw_session_at(&t, "kept", 5001, 1, 0);
    quiet.write_all(&session_batch(5001, 0, 1)).unwrap();
    assert_eq!(common::next_frame(&mut quiet).0.kind, FrameKind::HelloOk);
    for client in 0..254 {
        drop(publish_first_batch(&t, "kept", client));
    }
    // Idleness is the property: the closed sessions must be idle for the threshold,
    // while the two connected ones stay quiet just as long.
    std::thread::sleep(Duration::from_millis(3500));
    for client in 1000..1254 {
        drop(publish_first_batch(&t, "kept", client));
    }
    assert_eq!(
        t.metric_sum("embarcadero_sequencer_sessions_evicted_total"),
        254
    );
    waiting.write_all(&session_batch(5000, 1, 1)).unwrap();
    let (ack, _) = common::next_frame(&mut waiting);
    assert_eq!(
        (ack.kind, ack.arg),
        (FrameKind::Ack, 2),
        "session 5000 went on"
    );
    quiet.write_all(&session_batch(5001, 1, 1)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while t.server.topic("kept").unwrap().next_position < 512 {
        assert!(
            std::time::Instant::now() < deadline,
            "session 5001's batch 1 is ordered"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(t.server.topic("kept").unwrap().next_position, 512);
}

/// A topic keeps a session slot per client id; once all 256 hold sessions active within
/// `sequencer.session_idle_evict_secs` (600 s by default), a new client is told so
/// (SessionsExhausted) at its hello. A client's hello opens its session, so one that
/// connected while there was room holds its slot and publishes once the table is full;
/// clients that have a slot carry on.
#[test]
fn a_new_session_is_refused_with_a_clear_error_once_every_slot_is_taken() {
    let t = common::start();
    t.admin().create_topic(&TopicSpec::new("full", 5)).unwrap();
    // Connected while there is room; publishes only once the table is full.
    let mut late = raw_session(&t, "full", 5000, 1);
    for client in 1000..1255 {
        publish_first_batch(&t, "full", client);
    }
    let mut refused = raw_session(&t, "full", 5001, 1);
    let e = error_frame(&mut refused);
    assert_eq!(e.code, ErrorCode::SessionsExhausted, "{}", e.message);
    assert!(e.message.contains("256"), "{}", e.message);

    late.write_all(&session_batch(5000, 0, 1)).unwrap();
    let (ack, _) = frame_after_hello(&mut late);
    assert_eq!(
        (ack.kind, ack.arg),
        (FrameKind::Ack, 1),
        "its hello took a slot"
    );

    // A client with a slot publishes on, on a new connection.
    let mut known = raw_session(&t, "full", 1000, 1);
    known.write_all(&session_batch(1000, 1, 1)).unwrap();
    let (ack, _) = frame_after_hello(&mut known);
    assert_eq!((ack.kind, ack.arg), (FrameKind::Ack, 2));
    assert_eq!(t.server.topic("full").unwrap().next_position, 257);
}

/// A publisher that closes ends its session (PROTOCOL.md section 8, "Ending a session"),
/// so that its slot goes to a new session at once: a script that runs `embarcadero pub`
/// in a loop, or a program that makes a publisher per request, used to take every slot
/// of the topic for `sequencer.session_idle_evict_secs` (600 s) after 256 of them. Over
/// both transports, each message is delivered once, in publishing order.
#[test]
fn publishers_that_close_give_their_session_slots_to_new_ones_at_once() {
    let t = common::start();
    t.admin()
        .create_topic(&TopicSpec::new("closing", 5))
        .unwrap();
    const PUBLISHERS: u64 = 300;
    for i in 0..PUBLISHERS {
        let config = PublisherConfig {
            session_epoch: 1,
            transport: if i % 2 == 0 {
                embarcadero_client::Transport::Tcp
            } else {
                embarcadero_client::Transport::Auto
            },
            ..PublisherConfig::default()
        };
        let p = Publisher::connect(&t.control(), "closing", config)
            .unwrap_or_else(|e| panic!("publisher {i}: {e}"));
        p.publish(&i.to_le_bytes()).unwrap();
        p.close().unwrap_or_else(|e| panic!("publisher {i}: {e}"));
    }
    let got: Vec<u64> = read(&t.brokers(), "closing", PUBLISHERS as usize)
        .iter()
        .map(|m| u64::from_le_bytes(m.payload[..8].try_into().unwrap()))
        .collect();
    assert_eq!(got, (0..PUBLISHERS).collect::<Vec<_>>());
    assert_eq!(
        t.metric_sum("embarcadero_sequencer_sessions_ended_by_publisher_total"),
        PUBLISHERS
    );
    assert_eq!(
        t.metric_sum("embarcadero_sequencer_sessions_evicted_total"),
        PUBLISHERS - 256,
        "each publisher past the 256th took the slot of one that closed"
    );
}

/// A session's end names no messages, is taken only on order 5, is the last thing its
/// connection sends, and can end only the connection's own session (the broker takes
/// the session from the hello it accepted, whatever epoch the header names): a
/// connection whose end is refused, or a session that did not end (its end named a
/// batch still to come), keeps its slot, so a full table still refuses a new client.
#[test]
fn a_session_end_ends_only_its_own_connections_session() {
    let t = common::start();
    t.admin().create_topic(&TopicSpec::new("o2", 2)).unwrap();
    t.admin().create_topic(&TopicSpec::new("ends", 5)).unwrap();
    let end_at = |client: u64, next_seq: u64, num_msg: u32, session_epoch: u64| {
        BatchHeader {
            batch_seq: next_seq,
            client_id: client,
            num_msg,
            flags: embarcadero_wire::BatchFlags::END_SESSION,
            session_epoch,
            ..Default::default()
        }
        .encode()
    };
    let end = |client: u64, next_seq: u64, num_msg: u32| end_at(client, next_seq, num_msg, 1);
    let refused = |s: &mut TcpStream, what: &str| {
        let e = error_frame(s);
        assert_eq!(e.code, ErrorCode::MalformedBatch, "{what}: {}", e.message);
        e.message
    };
    let mut o2 = raw_publish(&t, "o2", 0);
    o2.write_all(&end(99, 0, 0)).unwrap();
    assert!(refused(&mut o2, "order 2").contains("order-5"));
    // Client 0 ends client 1's session, then says its end holds a message.
    let mut c0 = publish_first_batch(&t, "ends", 0);
    let c1 = publish_first_batch(&t, "ends", 1);
    c0.write_all(&end(1, 1, 0)).unwrap();
    refused(&mut c0, "another client's end");
    let mut c0 = raw_session(&t, "ends", 0, 1);
    c0.write_all(&end(0, 1, 1)).unwrap();
    refused(&mut c0, "an end with a message");
    // Client 2 ends its session before its batch 1 has come: nothing ends.
    let mut c2 = publish_first_batch(&t, "ends", 2);
    c2.write_all(&end(2, 2, 0)).unwrap();
    drop((c1, c2));
    for client in 3..256 {
        drop(publish_first_batch(&t, "ends", client));
    }
    let mut late = raw_session(&t, "ends", 5000, 1);
    let e = error_frame(&mut late);
    assert_eq!(e.code, ErrorCode::SessionsExhausted, "{}", e.message);
    // Client 3 ends its session as it stands (the epoch its header names is not the
    // connection's, and does not matter): client 5000 takes the slot.
    let mut c3 = raw_session(&t, "ends", 3, 1);
    assert_eq!(common::next_frame(&mut c3).0.kind, FrameKind::HelloOk);
    c3.write_all(&end_at(3, 1, 0, 9)).unwrap();
    c3.write_all(&session_batch(3, 1, 1)).unwrap();
    assert!(refused(&mut c3, "a batch after the end").contains("nothing may follow"));
    drop(publish_first_batch(&t, "ends", 5000));
    assert_eq!(
        (
            t.metric_sum("embarcadero_sequencer_sessions_ended_by_publisher_total"),
            t.metric_sum("embarcadero_sequencer_sessions_evicted_total")
        ),
        (1, 1)
    );
}
