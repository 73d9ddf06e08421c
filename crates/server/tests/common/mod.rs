//! Helpers shared by the integration tests: an embedded server on ephemeral ports in
//! a temporary data directory, with small capacities so wrap-around happens quickly.

#![allow(dead_code)]

use embarcadero_client::{Admin, TopicSpec};
use embarcadero_server::{Server, ServerConfig};

pub struct TestServer {
    pub server: Server,
    pub dir: tempfile::TempDir,
}

impl TestServer {
    pub fn control(&self) -> String {
        self.server.control_addr().to_string()
    }

    pub fn brokers(&self) -> Vec<String> {
        self.server
            .broker_addrs()
            .iter()
            .map(|a| a.to_string())
            .collect()
    }

    pub fn admin(&self) -> Admin {
        Admin::new(&self.control())
    }

    /// Sums a metric over its labels (lines starting with `prefix`), from /metrics.
    pub fn metric_sum(&self, prefix: &str) -> u64 {
        Self::sum_in(&Self::metric_text(&self.control()), prefix)
    }

    /// Waits (at most 30 s, else fails the test with `what`) until the metric summed
    /// over the lines starting with `prefix` is at most `max`.
    pub fn wait_for_metric_at_most(&self, prefix: &str, max: u64, what: &str) {
        self.wait_for_metric(prefix, what, &format!("at most {max}"), |v| v <= max);
    }

    /// The same, until it is at least `min`.
    pub fn wait_for_metric_at_least(&self, prefix: &str, min: u64, what: &str) {
        self.wait_for_metric(prefix, what, &format!("at least {min}"), |v| v >= min);
    }

    fn wait_for_metric(&self, prefix: &str, what: &str, want: &str, ok: impl Fn(u64) -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let value = self.metric_sum(prefix);
            if ok(value) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what}: {prefix} is {value}, not {want}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// The text of `/metrics` of the server whose admin API is at `control`.
    pub fn metric_text(control: &str) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(control).unwrap();
        // A wedged admin API fails the test instead of hanging it.
        s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    }

    /// Sums the samples of the lines of `text` that start with `prefix`.
    pub fn sum_in(text: &str, prefix: &str) -> u64 {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    pub fn create_topic(&self, name: &str, order: u8) {
        self.admin()
            .create_topic(&TopicSpec::new(name, order))
            .expect("create topic");
    }
}

pub fn config(dir: &std::path::Path) -> ServerConfig {
    let mut c = ServerConfig {
        data_dir: dir.to_path_buf(),
        base_port: 0,
        control_port: 0,
        ..ServerConfig::default()
    };
    c.region.max_topics = 4;
    c.region.goi_slots = 4096;
    c.region.pbr_slots = 1024;
    c.region.segment_bytes = 4 << 20;
    c.region.segments_per_broker = 8;
    c.sequencer.epoch_us = 200;
    c
}

pub fn start() -> TestServer {
    start_with(|_| {})
}

pub fn start_with(tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = config(dir.path());
    tweak(&mut c);
    let server = Server::start(c).expect("server starts");
    TestServer { server, dir }
}

/// Reads one frame (header and body) from a raw broker connection, failing the test
/// after 10 s without one.
pub fn next_frame(s: &mut std::net::TcpStream) -> (embarcadero_wire::FrameHeader, Vec<u8>) {
    use std::io::Read;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut raw = [0u8; 16];
    s.read_exact(&mut raw).expect("a frame");
    let h = embarcadero_wire::FrameHeader::decode(&raw, 1 << 20).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).expect("the frame's body");
    (h, body)
}

/// The first available position a PositionNotRetained refusal names.
pub fn first_available(err: &embarcadero_client::Error) -> u64 {
    assert!(
        matches!(
            err,
            embarcadero_client::Error::Broker {
                code: embarcadero_wire::ErrorCode::PositionNotRetained,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    text.split("first available position is ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no first position in {text:?}"))
}
