//! Checks the byte-exact test vectors in `testdata/wire/` against this crate.
//!
//! For every positive vector the structure is built from `fields`, encoded and compared
//! with `hex`; `hex` is decoded and compared with `fields`; and every field is read
//! a second time straight from the bytes through the offset tables below (a layout
//! written independently of the crate, from `docs/PROTOCOL.md`), which also checks
//! that every reserved byte is zero. Every negative vector must be refused with the
//! named error. Each `*.json` file in the directory must be handled, so a new vector
//! of an unknown kind (or a malformed one) fails the test instead of being skipped.
//!
//! `regenerate_vectors` (ignored, in `vectors/generate.rs`) rewrites the files; the
//! committed JSON stays the source of truth.

#[path = "vectors/generate.rs"]
mod generate;

use embarcadero_wire::{
    message_stride, validate_batch_payload, Ack, BatchHeader, BatchOk, BlogMessageHeader,
    DeliveryHeader, ErrorCode, ErrorFrame, FrameHeader, FrameKind, Hello, HelloOk, MessageIter,
    Role, WireError, BATCH_HEADER_LEN, DELIVERY_HEADER_LEN, FRAME_HEADER_LEN, HELLO_LEN,
    HELLO_OK_LEN, MESSAGE_HEADER_LEN, PROTOCOL_MAGIC, PROTOCOL_VERSION,
};
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Broker limits a vector is checked with when it has no `limits` object.
pub(crate) const DEFAULT_MAX_MESSAGE: u64 = 1 << 20;
pub(crate) const DEFAULT_MAX_BATCH: u64 = 4 << 20;

pub(crate) fn vector_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/wire")
}

/// Vectors that must exist; deleting one fails the test.
const REQUIRED: &[&str] = &[
    "hello_publish",
    "hello_publish_session",
    "hello_subscribe",
    "hello_subscribe_cursors",
    "hello_ok_publish",
    "hello_ok_subscribe",
    "ack",
    "ack_cumulative",
    "error_backpressure",
    "error_out_of_sequence",
    "error_unknown_topic",
    "error_position_not_retained",
    "error_session_fenced",
    "error_session_superseded",
    "delivery_header",
    "delivery",
    "batch_ok",
    "batch_header_client",
    "batch_header_pbr_slot",
    "blog_message_header",
    "publish_batch",
    "publish_single",
    "neg_hello_bad_magic",
    "neg_hello_unsupported_version",
    "neg_hello_invalid_topic_name",
    "neg_hello_ok_unsupported_version",
    "neg_batch_sizes_disagree",
    "neg_batch_num_msg_too_many",
    "neg_batch_message_overruns",
    "neg_batch_message_too_large",
    "neg_batch_foreign_message",
    "neg_batch_header_too_large",
    "neg_batch_header_unaligned",
    "neg_batch_header_zero_messages",
    "neg_delivery_skip_exceeds_num_msg",
    "neg_frame_unknown_kind",
    "neg_error_unknown_code",
];

/// Every value of `frame`, and whether a positive vector of it is required.
const FRAMES: &[(&str, bool)] = &[
    ("hello", true),
    ("hello_ok", true),
    ("ack", true),
    ("error", true),
    ("delivery_header", true),
    ("delivery", true),
    ("batch_ok", true),
    ("batch_header", true),
    ("blog_message_header", true),
    ("publish_batch", true),
    ("frame_header", false),
];

