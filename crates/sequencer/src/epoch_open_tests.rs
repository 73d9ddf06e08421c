//! Order 5: epochs opened by epoch-open slots (`BatchFlags::EPOCH_OPEN`), which brokers
//! write for a publisher's opening hello and answer once the session table shows the
//! epoch. The table must show a new epoch only once every batch the epoch before
//! admitted is committed (the committed mark is where the opener numbers from), and the
//! open's slot must stay below the ordered frontier until then (its broker takes the
//! frontier passing it, with the table not showing the epoch, for a refusal).

use crate::tests::{commit_session, goi_sessions, session_core, session_region};
use embarcadero_region::{Region, SessionRecord};
use embarcadero_wire::{BatchFlags, BatchHeader};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::sync::atomic::Ordering;
use std::time::Duration;

const CLIENT: u64 = 7;

/// Commits slot `index` of `broker` as an epoch open of `CLIENT`'s session.
fn commit_open(r: &Region, broker: u32, index: u64, epoch: u64, opener: u32) {
    r.pbr_commit(
        0,
        broker,
        index,
        &BatchHeader {
            client_id: CLIENT,
            session_epoch: epoch,
            batch_id: opener as u64,
            broker_id: broker as u16,
            flags: BatchFlags::VOID | BatchFlags::EPOCH_OPEN,
            pbr_index: index,
            total_size: 64,
            log_offset: index * 64,
            ..Default::default()
        },
    );
}

fn table(r: &Region) -> SessionRecord {
    r.session_find(0, CLIENT)
        .expect("the session is in the table")
        .1
}

fn ordered(r: &Region, broker: u32) -> u64 {
    r.log(0, broker).ordered_pbr.load(Ordering::Acquire)
}

#[test]
fn a_new_epoch_shows_in_the_table_only_once_the_old_ones_batches_are_committed() {
    let (_d, r) = session_region();
    let mut c = session_core(&r, Duration::from_secs(30));
    commit_open(&r, 1, 0, 1, 0xa);
    c.scan();
    c.seal_all();
    assert_eq!((table(&r).session_epoch, table(&r).opener), (1, 0xa));
    // Epoch 1 has two batches admitted, not committed, when epoch 2 is opened.
    commit_session(&r, 0, 0, CLIENT, 1, 0);
    commit_session(&r, 0, 1, CLIENT, 1, 1);
    c.scan();
    commit_open(&r, 1, 1, 2, 0xb);
    // Epoch 1's next batch, on a broker scanned after the open's: dropped.
    commit_session(&r, 2, 0, CLIENT, 1, 2);
    c.scan();
    // The position ceiling lets one of epoch 1's two batches commit in this seal.
    let ceiling = r.control_plane().position_ceiling(0);
    ceiling.set_for_test(1);
    c.seal_all();
    // Opens taken while the switch waits are held too, whatever they ask for: their
    // brokers must not answer from a table that is not current yet.
    commit_open(&r, 2, 1, 2, 0xc);
    commit_open(&r, 2, 2, 1, 0xd);
    c.scan();
    c.seal_all();
    assert_eq!(ordered(&r, 2), 1, "opens taken during the switch are held");
    let before = table(&r);
    assert_eq!(
        (before.session_epoch, before.opener, before.committed_hwm),
        (1, 0xa, 1),
        "epoch 1 still has a batch to commit: {before:?}"
    );
    assert_eq!(
        ordered(&r, 1),
        1,
        "the open's slot is held below the frontier"
    );
    ceiling.advance(1 << 32, Ordering::Release);
    c.seal_all();
    let after = table(&r);
    assert_eq!(
        (after.session_epoch, after.opener, after.committed_hwm),
        (2, 0xb, 2),
        "the table shows epoch 2 with the mark where epoch 1 stopped"
    );
    assert_eq!((ordered(&r, 1), ordered(&r, 2)), (2, 3));
    assert_eq!(goi_sessions(&r), vec![(CLIENT, 0), (CLIENT, 1)]);
    // The opener numbers from the mark: its batch 2 is admitted, not a duplicate.
    commit_session(&r, 2, 3, CLIENT, 2, 2);
    c.scan();
    c.seal_all();
    assert_eq!(
        goi_sessions(&r),
        vec![(CLIENT, 0), (CLIENT, 1), (CLIENT, 2)]
    );
}

