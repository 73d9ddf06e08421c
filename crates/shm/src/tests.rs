//! The rings and the handshake checks, in one process (the broker's side gets the same
//! `Mapping` a second process would).

use crate::layout::{self, ack_ring, data_ring, feed_ring, MIN_DATA_CAPACITY};
use crate::ring::{Consumer, Producer, RingMaps, Waited};
use crate::socket::{
    create_channel, create_cursor_page, create_feed, map_client_channel, map_cursor_page, map_feed,
    recv_hello, send_hello,
};
use crate::{Mapping, Span};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn pair(cap: usize) -> (Producer, Consumer, Arc<Mapping>) {
    let (_fd, map) = create_channel(cap).unwrap();
    let map = Arc::new(map);
    (
        Producer::new(map.clone(), data_ring(cap)),
        Consumer::new(map.clone(), data_ring(cap)),
        map,
    )
}

#[test]
fn bytes_cross_the_ring_in_order_across_many_wraps() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, _map) = pair(cap);
    let mut expect = 0u8;
    let mut next = 0u8;
    for round in 0..200 {
        let len = 1000 + round * 37;
        let chunk: Vec<u8> = (0..len)
            .map(|_| {
                next = next.wrapping_add(1);
                next
            })
            .collect();
        assert_eq!(p.write(&chunk).unwrap(), len);
        p.publish();
        assert_eq!(c.available().unwrap(), len);
        let mut out = vec![0; len];
        c.copy_out(&mut out);
        c.consume(len);
        for b in out {
            expect = expect.wrapping_add(1);
            assert_eq!(b, expect);
        }
    }
}

#[test]
fn a_full_ring_takes_no_more_and_write_all_waits_for_room() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, _map) = pair(cap);
    assert_eq!(p.write(&vec![1; cap + 10]).unwrap(), cap);
    assert_eq!(p.write(&[1]).unwrap(), 0);
    p.publish();
    let reader = std::thread::spawn(move || {
        let mut total = 0;
        let mut buf = vec![0; cap];
        while total < 3 * cap {
            assert_eq!(c.wait_available(1, None, || true).unwrap(), Waited::Ready);
            let n = c.available().unwrap();
            c.copy_out(&mut buf[..n]);
            c.consume(n);
            total += n;
        }
        total
    });
    p.write_all(&[&vec![2; cap], &vec![3; cap]], || true)
        .unwrap();
    assert_eq!(reader.join().unwrap(), 3 * cap);
}

/// A producer sleeping for room says where the consumer's head must reach before that
/// room can exist, and the consumer wakes it only from there: freeing less, in many
/// small steps, wakes it not once (each wake-up cost the consumer its CPU on two
/// cores); freeing enough ends the wait.
#[test]
fn a_producer_waiting_for_room_is_woken_only_once_the_consumer_freed_it() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, map) = pair(cap);
    assert_eq!(p.write(&vec![7; cap]).unwrap(), cap);
    p.publish();
    let waiter = std::thread::spawn(move || {
        let far = Instant::now() + Duration::from_secs(600);
        p.wait_room(cap / 2, Some(far), || true).unwrap()
    });
    let place = data_ring(cap);
    let word = |at: usize| map.u32_at(place.producer_line + at);
    // Synchronisation, not timing: the producer is asleep (or about to be) once it has
    // set its waiters word, after its wake point.
    while word(layout::P_SPACE_WAITERS).load(Ordering::SeqCst) == 0 {
        assert!(
            !waiter.is_finished(),
            "the producer stopped waiting without room"
        );
        std::hint::spin_loop();
    }
    assert_eq!(
        word(layout::P_SPACE_WAKE_AT).load(Ordering::SeqCst),
        (cap / 2) as u32
    );
    c.available().unwrap();
    let mut out = vec![0; 256];
    for _ in 0..(cap / 2 / 256 - 1) {
        c.copy_out(&mut out);
        c.consume(out.len());
    }
    assert_eq!(
        c.producer_wakes(),
        0,
        "woken before the room it waits for was free"
    );
    c.copy_out(&mut out);
    c.consume(out.len());
    assert_eq!(waiter.join().unwrap(), Waited::Ready);
    assert!(c.producer_wakes() <= 1);
}

