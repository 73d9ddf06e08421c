//! The orchestrator across its log's outages and at its stop. Owns riding out an outage
//! (a server restart): the engine stops deciding and serving, retries with backoff, and
//! once the server answers follows the log again from its fold's position (a new
//! subscription, a new publisher session), reads it to its end and only then decides,
//! so it never acts on a state it could not confirm. Its state is only the fold of the
//! log, so resuming is subscribing again where the fold is; the lease and its fencing
//! ([`crate::leadership`]) are in the log, so a standby that took over meanwhile is read
//! like any other takeover. Also owns the release of the lease on stop, so that a
//! standby takes over at once instead of a lease later.

use super::{identity_of, Runtime, IDLE_POLL};
use crate::log::{Folder, Writer};
use crate::state::State;
use embarcadero_client::{Admin, Error};
use embarcadero_wire::ErrorCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The first pause between attempts to reach the log again, doubled after each failed
/// attempt up to `LAST_PAUSE`.
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const LAST_PAUSE: Duration = Duration::from_secs(1);

/// Whether `e` can be an outage of the log (a server restarting, its brokers gone or
/// not yet back), which the engine rides out, rather than a fault that trying again
/// cannot mend: a configuration the server refuses, an event too large, events the fold
/// needs that the log no longer holds.
pub(super) fn outage(e: &Error) -> bool {
    match e {
        Error::Config(_) | Error::InvalidName(_) | Error::MessageTooLarge { .. } => false,
        e => e.code() != Some(ErrorCode::PositionNotRetained),
    }
}

