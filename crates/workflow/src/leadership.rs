//! Which orchestrator decides: a lease kept in the event log itself and fenced in log
//! order. Owns the fold's [`Leader`] (the current term and its holder), the rule that
//! refuses a decision written under any other term ([`Leader::admits`]), and the
//! [`Candidate`] every orchestrator runs outside the fold (when to renew its lease,
//! when to bid for a lapsed one). Touches nothing but its arguments: the orchestrator
//! publishes what [`Candidate::due`] returns.
//!
//! The idea is the sequencer's region lease (`crates/sequencer/src/lease.rs`): one
//! point of arbitration at which two contenders for the same lapsed lease cannot both
//! win, and a fencing number (there the fencing epoch, here the term) that rises by one
//! with every acquisition, so a later holder always has the higher one. There the
//! arbitration point is a compare-and-swap on a word of the shared region; here it is
//! the log's order: a bid for term N+1 is accepted only while N is current, so the
//! first bid in log order wins and every reader refuses the others alike. The region
//! word cannot serve: an orchestrator is a client of the cluster, possibly on another
//! host, and never maps the region (nor does it need etcd, which the sequencer's
//! cross-host election uses). The code is therefore not shared, only the design; see
//! docs/WORKFLOW.md "Snapshots, standby and fencing".
//!
//! Safety does not depend on clocks: at every position of the log exactly one term is
//! current, and only decisions stamped with it apply, so a paused or partitioned
//! orchestrator that wakes up after a takeover has every decision refused. Clocks only
//! decide liveness: when a standby considers the lease lapsed and bids.
//!
//! **Quiet renewals.** A renewal every third of the lease is an event a second at the
//! default lease, for ever, into a log that keeps everything: an engine with nothing to do
//! wrote 86,400 events a day. While no task is open the holder's renewals say so (a quiet
//! lease of `QUIET_LEASES` leases; the fold keeps it only if no task is open at the
//! renewal's position), and once it read one back it renews every third of that. The log
//! decides when that long lease is cut short: any other event after the renewal (a task
//! created, a template registered) restarts the normal lease for the standbys from the
//! moment they read it, and the holder, reading the same event, is back to renewing every
//! third of a normal lease. So a holder that died quiet is replaced a normal lease after
//! the first thing there is to decide, as before, and a quiet engine writes a tenth of
//! the renewals (docs/WORKFLOW.md "Quiet renewals" has every rule).

use crate::event::{Envelope, Event};
use crate::state::Rejected;
use serde::{Deserialize, Serialize};

/// The lease as the fold sees it. Term 0 (no holder) until the first bid; a log written
/// before leadership existed stays at term 0, and its decisions (which carry no term)
/// still apply.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leader {
    pub term: u64,
    pub holder: String,
    /// The holder's wall clock at its last accepted bid or renewal, as stamped in the
    /// event (so every reader has the same value); dates the lease after a replay.
    pub renewed_ts_ms: u64,
    /// That renewal's quiet lease (0: the normal one); see "Quiet renewals".
    #[serde(default)]
    pub quiet_lease_ms: u64,
}

impl Leader {
    /// A bid (term one above the current, from anyone: the first in log order wins) or
    /// a renewal (the current term, from its holder). Anything else is refused.
    pub(crate) fn bid(
        &mut self,
        term: u64,
        holder: &str,
        ts_ms: u64,
        quiet_lease_ms: u64,
    ) -> Result<(), Rejected> {
        let renewal = term > 0 && term == self.term && holder == self.holder;
        let takeover = Some(term) == self.term.checked_add(1);
        if !(renewal || takeover) || holder.is_empty() {
            return Err(Rejected::LeaseRefused {
                term,
                holder: holder.to_string(),
                current: self.term,
                current_holder: self.holder.clone(),
            });
        }
        if takeover {
            self.holder = holder.to_string();
        }
        self.term = term;
        self.renewed_ts_ms = ts_ms;
        self.quiet_lease_ms = quiet_lease_ms;
        debug_assert!(self.term > 0 && !self.holder.is_empty());
        Ok(())
    }

