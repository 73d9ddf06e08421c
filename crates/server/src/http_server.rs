//! A small HTTP/1.1 server for the admin API and `/metrics`: one request per connection,
//! each connection on a thread of its own, the whole request (headers and body) due
//! within a deadline, and a bound on connections open at once.
//!
//! Why not a general-purpose library: the admin API must answer heartbeats and claims
//! whatever other clients do. With a fixed pool of workers (tiny_http, used before), a
//! client that announces a body and never sends it holds a worker, and enough of them
//! queue everyone else; here such a client holds only its own thread, until its deadline.
//! The requests are small JSON documents and scrapes, so no chunked bodies (411: send a
//! Content-Length), and bodies of at most `MAX_BODY`. One request per connection, unless
//! the server is started with [`Limits::keep_alive`] (the workflow API, whose clients
//! send thousands of requests a second: a connection and a thread for each cost more
//! than answering it); then an HTTP/1.1 connection serves request after request on its
//! thread until the client closes it, asks to (`Connection: close`), or is silent for
//! that long.

use std::borrow::Cow;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Largest request body accepted (413 above).
pub const MAX_BODY: usize = embarcadero_api::MAX_REQUEST_BODY;
/// Largest request line plus headers accepted (431 above).
const MAX_HEAD: usize = 16 * 1024;

/// A request, read in full before it is routed.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    /// The request target as sent (path and query).
    pub url: String,
    pub body: Vec<u8>,
    /// The `Last-Event-ID` header (an event stream's client resuming), trimmed.
    pub last_event_id: Option<String>,
    /// The `Content-Type` header, trimmed (what the control port forwards to the
    /// workflow engine with the body).
    pub content_type: Option<String>,
}

impl Request {
    /// The target without its query string.
    pub fn path(&self) -> &str {
        self.url.split('?').next().unwrap_or("")
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    pub status: u16,
    /// Mostly a constant; a forwarded answer's own (`workflow_proxy`).
    pub content_type: Cow<'static, str>,
    pub body: String,
    /// Headers beyond Content-Type, Content-Length and Connection (e.g. Retry-After).
    /// With `stream`, a Content-Length here frames the streamed body (a forwarded answer).
    pub headers: Vec<(Cow<'static, str>, String)>,
    /// A body written as it is produced (server-sent events), instead of `body`: the
    /// response has no Content-Length and ends when the connection closes.
    pub stream: Option<StreamBody>,
}

/// Writes a streamed body to the connection, returning when it is complete or a write
/// failed (the client left).
#[derive(Clone)]
pub struct StreamBody(pub Arc<WriteBody>);

/// What a [`StreamBody`] runs on the connection's thread.
pub type WriteBody = dyn Fn(&mut dyn Write) -> io::Result<()> + Send + Sync;

impl std::fmt::Debug for StreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamBody")
    }
}

impl PartialEq for StreamBody {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Response {
    pub fn new(status: u16, content_type: &'static str, body: String) -> Self {
        Self {
            status,
            content_type: Cow::Borrowed(content_type),
            body,
            headers: Vec::new(),
            stream: None,
        }
    }

    /// `{"error": message}`, the admin API's error body.
    pub fn error(status: u16, message: impl Into<String>) -> Self {
        let body = serde_json::json!({ "error": message.into() }).to_string();
        Self::new(status, "application/json", body)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The request line, headers and body must all arrive within this long of the
    /// connection being accepted (408 after); each write of the response must make
    /// progress within as long.
    pub request_deadline: Duration,
    /// Connections served at once; one more is answered 503 at once and closed.
    pub max_connections: usize,
    /// `Some(idle)`: keep an HTTP/1.1 connection open after an answer (not after an
    /// event stream), for a next request that must arrive whole within `idle`. `None`:
    /// one request per connection.
    pub keep_alive: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            request_deadline: Duration::from_secs(10),
            max_connections: 1024,
            keep_alive: None,
        }
    }
}

type Handler = dyn Fn(&Request) -> Response + Send + Sync;

