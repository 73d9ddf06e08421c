//! Publishing and subscribing over local shared memory (issue 26) against a real
//! server: every order and ack level delivers exactly once in order; order-5 sessions
//! are fenced and reopen over them; a client that writes garbage into its live channel
//! is refused with an error while another publisher of the same broker carries on;
//! another uid is refused unless the operator allows it; `auto` falls back to TCP; a
//! batch due on a full queue is deflected to another.
//! Subscribers read feeds: exactly once in one order, the same order as a TCP
//! subscriber, from a position and with PositionNotRetained as over TCP; a SIGKILLed
//! one releases its reader pin within the stall timeout; a feed is read-only to its
//! subscriber and holds only its topic's bytes.

mod common;

use embarcadero_client::{
    Cursor, Error, Message, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec,
    Transport,
};
use embarcadero_server::ServerConfig;
use embarcadero_shm::layout::{self, ack_ring, data_ring, feed_ring};
use embarcadero_shm::ring::RingMaps;
use embarcadero_shm::{socket, Consumer, Mapping, Producer, Waited};
use embarcadero_wire::{
    message_stride, BatchHeader, BlogMessageHeader, ErrorCode, ErrorFrame, FrameHeader, FrameKind,
    Hello, Role,
};
use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn shm_config(ack: u8) -> PublisherConfig {
    PublisherConfig {
        ack_level: ack,
        batch_bytes: 16 * 1024,
        linger: Duration::from_micros(200),
        threads_per_broker: 2,
        transport: Transport::Shm,
        shm_ring_bytes: 256 * 1024,
        ..PublisherConfig::default()
    }
}

fn sub_config(transport: Transport) -> SubscriberConfig {
    SubscriberConfig {
        transport,
        ..SubscriberConfig::default()
    }
}

/// Reads `n` messages of `topic` over a shared-memory feed.
fn read_all(brokers: &[String], topic: &str, n: usize) -> Vec<Message> {
    read_over(brokers, topic, n, Transport::Shm)
}

fn read_over(brokers: &[String], topic: &str, n: usize, transport: Transport) -> Vec<Message> {
    let mut s = Subscriber::connect_brokers(brokers, topic, sub_config(transport)).unwrap();
    assert_eq!(
        s.transport(),
        transport.to_string(),
        "{topic}: read over {transport}"
    );
    (0..n)
        .map(|i| {
            s.poll(Duration::from_secs(30))
                .unwrap()
                .unwrap_or_else(|| panic!("{topic}: stuck after {i} messages"))
        })
        .collect()
}

/// Publishes `N` numbered messages from each of two publishers over `config.transport`
/// and checks the subscriber (over a shared-memory feed) got each exactly once; orders 2
/// and 5 at consecutive positions from 0, order 5 each publisher's in publish order (orders 0-2 keep only each
/// connection's order, and a publisher has eight connections here).
fn exactly_once_in_order(t: &common::TestServer, topic: &str, config: PublisherConfig) {
    const N: u64 = 2000;
    let publishers: Vec<_> = (0..2)
        .map(|_| {
            let (brokers, topic, config) = (t.brokers(), topic.to_string(), config.clone());
            std::thread::spawn(move || {
                let transport = config.transport.to_string();
                let p = Publisher::connect_brokers(&brokers, &topic, config).unwrap();
                assert!(
                    p.stats().queues.iter().all(|q| q.transport == transport),
                    "every connection is over {transport}"
                );
                for i in 0..N {
                    p.publish(format!("{i}:{}", "x".repeat((i % 200) as usize)).as_bytes())
                        .unwrap();
                }
                let id = p.client_id();
                let stats = p
                    .close()
                    .unwrap_or_else(|e| panic!("{topic}: not every message acknowledged: {e}"));
                assert_eq!(stats.messages, N);
                if transport == "shm" {
                    let in_place: u64 = stats.queues.iter().map(|q| q.in_place).sum();
                    assert!(in_place > 0, "{topic}: batches are built in the rings");
                }
                id
            })
        })
        .collect();
    let ids: Vec<u64> = publishers.into_iter().map(|h| h.join().unwrap()).collect();
    let got = read_all(&t.brokers(), topic, 2 * N as usize);
    let mut next: BTreeMap<u64, u64> = ids.iter().map(|&id| (id, 0)).collect();
    // Orders 0 and 1 keep each connection's order only; counters still cover 0..N once.
    let mut seen: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for (at, m) in got.iter().enumerate() {
        let i: u64 = std::str::from_utf8(&m.payload)
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(i, m.counter, "payload matches its counter");
        seen.entry(m.client_id).or_default().push(m.counter);
        if topic.starts_with("o2") || topic.starts_with("o5") {
            assert_eq!(m.position, at as u64, "one global order, positions from 0");
        }
        // Order 5 keeps each session's publish order across every broker and connection.
        if topic.starts_with("o5") {
            let expected = next.get_mut(&m.client_id).expect("one of ours");
            assert_eq!(m.counter, *expected, "client {} out of order", m.client_id);
            *expected += 1;
        }
    }
    for id in &ids {
        let mut counters = seen.remove(id).expect("messages of every publisher");
        counters.sort_unstable();
        assert_eq!(counters, (0..N).collect::<Vec<_>>(), "exactly once");
    }
}

/// Ack 2 needs disk replicas, which only orders 2 and 5 have (a topic of order 0 or 1
/// with rf 2 is refused at creation), so orders 0 and 1 run at acks 0 and 1.
#[test]
fn every_order_and_ack_level_over_shm_delivers_exactly_once_in_order() {
    // Ten topics, each of which keeps at least its open segment on every broker.
    let t = common::start_with(|c| {
        c.region.max_topics = 16;
        c.region.segments_per_broker = 32;
    });
    for order in [0u8, 1, 2, 5] {
        let acks: &[u8] = if order >= 2 { &[0, 1, 2] } else { &[0, 1] };
        for &ack in acks {
            let topic = format!("o{order}a{ack}");
            let spec = TopicSpec::new(&topic, order);
            let spec = if ack == 2 { spec.replicated(2) } else { spec };
            t.admin().create_topic(&spec).unwrap();
            let mut config = shm_config(ack);
            if order == 5 {
                config.session_epoch = 1;
            }
            exactly_once_in_order(&t, &topic, config);
        }
    }
}

