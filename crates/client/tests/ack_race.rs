//! A fake broker (test double) that acknowledges each batch as soon as its header
//! arrives, before the client has finished writing the payload: the acknowledgement
//! always overtakes the sender. `flush` must still see every batch acknowledged.

mod common;

use common::{fake_broker, AckWhen};
use embarcadero_client::{Publisher, PublisherConfig};
use std::time::Duration;

#[test]
fn an_ack_that_overtakes_the_sender_is_not_lost() {
    let broker = fake_broker(AckWhen::BeforePayload);
    let p = Publisher::connect_brokers(
        &[broker],
        "t",
        PublisherConfig {
            batch_bytes: 16 << 20,
            flush_timeout: Duration::from_secs(10),
            ..PublisherConfig::default()
        },
    )
    .unwrap();
    let payload = vec![1u8; 1 << 20];
    for _ in 0..3 {
        for _ in 0..16 {
            p.publish(&payload).unwrap();
        }
        p.flush().expect("every batch acknowledged");
    }
    let stats = p.close().unwrap();
    assert_eq!(stats.acked_batches, stats.batches);
}
