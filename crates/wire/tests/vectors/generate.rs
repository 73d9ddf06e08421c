//! Deterministic generator of `testdata/wire/*.json`.
//!
//! Run: `cargo test -p embarcadero-wire --test vectors -- --ignored regenerate_vectors`.
//! It (re)writes only the files it knows and never deletes any. The committed files
//! are the source of truth: review the diff before committing regenerated vectors,
//! since a changed byte there is a protocol change for every client library.

use super::{vector_dir, DEFAULT_MAX_BATCH, DEFAULT_MAX_MESSAGE};
use embarcadero_wire::{
    message_stride, BatchFlags, BatchHeader, BatchOk, BlogMessageHeader, DeliveryHeader, ErrorCode,
    ErrorFrame, FrameHeader, FrameKind, Hello, HelloOk, Role, BATCH_HEADER_LEN, HELLO_FLAGS_OFFSET,
    HELLO_OK_LEN, PROTOCOL_MAGIC, PROTOCOL_VERSION, PUBLISH_OPENS_EPOCH,
    SUBSCRIBE_FROM_FIRST_RETAINED,
};

/// A JSON value whose objects keep the order their keys were written in.
enum J {
    N(u64),
    S(String),
    A(Vec<J>),
    O(Vec<(&'static str, J)>),
}

fn n(v: impl Into<u64>) -> J {
    J::N(v.into())
}

fn s(v: impl Into<String>) -> J {
    J::S(v.into())
}

fn hx(b: &[u8]) -> J {
    J::S(hex::encode(b))
}

fn write(j: &J, indent: usize, out: &mut String) {
    match j {
        J::N(v) => out.push_str(&v.to_string()),
        J::S(v) => out.push_str(&serde_json::to_string(v).expect("string")),
        J::A(items) if items.iter().all(|i| matches!(i, J::N(_) | J::S(_))) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write(item, indent, out);
            }
            out.push(']');
        }
        J::A(items) => {
            out.push_str("[\n");
            for (i, item) in items.iter().enumerate() {
                out.push_str(&" ".repeat(indent + 2));
                write(item, indent + 2, out);
                out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
            }
            out.push_str(&" ".repeat(indent));
            out.push(']');
        }
        J::O(pairs) => {
            out.push_str("{\n");
            for (i, (k, v)) in pairs.iter().enumerate() {
                out.push_str(&" ".repeat(indent + 2));
                out.push_str(&serde_json::to_string(k).expect("key"));
                out.push_str(": ");
                write(v, indent + 2, out);
                out.push_str(if i + 1 < pairs.len() { ",\n" } else { "\n" });
            }
            out.push_str(&" ".repeat(indent));
            out.push('}');
        }
    }
}

// ---------------------------------------------------------------------------------
// Structures to JSON, field by field, in byte order.
// ---------------------------------------------------------------------------------

fn frame_header_j(h: &FrameHeader) -> J {
    J::O(vec![
        ("kind", n(h.kind as u8)),
        ("flags", n(h.flags)),
        ("body_len", n(h.body_len)),
        ("arg", n(h.arg)),
    ])
}

fn hello_j(h: &Hello, cursors: &[u64]) -> J {
    J::O(vec![
        ("magic", s(std::str::from_utf8(&PROTOCOL_MAGIC).unwrap())),
        ("version", n(PROTOCOL_VERSION)),
        ("role", n(h.role as u8)),
        ("ack_level", n(h.ack_level)),
        ("client_id", n(h.client_id)),
        ("session_epoch", n(h.session_epoch)),
        ("start_position", n(h.start_position)),
        ("connection_index", n(h.connection_index)),
        ("cursor_count", n(h.cursor_count)),
        ("topic_len", n(h.topic.len() as u64)),
        ("topic", s(h.topic.clone())),
        ("cursors", J::A(cursors.iter().map(|&c| n(c)).collect())),
        (
            "session_key_lo",
            n(u64::from_le_bytes(h.session_key[..8].try_into().unwrap())),
        ),
        (
            "session_key_hi",
            n(u64::from_le_bytes(h.session_key[8..].try_into().unwrap())),
        ),
        ("flags", n(h.flags)),
        ("opener", n(h.opener)),
    ])
}

fn hello_ok_j(b: &HelloOk) -> J {
    J::O(vec![
        ("version", n(PROTOCOL_VERSION)),
        ("broker_id", n(b.broker_id)),
        ("num_brokers", n(b.num_brokers)),
        ("order", n(b.order)),
        ("ack_level", n(b.ack_level)),
        ("replication_factor", n(b.replication_factor)),
        ("topic_id", n(b.topic_id)),
        ("max_message_bytes", n(b.max_message_bytes)),
        ("max_batch_bytes", n(b.max_batch_bytes)),
        ("next_batch_seq", n(b.next_batch_seq)),
        ("first_retained", n(b.first_retained)),
    ])
}

