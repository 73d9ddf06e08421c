//! Tests of the region's memory protocol across its parts (moved whole from region.rs).

use crate::layout::*;
use crate::slots::{GoiEntry, SessionRecord, SessionState, TopicMeta};
use crate::*;
use embarcadero_wire::BatchFlags;
use embarcadero_wire::BatchHeader;
use std::fs::OpenOptions;
use std::sync::atomic::Ordering;
use std::sync::Arc;

fn small() -> Capacities {
    Capacities {
        max_topics: 2,
        brokers: 2,
        goi_slots: 16,
        pbr_slots: 8,
        segment_bytes: 8192,
        segments_per_broker: 4,
        seg_map_slots: 8,
    }
}

/// Pins `slot` of topic 1 at position 10 for `broker`, with heartbeat `beat`.
fn pin_slot(r: &Region, slot: u32, broker: u64, beat: u64) {
    let pin = r.reader_slot(1, slot);
    pin.mark_claimed();
    pin.owner.store(broker + 1, Ordering::Release);
    pin.position(0).store(10, Ordering::Release);
    pin.heartbeat.store(beat, Ordering::Release);
}

#[test]
fn releasing_a_brokers_reader_slots_frees_only_its_own_that_stopped_beating() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    let death = std::time::Duration::from_millis(600);
    let long_ago = monotonic_ns() - 2 * death.as_nanos() as u64;
    // Broker 1: one slot silent since long ago, one still beaten (a follower declared
    // dead that is still serving), one being claimed; broker 0: one silent slot.
    pin_slot(&r, 0, 1, long_ago);
    pin_slot(&r, 1, 0, long_ago);
    pin_slot(&r, 2, 1, monotonic_ns());
    pin_slot(&r, 3, 1, READER_CLAIMING);
    let mut claims = Vec::new();
    let pass = r.release_reader_slots(1, death, &mut claims);
    assert_eq!(pass, Released { freed: 1, live: 2 });
    assert_eq!(r.reader_heartbeat(1, 0).load(Ordering::Acquire), 0);
    assert_ne!(
        r.reader_heartbeat(1, 1).load(Ordering::Acquire),
        0,
        "broker 0's"
    );
    assert_ne!(
        r.reader_heartbeat(1, 2).load(Ordering::Acquire),
        0,
        "still beaten: its subscriber is being served"
    );
    assert_eq!(
        r.reader_heartbeat(1, 3).load(Ordering::Acquire),
        READER_CLAIMING,
        "a claim in progress is left to finish"
    );
    assert_eq!(claims, [(1, 3)]);
    // Still being claimed a pass later: the claimant died mid-claim.
    let pass = r.release_reader_slots(1, death, &mut claims);
    assert_eq!(pass, Released { freed: 1, live: 1 });
    assert_eq!(r.reader_heartbeat(1, 3).load(Ordering::Acquire), 0);
    assert_eq!(r.reader_floor(1, 0, std::time::Duration::from_secs(30)), 10);
}

#[test]
fn a_floor_past_a_position_leaves_out_the_readers_at_or_below_it_but_not_a_claim() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    let stall = std::time::Duration::from_secs(30);
    pin_slot(&r, 0, 0, monotonic_ns());
    pin_slot(&r, 1, 0, monotonic_ns());
    r.reader_slot(1, 1).position(0).store(25, Ordering::Release);
    assert_eq!(r.reader_floor(1, 0, stall), 10);
    assert_eq!(r.reader_floor_past(1, 0, stall, Some(10)), 25);
    assert_eq!(r.reader_floor_past(1, 0, stall, Some(25)), u64::MAX);
    // A slot being claimed holds position 0 whatever was passed: its reader has not
    // said where it starts yet.
    let claim = r.reader_slot(1, 2);
    claim.mark_claimed();
    claim.heartbeat.store(READER_CLAIMING, Ordering::Release);
    assert_eq!(r.reader_floor_past(1, 0, stall, Some(25)), 0);
}

