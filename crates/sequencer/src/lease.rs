//! The region's sequencer lease: which sequencer may order this region, until when,
//! and under which fencing epoch.
//!
//! Three words of the control block: `lease_deadline_ns` (CLOCK_MONOTONIC, shared by
//! every process on the host that maps the region), `sequencer_id` and
//! `fencing_epoch`. The deadline word is the only point of arbitration: a sequencer
//! takes the lease with one compare-and-swap from an expired deadline to a fresh one,
//! and renews it with a compare-and-swap from the deadline it last wrote. Two
//! contenders that both saw the same expired deadline cannot both succeed, and a
//! holder that was paused past its deadline finds the word changed and knows it lost.
//!
//! Invariants:
//! - at most one holder per deadline value; the fencing epoch rises by one with every
//!   acquisition, so a later holder always has the higher epoch;
//! - a holder never extends a lease it no longer holds (renewal is a CAS from its own
//!   last deadline).

use embarcadero_region::{monotonic_ns, Fenced, OwnedWord, OwnerRecord, ProcessIdentity, Region};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("another sequencer (id {holder:016x}, fencing epoch {epoch}) holds this region's lease for {remaining_ms} ms more; stop it first, or start this one with --standby to take over when its lease expires")]
    Held {
        holder: u64,
        epoch: u64,
        remaining_ms: u64,
    },
    #[error("the previous sequencer (pid {pid}) lost its lease but could not be stopped: {error}; stop it by hand")]
    PredecessorAlive { pid: u32, error: String },
}

/// What the control block says about the lease right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LeaseState {
    pub holder: u64,
    pub fencing_epoch: u64,
    /// Milliseconds until the lease expires; 0 when it has.
    pub remaining_ms: u64,
}

impl LeaseState {
    pub fn read(region: &Region) -> Self {
        let deadline = region.lease_deadline_ns().load(Ordering::Acquire);
        Self {
            holder: region.sequencer_id().load(Ordering::Acquire),
            fencing_epoch: region.fencing_epoch().load(Ordering::Acquire),
            remaining_ms: deadline.saturating_sub(monotonic_ns()) / 1_000_000,
        }
    }
}

/// A held lease, renewed by a background thread until dropped (which releases it).
pub struct Lease {
    region: Arc<Region>,
    id: u64,
    epoch: u64,
    lost: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    renewer: Option<JoinHandle<()>>,
}

impl Lease {
    /// Takes the lease if nobody holds it (or the holder's has expired); renews it
    /// every third of `duration`.
    pub fn acquire(region: Arc<Region>, id: u64, duration: Duration) -> Result<Self, LeaseError> {
        assert!(id != 0, "sequencer id 0 means no holder");
        // A lease of no length is expired when taken: a second sequencer could take it
        // at once, and the renewer would spin.
        assert!(
            duration.as_millis() > 0,
            "a sequencer lease of {duration:?}"
        );
        let deadline_word = region.lease_words().deadline_ns;
        let ttl = duration.as_nanos() as u64;
        let deadline = take_deadline(&region, &deadline_word, ttl)?;
        // A predecessor whose lease ran out may only be paused: on this host it is
        // killed before this holder writes anything (a paused process would resume in
        // the middle of an epoch's writes, after its last check of the epoch).
        let owner = region.sequencer_owner();
        fence_off_predecessor(&owner, &deadline_word)?;
        owner.write(id, &ProcessIdentity::current());
        let words = region.lease_words();
        let epoch = words.fencing_epoch.add(1, Ordering::AcqRel) + 1;
        words.sequencer_id.store(id, Ordering::Release);
        let lost = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let renewer = {
            let (region, lost, stop) = (region.clone(), lost.clone(), stop.clone());
            std::thread::Builder::new()
                .name("sequencer-lease".into())
                .spawn(move || renew(&region, deadline, ttl, &lost, &stop))
                .expect("spawn the lease renewer")
        };
        Ok(Self {
            region,
            id,
            epoch,
            lost,
            stop,
            renewer: Some(renewer),
        })
    }

    /// Waits until the lease can be taken (standby), checking every `poll`. `None` once
    /// `give_up` is raised or a restarted head retired the region (its lease is worth
    /// nothing then).
    pub fn acquire_when_free(
        region: Arc<Region>,
        id: u64,
        duration: Duration,
        poll: Duration,
        give_up: &AtomicBool,
    ) -> Option<Self> {
        loop {
            if give_up.load(Ordering::Relaxed) || region.is_retired() {
                return None;
            }
            match Self::acquire(region.clone(), id, duration) {
                Ok(lease) => return Some(lease),
                Err(LeaseError::Held { .. }) => std::thread::sleep(poll),
                Err(e @ LeaseError::PredecessorAlive { .. }) => {
                    tracing::error!("{e}; retrying");
                    std::thread::sleep(poll);
                }
            }
        }
    }

    pub fn fencing_epoch(&self) -> u64 {
        self.epoch
    }

