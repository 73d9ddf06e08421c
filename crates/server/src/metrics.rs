//! Prometheus `/metrics`: the families of the head (its brokers, embedded sequencer,
//! replicas, topics and process), of a follower's brokers and of an external sequencer,
//! and the metrics-only HTTP server of those processes.
//!
//! Owns nothing: it reads counters that brokers, the sequencer and replica workers own,
//! and the region's topic lines.

use crate::http_server::{Request, Response};
use crate::Inner;
use embarcadero_sequencer::SequencerMetrics;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Prometheus text format, one family at a time.
#[derive(Default)]
pub(crate) struct Families(String);

impl Families {
    pub(crate) fn family(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        samples: Vec<(String, u64)>,
    ) {
        let _ = writeln!(self.0, "# HELP embarcadero_{name} {help}");
        let _ = writeln!(self.0, "# TYPE embarcadero_{name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(self.0, "embarcadero_{name}{labels} {v}");
        }
    }

    /// The text, with the process's CPU time under its standard Prometheus name.
    pub(crate) fn text(mut self) -> String {
        let _ = writeln!(
            self.0,
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds."
        );
        let _ = writeln!(self.0, "# TYPE process_cpu_seconds_total counter");
        let _ = writeln!(
            self.0,
            "process_cpu_seconds_total {}",
            crate::cpu::process_cpu_seconds()
        );
        self.0
    }
}

/// A counter of every broker.
type BrokerCounter = fn(&embarcadero_broker::BrokerMetrics) -> &AtomicU64;

/// Per-broker families: name, type, help, counter.
const BROKER_COUNTERS: [(&str, &str, &str, BrokerCounter); 18] = [
    (
        "publish_bytes_total",
        "counter",
        "Bytes of batches written into the broker's log: payloads with their 64-byte message headers and padding.",
        |m| &m.publish_bytes,
    ),
    (
        "publish_batches_total",
        "counter",
        "Batches committed to the broker's log.",
        |m| &m.publish_batches,
    ),
    (
        "publish_messages_total",
        "counter",
        "Messages committed to the broker's log.",
        |m| &m.publish_messages,
    ),
    (
        "subscribe_bytes_total",
        "counter",
        "Bytes of batches sent to subscribers: payloads with their 64-byte message headers and padding.",
        |m| &m.subscribe_bytes,
    ),
    (
        "subscribe_batches_total",
        "counter",
        "Batches sent to subscribers.",
        |m| &m.subscribe_batches,
    ),
    (
        "acks_sent_total",
        "counter",
        "Acknowledgement frames sent.",
        |m| &m.acks_sent,
    ),
    (
        "errors_sent_total",
        "counter",
        "Error frames sent before closing a connection.",
        |m| &m.errors_sent,
    ),
    (
        "backpressure_errors_total",
        "counter",
        "Batches refused with a retriable BACKPRESSURE error.",
        |m| &m.backpressure_errors,
    ),
    (
        "backpressure_waits_total",
        "counter",
        "Times a publisher connection had to wait for log memory.",
        |m| &m.backpressure_waits,
    ),
    (
        "reclaimed_batches_total",
        "counter",
        "Batches whose memory was reclaimed.",
        |m| &m.reclaimed_batches,
    ),
    (
        "retired_tail_segments_total",
        "counter",
        "Partly filled last segments that idle topics gave back to a broker's pool running short.",
        |m| &m.retired_tails,
    ),
    (
        "connections_open",
        "gauge",
        "Open client connections.",
        |m| &m.connections_open,
    ),
    (
        "connections_refused_total",
        "counter",
        "Connections refused because broker.max_connections were open.",
        |m| &m.connections_refused,
    ),
    (
        "connections_refused_per_address_total",
        "counter",
        "Connections refused because their client address had broker.max_connections_per_address open.",
        |m| &m.connections_refused_per_address,
    ),
    (
        "subscribers_dropped_total",
        "counter",
        "Subscriber connections closed because the subscriber left or sent bytes after its hello.",
        |m| &m.subscribers_dropped,
    ),
    (
        "session_window_waits_total",
        "counter",
        "Order-5 batches held back because they were beyond their session's window.",
        |m| &m.session_window_waits,
    ),
    (
        "session_key_refusals_total",
        "counter",
        "Order-5 hellos and connections refused because their session is bound to another key (hijack attempts).",
        |m| &m.session_key_refusals,
    ),
    (
        "position_ceiling_stalls_total",
        "counter",
        "Order 0/1 service rounds held at a memory-only topic's position ceiling (the control plane fell behind raising it).",
        |m| &m.ceiling_stalls,
    ),
];

