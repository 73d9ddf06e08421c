//! A publisher made through the head follows membership: a fake head (test double)
//! serves `/v1/cluster`, fake brokers acknowledge every batch, and brokers are listed
//! after the publisher connected. Order 5: a broker that joins reports the session's
//! mark as it read it when the hello came.

mod common;

use embarcadero_client::{Publisher, PublisherConfig, PublisherStats};
use embarcadero_wire::{Ack, BatchHeader, HelloOk, BATCH_HEADER_LEN};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// An order-2 broker that acknowledges each batch once it has read it.
struct FakeBroker {
    addr: String,
    connections: Arc<AtomicU64>,
    batches: Arc<AtomicU64>,
}

impl FakeBroker {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let connections = Arc::new(AtomicU64::new(0));
        let batches = Arc::new(AtomicU64::new(0));
        let (c, b) = (connections.clone(), batches.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                c.fetch_add(1, Ordering::AcqRel);
                let b = b.clone();
                std::thread::spawn(move || serve_publisher(stream, &b));
            }
        });
        Self {
            addr,
            connections,
            batches,
        }
    }

    fn connections(&self) -> u64 {
        self.connections.load(Ordering::Acquire)
    }

    fn batches(&self) -> u64 {
        self.batches.load(Ordering::Acquire)
    }
}

fn serve_publisher(mut s: TcpStream, batches: &AtomicU64) {
    let Ok(hello) = common::answer_hello(&mut s, 1 << 20) else {
        return;
    };
    ack_each_batch(s, hello.ack_level, |h| {
        batches.fetch_add(1, Ordering::AcqRel);
        h.batch_seq + 1
    });
}

/// Reads batches until the client goes, acknowledging each, once read whole, up to what
/// `count` says of it.
fn ack_each_batch(mut s: TcpStream, level: u8, mut count: impl FnMut(&BatchHeader) -> u64) {
    loop {
        let mut raw = [0u8; BATCH_HEADER_LEN];
        if s.read_exact(&mut raw).is_err() {
            return;
        }
        let h = BatchHeader::decode(&raw).unwrap();
        let mut payload = vec![0u8; h.total_size as usize];
        if s.read_exact(&mut payload).is_err() {
            return;
        }
        let ack = Ack {
            level,
            count: count(&h),
        };
        if s.write_all(&ack.encode()).is_err() {
            return;
        }
    }
}

/// The head's `/v1/cluster` with the brokers the test lists: (id, address, incarnation).
struct FakeHead {
    addr: String,
    brokers: Arc<Mutex<Vec<(u32, String, u64)>>>,
    cluster_reads: Arc<AtomicU64>,
}

impl FakeHead {
    fn start(brokers: Vec<(u32, String, u64)>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let brokers = Arc::new(Mutex::new(brokers));
        let cluster_reads = Arc::new(AtomicU64::new(0));
        let (listed, reads) = (brokers.clone(), cluster_reads.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                answer(stream, &listed, &reads);
            }
        });
        Self {
            addr,
            brokers,
            cluster_reads,
        }
    }

    fn list(&self, brokers: Vec<(u32, String, u64)>) {
        *self.brokers.lock().unwrap() = brokers;
    }

    fn cluster_reads(&self) -> u64 {
        self.cluster_reads.load(Ordering::Acquire)
    }
}

/// One HTTP request: `/v1/cluster` lists the brokers, anything else is 404 (so the
/// publisher takes the topic's order from the brokers' HelloOk).
fn answer(stream: TcpStream, listed: &Mutex<Vec<(u32, String, u64)>>, reads: &AtomicU64) {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) if line == "\r\n" => break,
            Ok(_) => {}
        }
    }
    let (status, body) = if request_line.starts_with("GET /v1/cluster ") {
        let brokers: Vec<_> = listed
            .lock()
            .unwrap()
            .iter()
            .map(|(id, addr, incarnation)| {
                serde_json::json!({"id": id, "addr": addr, "incarnation": incarnation})
            })
            .collect();
        reads.fetch_add(1, Ordering::AcqRel);
        let cluster = serde_json::json!({
            "brokers": brokers,
            "max_message_bytes": 1 << 20,
            "max_batch_bytes": 1 << 20,
        });
        ("200 OK", cluster.to_string())
    } else {
        ("404 Not Found", r#"{"error":"not found"}"#.to_string())
    };
    let mut stream = reader.into_inner();
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
}

fn config(max_joined_brokers: usize) -> PublisherConfig {
    PublisherConfig {
        batch_bytes: 4096,
        membership_refresh: Duration::from_millis(20),
        max_joined_brokers,
        flush_timeout: Duration::from_secs(10),
        ..PublisherConfig::default()
    }
}

/// Publishes and flushes rounds of messages until `done` holds for the stats; fails the
/// test after 20 s.
fn publish_until(p: &Publisher, what: &str, done: impl Fn(&PublisherStats) -> bool) {
    let start = Instant::now();
    while !done(&p.stats()) {
        assert!(start.elapsed() < Duration::from_secs(20), "never: {what}");
        for _ in 0..20 {
            p.publish(&[7u8; 100]).unwrap();
        }
        p.flush().unwrap();
    }
}

fn acked_through(stats: &PublisherStats, broker: &FakeBroker) -> u64 {
    stats
        .queues
        .iter()
        .filter(|q| q.broker == broker.addr)
        .map(|q| q.acked_batches)
        .sum()
}

