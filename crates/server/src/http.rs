//! The admin API (HTTP/JSON) on the control port (`/metrics` is rendered by `metrics`).
//!
//! | method | path | |
//! |---|---|---|
//! | GET | `/v1/cluster` | live brokers (clients discover brokers here), every member and its state, the region, the sequencer lease |
//! | POST | `/v1/cluster/claim` | a starting follower takes a broker id and fences the logs its previous process left, before it resumes them: `{"id","incarnation"}` |
//! | POST | `/v1/cluster/join` | a follower serves a broker id at an address: `{"id","addr","incarnation"}` |
//! | POST | `/v1/cluster/heartbeat` | a follower is alive: `{"id","incarnation"}` |
//! | POST | `/v1/failover` | which of a publisher's batches through a dead broker were ordered: `{"topic","broker","incarnation","client_id","batch_ids","ack_level"}` |
//! | GET | `/v1/status` | cluster, topics with counters and health, rates over the last seconds, broker and sequencer metrics, services |
//! | GET | `/v1/services` | services beside the log that announced themselves (the workflow orchestrator) |
//! | POST | `/v1/services` | a service says where it serves: `{"kind","addr","ttl_ms"}`; forgotten after `ttl_ms` of silence |
//! | GET | `/v1/topics` | every topic |
//! | POST | `/v1/topics` | create: `{"name","order","replication_factor","default_ack","retention_bytes","retention_ms"}`; any other field is a 400 that names it |
//! | GET | `/v1/topics/{name}` | one topic |
//! | DELETE | `/v1/topics/{name}` | delete a topic: its connections get TopicDeleted, its memory and disk logs are freed |
//! | any | `/v1/tasks*`, `/v1/templates*`, `/v1/dlq*`, `/v1/workflow/metrics` | the workflow API, forwarded to the orchestrator that announced itself (the newest; `workflow_proxy`); 503 `no_workflow_engine` while none did, 502 when none answers |
//! | GET | `/metrics` | Prometheus text format |
//! | GET | `/healthz` | `ok` |

use crate::cluster::{FenceRefusal, JoinError, MemberState};
use crate::control::{TopicError, TopicSpec};
use crate::follower::SharedConfig;
use crate::http_server::{Request, Response};
use crate::Inner;
use embarcadero_api::{
    BrokerAddr, ClusterInfo, LocalBrokerStats, RegionInfo, SequencerLease, SequencerStats,
    StatusReport,
};
use embarcadero_region::Capacities;
use serde_json::json;
use std::sync::atomic::Ordering;

/// Answers one admin request (`HttpServer` has read it in full).
pub fn respond(inner: &Inner, request: &Request) -> Response {
    if crate::workflow_proxy::is_workflow_route(request.path()) {
        return crate::workflow_proxy::forward(&inner.services, &inner.workflow_proxy, request);
    }
    let (status, content_type, body) = route(inner, request);
    // Only where no route answered: a route added for a new method is never shadowed.
    if let Some(allowed) = methods_other_than(request).filter(|_| status == 404) {
        let mut response = Response::error(
            405,
            format!(
                "{} does not take {}; it takes {allowed}",
                request.path(),
                request.method
            ),
        );
        response.headers.push(("Allow".into(), allowed.to_string()));
        return response;
    }
    Response::new(status, content_type, body)
}

/// The methods the request's path takes, when it is one of the API's paths and they do
/// not include the request's method (a 405 rather than the fallback's 404: the path is
/// right). A 404 of a route that took the method (no such topic) is left as it is.
fn methods_other_than(request: &Request) -> Option<&'static str> {
    let path = request.path();
    let allowed = match path {
        "/healthz" | "/metrics" | "/v1/cluster" | "/v1/status" => "GET",
        "/v1/cluster/claim" | "/v1/cluster/join" | "/v1/cluster/heartbeat" | "/v1/failover" => {
            "POST"
        }
        "/v1/services" | "/v1/topics" => "GET, POST",
        _ if path.len() > "/v1/topics/".len() && path.starts_with("/v1/topics/") => "GET, DELETE",
        _ => return None,
    };
    // HEAD goes wherever GET does (RFC 9110): not a 405 on a path GET takes.
    let method = match request.method.as_str() {
        "HEAD" => "GET",
        other => other,
    };
    (!allowed.split(", ").any(|m| m == method)).then_some(allowed)
}