/// The wake point is a position's low 32 bits: reached is decided across the wrap.
#[test]
fn a_wake_point_is_reached_across_the_32_bit_wrap() {
    use crate::ring::reached;
    assert!(reached(10, 10) && reached(11, 10) && !reached(9, 10));
    let before_wrap = (1u64 << 32) - 4;
    assert!(
        !reached(before_wrap, 2),
        "2 lies after the wrap, ahead of the head"
    );
    assert!(reached((1u64 << 32) + 2, 2));
    assert!(
        reached((1u64 << 32) + 2, u32::MAX - 1),
        "a point before the wrap is behind"
    );
}

#[test]
fn a_tail_that_goes_back_or_runs_too_far_ahead_is_a_violation() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, map) = pair(cap);
    p.write(&[7; 100]).unwrap();
    p.publish();
    assert_eq!(c.available().unwrap(), 100);
    let tail = map.u64_at(layout::DATA_PRODUCER + layout::P_TAIL);
    tail.store(50, Ordering::Release);
    let e = c.available().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    let (_p, mut c, map) = pair(cap);
    map.u64_at(layout::DATA_PRODUCER + layout::P_TAIL)
        .store(cap as u64 + 1, Ordering::Release);
    assert_eq!(
        c.available().unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );
}

#[test]
fn a_head_that_passes_the_tail_or_goes_back_is_a_violation() {
    let cap = MIN_DATA_CAPACITY;
    let (_fd, map) = create_channel(cap).unwrap();
    let map = Arc::new(map);
    let mut acks = Producer::new(map.clone(), ack_ring(cap));
    acks.write(&[1; 64]).unwrap();
    acks.publish();
    let head = map.u64_at(layout::ACK_CONSUMER + layout::C_HEAD);
    head.store(65, Ordering::Release);
    assert_eq!(
        acks.room().unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );
    head.store(32, Ordering::Release);
    assert_eq!(acks.room().unwrap(), layout::ACK_CAPACITY - 32);
    head.store(16, Ordering::Release);
    assert_eq!(
        acks.room().unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );
}

#[test]
fn a_wait_ends_at_its_deadline_or_when_the_peer_is_gone() {
    let (_p, mut c, _map) = pair(MIN_DATA_CAPACITY);
    let deadline = Instant::now() + Duration::from_millis(30);
    assert_eq!(
        c.wait_available(1, Some(deadline), || true).unwrap(),
        Waited::TimedOut
    );
    assert_eq!(c.wait_available(1, None, || false).unwrap(), Waited::Gone);
}

#[test]
fn the_memfd_and_hello_cross_a_socket_and_the_broker_maps_the_same_memory() {
    let (client, broker) = UnixStream::pair().unwrap();
    let (fd, map) = create_channel(MIN_DATA_CAPACITY).unwrap();
    send_hello(&client, &[9u8; 128], &fd).unwrap();
    let mut hello = [0u8; 128];
    let got = recv_hello(&broker, &mut hello, Duration::from_secs(5)).unwrap();
    assert_eq!(hello, [9u8; 128]);
    let (theirs, cap) = map_client_channel(&got, 1 << 20).unwrap();
    assert_eq!(cap, MIN_DATA_CAPACITY);
    map.u64_at(layout::DATA_PRODUCER)
        .store(42, Ordering::Release);
    assert_eq!(
        theirs.u64_at(layout::DATA_PRODUCER).load(Ordering::Acquire),
        42
    );
}

