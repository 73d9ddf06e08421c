//! The network namespace of the partition nemesis: follower broker 2 runs inside it,
//! joined to the host's namespace by a veth pair, and taking the pair's host end down
//! partitions it from the head and from every client at once (connections stall; no
//! reset is sent). Brokers of one host also share the region's memory, which no network
//! fault cuts: what a partition takes away is the control plane's heartbeats and joins
//! and the clients' connections.
//!
//! Owns the namespace and the link, made with the `ip` tool, and removes both when
//! dropped. Needs root (CAP_NET_ADMIN); [`Netns::create`] says why it cannot where
//! either is missing, and the campaign then leaves the fault out.

use std::process::Command;

pub struct Netns {
    name: String,
    host_if: String,
    /// The host end's address: the head binds it, so the namespace can reach it.
    pub host_ip: String,
    /// The namespace end's address: the follower inside binds it.
    pub inner_ip: String,
}

/// Runs `ip` with `args`; the error names the command and what it printed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` ({e}); install iproute2"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "`ip {}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

impl Netns {
    /// Makes the namespace and the veth pair, both named after this process (so that
    /// campaigns side by side do not collide), with a /30 of 10.231.0.0/16 named by the
    /// process id too.
    pub fn create() -> Result<Self, String> {
        let pid = std::process::id();
        let (b, c) = ((pid >> 6) & 0xff, (pid & 0x3f) << 2);
        let ns = Self {
            name: format!("emb-chaos-{pid}"),
            host_if: format!("ecx{pid}"),
            host_ip: format!("10.231.{b}.{}", c + 1),
            inner_ip: format!("10.231.{b}.{}", c + 2),
        };
        ip(&["netns", "add", &ns.name])
            .map_err(|e| format!("cannot make a network namespace (needs root): {e}"))?;
        // From here on, dropping `ns` removes what was made.
        let inner_if = format!("ecy{pid}");
        let (host, inner) = (format!("{}/30", ns.host_ip), format!("{}/30", ns.inner_ip));
        ip(&[
            "link",
            "add",
            &ns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &inner_if,
            "netns",
            &ns.name,
        ])?;
        ip(&["addr", "add", &host, "dev", &ns.host_if])?;
        ip(&["link", "set", &ns.host_if, "up"])?;
        ip(&["-n", &ns.name, "addr", "add", &inner, "dev", &inner_if])?;
        ip(&["-n", &ns.name, "link", "set", &inner_if, "up"])?;
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The command a process is started through to run inside the namespace.
    pub fn launch_prefix(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.name]
            .map(str::to_string)
            .to_vec()
    }

    /// Partitions the namespace from the host: the link goes down.
    pub fn cut(&self) -> Result<(), String> {
        ip(&["link", "set", &self.host_if, "down"])
    }

    /// Heals the partition.
    pub fn mend(&self) -> Result<(), String> {
        ip(&["link", "set", &self.host_if, "up"])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it the host's.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host_if]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A listener inside the namespace is reachable from the host until the cut, not
    /// during it, and again after the mend. Skips (saying why) where namespaces cannot
    /// be made.
    #[test]
    fn a_cut_partitions_the_namespace_and_a_mend_heals_it() {
        let ns = match Netns::create() {
            Ok(ns) => ns,
            Err(why) => {
                eprintln!("skipped: {why}");
                return;
            }
        };
        // A process in the namespace (bash's /dev/tcp) connects to a listener on the
        // host's end; `timeout` bounds a connection that cannot get through.
        let listener = TcpListener::bind((ns.host_ip.as_str(), 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let connect = |timeout: &str| {
            let mut prefix = ns.launch_prefix();
            prefix.extend(
                [
                    "timeout",
                    timeout,
                    "bash",
                    "-c",
                    &format!("exec 3<>/dev/tcp/{}/{port}", ns.host_ip),
                ]
                .map(str::to_string),
            );
            Command::new(&prefix[0])
                .args(&prefix[1..])
                .status()
                .unwrap()
                .success()
        };
        assert!(connect("5"), "reachable before the cut");
        listener.accept().unwrap();
        ns.cut().unwrap();
        assert!(!connect("1"), "unreachable while cut");
        ns.mend().unwrap();
        assert!(connect("5"), "reachable again after the mend");
    }
}
