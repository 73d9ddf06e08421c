//! The network of the partition nemeses: each broker process (the head, the followers)
//! runs in a network namespace of its own ("space"), every space joined by a veth pair
//! to one bridge in the host's namespace, where the clients (publishers, readers) and
//! the sequencers stay and reach the brokers through the bridge's address.
//!
//! Two kinds of cut, both silent (packets vanish; no reset, no error to a sender):
//! - [`Netns::cut`] isolates a space from everything: its link to the bridge goes down;
//! - [`Netns::cut_pair`] parts two parties only (two spaces, or the host and a space),
//!   while each still reaches everyone else: each side's neighbour entry for the other
//!   is pinned to a hardware address nobody has, so their frames go nowhere. Only the
//!   `ip` tool is needed (this kernel has no tc drop action, and no nftables here).
//!
//! Brokers of one host also share the region's memory, which no network fault cuts:
//! what a partition takes away is the control plane's heartbeats and joins, and
//! clients' connections. The sequencers talk to brokers only through that memory (and
//! to the head only to read the cluster document when they start), so no network cut
//! can part a sequencer from a broker.
//!
//! Owns the namespaces, the bridge and the links, made with the `ip` tool, and removes
//! them when dropped. Needs root (CAP_NET_ADMIN); [`Netns::create`] says why it cannot
//! where either is missing, and the campaign then leaves the partitions out.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A hardware address no interface has: frames sent to it are flooded by the bridge
/// and dropped by every receiver, as not theirs. (Locally administered, unicast.)
const NOWHERE_MAC: &str = "02:00:00:00:0e:cc";

/// One end of a pair cut: the host's namespace (the clients and sequencers) or a space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Party {
    Host,
    Space(usize),
}

/// A network namespace of the lab and its end of the link to the bridge.
pub struct Space {
    pub name: String,
    /// The link's end on the bridge (host side).
    host_if: String,
    /// The link's end inside the namespace.
    inner_if: String,
    /// The space's address: the process inside binds it.
    pub ip: String,
}

pub struct Netns {
    bridge: String,
    /// The bridge's address: the host's (clients', sequencers') address in the lab.
    pub host_ip: String,
    spaces: Vec<Space>,
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
    /// Most spaces a lab holds: its /28 has the bridge's address and 13 more.
    pub const MAX_SPACES: usize = 13;

    /// Makes the bridge and `spaces` namespaces on it, all named after this process and
    /// a count of the labs it made (so that campaigns side by side, and tests of one
    /// process, do not collide), in a /28 of 10.231.0.0/16 chosen by both.
    pub fn create(spaces: usize) -> Result<Self, String> {
        static MADE: AtomicU32 = AtomicU32::new(0);
        assert!((1..=Self::MAX_SPACES).contains(&spaces), "{spaces} spaces");
        let pid = std::process::id();
        // Up to four labs of a process at once; interface names stay within 15 bytes.
        let n = MADE.fetch_add(1, Ordering::Relaxed) % 4;
        let tag = format!("{pid}-{n}");
        let net = pid.wrapping_mul(4).wrapping_add(n) & 0xfff;
        let (b, c) = (net >> 4, (net & 0xf) << 4);
        let mut lab = Self {
            bridge: format!("ecb{tag}"),
            host_ip: format!("10.231.{b}.{}", c + 1),
            spaces: Vec::new(),
        };
        ip(&["link", "add", &lab.bridge, "type", "bridge"])
            .map_err(|e| format!("cannot make a bridge (needs root): {e}"))?;
        // From here on, dropping `lab` removes what was made.
        ip(&[
            "addr",
            "add",
            &format!("{}/28", lab.host_ip),
            "dev",
            &lab.bridge,
        ])?;
        ip(&["link", "set", &lab.bridge, "up"])?;
        for i in 0..spaces {
            let space = Space {
                name: format!("emb-chaos-{tag}-{i}"),
                host_if: format!("ecx{tag}{i:x}"),
                inner_if: format!("ecy{tag}{i:x}"),
                ip: format!("10.231.{b}.{}", c + 2 + i as u32),
            };
            ip(&["netns", "add", &space.name])
                .map_err(|e| format!("cannot make a network namespace (needs root): {e}"))?;
            lab.spaces.push(space);
            lab.wire(i)?;
        }
        Ok(lab)
    }

