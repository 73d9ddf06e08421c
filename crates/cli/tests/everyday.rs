//! Everyday use of the `embarcadero` binary (issue 22), as a user hits it: live `sub`
//! output, what a failed `pub` says, `sub --from end`, names checked before a request,
//! `--advertise`, the region's room on its filesystem, and the smaller rough edges.

mod common;

use common::{failed, ok, Serve, BIN};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Longest wait for one line before the test fails: a hang guard, far above any
/// normal delay, not a measurement.
const LINE_GUARD: Duration = Duration::from_secs(30);

/// The lines of a child's pipe, as they are written, read on a thread of their own.
fn lines_of(pipe: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The next line of `lines` that contains `marker` (others are skipped).
fn wait_for(lines: &Receiver<String>, marker: &str) -> String {
    loop {
        match lines.recv_timeout(LINE_GUARD) {
            Ok(line) if line.contains(marker) => return line,
            Ok(_) => {}
            Err(RecvTimeoutError::Timeout) => {
                panic!("no line with {marker:?} within {LINE_GUARD:?}")
            }
            Err(RecvTimeoutError::Disconnected) => panic!("the pipe closed before {marker:?}"),
        }
    }
}

/// `embarcadero ARGS --control ...` with every pipe connected to the test.
fn spawn(serve: &Serve, args: &[&str]) -> Child {
    Command::new(BIN)
        .args(args)
        .args(["--control", &serve.control])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn write_line(stdin: &Mutex<ChildStdin>, line: &str) {
    let mut stdin = stdin.lock().unwrap();
    writeln!(stdin, "{line}").unwrap();
    stdin.flush().unwrap();
}

/// Messages published one at a time are each printed before the next is sent. Another
/// message every 10 ms keeps the subscriber from ever going idle for its 200 ms poll, so
/// a `sub` that flushed only after an idle poll (or a full 8 KiB buffer, 40 s of those
/// two-byte messages) would never print the awaited line and the test would time out.
#[test]
fn sub_prints_each_message_as_it_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "live", "--order", "2"], None));
    let mut sub = spawn(&serve, &["sub", "live"]);
    let printed = lines_of(sub.stdout.take().unwrap());
    let mut publisher = spawn(&serve, &["pub", "live", "--linger-us", "0"]);
    let stdin = Arc::new(Mutex::new(publisher.stdin.take().unwrap()));
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = {
        let (stdin, stop) = (stdin.clone(), stop.clone());
        // A steady trickle (load, not synchronisation): never idle, never a full buffer.
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                write_line(&stdin, ".");
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    for i in 0..5 {
        let message = format!("message-{i}");
        write_line(&stdin, &message);
        assert_eq!(wait_for(&printed, "message-"), message);
    }
    stop.store(true, Ordering::Release);
    ticker.join().unwrap();
    drop(stdin);
    let published = publisher.wait_with_output().unwrap();
    ok(&published);
    sub.kill().unwrap();
    sub.wait().unwrap();
    serve.stop();
}

/// The counts a failed `pub` reports: "N message(s) of P acknowledged", and the line
/// to resume from (reading stdin).
fn acked_and_resume(stderr: &str) -> (u64, u64) {
    let acked_line = stderr
        .lines()
        .find(|l| l.contains(" acknowledged"))
        .unwrap_or_else(|| panic!("no acknowledged count in {stderr}"));
    let acked: u64 = acked_line
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let resume: u64 = acked_line
        .split("resume from line ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("no resume line in {acked_line}"))
        .parse()
        .unwrap();
    (acked, resume)
}

/// A line too large to publish: the lines before it are acknowledged, and `pub` says
/// so, names the line, says where to resume, and exits non-zero.
#[test]
fn pub_with_a_bad_line_says_what_was_acknowledged_and_where_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "lines", "--order", "2"], None));
    let too_large = "x".repeat(2 << 20);
    // Last, so that all of stdin is written before `pub` can stop reading it.
    let input = format!("one\ntwo\n{too_large}\n");
    let out = serve.run(&["pub", "lines", "--json"], Some(&input));
    let err = failed(&out);
    assert!(
        err.contains("line 3 was not published") && err.contains("exceeds"),
        "{err}"
    );
    assert!(err.contains("2 messages of 2 acknowledged"), "{err}");
    assert_eq!(acked_and_resume(&err), (2, 3));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["acked_messages"], 2);
    assert_eq!(summary["resume_line"], 3);
    let read = ok(&serve.run(&["sub", "lines", "--count", "2"], None));
    assert_eq!(read, "one\ntwo\n");
    serve.stop();
}

