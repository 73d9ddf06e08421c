//! The `embarcadero` binary as a user runs it: a real `serve` process, the quickstart
//! commands against it, a restart that keeps topics, and clear errors.

mod common;

use common::{failed, free_port, ok, Proc, Serve, BIN};
use std::io::Write;
use std::net::TcpListener;
use std::process::{Command, Stdio};

#[test]
fn quickstart_then_restart_keeps_topics() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let serve = Serve::start(&data);
    ok(&serve.run(&["topic", "create", "orders", "--order", "2"], None));
    ok(&serve.run(&["topic", "create", "logs", "--order", "0"], None));
    let published = ok(&serve.run(
        &["pub", "orders", "--json"],
        Some("first\nsecond\nthird é\n"),
    ));
    let summary: serde_json::Value = serde_json::from_str(&published).unwrap();
    assert_eq!(summary["messages"], 3);
    assert_eq!(
        summary["acked_messages"], 3,
        "the whole input, acknowledged"
    );
    assert_eq!(summary["reconnects"], 0);
    assert_eq!(summary["acked_batches"], summary["batches"]);
    let lines = ok(&serve.run(
        &["sub", "orders", "--count", "3", "--format", "jsonl"],
        None,
    ));
    let got: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let payloads: Vec<&str> = got.iter().map(|v| v["payload"].as_str().unwrap()).collect();
    assert_eq!(payloads, vec!["first", "second", "third é"]);
    let seqs: Vec<u64> = got
        .iter()
        .map(|v| v["global_seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, vec![0, 1, 2]);
    let text = ok(&serve.run(&["sub", "orders", "--from", "1", "--count", "2"], None));
    assert_eq!(text, "second\nthird é\n");
    // `start`, as the SDKs name the beginning, is the default's first retained message.
    let text = ok(&serve.run(&["sub", "orders", "--from", "start", "--count", "1"], None));
    assert_eq!(text, "first\n");
    // Positions of the wrong kind are refused with a message that says which kind.
    let out = serve.run(&["sub", "orders", "--from", "1,2"], None);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("positions are global") && err.contains("--from 1"),
        "{err}"
    );
    let out = serve.run(&["sub", "logs", "--from", "1,2"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("has 4 brokers") && err.contains("--from 0,0,0,0"),
        "{err}"
    );
    // Past the end: a note on stderr, and the idle timeout names where it waited.
    let out = serve.run(
        &["sub", "orders", "--from", "50", "--idle-timeout-s", "1"],
        None,
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("beyond the end of topic orders (next position 3)"),
        "{err}"
    );
    assert!(err.contains("(next position 50)"), "{err}");
    // From the start of a topic with nothing in it, no position is named (the cursor's
    // default 0 is not where a memory-only topic continues after a restart).
    ok(&serve.run(&["topic", "create", "quiet", "--memory-only"], None));
    let out = serve.run(&["sub", "quiet", "--idle-timeout-s", "1"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nothing retained to read yet"), "{err}");
    ok(&serve.run(&["topic", "delete", "quiet"], None));
    let generated = ok(&serve.run(
        &["pub", "logs", "--count", "5000", "--size", "100", "--json"],
        None,
    ));
    let summary: serde_json::Value = serde_json::from_str(&generated).unwrap();
    assert_eq!(summary["messages"], 5000);
    assert!(summary["ack_latency_us"]["p99"].as_u64().unwrap() > 0);
    // Without --ack, pub uses the topic's default ack level.
    ok(&serve.run(
        &[
            "topic",
            "create",
            "fire",
            "--order",
            "0",
            "--default-ack",
            "0",
        ],
        None,
    ));
    for (extra, level, acked) in [(None, 0, false), (Some("1"), 1, true)] {
        let mut args = vec!["pub", "fire", "--count", "2", "--json"];
        args.extend(extra.map(|a| ["--ack", a]).into_iter().flatten());
        let summary: serde_json::Value =
            serde_json::from_str(&ok(&serve.run(&args, None))).unwrap();
        assert_eq!(summary["ack_level"], level, "{args:?}");
        assert_eq!(
            summary["acked_batches"].as_u64().unwrap() > 0,
            acked,
            "{args:?}"
        );
    }
    let status: serde_json::Value =
        serde_json::from_str(&ok(&serve.run(&["status", "--json"], None))).unwrap();
    assert_eq!(status["brokers"].as_array().unwrap().len(), 4);
    // A reader that goes away (`status | head -0`) ends the command quietly.
    let mut child = Command::new(BIN)
        .args(["status", "--control", &serve.control])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("panicked"), "{err}");
    let described: serde_json::Value = serde_json::from_str(&ok(
        &serve.run(&["topic", "describe", "orders", "--json"], None)
    ))
    .unwrap();
    assert_eq!(described["next_position"], 3);
    serve.stop();

    let serve = Serve::start(&data);
    let topics: serde_json::Value =
        serde_json::from_str(&ok(&serve.run(&["topic", "list", "--json"], None))).unwrap();
    let mut names: Vec<&str> = topics["topics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, vec!["fire", "logs", "orders"]);
    serve.stop();
}

#[test]
fn binary_payloads_are_base64_in_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "bin", "--order", "1"], None));
    ok(&serve.run(&["pub", "bin"], Some("\u{0}\u{1}\n")));
    // A non-UTF-8 byte cannot come through a Rust &str; publish raw bytes instead.
    let mut child = Command::new(BIN)
        .args(["pub", "bin", "--control", &serve.control])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&[0xff, 0xfe, b'\n'])
        .unwrap();
    assert!(child.wait().unwrap().success());
    let out = ok(&serve.run(&["sub", "bin", "--count", "2", "--format", "jsonl"], None));
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines.iter().any(|v| v["payload_b64"] == "//4="), "{out}");
    assert!(lines
        .iter()
        .all(|v| v["global_seq"].is_null() && v["broker_seq"].is_u64()));
    serve.stop();
}