#[test]
fn every_vector_file_passes() {
    let dir = vector_dir();
    let mut files = Vec::new();
    let mut strays = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".json") {
            files.push(path);
        } else if name != "README.md" {
            strays.push(name);
        }
    }
    assert!(
        strays.is_empty(),
        "files in testdata/wire that no test reads: {strays:?}"
    );
    files.sort();

    let mut visited = BTreeSet::new();
    let mut positive_frames = BTreeSet::new();
    let mut failures = Vec::new();
    for path in &files {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(path).expect("readable vector");
        match catch_unwind(AssertUnwindSafe(|| check_vector(&text))) {
            Ok((frame, positive)) => {
                assert!(
                    positive != stem.starts_with("neg_"),
                    "{stem}: negative vectors, and only they, are named neg_*"
                );
                if positive {
                    positive_frames.insert(frame);
                }
                visited.insert(stem);
            }
            Err(panic) => failures.push(format!("{stem}.json: {}", panic_text(&panic))),
        }
    }
    assert!(
        failures.is_empty(),
        "failing vectors:\n{}",
        failures.join("\n")
    );
    assert_eq!(visited.len(), files.len(), "every vector file is checked");
    for name in REQUIRED {
        assert!(visited.contains(*name), "missing vector {name}.json");
    }
    for (frame, needs_positive) in FRAMES {
        if *needs_positive {
            assert!(
                positive_frames.contains(*frame),
                "no positive vector for frame {frame:?}"
            );
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else {
        "panic".into()
    }
}

// ---------------------------------------------------------------------------------
// JSON access. Every object's key set is checked exactly, so a vector cannot carry
// a misspelled or unchecked field.
// ---------------------------------------------------------------------------------

type Obj = Map<String, Value>;

fn keys(m: &Obj, required: &[&str], optional: &[&str]) {
    for k in required {
        assert!(m.contains_key(*k), "missing key {k:?}");
    }
    for k in m.keys() {
        assert!(
            required.contains(&k.as_str()) || optional.contains(&k.as_str()),
            "unexpected key {k:?}"
        );
    }
}

fn obj<'a>(m: &'a Obj, k: &str) -> &'a Obj {
    m.get(k)
        .and_then(Value::as_object)
        .unwrap_or_else(|| panic!("{k:?} must be an object"))
}

fn arr<'a>(m: &'a Obj, k: &str) -> &'a Vec<Value> {
    m.get(k)
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("{k:?} must be an array"))
}

fn string<'a>(m: &'a Obj, k: &str) -> &'a str {
    m.get(k)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{k:?} must be a string"))
}

fn num(m: &Obj, k: &str) -> u64 {
    m.get(k)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{k:?} must be an unsigned integer"))
}

/// An integer field that must fit the wire type `T`.
fn int<T: TryFrom<u64>>(m: &Obj, k: &str) -> T {
    let v = num(m, k);
    T::try_from(v).unwrap_or_else(|_| panic!("{k:?} = {v} does not fit its wire type"))
}

fn hex_field(m: &Obj, k: &str) -> Vec<u8> {
    let s = string(m, k);
    let b = hex::decode(s).unwrap_or_else(|e| panic!("{k:?} is not hex: {e}"));
    assert_eq!(s, hex::encode(&b), "{k:?}: hex must be lowercase");
    b
}

fn assert_bytes(what: &str, got: &[u8], want: &[u8]) {
    if got != want {
        let at = got
            .iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len()));
        panic!(
            "{what}: encoding differs from \"hex\" at byte {at} (encoded {} bytes, vector {} bytes)\n encoded: {}\n  vector: {}",
            got.len(),
            want.len(),
            hex::encode(got),
            hex::encode(want)
        );
    }
}

#[derive(Clone, Copy)]
struct Limits {
    max_message: u64,
    max_batch: u64,
}