/// The server is SIGKILLed while `pub --ack 2` reads stdin: `pub` exits non-zero with
/// the number of acknowledged lines, and after a restart exactly those lines (at least)
/// are in the topic, so resuming from the line it names loses nothing.
#[test]
fn pub_whose_server_is_killed_says_what_was_acknowledged_and_where_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let serve = Serve::start(&data);
    ok(&serve.run(
        &["topic", "create", "kept", "--order", "2", "--rf", "2"],
        None,
    ));
    let mut publisher = spawn(
        &serve,
        &[
            "pub",
            "kept",
            "--ack",
            "2",
            "--linger-us",
            "0",
            "--retry-for",
            "0",
        ],
    );
    let stdin = Mutex::new(publisher.stdin.take().unwrap());
    for i in 1..=5 {
        write_line(&stdin, &format!("line-{i}"));
    }
    // Durable, so acknowledged or about to be: the run is well under way.
    ok(&serve.run(&["sub", "kept", "--count", "5"], None));
    serve.kill();
    for i in 6..=10 {
        // The publisher may already have given up and closed its end.
        let _ = writeln!(stdin.lock().unwrap(), "line-{i}");
    }
    drop(stdin);
    let out = publisher.wait_with_output().unwrap();
    let err = failed(&out);
    let (acked, resume) = acked_and_resume(&err);
    assert!(acked <= 10, "{err}");
    assert_eq!(resume, acked + 1, "{err}");
    assert!(err.contains(&format!("tail -n +{resume}")), "{err}");

    let serve = Serve::start(&data);
    if acked > 0 {
        let count = acked.to_string();
        let read = ok(&serve.run(&["sub", "kept", "--count", &count], None));
        let want: String = (1..=acked).map(|i| format!("line-{i}\n")).collect();
        assert_eq!(read, want, "every acknowledged line survived");
    }
    serve.stop();
}

/// The server is SIGKILLed and started again on the same ports while `pub` reads stdin
/// and `sub` prints: both reconnect by themselves (`--retry-for`, 60 s by default),
/// `pub` exits 0 once every line is acknowledged, and `sub` continues where it was:
/// every line arrives, in order of first appearance (a line whose acknowledgement was
/// lost with the server may be published, and so printed, a second time).
#[test]
fn pub_and_sub_carry_on_across_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (base, control) = (common::free_port(), common::free_port());
    let one_broker = ["--brokers", "1"];
    let serve = Serve::start_on(&data, base, control, &one_broker);
    ok(&serve.run(&["topic", "create", "on", "--order", "2"], None));
    let mut sub = spawn(&serve, &["sub", "on"]);
    let printed = lines_of(sub.stdout.take().unwrap());
    let mut publisher = spawn(&serve, &["pub", "on", "--ack", "2", "--linger-us", "0"]);
    let stdin = Mutex::new(publisher.stdin.take().unwrap());
    let mut seen = Vec::new();
    for i in 1..=5 {
        write_line(&stdin, &format!("line-{i}"));
        seen.push(wait_for(&printed, "line-"));
    }
    let notes = lines_of(publisher.stderr.take().unwrap());
    serve.kill();
    for i in 6..=10 {
        write_line(&stdin, &format!("line-{i}"));
    }
    // At the end of its input `pub` waits for the acknowledgements; the server stays
    // down until `pub` has given up on its connections and waits for the server.
    drop(stdin);
    wait_for(&notes, "lost the server");
    let serve = Serve::start_on(&data, base, control, &one_broker);
    wait_for(&notes, "reconnected");
    let out = publisher.wait_with_output().unwrap();
    // Its summary counts the whole input, not what the last connection published.
    let summary = ok(&out);
    assert!(
        summary.contains("10 messages acknowledged in all; reconnected 1 time"),
        "{summary}"
    );
    while seen.last().is_none_or(|l| l != "line-10") {
        seen.push(wait_for(&printed, "line-"));
    }
    let mut first_seen: Vec<&String> = Vec::new();
    for line in &seen {
        if !first_seen.contains(&line) {
            first_seen.push(line);
        }
    }
    let want: Vec<String> = (1..=10).map(|i| format!("line-{i}")).collect();
    assert_eq!(
        first_seen,
        want.iter().collect::<Vec<_>>(),
        "printed: {seen:?}"
    );
    sub.kill().unwrap();
    sub.wait().unwrap();
    serve.stop();
}

