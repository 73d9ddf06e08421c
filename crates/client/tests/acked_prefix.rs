//! The acknowledged prefix: two fake brokers, one acknowledging at once and one
//! holding its acknowledgements; the prefix stops at the oldest batch still waiting
//! while the count of acknowledgements runs ahead of it.

mod common;

use common::{fake_broker, wait_for, AckWhen};
use embarcadero_client::{Publisher, PublisherConfig};
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn the_acked_prefix_stops_at_the_oldest_unacknowledged_batch() {
    let (release_fast, fast_rx) = mpsc::channel();
    let (release_held, held_rx) = mpsc::channel();
    for _ in 0..2 {
        release_fast.send(()).unwrap();
    }
    let brokers = [
        fake_broker(AckWhen::Released(fast_rx)),
        fake_broker(AckWhen::Released(held_rx)),
    ];
    let p = Publisher::connect_brokers(
        &brokers,
        "t",
        PublisherConfig {
            batch_bytes: 4096,
            flush_timeout: Duration::from_secs(10),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    // One message fills a batch: batches 0 and 2 go to the fast broker, 1 and 3 to
    // the held one (round-robin).
    let payload = vec![1u8; 4096];
    for _ in 0..4 {
        p.publish(&payload).unwrap();
    }
    assert_eq!(p.batches_sealed(), 4);
    wait_for("the fast broker's two acknowledgements", || {
        p.stats().acked_batches == 2
    });
    assert_eq!(
        p.acked_prefix(),
        1,
        "batch 1 is held: the prefix stops there"
    );

    release_held.send(()).unwrap();
    wait_for("batch 1 acknowledged", || p.acked_prefix() == 3);
    release_held.send(()).unwrap();
    p.flush().unwrap();
    assert_eq!(p.acked_prefix(), 4);
    let stats = p.close().unwrap();
    assert_eq!(stats.acked_batches, 4);
}
