//! The workflow API on the control port: `/v1/tasks*`, `/v1/templates*`, `/v1/dlq*` and
//! `/v1/workflow/*` (the engine's metrics) are forwarded to the workflow orchestrator that announced itself (`services`, kind
//! `workflow`), so that a user needs one address for the log and the engine.
//!
//! Owns the forwarding and its counters; reads the service registry and touches nothing
//! else. Each request gets a fresh upstream connection that says `Connection: close`;
//! the answer's head is read and checked here, then its body is copied as it arrives
//! (a long poll's JSON, or a task's server-sent events one by one) until its
//! Content-Length or the upstream's end, and the client's connection closes after it.
//! Bounded: a connect, the answer's head and each read of the body have deadlines, and
//! the control port's connection limit counts every forwarded request.

use crate::http_server::{Request, Response, StreamBody};
use crate::services::Services;
use std::borrow::Cow;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The service kind the orchestrator announces (`embarcadero orchestrator`).
pub const KIND: &str = "workflow";
/// The longest long poll the workflow API allows (`?wait=`, its `MAX_WAIT_S`; the CLI
/// asserts at compile time that the two agree).
pub const MAX_WAIT_S: u64 = 300;
/// How long a connect to an orchestrator may take before the next one is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the answer's head may take beyond the request's `?wait=`: the API answers a
/// command once the log applied it, within 10 s, or says why not.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest silence within a body: an event stream sends a comment every 15 s.
const BODY_IDLE: Duration = Duration::from_secs(60);
/// Largest answer head accepted from the orchestrator (its answers' heads are small).
const MAX_HEAD: usize = 16 * 1024;
const MAX_HEADERS: usize = 64;
/// Requests forwarded at once, bodies included: a quarter of the control port's 1024
/// connections. Each holds its connection for as long as the orchestrator takes (a long
/// poll up to 300 s, an event stream for the task's life), so without a cap a burst of
/// long polls took every connection of the control port, and the admin API and every
/// `pub`/`sub` start with it, for five minutes (an adversarial run, session 33).
pub const MAX_FORWARDED: usize = 256;

/// What `/metrics` shows of the forwarding.
#[derive(Debug, Default)]
pub struct ProxyMetrics {
    /// Requests an orchestrator answered (whatever its status).
    pub forwarded: AtomicU64,
    /// Requests answered 503 because no orchestrator had announced itself.
    pub no_engine: AtomicU64,
    /// Requests answered 502: no announced orchestrator accepted a connection.
    pub unreachable: AtomicU64,
    /// Requests answered 502: the orchestrator's answer was cut off, late or malformed.
    pub bad_answer: AtomicU64,
    /// Requests answered 503 because [`MAX_FORWARDED`] were in progress.
    pub busy: AtomicU64,
    /// Requests being forwarded now, until their answer's body has been copied.
    pub in_flight: Arc<AtomicUsize>,
}

/// A forwarded request's place in [`ProxyMetrics::in_flight`], given back when dropped:
/// with the answer's body, which is copied after `forward` returns.
struct Forwarding(Arc<AtomicUsize>);

impl Forwarding {
    /// A place, or `None` when [`MAX_FORWARDED`] are taken.
    fn take(in_flight: &Arc<AtomicUsize>) -> Option<Self> {
        if in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_FORWARDED {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(in_flight.clone()))
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        let before = self.0.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "a forwarding place given back twice");
    }
}

