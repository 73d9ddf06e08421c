//! The workflow engine end to end: a real `embarcadero serve`, a real orchestrator and
//! real workers (`embarcadero orchestrator` / `embarcadero worker`), driven through the
//! API and the CLI; workers are paused or killed and the orchestrator restarted.

mod common;

use common::{failed, ok, run_bin, Proc, Serve};
use embarcadero_workflow::client::ApiClient;
use serde_json::{json, Value};
use std::io::BufReader;
use std::net::TcpStream;
use std::time::{Duration, Instant};

const LINEAR: &str = "name: linear
namespace: demo
version: 1.0.0
description: square the even number four times
input_schema:
  type: object
  required: [even_number]
  properties: {even_number: {type: integer, multipleOf: 2}}
steps:
  - {name: one, handler: {callable: math.square}}
  - {name: two, dependencies: [one], handler: {callable: math.square}}
  - {name: three, dependencies: [two], handler: {callable: math.square}}
  - {name: four, dependencies: [three], handler: {callable: math.square}}
";

const DIAMOND: &str = "name: diamond
namespace: demo
version: 1.0.0
steps:
  - {name: start, handler: {callable: math.square}}
  - {name: left, dependencies: [start], handler: {callable: math.square}}
  - {name: right, dependencies: [start], handler: {callable: math.square}}
  - {name: end, dependencies: [left, right], handler: {callable: math.square}}
";

const FLAKY: &str = "name: flaky
namespace: demo
version: 1.0.0
steps:
  - name: once
    handler: {callable: test.fail_times, initialization: {failures: 1}}
    retry: {max_attempts: 3, backoff: linear, backoff_base_ms: 50}
  - name: always
    dependencies: [once]
    handler: {callable: test.fail_times, initialization: {failures: 100}}
    retry: {max_attempts: 2, backoff: exponential, backoff_base_ms: 20}
";

/// One slow step (for pausing its worker), then a quick one.
const SLOW: &str = "name: slow
namespace: demo
version: 1.0.0
steps:
  - {name: nap, handler: {callable: test.sleep, initialization: {ms: 1500}}}
  - {name: after, dependencies: [nap], handler: {callable: test.sleep}}
";

/// Tasker's conditional shape: a decision creates some of four branches (those the
/// context lists), a deferred convergence waits for the ones created.
const CONDITIONAL: &str = include_str!("../../../testdata/workflow/conditional.yaml");

/// Tasker's CSV batch: analyze splits the rows among workers, one instance of
/// `process` per cursor, `aggregate` converges them. `STRATEGY` and `PAUSE` (after each
/// checkpoint, ms) are filled in per test.
const CSV: &str = "name: csv_STRATEGY
namespace: demo
version: 1.0.0
steps:
  - name: analyze
    type: batchable
    handler: {callable: csv.analyze}
    batch_config: {failure_strategy: STRATEGY}
  - name: process
    type: batch_worker
    dependencies: [analyze]
    handler: {callable: csv.process_batch, initialization: {pause_ms: PAUSE}}
    retry: {max_attempts: 1}
  - name: aggregate
    type: deferred_convergence
    dependencies: [process]
    handler: {callable: csv.aggregate}
";

/// One step, under the identity strategy `STRATEGY` (filled in per template).
const IDENTITY: &str = "name: id_STRATEGY
namespace: demo
version: 1.0.0
identity_strategy: STRATEGY
steps:
  - {name: one, handler: {callable: math.square, initialization: {input: x}}}
";

/// A step that sleeps for a minute under a 0.6 s (0.01 min) in-process threshold.
const STALE: &str = "name: stale
namespace: demo
version: 1.0.0
lifecycle: {max_steps_in_process_minutes: 0.01}
steps:
  - {name: nap, timeout_seconds: 120, handler: {callable: test.sleep, initialization: {ms: 60000}}}
  - {name: after, dependencies: [nap], handler: {callable: test.sleep}}
";

/// Two parallel steps that fail their first attempt, with no retry; then a join.
const RERUN: &str = "name: rerun
namespace: demo
version: 1.0.0
steps:
  - {name: left, retry: {max_attempts: 1}, handler: {callable: test.fail_times, initialization: {failures: 1}}}
  - {name: right, retry: {max_attempts: 1}, handler: {callable: test.fail_times, initialization: {failures: 1}}}
  - {name: join, dependencies: [left, right], handler: {callable: test.fail_times, initialization: {failures: 0}}}
";

fn csv(strategy: &str, pause_ms: u64) -> String {
    CSV.replace("STRATEGY", strategy)
        .replace("PAUSE", &pause_ms.to_string())
}

/// The inventory value of the first `rows` rows of csv.process_batch's synthetic CSV.
fn csv_value(rows: std::ops::Range<u64>) -> u64 {
    rows.map(|i| (100 + (i * 37) % 1000) * (1 + i % 9)).sum()
}

/// The position at which a step entered `state` (its first time).
fn entered_at(step: &Value, state: &str) -> Option<u64> {
    let moves = step["transitions"].as_array().unwrap();
    moves.iter().find(|m| m["to"] == state)?["position"].as_u64()
}

/// A server and the engine's processes on it.
struct Engine {
    serve: Serve,
    _dir: tempfile::TempDir,
}

impl Engine {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let serve = Serve::start(dir.path());
        Self { serve, _dir: dir }
    }

    /// Starts an orchestrator; returns it and its API address.
    fn orchestrator(&self, lease_ms: &str) -> (Proc, String) {
        self.orchestrator_with(lease_ms, &[])
    }

    /// The same with more arguments.
    fn orchestrator_with(&self, lease_ms: &str, more: &[&str]) -> (Proc, String) {
        let mut args = vec![
            "orchestrator",
            "--control",
            &self.serve.control,
            "--listen",
            "127.0.0.1:0",
            "--lease-ms",
            lease_ms,
        ];
        args.extend_from_slice(more);
        let (p, line) = Proc::ready(&args, &[], "workflow orchestrator is serving");
        let api = line.rsplit("http://").next().unwrap().trim().to_string();
        (p, api)
    }

    /// Starts a worker; returns it and its id.
    fn worker(&self, lease_ms: &str) -> (Proc, String) {
        self.worker_with(lease_ms, &[])
    }

    /// The same with more arguments.
    fn worker_with(&self, lease_ms: &str, more: &[&str]) -> (Proc, String) {
        let mut args = vec![
            "worker",
            "--control",
            &self.serve.control,
            "--lease-ms",
            lease_ms,
        ];
        args.extend_from_slice(more);
        let (p, line) = Proc::ready(&args, &[], "is running");
        let id = line
            .split("workflow worker ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_string();
        (p, id)
    }
}

/// The usual setup: a server, an orchestrator, some workers and the templates
/// registered. Fields drop in order: workers, then the orchestrator, then the server.
struct Stack {
    workers: Vec<(Proc, String)>,
    orchestrator: Proc,
    addr: String,
    api: ApiClient,
    engine: Engine,
}

impl Stack {
    fn start(lease_ms: &str, workers: usize, templates: &[&str]) -> Self {
        let engine = Engine::start();
        let (orchestrator, addr) = engine.orchestrator(lease_ms);
        let workers = (0..workers).map(|_| engine.worker(lease_ms)).collect();
        let api = ApiClient::new(&addr);
        for t in templates {
            register(&api, t);
        }
        Self {
            workers,
            orchestrator,
            addr,
            api,
            engine,
        }
    }
}

fn register(api: &ApiClient, yaml: &str) {
    api.register_template(yaml).unwrap();
}

fn create(api: &ApiClient, name: &str, context: Value) -> String {
    let t = api
        .create_task("demo", name, "1.0.0", context, None)
        .unwrap();
    t["task_uuid"].as_str().unwrap().to_string()
}

fn step<'a>(task: &'a Value, name: &str) -> &'a Value {
    task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap()
}

/// Polls the task until `cond` holds (at most 30 s).
fn until(api: &ApiClient, uuid: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = api.get_task(uuid, 0).unwrap();
        if cond(&t) {
            return t;
        }
        assert!(Instant::now() < deadline, "waited 30 s for {what}: {t:#}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An answer read off a plain socket: status, headers (names in lower case), body.
struct RawAnswer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl RawAnswer {
    fn header(&self, name: &str) -> Option<&str> {
        let found = self.headers.iter().find(|(k, _)| k == name);
        found.map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// One HTTP/1.1 request over a plain socket, read to its end (the API closes every
/// connection after its answer).
fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> RawAnswer {
    use std::io::Read;
    let (status, headers, mut reader) = send(addr, method, path, body);
    let mut body = String::new();
    reader.read_to_string(&mut body).unwrap();
    RawAnswer {
        status,
        headers,
        body,
    }
}

/// Sends a request and reads the answer's head; the reader is at the body. Each request
/// says `Connection: close`, so that reading the body to its end does not wait out the
/// workflow API's keep-alive (30 s idle).
/// Opens task `uuid`'s event stream at `addr` and reads it until the task's first step is
/// enqueued (with no worker running, the task is still open then): those events, and the
/// stream, still open.
fn events_until_enqueued(addr: &str, uuid: &str) -> (Vec<Value>, BufReader<TcpStream>) {
    let (status, headers, mut stream) =
        send(addr, "GET", &format!("/v1/tasks/{uuid}/events"), None);
    assert_eq!(status, 200);
    assert!(
        headers.contains(&("content-type".into(), "text/event-stream".into())),
        "{headers:?}"
    );
    let mut events = Vec::new();
    while events.last().is_none_or(|e: &Value| e["to"] != "enqueued") {
        events.push(next_event(&mut stream).expect("the stream stays open while the task runs"));
    }
    (events, stream)
}

fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Vec<(String, String)>, BufReader<TcpStream>) {
    send_with(addr, method, path, body, "")
}

/// [`send`] with `extra` (whole header lines, each ending in CRLF) in the head.
fn send_with(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    extra: &str,
) -> (u16, Vec<(String, String)>, BufReader<TcpStream>) {
    use std::io::{BufRead, Write};
    let mut socket = TcpStream::connect(addr).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Connection: close\r\n{extra}Content-Length: {}\r\n\r\n",
        body.len()
    );
    socket.write_all((head + &body).as_bytes()).unwrap();
    let mut reader = BufReader::new(socket);
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line.trim_end().is_empty() {
            break;
        }
        lines.push(line.trim_end().to_string());
    }
    let status = lines[0].split(' ').nth(1).unwrap().parse().unwrap();
    let headers = lines[1..]
        .iter()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, reader)
}

/// The next `data:` of a server-sent event stream (comments skipped); `None` at its end.
fn next_event(reader: &mut BufReader<TcpStream>) -> Option<Value> {
    use std::io::BufRead;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            return None;
        }
        if let Some(data) = line.strip_prefix("data: ") {
            return Some(serde_json::from_str(data).unwrap());
        }
    }
}

/// The next server-sent event (comments skipped): its `data:` and its `id:`, if it has
/// one; `None` at the stream's end.
fn next_event_with_id(reader: &mut BufReader<TcpStream>) -> Option<(Value, Option<u64>)> {
    use std::io::BufRead;
    let (mut data, mut id) = (None, None);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            assert!(data.is_none(), "the stream ended inside an event");
            return None;
        }
        let line = line.trim_end_matches('\n');
        if let Some(d) = line.strip_prefix("data: ") {
            data = Some(serde_json::from_str(d).unwrap());
        } else if let Some(i) = line.strip_prefix("id: ") {
            id = Some(i.parse().unwrap());
        } else if line.is_empty() {
            if let Some(event) = data.take() {
                return Some((event, id));
            }
        }
    }
}

/// `POST /v1/tasks` of `demo/{name}@1.0.0` over a plain socket (to see 200 from 201).
fn submit(addr: &str, name: &str, context: Value, key: Option<&str>) -> RawAnswer {
    let mut body =
        json!({"namespace": "demo", "name": name, "version": "1.0.0", "context": context});
    if let Some(k) = key {
        body["idempotency_key"] = json!(k);
    }
    http(addr, "POST", "/v1/tasks", Some(&body))
}