    /// Joins space `i` to the bridge and gives it its address.
    fn wire(&self, i: usize) -> Result<(), String> {
        let s = &self.spaces[i];
        let (ns, inner) = (s.name.as_str(), s.inner_if.as_str());
        ip(&[
            "link", "add", &s.host_if, "type", "veth", "peer", "name", inner, "netns", ns,
        ])?;
        ip(&["link", "set", &s.host_if, "master", &self.bridge])?;
        ip(&["link", "set", &s.host_if, "up"])?;
        ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{}/28", s.ip),
            "dev",
            inner,
        ])?;
        ip(&["-n", ns, "link", "set", inner, "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])
    }

    pub fn space(&self, i: usize) -> &Space {
        &self.spaces[i]
    }

    /// The command a process is started through to run inside space `i`.
    pub fn launch_prefix(&self, i: usize) -> Vec<String> {
        ["ip", "netns", "exec", &self.spaces[i].name]
            .map(str::to_string)
            .to_vec()
    }

    /// Isolates space `i` from everyone: its link goes down.
    pub fn cut(&self, i: usize) -> Result<(), String> {
        ip(&["link", "set", &self.spaces[i].host_if, "down"])
    }

    /// Heals [`Netns::cut`].
    pub fn mend(&self, i: usize) -> Result<(), String> {
        ip(&["link", "set", &self.spaces[i].host_if, "up"])
    }

    /// Parts `a` and `b` only: neither's packets reach the other, in either direction,
    /// while both still reach every other party.
    pub fn cut_pair(&self, a: Party, b: Party) -> Result<(), String> {
        assert_ne!(a, b, "a party cannot be cut from itself");
        self.neighbour(a, b, true)?;
        self.neighbour(b, a, true)
    }

    /// Heals [`Netns::cut_pair`]: the pinned entries go, and the next packet asks (ARP)
    /// for the real address again.
    pub fn mend_pair(&self, a: Party, b: Party) -> Result<(), String> {
        let first = self.neighbour(a, b, false);
        let second = self.neighbour(b, a, false);
        first.and(second)
    }

    /// The address of `party` in the lab.
    pub fn ip_of(&self, party: Party) -> &str {
        match party {
            Party::Host => &self.host_ip,
            Party::Space(i) => &self.spaces[i].ip,
        }
    }

    /// Pins (or unpins) `from`'s neighbour entry for `to` to [`NOWHERE_MAC`]. A
    /// permanent entry is not overwritten by the ARP answers `to` still gives.
    fn neighbour(&self, from: Party, to: Party, pin: bool) -> Result<(), String> {
        let to_ip = self.ip_of(to);
        let mut args: Vec<&str> = Vec::new();
        let dev = match from {
            Party::Host => self.bridge.as_str(),
            Party::Space(i) => {
                args.extend(["-n", self.spaces[i].name.as_str()]);
                self.spaces[i].inner_if.as_str()
            }
        };
        if pin {
            args.extend([
                "neigh",
                "replace",
                to_ip,
                "lladdr",
                NOWHERE_MAC,
                "dev",
                dev,
                "nud",
                "permanent",
            ]);
        } else {
            args.extend(["neigh", "del", to_ip, "dev", dev]);
        }
        ip(&args)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the pair, and with it the host's
        // (once no process is left inside); the bridge goes last.
        for s in &self.spaces {
            let _ = ip(&["netns", "del", &s.name]);
            let _ = ip(&["link", "del", &s.host_if]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::time::Duration;

    /// Runs `f` on a thread that has joined space `party` (or on a plain thread for the
    /// host): sockets it makes belong to that namespace for good, whichever thread
    /// uses them later.
    fn within<T: Send + 'static>(
        lab: &Netns,
        party: Party,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let path = match party {
            Party::Host => None,
            Party::Space(i) => Some(format!("/run/netns/{}", lab.space(i).name)),
        };
        std::thread::spawn(move || {
            if let Some(path) = path {
                let file = std::fs::File::open(&path).unwrap();
                // Only this thread moves; the test's own stays in the host's namespace.
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            }
            f()
        })
        .join()
        .unwrap()
    }

    /// A listener on `party`'s address in the lab, made inside its namespace.
    fn listen(lab: &Netns, party: Party) -> (TcpListener, SocketAddr) {
        let ip = lab.ip_of(party).to_string();
        let listener = within(lab, party, move || {
            TcpListener::bind((ip.as_str(), 0)).unwrap()
        });
        let addr = listener.local_addr().unwrap();
        (listener, addr)
    }

    /// Whether a connection from `from` to `to` gets through within `wait`.
    fn reaches(lab: &Netns, from: Party, to: SocketAddr, wait: Duration) -> bool {
        within(lab, from, move || {
            TcpStream::connect_timeout(&to, wait).is_ok()
        })
    }

    /// Makes a lab of two spaces, or says why it skips.
    fn lab_or_skip() -> Option<Netns> {
        match Netns::create(2) {
            Ok(lab) => Some(lab),
            Err(why) => {
                eprintln!("skipped: {why}");
                None
            }
        }
    }

    const THROUGH: Duration = Duration::from_secs(5);
    /// A silent drop never answers: a connection still pending after this is cut off.
    const CUT_OFF: Duration = Duration::from_secs(1);

    /// A listener inside a space is reachable from the host until the cut, not during
    /// it, and again after the mend. Skips (saying why) where namespaces cannot be made.
    #[test]
    fn a_cut_partitions_the_namespace_and_a_mend_heals_it() {
        let Some(lab) = lab_or_skip() else { return };
        let (_l, inside) = listen(&lab, Party::Space(1));
        let (_h, host) = listen(&lab, Party::Host);
        assert!(
            reaches(&lab, Party::Host, inside, THROUGH),
            "before the cut"
        );
        lab.cut(1).unwrap();
        assert!(
            !reaches(&lab, Party::Host, inside, CUT_OFF),
            "host to space"
        );
        assert!(
            !reaches(&lab, Party::Space(0), inside, CUT_OFF),
            "space to space"
        );
        assert!(
            !reaches(&lab, Party::Space(1), host, CUT_OFF),
            "space to host"
        );
        lab.mend(1).unwrap();
        assert!(
            reaches(&lab, Party::Host, inside, THROUGH),
            "after the mend"
        );
        assert!(
            reaches(&lab, Party::Space(1), host, THROUGH),
            "out after the mend"
        );
    }

    /// A pair cut parts those two parties both ways and nobody else: between two
    /// spaces, the host still reaches both and they reach it; between the host and a
    /// space, the other space still reaches both. The mend heals each. Skips where
    /// namespaces cannot be made.
    #[test]
    fn a_pair_cut_parts_only_that_pair_and_a_mend_heals_it() {
        let Some(lab) = lab_or_skip() else { return };
        let (h, a, b) = (Party::Host, Party::Space(0), Party::Space(1));
        let listeners = [listen(&lab, h), listen(&lab, a), listen(&lab, b)];
        let addr = |p: Party| match p {
            Party::Host => listeners[0].1,
            Party::Space(i) => listeners[1 + i].1,
        };
        let all = [h, a, b];
        let check = |cut: Option<(Party, Party)>| {
            for from in all {
                for to in all.into_iter().filter(|&to| to != from) {
                    let parted =
                        cut.is_some_and(|(x, y)| (from, to) == (x, y) || (from, to) == (y, x));
                    let wait = if parted { CUT_OFF } else { THROUGH };
                    assert_eq!(
                        reaches(&lab, from, addr(to), wait),
                        !parted,
                        "{from:?} to {to:?} with {cut:?} cut"
                    );
                }
            }
        };
        check(None);
        for (x, y) in [(a, b), (h, b)] {
            lab.cut_pair(x, y).unwrap();
            check(Some((x, y)));
            lab.mend_pair(x, y).unwrap();
            check(None);
        }
    }
}