#[test]
fn a_pin_stored_while_a_reclamation_pass_reads_the_pins_waits_for_the_pass_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(Region::create(&dir.path().join("r"), small()).unwrap());
    let stall = std::time::Duration::from_secs(30);
    let patience = std::time::Duration::from_secs(60);
    assert!(r.await_reclaim_passes(1, patience), "no pass under way");
    // Broker 1's reclamation starts a pass and reads the pins: none yet.
    let pass = r.broker_line(1, 1).reclaim_pass;
    pass.add(1, Ordering::SeqCst);
    assert_eq!(r.reader_floor(1, 0, stall), u64::MAX);
    // A reader pins position 10, which it found retained; the pass it raced with may
    // still move the frontier past it, so it must not look for its batch yet.
    pin_slot(&r, 0, 0, monotonic_ns());
    assert!(
        !r.await_reclaim_passes(1, std::time::Duration::ZERO),
        "the pass under way is seen"
    );
    let waiter = {
        let r = r.clone();
        std::thread::spawn(move || {
            let ended = r.await_reclaim_passes(1, patience);
            (ended, r.log(1, 1).reclaimed_blog.load(Ordering::Acquire))
        })
    };
    // The pass moves the frontier, then ends.
    r.broker_line(1, 1)
        .reclaimed_blog
        .advance(4096, Ordering::Release);
    pass.add(1, Ordering::Release);
    let (ended, reclaimed) = waiter.join().unwrap();
    assert!(ended);
    assert_eq!(
        reclaimed, 4096,
        "the waiter sees where the pass left the frontier"
    );
    // The next pass reads the pin.
    pass.add(1, Ordering::SeqCst);
    assert_eq!(r.reader_floor(1, 0, stall), 10);
    pass.add(1, Ordering::Release);
}

#[test]
fn prefault_keeps_the_contents_and_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r");
    let r = Region::create(&path, small()).unwrap();
    r.sequencer_topic(1)
        .committed_seq
        .advance(7, Ordering::Release);
    r.prefault().unwrap();
    assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 7);
    assert_eq!(r.topic_seq(0).committed_seq.load(Ordering::Acquire), 0);
    let again = Region::attach(&path, Some(small())).unwrap();
    assert_eq!(again.topic_seq(1).committed_seq.load(Ordering::Acquire), 7);
}

#[test]
fn create_then_attach_from_another_handle_shares_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    let a = Region::create(&path, small()).unwrap();
    let b = Region::attach(&path, Some(small())).unwrap();
    a.sequencer_topic(1)
        .committed_seq
        .advance(42, Ordering::Release);
    assert_eq!(b.topic_seq(1).committed_seq.load(Ordering::Acquire), 42);
    // The file is sparse: far fewer blocks than its length.
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(&path).unwrap();
    assert!(md.blocks() * 512 < md.len());
}

#[test]
fn attach_checks_magic_version_and_capacities() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    drop(Region::create(&path, small()).unwrap());
    let other = Capacities {
        pbr_slots: 16,
        ..small()
    };
    match Region::attach(&path, Some(other)) {
        Err(RegionError::LayoutMismatch { field, .. }) => assert_eq!(field, "pbr_slots"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("mismatched capacities accepted"),
    }
    // Corrupt the version.
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &9u64.to_le_bytes(), H_VERSION).unwrap();
    assert!(matches!(
        Region::attach(&path, None),
        Err(RegionError::VersionMismatch { found: 9, .. })
    ));
    std::os::unix::fs::FileExt::write_all_at(&f, b"NOTAREGN", 0).unwrap();
    assert!(matches!(
        Region::attach(&path, None),
        Err(RegionError::BadMagic { .. })
    ));
    let garbage = dir.path().join("garbage");
    std::fs::write(&garbage, b"hello").unwrap();
    assert!(Region::attach(&garbage, None).is_err());
}