#[test]
fn errors_say_what_to_do_and_exit_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    let out = serve.run(&["pub", "missing"], Some("x\n"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("topic create"), "{err}");
    let out = serve.run(&["topic", "create", "bad/name"], None);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid topic name"));
    let out = serve.run(
        &["topic", "create", "t", "--rf", "1", "--default-ack", "2"],
        None,
    );
    assert!(!out.status.success());
    // A second server on the same data dir is refused.
    let second = Command::new(BIN)
        .args([
            "serve",
            "--base-port",
            "0",
            "--control-port",
            "0",
            "--data-dir",
        ])
        .arg(dir.path().join("d"))
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("in use by another"));
    // A broker's data port given as the control address.
    let status: serde_json::Value =
        serde_json::from_str(&ok(&serve.run(&["status", "--json"], None))).unwrap();
    let broker = status["brokers"][0]["addr"].as_str().unwrap();
    let out = Command::new(BIN)
        .args(["status", "--control", broker])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not the admin API") && err.contains("control port"),
        "{err}"
    );
    serve.stop();

    // Nothing listening.
    let out = Command::new(BIN)
        .args(["status", "--control", &format!("127.0.0.1:{}", free_port())])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("embarcadero serve"));
}

#[test]
fn serve_refuses_an_unusable_data_dir_and_a_busy_port() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let out = Command::new(BIN)
        .args([
            "serve",
            "--base-port",
            "0",
            "--control-port",
            "0",
            "--data-dir",
        ])
        .arg(file.join("data"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--data-dir"));

    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let out = Command::new(BIN)
        .args(["serve", "--control-port", "0", "--base-port"])
        .arg(port.to_string())
        .arg("--data-dir")
        .arg(dir.path().join("d2"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot listen") && err.contains("--base-port"),
        "{err}"
    );
}

/// Two servers configured with one region file: the second rebuilds the region, so the
/// first one, whose brokers no longer acknowledge, stops and says why.
#[test]
fn a_second_server_on_the_same_region_file_stops_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("shared.region").display().to_string();
    let env = [("EMBARCADERO_REGION_PATH", region.as_str())];
    let serve = |data: &str| {
        let data = dir.path().join(data).display().to_string();
        Proc::ready(
            &[
                "serve",
                "--base-port",
                "0",
                "--control-port",
                "0",
                "--data-dir",
                &data,
            ],
            &env,
            "embarcadero is serving",
        )
        .0
    };
    let mut first = serve("one");
    let second = serve("two");
    let line = first.wait_line("replaced it; this server stopped");
    assert!(line.contains("region.path"), "{line}");
    assert!(
        !first.wait().success(),
        "the first server exits with an error"
    );
    second.stop();
}

#[test]
fn config_file_env_and_flags_layer_in_that_order() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "brokers = 2\n[sequencer]\nepoch_us = 300\n").unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--print-config", "--epoch-us", "100", "--config"])
        .arg(&config)
        .env("EMBARCADERO_BROKERS", "3")
        .env("EMBARCADERO_SEQUENCER_EPOCH_US", "200")
        .output()
        .unwrap();
    let text = ok(&out);
    assert!(text.contains("brokers = 3"), "{text}");
    assert!(text.contains("epoch_us = 100"), "{text}");
    let out = Command::new(BIN)
        .args(["serve", "--print-config"])
        .env("EMBARCADERO_SEQUENCER_EPOCH_US", "nope")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("EMBARCADERO_SEQUENCER_EPOCH_US"));
    // A value out of its setting's range is the variable's fault, not a file's.
    let out = Command::new(BIN)
        .args(["serve", "--print-config"])
        .env("EMBARCADERO_BASE_PORT", "70000")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("EMBARCADERO_BASE_PORT"),
        "{err}"
    );
    assert!(!err.contains("config file"), "{err}");
    // ...and a file's is the file's, whatever variables are set beside it.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "base_port = 70000\n").unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--print-config", "--config"])
        .arg(&bad)
        .env("EMBARCADERO_BROKERS", "4")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.toml") && !err.contains("EMBARCADERO_BROKERS"),
        "{err}"
    );
    // The head's own default (broker 0) gives way to the file's and the environment's.
    let head = dir.path().join("head.toml");
    std::fs::write(&head, "brokers = 3\n[cluster]\nlocal_brokers = \"0,1\"\n").unwrap();
    let print_head = |env: &[(&str, &str)]| {
        let out = Command::new(BIN)
            .args(["broker", "--head", "--print-config", "--config"])
            .arg(&head)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        ok(&out)
    };
    assert!(print_head(&[]).contains("local_brokers = \"0,1\""));
    let from_env = print_head(&[("EMBARCADERO_CLUSTER_LOCAL_BROKERS", "0,2")]);
    assert!(from_env.contains("local_brokers = \"0,2\""), "{from_env}");
    // A follower reads none of it, and says so rather than start.
    let out = Command::new(BIN)
        .args([
            "broker",
            "--follower",
            "--head-addr",
            "127.0.0.1:1",
            "--broker-id",
            "1",
        ])
        .arg("--print-config")
        .output()
        .unwrap();
    assert!(failed(&out).contains("--print-config applies to `broker --head`"));
    // A misspelt variable is named, with the one it most likely meant; the settings left
    // empty are resolved in comments.
    let out = Command::new(BIN)
        .args(["serve", "--print-config", "--data-dir", "/srv/e"])
        .env("EMBARCADERO_SEQUENCER_EPOCHUS", "200")
        .output()
        .unwrap();
    let text = ok(&out);
    let warning = String::from_utf8_lossy(&out.stderr);
    assert!(
        warning.contains("EMBARCADERO_SEQUENCER_EPOCHUS")
            && warning.contains("did you mean EMBARCADERO_SEQUENCER_EPOCH_US"),
        "{warning}"
    );
    assert!(
        text.contains("region.path = \"\" means /srv/e/region"),
        "{text}"
    );
    assert!(
        text.contains("/srv/e/replica-1, /srv/e/replica-2"),
        "{text}"
    );
}

