//! Bad input gets a clear error frame and a closed connection, and nothing else is
//! disturbed: a well-behaved publisher connected to the same broker before the bad
//! client keeps publishing, and every one of its messages is delivered in order.

mod common;

use embarcadero_client::{
    Admin, Error, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec,
};
use embarcadero_wire::{
    message_stride, BatchHeader, BlogMessageHeader, ErrorCode, ErrorFrame, FrameKind, Hello,
    HelloOk, Role, PROTOCOL_VERSION,
};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const CLIENT: u64 = 77;

fn hello(topic: &str, role: Role, ack: u8) -> Hello {
    Hello {
        role,
        ack_level: ack,
        client_id: CLIENT,
        session_epoch: 0,
        start_position: 0,
        connection_index: 0,
        cursor_count: 0,
        topic: topic.into(),
        session_key: [0; 16],
        flags: 0,
        opener: 0,
    }
}

/// Reads frames until an error frame; returns it, after checking the broker closed.
fn expect_error(stream: &mut TcpStream) -> ErrorFrame {
    loop {
        let (h, body) = common::next_frame(stream);
        if h.kind == FrameKind::Error {
            let e = ErrorFrame::decode(&h, &body).unwrap();
            let mut rest = Vec::new();
            let n = stream.read_to_end(&mut rest).unwrap_or(0);
            assert_eq!(n, 0, "the broker closes after an error");
            return e;
        }
    }
}

fn connect(t: &common::TestServer, broker: usize, h: &Hello) -> (TcpStream, HelloOk) {
    let mut s = TcpStream::connect(&t.brokers()[broker]).unwrap();
    s.write_all(&h.encode()).unwrap();
    let (fh, body) = common::next_frame(&mut s);
    assert_eq!(
        fh.kind,
        FrameKind::HelloOk,
        "{:?}",
        ErrorFrame::decode(&fh, &body)
    );
    (s, HelloOk::decode(&body).unwrap())
}

/// A batch with messages of the given sizes, as a client would send it.
fn batch(seq: u64, sizes: &[u32]) -> (BatchHeader, Vec<u8>) {
    let mut payload = Vec::new();
    for &size in sizes {
        let at = payload.len();
        payload.resize(at + message_stride(size as u64) as usize, b'z');
        BlogMessageHeader {
            size,
            client_id: CLIENT,
            ..Default::default()
        }
        .encode_into(&mut payload[at..]);
    }
    let h = BatchHeader {
        batch_seq: seq,
        client_id: CLIENT,
        num_msg: sizes.len() as u32,
        total_size: payload.len() as u64,
        ..Default::default()
    };
    (h, payload)
}

/// A publisher that keeps working while the bad client misbehaves on broker 0.
struct Bystander {
    publisher: Publisher,
    sent: u64,
}

impl Bystander {
    fn start(t: &common::TestServer) -> Self {
        let publisher = Publisher::connect_brokers(
            &t.brokers(),
            "t",
            PublisherConfig {
                batch_bytes: 4096,
                ..PublisherConfig::default()
            },
        )
        .unwrap();
        let mut b = Self { publisher, sent: 0 };
        b.publish(500);
        b
    }

    fn publish(&mut self, n: u64) {
        for _ in 0..n {
            self.publisher
                .publish(format!("good-{}", self.sent).as_bytes())
                .unwrap();
            self.sent += 1;
        }
        self.publisher
            .flush()
            .expect("bystander still acknowledged");
    }

    /// Publishes more, then checks that the topic holds exactly the bystander's messages.
    fn finish(mut self, t: &common::TestServer) {
        self.publish(500);
        let total = self.sent;
        self.publisher.close().unwrap();
        let mut s =
            Subscriber::connect_brokers(&t.brokers(), "t", SubscriberConfig::default()).unwrap();
        for i in 0..total {
            let m = s.poll(Duration::from_secs(10)).unwrap().expect("message");
            assert_eq!(m.position, i);
            assert_eq!(m.payload, format!("good-{}", m.counter).as_bytes());
        }
        assert!(
            s.poll(Duration::from_millis(300)).unwrap().is_none(),
            "nothing extra visible"
        );
    }
}

