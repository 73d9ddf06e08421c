//! Writes the starting corpus of every target: `seeds TESTDATA_WIRE_DIR OUT_DIR`.
//! Wire frames come from the test vectors (hex in `testdata/wire/*.json`); the other
//! targets get hand-made seeds built with the real encoders (a region header from
//! `Region::create`, segment files from `TopicStore`, the default configuration, workflow
//! logs from `event::encode` of a fold's events and the orchestrator's decisions).
//! Not a fuzz target.
use embarcadero_region::{Capacities, Region, GOI_SESSION_START};
use embarcadero_replication::record::RecordHeader;
use embarcadero_replication::store::list_segments;
use embarcadero_replication::TopicStore;
use embarcadero_server::fuzzing::BODY_ENDPOINTS;
use embarcadero_server::ServerConfig;
use embarcadero_workflow::decide::{decide, Clock};
use embarcadero_workflow::event::{encode, Envelope};
use embarcadero_workflow::{Event, Outcome, State, StepRef, StepState};
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

const DIAMOND: &str = "name: diamond\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: x}, retry: {max_attempts: 2, backoff: none}}
  - {name: b, dependencies: [a], handler: {callable: x}}
  - {name: c, dependencies: [a], handler: {callable: x}}
  - {name: d, dependencies: [b, c], handler: {callable: x}}
";
const CONDITIONAL: &str = "name: cond\nnamespace: p\nversion: '1'\nsteps:
  - {name: a, handler: {callable: x}}
  - {name: d, type: decision, dependencies: [a], handler: {callable: x}}
  - {name: b1, dependencies: [d], handler: {callable: x}}
  - {name: b2, dependencies: [d], handler: {callable: x}}
  - {name: j, type: deferred_convergence, dependencies: [b1, b2], handler: {callable: x}}
lifecycle: {max_duration_minutes: 5}
";
const BATCH: &str = "name: batch\nnamespace: p\nversion: '1'\nsteps:
  - {name: an, type: batchable, handler: {callable: x}, batch_config: {failure_strategy: fail_fast}}
  - {name: w, type: batch_worker, dependencies: [an], handler: {callable: x}, retry: {max_attempts: 1}}
  - {name: agg, type: deferred_convergence, dependencies: [w], handler: {callable: x}}
input_schema: {type: object, properties: {n: {type: integer, minimum: 0}}, required: [n]}
";

/// A workflow log being written: each event applied to the state as the fold would, and
/// kept encoded, one message per line.
struct Log {
    state: State,
    lines: Vec<u8>,
}

impl Log {
    fn new() -> Self {
        let mut log = Self {
            state: State::default(),
            lines: Vec::new(),
        };
        let lease = Event::OrchestratorLease {
            term: 1,
            holder: "o1".into(),
            worker_lease_ms: 3000,
            quiet_lease_ms: 0,
        };
        log.push(lease, None);
        log
    }

    fn push(&mut self, event: Event, term: Option<u64>) {
        let env = Envelope {
            ts_ms: 1000 + self.state.next_position,
            term,
            event,
        };
        let _ = self.state.apply(self.state.next_position, &env);
        if !self.lines.is_empty() {
            self.lines.push(b'\n');
        }
        self.lines.extend_from_slice(&encode(&env));
    }

    fn task(&mut self, yaml: &str, task: &str, protocol: Option<u8>) {
        let template = embarcadero_workflow::validate::load(yaml, None).unwrap();
        let created = Event::TaskCreated {
            task: task.into(),
            namespace: template.namespace.clone(),
            name: template.name.clone(),
            version: template.version.clone(),
            context: serde_json::json!({"n": 3}),
            idempotency_key: Some(format!("key-{task}")),
            identity: None,
            protocol,
        };
        self.push(Event::TemplateRegistered { template }, None);
        self.push(created, None);
    }

    /// Runs every task to its end: the orchestrator's decisions (in term 1), a worker's
    /// claim and the handler's outcome for every attempt enqueued.
    fn run(&mut self, outcome: impl Fn(&StepRef) -> Outcome) {
        self.run_at(2000, 40, outcome);
    }

