//! Property tests that model-check the ordering protocol deterministically.
//!
//! A scenario reserves PBR slots on the region's brokers up front (reservation is not
//! visible to the sequencer), then interleaves, on one thread, "a broker commits one of
//! its reserved slots" with the sequencer's own steps: a scan pass, an epoch seal, a
//! restart of the sequencer from the region and (for a wrapping GOI) a broker's
//! reclamation of what is ordered. A model of what has been committed and scanned is
//! checked against the region after the steps; in the end every slot is committed and
//! the sequencer runs until nothing is left to order.
//!
//! A broker commits its slots out of reservation order within [`COMMIT_WINDOW`], as its
//! connections do.
//!
//! What one thread cannot observe: the memory orderings between the sequencer's writes
//! (GOI token, `committed_seq`, `ordered_pbr`, session table). A crash in the middle of a
//! seal is modelled at one point, the widest: after `committed_seq` is published and
//! before any `ordered_pbr` moved (`Step::CrashAfterPublish`, found by the fault
//! campaign), for order 2 also before `next_position` took the epoch's positions (the
//! store right after `committed_seq`; order 5 writes its table in between); the unit test `a_restarted_sequencer_recovers_sessions_from_table_and_goi`
//! simulates order 5's other torn cases by hand.

use crate::tests::{
    commit, commit_session, core, goi_sessions, region, session_core, session_region,
};
use crate::Core;
use embarcadero_region::{GoiEntry, Region, SessionState};
use embarcadero_wire::{BatchFlags, BatchHeader};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Brokers of the test region (`tests::region`).
const BROKERS: usize = 3;
/// The order-2 topic of `tests::region` and the order-5 topic of `tests::session_region`.
const ORDER2_TOPIC: u32 = 1;
const ORDER5_TOPIC: u32 = 0;
/// How many of its lowest uncommitted slots a broker may commit next (its connections).
const COMMIT_WINDOW: usize = 3;
/// No session is fenced in these scenarios: no gap lasts this long.
const LONG_LEASE: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone, Copy)]
enum Step {
    /// `broker` commits one of its first [`COMMIT_WINDOW`] uncommitted slots (no-op if
    /// it has none left).
    Commit { broker: usize, pick: usize },
    /// The sequencer's scan pass.
    Scan,
    /// The sequencer seals an epoch.
    Seal,
    /// `broker` reclaims everything ordered on it (what its service thread may free).
    Reclaim { broker: usize },
    /// The sequencer is replaced by a new one that resumes from the region.
    Restart,
    /// The sequencer seals an epoch and dies after publishing it (`committed_seq`) but
    /// before any `ordered_pbr` moved; a new one resumes from the region.
    CrashAfterPublish,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (0..BROKERS, 0..COMMIT_WINDOW)
            .prop_map(|(broker, pick)| Step::Commit { broker, pick }),
        3 => Just(Step::Scan),
        3 => Just(Step::Seal),
        1 => (0..BROKERS).prop_map(|broker| Step::Reclaim { broker }),
        1 => Just(Step::Restart),
        1 => Just(Step::CrashAfterPublish),
    ]
}

/// Puts every `ordered_pbr` of `topic` back where `before` saw it, as a sequencer
/// killed between publishing an epoch and advancing them leaves the region; with
/// `positions`, `next_position` too (killed right after `committed_seq`).
fn crash_before_ordered_pbr_moved(r: &Region, topic: u32, before: &Lines, positions: bool) {
    if positions {
        r.sequencer_topic(topic)
            .next_position
            .set_for_test(before.next_position);
    }
    for (b, ordered) in before.ordered_pbr.iter().enumerate() {
        r.sequencer_line(topic, b as u32)
            .ordered_pbr
            .set_for_test(*ordered);
    }
}

/// Which slots of each broker are committed, in PBR index order.
#[derive(Debug)]
struct Commits(Vec<Vec<bool>>);

