//! A model of the orchestrator lease with quiet renewals (test only): a holder and a
//! standby, each reading one log with a delay of its own, tasks opened and finished and
//! other events written by clients at random times, and the holder perhaps dying. Time
//! moves in ticks; each candidate folds what has reached it, then publishes what
//! [`Candidate::due`] returns. The fold's rule (a renewal is quiet only with no task open
//! at its position) is applied as `State::apply` applies it.
//!
//! Some of the holder's renewals are lost on their way (never two in a row, which no
//! lease survives): a quiet renewal lost must leave the holder on the cadence the standby
//! is still counting.
//!
//! Besides death, one disturbance per run ([`Disturbance`]): the holder releases its
//! term and stops; the standby restarts (a new process: it replays the log and dates the
//! lease by the holder's stamp, [`Candidate::replayed`]); or the server is out (nobody
//! reads or writes for a while, and each comes back on its own delay,
//! [`Candidate::resumed`]).
//!
//! What it checks, for delays under a third of a lease minus a tick:
//! - a live holder is never deposed, quiet or not, across a standby's restart or an
//!   outage, and with nothing happening it renews at the quiet cadence;
//! - a holder that died is replaced within a quiet lease of its death, within a normal
//!   lease of its death if a task was open then, and within a normal lease of the first
//!   event written after its death;
//! - a holder that released its term is replaced as soon as the standby reads the release.

use super::*;
use proptest::prelude::*;

const LEASE: u64 = 300;
const QUIET: u64 = LEASE * QUIET_LEASES;
const TICK: u64 = 10;
const MAX_DELAY: u64 = LEASE / RENEWALS_PER_LEASE - 2 * TICK;
const LAST_EVENT: u64 = 20_000;

#[derive(Clone, Copy, Debug)]
enum Client {
    OpenTask,
    FinishTask,
    Other,
}

#[derive(Clone, Debug)]
enum Entry {
    Lease(Box<Event>),
    Client(Client),
}

struct Reader {
    candidate: Candidate,
    leader: Leader,
    open: usize,
    read: usize,
    delay: u64,
}

impl Reader {
    fn new(id: &str, delay: u64) -> Self {
        Self {
            candidate: Candidate::new(id.into(), LEASE),
            leader: Leader::default(),
            open: 0,
            read: 0,
            delay,
        }
    }

    /// Folds the entries written at least `delay` before `now`, in log order.
    fn fold(&mut self, log: &[(u64, Entry)], now: u64) {
        while let Some((at, entry)) = log.get(self.read) {
            if at + self.delay > now {
                return;
            }
            self.read += 1;
            match entry {
                Entry::Lease(lease) => self.fold_lease(lease, *at, now),
                Entry::Client(c) => {
                    match c {
                        Client::OpenTask => self.open += 1,
                        Client::FinishTask => self.open = self.open.saturating_sub(1),
                        Client::Other => {}
                    }
                    self.candidate.stirred(now);
                }
            }
        }
    }
}

impl Reader {
    /// As the orchestrator observes a lease event: a renewal or bid accepted restarts the
    /// lease; a release (not a lease event) stirs it, and leaves the term without holder.
    fn fold_lease(&mut self, lease: &Event, at: u64, now: u64) {
        match lease {
            Event::OrchestratorLease {
                term,
                holder,
                quiet_lease_ms,
                ..
            } => {
                let quiet = if self.open == 0 { *quiet_lease_ms } else { 0 };
                if self.leader.bid(*term, holder, at, quiet).is_ok() {
                    self.candidate.renewed(&self.leader, now);
                }
            }
            Event::OrchestratorRelease { term, holder } => {
                let _ = self.leader.release(*term, holder, at);
                self.candidate.stirred(now);
            }
            _ => unreachable!("only lease events are published"),
        }
    }

    /// A new process in this one's place: it replays the log as it reaches it now.
    fn restarted(&self, id: &str, now: u64, log: &[(u64, Entry)]) -> Self {
        let mut fresh = Reader::new(id, self.delay);
        fresh.fold(log, now);
        let open = fresh.open > 0;
        fresh.candidate.replayed(&fresh.leader, now, open);
        fresh
    }
}

/// What a run's log shows: when the standby's bid for term 2 was written (if ever), and
/// the open tasks at each moment (by the log without delay).
struct Run {
    log: Vec<(u64, Entry)>,
    takeover: Option<u64>,
    /// The holder's renewals written, and those lost.
    renewals: usize,
    lost: usize,
}

/// What else happens in a run, besides the holder's death.
#[derive(Clone, Copy, Debug)]
enum Disturbance {
    None,
    /// The holder publishes its release at this time and stops.
    Release(u64),
    /// The standby's process is replaced at this time by one that replays the log.
    Restart(u64),
    /// From the first time to the second nobody reads or writes the log (a server
    /// restart); clients' events meanwhile are lost, and each reader comes back its
    /// delay after the end.
    Outage(u64, u64),
}

