//! Who seals a batch when its linger runs out: normally the sender of the queue it is
//! due on, which then writes it itself; a backstop thread when that sender is busy.

mod common;

use common::{fake_broker, wait_for, AckWhen};
use embarcadero_client::{Publisher, PublisherConfig};
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn a_lingering_batch_is_sealed_and_written_by_the_sender_of_its_queue() {
    sealed_by_the_sender_of_its_queue(Duration::from_millis(1));
}

#[test]
fn with_no_linger_the_idle_sender_seals_a_batch_at_once() {
    sealed_by_the_sender_of_its_queue(Duration::ZERO);
}

fn sealed_by_the_sender_of_its_queue(linger: Duration) {
    let (release_a, a_rx) = mpsc::channel();
    let (release_b, b_rx) = mpsc::channel();
    for _ in 0..2 {
        release_a.send(()).unwrap();
        release_b.send(()).unwrap();
    }
    let brokers = [
        fake_broker(AckWhen::Released(a_rx)),
        fake_broker(AckWhen::Released(b_rx)),
    ];
    let p = Publisher::connect_brokers(
        &brokers,
        "t",
        PublisherConfig {
            linger,
            // Only a sender can seal within the test's time.
            linger_backstop: Duration::from_secs(3600),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    // No flush: nothing but the linger seals these. Round-robin: queue 0, then 1.
    for (n, queue) in [(1, 0), (2, 1)] {
        p.publish(b"lone message").unwrap();
        wait_for("the batch acknowledged", || p.stats().acked_batches == n);
        let stats = p.stats();
        assert_eq!(p.batches_sealed(), n);
        assert_eq!(
            stats.queues[queue].lingered, 1,
            "sealed by queue {queue}'s sender"
        );
        assert_eq!(stats.queues[queue].batches, 1);
    }
    p.close().unwrap();
}

#[test]
fn a_batch_whose_sender_waits_for_acknowledgements_is_sealed_on_time_by_the_backstop() {
    let (release, held) = mpsc::channel();
    let brokers = [fake_broker(AckWhen::Released(held))];
    let p = Publisher::connect_brokers(
        &brokers,
        "t",
        PublisherConfig {
            linger: Duration::from_millis(1),
            // Not this late: the waiting sender arms the backstop for the linger itself.
            linger_backstop: Duration::from_secs(3600),
            max_inflight_batches: 1,
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    p.publish(b"first").unwrap();
    wait_for("the first batch lingered out by the sender", || {
        p.stats().queues[0].lingered == 1
    });
    // Its acknowledgement is held, so the sender waits at the in-flight limit.
    p.publish(b"second").unwrap();
    wait_for("the second batch sealed by the backstop", || {
        p.batches_sealed() == 2
    });
    assert_eq!(p.stats().queues[0].lingered, 1, "not by the waiting sender");
    for _ in 0..2 {
        release.send(()).unwrap();
    }
    p.flush().unwrap();
    let stats = p.close().unwrap();
    assert_eq!(stats.acked_batches, 2);
}

#[test]
fn a_connection_receives_its_batches_in_the_order_they_were_sealed() {
    let (arrivals, arrived) = mpsc::channel();
    let brokers = [fake_broker(AckWhen::Recorded(arrivals))];
    let p = Publisher::connect_brokers(
        &brokers,
        "t",
        PublisherConfig {
            // Batches sealed by size (by the producer, through the queue) and by linger
            // (by the sender itself) interleave on the one connection.
            batch_bytes: 4096,
            linger: Duration::from_micros(20),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let payload = [7u8; 100];
    for i in 0..20_000 {
        p.publish(&payload).unwrap();
        if i % 97 == 0 {
            // A pause lets the linger, not the size, end some batches.
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    p.flush().unwrap();
    let stats = p.close().unwrap();
    let ids: Vec<u64> = arrived.try_iter().collect();
    assert_eq!(ids.len() as u64, stats.batches);
    assert!(stats.queues[0].lingered > 0, "some batches lingered out");
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "batch ids arrive in the order they were sealed"
    );
}

#[test]
fn publish_all_puts_messages_that_belong_together_in_one_batch() {
    let (arrivals, arrived) = mpsc::channel();
    let brokers = [fake_broker(AckWhen::Recorded(arrivals))];
    let p = Publisher::connect_brokers(
        &brokers,
        "t",
        PublisherConfig {
            // No linger: an idle sender seals a batch as soon as it can take the builder,
            // so single appends in a row may each get a batch of their own.
            linger: Duration::ZERO,
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    for round in 1..=50u64 {
        p.publish_all(&[b"result", b"claim one", b"claim two"])
            .unwrap();
        wait_for("the batch acknowledged", || {
            p.stats().acked_batches == round
        });
        assert_eq!(p.batches_sealed(), round, "three messages, one batch");
    }
    // A payload too large appends none of the others.
    let huge = vec![0u8; p.max_message_bytes() + 1];
    assert!(p.publish_all(&[b"fits", &huge]).is_err());
    p.flush().unwrap();
    let stats = p.close().unwrap();
    assert_eq!(stats.messages, 150);
    assert_eq!(stats.batches, 50);
    assert_eq!(arrived.try_iter().count(), 50, "the broker got 50 batches");
}
