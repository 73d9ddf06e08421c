//! `bench --mode failure`: broker failure under load. Starts a cluster of real processes
//! from this executable (a head and follower brokers, `embarcadero_cli::local_cluster`),
//! publishes with the normal bench publishers while one subscriber reads everything
//! (through the brokers that stay alive),
//! SIGKILLs the last follower partway, and reports throughput before and after the kill,
//! the longest stall of the acknowledged prefix after it (and when the prefix moved
//! again), the time until every batch sealed before the kill was acknowledged, and
//! whether every acknowledged message was delivered exactly once in one order.

use super::{
    add_ceiling_ratios, common_figures, measure_ceilings, merge, message_count, print_ceilings,
    print_run_header, progress_bar, publish_all, tempdir, BenchArgs, PublishOutcome, Publishing,
    RunConfig,
};
use crate::publish::report;
use crate::CliResult;
use embarcadero_cli::local_cluster::{ClusterSpec, LocalCluster};
use embarcadero_client::{Admin, Publisher, Subscriber, SubscriberConfig, TopicSpec};
use indicatif::ProgressBar;
use serde::Serialize;
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bits of a message id that number the messages of one publisher.
const SEQ_BITS: u32 = 48;

/// The id `bench --mode failure` writes into the first 8 bytes of each message: the
/// publisher's index above the message's sequence number within that publisher.
pub fn message_id(publisher: usize, seq: u64) -> u64 {
    ((publisher as u64) << SEQ_BITS) | seq
}

pub fn check_args(args: &BenchArgs) -> CliResult {
    if args.control.is_some() {
        return Err("--mode failure starts its own cluster of processes; drop --control".into());
    }
    if let Some(order) = args.order.iter().find(|o| !matches!(o, 2 | 5)) {
        return Err(format!(
            "--mode failure needs order 2 or 5, not {order}: publishers fail over from a dead broker only where there is a global order"
        ));
    }
    if args.ack == 0 {
        return Err("--mode failure measures acknowledgements: use --ack 1 or 2".into());
    }
    if args.brokers < 2 {
        return Err("--mode failure needs --brokers 2 or more (the head's and a follower)".into());
    }
    if args.size < 8 {
        return Err(
            "--mode failure writes each message's id into its first 8 bytes: use --size 8 or more"
                .into(),
        );
    }
    if args.publishers >= 1 << (64 - SEQ_BITS) {
        return Err("--mode failure numbers at most 65535 publishers".into());
    }
    if let Some(after) = args.kill_after_secs {
        if !(after.is_finite() && after >= 0.0) {
            return Err("--kill-after-secs takes a number of seconds, 0 or more".into());
        }
        if args.duration.is_some_and(|d| after >= d) {
            return Err("--kill-after-secs must fall before the end of --duration".into());
        }
    }
    Ok(())
}

/// When the follower dies.
#[derive(Debug, Clone, Copy)]
enum KillAt {
    /// This long after publishing starts.
    Elapsed(Duration),
    /// Once this many messages are published.
    Published(u64),
}

fn kill_at(args: &BenchArgs) -> KillAt {
    match (args.kill_after_secs, args.duration, message_count(args)) {
        (Some(secs), _, _) => KillAt::Elapsed(Duration::from_secs_f64(secs)),
        (None, Some(duration), _) => KillAt::Elapsed(Duration::from_secs_f64(duration / 3.0)),
        (None, None, count) => KillAt::Published(count.unwrap_or(0) / 3),
    }
}

/// What happened around the kill, as the publishers saw it.
struct Timeline {
    /// From the start of publishing to the kill.
    killed_after: Duration,
    /// Messages published before the kill (counted in steps of 64 per publisher).
    published_at_kill: u64,
    /// The longest time, from the kill to the end of the run, that a publisher's
    /// acknowledged prefix stood still while it had batches outstanding: the failover
    /// of the batches on the dead broker, sealed before the kill or after it (until
    /// the publisher noticed).
    longest_stall: Duration,
    /// From the kill until the prefix moved again at the end of that stall.
    stall_ended: Duration,
    /// From the kill until every batch sealed before it was acknowledged.
    all_prior_acked: Option<Duration>,
}