impl Disturbance {
    fn log_out(self, now: u64) -> bool {
        matches!(self, Disturbance::Outage(a, b) if (a..b).contains(&now))
    }

    /// Whether a reader with `delay` is still away at `now`, and whether `now` is the
    /// tick it comes back at (it folds the backlog, then resumes).
    fn away(self, delay: u64, now: u64) -> (bool, bool) {
        match self {
            Disturbance::Outage(a, b) => {
                let back = b + delay;
                (now >= a && now < back, now >= back && now < back + TICK)
            }
            _ => (false, false),
        }
    }
}

/// One run: the readers' delays, the clients' events, when the holder dies (if it does),
/// what else happens, and which of the holder's publications after its first are lost
/// (cycled; a loss right after a loss is not made).
struct Scenario<'a> {
    delays: (u64, u64),
    clients: &'a [(u64, Client)],
    death: Option<u64>,
    disturbance: Disturbance,
    losses: &'a [bool],
}

/// Which of the holder's publications are lost on their way.
struct Losses<'a> {
    pattern: &'a [bool],
    published: usize,
    lost: usize,
    lost_last: bool,
}

impl Losses<'_> {
    fn lose_next(&mut self) -> bool {
        self.published += 1;
        let lose = self.published > 1
            && !self.lost_last
            && !self.pattern.is_empty()
            && self.pattern[self.published % self.pattern.len()];
        self.lost_last = lose;
        self.lost += usize::from(lose);
        lose
    }
}

fn run(sc: Scenario<'_>) -> Run {
    let horizon = LAST_EVENT + QUIET + 2 * LEASE;
    let mut readers = [Reader::new("a", sc.delays.0), Reader::new("b", sc.delays.1)];
    let mut log: Vec<(u64, Entry)> = Vec::new();
    let mut pending = sc.clients.to_vec();
    pending.sort_by_key(|c| c.0);
    let mut pending = pending.into_iter().peekable();
    let mut losses = Losses {
        pattern: sc.losses,
        published: 0,
        lost: 0,
        lost_last: false,
    };
    let mut now = 0;
    while now <= horizon {
        while let Some((_, c)) = pending.next_if(|c| c.0 <= now) {
            if !sc.disturbance.log_out(now) {
                log.push((now, Entry::Client(c)));
            }
        }
        if matches!(sc.disturbance, Disturbance::Restart(t) if (t..t + TICK).contains(&now)) {
            readers[1] = readers[1].restarted("c", now, &log);
        }
        let holder_acts = sc.death.is_none_or(|d| now < d)
            && !matches!(sc.disturbance, Disturbance::Release(r) if now > r);
        for (i, reader) in readers.iter_mut().enumerate() {
            let acts = i == 1 || holder_acts;
            if let Some(e) = step(reader, acts, &sc, &log, now) {
                let release = matches!(e, Event::OrchestratorRelease { .. });
                if i == 0 && !release && losses.lose_next() {
                    continue;
                }
                log.push((now, Entry::Lease(Box::new(e))));
            }
        }
        now += TICK;
    }
    let takeover = first_accepted_bid(&log, 2);
    Run {
        log,
        takeover,
        renewals: losses.published - losses.lost,
        lost: losses.lost,
    }
}

/// One reader's tick: what it publishes, if anything.
fn step(
    reader: &mut Reader,
    acts: bool,
    sc: &Scenario<'_>,
    log: &[(u64, Entry)],
    now: u64,
) -> Option<Event> {
    let (away, back) = sc.disturbance.away(reader.delay, now);
    if !acts || away {
        return None;
    }
    reader.fold(log, now);
    if back {
        reader.candidate.resumed(now);
    }
    if matches!(sc.disturbance, Disturbance::Release(r) if (r..r + TICK).contains(&now)) {
        if let Some(e) = reader.candidate.release(&reader.leader) {
            return Some(e);
        }
    }
    let quiet = reader.open == 0;
    reader.candidate.due(&reader.leader, now, quiet)
}

/// When the log accepted a bid for `term` (folded without delay), by anyone.
fn first_accepted_bid(log: &[(u64, Entry)], term: u64) -> Option<u64> {
    let mut leader = Leader::default();
    for (at, entry) in log {
        let Entry::Lease(lease) = entry else { continue };
        let accepted = match &**lease {
            Event::OrchestratorLease {
                term: t, holder: h, ..
            } => leader.bid(*t, h, *at, 0).is_ok() && *t == term,
            Event::OrchestratorRelease { term: t, holder: h } => {
                let _ = leader.release(*t, h, *at);
                false
            }
            _ => false,
        };
        if accepted {
            return Some(*at);
        }
    }
    None
}