impl Commits {
    fn new(lens: impl Iterator<Item = usize>) -> Self {
        Self(lens.map(|n| vec![false; n]).collect())
    }

    /// Marks and returns the slot `broker` commits for `pick`, if any is left.
    fn next(&mut self, broker: usize, pick: usize) -> Option<u64> {
        let open: Vec<usize> = (0..self.0[broker].len())
            .filter(|&i| !self.0[broker][i])
            .take(COMMIT_WINDOW)
            .collect();
        let i = *open.get(pick % open.len().max(1))?;
        self.0[broker][i] = true;
        Some(i as u64)
    }

    fn is(&self, broker: usize, index: u64) -> bool {
        self.0[broker].get(index as usize).copied().unwrap_or(false)
    }

    /// The committed prefix of `broker`: how far a scanner can get.
    fn prefix(&self, broker: usize) -> u64 {
        self.0[broker].iter().take_while(|c| **c).count() as u64
    }

    fn all_done(&self) -> bool {
        self.0.iter().flatten().all(|c| *c)
    }
}

/// The sequencer's lines of one topic, to check that they only move forward.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Lines {
    committed_seq: u64,
    next_position: u64,
    ordered_pbr: Vec<u64>,
}

impl Lines {
    fn read(r: &Region, topic: u32) -> Self {
        let seq = r.topic_seq(topic);
        Self {
            committed_seq: seq.committed_seq.load(Ordering::Acquire),
            next_position: seq.next_position.load(Ordering::Acquire),
            ordered_pbr: (0..BROKERS as u32)
                .map(|b| r.log(topic, b).ordered_pbr.load(Ordering::Acquire))
                .collect(),
        }
    }

    fn check_forward_from(&self, before: &Lines) -> Result<(), TestCaseError> {
        prop_assert!(
            self.committed_seq >= before.committed_seq
                && self.next_position >= before.next_position,
            "sequence line moved back: {before:?} -> {self:?}"
        );
        for (b, (now, was)) in self.ordered_pbr.iter().zip(&before.ordered_pbr).enumerate() {
            prop_assert!(
                now >= was,
                "ordered_pbr of broker {b} moved back: {was} -> {now}"
            );
        }
        Ok(())
    }
}

/// Reads the GOI entries the last seal appended, checking that positions continue
/// without a hole from where `mirror` ends.
fn read_new_entries(
    r: &Region,
    topic: u32,
    mirror: &[GoiEntry],
) -> Result<Vec<GoiEntry>, TestCaseError> {
    let committed = r.topic_seq(topic).committed_seq.load(Ordering::Acquire);
    let mut position = mirror
        .last()
        .map_or(0, |e| e.total_order + e.num_msg as u64);
    let mut new = Vec::new();
    for g in mirror.len() as u64..committed {
        let e = r.goi_read(topic, g);
        prop_assert!(
            e.is_some(),
            "GOI entry {g} under committed_seq {committed} unreadable"
        );
        let e = e.unwrap();
        prop_assert_eq!(e.total_order, position, "position hole at GOI entry {}", g);
        position += e.num_msg as u64;
        new.push(e);
    }
    Ok(new)
}

// ------------------------------------------------------------------ order 2

#[derive(Debug, Clone)]
struct Order2Scenario {
    /// Per broker, its reserved slots in PBR index order: `(num_msg, valid)`.
    slots: Vec<Vec<(u32, bool)>>,
    steps: Vec<Step>,
}

fn order2_scenario() -> impl Strategy<Value = Order2Scenario> {
    let slot = (1u32..5, prop::bool::weighted(0.8));
    (
        prop::collection::vec(prop::collection::vec(slot, 0..12), BROKERS),
        prop::collection::vec(step(), 0..80),
    )
        .prop_map(|(slots, steps)| Order2Scenario { slots, steps })
}