fn batch_header_j(h: &BatchHeader) -> J {
    J::O(vec![
        ("batch_seq", n(h.batch_seq)),
        ("client_id", n(h.client_id)),
        ("num_msg", n(h.num_msg)),
        ("broker_id", n(h.broker_id)),
        ("flags", n(h.flags)),
        ("epoch_created", n(h.epoch_created)),
        ("session_epoch", n(h.session_epoch)),
        ("batch_id", n(h.batch_id)),
        ("pbr_index", n(h.pbr_index)),
        ("total_size", n(h.total_size)),
        ("start_logical_offset", n(h.start_logical_offset)),
        ("log_offset", n(h.log_offset)),
        ("total_order", n(h.total_order)),
        ("topic_id", n(h.topic_id)),
        ("committed_ns", n(h.committed_ns)),
        ("session_key_hash", n(h.session_key_hash)),
        ("publish_commit", n(h.publish_commit)),
    ])
}

fn message_header_j(h: &BlogMessageHeader) -> J {
    J::O(vec![
        ("size", n(h.size)),
        ("flags", n(h.flags)),
        ("publish_ts_ns", n(h.publish_ts_ns)),
        ("counter", n(h.counter)),
        ("processed_ts", n(h.processed_ts)),
        ("total_order", n(h.total_order)),
        ("ordered_ts", n(h.ordered_ts)),
        ("client_id", n(h.client_id)),
    ])
}

fn delivery_header_j(d: &DeliveryHeader) -> J {
    J::O(vec![
        ("batch_position", n(d.batch_position)),
        ("first_position", n(d.first_position)),
        ("client_id", n(d.client_id)),
        ("batch_seq", n(d.batch_seq)),
        ("num_msg", n(d.num_msg)),
        ("skip", n(d.skip)),
        ("broker_id", n(d.broker_id)),
        ("order", n(d.order)),
        ("payload_len", n(d.payload_len)),
        ("session_epoch", n(d.session_epoch)),
    ])
}

type Msg = (BlogMessageHeader, Vec<u8>);

fn messages_j(msgs: &[Msg]) -> J {
    J::A(
        msgs.iter()
            .map(|(h, p)| {
                J::O(vec![
                    ("header", message_header_j(h)),
                    ("payload_hex", hx(p)),
                    ("stride", n(message_stride(p.len() as u64))),
                ])
            })
            .collect(),
    )
}

fn messages_bytes(msgs: &[Msg]) -> Vec<u8> {
    let mut out = Vec::new();
    for (h, p) in msgs {
        let start = out.len();
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(p);
        out.resize(start + message_stride(p.len() as u64) as usize, 0);
    }
    out
}

fn batch_bytes(h: &BatchHeader, msgs: &[Msg]) -> Vec<u8> {
    let mut out = h.encode().to_vec();
    out.extend_from_slice(&messages_bytes(msgs));
    out
}

// ---------------------------------------------------------------------------------
// The vectors.
// ---------------------------------------------------------------------------------

/// One client id for every vector; its bytes make little-endian order visible.
const CLIENT: u64 = 0x1122_3344_5566_7788;
/// 2025-06-15 15:06:40 UTC in nanoseconds, a plausible seal time.
const SEALED_NS: u64 = 1_750_000_000_000_000_000;

struct Vector {
    name: &'static str,
    json: J,
}

struct Expect {
    error: &'static str,
    fields: Option<J>,
    code: Option<ErrorCode>,
}

fn limits_j(max_message: u64, max_batch: u64) -> J {
    J::O(vec![
        ("max_message_bytes", n(max_message)),
        ("max_batch_bytes", n(max_batch)),
    ])
}

fn positive(
    name: &'static str,
    frame: &str,
    description: &str,
    limits: Option<J>,
    fields: J,
    bytes: &[u8],
) -> Vector {
    let mut pairs = vec![("frame", s(frame)), ("description", s(description))];
    if let Some(l) = limits {
        pairs.push(("limits", l));
    }
    pairs.push(("fields", fields));
    pairs.push(("hex", hx(bytes)));
    Vector {
        name,
        json: J::O(pairs),
    }
}

fn negative(
    name: &'static str,
    frame: &str,
    description: &str,
    limits: Option<J>,
    expect: Expect,
    bytes: &[u8],
) -> Vector {
    let mut pairs = vec![("frame", s(frame)), ("description", s(description))];
    if let Some(l) = limits {
        pairs.push(("limits", l));
    }
    pairs.push(("expect_error", s(expect.error)));
    if let Some(f) = expect.fields {
        pairs.push(("error_fields", f));
    }
    if let Some(code) = expect.code {
        pairs.push(("expect_code", n(code as u16)));
        pairs.push(("expect_code_name", s(format!("{code:?}"))));
    }
    pairs.push(("hex", hx(bytes)));
    Vector {
        name,
        json: J::O(pairs),
    }
}