#[test]
fn the_broker_refuses_an_unsealed_fd_a_bad_descriptor_and_an_oversized_ring() {
    let plain = tempfile_fd();
    let e = map_client_channel(&plain, 1 << 20).err().unwrap();
    assert!(e.contains("sealable memfd"), "{e}");
    let unsealed =
        nix::sys::memfd::memfd_create("t", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    nix::unistd::ftruncate(&unsealed, layout::channel_len(MIN_DATA_CAPACITY) as i64).unwrap();
    let e = map_client_channel(&unsealed, 1 << 20).err().unwrap();
    assert!(
        e.contains("sealable memfd") || e.contains("not sealed"),
        "{e}"
    );
    // Sealed against writing too: refused naming the seal (mapping it failed with EPERM).
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    let flags =
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING;
    let frozen = nix::sys::memfd::memfd_create("t", flags).unwrap();
    nix::unistd::ftruncate(&frozen, layout::channel_len(MIN_DATA_CAPACITY) as i64).unwrap();
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_FUTURE_WRITE;
    fcntl(&frozen, FcntlArg::F_ADD_SEALS(seals)).unwrap();
    let e = map_client_channel(&frozen, 1 << 20).err().unwrap();
    assert!(e.contains("sealed against writing"), "{e}");
    let (fd, map) = create_channel(MIN_DATA_CAPACITY).unwrap();
    let e = map_client_channel(&fd, MIN_DATA_CAPACITY / 2)
        .err()
        .unwrap();
    assert!(e.contains("above this broker"), "{e}");
    map.u64_at(layout::D_DATA_CAPACITY)
        .store(3 << 20, Ordering::Release);
    let e = map_client_channel(&fd, 1 << 30).err().unwrap();
    assert!(e.contains("power of two"), "{e}");
    map.u64_at(layout::D_DATA_CAPACITY)
        .store(1 << 20, Ordering::Release);
    let e = map_client_channel(&fd, 1 << 30).err().unwrap();
    assert!(e.contains("its rings need"), "{e}");
    map.u64_at(layout::D_MAGIC).store(1, Ordering::Release);
    let e = map_client_channel(&fd, 1 << 30).err().unwrap();
    assert!(e.contains("magic"), "{e}");
}

fn tempfile_fd() -> std::os::fd::OwnedFd {
    let path = std::env::temp_dir().join(format!("embarcadero-shm-test-{}", std::process::id()));
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(1 << 20).unwrap();
    let _ = std::fs::remove_file(&path);
    f.into()
}

/// A feed as a broker makes it and a subscriber maps it: the subscriber's view of the
/// ring is read-only and the broker's of the cursor page too, and bytes still cross the
/// ring in order across wraps, with each side writing only its own mapping.
#[test]
fn a_feed_crosses_between_two_mappings_each_written_by_one_side_only() {
    let cap = MIN_DATA_CAPACITY;
    let (feed_fd, feed) = create_feed(cap).unwrap();
    let (page_fd, page) = create_cursor_page().unwrap();
    let (view, got) = map_feed(&feed_fd).unwrap();
    assert_eq!(got, cap);
    let broker_page = map_cursor_page(&page_fd).unwrap();
    assert!(!view.is_writable() && !broker_page.is_writable());
    let mut p = Producer::split(
        RingMaps {
            producer: Arc::new(feed),
            consumer: Arc::new(broker_page),
        },
        feed_ring(cap),
    );
    let mut c = Consumer::split(
        RingMaps {
            producer: Arc::new(view),
            consumer: Arc::new(page),
        },
        feed_ring(cap),
    );
    let mut sent = 0u64;
    let mut got = 0u64;
    for round in 0..100u64 {
        let chunk: Vec<u8> = (0..5000 + round * 13).map(|i| (sent + i) as u8).collect();
        p.write_all(&[&chunk], || true).unwrap();
        sent += chunk.len() as u64;
        let n = c.available().unwrap();
        let mut out = vec![0; n];
        c.copy_out(&mut out);
        c.consume(n);
        for b in out {
            assert_eq!(b, got as u8);
            got += 1;
        }
    }
    assert_eq!((sent, got), (sent, sent));
    assert_eq!(
        p.room().unwrap(),
        cap,
        "the producer sees every byte consumed"
    );
}

/// What a subscriber (or a broker) is handed must carry the seals that protect it: a
/// feed without `F_SEAL_FUTURE_WRITE` (the broker could be handing out a writable view
/// of something else), or a cursor page of the wrong size, is refused.
#[test]
fn an_unsealed_feed_or_a_wrong_cursor_page_is_refused() {
    let (fd, _map) = create_channel(MIN_DATA_CAPACITY).unwrap();
    let e = map_feed(&fd).err().unwrap();
    assert!(e.contains("must carry"), "{e}");
    let e = map_cursor_page(&fd).err().unwrap();
    assert!(e.contains("must be 4096"), "{e}");
    let (feed_fd, _feed) = create_feed(MIN_DATA_CAPACITY).unwrap();
    let e = map_cursor_page(&feed_fd).err().unwrap();
    assert!(e.contains("must be 4096"), "{e}");
}

/// Reads everything the consumer has been published.
fn drain(c: &mut Consumer) -> Vec<u8> {
    let n = c.available().unwrap();
    let mut out = vec![0u8; n];
    c.copy_out(&mut out);
    c.consume(n);
    out
}

#[test]
fn a_lent_span_is_published_only_when_committed_and_kept_until_dropped() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, _map) = pair(cap);
    let mut span = p.lend(1000).unwrap().expect("an empty ring lends");
    assert!(p.lend(10).unwrap().is_none(), "one span at a time");
    span.write_at(8, &[7u8; 100]);
    assert_eq!(
        c.available().unwrap(),
        0,
        "nothing of a lent span is published"
    );
    assert!(p.commit(&mut span, 108, &[1u8; 8]));
    let got = drain(&mut c);
    assert_eq!(&got[..8], &[1u8; 8]);
    assert_eq!(&got[8..], &[7u8; 100][..]);
    // Consumed, but kept: the producer's room does not count it free.
    assert_eq!(p.room().unwrap(), cap - 108);
    assert_eq!(
        span.read_out(8, 100),
        vec![7u8; 100],
        "kept bytes stay as written"
    );
    drop(span);
    assert_eq!(p.room().unwrap(), cap, "a dropped span frees its bytes");
}