fn server() -> common::TestServer {
    let t = common::start();
    t.create_topic("t", 2);
    t
}

#[test]
fn wrong_magic_and_version_are_refused() {
    let t = server();
    let by = Bystander::start(&t);
    let mut raw = hello("t", Role::Publish, 1).encode();
    raw[0] = b'X';
    let mut s = TcpStream::connect(&t.brokers()[0]).unwrap();
    s.write_all(&raw).unwrap();
    assert_eq!(expect_error(&mut s).code, ErrorCode::BadMagic);

    let mut raw = hello("t", Role::Publish, 1).encode();
    raw[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    let mut s = TcpStream::connect(&t.brokers()[0]).unwrap();
    s.write_all(&raw).unwrap();
    let e = expect_error(&mut s);
    assert_eq!(e.code, ErrorCode::UnsupportedVersion);
    assert!(e.message.contains("version"), "{}", e.message);
    by.finish(&t);
}

/// An HTTP request on a data port (`curl`, `--control` given a broker's address) is
/// answered at once with what to use instead, in the admin API's error shape, rather
/// than after the hello timeout; others carry on.
#[test]
fn an_http_request_on_a_data_port_is_told_it_is_not_the_admin_api() {
    let t = server();
    let by = Bystander::start(&t);
    let mut s = TcpStream::connect(&t.brokers()[1]).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    s.write_all(b"GET /v1/status HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    let body: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("broker 1's data port, not the admin API"),
        "{error}"
    );
    by.finish(&t);
}

#[test]
fn unknown_topic_invalid_name_and_ack_2_without_replicas_are_refused() {
    let t = server();
    let by = Bystander::start(&t);
    let mut s = TcpStream::connect(&t.brokers()[1]).unwrap();
    s.write_all(&hello("nope", Role::Publish, 1).encode())
        .unwrap();
    let e = expect_error(&mut s);
    assert_eq!(e.code, ErrorCode::UnknownTopic);
    assert!(
        e.message.contains("topic create"),
        "says what to do: {}",
        e.message
    );

    let mut raw = hello("t", Role::Publish, 1).encode();
    raw[41] = b'/';
    let mut s = TcpStream::connect(&t.brokers()[1]).unwrap();
    s.write_all(&raw).unwrap();
    assert_eq!(expect_error(&mut s).code, ErrorCode::InvalidTopicName);

    let mut s = TcpStream::connect(&t.brokers()[1]).unwrap();
    s.write_all(&hello("t", Role::Publish, 2).encode()).unwrap();
    assert_eq!(expect_error(&mut s).code, ErrorCode::AckNotAllowed);

    // The client library reports the same refusal as a typed error.
    let e = Publisher::connect_brokers(
        &t.brokers(),
        "t",
        PublisherConfig {
            ack_level: 2,
            ..PublisherConfig::default()
        },
    )
    .err()
    .expect("ack 2 refused");
    assert_eq!(e.code(), Some(ErrorCode::AckNotAllowed));
    by.finish(&t);
}

#[test]
fn malformed_batches_are_refused() {
    let t = server();
    let by = Bystander::start(&t);
    type Case = (&'static str, Box<dyn Fn() -> Vec<u8>>, ErrorCode);
    let cases: Vec<Case> = vec![
        (
            "sizes disagree",
            Box::new(|| {
                let (mut h, p) = batch(0, &[10, 20]);
                h.total_size += 64;
                [h.encode().to_vec(), p, vec![0; 64]].concat()
            }),
            ErrorCode::MalformedBatch,
        ),
        (
            "zero messages",
            Box::new(|| {
                let (mut h, p) = batch(0, &[10]);
                h.num_msg = 0;
                [h.encode().to_vec(), p].concat()
            }),
            ErrorCode::MalformedBatch,
        ),
        (
            "too many messages for the size",
            Box::new(|| {
                let (mut h, p) = batch(0, &[10]);
                h.num_msg = 1000;
                [h.encode().to_vec(), p].concat()
            }),
            ErrorCode::MalformedBatch,
        ),
        (
            "message over the maximum",
            Box::new(|| {
                let (h, p) = batch(0, &[(1 << 20) + 1]);
                [h.encode().to_vec(), p].concat()
            }),
            ErrorCode::MessageTooLarge,
        ),
        (
            "batch over the maximum",
            Box::new(|| {
                let (mut h, _) = batch(0, &[10]);
                h.total_size = 64 << 20;
                h.encode().to_vec()
            }),
            ErrorCode::BatchTooLarge,
        ),
        (
            "foreign client id",
            Box::new(|| {
                let (mut h, p) = batch(0, &[10]);
                h.client_id = 5;
                [h.encode().to_vec(), p].concat()
            }),
            ErrorCode::MalformedBatch,
        ),
        (
            "out of sequence",
            Box::new(|| {
                let (h, p) = batch(7, &[10]);
                [h.encode().to_vec(), p].concat()
            }),
            ErrorCode::OutOfSequence,
        ),
    ];
    for (what, bytes, code) in cases {
        let (mut s, _) = connect(&t, 0, &hello("t", Role::Publish, 1));
        s.write_all(&bytes()).unwrap();
        let e = expect_error(&mut s);
        assert_eq!(e.code, code, "{what}: {}", e.message);
    }
    by.finish(&t);
}

#[test]
fn a_batch_cut_off_mid_payload_never_becomes_visible() {
    let t = server();
    let by = Bystander::start(&t);
    for broker in 0..4 {
        let (mut s, _) = connect(&t, broker, &hello("t", Role::Publish, 1));
        let (h, p) = batch(0, &[100, 100, 100]);
        s.write_all(&h.encode()).unwrap();
        s.write_all(&p[..p.len() / 2]).unwrap();
        drop(s);
    }
    by.finish(&t);
}

#[test]
fn invalid_topics_are_refused_by_the_admin_api() {
    let t = server();
    let admin = Admin::new(&t.control());
    for (spec, status) in [
        (TopicSpec::new("t", 2), 409),
        (TopicSpec::new("x", 3), 400),
        (
            TopicSpec {
                default_ack: 2,
                ..TopicSpec::new("y", 2)
            },
            400,
        ),
    ] {
        match admin.create_topic(&spec) {
            Err(Error::Admin {
                status: got,
                message,
            }) => {
                assert_eq!(got, status, "{spec:?}: {message}")
            }
            other => panic!("{spec:?} accepted: {other:?}"),
        }
    }
    match admin.describe_topic("missing") {
        Err(Error::Admin { status: 404, .. }) => {}
        other => panic!("{other:?}"),
    }
    // The client refuses a bad name before any request; the server refuses it too.
    match admin.create_topic(&TopicSpec::new("bad name", 2)) {
        Err(Error::InvalidName(message)) => assert!(message.contains("1 to 63"), "{message}"),
        other => panic!("{other:?}"),
    }
    let (status, body) = post_json(
        &t.control(),
        "/v1/topics",
        r#"{"name": "bad name", "order": 2}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid topic name"), "{body}");
}

/// A field the API does not know is refused and named, not dropped: `"replication": 2`
/// silently ignored would create a memory-only topic the caller meant to replicate.
#[test]
fn unknown_fields_of_a_topic_creation_are_refused_and_named() {
    let t = server();
    let (status, body) = post_json(
        &t.control(),
        "/v1/topics",
        r#"{"name": "meant-replicated", "order": 2, "replication": 2}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("unknown field `replication`"), "{body}");
    assert!(
        matches!(
            t.admin().describe_topic("meant-replicated"),
            Err(Error::Admin { status: 404, .. })
        ),
        "the topic was not created"
    );
}

/// The same holds for every endpoint that takes a body (docs/API.md): a misspelt field
/// of a cluster or failover call is named, and nothing is done.
#[test]
fn unknown_fields_of_every_admin_call_are_refused_and_named() {
    let t = server();
    for (path, body) in [
        (
            "/v1/cluster/claim",
            r#"{"id": 1, "incarnation": 7, "incarnaton": 8}"#,
        ),
        (
            "/v1/cluster/join",
            r#"{"id": 1, "incarnation": 7, "adress": "127.0.0.1:1"}"#,
        ),
        (
            "/v1/cluster/heartbeat",
            r#"{"id": 1, "incarnation": 7, "state": "ok"}"#,
        ),
        (
            "/v1/failover",
            r#"{"topic": "t", "broker": 1, "client_id": 7, "batch_ids": [], "ack": 2}"#,
        ),
    ] {
        let (status, answer) = post_json(&t.control(), path, body);
        assert_eq!(status, 400, "{path}: {answer}");
        assert!(answer.contains("unknown field"), "{path}: {answer}");
    }
}

/// A path of the API asked with a method it does not take is a 405 that lists the ones
/// it takes (in `Allow` too); a path the API does not have stays a 404.
#[test]
fn a_method_a_path_does_not_take_is_a_405_that_names_the_ones_it_does() {
    let t = server();
    for (method, path, allowed) in [
        ("PUT", "/v1/topics/t", "GET, DELETE"),
        ("DELETE", "/v1/topics", "GET, POST"),
        ("GET", "/v1/cluster/join", "POST"),
        ("POST", "/v1/status", "GET"),
    ] {
        let (status, head, body) = http_call(&t.control(), method, path, "{}");
        assert_eq!(status, 405, "{method} {path}: {body}");
        assert!(
            head.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{head}"
        );
        assert!(head.contains(&format!("Allow: {allowed}\r\n")), "{head}");
        assert!(body.contains(&format!("it takes {allowed}")), "{body}");
    }
    let (status, _, body) = http_call(&t.control(), "PUT", "/v1/nothing", "{}");
    assert_eq!(status, 404, "{body}");
    // HEAD goes wherever GET does: never a 405 there.
    let (status, _, body) = http_call(&t.control(), "HEAD", "/v1/cluster", "");
    assert_ne!(status, 405, "{body}");
}

/// One admin API request as any HTTP client sends it; returns the status and body.
fn post_json(control: &str, path: &str, body: &str) -> (u16, String) {
    let (status, _, body) = http_call(control, "POST", path, body);
    (status, body)
}

/// One request with a JSON body; returns the status, the head and the body.
fn http_call(control: &str, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(control).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {response:?}"));
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (status, format!("{head}\r\n"), body.to_string())
}

#[test]
fn a_client_that_sends_garbage_instead_of_a_hello_is_dropped() {
    let t = server();
    let by = Bystander::start(&t);
    let mut s = TcpStream::connect(&t.brokers()[2]).unwrap();
    s.write_all(&[0xffu8; 128]).unwrap();
    assert_eq!(expect_error(&mut s).code, ErrorCode::BadMagic);
    // A client that connects and says nothing does not block the broker either.
    let _silent = TcpStream::connect(&t.brokers()[2]).unwrap();
    by.finish(&t);
}

/// A hello sent a byte at a time, each byte well within a read's timeout, is cut off
/// once the whole hello is late (10 s after the accept): a per-read timeout let an
/// adversarial run hold a connection for 129 s before its hello was whole.
#[test]
fn a_hello_trickled_a_byte_at_a_time_is_cut_off_at_the_hello_timeout() {
    let t = server();
    let by = Bystander::start(&t);
    let mut s = TcpStream::connect(&t.brokers()[1]).unwrap();
    let raw = hello("anything", Role::Publish, 1).encode();
    let mut trickle = s.try_clone().unwrap();
    // At one byte per 200 ms, the whole hello would take about 26 s.
    let trickler = std::thread::spawn(move || {
        let mut sent = 0;
        for byte in &raw {
            if trickle.write_all(std::slice::from_ref(byte)).is_err() {
                break;
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        (sent, raw.len())
    });
    // The broker closes the connection: the read ends without a frame.
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    drop(s);
    let (sent, len) = trickler.join().unwrap();
    assert!(sent < len, "cut off after {sent} of {len} bytes");
    by.finish(&t);
}

/// A client that sends a batch's header and then its payload a byte at a time, never
/// waiting long enough between two bytes for a per-read timeout, is cut off once the
/// whole payload is late: its reserved place in the log would otherwise hold up every
/// later batch of the log for as long as it keeps trickling.
#[test]
fn a_payload_trickled_a_byte_at_a_time_is_cut_off_at_the_payload_timeout() {
    let t = common::start_with(|c| c.broker.payload_timeout_ms = 1000);
    t.create_topic("t", 2);
    let by = Bystander::start(&t);
    let (mut s, _) = connect(&t, 0, &hello("t", Role::Publish, 1));
    let (h, payload) = batch(0, &[100, 100, 100]);
    s.write_all(&h.encode()).unwrap();
    let mut trickle = s.try_clone().unwrap();
    // At one byte per 100 ms, the whole payload would take about a minute.
    let trickler = std::thread::spawn(move || {
        let mut sent = 0;
        for byte in &payload {
            if trickle.write_all(std::slice::from_ref(byte)).is_err() {
                break;
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        (sent, payload.len())
    });
    let e = expect_error(&mut s);
    assert_eq!(e.code, ErrorCode::SlowPayload, "{}", e.message);
    drop(s);
    let (sent, len) = trickler.join().unwrap();
    assert!(sent < len, "cut off after {sent} of {len} bytes");
    by.finish(&t);
}

/// Issue 28: a client that sends a batch header and then trickles its payload must not
/// hold back anyone else. Nothing is reserved in the log until the whole payload is in
/// the broker's socket, so while it dawdles (the payload timeout is two minutes here,
/// longer than the bystander's flush waits) the other publishers of its broker are
/// acknowledged and their messages delivered; and once its payload is whole, it is
/// acknowledged too.
#[test]
fn a_trickling_client_holds_back_no_other_publisher_of_its_broker() {
    let t = common::start_with(|c| c.broker.payload_timeout_ms = 120_000);
    t.create_topic("t", 2);
    let (mut slow, _) = connect(&t, 0, &hello("t", Role::Publish, 1));
    let (h, payload) = batch(0, &[100, 100, 100]);
    slow.write_all(&h.encode()).unwrap();
    slow.write_all(&payload[..1]).unwrap();
    let by = Bystander::start(&t);
    by.finish(&t);
    slow.write_all(&payload[1..]).unwrap();
    let (ack, _) = common::next_frame(&mut slow);
    assert_eq!(
        (ack.kind, ack.arg),
        (FrameKind::Ack, 1),
        "the slow client is served too"
    );
}

/// A broker holds a thread per connection, so it takes only `broker.max_connections`
/// at once: one more is told why and closed, the connections it has carry on, and a
/// place that frees up is taken again.
#[test]
fn connections_beyond_the_limit_are_refused_and_the_rest_carry_on() {
    let t = common::start_with(|c| c.broker.max_connections = 3);
    t.create_topic("t", 2);
    // The bystander holds one connection to every broker; two more fill broker 0.
    let mut by = Bystander::start(&t);
    let publish = hello("t", Role::Publish, 1);
    let (first, _) = connect(&t, 0, &publish);
    let (second, _) = connect(&t, 0, &publish);
    let mut extra = TcpStream::connect(&t.brokers()[0]).unwrap();
    extra.write_all(&publish.encode()).unwrap();
    let e = expect_error(&mut extra);
    assert_eq!(e.code, ErrorCode::TooManyConnections);
    assert!(
        e.message.contains("broker.max_connections"),
        "{}",
        e.message
    );
    assert_eq!(t.metric_sum("embarcadero_connections_refused_total{"), 1);
    by.publish(500);

    drop(first);
    let open = "embarcadero_connections_open{broker=\"0\"}";
    t.wait_for_metric_at_most(open, 2, "the closed connection was never released");
    let (again, ok) = connect(&t, 0, &publish);
    assert_eq!(ok.ack_level, 1);
    // Room again for the subscriber that checks the bystander's messages.
    drop((second, again));
    t.wait_for_metric_at_most(open, 1, "closed connections never released");
    by.finish(&t);
}