/// How many times a step entered `state` in its audit trail.
fn entered(step: &Value, state: &str) -> usize {
    transitions_to(step)
        .iter()
        .filter(|&&to| to == state)
        .count()
}

#[test]
fn linear_and_diamond_tasks_complete_with_the_right_results() {
    let stack = Stack::start("3000", 2, &[DIAMOND]);
    let (api, addr) = (&stack.api, &stack.addr);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("linear.yaml");
    std::fs::write(&file, LINEAR).unwrap();
    let out = run_bin(&[
        "template",
        "register",
        file.to_str().unwrap(),
        "--api",
        addr,
    ]);
    ok(&out);

    let out = run_bin(&[
        "task",
        "create",
        "--namespace",
        "demo",
        "--name",
        "linear",
        "--context",
        r#"{"even_number":2}"#,
        "--wait",
        "30",
        "--json",
        "--api",
        addr,
    ]);
    let t: Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(
        (t["status"].as_str(), t["completion_percentage"].as_f64()),
        (Some("complete"), Some(100.0))
    );
    assert_eq!(t["execution_status"], "all_complete");
    let results: Vec<&Value> = ["one", "two", "three", "four"]
        .iter()
        .map(|s| &step(&t, s)["result"])
        .collect();
    assert_eq!(results, [&json!(4), &json!(16), &json!(256), &json!(65536)]);

    let d = api
        .get_task(&create(api, "diamond", json!({"even_number": 2})), 30)
        .unwrap();
    assert_eq!(d["status"], "complete", "{d:#}");
    assert_eq!(
        (&step(&d, "left")["result"], &step(&d, "end")["result"]),
        (&json!(16), &json!(65536))
    );
    // Parallel branches go out together: both enqueued at the position where `start`
    // completed, and each held by a worker before the other one returned.
    let (left, right) = (step(&d, "left"), step(&d, "right"));
    assert_eq!(entered_at(left, "enqueued"), entered_at(right, "enqueued"));
    let [left_ran, right_ran] = [left, right].map(|s| entered_at(s, "in_progress").unwrap());
    let [left_back, right_back] =
        [left, right].map(|s| entered_at(s, "enqueued_for_orchestration").unwrap());
    assert!(
        left_ran < right_back && right_ran < left_back,
        "both in progress at once: {left:#} {right:#}"
    );

    let e = api
        .create_task("demo", "linear", "1.0.0", json!({"even_number": 3}), None)
        .unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (400, "invalid_input"), "{e}");
    assert!(e.message.contains("/even_number"), "{e}");
    let first = api
        .create_task(
            "demo",
            "diamond",
            "1.0.0",
            json!({"even_number": 4}),
            Some("k1"),
        )
        .unwrap();
    let again = api
        .create_task(
            "demo",
            "diamond",
            "1.0.0",
            json!({"even_number": 4}),
            Some("k1"),
        )
        .unwrap();
    assert_eq!(
        first["task_uuid"], again["task_uuid"],
        "the same idempotency key gives the same task"
    );
    // The CLI says when a create found an existing task (same template and context).
    let create = ["task", "create", "--namespace", "demo", "--name", "diamond"];
    let args = [
        &create[..],
        &["--context", r#"{"even_number":8}"#, "--api", addr],
    ]
    .concat();
    let (first, again) = (run_bin(&args), run_bin(&args));
    assert!(!String::from_utf8_lossy(&first.stderr).contains("already existed"));
    let note = String::from_utf8_lossy(&again.stderr);
    assert!(
        note.contains("already existed") && note.contains("--idempotency-key"),
        "{note}"
    );
    let uuid = |out: &std::process::Output| ok(out).split_whitespace().nth(1).map(str::to_string);
    assert_eq!(uuid(&first), uuid(&again), "the same task");
    let e = api.get_task("no-such-task", 0).unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (404, "not_found"));
    // A long poll for an unknown task is answered before its wait is over: 300 s asked,
    // a deadline of 60 s (it held the whole wait before).
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = api.clone();
    std::thread::spawn(move || tx.send(waiting.get_task("no-such-task", 300)));
    let answer = rx.recv_timeout(std::time::Duration::from_secs(60));
    let e = answer
        .expect("the long poll answered within 60 s")
        .unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (404, "not_found"));
}

#[test]
fn template_errors_name_the_template_step_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    let bad = LINEAR.replace("dependencies: [two]", "dependencies: [twoo]");
    std::fs::write(&file, &bad).unwrap();
    let out = run_bin(&["template", "validate", file.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("demo/linear@1.0.0")
            && err.contains("step `three`")
            && err.contains("field `dependencies`")
            && err.contains("twoo"),
        "{err}"
    );
    let out = run_bin(&["template", "validate", "--json", file.to_str().unwrap()]);
    assert!(
        !out.status.success(),
        "an invalid template fails with --json too"
    );
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&shown["valid"], &shown["step"], &shown["field"]),
        (&json!(false), &json!("three"), &json!("dependencies")),
        "{shown}"
    );
    std::fs::write(&file, LINEAR).unwrap();
    let valid = json_of(&run_bin(&[
        "template",
        "validate",
        "--json",
        file.to_str().unwrap(),
    ]));
    assert_eq!(
        (&valid["valid"], &valid["template"], &valid["steps"]),
        (&json!(true), &json!("demo/linear@1.0.0"), &json!(4)),
        "{valid}"
    );

    let engine = Engine::start();
    let (_orchestrator, addr) = engine.orchestrator("3000");
    let api = ApiClient::new(&addr);
    let e = api
        .register_template(&LINEAR.replace(
            "math.square}}\n  - {name: four",
            "math.cube}}\n  - {name: four",
        ))
        .unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (400, "invalid_template"));
    assert!(
        e.message.contains("step `three`")
            && e.message.contains("handler.callable")
            && e.message.contains("math.cube"),
        "{e}"
    );
    let e = api
        .register_template(&LINEAR.replace("dependencies: [one]", "dependencies: [four]"))
        .unwrap_err();
    assert!(e.message.contains("cycle"), "{e}");
    register(&api, LINEAR);
    let e = api
        .register_template(&LINEAR.replace("four times", "4 times"))
        .unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (409, "template_conflict"));
    let list = api.list_templates().unwrap();
    assert_eq!(list["templates"].as_array().unwrap().len(), 1);
}

/// The states an object's audit trail (`transitions`) moved it to, in order.
fn transitions_to(v: &Value) -> Vec<&str> {
    v["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["to"].as_str().unwrap())
        .collect()
}

/// `template show`'s text lines as (stage, step, type, what it waits for).
fn shown_steps(text: &str) -> Vec<(String, String, String, String)> {
    text.lines()
        .skip(1)
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = line.split(" after ").nth(1).unwrap_or_default();
            (
                words[0].into(),
                words[1].into(),
                words[2].into(),
                after.trim().into(),
            )
        })
        .collect()
}

#[test]
fn template_show_prints_a_dag_by_stage_as_dot_or_as_json_from_the_api_or_a_file() {
    let engine = Engine::start();
    let (_orchestrator, addr) = engine.orchestrator("3000");
    let api = ApiClient::new(&addr);
    register(&api, DIAMOND);
    // 1.10.0 is newer than 1.9.0 though it sorts first as text.
    let end_after_left = DIAMOND.replace("dependencies: [left, right]", "dependencies: [left]");
    register(&api, &end_after_left.replace("1.0.0", "1.10.0"));
    register(&api, &DIAMOND.replace("1.0.0", "1.9.0"));
    let show = |args: &[&str]| run_bin(&[&["template", "show"], args, &["--api", &addr]].concat());

    let newest = ok(&show(&["demo/diamond"]));
    assert!(
        newest.starts_with("demo/diamond@1.10.0: 4 steps in 3 stages\n"),
        "{newest}"
    );
    let steps = shown_steps(&newest);
    let row = |stage: &str, name: &str, after: &str| {
        (stage.into(), name.into(), "standard".into(), after.into())
    };
    assert_eq!(
        steps,
        vec![
            row("1", "start", "(start)"),
            row("2", "left", "start"),
            row("2", "right", "start"),
            row("3", "end", "left"),
        ],
        "{newest}"
    );
    let first = ok(&show(&["demo/diamond@1.0.0"]));
    assert_eq!(shown_steps(&first)[3].3, "left, right", "{first}");

    let dot = ok(&show(&["demo/diamond@1.0.0", "--dot"]));
    assert!(dot.starts_with("digraph \"demo/diamond@1.0.0\" {"), "{dot}");
    for edge in [
        "start\" -> \"left",
        "start\" -> \"right",
        "left\" -> \"end",
        "right\" -> \"end",
    ] {
        assert!(dot.contains(edge), "{edge} in {dot}");
    }
    assert_eq!(dot.matches("->").count(), 4, "{dot}");

    let json: Value = serde_json::from_str(&ok(&show(&["demo/diamond@1.9.0", "--json"]))).unwrap();
    assert_eq!(json["version"], "1.9.0");
    assert_eq!(json["steps"][3]["dependencies"], json!(["left", "right"]));
    assert_eq!(json["steps"][0]["handler"]["callable"], "math.square");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("linear.yaml");
    std::fs::write(&file, LINEAR).unwrap();
    let from_file = ok(&run_bin(&[
        "template",
        "show",
        "--file",
        file.to_str().unwrap(),
    ]));
    assert!(
        from_file.starts_with("demo/linear@1.0.0: 4 steps in 4 stages\n"),
        "{from_file}"
    );
    assert_eq!(shown_steps(&from_file)[3].0, "4", "{from_file}");

    let missing = failed(&show(&["demo/nope"]));
    assert!(
        missing.contains("no template demo/nope is registered")
            && missing.contains("template list"),
        "{missing}"
    );
    let missing = failed(&show(&["demo/diamond@3.0.0"]));
    assert!(missing.contains("demo/diamond@3.0.0"), "{missing}");
    let malformed = failed(&show(&["diamond"]));
    assert!(malformed.contains("NAMESPACE/NAME"), "{malformed}");

    // `task create` without --version starts the newest version, as `template show`.
    let create = |args: &[&str]| {
        let base = ["task", "create", "--namespace", "demo", "--name", "diamond"];
        run_bin(&[&base[..], args, &["--api", &addr, "--json"]].concat())
    };
    let created: Value = serde_json::from_str(&ok(&create(&[]))).unwrap();
    assert_eq!(created["version"], "1.10.0", "{created}");
    let not_an_object = failed(&create(&["--context", "[1, 2]"]));
    assert!(
        not_an_object.contains("--context is a JSON object"),
        "{not_an_object}"
    );
}

#[test]
fn failing_steps_are_retried_by_their_policy_and_then_fail_the_task() {
    let stack = Stack::start("3000", 1, &[FLAKY]);
    let api = &stack.api;
    let t = api.get_task(&create(api, "flaky", json!({})), 30).unwrap();
    assert_eq!(t["status"], "error", "{t:#}");
    let once = step(&t, "once");
    assert_eq!(
        (&once["current_state"], &once["attempts"], &once["result"]),
        (&json!("complete"), &json!(2), &json!({"attempt": 2}))
    );
    assert_eq!(entered(once, "waiting_for_retry"), 1);
    let always = step(&t, "always");
    assert_eq!(
        (
            &always["current_state"],
            &always["attempts"],
            &always["failures"]
        ),
        (&json!("error"), &json!(2), &json!(2))
    );
    assert!(
        always["last_error"]
            .as_str()
            .unwrap()
            .contains("max attempts (2)"),
        "{always:#}"
    );
    let task_states = transitions_to(&t);
    assert!(
        task_states.contains(&"waiting_for_retry") && task_states.ends_with(&["error"]),
        "{task_states:?}"
    );
}

/// A handler that outlives its step's one-second timeout, twice.
const SLEEPY: &str = "name: sleepy
namespace: demo
version: 1.0.0
steps:
  - name: nap
    timeout_seconds: 1
    handler: {callable: test.sleep, initialization: {ms: 1300}}
    retry: {max_attempts: 2, backoff: none}
";