/// `sub --from end` prints only what is published after it starts, for a global order
/// and for per-broker positions.
#[test]
fn sub_from_end_prints_only_new_messages() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    for (topic, order) in [("total", "2"), ("fifo", "1")] {
        ok(&serve.run(&["topic", "create", topic, "--order", order], None));
        ok(&serve.run(&["pub", topic], Some("old-1\nold-2\nold-3\n")));
        let mut sub = spawn(&serve, &["sub", topic, "--from", "end", "--count", "1"]);
        let notes = lines_of(sub.stderr.take().unwrap());
        let note = wait_for(&notes, "starting at the end");
        assert!(note.contains(topic), "{note}");
        ok(&serve.run(&["pub", topic], Some("new\n")));
        let out = sub.wait_with_output().unwrap();
        assert_eq!(ok(&out), "new\n", "topic {topic}");
    }
    // Negative positions get advice that works, not clap's `-- -1` tip.
    let err = failed(&serve.run(&["sub", "total", "--from", "-1"], None));
    assert!(
        err.contains("--from end") && !err.contains("-- -1"),
        "{err}"
    );
    serve.stop();
}

/// Names are checked before any request: `a?zzz` is not topic `a` with a query, and
/// `../status` is not another endpoint.
#[test]
fn topic_names_are_checked_before_any_request() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "a", "--order", "2"], None));
    for name in ["a?zzz", "../status", "a/b"] {
        for args in [
            vec!["topic", "describe", name],
            vec!["sub", name],
            vec!["pub", name],
        ] {
            let err = failed(&serve.run(&args, None));
            assert!(
                err.contains("invalid topic name") && err.contains("1 to 63 letters"),
                "{args:?}: {err}"
            );
        }
    }
    serve.stop();
}

/// The smaller rough edges of issue 22.
#[test]
fn small_rough_edges_are_smoothed() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "o0", "--order", "0"], None));
    ok(&serve.run(
        &["topic", "create", "o2", "--order", "2", "--memory-only"],
        None,
    ));
    // A huge generated size is bounded by the brokers' limit, not an allocation abort.
    let err = failed(&serve.run(
        &["pub", "o2", "--count", "1", "--size", "100000000000"],
        None,
    ));
    assert!(
        err.contains("largest message the brokers accept (1048576 bytes"),
        "{err}"
    );
    // Ack 2 where the order cannot have replicas: no `--rf 2` for this topic.
    let err = failed(&serve.run(&["pub", "o0", "--ack", "2", "--count", "1"], None));
    assert!(
        err.contains("order 0, which cannot have them") && err.contains("--order 2 --rf 2"),
        "{err}"
    );
    let err = failed(&serve.run(&["pub", "o2", "--ack", "2", "--count", "1"], None));
    assert!(err.contains("created with --rf 2 or more"), "{err}");
    // One message is "1 message".
    let out = ok(&serve.run(&["pub", "o2"], Some("only\n")));
    assert!(out.contains("published 1 message,"), "{out}");
    // Piped lines get one line of summary; latencies are a load run's (`--count`).
    assert_eq!(out.lines().count(), 1, "{out}");
    let load = ok(&serve.run(&["pub", "o2", "--count", "10"], None));
    assert!(load.contains("append to ack"), "{load}");
    // A misspelt variable is named by client commands too.
    let out = Command::new(BIN)
        .args(["status", "--control", &serve.control])
        .env("EMBARCADERO_CONTROLL", "elsewhere:1")
        .output()
        .unwrap();
    ok(&out);
    let warning = String::from_utf8_lossy(&out.stderr);
    assert!(
        warning.contains("EMBARCADERO_CONTROLL") && warning.contains("EMBARCADERO_CONTROL?"),
        "{warning}"
    );
    serve.stop();
    // Booleans take the spellings of shells and service files.
    let out = Command::new(BIN)
        .args(["serve", "--print-config"])
        .env("EMBARCADERO_REGION_PREFAULT", "1")
        .output()
        .unwrap();
    assert!(ok(&out).contains("prefault = true"));
    let ignored =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../.gitignore")).unwrap();
    assert!(ignored.lines().any(|l| l == "/embarcadero-data"));
}