fn limits(top: &Obj) -> Limits {
    match top.get("limits") {
        None => Limits {
            max_message: DEFAULT_MAX_MESSAGE,
            max_batch: DEFAULT_MAX_BATCH,
        },
        Some(_) => {
            let l = obj(top, "limits");
            keys(l, &["max_message_bytes", "max_batch_bytes"], &[]);
            Limits {
                max_message: num(l, "max_message_bytes"),
                max_batch: num(l, "max_batch_bytes"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// Independent layout tables: (field, offset, size). Bytes no entry covers are
// reserved and must be zero.
// ---------------------------------------------------------------------------------

type Layout = &'static [(&'static str, usize, usize)];

const FRAME_HEADER_LAYOUT: Layout = &[
    ("kind", 0, 1),
    ("flags", 1, 1),
    ("body_len", 4, 4),
    ("arg", 8, 8),
];

/// Magic (0..4) and topic bytes (41..) are checked separately.
const HELLO_LAYOUT: Layout = &[
    ("version", 4, 2),
    ("role", 6, 1),
    ("ack_level", 7, 1),
    ("client_id", 8, 8),
    ("session_epoch", 16, 8),
    ("start_position", 24, 8),
    ("connection_index", 32, 4),
    ("cursor_count", 36, 4),
    ("topic_len", 40, 1),
    ("session_key_lo", 104, 8),
    ("session_key_hi", 112, 8),
    ("flags", 120, 1),
    ("opener", 124, 4),
];

const HELLO_OK_LAYOUT: Layout = &[
    ("version", 0, 2),
    ("broker_id", 2, 2),
    ("num_brokers", 4, 2),
    ("order", 6, 1),
    ("ack_level", 7, 1),
    ("replication_factor", 8, 1),
    ("topic_id", 12, 4),
    ("max_message_bytes", 16, 4),
    ("max_batch_bytes", 20, 4),
    ("next_batch_seq", 24, 8),
    ("first_retained", 32, 8),
];

/// The Error body's fixed part; `session_epoch` follows the text (checked apart).
const ERROR_BODY_LAYOUT: Layout = &[("code", 0, 2), ("retriable", 2, 1), ("text_len", 4, 4)];

const BATCH_HEADER_LAYOUT: Layout = &[
    ("batch_seq", 0, 8),
    ("client_id", 8, 8),
    ("num_msg", 16, 4),
    ("broker_id", 20, 2),
    ("flags", 22, 2),
    ("epoch_created", 24, 8),
    ("session_epoch", 32, 8),
    ("batch_id", 40, 8),
    ("pbr_index", 48, 8),
    ("total_size", 56, 8),
    ("start_logical_offset", 64, 8),
    ("log_offset", 72, 8),
    ("total_order", 80, 8),
    ("topic_id", 88, 4),
    ("committed_ns", 96, 8),
    ("session_key_hash", 104, 8),
    ("publish_commit", 120, 8),
];

const MESSAGE_HEADER_LAYOUT: Layout = &[
    ("size", 0, 4),
    ("flags", 4, 4),
    ("publish_ts_ns", 8, 8),
    ("counter", 16, 8),
    ("processed_ts", 24, 8),
    ("total_order", 32, 8),
    ("ordered_ts", 40, 8),
    ("client_id", 48, 8),
];

const DELIVERY_HEADER_LAYOUT: Layout = &[
    ("batch_position", 0, 8),
    ("first_position", 8, 8),
    ("client_id", 16, 8),
    ("batch_seq", 24, 8),
    ("num_msg", 32, 4),
    ("skip", 36, 4),
    ("broker_id", 40, 2),
    ("order", 42, 1),
    ("payload_len", 44, 4),
    ("session_epoch", 48, 8),
];

fn layout_names(layout: Layout) -> Vec<&'static str> {
    layout.iter().map(|f| f.0).collect()
}

/// Reads every field of `layout` from `bytes` and compares it with `fields`; every
/// byte not covered by the layout or by `also` must be zero.
/// `also` lists further covered byte ranges as `(start, end)`.
fn check_layout(bytes: &[u8], layout: Layout, fields: &Obj, also: &[(usize, usize)]) {
    let mut covered = vec![false; bytes.len()];
    for &(name, at, size) in layout {
        let mut raw = [0u8; 8];
        raw[..size].copy_from_slice(&bytes[at..at + size]);
        let got = u64::from_le_bytes(raw);
        assert_eq!(
            got,
            num(fields, name),
            "layout check: {name} at offset {at} ({size} bytes)"
        );
        for c in &mut covered[at..at + size] {
            assert!(!*c, "layout table overlaps at {name}");
            *c = true;
        }
    }
    for &(start, end) in also {
        covered[start..end].fill(true);
    }
    for (i, (&byte, &c)) in bytes.iter().zip(&covered).enumerate() {
        assert!(
            c || byte == 0,
            "reserved byte at offset {i} is {byte:#04x}, not 0"
        );
    }
}

// ---------------------------------------------------------------------------------
// Structures from JSON fields.
// ---------------------------------------------------------------------------------

fn frame_header_from(m: &Obj) -> FrameHeader {
    keys(m, &layout_names(FRAME_HEADER_LAYOUT), &[]);
    FrameHeader {
        kind: FrameKind::from_u8(int(m, "kind")).expect("known frame kind"),
        flags: int(m, "flags"),
        body_len: int(m, "body_len"),
        arg: num(m, "arg"),
    }
}

fn hello_from(m: &Obj) -> (Hello, Vec<u64>) {
    let mut names = layout_names(HELLO_LAYOUT);
    names.extend(["magic", "topic", "cursors"]);
    keys(m, &names, &[]);
    assert_eq!(string(m, "magic").as_bytes(), PROTOCOL_MAGIC, "magic");
    assert_eq!(num(m, "version"), PROTOCOL_VERSION as u64, "version");
    let topic = string(m, "topic").to_string();
    assert_eq!(num(m, "topic_len"), topic.len() as u64, "topic_len");
    let role = match num(m, "role") {
        1 => Role::Publish,
        2 => Role::Subscribe,
        other => panic!("role {other}"),
    };
    let cursors: Vec<u64> = arr(m, "cursors")
        .iter()
        .map(|c| c.as_u64().expect("cursor is an unsigned integer"))
        .collect();
    assert_eq!(cursors.len() as u64, num(m, "cursor_count"), "cursor_count");
    let hello = Hello {
        role,
        ack_level: int(m, "ack_level"),
        client_id: num(m, "client_id"),
        session_epoch: num(m, "session_epoch"),
        start_position: num(m, "start_position"),
        connection_index: int(m, "connection_index"),
        cursor_count: int(m, "cursor_count"),
        topic,
        session_key: session_key_from(num(m, "session_key_lo"), num(m, "session_key_hi")),
        flags: int(m, "flags"),
        opener: int(m, "opener"),
    };
    (hello, cursors)
}

/// The 16 key bytes from the two little-endian halves the vectors name.
fn session_key_from(lo: u64, hi: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&lo.to_le_bytes());
    key[8..].copy_from_slice(&hi.to_le_bytes());
    key
}

fn hello_ok_from(m: &Obj) -> HelloOk {
    keys(m, &layout_names(HELLO_OK_LAYOUT), &[]);
    assert_eq!(num(m, "version"), PROTOCOL_VERSION as u64, "version");
    HelloOk {
        broker_id: int(m, "broker_id"),
        num_brokers: int(m, "num_brokers"),
        order: int(m, "order"),
        ack_level: int(m, "ack_level"),
        replication_factor: int(m, "replication_factor"),
        topic_id: int(m, "topic_id"),
        max_message_bytes: int(m, "max_message_bytes"),
        max_batch_bytes: int(m, "max_batch_bytes"),
        next_batch_seq: num(m, "next_batch_seq"),
        first_retained: num(m, "first_retained"),
    }
}

fn batch_header_from(m: &Obj) -> BatchHeader {
    keys(m, &layout_names(BATCH_HEADER_LAYOUT), &[]);
    BatchHeader {
        batch_seq: num(m, "batch_seq"),
        client_id: num(m, "client_id"),
        num_msg: int(m, "num_msg"),
        broker_id: int(m, "broker_id"),
        flags: int(m, "flags"),
        epoch_created: num(m, "epoch_created"),
        session_epoch: num(m, "session_epoch"),
        batch_id: num(m, "batch_id"),
        pbr_index: num(m, "pbr_index"),
        total_size: num(m, "total_size"),
        start_logical_offset: num(m, "start_logical_offset"),
        log_offset: num(m, "log_offset"),
        total_order: num(m, "total_order"),
        topic_id: int(m, "topic_id"),
        committed_ns: num(m, "committed_ns"),
        session_key_hash: num(m, "session_key_hash"),
        publish_commit: num(m, "publish_commit"),
    }
}

fn message_header_from(m: &Obj) -> BlogMessageHeader {
    keys(m, &layout_names(MESSAGE_HEADER_LAYOUT), &[]);
    BlogMessageHeader {
        size: int(m, "size"),
        flags: int(m, "flags"),
        publish_ts_ns: num(m, "publish_ts_ns"),
        counter: num(m, "counter"),
        processed_ts: num(m, "processed_ts"),
        total_order: num(m, "total_order"),
        ordered_ts: num(m, "ordered_ts"),
        client_id: num(m, "client_id"),
    }
}

fn delivery_header_from(m: &Obj) -> DeliveryHeader {
    keys(m, &layout_names(DELIVERY_HEADER_LAYOUT), &[]);
    DeliveryHeader {
        batch_position: num(m, "batch_position"),
        first_position: num(m, "first_position"),
        client_id: num(m, "client_id"),
        batch_seq: num(m, "batch_seq"),
        num_msg: int(m, "num_msg"),
        skip: int(m, "skip"),
        broker_id: int(m, "broker_id"),
        order: int(m, "order"),
        payload_len: int(m, "payload_len"),
        session_epoch: num(m, "session_epoch"),
    }
}

/// One message of a batch: header, payload, and the stride the vector states.
struct Message<'a> {
    fields: &'a Obj,
    header: BlogMessageHeader,
    payload: Vec<u8>,
}

