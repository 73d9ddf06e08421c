//! Order 5: epochs opened by epoch-open slots (`BatchFlags::EPOCH_OPEN`), which brokers
//! write for a publisher's opening hello and answer once the session table shows the
//! epoch. The table must show a new epoch only once every batch the epoch before
//! admitted is committed (the committed mark is where the opener numbers from), and the
//! open's slot must stay below the ordered frontier until then (its broker takes the
//! frontier passing it, with the table not showing the epoch, for a refusal).

use crate::tests::{commit_session, goi_sessions, session_core, session_region};
use embarcadero_region::{Region, SessionRecord};
use embarcadero_wire::{BatchFlags, BatchHeader};
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