/// `--bind 0.0.0.0` alone would advertise brokers at 0.0.0.0: refused, saying to pass
/// `--advertise`; with it, clients are told that host and publish and read through it.
#[test]
fn serve_on_every_interface_advertises_the_given_host() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d").display().to_string();
    let out = Command::new(BIN)
        .args(["serve", "--bind", "0.0.0.0", "--base-port", "0"])
        .args(["--control-port", "0", "--data-dir", &data])
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(err.contains("pass --advertise HOST"), "{err}");
    // A follower likewise, before it contacts any head.
    let out = Command::new(BIN)
        .args(["broker", "--follower", "--head-addr", "127.0.0.1:1"])
        .args(["--broker-id", "1", "--bind", "0.0.0.0"])
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(err.contains("pass --advertise HOST"), "{err}");

    let serve = Serve::start_with(
        &dir.path().join("d"),
        &["--bind", "0.0.0.0", "--advertise", "127.0.0.1"],
    );
    assert!(serve.control.starts_with("127.0.0.1:"), "{}", serve.control);
    let status: serde_json::Value =
        serde_json::from_str(&ok(&serve.run(&["status", "--json"], None))).unwrap();
    let advertised: Vec<&str> = status["cluster"]["brokers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["addr"].as_str().unwrap())
        .collect();
    assert_eq!(advertised.len(), 4);
    assert!(
        advertised.iter().all(|a| a.starts_with("127.0.0.1:")),
        "{advertised:?}"
    );
    ok(&serve.run(&["topic", "create", "t", "--order", "2"], None));
    ok(&serve.run(&["pub", "t"], Some("through the advertised host\n")));
    let read = ok(&serve.run(&["sub", "t", "--count", "1"], None));
    assert_eq!(read, "through the advertised host\n");
    serve.stop();
    // The configuration key and its variable.
    let out = Command::new(BIN)
        .args(["serve", "--print-config", "--bind", "0.0.0.0"])
        .env("EMBARCADERO_ADVERTISE", "10.1.2.3")
        .output()
        .unwrap();
    assert!(ok(&out).contains("advertise = \"10.1.2.3\""));
}

/// A region page that cannot be backed (the file truncated by another program; running
/// out of room cannot do it, see the next test) kills the server with SIGBUS, which no
/// code can turn into an error: the server says why and what to do before it dies of the
/// signal. (The signal is sent here: truncating the file under a server proves nothing
/// more.)
#[test]
fn a_server_killed_by_sigbus_says_why() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let mut serve = Serve::start(&dir.path().join("d"));
    serve.proc.signal("BUS");
    let line = serve.proc.wait_line("killed by SIGBUS");
    assert!(
        line.contains("truncated") && line.contains("region.path"),
        "{line}"
    );
    assert_eq!(serve.proc.wait().signal(), Some(libc::SIGBUS));
}

/// A region larger than its filesystem's free space is refused at start with what it
/// needs, what is free and which settings to lower, instead of a SIGBUS later; the
/// region file is not even created.
#[test]
fn serve_refuses_a_region_its_filesystem_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    // 4 brokers x 2,000,000 segments x 1 GiB: far beyond any disk.
    let out = Command::new(BIN)
        .args([
            "serve",
            "--base-port",
            "0",
            "--control-port",
            "0",
            "--data-dir",
        ])
        .arg(&data)
        .env("EMBARCADERO_REGION_SEGMENT_BYTES", "1073741824")
        .env("EMBARCADERO_REGION_SEGMENTS_PER_BROKER", "2000000")
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(out.status.code().is_some(), "ended by a signal: {err}");
    for part in [
        "needs",
        "free",
        "region.segments_per_broker (2000000)",
        "region.segment_bytes (1 GiB)",
        "brokers (4)",
    ] {
        assert!(err.contains(part), "{part:?} missing from {err}");
    }
    assert!(!data.join("region").exists(), "no region file was created");
}

