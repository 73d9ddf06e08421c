//! Cluster membership, kept by the head's control plane: which broker ids exist, which
//! are served by this process, which by followers, and whether each follower is alive.
//!
//! A follower joins with its id, its data address and an incarnation number it picks
//! at start; it then sends heartbeats naming that incarnation. It is alive while
//! heartbeats arrive, dead after `misses` intervals without one. An id is taken while
//! its holder is local or alive: a second process claiming it is refused, and a dead
//! follower's id can be claimed again (by its restart, or by a replacement).
//!
//! Membership is control-plane state, not data-path state: publishers and subscribers
//! learn the live brokers from `/v1/cluster` and nothing on the data path waits on it.
//! Heartbeats are timed on the head's [`RunningClock`], so a head that was not running
//! (stopped, paused, starved) holds none of that time against its followers.

use crate::running_clock::RunningClock;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

pub use embarcadero_api::{MemberState, MemberView};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum JoinError {
    #[error("broker id {id} is out of range: this cluster has brokers 0..{brokers}; pick another --broker-id or raise `brokers` on the head")]
    OutOfRange { id: u32, brokers: u32 },
    #[error("broker id {id} is served by the head itself; pick another --broker-id")]
    Local { id: u32 },
    #[error("broker id {id} is in use by {addr} (last heartbeat {ago_ms} ms ago); pick another --broker-id or stop that broker")]
    Taken { id: u32, addr: String, ago_ms: u64 },
    #[error("broker {id} is not a member under incarnation {incarnation} (it was declared dead or replaced); join again")]
    NotMember { id: u32, incarnation: u64 },
    #[error("broker {id} was declared dead and fenced (publishers moved its batches away), so this process stops serving; start a new `embarcadero broker --follower` for the id: it resumes the logs")]
    Fenced { id: u32 },
}

impl JoinError {
    fn taken(id: u32, holder: &Member, now: Duration) -> Self {
        Self::Taken {
            id,
            addr: holder.addr.map(|a| a.to_string()).unwrap_or_default(),
            ago_ms: holder
                .last_heartbeat
                .map_or(0, |t| now.saturating_sub(t).as_millis() as u64),
        }
    }
}

/// Why a failover question about a broker cannot be answered (yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceRefusal {
    /// The broker is not dead: ask again once it is.
    NotDead(MemberState),
    /// The incarnation asked about is not one this head has known: it served before
    /// the head restarted (in a region the head replaced), so the head's region cannot
    /// tell which of its batches were ordered.
    UnknownIncarnation,
}

/// Replaced incarnations remembered per id (restarts; the oldest are forgotten, and a
/// question about a forgotten one is refused as unknown rather than guessed).
const REMEMBERED_INCARNATIONS: usize = 1024;

struct Member {
    addr: Option<SocketAddr>,
    local: bool,
    incarnation: u64,
    /// Earlier incarnations of this id that this head saw replaced.
    replaced: VecDeque<u64>,
    /// On the membership's running clock.
    last_heartbeat: Option<Duration>,
    joins: u64,
    /// Its current death was reported by `newly_dead`.
    death_reported: bool,
}

impl Member {
    /// `incarnation` serves the id from now on; the one before is remembered.
    fn replace_incarnation(&mut self, incarnation: u64) {
        if self.incarnation != 0 {
            if self.replaced.len() == REMEMBERED_INCARNATIONS {
                self.replaced.pop_front();
            }
            self.replaced.push_back(self.incarnation);
        }
        self.incarnation = incarnation;
    }
}

pub struct Membership {
    members: Mutex<Vec<Member>>,
    /// A follower is dead after this long without a heartbeat.
    timeout: Duration,
    /// What heartbeats are timed on: steps of at most half the timeout.
    clock: RunningClock,
}

impl Membership {
    /// `brokers` ids in all; `local` are served by this process: (id, address,
    /// incarnation).
    pub fn new(brokers: u32, local: &[(u32, SocketAddr, u64)], timeout: Duration) -> Self {
        let members = (0..brokers)
            .map(|id| {
                let served = local.iter().find(|(l, _, _)| *l == id);
                Member {
                    addr: served.map(|&(_, a, _)| a),
                    local: served.is_some(),
                    incarnation: served.map_or(0, |&(_, _, i)| i),
                    replaced: VecDeque::new(),
                    last_heartbeat: None,
                    joins: 0,
                    death_reported: false,
                }
            })
            .collect();
        Self {
            members: Mutex::new(members),
            timeout,
            clock: RunningClock::new(timeout / 2),
        }
    }

