//! Append-to-ack latency on a schedule is counted per message, from each message's own
//! due time (as the peers' load generators count it), including batches whose
//! acknowledgement overtook the sender. A fake broker (test double) acknowledges.

mod common;

use common::{fake_broker, AckWhen};
use embarcadero_client::{Publisher, PublisherConfig};
use std::time::{Duration, Instant};

#[test]
fn each_scheduled_message_is_timed_from_its_own_due_time() {
    let broker = fake_broker(AckWhen::BeforePayload);
    let p = Publisher::connect_brokers(
        &[broker],
        "t",
        PublisherConfig {
            batch_bytes: 1 << 20,
            flush_timeout: Duration::from_secs(10),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let payload = vec![7u8; 1024];
    let now = Instant::now();
    // One batch: its first message fell due an hour ago, the other nine just now.
    p.publish_due(&payload, now - Duration::from_secs(3600))
        .unwrap();
    for _ in 0..9 {
        p.publish_due(&payload, now).unwrap();
    }
    p.flush().unwrap();
    let stats = p.close().unwrap();
    assert_eq!(stats.batches, 1);
    assert_eq!(
        stats.ack_latency_us.count, 1,
        "seal to ack: one figure per batch"
    );
    let append = &stats.append_to_ack_us;
    assert_eq!(append.count, 10, "append to ack: one figure per message");
    assert!(
        append.max >= 3_600_000_000,
        "the late message keeps its lateness"
    );
    assert!(
        append.p50 < 3_600_000_000,
        "the other nine are not charged with the first one's wait: {append:?}"
    );
}