fn messages_from(list: &[Value]) -> Vec<Message<'_>> {
    list.iter()
        .map(|v| {
            let m = v.as_object().expect("message is an object");
            keys(m, &["header", "payload_hex", "stride"], &[]);
            let fields = obj(m, "header");
            let header = message_header_from(fields);
            let payload = hex_field(m, "payload_hex");
            assert_eq!(header.size as usize, payload.len(), "size vs payload_hex");
            assert_eq!(
                num(m, "stride"),
                message_stride(payload.len() as u64),
                "stride"
            );
            Message {
                fields,
                header,
                payload,
            }
        })
        .collect()
}

/// Messages laid out as in a batch: header, payload, zero padding to the stride.
fn encode_messages(messages: &[Message]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        let start = out.len();
        out.extend_from_slice(&m.header.encode());
        out.extend_from_slice(&m.payload);
        out.resize(start + message_stride(m.payload.len() as u64) as usize, 0);
    }
    out
}

/// Reads the messages back with the crate's iterator and the independent layout.
fn check_messages(bytes: &[u8], messages: &[Message]) {
    let seen: Vec<_> = MessageIter::new(bytes, messages.len() as u32)
        .map(|m| m.expect("message decodes"))
        .collect();
    assert_eq!(seen.len(), messages.len());
    let mut at = 0;
    for (view, m) in seen.iter().zip(messages) {
        assert_eq!(view.header, m.header, "decoded message header");
        assert_eq!(view.payload, &m.payload[..], "decoded payload");
        let stride = message_stride(m.payload.len() as u64) as usize;
        // The padding after the payload is checked as reserved (zero) bytes.
        check_layout(
            &bytes[at..at + stride],
            MESSAGE_HEADER_LAYOUT,
            m.fields,
            &[(MESSAGE_HEADER_LEN, MESSAGE_HEADER_LEN + m.payload.len())],
        );
        at += stride;
    }
    assert_eq!(at, bytes.len(), "messages tile the payload");
}

