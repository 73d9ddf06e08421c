//! `embarcadero bench` as a user runs it: broker-failure runs on a cluster of processes
//! with their exactly-once check, sweeps over orders and rates with a JSON array and a
//! plot, re-plotting saved results, publishing for a duration, and a failure run ended by
//! a signal taking its cluster with it.

mod common;

use common::{run_bin, BIN};
use serde_json::Value;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The run's stdout as JSON, after checking it exited 0.
fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("bench --json prints JSON")
}

/// (width, height) of a PNG file, decoded with the `png` crate.
fn png_size(path: &std::path::Path) -> (u32, u32) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut pixels).unwrap();
    (info.width, info.height)
}

#[test]
fn failure_mode_delivers_every_acknowledged_message_exactly_once_at_orders_2_and_5() {
    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--mode",
        "failure",
        "--order",
        "2,5",
        "--total-bytes",
        "60000000",
        "--json",
    ]);
    let runs = json_of(&out);
    let runs = runs.as_array().expect("two runs: an array");
    assert_eq!(runs.len(), 2);
    for (run, order) in runs.iter().zip([2, 5]) {
        assert_eq!(run["order"], order);
        let failure = &run["failure"];
        let check = &failure["check"];
        assert_eq!(check["passed"], true, "order {order}: {check}");
        assert_eq!(check["published"], run["messages"]);
        assert_eq!(check["delivered"], run["messages"]);
        assert_eq!(check["duplicates"], 0);
        assert_eq!(check["missing"], 0);
        // The last follower died while the publisher had batches on it.
        assert_eq!(failure["killed_broker"], 3);
        let victim = failure["killed_broker_addr"].as_str().unwrap();
        let victim_batches: u64 = run["queues"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|q| q["broker"] == victim)
            .map(|q| q["batches"].as_u64().unwrap())
            .sum();
        assert!(
            victim_batches > 0,
            "order {order}: the killed broker was in use"
        );
        assert!(
            failure["messages_before_kill"].as_u64().unwrap() > 0,
            "killed partway"
        );
        assert!(failure["kill_to_all_prior_acked_s"].is_f64());
        assert!(failure["longest_ack_stall_s"].is_f64());
    }
}

#[test]
fn a_sweep_prints_one_json_run_per_combination_and_plots_them_again_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("sweep.png");
    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--order",
        "0,2",
        "--rate",
        "20,max",
        "--total-bytes",
        "2000000",
        "--json",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let runs = json_of(&out);
    let combinations: Vec<(u64, Option<f64>)> = runs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["order"].as_u64().unwrap(), r["rate_mb_per_s"].as_f64()))
        .collect();
    assert_eq!(
        combinations,
        [(0, Some(20.0)), (0, None), (2, Some(20.0)), (2, None)]
    );
    let size = png_size(&plot);
    assert!(size.0 >= 1600 && size.1 > 0, "{size:?}");

    // The saved output, plotted again without running anything.
    let saved = dir.path().join("sweep.json");
    std::fs::write(&saved, &out.stdout).unwrap();
    let replot = dir.path().join("again.png");
    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--plot",
        replot.to_str().unwrap(),
        "--from-json",
        saved.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("plotted 4 runs"));
    assert_eq!(png_size(&replot), size);
}