/// The write prefetch is a hint: asked over a span that wraps the ring's end, past the
/// span's limit, empty, and before and after a commit, it changes no byte and never
/// reaches outside the span's pieces (its `pieces` assertion would panic).
#[test]
fn a_write_prefetch_of_a_wrapping_span_changes_nothing() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, _map) = pair(cap);
    assert_eq!(p.write(&vec![3u8; cap - 100]).unwrap(), cap - 100);
    p.publish();
    assert_eq!(drain(&mut c).len(), cap - 100);
    let mut span = p.lend(1000).unwrap().expect("a consumed ring lends again");
    let start = span.lent().start as usize % cap;
    assert!(
        start + 1000 > cap,
        "the span wraps: it starts at {start} of {cap}"
    );
    let body: Vec<u8> = (0..992u32).map(|i| i as u8).collect();
    span.write_at(8, &body);
    for (offset, len) in [
        (0, 1000),
        (50, 100),
        (90, 20),
        (990, 64),
        (1000, 64),
        (5, 0),
    ] {
        span.prefetch_for_write(offset, len);
    }
    span.prefetch_for_write(usize::MAX - 1, 8);
    assert!(p.commit(&mut span, 1000, &[1u8; 8]));
    span.prefetch_for_write(0, 1000);
    let got = drain(&mut c);
    assert_eq!((&got[..8], &got[8..]), (&[1u8; 8][..], &body[..]));
}

#[test]
fn a_dropped_uncommitted_span_is_cancelled_and_the_ring_moves_on() {
    let (mut p, mut c, _map) = pair(MIN_DATA_CAPACITY);
    let mut span = p.lend(500).unwrap().unwrap();
    span.write_at(0, &[9u8; 500]);
    drop(span);
    assert!(!p.is_lent());
    assert_eq!(p.write(b"after").unwrap(), 5);
    p.publish();
    assert_eq!(
        drain(&mut c),
        b"after",
        "the cancelled span left no byte behind"
    );
}