#[test]
fn brokers_that_join_later_get_batches_from_a_running_publisher() {
    let a = FakeBroker::start();
    let head = FakeHead::start(vec![(0, a.addr.clone(), 0)]);
    let p = Publisher::connect(&head.addr, "t", config(8)).unwrap();
    publish_until(&p, "a batch through the first broker", |s| {
        acked_through(s, &a) > 0
    });
    assert_eq!(p.stats().queues.len(), 1);

    // A new broker joins.
    let b = FakeBroker::start();
    head.list(vec![(0, a.addr.clone(), 0), (1, b.addr.clone(), 7)]);
    publish_until(&p, "a batch through the joined broker", |s| {
        acked_through(s, &b) > 0
    });

    // Broker 1 restarts: a new process (incarnation) at a new address, while the old
    // one's connection is still up. The new process gets queues of its own.
    let b2 = FakeBroker::start();
    head.list(vec![(0, a.addr.clone(), 0), (1, b2.addr.clone(), 8)]);
    publish_until(&p, "a batch through the restarted broker", |s| {
        acked_through(s, &b2) > 0
    });
    // A few more refreshes that list processes it has queues for already.
    let reads = head.cluster_reads();
    publish_until(&p, "three more membership reads", |_| {
        head.cluster_reads() >= reads + 3
    });

    let stats = p.close().unwrap();
    assert_eq!(
        stats.acked_batches, stats.batches,
        "every batch acknowledged"
    );
    assert_eq!(stats.queues.len(), 3, "one queue per broker process");
    for broker in [&a, &b, &b2] {
        assert_eq!(broker.connections(), 1, "connected once to {}", broker.addr);
        let queue = stats
            .queues
            .iter()
            .find(|q| q.broker == broker.addr)
            .unwrap();
        assert_eq!(queue.batches, broker.batches(), "{}", broker.addr);
        assert_eq!(queue.acked_batches, queue.batches, "{}", broker.addr);
    }
}

#[test]
fn max_joined_brokers_bounds_what_a_publisher_adds() {
    let a = FakeBroker::start();
    let head = FakeHead::start(vec![(0, a.addr.clone(), 0)]);
    let p = Publisher::connect(&head.addr, "t", config(1)).unwrap();
    let (b, c) = (FakeBroker::start(), FakeBroker::start());
    head.list(vec![
        (0, a.addr.clone(), 0),
        (1, b.addr.clone(), 1),
        (2, c.addr.clone(), 1),
    ]);
    publish_until(&p, "a batch through the joined broker", |s| {
        acked_through(s, &b) > 0
    });
    // `close` waits for the watcher, so the pass that added broker 1 has looked at
    // broker 2 by the time the counts are read.
    let stats = p.close().unwrap();
    assert_eq!(stats.acked_batches, stats.batches);
    assert_eq!(stats.queues.len(), 2, "the first broker and one joined");
    assert_eq!(
        c.connections(),
        0,
        "past max_joined_brokers, no more brokers"
    );
}

/// Order 5: the session's committed mark as the region's table holds it, shared by the
/// fake session brokers: each ack carries it, each HelloOk reports it.
type SessionMark = Arc<AtomicU64>;

/// A hello held by a fake session broker: it sends the mark it read when the hello came,
/// then answers once the test sends on the second channel.
type HeldHello = (mpsc::Sender<u64>, mpsc::Receiver<()>);

/// An order-5 broker for one connection that acknowledges each batch once read, with
/// the session's mark; `held`: its hello is answered when the test says.
fn session_broker(mark: SessionMark, held: Option<HeldHello>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let hello = common::read_hello(&mut s).unwrap();
        let at_hello = mark.load(Ordering::Acquire);
        if let Some((told, go)) = held {
            told.send(at_hello).unwrap();
            go.recv().unwrap();
        }
        let ok = HelloOk {
            next_batch_seq: at_hello,
            ..common::hello_ok(&hello, 5, 1 << 20)
        };
        s.write_all(&ok.encode_frame()).unwrap();
        ack_each_batch(s, hello.ack_level, |h| {
            let next = h.batch_seq + 1;
            mark.fetch_max(next, Ordering::AcqRel).max(next)
        });
    });
    addr
}

#[test]
fn a_joining_brokers_session_mark_is_held_to_the_acks_from_before_its_hello() {
    let mark = SessionMark::default();
    let a = session_broker(mark.clone(), None);
    let head = FakeHead::start(vec![(0, a.clone(), 0)]);
    let p = Publisher::connect(&head.addr, "t", config(8)).unwrap();
    publish_until(&p, "a batch through the first broker", |s| {
        s.acked_batches > 0
    });

    let (told, hello_came) = mpsc::channel();
    let (answer, go) = mpsc::channel();
    let b = session_broker(mark.clone(), Some((told, go)));
    head.list(vec![(0, a.clone(), 0), (1, b.clone(), 1)]);
    let at_hello = hello_came.recv_timeout(Duration::from_secs(20)).unwrap();
    // While broker 1's answer is on its way, broker 0 acknowledges more of the session.
    publish_until(&p, "acks past the joining broker's mark", |_| {
        mark.load(Ordering::Acquire) > at_hello
    });
    answer.send(()).unwrap();
    publish_until(&p, "a batch through the joined broker", |s| {
        s.queues
            .iter()
            .any(|q| q.broker == b && q.acked_batches > 0)
    });
    let stats = p.close().unwrap();
    assert_eq!(
        stats.acked_batches, stats.batches,
        "every batch acknowledged"
    );
}