    /// The same at `now_ms` (the events are stamped from 1000 on), for `rounds` rounds.
    fn run_at(&mut self, now_ms: u64, rounds: usize, outcome: impl Fn(&StepRef) -> Outcome) {
        let clock = Clock {
            now_ms,
            lease_ms: 3000,
            claimed_at: &|_| Some(now_ms),
            worker_seen: &|_| Some(now_ms),
        };
        for _ in 0..rounds {
            for event in decide(&self.state, &clock).0 {
                self.push(event, Some(1));
            }
            let enqueued: Vec<StepRef> = (self.state.tasks.values())
                .flat_map(|t| t.steps.iter().map(move |s| (t, s)))
                .filter(|(_, s)| s.created && s.state == StepState::Enqueued)
                .map(|(t, s)| StepRef {
                    task: t.uuid.clone(),
                    step: s.name.clone(),
                    attempt: s.attempt,
                })
                .collect();
            for at in enqueued {
                let worker = "w1".to_string();
                let claim = Event::StepClaimed {
                    at: at.clone(),
                    worker: worker.clone(),
                };
                self.push(claim, None);
                let outcome = outcome(&at);
                self.push(
                    Event::StepResult {
                        at,
                        worker,
                        outcome,
                    },
                    None,
                );
            }
        }
    }
}

fn success(result: serde_json::Value) -> Outcome {
    Outcome::Success { result }
}

/// Workflow logs written by the real encoders: whole lives of tasks (a diamond whose
/// first step fails once, a decision, a batch, under protocols 1 and 2), an operator's
/// interventions, lease changes and messages that do not decode; and templates.
fn workflow(out: &Out) {
    let mut life = Log::new();
    life.task(DIAMOND, "t1", None);
    life.run(|at| match at.step.as_str() {
        "a" if at.attempt == 1 => Outcome::Failure {
            message: "busy".into(),
            retryable: true,
            retry_after_ms: Some(0),
        },
        _ => success(serde_json::json!(at.attempt)),
    });
    out.put("workflow_events", "diamond_life", &life.lines);

    let mut branches = Log::new();
    branches.task(CONDITIONAL, "t2", Some(2));
    branches.task(BATCH, "t3", None);
    branches.run(|at| match at.step.as_str() {
        "d" => success(serde_json::json!({"step_names": ["b1"]})),
        "an" => success(serde_json::json!({"cursors": [0, 10], "worker_count": 2})),
        _ => success(serde_json::json!({"ok": true})),
    });
    out.put("workflow_events", "decision_and_batch", &branches.lines);

    // The conditional task's `lifecycle` (5 minutes) runs out after its first step:
    // the orchestrator fails what is left with `step_stale` events.
    let mut stale = Log::new();
    stale.task(CONDITIONAL, "t6", None);
    stale.run_at(2000, 1, |at| success(serde_json::json!(at.attempt)));
    stale.run_at(1_000_000, 2, |at| success(serde_json::json!(at.attempt)));
    out.put("workflow_events", "stale", &stale.lines);

    let mut operator = Log::new();
    operator.task(DIAMOND, "t4", Some(2));
    operator.task(DIAMOND, "t5", None);
    let fail = |_: &StepRef| Outcome::Failure {
        message: "no".into(),
        retryable: false,
        retry_after_ms: None,
    };
    operator.run(fail);
    let at = |task: &str| StepRef {
        task: task.into(),
        step: "a".into(),
        attempt: 1,
    };
    let reason = || "operator".to_string();
    operator.push(
        Event::StepReset {
            at: at("t4"),
            reason: reason(),
        },
        None,
    );
    operator.push(
        Event::StepResolved {
            at: at("t5"),
            reason: reason(),
            complete: true,
            result: Some(serde_json::json!(1)),
        },
        None,
    );
    operator.push(
        Event::TaskRerun {
            task: "t4".into(),
            reason: reason(),
        },
        None,
    );
    operator.push(
        Event::TaskCancelled {
            task: "t4".into(),
            reason: reason(),
        },
        None,
    );
    operator.push(
        Event::TaskResolved {
            task: "t5".into(),
            reason: reason(),
        },
        None,
    );
    operator.push(
        Event::Heartbeat {
            worker: "w1".into(),
        },
        None,
    );
    let release = Event::OrchestratorRelease {
        term: 1,
        holder: "o1".into(),
    };
    operator.push(release, None);
    let bid = Event::OrchestratorLease {
        term: 2,
        holder: "o2".into(),
        worker_lease_ms: 0,
        quiet_lease_ms: 30_000,
    };
    operator.push(bid, None);
    operator
        .lines
        .extend_from_slice(b"\n\x02{}\n\x01{\"kind\":\"nope\"}\n");
    out.put("workflow_events", "operator_and_leases", &operator.lines);

    for (name, text) in [
        ("diamond", DIAMOND),
        ("conditional", CONDITIONAL),
        ("batch", BATCH),
    ] {
        out.put(
            "workflow_template",
            &format!("{name}_yaml"),
            text.as_bytes(),
        );
        let t = embarcadero_workflow::validate::load(text, None).unwrap();
        let json = serde_json::to_vec(&t).unwrap();
        out.put("workflow_template", &format!("{name}_json"), &json);
    }
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
    workflow(&out);
}