    /// The holder gives its term up (it is stopping): the term stays current with no
    /// holder, so a bid for the next one is the only lease event accepted after it (by
    /// anyone, at once). The holder's decisions were all published before this, its
    /// last event, in its session's order; none of the released term follows it.
    pub(crate) fn release(&mut self, term: u64, holder: &str, ts_ms: u64) -> Result<(), Rejected> {
        if term == 0 || term != self.term || holder.is_empty() || holder != self.holder {
            return Err(Rejected::LeaseRefused {
                term,
                holder: holder.to_string(),
                current: self.term,
                current_holder: self.holder.clone(),
            });
        }
        self.holder.clear();
        self.renewed_ts_ms = ts_ms;
        self.quiet_lease_ms = 0;
        Ok(())
    }

    /// Refuses a decision not written under the current term.
    pub(crate) fn admits(&self, env: &Envelope) -> Result<(), Rejected> {
        let term = env.term.unwrap_or(0);
        if is_decision(&env.event) && term != self.term {
            return Err(Rejected::Fenced {
                event: env.event.kind(),
                term,
                current: self.term,
            });
        }
        Ok(())
    }
}

/// The events only the active orchestrator writes (what [`crate::decide`] returns).
/// Commands (the API's) and workers' events are not fenced: they do not depend on who
/// decides, and any orchestrator's API may relay them.
pub fn is_decision(event: &Event) -> bool {
    matches!(
        event,
        Event::StepEnqueued(_)
            | Event::StepExpired { .. }
            | Event::StepCompleted(_)
            | Event::RetryScheduled { .. }
            | Event::StepErrored { .. }
            | Event::StepStale { .. }
    )
}

/// Renewals per lease (as the sequencer's renewer: every third of the lease).
const RENEWALS_PER_LEASE: u64 = 3;
/// A quiet renewal's lease, in normal leases (30 s, a renewal every 10 s, at the default).
pub const QUIET_LEASES: u64 = 10;

/// One orchestrator's side of the lease, by its own clock (milliseconds).
#[derive(Debug)]
pub struct Candidate {
    /// This orchestrator's name in the lease (unique per process start).
    pub id: String,
    lease_ms: u64,
    /// When the current term was last bid for or renewed, as far as this one read.
    renewed_at: u64,
    /// That renewal's quiet lease (0: the normal one).
    quiet_lease_ms: u64,
    /// When this one first read another event after that renewal: a quiet lease then
    /// ends a normal lease later at the latest.
    stirred_at: Option<u64>,
    /// When this one last published a renewal or a bid.
    sent_at: u64,
    /// The holder read its own quiet renewal back, and nothing else since: its next
    /// renewal is due a third of the quiet lease after the last it sent. Set only by
    /// reading, so a quiet renewal lost on its way leaves the normal cadence (which the
    /// standbys are still counting); cleared by any other event.
    quiet_read: bool,
    /// The term this one bid for and has not yet seen decided.
    bid: Option<u64>,
    /// Its lease of a worker's claim, told to workers in every lease event (0: not told).
    worker_lease_ms: u64,
}

impl Candidate {
    pub fn new(id: String, lease_ms: u64) -> Self {
        assert!(
            lease_ms >= RENEWALS_PER_LEASE,
            "an orchestrator lease of {lease_ms} ms"
        );
        Self {
            id,
            lease_ms,
            renewed_at: 0,
            quiet_lease_ms: 0,
            stirred_at: None,
            sent_at: 0,
            quiet_read: false,
            bid: None,
            worker_lease_ms: 0,
        }
    }

    /// A fresh candidate with this one's name and leases (the log's terms began again).
    pub fn starting_over(&self) -> Self {
        Self::new(self.id.clone(), self.lease_ms).telling_workers(self.worker_lease_ms)
    }

    /// The same, telling workers its lease of their claims (`--lease-ms`) in its lease
    /// events, so that a worker configured with a longer one still heartbeats in time.
    pub fn telling_workers(mut self, worker_lease_ms: u64) -> Self {
        self.worker_lease_ms = worker_lease_ms;
        self
    }