fn message(size_text: &[u8], counter: u64) -> Msg {
    let h = BlogMessageHeader {
        size: size_text.len() as u32,
        flags: 0,
        publish_ts_ns: SEALED_NS - 1_000_000 + counter * 1000,
        counter,
        processed_ts: 0,
        total_order: 0,
        ordered_ts: 0,
        client_id: CLIENT,
    };
    (h, size_text.to_vec())
}

const TEXT_70: &[u8] = b"Embarcadero test vector: a 70-byte message that needs 58 padding bytes";

/// The three messages (payloads of 0, 5 and 70 bytes) of batch 2.
fn three_messages() -> Vec<Msg> {
    assert_eq!(TEXT_70.len(), 70);
    vec![
        message(b"", 40),
        message(b"hello", 41),
        message(TEXT_70, 42),
    ]
}

fn client_batch_header(batch_seq: u64, batch_id: u64, msgs: &[Msg]) -> BatchHeader {
    BatchHeader {
        batch_seq,
        client_id: CLIENT,
        num_msg: msgs.len() as u32,
        epoch_created: SEALED_NS + batch_seq * 1_000_000,
        batch_id,
        total_size: messages_bytes(msgs).len() as u64,
        ..Default::default()
    }
}

fn hello_ok_frame(body: &HelloOk) -> (FrameHeader, Vec<u8>) {
    let header = FrameHeader {
        kind: FrameKind::HelloOk,
        flags: 0,
        body_len: HELLO_OK_LEN as u32,
        arg: 0,
    };
    let mut bytes = header.encode().to_vec();
    bytes.extend_from_slice(&body.encode());
    (header, bytes)
}

fn error_vector(name: &'static str, description: &str, frame: ErrorFrame) -> Vector {
    let bytes = frame.encode();
    let header = FrameHeader::decode(&bytes, u32::MAX).expect("own frame");
    let fields = J::O(vec![
        ("header", frame_header_j(&header)),
        (
            "body",
            J::O(vec![
                ("code", n(frame.code as u16)),
                ("code_name", s(format!("{:?}", frame.code))),
                ("retriable", n(frame.code.is_retriable() as u8)),
                ("text_len", n(frame.message.len() as u64)),
                ("text", s(frame.message.clone())),
                ("session_epoch", n(frame.session_epoch)),
            ]),
        ),
    ]);
    positive(name, "error", description, None, fields, &bytes)
}