    /// The running time now (see [`RunningClock`]): what the head's other timers of
    /// membership, such as the fence of a broker declared dead, are measured on.
    pub fn running_now(&self) -> Duration {
        self.clock.now()
    }

    fn alive(&self, m: &Member, now: Duration) -> bool {
        m.local
            || m.last_heartbeat
                .is_some_and(|t| now.saturating_sub(t) <= self.timeout)
    }

    /// Claims `id`. `is_fenced` is asked under the membership lock, so a broker cannot
    /// rejoin between a failover's "is it dead?" and its fence.
    pub fn join(
        &self,
        id: u32,
        addr: SocketAddr,
        incarnation: u64,
        is_fenced: impl FnOnce() -> bool,
    ) -> Result<(), JoinError> {
        let mut members = self.members.lock();
        let brokers = members.len() as u32;
        let now = self.clock.now();
        let alive = match members.get(id as usize) {
            None => return Err(JoinError::OutOfRange { id, brokers }),
            Some(m) if m.local => return Err(JoinError::Local { id }),
            Some(m) => self.alive(m, now) && m.incarnation != incarnation,
        };
        let m = &mut members[id as usize];
        if !alive && is_fenced() {
            return Err(JoinError::Fenced { id });
        }
        if alive {
            return Err(JoinError::taken(id, m, now));
        }
        if m.incarnation != incarnation {
            m.joins += 1;
            m.replace_incarnation(incarnation);
        }
        m.addr = Some(addr);
        m.last_heartbeat = Some(now);
        m.death_reported = false;
        Ok(())
    }

    pub fn heartbeat(&self, id: u32, incarnation: u64) -> Result<(), JoinError> {
        let mut members = self.members.lock();
        let now = self.clock.now();
        match members.get_mut(id as usize) {
            Some(m) if !m.local && m.incarnation == incarnation && m.last_heartbeat.is_some() => {
                // A heartbeat after the timeout revives nothing: the follower was
                // declared dead (clients stopped using it) and must join again.
                if now.saturating_sub(m.last_heartbeat.expect("checked")) > self.timeout {
                    return Err(JoinError::NotMember { id, incarnation });
                }
                m.last_heartbeat = Some(now);
                Ok(())
            }
            _ => Err(JoinError::NotMember { id, incarnation }),
        }
    }

    /// A restarted follower claims `id` before it touches the logs the previous
    /// process left: refused while that process is alive; otherwise `fence` runs under
    /// the membership lock (the logs are fenced before anyone resumes them, so
    /// publishers of the old process get exact answers), and the id is taken by
    /// `incarnation` without an address until it joins.
    pub fn claim(
        &self,
        id: u32,
        incarnation: u64,
        fence: impl FnOnce() -> usize,
    ) -> Result<usize, JoinError> {
        let mut members = self.members.lock();
        let brokers = members.len() as u32;
        let now = self.clock.now();
        let Some(m) = members.get_mut(id as usize) else {
            return Err(JoinError::OutOfRange { id, brokers });
        };
        if m.local {
            return Err(JoinError::Local { id });
        }
        if self.alive(m, now) && m.incarnation != incarnation {
            return Err(JoinError::taken(id, m, now));
        }
        let fenced = fence();
        if m.incarnation != incarnation {
            m.joins += 1;
            m.replace_incarnation(incarnation);
        }
        m.addr = None;
        m.last_heartbeat = Some(now);
        m.death_reported = false;
        Ok(fenced)
    }