/// Tasks open once every entry written before `at` is folded.
fn open_before(log: &[(u64, Entry)], at: u64) -> usize {
    log.iter()
        .take_while(|(t, _)| *t < at)
        .fold(0usize, |open, (_, e)| match e {
            Entry::Client(Client::OpenTask) => open + 1,
            Entry::Client(Client::FinishTask) => open.saturating_sub(1),
            _ => open,
        })
}

fn client() -> impl Strategy<Value = (u64, Client)> {
    let kind = prop_oneof![
        Just(Client::OpenTask),
        Just(Client::FinishTask),
        Just(Client::Other)
    ];
    ((0..LAST_EVENT / TICK).prop_map(|t| t * TICK), kind)
}

fn at_tick(range: std::ops::Range<u64>) -> impl Strategy<Value = u64> {
    (range.start / TICK..range.end / TICK).prop_map(|t| t * TICK)
}

/// A standby's restart or a server outage (up to two leases long), or neither.
fn survivable() -> impl Strategy<Value = Disturbance> {
    prop_oneof![
        Just(Disturbance::None),
        at_tick(0..LAST_EVENT).prop_map(Disturbance::Restart),
        (at_tick(0..LAST_EVENT), at_tick(TICK..2 * LEASE))
            .prop_map(|(a, len)| Disturbance::Outage(a, a + len)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn a_live_holder_is_never_deposed_quiet_or_not(
        delays in (0..=MAX_DELAY, 0..=MAX_DELAY),
        clients in prop::collection::vec(client(), 0..12),
        disturbance in survivable(),
        losses in prop::collection::vec(any::<bool>(), 0..8),
    ) {
        let sc = Scenario { delays, clients: &clients, death: None, disturbance, losses: &losses };
        let r = run(sc);
        prop_assert_eq!(r.takeover, None);
        // With nothing happening, the quiet cadence: a renewal a third of a quiet lease,
        // plus one normal renewal for each lost quiet one and a few to get there.
        if clients.is_empty() && matches!(disturbance, Disturbance::None) {
            let horizon = LAST_EVENT + QUIET + 2 * LEASE;
            let bound = (horizon / (QUIET / RENEWALS_PER_LEASE)) as usize + r.lost + 4;
            prop_assert!(r.renewals <= bound, "{} renewals, bound {}", r.renewals, bound);
        }
    }

    #[test]
    fn a_dead_holder_is_replaced_within_a_normal_lease_of_anything_to_decide(
        delays in (0..=MAX_DELAY, 0..=MAX_DELAY),
        clients in prop::collection::vec(client(), 0..12),
        death in at_tick(TICK..LAST_EVENT),
        // The standby's restart after the death, within the quiet lease it may wait.
        restart_after in prop::option::of(at_tick(0..QUIET)),
        losses in prop::collection::vec(any::<bool>(), 0..8),
    ) {
        let restart = restart_after.map(|after| death + after);
        let disturbance = restart.map_or(Disturbance::None, Disturbance::Restart);
        let sc = Scenario { delays, clients: &clients, death: Some(death), disturbance, losses: &losses };
        let r = run(sc);
        let takeover = r.takeover;
        prop_assert!(takeover.is_some(), "never replaced");
        let takeover = takeover.unwrap();
        let slack = delays.1 + 2 * TICK;
        // A standby restarted after an event counts its normal lease from its replay.
        let replay = restart.unwrap_or(0);
        prop_assert!(takeover <= death + QUIET + slack, "later than a quiet lease: {}", takeover);
        if open_before(&r.log, death) > 0 {
            let bound = death.max(replay) + LEASE + slack;
            prop_assert!(takeover <= bound, "a task was open: {}", takeover);
        }
        let first_after = r.log.iter().find(|(t, e)| *t >= death && matches!(e, Entry::Client(_)));
        if let Some((at, _)) = first_after {
            let bound = (*at).max(replay) + LEASE + slack;
            prop_assert!(takeover <= bound, "event at {}: {}", at, takeover);
        }
    }

    #[test]
    fn a_released_term_is_taken_as_soon_as_the_standby_reads_the_release(
        delays in (0..=MAX_DELAY, 0..=MAX_DELAY),
        clients in prop::collection::vec(client(), 0..12),
        release in at_tick(LEASE..LAST_EVENT),
        losses in prop::collection::vec(any::<bool>(), 0..8),
    ) {
        let disturbance = Disturbance::Release(release);
        let sc = Scenario { delays, clients: &clients, death: None, disturbance, losses: &losses };
        let r = run(sc);
        let takeover = r.takeover;
        prop_assert!(takeover.is_some(), "never replaced");
        let takeover = takeover.unwrap();
        prop_assert!(takeover >= release, "deposed before the release: {}", takeover);
        prop_assert!(takeover <= release + delays.1 + TICK, "taken at {}", takeover);
    }
}
