//! Sequencer leader election on etcd, for sequencers on different hosts.
//!
//! The candidates race for one key (`/embarcadero/<cluster>/sequencer`) with a
//! transaction "create it if it does not exist", the key bound to an etcd lease that
//! the leader keeps alive. When the leader dies or is cut off, etcd lets the lease
//! expire and deletes the key, and a waiting candidate's transaction succeeds. Talks to
//! etcd's JSON gateway (`/v3/...`) over plain HTTP, so no gRPC stack is needed.
//!
//! Winning the election is necessary, not sufficient: the elected sequencer then takes
//! the region's own lease (see `embarcadero_sequencer::lease`), which is what fences
//! writes to the region itself.

use base64::Engine as _;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error("cannot reach etcd at {endpoint}: {message}; start etcd or fix --etcd")]
    Unreachable { endpoint: String, message: String },
    #[error("etcd at {endpoint} answered something unexpected: {message}")]
    Protocol { endpoint: String, message: String },
}

/// Won leadership. Dropping it resigns (revokes the etcd lease).
pub struct Leadership {
    endpoint: String,
    lease_id: String,
    lost: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    keepalive: Option<JoinHandle<()>>,
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn call(endpoint: &str, path: &str, body: Value) -> Result<Value, ElectionError> {
    let url = format!("{}/v3/{path}", endpoint.trim_end_matches('/'));
    let response = ureq::post(&url)
        .timeout(Duration::from_secs(5))
        .send_json(body)
        .map_err(|e| ElectionError::Unreachable {
            endpoint: endpoint.to_string(),
            message: e.to_string(),
        })?;
    response.into_json().map_err(|e| ElectionError::Protocol {
        endpoint: endpoint.to_string(),
        message: e.to_string(),
    })
}

/// The key every candidate of `cluster` races for.
pub fn election_key(cluster: &str) -> String {
    format!("/embarcadero/{cluster}/sequencer")
}

/// Who holds `key` now, if anyone (the value the leader wrote).
pub fn current_leader(endpoint: &str, key: &str) -> Result<Option<String>, ElectionError> {
    let v = call(endpoint, "kv/range", json!({ "key": b64(key) }))?;
    Ok(v["kvs"][0]["value"].as_str().and_then(|s| {
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
    }))
}

/// Campaigns for `key` with a lease of `ttl` until elected (returns the leadership),
/// or until `give_up` is raised (returns `None`). `me` is written as the key's value.
/// A candidate that gives up or fails revokes its lease at once, rather than leaving it
/// to expire.
pub fn campaign(
    endpoint: &str,
    key: &str,
    me: &str,
    ttl: Duration,
    give_up: &AtomicBool,
) -> Result<Option<Leadership>, ElectionError> {
    let ttl_s = ttl.as_secs().max(2);
    let mut lease_id = grant_lease(endpoint, ttl_s)?;
    match race(endpoint, key, me, ttl_s, &mut lease_id, give_up) {
        Ok(true) => Ok(Some(lead(endpoint, lease_id, ttl_s))),
        lost_or_failed => {
            let _ = call(endpoint, "lease/revoke", json!({ "ID": lease_id }));
            lost_or_failed.map(|_| None)
        }
    }
}

/// Tries to create `key` bound to the candidate's lease until it succeeds (`true`) or
/// `give_up` is raised (`false`), keeping the lease alive meanwhile. A lease that
/// expired while waiting (etcd was away longer than its TTL) is replaced in
/// `lease_id`: a key cannot be bound to a lease etcd no longer has.
fn race(
    endpoint: &str,
    key: &str,
    me: &str,
    ttl_s: u64,
    lease_id: &mut String,
    give_up: &AtomicBool,
) -> Result<bool, ElectionError> {
    let poll = Duration::from_millis((ttl_s * 1000 / 10).max(50));
    loop {
        if give_up.load(Ordering::Acquire) {
            return Ok(false);
        }
        let txn = call(
            endpoint,
            "kv/txn",
            json!({
                "compare": [{"key": b64(key), "target": "CREATE", "create_revision": "0"}],
                "success": [{"requestPut": {"key": b64(key), "value": b64(me), "lease": *lease_id}}],
            }),
        )?;
        if txn["succeeded"].as_bool() == Some(true) {
            return Ok(true);
        }
        // Someone else leads; keep our own lease alive while we wait.
        let kept = call(endpoint, "lease/keepalive", json!({ "ID": *lease_id }))?;
        if kept["result"]["TTL"].as_str().is_none_or(|t| t == "0") {
            tracing::warn!(lease = %lease_id, "the candidate's etcd lease expired; granting another");
            *lease_id = grant_lease(endpoint, ttl_s)?;
        }
        std::thread::sleep(poll);
    }
}

/// The leadership won with `lease_id`, its keep-alive thread started.
fn lead(endpoint: &str, lease_id: String, ttl_s: u64) -> Leadership {
    let lost = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let keepalive = spawn_keepalive(endpoint, &lease_id, ttl_s, &lost, &stop);
    Leadership {
        endpoint: endpoint.to_string(),
        lease_id,
        lost,
        stop,
        keepalive: Some(keepalive),
    }
}

/// Grants the etcd lease (of `ttl_s` seconds) a candidate binds the key to; returns its
/// ID.
fn grant_lease(endpoint: &str, ttl_s: u64) -> Result<String, ElectionError> {
    let grant = call(endpoint, "lease/grant", json!({ "TTL": ttl_s }))?;
    let lease_id = grant["ID"]
        .as_str()
        .ok_or_else(|| ElectionError::Protocol {
            endpoint: endpoint.to_string(),
            message: format!("lease grant without an ID: {grant}"),
        })?
        .to_string();
    Ok(lease_id)
}

/// Starts the elected leader's thread that keeps its etcd lease `lease_id` alive, a
/// third of `ttl_s` apart, until `stop` is raised; raises `lost` if a renewal fails.
fn spawn_keepalive(
    endpoint: &str,
    lease_id: &str,
    ttl_s: u64,
    lost: &Arc<AtomicBool>,
    stop: &Arc<AtomicBool>,
) -> JoinHandle<()> {
    let (endpoint, lease_id, lost, stop) = (
        endpoint.to_string(),
        lease_id.to_string(),
        lost.clone(),
        stop.clone(),
    );
    let period = Duration::from_millis(ttl_s * 1000 / 3);
    std::thread::Builder::new()
        .name("etcd-keepalive".into())
        .spawn(move || {
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(period);
                let alive = call(&endpoint, "lease/keepalive", json!({ "ID": lease_id }))
                    .map(|v| v["result"]["TTL"].as_str().is_some_and(|t| t != "0"));
                if alive.as_ref().map_or(true, |a| !a) && !stop.load(Ordering::Acquire) {
                    tracing::error!(
                        "lost the etcd leadership lease ({}); this sequencer must stop",
                        match alive {
                            Ok(_) => "expired".to_string(),
                            Err(e) => e.to_string(),
                        }
                    );
                    lost.store(true, Ordering::Release);
                    return;
                }
            }
        })
        .expect("spawn the etcd keepalive")
}

impl Leadership {
    /// True once the etcd lease could not be renewed: another candidate may lead now.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.keepalive.take() {
            let _ = t.join();
        }
        let _ = call(
            &self.endpoint,
            "lease/revoke",
            json!({ "ID": self.lease_id }),
        );
    }
}
