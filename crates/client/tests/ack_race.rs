//! A fake broker (test double) that acknowledges each batch as soon as its header
//! arrives, before the client has finished writing the payload: the acknowledgement
//! always overtakes the sender. `flush` must still see every batch acknowledged.

use embarcadero_client::{Publisher, PublisherConfig};
use embarcadero_wire::{
    Ack, BatchHeader, FrameHeader, FrameKind, Hello, HelloOk, BATCH_HEADER_LEN, HELLO_LEN,
    HELLO_OK_LEN,
};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

fn fake_broker() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut raw = [0u8; HELLO_LEN];
        s.read_exact(&mut raw).unwrap();
        let hello = Hello::decode(&raw).unwrap();
        let mut frame = FrameHeader {
            kind: FrameKind::HelloOk,
            flags: 0,
            body_len: HELLO_OK_LEN as u32,
            arg: 0,
        }
        .encode()
        .to_vec();
        frame.extend_from_slice(
            &HelloOk {
                order: 2,
                ack_level: hello.ack_level,
                num_brokers: 1,
                max_message_bytes: 1 << 20,
                max_batch_bytes: 32 << 20,
                ..Default::default()
            }
            .encode(),
        );
        s.write_all(&frame).unwrap();
        let mut count = 0;
        loop {
            let mut raw = [0u8; BATCH_HEADER_LEN];
            if s.read_exact(&mut raw).is_err() {
                return;
            }
            let h = BatchHeader::decode(&raw).unwrap();
            count += 1;
            // Acknowledge before reading the payload the client is still writing.
            s.write_all(&Ack { level: 1, count }.encode()).unwrap();
            // The batch is larger than the socket buffers, so the client is still
            // blocked writing it while this ack reaches its reader.
            std::thread::sleep(Duration::from_millis(50));
            let mut payload = vec![0u8; h.total_size as usize];
            if s.read_exact(&mut payload).is_err() {
                return;
            }
        }
    });
    addr
}

#[test]
fn an_ack_that_overtakes_the_sender_is_not_lost() {
    let broker = fake_broker();
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