/// One connection (order 1, ack 0) whose sender pauses after taking each batch, before
/// writing it. The publisher seals one batch at a time, and opens the next only once
/// every earlier batch is written, so it opens in the pause, while the batch just sealed
/// is in the sender's hands (neither in the channel nor written). A span lent then
/// carried a later batch that went out first. Every message arrives in publish order
/// (orders 0-2 keep each connection's order).
#[test]
fn a_batch_in_the_senders_hands_is_written_before_a_span_lent_after_it() {
    let t = common::start();
    t.create_topic("hand", 1);
    const ROUNDS: u64 = 200;
    const BATCH: usize = 4 * 1024;
    let payload = |i: u64| format!("{i:06}:{}", "y".repeat(100));
    // Messages per batch: a batch seals at its first message past BATCH bytes.
    let per_batch = (BATCH as u64).div_ceil(message_stride(payload(0).len() as u64));
    let config = PublisherConfig {
        ack_level: 0,
        batch_bytes: BATCH,
        linger: Duration::from_secs(5),
        threads_per_broker: 1,
        transport: Transport::Shm,
        slow_queue: Some((0, Duration::from_millis(2))),
        ..PublisherConfig::default()
    };
    let brokers = &t.brokers()[..1];
    let p = Publisher::connect_brokers(brokers, "hand", config).unwrap();
    for round in 0..ROUNDS {
        for i in round * per_batch..(round + 1) * per_batch {
            p.publish(payload(i).as_bytes()).unwrap();
        }
        assert_eq!(p.batches_sealed(), round + 1, "one batch a round");
        let deadline = Instant::now() + Duration::from_secs(30);
        while p.acked_prefix() < round {
            assert!(
                Instant::now() < deadline,
                "round {round}: batches not written"
            );
            std::thread::yield_now();
        }
    }
    let stats = p.close().unwrap();
    let in_place: u64 = stats.queues.iter().map(|q| q.in_place).sum();
    assert!(in_place > 0, "batches were built in the ring");
    let n = ROUNDS * per_batch;
    let got = read_all(brokers, "hand", n as usize);
    let misplaced = got.iter().zip(0..n).find(|(m, i)| m.counter != *i);
    assert!(
        misplaced.is_none(),
        "message {:?} at the place of message {:?}: out of publish order",
        misplaced.map(|(m, _)| m.counter),
        misplaced.map(|(_, i)| i),
    );
}

/// Deflect-when-full over shared memory: with one queue's sender slowed to a batch every
/// 200 ms and room for one batch, the batches due on it go to the other queues (counted
/// as deflected on the queue they were due on), and every message arrives exactly once;
/// order 5 also keeps the publish order.
#[test]
fn batches_due_on_a_full_shm_queue_are_deflected_and_arrive_exactly_once() {
    let t = common::start();
    const N: u64 = 4000;
    for (topic, order) in [("o2-deflect", 2), ("o5-deflect", 5)] {
        t.create_topic(topic, order);
        let config = PublisherConfig {
            batch_bytes: 4096,
            queue_depth: 1,
            slow_queue: Some((0, Duration::from_millis(200))),
            session_epoch: u64::from(order == 5),
            ..shm_config(1)
        };
        let p = Publisher::connect_brokers(&t.brokers(), topic, config).unwrap();
        for i in 0..N {
            p.publish(format!("{i}:{}", "x".repeat(100)).as_bytes())
                .unwrap();
        }
        let stats = p.close().unwrap();
        assert_eq!(stats.messages, N);
        assert!(stats.queues.iter().all(|q| q.transport == "shm"), "{topic}");
        let deflected: Vec<u64> = stats.queues.iter().map(|q| q.deflected).collect();
        assert!(
            deflected[0] > 0,
            "{topic}: none went past the full queue: {deflected:?}"
        );
        let got = read_all(&t.brokers(), topic, N as usize);
        let mut counters: Vec<u64> = got.iter().map(|m| m.counter).collect();
        if order == 5 {
            assert_eq!(
                counters,
                (0..N).collect::<Vec<_>>(),
                "{topic}: publish order"
            );
        }
        counters.sort_unstable();
        assert_eq!(
            counters,
            (0..N).collect::<Vec<_>>(),
            "{topic}: exactly once"
        );
    }
}

/// A server with 1 MiB of log per broker (four 256 KiB segments) and batches of at most
/// 128 KiB: memory fills after a few batches.
fn small_memory(c: &mut ServerConfig) {
    c.region.segment_bytes = 256 * 1024;
    c.region.segments_per_broker = 4;
    c.broker.max_batch_bytes = 128 * 1024;
    c.broker.max_message_bytes = 16 * 1024;
}

/// Batches built in place in a channel's ring, refused with BACKPRESSURE after the
/// broker consumed them, are resent from the ring (go-back-N): every message arrives
/// exactly once, in one order.
#[test]
fn batches_built_in_the_ring_and_refused_for_backpressure_are_resent_exactly_once() {
    let t = common::start_with(|c| {
        small_memory(c);
        c.broker.backpressure_timeout_ms = 50;
    });
    t.create_topic("bp", 2);
    // A subscriber that pauses for a second holds its pin, so memory fills up and the
    // brokers answer BACKPRESSURE after 50 ms.
    const N: u64 = 16_000;
    let (tx, rx) = std::sync::mpsc::channel();
    let brokers = t.brokers();
    let reader = std::thread::spawn(move || {
        let mut s =
            Subscriber::connect_brokers(&brokers, "bp", sub_config(Transport::Tcp)).unwrap();
        tx.send(()).unwrap();
        std::thread::sleep(Duration::from_secs(1));
        (0..N)
            .map(|i| {
                let m = s.poll(Duration::from_secs(30)).unwrap().expect("message");
                assert_eq!(m.position, i, "one order from 0");
                m.counter
            })
            .collect::<Vec<u64>>()
    });
    rx.recv().unwrap();
    let config = PublisherConfig {
        batch_bytes: 32 * 1024,
        transport: Transport::Shm,
        ..PublisherConfig::default()
    };
    let p = Publisher::connect_brokers(&t.brokers(), "bp", config).unwrap();
    let payload = vec![2u8; 1000];
    for _ in 0..N {
        p.publish(&payload).unwrap();
    }
    let stats = p.close().unwrap();
    let retries: u64 = stats.queues.iter().map(|q| q.backpressure_retries).sum();
    let in_place: u64 = stats.queues.iter().map(|q| q.in_place).sum();
    assert!(retries > 0, "the BACKPRESSURE path was exercised");
    assert!(in_place > 0, "batches were built in the rings");
    let mut counters = reader.join().unwrap();
    counters.sort_unstable();
    assert_eq!(counters, (0..N).collect::<Vec<_>>(), "exactly once");
}