#[test]
fn topic_meta_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    assert!(r.topic_meta(0).is_none());
    let meta = TopicMeta {
        name: "orders".into(),
        order: 2,
        replication_factor: 1,
        default_ack: 1,
        generation: 3,
        created_unix_ms: 99,
        retention_bytes: 1 << 30,
        retention_ms: 3_600_000,
        position_ceiling: 1 << 40,
    };
    r.write_topic_meta(0, &meta);
    assert_eq!(r.topic_meta(0).unwrap(), meta);
}

#[test]
fn a_deleted_topic_is_neither_described_nor_found_but_keeps_its_slot() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r");
    let r = Region::create(&path, small()).unwrap();
    r.write_topic_meta(1, &TopicMeta::new("gone", 2));
    r.sequencer_topic(1)
        .committed_seq
        .advance(5, Ordering::Release);
    assert!(!r.topic_deleted(1) && !r.topic_deleted(0));
    assert!(r.topic_slot_used(1) && !r.topic_slot_used(0));
    r.delete_topic(1);
    assert!(r.topic_slot_used(1), "until a new region");
    assert!(r.topic_deleted(1), "a free slot is not a deleted one");
    assert!(r.topic_meta(1).is_none());
    assert!(r.find_topic("gone").is_none());
    // What processes still hold of it is left alone for them to let go of.
    assert_eq!(r.topic_seq(1).committed_seq.load(Ordering::Acquire), 5);
    // Another mapping (a follower, a restart reading the previous region) agrees.
    let other = Region::attach(&path, None).unwrap();
    assert!(other.topic_deleted(1) && other.topic_meta(1).is_none());
}

#[test]
fn retiring_shows_in_every_mapping_of_the_region() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r");
    let r = Region::create(&path, small()).unwrap();
    let other = Region::attach(&path, None).unwrap();
    assert!(
        !r.is_retired() && !other.is_retired(),
        "a new region is live"
    );
    other.retire();
    assert!(r.is_retired(), "the other mapping sees it");
    assert!(
        Region::attach(&path, None).unwrap().is_retired(),
        "and it stays"
    );
}

#[test]
fn a_new_region_was_created_this_boot() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    assert!(r.created_this_boot());
    r.word(H_BOOT_ID).fetch_xor(1, Ordering::Relaxed);
    assert!(
        !r.created_this_boot(),
        "a region from another boot is not trusted"
    );
}

#[test]
fn pbr_token_guards_slot_and_detects_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    assert!(r.pbr_read(0, 1, 3).is_none());
    let h = BatchHeader {
        batch_seq: 5,
        num_msg: 2,
        flags: BatchFlags::VALID,
        pbr_index: 3,
        total_size: 128,
        ..Default::default()
    };
    r.pbr_commit(0, 1, 3, &h);
    let got = r.pbr_read(0, 1, 3).unwrap();
    assert_eq!(got.batch_seq, 5);
    assert_eq!(got.publish_commit, 4);
    // Index 11 maps to the same slot (8 slots): the old token must not satisfy it.
    assert!(r.pbr_read(0, 1, 11).is_none());
    r.pbr_commit(0, 1, 11, &BatchHeader { pbr_index: 11, ..h });
    assert!(!r.pbr_holds(0, 1, 3));
    assert!(r.pbr_read(0, 1, 3).is_none());
}

#[test]
fn goi_entry_roundtrip_and_wrap_detection() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    let e = GoiEntry {
        batch_id: 1,
        total_order: 100,
        blog_offset: 4096,
        pbr_index: 7,
        client_id: 9,
        client_seq: 3,
        session_epoch: 0,
        payload_size: 640,
        num_msg: 10,
        broker_id: 1,
        flags: 0,
        replication_token: 0,
        session_key_hash: 0x5eed,
    };
    r.goi_write(1, 5, &e);
    assert_eq!(r.goi_read(1, 5).unwrap(), e);
    assert_eq!(r.goi_slot_occupant(1, 21), Some(5));
    r.goi_write(1, 21, &e);
    assert!(r.goi_read(1, 5).is_none());
}