    /// Runs `fence` if broker `id` is dead, holding the membership lock so it cannot
    /// rejoin meanwhile; otherwise says why not. A question about an `incarnation`
    /// that a restarted process has replaced needs no fence (its claim set one): `fence`
    /// does not run and the answer is `Ok(None)`. One about an incarnation this head
    /// never knew is refused: it served a region this head replaced.
    pub fn fence_if_dead<T>(
        &self,
        id: u32,
        incarnation: Option<u64>,
        fence: impl FnOnce() -> T,
    ) -> Result<Option<T>, FenceRefusal> {
        let members = self.members.lock();
        let Some(m) = members.get(id as usize) else {
            return Err(FenceRefusal::NotDead(MemberState::Absent));
        };
        let now = self.clock.now();
        if let Some(i) = incarnation.filter(|&i| i != m.incarnation) {
            return if m.replaced.contains(&i) {
                Ok(None)
            } else {
                Err(FenceRefusal::UnknownIncarnation)
            };
        }
        if m.local || m.last_heartbeat.is_none() || self.alive(m, now) {
            let state = if m.local {
                MemberState::Local
            } else if m.last_heartbeat.is_none() {
                MemberState::Absent
            } else if m.addr.is_none() {
                MemberState::Joining
            } else {
                MemberState::Alive
            };
            return Err(FenceRefusal::NotDead(state));
        }
        Ok(Some(fence()))
    }

    /// Whether broker `id` is served now by the follower process `incarnation` (one
    /// declared dead that rejoined is alive again; a restart is another incarnation).
    pub fn is_alive_as(&self, id: u32, incarnation: u64) -> bool {
        let members = self.members.lock();
        members
            .get(id as usize)
            .is_some_and(|m| m.incarnation == incarnation && self.alive(m, self.clock.now()))
    }

    /// Followers that have died since the last call, each death reported once with the
    /// incarnation that died: what they held for their subscribers can be released.
    pub fn newly_dead(&self) -> Vec<(u32, u64)> {
        let mut members = self.members.lock();
        let now = self.clock.now();
        let mut dead = Vec::new();
        for (id, m) in members.iter_mut().enumerate() {
            let died = !m.local && m.last_heartbeat.is_some() && !self.alive(m, now);
            if died && !m.death_reported {
                m.death_reported = true;
                dead.push((id as u32, m.incarnation));
            }
        }
        dead
    }

