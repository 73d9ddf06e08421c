//! The admin API (HTTP/JSON) and Prometheus `/metrics`, on the control port.
//!
//! | method | path | |
//! |---|---|---|
//! | GET | `/v1/cluster` | live brokers (clients discover brokers here), every member and its state, the region, the sequencer lease |
//! | POST | `/v1/cluster/claim` | a starting follower takes a broker id and fences the logs its previous process left, before it resumes them: `{"id","incarnation"}` |
//! | POST | `/v1/cluster/join` | a follower serves a broker id at an address: `{"id","addr","incarnation"}` |
//! | POST | `/v1/cluster/heartbeat` | a follower is alive: `{"id","incarnation"}` |
//! | POST | `/v1/failover` | which of a publisher's batches through a dead broker were ordered: `{"topic","broker","incarnation","client_id","batch_ids","ack_level"}` |
//! | GET | `/v1/status` | cluster, topics with counters, broker and sequencer metrics |
//! | GET | `/v1/topics` | every topic |
//! | POST | `/v1/topics` | create: `{"name","order","replication_factor","default_ack","retention_bytes","retention_ms"}`; any other field is a 400 that names it |
//! | GET | `/v1/topics/{name}` | one topic |
//! | GET | `/metrics` | Prometheus text format |
//! | GET | `/healthz` | `ok` |

use crate::cluster::{FenceRefusal, JoinError, MemberState};
use crate::control::{TopicError, TopicSpec};
use crate::http_server::{Request, Response};
use crate::Inner;
use embarcadero_sequencer::SequencerMetrics;
use serde_json::json;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Answers one admin request (`HttpServer` has read it in full).
pub fn respond(inner: &Inner, request: &Request) -> Response {
    let (status, content_type, body) = route(inner, request);
    Response::new(status, content_type, body)
}

fn route(inner: &Inner, request: &Request) -> (u16, &'static str, String) {
    let json_ok = |v: serde_json::Value| (200, "application/json", v.to_string());
    match (request.method.as_str(), request.path()) {
        ("GET", "/healthz") => (200, "text/plain", "ok\n".into()),
        ("GET", "/metrics") => (200, "text/plain; version=0.0.4", metrics(inner)),
        ("GET", "/v1/cluster") => json_ok(cluster(inner)),
        ("POST", "/v1/cluster/claim") => claim_call(inner, request),
        ("POST", "/v1/cluster/join") => membership_call(inner, request, true),
        ("POST", "/v1/cluster/heartbeat") => membership_call(inner, request, false),
        ("POST", "/v1/failover") => failover_call(inner, request),
        ("GET", "/v1/status") => json_ok(status(inner)),
        ("GET", "/v1/topics") => json_ok(json!({ "topics": inner.control.list() })),
        ("POST", "/v1/topics") => {
            let spec: TopicSpec = match read_json(request, r#"{"name": "t", "order": 2}"#) {
                Ok(s) => s,
                Err(e) => return e,
            };
            match inner.control.create(spec) {
                Ok(spec) => match inner.control.describe(&spec.name) {
                    Ok(info) => (
                        201,
                        "application/json",
                        serde_json::to_string(&info).expect("serialisable"),
                    ),
                    Err(e) => topic_error(e),
                },
                Err(e) => topic_error(e),
            }
        }
        ("GET", path) if path.starts_with("/v1/topics/") => {
            match inner.control.describe(&path["/v1/topics/".len()..]) {
                Ok(info) => json_ok(serde_json::to_value(info).expect("serialisable")),
                Err(e) => topic_error(e),
            }
        }
        ("DELETE", path) if path.starts_with("/v1/topics/") => {
            delete_topic(inner, &path["/v1/topics/".len()..])
        }
        (_, path) => error(404, format!("no such endpoint: {path}")),
    }
}

