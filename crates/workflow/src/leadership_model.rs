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
//! What it checks, for delays under a third of a lease minus a tick:
//! - a live holder is never deposed, quiet or not, and with nothing happening it renews
//!   at the quiet cadence;
//! - a holder that died is replaced within a quiet lease of its death, within a normal
//!   lease of its death if a task was open then, and within a normal lease of the first
//!   event written after its death.

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
                Entry::Lease(lease) => {
                    let Event::OrchestratorLease {
                        term,
                        holder,
                        quiet_lease_ms,
                        ..
                    } = &**lease
                    else {
                        unreachable!("only lease events are published")
                    };
                    let quiet = if self.open == 0 { *quiet_lease_ms } else { 0 };
                    if self.leader.bid(*term, holder, *at, quiet).is_ok() {
                        self.candidate.renewed(&self.leader, now);
                    }
                }
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

/// What a run's log shows: when the standby's bid for term 2 was written (if ever), and
/// the open tasks at each moment (by the log without delay).
struct Run {
    log: Vec<(u64, Entry)>,
    takeover: Option<u64>,
    /// The holder's renewals written, and those lost.
    renewals: usize,
    lost: usize,
}

/// One run: the readers' delays, the clients' events, when the holder dies (if it does),
/// and which of the holder's publications after its first are lost (cycled; a loss right
/// after a loss is not made).
struct Scenario<'a> {
    delays: (u64, u64),
    clients: &'a [(u64, Client)],
    death: Option<u64>,
    losses: &'a [bool],
}

fn run(sc: Scenario<'_>) -> Run {
    let Scenario {
        delays,
        clients,
        death,
        losses,
    } = sc;
    let horizon = LAST_EVENT + QUIET + 2 * LEASE;
    let (mut holder, mut standby) = (Reader::new("a", delays.0), Reader::new("b", delays.1));
    let mut log: Vec<(u64, Entry)> = Vec::new();
    let mut pending = clients.to_vec();
    pending.sort_by_key(|c| c.0);
    let mut pending = pending.into_iter().peekable();
    let (mut published, mut renewals, mut lost, mut lost_last) = (0usize, 0, 0, false);
    let mut now = 0;
    while now <= horizon {
        while let Some((_, c)) = pending.next_if(|c| c.0 <= now) {
            log.push((now, Entry::Client(c)));
        }
        let holder_alive = death.is_none_or(|d| now < d);
        for (reader, acts) in [(&mut holder, holder_alive), (&mut standby, true)] {
            if !acts {
                continue;
            }
            reader.fold(&log, now);
            let quiet = reader.open == 0;
            let Some(e) = reader.candidate.due(&reader.leader, now, quiet) else {
                continue;
            };
            if reader.candidate.id == "a" {
                published += 1;
                let lose = published > 1
                    && !lost_last
                    && !losses.is_empty()
                    && losses[published % losses.len()];
                lost_last = lose;
                if lose {
                    lost += 1;
                    continue;
                }
                renewals += 1;
            }
            log.push((now, Entry::Lease(Box::new(e))));
        }
        now += TICK;
    }
    let takeover = first_accepted_bid_of(&log, "b", 2);
    Run {
        log,
        takeover,
        renewals,
        lost,
    }
}

/// When the log accepted `holder`'s bid for `term` (folded without delay).
fn first_accepted_bid_of(log: &[(u64, Entry)], holder: &str, term: u64) -> Option<u64> {
    let mut leader = Leader::default();
    for (at, entry) in log {
        let Entry::Lease(lease) = entry else { continue };
        let Event::OrchestratorLease {
            term: t, holder: h, ..
        } = &**lease
        else {
            continue;
        };
        let accepted = leader.bid(*t, h, *at, 0).is_ok();
        if accepted && *t == term && h == holder {
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn a_live_holder_is_never_deposed_quiet_or_not(
        delays in (0..=MAX_DELAY, 0..=MAX_DELAY),
        clients in prop::collection::vec(client(), 0..12),
        losses in prop::collection::vec(any::<bool>(), 0..8),
    ) {
        let sc = Scenario { delays, clients: &clients, death: None, losses: &losses };
        let r = run(sc);
        prop_assert_eq!(r.takeover, None);
        // With nothing happening, the quiet cadence: a renewal a third of a quiet lease,
        // plus one normal renewal for each lost quiet one and a few to get there.
        if clients.is_empty() {
            let horizon = LAST_EVENT + QUIET + 2 * LEASE;
            let bound = (horizon / (QUIET / RENEWALS_PER_LEASE)) as usize + r.lost + 4;
            prop_assert!(r.renewals <= bound, "{} renewals, bound {}", r.renewals, bound);
        }
    }

    #[test]
    fn a_dead_holder_is_replaced_within_a_normal_lease_of_anything_to_decide(
        delays in (0..=MAX_DELAY, 0..=MAX_DELAY),
        clients in prop::collection::vec(client(), 0..12),
        death in (1..LAST_EVENT / TICK).prop_map(|t| t * TICK),
        losses in prop::collection::vec(any::<bool>(), 0..8),
    ) {
        let sc = Scenario { delays, clients: &clients, death: Some(death), losses: &losses };
        let r = run(sc);
        let takeover = r.takeover;
        prop_assert!(takeover.is_some(), "never replaced");
        let takeover = takeover.unwrap();
        let slack = delays.1 + 2 * TICK;
        prop_assert!(takeover <= death + QUIET + slack, "later than a quiet lease: {}", takeover);
        if open_before(&r.log, death) > 0 {
            prop_assert!(takeover <= death + LEASE + slack, "a task was open: {}", takeover);
        }
        let first_after = r.log.iter().find(|(t, e)| *t >= death && matches!(e, Entry::Client(_)));
        if let Some((at, _)) = first_after {
            prop_assert!(takeover <= at + LEASE + slack, "event at {}: {}", at, takeover);
        }
    }
}