/// A default run measures the machine's ceilings right after itself and reports every
/// headline figure against them, and summarises the server's per-stage timers.
#[test]
fn a_run_reports_its_figures_against_the_same_runs_ceilings_and_per_stage() {
    let out = run_bin(&[
        "bench",
        "--mode",
        "e2e",
        "--order",
        "2",
        "--total-bytes",
        "20000000",
        "--json",
    ]);
    let run = json_of(&out);
    let ceilings = run["ceilings"].as_array().expect("ceilings by default");
    let ceiling = |prefix: &str| {
        ceilings
            .iter()
            .find(|c| c["name"].as_str().unwrap().starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} ceiling in {ceilings:?}"))
    };
    for prefix in ["loopback_tcp_ring", "memcpy", "fdatasync"] {
        assert!(ceiling(prefix)["mb_per_s"].as_f64().unwrap() > 0.0);
    }
    let ratios = &run["ceiling_ratios"];
    let ratio = |key: &str| {
        ratios[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {ratios}"))
    };
    let mb_s = run["mb_per_s"].as_f64().unwrap();
    let same = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    let loopback = ceiling("loopback_tcp streams=1 ")["mb_per_s"]
        .as_f64()
        .unwrap();
    assert!(same(ratio("mb_per_s_to_loopback_tcp"), mb_s / loopback));
    assert!(ratio("mb_per_s_to_loopback_tcp_ring") > 0.0);
    // Latencies as multiples of one message's loopback round trip.
    let round_trip = ceiling("loopback_round_trip request=1024 reply=16");
    for (figure, key) in [
        ("append_to_ack_us", "append_to_ack"),
        ("e2e_latency_us", "e2e"),
    ] {
        for p in ["p50", "p99"] {
            let ours = run[figure][p].as_f64().unwrap();
            let floor = round_trip[format!("{p}_us")].as_f64().unwrap();
            let key = format!("{key}_{p}_over_loopback_round_trip");
            assert!(same(ratio(&key), ours / floor), "{key}");
        }
    }
    assert!(
        ratios.get("mb_per_s_to_fdatasync").is_none(),
        "ack 1 writes no disk"
    );
    // Per stage: the brokers' and the sequencer's, and the epoch's share of the wait.
    let stages = run["stage_ms_per_gb"].as_object().unwrap();
    for stage in [
        "receive",
        "commit",
        "ack_send",
        "sequencer_scan",
        "sequencer_goi_write",
        "sequencer_sequence",
    ] {
        assert!(
            stages[stage].as_f64().unwrap() > 0.0,
            "stage {stage}: {stages:?}"
        );
    }
    let epoch_wait = run["epoch_wait_us_per_batch"].as_f64().unwrap();
    let ack_wait = run["ack_wait_us_per_batch"].as_f64().unwrap();
    assert!(
        epoch_wait > 0.0 && epoch_wait <= ack_wait,
        "{epoch_wait} of {ack_wait}"
    );
}

#[test]
fn duration_publishes_until_it_ends_and_excludes_total_bytes() {
    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--duration",
        "1",
        "--rate",
        "10",
        "--json",
    ]);
    let run = json_of(&out);
    assert!(run.is_object(), "one run: one object, as before");
    assert_eq!(run["duration_s"], 1.0);
    assert!(run["publish_seconds"].as_f64().unwrap() >= 1.0);
    // On the fixed schedule no message is published before it is due, so one second at
    // 10 MB/s holds at most 9766 messages (plus the 16 between two clock checks).
    let messages = run["messages"].as_u64().unwrap();
    assert!((1..=9766 + 16).contains(&messages), "{messages}");

    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--duration",
        "1",
        "--total-bytes",
        "1000",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}

/// An end-to-end run with a warm-up: the subscriber reads the warm-up's messages as well
/// (it waits for all of them), but they are neither counted nor timed.
#[test]
fn an_end_to_end_warm_up_is_read_but_left_out_of_the_figures() {
    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--mode",
        "e2e",
        "--rate",
        "20",
        "--total-bytes",
        "2000000",
        "--warmup-messages",
        "1000",
        "--json",
    ]);
    let run = json_of(&out);
    assert_eq!(
        run["messages"], 1953,
        "2 MB of 1 KiB messages, warm-up excluded"
    );
    assert_eq!(run["warmup_messages"], 1000);
    // One in 64 received messages is timed: the measured ones are received 1000-2952
    // (the warm-up's are ordered first), so at most the 31 multiples of 64 among them.
    let timed = run["e2e_latency_us"]["samples"].as_u64().unwrap();
    assert!((1..=31).contains(&timed), "{timed}");
}

