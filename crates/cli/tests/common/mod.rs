//! Real `embarcadero` processes for the binary's tests.

#![allow(dead_code)]

use embarcadero_cli::local_cluster::{ChildProcess, Echo};
use std::io::Write;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_embarcadero");

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `embarcadero` (or peer) process whose stderr lines can be waited for: the
/// product's own [`ChildProcess`], with every failure a panic and its output echoed.
pub struct Proc {
    process: ChildProcess,
}

impl Proc {
    /// Starts `embarcadero ARGS` with extra environment variables.
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_program(BIN, args, env)
    }

    /// The same for another program (a peer such as etcd).
    pub fn spawn_program(program: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let name = format!("`{program} {}`", args.join(" "));
        let process = ChildProcess::spawn(Path::new(program), args, &env, &name, Echo::ToStderr)
            .unwrap_or_else(|e| panic!("{e}"));
        Self { process }
    }

    /// Starts it and waits for a stderr line containing `ready`.
    pub fn ready(args: &[&str], env: &[(&str, &str)], ready: &str) -> (Self, String) {
        let mut p = Self::spawn(args, env);
        let line = p.wait_line(ready);
        (p, line)
    }

    /// The same for another program.
    pub fn ready_program(program: &str, args: &[&str], ready: &str) -> (Self, String) {
        let mut p = Self::spawn_program(program, args, &[]);
        let line = p.wait_line(ready);
        (p, line)
    }

    /// Waits (at most 30 s) for a stderr line containing `marker`; returns it.
    pub fn wait_line(&mut self, marker: &str) -> String {
        self.process
            .wait_line(marker, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Whether a stderr line printed so far contains `marker` (see
    /// [`ChildProcess::printed`]).
    pub fn printed(&self, marker: &str) -> bool {
        self.process.printed(marker)
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        self.process.exited()
    }

    /// SIGKILL, as a crash would: no chance to flush or clean up.
    pub fn kill(mut self) {
        self.process.kill().unwrap_or_else(|e| panic!("{e}"));
    }

    /// SIGTERM, as an operator's service manager would send; it must exit 0.
    pub fn stop(mut self) {
        let exit = self.process.terminate().unwrap_or_else(|e| panic!("{e}"));
        assert!(exit.success(), "graceful shutdown exits 0: {exit:?}");
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`).
    pub fn signal(&self, name: &str) {
        self.process.signal(name).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits for the process to exit (however it ends).
    pub fn wait(&mut self) -> ExitStatus {
        self.process.wait().unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The stdout of a command that must have succeeded (else its stderr is the failure).
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "command failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The stderr of a command that must have failed.
pub fn failed(out: &Output) -> String {
    assert!(!out.status.success(), "command succeeded unexpectedly");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `embarcadero ARGS` to completion.
pub fn run_bin(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The region settings of every test server: 64 topic slots instead of 256, so a
/// server's region is about 1.3 GiB instead of 2.8 GiB. `serve` refuses a region its
/// filesystem could not hold whole, and a CI host's disk can be nearly full. The logs
/// keep their default size: a module's tests share a server and fill them. Not applied
/// to a server started with a config file of the test's own.
pub const TEST_REGION: &[(&str, &str)] = &[("EMBARCADERO_REGION_MAX_TOPICS", "64")];

pub struct Serve {
    pub proc: Proc,
    pub control: String,
}

impl Serve {
    /// Starts `embarcadero serve` and waits for its "serving" line.
    pub fn start(data_dir: &Path) -> Self {
        Self::start_with(data_dir, &[])
    }

    /// The same, with more `serve` arguments. The control port is an ephemeral one the
    /// server picks and names in its "serving" line: a port picked here and released
    /// before the server binds it can be taken by someone else meanwhile.
    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Self {
        Self::start_on(data_dir, 0, 0, extra)
    }

    /// A server of one broker with 16 MiB of log memory (four segments of 4 MiB), its
    /// config file and data under `dir`: a memory-only topic fills it within a test.
    pub fn start_small(dir: &Path) -> Self {
        let config = dir.join("small.toml");
        std::fs::write(
            &config,
            "brokers = 1\n[region]\nsegment_bytes = 4194304\nsegments_per_broker = 4\n",
        )
        .unwrap();
        Self::start_with(&dir.join("d"), &["--config", config.to_str().unwrap()])
    }

    /// The same on given ports (0: ephemeral), for a server that must come back where
    /// its clients knew it, after a restart.
    pub fn start_on(data_dir: &Path, base_port: u16, control_port: u16, extra: &[&str]) -> Self {
        let data_dir = data_dir.display().to_string();
        let (base_port, control_port) = (base_port.to_string(), control_port.to_string());
        let mut args = vec![
            "serve",
            "--base-port",
            &base_port,
            "--control-port",
            &control_port,
            "--data-dir",
            &data_dir,
        ];
        args.extend_from_slice(extra);
        // A test's own config file is taken as it is (the environment would override it).
        let env = if extra.contains(&"--config") {
            &[][..]
        } else {
            TEST_REGION
        };
        let (proc, line) = Proc::ready(&args, env, "embarcadero is serving");
        let control = control_address(&line);
        Self { proc, control }
    }

    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> Output {
        run_against(&self.control, args, stdin)
    }

    pub fn stop(self) {
        self.proc.stop();
    }

    pub fn kill(self) {
        self.proc.kill();
    }
}

/// `embarcadero ARGS --control CONTROL` with `stdin` as its input, within [`RUN_GUARD`]:
/// a client command against a server the test started (a [`Serve`], or its own).
pub fn run_against(control: &str, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .args(["--control", control])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        // A command that fails early (a `pub` to a missing topic) may exit before it
        // reads its input; the write then meets a closed pipe, which is its answer,
        // not the test's failure. The exit status and stderr below are checked.
        match input.write_all(text.as_bytes()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            other => other.unwrap(),
        }
    }
    drop(input);
    output_within(child, args, RUN_GUARD)
}

/// Longest a client command of a test may run before the test fails: a hang guard far
/// above any normal run, so that a command that waits for ever (a `sub` whose messages
/// never come) fails its test instead of holding the whole suite.
pub const RUN_GUARD: Duration = Duration::from_secs(180);

/// Waits for `child` like `wait_with_output`, but kills it and fails the test if it has
/// not ended within `guard`. Its pipes are read on threads of their own meanwhile, so
/// a child that writes much is never blocked on a full pipe.
pub fn output_within(mut child: std::process::Child, args: &[&str], guard: Duration) -> Output {
    use std::io::Read;
    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match rx.recv_timeout(guard) {
        Ok(status) => status.unwrap(),
        Err(_) => {
            // SAFETY: kill(2) touches no memory of ours. The child had not ended when
            // the guard ran out; should it end in this very instant and its pid be
            // reused at once, another process would get the signal: a risk accepted
            // for a hang guard in a test.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let _ = rx.recv();
            let err = String::from_utf8_lossy(&stderr.join().unwrap()).into_owned();
            panic!(
                "`embarcadero {}` still running after {guard:?}; stderr: {err}",
                args.join(" ")
            );
        }
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// The control API address in a serving line: "embarcadero is serving: control API
/// http://ADDR  brokers ...". Servers started with `--control-port 0` pick a free port
/// themselves, with no window for another process to take it.
pub fn control_address(line: &str) -> String {
    line.split("control API http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no control address in {line:?}"))
        .to_string()
}

/// GET /metrics from `addr`: the text.
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

/// The value of the sample `name` (labels included) in a /metrics text.
pub fn sample(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
        .parse()
        .unwrap()
}
