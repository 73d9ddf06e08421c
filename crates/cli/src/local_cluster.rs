//! A cluster of real `embarcadero` processes on this host: a head, follower brokers and,
//! when asked, external sequencers, each started from a given executable, with the data
//! directory in a temporary directory and the region file on /dev/shm when it exists.
//! Used by `bench --mode failure` and the failover example. Every process is SIGKILLed
//! when the cluster (or the process handle) is dropped, so an error or a panic half-way
//! leaves nothing running; SIGINT, SIGTERM or SIGHUP, which end this process without
//! running `Drop`, kill them too and remove the cluster's files.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a process may take to print its ready line.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a follower or sequencer of a replaced region may take to notice and stop.
const OLD_REGION_EXIT: Duration = Duration::from_secs(30);
/// Lines of a process's stderr shown in error messages.
const TAIL_LINES: usize = 30;
/// Lines of a process's stderr kept to wait for (older ones are dropped: a cluster may
/// run for days).
const KEPT_LINES: usize = 10_000;

/// What to kill and remove if a signal ends this process: `Drop` does not run then.
struct Leftovers {
    pids: Vec<u32>,
    paths: Vec<PathBuf>,
}

static LEFTOVERS: Mutex<Leftovers> = Mutex::new(Leftovers {
    pids: Vec::new(),
    paths: Vec::new(),
});

fn leftovers() -> std::sync::MutexGuard<'static, Leftovers> {
    LEFTOVERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Installs (once) a SIGINT/SIGTERM/SIGHUP handler that SIGKILLs the children still
/// running, removes the cluster files still there, and exits with status 130. A
/// process that installed its own handler first keeps it.
fn clean_up_on_signal() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let _ = ctrlc::set_handler(|| {
            let left = leftovers();
            for pid in &left.pids {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
            for path in &left.paths {
                let _ = std::fs::remove_file(path).or_else(|_| std::fs::remove_dir_all(path));
            }
            std::process::exit(130);
        });
    });
}

/// A child's stderr line by line until it closes. Not `BufRead::lines`: a line that is
/// not UTF-8 would end it, leaving the child to block on a full pipe and a waiter to
/// take it for an exit.
fn lossy_lines(pipe: impl std::io::Read) -> impl Iterator<Item = String> {
    use std::io::Read;
    /// A longer line is kept in pieces of this size (a child may print without newlines).
    const MAX_LINE: u64 = 64 * 1024;
    let mut reader = BufReader::new(pipe);
    std::iter::from_fn(move || {
        let mut raw = Vec::new();
        match reader.by_ref().take(MAX_LINE).read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => None,
            Ok(_) => {
                let end = raw.strip_suffix(b"\n").unwrap_or(&raw);
                let end = end.strip_suffix(b"\r").unwrap_or(end);
                Some(String::from_utf8_lossy(end).into_owned())
            }
        }
    })
}

/// Paths removed already (or about to be): no longer for the signal handler.
fn forget_paths(paths: &[&Path]) {
    leftovers().paths.retain(|p| !paths.contains(&p.as_path()));
}

/// Whether a child's stderr lines are also echoed to this process's stderr (tests want
/// them in their output; a cluster serving a benchmark does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Echo {
    Quiet,
    ToStderr,
}

/// What a child printed on stderr, up to its last `KEPT_LINES` lines.
#[derive(Default)]
struct Printed {
    lines: VecDeque<String>,
    /// Lines dropped from the front so far: `lines[0]` is line number `dropped`.
    dropped: u64,
    /// The child closed its stderr (it exited).
    ended: bool,
}

/// A child's stderr, filled by its reader thread.
#[derive(Default)]
struct Stderr {
    printed: Mutex<Printed>,
    grew: Condvar,
}

impl Stderr {
    fn lock(&self) -> MutexGuard<'_, Printed> {
        self.printed.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, line: String) {
        let mut printed = self.lock();
        if printed.lines.len() == KEPT_LINES {
            printed.lines.pop_front();
            printed.dropped += 1;
        }
        printed.lines.push_back(line);
        self.grew.notify_all();
    }

    fn end(&self) {
        self.lock().ended = true;
        self.grew.notify_all();
    }
}