/// Waits for the kill moment, SIGKILLs broker `victim`'s process, then samples every
/// publisher's acknowledged prefix each millisecond until publishing ends.
fn kill_and_watch(
    p: &Publishing,
    cluster: &mut LocalCluster,
    victim: u32,
    when: KillAt,
    bar: &ProgressBar,
) -> Result<Timeline, String> {
    loop {
        if p.finished() {
            return Err(format!(
                "publishing ended before the kill ({} messages): give a larger --total-bytes or --duration, or a smaller --kill-after-secs",
                p.progress()
            ));
        }
        let due = match when {
            KillAt::Elapsed(after) => p.start.elapsed() >= after,
            KillAt::Published(count) => p.progress() >= count,
        };
        if due {
            break;
        }
        bar.set_position(p.progress());
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed_at = cluster.kill_follower(victim)?;
    let killed_after = killed_at.duration_since(p.start);
    let published_at_kill = p.progress();
    let marks: Vec<u64> = p.publishers.iter().map(Publisher::batches_sealed).collect();
    let mut prefixes: Vec<u64> = p.publishers.iter().map(Publisher::acked_prefix).collect();
    let mut moved_at = vec![killed_at; p.publishers.len()];
    let (mut longest_stall, mut stall_ended) = (Duration::ZERO, Duration::ZERO);
    let mut all_prior_acked = None;
    loop {
        let done = p.finished();
        let now = Instant::now();
        for (i, publisher) in p.publishers.iter().enumerate() {
            let prefix = publisher.acked_prefix();
            if prefix != prefixes[i] {
                if now - moved_at[i] > longest_stall {
                    longest_stall = now - moved_at[i];
                    stall_ended = now - killed_at;
                }
                prefixes[i] = prefix;
                moved_at[i] = now;
            } else if prefix == publisher.batches_sealed() {
                // Nothing outstanding: waiting for the next batch is not a stall.
                moved_at[i] = now;
            }
        }
        if all_prior_acked.is_none() && prefixes.iter().zip(&marks).all(|(p, m)| p >= m) {
            all_prior_acked = Some(now - killed_at);
        }
        if done {
            break;
        }
        bar.set_position(p.progress());
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(Timeline {
        killed_after,
        published_at_kill,
        longest_stall,
        stall_ended,
        all_prior_acked,
    })
}

/// The result of the exactly-once check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub passed: bool,
    /// Messages published, every one acknowledged (the publishers' flush succeeded).
    pub published: u64,
    pub delivered: u64,
    /// Deliveries of a message already delivered.
    pub duplicates: u64,
    /// Published messages never delivered.
    pub missing: u64,
    /// Deliveries whose position was not the one after the previous delivery's.
    pub out_of_place: u64,
    /// Deliveries that are no message of this run's publishers.
    pub unknown: u64,
    /// Order 5: deliveries of a publisher's message before one it published earlier.
    pub out_of_session_order: Option<u64>,
    /// Positions in the topic beyond the published messages.
    pub beyond_published: u64,
}

/// Checks a subscriber's deliveries, one at a time, against the messages published:
/// one total order means contiguous positions from 0, exactly once means every
/// publisher's ids 0..published once each; order 5 also keeps each session's order.
pub struct Verifier {
    session_order: bool,
    next_position: u64,
    /// Per publisher, one bit per message id delivered.
    seen: Vec<Vec<u64>>,
    last_seq: Vec<Option<u64>>,
    delivered: u64,
    duplicates: u64,
    out_of_place: u64,
    unknown: u64,
    out_of_session_order: u64,
}

impl Verifier {
    pub fn new(order: u8, publishers: usize) -> Self {
        Self {
            session_order: order == 5,
            next_position: 0,
            seen: vec![Vec::new(); publishers],
            last_seq: vec![None; publishers],
            delivered: 0,
            duplicates: 0,
            out_of_place: 0,
            unknown: 0,
            out_of_session_order: 0,
        }
    }

    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    pub fn observe(&mut self, position: u64, payload: &[u8]) {
        self.delivered += 1;
        if position != self.next_position {
            self.out_of_place += 1;
        }
        self.next_position = position + 1;
        let Some(id) = payload
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        else {
            self.unknown += 1;
            return;
        };
        let (publisher, seq) = ((id >> SEQ_BITS) as usize, id & ((1 << SEQ_BITS) - 1));
        let Some(bits) = self.seen.get_mut(publisher) else {
            self.unknown += 1;
            return;
        };
        let word = (seq / 64) as usize;
        // Ids arrive close to publish order; a jump far ahead is no id of ours (and
        // must not make the bitmap huge).
        if word >= bits.len() {
            if word > bits.len() * 2 + (1 << 16) {
                self.unknown += 1;
                return;
            }
            bits.resize(word + 1, 0);
        }
        let bit = 1u64 << (seq % 64);
        if bits[word] & bit != 0 {
            self.duplicates += 1;
        } else {
            bits[word] |= bit;
        }
        if self.session_order {
            if self.last_seq[publisher].is_some_and(|last| seq <= last) {
                self.out_of_session_order += 1;
            }
            self.last_seq[publisher] = Some(seq);
        }
    }

    /// The verdict, given how many messages each publisher published and where the
    /// topic ends (its next position).
    pub fn finish(mut self, published: &[u64], topic_end: u64) -> Check {
        let mut missing = 0;
        for (p, bits) in self.seen.iter().enumerate() {
            let count = published.get(p).copied().unwrap_or(0);
            let mut present = 0;
            for (w, word) in bits.iter().enumerate() {
                let first = w as u64 * 64;
                // Bits of ids below `count` count as delivered; the rest were never published.
                let valid = match count.saturating_sub(first) {
                    0 => 0,
                    n if n >= 64 => u64::MAX,
                    n => (1u64 << n) - 1,
                };
                present += u64::from((word & valid).count_ones());
                self.unknown += u64::from((word & !valid).count_ones());
            }
            missing += count - present;
        }
        let total: u64 = published.iter().sum();
        let beyond_published = topic_end.saturating_sub(total);
        let out_of_session_order = self.session_order.then_some(self.out_of_session_order);
        let passed = self.delivered == total
            && self.duplicates == 0
            && missing == 0
            && self.out_of_place == 0
            && self.unknown == 0
            && self.out_of_session_order == 0
            && beyond_published == 0;
        Check {
            passed,
            published: total,
            delivered: self.delivered,
            duplicates: self.duplicates,
            missing,
            out_of_place: self.out_of_place,
            unknown: self.unknown,
            out_of_session_order,
            beyond_published,
        }
    }
}

/// Reads the topic from position 0 through `brokers` on its own thread until it has
/// delivered as many messages as `target` says were published (unknown, u64::MAX,
/// until publishing ends; 0 gives up), feeding a [`Verifier`].
fn spawn_verifier(
    brokers: &[String],
    topic: &str,
    order: u8,
    publishers: usize,
    target: Arc<AtomicU64>,
) -> Result<std::thread::JoinHandle<Result<Verifier, String>>, String> {
    let mut subscriber = Subscriber::connect_brokers(brokers, topic, SubscriberConfig::default())
        .map_err(|e| format!("cannot subscribe to check the deliveries: {e}"))?;
    Ok(std::thread::spawn(move || {
        let mut verifier = Verifier::new(order, publishers);
        let mut last_delivery = Instant::now();
        while verifier.delivered() < target.load(Ordering::Acquire) {
            let n = subscriber
                .poll_with(Duration::from_millis(100), |m| {
                    verifier.observe(m.position, m.payload)
                })
                .map_err(|e| format!("the checking subscriber failed: {e}"))?;
            if n > 0 {
                last_delivery = Instant::now();
            } else if last_delivery.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "the checking subscriber received nothing for 30 s after {} messages",
                    verifier.delivered()
                ));
            }
        }
        Ok(verifier)
    }))
}

