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

/// User + system CPU seconds of this process, exited threads included.
pub fn process_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| parse_stat(&stat))
        .map_or(0.0, |(_, seconds)| seconds)
}

/// User + system CPU seconds of each live thread of this process, by thread id, with
/// its name. A thread that has exited is no longer listed.
pub fn thread_cpu_seconds() -> HashMap<u64, (String, f64)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return HashMap::new();
    };
    tasks
        .filter_map(|task| {
            let task = task.ok()?;
            let tid = task.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            Some((tid, parse_stat(&stat)?))
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
}