#[test]
fn a_span_is_committed_only_by_its_own_ring() {
    let (mut p1, _c1, _m1) = pair(MIN_DATA_CAPACITY);
    let (mut p2, mut c2, _m2) = pair(MIN_DATA_CAPACITY);
    let mut span = p1.lend(100).unwrap().unwrap();
    assert!(!p2.commit(&mut span, 100, &[0u8; 8]), "another ring's span");
    assert_eq!(c2.available().unwrap(), 0);
    assert!(p1.commit(&mut span, 100, &[0u8; 8]));
}

/// Issue 26's revert: a publisher drops a kept span when its batch is acknowledged, and
/// at order 5 that acknowledgement can wait for a batch this producer has still to
/// write (a failover's moved batch). So a write never waits for kept spans the consumer
/// has read: it copies them out of the ring, and the spans still read what was committed.
#[test]
fn a_write_copies_out_kept_spans_the_consumer_has_read_instead_of_waiting_for_them() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, _map) = pair(cap);
    // Four kept spans fill the ring; the consumer reads them all; none is dropped.
    let mut spans = Vec::new();
    for i in 0..4u8 {
        let mut span = p.lend(cap / 4).unwrap().expect("room for a quarter");
        span.write_at(8, &vec![i; cap / 4 - 8]);
        assert!(p.commit(&mut span, cap / 4, &[0xA0 + i; 8]));
        spans.push(span);
    }
    assert_eq!(drain(&mut c).len(), cap);
    assert_eq!(p.room().unwrap(), 0, "kept spans hold the ring");
    // A write of half the ring goes in at once: the two oldest spans are copied out.
    let fresh = vec![0xEE; cap / 2];
    assert_eq!(p.write(&fresh).unwrap(), cap / 2, "the write did not wait");
    assert_eq!(p.copied_out(), 2);
    p.publish();
    assert_eq!(drain(&mut c), fresh);
    for (i, span) in spans.iter().enumerate() {
        let i = i as u8;
        assert_eq!(span.read_out(0, 8), vec![0xA0 + i; 8], "span {i}'s header");
        assert_eq!(
            span.read_out(8, cap / 4 - 8),
            vec![i; cap / 4 - 8],
            "span {i}"
        );
    }
    // Dropping them, copied out or not, frees the rest (the consumer read it all).
    drop(spans);
    assert_eq!(p.room().unwrap(), cap);
    assert_eq!(p.write(&vec![1; cap / 2]).unwrap(), cap / 2);
    assert_eq!(p.copied_out(), 2, "nothing kept: nothing to copy out");
}

/// A kept span the consumer has not read yet is never copied out: the room it holds
/// is the consumer's to give.
#[test]
fn kept_spans_the_consumer_has_not_read_stay_in_the_ring() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, _map) = pair(cap);
    let mut span = p.lend(cap / 2).unwrap().unwrap();
    assert!(p.commit(&mut span, cap / 2, &[1; 8]));
    assert_eq!(
        p.write(&vec![2; cap]).unwrap(),
        cap / 2,
        "only the free half"
    );
    p.publish();
    assert_eq!(p.write(&[3]).unwrap(), 0, "the consumer has read nothing");
    assert_eq!(p.copied_out(), 0);
    let mut some = vec![0u8; 100];
    assert_eq!(c.available().unwrap(), cap);
    c.copy_out(&mut some);
    c.consume(100);
    assert_eq!(
        p.write(&[3; 200]).unwrap(),
        100,
        "what the consumer read, no more"
    );
    assert_eq!(p.copied_out(), 1);
    assert_eq!(span.read_out(0, 8), vec![1; 8]);
}