/// One child process whose stderr is read by a thread (so it never blocks on a full
/// pipe) and kept, to wait for lines and to explain a failure with its last ones.
pub struct ChildProcess {
    child: Child,
    name: String,
    stderr: Arc<Stderr>,
    /// The first line `wait_line` has not looked at yet.
    next_line: u64,
}

impl ChildProcess {
    /// Starts `program args` with extra environment variables; `name` names it in errors.
    pub fn spawn(
        program: &Path,
        args: &[&str],
        env: &[(String, String)],
        name: &str,
        echo: Echo,
    ) -> Result<Self, String> {
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
        clean_up_on_signal();
        leftovers().pids.push(child.id());
        let pipe = child.stderr.take().expect("stderr is piped");
        let stderr = Arc::new(Stderr::default());
        let filled = stderr.clone();
        let who = name.to_string();
        std::thread::spawn(move || {
            for line in lossy_lines(pipe) {
                if echo == Echo::ToStderr {
                    // Dropped if our stderr is gone: this thread must go on draining the
                    // child's pipe, or the child blocks on a full one.
                    let _ = std::io::Write::write_fmt(
                        &mut std::io::stderr(),
                        format_args!("  {who} | {line}\n"),
                    );
                }
                filled.push(line);
            }
            filled.end();
        });
        Ok(Self {
            child,
            name: name.to_string(),
            stderr,
            next_line: 0,
        })
    }

    /// Starts it and waits for a stderr line containing `ready`; returns the process and
    /// that line.
    pub fn ready(
        program: &Path,
        args: &[&str],
        env: &[(String, String)],
        name: &str,
        ready: &str,
        echo: Echo,
    ) -> Result<(Self, String), String> {
        let mut process = Self::spawn(program, args, env, name, echo)?;
        let line = process.wait_line(ready, START_TIMEOUT)?;
        Ok((process, line))
    }

