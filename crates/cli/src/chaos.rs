//! `embarcadero chaos`: a fault campaign in the spirit of Jepsen's queue tests. Each
//! cycle starts a cluster of real processes (a head, two follower brokers, an active
//! and a standby sequencer), has two publishers publish and two readers read one
//! topic while a nemesis strikes and heals, records every send, acknowledgement,
//! failure and delivery in a history file, and checks that history. It owns the cycle
//! and the campaign; the history, the checker and the faults have rooms of their own.

mod checker;
mod history;
mod nemesis;
mod netns;

use crate::bench::failure::message_id;
use crate::CliResult;
use checker::Report;
use clap::Args;
use embarcadero_cli::local_cluster::{ClusterSpec, Echo, Launch, LocalCluster};
use embarcadero_client::{
    Admin, Publisher, PublisherConfig, Subscriber, SubscriberConfig, TopicSpec,
};
use history::{Event, Recorder};
use nemesis::{Lab, Nemesis, Pair};
use netns::Netns;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct ChaosArgs {
    /// Stop after this many cycles...
    #[arg(long)]
    pub cycles: Option<u64>,
    /// ...or once this many seconds have passed (a cycle under way finishes).
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Seconds of publishing per cycle; the fault strikes and heals within them.
    #[arg(long, default_value_t = 3.0)]
    pub cycle_secs: f64,
    /// The faults to cycle through, by name (default: all).
    #[arg(long, value_delimiter = ',')]
    pub nemesis: Vec<String>,
    /// Where the histories go; a passing cycle's is removed unless --keep-histories.
    #[arg(long, default_value = "chaos-histories")]
    pub out: PathBuf,
    /// Keep the history of every cycle, not only of a failing one.
    #[arg(long)]
    pub keep_histories: bool,
    /// Seed of the fault timings (default: from the clock); printed at the start.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Echo every process's stderr, named, to this one's stderr (to see what the
    /// cluster said around an anomaly).
    #[arg(long)]
    pub echo_processes: bool,
    /// Check this history file instead of running (prints the report as JSON).
    #[arg(long)]
    pub check: Option<PathBuf>,
}

/// Publishers per cycle; a publisher whose flush fails is replaced by a new one, with
/// a publisher number `PUBLISHERS` higher.
const PUBLISHERS: usize = 2;
/// Readers per cycle: reader r reads through broker r.
const READERS: usize = 2;
/// Messages published between two flushes.
const ROUND: u64 = 16;
/// Replacements of a failed publisher per cycle, at most.
const MAX_GENERATIONS: usize = 20;
/// Tries to start a cycle's cluster before the campaign gives up.
const SETUP_ATTEMPTS: u32 = 3;
/// A reader that gets nothing this long after publishing stopped gives up.
const READER_IDLE: Duration = Duration::from_secs(20);

pub fn run(args: ChaosArgs) -> CliResult {
    if let Some(path) = &args.check {
        let report = checker::check(&history::read(path)?);
        say!("{}", serde_json::to_string_pretty(&report).expect("json"));
        return match report.anomalies() {
            0 => Ok(()),
            n => Err(format!("{n} anomalies in {}", path.display())),
        };
    }
    if args.cycles.is_none() && args.seconds.is_none() {
        return Err("give --cycles or --seconds (or both)".into());
    }
    if !(args.cycle_secs.is_finite() && (1.0..=60.0).contains(&args.cycle_secs)) {
        return Err("--cycle-secs takes 1 to 60 seconds".into());
    }
    let mut nemeses: Vec<Nemesis> = if args.nemesis.is_empty() {
        nemesis::ALL.to_vec()
    } else {
        args.nemesis
            .iter()
            .map(|n| Nemesis::parse(n))
            .collect::<Result<_, _>>()?
    };
    let netns = partition_namespace(&mut nemeses)?;
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    campaign(&args, &nemeses, netns.as_ref())
}

/// The network namespaces the partitions run the brokers in, if a partition is among
/// `nemeses`; where none can be made (not root, no `ip`) the partitions are left out
/// of the campaign, saying why.
fn partition_namespace(nemeses: &mut Vec<Nemesis>) -> Result<Option<Netns>, String> {
    if !nemeses.iter().any(|n| n.partitions()) {
        return Ok(None);
    }
    match Netns::create(nemesis::PARTITION_SPACES) {
        Ok(ns) => Ok(Some(ns)),
        Err(why) => {
            say!("chaos: the partitions are left out: {why}");
            nemeses.retain(|n| !n.partitions());
            if nemeses.is_empty() {
                return Err("no nemesis left to run".into());
            }
            Ok(None)
        }
    }
}

