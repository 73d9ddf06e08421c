//! CPU time of this process and of its threads, from `/proc` (Linux; zero elsewhere).
//!
//! `/metrics` exports the process's as `process_cpu_seconds_total`, and `embarcadero
//! bench` splits an embedded server's CPU from its publishers' by thread name: every
//! thread the server starts is named by one of [`SERVER_THREAD_PREFIXES`].

use std::collections::HashMap;

/// Name prefixes of the threads a server runs (brokers, sequencer, replicas, control
/// plane); clients' threads are `pub-*` and `sub-*`.
pub const SERVER_THREAD_PREFIXES: &[&str] = &[
    "broker",
    "sequencer",
    "replica",
    "control-",
    "cluster-monitor",
    "etcd-keepalive",
    "follower-",
    "heartbeat",
];

/// Whether a thread of this name is one of a server's.
pub fn is_server_thread(name: &str) -> bool {
    SERVER_THREAD_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// User + system CPU seconds of this process, exited threads included, to the
/// nanosecond where the kernel's CPU clocks answer (else in clock ticks).
pub fn process_cpu_seconds() -> f64 {
    cpu_clock_seconds(libc::CLOCK_PROCESS_CPUTIME_ID).unwrap_or_else(|| {
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| parse_stat(&stat))
            .map_or(0.0, |(_, seconds)| seconds)
    })
}

/// The Linux CPU clock of one thread of this process: what `pthread_getcpuclockid`
/// returns, built from a thread id read in `/proc` (CPUCLOCK_SCHED | PERTHREAD).
fn thread_cpu_clock(tid: u64) -> Option<libc::clockid_t> {
    let tid = libc::clockid_t::try_from(tid).ok()?;
    Some((!tid << 3) | 6)
}

/// A CPU clock's reading in seconds; none if the kernel refuses it (the thread exited,
/// or the clock is unsupported).
fn cpu_clock_seconds(clock: libc::clockid_t) -> Option<f64> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec; an unknown clock is an error return.
    let rc = unsafe { libc::clock_gettime(clock, &mut now) };
    (rc == 0).then_some(now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9)
}

/// User + system CPU seconds of each live thread of this process, by thread id, with
/// its name. A thread that has exited is no longer listed. Read from the thread's CPU
/// clock where it answers: `/proc`'s clock ticks (10 ms) would show zero for a thread
/// that ran a few milliseconds, such as a broker's receive thread over shared memory.
pub fn thread_cpu_seconds() -> HashMap<u64, (String, f64)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return HashMap::new();
    };
    tasks
        .filter_map(|task| {
            let task = task.ok()?;
            let tid = task.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            let (name, ticked) = parse_stat(&stat)?;
            let precise = thread_cpu_clock(tid).and_then(cpu_clock_seconds);
            Some((tid, (name, precise.unwrap_or(ticked))))
        })
        .collect()
}

/// The name and user + system CPU seconds in a `/proc/.../stat` line.
fn parse_stat(stat: &str) -> Option<(String, f64)> {
    // The name is in parentheses and may itself hold spaces and parentheses: it ends at
    // the last ')'.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_string();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the name.
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    // SAFETY: sysconf only reads a configuration value.
    let per_second = match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as f64,
        _ => 100.0,
    };
    Some((name, (ticks(11)? + ticks(12)?) / per_second))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_with_spaces_and_parentheses_is_read_whole() {
        let line = "4242 (pub (send) 1) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0";
        let (name, seconds) = parse_stat(line).unwrap();
        assert_eq!(name, "pub (send) 1");
        // SAFETY: sysconf only reads a configuration value.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        assert_eq!(seconds, 300.0 / per_second);
    }

    #[test]
    fn a_truncated_line_is_no_reading() {
        assert_eq!(parse_stat("4242 (x) S 1 2"), None);
    }

    #[test]
    fn this_thread_is_listed_under_its_name() {
        let listed = std::thread::Builder::new()
            .name("broker9-probe".into())
            .spawn(|| {
                // SAFETY: gettid takes nothing and cannot fail.
                let me = unsafe { libc::gettid() } as u64;
                thread_cpu_seconds().get(&me).map(|(name, _)| name.clone())
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(listed.as_deref(), Some("broker9-probe"));
        assert!(is_server_thread("broker9-probe"));
        assert!(!is_server_thread("pub-send-0"));
    }

    #[test]
    fn a_thread_that_ran_a_millisecond_shows_it() {
        let burned = std::thread::spawn(|| {
            // SAFETY: gettid takes nothing and cannot fail.
            let me = unsafe { libc::gettid() } as u64;
            let before = thread_cpu_seconds()[&me].1;
            let start = std::time::Instant::now();
            while start.elapsed() < std::time::Duration::from_millis(2) {
                std::hint::black_box(0u64);
            }
            thread_cpu_seconds()[&me].1 - before
        })
        .join()
        .unwrap();
        assert!(burned > 0.0, "a 2 ms busy loop read as {burned} s");
    }
}
