//! A real `embarcadero serve` process for the binary's tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_embarcadero");

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Serve {
    pub child: Child,
    pub control: String,
}

impl Serve {
    /// Starts `embarcadero serve` and waits for its "serving" line.
    pub fn start(data_dir: &Path) -> Self {
        let control_port = free_port();
        let mut child = Command::new(BIN)
            .args(["serve", "--base-port", "0", "--control-port"])
            .arg(control_port.to_string())
            .arg("--data-dir")
            .arg(data_dir)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("embarcadero is serving") {
                    let _ = tx.send(line);
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("server reports it is serving");
        assert!(
            line.contains(&format!("127.0.0.1:{control_port}")),
            "{line}"
        );
        Self {
            child,
            control: format!("127.0.0.1:{control_port}"),
        }
    }

    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut child = Command::new(BIN)
            .args(args)
            .args(["--control", &self.control])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).unwrap();
        }
        drop(input);
        child.wait_with_output().unwrap()
    }

    /// SIGTERM, as an operator's service manager would send, then wait.
    pub fn stop(mut self) {
        let status = Command::new("kill")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
        let exit = self.child.wait().unwrap();
        assert!(exit.success(), "graceful shutdown exits 0: {exit:?}");
    }
}

impl Serve {
    /// SIGKILL, as a crash would: no chance to flush or clean up.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}