struct Order2Model {
    _dir: tempfile::TempDir,
    r: Arc<Region>,
    c: Core,
    goi_slots: u64,
    /// Check the invariants after every step (else only run the steps).
    check_steps: bool,
    slots: Vec<Vec<(u32, bool)>>,
    commits: Commits,
    /// Per broker, the committed prefix when the running sequencer last scanned.
    scanned: Vec<u64>,
    /// Per broker, the `reclaimed_pbr` the model's broker stored.
    reclaimed: Vec<u64>,
    /// Every GOI entry, read back after the seal that wrote it (the ring may wrap).
    goi: Vec<GoiEntry>,
    in_goi: HashSet<(u16, u64)>,
    lines: Lines,
}

impl Order2Model {
    fn new(slots: Vec<Vec<(u32, bool)>>, goi_slots: u64, check_steps: bool) -> Self {
        let (dir, r) = region(goi_slots);
        let c = core(&r);
        let lines = Lines::read(&r, ORDER2_TOPIC);
        Self {
            _dir: dir,
            c,
            goi_slots,
            check_steps,
            commits: Commits::new(slots.iter().map(Vec::len)),
            slots,
            scanned: vec![0; BROKERS],
            reclaimed: vec![0; BROKERS],
            goi: Vec::new(),
            in_goi: HashSet::new(),
            lines,
            r,
        }
    }