/// As `order5.rs`'s fence test, over shared memory: broker 1 drops the session's first
/// batch, the session is fenced after its lease, the publisher reopens its channels with
/// the next epoch and resends, and every message is delivered exactly once in order.
#[test]
fn an_order5_session_is_fenced_and_reopens_over_shm() {
    let t = common::start_with(|c| {
        c.broker.fault_broker = 1;
        c.broker.fault_drop_fraction = 1.0;
        c.broker.fault_drop_limit = 1;
        c.sequencer.session_lease_ms = 300;
    });
    t.admin().create_topic(&TopicSpec::new("f", 5)).unwrap();
    const N: u64 = 3000;
    let brokers = t.brokers();
    let reader = std::thread::spawn(move || read_all(&brokers, "f", N as usize));
    let config = PublisherConfig {
        session_epoch: 1,
        ..shm_config(1)
    };
    let p = Publisher::connect_brokers(&t.brokers(), "f", config).unwrap();
    for i in 0..N {
        p.publish(format!("{i}").as_bytes()).unwrap();
    }
    assert!(p.stats().queues.iter().all(|q| q.transport == "shm"));
    let id = p.client_id();
    p.close()
        .expect("reopened after the fence and acknowledged");
    let got = reader.join().unwrap();
    for (i, m) in got.iter().enumerate() {
        assert_eq!(
            (m.position, m.client_id, m.counter),
            (i as u64, id, i as u64)
        );
    }
    let (_, rec) = t.server.region().session_find(0, id).unwrap();
    assert!(rec.session_epoch >= 2, "fenced and reopened: {rec:?}");
}

/// A hand-driven channel: the test plays a client that writes whatever it likes.
struct RawChannel {
    sock: UnixStream,
    map: Arc<Mapping>,
    data: Producer,
    acks: Consumer,
    cap: usize,
}

const RAW_CLIENT: u64 = 4242;
const CAP: usize = layout::MIN_DATA_CAPACITY;

impl RawChannel {
    fn open(broker: &str, topic: &str) -> RawChannel {
        let target = broker.parse().unwrap();
        let name = &socket::names_for(target)[0];
        let sock = socket::connect(name).unwrap();
        let (fd, map) = socket::create_channel(CAP).unwrap();
        let hello = Hello {
            role: Role::Publish,
            ack_level: 1,
            client_id: RAW_CLIENT,
            session_epoch: 0,
            start_position: 0,
            connection_index: 0,
            cursor_count: 0,
            topic: topic.into(),
            session_key: [0; 16],
            flags: 0,
            opener: 0,
        };
        socket::send_hello(&sock, &hello.encode(), &fd).unwrap();
        let (h, _) = frame_from(&mut &sock);
        assert_eq!(h.kind, FrameKind::HelloOk);
        let map = Arc::new(map);
        RawChannel {
            sock,
            data: Producer::new(map.clone(), data_ring(CAP)),
            acks: Consumer::new(map.clone(), ack_ring(CAP)),
            map,
            cap: CAP,
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.data.write_all(&[bytes], || true).unwrap();
    }

    /// The next frame the broker writes into the ack ring.
    fn frame(&mut self) -> (FrameHeader, Vec<u8>) {
        let mut reader = AckReader(&mut self.acks, &self.sock);
        frame_from(&mut reader)
    }

    /// The broker's error frame, skipping acks before it.
    fn error(&mut self) -> ErrorFrame {
        loop {
            let (h, body) = self.frame();
            if h.kind == FrameKind::Error {
                return ErrorFrame::decode(&h, &body).unwrap();
            }
        }
    }

    /// Whether the broker closed the channel's socket within 10 s.
    fn closed_by_broker(&self) -> bool {
        self.sock
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut b = [0u8; 1];
        matches!((&self.sock).read(&mut b), Ok(0) | Err(_))
    }

    fn tail_word(&self) -> &std::sync::atomic::AtomicU64 {
        self.map.u64_at(layout::DATA_PRODUCER + layout::P_TAIL)
    }
}

struct AckReader<'a>(&'a mut Consumer, &'a UnixStream);

impl Read for AckReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let deadline = Some(Instant::now() + Duration::from_secs(10));
        let alive = || {
            let mut b = [0u8; 1];
            self.1.set_nonblocking(true).unwrap();
            let r = (&*self.1).read(&mut b);
            self.1.set_nonblocking(false).unwrap();
            matches!(r, Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock)
        };
        if self.0.wait_available(1, deadline, alive)? != Waited::Ready {
            return Ok(0);
        }
        let n = self.0.available()?.min(buf.len());
        self.0.copy_out(&mut buf[..n]);
        self.0.consume(n);
        Ok(n)
    }
}

fn frame_from(r: &mut impl Read) -> (FrameHeader, Vec<u8>) {
    let mut raw = [0u8; 16];
    r.read_exact(&mut raw).expect("a frame");
    let h = FrameHeader::decode(&raw, 1 << 20).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    r.read_exact(&mut body).expect("the frame's body");
    (h, body)
}