/// The families of `brokers` (the head's own, or a follower's); returns their
/// per-stage time samples, which share one family with the sequencer's.
pub(crate) fn broker_families(
    families: &mut Families,
    brokers: &[crate::BrokerInfo],
) -> Vec<(String, u64)> {
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, u64)>| {
        families.family(name, kind, help, samples)
    };
    for (name, kind, help, field) in BROKER_COUNTERS {
        family(
            name,
            kind,
            help,
            brokers
                .iter()
                .map(|b| {
                    (
                        format!("{{broker=\"{}\"}}", b.id),
                        field(&b.metrics).load(Ordering::Relaxed),
                    )
                })
                .collect(),
        );
    }
    family(
        "free_segments",
        "gauge",
        "Free BLog segments in the broker's pool.",
        brokers
            .iter()
            .map(|b| {
                (
                    format!("{{broker=\"{}\"}}", b.id),
                    b.pool.free_count() as u64,
                )
            })
            .collect(),
    );
    broker_stage_samples(brokers)
}

/// Each broker's time per publish stage, in ns.
fn broker_stage_samples(brokers: &[crate::BrokerInfo]) -> Vec<(String, u64)> {
    type Stage = fn(&embarcadero_broker::StageTimes) -> &std::sync::atomic::AtomicU64;
    let stages: [(&str, Stage); 8] = [
        ("reserve", |s| &s.reserve),
        ("receive", |s| &s.receive),
        ("validate", |s| &s.validate),
        ("commit", |s| &s.commit),
        ("frontier", |s| &s.frontier),
        ("reclaim", |s| &s.reclaim),
        ("ack_send", |s| &s.ack_send),
        ("ack_wait", |s| &s.ack_wait),
    ];
    let mut samples = Vec::new();
    for b in brokers {
        for (stage, field) in stages {
            samples.push((
                format!("{{broker=\"{}\",stage=\"{stage}\"}}", b.id),
                field(&b.metrics.stages).load(Ordering::Relaxed),
            ));
        }
    }
    samples
}

/// What a follower exports: its broker's families.
pub(crate) fn follower_metrics(broker: &crate::BrokerInfo) -> String {
    let mut families = Families::default();
    let stages = broker_families(&mut families, std::slice::from_ref(broker));
    families.family("stage_nanoseconds_total", "counter", STAGES_HELP, stages);
    families.text()
}

/// Serves `/metrics` (the text `metrics` returns) and `/healthz` on `listen`, for a
/// process that serves nothing else: a follower broker (`role` "a follower") or an
/// external sequencer.
pub(crate) fn serve_metrics_only(
    listen: std::net::SocketAddr,
    role: &'static str,
    thread_name: &str,
    metrics: impl Fn() -> String + Send + Sync + 'static,
) -> Result<crate::http_server::HttpServer, crate::ServerError> {
    let listener = std::net::TcpListener::bind(listen).map_err(|e| {
        crate::ServerError::Start(format!(
            "cannot listen for /metrics on {listen}: {e}; choose another --metrics-port"
        ))
    })?;
    crate::http_server::HttpServer::start(
        listener,
        thread_name,
        crate::http_server::Limits::default(),
        std::sync::Arc::default(),
        move |request| respond_metrics_only(role, request, &metrics),
    )
    .map_err(|e| crate::ServerError::Start(format!("cannot serve /metrics: {e}")))
}

fn respond_metrics_only(role: &str, request: &Request, metrics: &dyn Fn() -> String) -> Response {
    match (request.method.as_str(), request.path()) {
        ("GET", "/metrics") => Response::new(200, "text/plain; version=0.0.4", metrics()),
        ("GET", "/healthz") => Response::new(200, "text/plain", "ok\n".to_string()),
        (_, path) => Response::error(
            404,
            format!("no such endpoint: {path} ({role} serves /metrics and /healthz; the rest is on the head)"),
        ),
    }
}

const STAGES_HELP: &str = "Time spent in each stage of the data path (broker stages per broker; the sequencer's scan, epoch wait, sequencing and GOI write). Thread time, except ack_wait and sequencer_epoch_wait: batch-time spent waiting.";