/// A running server; `stop` (or dropping it) stops accepting. Connections being served
/// finish on their own, within their deadline.
pub struct HttpServer {
    local_addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Serves `handler` on `listener` (already bound, so that the caller reports bind
    /// errors in its own words), with threads named after `name`. `open` counts the
    /// connections being served (a gauge the caller may export).
    pub fn start(
        listener: TcpListener,
        name: &str,
        limits: Limits,
        open: Arc<AtomicUsize>,
        handler: impl Fn(&Request) -> Response + Send + Sync + 'static,
    ) -> io::Result<Self> {
        let local_addr = listener.local_addr()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(handler);
        let accept = {
            let (stopping, open, name) = (stopping.clone(), open.clone(), name.to_string());
            std::thread::Builder::new()
                .name(format!("{name}-accept"))
                .spawn(move || accept_loop(listener, &name, limits, &handler, &stopping, &open))?
        };
        Ok(Self {
            local_addr,
            stopping,
            accept: Some(accept),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the accepting thread with a connection of our own.
        let mut wake = self.local_addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        let _ = accept.join();
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: TcpListener,
    name: &str,
    limits: Limits,
    handler: &Arc<Handler>,
    stopping: &Arc<AtomicBool>,
    open: &Arc<AtomicUsize>,
) {
    for stream in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else {
            // Out of file descriptors, for instance: let some connections finish.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if open.fetch_add(1, Ordering::AcqRel) >= limits.max_connections {
            open.fetch_sub(1, Ordering::AcqRel);
            refuse_busy(stream, limits.max_connections);
            continue;
        }
        let (handler, open_in_thread) = (handler.clone(), open.clone());
        let stopping_in_thread = stopping.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-conn"))
            .spawn(move || {
                let _place = Place(&open_in_thread);
                serve_connection(stream, limits, &*handler, &stopping_in_thread);
            });
        if let Err(e) = spawned {
            open.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("cannot start a thread for an HTTP connection: {e}");
        }
    }
}

/// A connection's place in the count, given back when its thread ends, also by a panic
/// in a handler (else 1024 panics would leave the server answering only 503).
struct Place<'a>(&'a AtomicUsize);

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers 503 without waiting on the client (on the accepting thread).
fn refuse_busy(mut stream: TcpStream, limit: usize) {
    let response = Response::error(
        503,
        format!(
            "{limit} requests are in progress, the most this server serves at once; retry shortly"
        ),
    );
    if stream.set_nonblocking(true).is_ok() {
        // Whatever has arrived is read, so that closing does not reset the connection
        // before the client reads the answer.
        let mut scratch = [0u8; 4096];
        let _ = stream.read(&mut scratch);
        let _ = stream.write_all(&encode(&response, false));
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Serves one request, or with [`Limits::keep_alive`] requests until the connection
/// ends (see the module's doc); closes the connection.
fn serve_connection(
    mut stream: TcpStream,
    limits: Limits,
    handler: &Handler,
    stopping: &AtomicBool,
) {
    let deadline = limits.request_deadline;
    // Each write of a response must make progress within the deadline.
    let _ = stream.set_write_timeout(Some(deadline));
    // Bytes of the next request that came with the one before (a pipelining client).
    let mut carry = Vec::new();
    let mut due = Instant::now() + deadline;
    let mut idle = false;
    loop {
        let read = read_request(&mut stream, &mut carry, due, limits.keep_alive, idle);
        let (response, keep, refused) = match read {
            Ok((request, keep)) => (handler(&request), keep, false),
            Err(RequestError::Gone) => break,
            Err(RequestError::Refused(response)) => (response, false, true),
        };
        let keep = keep && response.stream.is_none() && !stopping.load(Ordering::SeqCst);
        let written = stream.write_all(&encode(&response, keep));
        if let (Ok(()), Some(body)) = (&written, &response.stream) {
            let _ = (body.0)(&mut stream);
        }
        if refused && written.is_ok() {
            linger_after_refusal(&mut stream);
        }
        match (written, limits.keep_alive) {
            (Ok(()), Some(wait)) if keep => (due, idle) = (Instant::now() + wait, true),
            _ => break,
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// How long, and how many bytes, a refused request's remaining body is read and thrown
/// away after the answer (nginx's "lingering close").
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 16 << 20;

/// After answering a request that was refused before its body was read (413, 408, a
/// malformed head), ends the sending side and reads what the client still sends, up to
/// [`LINGER_TIME`] and [`LINGER_BYTES`]: closing a socket with unread bytes resets the
/// connection, and the reset can discard the answer before the client reads it, which
/// left a client sending a large body with a broken pipe instead of the 413.
fn linger_after_refusal(stream: &mut TcpStream) {
    if stream.shutdown(Shutdown::Write).is_err() {
        return;
    }
    let until = Instant::now() + LINGER_TIME;
    let mut scratch = [0u8; 16 << 10];
    let mut drained = 0;
    while drained < LINGER_BYTES {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut scratch) {
            Ok(0) => return,
            Ok(n) => drained += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

enum RequestError {
    /// The connection failed or closed: nobody to answer.
    Gone,
    /// Answer this, then close.
    Refused(Response),
}

impl From<io::Error> for RequestError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => RequestError::Refused(
                Response::error(408, "the request did not arrive in full in time"),
            ),
            _ => RequestError::Gone,
        }
    }
}

fn refused(status: u16, message: impl Into<String>) -> RequestError {
    RequestError::Refused(Response::error(status, message))
}

/// Reads into `buf` (beyond its current length) once, by `due`; `Gone` at end of stream.
fn read_some(stream: &mut TcpStream, buf: &mut Vec<u8>, due: Instant) -> Result<(), RequestError> {
    let left = due.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::from(io::ErrorKind::TimedOut).into());
    }
    stream.set_read_timeout(Some(left))?;
    let start = buf.len();
    buf.resize(start + 4096, 0);
    let n = loop {
        match stream.read(&mut buf[start..]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => break other,
        }
    };
    buf.truncate(start + *n.as_ref().unwrap_or(&0));
    match n? {
        0 => Err(RequestError::Gone),
        _ => Ok(()),
    }
}

/// Reads one request (starting with the bytes in `carry`) by `due`, and whether the
/// connection may serve another after it (`keep_alive` on, HTTP/1.1, no
/// `Connection: close`); then `carry` holds whatever came after this request. `idle`:
/// a kept connection waiting for its next request, closed without an answer if none
/// begins by `due`.
fn read_request(
    stream: &mut TcpStream,
    carry: &mut Vec<u8>,
    due: Instant,
    keep_alive: Option<Duration>,
    idle: bool,
) -> Result<(Request, bool), RequestError> {
    let mut buf = std::mem::take(carry);
    let head_len = loop {
        if let Some(end) = head_end(&buf).map_err(RequestError::Refused)? {
            break end;
        }
        match read_some(stream, &mut buf, due) {
            Err(RequestError::Refused(_)) if idle && buf.is_empty() => {
                return Err(RequestError::Gone)
            }
            read => read?,
        }
    };
    let mut body = buf.split_off(head_len);
    let head = parse_head(&buf).map_err(RequestError::Refused)?;
    let keep = keep_alive.is_some() && head.http11 && !head.close;
    let content_length = head.content_length;
    if head.expect_continue && head.http11 && body.len() < content_length {
        stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .map_err(|_| RequestError::Gone)?;
    }
    loop {
        if body.len() > content_length {
            if !keep {
                return Err(refused(
                    400,
                    "more bytes than the Content-Length; one request per connection",
                ));
            }
            *carry = body.split_off(content_length);
        }
        if body.len() == content_length {
            break;
        }
        read_some(stream, &mut body, due)?;
    }
    let request = Request {
        method: head.method,
        url: head.url,
        body,
        last_event_id: head.last_event_id,
        content_type: head.content_type,
    };
    Ok((request, keep))
}

/// Where the head (request line and headers, up to and including the blank line) of the
/// bytes received so far ends: `Ok(None)` while it is incomplete, the 431 answer once it
/// is longer than allowed.
pub fn head_end(received: &[u8]) -> Result<Option<usize>, Response> {
    let end = received
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    if end.unwrap_or(received.len()) > MAX_HEAD {
        return Err(Response::error(
            431,
            format!("request headers longer than {MAX_HEAD} bytes"),
        ));
    }
    Ok(end)
}

/// What a request's head says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub url: String,
    /// HTTP/1.1 (else 1.0).
    pub http11: bool,
    pub content_length: usize,
    /// `Expect: 100-continue`.
    pub expect_continue: bool,
    /// `Last-Event-ID`, trimmed.
    pub last_event_id: Option<String>,
    /// `Content-Type`, trimmed.
    pub content_type: Option<String>,
    /// `Connection: close`: the client wants no other request on this connection.
    pub close: bool,
}

/// Most headers a request may carry.
const MAX_HEADERS: usize = 64;

/// Parses a request's head (the bytes [`head_end`] delimits; untrusted) with `httparse`:
/// the request line and the headers this server acts on. A refusal is the response that
/// says why.
pub fn parse_head(head: &[u8]) -> Result<RequestHead, Response> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err(Response::error(400, "the request head ends too early"))
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Response::error(
                431,
                format!("more than {MAX_HEADERS} request headers"),
            ))
        }
        Err(e) => return Err(Response::error(400, format!("malformed request head: {e}"))),
    }
    let (Some(method), Some(url), Some(version)) = (request.method, request.path, request.version)
    else {
        return Err(Response::error(400, "malformed request line"));
    };
    if !url.starts_with('/') {
        return Err(Response::error(
            400,
            format!("request target {url:?} is not a path"),
        ));
    }
    let mut content_length = None;
    let mut expect_continue = false;
    let mut last_event_id = None;
    let mut content_type = None;
    let mut close = false;
    for header in request.headers.iter() {
        let value = std::str::from_utf8(header.value)
            .map_err(|_| Response::error(400, format!("header {} is not UTF-8 text", header.name)))?
            .trim();
        if header.name.eq_ignore_ascii_case("content-length") {
            if content_length.is_some() {
                return Err(Response::error(400, "more than one Content-Length header"));
            }
            content_length = Some(body_length(value)?);
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Response::error(
                411,
                "send the body with a Content-Length, not chunked",
            ));
        } else if header.name.eq_ignore_ascii_case("expect") {
            expect_continue = value.eq_ignore_ascii_case("100-continue");
        } else if header.name.eq_ignore_ascii_case("last-event-id") {
            last_event_id = Some(value.to_string());
        } else if header.name.eq_ignore_ascii_case("content-type") {
            content_type = Some(value.to_string());
        } else if header.name.eq_ignore_ascii_case("connection") {
            close |= value
                .split(',')
                .any(|token| token.trim().eq_ignore_ascii_case("close"));
        }
    }
    Ok(RequestHead {
        method: method.to_string(),
        url: url.to_string(),
        http11: version == 1,
        content_length: content_length.unwrap_or(0),
        expect_continue,
        last_event_id,
        content_type,
        close,
    })
}