    /// Waits at most `timeout` for a stderr line containing `marker`, looking only at
    /// lines printed after the one the previous wait returned.
    pub fn wait_line(&mut self, marker: &str, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        let mut printed = self.stderr.lock();
        loop {
            let from = self.next_line.max(printed.dropped);
            let end = printed.dropped + printed.lines.len() as u64;
            for number in from..end {
                let line = &printed.lines[(number - printed.dropped) as usize];
                if line.contains(marker) {
                    self.next_line = number + 1;
                    return Ok(line.clone());
                }
            }
            self.next_line = end;
            if printed.ended {
                drop(printed);
                let how = match self.exit_status_after_eof() {
                    Some(status) => format!("exited ({status})"),
                    None => "closed its stderr".to_string(),
                };
                return Err(self.failure(&format!("{how} before printing {marker:?}")));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(printed);
                return Err(self.failure(&format!("printed no {marker:?} in {timeout:?}")));
            }
            printed = self
                .stderr
                .grew
                .wait_timeout(printed, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Its exit status once its stderr closed: the kernel closes a dying process's
    /// files a moment before it can be reaped, so this waits for that moment (at most
    /// a second: a child may close its stderr and go on).
    fn exit_status_after_eof(&mut self) -> Option<ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            if let Some(status) = self.reaped() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// An error naming the process, with the last lines it printed.
    fn failure(&self, what: &str) -> String {
        let printed = self.stderr.lock();
        let skip = printed.lines.len().saturating_sub(TAIL_LINES);
        let tail: Vec<&str> = printed
            .lines
            .iter()
            .skip(skip)
            .map(String::as_str)
            .collect();
        format!(
            "{} {what}; its last output:\n  {}",
            self.name,
            tail.join("\n  ")
        )
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether any line it printed so far (of the last `KEPT_LINES`) contains `marker`:
    /// for a test that a line did not come, once a later line shows it would have.
    pub fn printed(&self, marker: &str) -> bool {
        self.stderr.lock().lines.iter().any(|l| l.contains(marker))
    }

    /// Whether the process has exited (reaped here if so).
    pub fn exited(&mut self) -> bool {
        self.reaped().is_some()
    }

    /// Its exit status if it has exited, reaped now: its pid may then be reused, so it
    /// is no longer the signal handler's to kill.
    fn reaped(&mut self) -> Option<ExitStatus> {
        let status = self.child.try_wait().ok().flatten()?;
        let pid = self.child.id();
        leftovers().pids.retain(|&p| p != pid);
        Some(status)
    }

    /// SIGKILL, as a crash would: no chance to flush or say goodbye. Returns the instant
    /// the signal went out (where a failover clock starts), after the process is gone.
    pub fn kill(&mut self) -> Result<Instant, String> {
        if let Some(status) = self.reaped() {
            return Err(self.failure(&format!("had already exited ({status})")));
        }
        self.child
            .kill()
            .map_err(|e| format!("cannot kill {}: {e}", self.name))?;
        let at = Instant::now();
        self.wait()?;
        Ok(at)
    }

    /// Sends the signal named `signal` (`TERM`, `STOP`, `CONT`, ...).
    pub fn signal(&self, signal: &str) -> Result<(), String> {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .map_err(|e| format!("cannot run kill: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill -{signal} {} failed: {status}", self.name))
        }
    }

    /// SIGTERM, as a service manager stops a process; returns how it exited.
    pub fn terminate(&mut self) -> Result<ExitStatus, String> {
        self.signal("TERM")?;
        self.wait()
    }

    /// Waits for the exit, after which the pid may be reused: no longer ours to kill.
    pub fn wait(&mut self) -> Result<ExitStatus, String> {
        let status = self
            .child
            .wait()
            .map_err(|e| format!("cannot wait for {}: {e}", self.name));
        let pid = self.child.id();
        leftovers().pids.retain(|&p| p != pid);
        status
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.wait();
    }
}

/// /dev/shm when this host has it, else `fallback`: the region is memory by design, and
/// on tmpfs the kernel never writes it back to disk (see docs/PERFORMANCE.md).
pub fn shm_or(fallback: &Path) -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        fallback.to_path_buf()
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The `embarcadero` executable.
    pub program: PathBuf,
    /// Brokers in all: the head serves broker 0, followers 1..brokers.
    pub brokers: u32,
    /// Leave ordering to `embarcadero sequencer` processes ([`LocalCluster::start_sequencer`]).
    pub external_sequencer: bool,
    /// Sequencer epoch, microseconds (`None`: the server's default).
    pub epoch_us: Option<u64>,
    /// Directory of the region file (`None`: /dev/shm when it exists, else the data dir).
    pub region_dir: Option<PathBuf>,
    /// Disk replica directories of the head (`None`: the server's default, in the data dir).
    pub replica_dirs: Vec<PathBuf>,
    /// Extra environment for every process (settings such as the heartbeat interval).
    pub env: Vec<(String, String)>,
    /// Whether the processes' stderr lines are echoed to this process's stderr.
    pub echo: Echo,
    /// How the head is started differently (e.g. in a network namespace, with
    /// `--bind ADDR`); a restarted head is started the same way.
    pub head_launch: Launch,
    /// Followers started differently (e.g. in a network namespace), by broker id.
    pub follower_launch: Vec<(u32, Launch)>,
}

/// How the head or a follower is started differently: through a command (such as
/// `ip netns exec NAME`, which puts it in a network namespace) and with extra
/// arguments (such as `--bind ADDR`).
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// The command and its arguments the follower's command line is appended to.
    pub prefix: Vec<String>,
    pub args: Vec<String>,
}

impl ClusterSpec {
    pub fn new(program: PathBuf, brokers: u32) -> Self {
        Self {
            program,
            brokers,
            external_sequencer: false,
            epoch_us: None,
            region_dir: None,
            replica_dirs: Vec::new(),
            env: Vec::new(),
            echo: Echo::Quiet,
            head_launch: Launch::default(),
            follower_launch: Vec::new(),
        }
    }
}

/// The region file of a cluster whose data lives in `dir`: in the spec's region
/// directory (else /dev/shm when it exists, else `dir`), named after this process and
/// `dir`, so clusters started side by side do not share one.
fn region_file_in(spec: &ClusterSpec, dir: &Path) -> PathBuf {
    let region_dir = spec.region_dir.clone().unwrap_or_else(|| shm_or(dir));
    region_dir.join(format!(
        "embarcadero-cluster-{}-{}.region",
        std::process::id(),
        dir.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    ))
}

/// Starts the head on `data_dir` and `region_file`, its control API on `control_port`
/// (0: one the system picks); returns it and its ready line.
fn start_head(
    spec: &ClusterSpec,
    data_dir: &Path,
    region_file: &Path,
    control_port: u16,
) -> Result<(ChildProcess, String), String> {
    let mut env = spec.env.clone();
    env.push((
        "EMBARCADERO_REGION_PATH".into(),
        region_file.display().to_string(),
    ));
    if !spec.replica_dirs.is_empty() {
        let dirs: Vec<String> = spec
            .replica_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        env.push(("EMBARCADERO_REPLICATION_DIRS".into(), dirs.join(",")));
    }
    let brokers = spec.brokers.to_string();
    let data = data_dir.display().to_string();
    let epoch = spec.epoch_us.map(|e| e.to_string());
    let port = control_port.to_string();
    let mut args = vec![
        "broker",
        "--head",
        "--brokers",
        &brokers,
        "--base-port",
        "0",
        "--control-port",
        &port,
        "--data-dir",
        &data,
    ];
    if spec.external_sequencer {
        args.push("--external-sequencer");
    }
    args.extend(spec.head_launch.args.iter().map(String::as_str));
    if let Some(epoch) = &epoch {
        args.extend(["--epoch-us", epoch]);
    }
    let program = spec.program.display().to_string();
    let mut command: Vec<&str> = spec.head_launch.prefix.iter().map(String::as_str).collect();
    command.push(&program);
    command.extend(args);
    // The head picks its control port (0: no race for a free port); its ready line
    // names it: "embarcadero is serving: control API http://ADDR  brokers ...".
    ChildProcess::ready(
        Path::new(command[0]),
        &command[1..],
        &env,
        "the head",
        "embarcadero is serving",
        spec.echo,
    )
}

/// The control address the head's ready line names.
fn control_addr_in(line: &str) -> Result<String, String> {
    Ok(line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .ok_or_else(|| format!("the head's ready line names no control address: {line}"))?
        .to_string())
}

/// One process of a [`LocalCluster`], for a fault to aim at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Member {
    Head,
    /// The follower serving this broker id.
    Follower(u32),
    /// By the index [`LocalCluster::start_sequencer`] returned.
    Sequencer(usize),
}

