//! Reading on the caller's thread (`ReadAhead::try_read_here`, what the TypeScript
//! binding's `pollBatch` does): over a shared-memory feed the caller takes what has
//! arrived without a thread in between, the thread polls only for a caller that waits, and
//! every message comes once, in order, however the two kinds of poll interleave; over TCP
//! no frame is read on the caller's thread, and the thread reads ahead as before; and a caller that keeps more than its bound of
//! earlier polls reads nothing more there until it lets go.

mod common;

use embarcadero_client::{
    Collect, MessageRef, Publisher, PublisherConfig, ReadAhead, SharedBatch, Subscriber,
    SubscriberConfig, Transport,
};
use std::sync::mpsc;
use std::time::Duration;

/// Publishes messages `msg-0` .. `msg-{n-1}` in batches of at most `batch_bytes`.
fn publish(t: &common::TestServer, topic: &str, n: u64, batch_bytes: usize) {
    let config = PublisherConfig {
        batch_bytes,
        ..PublisherConfig::default()
    };
    let p = Publisher::connect_brokers(&t.brokers(), topic, config).unwrap();
    for i in 0..n {
        p.publish(format!("msg-{i}").as_bytes()).unwrap();
    }
    p.close().unwrap();
}

/// A poll's messages: each one's index (from its payload) and position, and the batches
/// they lie in, kept alive for as long as the poll is.
#[derive(Default)]
struct Kept {
    batches: Vec<SharedBatch>,
    indexes: Vec<u64>,
    positions: Vec<(u16, u64)>,
}

impl Collect for Kept {
    fn collect(&mut self, batch: &SharedBatch, m: MessageRef<'_>) {
        let same = |b: &SharedBatch| b.as_mut_ptr() == batch.as_mut_ptr();
        if !self.batches.last().is_some_and(same) {
            self.batches.push(batch.clone());
        }
        let text = std::str::from_utf8(m.payload).unwrap();
        self.indexes.push(text["msg-".len()..].parse().unwrap());
        self.positions.push((m.broker_id, m.position));
    }

    fn count(&self) -> usize {
        self.indexes.len()
    }

    fn positions(&self) -> Vec<(u16, u64)> {
        self.positions.clone()
    }
}

/// A subscriber of `topic` over `transport`, whose caller reads on its own thread, with
/// polls of one batch each (whole batches, at least one).
fn reading_here(t: &common::TestServer, topic: &str, transport: Transport) -> ReadAhead<Kept> {
    let config = SubscriberConfig {
        transport,
        ..SubscriberConfig::default()
    };
    let sub = Subscriber::connect_brokers(&t.brokers(), topic, config).unwrap();
    assert_eq!(sub.transport(), format!("{transport:?}").to_lowercase());
    let reader = ReadAhead::new(sub, 2, 1);
    reader.set_caller_reads(true);
    reader
}

/// The next poll: read here if anything has arrived (`true`), else the one the thread
/// read for this caller once it woke it (`false`). Nothing else is ever queued: the thread
/// polls only for a waiting caller, once per wake.
fn next(reader: &ReadAhead<Kept>, max_held: usize) -> (Kept, bool) {
    assert!(reader.try_next().is_none(), "the thread read ahead");
    if let Some(polled) = reader.try_read_here(max_held) {
        return (polled.unwrap().messages, true);
    }
    let (tx, rx) = mpsc::channel();
    if reader.wake_when_ready(move || tx.send(()).unwrap()) {
        // A hang guard, not a timing: a thread that never polled for the waiting caller
        // would fail here.
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the thread polls for a waiting caller");
    }
    let polled = reader.try_next().expect("the poll it was woken for");
    (polled.unwrap().messages, false)
}

/// Takes polls from `next` until they hold `n` messages, and checks that those are the
/// messages published, each once, in position order; how many polls were read here.
fn read_once_in_order(n: u64, mut next: impl FnMut() -> (Kept, bool)) -> usize {
    let (mut indexes, mut positions, mut here) = (Vec::new(), Vec::new(), 0);
    while (indexes.len() as u64) < n {
        let (kept, read_here) = next();
        here += usize::from(read_here);
        indexes.extend(kept.indexes);
        positions.extend(kept.positions.iter().map(|&(_, p)| p));
    }
    assert_eq!(
        positions,
        (0..n).collect::<Vec<_>>(),
        "in order, none missed"
    );
    indexes.sort_unstable();
    assert_eq!(indexes, (0..n).collect::<Vec<_>>(), "once each");
    here
}

#[test]
fn over_a_feed_the_caller_reads_what_has_arrived_and_every_message_comes_once_in_order() {
    let t = common::start();
    t.create_topic("here", 2);
    publish(&t, "here", 3000, 2048);
    let reader = reading_here(&t, "here", Transport::Shm);
    let here = read_once_in_order(3000, || next(&reader, usize::MAX));
    // The thread's poll for the first waiting caller lends one batch of a round of many;
    // the rest of the round is the subscriber's already, so at least that is read here.
    assert!(here > 0, "nothing was read on the caller's thread");
    reader.close();
}

#[test]
fn over_tcp_the_caller_reads_no_frame_and_the_thread_still_reads_ahead() {
    let t = common::start();
    t.create_topic("tcp", 2);
    publish(&t, "tcp", 1000, 2048);
    let tcp = SubscriberConfig {
        transport: Transport::Tcp,
        ..SubscriberConfig::default()
    };
    // Reading a frame that has begun to arrive could wait on the network: a subscriber
    // that holds nothing yet reads nothing without waiting, and a waiting poll then does.
    let mut sub = Subscriber::connect_brokers(&t.brokers(), "tcp", tcp).unwrap();
    assert_eq!(sub.poll_shared_now(usize::MAX, |_, _| {}).unwrap(), 0);
    let waited = sub.poll_shared_upto(Duration::from_secs(60), usize::MAX, |_, _| {});
    assert!(waited.unwrap() > 0);
    drop(sub);
    let reader = reading_here(&t, "tcp", Transport::Tcp);
    // Over TCP the thread reads ahead with no caller waiting (a hang guard, not a timing).
    assert!(
        reader.wait_until_ready(Duration::from_secs(60)),
        "no read-ahead"
    );
    read_once_in_order(1000, || {
        let polled = reader.next_poll(Duration::from_secs(60)).expect("a poll");
        (polled.unwrap().messages, false)
    });
    reader.close();
}

#[test]
fn a_caller_holding_more_than_its_bound_reads_nothing_here_until_it_lets_go() {
    let t = common::start();
    t.create_topic("held", 2);
    publish(&t, "held", 3000, 2048);
    let reader = reading_here(&t, "held", Transport::Shm);
    let (first, _) = next(&reader, usize::MAX);
    assert!(!first.batches.is_empty());
    // The first poll is one batch of a round of many: the rest is there to read, but the
    // caller holds a batch, more than a bound of 0 bytes.
    assert!(reader.try_read_here(0).is_none(), "read while holding");
    drop(first);
    let (second, here) = next(&reader, 0);
    assert!(here, "the rest of the round, once nothing is held");
    assert!(!second.indexes.is_empty());
    reader.close();
}