/// Every setting `serve --print-config` shows has a row in the README's configuration
/// table (a newcomer found five missing): `section.key`, or `key` in the row of its
/// section's pair (`broker.high_watermark` / `low_watermark`).
#[test]
fn the_readme_documents_every_setting() {
    let config = ok(&Command::new(BIN)
        .args(["serve", "--print-config"])
        .output()
        .unwrap());
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let rows: Vec<&str> = readme.lines().filter(|l| l.starts_with("| `")).collect();
    let mut section = String::new();
    let mut missing = Vec::new();
    let settings = config
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'));
    for line in settings {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = format!("{name}.");
            continue;
        }
        let Some((key, _)) = line.split_once(" = ") else {
            continue;
        };
        let full = format!("`{section}{key}`");
        let paired = format!("`{key}`");
        let documented = rows.iter().any(|r| {
            r.contains(&full) || (r.contains(&paired) && r.starts_with(&format!("| `{section}")))
        });
        if !documented {
            missing.push(format!("{section}{key}"));
        }
    }
    assert!(missing.is_empty(), "not in the README's table: {missing:?}");
}

#[test]
fn every_subcommand_has_help() {
    for args in [
        vec!["--help"],
        vec!["serve", "--help"],
        vec!["topic", "--help"],
        vec!["topic", "create", "--help"],
        vec!["topic", "list", "--help"],
        vec!["topic", "describe", "--help"],
        vec!["pub", "--help"],
        vec!["sub", "--help"],
        vec!["status", "--help"],
        vec!["bench", "--help"],
        vec!["broker", "--help"],
        vec!["sequencer", "--help"],
    ] {
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage"),
            "{args:?}"
        );
    }
}