/// A tmpfs mounted at a fresh directory for the life of the guard (root only).
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .stderr(Stdio::null())
            .status()
            .ok()?;
        status.success().then_some(Self(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

/// Issue 22, "no SIGBUS later": the region's filesystem is filled by someone else after
/// the server started. A topic created then is refused (HTTP 507, naming the file and
/// what to do) instead of the server dying of SIGBUS when it first writes there; the
/// topic created before keeps working, and once space returns creation succeeds. Needs
/// a small filesystem of its own, a tmpfs: where this test may not mount one (not root),
/// it says so and checks nothing.
#[test]
fn a_filesystem_filled_after_start_refuses_a_topic_instead_of_killing_the_server() {
    let Some(fs) = Tmpfs::mount("96m") else {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    let data = fs.0.path().join("d").display().to_string();
    let small = [
        ("EMBARCADERO_REGION_MAX_TOPICS", "4"),
        ("EMBARCADERO_REGION_SEGMENT_BYTES", "4194304"),
        ("EMBARCADERO_REGION_SEGMENTS_PER_BROKER", "2"),
    ];
    let args = [
        "serve",
        "--base-port",
        "0",
        "--control-port",
        "0",
        "--data-dir",
        &data,
    ];
    let (proc, line) = common::Proc::ready(&args, &small, "embarcadero is serving");
    let serve = Serve {
        control: common::control_address(&line),
        proc,
    };
    ok(&serve.run(&["topic", "create", "before", "--memory-only"], None));
    let filler = fs.0.path().join("filler");
    fill(&filler);
    let err = failed(&serve.run(&["topic", "create", "after", "--memory-only"], None));
    for part in ["cannot allocate", "topic slot 1", "region", "No space left"] {
        assert!(err.contains(part), "{part:?} missing from {err}");
    }
    ok(&serve.run(&["pub", "before"], Some("still\n")));
    assert_eq!(
        ok(&serve.run(&["sub", "before", "--count", "1"], None)),
        "still\n"
    );
    std::fs::remove_file(&filler).unwrap();
    ok(&serve.run(&["topic", "create", "after", "--memory-only"], None));
    serve.stop();
}

/// Writes `path` until its filesystem has no room left.
fn fill(path: &std::path::Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![7u8; 1 << 20];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
}

/// Issue 22: `topic create` keeps a topic's data across restarts unless asked not to.
/// A topic created with no flags survives a SIGKILL of the server and the loss of its
/// region file; `--memory-only` makes one that does not keep its data; an order-0 topic
/// cannot have disk replicas and says so.
#[test]
fn topics_are_durable_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let serve = Serve::start(&data);
    let made = ok(&serve.run(&["topic", "create", "kept", "--json"], None));
    let made: serde_json::Value = serde_json::from_str(&made).unwrap();
    assert_eq!(made["replication_factor"], 2, "{made}");
    let made = ok(&serve.run(
        &["topic", "create", "fleeting", "--memory-only", "--json"],
        None,
    ));
    let made: serde_json::Value = serde_json::from_str(&made).unwrap();
    assert_eq!(made["replication_factor"], 1, "{made}");
    let out = serve.run(&["topic", "create", "unordered", "--order", "0"], None);
    ok(&out);
    let note = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(note.contains("memory only"), "{note}");
    ok(&serve.run(&["pub", "kept", "--ack", "2"], Some("a\nb\n")));
    serve.kill();
    std::fs::remove_file(data.join("region")).unwrap();
    let serve = Serve::start(&data);
    assert_eq!(
        ok(&serve.run(&["sub", "kept", "--count", "2"], None)),
        "a\nb\n"
    );
    serve.stop();
}

/// A memory-only topic never reuses a position: the server is SIGKILLed and its region
/// file deleted (a reboot loses it too); after the restart `topic describe` shows the
/// positions moved past every old one, `sub --from` an old position is refused naming
/// the first available one, `sub` with no `--from` starts at the first available one,
/// and new messages take positions from there.
#[test]
fn memory_only_positions_move_forward_after_sigkill_and_a_lost_region() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let serve = Serve::start(&data);
    for (topic, order) in [("fifo", "1"), ("total", "2")] {
        ok(&serve.run(
            &["topic", "create", topic, "--order", order, "--memory-only"],
            None,
        ));
        ok(&serve.run(&["pub", topic], Some("a\nb\nc\n")));
    }
    serve.kill();
    std::fs::remove_file(data.join("region")).unwrap();
    let serve = Serve::start(&data);
    let describe = |topic: &str| -> serde_json::Value {
        serde_json::from_str(&ok(
            &serve.run(&["topic", "describe", topic, "--json"], None)
        ))
        .unwrap()
    };
    let next = describe("total")["next_position"].as_u64().unwrap();
    assert!(next >= 3, "the global position moved past 0, 1, 2: {next}");
    let fifo = describe("fifo");
    let per_broker: Vec<u64> = fifo["brokers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["messages"].as_u64().unwrap())
        .collect();
    assert!(per_broker.iter().all(|p| *p >= 3), "{per_broker:?}");

    let err = failed(&serve.run(&["sub", "total", "--from", "0", "--count", "1"], None));
    assert!(
        err.contains(&format!("first available position is {next}")),
        "{err}"
    );
    let zeros = vec!["0"; per_broker.len()].join(",");
    let err = failed(&serve.run(&["sub", "fifo", "--from", &zeros, "--count", "1"], None));
    assert!(
        err.contains(&format!("first available position is {}", per_broker[0])),
        "{err}"
    );
    // The hint is one position per broker, each gone one replaced by its log's first
    // retained one (here all of them): following it works at once.
    let hint: Vec<String> = per_broker.iter().map(u64::to_string).collect();
    let hint = hint.join(",");
    assert!(
        err.contains(&format!("subscribe again with --from {hint} ")),
        "{err}"
    );
    ok(&serve.run(&["pub", "total"], Some("d\n")));
    ok(&serve.run(&["pub", "fifo"], Some("e\n")));
    // No --from: the beginning, which is now the first retained message.
    let out = ok(&serve.run(&["sub", "fifo", "--from", &hint, "--count", "1"], None));
    assert_eq!(out, "e\n", "the hint's --from");
    for (topic, first) in [("total", "d\n"), ("fifo", "e\n")] {
        let out = ok(&serve.run(&["sub", topic, "--count", "1"], None));
        assert_eq!(out, first, "{topic}");
    }
    let from = next.to_string();
    let line = ok(&serve.run(
        &[
            "sub", "total", "--from", &from, "--count", "1", "--format", "jsonl",
        ],
        None,
    ));
    let m: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(
        (m["global_seq"].as_u64(), m["payload"].as_str()),
        (Some(next), Some("d"))
    );
    serve.stop();
}

/// The free segments of each broker, from `status --json`.
fn free_segments(serve: &Serve) -> Vec<u64> {
    let status = ok(&serve.run(&["status", "--json"], None));
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    status["brokers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["free_segments"].as_u64().unwrap())
        .collect()
}

/// Polls `done` until it holds, failing the test with `what` after a hang guard.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + LINE_GUARD;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `topic delete` as a user hits it: a connected `sub` and `pub` are told the topic was
/// deleted and exit non-zero, every broker's free segments come back, the disk replica
/// goes, the name is unknown after (with describe's advice), and a topic created again
/// with the name starts afresh: a subscriber sees only its messages.
#[test]
fn topic_delete_frees_memory_and_disk_tells_clients_and_frees_the_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let serve = Serve::start(&data);
    let free_before = free_segments(&serve);
    ok(&serve.run(&["topic", "create", "doomed"], None));
    ok(&serve.run(&["pub", "doomed", "--ack", "2"], Some("old-1\nold-2\n")));
    assert!(
        free_segments(&serve) < free_before,
        "the messages took segments"
    );
    let mut sub = spawn(&serve, &["sub", "doomed"]);
    let out = lines_of(sub.stdout.take().unwrap());
    wait_for(&out, "old-2");
    let mut publisher = spawn(&serve, &["pub", "doomed", "--ack", "1"]);
    let stdin = Mutex::new(publisher.stdin.take().unwrap());
    write_line(&stdin, "live-1");
    wait_for(&out, "live-1");

    let said = ok(&serve.run(&["topic", "delete", "doomed"], None));
    assert!(
        said.starts_with("deleted topic doomed") && said.lines().count() == 1,
        "{said}"
    );
    assert!(
        said.contains("its data, memory and disk replicas are freed"),
        "{said}"
    );
    let sub = sub.wait_with_output().unwrap();
    let sub_err = failed(&sub);
    assert!(sub_err.contains("was deleted"), "{sub_err}");
    // Whether `pub` has already ended on the error or meets it with this line.
    let _ = writeln!(stdin.lock().unwrap(), "live-2");
    drop(stdin);
    let pub_err = failed(&publisher.wait_with_output().unwrap());
    assert!(pub_err.contains("was deleted"), "{pub_err}");

    eventually("every broker's segments came back", || {
        free_segments(&serve) == free_before
    });
    let replica = data.join("replica-1");
    eventually("the disk replica is removed", || {
        std::fs::read_dir(&replica).unwrap().all(|e| {
            !e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("doomed.")
        })
    });
    let describe = failed(&serve.run(&["topic", "describe", "doomed"], None));
    let again = failed(&serve.run(&["topic", "delete", "doomed"], None));
    assert!(describe.contains("does not exist"), "{describe}");
    assert!(again.contains("does not exist"), "{again}");
    assert!(
        again.contains("nothing was deleted") && !again.contains("create it"),
        "{again}"
    );

    let made = ok(&serve.run(&["topic", "create", "doomed", "--json"], None));
    let made: serde_json::Value = serde_json::from_str(&made).unwrap();
    assert_eq!(made["next_position"], 0, "a new topic: {made}");
    ok(&serve.run(&["pub", "doomed", "--ack", "2"], Some("new-1\n")));
    assert_eq!(
        ok(&serve.run(&["sub", "doomed", "--count", "1"], None)),
        "new-1\n"
    );
    let gone = ok(&serve.run(&["topic", "delete", "doomed", "--json"], None));
    let gone: serde_json::Value = serde_json::from_str(&gone).unwrap();
    assert_eq!(gone["deleted"], true, "{gone}");
    assert_eq!(gone["name"], "doomed", "{gone}");
    serve.stop();
}

/// `pub --transport shm` (a shared-memory channel to each broker on this host) and
/// `--transport tcp` both deliver, in order; a transport that does not exist is refused
/// with the choices.
#[test]
fn pub_publishes_and_sub_reads_over_either_transport() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "both", "--order", "2"], None));
    ok(&serve.run(&["pub", "both", "--transport", "shm"], Some("a\nb\n")));
    ok(&serve.run(&["pub", "both", "--transport", "tcp"], Some("c\n")));
    for transport in ["shm", "tcp", "auto"] {
        let args = ["sub", "both", "--count", "3", "--transport", transport];
        assert_eq!(
            ok(&serve.run(&args, None)),
            "a\nb\nc\n",
            "sub over {transport}"
        );
    }
    // No stdin: the argument error ends the process before it would read any, and a
    // write into its closed pipe would fail the test instead.
    let err = failed(&serve.run(&["pub", "both", "--transport", "udp"], None));
    assert!(err.contains("auto, tcp or shm"), "{err}");
    let err = failed(&serve.run(&["sub", "both", "--transport", "udp"], None));
    assert!(err.contains("auto, tcp or shm"), "{err}");
    serve.stop();
}

