mod common;

use embarcadero_client::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use std::time::Duration;

#[test]
fn publish_then_subscribe_order_2() {
    let t = common::start();
    t.create_topic("smoke", 2);
    let p = Publisher::connect(&t.control(), "smoke", PublisherConfig::default()).unwrap();
    for i in 0..10_000u32 {
        p.publish(format!("m{i}").as_bytes()).unwrap();
    }
    let stats = p.close().unwrap();
    assert_eq!(stats.messages, 10_000);
    let mut s = Subscriber::connect(&t.control(), "smoke", SubscriberConfig::default()).unwrap();
    let mut n = 0u64;
    while n < 10_000 {
        let m = s.poll(Duration::from_secs(10)).unwrap().expect("message");
        assert_eq!(m.position, n);
        n += 1;
    }
}