/// The request body as JSON of type `T`, or the 400 response that says what is wrong.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(
    request: &Request,
    example: &str,
) -> Result<T, (u16, &'static str, String)> {
    let Ok(body) = std::str::from_utf8(&request.body) else {
        return Err(error(400, "request body is not UTF-8 text".into()));
    };
    serde_json::from_str(body).map_err(|e| {
        error(
            400,
            format!(
                "request body is not valid for {}: {e}; expected {example}",
                request.path()
            ),
        )
    })
}

/// `DELETE /v1/topics/NAME`: the topic as it was just before, with `"deleted": true`.
fn delete_topic(inner: &Inner, name: &str) -> (u16, &'static str, String) {
    match inner.control.delete(name) {
        Ok(info) => {
            let mut body = serde_json::to_value(info).expect("serialisable");
            body["deleted"] = json!(true);
            (200, "application/json", body.to_string())
        }
        Err(e) => topic_error(e),
    }
}

fn error(status: u16, message: String) -> (u16, &'static str, String) {
    (
        status,
        "application/json",
        json!({ "error": message }).to_string(),
    )
}

fn topic_error(e: TopicError) -> (u16, &'static str, String) {
    let status = match e {
        TopicError::Invalid(_) => 400,
        TopicError::NotFound(_) => 404,
        TopicError::Exists(_) => 409,
        TopicError::Full(_) | TopicError::FullOfDeleted { .. } => 507,
        TopicError::TooFewSlots { .. } => 500,
        TopicError::Io { .. } => 500,
    };
    error(status, e.to_string())
}

fn cluster(inner: &Inner) -> serde_json::Value {
    let members = inner.membership.view();
    let caps = inner.region.capacities();
    let lease = embarcadero_sequencer::LeaseState::read(&inner.region);
    json!({
        // What clients use: the brokers that serve now.
        "brokers": members.iter().filter(|m| matches!(m.state, MemberState::Local | MemberState::Alive)).map(|m| json!({
            "id": m.id,
            "addr": m.addr,
            "incarnation": m.incarnation,
        })).collect::<Vec<_>>(),
        "members": members,
        "epoch_us": inner.config.sequencer.epoch_us,
        "max_message_bytes": inner.config.broker.max_message_bytes,
        "max_batch_bytes": inner.config.broker.max_batch_bytes,
        "region": {
            "path": inner.region.path().display().to_string(),
            "bytes": inner.region.len(),
            "layout_version": embarcadero_region::layout::LAYOUT_VERSION,
            "capacities": caps,
        },
        // What followers and an external sequencer need to run like the head's own.
        "config": {
            "broker": inner.config.broker,
            "sequencer": inner.config.sequencer,
            "cluster": inner.config.cluster,
            "replica_dirs": inner.config.replica_dirs(),
        },
        "sequencer": {
            "mode": inner.config.cluster.sequencer,
            "holder": format!("{:016x}", lease.holder),
            "fencing_epoch": lease.fencing_epoch,
            "lease_remaining_ms": lease.remaining_ms,
        },
    })
}

/// `POST /v1/failover`: fences the dead broker and answers which of the client's
/// batches through it (by batch id) are in the global order (and durable, for ack
/// level 2). 409 while the broker is not declared dead yet.
/// The body of `POST /v1/failover`.
#[derive(serde::Deserialize)]
pub(crate) struct FailoverCall {
    topic: String,
    broker: u32,
    /// The broker process the batches went to (from `/v1/cluster`); absent: the
    /// one serving the id now.
    #[serde(default)]
    incarnation: Option<u64>,
    client_id: u64,
    batch_ids: Vec<u64>,
    #[serde(default = "one")]
    ack_level: u8,
}

fn one() -> u8 {
    1
}