/// Batch `seq` of the raw client: `count` 3-byte messages.
fn raw_batch(seq: u64, count: u32) -> (BatchHeader, Vec<u8>) {
    let stride = message_stride(3) as usize;
    let mut payload = vec![0u8; stride * count as usize];
    for m in 0..count as usize {
        BlogMessageHeader {
            size: 3,
            client_id: RAW_CLIENT,
            ..Default::default()
        }
        .encode_into(&mut payload[m * stride..]);
    }
    let h = BatchHeader {
        batch_seq: seq,
        client_id: RAW_CLIENT,
        num_msg: count,
        total_size: payload.len() as u64,
        ..Default::default()
    };
    (h, payload)
}

fn bytes_of(h: &BatchHeader, payload: &[u8]) -> Vec<u8> {
    [h.encode().to_vec(), payload.to_vec()].concat()
}

/// Each kind of garbage a client can write into its live channel: the broker answers
/// that client with an error (or, when even its ack ring is garbage, closes it), and a
/// well-behaved publisher of the same broker is acknowledged throughout.
#[test]
fn garbage_in_a_live_ring_gets_that_client_refused_and_others_carry_on() {
    let t = common::start();
    t.create_topic("g", 2);
    let broker = t.brokers()[0].clone();
    let (stop, good) = good_publisher(&broker);
    garbage_positions(&broker);
    garbage_batches(&broker);
    stop.store(true, Ordering::Relaxed);
    assert!(good.join().unwrap() >= 5, "the good publisher kept going");
    // And the broker still opens channels.
    let p = Publisher::connect_brokers(&[broker], "g", shm_config(1)).unwrap();
    p.publish(b"after").unwrap();
    p.close().unwrap();
}

/// A publisher over shared memory that flushes every 200 messages until told to stop
/// (and at least 5 times); a flush that fails fails the test. Returns its rounds.
fn good_publisher(broker: &str) -> (Arc<AtomicBool>, std::thread::JoinHandle<u64>) {
    let broker = broker.to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let h = std::thread::spawn(move || {
        let p = Publisher::connect_brokers(&[broker], "g", shm_config(1)).unwrap();
        let mut rounds = 0u64;
        while !s.load(Ordering::Relaxed) || rounds < 5 {
            for i in 0..200 {
                p.publish(format!("good {rounds} {i}").as_bytes()).unwrap();
            }
            p.flush()
                .expect("the good publisher is acknowledged throughout");
            rounds += 1;
        }
        p.close().unwrap();
        rounds
    });
    (stop, h)
}

/// The broker's error on `ch` has one of `codes`, and the broker closed the channel.
fn expect_error(ch: &mut RawChannel, codes: &[ErrorCode], what: &str) -> String {
    let e = ch.error();
    assert!(codes.contains(&e.code), "{what}: {e:?}");
    assert!(
        ch.closed_by_broker(),
        "{what}: the broker closed the channel"
    );
    e.message
}

/// Positions out of range: a producer position that goes back, one more than the ring
/// ahead, and an ack-ring consumer position past what the broker wrote.
fn garbage_positions(broker: &str) {
    let mut ch = RawChannel::open(broker, "g");
    let (h, p) = raw_batch(0, 2);
    ch.send(&bytes_of(&h, &p));
    let (ack, _) = ch.frame();
    assert_eq!((ack.kind, ack.arg), (FrameKind::Ack, 1));
    ch.tail_word().store(10, Ordering::Release);
    let m = expect_error(&mut ch, &[ErrorCode::MalformedBatch], "tail went back");
    assert!(m.contains("went back"), "{m}");
    let mut ch = RawChannel::open(broker, "g");
    ch.tail_word().store(ch.cap as u64 * 3, Ordering::Release);
    layout_ring(&ch);
    let m = expect_error(&mut ch, &[ErrorCode::MalformedBatch], "tail too far");
    assert!(m.contains("past the consumer"), "{m}");
    // The broker cannot even tell this one why: it closes the channel.
    let mut ch = RawChannel::open(broker, "g");
    ch.map
        .u64_at(layout::ACK_CONSUMER + layout::C_HEAD)
        .store(1 << 40, Ordering::Release);
    let (h, p) = raw_batch(0, 1);
    ch.send(&bytes_of(&h, &p));
    assert!(
        ch.closed_by_broker(),
        "a garbage ack position closes the channel"
    );
}

/// Batches whose lengths, counts or offsets are wrong, validated in the log as over TCP.
fn garbage_batches(broker: &str) {
    let mut ch = RawChannel::open(broker, "g");
    let (mut h, _) = raw_batch(0, 1);
    h.total_size = u64::MAX / 2;
    ch.send(&h.encode());
    expect_error(&mut ch, &[ErrorCode::BatchTooLarge], "huge total size");
    let mut ch = RawChannel::open(broker, "g");
    let (mut h, p) = raw_batch(0, 3);
    h.num_msg = 7;
    ch.send(&bytes_of(&h, &p));
    expect_error(&mut ch, &[ErrorCode::MalformedBatch], "wrong count");
    // A message whose length runs past its batch.
    let mut ch = RawChannel::open(broker, "g");
    let (h, mut p) = raw_batch(0, 2);
    let stride = message_stride(3) as usize;
    BlogMessageHeader {
        size: 1 << 20,
        client_id: RAW_CLIENT,
        ..Default::default()
    }
    .encode_into(&mut p[stride..]);
    ch.send(&bytes_of(&h, &p));
    let codes = [ErrorCode::MalformedBatch, ErrorCode::MessageTooLarge];
    expect_error(&mut ch, &codes, "message past its batch");
}

/// Rings the broker's doorbell after a position was written by hand.
fn layout_ring(ch: &RawChannel) {
    let bell = ch.map.u32_at(layout::DATA_PRODUCER + layout::P_DATA_BELL);
    bell.fetch_add(1, Ordering::SeqCst);
    embarcadero_shm::bell::wake(bell);
}