/// Sends `child` SIGINT, as Ctrl-C does.
fn interrupt(child: &Child) {
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
}

/// SIGINT (Ctrl-C) while `pub` reads stdin: it says, as a failure does, how many
/// messages are acknowledged and the line to resume from, and exits 130, rather than
/// vanishing without a word. The resume line skips nothing: it is at most one past the
/// lines delivered.
#[test]
fn an_interrupted_pub_says_where_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "int", "--order", "2"], None));
    let mut sub = spawn(&serve, &["sub", "int"]);
    let printed = lines_of(sub.stdout.take().unwrap());
    let mut publisher = spawn(&serve, &["pub", "int", "--linger-us", "0"]);
    let stdin = Mutex::new(publisher.stdin.take().unwrap());
    for i in 1..=3 {
        write_line(&stdin, &format!("line-{i}"));
        wait_for(&printed, &format!("line-{i}"));
    }
    interrupt(&publisher);
    let out = publisher.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    let resume: u64 = err
        .split("resume from line ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a resume line: {err}"));
    assert!(
        (1..=4).contains(&resume),
        "3 lines delivered, resume at {resume}"
    );
    sub.kill().unwrap();
    sub.wait().unwrap();
    serve.stop();
}

/// SIGINT while `pub` publishes a stream it reads as fast as it comes: it stops reading
/// and waits for the acknowledgements of what it sent, so the count it reports is the
/// topic's whole content and a resume from the line it names repeats nothing (before,
/// it exited at once, a batch or more of sent messages unacknowledged and uncounted, and
/// a resume repeated them).
#[test]
fn an_interrupted_pub_waits_for_what_it_sent_so_a_resume_repeats_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&dir.path().join("d"));
    ok(&serve.run(&["topic", "create", "drain", "--order", "2"], None));
    let mut publisher = spawn(&serve, &["pub", "drain", "--json"]);
    let mut stdin = publisher.stdin.take().unwrap();
    let (written_tx, written) = std::sync::mpsc::channel();
    // Lines until the pipe breaks: `pub` never waits for input while interrupted.
    let writer = std::thread::spawn(move || {
        for i in 1u64.. {
            if writeln!(stdin, "line-{i}").is_err() {
                return;
            }
            if i == 50_000 {
                let _ = written_tx.send(());
            }
        }
    });
    written
        .recv_timeout(LINE_GUARD)
        .expect("50,000 lines written");
    interrupt(&publisher);
    let out = publisher.wait_with_output().unwrap();
    writer.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let acked = report["acked_messages"].as_u64().unwrap();
    assert_eq!(report["resume_line"].as_u64(), Some(acked + 1), "{report}");
    assert_eq!(
        report["published_messages"].as_u64(),
        Some(acked),
        "{report}"
    );
    assert!(acked >= 1, "{report}");
    let described: serde_json::Value = serde_json::from_str(&ok(
        &serve.run(&["topic", "describe", "drain", "--json"], None)
    ))
    .unwrap();
    assert_eq!(
        described["next_position"].as_u64(),
        Some(acked),
        "the topic holds exactly what was reported acknowledged: {report}"
    );
    serve.stop();
}

