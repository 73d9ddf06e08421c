//! `bench --mode workflow`: the workflow engine's latency on Tasker's shapes and its
//! sustained throughput, on a server, an orchestrator and a worker started here as child
//! processes of this executable (events durable: the engine's defaults, topic RF 2 and
//! ack 2). Owns those processes (all stopped at the end and on error) and a scratch
//! data directory; the measuring itself is `crate::workflow::measure`'s.

use super::BenchArgs;
use crate::workflow::measure::{measure, Measured, Until};
use embarcadero_cli::local_cluster::{ChildProcess, Echo};
use embarcadero_workflow::client::ApiClient;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// Tasker's shapes, built in so the binary needs no files (the Tasker peer scripts read
/// the same files, `scripts/peers/tasker/run.sh`).
const TEMPLATES: [&str; 6] = [
    include_str!("workflow/linear.yaml"),
    include_str!("workflow/diamond.yaml"),
    include_str!("workflow/conditional.yaml"),
    include_str!("workflow/complex_dag.yaml"),
    include_str!("workflow/tree.yaml"),
    include_str!("workflow/batch.yaml"),
];

/// Seconds of the sustained run when --duration is not given.
const SUSTAINED_SECS: f64 = 10.0;

/// One measured shape: its name in the table, its template, its root number (larger
/// shapes overflow 64 bits when squaring 2) and how many clients run it at once.
struct Shape {
    label: &'static str,
    template: &'static str,
    number: u64,
    clients: usize,
}

const SHAPES: [Shape; 7] = [
    shape("linear", "linear", 2, 1),
    shape("diamond", "diamond", 2, 1),
    shape("conditional", "conditional", 2, 1),
    shape("complex_dag", "complex_dag", 1, 1),
    shape("tree", "tree", 1, 1),
    shape("batch", "batch", 2, 1),
    // Two linear tasks at once (Tasker's concurrent_2x), each timed on its own.
    shape("concurrent_2x", "linear", 2, 2),
];

const fn shape(label: &'static str, template: &'static str, number: u64, clients: usize) -> Shape {
    Shape {
        label,
        template,
        number,
        clients,
    }
}

/// The engine's three processes; fields drop (and so stop) worker first, server last.
struct Engine {
    worker: ChildProcess,
    orchestrator: ChildProcess,
    serve: ChildProcess,
    api: String,
}

impl Engine {
    fn start(args: &BenchArgs, data: &Path) -> Result<Self, String> {
        let program = std::env::current_exe()
            .map_err(|e| format!("cannot find this executable to start the engine: {e}"))?;
        let dir = data.to_string_lossy().to_string();
        let epoch = args.epoch_us.to_string();
        let (serve, line) = ChildProcess::ready(
            &program,
            &[
                "serve",
                "--data-dir",
                &dir,
                "--base-port",
                "0",
                "--control-port",
                "0",
                "--epoch-us",
                &epoch,
            ],
            &[],
            "the server",
            "embarcadero is serving",
            Echo::Quiet,
        )?;
        let control = address_in(&line)?;
        let (orchestrator, line) = ChildProcess::ready(
            &program,
            &[
                "orchestrator",
                "--control",
                &control,
                "--listen",
                "127.0.0.1:0",
            ],
            &[],
            "the orchestrator",
            "orchestrator is serving",
            Echo::Quiet,
        )?;
        let api = address_in(&line)?;
        let (worker, _) = ChildProcess::ready(
            &program,
            &["worker", "--control", &control],
            &[],
            "the worker",
            "is running",
            Echo::Quiet,
        )?;
        Ok(Self {
            worker,
            orchestrator,
            serve,
            api,
        })
    }

    fn pids(&self) -> Value {
        json!({"serve": self.serve.id(), "orchestrator": self.orchestrator.id(), "worker": self.worker.id()})
    }

    /// SIGTERM to each, worker first, and wait for each to exit.
    fn stop(mut self) -> Result<(), String> {
        for p in [&mut self.worker, &mut self.orchestrator, &mut self.serve] {
            p.terminate()?;
        }
        Ok(())
    }
}