/// `--verify` on an end-to-end run: every message of two order-5 publishers reaches the
/// subscriber once, in one gap-free order that keeps each publisher's order; other modes
/// and unordered topics are refused before anything runs.
#[test]
fn an_end_to_end_run_with_verify_checks_every_message_exactly_once() {
    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--mode",
        "e2e",
        "--order",
        "5",
        "--publishers",
        "2",
        "--total-bytes",
        "20000000",
        "--verify",
        "--json",
    ]);
    let run = json_of(&out);
    let check = &run["check"];
    assert_eq!(check["passed"], true, "{check}");
    assert_eq!(check["published"], run["messages"]);
    assert_eq!(check["delivered"], run["messages"]);
    assert_eq!(check["out_of_session_order"], 0);

    for refused in [
        &["--mode", "e2e", "--order", "0", "--verify"][..],
        &["--mode", "publish", "--order", "2", "--verify"][..],
        &["--mode", "e2e", "--order", "2", "--verify", "--size", "4"][..],
    ] {
        let out = run_bin(&[&["bench"], refused].concat());
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("--verify"));
    }
}

#[test]
fn bench_help_documents_duration_failure_mode_and_plots() {
    let out = run_bin(&["bench", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--duration <SECS>",
        "failure",
        "--kill-after-secs",
        "--plot <FILE.png>",
        "--from-json <FILE.json>",
        "--rate 100,200,400,800",
        "--order 0,2,5",
    ] {
        assert!(help.contains(flag), "bench --help does not mention {flag}");
    }
}

/// Process ids whose parent is `parent`, from /proc.
fn children_of(parent: u32) -> Vec<u32> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name (in parentheses): state, then the parent's id.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        if rest.split_whitespace().nth(1) == Some(&parent.to_string()) {
            children.push(pid);
        }
    }
    children
}

/// Gone, or a zombie waiting to be reaped.
fn is_dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

/// Polls `cond` until it holds; fails the test after 20 s.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(20), "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_failure_run_ended_by_sigterm_kills_its_cluster_and_removes_its_region() {
    let mut bench = Command::new(BIN)
        .args([
            "bench",
            "--no-ceilings",
            "--mode",
            "failure",
            "--duration",
            "60",
            "--rate",
            "10",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = bench.id();
    let mut cluster = Vec::new();
    wait_for("the head and three followers running", || {
        cluster = children_of(pid);
        cluster.len() == 4
    });
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = bench.wait().unwrap();
    assert_eq!(exit.code(), Some(130), "interrupted: {exit:?}");
    wait_for("every process of the cluster dead", || {
        cluster.iter().all(|&p| is_dead(p))
    });
    let prefix = format!("embarcadero-cluster-{pid}-");
    let regions: Vec<_> = std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .collect();
    assert!(regions.is_empty(), "left behind: {regions:?}");
}

/// `bench --mode subscribe` against a server whose memory-only topic cannot keep the
/// whole run: the subscriber, which starts from the beginning once publishing ends, is
/// told its start was reclaimed, and the run ends with an error naming the positions and
/// what to change, instead of waiting for messages that can never come.
#[test]
fn subscribe_mode_reports_a_reclaimed_start_instead_of_waiting_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let serve = common::Serve::start_small(dir.path());
    // Twice the broker's whole log memory: the first messages are reclaimed for sure.
    let out = run_bin(&[
        "bench",
        "--no-ceilings",
        "--mode",
        "subscribe",
        "--control",
        &serve.control,
        "--total-bytes",
        "33554432",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the run cannot read what was reclaimed"
    );
    assert!(
        stderr.contains("were reclaimed before the subscriber started")
            && stderr.contains("--total-bytes"),
        "{stderr}"
    );
    serve.stop();
}