/// The sequencer's stages, as samples of `stage_nanoseconds_total`.
fn sequencer_stages(s: &SequencerMetrics) -> Vec<(String, u64)> {
    [
        ("sequencer_scan", &s.scan_nanos),
        ("sequencer_epoch_wait", &s.epoch_wait_nanos),
        ("sequencer_sequence", &s.sequence_nanos),
        ("sequencer_goi_write", &s.goi_write_nanos),
    ]
    .into_iter()
    .map(|(stage, v)| (format!("{{stage=\"{stage}\"}}"), v.load(Ordering::Relaxed)))
    .collect()
}

/// The sequencer's own families, the same in the head and in `embarcadero sequencer`.
fn sequencer_families(families: &mut Families, s: &SequencerMetrics) {
    let counters: [(&str, &str, &AtomicU64); 9] = [
        (
            "sequencer_epochs_total",
            "Epochs sealed by the sequencer.",
            &s.epochs_sealed,
        ),
        (
            "sequencer_batches_ordered_total",
            "Batches given a global position.",
            &s.batches_ordered,
        ),
        (
            "sequencer_messages_ordered_total",
            "Messages given a global position.",
            &s.messages_ordered,
        ),
        (
            "sequencer_seal_nanoseconds_total",
            "Time spent sealing epochs (GOI write plus sequencing).",
            &s.seal_nanos,
        ),
        (
            "sequencer_goi_full_stalls_total",
            "Epochs cut short because GOI slots were still in use.",
            &s.goi_full_stalls,
        ),
        (
            "sequencer_position_ceiling_stalls_total",
            "Epochs cut short because a memory-only topic reached its position ceiling (the control plane fell behind raising it).",
            &s.ceiling_stalls,
        ),
        (
            "sequencer_sessions_evicted_total",
            "Order-5 sessions (ended by their publishers, or idle) that gave up their session-table slot to a new session.",
            &s.sessions_evicted,
        ),
        (
            "sequencer_sessions_ended_by_publisher_total",
            "Order-5 sessions their publishers ended on closing, whose slots go to new sessions first.",
            &s.sessions_ended_by_publisher,
        ),
        (
            "sequencer_session_key_mismatches_total",
            "Order-5 batches dropped because they claimed a session bound to another key.",
            &s.session_key_mismatches,
        ),
    ];
    for (name, help, value) in counters {
        families.family(
            name,
            "counter",
            help,
            vec![(String::new(), value.load(Ordering::Relaxed))],
        );
    }
}

/// What an external sequencer (`embarcadero sequencer`) exports.
pub(crate) fn sequencer_process_metrics(s: &SequencerMetrics) -> String {
    let mut families = Families::default();
    families.family(
        "stage_nanoseconds_total",
        "counter",
        STAGES_HELP,
        sequencer_stages(s),
    );
    sequencer_families(&mut families, s);
    families.text()
}

/// Everything the head exports.
pub(crate) fn of_head(inner: &Inner) -> String {
    let mut families = Families::default();
    let mut samples = broker_families(&mut families, &inner.brokers);
    // An external sequencer's counters live in its own process (its own /metrics).
    if let Some(s) = inner.sequencer_metrics.as_deref() {
        samples.extend(sequencer_stages(s));
    }
    families.family("stage_nanoseconds_total", "counter", STAGES_HELP, samples);
    if let Some(s) = inner.sequencer_metrics.as_deref() {
        sequencer_families(&mut families, s);
    }
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, u64)>| {
        families.family(name, kind, help, samples)
    };
    let topics = inner.control.list();
    topic_families(&topics, &mut family);
    control_families(inner, &mut family);
    replication_metrics(inner, &topics, &mut family);
    let mut out = families.text();
    write_fsync_histogram(&mut out, &inner.replication_metrics);
    out
}

/// Per topic: its committed order, next position and messages per broker.
fn topic_families(
    topics: &[crate::TopicInfo],
    family: &mut impl FnMut(&str, &str, &str, Vec<(String, u64)>),
) {
    family(
        "topic_committed_batches",
        "gauge",
        "Batches in the topic's committed global order (orders 2, 5).",
        topics
            .iter()
            .map(|t| (format!("{{topic=\"{}\"}}", t.name), t.committed_batches))
            .collect(),
    );
    family(
        "topic_next_position",
        "gauge",
        "Next global message position of the topic (orders 2, 5).",
        topics
            .iter()
            .map(|t| (format!("{{topic=\"{}\"}}", t.name), t.next_position))
            .collect(),
    );
    topic_reader_families(topics, family);
    family(
        "topic_broker_messages",
        "gauge",
        "Messages written per topic and broker.",
        topics
            .iter()
            .flat_map(|t| {
                t.brokers.iter().map(move |b| {
                    (
                        format!("{{topic=\"{}\",broker=\"{}\"}}", t.name, b.broker),
                        b.messages,
                    )
                })
            })
            .collect(),
    );
}