fn vectors() -> Vec<Vector> {
    let mut v = Vec::new();

    // --- Hello ---------------------------------------------------------------------
    let hello_publish = Hello {
        role: Role::Publish,
        ack_level: 1,
        client_id: CLIENT,
        session_epoch: 0,
        start_position: 0,
        connection_index: 1,
        cursor_count: 0,
        topic: "orders".into(),
        session_key: [0; 16],
        flags: 0,
        opener: 0,
    };
    v.push(positive(
        "hello_publish",
        "hello",
        "Publisher hello: role 1 (publish), ack level 1, second connection (index 1) of \
         client 0x1122334455667788 to this broker, topic \"orders\". 128 bytes, nothing follows.",
        None,
        hello_j(&hello_publish, &[]),
        &hello_publish.encode(),
    ));
    let hello_session = Hello {
        role: Role::Publish,
        ack_level: 2,
        client_id: CLIENT,
        session_epoch: 3,
        start_position: 0,
        connection_index: 0,
        cursor_count: 0,
        topic: "payments.eu-west_1".into(),
        session_key: *b"secret-key-16-by",
        flags: PUBLISH_OPENS_EPOCH,
        opener: 0x0a0b_0c0d,
    };
    v.push(positive(
        "hello_publish_session",
        "hello",
        "Publisher hello for an order-5 topic: ack level 2 (durable), session epoch 3, \
         connection index 0, topic \"payments.eu-west_1\" (uses every allowed punctuation), \
         session key \"secret-key-16-by\" (16 bytes at offset 104; a real client draws it at random), \
         flags 1 (PUBLISH_OPENS_EPOCH: the publisher opens epoch 3; refused with SessionFenced \
         when the session is past it, SessionTakenOver when another opener holds it), opener \
         0x0a0b0c0d (the last 4 bytes; drawn at random when the publisher starts).",
        None,
        hello_j(&hello_session, &[]),
        &hello_session.encode(),
    ));
    let hello_subscribe = Hello {
        role: Role::Subscribe,
        ack_level: 0,
        client_id: 0x0102_0304_0506_0708,
        session_epoch: 0,
        start_position: 1000,
        connection_index: 0,
        cursor_count: 0,
        topic: "orders".into(),
        session_key: [0; 16],
        flags: 0,
        opener: 0,
    };
    v.push(positive(
        "hello_subscribe",
        "hello",
        "Subscriber hello for a totally ordered topic (order 2 or 5): start at global \
         message position 1000; no cursors follow.",
        None,
        hello_j(&hello_subscribe, &[]),
        &hello_subscribe.encode(),
    ));
    let hello_from_first = Hello {
        start_position: 0,
        flags: SUBSCRIBE_FROM_FIRST_RETAINED,
        ..hello_subscribe.clone()
    };
    v.push(positive(
        "hello_subscribe_from_first",
        "hello",
        "Subscriber hello that asks for the beginning of the topic (position 0) with \
         flags 1 (from first retained): where position 0 is no longer retained, \
         the broker starts at the first retained position instead of refusing with \
         PositionNotRetained.",
        None,
        hello_j(&hello_from_first, &[]),
        &hello_from_first.encode(),
    ));
    let cursors = [120u64, 0, 77, 4096];
    let hello_cursors = Hello {
        role: Role::Subscribe,
        ack_level: 0,
        client_id: 0x0102_0304_0506_0708,
        session_epoch: 0,
        start_position: 0,
        connection_index: 0,
        cursor_count: cursors.len() as u32,
        topic: "clicks".into(),
        session_key: [0; 16],
        flags: 0,
        opener: 0,
    };
    let mut bytes = hello_cursors.encode().to_vec();
    for c in cursors {
        bytes.extend_from_slice(&c.to_le_bytes());
    }
    v.push(positive(
        "hello_subscribe_cursors",
        "hello",
        "Subscriber hello for an order-0/1 topic on a 4-broker cluster: cursor_count 4, and \
         the 128-byte hello is followed by 4 little-endian u64 per-broker start positions \
         (broker 0 from 120, broker 1 from 0, broker 2 from 77, broker 3 from 4096). \
         \"hex\" holds the hello and the 32 cursor bytes.",
        None,
        hello_j(&hello_cursors, &cursors),
        &bytes,
    ));

    // --- HelloOk -------------------------------------------------------------------
    let ok_publish = HelloOk {
        broker_id: 2,
        num_brokers: 4,
        order: 2,
        ack_level: 1,
        replication_factor: 1,
        topic_id: 3,
        max_message_bytes: DEFAULT_MAX_MESSAGE as u32,
        max_batch_bytes: DEFAULT_MAX_BATCH as u32,
        next_batch_seq: 0,
        first_retained: 0,
    };
    let (header, bytes) = hello_ok_frame(&ok_publish);
    v.push(positive(
        "hello_ok_publish",
        "hello_ok",
        "Broker 2 of 4 accepts a publisher: FrameHeader (kind 1 HelloOk, body_len 48, arg 0) \
         then the 48-byte HelloOk body: topic id 3, order 2, ack level 1, replication factor 1, \
         default limits (1 MiB message, 4 MiB batch), first batch_seq expected 0.",
        None,
        J::O(vec![
            ("header", frame_header_j(&header)),
            ("body", hello_ok_j(&ok_publish)),
        ]),
        &bytes,
    ));
    let ok_subscribe = HelloOk {
        broker_id: 0,
        num_brokers: 4,
        order: 1,
        ack_level: 0,
        replication_factor: 2,
        topic_id: 5,
        max_message_bytes: DEFAULT_MAX_MESSAGE as u32,
        max_batch_bytes: DEFAULT_MAX_BATCH as u32,
        next_batch_seq: 0,
        first_retained: 65536,
    };
    let (header, bytes) = hello_ok_frame(&ok_subscribe);
    v.push(positive(
        "hello_ok_subscribe",
        "hello_ok",
        "Broker 0 of 4 accepts a subscriber of topic id 5 (order 1, replication factor 2); \
         the first position still retained is 65536.",
        None,
        J::O(vec![
            ("header", frame_header_j(&header)),
            ("body", hello_ok_j(&ok_subscribe)),
        ]),
        &bytes,
    ));

    // --- Ack -------------------------------------------------------------------------
    for (name, level, count, description) in [
        (
            "ack",
            1u8,
            1u64,
            "Ack frame (kind 2) at ack level 1 with count 1: batch_seq 0 of this connection is \
             acknowledged. It is the ack that follows publish_single.json.",
        ),
        (
            "ack_cumulative",
            2,
            258,
            "Ack frame at ack level 2 with count 258: every batch with batch_seq < 258 on this \
             connection is durable.",
        ),
    ] {
        let ack = embarcadero_wire::Ack { level, count };
        let header = FrameHeader::decode(&ack.encode(), 0).expect("own frame");
        v.push(positive(
            name,
            "ack",
            description,
            None,
            J::O(vec![
                ("header", frame_header_j(&header)),
                ("level", n(level)),
                ("count", n(count)),
            ]),
            &ack.encode(),
        ));
    }

    // --- Error -----------------------------------------------------------------------
    v.push(error_vector(
        "error_backpressure",
        "Error frame (kind 3) for batch_seq 7 with code 9 Backpressure, retriable: batch 7 was \
         not written; the broker drops later batches until batch 7 arrives again. The \
         connection stays open.",
        ErrorFrame {
            code: ErrorCode::Backpressure,
            batch_seq: 7,
            session_epoch: 0,
            message: "broker 2 is out of log memory for 200 ms; resend from batch 7".into(),
        },
    ));
    v.push(error_vector(
        "error_out_of_sequence",
        "Error frame for batch_seq 9 with code 10 OutOfSequence (not retriable): batch 8 was \
         expected. The broker closes the connection after it.",
        ErrorFrame {
            code: ErrorCode::OutOfSequence,
            batch_seq: 9,
            session_epoch: 0,
            message: "batch sequence 9 arrived, 8 was expected".into(),
        },
    ));
    v.push(error_vector(
        "error_unknown_topic",
        "Error frame answering a hello (arg u64::MAX: no batch) with code 3 UnknownTopic.",
        ErrorFrame {
            code: ErrorCode::UnknownTopic,
            batch_seq: u64::MAX,
            session_epoch: 0,
            message: "topic \"nope\" does not exist".into(),
        },
    ));
    v.push(error_vector(
        "error_session_fenced",
        "Error frame with code 16 SessionFenced: order-5 session epoch 3 is fenced; arg is \
         the session's committed high-water mark (batch 41): reopen with epoch 4 and resend \
         from batch 41. The body's session_epoch (3) is the session's current epoch: the \
         fenced one. The broker closes the connection after it.",
        ErrorFrame::session_fenced(3, 41, 3),
    ));
    v.push(error_vector(
        "error_session_superseded",
        "Error frame with code 16 SessionFenced for a connection of epoch 3 whose session is \
         at epoch 5 (body session_epoch): the publisher that opened epoch 5 reopens with it \
         and resends from batch 41; any other publisher was taken over and stops.",
        ErrorFrame::session_fenced(3, 41, 5),
    ));
    v.push(error_vector(
        "error_position_not_retained",
        "Error frame on a subscription (arg u64::MAX) with code 11 PositionNotRetained: a \
         delivery was reclaimed while being sent; unconfirmed deliveries must be discarded.",
        ErrorFrame {
            code: ErrorCode::PositionNotRetained,
            batch_seq: u64::MAX,
            session_epoch: 0,
            message: "batch at position 1234 was reclaimed while being sent".into(),
        },
    ));

    // --- Publish batches ---------------------------------------------------------------
    let single = vec![message(b"hello", 0)];
    let single_header = client_batch_header(0, 1, &single);
    v.push(positive(
        "publish_single",
        "publish_batch",
        "The first batch of a publish connection: BatchHeader (batch_seq 0, batch_id 1, \
         1 message, total_size 128, broker fields zero) then one message with the 5-byte \
         payload \"hello\": 64-byte header, 5 payload bytes, 59 zero padding bytes. 256 bytes.",
        None,
        J::O(vec![
            ("batch_header", batch_header_j(&single_header)),
            ("messages", messages_j(&single)),
        ]),
        &batch_bytes(&single_header, &single),
    ));
    let three = three_messages();
    let three_header = client_batch_header(2, 1002, &three);
    v.push(positive(
        "publish_batch",
        "publish_batch",
        "Batch 2 of a publish connection as the client sends it: BatchHeader (3 messages, \
         total_size 384, broker fields zero) then messages with payloads of 0, 5 and 70 bytes; \
         strides 64, 128 and 192 (padding 0, 59 and 58 zero bytes).",
        None,
        J::O(vec![
            ("batch_header", batch_header_j(&three_header)),
            ("messages", messages_j(&three)),
        ]),
        &batch_bytes(&three_header, &three),
    ));

    // --- BatchHeader and BlogMessageHeader ---------------------------------------------
    v.push(positive(
        "batch_header_client",
        "batch_header",
        "The BatchHeader of publish_batch.json alone, as sent by a client: broker_id, flags, \
         pbr_index, start_logical_offset, log_offset, total_order, topic_id, committed_ns and \
         publish_commit are zero.",
        None,
        batch_header_j(&three_header),
        &three_header.encode(),
    ));
    let slot = BatchHeader {
        broker_id: 2,
        flags: BatchFlags::VALID,
        pbr_index: 41,
        start_logical_offset: 5000,
        log_offset: 0x0004_0000,
        total_order: 1234,
        topic_id: 3,
        committed_ns: 86_400_000_250_000,
        publish_commit: 42,
        ..three_header
    };
    v.push(positive(
        "batch_header_pbr_slot",
        "batch_header",
        "The same batch as a committed PBR slot in the shared region after ordering: broker 2, \
         flags VALID (1), PBR index 41, per-broker position 5000, log offset 0x40000, topic id 3, \
         committed a day and 250 us after the host booted (committed_ns, its monotonic clock), global position 1234 (written by the sequencer), publish_commit = pbr_index + 1 = 42.",
        None,
        batch_header_j(&slot),
        &slot.encode(),
    ));
    let end = BatchHeader {
        batch_seq: 3,
        num_msg: 0,
        flags: BatchFlags::END_SESSION,
        session_epoch: 1,
        total_size: 0,
        ..three_header
    };
    v.push(positive(
        "batch_header_session_end",
        "batch_header",
        "An order-5 publisher that closes, after every batch it sent was acknowledged: flags \
         END_SESSION (8), no messages (num_msg 0, total_size 0), batch_seq 3 the next batch it \
         would have numbered in epoch 1. No payload follows; the broker sends no answer.",
        None,
        batch_header_j(&end),
        &end.encode(),
    ));
    let (mh, _) = &three[1];
    v.push(positive(
        "blog_message_header",
        "blog_message_header",
        "The 64-byte header of the second message of publish_batch.json (payload 5 bytes, \
         counter 41) in its final form as the publisher writes it; processed_ts, total_order \
         and ordered_ts are 0.",
        None,
        message_header_j(mh),
        &mh.encode(),
    ));

    // --- Delivery and BatchOk ----------------------------------------------------------
    let payload = messages_bytes(&three);
    let per_broker = DeliveryHeader {
        batch_position: 41,
        first_position: 5000,
        client_id: CLIENT,
        batch_seq: 2,
        num_msg: 3,
        skip: 1,
        broker_id: 2,
        order: 1,
        payload_len: payload.len() as u32,
        session_epoch: 0,
    };
    let mut bytes = per_broker.frame_header().encode().to_vec();
    bytes.extend_from_slice(&per_broker.encode());
    v.push(positive(
        "delivery_header",
        "delivery_header",
        "The first 80 bytes of a Delivery frame on an order-1 subscription: FrameHeader (kind 4, \
         body_len 64 + 384, arg = batch_position 41, the PBR index on broker 2) and the \
         DeliveryHeader. first_position 5000 is per broker; skip 1 means the subscriber already \
         has message 5000 and resumes at 5001. The 384 payload bytes that follow are not in \
         \"hex\" (see delivery.json).",
        None,
        J::O(vec![
            ("header", frame_header_j(&per_broker.frame_header())),
            ("delivery_header", delivery_header_j(&per_broker)),
        ]),
        &bytes,
    ));
    let global = DeliveryHeader {
        batch_position: 7,
        first_position: 1234,
        client_id: CLIENT,
        batch_seq: 2,
        num_msg: 3,
        skip: 0,
        broker_id: 2,
        order: 2,
        payload_len: payload.len() as u32,
        session_epoch: 0,
    };
    let mut bytes = global.frame_header().encode().to_vec();
    bytes.extend_from_slice(&global.encode());
    bytes.extend_from_slice(&payload);
    v.push(positive(
        "delivery",
        "delivery",
        "A complete Delivery frame on an order-2 subscription: the batch of publish_batch.json \
         at GOI index 7; its messages have global positions 1234, 1235 and 1236. The payload is \
         byte for byte what the publisher sent after the BatchHeader.",
        None,
        J::O(vec![
            ("header", frame_header_j(&global.frame_header())),
            ("delivery_header", delivery_header_j(&global)),
            ("messages", messages_j(&three)),
        ]),
        &bytes,
    ));
    let ok = BatchOk {
        count: 2,
        discard_rest: false,
    };
    let header = FrameHeader::decode(&ok.encode(), 0).expect("own frame");
    v.push(positive(
        "batch_ok",
        "batch_ok",
        "BatchOk frame (kind 5) with count 2: the two oldest unconfirmed deliveries are \
         intact.",
        None,
        J::O(vec![
            ("header", frame_header_j(&header)),
            ("count", n(ok.count)),
        ]),
        &ok.encode(),
    ));

    // --- Negative vectors --------------------------------------------------------------
    let mut bytes = hello_publish.encode();
    bytes[0..4].copy_from_slice(b"GET ");
    v.push(negative(
        "neg_hello_bad_magic",
        "hello",
        "hello_publish.json with the magic replaced by \"GET \" (an HTTP client): refused with \
         BadMagic, answered with error code 1 and the connection closed.",
        None,
        Expect {
            error: "BadMagic",
            fields: Some(J::O(vec![("magic", s("47455420"))])),
            code: Some(ErrorCode::BadMagic),
        },
        &bytes,
    ));
    let mut bytes = hello_publish.encode();
    bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
    v.push(negative(
        "neg_hello_unsupported_version",
        "hello",
        "hello_publish.json claiming protocol version 2: refused with UnsupportedVersion \
         (error code 2).",
        None,
        Expect {
            error: "UnsupportedVersion",
            fields: Some(J::O(vec![("version", n(2u16))])),
            code: Some(ErrorCode::UnsupportedVersion),
        },
        &bytes,
    ));
    let bad_topic = Hello {
        topic: "bad topic".into(),
        session_key: [0; 16],
        ..hello_publish.clone()
    };
    v.push(negative(
        "neg_hello_invalid_topic_name",
        "hello",
        "A publisher hello naming topic \"bad topic\" (a space is not allowed): refused with \
         InvalidTopicName (error code 12).",
        None,
        Expect {
            error: "InvalidTopicName",
            fields: None,
            code: Some(ErrorCode::InvalidTopicName),
        },
        &bad_topic.encode(),
    ));
    let mut bytes = hello_publish.encode();
    bytes[HELLO_FLAGS_OFFSET] = PUBLISH_OPENS_EPOCH;
    v.push(negative(
        "neg_hello_publish_flags",
        "hello",
        "hello_publish.json with flags 1 (for a publisher, PUBLISH_OPENS_EPOCH) but session \
         epoch 0: only an order-5 session opens an epoch. Refused with MalformedBatch (error \
         code 6), naming the field.",
        None,
        Expect {
            error: "InvalidField",
            fields: Some(J::O(vec![("field", s("flags")), ("value", n(1u8))])),
            code: Some(ErrorCode::MalformedBatch),
        },
        &bytes,
    ));
    let mut bytes = hello_subscribe.encode();
    bytes[7] = 1;
    v.push(negative(
        "neg_hello_subscribe_ack_level",
        "hello",
        "hello_subscribe.json with ack_level 1: a subscriber acknowledges nothing, so its \
         level is 0. Refused with AckNotAllowed (error code 5), naming the field.",
        None,
        Expect {
            error: "InvalidField",
            fields: Some(J::O(vec![("field", s("ack_level")), ("value", n(1u8))])),
            code: Some(ErrorCode::AckNotAllowed),
        },
        &bytes,
    ));
    let (_, mut bytes) = hello_ok_frame(&ok_publish);
    bytes[16..18].copy_from_slice(&2u16.to_le_bytes());
    v.push(negative(
        "neg_hello_ok_unsupported_version",
        "hello_ok",
        "hello_ok_publish.json with the body's version set to 2: the client must refuse it \
         with UnsupportedVersion.",
        None,
        Expect {
            error: "UnsupportedVersion",
            fields: Some(J::O(vec![("version", n(2u16))])),
            code: None,
        },
        &bytes,
    ));

    let two = vec![message(b"", 0), message(b"hello", 1)];
    let mut h = client_batch_header(0, 1, &two);
    h.total_size = 256;
    let mut bytes = batch_bytes(&h, &two);
    bytes.resize(BATCH_HEADER_LEN + 256, 0);
    v.push(negative(
        "neg_batch_sizes_disagree",
        "publish_batch",
        "A batch whose header says 2 messages in 256 bytes, but the 2 messages (strides 64 and \
         128) cover only 192; 64 zero bytes follow. The broker reads all 256 bytes, then \
         refuses the batch with MalformedBatch (error code 6) and closes the connection.",
        None,
        Expect {
            error: "MalformedBatch",
            fields: None,
            code: Some(ErrorCode::MalformedBatch),
        },
        &bytes,
    ));
    let mut h = client_batch_header(0, 1, &two);
    h.num_msg = 3;
    v.push(negative(
        "neg_batch_num_msg_too_many",
        "publish_batch",
        "A batch whose header says 3 messages but whose 192 bytes hold 2: the third header \
         would start at the end of the payload. MalformedBatch.",
        None,
        Expect {
            error: "MalformedBatch",
            fields: None,
            code: Some(ErrorCode::MalformedBatch),
        },
        &batch_bytes(&h, &two),
    ));
    let h = client_batch_header(0, 1, &single);
    let mut bytes = batch_bytes(&h, &single);
    bytes[BATCH_HEADER_LEN..BATCH_HEADER_LEN + 4].copy_from_slice(&100u32.to_le_bytes());
    v.push(negative(
        "neg_batch_message_overruns",
        "publish_batch",
        "publish_single.json with the message size changed from 5 to 100: its stride (192) \
         runs past the 128-byte payload. MalformedBatch.",
        None,
        Expect {
            error: "MalformedBatch",
            fields: None,
            code: Some(ErrorCode::MalformedBatch),
        },
        &bytes,
    ));
    let big = vec![message(TEXT_70, 0)];
    let h = client_batch_header(0, 1, &big);
    v.push(negative(
        "neg_batch_message_too_large",
        "publish_batch",
        "A well-formed batch of one 70-byte message sent to a broker configured with \
         max_message_bytes 64 (see limits): MessageTooLarge (error code 7).",
        Some(limits_j(64, DEFAULT_MAX_BATCH)),
        Expect {
            error: "MessageTooLarge",
            fields: Some(J::O(vec![("size", n(70u64)), ("max", n(64u64))])),
            code: Some(ErrorCode::MessageTooLarge),
        },
        &batch_bytes(&h, &big),
    ));
    let mut foreign = three_messages();
    foreign[1].0.client_id = CLIENT + 1;
    let h = client_batch_header(2, 1002, &three);
    v.push(negative(
        "neg_batch_foreign_message",
        "publish_batch",
        "publish_batch.json with the second message naming client_id 0x1122334455667789 instead \
         of the batch's 0x1122334455667788: every message must name its batch's client_id. \
         MalformedBatch.",
        None,
        Expect {
            error: "MalformedBatch",
            fields: None,
            code: Some(ErrorCode::MalformedBatch),
        },
        &batch_bytes(&h, &foreign),
    ));
    let h = BatchHeader {
        num_msg: 1,
        total_size: DEFAULT_MAX_BATCH + 64,
        ..client_batch_header(0, 1, &single)
    };
    v.push(negative(
        "neg_batch_header_too_large",
        "batch_header",
        "A BatchHeader announcing 4 MiB + 64 bytes of messages, over the default batch limit: \
         refused with BatchTooLarge (error code 8) before any payload is read.",
        None,
        Expect {
            error: "BatchTooLarge",
            fields: Some(J::O(vec![
                ("size", n(DEFAULT_MAX_BATCH + 64)),
                ("max", n(DEFAULT_MAX_BATCH)),
            ])),
            code: Some(ErrorCode::BatchTooLarge),
        },
        &h.encode(),
    ));
    let h = BatchHeader {
        total_size: 200,
        ..client_batch_header(0, 1, &single)
    };
    v.push(negative(
        "neg_batch_header_unaligned",
        "batch_header",
        "A BatchHeader with total_size 200, not a multiple of 64: MalformedBatch.",
        None,
        Expect {
            error: "MalformedBatch",
            fields: None,
            code: Some(ErrorCode::MalformedBatch),
        },
        &h.encode(),
    ));
    let h = BatchHeader {
        flags: BatchFlags::END_SESSION,
        session_epoch: 1,
        ..client_batch_header(0, 1, &single)
    };
    v.push(negative(
        "neg_batch_header_session_end_with_messages",
        "batch_header",
        "A session's end (flags END_SESSION) that says it carries one message: an end carries \
         none. MalformedBatch.",
        None,
        Expect {
            error: "MalformedBatch",
            fields: None,
            code: Some(ErrorCode::MalformedBatch),
        },
        &h.encode(),
    ));
    let h = BatchHeader {
        num_msg: 0,
        ..client_batch_header(0, 1, &single)
    };
    v.push(negative(
        "neg_batch_header_zero_messages",
        "batch_header",
        "A BatchHeader with num_msg 0: a batch holds at least one message. MalformedBatch.",
        None,
        Expect {
            error: "MalformedBatch",
            fields: None,
            code: Some(ErrorCode::MalformedBatch),
        },
        &h.encode(),
    ));
    let bad = DeliveryHeader {
        skip: 4,
        ..per_broker
    };
    let mut bytes = bad.frame_header().encode().to_vec();
    bytes.extend_from_slice(&bad.encode());
    v.push(negative(
        "neg_delivery_skip_exceeds_num_msg",
        "delivery_header",
        "delivery_header.json with skip 4 in a batch of 3 messages: the client must refuse it \
         as InvalidField.",
        None,
        Expect {
            error: "InvalidField",
            fields: Some(J::O(vec![("field", s("skip")), ("value", n(4u64))])),
            code: None,
        },
        &bytes,
    ));
    let mut bytes = ok.encode();
    bytes[0] = 6;
    v.push(negative(
        "neg_frame_unknown_kind",
        "frame_header",
        "A frame header of kind 6, which protocol version 1 does not define: InvalidField.",
        None,
        Expect {
            error: "InvalidField",
            fields: Some(J::O(vec![("field", s("frame kind")), ("value", n(6u64))])),
            code: None,
        },
        &bytes,
    ));
    let mut bytes = ErrorFrame {
        code: ErrorCode::Internal,
        batch_seq: u64::MAX,
        session_epoch: 0,
        message: "?".into(),
    }
    .encode();
    bytes[16..18].copy_from_slice(&99u16.to_le_bytes());
    v.push(negative(
        "neg_error_unknown_code",
        "error",
        "An error frame with code 99, which protocol version 1 does not define: InvalidField.",
        None,
        Expect {
            error: "InvalidField",
            fields: Some(J::O(vec![("field", s("error code")), ("value", n(99u64))])),
            code: None,
        },
        &bytes,
    ));
    v
}

#[test]
#[ignore = "rewrites testdata/wire; run on purpose and review the diff"]
fn regenerate_vectors() {
    let dir = vector_dir();
    std::fs::create_dir_all(&dir).expect("create testdata/wire");
    for vector in vectors() {
        let mut text = String::new();
        write(&vector.json, 0, &mut text);
        text.push('\n');
        let path = dir.join(format!("{}.json", vector.name));
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}