#[test]
fn blog_pointers_stay_inside_one_mapped_segment() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    assert!(r.blog_ptr(0, 0, 0, 64).is_none(), "unmapped segment");
    r.seg_map_publish(0, 0, 0, 2);
    assert!(r.blog_ptr(0, 0, 0, 8192).is_some());
    assert!(r.blog_ptr(0, 0, 8000, 200).is_none(), "straddles a segment");
    assert!(r.blog_ptr(0, 0, 0, u64::MAX).is_none(), "overflow");
    assert!(r.blog_ptr(0, 0, 8192, 1).is_none(), "next segment unmapped");
    // SAFETY: nothing else uses this log in the test.
    let bytes = unsafe { r.blog_bytes_mut(0, 0, 64, 4).unwrap() };
    bytes.copy_from_slice(b"abcd");
    let other = Region::attach(r.path(), None).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { other.blog_bytes(0, 0, 64, 4).unwrap() }, b"abcd");
}

/// A writer publishes PBR slots around a small ring while a reader follows with
/// the token protocol and reclaims behind itself: the reader sees every index
/// exactly once, in order, with the payload field the writer stored for it.
#[test]
fn pbr_ring_writer_reader_stress() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(Region::create(&dir.path().join("r"), small()).unwrap());
    const N: u64 = 200_000;
    let w = r.clone();
    let writer = std::thread::spawn(move || {
        let log = w.log(0, 0);
        for i in 0..N {
            while i >= log.reclaimed_pbr.load(Ordering::Acquire) + 8 {
                std::hint::spin_loop();
            }
            let h = BatchHeader {
                batch_seq: i * 3,
                num_msg: 1,
                total_size: 64,
                pbr_index: i,
                ..Default::default()
            };
            w.pbr_commit(0, 0, i, &h);
        }
    });
    let line = r.broker_line(0, 0);
    let mut next = 0;
    while next < N {
        match r.pbr_read(0, 0, next) {
            Some(h) => {
                assert_eq!(h.batch_seq, next * 3);
                assert_eq!(h.pbr_index, next);
                next += 1;
                line.reclaimed_pbr.advance(next, Ordering::Release);
            }
            None => std::hint::spin_loop(),
        }
    }
    writer.join().unwrap();
}

/// The GOI seqlock: a writer laps a tiny ring many times while a reader samples
/// arbitrary indices. Whatever `goi_read` returns must be exactly the entry the
/// writer stored for that index, never a mix of two laps.
#[test]
fn goi_readers_never_accept_a_torn_entry() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(Region::create(&dir.path().join("r"), small()).unwrap());
    let entry = |g: u64| GoiEntry {
        batch_id: g,
        total_order: g * 3,
        blog_offset: g * 5,
        pbr_index: g * 7,
        client_id: g * 11,
        client_seq: g * 13,
        session_epoch: g,
        payload_size: g as u32,
        num_msg: (g as u32).wrapping_mul(17),
        broker_id: g as u16,
        flags: 0,
        replication_token: 0,
        session_key_hash: g * 19,
    };
    const N: u64 = 300_000;
    let w = r.clone();
    let writer = std::thread::spawn(move || {
        for g in 0..N {
            w.goi_write(0, g, &entry(g));
        }
    });
    let mut accepted = 0u64;
    let mut probe = 0u64;
    // Until the writer is done and at least one read got through: on a busy machine
    // the writer may finish before this thread first runs.
    while !writer.is_finished() || accepted == 0 {
        let g = probe % N;
        probe = probe
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        if let Some(e) = r.goi_read(0, g) {
            assert_eq!(e, entry(g), "torn or foreign entry accepted for {g}");
            accepted += 1;
        }
        // Also follow the writer closely, where races are likeliest.
        if let Some(latest) = r.goi_slot_occupant(0, probe) {
            if let Some(e) = r.goi_read(0, latest) {
                assert_eq!(e, entry(latest));
                accepted += 1;
            }
        }
    }
    writer.join().unwrap();
    assert!(accepted > 0);
    // At rest, the writer's last lap reads back whole.
    for g in N - small().goi_slots..N {
        assert_eq!(r.goi_read(0, g), Some(entry(g)));
    }
}