fn failover_call(inner: &Inner, request: &Request) -> (u16, &'static str, String) {
    let call: FailoverCall = match read_json(
        request,
        r#"{"topic": "t", "broker": 2, "client_id": 7, "batch_ids": [40, 41], "ack_level": 1}"#,
    ) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let topic = match inner.control.describe(&call.topic) {
        Ok(t) => t,
        Err(e) => return topic_error(e),
    };
    if topic.order != 2 {
        return error(
            400,
            format!(
                "topic {:?} has order {}: only order 2 is answered here (order-5 publishers resend by session sequence, orders 0 and 1 have no global order)",
                topic.name, topic.order
            ),
        );
    }
    let fenced =
        inner
            .membership
            .fence_if_dead(call.broker, call.incarnation.filter(|&i| i != 0), || {
                crate::failover::fence_broker(&inner.region, call.broker)
            });
    match fenced {
        Ok(None | Some(0)) => {}
        Ok(Some(logs)) => tracing::warn!(
            broker = call.broker,
            logs,
            "dead broker fenced: its uncommitted slots will never be ordered"
        ),
        Err(FenceRefusal::NotDead(state)) => {
            return error(
                409,
                format!(
                    "broker {} is {state:?}, not dead; the head declares a broker dead {} ms after its last heartbeat",
                    call.broker,
                    inner.config.cluster.heartbeat_interval_ms
                        * inner.config.cluster.heartbeat_misses as u64
                ),
            )
        }
        Err(FenceRefusal::UnknownIncarnation) => {
            return error(
                410,
                format!(
                    "broker {} incarnation {} served before this head restarted, in a region the head replaced; which of those batches were ordered cannot be told exactly, so they count as failed: publish them again if they must be delivered",
                    call.broker,
                    call.incarnation.unwrap_or_default()
                ),
            )
        }
    }
    let query = crate::failover::FailoverQuery {
        topic: topic.id,
        replication_factor: topic.replication_factor,
        broker: call.broker,
        client_id: call.client_id,
        batch_ids: call.batch_ids,
        durable: call.ack_level >= 2,
    };
    match crate::failover::ordered_batches(
        &inner.region,
        &query,
        std::time::Duration::from_secs(10),
    ) {
        Ok(ids) => (
            200,
            "application/json",
            json!({ "ordered": ids }).to_string(),
        ),
        Err(e) => error(503, e.to_string()),
    }
}

/// `POST /v1/cluster/claim`: `{"id","incarnation"}`; answers how many logs it fenced.
/// The body of `POST /v1/cluster/claim`.
#[derive(serde::Deserialize)]
pub(crate) struct ClaimCall {
    id: u32,
    incarnation: u64,
}

fn claim_call(inner: &Inner, request: &Request) -> (u16, &'static str, String) {
    let call: ClaimCall = match read_json(request, r#"{"id": 1, "incarnation": 7}"#) {
        Ok(c) => c,
        Err(e) => return e,
    };
    if call.incarnation == 0 {
        return error(
            400,
            "incarnation 0 is reserved; pick any other number".into(),
        );
    }
    match inner.membership.claim(call.id, call.incarnation, || {
        crate::failover::fence_broker(&inner.region, call.id)
    }) {
        Ok(fenced) => {
            tracing::info!(
                broker = call.id,
                incarnation = call.incarnation,
                fenced,
                "broker id claimed by a starting follower"
            );
            (
                200,
                "application/json",
                json!({ "fenced_logs": fenced }).to_string(),
            )
        }
        // Only a taken id can clear (once its holder is declared dead).
        Err(e @ JoinError::Taken { .. }) => error(409, e.to_string()),
        Err(e) => error(400, e.to_string()),
    }
}

/// `POST /v1/cluster/join` and `/v1/cluster/heartbeat`: `{"id","addr","incarnation"}`.
/// The body of `POST /v1/cluster/join` and `/v1/cluster/heartbeat`.
#[derive(serde::Deserialize)]
pub(crate) struct MembershipCall {
    id: u32,
    #[serde(default)]
    addr: Option<std::net::SocketAddr>,
    incarnation: u64,
}