/// Checks the frame header at the front of `bytes` against its JSON, and returns it.
fn check_frame_header(bytes: &[u8], m: &Obj, kind: FrameKind) -> FrameHeader {
    let want = frame_header_from(m);
    assert_eq!(want.kind, kind, "frame kind");
    assert_eq!(
        FrameHeader::decode(bytes, u32::MAX).expect("frame header decodes"),
        want
    );
    assert_eq!(
        bytes.len(),
        FRAME_HEADER_LEN + want.body_len as usize,
        "body_len matches the bytes that follow the frame header"
    );
    check_layout(&bytes[..FRAME_HEADER_LEN], FRAME_HEADER_LAYOUT, m, &[]);
    want
}

// ---------------------------------------------------------------------------------
// Vectors.
// ---------------------------------------------------------------------------------

/// Checks one vector; returns its frame and whether it is positive.
fn check_vector(text: &str) -> (String, bool) {
    let v: Value = serde_json::from_str(text).expect("valid JSON");
    let top = v.as_object().expect("top level is an object");
    let frame = string(top, "frame").to_string();
    assert!(
        FRAMES.iter().any(|(f, _)| *f == frame),
        "unknown frame {frame:?}"
    );
    assert!(
        !string(top, "description").trim().is_empty(),
        "description is empty"
    );
    let bytes = hex_field(top, "hex");
    let limits = limits(top);
    if top.contains_key("expect_error") {
        keys(
            top,
            &["frame", "description", "hex", "expect_error"],
            &["limits", "error_fields", "expect_code", "expect_code_name"],
        );
        check_negative(&frame, &bytes, limits, top);
        (frame, false)
    } else {
        keys(top, &["frame", "description", "hex", "fields"], &["limits"]);
        check_positive(&frame, &bytes, limits, obj(top, "fields"));
        (frame, true)
    }
}