/// Whether the control port forwards `path` to the workflow engine.
pub fn is_workflow_route(path: &str) -> bool {
    ["/v1/tasks", "/v1/templates", "/v1/dlq", "/v1/workflow"]
        .iter()
        .any(|p| {
            path.strip_prefix(p)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
}

/// Forwards `request` to the newest announced orchestrator (the next one when a connect
/// fails) and returns its answer, the body streamed; 503 `no_workflow_engine` when none
/// announced itself, 502 when none can be reached or its answer is unusable.
pub fn forward(services: &Services, metrics: &ProxyMetrics, request: &Request) -> Response {
    let Some(place) = Forwarding::take(&metrics.in_flight) else {
        metrics.busy.fetch_add(1, Ordering::Relaxed);
        return api_error(
            503,
            "workflow_proxy_busy",
            format!("{MAX_FORWARDED} workflow requests (long polls and event streams included) are in progress through this control port, the most it forwards at once so that the admin API stays reachable; retry shortly, or ask the orchestrator at its own address"),
        );
    };
    let engines = services.newest_first(KIND);
    if engines.is_empty() {
        metrics.no_engine.fetch_add(1, Ordering::Relaxed);
        return api_error(
            503,
            "no_workflow_engine",
            "no workflow orchestrator has announced itself to this head; start `embarcadero orchestrator --control ...`".into(),
        );
    }
    let (mut upstream, addr) = match connect_first(&engines) {
        Ok(found) => found,
        Err(why) => {
            metrics.unreachable.fetch_add(1, Ordering::Relaxed);
            return api_error(
                502,
                "workflow_engine_unreachable",
                format!("no announced workflow orchestrator accepts connections ({why}); it may have just died: a standby takes over within its failover time, retry then"),
            );
        }
    };
    let due = Instant::now() + ANSWER_TIMEOUT + Duration::from_secs(wait_s(&request.url));
    match exchange(&mut upstream, request, &addr, due) {
        Ok((mut response, rest)) => {
            metrics.forwarded.fetch_add(1, Ordering::Relaxed);
            let length = response_length(&response, request);
            response.stream = Some(copy_body(upstream, rest, length, place));
            response
        }
        Err(why) => {
            metrics.bad_answer.fetch_add(1, Ordering::Relaxed);
            api_error(
                502,
                "workflow_engine_failed",
                format!("the workflow orchestrator at {addr} did not answer usably: {why}"),
            )
        }
    }
}

/// The workflow API's error shape, `{"error":{"code","message"}}`.
fn api_error(status: u16, code: &str, message: String) -> Response {
    let body = serde_json::json!({"error": {"code": code, "message": message}}).to_string();
    let mut response = Response::new(status, "application/json", body);
    if status == 503 {
        // An orchestrator announces itself within a second of serving.
        response.headers.push(("Retry-After".into(), "1".into()));
    }
    response
}

/// The first of `engines` (host:port each) that accepts a connection, and its address.
fn connect_first(engines: &[String]) -> Result<(TcpStream, SocketAddr), String> {
    let mut why = Vec::new();
    for engine in engines {
        let addrs = match engine.to_socket_addrs() {
            Ok(addrs) => addrs,
            Err(e) => {
                why.push(format!("{engine}: {e}"));
                continue;
            }
        };
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(stream) => return Ok((stream, addr)),
                Err(e) => why.push(format!("{engine}: {e}")),
            }
        }
    }
    Err(why.join("; "))
}

/// The `wait` of a long poll (`?wait=SECONDS`), at most what the API allows; 0 when
/// absent or not a number (the API then answers 400 at once).
fn wait_s(url: &str) -> u64 {
    let query = url.split_once('?').map(|(_, q)| q).unwrap_or("");
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix("wait="))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |s| s.min(MAX_WAIT_S))
}

/// Sends the request and reads the answer's head by `due`: the response (without its
/// body) and the body's bytes that came with the head.
fn exchange(
    upstream: &mut TcpStream,
    request: &Request,
    addr: &SocketAddr,
    due: Instant,
) -> Result<(Response, Vec<u8>), String> {
    upstream
        .set_write_timeout(Some(CONNECT_TIMEOUT * 5))
        .map_err(|e| e.to_string())?;
    upstream
        .write_all(&request_bytes(request, addr))
        .map_err(|e| format!("sending the request: {e}"))?;
    let mut received = Vec::new();
    let head_len = loop {
        if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        if received.len() > MAX_HEAD {
            return Err(format!("an answer head longer than {MAX_HEAD} bytes"));
        }
        let left = due.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("no answer in time".into());
        }
        upstream
            .set_read_timeout(Some(left))
            .map_err(|e| e.to_string())?;
        let mut chunk = [0u8; 4096];
        match upstream.read(&mut chunk) {
            Ok(0) => return Err("the connection closed before the answer".into()),
            Ok(n) => received.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the answer: {e}")),
        }
    };
    if head_len > MAX_HEAD {
        return Err(format!("an answer head longer than {MAX_HEAD} bytes"));
    }
    let rest = received.split_off(head_len);
    Ok((parse_answer_head(&received)?, rest))
}

