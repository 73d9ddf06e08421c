//! A fake broker (test double) that speaks just enough of the protocol for publisher
//! tests: the hello handshake, then an acknowledgement per batch, when the test says.

#![allow(dead_code)]

use embarcadero_wire::{Ack, BatchHeader, Hello, HelloOk, BATCH_HEADER_LEN, HELLO_LEN};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// When the fake broker acknowledges a batch.
pub enum AckWhen {
    /// As soon as the header arrives, while the client may still be writing the
    /// payload; it then waits 50 ms before reading the payload, so a batch larger than
    /// the socket buffers keeps the client's sender blocked while the ack arrives.
    BeforePayload,
    /// After the payload, once the test sends a release for that batch.
    Released(mpsc::Receiver<()>),
    /// After the payload, at once, reporting each batch's `batch_id` in arrival order.
    Recorded(mpsc::Sender<u64>),
}

/// Starts a fake broker for one publish connection; returns its address.
pub fn fake_broker(when: AckWhen) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        answer_hello(&mut s, 32 << 20).unwrap();
        let mut count = 0;
        loop {
            let mut raw = [0u8; BATCH_HEADER_LEN];
            if s.read_exact(&mut raw).is_err() {
                return;
            }
            let h = BatchHeader::decode(&raw).unwrap();
            count += 1;
            let mut payload = vec![0u8; h.total_size as usize];
            match &when {
                AckWhen::BeforePayload => {
                    s.write_all(&Ack { level: 1, count }.encode()).unwrap();
                    std::thread::sleep(Duration::from_millis(50));
                    if s.read_exact(&mut payload).is_err() {
                        return;
                    }
                }
                AckWhen::Recorded(arrivals) => {
                    if s.read_exact(&mut payload).is_err() || arrivals.send(h.batch_id).is_err() {
                        return;
                    }
                    if s.write_all(&Ack { level: 1, count }.encode()).is_err() {
                        return;
                    }
                }
                AckWhen::Released(release) => {
                    if s.read_exact(&mut payload).is_err() || release.recv().is_err() {
                        return;
                    }
                    if s.write_all(&Ack { level: 1, count }.encode()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    addr
}

/// The broker side of the hello handshake, as an order-2 broker with one broker and
/// batches of up to `max_batch_bytes`: reads the client's hello and answers HelloOk.
pub fn answer_hello(s: &mut TcpStream, max_batch_bytes: u32) -> std::io::Result<Hello> {
    let hello = read_hello(s)?;
    s.write_all(&hello_ok(&hello, 2, max_batch_bytes).encode_frame())?;
    Ok(hello)
}

/// Reads a client's hello.
pub fn read_hello(s: &mut TcpStream) -> std::io::Result<Hello> {
    let mut raw = [0u8; HELLO_LEN];
    s.read_exact(&mut raw)?;
    Ok(Hello::decode(&raw).expect("a valid hello"))
}

/// The HelloOk a one-broker topic of `order` answers `hello` with.
pub fn hello_ok(hello: &Hello, order: u8, max_batch_bytes: u32) -> HelloOk {
    HelloOk {
        order,
        ack_level: hello.ack_level,
        num_brokers: 1,
        max_message_bytes: 1 << 20,
        max_batch_bytes,
        ..Default::default()
    }
}

/// Polls `cond` until it holds; fails the test after 10 s.
pub fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}