/// Spans read out (and dropped) by other threads while the producer copies kept spans
/// out and overwrites their bytes: every read sees the committed bytes, and every span
/// comes back exactly once (the producer's assertions check that).
#[test]
fn spans_read_and_dropped_by_other_threads_while_the_producer_reclaims_stay_intact() {
    let cap = MIN_DATA_CAPACITY;
    let (mut p, mut c, _map) = pair(cap);
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Span, u8)>(64);
    let reader = std::thread::spawn(move || {
        let mut reads = 0u64;
        for (span, fill) in rx {
            for _ in 0..3 {
                assert_eq!(span.read_out(8, 4088), vec![fill; 4088]);
                reads += 1;
            }
        }
        reads
    });
    // Every 16th span is held here to the end, so the ring must be reclaimed past it.
    let mut held = Vec::new();
    for round in 0..2000u32 {
        let fill = (round % 251) as u8;
        if let Some(mut span) = p.lend(4096).unwrap() {
            span.write_at(0, &[fill; 4096]);
            assert!(p.commit(&mut span, 4096, &[fill; 8]));
            if round % 16 == 0 {
                held.push((span, fill));
            } else {
                tx.send((span, fill)).unwrap();
            }
        } else {
            let n = p.write(&[fill ^ 0xFF; 4096]).unwrap();
            assert!(n > 0 || c.available().unwrap() > 0, "room once consumed");
            p.publish();
        }
        let n = c.available().unwrap();
        c.consume(n);
    }
    drop(tx);
    assert!(reader.join().unwrap() > 0);
    assert!(p.copied_out() > 0, "the producer copied kept spans out");
    for (span, fill) in &held {
        assert_eq!(span.read_out(8, 4088), vec![*fill; 4088]);
    }
}

#[test]
#[should_panic(expected = "nothing is written while a span is lent")]
fn writing_while_a_span_is_lent_is_a_bug() {
    let (mut p, _c, _map) = pair(MIN_DATA_CAPACITY);
    let _span = p.lend(100).unwrap().unwrap();
    let _ = p.write(b"x");
}