#[test]
fn a_handler_past_its_timeout_fails_its_attempt_and_its_late_value_is_dropped() {
    // A lease of ten minutes: the orchestrator's backstop (timeout + lease) cannot take
    // the attempts back while the test runs, so the timeouts seen are the worker's.
    let stack = Stack::start("600000", 1, &[SLEEPY]);
    let api = &stack.api;
    let t = api.get_task(&create(api, "sleepy", json!({})), 30).unwrap();
    assert_eq!(t["status"], "error", "{t:#}");
    let nap = step(&t, "nap");
    assert_eq!(
        (&nap["attempts"], &nap["failures"], &nap["lease_losses"]),
        (&json!(2), &json!(2), &json!(0)),
        "{nap:#}"
    );
    let error = nap["last_error"].as_str().unwrap();
    assert!(
        error.contains("max attempts (2) reached: timed out after 1 s"),
        "{error}"
    );
    // Attempt 1's handler finished (at 1.3 s) while attempt 2 ran: had its late value
    // been published, the fold would have refused it as superseded.
    assert_eq!(entered(nap, "enqueued_for_orchestration"), 2);
    assert!(
        !nap["refused_events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r.as_str().unwrap().contains("step_result")),
        "{nap:#}"
    );
}

/// `task wait` tells a script a task still running when the wait ran out (exit 124, as
/// `timeout`; 2 is a usage error) from
/// one that ended without completing (exit 1, in
/// `a_failed_step_blocks_its_task_and_a_manual_resolution_lets_its_dependents_run`): with no
/// worker, the task cannot finish.
#[test]
fn a_wait_that_runs_out_exits_124() {
    let stack = Stack::start("3000", 0, &[SLOW]);
    let uuid = create(&stack.api, "slow", json!({}));
    let out = run_bin(&[
        "task",
        "wait",
        &uuid,
        "--timeout",
        "1",
        "--api",
        &stack.addr,
    ]);
    assert_eq!(out.status.code(), Some(124), "{}", failed(&out));
    assert!(failed(&out).contains("the wait ran out"));
}

/// A step that sleeps for ten minutes (its timeout too), and a quick task after it.
const NAPPING: &str = "name: napping
namespace: demo
version: 1.0.0
steps:
  - {name: nap, timeout_seconds: 600, handler: {callable: test.sleep, initialization: {ms: 600000}}}
";

const QUICK: &str = "name: quick
namespace: demo
version: 1.0.0
steps:
  - {name: only, handler: {callable: math.square}}
";

/// A running step whose task is cancelled is called off: the worker tells its handler
/// (the built-in `test.sleep` stops at once) and frees the attempt's slot without
/// waiting for it, so a worker with one slot runs the next task's step while the
/// cancelled one would still sleep for ten minutes (before, the cancel never reached a
/// running handler and its slot stayed taken until the step's timeout).
#[test]
fn a_cancelled_tasks_running_step_is_called_off_and_frees_its_workers_slot() {
    let stack = Stack::start("3000", 0, &[NAPPING, QUICK]);
    let (mut worker, _) = stack.engine.worker_with("3000", &["--concurrency", "1"]);
    let napping = create(&stack.api, "napping", json!({}));
    until(&stack.api, &napping, "the nap to run", |t| {
        step(t, "nap")["current_state"] == "in_progress"
    });
    let cancelled = stack.api.cancel_task(&napping).unwrap();
    assert_eq!(cancelled["status"], "cancelled", "{cancelled:#}");
    assert!(worker.wait_line("attempt called off").contains("step=nap"));
    let quick = create(&stack.api, "quick", json!({"even_number": 4}));
    let done = stack
        .api
        .wait_task(&quick, Some(Duration::from_secs(60)))
        .unwrap();
    assert_eq!(done["status"], "complete", "{done:#}");
    assert_eq!(step(&done, "only")["result"], json!(16));
}

/// A worker started with a longer lease than the orchestrator's heartbeated too seldom:
/// every attempt of a step longer than the orchestrator's lease was taken back while it
/// ran and run again, five times, then the task failed (a newcomer's first hour). The
/// orchestrator tells its lease in its lease events, and the worker heartbeats by it:
/// the 1.5 s step (five of the orchestrator's 300 ms leases) runs once.
#[test]
fn a_worker_with_a_longer_lease_heartbeats_by_the_orchestrators() {
    let engine = Engine::start();
    let (_orchestrator, addr) = engine.orchestrator("300");
    let (worker, _) = engine.worker("3000");
    let api = ApiClient::new(&addr);
    register(&api, SLOW);
    let t = api.get_task(&create(&api, "slow", json!({})), 60).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let nap = step(&t, "nap");
    assert_eq!(
        (nap["attempts"].as_u64(), nap["lease_losses"].as_u64()),
        (Some(1), Some(0)),
        "{nap:#}"
    );
    assert!(worker.printed("heartbeating every 100 ms instead"));
}

/// A paused worker loses its claim to another, and its outcome, when it wakes, does not count
/// (refused by the fold, or never published: called off once it reads its attempt was taken
/// back).
#[test]
fn a_paused_worker_loses_its_claim_and_its_late_outcome_does_not_count() {
    let mut stack = Stack::start("1000", 1, &[SLOW]);
    let (first, first_id) = stack.workers.pop().unwrap();
    let (api, engine) = (&stack.api, &stack.engine);
    let uuid = create(api, "slow", json!({}));
    until(api, &uuid, "the first worker's claim", |t| {
        step(t, "nap")["worker"] == first_id.as_str()
    });
    first.signal("STOP");
    let (_second, second_id) = engine.worker("1000");
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let nap = step(&t, "nap");
    // The first worker's attempt was taken back (a very slow machine may also take one
    // of the second worker's back; it then runs the next attempt itself).
    assert_eq!(nap["worker"], json!(second_id), "{nap:#}");
    assert!(nap["lease_losses"].as_u64().unwrap() >= 1, "{nap:#}");
    assert_eq!(nap["result"]["attempt"], nap["attempts"], "{nap:#}");
    first.signal("CONT");
    // Woken, the first worker either publishes its late result, which the fold refuses,
    // or first reads that its attempt was taken back and calls it off (publishing
    // nothing): which comes first is a race between its handler's thread and its loop.
    let called_off = "attempt called off: the log no longer wants its outcome";
    let late = |t: &Value| {
        step(t, "nap")["refused_events"]
            .to_string()
            .contains("step_result of attempt 1")
            || first.printed(called_off)
    };
    let t = until(api, &uuid, "the late result refused or called off", late);
    let nap = step(&t, "nap");
    assert_eq!(nap["worker"], json!(second_id), "{nap:#}");
    assert_eq!(entered(nap, "complete"), 1, "accepted once: {nap:#}");
    first.kill();
}

#[test]
fn a_restarted_orchestrator_replays_the_log_and_the_task_completes() {
    let Stack {
        workers: _w,
        orchestrator,
        api,
        engine,
        ..
    } = Stack::start("3000", 1, &[SLOW]);
    let uuid = create(&api, "slow", json!({}));
    until(&api, &uuid, "the slow step to start", |t| {
        step(t, "nap")["current_state"] == "in_progress"
    });
    orchestrator.kill();
    let (_again, addr) = engine.orchestrator("3000");
    let api = ApiClient::new(&addr);
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    for s in t["steps"].as_array().unwrap() {
        assert_eq!(
            (entered(s, "complete"), &s["attempts"]),
            (1, &json!(1)),
            "{s:#}"
        );
    }
}

#[test]
fn a_decision_creates_the_branches_it_names_and_the_convergence_waits_for_them() {
    let stack = Stack::start("3000", 2, &[CONDITIONAL]);
    let api = &stack.api;
    let context = json!({"even_number": 2, "branches": ["medium", "huge"]});
    let t = api
        .get_task(&create(api, "conditional", context), 30)
        .unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let names: Vec<&str> = t["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["start", "route", "medium", "huge", "converge"]);
    assert_eq!(t["not_created_steps"], json!(["small", "large"]));
    assert_eq!(
        (&t["total_steps"], &t["completion_percentage"]),
        (&json!(5), &json!(100.0))
    );
    // start 2^2 = 4; each branch 4^2 = 16; converge (16 x 16)^2.
    assert_eq!(step(&t, "medium")["result"], json!(16));
    assert_eq!(step(&t, "converge")["result"], json!(65536));
    let enqueued = |name: &str| {
        let s = step(&t, name);
        let moves = s["transitions"].as_array().unwrap();
        let hop = |to: &str| moves.iter().find(|m| m["to"] == to).unwrap()["position"].as_u64();
        (hop("enqueued").unwrap(), hop("complete").unwrap())
    };
    // Once both branches completed: under protocol 2 (the default) the fold enqueues
    // it at the position where the last one completes.
    let converge_enqueued = enqueued("converge").0;
    assert!(converge_enqueued >= enqueued("medium").1.max(enqueued("huge").1));
    assert_eq!(t["protocol"], 2);

    let bad = json!({"even_number": 2, "branches": ["medium", "tiny"]});
    let t = api.get_task(&create(api, "conditional", bad), 30).unwrap();
    assert_eq!(t["status"], "error", "{t:#}");
    let route = step(&t, "route");
    assert!(
        route["last_error"].as_str().unwrap().contains("`tiny`"),
        "{route:#}"
    );
    assert_eq!(
        t["not_created_steps"],
        json!(["small", "medium", "large", "huge", "converge"])
    );
    let dlq = api.request("GET", "/v1/dlq", None).unwrap();
    let entries = dlq["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{dlq:#}");
    assert_eq!(
        (&entries[0]["step"], &entries[0]["reason"]),
        (&json!("route"), &json!("invalid_result"))
    );
}

#[test]
fn a_csv_batch_of_1000_rows_in_5_workers_resumes_from_its_checkpoint_after_a_crash() {
    let mut stack = Stack::start("1000", 1, &[csv("fail_fast", 500).as_str()]);
    let (first, first_id) = stack.workers.pop().unwrap();
    let api = &stack.api;
    let context = json!({"rows": 1000, "worker_count": 5, "checkpoint_every": 50});
    let uuid = create(api, "csv_fail_fast", context);
    until(api, &uuid, "a checkpoint of a running batch", |t| {
        t["steps"].as_array().unwrap().iter().any(|s| {
            s["checkpoint"]["items_done"].as_u64() >= Some(50)
                && s["current_state"] == "in_progress"
                && s["worker"] == first_id.as_str()
        })
    });
    first.kill();
    let (_second, _) = stack.engine.worker("1000");
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let names: Vec<&str> = t["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "analyze",
            "aggregate",
            "process_001",
            "process_002",
            "process_003",
            "process_004",
            "process_005"
        ]
    );
    assert_eq!(t["not_created_steps"], json!(["process"]));
    assert_eq!(
        step(&t, "aggregate")["result"],
        json!({"rows": 1000, "value": csv_value(0..1000), "batches": 5})
    );
    assert_eq!(
        step(&t, "process_002")["batch"]["cursor"],
        json!({"start": 200, "end": 400})
    );
    // The instances the crash took back resumed from their checkpoints and still
    // counted all their rows (the aggregate's total above says no row was lost or doubled).
    let resumed: Vec<&Value> = t["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["lease_losses"].as_u64() >= Some(1) && !s["result"]["resumed_from"].is_null())
        .collect();
    assert!(!resumed.is_empty(), "{t:#}");
    for s in resumed {
        let (from, start) = (&s["result"]["resumed_from"], &s["batch"]["cursor"]["start"]);
        assert!(from.as_u64() > start.as_u64(), "{s:#}");
        assert_eq!(s["result"]["rows"], json!(200), "{s:#}");
    }
}

#[test]
fn batch_failure_strategies_continue_fail_fast_or_isolate() {
    let templates = ["continue_on_failure", "fail_fast", "isolate"].map(|s| csv(s, 0));
    let stack = Stack::start("3000", 2, &templates.each_ref().map(String::as_str));
    let api = &stack.api;
    let context = json!({"rows": 1000, "worker_count": 5, "fail_batch": 3});
    let run = |strategy: &str| {
        let uuid = create(api, &format!("csv_{strategy}"), context.clone());
        api.get_task(&uuid, 30).unwrap()
    };
    let siblings = ["process_001", "process_002", "process_004", "process_005"];

    let t = run("continue_on_failure");
    assert_eq!(
        (&t["status"], &t["failed_steps"]),
        (&json!("complete"), &json!(1)),
        "{t:#}"
    );
    let expected = csv_value(0..400) + csv_value(600..1000);
    assert_eq!(
        step(&t, "aggregate")["result"],
        json!({"rows": 800, "value": expected, "batches": 4})
    );
    // The five instances go out together, at the position where `analyze` completed.
    let instances = ["process_003"].iter().chain(&siblings);
    let enqueued: std::collections::BTreeSet<Option<u64>> = instances
        .map(|name| entered_at(step(&t, name), "enqueued"))
        .collect();
    assert_eq!(enqueued.len(), 1, "{enqueued:?}");
    assert_eq!(
        enqueued.first(),
        Some(&entered_at(step(&t, "analyze"), "complete"))
    );

    let t = run("fail_fast");
    assert_eq!(t["status"], "error", "{t:#}");
    let failed_at = entered_at(step(&t, "process_003"), "error").unwrap();
    for name in siblings {
        let s = step(&t, name);
        let state = s["current_state"].as_str().unwrap();
        assert!(matches!(state, "complete" | "cancelled"), "{s:#}");
        assert!(
            entered_at(s, "complete").is_none_or(|p| p < failed_at),
            "completed after the failure: {s:#}"
        );
    }
    assert_eq!(step(&t, "aggregate")["current_state"], "pending");

    let t = run("isolate");
    assert_eq!(t["status"], "error", "{t:#}");
    for name in siblings {
        assert_eq!(step(&t, name)["current_state"], "complete", "{t:#}");
    }
    assert_eq!(step(&t, "aggregate")["current_state"], "pending");
}

#[test]
fn tasks_are_listed_cancelled_reset_resolved_and_dead_lettered() {
    let stack = Stack::start("3000", 1, &[FLAKY, SLOW]);
    let (api, addr) = (&stack.api, stack.addr.as_str());
    let flaky = create(api, "flaky", json!({}));
    assert_eq!(api.get_task(&flaky, 30).unwrap()["status"], "error");

    failed_steps_are_dead_lettered_reset_and_resolved(api, addr, &flaky);
    cancel_and_list(api, addr, &flaky);
}

/// The DLQ entry of a failed step; a reset that runs it again (and fails again); a
/// manual completion that completes the task; the step routes.
fn failed_steps_are_dead_lettered_reset_and_resolved(api: &ApiClient, addr: &str, flaky: &str) {
    let dlq = api.request("GET", "/v1/dlq", None).unwrap();
    assert_eq!(dlq["entries"].as_array().unwrap().len(), 1, "{dlq:#}");
    let entry = &dlq["entries"][0];
    assert_eq!(
        (&entry["step"], &entry["reason"]),
        (&json!("always"), &json!("max_retries"))
    );

    let e = api
        .step_action(flaky, "once", json!({"action_type": "reset_for_retry"}))
        .unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (409, "invalid_state"), "{e}");
    ok(&run_bin(&[
        "task",
        "reset-step",
        flaky,
        "always",
        "--reason",
        "try again",
        "--api",
        addr,
    ]));
    let t = api.get_task(flaky, 30).unwrap();
    let always = step(&t, "always");
    assert_eq!(
        (&t["status"], &always["attempts"]),
        (&json!("error"), &json!(4)),
        "{t:#}"
    );
    assert_eq!(
        entered(always, "pending"),
        1,
        "the reset is in the audit trail: {always:#}"
    );
    let out = ok(&run_bin(&[
        "task",
        "resolve-step",
        flaky,
        "always",
        "--result",
        "7",
        "--json",
        "--api",
        addr,
    ]));
    let resolved: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&resolved["current_state"], &resolved["result"]),
        (&json!("complete"), &json!(7))
    );
    let t = api.get_task(flaky, 0).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let audit = api
        .request(
            "GET",
            &format!("/v1/tasks/{flaky}/workflow_steps/always/audit"),
            None,
        )
        .unwrap();
    let moves = transitions_to(&audit);
    assert!(moves.ends_with(&["error", "complete"]), "{moves:?}");
    let e = api
        .request(
            "GET",
            &format!("/v1/tasks/{flaky}/workflow_steps/nope"),
            None,
        )
        .unwrap_err();
    assert_eq!(e.status, 404);
}