/// A Content-Length value: digits only, at most [`MAX_BODY`].
fn body_length(value: &str) -> Result<usize, Response> {
    let bad = || Response::error(400, format!("bad Content-Length {value:?}"));
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let length: usize = value.parse().map_err(|_| bad())?;
    if length > MAX_BODY {
        return Err(Response::error(
            413,
            format!("request body of {length} bytes; at most {MAX_BODY} are accepted"),
        ));
    }
    Ok(length)
}

/// The response's bytes; `keep`: the connection stays open for another request.
fn encode(response: &Response, keep: bool) -> Vec<u8> {
    let reason = reason_phrase(response.status);
    let connection = if keep { "keep-alive" } else { "close" };
    let mut out = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nConnection: {connection}\r\n",
        response.status, response.content_type,
    );
    if response.stream.is_none() {
        out.push_str(&format!("Content-Length: {}\r\n", response.body.len()));
    }
    for (name, value) in &response.headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    out.extend_from_slice(response.body.as_bytes());
    out
}

/// The reason phrase of a status the admin and workflow APIs answer; empty for others
/// (a client reads the code).
fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        507 => "Insufficient Storage",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo(limits: Limits) -> HttpServer {
        echo_counted(limits, Arc::default())
    }

    /// A server that answers with the request's method, path and body.
    fn echo_counted(limits: Limits, open: Arc<AtomicUsize>) -> HttpServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        HttpServer::start(listener, "test-http", limits, open, |r: &Request| {
            let body = format!(
                "{} {} {}",
                r.method,
                r.path(),
                String::from_utf8_lossy(&r.body)
            );
            Response::new(200, "text/plain", body)
        })
        .unwrap()
    }

    /// Sends `parts` (in separate writes) and returns the whole response.
    fn exchange(server: &HttpServer, parts: &[&[u8]]) -> String {
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // Each part its own segment, as far as the kernel obliges.
        s.set_nodelay(true).unwrap();
        for p in parts {
            s.write_all(p).unwrap();
        }
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    fn status(response: &str) -> u16 {
        response
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn a_request_sent_in_pieces_is_answered_once_it_is_whole() {
        let server = echo(Limits::default());
        let get = exchange(&server, &[b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"]);
        assert_eq!(status(&get), 200, "{get}");
        assert!(get.ends_with("\r\n\r\nGET /metrics "), "{get}");
        assert!(get.contains("Content-Length: 13\r\n") && get.contains("Connection: close"));
        let post = exchange(
            &server,
            &[
                b"POST /v1/topics HTTP/1.1\r\nContent-Le",
                b"ngth: 12\r\n\r\n{\"na",
                b"me\":\"t\"}",
            ],
        );
        assert!(post.ends_with("POST /v1/topics {\"name\":\"t\"}"), "{post}");
    }

    /// Reads one response (head and Content-Length body) from a kept connection.
    fn read_response(s: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let mut byte = [0u8; 1];
        while !out.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut byte).unwrap();
            out.push(byte[0]);
        }
        let head = String::from_utf8(out).unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        let mut body = vec![0u8; length];
        s.read_exact(&mut body).unwrap();
        head + &String::from_utf8(body).unwrap()
    }

    #[test]
    fn a_kept_connection_serves_request_after_request_until_the_client_says_close() {
        let limits = Limits {
            keep_alive: Some(Duration::from_secs(30)),
            ..Limits::default()
        };
        let server = echo(limits);
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
            .unwrap();
        let first = read_response(&mut s);
        assert!(
            first.contains("Connection: keep-alive") && first.ends_with("POST /a {}"),
            "{first}"
        );
        // Two requests in one write (pipelined): answered in turn.
        s.write_all(b"GET /b HTTP/1.1\r\n\r\nPOST /c HTTP/1.1\r\nContent-Length: 1\r\n\r\nx")
            .unwrap();
        assert!(read_response(&mut s).ends_with("GET /b "));
        assert!(read_response(&mut s).ends_with("POST /c x"));
        s.write_all(b"GET /d HTTP/1.1\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut last = String::new();
        s.read_to_string(&mut last).unwrap();
        assert!(
            last.contains("Connection: close") && last.ends_with("GET /d "),
            "{last}"
        );
        // HTTP/1.0, or a server without keep-alive: one request per connection.
        let old = exchange(&server, &[b"GET /e HTTP/1.0\r\n\r\n"]);
        assert!(old.contains("Connection: close"), "{old}");
    }

    #[test]
    fn a_kept_connection_silent_past_its_idle_time_is_closed_without_an_answer() {
        let server = echo(Limits {
            keep_alive: Some(Duration::from_millis(200)),
            ..Limits::default()
        });
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"GET /a HTTP/1.1\r\n\r\n").unwrap();
        assert!(read_response(&mut s).ends_with("GET /a "));
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    }

    /// The fuzz harness's round trip (`fuzz/src/bin/http_request.rs`), on the kind of head
    /// its 61 session-23 crash files held: every field the parser keeps, written out again
    /// as headers, parses to the same head.
    #[test]
    fn a_head_written_out_with_every_field_it_holds_parses_the_same() {
        let raw = b"POST /v1/topics HTTP/1.1\r\nKlkt: q@0206\r\nContent-Type:  apox \r\n\
                    Connection: keep-alive, Close\r\nLast-Event-ID: 9\r\nContent-Length: 3\r\n\r\n";
        let head = parse_head(raw).unwrap();
        assert_eq!(head.content_type.as_deref(), Some("apox"));
        assert_eq!(head.last_event_id.as_deref(), Some("9"));
        assert!(head.close && head.http11 && head.content_length == 3);
        let again = format!(
            "{} {} HTTP/1.1\r\nContent-Length: {}\r\nLast-Event-ID: {}\r\n\
             Content-Type: {}\r\nConnection: close\r\n\r\n",
            head.method,
            head.url,
            head.content_length,
            head.last_event_id.as_deref().unwrap(),
            head.content_type.as_deref().unwrap(),
        );
        assert_eq!(parse_head(again.as_bytes()).unwrap(), head);
    }

    #[test]
    fn last_event_id_is_read_from_the_head_trimmed() {
        let head = parse_head(b"GET /e HTTP/1.1\r\nlast-event-id:  17 \r\n\r\n").unwrap();
        assert_eq!(head.last_event_id.as_deref(), Some("17"));
        let none = parse_head(b"GET /e HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert_eq!(none.last_event_id, None);
    }

    #[test]
    fn expect_100_continue_is_answered_before_the_body_is_read() {
        let server = echo(Limits::default());
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
            .unwrap();
        let mut interim = [0u8; 25];
        s.read_exact(&mut interim).unwrap();
        assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
        s.write_all(b"{}").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(
            out.starts_with("HTTP/1.1 200") && out.ends_with("POST /x {}"),
            "{out}"
        );
    }

    #[test]
    fn bad_requests_get_the_status_that_says_why() {
        let server = echo(Limits::default());
        let many_headers = format!("GET /x HTTP/1.1\r\n{}\r\n", "A: b\r\n".repeat(65));
        let cases: [(&[u8], u16); 9] = [
            (b"NONSENSE\r\n\r\n", 400),
            (b"GET /x HTTP/2.0\r\n\r\n", 400),
            (b"GET /x HTTP/1.1\r\nno colon\r\n\r\n", 400),
            (b"POST /x HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
            (
                b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                411,
            ),
            (b"POST /x HTTP/1.1\r\nContent-Length: 1\r\n\r\nab", 400),
            // Two lengths would let two parsers of one request disagree on its body.
            (
                b"POST /x HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
                400,
            ),
            (b"POST /x HTTP/1.1\r\nContent-Length: +2\r\n\r\nab", 400),
            (many_headers.as_bytes(), 431),
        ];
        for (request, expected) in cases {
            let response = exchange(&server, &[request]);
            assert_eq!(status(&response), expected, "{response}");
            assert!(response.contains("\"error\""), "{response}");
        }
        let huge = format!("GET /x HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(status(&exchange(&server, &[huge.as_bytes()])), 431);
    }

    /// Waits (at most 30 s) until `open` reads `want`.
    fn wait_for(open: &AtomicUsize, want: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while open.load(Ordering::Relaxed) != want {
            assert!(
                Instant::now() < deadline,
                "open connections never reached {want}"
            );
            std::thread::yield_now();
        }
    }

    /// The property tiny_http lacked: clients that never finish their requests hold
    /// nothing anybody else needs. Their deadline (two minutes) is far beyond the read
    /// timeout of `exchange` (30 s), so a server that made the next request wait for
    /// them would fail this test.
    #[test]
    fn stalled_requests_hold_up_no_one() {
        let open = Arc::new(AtomicUsize::new(0));
        let limits = Limits {
            request_deadline: Duration::from_secs(120),
            max_connections: 64,
            keep_alive: None,
        };
        let server = echo_counted(limits, open.clone());
        let _stalled: Vec<TcpStream> = (0..16)
            .map(|_| {
                let mut s = TcpStream::connect(server.local_addr()).unwrap();
                s.write_all(b"POST /x HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
                    .unwrap();
                s
            })
            .collect();
        wait_for(&open, 16);
        let answered = exchange(&server, &[b"GET /healthz HTTP/1.1\r\n\r\n"]);
        assert_eq!(status(&answered), 200);
    }

    #[test]
    fn a_request_that_does_not_arrive_in_full_by_its_deadline_gets_408() {
        let server = echo(Limits {
            request_deadline: Duration::from_millis(300),
            max_connections: 64,
            keep_alive: None,
        });
        let out = exchange(
            &server,
            &[b"POST /x HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"],
        );
        assert_eq!(status(&out), 408, "{out}");
    }

    #[test]
    fn a_handler_that_panics_gives_its_place_back() {
        let open = Arc::new(AtomicUsize::new(0));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let limits = Limits {
            request_deadline: Duration::from_secs(30),
            max_connections: 1,
            keep_alive: None,
        };
        let server = HttpServer::start(
            listener,
            "test-http",
            limits,
            open.clone(),
            |r: &Request| {
                assert_ne!(r.path(), "/panic", "a bug in a handler");
                Response::new(200, "text/plain", "fine".into())
            },
        )
        .unwrap();
        for _ in 0..3 {
            let mut s = TcpStream::connect(server.local_addr()).unwrap();
            s.write_all(b"GET /panic HTTP/1.1\r\n\r\n").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            assert!(out.is_empty(), "no answer from a panicked handler");
            wait_for(&open, 0);
        }
        let ok = exchange(&server, &[b"GET /healthz HTTP/1.1\r\n\r\n"]);
        assert_eq!(status(&ok), 200, "{ok}");
    }

    #[test]
    fn connections_beyond_the_limit_get_503_and_a_freed_place_is_used_again() {
        let open = Arc::new(AtomicUsize::new(0));
        let limits = Limits {
            request_deadline: Duration::from_secs(30),
            max_connections: 2,
            keep_alive: None,
        };
        let server = echo_counted(limits, open.clone());
        let held: Vec<TcpStream> = (0..2)
            .map(|_| TcpStream::connect(server.local_addr()).unwrap())
            .collect();
        wait_for(&open, 2);
        let busy = exchange(&server, &[b"GET /healthz HTTP/1.1\r\n\r\n"]);
        assert_eq!(status(&busy), 503, "{busy}");
        drop(held);
        wait_for(&open, 0);
        let ok = exchange(&server, &[b"GET /healthz HTTP/1.1\r\n\r\n"]);
        assert_eq!(status(&ok), 200, "{ok}");
    }

    /// A client that sends a body over the limit in full before it reads reads the 413:
    /// the server reads and drops the rest of the body after answering, instead of
    /// closing on unread bytes (which reset the connection: a broken pipe, no answer).
    #[test]
    fn a_body_over_the_limit_sent_in_full_gets_its_413_not_a_reset() {
        let server = echo(Limits::default());
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let body = vec![b'x'; 128 * MAX_BODY];
        let head = format!("POST /x HTTP/1.1\r\nContent-Length: {}\r\n\r\n", body.len());
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(&body)
            .expect("the whole body is taken, not refused with a reset");
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert_eq!(status(&out), 413, "{out}");
    }

    #[test]
    fn stop_ends_the_accepting_thread() {
        let mut server = echo(Limits::default());
        let addr = server.local_addr();
        server.stop();
        // Nothing accepts any more: the connection is refused or closed unanswered.
        if let Ok(mut s) = TcpStream::connect(addr) {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n");
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            assert!(out.is_empty(), "{out}");
        }
    }
}