/// The host:port after `http://` in a readiness line.
fn address_in(line: &str) -> Result<String, String> {
    let rest = line
        .split("http://")
        .nth(1)
        .ok_or_else(|| format!("no address in {line:?}"))?;
    Ok(rest
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

pub fn check_args(args: &BenchArgs) -> Result<(), String> {
    if args.control.is_some() {
        return Err("--mode workflow starts its own server: leave out --control".into());
    }
    Ok(())
}

/// Starts the engine, measures, stops the engine; prints the table or the JSON.
pub fn run(args: &BenchArgs) -> Result<(), String> {
    let scratch = tempfile::Builder::new()
        .prefix("embarcadero-bench-workflow")
        .tempdir()
        .map_err(|e| format!("cannot make a scratch directory: {e}"))?;
    let engine = Engine::start(args, scratch.path())?;
    let load_before = loadavg();
    // On error the engine drops here, which kills and reaps every process.
    let figures = measure_all(args, &engine.api)?;
    let pids = engine.pids();
    engine.stop()?;
    let out = json!({"mode": "workflow", "shapes": figures.0, "sustained": figures.1,
        "processes": pids, "load_before": load_before, "load_after": loadavg()});
    match args.json {
        true => say!("{}", serde_json::to_string_pretty(&out).expect("json")),
        false => print_table(&out),
    }
    Ok(())
}

/// Registers the templates, runs every shape one task at a time, then the sustained run.
fn measure_all(args: &BenchArgs, api: &str) -> Result<(Vec<Value>, Value), String> {
    let client = ApiClient::new(api);
    for yaml in TEMPLATES {
        client
            .register_template(yaml)
            .map_err(|e| format!("cannot register a template: {e}"))?;
    }
    let mut shapes = Vec::with_capacity(SHAPES.len());
    for s in &SHAPES {
        let count = args.workflow_tasks * s.clients;
        let m = measure(
            api,
            template(s.template),
            &context(s),
            Until::Tasks(count),
            s.clients,
        )
        .map_err(|e| format!("shape {}: {e}", s.label))?;
        shapes.push(row(s.label, &m));
    }
    let until = match args.workflow_sustained_tasks {
        Some(n) => Until::Tasks(n),
        None => Until::Elapsed(Duration::from_secs_f64(
            args.duration.unwrap_or(SUSTAINED_SECS),
        )),
    };
    let linear = &SHAPES[0];
    let m = measure(
        api,
        template(linear.template),
        &context(linear),
        until,
        args.clients,
    )
    .map_err(|e| format!("sustained run: {e}"))?;
    Ok((shapes, row("sustained linear", &m)))
}

fn template(name: &str) -> [&str; 3] {
    ["bench", name, "1.0.0"]
}

/// A task's input: the root's number; the conditional's decision creates the two
/// branches `branches` names.
fn context(s: &Shape) -> Value {
    match s.template {
        "conditional" => json!({"even_number": s.number, "branches": ["medium", "huge"]}),
        _ => json!({"even_number": s.number}),
    }
}

fn row(label: &str, m: &Measured) -> Value {
    let mut v = m.to_json();
    v["shape"] = json!(label);
    v["create_p95_ms"] = json!(m.create[1]);
    v
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|_| "?".into(), |l| l.trim().into())
}

fn print_table(out: &Value) {
    say!(
        "{:<18} {:>6} {:>8} {:>8} {:>8} {:>10} {:>8}",
        "shape",
        "tasks",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "create p50",
        "tasks/s"
    );
    let rows = out["shapes"].as_array().into_iter().flatten();
    for r in rows.chain(std::iter::once(&out["sustained"])) {
        let sustained = r == &out["sustained"];
        let per_s = match sustained {
            true => format!("{:.1}", r["tasks_per_s"].as_f64().unwrap_or(0.0)),
            false => "-".into(),
        };
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        say!(
            "{:<18} {:>6} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {:>8}",
            r["shape"].as_str().unwrap_or("?"),
            r["tasks"].as_u64().unwrap_or(0),
            f("p50_ms"),
            f("p95_ms"),
            f("p99_ms"),
            f("create_p50_ms"),
            per_s
        );
    }
    say!(
        "sustained: {} closed-loop clients; load before {}, after {}",
        out["sustained"]["clients"],
        out["load_before"].as_str().unwrap_or("?"),
        out["load_after"].as_str().unwrap_or("?")
    );
}