    pub fn view(&self) -> Vec<MemberView> {
        let members = self.members.lock();
        let now = self.clock.now();
        members
            .iter()
            .enumerate()
            .map(|(id, m)| MemberView {
                id: id as u32,
                addr: m.addr.map(|a| a.to_string()),
                state: if m.local {
                    MemberState::Local
                } else if m.last_heartbeat.is_none() {
                    MemberState::Absent
                } else if self.alive(m, now) && m.addr.is_none() {
                    MemberState::Joining
                } else if self.alive(m, now) {
                    MemberState::Alive
                } else {
                    MemberState::Dead
                },
                last_heartbeat_ms: m
                    .last_heartbeat
                    .map(|t| now.saturating_sub(t).as_millis() as u64),
                incarnation: m.incarnation,
                joins: m.joins,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Lets more than `d` of running time pass: the head looks at its clock all along,
    /// as a running head does.
    fn running_past(m: &Membership, d: Duration) {
        let start = m.clock.now();
        while m.clock.now() - start <= d {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn a_head_that_did_not_run_for_longer_than_the_timeout_declares_no_one_dead() {
        let timeout = Duration::from_millis(600);
        let m = Membership::new(2, &[], timeout);
        m.join(1, addr(2), 7, || false).unwrap();
        // Stopped for five timeouts: the heartbeat waiting in its socket is taken.
        m.clock.stall(timeout * 5);
        assert_eq!(m.heartbeat(1, 7), Ok(()));
        m.clock.stall(timeout * 5);
        assert!(
            m.newly_dead().is_empty(),
            "no death found by the watcher either"
        );
        assert_eq!(m.view()[1].state, MemberState::Alive);
        // A follower that really went silent is dead once the head has run a timeout.
        running_past(&m, timeout);
        assert_eq!(m.newly_dead(), [(1, 7)]);
    }

    #[test]
    fn ids_are_claimed_once_and_freed_by_death() {
        let m = Membership::new(3, &[(0, addr(1), 5)], Duration::from_millis(50));
        assert_eq!(
            m.join(0, addr(2), 7, || false),
            Err(JoinError::Local { id: 0 })
        );
        assert_eq!(
            m.fence_if_dead(0, Some(5), || ()),
            Err(FenceRefusal::NotDead(MemberState::Local))
        );
        assert_eq!(
            m.fence_if_dead(0, Some(4), || ()),
            Err(FenceRefusal::UnknownIncarnation),
            "the head's own brokers before it restarted"
        );
        assert_eq!(
            m.join(3, addr(2), 7, || false),
            Err(JoinError::OutOfRange { id: 3, brokers: 3 })
        );
        m.join(1, addr(2), 7, || false).unwrap();
        m.join(1, addr(2), 7, || false).unwrap(); // a retried join of the same incarnation
        assert!(matches!(
            m.join(1, addr(3), 8, || false),
            Err(JoinError::Taken { id: 1, .. })
        ));
        let states: Vec<_> = m.view().iter().map(|v| v.state).collect();
        assert_eq!(
            states,
            [MemberState::Local, MemberState::Alive, MemberState::Absent]
        );
        m.heartbeat(1, 7).unwrap();
        assert!(m.heartbeat(1, 8).is_err(), "another incarnation");
        assert!(m.heartbeat(2, 0).is_err(), "never joined");
    }

    #[test]
    fn a_silent_follower_is_dead_and_must_rejoin() {
        let timeout = Duration::from_millis(20);
        let m = Membership::new(2, &[], timeout);
        m.join(1, addr(2), 7, || false).unwrap();
        running_past(&m, timeout);
        assert_eq!(m.view()[1].state, MemberState::Dead);
        assert_eq!(m.newly_dead(), [(1, 7)]);
        assert!(m.newly_dead().is_empty(), "each death is reported once");
        assert_eq!(
            m.heartbeat(1, 7),
            Err(JoinError::NotMember {
                id: 1,
                incarnation: 7
            })
        );
        assert_eq!(m.fence_if_dead(1, None, || "fenced"), Ok(Some("fenced")));
        assert_eq!(
            m.join(1, addr(3), 9, || true),
            Err(JoinError::Fenced { id: 1 }),
            "a fenced broker cannot come back"
        );
        m.join(1, addr(3), 9, || false).unwrap();
        assert_eq!(
            m.fence_if_dead(1, None, || ()),
            Err(FenceRefusal::NotDead(MemberState::Alive))
        );
        let v = &m.view()[1];
        assert_eq!(
            (v.state, v.joins, v.addr.as_deref()),
            (MemberState::Alive, 2, Some("127.0.0.1:3"))
        );
    }

    #[test]
    fn a_restarted_follower_claims_its_id_fences_the_old_logs_then_joins() {
        let timeout = Duration::from_millis(20);
        let m = Membership::new(2, &[], timeout);
        m.join(1, addr(2), 7, || false).unwrap();
        assert!(
            matches!(m.claim(1, 8, || 1), Err(JoinError::Taken { id: 1, .. })),
            "not while the old process is alive"
        );
        running_past(&m, timeout);
        let mut fenced_under_claim = false;
        assert_eq!(
            m.claim(1, 8, || {
                fenced_under_claim = true;
                3
            }),
            Ok(3)
        );
        assert!(fenced_under_claim);
        let v = &m.view()[1];
        assert_eq!((v.state, v.addr.as_deref()), (MemberState::Joining, None));
        assert_eq!(
            m.fence_if_dead(1, Some(7), || unreachable!(
                "the claim fenced incarnation 7"
            )),
            Ok(None),
            "questions about the replaced incarnation are answered without a new fence"
        );
        assert_eq!(
            m.fence_if_dead(1, Some(8), || ()),
            Err(FenceRefusal::NotDead(MemberState::Joining)),
            "the new incarnation is not dead"
        );
        assert_eq!(
            m.fence_if_dead(1, Some(6), || ()),
            Err(FenceRefusal::UnknownIncarnation),
            "an incarnation this head never saw served before it restarted"
        );
        m.join(1, addr(3), 8, || false).unwrap();
        assert_eq!(m.view()[1].state, MemberState::Alive);
        assert_eq!(
            m.claim(0, 9, || 0),
            Ok(0),
            "an absent id is claimed at once"
        );
    }
}
