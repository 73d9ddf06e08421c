//! Order 5: sessions ended by their publishers (`BatchFlags::END_SESSION`), which a
//! closing publisher sends once everything it sent is acknowledged. A full session table
//! gives such a session's slot to a new session at once, where an idle one waits
//! `session_idle_evict`; an end that does not describe the session as it stands (a
//! batch still to come or held, another epoch, opener or key, a later batch) ends
//! nothing.

use crate::sessions::test_clock::NOW_MS;
use crate::tests::{
    commit_keyed, commit_session, fill_session_table, goi_sessions, idle_core, wide_session_region,
    MINUTE_MS,
};
use embarcadero_region::{Region, SessionRecord, SessionState, SESSION_SLOTS};
use embarcadero_wire::{BatchFlags, BatchHeader};
use std::sync::atomic::Ordering;

/// What a session-end slot names besides its client id.
#[derive(Clone, Copy)]
struct End {
    epoch: u64,
    opener: u32,
    key_hash: u64,
    next_seq: u64,
}

/// The end of a session opened by its batches (opener 0, no key) after `next_seq`
/// batches of epoch 1.
fn end_after(next_seq: u64) -> End {
    End {
        epoch: 1,
        opener: 0,
        key_hash: 0,
        next_seq,
    }
}

/// Commits slot `index` of broker 0 as the end of `client`'s session.
fn commit_end(r: &Region, index: u64, client: u64, end: End) {
    r.pbr_commit(
        0,
        0,
        index,
        &BatchHeader {
            batch_seq: end.next_seq,
            client_id: client,
            session_epoch: end.epoch,
            batch_id: end.opener as u64,
            flags: BatchFlags::VOID | BatchFlags::END_SESSION,
            pbr_index: index,
            total_size: 64,
            log_offset: index * 64,
            session_key_hash: end.key_hash,
            ..Default::default()
        },
    );
}

fn has_session(r: &Region, client: u64) -> bool {
    r.session_find(0, client).is_some()
}

#[test]
fn a_full_table_gives_a_slot_its_publisher_ended_to_a_new_session_at_once() {
    let (_d, r) = wide_session_region(1);
    let mut c = idle_core(&r);
    let t0 = 1_000 * MINUTE_MS;
    fill_session_table(&r, &mut c, t0);
    let (slot_of_5, _) = r.session_find(0, 5).unwrap();
    // A second later, client 5 ends its session after its one batch.
    NOW_MS.set(Some(t0 + 1_000));
    commit_end(&r, 256, 5, end_after(1));
    commit_session(&r, 0, 257, 1000, 1, 0);
    c.scan();
    c.seal_all();
    assert_eq!(goi_sessions(&r).last(), Some(&(1000, 0)), "admitted");
    assert_eq!(r.session_find(0, 1000).unwrap().0, slot_of_5);
    assert!(!has_session(&r, 5), "session 5 ended");
    assert_eq!(c.metrics.sessions_evicted.load(Ordering::Relaxed), 1);
    // No other session was ended or is idle: the next new one finds no slot.
    commit_session(&r, 0, 258, 1001, 1, 0);
    c.scan();
    c.seal_all();
    assert!(!has_session(&r, 1001));
    assert_eq!(r.log(0, 0).ordered_pbr.load(Ordering::Acquire), 259);
    NOW_MS.set(None);
}