/// The upstream request: method, target, body and the headers the API reads.
fn request_bytes(request: &Request, addr: &SocketAddr) -> Vec<u8> {
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        request.method,
        request.url,
        request.body.len()
    );
    // Both values were parsed by httparse, which admits no CR or LF in them.
    if let Some(t) = &request.content_type {
        head.push_str(&format!("Content-Type: {t}\r\n"));
    }
    if let Some(id) = &request.last_event_id {
        head.push_str(&format!("Last-Event-ID: {id}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(&request.body);
    out
}

/// Parses the orchestrator's answer head (untrusted bytes): status, Content-Type and
/// every end-to-end header, Content-Length checked (digits, one value).
pub fn parse_answer_head(head: &[u8]) -> Result<Response, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    match parsed.parse(head) {
        Ok(httparse::Status::Complete(n)) if n == head.len() => {}
        Ok(_) => return Err("an incomplete answer head".into()),
        Err(e) => return Err(format!("a malformed answer head: {e}")),
    }
    let status = parsed.code.unwrap_or(0);
    if !(200..=599).contains(&status) {
        return Err(format!("status {status}, not a final answer"));
    }
    let mut response = Response::new(status, "application/octet-stream", String::new());
    let mut length: Option<u64> = None;
    for h in parsed.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| format!("header {} is not UTF-8 text", h.name))?
            .trim();
        let name = h.name.to_ascii_lowercase();
        match name.as_str() {
            // Hop by hop: this connection's, not the client's.
            "connection" | "keep-alive" | "proxy-connection" | "upgrade" | "te" | "trailer" => {}
            "content-type" => response.content_type = Cow::Owned(value.to_string()),
            "content-length" => {
                let n = value
                    .parse::<u64>()
                    .ok()
                    .filter(|_| value.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| format!("bad Content-Length {value:?}"))?;
                if length.is_some_and(|l| l != n) {
                    return Err("two different Content-Lengths".into());
                }
                length = Some(n);
            }
            _ => response
                .headers
                .push((Cow::Owned(h.name.to_string()), value.to_string())),
        }
    }
    if let Some(n) = length {
        response
            .headers
            .push(("Content-Length".into(), n.to_string()));
    }
    Ok(response)
}

/// How many body bytes follow the head: `Some(n)` by Content-Length (0 for a HEAD
/// request and for 204 and 304), `None` to the upstream's end (an event stream).
fn response_length(response: &Response, request: &Request) -> Option<u64> {
    if request.method == "HEAD" || matches!(response.status, 204 | 304) {
        return Some(0);
    }
    response
        .headers
        .iter()
        .find(|(n, _)| n == "Content-Length")
        .and_then(|(_, v)| v.parse().ok())
}