/// `embarcadero serve ARGS` on free ports with its data under `dir`, the test region and
/// `env`, and the lines of its stderr as they come.
fn serve_with_log(
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Child, Receiver<String>) {
    let mut server = Command::new(BIN)
        .arg("serve")
        .args(args)
        .args(["--base-port", "0", "--control-port", "0", "--data-dir"])
        .arg(dir.join("d"))
        .env("EMBARCADERO_REGION_MAX_TOPICS", "64")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(server.stderr.take().unwrap());
    (server, lines)
}

/// A server whose log reader went away (`serve 2>&1 | head -3`, a log shipper that
/// restarted) keeps serving: every log write then failed with EPIPE, the logging library
/// reported that with a panicking `eprintln!`, and whichever thread logged next died
/// (the sequencer at a topic's deletion), while `/healthz` still said ok. Here the pipe
/// is closed right after the serving line, then topics are made and deleted (which the
/// server logs) and an ordered topic is published to and read back through the
/// sequencer.
#[test]
fn a_server_whose_log_reader_went_away_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, lines) = serve_with_log(dir.path(), &[], &[("EMBARCADERO_LOG", "debug")]);
    let serving = wait_for(&lines, "embarcadero is serving");
    drop(lines); // the reader thread ends at its next line, closing the pipe
    let control = common::control_address(&serving);
    let run = |args: &[&str], input: &str| common::run_against(&control, args, Some(input));
    for name in ["a", "b", "c"] {
        ok(&run(
            &["topic", "create", name, "--order", "2", "--memory-only"],
            "",
        ));
    }
    ok(&run(&["topic", "delete", "b"], ""));
    ok(&run(&["topic", "delete", "c"], ""));
    let input: String = (0..1000).map(|i| format!("m{i}\n")).collect();
    ok(&run(&["pub", "a"], &input));
    let out = ok(&run(
        &["sub", "a", "--from", "start", "--count", "1000"],
        "",
    ));
    assert_eq!(out.lines().count(), 1000);
    assert!(
        server.try_wait().unwrap().is_none(),
        "the server still runs"
    );
    let _ = server.kill();
}