/// The sequencer rewrites one session slot over and over, alternating between two
/// clients whose marks differ, while a reader reads it: every read it accepts is
/// one whole record, never one client's id with the other's marks.
#[test]
fn a_session_slot_rewritten_for_another_client_never_reads_torn() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(Region::create(&dir.path().join("r"), small()).unwrap());
    let record = |i: u64| {
        let client = i % 2;
        SessionRecord {
            state: SessionState::Open,
            client_id: client,
            session_epoch: 10 + client,
            opener: 0,
            committed_hwm: 100 * client + i,
            last_active_ms: 0,
            opened_at: client,
            key_hash: 1000 + client,
        }
    };
    const WRITES: u64 = 200_000;
    let writer = {
        let r = r.clone();
        std::thread::spawn(move || {
            for i in 0..WRITES {
                r.session_write(0, 3, &record(i));
            }
        })
    };
    let mut accepted = 0u64;
    // Until the writer is done and at least one read got through (on a busy machine
    // the writer may finish before this thread first runs).
    while !writer.is_finished() || accepted == 0 {
        if let Some(rec) = r.session_read(0, 3) {
            let client = rec.client_id;
            assert_eq!(rec.session_epoch, 10 + client, "{rec:?}");
            assert_eq!(rec.key_hash, 1000 + client, "{rec:?}");
            assert_eq!(rec.committed_hwm % 2, client, "{rec:?}");
            if client == 1 {
                assert!(rec.committed_hwm >= 100, "{rec:?}");
            }
            accepted += 1;
        }
    }
    writer.join().unwrap();
    assert!(accepted > 0);
    assert_eq!(r.session_read(0, 3), Some(record(WRITES - 1)));
}

/// A ring slot moves on only to a later lap: committing an older index over a newer
/// one (a reservation reused after its slot was recycled) stops at the store.
#[test]
#[should_panic(expected = "PBR slot of (0, 1) holds record 11 and would take 3")]
fn a_pbr_slot_never_goes_back_to_an_older_index() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    let h = |pbr_index| BatchHeader {
        flags: BatchFlags::VALID,
        pbr_index,
        ..Default::default()
    };
    r.pbr_commit(0, 1, 11, &h(11));
    r.pbr_commit(0, 1, 3, &h(3));
}

#[test]
#[should_panic(expected = "names another")]
fn a_pbr_slot_takes_only_a_header_naming_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    let h = BatchHeader {
        pbr_index: 4,
        ..Default::default()
    };
    r.pbr_commit(0, 1, 5, &h);
}

#[test]
#[should_panic(expected = "GOI slot of topic 1 holds record 21 and would take 5")]
fn a_goi_slot_never_goes_back_to_an_older_entry() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    r.goi_write(1, 21, &GoiEntry::default());
    r.goi_write(1, 5, &GoiEntry::default());
}

#[test]
#[should_panic(expected = "topic slot 1 deleted while not active")]
fn deleting_a_free_topic_slot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::create(&dir.path().join("r"), small()).unwrap();
    r.delete_topic(1);
}

/// A 32-bit capacity stored in a larger header word is refused, not cut to its low bits
/// (which named a region of 2 topics for one that claimed 2^32 + 2).
#[test]
fn a_header_capacity_too_large_for_its_field_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r");
    let r = Region::create(&path, small()).unwrap();
    let mut head = std::fs::read(&path).unwrap()[..ATTACH_HEAD_LEN].to_vec();
    assert!(Region::check_header(&path, &head, r.len(), None).is_ok());
    let max_topics = H_CAPS as usize;
    head[max_topics..max_topics + 8].copy_from_slice(&((1u64 << 32) | 2).to_le_bytes());
    assert!(matches!(
        Region::check_header(&path, &head, r.len(), None),
        Err(RegionError::BadCapacities(_))
    ));
}