    /// True once a renewal found that another sequencer took the lease over.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

/// The arbitration of [`Lease::acquire`]: one compare-and-swap of the deadline word
/// (`deadline_word`) from an expired deadline to one `ttl` from now. Returns the new
/// deadline, or who holds the lease when it has not expired.
fn take_deadline(
    region: &Region,
    deadline_word: &OwnedWord<'_>,
    ttl: u64,
) -> Result<u64, LeaseError> {
    let mut seen = deadline_word.load(Ordering::Acquire);
    let deadline = loop {
        let now = monotonic_ns();
        if seen > now {
            let state = LeaseState::read(region);
            return Err(LeaseError::Held {
                holder: state.holder,
                epoch: state.fencing_epoch,
                remaining_ms: state.remaining_ms.max(1),
            });
        }
        match deadline_word.compare_exchange(seen, now + ttl, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break now + ttl,
            Err(current) => seen = current,
        }
    };
    Ok(deadline)
}

/// Stops the sequencer recorded in `owner`, if it still runs after its lease expired.
/// When it cannot be stopped, gives the lease just taken back (`deadline_word` to 0)
/// and fails: nothing was written yet.
fn fence_off_predecessor(
    owner: &OwnerRecord<'_>,
    deadline_word: &OwnedWord<'_>,
) -> Result<(), LeaseError> {
    if let Some((old_id, who)) = owner.read() {
        match who.fence_off(Duration::from_secs(10)) {
            Ok(Fenced::Killed) => tracing::warn!(
                pid = who.pid,
                old_id = format!("{old_id:016x}"),
                "the previous sequencer was still running after its lease expired (paused?); killed it before taking over"
            ),
            Ok(_) => {}
            Err(e) => {
                // Give the lease back at once; nothing was written.
                deadline_word.store(0, Ordering::Release);
                return Err(LeaseError::PredecessorAlive {
                    pid: who.pid,
                    error: e.to_string(),
                });
            }
        }
    }
    Ok(())
}

fn renew(region: &Region, mut deadline: u64, ttl: u64, lost: &AtomicBool, stop: &AtomicBool) {
    let period = Duration::from_nanos(ttl / 3);
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(period);
        if stop.load(Ordering::Acquire) {
            return;
        }
        let next = monotonic_ns() + ttl;
        assert!(
            next >= deadline,
            "the monotonic clock went back: a renewal would shorten the lease"
        );
        match region.lease_words().deadline_ns.compare_exchange(
            deadline,
            next,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => deadline = next,
            Err(_) => {
                lost.store(true, Ordering::Release);
                tracing::error!(
                    "this sequencer lost the region's lease to another one; it must stop ordering"
                );
                return;
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.renewer.take() {
            let _ = t.join();
        }
        if !self.is_lost() && self.region.sequencer_id().load(Ordering::Acquire) == self.id {
            // Release at once so a standby need not wait for the deadline.
            self.region
                .lease_words()
                .deadline_ns
                .store(0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use embarcadero_region::Capacities;

    fn region(dir: &std::path::Path) -> Arc<Region> {
        let caps = Capacities {
            max_topics: 1,
            brokers: 1,
            goi_slots: 64,
            pbr_slots: 64,
            segment_bytes: 1 << 16,
            segments_per_broker: 2,
            seg_map_slots: 8,
        };
        Arc::new(Region::create(&dir.join("r"), caps).unwrap())
    }

    #[test]
    fn a_held_lease_refuses_a_second_sequencer_and_is_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(dir.path());
        let first = Lease::acquire(r.clone(), 1, Duration::from_secs(5)).unwrap();
        assert_eq!(first.fencing_epoch(), 1);
        let err = Lease::acquire(r.clone(), 2, Duration::from_secs(5))
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                LeaseError::Held {
                    holder: 1,
                    epoch: 1,
                    ..
                }
            ),
            "{err}"
        );
        drop(first);
        let second = Lease::acquire(r.clone(), 2, Duration::from_secs(5)).unwrap();
        assert_eq!(
            second.fencing_epoch(),
            2,
            "every holder gets a higher epoch"
        );
        assert_eq!(LeaseState::read(&r).holder, 2);
    }

    #[test]
    fn contenders_for_an_expired_lease_get_exactly_one_holder() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(dir.path());
        let barrier = std::sync::Barrier::new(8);
        let winners: Vec<Lease> = std::thread::scope(|s| {
            let handles: Vec<_> = (1..=8u64)
                .map(|id| {
                    let (r, barrier) = (r.clone(), &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        Lease::acquire(r, id, Duration::from_secs(5)).ok()
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(winners.len(), 1);
        assert_eq!(LeaseState::read(&r).holder, winners[0].id);
    }

    #[test]
    fn a_standby_stops_waiting_once_the_region_is_retired() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(dir.path());
        let _active = Lease::acquire(r.clone(), 1, Duration::from_secs(5)).unwrap();
        let give_up = AtomicBool::new(false);
        std::thread::scope(|s| {
            let standby = s.spawn(|| {
                Lease::acquire_when_free(
                    r.clone(),
                    2,
                    Duration::from_secs(5),
                    Duration::from_millis(5),
                    &give_up,
                )
            });
            r.retire();
            assert!(
                standby.join().unwrap().is_none(),
                "no lease on a retired region"
            );
        });
    }

    #[test]
    fn a_holder_whose_lease_was_taken_over_learns_it_lost() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(dir.path());
        let old = Lease::acquire(r.clone(), 1, Duration::from_millis(300)).unwrap();
        // As if the old holder were paused past its deadline: a standby takes over.
        r.lease_words().deadline_ns.store(0, Ordering::Release);
        let new = Lease::acquire(r.clone(), 2, Duration::from_secs(5)).unwrap();
        while !old.is_lost() {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(new.fencing_epoch() > old.fencing_epoch());
        drop(old);
        assert_eq!(LeaseState::read(&r).holder, 2, "the loser does not release");
        assert!(!new.is_lost());
    }
}
