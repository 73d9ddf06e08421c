//! `status`, `topic list` and `topic describe` as people read them (issue 22): labeled
//! columns, real positions for orders 0 and 1, rates, and trouble named where it is —
//! a subscriber that does not read holds publishers back, and both `status` and `pub`
//! say so.

mod common;

use common::{ok, sample, scrape, Serve, BIN};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest wait for a condition before the test fails: a hang guard, not a measurement.
const GUARD: Duration = Duration::from_secs(60);

fn json(serve: &Serve, args: &[&str]) -> serde_json::Value {
    let mut args = args.to_vec();
    args.push("--json");
    serde_json::from_str(&ok(&serve.run(&args, None))).unwrap()
}

/// Polls `check` until it returns something, failing after `GUARD`.
fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + GUARD;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {GUARD:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn status_and_topic_list_label_their_columns_and_show_order_1_positions() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "fifo", "--order", "1"], None));
    ok(&serve.run(&["pub", "fifo", "--count", "1000", "--size", "10"], None));

    let list = ok(&serve.run(&["topic", "list"], None));
    let mut lines = list.lines();
    let header = lines.next().unwrap();
    for column in ["TOPIC", "ORDER", "RF", "READERS", "NEXT POSITION"] {
        assert!(header.contains(column), "{column} missing: {list}");
    }
    // Orders 0 and 1 have a position per broker log: they add up to what was sent.
    let row = lines.next().unwrap();
    let positions: u64 = row
        .split_whitespace()
        .filter_map(|w| w.split_once(':'))
        .map(|(_, n)| n.replace(',', "").parse::<u64>().unwrap())
        .sum();
    assert_eq!(positions, 1000, "{list}");

    // Rates appear once the server has two samples (one a second).
    let rates = eventually("rates in status", || {
        let s = json(&serve, &["status"]);
        s["rates"]["window_ms"].as_u64().map(|_| s["rates"].clone())
    });
    assert!(rates["topics"]["fifo"].is_u64(), "{rates}");
    assert!(
        rates["brokers"][0]["publish_bytes_per_s"].is_u64(),
        "{rates}"
    );
    let status = ok(&serve.run(&["status"], None));
    for column in [
        "BROKER",
        "ADDRESS",
        "PUB/S",
        "SUB/S",
        "MSG/S",
        "NEXT POSITION",
    ] {
        assert!(status.contains(column), "{column} missing: {status}");
    }
    let describe = ok(&serve.run(&["topic", "describe", "fifo"], None));
    assert!(describe.contains("FIFO per broker"), "{describe}");
    assert!(
        describe.contains("BROKER") && describe.contains("MESSAGES"),
        "{describe}"
    );
    assert!(!describe.contains('{'), "no raw JSON: {describe}");
    serve.stop();
}

/// A memory-only topic with little memory, a subscriber whose output nobody reads, and
/// a publisher: memory fills with what the subscriber has not read, the publisher waits
/// and says so, and `topic describe`/`status` name the subscriber.
#[test]
fn a_subscriber_that_does_not_read_is_named_and_its_publisher_warns() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start_small(dir.path());
    ok(&serve.run(&["topic", "create", "held", "--memory-only"], None));
    // Its stdout is a pipe the test never reads: once the pipe is full it stops.
    let mut sub = Command::new(BIN)
        .args(["sub", "held", "--control", &serve.control])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    eventually("the subscriber connected", || {
        let t = json(&serve, &["topic", "describe", "held"]);
        (t["health"]["readers"] == 1).then_some(())
    });
    let mut publisher = Command::new(BIN)
        .args(["pub", "held", "--count", "100000000", "--size", "1000"])
        .args(["--control", &serve.control])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut warning = String::new();
    let mut stderr = BufReader::new(publisher.stderr.take().unwrap());
    while !warning.contains("no acknowledgement for") {
        warning.clear();
        assert!(
            stderr.read_line(&mut warning).unwrap() > 0,
            "pub ended without a warning"
        );
    }
    assert!(warning.contains("embarcadero status"), "{warning}");

    let t = json(&serve, &["topic", "describe", "held"]);
    let slowest = &t["health"]["slowest_reader"];
    assert!(slowest["behind"].as_u64().unwrap() > 0, "{t}");
    // The same for an alert: /metrics has the subscriber and its lag.
    let metrics = scrape(&serve.control);
    assert_eq!(
        sample(&metrics, "embarcadero_topic_readers{topic=\"held\"}"),
        1
    );
    let lag = "embarcadero_topic_reader_lag_messages{topic=\"held\"}";
    assert!(sample(&metrics, lag) > 0, "{metrics}");
    let status = eventually("status names the subscriber", || {
        let s = ok(&serve.run(&["status"], None));
        s.contains("needs attention").then_some(s)
    });
    assert!(
        status.contains("topic held: a subscriber (reader slot"),
        "{status}"
    );
    publisher.kill().unwrap();
    publisher.wait().unwrap();
    sub.kill().unwrap();
    sub.wait().unwrap();
    serve.stop();
}