#[test]
fn auto_falls_back_to_tcp_when_the_broker_serves_no_channels() {
    let t = common::start_with(|c| c.broker.shm = false);
    t.create_topic("t", 2);
    let auto = PublisherConfig {
        transport: Transport::Auto,
        ..shm_config(1)
    };
    let p = Publisher::connect_brokers(&t.brokers(), "t", auto).unwrap();
    assert!(p.stats().queues.iter().all(|q| q.transport == "tcp"));
    p.publish(b"over tcp").unwrap();
    p.close().unwrap();
    let e = Publisher::connect_brokers(&t.brokers(), "t", shm_config(1))
        .err()
        .unwrap();
    assert!(matches!(e, Error::Connect { .. }), "{e}");
    // A subscriber too: auto reads over TCP, shm is refused.
    let mut s =
        Subscriber::connect_brokers(&t.brokers(), "t", sub_config(Transport::Auto)).unwrap();
    assert_eq!(s.transport(), "tcp");
    let m = s
        .poll(Duration::from_secs(10))
        .unwrap()
        .expect("the message");
    assert_eq!(m.payload, b"over tcp");
    let e = Subscriber::connect_brokers(&t.brokers(), "t", sub_config(Transport::Shm))
        .err()
        .unwrap();
    assert!(matches!(e, Error::Connect { .. }), "{e}");
    // With channels on, auto takes them.
    let t = common::start();
    t.create_topic("t", 2);
    let auto = PublisherConfig {
        transport: Transport::Auto,
        ..shm_config(1)
    };
    let p = Publisher::connect_brokers(&t.brokers(), "t", auto).unwrap();
    assert!(p.stats().queues.iter().all(|q| q.transport == "shm"));
    p.close().unwrap();
    let s = Subscriber::connect_brokers(&t.brokers(), "t", sub_config(Transport::Auto)).unwrap();
    assert_eq!(s.transport(), "shm");
}

/// The client half of `another_uid_is_refused_unless_allowed`, run as uid 65534 in a
/// child process of this test binary (a no-op when run by itself).
#[test]
fn uid_child() {
    let Ok(broker) = std::env::var("EMBARCADERO_SHM_CHILD_BROKER") else {
        return;
    };
    let expect_allowed = std::env::var("EMBARCADERO_SHM_CHILD_ALLOWED").is_ok();
    let shm = Publisher::connect_brokers(std::slice::from_ref(&broker), "u", shm_config(1));
    match (&shm, expect_allowed) {
        (Ok(_), true) => println!("CHILD shm accepted"),
        (
            Err(Error::Broker {
                code: ErrorCode::ShmRefused,
                message,
                ..
            }),
            false,
        ) => {
            println!("CHILD shm refused: {message}")
        }
        (other, _) => panic!("unexpected: {:?}", other.as_ref().map(|_| ())),
    }
    if let Ok(p) = shm {
        p.publish(b"from 65534 over shm").unwrap();
        p.close().unwrap();
    }
    let auto = PublisherConfig {
        transport: Transport::Auto,
        ..shm_config(1)
    };
    let p = Publisher::connect_brokers(std::slice::from_ref(&broker), "u", auto).unwrap();
    let transport = p.stats().queues[0].transport;
    p.publish(b"from 65534 over auto").unwrap();
    p.close().unwrap();
    println!("CHILD auto used {transport}");
    let feed = Subscriber::connect_brokers(
        std::slice::from_ref(&broker),
        "u",
        sub_config(Transport::Shm),
    );
    match (&feed, expect_allowed) {
        (Ok(_), true) => println!("CHILD feed accepted"),
        (
            Err(Error::Broker {
                code: ErrorCode::ShmRefused,
                ..
            }),
            false,
        ) => println!("CHILD feed refused"),
        (other, _) => panic!("unexpected feed: {:?}", other.as_ref().map(|_| ())),
    }
    let s = Subscriber::connect_brokers(&[broker], "u", sub_config(Transport::Auto)).unwrap();
    println!("CHILD auto subscriber used {}", s.transport());
}

#[test]
fn another_uid_is_refused_unless_allowed() {
    if nix_euid() != 0 {
        println!(
            "skipped: needs root to run its client as uid 65534 (running as uid {})",
            nix_euid()
        );
        return;
    }
    for allowed in [false, true] {
        let t = common::start_with(|c| {
            if allowed {
                c.broker.shm_allowed_uids = vec![65534];
            }
        });
        t.create_topic("u", 2);
        let out = child_as_nobody(&t.brokers()[0], allowed);
        if allowed {
            assert!(out.contains("CHILD shm accepted"), "{out}");
            assert!(out.contains("CHILD auto used shm"), "{out}");
            assert!(out.contains("CHILD feed accepted"), "{out}");
            assert!(out.contains("CHILD auto subscriber used shm"), "{out}");
        } else {
            assert!(
                out.contains("CHILD shm refused") && out.contains("shm_allowed_uids"),
                "{out}"
            );
            assert!(out.contains("CHILD auto used tcp"), "{out}");
            assert!(out.contains("CHILD feed refused"), "{out}");
            assert!(out.contains("CHILD auto subscriber used tcp"), "{out}");
        }
        let got = read_all(&t.brokers(), "u", if allowed { 2 } else { 1 });
        assert!(got.iter().all(|m| m.payload.starts_with(b"from 65534")));
    }
}

fn nix_euid() -> u32 {
    socket::own_uid()
}

/// Runs `uid_child` as uid 65534 against `broker`; returns its output.
fn child_as_nobody(broker: &str, allowed: bool) -> String {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "uid_child", "--nocapture", "--test-threads=1"])
        .env("EMBARCADERO_SHM_CHILD_BROKER", broker)
        .uid(65534)
        .gid(65534);
    if allowed {
        cmd.env("EMBARCADERO_SHM_CHILD_ALLOWED", "1");
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed: {text}");
    text
}

// ------------------------------------------------------------ subscribing over feeds

/// Every order, published over TCP so that only the subscription runs over shared
/// memory: the feed's subscriber gets every message exactly once, orders 2 and 5 at
/// consecutive positions from 0, order 5 in each publisher's order.
#[test]
fn every_order_is_read_exactly_once_in_one_order_over_a_shm_feed() {
    let t = common::start_with(|c| {
        c.region.max_topics = 8;
        c.region.segments_per_broker = 16;
    });
    for order in [0u8, 1, 2, 5] {
        let topic = format!("o{order}feed");
        t.create_topic(&topic, order);
        let config = PublisherConfig {
            transport: Transport::Tcp,
            session_epoch: if order == 5 { 1 } else { 0 },
            ..shm_config(1)
        };
        exactly_once_in_order(&t, &topic, config);
    }
}