/// Cancel while a step runs (and again: 409); the list's filters and pagination.
fn cancel_and_list(api: &ApiClient, addr: &str, flaky: &str) {
    let slow = create(api, "slow", json!({}));
    until(api, &slow, "the slow step to start", |t| {
        step(t, "nap")["current_state"] == "in_progress"
    });
    let out = ok(&run_bin(&[
        "task", "cancel", &slow, "--json", "--api", addr,
    ]));
    let t: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&t["status"], &step(&t, "nap")["current_state"]),
        (&json!("cancelled"), &json!("cancelled"))
    );
    let e = api.cancel_task(&slow).unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (409, "task_closed"), "{e}");

    let list = api
        .request("GET", "/v1/tasks?namespace=demo&per_page=1", None)
        .unwrap();
    assert_eq!(
        list["tasks"][0]["task_uuid"],
        json!(flaky),
        "oldest first: {list:#}"
    );
    let p = &list["pagination"];
    assert_eq!(
        (&p["total_count"], &p["total_pages"], &p["has_next"]),
        (&json!(2), &json!(2), &json!(true))
    );
    let cancelled = api
        .request("GET", "/v1/tasks?status=cancelled", None)
        .unwrap();
    assert_eq!(cancelled["tasks"].as_array().unwrap().len(), 1);
    assert_eq!(cancelled["tasks"][0]["task_uuid"], json!(slow));
    let e = api
        .request("GET", "/v1/tasks?status=sleepy", None)
        .unwrap_err();
    assert_eq!(e.status, 400);
    let steps = api
        .request("GET", &format!("/v1/tasks/{slow}/workflow_steps"), None)
        .unwrap();
    assert_eq!(steps["steps"].as_array().unwrap().len(), 2);
    assert_eq!(
        api.request("GET", "/v1/dlq", None).unwrap()["entries"],
        json!([])
    );
}

#[test]
fn identity_strategies_deduplicate_by_context_by_key_or_never() {
    let yaml =
        ["strict", "caller_provided", "always_unique"].map(|s| IDENTITY.replace("STRATEGY", s));
    let Stack {
        orchestrator,
        engine,
        addr,
        ..
    } = Stack::start("3000", 0, &yaml.each_ref().map(String::as_str));
    let answer = |addr: &str, name, context, key| {
        let a = submit(addr, name, context, key);
        (a.status, a.json()["task_uuid"].clone())
    };
    let reordered: Value = serde_json::from_str(r#"{"y": [1, 2], "x": 1}"#).unwrap();
    let (first, strict) = answer(&addr, "id_strict", json!({"x": 1, "y": [1, 2]}), None);
    assert_eq!(first, 201);
    assert_eq!(
        answer(&addr, "id_strict", reordered.clone(), None),
        (200, strict.clone()),
        "the same context, keys in another order, is the same task"
    );
    let (status, other) = answer(&addr, "id_strict", json!({"x": 2, "y": [1, 2]}), None);
    assert_eq!(status, 201);
    assert_ne!(other, strict);

    let refused = submit(&addr, "id_caller_provided", json!({}), None);
    assert_eq!(
        (refused.status, &refused.json()["error"]["code"]),
        (400, &json!("idempotency_key_required"))
    );
    let (status, keyed) = answer(
        &addr,
        "id_caller_provided",
        json!({"x": 1}),
        Some("order-7"),
    );
    assert_eq!(status, 201);
    assert_eq!(
        answer(
            &addr,
            "id_caller_provided",
            json!({"x": 1}),
            Some("order-7")
        ),
        (200, keyed.clone()),
        "a retry with the key is answered with the task"
    );
    let reused = submit(
        &addr,
        "id_caller_provided",
        json!({"x": 2}),
        Some("order-7"),
    );
    let error = &reused.json()["error"];
    assert_eq!(
        (reused.status, &error["code"], &error["task_uuid"]),
        (409, &json!("idempotency_key_reused"), &keyed),
        "the key sent again with another context is refused, naming the task: {error}"
    );
    assert_eq!(
        answer(
            &addr,
            "id_caller_provided",
            json!({"x": 1}),
            Some("order-8")
        )
        .0,
        201
    );

    let unique = [1, 2].map(|_| answer(&addr, "id_always_unique", json!({"x": 1}), Some("k")));
    assert_eq!((unique[0].0, unique[1].0), (201, 201));
    assert_ne!(unique[0].1, unique[1].1);

    orchestrator.kill();
    let (_again, addr) = engine.orchestrator("3000");
    assert_eq!(
        answer(&addr, "id_strict", reordered, None),
        (200, strict),
        "a replaying orchestrator knows the identities from the log"
    );
    assert_eq!(
        answer(
            &addr,
            "id_caller_provided",
            json!({"x": 1}),
            Some("order-7")
        ),
        (200, keyed)
    );
    let not_an_object = submit(&addr, "id_strict", json!([1, 2]), None);
    assert_eq!(
        (not_an_object.status, &not_an_object.json()["error"]["code"]),
        (400, &json!("invalid_context"))
    );
}

#[test]
fn new_tasks_get_503_with_retry_after_while_the_open_tasks_are_at_the_limit() {
    let engine = Engine::start();
    let (_orchestrator, addr) = engine.orchestrator_with("3000", &["--max-open-tasks", "2"]);
    let api = ApiClient::new(&addr);
    register(&api, &IDENTITY.replace("STRATEGY", "strict"));
    let open: Vec<Value> = [1, 2]
        .map(|x| {
            let a = submit(&addr, "id_strict", json!({"x": x}), None);
            assert_eq!(a.status, 201, "{}", a.body);
            a.json()["task_uuid"].clone()
        })
        .into();

    let refused = submit(&addr, "id_strict", json!({"x": 3}), None);
    assert_eq!(
        (refused.status, refused.header("retry-after")),
        (503, Some("1")),
        "{}",
        refused.body
    );
    assert_eq!(refused.json()["error"]["code"], "backpressure");
    let duplicate = submit(&addr, "id_strict", json!({"x": 1}), None);
    assert_eq!(
        (duplicate.status, &duplicate.json()["task_uuid"]),
        (200, &open[0]),
        "a duplicate adds no work and is answered"
    );

    let _worker = engine.worker("3000");
    for uuid in &open {
        let t = api.get_task(uuid.as_str().unwrap(), 30).unwrap();
        assert_eq!(t["status"], "complete", "{t:#}");
    }
    let retried = submit(&addr, "id_strict", json!({"x": 3}), None);
    assert_eq!(retried.status, 201, "{}", retried.body);
}

#[test]
fn task_events_stream_every_transition_in_log_order_and_end_when_the_task_is_finished() {
    let stack = Stack::start("3000", 0, &[LINEAR]);
    let (api, addr, engine) = (&stack.api, stack.addr.as_str(), &stack.engine);
    let uuid = create(api, "linear", json!({"even_number": 2}));
    // No worker yet, so the task cannot finish: what arrives before one starts came
    // while the task was open, and the stream is still open after it.
    let (mut events, mut stream) = events_until_enqueued(addr, &uuid);
    let _worker = engine.worker("3000");
    while let Some(e) = next_event(&mut stream) {
        events.push(e);
    }

    let t = api.get_task(&uuid, 0).unwrap();
    assert_eq!(
        t["status"], "complete",
        "the stream ended with the task: {t:#}"
    );
    let positions: Vec<u64> = events
        .iter()
        .map(|e| e["position"].as_u64().unwrap())
        .collect();
    assert!(positions.is_sorted(), "log order: {positions:?}");
    let mut expected: Vec<(u64, Value, Value, Value)> = Vec::new();
    for s in t["steps"].as_array().unwrap() {
        for m in s["transitions"].as_array().unwrap() {
            expected.push((
                m["position"].as_u64().unwrap(),
                s["name"].clone(),
                m["from"].clone(),
                m["to"].clone(),
            ));
        }
    }
    for m in t["transitions"].as_array().unwrap() {
        expected.push((
            m["position"].as_u64().unwrap(),
            Value::Null,
            m["from"].clone(),
            m["to"].clone(),
        ));
    }
    expected.sort_by_key(|e| e.0);
    let got: Vec<(u64, Value, Value, Value)> = events
        .iter()
        .map(|e| {
            (
                e["position"].as_u64().unwrap(),
                e["step"].clone(),
                e["from"].clone(),
                e["to"].clone(),
            )
        })
        .collect();
    assert_eq!(
        got, expected,
        "every transition of the task and its steps, once"
    );
    assert_eq!(events.last().unwrap()["to"], "complete");

    let missing = http(addr, "GET", "/v1/tasks/nope/events", None);
    assert_eq!(
        (missing.status, &missing.json()["error"]["code"]),
        (404, &json!("not_found"))
    );
}

/// Every transition of a task and its steps from its audit trail, in log order (within a
/// position, steps before the task, as the stream sends them), as `(position, step, to)`.
fn audit_transitions(task: &Value) -> Vec<(u64, Value, Value)> {
    let mut all = Vec::new();
    for s in task["steps"].as_array().unwrap() {
        for m in s["transitions"].as_array().unwrap() {
            all.push((
                m["position"].as_u64().unwrap(),
                s["name"].clone(),
                m["to"].clone(),
            ));
        }
    }
    for m in task["transitions"].as_array().unwrap() {
        all.push((
            m["position"].as_u64().unwrap(),
            Value::Null,
            m["to"].clone(),
        ));
    }
    all.sort_by_key(|t| t.0);
    all
}

#[test]
fn a_task_event_stream_resumes_after_its_last_event_id_without_a_repeat_or_a_gap() {
    let stack = Stack::start("3000", 0, &[LINEAR]);
    let (api, addr, engine) = (&stack.api, stack.addr.as_str(), &stack.engine);
    let uuid = create(api, "linear", json!({"even_number": 2}));
    let path = format!("/v1/tasks/{uuid}/events");
    let (status, _, mut stream) = send(addr, "GET", &path, None);
    assert_eq!(status, 200);
    // No worker: the task stops at its first step's enqueue. Read up to it and on to the
    // end of its position (its `id:`), then leave, as a client whose connection broke.
    let mut first: Vec<(Value, Option<u64>)> = Vec::new();
    let mut enqueued = false;
    while !(enqueued && first.last().is_some_and(|(_, id)| id.is_some())) {
        let event = next_event_with_id(&mut stream).expect("the task is still open");
        enqueued |= event.0["to"] == "enqueued";
        first.push(event);
    }
    drop(stream);
    let last_id = first.last().unwrap().1.unwrap();
    for (event, id) in &first {
        if let Some(id) = id {
            assert_eq!(
                event["position"],
                json!(id),
                "an event's id is its position"
            );
        }
    }

    let _worker = engine.worker("3000");
    let t = api.get_task(&uuid, 60).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let resume = format!("Last-Event-ID: {last_id}\r\n");
    let (status, _, mut stream) = send_with(addr, "GET", &path, None, &resume);
    assert_eq!(status, 200);
    let mut rest = Vec::new();
    while let Some(event) = next_event_with_id(&mut stream) {
        rest.push(event);
    }
    assert!(
        rest.iter()
            .all(|(e, _)| e["position"].as_u64().unwrap() > last_id),
        "only what came after position {last_id}: {rest:?}"
    );
    let got: Vec<(u64, Value, Value)> = first
        .iter()
        .chain(&rest)
        .map(|(e, _)| {
            (
                e["position"].as_u64().unwrap(),
                e["step"].clone(),
                e["to"].clone(),
            )
        })
        .collect();
    assert_eq!(
        got,
        audit_transitions(&t),
        "both connections together: every transition once"
    );
    assert_eq!(
        rest.last().unwrap().1,
        Some(rest.last().unwrap().0["position"].as_u64().unwrap())
    );

    // The stream's last id: nothing more, and the stream ends (the task is finished).
    let end = rest.last().unwrap().1.unwrap();
    let (_, _, mut stream) = send_with(
        addr,
        "GET",
        &path,
        None,
        &format!("Last-Event-ID: {end}\r\n"),
    );
    assert!(next_event_with_id(&mut stream).is_none());
    let (status, _, _) = send_with(addr, "GET", &path, None, "Last-Event-ID: yesterday\r\n");
    assert_eq!(status, 400);
}

#[test]
fn a_step_stuck_past_its_lifecycle_threshold_is_dead_lettered_as_stale_and_replay_agrees() {
    let Stack {
        workers: _w,
        orchestrator,
        api,
        engine,
        ..
    } = Stack::start("3000", 1, &[STALE]);
    let uuid = create(&api, "stale", json!({}));
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "error", "{t:#}");
    let nap = step(&t, "nap");
    assert_eq!(nap["current_state"], "error");
    let error = nap["last_error"].as_str().unwrap();
    assert!(
        error.starts_with("stale:") && error.contains("max_steps_in_process_minutes"),
        "{error}"
    );
    assert_eq!(step(&t, "after")["current_state"], "pending");
    let dlq = api.request("GET", "/v1/dlq", None).unwrap();
    let entries = dlq["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{dlq:#}");
    assert_eq!(
        (&entries[0]["step"], &entries[0]["reason"]),
        (&json!("nap"), &json!("staleness"))
    );

    orchestrator.kill();
    let (_again, addr) = engine.orchestrator("3000");
    let replayed = ApiClient::new(&addr).get_task(&uuid, 0).unwrap();
    for field in ["status", "transitions", "steps"] {
        assert_eq!(replayed[field], t[field], "replay agrees on {field}");
    }
}