fn route(inner: &Inner, request: &Request) -> (u16, &'static str, String) {
    let json_ok = |v: serde_json::Value| (200, "application/json", v.to_string());
    match (request.method.as_str(), request.path()) {
        ("GET", "/healthz") => (200, "text/plain", "ok\n".into()),
        ("GET", "/metrics") => (
            200,
            "text/plain; version=0.0.4",
            crate::metrics::of_head(inner),
        ),
        ("GET", "/v1/cluster") => json_ok(to_json(&cluster(inner))),
        ("POST", "/v1/cluster/claim") => claim_call(inner, request),
        ("POST", "/v1/cluster/join") => membership_call(inner, request, true),
        ("POST", "/v1/cluster/heartbeat") => membership_call(inner, request, false),
        ("POST", "/v1/failover") => failover_call(inner, request),
        ("GET", "/v1/status") => json_ok(to_json(&status(inner))),
        ("GET", "/v1/services") => json_ok(json!({ "services": inner.services.live() })),
        ("POST", "/v1/services") => announce_call(inner, request),
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
        // The usual text suggests creating the topic, which is not what a delete wants.
        Err(TopicError::NotFound(name, _)) => error(
            404,
            format!("topic {name:?} does not exist, so nothing was deleted; `embarcadero topic list` (GET /v1/topics) shows the topics"),
        ),
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
    let status = match &e {
        TopicError::Invalid(_) => 400,
        TopicError::NotFound(..) => 404,
        TopicError::Exists(_) => 409,
        TopicError::Full(_) | TopicError::FullOfDeleted { .. } => 507,
        TopicError::NoRoom(e) if e.is_no_room() => 507,
        TopicError::NoRoom(_) => 500,
        TopicError::TooFewSlots { .. } => 500,
        TopicError::Io { .. } => 500,
    };
    error(status, e.to_string())
}

fn cluster(inner: &Inner) -> ClusterInfo<SharedConfig, Capacities> {
    let members = inner.membership.view();
    let lease = embarcadero_sequencer::LeaseState::read(&inner.region);
    let config = &inner.config;
    ClusterInfo {
        // What clients use: the brokers that serve now.
        brokers: members
            .iter()
            .filter(|m| matches!(m.state, MemberState::Local | MemberState::Alive))
            .filter_map(|m| {
                let addr = m.addr.clone()?;
                Some(BrokerAddr {
                    id: m.id,
                    addr,
                    incarnation: m.incarnation,
                })
            })
            .collect(),
        members,
        epoch_us: config.sequencer.epoch_us,
        max_message_bytes: config.broker.max_message_bytes,
        max_batch_bytes: config.broker.max_batch_bytes,
        region: Some(RegionInfo {
            path: inner.region.path().display().to_string(),
            bytes: inner.region.len(),
            layout_version: embarcadero_region::layout::LAYOUT_VERSION,
            capacities: inner.region.capacities(),
        }),
        // What followers and an external sequencer need to run like the head's own.
        config: Some(SharedConfig {
            broker: config.broker.clone(),
            sequencer: config.sequencer.clone(),
            cluster: config.cluster.clone(),
            replica_dirs: config.replica_dirs(),
        }),
        sequencer: Some(SequencerLease {
            mode: config.cluster.sequencer.clone(),
            holder: format!("{:016x}", lease.holder),
            fencing_epoch: lease.fencing_epoch,
            lease_remaining_ms: lease.remaining_ms,
        }),
    }
}

/// The body of `POST /v1/failover`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
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

/// `POST /v1/failover`: fences the dead broker and answers which of the client's
/// batches through it (by batch id) are in the global order (and durable, for ack
/// level 2). 409 while the broker is not declared dead yet.
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
    if let Err(refused) = fence_dead_broker(inner, &call) {
        return refused;
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

/// Fences `call`'s broker if the head has declared that process dead (its
/// uncommitted slots are then never ordered), so the GOI answers for its batches. The
/// error is the answer to give instead: 409 while the broker is not declared dead, 410
/// for a process of a region the head replaced.
fn fence_dead_broker(
    inner: &Inner,
    call: &FailoverCall,
) -> Result<(), (u16, &'static str, String)> {
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
            return Err(error(
                409,
                format!(
                    "broker {} is {state:?}, not dead; the head declares a broker dead {} ms after its last heartbeat",
                    call.broker,
                    inner.config.cluster.heartbeat_interval_ms
                        * inner.config.cluster.heartbeat_misses as u64
                ),
            ))
        }
        Err(FenceRefusal::UnknownIncarnation) => {
            return Err(error(
                410,
                format!(
                    "broker {} incarnation {} served before this head restarted, in a region the head replaced; which of those batches were ordered cannot be told exactly, so they count as failed: publish them again if they must be delivered",
                    call.broker,
                    call.incarnation.unwrap_or_default()
                ),
            ))
        }
    }
    Ok(())
}