    /// After the replay: the lease is dated by its holder's last stamp (never later than
    /// now), so a restart after the holder died waits only what is left of its lease.
    /// If anything came after a quiet renewal (read during the replay, or a task open at
    /// its end, which was opened after it: none was open at it), the quiet lease ends a
    /// normal lease from now at the latest, as if this one had just read that event. Not
    /// from the stamp: a live holder renews only a third of a normal lease after reading
    /// the event, so a restart in between would find a normal lease from the quiet
    /// renewal long lapsed and depose it.
    pub fn replayed(&mut self, leader: &Leader, now_ms: u64, tasks_open: bool) {
        let stirred = self.stirred_at.is_some() || tasks_open;
        self.renewed_at = leader.renewed_ts_ms.min(now_ms);
        self.quiet_lease_ms = self.quiet_lease_of(leader);
        self.stirred_at = stirred.then_some(now_ms);
        self.quiet_read = false;
    }

    /// A lease event was read and accepted (by anyone): the lease runs from now.
    pub fn renewed(&mut self, leader: &Leader, now_ms: u64) {
        self.renewed_at = now_ms;
        self.quiet_lease_ms = self.quiet_lease_of(leader);
        self.stirred_at = None;
        self.quiet_read = leader.holder == self.id && self.quiet_lease_ms > self.lease_ms;
        if self.bid.is_some_and(|t| t <= leader.term) {
            self.bid = None;
        }
    }

    /// An event other than a lease event (or one that does not decode) was read: a
    /// quiet lease ends a normal lease from now at the latest, and a quiet holder is
    /// back to renewing every third of a normal lease.
    pub fn stirred(&mut self, now_ms: u64) {
        self.stirred_at.get_or_insert(now_ms);
        self.quiet_read = false;
    }

    /// The leader's quiet lease as this one counts it: never longer than its own quiet
    /// lease, whatever a lease event in the log says.
    fn quiet_lease_of(&self, leader: &Leader) -> u64 {
        leader.quiet_lease_ms.min(self.quiet_lease())
    }

    /// The current lease, as this one read it, is a quiet one not cut short yet.
    pub fn is_quiet(&self) -> bool {
        self.quiet_lease_ms > self.lease_ms && self.stirred_at.is_none()
    }

    /// When the current lease lapses, by this one's clock.
    fn lapses_at(&self) -> u64 {
        let normal = self.renewed_at.saturating_add(self.lease_ms);
        if self.quiet_lease_ms <= self.lease_ms {
            return normal;
        }
        let quiet = self.renewed_at.saturating_add(self.quiet_lease_ms);
        let lapses = match self.stirred_at {
            Some(at) => quiet.min(at.max(self.renewed_at).saturating_add(self.lease_ms)),
            None => quiet,
        };
        assert!(
            lapses >= normal,
            "a quiet lease is never shorter than a normal one"
        );
        lapses
    }

    pub fn is_active(&self, leader: &Leader) -> bool {
        leader.term > 0 && leader.holder == self.id
    }

    /// What to publish now: the holder's renewal every third of a lease (of the quiet
    /// lease once it read its own quiet renewal back and nothing since), quiet when
    /// `quiet` (no task open; the fold checks that again at the renewal's position); a
    /// bid for the next term once the current one lapsed (or none was ever taken),
    /// unless a bid of this one is still on its way through the log (for up to a lease).
    pub fn due(&mut self, leader: &Leader, now_ms: u64, quiet: bool) -> Option<Event> {
        let since_sent = now_ms.saturating_sub(self.sent_at);
        if self.is_active(leader) {
            let lease = if self.quiet_read {
                self.quiet_lease()
            } else {
                self.lease_ms
            };
            if since_sent < lease / RENEWALS_PER_LEASE {
                return None;
            }
            self.sent_at = now_ms;
            let quiet_lease_ms = if quiet { self.quiet_lease() } else { 0 };
            return Some(self.lease_event(leader.term, quiet_lease_ms));
        }
        // A released term (no holder) is lapsed at once: its holder stopped.
        let lapsed = leader.term == 0 || leader.holder.is_empty() || now_ms >= self.lapses_at();
        let pending = self.bid == Some(leader.term + 1) && since_sent < self.lease_ms;
        if !lapsed || pending {
            return None;
        }
        self.bid = Some(leader.term + 1);
        self.sent_at = now_ms;
        Some(self.lease_event(leader.term + 1, 0))
    }