fn check_positive(frame: &str, bytes: &[u8], limits: Limits, f: &Obj) {
    match frame {
        "hello" => {
            let (hello, cursors) = hello_from(f);
            let mut encoded = hello.encode().to_vec();
            for c in &cursors {
                encoded.extend_from_slice(&c.to_le_bytes());
            }
            assert_bytes("hello", &encoded, bytes);
            assert_eq!(Hello::decode(bytes).expect("hello decodes"), hello);
            let tail: Vec<u64> = bytes[HELLO_LEN..]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(tail, cursors, "cursors after the hello");
            let topic_end = 41 + hello.topic.len();
            assert_eq!(&bytes[0..4], PROTOCOL_MAGIC, "magic at offset 0");
            assert_eq!(&bytes[41..topic_end], hello.topic.as_bytes(), "topic at 41");
            check_layout(
                &bytes[..HELLO_LEN],
                HELLO_LAYOUT,
                f,
                &[(0, 4), (41, topic_end)],
            );
        }
        "hello_ok" => {
            keys(f, &["header", "body"], &[]);
            let body = hello_ok_from(obj(f, "body"));
            let header = check_frame_header(bytes, obj(f, "header"), FrameKind::HelloOk);
            assert_eq!(header.body_len as usize, HELLO_OK_LEN);
            let mut encoded = header.encode().to_vec();
            encoded.extend_from_slice(&body.encode());
            assert_bytes("hello_ok", &encoded, bytes);
            let decoded = HelloOk::decode(&bytes[FRAME_HEADER_LEN..]).expect("decodes");
            assert_eq!(decoded, body);
            check_layout(
                &bytes[FRAME_HEADER_LEN..],
                HELLO_OK_LAYOUT,
                obj(f, "body"),
                &[],
            );
        }
        "ack" => {
            keys(f, &["header", "level", "count"], &[]);
            let ack = Ack {
                level: int(f, "level"),
                count: num(f, "count"),
            };
            assert_bytes("ack", &ack.encode(), bytes);
            let header = check_frame_header(bytes, obj(f, "header"), FrameKind::Ack);
            assert_eq!(header.body_len, 0);
            assert_eq!((header.flags, header.arg), (ack.level, ack.count));
        }
        "batch_ok" => {
            keys(f, &["header", "count"], &[]);
            let ok = BatchOk {
                count: num(f, "count"),
                discard_rest: false,
            };
            assert_bytes("batch_ok", &ok.encode(), bytes);
            let header = check_frame_header(bytes, obj(f, "header"), FrameKind::BatchOk);
            assert_eq!(
                (header.flags, header.body_len, header.arg),
                (0, 0, ok.count)
            );
        }
        "error" => {
            keys(f, &["header", "body"], &[]);
            let body = obj(f, "body");
            keys(
                body,
                &[
                    "code",
                    "code_name",
                    "retriable",
                    "text_len",
                    "session_epoch",
                    "text",
                ],
                &[],
            );
            let code = ErrorCode::from_u16(int(body, "code")).expect("known error code");
            assert_eq!(string(body, "code_name"), format!("{code:?}"), "code_name");
            assert_eq!(
                num(body, "retriable"),
                code.is_retriable() as u64,
                "retriable"
            );
            let text = string(body, "text");
            assert_eq!(num(body, "text_len"), text.len() as u64, "text_len");
            let header = check_frame_header(bytes, obj(f, "header"), FrameKind::Error);
            let frame = ErrorFrame {
                code,
                batch_seq: header.arg,
                session_epoch: num(body, "session_epoch"),
                message: text.to_string(),
            };
            assert_bytes("error", &frame.encode(), bytes);
            let decoded = ErrorFrame::decode(&header, &bytes[FRAME_HEADER_LEN..]).unwrap();
            assert_eq!(decoded, frame);
            let body_bytes = &bytes[FRAME_HEADER_LEN..];
            let after_text = 8 + text.len();
            let epoch =
                u64::from_le_bytes(body_bytes[after_text..after_text + 8].try_into().unwrap());
            assert_eq!(
                epoch,
                num(body, "session_epoch"),
                "session_epoch after the text"
            );
            assert_eq!(
                body_bytes.len(),
                after_text + 8,
                "nothing after session_epoch"
            );
            check_layout(body_bytes, ERROR_BODY_LAYOUT, body, &[(8, after_text + 8)]);
        }
        "delivery_header" | "delivery" => {
            let full = frame == "delivery";
            if full {
                keys(f, &["header", "delivery_header", "messages"], &[]);
            } else {
                keys(f, &["header", "delivery_header"], &[]);
            }
            let dh_fields = obj(f, "delivery_header");
            let dh = delivery_header_from(dh_fields);
            let prefix = FRAME_HEADER_LEN + DELIVERY_HEADER_LEN;
            let header_json = frame_header_from(obj(f, "header"));
            assert_eq!(
                header_json,
                dh.frame_header(),
                "frame header of the delivery"
            );
            let mut encoded = dh.frame_header().encode().to_vec();
            encoded.extend_from_slice(&dh.encode());
            let messages = if full {
                messages_from(arr(f, "messages"))
            } else {
                Vec::new()
            };
            if full {
                encoded.extend_from_slice(&encode_messages(&messages));
                check_frame_header(bytes, obj(f, "header"), FrameKind::Delivery);
            } else {
                assert_eq!(bytes.len(), prefix, "delivery_header is the first 80 bytes");
                check_layout(
                    &bytes[..FRAME_HEADER_LEN],
                    FRAME_HEADER_LAYOUT,
                    obj(f, "header"),
                    &[],
                );
            }
            assert_bytes(frame, &encoded, bytes);
            assert_eq!(
                FrameHeader::decode(bytes, u32::MAX).unwrap(),
                dh.frame_header()
            );
            let decoded = DeliveryHeader::decode(&bytes[FRAME_HEADER_LEN..]).expect("decodes");
            assert_eq!(decoded, dh);
            check_layout(
                &bytes[FRAME_HEADER_LEN..prefix],
                DELIVERY_HEADER_LAYOUT,
                dh_fields,
                &[],
            );
            if full {
                let payload = &bytes[prefix..];
                assert_eq!(payload.len(), dh.payload_len as usize, "payload_len");
                assert_eq!(messages.len(), dh.num_msg as usize, "num_msg");
                check_messages(payload, &messages);
                // A subscriber can validate a delivered batch like the broker did.
                let as_batch = BatchHeader {
                    batch_seq: dh.batch_seq,
                    client_id: dh.client_id,
                    num_msg: dh.num_msg,
                    total_size: dh.payload_len as u64,
                    ..Default::default()
                };
                validate_batch_payload(&as_batch, payload, limits.max_message)
                    .expect("delivered batch validates");
            }
        }
        "batch_header" => {
            let h = batch_header_from(f);
            assert_bytes("batch_header", &h.encode(), bytes);
            assert_eq!(BatchHeader::decode(bytes).expect("decodes"), h);
            check_layout(bytes, BATCH_HEADER_LAYOUT, f, &[]);
            h.validate_incoming(limits.max_batch)
                .expect("header validates");
        }
        "blog_message_header" => {
            let h = message_header_from(f);
            assert_bytes("blog_message_header", &h.encode(), bytes);
            assert_eq!(BlogMessageHeader::decode(bytes).expect("decodes"), h);
            check_layout(bytes, MESSAGE_HEADER_LAYOUT, f, &[]);
        }
        "publish_batch" => {
            keys(f, &["batch_header", "messages"], &[]);
            let hf = obj(f, "batch_header");
            let h = batch_header_from(hf);
            let messages = messages_from(arr(f, "messages"));
            let mut encoded = h.encode().to_vec();
            encoded.extend_from_slice(&encode_messages(&messages));
            assert_bytes("publish_batch", &encoded, bytes);
            assert_eq!(BatchHeader::decode(bytes).expect("decodes"), h);
            check_layout(&bytes[..BATCH_HEADER_LEN], BATCH_HEADER_LAYOUT, hf, &[]);
            let payload = &bytes[BATCH_HEADER_LEN..];
            assert_eq!(payload.len() as u64, h.total_size, "total_size");
            assert_eq!(messages.len(), h.num_msg as usize, "num_msg");
            h.validate_incoming(limits.max_batch)
                .expect("header validates");
            validate_batch_payload(&h, payload, limits.max_message).expect("payload validates");
            check_messages(payload, &messages);
        }
        other => panic!("no positive check for frame {other:?}"),
    }
}