/// The cluster of a failure run, its topic, and the follower to be killed.
struct Setup {
    cluster: LocalCluster,
    topic: String,
    victim: u32,
    victim_addr: String,
    /// The brokers that stay alive, for the checking subscriber.
    survivors: Vec<String>,
}

/// Starts the cluster and makes the topic.
fn set_up(args: &BenchArgs, config: RunConfig) -> Result<Setup, String> {
    let program = std::env::current_exe()
        .map_err(|e| format!("cannot find this executable to start the cluster: {e}"))?;
    let mut spec = ClusterSpec::new(program, args.brokers);
    spec.epoch_us = Some(args.epoch_us);
    spec.region_dir = args.region_dir.clone();
    spec.replica_dirs = args.replica_dir.clone();
    let cluster = LocalCluster::start(&spec)?;
    let victim = args.brokers - 1;
    let topic = format!("bench-failure-{}-{}", config.order, std::process::id());
    let admin = Admin::new(&cluster.control);
    admin
        .create_topic(&TopicSpec::new(&topic, config.order).replicated(args.rf))
        .map_err(|e| e.to_string())?;
    let (victims, survivors): (Vec<_>, Vec<_>) = admin
        .cluster()
        .map_err(|e| e.to_string())?
        .brokers
        .into_iter()
        .partition(|b| b.id == victim);
    let victim_addr = victims
        .into_iter()
        .next()
        .map(|b| b.addr)
        .ok_or_else(|| format!("broker {victim} is not in the cluster"))?;
    Ok(Setup {
        cluster,
        topic,
        victim,
        victim_addr,
        survivors: survivors.into_iter().map(|b| b.addr).collect(),
    })
}

