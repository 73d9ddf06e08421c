//! Writes the starting corpus of every target: `seeds TESTDATA_WIRE_DIR OUT_DIR`.
//! Wire frames come from the test vectors (hex in `testdata/wire/*.json`); the other
//! targets get hand-made seeds built with the real encoders (a region header from
//! `Region::create`, segment files from `TopicStore`, the default configuration).
//! Not a fuzz target.
use embarcadero_region::{Capacities, Region, GOI_SESSION_START};
use embarcadero_replication::record::RecordHeader;
use embarcadero_replication::store::list_segments;
use embarcadero_replication::TopicStore;
use embarcadero_server::fuzzing::BODY_ENDPOINTS;
use embarcadero_server::ServerConfig;
use std::path::{Path, PathBuf};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

struct Out(PathBuf);

impl Out {
    fn put(&self, target: &str, name: &str, bytes: &[u8]) {
        let dir = self.0.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

fn wire(vectors: &Path, out: &Out) {
    let mut files: Vec<_> = std::fs::read_dir(vectors)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    for path in files {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let bytes = hex(v["hex"].as_str().expect("hex"));
        let limit = |key: &str, default: u64| v["limits"][key].as_u64().unwrap_or(default) as u32;
        match v["frame"].as_str().expect("frame") {
            "hello" => out.put("wire_hello", &name, &bytes),
            "batch_header" | "publish_batch" => {
                let mut seed = limit("max_message_bytes", 1 << 20).to_le_bytes().to_vec();
                seed.extend_from_slice(&limit("max_batch_bytes", 4 << 20).to_le_bytes());
                seed.extend_from_slice(&bytes);
                out.put("wire_batch", &name, &seed);
            }
            "blog_message_header" => {}
            _ => out.put("wire_frames", &name, &bytes),
        }
    }
}

fn region(out: &Out) {
    let dir = std::env::temp_dir().join(format!("embd-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let small = Capacities {
        max_topics: 1,
        brokers: 1,
        goi_slots: 8,
        pbr_slots: 8,
        segment_bytes: 4096,
        segments_per_broker: 2,
        seg_map_slots: 8,
    };
    for (name, caps) in [("small", small), ("default", Capacities::default())] {
        let path = dir.join(name);
        let region = Region::create(&path, caps).unwrap();
        drop(region);
        let head = std::fs::read(&path).unwrap()[..96].to_vec();
        out.put("region_header", name, &head);
        let mut short = head.clone();
        short.extend_from_slice(&4096u64.to_le_bytes());
        out.put("region_header", &format!("{name}_truncated"), &short);
        std::fs::remove_file(&path).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn replication(out: &Out) {
    let dir = std::env::temp_dir().join(format!("embd-seeds-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut store = TopicStore::open(&dir, 1 << 20).unwrap();
    store.start_at(10, 100).unwrap();
    for i in 0..4u64 {
        let payload = vec![i as u8; 64 * (i as usize + 1)];
        let h = RecordHeader {
            seq: store.next_seq(),
            total_order: store.next_position(),
            batch_id: 1000 + i,
            client_id: 5,
            client_seq: i,
            session_epoch: 1,
            payload_len: payload.len() as u32,
            num_msg: i as u32 + 1,
            payload_crc: crc32fast::hash(&payload),
            broker_id: 1,
            flags: if i == 0 { GOI_SESSION_START } else { 0 },
            pbr_index: i,
        };
        store.append(&h, &payload).unwrap();
    }
    store.sync().unwrap();
    drop(store);
    let segments = list_segments(&dir).unwrap();
    let seg = &segments[0];
    let bytes = std::fs::read(&seg.path).unwrap();
    for (name, ctl, len) in [
        ("log", 0u8, bytes.len()),
        ("log_fixed_split_append", 1 | 2 | 4, bytes.len()),
        ("log_renumbered", 1 | 8, bytes.len()),
        ("log_torn", 4, bytes.len() - 10),
        ("log_empty", 4, 0),
    ] {
        let mut seed = vec![ctl, 1];
        seed.extend_from_slice(&seg.first_seq.to_le_bytes());
        seed.extend_from_slice(&seg.first_position.to_le_bytes());
        seed.extend_from_slice(&bytes[..len]);
        out.put("replication_segment", name, &seed);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn admin(out: &Out) {
    let topic = br#"{"name": "orders", "order": 2, "replication_factor": 2, "default_ack": 2, "retention_bytes": 1000000, "retention_ms": 60000}"#;
    // The first byte is the index into BODY_ENDPOINTS, looked up by path so the seeds
    // follow the list when it changes (it grew from five to six with `/v1/services`).
    let bodies: [(&str, &str, &[u8]); 6] = [
        ("topics", "/v1/topics", topic),
        (
            "services",
            "/v1/services",
            br#"{"kind": "workflow", "addr": "10.0.0.2:1216", "ttl_ms": 3000}"#,
        ),
        ("claim", "/v1/cluster/claim", br#"{"id": 1, "incarnation": 7}"#),
        (
            "join",
            "/v1/cluster/join",
            br#"{"id": 1, "addr": "10.0.0.2:1215", "incarnation": 7}"#,
        ),
        ("heartbeat", "/v1/cluster/heartbeat", br#"{"id": 1, "incarnation": 7}"#),
        (
            "failover",
            "/v1/failover",
            br#"{"topic": "t", "broker": 2, "incarnation": 3, "client_id": 7, "batch_ids": [40, 41], "ack_level": 1}"#,
        ),
    ];
    for (name, path, body) in bodies {
        let endpoint = BODY_ENDPOINTS
            .iter()
            .position(|e| *e == path)
            .expect("an admin endpoint with a JSON body") as u8;
        let mut seed = vec![endpoint, 2];
        seed.extend_from_slice(body);
        out.put("admin_json", name, &seed);
    }
    let post = |url: &str, body: &[u8], extra: &str| {
        let mut r = format!(
            "POST {url} HTTP/1.1\r\nHost: localhost:1214\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    };
    out.put(
        "http_request",
        "get_healthz",
        b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n",
    );
    out.put(
        "http_request",
        "get_topic",
        b"GET /v1/topics/orders?x=1 HTTP/1.0\r\n\r\n",
    );
    out.put("http_request", "post_topic", &post("/v1/topics", topic, ""));
    out.put(
        "http_request",
        "post_join_continue",
        &post(
            "/v1/cluster/join",
            br#"{"id": 1, "addr": "10.0.0.2:1215", "incarnation": 7}"#,
            "Expect: 100-continue\r\n",
        ),
    );
    out.put(
        "http_request",
        "chunked",
        b"POST /v1/topics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    );
}

fn config(out: &Out) {
    out.put(
        "config_toml",
        "default",
        ServerConfig::default().to_toml().as_bytes(),
    );
    out.put(
        "config_toml",
        "small",
        b"data_dir = \"/tmp/x\"\nbrokers = 2\n[region]\ngoi_slots = 64\n[broker]\nmax_message_bytes = 1024\nlow_watermark = 0.5\n[cluster]\nlocal_brokers = \"0,1\"\n",
    );
    out.put(
        "config_toml",
        "with_env",
        b"brokers = 1\n\0EMBARCADERO_BROKERS=3\nEMBARCADERO_REGION_GOI_SLOTS=64\nEMBARCADERO_REPLICATION_DIRS=/a,/b\nEMBARCADERO_BROKER_HIGH_WATERMARK=0.9\n",
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, vectors, out] = &args[..] else {
        eprintln!("usage: seeds TESTDATA_WIRE_DIR OUT_DIR");
        std::process::exit(2);
    };
    let out = Out(PathBuf::from(out));
    wire(Path::new(vectors), &out);
    region(&out);
    replication(&out);
    admin(&out);
    config(&out);
}