/// `bench` runs end to end on its own embedded server: several publishers, then a
/// subscriber reading the filled topic from the start; every message is accounted for.
#[test]
fn bench_fills_a_topic_with_parallel_publishers_and_reads_it_back() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--no-ceilings",
            "--mode",
            "subscribe",
            "--publishers",
            "3",
            "--total-bytes",
            "4194304",
            "--json",
        ])
        .output()
        .unwrap();
    let figures: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(figures["publishers"], 3);
    assert_eq!(figures["messages"], 4096);
    assert_eq!(figures["payload_bytes"], 4194304);
    assert_eq!(figures["queues"].as_array().unwrap().len(), 3 * 4);
    assert!(figures["subscribe_only_seconds"].as_f64().unwrap() > 0.0);
    // The reading phase's CPU: part of the run's (which the process figure covers whole).
    let reading_cpu = figures["subscribe_only_cpu_seconds"].as_f64().unwrap();
    let run_cpu = figures["process_cpu_seconds_per_gb"].as_f64().unwrap() * 4194304.0 / 1e9;
    assert!(
        (0.0..=run_cpu + 1e-6).contains(&reading_cpu),
        "reading {reading_cpu} s of a run of {run_cpu} s"
    );
    assert_eq!(
        figures["append_to_ack_us"]["count"],
        figures["per_publisher_append_to_ack_us"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["count"].as_u64().unwrap())
            .sum::<u64>()
    );
}

/// `bench` splits CPU time per GB between the server and its clients: by thread for its
/// embedded server, from the server's own `process_cpu_seconds_total` for a running one.
#[test]
fn bench_reports_server_and_client_cpu_per_gb() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--no-ceilings",
            "--order",
            "2",
            "--total-bytes",
            "268435456",
            "--json",
        ])
        .output()
        .unwrap();
    let embedded: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    let process = embedded["process_cpu_seconds_per_gb"].as_f64().unwrap();
    let server = embedded["server_cpu_seconds_per_gb"].as_f64().unwrap();
    let client = embedded["client_cpu_seconds_per_gb"].as_f64().unwrap();
    assert!(
        server > 0.0,
        "the brokers' and sequencer's threads were found: {embedded}"
    );
    assert!(client > 0.0, "so were the publisher's: {embedded}");
    assert!((server + client - process).abs() < 1e-9);

    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    let out = serve.run(
        &[
            "bench",
            "--no-ceilings",
            "--order",
            "2",
            "--total-bytes",
            "67108864",
            "--json",
        ],
        None,
    );
    let running: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert!(running["process_cpu_seconds_per_gb"].is_null());
    assert!(running["server_cpu_seconds_per_gb"].as_f64().unwrap() > 0.0);
    assert!(running["client_cpu_seconds_per_gb"].as_f64().unwrap() > 0.0);
    serve.stop();
}

/// `bench --rate` with several publishers: they connect, warm up, start one schedule
/// together and keep it (the run takes the schedule's length, not less); the warm-up is
/// left out of the counts, and the latency is reported.
#[test]
fn bench_at_a_fixed_rate_keeps_the_schedule() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--no-ceilings",
            "--publishers",
            "3",
            "--total-bytes",
            "4194304",
            "--rate",
            "20",
            "--warmup-messages",
            "1000",
            "--json",
        ])
        .output()
        .unwrap();
    let figures: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(figures["messages"], 4096);
    assert_eq!(figures["payload_bytes"], 4194304);
    assert_eq!(figures["warmup_messages"], 1000);
    assert_eq!(figures["rate_mb_per_s"], 20.0);
    // 4 MiB at 20 MB/s: the last message is due after 0.21 s.
    let seconds = figures["publish_seconds"].as_f64().unwrap();
    assert!((0.2..5.0).contains(&seconds), "{seconds}");
    assert!(figures["append_to_ack_us"]["p99"].as_u64().unwrap() > 0);
    assert!(figures["schedule_max_lateness_us"].as_u64().is_some());
}