/// Publishes while the victim is killed and a subscriber checks every delivery.
fn publish_and_check(
    args: &BenchArgs,
    config: RunConfig,
    setup: &mut Setup,
) -> Result<(PublishOutcome, Timeline, Check), String> {
    let control = setup.cluster.control.clone();
    let target = Arc::new(AtomicU64::new(u64::MAX));
    let publishers = args.publishers.max(1);
    // The checking subscriber reads through the brokers that stay alive: the reader
    // slot of a subscriber served by the killed broker keeps pinning memory until it
    // goes stale (broker.reader_stall_timeout_ms, 30 s), which stalls every publisher
    // of a memory-only topic for that long (see docs/PERFORMANCE.md).
    let verifier = spawn_verifier(
        &setup.survivors,
        &setup.topic,
        config.order,
        publishers,
        target.clone(),
    )?;
    let bar = progress_bar(message_count(args));
    let when = kill_at(args);
    let (cluster, victim) = (&mut setup.cluster, setup.victim);
    let publishing = publish_all(&control, &setup.topic, args, config, true, |p| {
        kill_and_watch(p, cluster, victim, when, &bar)
    });
    bar.finish_and_clear();
    let (outcome, timeline) = match publishing {
        Ok(done) => done,
        Err(e) => {
            target.store(0, Ordering::Release);
            return Err(e);
        }
    };
    target.store(outcome.stats.messages, Ordering::Release);
    let verifier = verifier
        .join()
        .map_err(|_| "the checking subscriber panicked".to_string())??;
    let topic_end = Admin::new(&control)
        .describe_topic(&setup.topic)
        .map_err(|e| e.to_string())?
        .next_position;
    let published: Vec<u64> = outcome.runs.iter().map(|r| r.stats.messages).collect();
    let check = verifier.finish(&published, topic_end);
    Ok((outcome, timeline, check))
}