/// Cycles until the count or the time is up, or a cycle finds an anomaly or fails.
fn campaign(args: &ChaosArgs, nemeses: &[Nemesis], netns: Option<&Netns>) -> CliResult {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    say!("chaos: seed {seed}, nemeses {}", names(nemeses));
    let mut rng = XorShift(seed.max(1));
    let started = Instant::now();
    let mut cycle = 0u64;
    let mut by_nemesis = std::collections::BTreeMap::<&str, u64>::new();
    let mut setup_failures = 0u64;
    while args.cycles.is_none_or(|c| cycle < c)
        && args
            .seconds
            .is_none_or(|s| started.elapsed() < Duration::from_secs(s))
    {
        let nemesis = nemeses[cycle as usize % nemeses.len()];
        // Each pass over the faults uses the next topic kind, so every fault meets each;
        // and the next pair to part (5 pairs, 4 kinds: 20 passes meet every pairing).
        let pass = cycle as usize / nemeses.len();
        let mut plan = Plan::draw(cycle, pass % 4, nemesis, args.cycle_secs, &mut rng);
        plan.pair = nemesis::PAIRS[pass % nemesis::PAIRS.len()];
        if args.echo_processes {
            plan.echo = Echo::ToStderr;
            eprintln!("== cycle {cycle} ({})", plan.fault());
        }
        let history = args.out.join(format!("cycle-{cycle}.jsonl"));
        // Only a partition cycle puts the brokers in the namespaces.
        let netns = netns.filter(|_| nemesis.partitions());
        let stage = set_stage_retrying(&plan, netns, &mut setup_failures)?;
        let report = run_cycle(&plan, stage, netns, &history)
            .map_err(|e| format!("cycle {cycle} ({}) failed: {e}", plan.fault()))?;
        say!("{}", plan.summary(&report));
        if report.anomalies() > 0 {
            for (kind, example) in &report.examples {
                say!("  {kind:?}: {example}");
            }
            return Err(format!(
                "cycle {cycle}: {} anomalies; the history is {}",
                report.anomalies(),
                history.display()
            ));
        }
        if !args.keep_histories {
            let _ = std::fs::remove_file(&history);
        }
        *by_nemesis.entry(nemesis.name()).or_default() += 1;
        cycle += 1;
    }
    say!(
        "chaos: {cycle} cycles in {:.0} s, 0 anomalies ({by_nemesis:?}); {setup_failures} cluster starts retried",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A cycle's stage, set again (at most `SETUP_ATTEMPTS` times) when a cluster does not
/// come up whole: on a loaded machine a follower may miss its first heartbeats. That
/// happens before any fault or message, so it is counted, not an anomaly.
fn set_stage_retrying(
    plan: &Plan,
    netns: Option<&Netns>,
    failures: &mut u64,
) -> Result<Stage, String> {
    let mut attempt = 1;
    loop {
        match set_stage(plan, netns) {
            Ok(stage) => return Ok(stage),
            Err(e) if attempt < SETUP_ATTEMPTS => {
                *failures += 1;
                say!(
                    "cycle {}: the cluster did not come up ({e}); again",
                    plan.cycle
                );
                attempt += 1;
            }
            Err(e) => {
                return Err(format!(
                    "cycle {}: the cluster did not come up {SETUP_ATTEMPTS} times: {e}",
                    plan.cycle
                ))
            }
        }
    }
}

fn names(nemeses: &[Nemesis]) -> String {
    let names: Vec<&str> = nemeses.iter().map(|n| n.name()).collect();
    names.join(", ")
}

/// A small xorshift generator for the fault timings: reproducible from the seed.
struct XorShift(u64);

impl XorShift {
    /// A number in [lo, hi).
    fn between(&mut self, lo: f64, hi: f64) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        lo + (hi - lo) * (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What one cycle does: the topic, the fault, and when it strikes and heals.
struct Plan {
    cycle: u64,
    order: u8,
    ack: u8,
    nemesis: Nemesis,
    strike_after: Duration,
    heal_after: Duration,
    publish_for: Duration,
    /// Whether the cluster's processes echo their stderr.
    echo: Echo,
    /// The sides a `partition-pair` parts.
    pair: Pair,
}

impl Plan {
    /// `kind` picks the topic: 0 to 3 give order/ack 2/1, 5/1, 2/2, 5/2.
    fn draw(
        cycle: u64,
        kind: usize,
        nemesis: Nemesis,
        cycle_secs: f64,
        rng: &mut XorShift,
    ) -> Self {
        let strike = rng.between(0.15, 0.4) * cycle_secs;
        let hold = rng.between(0.1, 0.4) * cycle_secs;
        // Ack 1 promises a place in the region's memory only, and a restarted head
        // replaces the region: what was not yet on a replica's disk is lost by design.
        // So the head is killed under ack 2 only.
        let ack = match nemesis {
            Nemesis::KillHead => 2,
            _ => [1, 2][(kind / 2) % 2],
        };
        Self {
            cycle,
            order: [2, 5][kind % 2],
            ack,
            nemesis,
            strike_after: Duration::from_secs_f64(strike),
            heal_after: Duration::from_secs_f64(strike + hold),
            publish_for: Duration::from_secs_f64(cycle_secs),
            echo: Echo::Quiet,
            pair: nemesis::PAIRS[0],
        }
    }

    /// The fault's name, with the pair a `partition-pair` parts (`partition-pair
    /// head|follower-1`).
    fn fault(&self) -> String {
        match self.nemesis {
            Nemesis::PartitionPair => {
                let (a, b) = self.pair;
                format!("{} {}|{}", self.nemesis.name(), a.name(), b.name())
            }
            n => n.name().to_string(),
        }
    }

    fn summary(&self, report: &Report) -> String {
        format!(
            "cycle {} {} (order {} ack {}, strike {:.2} s heal {:.2} s): sent {} acked {} ({} while struck) failed {} delivered {:?}, {} anomalies",
            self.cycle,
            self.fault(),
            self.order,
            self.ack,
            self.strike_after.as_secs_f64(),
            self.heal_after.as_secs_f64(),
            report.sent,
            report.acked,
            report.acked_during_fault,
            report.failed,
            report.delivered,
            report.anomalies()
        )
    }
}

/// A cycle's cluster, ready for the fault: every broker has joined, the topic exists.
struct Stage {
    cluster: LocalCluster,
    /// Where the fault flags live (removed with it).
    flags: tempfile::TempDir,
    topic: String,
    /// Broker addresses by broker id.
    brokers: Vec<String>,
}

/// Starts the cluster of a cycle and makes its topic; waits (at most 10 s) until the
/// head lists all three brokers alive.
fn set_stage(plan: &Plan, netns: Option<&Netns>) -> Result<Stage, String> {
    let flags = tempfile::tempdir().map_err(|e| format!("cannot make a directory: {e}"))?;
    let cluster = start_cluster(flags.path(), plan.echo, netns)?;
    let topic = format!("chaos-{}", plan.cycle);
    let admin = Admin::new(&cluster.control);
    admin
        .create_topic(&TopicSpec::new(&topic, plan.order).replicated(2))
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut brokers: Vec<(u32, String)> = admin
            .cluster()
            .map_err(|e| e.to_string())?
            .brokers
            .into_iter()
            .map(|b| (b.id, b.addr))
            .collect();
        brokers.sort();
        if brokers.len() == 3 {
            let brokers = brokers.into_iter().map(|(_, addr)| addr).collect();
            return Ok(Stage {
                cluster,
                flags,
                topic,
                brokers,
            });
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the head lists {brokers:?} after 10 s, not 3 brokers"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One cycle on a fresh stage: the publishers, readers and the fault, the history
/// written to `history_path` and checked.
fn run_cycle(
    plan: &Plan,
    stage: Stage,
    netns: Option<&Netns>,
    history_path: &Path,
) -> Result<Report, String> {
    let Stage {
        mut cluster,
        flags,
        topic,
        brokers,
    } = stage;
    let control = cluster.control.clone();
    let admin = Admin::new(&control);
    let recorder = Recorder::create(history_path)?;
    recorder.record(&Event::Topic {
        order: plan.order,
        ack: plan.ack,
    });
    let stop = AtomicBool::new(false);
    let topic_end = AtomicU64::new(u64::MAX);
    let fault = std::thread::scope(|s| {
        // A killed head comes back with new broker addresses: readers then go through
        // the head, which names them.
        let through_head = plan.nemesis == Nemesis::KillHead;
        let readers: Vec<_> = (0..READERS)
            .map(|r| {
                let via = if through_head {
                    Via::Head(&control)
                } else {
                    Via::Broker(&brokers[r])
                };
                let (topic, recorder, end) = (&topic, &recorder, &topic_end);
                s.spawn(move || read_to_end(r, via, topic, end, recorder))
            })
            .collect();
        let publishers: Vec<_> = (0..PUBLISHERS)
            .map(|slot| {
                let (control, topic, recorder, stop) = (&control, &topic, &recorder, &stop);
                s.spawn(move || publish_until(slot, control, topic, plan.ack, stop, recorder))
            })
            .collect();
        let lab = Lab {
            flags: flags.path(),
            netns,
            pair: plan.pair,
        };
        let fault = strike_and_heal(plan, &mut cluster, &lab, &recorder);
        stop.store(true, Ordering::Release);
        for p in publishers {
            p.join().expect("a publisher thread panicked");
        }
        let end = admin.describe_topic(&topic).map(|t| t.next_position);
        // Without the end the readers stop at once, and the check says so.
        topic_end.store(end.as_ref().map_or(0, |e| *e), Ordering::Release);
        for r in readers {
            r.join().expect("a reader thread panicked");
        }
        fault.and(
            end.map(drop)
                .map_err(|e| format!("cannot read the topic's end: {e}")),
        )
    });
    drop(cluster);
    recorder.finish()?;
    fault?;
    Ok(checker::check(&history::read(history_path)?))
}

/// Starts a cycle's cluster; with `netns`, the head and each follower run in a space
/// of their own (broker b in space b), each binding its space's address, and the
/// sequencers stay with the clients in this namespace.
fn start_cluster(flags: &Path, echo: Echo, netns: Option<&Netns>) -> Result<LocalCluster, String> {
    let program = std::env::current_exe()
        .map_err(|e| format!("cannot find this executable to start the cluster: {e}"))?;
    let mut spec = ClusterSpec::new(program, 3);
    spec.external_sequencer = true;
    spec.echo = echo;
    spec.env = vec![
        // Quick failure detection, so a fault and its failover fit in a short cycle.
        (
            "EMBARCADERO_CLUSTER_HEARTBEAT_INTERVAL_MS".into(),
            "100".into(),
        ),
        (
            "EMBARCADERO_CLUSTER_SEQUENCER_LEASE_MS".into(),
            "400".into(),
        ),
    ];
    spec.env.extend(nemesis::flag_settings(flags));
    if let Some(ns) = netns {
        let launch = |b: usize| Launch {
            prefix: ns.launch_prefix(b),
            args: vec!["--bind".to_string(), ns.space(b).ip.clone()],
        };
        spec.head_launch = launch(0);
        spec.follower_launch = (1..nemesis::PARTITION_SPACES as u32)
            .map(|b| (b, launch(b as usize)))
            .collect();
    }
    let mut cluster = LocalCluster::start(&spec)?;
    cluster.start_sequencer(false)?;
    cluster.start_sequencer(true)?;
    Ok(cluster)
}

/// Waits for the plan's moments (a schedule, not a synchronisation): strikes, heals,
/// and returns once publishing time is over. The heal runs even if the strike failed.
fn strike_and_heal(
    plan: &Plan,
    cluster: &mut LocalCluster,
    lab: &Lab,
    recorder: &Recorder,
) -> Result<(), String> {
    let start = Instant::now();
    let phase = |phase: &str| Event::Nemesis {
        what: plan.fault(),
        phase: phase.into(),
    };
    std::thread::sleep(plan.strike_after);
    recorder.record(&phase("start"));
    let struck = plan.nemesis.strike(cluster, lab);
    std::thread::sleep(plan.heal_after.saturating_sub(start.elapsed()));
    let healed = plan.nemesis.heal(cluster, lab);
    recorder.record(&phase("end"));
    std::thread::sleep(plan.publish_for.saturating_sub(start.elapsed()));
    struck.and(healed)
}

/// The message id in a payload's first 8 bytes (u64::MAX, which no publisher sends,
/// for a payload too short to hold one).
fn id_of(payload: &[u8]) -> u64 {
    payload.get(..8).map_or(u64::MAX, |b| {
        u64::from_le_bytes(b.try_into().expect("8 bytes"))
    })
}

/// Publishes rounds of `ROUND` messages, each round flushed, until `stop`; a publisher
/// whose flush fails records its round as failed and is replaced by a new one.
fn publish_until(
    slot: usize,
    control: &str,
    topic: &str,
    ack: u8,
    stop: &AtomicBool,
    recorder: &Recorder,
) {
    let config = PublisherConfig {
        ack_level: ack,
        linger: Duration::from_millis(1),
        flush_timeout: Duration::from_secs(15),
        ..PublisherConfig::default()
    };
    let mut generation = 0;
    while generation < MAX_GENERATIONS && !stop.load(Ordering::Acquire) {
        let number = slot + generation * PUBLISHERS;
        match Publisher::connect(control, topic, config.clone()) {
            Ok(publisher) => {
                publish_rounds(&publisher, number, stop, recorder);
                generation += 1;
            }
            // The control plane may be paused or restarting: try again (not a
            // replacement: this generation never published).
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// One publisher's rounds, until `stop` or a failure.
fn publish_rounds(publisher: &Publisher, number: usize, stop: &AtomicBool, recorder: &Recorder) {
    let mut next = 0u64;
    while !stop.load(Ordering::Acquire) {
        let ids: Vec<u64> = (next..next + ROUND)
            .map(|s| message_id(number, s))
            .collect();
        next += ROUND;
        let sends: Vec<Event> = ids
            .iter()
            .map(|&id| Event::Send {
                publisher: number,
                id,
            })
            .collect();
        recorder.record_all(&sends);
        let mut payload = [0u8; 16];
        let published = ids.iter().try_for_each(|id| {
            payload[..8].copy_from_slice(&id.to_le_bytes());
            publisher.publish(&payload)
        });
        let ok = published.and_then(|()| publisher.flush()).is_ok();
        let outcome: Vec<Event> = ids
            .iter()
            .map(|&id| {
                let publisher = number;
                if ok {
                    Event::Ack { publisher, id }
                } else {
                    Event::Fail { publisher, id }
                }
            })
            .collect();
        recorder.record_all(&outcome);
        if !ok {
            return;
        }
    }
}

/// Where a reader connects.
#[derive(Clone, Copy)]
enum Via<'a> {
    /// This broker address only.
    Broker(&'a str),
    /// The brokers the head at this control address names, asked again when none of
    /// those known answers.
    Head(&'a str),
}

/// Reads the topic from position 0 `via` a broker or the head, recording every
/// delivery, until it reaches `topic_end` (u64::MAX until publishing stopped).
fn read_to_end(reader: usize, via: Via, topic: &str, topic_end: &AtomicU64, recorder: &Recorder) {
    let error = read_deliveries(reader, via, topic, topic_end, recorder).err();
    recorder.record(&Event::ReaderEnd {
        reader,
        topic_end: topic_end.load(Ordering::Acquire),
        error,
    });
}

fn read_deliveries(
    reader: usize,
    via: Via,
    topic: &str,
    topic_end: &AtomicU64,
    recorder: &Recorder,
) -> Result<(), String> {
    let subscriber = match via {
        Via::Broker(addr) => {
            let config = SubscriberConfig {
                max_reconnects: 100,
                ..SubscriberConfig::default()
            };
            Subscriber::connect_brokers(&[addr.to_string()], topic, config)
        }
        Via::Head(control) => {
            // Up to a minute of tries (each pause at most 100 ms): the head, then the
            // followers, start again meanwhile.
            let config = SubscriberConfig {
                max_reconnects: 600,
                ..SubscriberConfig::default()
            };
            Subscriber::connect(control, topic, config)
        }
    };
    let mut subscriber = subscriber.map_err(|e| format!("cannot subscribe: {e}"))?;
    let mut next = 0u64;
    let mut idle_since = Instant::now();
    loop {
        let end = topic_end.load(Ordering::Acquire);
        if next >= end {
            return Ok(());
        }
        let n = subscriber
            .poll_with(Duration::from_millis(100), |m| {
                recorder.record(&Event::Deliver {
                    reader,
                    position: m.position,
                    id: id_of(m.payload),
                });
                next = next.max(m.position + 1);
            })
            .map_err(|e| format!("the subscriber failed: {e}"))?;
        if n > 0 || end == u64::MAX {
            idle_since = Instant::now();
        } else if idle_since.elapsed() > READER_IDLE {
            return Err(format!(
                "nothing delivered for {READER_IDLE:?} at position {next}"
            ));
        }
    }
}