#[test]
fn an_open_with_nothing_waiting_shows_at_once_and_other_openers_change_nothing() {
    let (_d, r) = session_region();
    let mut c = session_core(&r, Duration::from_secs(30));
    commit_session(&r, 0, 0, CLIENT, 1, 0);
    c.scan();
    c.seal_all();
    commit_open(&r, 1, 0, 2, 0xb);
    commit_open(&r, 2, 0, 2, 0xc); // a second opener of the same epoch: too late
    commit_open(&r, 0, 1, 1, 0xd); // an older epoch
    c.scan();
    c.seal_all();
    let rec = table(&r);
    assert_eq!(
        (rec.session_epoch, rec.opener, rec.committed_hwm),
        (2, 0xb, 1)
    );
    assert_eq!((ordered(&r, 0), ordered(&r, 1), ordered(&r, 2)), (2, 1, 1));
}

#[test]
fn a_sequencer_restarted_with_a_switch_pending_switches_again_from_the_slot() {
    let (_d, r) = session_region();
    let mut c = session_core(&r, Duration::from_secs(30));
    commit_session(&r, 0, 0, CLIENT, 1, 0);
    c.scan();
    commit_open(&r, 1, 0, 2, 0xb);
    c.scan();
    drop(c); // before the seal: batch 0 admitted, not committed; the switch pending
    assert_eq!(table(&r).session_epoch, 1);
    assert_eq!(ordered(&r, 1), 0, "the open is still to be scanned");
    let mut c = session_core(&r, Duration::from_secs(30));
    c.scan();
    c.seal_all();
    let rec = table(&r);
    assert_eq!((rec.session_epoch, rec.opener), (2, 0xb), "{rec:?}");
    assert_eq!(
        rec.committed_hwm,
        goi_sessions(&r).len() as u64,
        "the opener is told the mark of what epoch 1 committed"
    );
    assert_eq!(ordered(&r, 1), 1);
}

/// What one step of the property test below does.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// The next slot of the plan is committed (an old-epoch batch, or the open).
    Commit,
    Scan,
    Seal,
    /// A new sequencer from the region (the old one dies between any two steps).
    Restart,
    /// The position ceiling stops the next seal after one more message; or lifts.
    Stall,
    Unstall,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Commit),
        2 => Just(Step::Scan),
        2 => Just(Step::Seal),
        1 => Just(Step::Restart),
        1 => Just(Step::Stall),
        1 => Just(Step::Unstall),
    ]
}

/// One session, two publishers: the old one sends batches 0, 1, ... of epoch 1 to the
/// brokers in `old`, and at `open_at` of them the new one's epoch 2 open lands on
/// `open_broker`; once the table shows epoch 2 (what its broker waits for), the new
/// publisher sends `NEW` batches numbered from the table's committed mark. Interleaved
/// with scans, seals, sequencer restarts and stalls at the position ceiling.
struct TwoPublishers {
    _dir: tempfile::TempDir,
    r: std::sync::Arc<Region>,
    c: crate::Core,
    /// The plan of slots still to commit: `(broker, Some(seq))` an old batch, `None`
    /// the open.
    plan: std::collections::VecDeque<(u32, Option<u64>)>,
    /// Per broker, the next PBR index.
    next_index: [u64; 3],
    /// The mark the table showed with epoch 2 first: where the new publisher numbers from.
    opened_at: Option<u64>,
}

const NEW: u64 = 3;

impl TwoPublishers {
    fn commit(&mut self, broker: u32, slot: Option<u64>, epoch: u64) {
        let index = self.next_index[broker as usize];
        self.next_index[broker as usize] += 1;
        match slot {
            Some(seq) => commit_session(&self.r, broker, index, CLIENT, epoch, seq),
            None => commit_open(&self.r, broker, index, 2, 0xb),
        }
    }