    fn valid_count(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|(_, valid)| *valid)
            .count()
    }

    /// The GOI has room for every valid slot: a seal can never stall.
    fn goi_unbounded(&self) -> bool {
        self.valid_count() as u64 <= self.goi_slots
    }

    fn run(&mut self, step: Step) -> Result<(), TestCaseError> {
        match step {
            Step::Commit { broker, pick } => {
                if let Some(i) = self.commits.next(broker, pick) {
                    let (num_msg, valid) = self.slots[broker][i as usize];
                    commit(&self.r, broker as u32, i, num_msg, valid);
                }
            }
            Step::Scan => {
                self.c.scan();
                for b in 0..BROKERS {
                    self.scanned[b] = self.commits.prefix(b);
                }
            }
            Step::Seal => {
                self.c.seal_all();
                self.after_seal()?;
            }
            Step::Reclaim { broker } => {
                let log = self.r.log(ORDER2_TOPIC, broker as u32);
                let ordered = log.ordered_pbr.load(Ordering::Acquire);
                self.r
                    .broker_line(ORDER2_TOPIC, broker as u32)
                    .reclaimed_pbr
                    .advance(ordered, Ordering::Release);
                self.reclaimed[broker] = ordered;
            }
            Step::Restart => {
                self.c = core(&self.r);
                // The new sequencer resumes from the region: it has scanned nothing yet.
                self.scanned = self.lines.ordered_pbr.clone();
            }
            Step::CrashAfterPublish => {
                self.c.seal_all();
                self.after_seal()?;
                crash_before_ordered_pbr_moved(&self.r, ORDER2_TOPIC, &self.lines, true);
                self.c = core(&self.r);
                // It resumes past what the GOI holds: the lines now say where.
                self.scanned = Lines::read(&self.r, ORDER2_TOPIC).ordered_pbr;
            }
        }
        let lines = Lines::read(&self.r, ORDER2_TOPIC);
        if self.check_steps {
            lines.check_forward_from(&self.lines)?;
        }
        self.lines = lines;
        Ok(())
    }

    /// Takes in what the seal appended to the GOI and, when checking steps, checks it
    /// against what had been committed and scanned.
    fn after_seal(&mut self) -> Result<(), TestCaseError> {
        let new = read_new_entries(&self.r, ORDER2_TOPIC, &self.goi)?;
        for e in new {
            let (b, i) = (e.broker_id as usize, e.pbr_index);
            if self.check_steps {
                let g = self.goi.len() as u64;
                prop_assert!(
                    b < BROKERS && self.commits.is(b, i),
                    "GOI {g}: uncommitted {e:?}"
                );
                prop_assert!(
                    i < self.scanned[b],
                    "GOI {g}: ordered before a scan saw it: {e:?}"
                );
                let (num_msg, valid) = self.slots[b][i as usize];
                prop_assert!(valid, "GOI {g}: void slot ordered: {e:?}");
                // `tests::commit` stamps batch_seq = index and log_offset = index * 1024.
                prop_assert_eq!(
                    (e.num_msg, e.client_seq, e.blog_offset),
                    (num_msg, i, i * 1024),
                    "GOI entry {} does not describe its PBR slot",
                    g
                );
                let slot = self.r.pbr_read(ORDER2_TOPIC, b as u32, i).unwrap();
                prop_assert_eq!(slot.total_order, e.total_order, "PBR slot position");
                if let Some(old) = g.checked_sub(self.goi_slots) {
                    let old = self.goi[old as usize];
                    prop_assert!(
                        old.pbr_index < self.reclaimed[old.broker_id as usize],
                        "GOI {g} overwrote {old:?}, whose batch is still in memory"
                    );
                }
            }
            self.in_goi.insert((e.broker_id, e.pbr_index));
            self.goi.push(e);
        }
        if !self.check_steps {
            return Ok(());
        }
        for b in 0..BROKERS {
            let ordered = self
                .r
                .log(ORDER2_TOPIC, b as u32)
                .ordered_pbr
                .load(Ordering::Acquire);
            prop_assert!(
                ordered <= self.scanned[b],
                "broker {b}: ordered_pbr {ordered} above what was scanned"
            );
            for i in 0..ordered {
                prop_assert!(
                    !self.slots[b][i as usize].1 || self.in_goi.contains(&(b as u16, i)),
                    "broker {b}: ordered_pbr {ordered} passes slot {i}, not in the GOI"
                );
            }
            if self.goi_unbounded() {
                prop_assert_eq!(
                    ordered,
                    self.scanned[b],
                    "broker {}: a seal left scanned slots unordered",
                    b
                );
            }
        }
        Ok(())
    }

    /// Commits what is left and lets the sequencer (and brokers' reclamation) run until
    /// every slot is ordered.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        for b in 0..BROKERS {
            while let Some(i) = self.commits.next(b, 0) {
                let (num_msg, valid) = self.slots[b][i as usize];
                commit(&self.r, b as u32, i, num_msg, valid);
            }
        }
        prop_assert!(self.commits.all_done());
        for _ in 0..100 {
            let done = self.lines.committed_seq == self.valid_count() as u64
                && (0..BROKERS).all(|b| self.lines.ordered_pbr[b] == self.slots[b].len() as u64);
            if done {
                break;
            }
            self.run(Step::Scan)?;
            self.run(Step::Seal)?;
            for broker in 0..BROKERS {
                self.run(Step::Reclaim { broker })?;
            }
        }
        Ok(())
    }

    /// Every valid batch is in the GOI exactly once, no void one is, positions run
    /// from 0 without a hole, and each broker's batches are in PBR index order.
    fn check_final(&self) -> Result<(), TestCaseError> {
        let valid: HashSet<(u16, u64)> = (0..BROKERS)
            .flat_map(|b| {
                self.slots[b]
                    .iter()
                    .enumerate()
                    .filter(|(_, (_, valid))| *valid)
                    .map(move |(i, _)| (b as u16, i as u64))
            })
            .collect();
        let ordered: Vec<(u16, u64)> = self
            .goi
            .iter()
            .map(|e| (e.broker_id, e.pbr_index))
            .collect();
        prop_assert_eq!(
            ordered.len(),
            self.in_goi.len(),
            "a batch ordered twice: {:?}",
            ordered
        );
        prop_assert_eq!(&self.in_goi, &valid, "GOI {:?}", ordered);
        prop_assert_eq!(self.lines.committed_seq, valid.len() as u64);
        let mut position = 0;
        for (g, e) in self.goi.iter().enumerate() {
            prop_assert_eq!(e.total_order, position, "position hole at GOI entry {}", g);
            position += e.num_msg as u64;
        }
        let messages: u64 = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.1)
            .map(|s| s.0 as u64)
            .sum();
        prop_assert_eq!(position, messages);
        prop_assert_eq!(self.lines.next_position, messages);
        // What the region still holds is what was read back after each seal.
        let kept = self.goi.len().saturating_sub(self.goi_slots as usize);
        for (g, e) in self.goi.iter().enumerate().skip(kept) {
            let now = self.r.goi_read(ORDER2_TOPIC, g as u64);
            prop_assert_eq!(
                now.map(|x| (x.broker_id, x.pbr_index, x.total_order)),
                Some((e.broker_id, e.pbr_index, e.total_order))
            );
        }
        for b in 0..BROKERS {
            let mine: Vec<u64> = ordered
                .iter()
                .filter(|(x, _)| *x as usize == b)
                .map(|(_, i)| *i)
                .collect();
            prop_assert!(
                mine.windows(2).all(|w| w[0] < w[1]),
                "broker {b} out of FIFO order: {mine:?}"
            );
            prop_assert_eq!(
                self.lines.ordered_pbr[b],
                self.slots[b].len() as u64,
                "broker {} not fully ordered",
                b
            );
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ order 5

#[derive(Debug, Clone, Copy)]
enum Send {
    /// The client's next batch_seq.
    Next,
    /// A resend of one of the client's batch_seqs sent already (the pick, modulo).
    Again(u64),
    /// A slot the broker commits as void (a failed receive).
    Void,
}

fn send() -> impl Strategy<Value = Send> {
    prop_oneof![
        6 => Just(Send::Next),
        2 => any::<u64>().prop_map(Send::Again),
        1 => Just(Send::Void),
    ]
}

/// A session batch `(client_id, batch_seq)`, or `None` for a void slot.
type SessionSlot = Option<(u64, u64)>;

#[derive(Debug, Clone)]
struct Order5Scenario {
    /// Per client (id = index + 1), how many batches its session sends.
    batches: Vec<u64>,
    /// Per broker, its reserved slots in PBR index order.
    slots: Vec<Vec<SessionSlot>>,
    steps: Vec<Step>,
}

fn order5_scenario() -> impl Strategy<Value = Order5Scenario> {
    (
        prop::collection::vec(0u64..7, 1..=3),
        prop::collection::vec((any::<usize>(), send(), 0..BROKERS), 0..40),
        prop::collection::vec(step(), 0..80),
    )
        .prop_map(|(batches, sends, steps)| {
            // Each client sends its batch_seqs in order, interleaved with the others;
            // resends follow what the client sent already, to any broker.
            let mut slots = vec![Vec::new(); BROKERS];
            let mut sent = vec![0u64; batches.len()];
            for (client, send, broker) in sends {
                let c = client % batches.len();
                let id = c as u64 + 1;
                match send {
                    Send::Next if sent[c] < batches[c] => {
                        slots[broker].push(Some((id, sent[c])));
                        sent[c] += 1;
                    }
                    Send::Again(pick) if sent[c] > 0 => {
                        slots[broker].push(Some((id, pick % sent[c])));
                    }
                    Send::Void => slots[broker].push(None),
                    _ => {}
                }
            }
            for (c, &n) in batches.iter().enumerate() {
                for seq in sent[c]..n {
                    slots[(c + seq as usize) % BROKERS].push(Some((c as u64 + 1, seq)));
                }
            }
            Order5Scenario {
                batches,
                slots,
                steps,
            }
        })
}

fn commit_void(r: &Region, topic: u32, broker: u32, index: u64) {
    r.pbr_commit(
        topic,
        broker,
        index,
        &BatchHeader {
            broker_id: broker as u16,
            flags: BatchFlags::VOID,
            pbr_index: index,
            ..Default::default()
        },
    );
}

struct Order5Model {
    _dir: tempfile::TempDir,
    r: Arc<Region>,
    c: Core,
    check_steps: bool,
    batches: Vec<u64>,
    slots: Vec<Vec<SessionSlot>>,
    commits: Commits,
    /// Per broker, the committed prefix when the running sequencer last scanned.
    scanned: Vec<u64>,
    /// The GOI as read back after each seal.
    goi: Vec<GoiEntry>,
    /// Per client, how many of its batches the GOI holds.
    ordered: HashMap<u64, u64>,
    lines: Lines,
}

impl Order5Model {
    fn new(s: &Order5Scenario, check_steps: bool) -> Self {
        let (dir, r) = session_region();
        let c = session_core(&r, LONG_LEASE);
        let lines = Lines::read(&r, ORDER5_TOPIC);
        Self {
            _dir: dir,
            c,
            check_steps,
            batches: s.batches.clone(),
            commits: Commits::new(s.slots.iter().map(Vec::len)),
            slots: s.slots.clone(),
            scanned: vec![0; BROKERS],
            goi: Vec::new(),
            ordered: HashMap::new(),
            lines,
            r,
        }
    }

    fn run(&mut self, step: Step) -> Result<(), TestCaseError> {
        match step {
            Step::Commit { broker, pick } => {
                if let Some(i) = self.commits.next(broker, pick) {
                    self.commit(broker, i);
                }
            }
            Step::Scan => {
                self.c.scan();
                for b in 0..BROKERS {
                    self.scanned[b] = self.commits.prefix(b);
                }
            }
            Step::Seal => {
                self.c.seal_all();
                self.after_seal()?;
            }
            // At most 18 distinct batches: the GOI of 64 slots never wraps, and reclamation
            // changes nothing the sequencer reads.
            Step::Reclaim { .. } => {}
            Step::Restart => {
                self.c = session_core(&self.r, LONG_LEASE);
                self.scanned = self.lines.ordered_pbr.clone();
            }
            Step::CrashAfterPublish => {
                self.c.seal_all();
                self.after_seal()?;
                crash_before_ordered_pbr_moved(&self.r, ORDER5_TOPIC, &self.lines, false);
                self.c = session_core(&self.r, LONG_LEASE);
                self.scanned = self.lines.ordered_pbr.clone();
            }
        }
        let lines = Lines::read(&self.r, ORDER5_TOPIC);
        if self.check_steps {
            lines.check_forward_from(&self.lines)?;
        }
        self.lines = lines;
        Ok(())
    }

    fn commit(&self, broker: usize, index: u64) {
        match self.slots[broker][index as usize] {
            Some((client, seq)) => commit_session(&self.r, broker as u32, index, client, 1, seq),
            None => commit_void(&self.r, ORDER5_TOPIC, broker as u32, index),
        }
    }

    fn after_seal(&mut self) -> Result<(), TestCaseError> {
        let new = read_new_entries(&self.r, ORDER5_TOPIC, &self.goi)?;
        for e in new {
            let n = self.ordered.entry(e.client_id).or_default();
            if self.check_steps {
                let g = self.goi.len();
                let (b, i) = (e.broker_id as usize, e.pbr_index);
                prop_assert!(
                    b < BROKERS && self.commits.is(b, i),
                    "GOI {g}: uncommitted {e:?}"
                );
                prop_assert!(
                    i < self.scanned[b],
                    "GOI {g}: ordered before a scan saw it: {e:?}"
                );
                prop_assert_eq!(
                    self.slots[b][i as usize],
                    Some((e.client_id, e.client_seq)),
                    "GOI entry {} does not describe its PBR slot",
                    g
                );
                // Exactly once and in session order: the next of the client's batch_seqs.
                prop_assert_eq!(
                    e.client_seq,
                    *n,
                    "GOI {}: client {} out of session order",
                    g,
                    e.client_id
                );
            }
            *n += 1;
            self.goi.push(e);
        }
        if !self.check_steps {
            return Ok(());
        }
        let listed: Vec<(u64, u64)> = self
            .goi
            .iter()
            .map(|e| (e.client_id, e.client_seq))
            .collect();
        prop_assert_eq!(goi_sessions(&self.r), listed);
        // Every slot below a broker's ordered frontier is committed and done with: void,
        // or its batch is in the GOI, or, for a duplicate dropped because a copy of its
        // batch_seq is held behind a session gap, a committed copy is still at or above
        // its own broker's frontier (a restarted sequencer rescans it). So for order 5,
        // `ordered_pbr` passing a slot does not mean its batch is in the GOI (order-5
        // acks follow the session table instead); this is the closest property to
        // order 2's "everything below `ordered_pbr` is in the GOI".
        let frontiers = Lines::read(&self.r, ORDER5_TOPIC).ordered_pbr;
        for (b, &frontier) in frontiers.iter().enumerate() {
            prop_assert!(
                frontier <= self.scanned[b],
                "broker {b}: ordered_pbr {frontier} above what was scanned"
            );
            for i in 0..frontier {
                let Some((client, seq)) = self.slots[b][i as usize] else {
                    continue;
                };
                let in_goi = seq < self.ordered.get(&client).copied().unwrap_or(0);
                let kept = (0..BROKERS).any(|x| {
                    (frontiers[x]..self.slots[x].len() as u64).any(|j| {
                        self.commits.is(x, j) && self.slots[x][j as usize] == Some((client, seq))
                    })
                });
                prop_assert!(
                    in_goi || kept,
                    "broker {b}: ordered_pbr {frontier} passes slot {i} {:?}, which is \
                     neither in the GOI nor kept in another slot",
                    (client, seq)
                );
            }
        }
        // Nothing admissible waits: each session's GOI prefix reaches its first batch_seq
        // that no scan has seen yet.
        for (c, _) in self.batches.iter().enumerate() {
            let client = c as u64 + 1;
            let have = self.ordered.get(&client).copied().unwrap_or(0);
            let seen: HashSet<u64> = (0..BROKERS)
                .flat_map(|b| self.slots[b][..self.scanned[b] as usize].iter())
                .filter_map(|s| s.filter(|(x, _)| *x == client).map(|(_, seq)| seq))
                .collect();
            let reachable = (have..).find(|seq| !seen.contains(seq)).unwrap();
            prop_assert_eq!(have, reachable, "client {} held back behind no gap", client);
            // The session table follows the GOI, and nothing is fenced.
            match self.r.session_find(ORDER5_TOPIC, client) {
                Some((_, rec)) => {
                    prop_assert_eq!(
                        (rec.state, rec.session_epoch, rec.committed_hwm),
                        (SessionState::Open, 1, have)
                    );
                }
                None => prop_assert_eq!(have, 0, "client {} has no session record", client),
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), TestCaseError> {
        for b in 0..BROKERS {
            while let Some(i) = self.commits.next(b, 0) {
                self.commit(b, i);
            }
        }
        prop_assert!(self.commits.all_done());
        for _ in 0..3 {
            self.run(Step::Scan)?;
            self.run(Step::Seal)?;
        }
        Ok(())
    }

    /// Each `(client, batch_seq)` is in the GOI exactly once, and per client the
    /// batch_seqs run 0, 1, 2, ... in GOI order.
    fn check_final(&self) -> Result<(), TestCaseError> {
        let goi = goi_sessions(&self.r);
        let unique: HashSet<(u64, u64)> = goi.iter().copied().collect();
        prop_assert_eq!(unique.len(), goi.len(), "a batch ordered twice: {:?}", goi);
        let total: u64 = self.batches.iter().sum();
        prop_assert_eq!(goi.len() as u64, total, "GOI {:?}", goi);
        for (c, &n) in self.batches.iter().enumerate() {
            let client = c as u64 + 1;
            let seqs: Vec<u64> = goi
                .iter()
                .filter(|(x, _)| *x == client)
                .map(|(_, s)| *s)
                .collect();
            prop_assert_eq!(
                seqs,
                (0..n).collect::<Vec<_>>(),
                "client {} out of session order",
                client
            );
            if n > 0 {
                let (_, rec) = self.r.session_find(ORDER5_TOPIC, client).unwrap();
                prop_assert_eq!((rec.state, rec.committed_hwm), (SessionState::Open, n));
            }
        }
        for b in 0..BROKERS {
            prop_assert_eq!(
                self.lines.ordered_pbr[b],
                self.slots[b].len() as u64,
                "broker {} not fully ordered",
                b
            );
        }
        let held = self
            .c
            .topics
            .iter()
            .find(|t| t.line.topic == ORDER5_TOPIC)
            .unwrap()
            .orderer
            .sessions()
            .held();
        prop_assert_eq!(held, 0);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Order 2, after every commit and enough epochs: every valid batch is in the GOI
    /// exactly once, no void slot is, positions run from 0 without a hole, and each
    /// broker's batches appear in PBR index order.
    #[test]
    fn order2_goi_is_contiguous_exactly_once_and_per_broker_fifo(s in order2_scenario()) {
        let mut m = Order2Model::new(s.slots, 64, false);
        for step in s.steps {
            m.run(step)?;
        }
        m.finish()?;
        m.check_final()?;
    }

    /// Order 2, after every step: each GOI entry a seal writes is a valid slot that was
    /// committed and scanned before that seal; `ordered_pbr` never passes a slot that is
    /// not in the GOI and reaches what was scanned; `committed_seq`, `next_position` and
    /// every `ordered_pbr` only move forward, across sequencer restarts too.
    #[test]
    fn order2_orders_only_committed_batches_and_lines_only_move_forward(s in order2_scenario()) {
        let mut m = Order2Model::new(s.slots, 64, true);
        for step in s.steps {
            m.run(step)?;
        }
        m.finish()?;
    }

    /// Order 2 with a GOI of 8 slots that wraps: a seal stalls rather than overwrite an
    /// entry whose batch its broker has not reclaimed, and still orders everything
    /// exactly once, in per-broker FIFO order, once brokers reclaim.
    #[test]
    fn order2_wrapping_goi_overwrites_only_reclaimed_entries_and_loses_nothing(
        s in order2_scenario()
    ) {
        let mut m = Order2Model::new(s.slots, 8, true);
        for step in s.steps {
            m.run(step)?;
        }
        m.finish()?;
        m.check_final()?;
    }

    /// Order 5, sessions spread over brokers with resends: after everything, each
    /// `(client, batch_seq)` is in the GOI exactly once and each client's batch_seqs
    /// appear in strictly increasing order, contiguous from 0.
    #[test]
    fn order5_each_session_batch_is_ordered_exactly_once_in_session_order(s in order5_scenario()) {
        let mut m = Order5Model::new(&s, false);
        for step in s.steps {
            m.run(step)?;
        }
        m.finish()?;
        m.check_final()?;
    }

    /// Order 5, after every step: the GOI holds, per session, a contiguous prefix of its
    /// batch_seqs, each from a committed and scanned slot; no session waits behind a gap
    /// that a scan has filled; the session table's high-water mark matches the GOI; each
    /// `ordered_pbr` passes only slots that are void, whose batch is in the GOI, or whose
    /// batch has a committed copy the frontiers have not passed; the sequencer's lines
    /// only move forward, across restarts too.
    #[test]
    fn order5_every_seal_leaves_each_session_a_contiguous_prefix(s in order5_scenario()) {
        let mut m = Order5Model::new(&s, true);
        for step in s.steps {
            m.run(step)?;
        }
        m.finish()?;
    }
}