#[test]
fn an_end_that_does_not_describe_the_session_as_it_stands_ends_nothing() {
    let (_d, r) = wide_session_region(1);
    let mut c = idle_core(&r);
    let t0 = 1_000 * MINUTE_MS;
    NOW_MS.set(Some(t0));
    // Client 300's session is bound to a key; the table is then filled by 255 others.
    commit_keyed(&r, 0, 0, (300, 0xbeef), 1, 0);
    c.scan();
    c.seal_all();
    let mut index = 1;
    for client in 0..SESSION_SLOTS as u64 - 1 {
        commit_session(&r, 0, index, client, 1, 0);
        index += 1;
    }
    // Client 1's batch 2 is held (batch 1 missing), client 2 publishes again after its
    // end, and the others' ends are wrong in one way each.
    commit_session(&r, 0, index, 1, 1, 2);
    index += 1;
    let ends = [
        (0, end_after(0)), // its batch 0 was admitted: the end is older than it
        (1, end_after(3)), // batch 1 has not come, batch 2 is held
        (2, end_after(1)), // ended, then publishes batch 1 below
        (
            3,
            End {
                epoch: 2,
                ..end_after(1)
            },
        ),
        (
            4,
            End {
                opener: 9,
                ..end_after(1)
            },
        ),
        (
            300,
            End {
                key_hash: 0xdead,
                ..end_after(1)
            },
        ),
        (77_777, end_after(0)), // no such session
    ];
    for (client, end) in ends {
        commit_end(&r, index, client, end);
        index += 1;
    }
    commit_session(&r, 0, index, 2, 1, 1);
    index += 1;
    NOW_MS.set(Some(t0 + MINUTE_MS));
    commit_session(&r, 0, index, 1000, 1, 0);
    c.scan();
    c.seal_all();
    assert!(!has_session(&r, 1000), "no session could end");
    for client in [0, 1, 2, 3, 4, 300] {
        assert!(has_session(&r, client), "client {client}");
    }
    assert_eq!(c.metrics.sessions_evicted.load(Ordering::Relaxed), 0);
    // The owner of 300's key ends it as it stands: its slot is free at once.
    commit_end(
        &r,
        index + 1,
        300,
        End {
            key_hash: 0xbeef,
            ..end_after(1)
        },
    );
    commit_session(&r, 0, index + 2, 1000, 1, 0);
    c.scan();
    c.seal_all();
    assert!(has_session(&r, 1000) && !has_session(&r, 300));
    NOW_MS.set(None);
}

#[test]
fn an_ended_session_keeps_its_slot_until_the_disk_replicas_have_its_batches() {
    let (_d, r) = wide_session_region(2);
    let mut c = idle_core(&r);
    let t0 = 1_000 * MINUTE_MS;
    fill_session_table(&r, &mut c, t0);
    commit_end(&r, 256, 9, end_after(1));
    commit_session(&r, 0, 257, 1000, 1, 0);
    c.scan();
    c.seal_all();
    assert!(
        !has_session(&r, 1000) && has_session(&r, 9),
        "session 9's batch is not on the replica yet"
    );
    // The replica catches up with session 9's batch (GOI index 9), not the ones after.
    r.replica_line(0, 1)
        .durable_seq
        .advance(10, Ordering::Release);
    commit_session(&r, 0, 258, 1000, 1, 0);
    c.scan();
    c.seal_all();
    assert!(has_session(&r, 1000) && !has_session(&r, 9));
    NOW_MS.set(None);
}

/// The table keeps a session's end (state Ended), so a restarted sequencer gives that
/// slot first too; but where the table lags the GOI (the sequencer stopped between
/// committing a later batch of the session and writing the table), the later batch
/// makes the session Open again.
#[test]
fn a_restarted_sequencer_keeps_an_end_unless_the_goi_shows_a_later_batch() {
    let (_d, r) = wide_session_region(1);
    let mut c = idle_core(&r);
    let t0 = 1_000 * MINUTE_MS;
    fill_session_table(&r, &mut c, t0);
    NOW_MS.set(Some(t0 + 1_000));
    commit_end(&r, 256, 5, end_after(1));
    commit_end(&r, 257, 6, end_after(1));
    c.scan();
    c.seal_all();
    let state = |client| r.session_find(0, client).unwrap().1.state;
    assert_eq!(
        (state(5), state(6)),
        (SessionState::Ended, SessionState::Ended)
    );
    commit_session(&r, 0, 258, 6, 1, 1);
    c.scan();
    c.seal_all();
    assert_eq!(state(6), SessionState::Open, "a later batch undoes the end");
    // The sequencer dies having committed client 6's batch 1 but not its table record.
    let (slot_of_6, rec) = r.session_find(0, 6).unwrap();
    r.session_write(
        0,
        slot_of_6,
        &SessionRecord {
            state: SessionState::Ended,
            committed_hwm: 1,
            ..rec
        },
    );
    drop(c);
    let mut c = idle_core(&r);
    commit_session(&r, 0, 259, 1000, 1, 0);
    commit_session(&r, 0, 260, 1001, 1, 0);
    c.scan();
    c.seal_all();
    assert!(has_session(&r, 1000) && !has_session(&r, 5), "5's slot");
    assert!(!has_session(&r, 1001) && has_session(&r, 6), "6 is open");
    assert_eq!(
        (state(6), r.session_find(0, 6).unwrap().1.committed_hwm),
        (SessionState::Open, 2)
    );
    NOW_MS.set(None);
}