/// A running cluster; dropping it kills every process and removes its files.
pub struct LocalCluster {
    /// The head's control address (host:port).
    pub control: String,
    /// The region file all processes share.
    pub region_file: PathBuf,
    spec: ClusterSpec,
    sequencers: Vec<ChildProcess>,
    /// Whether each sequencer was started as a standby, for starting it again.
    standby: Vec<bool>,
    followers: Vec<(u32, ChildProcess)>,
    head: Option<ChildProcess>,
    /// The data directory, removed when the cluster is dropped.
    dir: tempfile::TempDir,
}

impl LocalCluster {
    /// Starts the head, then one follower per broker id 1..brokers, each once the one
    /// before it is serving.
    pub fn start(spec: &ClusterSpec) -> Result<Self, String> {
        if spec.brokers < 2 {
            return Err("a cluster needs at least 2 brokers (the head's and a follower)".into());
        }
        let dir = tempfile::Builder::new()
            .prefix("embarcadero-cluster-")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        let region_file = region_file_in(spec, dir.path());
        clean_up_on_signal();
        leftovers()
            .paths
            .extend([region_file.clone(), dir.path().to_path_buf()]);
        let (head, ready_line) = start_head(spec, &dir.path().join("head"), &region_file, 0)
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&region_file);
                forget_paths(&[&region_file, dir.path()]);
            })?;
        let control = control_addr_in(&ready_line)?;
        let mut cluster = Self {
            control,
            region_file,
            spec: spec.clone(),
            sequencers: Vec::new(),
            standby: Vec::new(),
            followers: Vec::new(),
            head: Some(head),
            dir,
        };
        cluster.start_followers()?;
        Ok(cluster)
    }

    /// Starts one follower per broker id 1..brokers, each once the one before it is
    /// serving.
    fn start_followers(&mut self) -> Result<(), String> {
        for id in 1..self.spec.brokers {
            let id_arg = id.to_string();
            let launch = self
                .spec
                .follower_launch
                .iter()
                .find(|(f, _)| *f == id)
                .map(|(_, l)| l.clone())
                .unwrap_or_default();
            let program = self.spec.program.display().to_string();
            let mut command: Vec<&str> = launch.prefix.iter().map(String::as_str).collect();
            command.extend([
                program.as_str(),
                "broker",
                "--follower",
                "--head-addr",
                &self.control,
                "--broker-id",
                &id_arg,
            ]);
            command.extend(launch.args.iter().map(String::as_str));
            let (follower, _) = ChildProcess::ready(
                Path::new(command[0]),
                &command[1..],
                &self.spec.env,
                &format!("follower {id}"),
                "is serving at",
                self.spec.echo,
            )?;
            self.followers.push((id, follower));
        }
        Ok(())
    }

    /// Starts an `embarcadero sequencer` (active, or a standby waiting for the lease);
    /// returns its index for [`LocalCluster::kill_sequencer`].
    pub fn start_sequencer(&mut self, standby: bool) -> Result<usize, String> {
        let mut args = vec!["sequencer", "--head-addr", &self.control];
        let ready = if standby {
            args.push("--standby");
            "standby: waiting"
        } else {
            "sequencer is active"
        };
        let name = format!("sequencer {}", self.sequencers.len());
        let (sequencer, _) = ChildProcess::ready(
            &self.spec.program,
            &args,
            &self.spec.env,
            &name,
            ready,
            self.spec.echo,
        )?;
        self.sequencers.push(sequencer);
        self.standby.push(standby);
        Ok(self.sequencers.len() - 1)
    }

    /// SIGKILLs the head (control plane and broker 0); returns the instant the signal
    /// went out, once the process is gone.
    pub fn kill_head(&mut self) -> Result<Instant, String> {
        let at = self
            .head
            .as_mut()
            .ok_or("the head is not running")?
            .kill()?;
        self.head = None;
        Ok(at)
    }

    /// Starts a killed head again on its data directory and control port, as a service
    /// manager would. A restarted head replaces the region (it recovers replicated
    /// topics from their disk replicas), so the followers and sequencers of the old one
    /// stop on their own: this waits for each to say so and exit, then starts them
    /// again, attached to the new region.
    pub fn restart_head(&mut self) -> Result<(), String> {
        if self.head.is_some() {
            return Err("the head is running: kill it first".into());
        }
        let port: u16 = self
            .control
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| format!("no port in the control address {}", self.control))?;
        let data = self.dir.path().join("head");
        let (head, _) = start_head(&self.spec, &data, &self.region_file, port)?;
        self.head = Some(head);
        let old = std::mem::take(&mut self.followers)
            .into_iter()
            .map(|(_, f)| f)
            .chain(std::mem::take(&mut self.sequencers));
        for mut process in old {
            if !process.exited() {
                process.wait_line("replaced the region", OLD_REGION_EXIT)?;
            }
            process.wait()?;
        }
        self.start_followers()?;
        for standby in std::mem::take(&mut self.standby) {
            self.start_sequencer(standby)?;
        }
        Ok(())
    }

    /// SIGKILLs the follower serving broker `id`; returns the instant the signal went
    /// out, once the process is gone.
    pub fn kill_follower(&mut self, id: u32) -> Result<Instant, String> {
        let at = self
            .followers
            .iter()
            .position(|(f, _)| *f == id)
            .ok_or_else(|| format!("no follower serves broker {id}"))?;
        let (_, mut follower) = self.followers.remove(at);
        follower.kill()
    }

    /// The process of `member`, while it is part of the cluster.
    pub fn member(&mut self, member: Member) -> Option<&mut ChildProcess> {
        match member {
            Member::Head => self.head.as_mut(),
            Member::Follower(id) => self
                .followers
                .iter_mut()
                .find(|(f, _)| *f == id)
                .map(|(_, p)| p),
            Member::Sequencer(index) => self.sequencers.get_mut(index),
        }
    }

    /// SIGKILLs sequencer `index`; returns the instant the signal went out.
    pub fn kill_sequencer(&mut self, index: usize) -> Result<Instant, String> {
        self.sequencers
            .get_mut(index)
            .ok_or_else(|| format!("no sequencer {index}"))?
            .kill()
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        // Sequencers and followers first, so the head outlives what talks to it.
        self.sequencers.clear();
        self.followers.clear();
        self.head = None;
        // The temporary directory removes itself; a region on /dev/shm does not.
        let _ = std::fs::remove_file(&self.region_file);
        forget_paths(&[&self.region_file, self.dir.path()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> ChildProcess {
        ChildProcess::spawn(
            Path::new("/bin/sh"),
            &["-c", script],
            &[],
            "the script",
            Echo::Quiet,
        )
        .unwrap()
    }

    #[test]
    fn wait_line_reads_on_from_the_last_line_it_returned() {
        let mut p = shell("echo one >&2; echo two >&2; echo one again >&2; sleep 30");
        let wait = Duration::from_secs(10);
        assert_eq!(p.wait_line("one", wait).unwrap(), "one");
        assert_eq!(p.wait_line("one", wait).unwrap(), "one again");
        // "two" was passed over on the way: it is not found again.
        let err = p.wait_line("two", Duration::from_millis(50)).unwrap_err();
        assert!(err.contains("printed no \"two\""), "{err}");
        assert!(
            err.contains("one again"),
            "the error shows the last lines: {err}"
        );
        p.kill().unwrap();
    }

    #[test]
    fn an_exit_ends_the_wait_with_the_last_lines() {
        let mut p = shell("echo starting >&2; echo cannot bind >&2; exit 3");
        let err = p.wait_line("serving", Duration::from_secs(30)).unwrap_err();
        assert!(
            err.contains("exited (exit status: 3) before printing"),
            "{err}"
        );
        assert!(err.contains("cannot bind"), "{err}");
        assert_eq!(p.wait().unwrap().code(), Some(3));
    }

    #[test]
    fn a_line_that_is_not_utf8_is_kept_and_the_lines_after_it_are_read() {
        let mut p = shell("printf 'bad \\377 byte\\n' >&2; echo serving >&2; sleep 30");
        let line = p.wait_line("serving", Duration::from_secs(30)).unwrap();
        assert_eq!(line, "serving");
        assert!(p.printed("bad \u{FFFD} byte"), "kept, with a replacement");
        p.kill().unwrap();
    }

    #[test]
    fn only_the_last_kept_lines_stay() {
        let script = format!(
            "i=0; while [ $i -lt {} ]; do echo line $i >&2; i=$((i+1)); done; echo done >&2",
            KEPT_LINES + 5
        );
        let mut p = shell(&script);
        p.wait_line("done", Duration::from_secs(30)).unwrap();
        let printed = p.stderr.lock();
        assert_eq!(printed.lines.len(), KEPT_LINES);
        assert_eq!(printed.dropped, 6);
        assert_eq!(printed.lines[0], "line 6");
    }

    #[test]
    fn terminate_reports_the_exit() {
        let mut p = shell("echo up >&2; exec sleep 30");
        p.wait_line("up", Duration::from_secs(10)).unwrap();
        let exit = p.terminate().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(exit.signal(), Some(15));
    }
}