fn check_negative(frame: &str, bytes: &[u8], limits: Limits, top: &Obj) {
    let body = || bytes.get(FRAME_HEADER_LEN..).unwrap_or(&[]);
    let result: Result<(), WireError> = match frame {
        "hello" => Hello::decode(bytes).map(drop),
        "hello_ok" => {
            FrameHeader::decode(bytes, u32::MAX).and_then(|_| HelloOk::decode(body()).map(drop))
        }
        "error" => FrameHeader::decode(bytes, u32::MAX)
            .and_then(|h| ErrorFrame::decode(&h, body()).map(drop)),
        "delivery_header" | "delivery" => FrameHeader::decode(bytes, u32::MAX)
            .and_then(|_| DeliveryHeader::decode(body()).map(drop)),
        "frame_header" => FrameHeader::decode(bytes, u32::MAX).map(drop),
        "batch_header" => {
            BatchHeader::decode(bytes).and_then(|h| h.validate_incoming(limits.max_batch))
        }
        "publish_batch" => BatchHeader::decode(bytes).and_then(|h| {
            h.validate_incoming(limits.max_batch)?;
            validate_batch_payload(&h, &bytes[BATCH_HEADER_LEN..], limits.max_message)
        }),
        other => panic!("no negative check for frame {other:?}"),
    };
    let err = match result {
        Ok(()) => panic!(
            "accepted, but the vector expects {:?}",
            string(top, "expect_error")
        ),
        Err(e) => e,
    };
    assert_eq!(
        error_name(&err),
        string(top, "expect_error"),
        "wrong error: {err}"
    );
    match (error_fields(&err), top.get("error_fields")) {
        (Some(want), Some(got)) => assert_eq!(got, &want, "error_fields of {err}"),
        (None, None) => {}
        (Some(want), None) => panic!("error_fields missing; the error carries {want}"),
        (None, Some(_)) => panic!("error_fields given, but {} has none", error_name(&err)),
    }
    match top.get("expect_code") {
        Some(_) => {
            let code = ErrorCode::for_wire_error(&err);
            assert_eq!(num(top, "expect_code"), code as u64, "expect_code");
            assert_eq!(
                string(top, "expect_code_name"),
                format!("{code:?}"),
                "expect_code_name"
            );
        }
        None => assert!(
            !top.contains_key("expect_code_name"),
            "expect_code_name without expect_code"
        ),
    }
}