/// The body of `POST /v1/cluster/claim`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClaimCall {
    id: u32,
    incarnation: u64,
}

/// `POST /v1/cluster/claim`: `{"id","incarnation"}`; answers how many logs it fenced.
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

/// The body of `POST /v1/cluster/join` and `/v1/cluster/heartbeat`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MembershipCall {
    id: u32,
    #[serde(default)]
    addr: Option<std::net::SocketAddr>,
    incarnation: u64,
}

/// `POST /v1/cluster/join` and `/v1/cluster/heartbeat`: `{"id","addr","incarnation"}`.
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

fn to_json(document: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(document).expect("the API's documents serialise")
}

fn status(inner: &Inner) -> StatusReport<SharedConfig, Capacities> {
    StatusReport {
        version: env!("CARGO_PKG_VERSION").to_string(),
        uptime_s: inner.started.elapsed().as_secs(),
        cluster: cluster(inner),
        topics: inner.control.list(),
        rates: inner.rates.report(),
        brokers: inner.brokers.iter().map(local_broker_stats).collect(),
        sequencer: match inner.sequencer_metrics.as_deref() {
            Some(seq) => SequencerStats::Embedded {
                epochs: seq.epochs_sealed.load(Ordering::Relaxed),
                batches_ordered: seq.batches_ordered.load(Ordering::Relaxed),
                messages_ordered: seq.messages_ordered.load(Ordering::Relaxed),
            },
            None => SequencerStats::External,
        },
        services: inner.services.live(),
    }
}

/// `POST /v1/services`: `{"kind", "addr", "ttl_ms", "log"?}`; 400 for a bad field, 409
/// for a log this head does not have, 507 when the registry is full.
fn announce_call(inner: &Inner, request: &Request) -> (u16, &'static str, String) {
    let example = r#"{"kind": "workflow", "addr": "127.0.0.1:7411", "ttl_ms": 3000}"#;
    let announce: embarcadero_api::ServiceAnnounce = match read_json(request, example) {
        Ok(a) => a,
        Err(e) => return e,
    };
    if let Err(e) = crate::services::validate(&announce) {
        return error(400, e.to_string());
    }
    if let Some(log) = &announce.log {
        let here = inner.control.describe(&log.topic).ok();
        if here.as_ref().map(|t| t.created_unix_ms) != Some(log.created_unix_ms) {
            return error(409, foreign_log(log, here.is_some()));
        }
    }
    match inner.services.announce(announce) {
        Ok(()) => (200, "application/json", "{}".into()),
        Err(e @ crate::services::ServiceError::Invalid(_)) => error(400, e.to_string()),
        Err(e @ crate::services::ServiceError::Full) => error(507, e.to_string()),
    }
}

/// Why a service's announcement names a log this head does not have.
fn foreign_log(log: &embarcadero_api::ServiceLog, name_known: bool) -> String {
    let what = if name_known {
        "a topic of that name created at another time"
    } else {
        "no topic of that name"
    };
    format!(
        "this head has {what}, not the topic {:?} created at unix ms {} that the service folds: \
         it belongs to another cluster or its topic was deleted; point the service at its \
         own cluster's head (--control), or restart it",
        log.topic, log.created_unix_ms
    )
}

fn local_broker_stats(b: &crate::BrokerInfo) -> LocalBrokerStats {
    let m = &b.metrics;
    LocalBrokerStats {
        id: b.id,
        addr: b.addr.to_string(),
        publish_bytes: m.publish_bytes.load(Ordering::Relaxed),
        publish_batches: m.publish_batches.load(Ordering::Relaxed),
        publish_messages: m.publish_messages.load(Ordering::Relaxed),
        subscribe_bytes: m.subscribe_bytes.load(Ordering::Relaxed),
        connections: m.connections_open.load(Ordering::Relaxed),
        backpressure_waits: m.backpressure_waits.load(Ordering::Relaxed),
        free_segments: b.pool.free_count() as u64,
    }
}
