//! Who owns a part of the region, as a process: a broker's logs (recorded when the
//! broker starts) and the sequencer lease (recorded by its holder).
//!
//! A successor records itself over its predecessor. Before it writes anything, it
//! makes sure the predecessor can write nothing more: a process that was declared dead
//! but is only paused (SIGSTOP, a frozen VM) would otherwise resume in the middle of
//! its stores. The successor cannot make a plain store of another process fail, so on
//! the same host it ends the predecessor with SIGKILL, which a stopped process cannot
//! defer, and waits until it has exited ("shoot the other node in the head"). A
//! predecessor on another host is left to its own checks of the epoch and owner words
//! (`docs/CLUSTER.md` describes that window).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Incarnations are shown as JSON numbers (`/v1/cluster`, `/v1/status`, the TypeScript
/// admin client's `incarnation: number`), so they stay at or below this.
pub use embarcadero_wire::MAX_JSON_SAFE;

/// A fresh, non-zero incarnation number for a process taking over a part of the
/// region (a broker id's logs, the sequencer lease): the clock's nanoseconds mixed with
/// the pid (bits 31 to 52: every pid Linux gives, up to 2^22, so two processes starting
/// in the same nanosecond differ), kept to 53 bits. Only ever compared for equality.
pub fn new_incarnation() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let incarnation = (((std::process::id() as u64) << 31 ^ nanos) & MAX_JSON_SAFE) | 1;
    assert!(incarnation != 0 && incarnation <= MAX_JSON_SAFE);
    incarnation
}

/// A process, identified across PID reuse: the host's boot id (first word), the pid
/// and the process's start time in clock ticks since boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub boot: u64,
    pub pid: u32,
    pub start_ticks: u64,
}

/// What [`ProcessIdentity::fence_off`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The process was not running (exited, or its pid belongs to another process now).
    NotRunning,
    /// It ran on this host and was killed; it has exited.
    Killed,
    /// It runs on another host: nothing can be done from here.
    OtherHost,
    /// It is this process (a restart within one process).
    Itself,
}

impl ProcessIdentity {
    /// The calling process.
    pub fn current() -> Self {
        let pid = std::process::id();
        Self {
            boot: crate::region::boot_id()[0],
            pid,
            start_ticks: proc_stat(pid).map_or(0, |s| s.start_ticks),
        }
    }

    fn on_this_host(&self) -> bool {
        self.boot != 0 && self.boot == crate::region::boot_id()[0]
    }

    /// True while the process runs (or is stopped) on this host; a zombie waiting to be
    /// reaped no longer runs.
    pub fn is_running(&self) -> bool {
        self.on_this_host()
            && proc_stat(self.pid).is_some_and(|s| s.start_ticks == self.start_ticks && !s.exited)
    }

    /// Makes sure the process writes nothing more: kills it if it still runs on this
    /// host and waits (at most `limit`) until it has exited.
    pub fn fence_off(&self, limit: Duration) -> std::io::Result<Fenced> {
        if *self == Self::current() {
            return Ok(Fenced::Itself);
        }
        if !self.on_this_host() {
            return Ok(Fenced::OtherHost);
        }
        if !self.is_running() {
            return Ok(Fenced::NotRunning);
        }
        // SAFETY: kill(2) has no memory-safety preconditions. The pid was checked
        // against the recorded start time just above; the window in which it could
        // exit and be reused by another process is the few microseconds between.
        if unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
        let deadline = Instant::now() + limit;
        while self.is_running() {
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "process {} did not exit within {limit:?} of SIGKILL",
                        self.pid
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(Fenced::Killed)
    }
}

struct ProcStat {
    start_ticks: u64,
    /// Zombie or dead: it runs no more code.
    exited: bool,
}

/// `/proc/PID/stat`: the state (field 3) and the start time (field 22).
fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: skip past the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?;
    Some(ProcStat {
        start_ticks: fields.get(19)?.parse().ok()?,
        exited: matches!(*state, "Z" | "X" | "x"),
    })
}

/// An owner record of the control block: four words, the owner's incarnation (any
/// non-zero number it picked) written last.
pub struct OwnerRecord<'a> {
    pub(crate) incarnation: &'a AtomicU64,
    pub(crate) boot: &'a AtomicU64,
    pub(crate) pid: &'a AtomicU64,
    pub(crate) start_ticks: &'a AtomicU64,
}

impl OwnerRecord<'_> {
    /// The recorded owner, if any.
    pub fn read(&self) -> Option<(u64, ProcessIdentity)> {
        let incarnation = self.incarnation.load(Ordering::Acquire);
        (incarnation != 0).then(|| {
            (
                incarnation,
                ProcessIdentity {
                    boot: self.boot.load(Ordering::Relaxed),
                    pid: self.pid.load(Ordering::Relaxed) as u32,
                    start_ticks: self.start_ticks.load(Ordering::Relaxed),
                },
            )
        })
    }

    /// The recorded owner's incarnation (0: none). One load: cheap enough per batch.
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(Ordering::Acquire)
    }

    /// Records `incarnation` of process `who`. Only the part's new owner writes this,
    /// after fencing off the previous one.
    pub fn write(&self, incarnation: u64, who: &ProcessIdentity) {
        assert!(incarnation != 0, "incarnation 0 means no owner");
        self.incarnation.store(0, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        self.boot.store(who.boot, Ordering::Relaxed);
        self.pid.store(who.pid as u64, Ordering::Relaxed);
        self.start_ticks.store(who.start_ticks, Ordering::Relaxed);
        self.incarnation.store(incarnation, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn incarnations_are_non_zero_and_survive_a_javascript_number() {
        for _ in 0..10_000 {
            let n = new_incarnation();
            assert!(n != 0 && n <= MAX_JSON_SAFE, "{n}");
            assert_eq!(n as f64 as u64, n, "a double carries {n} exactly");
        }
    }

    #[test]
    fn the_current_process_is_running_and_is_not_killed() {
        let me = ProcessIdentity::current();
        assert!(me.start_ticks > 0, "start time read from /proc");
        assert!(me.is_running());
        assert_eq!(
            me.fence_off(Duration::from_secs(1)).unwrap(),
            Fenced::Itself
        );
    }

    #[test]
    fn a_stopped_process_on_this_host_is_killed_and_gone() {
        let mut child = Command::new("sleep")
            .arg("60")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        let who = ProcessIdentity {
            pid,
            ..ProcessIdentity::current()
        };
        let who = ProcessIdentity {
            start_ticks: proc_stat(pid).unwrap().start_ticks,
            ..who
        };
        // SAFETY: signals a child we own.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
        assert!(
            who.is_running(),
            "a stopped process still counts as running"
        );
        // The child is not reaped yet: as a zombie it no longer runs.
        assert_eq!(
            who.fence_off(Duration::from_secs(5)).unwrap(),
            Fenced::Killed
        );
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert_eq!(
            who.fence_off(Duration::from_secs(1)).unwrap(),
            Fenced::NotRunning
        );
    }

    #[test]
    fn a_reused_pid_or_another_host_is_left_alone() {
        let me = ProcessIdentity::current();
        let reused = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(!reused.is_running(), "same pid, other start time");
        assert_eq!(
            reused.fence_off(Duration::from_secs(1)).unwrap(),
            Fenced::NotRunning
        );
        let elsewhere = ProcessIdentity {
            boot: me.boot ^ 1,
            ..me
        };
        assert_eq!(
            elsewhere.fence_off(Duration::from_secs(1)).unwrap(),
            Fenced::OtherHost
        );
    }
}