#[test]
fn a_rerun_starts_every_failed_step_of_a_failed_task_again() {
    let stack = Stack::start("3000", 1, &[RERUN]);
    let (api, addr) = (&stack.api, stack.addr.as_str());
    let uuid = create(api, "rerun", json!({}));
    let failed = until(api, &uuid, "both steps to fail", |t| {
        t["status"] == "error" && t["failed_steps"] == 2
    });
    assert_eq!(step(&failed, "join")["current_state"], "pending");

    let out = ok(&run_bin(&[
        "task", "rerun", &uuid, "--reason", "fixed", "--json", "--api", addr,
    ]));
    let reopened: Value = serde_json::from_str(&out).unwrap();
    assert_ne!(reopened["status"], "error", "{reopened:#}");
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    for name in ["left", "right"] {
        let s = step(&t, name);
        assert_eq!(
            (&s["result"], entered(s, "error"), entered(s, "pending")),
            (&json!({"attempt": 2}), 1, 1),
            "failed once, reset once, then attempt 2 succeeded: {s:#}"
        );
    }
    let again = api
        .request("POST", &format!("/v1/tasks/{uuid}/rerun"), Some(json!({})))
        .unwrap_err();
    assert_eq!((again.status, again.code.as_str()), (409, "invalid_state"));
}

/// A step failing for good at its first attempt (its policy says not retryable) beside
/// a short nap, which has a dependent, and a long one; a join waits for all three.
const BLOCKED: &str = "name: blocked
namespace: demo
version: 1.0.0
steps:
  - name: bad
    retry: {retryable: false, max_attempts: 3}
    handler: {callable: test.fail_times, initialization: {failures: 100}}
  - {name: nap, handler: {callable: test.sleep, initialization: {ms: 500}}}
  - {name: after_nap, dependencies: [nap], handler: {callable: test.sleep}}
  - {name: long, handler: {callable: test.sleep, initialization: {ms: 2500}}}
  - {name: join, dependencies: [bad, after_nap, long], handler: {callable: test.sleep}}
";