/// `--log-format json` (a log shipper's format) makes every line the server writes one
/// JSON object, the lifecycle lines for people ("serving", "shutting down") included,
/// from start to a graceful stop; the flag works after the subcommand.
#[test]
fn a_json_log_is_one_object_per_line_from_start_to_stop() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--log-format", "json"];
    let (mut server, lines) = serve_with_log(dir.path(), &args, &[("EMBARCADERO_LOG", "debug")]);
    let serving = wait_for(&lines, "embarcadero is serving");
    let control = common::control_address(&serving);
    let run = |args: &[&str]| common::run_against(&control, args, None);
    ok(&run(&["topic", "create", "j", "--order", "2"]));
    ok(&run(&["topic", "delete", "j"]));
    // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped; it
    // touches no memory of ours.
    assert_eq!(unsafe { libc::kill(server.id() as i32, libc::SIGTERM) }, 0);
    assert!(server.wait().unwrap().success(), "a graceful stop exits 0");
    let mut all: Vec<String> = vec![serving];
    all.extend(lines.iter());
    let objects: Vec<serde_json::Value> = all
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    for o in &objects {
        assert!(o["level"].is_string() && o["target"].is_string(), "{o}");
        assert!(o["fields"]["message"].is_string(), "{o}");
    }
    let said = |text: &str| {
        objects.iter().any(|o| {
            o["target"] == "embarcadero" && o["fields"]["message"].as_str().unwrap().contains(text)
        })
    };
    assert!(said("embarcadero is serving") && said("shutting down"));
    assert!(
        objects.len() > 3,
        "the debug log has more than the lifecycle lines"
    );
}

/// The lifecycle lines are not filtered out with the rest of a JSON log: a server run at
/// `EMBARCADERO_LOG=warn` still says, as one object, that it serves; the format's name
/// is taken in any case.
#[test]
fn a_json_log_filtered_to_warnings_still_says_the_server_is_serving() {
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("EMBARCADERO_LOG", "warn"),
        ("EMBARCADERO_LOG_FORMAT", "JSON"),
    ];
    let (mut server, lines) = serve_with_log(dir.path(), &[], &env);
    let serving = wait_for(&lines, "embarcadero is serving");
    let object: serde_json::Value = serde_json::from_str(&serving).unwrap();
    assert_eq!(
        (&object["level"], &object["target"]),
        (&"INFO".into(), &"embarcadero".into())
    );
    let _ = server.kill();
    let _ = server.wait();
}