    fn quiet_lease(&self) -> u64 {
        self.lease_ms.saturating_mul(QUIET_LEASES)
    }

    /// What the holder publishes when it stops ([`Leader::release`]); `None` when this
    /// one does not hold the lease.
    pub fn release(&self, leader: &Leader) -> Option<Event> {
        self.is_active(leader).then(|| Event::OrchestratorRelease {
            term: leader.term,
            holder: self.id.clone(),
        })
    }

    /// After the log was out of reach (a server restart): nobody could renew meanwhile,
    /// so the lease runs from now, and a holder that comes back with the log keeps it
    /// instead of being deposed by a standby that came back a moment earlier. A quiet
    /// lease stays quiet (the outage may have been this one's alone, the holder still on
    /// its quiet cadence), and an event read before the outage counts from now; a quiet
    /// holder renews within a normal third.
    pub fn resumed(&mut self, now_ms: u64) {
        self.renewed_at = now_ms;
        if self.stirred_at.is_some() {
            self.stirred_at = Some(now_ms);
        }
        self.quiet_read = false;
    }

    fn lease_event(&self, term: u64, quiet_lease_ms: u64) -> Event {
        Event::OrchestratorLease {
            term,
            holder: self.id.clone(),
            worker_lease_ms: self.worker_lease_ms,
            quiet_lease_ms,
        }
    }
}