/// `embarcadero ARGS --json --api ADDR`, which must succeed, as JSON.
fn cli_json(args: &[&str], addr: &str) -> Value {
    let out = ok(&run_bin(&[args, &["--json", "--api", addr]].concat()));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Tasker's counts of a task: total, pending, in progress, completed, failed, ready.
fn counts(t: &Value) -> [u64; 6] {
    [
        "total_steps",
        "pending_steps",
        "in_progress_steps",
        "completed_steps",
        "failed_steps",
        "ready_steps",
    ]
    .map(|k| t[k].as_u64().unwrap_or_else(|| panic!("no {k}: {t:#}")))
}

#[test]
fn a_failed_step_blocks_its_task_and_a_manual_resolution_lets_its_dependents_run() {
    let stack = Stack::start("3000", 1, &[BLOCKED]);
    let (api, addr) = (&stack.api, stack.addr.as_str());
    let uuid = create(api, "blocked", json!({}));
    // `bad` fails while the naps still run: the task is blocked, not yet failed.
    until(api, &uuid, "the task to be blocked", |t| {
        t["status"] == "blocked_by_failures"
    });
    // `after_nap` was ready from the short nap's completion on, while `long` kept the
    // task blocked, and was never enqueued: a task blocked by failures starts no new
    // step. Once `long` is done the task fails.
    let t = until(api, &uuid, "the task to fail", |t| t["status"] == "error");
    let bad = step(&t, "bad");
    assert_eq!(bad["attempts"], 1, "not retried: {bad:#}");
    let error = bad["last_error"].as_str().unwrap();
    assert!(error.starts_with("failed, not retryable"), "{error}");
    let [failed_at, nap_done, long_done] =
        [("bad", "error"), ("nap", "complete"), ("long", "complete")]
            .map(|(name, state)| entered_at(step(&t, name), state).unwrap());
    assert!(failed_at < nap_done && nap_done < long_done, "{t:#}");
    assert_eq!(entered(step(&t, "after_nap"), "enqueued"), 0, "{t:#}");
    let moves = transitions_to(&t);
    assert!(
        moves.ends_with(&["blocked_by_failures", "error"]),
        "{moves:?}"
    );
    assert_eq!(counts(&t), [5, 2, 0, 2, 1, 1], "{t:#}");
    let words = ["execution_status", "recommended_action", "health_status"].map(|k| &t[k]);
    assert_eq!(
        words,
        [
            &json!("blocked_by_failures"),
            &json!("handle_failures"),
            &json!("blocked")
        ]
    );
    assert_eq!(t["completion_percentage"], json!(40.0));

    let dlq = cli_json(&["task", "dlq"], addr);
    let entries = dlq["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{dlq:#}");
    assert_eq!(
        (&entries[0]["step"], &entries[0]["reason"]),
        (&json!("bad"), &json!("permanent_failure"))
    );
    let out = run_bin(&["task", "wait", &uuid, "--api", addr]);
    assert_eq!(out.status.code(), Some(1), "a task that failed");
    let waited = failed(&out);
    assert!(
        waited.contains(&format!("task {uuid} ended in error")),
        "{waited}"
    );

    // Resolved by hand (no result): its dependents run, and the task completes.
    let args = [
        "task",
        "resolve-step",
        &uuid,
        "bad",
        "--reason",
        "not needed",
    ];
    let resolved = cli_json(&args, addr);
    assert_eq!(
        (&resolved["current_state"], &resolved["result"]),
        (&json!("resolved_manually"), &Value::Null)
    );
    let t = cli_json(&["task", "wait", &uuid, "--timeout", "30"], addr);
    assert_eq!(t["status"], "complete", "{t:#}");
    assert_eq!(counts(&t), [5, 0, 0, 5, 0, 0], "{t:#}");
    for name in ["after_nap", "join"] {
        let s = step(&t, name);
        assert_eq!(
            (&s["current_state"], &s["attempts"]),
            (&json!("complete"), &json!(1))
        );
    }
    reads_back_through_the_cli(addr, &uuid, &t);
}

/// The resolved task of the test above through `task steps --audit|get|list|dlq` and
/// `template list`.
fn reads_back_through_the_cli(addr: &str, uuid: &str, t: &Value) {
    let audit = cli_json(&["task", "steps", uuid, "bad", "--audit"], addr);
    let moves = transitions_to(&audit);
    assert!(
        moves.ends_with(&["error", "resolved_manually"]),
        "{moves:?}"
    );
    let created_ms = t["created_at_ms"].as_u64().unwrap();
    for m in audit["transitions"].as_array().unwrap() {
        assert!(m["ts_ms"].as_u64() >= Some(created_ms), "timestamped: {m}");
    }
    assert_eq!(&cli_json(&["task", "get", uuid], addr), t);
    // `task steps` prints each step's result, or its error, as `task get` does (it printed
    // the last error's `null` for a step that had a result).
    let printed = ok(&run_bin(&["task", "steps", uuid, "--api", addr]));
    let with_results = t["steps"].as_array().unwrap().iter();
    for s in with_results.filter(|s| !s["result"].is_null()) {
        assert!(
            printed.contains(&format!("result: {}", s["result"])),
            "{printed}"
        );
    }
    assert!(!printed.contains("null"), "{printed}");
    let listed = cli_json(&["task", "list", "--status", "complete"], addr);
    assert_eq!(listed["tasks"][0]["task_uuid"], json!(uuid), "{listed:#}");
    assert_eq!(listed["pagination"]["total_count"], 1, "{listed:#}");
    let templates = ok(&run_bin(&["template", "list", "--api", addr]));
    assert_eq!(templates.trim(), "demo/blocked@1.0.0  5 steps");
    assert_eq!(cli_json(&["task", "dlq"], addr)["entries"], json!([]));
    let empty = ok(&run_bin(&["task", "dlq", "--api", addr]));
    assert_eq!(empty, "the dead-letter queue is empty\n");
}

/// One step in another namespace.
const ELSEWHERE: &str = "name: elsewhere
namespace: other
version: 1.0.0
steps:
  - {name: one, handler: {callable: test.sleep}}
";

#[test]
fn a_worker_claims_only_the_steps_of_the_namespaces_it_serves() {
    let stack = Stack::start("3000", 0, &[LINEAR, ELSEWHERE]);
    let (api, engine) = (&stack.api, &stack.engine);
    let (_other, other_id) = engine.worker_with("3000", &["--namespace", "other"]);
    let demo = create(api, "linear", json!({"even_number": 2}));
    let created = api.create_task("other", "elsewhere", "1.0.0", json!({}), None);
    let elsewhere = created.unwrap()["task_uuid"].as_str().unwrap().to_string();
    let t = api.get_task(&elsewhere, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    assert_eq!(step(&t, "one")["worker"], json!(other_id));
    // That worker read the demo task's first step enqueued before its own task's (the
    // log is read in order), and left it: still enqueued once its own task is done.
    let t = api.get_task(&demo, 0).unwrap();
    assert_eq!(step(&t, "one")["current_state"], "enqueued", "{t:#}");

    let (_demo, demo_id) = engine.worker_with("3000", &["--namespace", "demo"]);
    let t = api.get_task(&demo, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    for s in t["steps"].as_array().unwrap() {
        assert_eq!(s["worker"], json!(demo_id), "{s:#}");
    }
}

/// The value of the sample `series` (name and labels, as written) in a metrics text.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().unwrap())
}

#[test]
fn metrics_count_tasks_and_steps_by_state_step_latency_by_handler_and_queue_lag() {
    let stack = Stack::start("3000", 1, &[LINEAR]);
    let (api, addr) = (&stack.api, stack.addr.as_str());
    let uuid = create(api, "linear", json!({"even_number": 2}));
    assert_eq!(api.get_task(&uuid, 30).unwrap()["status"], "complete");

    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let m = http(addr, "GET", "/metrics", None);
        assert_eq!(m.status, 200);
        assert!(m.header("content-type").unwrap().starts_with("text/plain"));
        // The worker's last events may still be on their way to the fold.
        if sample(&m.body, "embarcadero_workflow_queue_lag_events") == Some(0.0) {
            break m.body;
        }
        assert!(
            Instant::now() < deadline,
            "the lag never reached 0: {}",
            m.body
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let tasks = |s: &str| {
        sample(
            &text,
            &format!("embarcadero_workflow_tasks{{state=\"{s}\"}}"),
        )
    };
    assert_eq!(
        (tasks("complete"), tasks("error")),
        (Some(1.0), Some(0.0)),
        "{text}"
    );
    let steps = sample(&text, "embarcadero_workflow_steps{state=\"complete\"}");
    assert_eq!(steps, Some(4.0), "{text}");
    let unclaimed = sample(&text, "embarcadero_workflow_unclaimed_steps");
    assert_eq!(unclaimed, Some(0.0), "every step was claimed: {text}");
    let histogram = "embarcadero_workflow_step_duration_seconds";
    let handler = "handler=\"math.square\"";
    let count = sample(&text, &format!("{histogram}_count{{{handler}}}"));
    let all = sample(
        &text,
        &format!("{histogram}_bucket{{{handler},le=\"+Inf\"}}"),
    );
    assert_eq!((count, all), (Some(4.0), Some(4.0)), "{text}");
    let buckets: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{histogram}_bucket{{{handler}")))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(
        buckets.is_sorted() && buckets.len() > 2,
        "cumulative buckets: {buckets:?}"
    );

    // The role line's quiet mark depends on whether the holder has gone quiet yet.
    let summary = ok(&run_bin(&["task", "stats", "--api", addr]));
    assert!(
        summary.starts_with(
            "tasks: complete 1\nsteps: complete 4\nqueue lag: 0 events\norchestrator: active (term 1)"
        ),
        "{summary}"
    );
    let mut summary = json_of(&run_bin(&["task", "stats", "--api", addr, "--json"]));
    assert_eq!(summary["orchestrator"]["active"], true, "{summary}");
    summary.as_object_mut().unwrap().remove("orchestrator");
    assert_eq!(
        summary,
        json!({"tasks": {"complete": 1}, "steps": {"complete": 4}, "queue_lag_events": 0})
    );
}

/// Polls `status` (announcements come once a second) until `want` holds of its text.
fn status_until(serve: &Serve, what: &str, want: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = ok(&serve.run(&["status"], None));
        if want(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "{what} never happened: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn status_shows_the_engine_that_announced_itself_and_forgets_it_once_silent() {
    let Stack {
        workers,
        orchestrator,
        addr,
        api,
        engine,
    } = Stack::start("3000", 1, &[LINEAR]);
    let uuid = create(&api, "linear", json!({"even_number": 2}));
    assert_eq!(api.get_task(&uuid, 30).unwrap()["status"], "complete");
    let line = format!("workflow engine   API http://{addr}   log workflow.events");
    let text = status_until(&engine.serve, "the engine in status", |t| {
        t.contains(&line) && t.contains("tasks: complete 1")
    });
    assert!(text.contains("steps: complete 4"), "{text}");

    let json: Value =
        serde_json::from_str(&ok(&engine.serve.run(&["status", "--json"], None))).unwrap();
    let services = json["services"].as_array().unwrap();
    assert!(
        services.iter().any(|s| s["kind"] == "workflow"
            && s["addr"] == addr.as_str()
            && s["log"]["topic"] == "workflow.events"),
        "{json}"
    );

    // Killed, it stops announcing; the head forgets it after the ttl (3 s).
    orchestrator.kill();
    status_until(&engine.serve, "the head forgetting the engine", |t| {
        !t.contains(&line)
    });
    drop(workers);
}

/// The chaos test of `scripts/workflow-chaos.sh`, short: 48 tasks of every shape while
/// workers, the orchestrators (an active one and a standby, `--standby`) and the
/// follower broker are SIGKILLed and restarted for six seconds; the active
/// orchestrator is killed at least once, so the standby takes over mid-run. Its checker (`scripts/workflow_chaos.py`) compares every task with its audit
/// trail and the workers' run log: every task complete, every step completed once with
/// one accepted result per returned attempt, and no handler run unaccounted for. The
/// long campaigns (hundreds of tasks) stay in the script.
#[test]
fn a_short_chaos_run_completes_every_task_and_accepts_each_result_once() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/workflow_chaos.py"
    );
    let out = std::process::Command::new("python3")
        .args([script, "--bin", env!("CARGO_BIN_EXE_embarcadero")])
        .args(["--tasks", "48", "--min-secs", "6", "--gap", "0.5", "1.5"])
        // Two orchestrators: the nemesis kills the active one (the standby takes over,
        // the killed one restarts and replays as a standby), and now and then the standby.
        .arg("--standby")
        .output()
        .expect("python3 runs the chaos checker (it needs only the standard library)");
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the chaos run failed:\n{log}");
    assert!(
        log.contains("PASSED (0 violations, 0 unplanned exits)"),
        "{log}"
    );
    let takeovers = log
        .split("standby: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<u32>().ok());
    assert!(
        takeovers.is_some_and(|n| n >= 1),
        "the active orchestrator was killed at least once: {log}"
    );
}

/// Three steps of 150 ms each, so that tasks are mid-way when an orchestrator dies.
const CHAIN: &str = "name: chain
namespace: demo
version: 1.0.0
steps:
  - {name: a, handler: {callable: test.sleep, initialization: {ms: 150}}}
  - {name: b, dependencies: [a], handler: {callable: test.sleep, initialization: {ms: 150}}}
  - {name: c, dependencies: [b], handler: {callable: test.sleep, initialization: {ms: 150}}}
";

/// An orchestrator's gauge `embarcadero_workflow_{name}`.
fn gauge(api: &ApiClient, name: &str) -> f64 {
    let text = api.metrics().unwrap();
    let series = format!("embarcadero_workflow_{name}");
    sample(&text, &series).unwrap_or_else(|| panic!("no {series} in {text}"))
}

/// Polls the gauge until `want` holds (at most 30 s); returns its value.
fn gauge_until(api: &ApiClient, name: &str, want: impl Fn(f64) -> bool) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = gauge(api, name);
        if want(v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "waited 30 s for {name}, still {v}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every step of every task completed, each by exactly one accepted result (the
/// audit trail enters `complete` once, from the attempt whose result it holds), and
/// each attempt's handler ran at most once by the workers' run log.
fn each_step_accepted_once(api: &ApiClient, tasks: &[String], run_log: &std::path::Path) {
    let runs = std::fs::read_to_string(run_log).unwrap();
    let mut ran: std::collections::HashMap<(String, String, u64), usize> = Default::default();
    for line in runs.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        *ran.entry((f[0].into(), f[1].into(), f[2].parse().unwrap()))
            .or_default() += 1;
    }
    for uuid in tasks {
        let t = api.get_task(uuid, 30).unwrap();
        assert_eq!(t["status"], "complete", "{t:#}");
        for s in t["steps"].as_array().unwrap() {
            assert_eq!(entered(s, "complete"), 1, "accepted once: {s:#}");
            let attempt = s["attempts"].as_u64().unwrap();
            assert_eq!(s["result"]["attempt"], json!(attempt), "{s:#}");
            let name = s["name"].as_str().unwrap().to_string();
            let key = (uuid.clone(), name, attempt);
            assert_eq!(
                ran.get(&key),
                Some(&1),
                "the accepted attempt ran once: {s:#}"
            );
        }
    }
    assert!(
        ran.values().all(|&n| n == 1),
        "an attempt ran twice: {ran:?}"
    );
}

/// Which of the orchestrators holds the lease (polled until exactly one says so).
fn the_active(apis: &[&ApiClient]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let active: Vec<usize> = (0..apis.len())
            .filter(|&i| gauge(apis[i], "orchestrator_active") == 1.0)
            .collect();
        if let [one] = active[..] {
            return one;
        }
        assert!(
            Instant::now() < deadline,
            "waited 30 s for one active orchestrator: {active:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two orchestrators on one log, each with its API client, the active one first.
fn two_orchestrators(engine: &Engine) -> [(Proc, ApiClient); 2] {
    two_orchestrators_with(engine, "1500")
}

/// The same with the given `--failover-ms`.
fn two_orchestrators_with(engine: &Engine, failover_ms: &str) -> [(Proc, ApiClient); 2] {
    let lease = ["--failover-ms", failover_ms];
    let (a, a_addr) = engine.orchestrator_with("3000", &lease);
    let (b, b_addr) = engine.orchestrator_with("3000", &lease);
    let (a_api, b_api) = (ApiClient::new(&a_addr), ApiClient::new(&b_addr));
    match the_active(&[&a_api, &b_api]) {
        0 => [(a, a_api), (b, b_api)],
        _ => [(b, b_api), (a, a_api)],
    }
}

#[test]
fn a_standby_orchestrator_takes_over_from_a_killed_one_and_every_step_is_accepted_once() {
    let engine = Engine::start();
    let [(active, active_api), (_standby, standby_api)] = two_orchestrators(&engine);
    let term = gauge(&active_api, "orchestrator_term");
    let runs = engine._dir.path().join("runs.log");
    let env = [("EMBARCADERO_WORKFLOW_RUN_LOG", runs.to_str().unwrap())];
    let worker_args = [
        "worker",
        "--control",
        &engine.serve.control,
        "--lease-ms",
        "3000",
    ];
    let _workers: Vec<_> = (0..2)
        .map(|_| Proc::ready(&worker_args, &env, "is running"))
        .collect();
    register(&active_api, CHAIN);
    // Half through the standby's API: it answers too (it folds the same log).
    let tasks: Vec<String> = (0..16)
        .map(|i| {
            let api = if i % 2 == 0 {
                &active_api
            } else {
                &standby_api
            };
            create(api, "chain", json!({ "i": i }))
        })
        .collect();
    until(&standby_api, &tasks[15], "the last task to start", |t| {
        step(t, "a")["current_state"] != "pending"
    });
    active.kill();
    gauge_until(&standby_api, "orchestrator_active", |v| v == 1.0);
    assert!(
        gauge(&standby_api, "orchestrator_term") > term,
        "a newer term"
    );
    each_step_accepted_once(&standby_api, &tasks, &runs);
}

/// With no task open the holder renews quietly (a lease ten times `--failover-ms`, here
/// 50 s); killed then, it is replaced once a task is created, `--failover-ms` later: within
/// the 30 s this test waits, which the quiet lease alone would outlast. (The task itself
/// runs without an orchestrator: its workers enqueue and claim its steps.)
#[test]
fn a_quiet_holder_that_died_is_replaced_once_there_is_a_task() {
    let engine = Engine::start();
    let [(active, _), (_standby, standby_api)] = two_orchestrators_with(&engine, "5000");
    let (_worker, _) = engine.worker("3000");
    register(&standby_api, CHAIN);
    gauge_until(&standby_api, "orchestrator_lease_quiet", |v| v == 1.0);
    active.kill();
    let uuid = create(&standby_api, "chain", json!({}));
    gauge_until(&standby_api, "orchestrator_active", |v| v == 1.0);
    let t = standby_api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
}

#[test]
fn a_paused_orchestrator_is_deposed_and_follows_once_it_resumes() {
    let engine = Engine::start();
    let [(active, active_api), (_standby, standby_api)] = two_orchestrators(&engine);
    let (_worker, _) = engine.worker("3000");
    register(&standby_api, CHAIN);
    active.signal("STOP");
    gauge_until(&standby_api, "orchestrator_active", |v| v == 1.0);
    let term = gauge(&standby_api, "orchestrator_term");
    active.signal("CONT");
    // It reads the newer term and stops deciding; whatever it decided before reading
    // it was written under its old term and refused by every reader.
    gauge_until(&active_api, "orchestrator_active", |v| v == 0.0);
    assert!(gauge(&active_api, "orchestrator_term") >= term);
    // Created through the deposed one, waited for there: its fold has the task once
    // `create` returns, the new holder's a moment later (it runs it all the same).
    let uuid = create(&active_api, "chain", json!({}));
    let t = active_api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    active.kill();
}

/// SIGTERM makes the active orchestrator release its lease in the log and say so, and
/// the standby takes over at once: with a failover of ten minutes, a lapse of the lease
/// cannot be what made it active. A task then completes under the new holder.
#[test]
fn a_stopped_orchestrator_releases_its_lease_and_the_standby_takes_over() {
    let engine = Engine::start();
    let [(mut active, active_api), (mut standby, standby_api)] =
        two_orchestrators_with(&engine, "600000");
    let term = gauge(&active_api, "orchestrator_term");
    let (_worker, _) = engine.worker("3000");
    register(&standby_api, CHAIN);
    active.signal("TERM");
    active.wait_line("released its lease");
    assert!(active.wait().success(), "a graceful stop exits 0");
    standby.wait_line("orchestrator active: deciding");
    gauge_until(&standby_api, "orchestrator_active", |v| v == 1.0);
    assert_eq!(gauge(&standby_api, "orchestrator_term"), term + 1.0);
    let uuid = create(&standby_api, "chain", json!({}));
    let t = standby_api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
}

#[test]
fn a_restart_loads_the_newest_snapshot_and_replays_only_the_log_after_it() {
    let engine = Engine::start();
    let data = engine._dir.path().join("orchestrator");
    let args = [
        "--data-dir",
        data.to_str().unwrap(),
        "--snapshot-every",
        "20",
        "--failover-ms",
        "1000",
    ];
    let (first, addr) = engine.orchestrator_with("3000", &args);
    let api = ApiClient::new(&addr);
    let (_worker, _) = engine.worker("3000");
    register(&api, LINEAR);
    // Tasks until a snapshot covers 60 events: the log grows by what they write (a
    // quiet orchestrator renews its lease only every few seconds).
    let mut tasks = Vec::new();
    while gauge(&api, "snapshot_position") < 60.0 {
        assert!(
            tasks.len() < 40,
            "no snapshot past position 60 after 40 tasks"
        );
        // Contexts differ: a task like one made before is that task (its identity).
        let n = tasks.len();
        let uuid = create(&api, "linear", json!({"even_number": 2 * (n % 6), "n": n}));
        let t = api.get_task(&uuid, 30).unwrap();
        assert_eq!(t["status"], "complete", "{t:#}");
        tasks.push(uuid);
    }
    let written = gauge(&api, "snapshot_position") as u64;
    let before: Vec<Value> = tasks.iter().map(|u| api.get_task(u, 0).unwrap()).collect();
    first.kill();
    // The newest file is the one the restart must start from.
    let newest = std::fs::read_dir(&data)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_prefix("snapshot-")?
                .strip_suffix(".snap")?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap();
    assert!(newest >= written, "{newest} < {written}");
    let (again, addr) = engine.orchestrator_with("3000", &args);
    // Its replay needs the log from the snapshot on, which is all there: no alarm about
    // lost events (the events before the snapshot are not needed).
    assert!(again.printed("loaded snapshot"));
    assert!(!again.printed("are gone"), "a false alarm on a healthy log");
    let api = ApiClient::new(&addr);
    let from = gauge(&api, "replay_from_position") as u64;
    let to = gauge(&api, "replay_to_position") as u64;
    assert_eq!(from, newest, "the replay starts at the newest snapshot");
    assert_eq!(
        gauge(&api, "replayed_events") as u64,
        to - from,
        "only the tail"
    );
    assert!(from > 0, "fewer events than the whole log");
    for (uuid, was) in tasks.iter().zip(&before) {
        assert_eq!(
            &api.get_task(uuid, 0).unwrap(),
            was,
            "the same task after the restart"
        );
    }
    // And the engine goes on: a new task completes once this one holds the lease.
    let uuid = create(&api, "linear", json!({"even_number": 2, "again": true}));
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
}

/// A worker process outlives its server: when the server is SIGKILLed under it, its loop
/// fails and it says so; once the server is back on its ports, a new worker (a new
/// session) starts in the same process, and the next task runs on it.
#[test]
fn a_worker_process_carries_on_after_its_server_is_killed_and_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (base, control) = (common::free_port(), common::free_port());
    let one_broker = ["--brokers", "1"];
    let serve = Serve::start_on(&data, base, control, &one_broker);
    let engine = Engine { serve, _dir: dir };
    let (mut worker, first_id) = engine.worker("1000");
    let (orchestrator, addr) = engine.orchestrator("1000");
    register(&ApiClient::new(&addr), LINEAR);
    // A different context each time: the same one would name the same task (identity).
    let run = |addr: &str, even_number: u64| {
        let api = ApiClient::new(addr);
        let uuid = create(&api, "linear", json!({ "even_number": even_number }));
        api.get_task(&uuid, 30).unwrap()
    };
    assert_eq!(run(&addr, 2)["status"], "complete");

    let Engine { serve, _dir } = engine;
    orchestrator.kill();
    serve.kill();
    let failed = worker.wait_line("a new worker starts in");
    assert!(failed.contains(&first_id), "{failed}");
    let serve = Serve::start_on(&data, base, control, &one_broker);
    let engine = Engine { serve, _dir };
    let started = worker.wait_line("is running");
    let second_id = started.split("workflow worker ").nth(1).unwrap();
    let second_id = second_id.split(' ').next().unwrap();
    assert_ne!(second_id, first_id);
    // The log is durable (the default --rf 2 --ack 2): the new orchestrator replays the
    // template and the first task from disk.
    let (_orchestrator, addr) = engine.orchestrator("1000");
    let t = run(&addr, 4);
    assert_eq!(t["status"], "complete", "{t:#}");
    assert_eq!(step(&t, "four")["worker"], json!(second_id), "{t:#}");
}

/// An orchestrator and a worker ride out a SIGKILL of their server and its restart on
/// the same data directory more than a second later (longer than the client library's
/// own reconnects last, which used to end the orchestrator): neither process exits, the
/// orchestrator says it lost the server and when it is back, its API answers 503
/// `log_unavailable` meanwhile, and a task the kill caught mid-step and one created
/// after the restart both complete, as one that completed before stays complete.
#[test]
fn an_orchestrator_and_a_worker_ride_out_their_server_killed_and_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (base, control) = (common::free_port(), common::free_port());
    let one_broker = ["--brokers", "1"];
    let serve = Serve::start_on(&data, base, control, &one_broker);
    let engine = Engine { serve, _dir: dir };
    let (mut worker, _) = engine.worker("1000");
    let (mut orchestrator, addr) = engine.orchestrator("1000");
    let api = ApiClient::new(&addr);
    register(&api, LINEAR);
    register(&api, SLOW);
    let before = create(&api, "linear", json!({"even_number": 2}));
    assert_eq!(api.get_task(&before, 30).unwrap()["status"], "complete");
    let caught = create(&api, "slow", json!({}));
    until(&api, &caught, "the slow step to start", |t| {
        step(t, "nap")["current_state"] == "in_progress"
    });

    let Engine { serve, _dir } = engine;
    serve.kill();
    orchestrator.wait_line("lost the server at");
    let during = http(&addr, "GET", "/v1/templates", None);
    assert_eq!(
        (during.status, during.header("retry-after")),
        (503, Some("1")),
        "{}",
        during.body
    );
    assert_eq!(during.json()["error"]["code"], "log_unavailable");
    worker.wait_line("a new worker starts in");
    // The outage's length (the fault injected), not a wait for anything to happen.
    std::thread::sleep(Duration::from_millis(1500));
    let serve = Serve::start_on(&data, base, control, &one_broker);
    let _engine = Engine { serve, _dir };
    orchestrator.wait_line("is back after");
    orchestrator.wait_line("serving again");
    worker.wait_line("is running");
    let t = api.get_task(&caught, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    let after = create(&api, "linear", json!({"even_number": 4}));
    let t = api.get_task(&after, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    assert_eq!(api.get_task(&before, 0).unwrap()["status"], "complete");
    assert!(!orchestrator.exited(), "the orchestrator process went on");
    assert!(!worker.exited(), "the worker process went on");
}

/// A worker and an orchestrator started before their server wait for it and say so,
/// instead of exiting, and serve once it is up.
#[test]
fn a_worker_and_an_orchestrator_started_before_their_server_wait_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let (base, control) = (common::free_port(), common::free_port());
    let control_addr = format!("127.0.0.1:{control}");
    let log = ["--control", control_addr.as_str(), "--lease-ms", "1000"];
    let mut worker = Proc::spawn(&[&["worker"][..], &log].concat(), &[]);
    let listen = ["orchestrator", "--listen", "127.0.0.1:0"];
    let mut orchestrator = Proc::spawn(&[&listen[..], &log].concat(), &[]);
    let waiting = format!("waiting for the server at {control_addr}");
    worker.wait_line(&waiting);
    orchestrator.wait_line(&waiting);
    let _serve = Serve::start_on(&dir.path().join("d"), base, control, &["--brokers", "1"]);
    worker.wait_line("is running");
    let line = orchestrator.wait_line("workflow orchestrator is serving");
    let api = ApiClient::new(line.rsplit("http://").next().unwrap().trim());
    register(&api, LINEAR);
    let uuid = create(&api, "linear", json!({"even_number": 2}));
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
}

/// An orchestrator and a worker both started fresh after the server restarted under a
/// memory-only log that had events: each replays what is left (nothing) and serves,
/// instead of waiting for the lost positions (issue 27).
#[test]
fn a_fresh_orchestrator_and_worker_serve_after_a_memory_only_log_lost_its_events() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (base, control) = (common::free_port(), common::free_port());
    let one_broker = ["--brokers", "1"];
    let serve = Serve::start_on(&data, base, control, &one_broker);
    let engine = Engine { serve, _dir: dir };
    let memory_only = ["--rf", "1", "--ack", "1"];
    let snapshots = engine._dir.path().join("orchestrator");
    let snapshots = snapshots.to_str().unwrap();
    let with_snapshots = [
        &memory_only[..],
        &["--data-dir", snapshots, "--snapshot-every", "5"],
    ]
    .concat();
    let (worker, _) = engine.worker_with("1000", &memory_only);
    let (orchestrator, addr) = engine.orchestrator_with("1000", &with_snapshots);
    let api = ApiClient::new(&addr);
    register(&api, LINEAR);
    let uuid = create(&api, "linear", json!({"even_number": 2}));
    assert_eq!(api.get_task(&uuid, 30).unwrap()["status"], "complete");
    gauge_until(&api, "snapshot_position", |v| v > 0.0);
    let Engine { serve, _dir } = engine;
    worker.kill();
    orchestrator.kill();
    serve.kill();

    let serve = Serve::start_on(&data, base, control, &one_broker);
    let engine = Engine { serve, _dir };
    let (orchestrator, addr) = engine.orchestrator_with("1000", &with_snapshots);
    // The snapshot's tail and everything before it are gone: it says both.
    assert!(orchestrator.printed("starting without the snapshot"));
    assert!(orchestrator.printed("the events before it are gone"));
    // Asking for another replication factor than the log's is said, not ignored.
    let (worker, id) = engine.worker_with("1000", &["--rf", "2", "--ack", "1"]);
    assert!(worker.printed("exists with replication factor 1, not the 2 asked for"));
    let api = ApiClient::new(&addr);
    register(&api, LINEAR);
    let uuid = create(&api, "linear", json!({"even_number": 2}));
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    assert_eq!(step(&t, "four")["worker"], json!(id), "{t:#}");
}

/// Polls `GET path` on the control port until it is no longer 503 `no_workflow_engine`
/// (an orchestrator announces itself within a second of serving; at most 30 s).
fn until_forwarded(control: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let a = http(control, "GET", "/v1/templates", None);
        if a.status != 503 {
            assert_eq!(a.status, 200, "{}", a.body);
            return;
        }
        assert!(Instant::now() < deadline, "never forwarded: {}", a.body);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The workflow API through the head's control port (`workflow_proxy`): 503
/// `no_workflow_engine` before any orchestrator runs; then templates, tasks, the
/// engine's own 503 with its Retry-After, a long poll, an event stream that flows event
/// by event and ends with the task, and the CLI with no `--api` (the control address is
/// the default); the head counts what it forwarded.
#[test]
fn the_control_port_forwards_the_workflow_api_to_the_orchestrator_that_announced_itself() {
    let engine = Engine::start();
    let control = engine.serve.control.clone();
    let none = http(&control, "GET", "/v1/tasks", None);
    assert_eq!(
        (none.status, none.header("retry-after")),
        (503, Some("1")),
        "{}",
        none.body
    );
    assert_eq!(none.json()["error"]["code"], "no_workflow_engine");
    assert_eq!(http(&control, "GET", "/v1/topics", None).status, 200);

    let (_orchestrator, _) = engine.orchestrator_with("3000", &["--max-open-tasks", "1"]);
    until_forwarded(&control);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("linear.yaml");
    std::fs::write(&file, LINEAR).unwrap();
    ok(&engine
        .serve
        .run(&["template", "register", file.to_str().unwrap()], None));

    let api = ApiClient::new(&control);
    let uuid = create(&api, "linear", json!({"even_number": 2}));
    let refused = submit(&control, "linear", json!({"even_number": 4}), None);
    assert_eq!(
        (refused.status, refused.header("retry-after")),
        (503, Some("1")),
        "the engine's backpressure, passed through: {}",
        refused.body
    );
    assert_eq!(refused.json()["error"]["code"], "backpressure");

    // No worker yet: these events arrive while the task is open, so the head passes
    // them on as they come, not once the upstream stream ended.
    let (mut events, mut stream) = events_until_enqueued(&control, &uuid);
    let (_worker, _) = engine.worker("3000");
    let t = api.get_task(&uuid, 30).unwrap();
    assert_eq!(t["status"], "complete", "the long poll: {t:#}");
    while let Some(e) = next_event(&mut stream) {
        events.push(e);
    }
    assert_eq!(events.last().unwrap()["to"], "complete", "{events:?}");

    let got = json_of(&engine.serve.run(&["task", "get", &uuid, "--json"], None));
    assert_eq!(got["status"], "complete", "{got:#}");
    let stats = ok(&engine.serve.run(&["task", "stats"], None));
    assert!(stats.contains("tasks: complete 1"), "{stats}");

    let metrics = http(&control, "GET", "/metrics", None).body;
    let forwarded = sample(&metrics, "embarcadero_workflow_proxy_requests_total").unwrap();
    assert!(forwarded >= 6.0, "{metrics}");
    let series = "embarcadero_workflow_proxy_failures_total{reason=\"no_engine\"}";
    assert!(sample(&metrics, series).unwrap() >= 1.0, "{metrics}");
}

fn json_of(out: &std::process::Output) -> Value {
    serde_json::from_str(&ok(out)).unwrap()
}

/// After the active orchestrator is SIGKILLed, the control port reaches the standby
/// that took over: a task created and awaited through it completes.
#[test]
fn the_control_port_reaches_the_standby_once_the_active_orchestrator_is_killed() {
    let engine = Engine::start();
    let [(active, active_api), (_standby, standby_api)] = two_orchestrators(&engine);
    let (_worker, _) = engine.worker("3000");
    let control = ApiClient::new(&engine.serve.control);
    until_forwarded(&engine.serve.control);
    register(&control, CHAIN);
    let first = create(&control, "chain", json!({"i": 0}));
    assert_eq!(control.get_task(&first, 30).unwrap()["status"], "complete");
    active.kill();
    let second = create(&control, "chain", json!({"i": 1}));
    let t = control.get_task(&second, 30).unwrap();
    assert_eq!(t["status"], "complete", "{t:#}");
    gauge_until(&standby_api, "orchestrator_active", |v| v == 1.0);
    assert!(
        active_api.get_task(&second, 0).is_err(),
        "the killed one is gone"
    );
}

/// One step in a namespace that no worker of the test serves: it stays enqueued.
const HELD: &str = "name: held
namespace: held
version: 1.0.0
steps:
  - {name: one, handler: {callable: math.square}}
  - {name: two, dependencies: [one], handler: {callable: math.square}}
";

#[test]
fn a_task_resolved_by_hand_ends_resolved_manually_only_if_unfinished_or_failed_and_replay_agrees() {
    let stack = Stack::start("3000", 0, &[LINEAR, FLAKY, HELD]);
    let _worker = stack.engine.worker_with("3000", &["--namespace", "demo"]);
    let (api, addr) = (&stack.api, stack.addr.as_str());

    // An unfinished task: its first step enqueued (no worker serves `held`), the second
    // pending behind it.
    let created = api
        .create_task("held", "held", "1.0.0", json!({}), None)
        .unwrap();
    let held = created["task_uuid"].as_str().unwrap().to_string();
    until(api, &held, "the first step to be enqueued", |t| {
        step(t, "one")["current_state"] == "enqueued"
    });
    let args = [
        "task",
        "resolve",
        &held,
        "--reason",
        "done by hand",
        "--by",
        "ops",
    ];
    let t = cli_json(&args, addr);
    assert_eq!(t["status"], "resolved_manually", "{t:#}");
    assert_eq!(t["resolution"], "done by hand (by ops)");
    assert_eq!(t["execution_status"], "resolved_manually");
    let moves = t["transitions"].as_array().unwrap();
    let last = moves.last().unwrap();
    assert_eq!(
        (&last["from"], &last["to"]),
        (&json!("steps_in_process"), &json!("resolved_manually"))
    );
    for name in ["one", "two"] {
        assert_eq!(step(&t, name)["current_state"], "cancelled", "{t:#}");
    }
    // Once resolved, a task cannot be resolved again (nor cancelled): 409 `task_closed`,
    // and the CLI exits non-zero saying so.
    let again = failed(&run_bin(&[&args[..], &["--api", addr]].concat()));
    assert!(
        again.contains("task_closed") && again.contains("resolved_manually"),
        "{again}"
    );
    let cancel = api.cancel_task(&held).unwrap_err();
    assert_eq!((cancel.status, cancel.code.as_str()), (409, "task_closed"));

    // A failed task may be resolved: it leaves the dead-letter list, its failed step
    // keeps its error.
    let flaky = create(api, "flaky", json!({}));
    let t = api.get_task(&flaky, 30).unwrap();
    assert_eq!(t["status"], "error", "{t:#}");
    let dlq = api.request("GET", "/v1/dlq", None).unwrap();
    assert_eq!(dlq["entries"].as_array().unwrap().len(), 1, "{dlq:#}");
    let path = format!("/v1/tasks/{flaky}/resolve");
    let t = api
        .request("POST", &path, Some(json!({"reason": "accepted as is"})))
        .unwrap();
    assert_eq!(
        (&t["status"], &t["resolution"]),
        (&json!("resolved_manually"), &json!("accepted as is"))
    );
    assert_eq!(step(&t, "always")["current_state"], "error");
    let dlq = api.request("GET", "/v1/dlq", None).unwrap();
    assert_eq!(dlq["entries"].as_array().unwrap().len(), 0, "{dlq:#}");

    // A complete task cannot be: 409, and it stays complete; an unknown one is 404.
    let linear = create(api, "linear", json!({"even_number": 2}));
    assert_eq!(api.get_task(&linear, 30).unwrap()["status"], "complete");
    let refused = api
        .request("POST", &format!("/v1/tasks/{linear}/resolve"), None)
        .unwrap_err();
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (409, "task_closed")
    );
    assert_eq!(api.get_task(&linear, 0).unwrap()["status"], "complete");
    let unknown = api
        .request("POST", "/v1/tasks/nope/resolve", Some(json!({})))
        .unwrap_err();
    assert_eq!((unknown.status, unknown.code.as_str()), (404, "not_found"));
    let bad = api
        .request("POST", &path, Some(json!({"why": "x"})))
        .unwrap_err();
    assert_eq!(bad.status, 400);
    let listed = api
        .request("GET", "/v1/tasks?status=resolved_manually", None)
        .unwrap();
    assert_eq!(listed["pagination"]["total_count"], 2, "{listed:#}");

    // A restarted orchestrator replays the `task_resolved` events to the same tasks.
    let before: Vec<Value> = [&held, &flaky]
        .iter()
        .map(|u| api.get_task(u, 0).unwrap())
        .collect();
    stack.orchestrator.kill();
    let (_again, addr) = stack.engine.orchestrator("3000");
    let replayed = ApiClient::new(&addr);
    for (uuid, t) in [&held, &flaky].iter().zip(&before) {
        let r = replayed.get_task(uuid, 0).unwrap();
        for field in ["status", "resolution", "transitions", "steps"] {
            assert_eq!(r[field], t[field], "replay agrees on {field} of {uuid}");
        }
    }
}
