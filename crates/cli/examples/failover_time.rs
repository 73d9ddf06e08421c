//! Measures cluster failover with real processes and the default settings:
//!
//! - broker failover: a follower is SIGKILLed under load; reported is the time from
//!   the kill until every batch published before it is acknowledged (through the live
//!   brokers, or found in the order by the head);
//! - sequencer failover: the active `embarcadero sequencer` is SIGKILLed with a standby
//!   waiting; reported is the time from the kill until a new batch is acknowledged.
//!
//! Usage (release build, so the `embarcadero` binary sits next to this example):
//! `cargo build --release -p embarcadero-cli --examples &&
//!  target/release/examples/failover_time [RUNS]`

use embarcadero_client::{Admin, Publisher, PublisherConfig, TopicSpec};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

fn binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent()
        .and_then(|examples| examples.parent())
        .map(|dir| dir.join("embarcadero"))
        .expect("target directory")
}

/// Starts `embarcadero ARGS` and waits for a stderr line containing `ready`.
fn spawn(args: &[&str], ready: &str) -> Child {
    let mut child = Command::new(binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run embarcadero (build it with --release first)");
    let stderr = child.stderr.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    let ready = ready.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains(&ready) {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("`embarcadero {}` did not start", args.join(" ")));
    child
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

struct Cluster {
    children: Vec<Child>,
    control: String,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn cluster(external_sequencer: bool) -> Cluster {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port().to_string();
    let data = dir.path().join("head").display().to_string();
    let mut args = vec![
        "broker",
        "--head",
        "--brokers",
        "3",
        "--base-port",
        "0",
        "--control-port",
        &port,
        "--data-dir",
        &data,
    ];
    if external_sequencer {
        args.push("--external-sequencer");
    }
    let head = spawn(&args, "embarcadero is serving");
    let control = format!("127.0.0.1:{port}");
    let mut children = vec![head];
    for id in ["1", "2"] {
        children.push(spawn(
            &[
                "broker",
                "--follower",
                "--head-addr",
                &control,
                "--broker-id",
                id,
            ],
            "is serving at",
        ));
    }
    Cluster {
        children,
        control,
        _dir: dir,
    }
}

/// Seconds from a follower's SIGKILL until everything published before it is acked.
fn broker_failover(order: u8) -> f64 {
    let mut c = cluster(false);
    Admin::new(&c.control)
        .create_topic(&TopicSpec::new("t", order))
        .expect("create topic");
    let publisher =
        Publisher::connect(&c.control, "t", PublisherConfig::default()).expect("publisher");
    let stop = Arc::new(AtomicBool::new(false));
    let payload = [7u8; 1024];
    let killed = std::thread::scope(|s| {
        let load = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                publisher.publish(&payload).expect("publish");
            }
        });
        std::thread::sleep(Duration::from_secs(1));
        let mut victim = c.children.remove(2);
        victim.kill().expect("kill follower 2");
        let killed = Instant::now();
        let _ = victim.wait();
        stop.store(true, Ordering::Relaxed);
        load.join().expect("publisher thread");
        killed
    });
    publisher.flush().expect("everything acknowledged");
    killed.elapsed().as_secs_f64()
}

/// Seconds from the active sequencer's SIGKILL until a new batch is acknowledged.
fn sequencer_failover() -> f64 {
    let mut c = cluster(true);
    let active = spawn(
        &["sequencer", "--head-addr", &c.control],
        "sequencer is active",
    );
    let standby = spawn(
        &["sequencer", "--head-addr", &c.control, "--standby"],
        "standby: waiting",
    );
    c.children.push(standby);
    Admin::new(&c.control)
        .create_topic(&TopicSpec::new("t", 2))
        .expect("create topic");
    let publisher =
        Publisher::connect(&c.control, "t", PublisherConfig::default()).expect("publisher");
    publisher.publish(b"before").expect("publish");
    publisher.flush().expect("ordered by the active sequencer");
    let mut active = active;
    active.kill().expect("kill the active sequencer");
    let killed = Instant::now();
    let _ = active.wait();
    publisher.publish(b"after").expect("publish");
    publisher.flush().expect("ordered by the standby");
    killed.elapsed().as_secs_f64()
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    for run in 1..=runs {
        println!(
            "run {run}: broker kill to all prior batches acked: order 2 {:.3} s, order 5 {:.3} s; sequencer kill to next ack: {:.3} s",
            broker_failover(2),
            broker_failover(5),
            sequencer_failover()
        );
    }
}