/// One broker-failure run.
pub fn run(args: &BenchArgs, config: RunConfig) -> Result<Value, String> {
    let mut setup = set_up(args, config)?;
    let (outcome, timeline, check) = publish_and_check(args, config, &mut setup)?;
    let scratch = tempdir()?;
    let ceilings = measure_ceilings(args, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    let ceilings = ceilings?;
    let region_file = setup.cluster.region_file.display().to_string();
    drop(setup.cluster);

    let size = args.size as f64;
    let before_s = timeline.killed_after.as_secs_f64();
    let after_s = outcome
        .elapsed
        .saturating_sub(timeline.killed_after)
        .as_secs_f64();
    let after_messages = outcome.stats.messages - timeline.published_at_kill;
    let before_mb_s = timeline.published_at_kill as f64 * size / before_s.max(1e-9) / 1e6;
    let after_mb_s = after_messages as f64 * size / after_s.max(1e-9) / 1e6;
    let mut figures = common_figures(args, config, &outcome, outcome.elapsed);
    merge(
        &mut figures,
        serde_json::json!({
            "region_file": region_file,
            "subscribe_only_seconds": null,
            "subscribe_only_cpu_seconds": null,
            "e2e_latency_us": null,
            // The brokers run in other processes: this process's CPU is the client's.
            "process_cpu_seconds_per_gb": null,
            "stage_ms_per_gb": {},
            "ceilings": ceilings,
            "failure": {
                "killed_broker": setup.victim,
                "killed_broker_addr": setup.victim_addr,
                "kill_after_s": before_s,
                "messages_before_kill": timeline.published_at_kill,
                "before_mb_per_s": before_mb_s,
                "after_mb_per_s": after_mb_s,
                "longest_ack_stall_s": timeline.longest_stall.as_secs_f64(),
                "kill_to_ack_frontier_moving_s": timeline.stall_ended.as_secs_f64(),
                "kill_to_all_prior_acked_s": timeline.all_prior_acked.map(|d| d.as_secs_f64()),
                "check": check,
            },
        }),
    );
    add_ceiling_ratios(&mut figures);
    if !args.json {
        print_run_header(args, config, outcome.runs.len());
        report(&outcome.stats, outcome.elapsed, false, args.ack);
        print_failure(
            setup.victim,
            &setup.victim_addr,
            &timeline,
            (before_mb_s, after_mb_s),
        );
        print_check(&check, config.order);
        print_ceilings(&figures);
    }
    Ok(figures)
}

/// The human report of the kill and the failover.
fn print_failure(victim: u32, victim_addr: &str, timeline: &Timeline, mb_s: (f64, f64)) {
    let (before_mb_s, after_mb_s) = mb_s;
    say!(
        "broker failure: follower broker {victim} ({victim_addr}) SIGKILLed {:.3} s into the run, after {} messages",
        timeline.killed_after.as_secs_f64(),
        timeline.published_at_kill
    );
    say!("  throughput before the kill {before_mb_s:>9.1} MB/s");
    say!(
        "  throughput after the kill  {after_mb_s:>9.1} MB/s (from the kill to the last acknowledgement, failover included)"
    );
    say!(
        "  acknowledged prefix stood still for at most {:.3} s after the kill, moving again {:.3} s after it",
        timeline.longest_stall.as_secs_f64(),
        timeline.stall_ended.as_secs_f64()
    );
    match timeline.all_prior_acked {
        Some(all) => say!(
            "  every batch sealed before the kill acknowledged {:.3} s after it",
            all.as_secs_f64()
        ),
        None => say!("  the batches sealed before the kill were never all acknowledged"),
    }
}

/// Prints the verdict of an exactly-once check.
pub fn print_check(check: &Check, order: u8) {
    if check.passed {
        say!(
            "exactly-once check PASSED: {} messages published and acknowledged, each delivered once, at positions 0 to {} in one order{}",
            check.published,
            check.published.saturating_sub(1),
            if order == 5 {
                ", each publisher's in publish order"
            } else {
                ""
            }
        );
    } else {
        say!(
            "exactly-once check FAILED: {}",
            serde_json::to_string(check).expect("json")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(publisher: usize, seq: u64) -> [u8; 16] {
        let mut p = [0u8; 16];
        p[..8].copy_from_slice(&message_id(publisher, seq).to_le_bytes());
        p
    }

    /// Feeds (publisher, seq) deliveries at contiguous positions.
    fn verify(order: u8, deliveries: &[(usize, u64)], published: &[u64]) -> Check {
        let mut v = Verifier::new(order, published.len());
        for (position, &(p, seq)) in deliveries.iter().enumerate() {
            v.observe(position as u64, &payload(p, seq));
        }
        v.finish(published, deliveries.len() as u64)
    }

    #[test]
    fn every_message_once_at_contiguous_positions_passes() {
        let check = verify(2, &[(0, 0), (1, 0), (0, 2), (0, 1), (1, 1)], &[3, 2]);
        assert!(check.passed, "{check:?}");
        assert_eq!((check.published, check.delivered), (5, 5));
        assert_eq!(check.out_of_session_order, None, "order 2 has no sessions");
    }

    #[test]
    fn a_duplicate_and_the_message_it_displaced_are_both_reported() {
        let check = verify(2, &[(0, 0), (0, 1), (0, 1)], &[3]);
        assert!(!check.passed);
        assert_eq!((check.duplicates, check.missing), (1, 1));
    }

    #[test]
    fn a_gap_in_positions_fails_the_check() {
        let mut v = Verifier::new(2, 1);
        v.observe(0, &payload(0, 0));
        v.observe(2, &payload(0, 1));
        let check = v.finish(&[2], 3);
        assert!(!check.passed);
        assert_eq!(check.out_of_place, 1);
        assert_eq!(check.beyond_published, 1);
    }

    #[test]
    fn order5_fails_a_session_delivered_out_of_publish_order() {
        let check = verify(5, &[(0, 1), (0, 0)], &[2]);
        assert!(!check.passed);
        assert_eq!(check.out_of_session_order, Some(1));
        assert!(verify(5, &[(0, 0), (1, 0), (0, 1)], &[2, 1]).passed);
    }

    #[test]
    fn messages_of_no_publisher_of_the_run_are_unknown() {
        let mut v = Verifier::new(2, 1);
        v.observe(0, &payload(0, 0));
        v.observe(1, &payload(7, 0));
        v.observe(2, b"short");
        v.observe(3, &payload(0, 1 << 40));
        v.observe(4, &payload(0, 5));
        let check = v.finish(&[1], 5);
        assert!(!check.passed);
        assert_eq!(
            check.unknown, 4,
            "another publisher, too short, far ahead, never published"
        );
    }
}