/// The body as a [`StreamBody`]: `rest` (what came with the head), then whatever the
/// upstream sends, each read written on at once, until `length` bytes or its end.
fn copy_body(
    upstream: TcpStream,
    rest: Vec<u8>,
    length: Option<u64>,
    place: Forwarding,
) -> StreamBody {
    let upstream = parking_lot::Mutex::new(Some((upstream, rest, place)));
    StreamBody(Arc::new(move |out: &mut dyn Write| {
        // The server runs a stream body once; a second run has nothing to copy. The
        // place goes back when this run ends (or the answer is dropped unsent).
        let Some((mut upstream, rest, _place)) = upstream.lock().take() else {
            return Ok(());
        };
        let mut left = length.unwrap_or(u64::MAX);
        let first = rest.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        out.write_all(&rest[..first])?;
        left -= first as u64;
        upstream.set_read_timeout(Some(BODY_IDLE))?;
        let mut chunk = vec![0u8; 16 * 1024];
        while left > 0 {
            let want = chunk.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = match upstream.read(&mut chunk[..want]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            assert!(
                n <= want,
                "a read returns at most what it was given room for"
            );
            out.write_all(&chunk[..n])?;
            out.flush()?;
            left -= n as u64;
        }
        Ok(())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http_server::{HttpServer, Limits};
    use embarcadero_api::ServiceAnnounce;
    use std::net::TcpListener;

    fn announced(addr: &str) -> Services {
        let services = Services::default();
        let announce = ServiceAnnounce {
            kind: KIND.into(),
            addr: addr.into(),
            ttl_ms: 60_000,
            log: None,
        };
        services.announce(announce).unwrap();
        services
    }

    #[test]
    fn an_answer_comes_back_with_its_status_headers_and_body() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let upstream = HttpServer::start(
            listener,
            "test-upstream",
            Limits::default(),
            Arc::default(),
            |r: &Request| {
                let body = format!(
                    "{} {} {:?} {:?} {}",
                    r.method,
                    r.url,
                    r.last_event_id,
                    r.content_type,
                    String::from_utf8_lossy(&r.body)
                );
                let mut answer = Response::new(201, "text/plain", body);
                answer.headers.push(("Retry-After".into(), "7".into()));
                answer
            },
        )
        .unwrap();
        let services = announced(&upstream.local_addr().to_string());
        let metrics = ProxyMetrics::default();
        let request = Request {
            method: "POST".into(),
            url: "/v1/tasks?wait=1".into(),
            body: b"{}".to_vec(),
            last_event_id: Some("5".into()),
            content_type: Some("application/json".into()),
        };
        let answer = forward(&services, &metrics, &request);
        assert_eq!((answer.status, &*answer.content_type), (201, "text/plain"));
        let expected = r#"POST /v1/tasks?wait=1 Some("5") Some("application/json") {}"#;
        let length = expected.len().to_string();
        assert!(answer.headers.contains(&("Retry-After".into(), "7".into())));
        assert!(answer.headers.contains(&("Content-Length".into(), length)));
        assert_eq!(
            metrics.in_flight.load(Ordering::Relaxed),
            1,
            "held with its body"
        );
        let mut body = Vec::new();
        (answer.stream.expect("a streamed body").0)(&mut body).unwrap();
        assert_eq!(String::from_utf8(body).unwrap(), expected);
        assert_eq!(metrics.forwarded.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.in_flight.load(Ordering::Relaxed), 0, "given back");
    }

    #[test]
    fn past_the_most_forwarded_at_once_a_request_is_answered_busy_at_once() {
        // An address nothing listens on: a request that were forwarded would fail 502.
        let services = announced("127.0.0.1:1");
        let metrics = ProxyMetrics::default();
        metrics.in_flight.store(MAX_FORWARDED, Ordering::Relaxed);
        let request = Request {
            method: "GET".into(),
            url: "/v1/tasks/u?wait=300".into(),
            body: Vec::new(),
            last_event_id: None,
            content_type: None,
        };
        let answer = forward(&services, &metrics, &request);
        assert_eq!(answer.status, 503);
        assert!(
            answer.body.contains("workflow_proxy_busy"),
            "{}",
            answer.body
        );
        assert_eq!(metrics.busy.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.in_flight.load(Ordering::Relaxed), MAX_FORWARDED);
        // One place freed: the next request is forwarded (and fails to connect: 502),
        // and its place is given back with its answer.
        metrics
            .in_flight
            .store(MAX_FORWARDED - 1, Ordering::Relaxed);
        assert_eq!(forward(&services, &metrics, &request).status, 502);
        assert_eq!(metrics.in_flight.load(Ordering::Relaxed), MAX_FORWARDED - 1);
    }

    #[test]
    fn a_refused_connect_falls_back_to_the_next_engine_and_none_is_a_502() {
        let live = TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let engines = [dead.to_string(), live.local_addr().unwrap().to_string()];
        let (_, reached) = connect_first(&engines).unwrap();
        assert_eq!(reached, live.local_addr().unwrap());
        let why = connect_first(&engines[..1]).unwrap_err();
        assert!(why.contains(&dead.to_string()), "{why}");

        let metrics = ProxyMetrics::default();
        let request = Request {
            method: "GET".into(),
            url: "/v1/tasks".into(),
            body: Vec::new(),
            last_event_id: None,
            content_type: None,
        };
        let answer = forward(&announced(&dead.to_string()), &metrics, &request);
        assert_eq!(answer.status, 502, "{}", answer.body);
        assert!(answer.body.contains("workflow_engine_unreachable"));
        let none = forward(&Services::default(), &metrics, &request);
        assert_eq!(none.status, 503);
        assert!(none.body.contains("no_workflow_engine"));
        let counted = [&metrics.unreachable, &metrics.no_engine].map(|c| c.load(Ordering::Relaxed));
        assert_eq!(counted, [1, 1]);
    }

    #[test]
    fn only_the_workflow_routes_are_forwarded() {
        for path in [
            "/v1/tasks",
            "/v1/tasks/x/events",
            "/v1/templates/a/b",
            "/v1/dlq",
        ] {
            assert!(is_workflow_route(path), "{path}");
        }
        for path in [
            "/v1/taskset",
            "/v1/topics",
            "/v1/dlqx",
            "/metrics",
            "/v1",
            "/v1/workflows",
        ] {
            assert!(!is_workflow_route(path), "{path}");
        }
    }

    #[test]
    fn wait_is_read_from_the_query_and_capped() {
        assert_eq!(wait_s("/v1/tasks/u?wait=30"), 30);
        assert_eq!(wait_s("/v1/tasks/u?x=1&wait=9999"), MAX_WAIT_S);
        assert_eq!(wait_s("/v1/tasks/u?wait=-1"), 0);
        assert_eq!(wait_s("/v1/tasks/u"), 0);
    }

    #[test]
    fn an_answer_head_keeps_end_to_end_headers_and_checks_its_length() {
        let r = parse_answer_head(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n\
              Connection: keep-alive\r\nRetry-After: 1\r\nContent-Length: 42\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, &*r.content_type), (503, "application/json"));
        let names: Vec<&str> = r.headers.iter().map(|(n, _)| &**n).collect();
        assert_eq!(names, ["Retry-After", "Content-Length"]);
        let bad: [&[u8]; 5] = [
            b"HTTP/1.1 200 OK\r\nContent-Length: +4\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            b"NONSENSE\r\n\r\n",
        ];
        for head in bad {
            assert!(parse_answer_head(head).is_err(), "{head:?}");
        }
    }
}