#[cfg(test)]
#[path = "leadership_model.rs"]
mod model;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::StepRef;
    use crate::state::State;

    fn env(term: Option<u64>, event: Event) -> Envelope {
        Envelope {
            ts_ms: 1,
            term,
            event,
        }
    }

    fn lease(term: u64, holder: &str) -> Envelope {
        env(
            None,
            Event::OrchestratorLease {
                term,
                holder: holder.into(),
                worker_lease_ms: 0,
                quiet_lease_ms: 0,
            },
        )
    }

    fn decision() -> Event {
        Event::StepCompleted(StepRef {
            task: "t".into(),
            step: "s".into(),
            attempt: 1,
        })
    }

    #[test]
    fn the_first_bid_for_the_next_term_wins_and_only_its_holder_renews() {
        let mut s = State::default();
        assert_eq!(s.apply(0, &lease(1, "a")), Ok(()));
        let second = s.apply(1, &lease(1, "b"));
        assert!(
            matches!(second, Err(Rejected::LeaseRefused { .. })),
            "{second:?}"
        );
        assert_eq!(s.apply(2, &lease(1, "a")), Ok(()), "the holder renews");
        assert!(s.apply(3, &lease(3, "b")).is_err(), "no skipping a term");
        assert_eq!(s.apply(4, &lease(2, "b")), Ok(()), "a takeover");
        assert!(
            s.apply(5, &lease(1, "a")).is_err(),
            "the deposed cannot renew"
        );
        assert!(
            s.apply(6, &lease(2, "")).is_err(),
            "no holder without a name"
        );
        assert_eq!((s.leader.term, s.leader.holder.as_str()), (2, "b"));
    }

    #[test]
    fn a_deposed_orchestrators_decisions_are_refused_in_log_order() {
        let mut s = State::default();
        // Before any term (old logs): decisions without a term are decisions of term 0.
        let old = s.apply(0, &env(None, decision()));
        assert!(matches!(old, Err(Rejected::UnknownTask(_))), "{old:?}");
        s.apply(1, &lease(1, "a")).unwrap();
        let untermed = s.apply(2, &env(None, decision()));
        assert!(matches!(
            untermed,
            Err(Rejected::Fenced {
                term: 0,
                current: 1,
                ..
            })
        ));
        // Term 1's decision passes the fence (and then fails on the unknown task).
        let current = s.apply(3, &env(Some(1), decision()));
        assert!(
            matches!(current, Err(Rejected::UnknownTask(_))),
            "{current:?}"
        );
        s.apply(4, &lease(2, "b")).unwrap();
        let deposed = s.apply(5, &env(Some(1), decision()));
        assert_eq!(
            deposed,
            Err(Rejected::Fenced {
                event: "step_completed",
                term: 1,
                current: 2
            })
        );
        let future = s.apply(6, &env(Some(3), decision()));
        assert!(matches!(future, Err(Rejected::Fenced { term: 3, .. })));
        // Workers' events and commands are not fenced.
        let claim = Event::StepClaimed {
            at: StepRef {
                task: "t".into(),
                step: "s".into(),
                attempt: 1,
            },
            worker: "w".into(),
        };
        assert!(matches!(
            s.apply(7, &env(None, claim)),
            Err(Rejected::UnknownTask(_))
        ));
    }

    #[test]
    fn a_fenced_decision_is_recorded_in_its_steps_audit_trail_and_changes_nothing_else() {
        let template = crate::fixtures::one_step_template();
        let mut s = State::default();
        s.apply(0, &env(None, Event::TemplateRegistered { template }))
            .unwrap();
        let created = crate::fixtures::task_created("t", None);
        s.apply(1, &env(None, created)).unwrap();
        s.apply(2, &lease(1, "a")).unwrap();
        s.apply(3, &lease(2, "b")).unwrap();
        let before = s.clone();
        // Term 1's enqueue, written after term 2 began: refused, and the step says so.
        let enqueue = Event::StepEnqueued(StepRef {
            task: "t".into(),
            step: "s".into(),
            attempt: 1,
        });
        let fenced = s.apply(4, &env(Some(1), enqueue));
        assert!(matches!(fenced, Err(Rejected::Fenced { .. })), "{fenced:?}");
        let step = &s.tasks["t"].steps[0];
        assert_eq!(step.refused.len(), 1, "{:?}", step.refused);
        let note = &step.refused[0];
        assert!(
            note.starts_with("position 4: step_enqueued of attempt 1:")
                && note.contains("term 1")
                && note.contains("term 2 is current"),
            "{note}"
        );
        // Nothing else moved: the step is still pending at attempt 0.
        let mut unchanged = s.clone();
        crate::state::State::task_mut(&mut unchanged, "t")
            .unwrap()
            .steps[0]
            .refused
            .clear();
        assert_eq!(unchanged.tasks, before.tasks);
        assert_eq!(s.rejected, before.rejected + 1);
        // A fenced decision about a task or step that does not exist notes nothing.
        let ghost = Event::StepEnqueued(StepRef {
            task: "t".into(),
            step: "nope".into(),
            attempt: 1,
        });
        assert!(s.apply(5, &env(Some(1), ghost)).is_err());
        assert_eq!(s.tasks["t"].steps[0].refused.len(), 1);
    }

    fn release(term: u64, holder: &str) -> Envelope {
        env(
            None,
            Event::OrchestratorRelease {
                term,
                holder: holder.into(),
            },
        )
    }

    #[test]
    fn only_the_holder_releases_its_term_and_anyone_may_bid_for_the_next_at_once() {
        let mut s = State::default();
        assert!(s.apply(0, &release(0, "a")).is_err(), "nothing to release");
        s.apply(1, &lease(1, "a")).unwrap();
        assert!(s.apply(2, &release(1, "b")).is_err(), "not the holder");
        assert!(
            s.apply(3, &release(2, "a")).is_err(),
            "not the current term"
        );
        assert_eq!(s.apply(4, &release(1, "a")), Ok(()));
        assert_eq!((s.leader.term, s.leader.holder.as_str()), (1, ""));
        assert!(
            s.apply(5, &lease(1, "a")).is_err(),
            "a released term is over"
        );
        assert!(s.apply(6, &release(1, "a")).is_err(), "released once");
        assert_eq!(s.apply(7, &lease(2, "b")), Ok(()), "the next term, at once");
        assert_eq!((s.leader.term, s.leader.holder.as_str()), (2, "b"));
    }

    #[test]
    fn a_standby_bids_as_soon_as_it_reads_a_release_and_a_resumed_one_waits_a_lease() {
        let mut leader = Leader::default();
        let (mut a, mut b) = (
            Candidate::new("a".into(), 300),
            Candidate::new("b".into(), 300),
        );
        leader.bid(1, "a", 1000, 0).unwrap();
        a.renewed(&leader, 1000);
        b.renewed(&leader, 1000);
        assert!(b.due(&leader, 1010, false).is_none(), "the lease runs");
        assert!(b.release(&leader).is_none(), "only the holder releases");
        let Some(Event::OrchestratorRelease { term: 1, holder }) = a.release(&leader) else {
            panic!("the holder releases its term");
        };
        leader.release(1, &holder, 1011).unwrap();
        assert!(!a.is_active(&leader));
        assert!(matches!(
            b.due(&leader, 1012, false),
            Some(Event::OrchestratorLease { term: 2, .. })
        ));
        // Back from an outage: the lease runs from the log's return, not from the last
        // renewal read before it.
        leader.bid(2, "b", 1013, 0).unwrap();
        a.renewed(&leader, 1013);
        a.resumed(5000);
        assert!(a.due(&leader, 5299, false).is_none());
        assert!(a.due(&leader, 5300, false).is_some());
    }

    #[test]
    fn a_candidate_bids_once_the_lease_lapses_and_the_holder_renews_every_third() {
        let mut leader = Leader::default();
        let mut a = Candidate::new("a".into(), 300);
        let mut b = Candidate::new("b".into(), 300);
        // Nobody ever held it: both bid at once; the log picks one.
        assert!(matches!(
            a.due(&leader, 1000, false),
            Some(Event::OrchestratorLease { term: 1, .. })
        ));
        assert!(b.due(&leader, 1000, false).is_some());
        assert!(
            a.due(&leader, 1001, false).is_none(),
            "a bid on its way is not repeated"
        );
        leader.bid(1, "a", 1000, 0).unwrap();
        a.renewed(&leader, 1002);
        b.renewed(&leader, 1002);
        assert!(a.is_active(&leader) && !b.is_active(&leader));
        assert!(
            a.due(&leader, 1050, false).is_none(),
            "renewed less than a third ago"
        );
        assert!(matches!(
            a.due(&leader, 1100, false),
            Some(Event::OrchestratorLease { term: 1, .. })
        ));
        assert!(
            b.due(&leader, 1301, false).is_none(),
            "a lease not yet lapsed"
        );
        assert!(matches!(
            b.due(&leader, 1302, false),
            Some(Event::OrchestratorLease { term: 2, .. })
        ));
        // A restart dates the lease by the holder's stamp (1000 here)...
        let mut c = Candidate::new("c".into(), 300);
        c.replayed(&leader, 1100, false);
        assert!(c.due(&leader, 1299, false).is_none());
        assert!(c.due(&leader, 1300, false).is_some());
        // ... never later than its own now (a clock behind the holder's).
        let mut d = Candidate::new("d".into(), 300);
        d.replayed(&leader, 900, false);
        assert!(d.due(&leader, 1199, false).is_none());
        assert!(d.due(&leader, 1200, false).is_some());
    }

    /// The quiet lease of a renewal (`Leader::bid` keeps it), as a standby reads it.
    fn quiet_renewal(leader: &mut Leader, ts: u64, quiet_lease_ms: u64) {
        leader.bid(1, "a", ts, quiet_lease_ms).unwrap();
    }

    #[test]
    fn a_holder_with_no_task_open_renews_a_tenth_as_often_once_it_read_that_back() {
        let mut leader = Leader::default();
        let mut a = Candidate::new("a".into(), 300);
        leader.bid(1, "a", 1000, 0).unwrap();
        a.renewed(&leader, 1000);
        a.sent_at = 1000;
        // Busy: every third of the lease, a normal renewal.
        let Some(Event::OrchestratorLease { quiet_lease_ms, .. }) = a.due(&leader, 1100, false)
        else {
            panic!("a renewal every third of the lease");
        };
        assert_eq!(quiet_lease_ms, 0);
        // Quiet: the next says its lease is ten leases...
        let Some(Event::OrchestratorLease { quiet_lease_ms, .. }) = a.due(&leader, 1200, true)
        else {
            panic!("a renewal every third of the lease");
        };
        assert_eq!(quiet_lease_ms, 300 * QUIET_LEASES);
        // ... but until it is read back the standbys count the normal lease: the normal
        // cadence goes on (a quiet renewal lost on its way costs nothing).
        assert!(a.due(&leader, 1300, true).is_some());
        quiet_renewal(&mut leader, 1300, 3000);
        a.renewed(&leader, 1310);
        assert!(a.is_quiet());
        // Read back: the next waits a third of the quiet lease after the last sent.
        assert!(a.due(&leader, 1300 + 999, true).is_none());
        assert!(a.due(&leader, 1300 + 1000, true).is_some());
        quiet_renewal(&mut leader, 2300, 3000);
        a.renewed(&leader, 2300);
        // Another event read: back to a third of the normal lease after the last one.
        a.stirred(2350);
        assert!(a.due(&leader, 2399, false).is_none());
        let Some(Event::OrchestratorLease { quiet_lease_ms, .. }) = a.due(&leader, 2400, false)
        else {
            panic!("a normal third after the last renewal");
        };
        assert_eq!(quiet_lease_ms, 0);
    }

    #[test]
    fn a_standby_waits_out_a_quiet_lease_unless_another_event_follows_the_renewal() {
        let mut leader = Leader::default();
        quiet_renewal(&mut leader, 1000, 3000);
        let mut b = Candidate::new("b".into(), 300);
        b.renewed(&leader, 1000);
        assert!(b.is_quiet());
        assert!(b.due(&leader, 1300, false).is_none(), "a quiet lease runs");
        assert!(b.due(&leader, 3999, false).is_none());
        assert!(b.due(&leader, 4000, false).is_some(), "lapsed after it");
        // Something else in the log at 1500: the normal lease from then.
        let mut c = Candidate::new("c".into(), 300);
        c.renewed(&leader, 1000);
        c.stirred(1500);
        c.stirred(1700); // the first such event counts
        assert!(!c.is_quiet());
        assert!(c.due(&leader, 1799, false).is_none());
        assert!(c.due(&leader, 1800, false).is_some());
        // A quiet renewal read after such an event starts a quiet lease again (the fold
        // made it quiet only because no task was open at its position).
        let mut d = Candidate::new("d".into(), 300);
        d.renewed(&leader, 1000);
        d.stirred(1500);
        quiet_renewal(&mut leader, 1600, 3000);
        d.renewed(&leader, 1600);
        assert!(d.is_quiet());
        assert!(d.due(&leader, 4599, false).is_none());
        assert!(d.due(&leader, 4600, false).is_some());
        // A quiet lease shorter than the standby's own lease is not a shorter lease, and
        // one longer than the standby's own quiet lease is cut to it.
        let mut e = Candidate::new("e".into(), 5000);
        quiet_renewal(&mut leader, 1000, 3000);
        e.renewed(&leader, 1000);
        assert!(e.due(&leader, 5999, false).is_none());
        let mut f = Candidate::new("f".into(), 300);
        quiet_renewal(&mut leader, 1000, u64::MAX);
        f.renewed(&leader, 1000);
        assert!(f.due(&leader, 3999, false).is_none());
        assert!(f.due(&leader, 4000, false).is_some());
    }

    #[test]
    fn a_renewal_is_quiet_in_the_fold_only_if_no_task_is_open_at_its_position() {
        let quiet = |holder: &str| Envelope {
            ts_ms: 1,
            term: None,
            event: Event::OrchestratorLease {
                term: 1,
                holder: holder.into(),
                worker_lease_ms: 0,
                quiet_lease_ms: 3000,
            },
        };
        let template = crate::fixtures::one_step_template();
        let mut s = State::default();
        s.apply(0, &quiet("a")).unwrap();
        assert_eq!(s.leader.quiet_lease_ms, 3000, "nothing open: quiet");
        s.apply(1, &env(None, Event::TemplateRegistered { template }))
            .unwrap();
        let created = crate::fixtures::task_created("t", None);
        // The holder wrote its renewal before it read the task: the log has the task
        // first, so the renewal renews a normal lease.
        s.apply(2, &env(None, created)).unwrap();
        s.apply(3, &quiet("a")).unwrap();
        assert_eq!(s.leader.quiet_lease_ms, 0, "a task open: the normal lease");
        let mut standby = Candidate::new("b".into(), 300);
        standby.renewed(&s.leader, 1000);
        assert!(!standby.is_quiet());
        assert!(standby.due(&s.leader, 1300, false).is_some());
    }

    #[test]
    fn a_restart_keeps_a_quiet_lease_only_while_no_task_is_open() {
        let mut leader = Leader::default();
        quiet_renewal(&mut leader, 1000, 3000);
        let mut quiet = Candidate::new("q".into(), 300);
        quiet.replayed(&leader, 1100, false);
        assert!(quiet.due(&leader, 3999, false).is_none());
        assert!(quiet.due(&leader, 4000, false).is_some());
        // A task open at the replay's end: a normal lease from the replay's end.
        let mut busy = Candidate::new("b".into(), 300);
        busy.replayed(&leader, 1100, true);
        assert!(busy.due(&leader, 1399, false).is_none());
        assert!(busy.due(&leader, 1400, false).is_some());
        // Not from the quiet renewal's stamp: the holder renews a third of a normal lease
        // after it read the task, and a replay may end before that renewal is in the log
        // (the lease model found this one deposing a live holder).
        let mut late = Candidate::new("l".into(), 300);
        late.replayed(&leader, 1900, true);
        assert!(late.due(&leader, 2199, false).is_none());
        assert!(late.due(&leader, 2200, false).is_some());
        // Anything read after the quiet renewal counts as well, with no task open.
        let mut stirred = Candidate::new("s".into(), 300);
        stirred.renewed(&leader, 1050);
        stirred.stirred(1060);
        stirred.replayed(&leader, 1900, false);
        assert!(stirred.due(&leader, 2199, false).is_none());
        assert!(stirred.due(&leader, 2200, false).is_some());
        // A release forgets the quiet lease (a bid for the next term is due at once).
        leader.release(1, "a", 1200).unwrap();
        assert_eq!(leader.quiet_lease_ms, 0);
    }

    #[test]
    fn an_outage_keeps_a_quiet_lease_and_a_quiet_holder_renews_within_a_normal_third() {
        let mut leader = Leader::default();
        let mut a = Candidate::new("a".into(), 300);
        leader.bid(1, "a", 1000, 0).unwrap();
        a.renewed(&leader, 1000);
        assert!(a.due(&leader, 1100, true).is_some(), "a quiet renewal");
        quiet_renewal(&mut leader, 1100, 3000);
        a.renewed(&leader, 1100);
        a.resumed(1150);
        assert!(a.due(&leader, 1199, true).is_none());
        assert!(a.due(&leader, 1200, true).is_some());
        // A standby whose own outage ended: the holder may still be on its quiet
        // cadence, so the quiet lease runs from its return...
        let mut b = Candidate::new("b".into(), 300);
        b.renewed(&leader, 1100);
        b.resumed(2000);
        assert!(b.due(&leader, 4999, false).is_none());
        assert!(b.due(&leader, 5000, false).is_some());
        // ... and an event it read before the outage counts from its return.
        let mut c = Candidate::new("c".into(), 300);
        c.renewed(&leader, 1100);
        c.stirred(1200);
        c.resumed(2000);
        assert!(c.due(&leader, 2299, false).is_none());
        assert!(c.due(&leader, 2300, false).is_some());
    }
}
