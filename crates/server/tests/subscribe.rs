//! Subscriber behaviour: resume from a position (also mid-batch), automatic reconnect
//! after a lost connection, waiting at the end of the log, and the error for
//! positions that are no longer retained; a subscriber that leaves an idle topic is let go.

mod common;

use embarcadero_client::{Cursor, Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use embarcadero_wire::ErrorCode;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

fn publish(t: &common::TestServer, topic: &str, from: u64, n: u64, batch_bytes: usize) {
    let p = Publisher::connect_brokers(
        &t.brokers(),
        topic,
        PublisherConfig {
            batch_bytes,
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    for i in from..from + n {
        p.publish(format!("msg-{i}").as_bytes()).unwrap();
    }
    p.close().unwrap();
}

fn payload_index(m: &embarcadero_client::Message) -> u64 {
    String::from_utf8_lossy(&m.payload)[4..].parse().unwrap()
}

#[test]
fn a_new_subscriber_resumes_exactly_where_another_stopped_even_mid_batch() {
    let t = common::start();
    t.create_topic("r", 2);
    publish(&t, "r", 0, 5000, 16 * 1024);
    let mut first =
        Subscriber::connect_brokers(&t.brokers(), "r", SubscriberConfig::default()).unwrap();
    let mut seen = Vec::new();
    for _ in 0..1234 {
        seen.push(first.poll(Duration::from_secs(10)).unwrap().unwrap());
    }
    assert_eq!(first.position(), Cursor::Global(1234));
    let mut second = Subscriber::connect_brokers(
        &t.brokers(),
        "r",
        SubscriberConfig {
            start: Some(first.position()),
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    for i in 1234..5000u64 {
        let m = second.poll(Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(m.position, i);
        seen.push(m);
    }
    // Positions and payloads line up with a reader that never stopped.
    let mut whole =
        Subscriber::connect_brokers(&t.brokers(), "r", SubscriberConfig::default()).unwrap();
    for expected in &seen {
        assert_eq!(
            &whole.poll(Duration::from_secs(10)).unwrap().unwrap(),
            expected
        );
    }
    // seek() goes back.
    second.seek(Cursor::Global(10)).unwrap();
    assert_eq!(
        second.poll(Duration::from_secs(10)).unwrap().unwrap(),
        seen[10]
    );
}

/// Forwards one connection to `upstream` and cuts it after `limit` bytes downstream.
fn cutting_proxy(upstream: String, limit: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(upstream).unwrap();
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = c2.read(&mut buf) {
                if n == 0 || s2.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        });
        let (mut s, mut c) = (server, client);
        let mut forwarded = 0;
        let mut buf = [0u8; 1000];
        while forwarded < limit {
            let Ok(n) = s.read(&mut buf) else { break };
            if n == 0 {
                break;
            }
            let n = n.min(limit - forwarded);
            if c.write_all(&buf[..n]).is_err() {
                break;
            }
            forwarded += n;
        }
        let _ = c.shutdown(Shutdown::Both);
        let _ = s.shutdown(Shutdown::Both);
    });
    addr
}

#[test]
fn a_subscriber_reconnects_after_a_lost_connection_and_resumes() {
    let t = common::start();
    t.create_topic("c", 2);
    publish(&t, "c", 0, 3000, 8 * 1024);
    // The proxy cuts the stream mid-frame after ~20 KB; the next address is a real broker.
    let brokers = vec![
        cutting_proxy(t.brokers()[0].clone(), 20_000),
        t.brokers()[1].clone(),
    ];
    let mut s = Subscriber::connect_brokers(
        &brokers,
        "c",
        SubscriberConfig {
            client_id: Some(0), // start with the proxy
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    let mut reference =
        Subscriber::connect_brokers(&t.brokers(), "c", SubscriberConfig::default()).unwrap();
    for i in 0..3000u64 {
        let m = s.poll(Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(m.position, i);
        assert_eq!(m, reference.poll(Duration::from_secs(10)).unwrap().unwrap());
    }
}

#[test]
fn subscribing_ahead_of_the_end_waits_for_new_data() {
    let t = common::start();
    t.create_topic("w", 2);
    publish(&t, "w", 0, 10, 4096);
    let brokers = t.brokers();
    let reader = std::thread::spawn(move || {
        let mut s = Subscriber::connect_brokers(
            &brokers,
            "w",
            SubscriberConfig {
                start: Some(Cursor::Global(15)),
                ..SubscriberConfig::default()
            },
        )
        .unwrap();
        let m = s
            .poll(Duration::from_secs(30))
            .unwrap()
            .expect("message 15 arrives");
        (m.position, payload_index(&m))
    });
    publish(&t, "w", 10, 10, 4096);
    assert_eq!(reader.join().unwrap(), (15, 15));
}

#[test]
fn order_1_subscribers_resume_from_per_broker_cursors() {
    let t = common::start();
    t.create_topic("f", 1);
    publish(&t, "f", 0, 2000, 4096);
    let mut a =
        Subscriber::connect_brokers(&t.brokers(), "f", SubscriberConfig::default()).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..700 {
        seen.insert(payload_index(
            &a.poll(Duration::from_secs(10)).unwrap().unwrap(),
        ));
    }
    let cursor = a.position();
    assert!(
        matches!(&cursor, Cursor::PerBroker(v) if v.len() == 4 && v.iter().sum::<u64>() == 700)
    );
    let mut b = Subscriber::connect_brokers(
        &t.brokers(),
        "f",
        SubscriberConfig {
            start: Some(cursor),
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    for _ in 700..2000 {
        assert!(seen.insert(payload_index(
            &b.poll(Duration::from_secs(10)).unwrap().unwrap()
        )));
    }
    assert_eq!(seen.len(), 2000);
}

#[test]
fn reading_below_the_retained_start_names_the_first_available_position_where_the_beginning_starts()
{
    // Four 256 KiB segments per broker: publishing 8 MB forces reclamation.
    let t = common::start_with(|c| {
        c.region.segment_bytes = 256 * 1024;
        c.region.segments_per_broker = 4;
        c.broker.max_batch_bytes = 200 * 1024;
        c.broker.max_message_bytes = 64 * 1024;
    });
    t.create_topic("small", 2);
    let p = Publisher::connect_brokers(
        &t.brokers(),
        "small",
        PublisherConfig {
            batch_bytes: 32 * 1024,
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let payload = vec![7u8; 1000];
    for _ in 0..8000 {
        p.publish(&payload).unwrap();
    }
    p.close().unwrap();
    let from_zero = SubscriberConfig {
        start: Some(Cursor::Global(0)),
        ..SubscriberConfig::default()
    };
    let err = Subscriber::connect_brokers(&t.brokers(), "small", from_zero)
        .and_then(|mut s| s.poll(Duration::from_secs(10)))
        .expect_err("position 0 is gone");
    assert_eq!(err.code(), Some(ErrorCode::PositionNotRetained));
    let text = err.to_string();
    let first: u64 = text
        .split("first available position is ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no position in {text}"));
    assert!(first > 0 && first < 8000);
    // From there on, everything up to the end is readable; a subscriber that asks for
    // the beginning (no start) starts there by itself.
    let mut s = Subscriber::connect_brokers(
        &t.brokers(),
        "small",
        SubscriberConfig {
            start: Some(Cursor::Global(first)),
            ..SubscriberConfig::default()
        },
    )
    .unwrap();
    let mut from_beginning =
        Subscriber::connect_brokers(&t.brokers(), "small", SubscriberConfig::default()).unwrap();
    let started = from_beginning
        .poll(Duration::from_secs(10))
        .unwrap()
        .unwrap();
    assert_eq!(
        started.position, first,
        "the beginning is the first retained"
    );
    for i in first..8000 {
        assert_eq!(
            s.poll(Duration::from_secs(10)).unwrap().unwrap().position,
            i
        );
    }
}

#[test]
fn subscribers_that_leave_an_idle_topic_release_their_connections() {
    let t = common::start();
    let open = "embarcadero_connections_open{";
    for (topic, order) in [("idle2", 2), ("idle1", 1)] {
        t.create_topic(topic, order);
        publish(&t, topic, 0, 10, 4096);
        // More subscribers than a topic has reader slots, each caught up and then gone
        // while nothing new is published.
        for _ in 0..40 {
            let mut s =
                Subscriber::connect_brokers(&t.brokers(), topic, SubscriberConfig::default())
                    .unwrap();
            for _ in 0..10 {
                s.poll(Duration::from_secs(10)).unwrap().expect("published");
            }
            assert!(s.poll(Duration::from_millis(1)).unwrap().is_none());
        }
        t.wait_for_metric_at_most(open, 0, &format!("departed subscribers of {topic}"));
    }
}

/// A raw subscriber hello for `topic` from position 0 (an order 2 topic).
fn subscriber_hello(topic: &str) -> Vec<u8> {
    embarcadero_wire::Hello {
        role: embarcadero_wire::Role::Subscribe,
        ack_level: 0,
        client_id: 5,
        session_epoch: 0,
        start_position: 0,
        connection_index: 0,
        cursor_count: 0,
        topic: topic.into(),
        session_key: [0; 16],
        flags: 0,
        opener: 0,
    }
    .encode()
    .to_vec()
}

/// Issue 28: a subscriber that sends a byte after its hello and then leaves used to look
/// alive to the broker's probe ("bytes waiting") for good, keeping its thread, socket and
/// reader slot. A subscriber sends nothing: one that talks is told so and closed, and
/// one that talked and left is let go, on an idle topic too.
#[test]
fn subscribers_that_talk_after_their_hello_are_closed_and_let_go() {
    let t = common::start();
    t.create_topic("quiet", 2);
    // Nothing to deliver: only the idle probe can notice.
    for _ in 0..40 {
        let mut s = TcpStream::connect(&t.brokers()[0]).unwrap();
        s.write_all(&subscriber_hello("quiet")).unwrap();
        s.write_all(b"x").unwrap();
    }
    // Dropped first: a connection still in the listen backlog (connected, not yet
    // accepted) is not open yet, so "none open" alone can be seen before all 40 were.
    t.wait_for_metric_at_least(
        "embarcadero_subscribers_dropped_total",
        40,
        "subscribers that talked and left, ended by the probe",
    );
    t.wait_for_metric_at_most(
        "embarcadero_connections_open{",
        0,
        "subscribers that talked and left",
    );
    // One that stays is told why.
    let mut s = TcpStream::connect(&t.brokers()[1]).unwrap();
    s.write_all(&subscriber_hello("quiet")).unwrap();
    s.write_all(b"x").unwrap();
    let error = loop {
        let (h, body) = common::next_frame(&mut s);
        if h.kind == embarcadero_wire::FrameKind::Error {
            break embarcadero_wire::ErrorFrame::decode(&h, &body).unwrap();
        }
    };
    assert_eq!(error.code, ErrorCode::UnexpectedData, "{}", error.message);
    // Well-behaved subscribers still read everything.
    publish(&t, "quiet", 0, 3, 4096);
    let mut good =
        Subscriber::connect_brokers(&t.brokers(), "quiet", SubscriberConfig::default()).unwrap();
    for _ in 0..3 {
        good.poll(Duration::from_secs(10))
            .unwrap()
            .expect("published");
    }
}

/// Issue 28: one client address cannot take every connection (and with them threads
/// and reader slots): past `broker.max_connections_per_address` it is refused with
/// TooManyConnections, the connections it has keep working, and a place that frees up
/// is taken again.
#[test]
fn one_address_gets_at_most_its_share_of_connections() {
    let t = common::start_with(|c| c.broker.max_connections_per_address = 4);
    t.create_topic("share", 2);
    publish(&t, "share", 0, 2, 4096);
    let mut held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(&t.brokers()[0]).unwrap();
            s.write_all(&subscriber_hello("share")).unwrap();
            assert_eq!(
                common::next_frame(&mut s).0.kind,
                embarcadero_wire::FrameKind::HelloOk
            );
            s
        })
        .collect();
    let mut extra = TcpStream::connect(&t.brokers()[0]).unwrap();
    extra.write_all(&subscriber_hello("share")).unwrap();
    let (h, body) = common::next_frame(&mut extra);
    let e = embarcadero_wire::ErrorFrame::decode(&h, &body).unwrap();
    assert_eq!(e.code, ErrorCode::TooManyConnections);
    assert!(
        e.message.contains("from this client address"),
        "{}",
        e.message
    );
    assert_eq!(
        t.metric_sum("embarcadero_connections_refused_per_address_total"),
        1
    );
    // The held ones still deliver: each gets the two messages' delivery.
    for s in &mut held {
        let (h, _) = common::next_frame(s);
        assert_eq!(h.kind, embarcadero_wire::FrameKind::Delivery);
    }
    drop(held.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut s = TcpStream::connect(&t.brokers()[0]).unwrap();
        s.write_all(&subscriber_hello("share")).unwrap();
        if common::next_frame(&mut s).0.kind == embarcadero_wire::FrameKind::HelloOk {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the freed place is never taken"
        );
    }
}

/// Issue 28: one client address cannot take every reader slot of a topic, even spread
/// over every broker (slots are region-wide): past `broker.max_subscribers_per_address`
/// a subscriber is refused with TooManyConnections, and a slot that frees up can be
/// taken again.
#[test]
fn one_address_holds_at_most_its_share_of_reader_slots() {
    let t = common::start_with(|c| c.broker.max_subscribers_per_address = 3);
    t.create_topic("pins", 2);
    publish(&t, "pins", 0, 1, 64);
    let brokers = t.brokers();
    let subscribe = |broker: usize| {
        let mut s = TcpStream::connect(&brokers[broker % brokers.len()]).unwrap();
        s.write_all(&subscriber_hello("pins")).unwrap();
        let (h, _) = common::next_frame(&mut s);
        assert_eq!(h.kind, embarcadero_wire::FrameKind::HelloOk);
        let (h, body) = common::next_frame(&mut s);
        (s, h, body)
    };
    let mut held: Vec<TcpStream> = (0..3)
        .map(|i| {
            let (s, h, _) = subscribe(i);
            assert_eq!(
                h.kind,
                embarcadero_wire::FrameKind::Delivery,
                "subscriber {i}"
            );
            s
        })
        .collect();
    let (_, h, body) = subscribe(3);
    let e = embarcadero_wire::ErrorFrame::decode(&h, &body).unwrap();
    assert_eq!(e.code, ErrorCode::TooManyConnections);
    assert!(
        e.message.contains("max_subscribers_per_address = 3"),
        "{}",
        e.message
    );
    drop(held.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, h, _) = subscribe(3);
        if h.kind == embarcadero_wire::FrameKind::Delivery {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the freed slot is never taken"
        );
    }
}

/// `poll_shared` lends each batch whole: a payload kept from an early poll still reads
/// as it was after many later polls: its buffer is not reused while it is alive.
#[test]
fn shared_batches_outlive_later_polls() {
    let t = common::start();
    t.create_topic("shared", 2);
    publish(&t, "shared", 0, 20_000, 16 * 1024);
    let mut sub =
        Subscriber::connect_brokers(&t.brokers(), "shared", SubscriberConfig::default()).unwrap();
    let mut kept: Vec<(
        Vec<u8>,
        embarcadero_client::SharedBatch,
        std::ops::Range<usize>,
    )> = Vec::new();
    let mut next = 0u64;
    while next < 20_000 {
        sub.poll_shared(Duration::from_secs(10), |batch, m| {
            assert_eq!(m.position, next);
            assert!(m.payload.starts_with(b"msg-"), "{:?}", m.payload);
            if next.is_multiple_of(1000) {
                kept.push((m.payload.to_vec(), batch.clone(), batch.range_of(m.payload)));
            }
            next += 1;
        })
        .unwrap();
    }
    assert_eq!(kept.len(), 20);
    for (payload, batch, range) in &kept {
        assert_eq!(
            &batch.bytes()[range.clone()],
            payload,
            "a kept payload is unchanged after later polls"
        );
    }
}

/// `poll_shared_upto` with a bound smaller than any batch lends one batch per call (the
/// rest wait, ready, for the next call) and, call after call, every message once, in order.
#[test]
fn poll_shared_upto_lends_one_batch_past_its_bound_and_every_message_once() {
    let t = common::start();
    t.create_topic("upto", 2);
    publish(&t, "upto", 0, 20_000, 16 * 1024);
    let mut sub =
        Subscriber::connect_brokers(&t.brokers(), "upto", SubscriberConfig::default()).unwrap();
    let (mut next, mut calls) = (0u64, 0u32);
    while next < 20_000 {
        let mut batches: Vec<embarcadero_client::SharedBatch> = Vec::new();
        let n = sub
            .poll_shared_upto(Duration::from_secs(10), 1, |batch, m| {
                assert_eq!(m.position, next, "in order, none skipped or repeated");
                next += 1;
                if !batches.iter().any(|b| b.as_mut_ptr() == batch.as_mut_ptr()) {
                    batches.push(batch.clone());
                }
            })
            .unwrap();
        assert!(
            batches.len() <= 1,
            "one batch per call, not {}",
            batches.len()
        );
        assert_eq!(n > 0, batches.len() == 1);
        calls += 1;
    }
    assert_eq!(next, 20_000);
    // 20,000 messages of a few bytes in 16 KiB batches: hundreds of batches, so the bound
    // split what had arrived rather than each call waiting for one batch.
    assert!(calls > 100, "{calls} calls");
    assert!(
        sub.poll_shared_upto(Duration::from_millis(200), 1, |_, m| panic!(
            "extra {}",
            m.position
        ))
        .unwrap()
            == 0
    );
}

/// Counts the messages of a read-ahead poll.
#[derive(Default)]
struct Count(usize);

impl embarcadero_client::Collect for Count {
    fn collect(
        &mut self,
        _: &embarcadero_client::SharedBatch,
        _: embarcadero_client::MessageRef<'_>,
    ) {
        self.0 += 1;
    }

    fn count(&self) -> usize {
        self.0
    }

    fn positions(&self) -> Vec<(u16, u64)> {
        Vec::new()
    }
}

/// What the bindings' getters (`transport`, `skipped`) read: the read-ahead's status is
/// known from connecting on, and taking it never needs the subscriber, which the thread
/// holds for up to a poll (100 ms) at a time. Shown by asking for it while holding the
/// subscriber: if it needed the subscriber too, it would never answer.
#[test]
fn a_read_ahead_says_its_subscribers_status_without_waiting_for_a_poll() {
    use embarcadero_client::ReadAhead;
    use std::sync::Arc;
    let t = common::start();
    t.create_topic("status", 2);
    let sub =
        Subscriber::connect_brokers(&t.brokers(), "status", SubscriberConfig::default()).unwrap();
    let connected = (sub.transport(), sub.skipped());
    let reader = Arc::new(ReadAhead::<Count>::new(sub, 2, 1 << 20));
    let status = reader.status();
    assert_eq!((status.transport, status.skipped), connected);
    assert_ne!(status.transport, "none", "connected");
    // The thread starts and polls the empty topic, holding the subscriber most of the time.
    assert!(reader.next_poll(Duration::from_millis(1)).is_none());
    let (tx, rx) = std::sync::mpsc::channel();
    let asking = reader.clone();
    std::thread::spawn(move || {
        let status = asking.with_sub(|_| Ok(asking.status())).unwrap();
        tx.send(status).unwrap();
    });
    // A hang guard far above any answer, not a timing: a status that needed the
    // subscriber would never come.
    let answered = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the status waited for the subscriber its caller held");
    assert_eq!(answered, status);
    // After messages are read ahead, it still says the same of this connection.
    publish(&t, "status", 0, 10, 16 * 1024);
    let mut read = 0;
    while read < 10 {
        let polled = reader
            .next_poll(Duration::from_secs(10))
            .expect("messages come");
        read += polled.unwrap().messages.0;
    }
    assert_eq!(read, 10);
    assert_eq!(reader.status(), status);
    reader.close();
}

/// The TypeScript binding sizes its polls by how JavaScript reads (`readBatches`): a size
/// set while the read-ahead runs bounds every poll it starts after that (the one under way
/// keeps the size it started with). With at most one byte per poll, each poll lends exactly
/// one batch (whole batches, at least one), so it holds no more messages than a batch can;
/// every message still comes, once.
#[test]
fn a_read_ahead_bounds_its_polls_by_the_size_set_last() {
    use embarcadero_client::ReadAhead;
    let t = common::start();
    t.create_topic("sized", 2);
    const BATCH_BYTES: usize = 2048;
    let sub =
        Subscriber::connect_brokers(&t.brokers(), "sized", SubscriberConfig::default()).unwrap();
    let reader = ReadAhead::<Count>::new(sub, 2, 1 << 20);
    // The thread starts, and polls the empty topic with polls of up to 1 MiB.
    assert!(reader.next_poll(Duration::from_millis(1)).is_none());
    reader.set_poll_bytes(1);
    publish(&t, "sized", 0, 3000, BATCH_BYTES);
    // Every message takes at least its 64-byte header of its batch's bytes.
    let most_per_batch = BATCH_BYTES / embarcadero_wire::MESSAGE_HEADER_LEN;
    let (mut read, mut polls) = (0, 0);
    while read < 3000 {
        let polled = reader
            .next_poll(Duration::from_secs(10))
            .expect("messages come");
        let n = polled.unwrap().messages.0;
        // The first may be the poll that was under way when the size changed.
        assert!(
            polls == 0 || n <= most_per_batch,
            "a poll of one batch holds {n} messages"
        );
        read += n;
        polls += 1;
    }
    assert_eq!(read, 3000);
    reader.close();
}

/// How the TypeScript binding waits for a poll without a thread of its own
/// (`wakeWhenReady`): a wake set while nothing is queued is called once the reading thread
/// has queued a poll, which is then there to take without waiting; none is kept while a
/// poll is ready already; and one pending when the read-ahead closes is called then, so a
/// caller waiting on it learns of the close.
#[test]
fn a_read_ahead_wakes_its_caller_when_a_poll_is_queued_or_it_closes() {
    use embarcadero_client::ReadAhead;
    use std::sync::mpsc;
    let t = common::start();
    t.create_topic("wake", 2);
    let sub =
        Subscriber::connect_brokers(&t.brokers(), "wake", SubscriberConfig::default()).unwrap();
    let reader = ReadAhead::<Count>::new(sub, 2, 1 << 20);
    let (tx, rx) = mpsc::channel();
    let woken = tx.clone();
    assert!(
        reader.wake_when_ready(move || woken.send("poll").unwrap()),
        "nothing queued yet"
    );
    publish(&t, "wake", 0, 10, 16 * 1024);
    // A hang guard, not a timing: a wake that never came would fail here.
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), "poll");
    let polled = reader
        .try_next()
        .expect("the poll it was woken for is there");
    let mut read = polled.unwrap().messages.0;
    while read < 10 {
        read += reader
            .next_poll(Duration::from_secs(10))
            .unwrap()
            .unwrap()
            .messages
            .0;
    }
    assert_eq!(read, 10);
    assert!(rx.try_recv().is_err(), "woken once");
    let woken = tx.clone();
    assert!(reader.wake_when_ready(move || woken.send("second").unwrap()));
    publish(&t, "wake", 10, 5, 16 * 1024);
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), "second");
    // A poll ready already: nothing is kept (it would be called at the close below), and
    // the caller takes the poll.
    let kept = tx.clone();
    assert!(!reader.wake_when_ready(move || kept.send("kept").unwrap()));
    assert!(reader.try_next().is_some());
    // A wake pending at the close is called by the close.
    let woken = tx.clone();
    assert!(reader.wake_when_ready(move || woken.send("closed").unwrap()));
    reader.close();
    assert_eq!(rx.try_recv().unwrap(), "closed");
}
