//! A subscription that asked for "the beginning" may start at the first retained
//! position only while it has delivered nothing (PROTOCOL.md, `flags` bit 0):
//! once anything is delivered, a reconnection must ask for its exact next position, so
//! that a reclaimed range is refused (PositionNotRetained), never skipped in silence.
//! And what it skipped at the start is reported. Against a fake broker that records
//! each hello.

use embarcadero_client::{Subscriber, SubscriberConfig};
use embarcadero_wire::{
    BatchOk, BlogMessageHeader, DeliveryHeader, Hello, HelloOk, DELIVERY_HEADER_LEN, HELLO_LEN,
    MESSAGE_HEADER_LEN, SUBSCRIBE_FROM_FIRST_RETAINED,
};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

/// Reads a subscriber's hello and answers an order-2 HelloOk naming `first_retained`.
fn answer(s: &mut TcpStream, first_retained: u64) -> Hello {
    let mut raw = [0u8; HELLO_LEN];
    s.read_exact(&mut raw).unwrap();
    let hello = Hello::decode(&raw).unwrap();
    let ok = HelloOk {
        order: 2,
        num_brokers: 1,
        max_message_bytes: 1 << 20,
        max_batch_bytes: 1 << 20,
        first_retained,
        ..Default::default()
    };
    s.write_all(&ok.encode_frame()).unwrap();
    hello
}

/// Sends one confirmed delivery of a single 8-byte message at global `position`.
fn deliver(s: &mut TcpStream, position: u64) {
    let mut payload = vec![0u8; 64 + 64];
    BlogMessageHeader {
        size: 8,
        ..Default::default()
    }
    .encode_into(&mut payload[..MESSAGE_HEADER_LEN]);
    let header = DeliveryHeader {
        batch_position: position,
        first_position: position,
        num_msg: 1,
        order: 2,
        payload_len: payload.len() as u32,
        ..Default::default()
    };
    let mut frame = header.frame_header().encode().to_vec();
    frame.extend_from_slice(&header.encode());
    assert_eq!(frame.len(), 16 + DELIVERY_HEADER_LEN);
    frame.extend_from_slice(&payload);
    frame.extend_from_slice(
        &BatchOk {
            count: 1,
            discard_rest: false,
        }
        .encode(),
    );
    s.write_all(&frame).unwrap();
}

/// A fake broker: its first connection names `first_retained` in its HelloOk, delivers
/// one message at `position` and closes; it reports each connection's hello.
fn fake_broker(first_retained: u64, position: u64) -> (String, mpsc::Receiver<Hello>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (mut first, _) = listener.accept().unwrap();
        tx.send(answer(&mut first, first_retained)).unwrap();
        deliver(&mut first, position);
        drop(first);
        // The reconnection: its hello is what the test checks; then hang up.
        let (mut second, _) = listener.accept().unwrap();
        let _ = tx.send(answer(&mut second, first_retained));
    });
    (addr, rx)
}

fn from_the_beginning() -> SubscriberConfig {
    SubscriberConfig {
        max_reconnects: 3,
        ..SubscriberConfig::default()
    }
}

#[test]
fn after_a_poll_with_delivery_a_reconnection_asks_for_its_exact_position() {
    let (addr, hellos) = fake_broker(0, 0);
    let mut s = Subscriber::connect_brokers(&[addr], "t", from_the_beginning()).unwrap();
    let first = hellos.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(
        first.flags, SUBSCRIBE_FROM_FIRST_RETAINED,
        "nothing delivered yet: the first retained position will do"
    );
    let mut positions = Vec::new();
    while positions.is_empty() {
        s.poll_with(Duration::from_secs(10), |m| positions.push(m.position))
            .unwrap();
    }
    assert_eq!(positions, [0]);
    // The broker hung up: the next poll reconnects.
    let _ = s.poll_with(Duration::from_millis(500), |_| {});
    let again = hellos.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(again.start_position, 1);
    assert_eq!(
        again.flags, 0,
        "a subscription that delivered something must hear that its position is gone"
    );
    assert_eq!(s.skipped(), None);
}

#[test]
fn what_a_subscription_from_the_beginning_skipped_is_reported() {
    // The broker says positions below 40 are gone, then delivers 40.
    let (addr, hellos) = fake_broker(40, 40);
    let mut s = Subscriber::connect_brokers(&[addr], "t", from_the_beginning()).unwrap();
    hellos.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(
        s.skipped(),
        Some((0, 40)),
        "known from the HelloOk, before anything is delivered"
    );
    let mut positions = Vec::new();
    while positions.is_empty() {
        s.poll_shared(Duration::from_secs(10), |_, m| positions.push(m.position))
            .unwrap();
    }
    assert_eq!(positions, [40]);
    assert_eq!(s.skipped(), Some((0, 40)));
    let _ = s.poll_shared(Duration::from_millis(500), |_, _| {});
    let again = hellos.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((again.start_position, again.flags), (41, 0));
}