/// Per topic: its live subscribers and how far the slowest is behind (consumer lag, for
/// an alert: 0 with none), as `topic describe`'s `health` tells them.
fn topic_reader_families(
    topics: &[crate::TopicInfo],
    family: &mut impl FnMut(&str, &str, &str, Vec<(String, u64)>),
) {
    let labels = |t: &crate::TopicInfo| format!("{{topic=\"{}\"}}", t.name);
    family(
        "topic_readers",
        "gauge",
        "Subscribers of the topic that are live (their broker beat for them within the stall timeout).",
        topics
            .iter()
            .map(|t| (labels(t), u64::from(t.health.readers)))
            .collect(),
    );
    family(
        "topic_reader_lag_messages",
        "gauge",
        "Messages written that the topic's slowest live subscriber has not been sent yet (orders 0 and 1: in the broker log where it is furthest behind); 0 with no subscriber.",
        topics
            .iter()
            .map(|t| {
                let behind = t.health.slowest_reader.as_ref().map_or(0, |r| r.behind);
                (labels(t), behind)
            })
            .collect(),
    );
}

/// The admin API's open connections and the workflow requests it forwarded or could not.
fn control_families(inner: &Inner, family: &mut impl FnMut(&str, &str, &str, Vec<(String, u64)>)) {
    family(
        "control_connections",
        "gauge",
        "Connections the admin API is serving (each on a thread of its own, until its request is answered).",
        vec![(
            String::new(),
            inner.control_connections.load(Ordering::Relaxed) as u64,
        )],
    );
    let proxy = &inner.workflow_proxy;
    family(
        "workflow_proxy_requests_total",
        "counter",
        "Workflow API requests the control port forwarded and an orchestrator answered.",
        vec![(String::new(), proxy.forwarded.load(Ordering::Relaxed))],
    );
    family(
        "workflow_proxy_failures_total",
        "counter",
        "Workflow API requests the control port could not forward: no orchestrator announced (503), too many in progress (busy, 503), none reachable or its answer unusable (502).",
        [
            ("no_engine", &proxy.no_engine),
            ("busy", &proxy.busy),
            ("unreachable", &proxy.unreachable),
            ("bad_answer", &proxy.bad_answer),
        ]
        .iter()
        .map(|(reason, n)| (format!("{{reason=\"{reason}\"}}"), n.load(Ordering::Relaxed)))
        .collect(),
    );
}

/// The replicas' fdatasync latency, as a Prometheus histogram.
fn write_fsync_histogram(out: &mut String, r: &embarcadero_replication::ReplicationMetrics) {
    let _ = writeln!(out, "# HELP embarcadero_replica_fsync_seconds Latency of the replicas' fdatasync (group commits).");
    let _ = writeln!(out, "# TYPE embarcadero_replica_fsync_seconds histogram");
    for (i, m) in r.replicas.iter().enumerate() {
        let replica = i + 1;
        let mut cumulative = 0;
        for (b, bound) in m.fsync_buckets.iter().zip(
            embarcadero_replication::worker::FSYNC_BUCKETS_US
                .iter()
                .map(|us| format!("{}", *us as f64 / 1e6))
                .chain(std::iter::once("+Inf".to_string())),
        ) {
            cumulative += b.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "embarcadero_replica_fsync_seconds_bucket{{replica=\"{replica}\",le=\"{bound}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "embarcadero_replica_fsync_seconds_sum{{replica=\"{replica}\"}} {}",
            m.fsync_nanos.load(Ordering::Relaxed) as f64 / 1e9
        );
        let _ = writeln!(
            out,
            "embarcadero_replica_fsync_seconds_count{{replica=\"{replica}\"}} {cumulative}"
        );
    }
}

/// A counter of every replica worker.
type ReplicaCounter = fn(&embarcadero_replication::worker::ReplicaMetrics) -> &AtomicU64;

/// Per-replica counter families: name, help, counter.
const REPLICA_COUNTERS: [(&str, &str, ReplicaCounter); 5] = [
    (
        "replica_bytes_written_total",
        "Record bytes written to the replica's disk.",
        |m| &m.bytes_written,
    ),
    (
        "replica_batches_written_total",
        "Batches written to the replica's disk.",
        |m| &m.batches_written,
    ),
    (
        "replica_fsyncs_total",
        "Group commits (fdatasync) of the replica.",
        |m| &m.syncs,
    ),
    (
        "replica_disk_errors_total",
        "Failed writes or syncs of the replica (each is retried).",
        |m| &m.disk_errors,
    ),
    (
        "replica_segments_removed_total",
        "Disk segments removed by retention.",
        |m| &m.segments_removed,
    ),
];

/// Replica counters, per-topic replication lag and durable frontiers.
fn replication_metrics(
    inner: &Inner,
    topics: &[crate::TopicInfo],
    family: &mut impl FnMut(&str, &str, &str, Vec<(String, u64)>),
) {
    let r = &inner.replication_metrics;
    for (name, help, field) in REPLICA_COUNTERS {
        family(
            name,
            "counter",
            help,
            r.replicas
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    (
                        format!("{{replica=\"{}\"}}", i + 1),
                        field(m).load(Ordering::Relaxed),
                    )
                })
                .collect(),
        );
    }
    replica_lag_families(inner, topics, family);
    topic_durable_families(topics, family);
}