impl Runtime {
    /// Runs the engine loop until it is stopped, riding out the log's outages.
    pub(super) fn follow(&mut self) -> Result<(), String> {
        loop {
            match self.run_loop() {
                Ok(()) => return Ok(()),
                Err(e) if outage(&e) => {
                    if !self.ride_out(e)? {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// The log failed under the engine (`lost`): stops deciding and serving, says so,
    /// and tries again with backoff until it follows the log again (true), is stopped
    /// (false), or gives up (`--retry-for`, or the log is not the one it folded).
    fn ride_out(&mut self, lost: Error) -> Result<bool, String> {
        let control = self.engine.log.control.clone();
        let since = Instant::now();
        *self.engine.outage.lock() = Some(format!("lost the server at {control}: {lost}"));
        // Whether it still holds the lease, it learns from the log once back.
        self.active = false;
        self.engine.role.active.store(false, Ordering::Release);
        let bound = match self.retry_for {
            Some(limit) => format!("for up to {} s (--retry-for)", limit.as_secs()),
            None => "for as long as the process lives".to_string(),
        };
        tracing::warn!("lost the server at {control} ({lost}); not deciding or serving until it is back and the log is read to its end; retrying {bound}");
        let mut pause = FIRST_PAUSE;
        let mut last = lost;
        for tries in 1u32.. {
            if let Some(limit) = self.retry_for.filter(|l| since.elapsed() >= *l) {
                return Err(format!(
                    "gave up on the server at {control} after {} s (--retry-for): {last}",
                    limit.as_secs()
                ));
            }
            if self.stopped_within(pause) {
                return Ok(false);
            }
            match self.reconnect() {
                Ok(end) => {
                    let secs = since.elapsed().as_secs_f64();
                    let at = self.folder.position();
                    tracing::info!("the server at {control} is back after {secs:.1} s; reading the log from position {at} to its end {end} before deciding");
                    return Ok(true);
                }
                Err(e) if !outage(&e) => return Err(e.to_string()),
                Err(e) => {
                    if tries.is_power_of_two() {
                        tracing::warn!(
                            "still waiting for the server at {control} ({e}); next try in {} ms",
                            pause.as_millis()
                        );
                    }
                    pause = (pause * 2).min(LAST_PAUSE);
                    last = e;
                }
            }
        }
        unreachable!("the attempts are counted for ever")
    }

    /// Waits `pause` unless the engine is stopped meanwhile; whether it was.
    fn stopped_within(&self, pause: Duration) -> bool {
        let until = Instant::now() + pause;
        while !self.engine.stop.load(Ordering::SeqCst) {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // `Orchestrator::stop` unparks it.
            std::thread::park_timeout(left);
        }
        true
    }

    /// Follows the log again: the same log (else an error), from the fold's position
    /// (or from its start, if it no longer holds the events the state was folded from),
    /// in a new publisher session. Returns the log's end, which the fold must reach
    /// before the engine decides again.
    fn reconnect(&mut self) -> Result<u64, Error> {
        let log = self.engine.log.clone();
        let info = match Admin::new(&log.control).describe_topic(&log.topic) {
            Err(Error::Admin { status: 404, .. }) => {
                return Err(Error::Config(format!(
                    "the event log {} is gone from the server; this orchestrator's state is of a log that no longer exists: start it again",
                    log.topic
                )))
            }
            found => found?,
        };
        if identity_of(&info) != self.log_id {
            return Err(Error::Config(format!(
                "the event log {} was deleted and created again while the server was away; this orchestrator's state is of the old one: start it again",
                log.topic
            )));
        }
        let at = self.folder.position();
        // Before anything is delivered, its position is where the log now starts.
        let from_first = Folder::open(&log, "orchestrator")?;
        let first = from_first.position();
        let writer = Writer::open(&log)?;
        if first > self.origin || info.next_position < at {
            self.start_over(first, info.next_position, from_first);
        } else {
            drop(from_first);
            self.folder = Folder::open_at(&log, "orchestrator", at)?;
        }
        *self.engine.writer.lock() = Arc::new(writer);
        self.replay_end = info.next_position;
        self.resumed = true;
        // Its decisions not read back may be lost with the old session: decided afresh.
        self.inflight.clear();
        self.engine.caught_up.store(false, Ordering::SeqCst);
        Ok(info.next_position)
    }

    /// The log came back without the events this state was folded from (a memory-only
    /// topic loses them to a server restart), or with fewer than the fold read: no
    /// reader starting now could have that state, and workers fold the log afresh after
    /// an outage. So the engine starts over from what the log holds, as a restarted
    /// orchestrator would, instead of deciding from events nobody else can read.
    fn start_over(&mut self, first: u64, end: u64, from_first: Folder) {
        tracing::warn!(
            "the event log {} now starts at position {first} and ends at {end}: the events this orchestrator's state was folded from (from position {}) are gone (a memory-only topic lost them to a server restart; use --rf 2 --ack 2 to keep them); starting over from what the log holds",
            self.engine.log.topic,
            self.origin
        );
        self.engine.shared.reset(State::default());
        self.folder = from_first;
        self.origin = first;
        self.claimed_at.clear();
        self.seen.clear();
        // The lease's terms begin again with the log's.
        self.candidate = self.candidate.starting_over();
    }

    /// The fold reached the log's end after an outage: the engine serves again and, if
    /// it (still or now) holds the lease, decides. Workers could not heartbeat while the
    /// log was away, so each gets a lease from now, as after a replay; the orchestrator
    /// lease too, for the same reason.
    pub(super) fn back(&mut self, now: u64) {
        for seen in self.seen.values_mut() {
            *seen = now;
        }
        self.start_leases(now);
        self.candidate.resumed(now);
        self.resumed = false;
        *self.engine.outage.lock() = None;
        self.engine.caught_up.store(true, Ordering::SeqCst);
        tracing::info!(
            "read the log to its end (position {}) after the outage; serving again",
            self.replay_end
        );
    }

    /// On stop: the holder releases its lease in the log and reads the release back (for
    /// at most a lease, after which a standby takes over anyway), so that a standby bids
    /// at once instead of waiting out `--failover-ms`. Says what it did either way.
    pub(super) fn release_lease(&mut self) {
        let leader = self.engine.shared.lock().leader.clone();
        let term = leader.term;
        let Some(release) = self.candidate.release(&leader) else {
            tracing::info!(
                term,
                "orchestrator stopping: it does not hold the lease; nothing to hand over"
            );
            return;
        };
        let failover_ms = self.failover_ms;
        if let Some(why) = self.engine.outage.lock().clone() {
            tracing::warn!(term, "orchestrator stopping without releasing its lease ({why}); a standby takes over {failover_ms} ms after the last renewal");
            return;
        }
        let deadline = Instant::now() + Duration::from_millis(failover_ms);
        let released = self.engine.writer().publish(release);
        match released.and_then(|()| self.read_back_release(term, deadline)) {
            Ok(true) => tracing::info!(term, "orchestrator stopping: released its lease; a standby takes over at once"),
            Ok(false) => tracing::warn!(term, "orchestrator stopping: its lease release was not read back within {failover_ms} ms; a standby takes over once the lease lapses"),
            Err(e) => tracing::warn!(term, "orchestrator stopping: cannot release its lease ({e}); a standby takes over {failover_ms} ms after the last renewal"),
        }
        self.engine.role.active.store(false, Ordering::Release);
    }

    /// Folds until the lease of `term` is no longer this one's (its release applied, or
    /// a takeover read); false if `deadline` came first.
    fn read_back_release(&mut self, term: u64, deadline: Instant) -> Result<bool, Error> {
        loop {
            let held = {
                let leader = &self.engine.shared.lock().leader;
                leader.term == term && self.candidate.is_active(leader)
            };
            if !held {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            self.folder.pump(&self.engine.shared, IDLE_POLL)?;
        }
    }
}