fn membership_call(inner: &Inner, request: &Request, join: bool) -> (u16, &'static str, String) {
    let call: MembershipCall = match read_json(
        request,
        r#"{"id": 1, "addr": "10.0.0.2:1215", "incarnation": 7}"#,
    ) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let result = if join {
        match call.addr {
            Some(addr) => inner.membership.join(call.id, addr, call.incarnation, || {
                crate::failover::is_fenced(&inner.region, call.id)
            }),
            None => {
                return error(
                    400,
                    "a join names the broker's data address: {\"id\",\"addr\",\"incarnation\"}"
                        .into(),
                )
            }
        }
    } else {
        inner.membership.heartbeat(call.id, call.incarnation)
    };
    match result {
        Ok(()) => {
            if join {
                tracing::info!(broker = call.id, addr = ?call.addr, incarnation = call.incarnation, "broker joined");
            }
            (
                200,
                "application/json",
                json!({"heartbeat_interval_ms": inner.config.cluster.heartbeat_interval_ms})
                    .to_string(),
            )
        }
        Err(e @ JoinError::OutOfRange { .. }) => error(400, e.to_string()),
        Err(e @ JoinError::NotMember { .. }) => error(404, e.to_string()),
        Err(e @ JoinError::Fenced { .. }) => error(410, e.to_string()),
        Err(e) => error(409, e.to_string()),
    }
}

fn status(inner: &Inner) -> serde_json::Value {
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_s": inner.started.elapsed().as_secs(),
        "cluster": cluster(inner),
        "topics": inner.control.list(),
        "brokers": inner.brokers.iter().map(|b| {
            let m = &b.metrics;
            json!({
                "id": b.id,
                "addr": b.addr.to_string(),
                "state": "local",
                "publish_bytes": m.publish_bytes.load(Ordering::Relaxed),
                "publish_batches": m.publish_batches.load(Ordering::Relaxed),
                "publish_messages": m.publish_messages.load(Ordering::Relaxed),
                "subscribe_bytes": m.subscribe_bytes.load(Ordering::Relaxed),
                "connections": m.connections_open.load(Ordering::Relaxed),
                "free_segments": b.pool.free_count(),
            })
        }).collect::<Vec<_>>(),
        "sequencer": match inner.sequencer_metrics.as_deref() {
            Some(seq) => json!({
                "state": "active",
                "mode": "embedded",
                "epochs": seq.epochs_sealed.load(Ordering::Relaxed),
                "batches_ordered": seq.batches_ordered.load(Ordering::Relaxed),
                "messages_ordered": seq.messages_ordered.load(Ordering::Relaxed),
            }),
            None => json!({"mode": "external"}),
        },
    })
}

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

/// The families of `brokers` (the head's own, or a follower's); returns their
/// per-stage time samples, which share one family with the sequencer's.
pub(crate) fn broker_families(
    families: &mut Families,
    brokers: &[crate::BrokerInfo],
) -> Vec<(String, u64)> {
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, u64)>| {
        families.family(name, kind, help, samples)
    };
    type Field = fn(&embarcadero_broker::BrokerMetrics) -> &std::sync::atomic::AtomicU64;
    let per_broker: [(&str, &str, &str, Field); 17] = [
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
    for (name, kind, help, field) in per_broker {
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
    let counters: [(&str, &str, &AtomicU64); 8] = [
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
            "Idle order-5 sessions that gave up their session-table slot to a new session.",
            &s.sessions_evicted,
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
fn metrics(inner: &Inner) -> String {
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
    family(
        "control_connections",
        "gauge",
        "Connections the admin API is serving (each on a thread of its own, until its request is answered).",
        vec![(
            String::new(),
            inner.control_connections.load(Ordering::Relaxed) as u64,
        )],
    );
    replication_metrics(inner, &topics, &mut family);
    let mut out = families.text();
    let r = &inner.replication_metrics;
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
    out
}

/// Replica counters, per-topic replication lag and durable frontiers.
fn replication_metrics(
    inner: &Inner,
    topics: &[crate::TopicInfo],
    family: &mut impl FnMut(&str, &str, &str, Vec<(String, u64)>),
) {
    type Field =
        fn(&embarcadero_replication::worker::ReplicaMetrics) -> &std::sync::atomic::AtomicU64;
    let per_replica: [(&str, &str, Field); 5] = [
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
    let r = &inner.replication_metrics;
    for (name, help, field) in per_replica {
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