/// Per topic and replica: how far behind the committed order its disk is, what a
/// start set aside, and the replica's last error.
fn replica_lag_families(
    inner: &Inner,
    topics: &[crate::TopicInfo],
    family: &mut impl FnMut(&str, &str, &str, Vec<(String, u64)>),
) {
    let region = &inner.region;
    let mut lag_batches = Vec::new();
    let mut lag_bytes = Vec::new();
    let mut errors = Vec::new();
    for t in topics.iter().filter(|t| t.replication_factor >= 2) {
        for replica in 1..t.replication_factor as u32 {
            let p = region.replica(t.id, replica);
            let durable = p.own_durable_seq.load(Ordering::Acquire);
            let labels = format!("{{topic=\"{}\",replica=\"{replica}\"}}", t.name);
            // Entries not yet durable are still in memory (reclamation waits for them).
            let bytes: u64 = (durable..t.committed_batches.max(durable))
                .filter_map(|g| region.goi_read(t.id, g))
                .map(|e| e.payload_size as u64)
                .sum();
            lag_batches.push((labels.clone(), t.committed_batches.saturating_sub(durable)));
            lag_bytes.push((labels.clone(), bytes));
            errors.push((labels, p.error.load(Ordering::Acquire)));
        }
    }
    family(
        "replica_lag_batches",
        "gauge",
        "Batches ordered but not yet on this replica's disk.",
        lag_batches,
    );
    family(
        "replica_lag_bytes",
        "gauge",
        "Payload bytes ordered but not yet on this replica's disk.",
        lag_bytes,
    );
    family(
        "replica_set_aside_bytes",
        "gauge",
        "Bytes a start moved into the set-aside directories of this replica's topic logs (a gap or a damaged record; the server's log says which): inspect them, then delete or restore them by hand.",
        inner
            .config
            .replica_dirs()
            .iter()
            .enumerate()
            .map(|(i, dir)| {
                (
                    format!("{{replica=\"{}\"}}", i + 1),
                    embarcadero_replication::store::set_aside_bytes(dir),
                )
            })
            .collect(),
    );
    family(
        "replica_error",
        "gauge",
        "0 while the replica's disk works, else the OS error number of its last failure.",
        errors,
    );
}

/// The durable frontiers: per topic, and per topic and broker.
fn topic_durable_families(
    topics: &[crate::TopicInfo],
    family: &mut impl FnMut(&str, &str, &str, Vec<(String, u64)>),
) {
    family(
        "topic_durable_batches",
        "gauge",
        "Batches of the topic's global order on every disk replica (the durable frontier).",
        topics
            .iter()
            .map(|t| (format!("{{topic=\"{}\"}}", t.name), t.durable_batches))
            .collect(),
    );
    family(
        "topic_broker_durable_batches",
        "gauge",
        "Per topic and broker: ring slots below this are on every disk replica.",
        topics
            .iter()
            .filter(|t| t.replication_factor >= 2)
            .flat_map(|t| {
                t.brokers.iter().map(move |b| {
                    (
                        format!("{{topic=\"{}\",broker=\"{}\"}}", t.name, b.broker),
                        b.durable_batches,
                    )
                })
            })
            .collect(),
    );
}
