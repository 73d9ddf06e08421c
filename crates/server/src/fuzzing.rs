//! Entry points for the coverage-guided fuzz targets in `fuzz/` (see
//! `docs/RELIABILITY.md`): the parsers of untrusted admin-API input, reachable without a
//! running server. Not an API; nothing else calls these.

use crate::control::{validate_spec, TopicSpec};
use crate::http::{read_json, ClaimCall, FailoverCall, MembershipCall};
use crate::http_server::{head_end, parse_head, Request, Response, MAX_BODY};
use embarcadero_api::ServiceAnnounce;

pub use crate::http_server::RequestHead;

/// What the admin server makes of `received`, the bytes of one connection, up to
/// routing: the head and the body, or the refusal it answers with; `Ok(None)` while the
/// request is incomplete (the server would read on).
pub fn http_request(received: &[u8]) -> Result<Option<(RequestHead, &[u8])>, Response> {
    let Some(end) = head_end(received)? else {
        return Ok(None);
    };
    let head = parse_head(&received[..end])?;
    let body = &received[end..];
    assert!(
        head.content_length <= MAX_BODY,
        "a larger body was accepted"
    );
    if body.len() > head.content_length {
        return Err(Response::error(
            400,
            "more bytes than the Content-Length; one request per connection",
        ));
    }
    if body.len() < head.content_length {
        return Ok(None);
    }
    Ok(Some((head, body)))
}

/// The admin endpoints that take a JSON body.
pub const BODY_ENDPOINTS: [&str; 6] = [
    "/v1/topics",
    "/v1/services",
    "/v1/cluster/claim",
    "/v1/cluster/join",
    "/v1/cluster/heartbeat",
    "/v1/failover",
];

/// Parses `body` as the endpoint at `BODY_ENDPOINTS[endpoint % 6]` does, and for a topic
/// creation validates the spec as the control plane does before it touches the region.
/// `Ok(true)` when the body is accepted.
pub fn admin_body(endpoint: usize, body: &[u8], disk_replicas: u8) -> Result<bool, Response> {
    let url = BODY_ENDPOINTS[endpoint % BODY_ENDPOINTS.len()];
    let request = Request {
        method: "POST".into(),
        url: url.into(),
        body: body.to_vec(),
        last_event_id: None,
        content_type: None,
    };
    let refused = |(status, _, body): (u16, &'static str, String)| {
        Response::new(status, "application/json", body)
    };
    match url {
        "/v1/topics" => {
            let spec: TopicSpec = read_json(&request, "").map_err(refused)?;
            Ok(validate_spec(&spec, disk_replicas).is_ok())
        }
        "/v1/cluster/claim" => read_json::<ClaimCall>(&request, "")
            .map(|_| true)
            .map_err(refused),
        "/v1/services" => {
            let announce: ServiceAnnounce = read_json(&request, "").map_err(refused)?;
            Ok(crate::services::validate(&announce).is_ok())
        }
        "/v1/failover" => read_json::<FailoverCall>(&request, "")
            .map(|_| true)
            .map_err(refused),
        _ => read_json::<MembershipCall>(&request, "")
            .map(|_| true)
            .map_err(refused),
    }
}

/// Loads a configuration file as `embarcadero serve --config` does, with `env` as the
/// environment, then computes the region layout its capacities give (what the server
/// does next, before it creates the region).
pub fn config_file(
    path: &std::path::Path,
    env: Vec<(String, String)>,
) -> Result<crate::ServerConfig, String> {
    let config = crate::ServerConfig::load_with_env(Some(path), env).map_err(|e| e.to_string())?;
    embarcadero_region::Layout::new(config.capacities()).map_err(|e| e.to_string())?;
    Ok(config)
}