/// The name a vector uses for an error: the variant of [`WireError`].
fn error_name(e: &WireError) -> &'static str {
    match e {
        WireError::BadMagic(_) => "BadMagic",
        WireError::UnsupportedVersion(_) => "UnsupportedVersion",
        WireError::Short { .. } => "Short",
        WireError::InvalidField { .. } => "InvalidField",
        WireError::InvalidTopicName(_) => "InvalidTopicName",
        WireError::MalformedBatch(_) => "MalformedBatch",
        WireError::MessageTooLarge { .. } => "MessageTooLarge",
        WireError::BatchTooLarge { .. } => "BatchTooLarge",
    }
}

/// The structured data of an error, as `error_fields` states it. Errors that carry
/// only free text have none.
pub(crate) fn error_fields(e: &WireError) -> Option<Value> {
    use serde_json::json;
    match e {
        WireError::BadMagic(m) => Some(json!({ "magic": hex::encode(m) })),
        WireError::UnsupportedVersion(v) => Some(json!({ "version": v })),
        WireError::Short { need, have } => Some(json!({ "need": need, "have": have })),
        WireError::InvalidField { field, value } => Some(json!({ "field": field, "value": value })),
        WireError::MessageTooLarge { size, max } | WireError::BatchTooLarge { size, max } => {
            Some(json!({ "size": size, "max": max }))
        }
        WireError::InvalidTopicName(_) | WireError::MalformedBatch(_) => None,
    }
}