mod lend_model {
    //! The claim/commit protocol against a model: random lends, commits, cancels,
    //! plain writes, consumption and out-of-order returns (the acknowledgements).
    use super::*;
    use crate::Span;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Lend `limit` bytes, write `fill` of them, then commit (`true`) or drop.
        Build {
            limit: usize,
            fill: usize,
            commit: bool,
        },
        Write(usize),
        Consume(usize),
        /// Drop the kept span at this index (modulo how many there are).
        Return(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..20_000, 0usize..20_000, any::<bool>()).prop_map(|(limit, fill, commit)| {
                Op::Build {
                    limit,
                    fill: fill.min(limit),
                    commit,
                }
            }),
            (1usize..20_000).prop_map(Op::Write),
            (1usize..40_000).prop_map(Op::Consume),
            any::<usize>().prop_map(Op::Return),
        ]
    }

    /// Distinct bytes for every write, so a misplaced byte shows.
    fn pattern(seed: &mut u32, len: usize) -> Vec<u8> {
        (0..len)
            .map(|_| {
                *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (*seed >> 24) as u8
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn the_consumer_reads_exactly_what_was_committed_or_written_and_kept_bytes_never_change(
            ops in proptest::collection::vec(op(), 1..120)
        ) {
            let cap = MIN_DATA_CAPACITY;
            let (mut p, mut c, _map) = pair(cap);
            let mut expected: Vec<u8> = Vec::new();
            let mut read = 0usize;
            let mut kept: Vec<(Span, Vec<u8>)> = Vec::new();
            let mut seed = 1u32;
            for op in ops {
                match op {
                    Op::Build { limit, fill, commit } => {
                        let Some(mut span) = p.lend(limit).unwrap() else {
                            // Refused only for want of room.
                            prop_assert!(p.room().unwrap() < limit);
                            continue;
                        };
                        let len = fill.max(8);
                        let len = len.min(limit);
                        let body = pattern(&mut seed, len);
                        span.write_at(0, &body);
                        if commit && len >= 8 {
                            let header = pattern(&mut seed, 8);
                            prop_assert!(p.commit(&mut span, len, &header));
                            let mut bytes = body.clone();
                            bytes[..8].copy_from_slice(&header);
                            expected.extend_from_slice(&bytes);
                            kept.push((span, bytes));
                        }
                    }
                    Op::Write(n) => {
                        let bytes = pattern(&mut seed, n);
                        let done = p.write(&bytes).unwrap();
                        // Kept spans never hold a write back: only what the consumer
                        // has not read does.
                        prop_assert_eq!(done, n.min(cap - (expected.len() - read)));
                        p.publish();
                        expected.extend_from_slice(&bytes[..done]);
                    }
                    Op::Consume(n) => {
                        let n = n.min(c.available().unwrap());
                        let mut out = vec![0u8; n];
                        c.copy_out(&mut out);
                        c.consume(n);
                        prop_assert_eq!(&out[..], &expected[read..read + n]);
                        read += n;
                    }
                    Op::Return(i) if !kept.is_empty() => {
                        let (span, bytes) = kept.remove(i % kept.len());
                        prop_assert_eq!(span.read_out(0, bytes.len()), bytes);
                    }
                    Op::Return(_) => {}
                }
                for (span, bytes) in &kept {
                    prop_assert_eq!(&span.read_out(0, bytes.len()), bytes);
                }
            }
            let rest = drain(&mut c);
            prop_assert_eq!(&rest[..], &expected[read..]);
        }
    }
}

/// Signals handled by [`a_signal_while_a_hello_is_awaited_does_not_fail_the_handshake`].
static SIGNALS_HANDLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn count_signal(_: libc::c_int) {
    SIGNALS_HANDLED.fetch_add(1, Ordering::SeqCst);
}

/// Whether thread `tid` of this process is blocked in `recvmsg` (`/proc`'s syscall file
/// names the call a sleeping thread is in).
fn blocked_in_recvmsg(tid: libc::pid_t) -> bool {
    let path = format!("/proc/self/task/{tid}/syscall");
    std::fs::read_to_string(path)
        .is_ok_and(|s| s.split_whitespace().next() == Some(libc::SYS_recvmsg.to_string().as_str()))
}

/// A signal handled while a hello is awaited does not end the wait. A socket with a
/// receive timeout is never restarted after a handler runs (signal(7)), so `recvmsg`
/// fails with EINTR, which was taken for a failed handshake: an orchestrator that got a
/// signal while opening its channel lost its broker (seen in the Tasker peer runs).
#[test]
fn a_signal_while_a_hello_is_awaited_does_not_fail_the_handshake() {
    // SAFETY: installs a handler that only adds to an atomic (async-signal-safe) for
    // SIGUSR1, which nothing else in this test binary uses; the struct is fully set
    // (zeroed, then the handler, no flags: no SA_RESTART, and an empty mask).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = count_signal as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()),
            0
        );
    }
    let (client, broker) = UnixStream::pair().unwrap();
    let (ids_tx, ids_rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // SAFETY: both only return the calling thread's ids.
        ids_tx
            .send(unsafe { (libc::pthread_self(), libc::gettid()) })
            .unwrap();
        let mut hello = [0u8; 128];
        recv_hello(&broker, &mut hello, Duration::from_secs(60)).map(|_| hello)
    });
    let (thread, tid) = ids_rx.recv().unwrap();
    while !blocked_in_recvmsg(tid) {
        std::thread::yield_now();
    }
    // SAFETY: `thread` is alive: it is blocked in recvmsg until the hello is sent.
    assert_eq!(unsafe { libc::pthread_kill(thread, libc::SIGUSR1) }, 0);
    while SIGNALS_HANDLED.load(Ordering::SeqCst) == 0 {
        std::thread::yield_now();
    }
    // Handled: the waiter is either back in recvmsg (waiting on) or has returned.
    while !waiter.is_finished() && !blocked_in_recvmsg(tid) {
        std::thread::yield_now();
    }
    let (fd, _map) = create_channel(MIN_DATA_CAPACITY).unwrap();
    send_hello(&client, &[7u8; 128], &fd).unwrap();
    let hello = waiter
        .join()
        .unwrap()
        .expect("the handshake survives the signal");
    assert_eq!(hello, [7u8; 128]);
}