    fn run(&mut self, step: Step) -> Result<(), TestCaseError> {
        match step {
            Step::Commit => {
                if let Some((broker, slot)) = self.plan.pop_front() {
                    self.commit(broker, slot, 1);
                }
            }
            Step::Scan => {
                self.c.scan();
            }
            Step::Seal => {
                self.c.seal_all();
                self.check_after_seal()?;
            }
            Step::Restart => self.c = session_core(&self.r, Duration::from_secs(30)),
            Step::Stall => {
                let next = self.r.topic_seq(0).next_position.load(Ordering::Acquire);
                self.r
                    .control_plane()
                    .position_ceiling(0)
                    .set_for_test(next + 1);
            }
            Step::Unstall => self
                .r
                .control_plane()
                .position_ceiling(0)
                .set_for_test(u64::MAX),
        }
        Ok(())
    }

    /// The client's batches in the GOI run 0, 1, 2, ... once each, those of epoch 1 all
    /// below the mark epoch 2 opened at; the table's mark is the GOI's count. When the
    /// table first shows epoch 2, the new publisher sends its batches from its mark.
    fn check_after_seal(&mut self) -> Result<(), TestCaseError> {
        let n = self.r.topic_seq(0).committed_seq.load(Ordering::Acquire);
        let entries: Vec<_> = (0..n).map(|g| self.r.goi_read(0, g).unwrap()).collect();
        for (g, e) in entries.iter().enumerate() {
            prop_assert_eq!(e.client_seq, g as u64, "GOI {} of {:?}", g, entries);
            if let Some(mark) = self.opened_at {
                prop_assert_eq!(e.session_epoch, if e.client_seq < mark { 1 } else { 2 });
            }
        }
        let Some((_, rec)) = self.r.session_find(0, CLIENT) else {
            return Ok(());
        };
        prop_assert_eq!(rec.committed_hwm, n, "the table's mark is the GOI's count");
        if rec.session_epoch == 2 && self.opened_at.is_none() {
            prop_assert_eq!(rec.opener, 0xb);
            self.opened_at = Some(rec.committed_hwm);
            prop_assert!(
                entries.iter().all(|e| e.session_epoch == 1),
                "nothing of epoch 2 before its open is shown"
            );
            for seq in rec.committed_hwm..rec.committed_hwm + NEW {
                self.commit((seq % 3) as u32, Some(seq), 2);
            }
        }
        Ok(())
    }

    /// Everything committed and ordered: the new publisher's batches all follow the
    /// old epoch's, once each.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        self.r
            .control_plane()
            .position_ceiling(0)
            .set_for_test(u64::MAX);
        while let Some((broker, slot)) = self.plan.pop_front() {
            self.commit(broker, slot, 1);
        }
        for _ in 0..4 {
            self.c.scan();
            self.c.seal_all();
            self.check_after_seal()?;
        }
        let mark = self.opened_at.expect("the table shows the opened epoch");
        prop_assert_eq!(goi_sessions(&self.r).len() as u64, mark + NEW);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever the interleaving, a publisher that opens an epoch while the previous one
    /// publishes numbers from a mark past every batch the previous epoch commits: none
    /// of its batches is dropped as a duplicate of the old one's, and no batch of the
    /// old epoch is ordered after the mark.
    #[test]
    fn an_opener_never_numbers_a_batch_the_old_epoch_commits(
        old in prop::collection::vec(0u32..3, 0..10),
        open_at in 0usize..11,
        open_broker in 0u32..3,
        steps in prop::collection::vec(step(), 0..60),
    ) {
        let (dir, r) = session_region();
        let c = session_core(&r, Duration::from_secs(30));
        let mut plan: std::collections::VecDeque<(u32, Option<u64>)> =
            old.iter().enumerate().map(|(seq, &b)| (b, Some(seq as u64))).collect();
        plan.insert(open_at.min(plan.len()), (open_broker, None));
        let mut t = TwoPublishers { _dir: dir, r, c, plan, next_index: [0; 3], opened_at: None };
        for step in steps {
            t.run(step)?;
        }
        t.finish()?;
    }
}
