//! For each order level: several publishers, each with two connections per broker,
//! publish concurrently through all brokers while several subscribers read. Checks:
//! every acknowledged message reaches every subscriber exactly once; positions are
//! contiguous from 0 (globally for order 2, per broker for orders 0 and 1); all
//! subscribers of an order-2 topic see one identical sequence; each connection's own
//! batches stay in order within its broker.

mod common;

use embarcadero_client::{Message, Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

const PUBLISHERS: usize = 3;
const MESSAGES_PER_PUBLISHER: usize = 6000;
const SUBSCRIBERS: usize = 3;

fn run(order: u8) {
    let t = common::start();
    let topic = format!("order{order}");
    t.create_topic(&topic, order);
    let total = PUBLISHERS * MESSAGES_PER_PUBLISHER;

    // Subscribers start first, so they also exercise waiting at the end of the log.
    let subscribers: Vec<_> = (0..SUBSCRIBERS)
        .map(|_| {
            let brokers = t.brokers();
            let topic = topic.clone();
            std::thread::spawn(move || {
                let mut s =
                    Subscriber::connect_brokers(&brokers, &topic, SubscriberConfig::default())
                        .expect("subscribe");
                let mut got = Vec::with_capacity(total);
                while got.len() < total {
                    match s.poll(Duration::from_secs(30)).expect("poll") {
                        Some(m) => got.push(m),
                        None => panic!("no message for 30 s after {} messages", got.len()),
                    }
                }
                got
            })
        })
        .collect();

    let publishers: Vec<_> = (0..PUBLISHERS)
        .map(|p| {
            let brokers = t.brokers();
            let topic = topic.clone();
            std::thread::spawn(move || {
                let config = PublisherConfig {
                    batch_bytes: 8 * 1024,
                    linger: Duration::from_micros(200),
                    threads_per_broker: 2,
                    ..PublisherConfig::default()
                };
                let publisher =
                    Publisher::connect_brokers(&brokers, &topic, config).expect("connect");
                for i in 0..MESSAGES_PER_PUBLISHER {
                    let size = 20 + (i * 7919) % 300;
                    let mut payload = format!("p{p}:{i}:").into_bytes();
                    payload.resize(size, b'x');
                    publisher.publish(&payload).expect("publish");
                }
                let client_id = publisher.client_id();
                let stats = publisher.close().expect("every message acknowledged");
                assert_eq!(stats.messages as usize, MESSAGES_PER_PUBLISHER);
                client_id
            })
        })
        .collect();
    let client_ids: Vec<u64> = publishers.into_iter().map(|h| h.join().unwrap()).collect();
    let results: Vec<Vec<Message>> = subscribers.into_iter().map(|h| h.join().unwrap()).collect();

    for got in &results {
        assert_eq!(got.len(), total);
        // Exactly once: every (publisher, counter) pair appears once.
        let unique: HashSet<(u64, u64)> = got.iter().map(|m| (m.client_id, m.counter)).collect();
        assert_eq!(unique.len(), total, "duplicates or losses");
        for m in got {
            assert!(client_ids.contains(&m.client_id));
            let text = String::from_utf8_lossy(&m.payload);
            let counter: u64 = text.split(':').nth(1).unwrap().parse().unwrap();
            assert_eq!(counter, m.counter, "payload belongs to its header");
        }
        if order >= 2 {
            let positions: Vec<u64> = got.iter().map(|m| m.position).collect();
            assert_eq!(positions, (0..total as u64).collect::<Vec<_>>());
        } else {
            let mut per_broker: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
            for m in got {
                per_broker.entry(m.broker_id).or_default().push(m.position);
            }
            for (broker, positions) in &per_broker {
                assert_eq!(
                    positions,
                    &(0..positions.len() as u64).collect::<Vec<_>>(),
                    "broker {broker} positions contiguous from 0"
                );
            }
        }
        // Each connection numbers its batches 0, 1, 2, ...; a client has two
        // connections per broker, so per (client, broker) the batch sequence numbers
        // must be an interleaving of two runs 0, 1, 2, ...: each new batch continues
        // one of them.
        let mut next: BTreeMap<(u64, u16), Vec<u64>> = BTreeMap::new();
        for m in got.iter().filter(|m| m.index_in_batch == 0) {
            let runs = next.entry((m.client_id, m.broker_id)).or_insert(vec![0, 0]);
            let run = runs.iter().position(|&n| n == m.batch_seq).unwrap_or_else(|| {
                panic!(
                    "connection order broken on broker {}: batch {} when the connections expected {:?}",
                    m.broker_id, m.batch_seq, runs
                )
            });
            runs[run] += 1;
        }
    }
    if order >= 2 {
        let first: Vec<(u64, u64, u64)> = results[0]
            .iter()
            .map(|m| (m.position, m.client_id, m.counter))
            .collect();
        for other in &results[1..] {
            let seq: Vec<(u64, u64, u64)> = other
                .iter()
                .map(|m| (m.position, m.client_id, m.counter))
                .collect();
            assert_eq!(seq, first, "subscribers disagree on the order");
        }
    }
}

#[test]
fn order_0_delivers_everything_exactly_once() {
    run(0);
}

#[test]
fn order_1_keeps_fifo_per_broker() {
    run(1);
}

#[test]
fn order_2_gives_every_subscriber_the_same_total_order() {
    run(2);
}
