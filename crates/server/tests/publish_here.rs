//! Publishing without waiting (`Publisher::try_publish_all`, what the TypeScript binding's
//! `publish` and `publishMany` do on the event loop's thread): it appends what it can and
//! returns, appending nothing more, where the next message would have to wait for a full
//! queue, even one that stays full; what follows through the waiting calls comes after it,
//! and every message arrives once, in the order it was published.

mod common;

use embarcadero_client::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use std::time::Duration;

/// Payload `i`: its number, then filler, about 100 bytes.
fn payload(i: u64) -> Vec<u8> {
    format!("m{i}:{}", "x".repeat(90)).into_bytes()
}

fn index_of(payload: &[u8]) -> u64 {
    let text = std::str::from_utf8(payload).unwrap();
    text[1..text.find(':').unwrap()].parse().unwrap()
}

/// An order-5 topic `topic` and its publisher, whose queue 0 sends a batch every `pause`
/// and holds at most one more: batches are due on it in turn (no deflection), so sealing
/// one of them soon has to wait. Batches are sealed by size only, on the publishing
/// thread (no linger runs out during a test).
fn slow_queue_0(t: &common::TestServer, topic: &str, pause: Duration) -> Publisher {
    t.create_topic(topic, 5);
    let config = PublisherConfig {
        batch_bytes: 4096,
        queue_depth: 1,
        deflect: false,
        slow_queue: Some((0, pause)),
        linger: Duration::from_secs(600),
        linger_backstop: Duration::from_secs(600),
        session_epoch: 1,
        ..PublisherConfig::default()
    };
    Publisher::connect_brokers(&t.brokers(), topic, config).unwrap()
}

/// Calls `try_publish_all` with chunks of 64 messages from `next` on until one appends
/// fewer; that chunk, and how many of it were appended (at most 1000 calls).
fn until_one_stops(p: &Publisher, next: &mut u64) -> Option<(Vec<Vec<u8>>, usize)> {
    for _ in 0..1000 {
        let chunk: Vec<Vec<u8>> = (*next..*next + 64).map(payload).collect();
        let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
        let appended = p.try_publish_all(&refs).unwrap();
        assert!(appended <= refs.len());
        *next += appended as u64;
        if appended < refs.len() {
            return Some((chunk, appended));
        }
    }
    None
}

/// The queue a batch is due on stays full (its sender sleeps for an hour): the call
/// returns, having appended less, instead of waiting. A call that waited would never
/// answer; the publisher is left behind, asleep, when the test ends.
#[test]
fn a_publish_that_never_waits_returns_while_the_queue_it_needs_stays_full() {
    let t = common::start();
    let p = slow_queue_0(&t, "full", Duration::from_secs(3600));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut next = 0;
        let stopped = until_one_stops(&p, &mut next).map(|(_, appended)| appended);
        tx.send((stopped, next)).unwrap();
        std::mem::forget(p);
    });
    // A hang guard, not a timing: a call that waited for the full queue never answers.
    let (stopped, appended) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a call waited for a queue that stays full");
    assert!(stopped.is_some(), "1000 calls appended everything");
    assert!(appended > 0, "nothing was appended before the queue filled");
}

#[test]
fn what_follows_a_publish_that_stopped_keeps_the_order() {
    let t = common::start();
    let p = slow_queue_0(&t, "here", Duration::from_millis(200));
    let mut next = 0;
    let (chunk, appended) = until_one_stops(&p, &mut next).expect("a call stopped");
    // The rest through a call that waits, right after: it comes next.
    let rest: Vec<&[u8]> = chunk[appended..].iter().map(Vec::as_slice).collect();
    p.publish_all(&rest).unwrap();
    next += rest.len() as u64;
    for i in next..next + 200 {
        p.publish(&payload(i)).unwrap();
    }
    let total = next + 200;
    p.close().unwrap();
    let mut sub =
        Subscriber::connect_brokers(&t.brokers(), "here", SubscriberConfig::default()).unwrap();
    let mut got = Vec::new();
    while (got.len() as u64) < total {
        let m = sub
            .poll(Duration::from_secs(30))
            .unwrap()
            .unwrap_or_else(|| panic!("stuck after {} messages", got.len()));
        got.push(index_of(&m.payload));
    }
    // One publisher, one session: the global order is its publish order.
    assert_eq!(got, (0..total).collect::<Vec<_>>());
}
