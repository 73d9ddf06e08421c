//! A publisher that outlives every broker of its server: what it may and may not do
//! while none is live, and once the restarted server's brokers join it again.
//!
//! Its own test binary: it installs a process-wide log capture, to wait for the
//! publisher's failover rather than for a guessed time.

mod common;

use common::Serve;
use embarcadero_client::{Admin, Error, Publisher, PublisherConfig, TopicSpec};
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Every line the client logged in this process.
fn log_lines() -> &'static Arc<Mutex<Vec<String>>> {
    static LINES: OnceLock<Arc<Mutex<Vec<String>>>> = OnceLock::new();
    LINES.get_or_init(|| {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Capture(sink.clone()))
            .init();
        lines
    })
}

/// A log writer that keeps each write as a line of [`log_lines`].
struct Capture(Arc<Mutex<Vec<String>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let line = String::from_utf8_lossy(buf).into_owned();
        self.0.lock().unwrap().push(line);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits (at most 60 s) until a logged line contains every one of `markers` (the
/// tests of this binary run side by side: each names its own broker's port).
fn wait_logged(markers: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen = log_lines()
            .lock()
            .unwrap()
            .iter()
            .any(|l| markers.iter().all(|m| l.contains(m)));
        if seen {
            return;
        }
        assert!(Instant::now() < deadline, "never logged {markers:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An order-5 publisher whose only broker died, with nothing unacknowledged, is left
/// running (a restarted broker may join it). A batch it seals while no broker is live
/// has nowhere to go: the publisher must fail, for good, rather than drop the batch and
/// go on. Before, it dropped it (with messages `publish` had accepted) and went on with
/// that session sequence missing: once the restarted broker joined, every later batch
/// waited behind the gap until the sequencer fenced the session, and again after each
/// reopen, while `flush` blocked (the workflow engine stalled this way after a server
/// restart).
#[test]
fn a_batch_sealed_while_no_broker_lives_fails_the_publisher_instead_of_leaving_a_gap() {
    log_lines();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (base, control) = (common::free_port(), common::free_port());
    let one_broker = ["--brokers", "1"];
    let serve = Serve::start_on(&data, base, control, &one_broker);
    Admin::new(&serve.control)
        .create_topic(&TopicSpec::new("sessions", 5).replicated(2))
        .unwrap();
    let config = PublisherConfig {
        ack_level: 2,
        // The batch stays open until `flush` seals it.
        linger: Duration::from_secs(30),
        ..PublisherConfig::default()
    };
    let publisher = Publisher::connect(&serve.control, "sessions", config).unwrap();
    publisher.publish(b"before").unwrap();
    publisher.flush().unwrap();
    serve.kill();
    wait_logged(&["failover done", &format!("127.0.0.1:{base}")]);
    publisher
        .publish(b"accepted while no broker lives")
        .unwrap();
    assert!(
        matches!(publisher.flush(), Err(Error::NoLiveBroker)),
        "sealing with no live broker fails"
    );
    let serve = Serve::start_on(&data, base, control, &one_broker);
    // Whether or not the restarted broker joins it, the publisher stays failed: the
    // message `publish` accepted was never sent, and no later flush may say otherwise.
    for _ in 0..3 {
        assert!(matches!(publisher.flush(), Err(Error::NoLiveBroker)));
        assert!(matches!(
            publisher.publish(b"after"),
            Err(Error::NoLiveBroker)
        ));
    }
    // A new publisher carries on at once.
    let config = PublisherConfig {
        ack_level: 2,
        ..PublisherConfig::default()
    };
    let fresh = Publisher::connect(&serve.control, "sessions", config).unwrap();
    fresh.publish(b"fresh").unwrap();
    fresh.flush().unwrap();
    let info = Admin::new(&serve.control)
        .describe_topic("sessions")
        .unwrap();
    assert_eq!(
        info.next_position, 2,
        "\"before\" and \"fresh\", nothing else"
    );
    serve.stop();
}

/// At ack 1 a server that lost its region file loses what had not reached a disk
/// replica (all of a memory-only topic), order-5 session marks included. A publisher
/// that outlived it must not carry on when the restarted broker joins it: the broker
/// expects the session's batches from one it had already acknowledged, which the
/// publisher no longer holds, so every later batch would wait for ever behind them. It
/// fails, saying what happened and what to do.
#[test]
fn a_joined_broker_that_lost_acknowledged_batches_of_the_session_fails_the_publisher() {
    log_lines();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (base, control) = (common::free_port(), common::free_port());
    let one_broker = ["--brokers", "1"];
    let serve = Serve::start_on(&data, base, control, &one_broker);
    Admin::new(&serve.control)
        .create_topic(&TopicSpec::new("forgotten", 5))
        .unwrap();
    let config = PublisherConfig {
        ack_level: 1,
        ..PublisherConfig::default()
    };
    let publisher = Publisher::connect(&serve.control, "forgotten", config).unwrap();
    publisher.publish(b"acknowledged").unwrap();
    publisher.flush().unwrap();
    serve.kill();
    wait_logged(&["failover done", &format!("127.0.0.1:{base}")]);
    std::fs::remove_file(data.join("region")).unwrap();
    let serve = Serve::start_on(&data, base, control, &one_broker);
    wait_logged(&[
        "cannot use a broker that joined",
        &format!("127.0.0.1:{base}"),
    ]);
    match publisher.flush() {
        Err(Error::Broker { code, message, .. }) => {
            assert_eq!(code, embarcadero_wire::ErrorCode::SessionExpired);
            assert!(message.contains("start a new publisher"), "{message}");
        }
        other => panic!("expected the session's loss to be reported, got {other:?}"),
    }
    serve.stop();
}