/// Two subscribers reading along while two publishers write, one over a feed and one
/// over TCP, see the same messages at the same positions, each exactly once.
#[test]
fn a_shm_and_a_tcp_subscriber_see_the_same_order() {
    let t = common::start();
    for (topic, order) in [("same2", 2u8), ("same5", 5)] {
        t.create_topic(topic, order);
        const N: u64 = 3000;
        let readers: Vec<_> = [Transport::Shm, Transport::Tcp]
            .into_iter()
            .map(|transport| {
                let (brokers, topic) = (t.brokers(), topic.to_string());
                let mut s =
                    Subscriber::connect_brokers(&brokers, &topic, sub_config(transport)).unwrap();
                assert_eq!(s.transport(), transport.to_string());
                std::thread::spawn(move || {
                    (0..2 * N)
                        .map(|i| {
                            let m = s
                                .poll(Duration::from_secs(30))
                                .unwrap()
                                .unwrap_or_else(|| panic!("{transport}: stuck after {i}"));
                            (m.position, m.client_id, m.counter)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let writers: Vec<_> = (0..2)
            .map(|_| {
                let (brokers, topic) = (t.brokers(), topic.to_string());
                std::thread::spawn(move || {
                    let config = PublisherConfig {
                        session_epoch: if order == 5 { 1 } else { 0 },
                        ..shm_config(1)
                    };
                    let p = Publisher::connect_brokers(&brokers, &topic, config).unwrap();
                    for i in 0..N {
                        p.publish(format!("{i}").as_bytes()).unwrap();
                    }
                    p.close().unwrap();
                })
            })
            .collect();
        writers.into_iter().for_each(|w| w.join().unwrap());
        let mut got: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        let (tcp, shm) = (got.pop().unwrap(), got.pop().unwrap());
        assert!(
            shm == tcp,
            "{topic}: the feed and the socket disagree on the order"
        );
        let positions: Vec<u64> = shm.iter().map(|m| m.0).collect();
        assert_eq!(positions, (0..2 * N).collect::<Vec<_>>(), "{topic}");
        let mut each: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (_, client, counter) in shm {
            each.entry(client).or_default().push(counter);
        }
        assert_eq!(each.len(), 2);
        for (_, mut counters) in each {
            if order == 2 {
                counters.sort_unstable();
            }
            assert_eq!(
                counters,
                (0..N).collect::<Vec<_>>(),
                "{topic}: exactly once"
            );
        }
    }
}

/// Over a feed as over TCP: a subscription starts at a given position, `seek` moves
/// it, and a position memory no longer holds is refused with PositionNotRetained,
/// naming the first available one, from which the rest is read.
#[test]
fn a_feed_starts_at_a_position_seeks_and_refuses_what_is_not_retained() {
    let t = common::start_with(small_memory);
    t.create_topic("r", 2);
    let p = Publisher::connect_brokers(&t.brokers(), "r", shm_config(1)).unwrap();
    const N: u64 = 20_000;
    let payload = vec![5u8; 1000];
    for _ in 0..N {
        p.publish(&payload).unwrap();
    }
    p.close().unwrap();
    let from = |position: u64| SubscriberConfig {
        start: Some(Cursor::Global(position)),
        ..sub_config(Transport::Shm)
    };
    let err = Subscriber::connect_brokers(&t.brokers(), "r", from(0))
        .and_then(|mut s| s.poll(Duration::from_secs(10)))
        .expect_err("20 MB through 4 MiB of memory: position 0 was reclaimed");
    let first = common::first_available(&err);
    assert!(first > 0 && first < N, "{err}");
    let mut s = Subscriber::connect_brokers(&t.brokers(), "r", from(first)).unwrap();
    assert_eq!(s.transport(), "shm");
    let m = s.poll(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(m.position, first);
    s.seek(Cursor::Global(N - 10)).unwrap();
    assert_eq!(s.transport(), "shm");
    for i in N - 10..N {
        assert_eq!(
            s.poll(Duration::from_secs(10)).unwrap().unwrap().position,
            i
        );
    }
}

/// The child half of `a_sigkilled_shm_subscriber_releases_its_pin_within_the_stall_timeout`
/// (a no-op when run by itself): subscribes over a feed, reads 10 messages, checks that
/// nothing of the region is mapped in this process, says so, and waits to be killed.
/// `broker.shm_feed_bytes` sets each feed's ring: a subscriber over a 64 KiB feed maps
/// exactly that much, and reads a stream about fifty times its size exactly once, in
/// one order.
#[test]
fn a_feed_of_the_configured_size_carries_a_stream_many_times_its_size() {
    const FEED: usize = 64 * 1024;
    let t = common::start_with(|c| c.broker.shm_feed_bytes = FEED as u64);
    t.create_topic("feed64k", 2);
    const N: u64 = 3000;
    let p = Publisher::connect_brokers(&t.brokers(), "feed64k", shm_config(1)).unwrap();
    let payload = vec![5u8; 1024];
    for _ in 0..N {
        p.publish(&payload).unwrap();
    }
    let id = p.client_id();
    p.close().unwrap();
    let mut s =
        Subscriber::connect_brokers(&t.brokers(), "feed64k", sub_config(Transport::Shm)).unwrap();
    let mut counters = Vec::new();
    for i in 0..N {
        let m = s.poll(Duration::from_secs(30)).unwrap().expect("a message");
        assert_eq!((m.position, m.client_id), (i, id), "one order from 0");
        counters.push(m.counter);
    }
    counters.sort_unstable();
    assert_eq!(counters, (0..N).collect::<Vec<_>>(), "exactly once");
    // Other tests of this process map feeds of the default size; this one's is 64 KiB.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let feed_sizes: Vec<usize> = maps
        .lines()
        .filter(|l| l.contains("embarcadero-feed"))
        .map(|l| {
            let (from, to) = l.split(' ').next().unwrap().split_once('-').unwrap();
            usize::from_str_radix(to, 16).unwrap() - usize::from_str_radix(from, 16).unwrap()
        })
        .collect();
    assert!(
        feed_sizes.contains(&layout::feed_len(FEED)),
        "a feed of {FEED} bytes is mapped: {feed_sizes:?}"
    );
    drop(s);
}

#[test]
fn feed_child() {
    let Ok(broker) = std::env::var("EMBARCADERO_FEED_CHILD_BROKER") else {
        return;
    };
    let region = std::env::var("EMBARCADERO_FEED_CHILD_REGION").unwrap();
    let mut s = Subscriber::connect_brokers(&[broker], "k", sub_config(Transport::Shm)).unwrap();
    for i in 0..10 {
        let m = s.poll(Duration::from_secs(30)).unwrap().expect("a message");
        assert_eq!(m.position, i);
    }
    assert_eq!(s.transport(), "shm");
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(
        !maps.contains(&region),
        "a subscriber maps nothing of the region:\n{maps}"
    );
    assert!(
        maps.contains("embarcadero-feed"),
        "the feed is mapped:\n{maps}"
    );
    println!("CHILD subscribed over shm");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    loop {
        std::thread::park();
    }
}

#[test]
fn a_sigkilled_shm_subscriber_releases_its_pin_within_the_stall_timeout() {
    const STALL: Duration = Duration::from_secs(10);
    let t = common::start_with(|c| c.broker.reader_stall_timeout_ms = STALL.as_millis() as u64);
    t.create_topic("k", 2);
    let p = Publisher::connect_brokers(&t.brokers(), "k", shm_config(1)).unwrap();
    for i in 0..100 {
        p.publish(format!("{i}").as_bytes()).unwrap();
    }
    p.close().unwrap();
    let topic = t.server.topic("k").unwrap().id;
    let region = t.server.region().clone();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "feed_child", "--nocapture", "--test-threads=1"])
        .env("EMBARCADERO_FEED_CHILD_BROKER", &t.brokers()[0])
        .env("EMBARCADERO_FEED_CHILD_REGION", region.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut seen = Vec::new();
    for line in std::io::BufRead::lines(out) {
        let line = line.unwrap();
        let done = line.contains("CHILD subscribed over shm");
        seen.push(line);
        if done {
            break;
        }
    }
    assert!(
        seen.last().is_some_and(|l| l.contains("CHILD subscribed")),
        "the child failed: {seen:?}"
    );
    // Stale pins count too: only a freed slot reads as no reader.
    let forever = Duration::from_secs(3600);
    assert_ne!(
        region.reader_floor(topic, 0, forever),
        u64::MAX,
        "the child holds a pin"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    while region.reader_floor(topic, 0, forever) != u64::MAX {
        assert!(
            killed.elapsed() < STALL,
            "a SIGKILLed subscriber's pin outlived the stall timeout"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A hand-driven subscription over a feed: the test plays the subscriber.
struct RawFeed {
    sock: UnixStream,
    fd: std::os::fd::OwnedFd,
    view: Arc<Mapping>,
    page: Arc<Mapping>,
    ring: Consumer,
}

impl RawFeed {
    fn open(broker: &str, topic: &str) -> RawFeed {
        let name = &socket::names_for(broker.parse().unwrap())[0];
        let sock = socket::connect(name).unwrap();
        let (page_fd, page) = socket::create_cursor_page().unwrap();
        let hello = Hello {
            role: Role::Subscribe,
            ack_level: 0,
            client_id: RAW_CLIENT,
            session_epoch: 0,
            start_position: 0,
            connection_index: 0,
            cursor_count: 0,
            topic: topic.into(),
            session_key: [0; 16],
            flags: 0,
            opener: 0,
        };
        socket::send_hello(&sock, &hello.encode(), &page_fd).unwrap();
        let mut raw = [0u8; 16];
        let fd = socket::recv_with_fd(&sock, &mut raw, Duration::from_secs(10))
            .unwrap()
            .expect("HelloOk carries the feed");
        let h = FrameHeader::decode(&raw, 1 << 10).unwrap();
        assert_eq!(h.kind, FrameKind::HelloOk);
        let mut body = vec![0u8; h.body_len as usize];
        (&sock).read_exact(&mut body).unwrap();
        let (view, cap) = socket::map_feed(&fd).unwrap();
        let (view, page) = (Arc::new(view), Arc::new(page));
        let maps = RingMaps {
            producer: view.clone(),
            consumer: page.clone(),
        };
        RawFeed {
            ring: Consumer::split(maps, feed_ring(cap)),
            sock,
            fd,
            view,
            page,
        }
    }

    /// Reads frames until `n` messages were delivered and confirmed.
    fn read_messages(&mut self, n: u64) {
        read_messages_from(&mut AckReader(&mut self.ring, &self.sock), n);
    }

    /// Every byte of the feed, as the subscriber can see them.
    fn all_bytes(&self) -> Vec<u8> {
        let mut all = vec![0u8; self.view.len()];
        // SAFETY: the whole mapping is readable; the broker writes only the ring's
        // unread part, and bytes torn by such a write are only searched, never trusted.
        unsafe {
            std::ptr::copy_nonoverlapping(self.view.base(), all.as_mut_ptr(), all.len());
        }
        all
    }
}

/// Reads a feed's frames from `r` until `n` messages were delivered and confirmed.
fn read_messages_from(r: &mut impl Read, n: u64) {
    let (mut pending, mut confirmed) = (Vec::new(), 0u64);
    while confirmed < n {
        let (h, body) = frame_from(r);
        match h.kind {
            FrameKind::Delivery => {
                let d = embarcadero_wire::DeliveryHeader::decode(&body).unwrap();
                pending.push((d.num_msg - d.skip) as u64);
            }
            FrameKind::BatchOk => {
                confirmed += pending.drain(..h.arg as usize).sum::<u64>();
            }
            other => panic!("unexpected {other:?} frame"),
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Reads slowly over part of a stream: after `fast` bytes, 4 KiB per 40 ms until `slow`
/// more bytes are read, then fast again.
struct Paced<R> {
    inner: R,
    read: usize,
    fast: usize,
    slow: usize,
}

impl<R: Read> Read for Paced<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        const CHUNK: usize = 4 << 10;
        let slow = (self.fast..self.fast + self.slow).contains(&self.read);
        let len = if slow {
            buf.len().min(CHUNK)
        } else {
            buf.len()
        };
        let n = self.inner.read(&mut buf[..len])?;
        self.read += n;
        if slow {
            // The scenario itself: a subscriber that keeps reading, at about 100 KB/s.
            std::thread::sleep(Duration::from_millis(40));
        }
        Ok(n)
    }
}

/// A shm subscriber that reads slowly but steadily is served to the end. The broker
/// waits for a quarter of the feed (2 MiB) to be free when the feed is full; a
/// subscriber that frees less than that, or than the batch it waits to write (here
/// up to 512 KiB), within the stall timeout (here 2 s: the setting's floor of 1 s,
/// doubled for a connection; about 200 KB at its pace) but frees something is slow,
/// not stalled, as over TCP, where any progress restarts the timeout. It was
/// disconnected before.
#[test]
fn a_slow_shm_subscriber_that_keeps_reading_is_not_disconnected() {
    const STALL: Duration = Duration::from_secs(1);
    let t = common::start_with(|c| c.broker.reader_stall_timeout_ms = STALL.as_millis() as u64);
    t.create_topic("slow", 2);
    const MESSAGES: u64 = 10 << 10;
    let config = PublisherConfig {
        ack_level: 1,
        transport: Transport::Shm,
        ..PublisherConfig::default()
    };
    let p = Publisher::connect_brokers(&t.brokers(), "slow", config).unwrap();
    for i in 0..MESSAGES {
        let mut m = vec![b'x'; 1000];
        m[..8].copy_from_slice(&i.to_le_bytes());
        p.publish(&m).unwrap();
    }
    p.close().unwrap();
    let mut feed = RawFeed::open(&t.brokers()[0], "slow");
    let mut paced = Paced {
        inner: AckReader(&mut feed.ring, &feed.sock),
        read: 0,
        // The first 512 KiB slowly (5 s), while the broker waits with 2 MiB more than
        // the feed holds.
        fast: 0,
        slow: 512 << 10,
    };
    read_messages_from(&mut paced, MESSAGES);
    assert!(
        paced.read >= paced.fast + paced.slow,
        "the slow stretch was read through the feed ({} bytes)",
        paced.read
    );
}

/// A subscriber's feed is read-only to it and holds only its topic's bytes: another
/// topic's messages, in the same brokers' memory, never appear in it; writing it
/// (`write(2)`, a writable shared mapping, `mprotect` of its mapping, `ftruncate`) is
/// refused by the kernel; and the one page it may write, its ring position, is checked:
/// garbage there gets it disconnected.
#[test]
fn a_feed_is_read_only_to_its_subscriber_and_holds_only_its_topic() {
    let t = common::start();
    t.create_topic("theirs", 2);
    t.create_topic("mine", 2);
    for (topic, text) in [("theirs", "THEIRS-SECRET"), ("mine", "MINE-PUBLIC")] {
        let p = Publisher::connect_brokers(&t.brokers(), topic, shm_config(1)).unwrap();
        for i in 0..500 {
            p.publish(format!("{text}-{i}").as_bytes()).unwrap();
        }
        p.close().unwrap();
    }
    let broker = t.brokers()[0].clone();
    let mut feed = RawFeed::open(&broker, "mine");
    feed.read_messages(500);
    let seen = feed.all_bytes();
    assert!(
        contains(&seen, b"MINE-PUBLIC-499"),
        "its own topic is there"
    );
    assert!(
        !contains(&seen, b"THEIRS-SECRET"),
        "no byte of another topic"
    );
    refused_writes(&feed);
    // Its ring position is the one word it writes; out of range, it is cut off.
    feed.page
        .u64_at(layout::CURSOR_LINE + layout::C_HEAD)
        .store(1 << 40, Ordering::Release);
    let p =
        Publisher::connect_brokers(std::slice::from_ref(&broker), "mine", shm_config(1)).unwrap();
    p.publish(b"one more").unwrap();
    p.close().unwrap();
    let sock = feed.sock.try_clone().unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut b = [0u8; 1];
    assert!(
        matches!((&sock).read(&mut b), Ok(0) | Err(_)),
        "a garbage ring position closes the feed"
    );
    // And the broker serves others.
    assert_eq!(read_all(&[broker], "mine", 501).len(), 501);
}

/// The kernel refuses every way of writing a feed its subscriber has.
fn refused_writes(feed: &RawFeed) {
    use std::os::fd::AsRawFd;
    let fd = feed.fd.as_raw_fd();
    let len = feed.view.len();
    let errno = || std::io::Error::last_os_error().raw_os_error();
    // SAFETY: a one-byte write from a local buffer; the kernel refuses it or writes it.
    let wrote = unsafe { libc::write(fd, b"x".as_ptr() as *const libc::c_void, 1) };
    assert_eq!((wrote, errno()), (-1, Some(libc::EPERM)), "write(2)");
    // SAFETY: asks for a fresh mapping; refused, or unmapped below at once.
    let mapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    let refused = mapped == libc::MAP_FAILED;
    let e = errno();
    if !refused {
        // SAFETY: the mapping just made, of `len` bytes.
        unsafe { libc::munmap(mapped, len) };
    }
    assert!(
        refused && e == Some(libc::EPERM),
        "a writable shared mapping: {e:?}"
    );
    // SAFETY: asks to make our read-only mapping writable; the kernel refuses, so
    // nothing changes (were it allowed, nothing would write through it here).
    let protected = unsafe {
        libc::mprotect(
            feed.view.base() as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
    assert_eq!(protected, -1, "mprotect to writable");
    assert_eq!(errno(), Some(libc::EACCES));
    // SAFETY: a plain system call on our fd.
    let truncated = unsafe { libc::ftruncate(fd, 0) };
    assert_eq!((truncated, errno()), (-1, Some(libc::EPERM)), "ftruncate");
}
