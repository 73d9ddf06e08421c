mod common;

use embarcadero_client::{Publisher, PublisherConfig, Subscriber, SubscriberConfig};
use std::time::Duration;

#[test]
fn publish_then_subscribe_order_2() {
    let t = common::start();
    t.create_topic("smoke", 2);
    let p = Publisher::connect(&t.control(), "smoke", PublisherConfig::default()).unwrap();
    for i in 0..10_000u32 {
        p.publish(format!("m{i}").as_bytes()).unwrap();
    }
    let stats = p.close().unwrap();
    assert_eq!(stats.messages, 10_000);
    let mut s = Subscriber::connect(&t.control(), "smoke", SubscriberConfig::default()).unwrap();
    let mut n = 0u64;
    while n < 10_000 {
        let m = s.poll(Duration::from_secs(10)).unwrap().expect("message");
        assert_eq!(m.position, n);
        n += 1;
    }
}

#[test]
fn metrics_count_bytes_batches_and_time_per_stage() {
    let t = common::start();
    t.create_topic("m", 2);
    let p = Publisher::connect(&t.control(), "m", PublisherConfig::default()).unwrap();
    for _ in 0..2000 {
        p.publish(&[7u8; 1000]).unwrap();
    }
    let stats = p.close().unwrap();
    assert_eq!(t.metric_sum("embarcadero_publish_messages_total"), 2000);
    assert_eq!(
        t.metric_sum("embarcadero_publish_batches_total"),
        stats.batches
    );
    assert_eq!(
        t.metric_sum("embarcadero_sequencer_messages_ordered_total"),
        2000
    );
    for stage in ["receive", "validate", "commit", "ack_send", "ack_wait"] {
        let prefix = "embarcadero_stage_nanoseconds_total{broker=";
        let total: u64 = (0..4)
            .map(|b| t.metric_sum(&format!("{prefix}\"{b}\",stage=\"{stage}\"}}")))
            .sum();
        assert!(total > 0, "stage {stage} was timed");
    }
    for stage in ["scan", "epoch_wait", "sequence", "goi_write"] {
        let name = format!("embarcadero_stage_nanoseconds_total{{stage=\"sequencer_{stage}\"}}");
        assert!(t.metric_sum(&name) > 0, "stage sequencer_{stage} was timed");
    }
    // The process's CPU time, under Prometheus's standard name: this process served 2000
    // messages, so it has used some.
    let text = common::TestServer::metric_text(&t.control());
    let cpu: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("process_cpu_seconds_total ")?.parse().ok())
        .expect("process_cpu_seconds_total is exported");
    assert!(cpu > 0.0);
}

/// A start whose control port or broker ports are taken is refused before its region
/// file is made: a failed start used to leave a fresh region behind (2.9 GiB apparent,
/// its log segments written) for the next start to retire. A data directory the failed
/// start made is gone with it; one that was there stays.
#[test]
fn a_start_on_ports_in_use_is_refused_before_the_region_is_made() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    type Take = fn(&mut embarcadero_server::ServerConfig, u16);
    let cases: [(&str, Take); 2] = [
        ("control port", |c, p| c.control_port = p),
        ("broker 0's port", |c, p| c.base_port = p),
    ];
    for (what, tweak) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut c = common::config(dir.path());
        tweak(&mut c, port);
        let region = c.region_path();
        let err = embarcadero_server::Server::start(c)
            .err()
            .unwrap_or_else(|| panic!("a start on a taken {what} is refused"));
        assert!(err.to_string().contains(what), "{err}");
        assert!(!region.exists(), "{what}: no region file was made");
        assert!(
            dir.path().exists(),
            "{what}: a data directory that was there stays"
        );
        let mut c = common::config(&dir.path().join("fresh"));
        tweak(&mut c, port);
        assert!(embarcadero_server::Server::start(c).is_err());
        let left = dir.path().join("fresh");
        assert!(!left.exists(), "{what}: the data directory it made is gone");
    }
}

/// A service that names the log it folds is listed only by a head that has that very
/// topic: one naming a topic this head lacks, or a topic of the same name created at
/// another time (another cluster's, or one deleted and made again), is refused with 409
/// and never listed, so the control port cannot forward the workflow API to it.
#[test]
fn a_service_naming_a_log_this_head_lacks_is_refused_and_not_listed() {
    use embarcadero_client::ServiceLog;
    let t = common::start();
    t.create_topic("wf", 5);
    let admin = t.admin();
    let info = admin.describe_topic("wf").unwrap();
    let ttl = Duration::from_secs(60);
    let log = |topic: &str, created_unix_ms| {
        Some(ServiceLog {
            topic: topic.into(),
            created_unix_ms,
        })
    };
    let refused = |addr: &str, l| {
        let e = admin
            .announce_service("workflow", addr, ttl, l)
            .unwrap_err();
        assert!(e.to_string().contains("409"), "{e}");
        assert!(e.to_string().contains("another cluster"), "{e}");
    };
    refused("127.0.0.1:1", log("elsewhere", info.created_unix_ms));
    refused("127.0.0.1:2", log("wf", info.created_unix_ms + 1));
    admin
        .announce_service(
            "workflow",
            "127.0.0.1:3",
            ttl,
            log("wf", info.created_unix_ms),
        )
        .unwrap();
    // One that names no log is taken as before (a service that folds none).
    admin
        .announce_service("other", "127.0.0.1:4", ttl, None)
        .unwrap();
    let listed: Vec<String> = admin
        .status()
        .unwrap()
        .services
        .into_iter()
        .map(|s| s.addr)
        .collect();
    assert_eq!(listed, ["127.0.0.1:3", "127.0.0.1:4"]);
}
