//! Publishing over local shared-memory channels (issue 26) against a real server: every
//! order and ack level delivers exactly once in order; order-5 sessions are fenced and
//! reopen over them; a client that writes garbage into its live channel is refused with
//! an error while another publisher of the same broker carries on; another uid is
//! refused unless the operator allows it; `auto` falls back to TCP.

mod common;

use embarcadero_client::{
    Error, Message, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec, Transport,
};
use embarcadero_shm::layout::{self, ack_ring, data_ring};
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

fn read_all(brokers: &[String], topic: &str, n: usize) -> Vec<Message> {
    let mut s = Subscriber::connect_brokers(brokers, topic, SubscriberConfig::default()).unwrap();
    (0..n)
        .map(|i| {
            s.poll(Duration::from_secs(30))
                .unwrap()
                .unwrap_or_else(|| panic!("{topic}: stuck after {i} messages"))
        })
        .collect()
}

/// Publishes `N` numbered messages from each of two publishers over shared memory and
/// checks the subscriber got each exactly once; orders 2 and 5 at consecutive positions
/// from 0, order 5 each publisher's in publish order (orders 0-2 keep only each
/// connection's order, and a publisher has eight connections here).
fn exactly_once_in_order(t: &common::TestServer, topic: &str, config: PublisherConfig) {
    const N: u64 = 2000;
    let publishers: Vec<_> = (0..2)
        .map(|_| {
            let (brokers, topic, config) = (t.brokers(), topic.to_string(), config.clone());
            std::thread::spawn(move || {
                let p = Publisher::connect_brokers(&brokers, &topic, config).unwrap();
                assert!(
                    p.stats().queues.iter().all(|q| q.transport == "shm"),
                    "every connection is a shared-memory channel"
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
            subscribe_flags: 0,
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
    let p = Publisher::connect_brokers(&[broker], "u", auto).unwrap();
    let transport = p.stats().queues[0].transport;
    p.publish(b"from 65534 over auto").unwrap();
    p.close().unwrap();
    println!("CHILD auto used {transport}");
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
        } else {
            assert!(
                out.contains("CHILD shm refused") && out.contains("shm_allowed_uids"),
                "{out}"
            );
            assert!(out.contains("CHILD auto used tcp"), "{out}");
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
