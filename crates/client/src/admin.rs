//! The admin client: topics and cluster discovery over the control plane's HTTP API.

use crate::{Error, Result};
pub use embarcadero_api::{
    BrokerAddr, BrokerLogInfo, BrokerRates, ClusterInfo, LocalBrokerStats, MemberState, MemberView,
    RatesReport, ReaderLag, ReplicaError, SequencerLease, SequencerStats, ServiceAnnounce,
    ServiceInfo, ServiceLog, StatusReport, TopicHealth, TopicInfo, TopicSpec,
};
use std::time::Duration;

/// The base URL of a control plane given as `host:port`, an `http://` URL, a bare port
/// (`12140`: on this host, as `127.0.0.1:12140`; a number alone would otherwise be read
/// as a host name, an IPv4 address in decimal, and reach some other machine's port 80),
/// or a host alone (`localhost`: on the default port 12140, not 80). The admin and
/// workflow clients both take their address through it.
pub fn control_url(control: &str) -> String {
    let control = control.trim().trim_end_matches('/');
    if control.starts_with("http://") {
        control.to_string()
    } else if !control.is_empty() && control.bytes().all(|b| b.is_ascii_digit()) {
        format!("http://127.0.0.1:{control}")
    } else if !control.is_empty() && !control.contains(':') {
        // A host alone: the control API's default port, not HTTP's 80.
        format!("http://{control}:{DEFAULT_CONTROL_PORT}")
    } else {
        format!("http://{control}")
    }
}

/// The admin API's port when an address names none (`serve --control-port`'s default).
pub const DEFAULT_CONTROL_PORT: u16 = 12140;

/// How long a request answered 503 (the server busy) is retried before the 503 counts.
pub const BUSY_RETRY_FOR: Duration = Duration::from_secs(3);

/// Client of the admin API at `host:port` (default `127.0.0.1:12140`).
#[derive(Debug, Clone)]
pub struct Admin {
    base: String,
    agent: ureq::Agent,
}

/// What to do about a request to the control plane that got no HTTP answer.
pub fn unreachable_hint(e: &ureq::Error) -> &'static str {
    match e.kind() {
        ureq::ErrorKind::ConnectionFailed | ureq::ErrorKind::Dns => {
            "is `embarcadero serve` running? (its control API is the `control API` \
             address of its serving line, default 127.0.0.1:12140; the CLI's --control, \
             an SDK's control argument or EMBARCADERO_CONTROL name it)"
        }
        ureq::ErrorKind::InvalidUrl | ureq::ErrorKind::UnknownScheme => {
            "give the control API as host:port (default 127.0.0.1:12140), a port on this \
             host, or an http:// URL"
        }
        // Connected, but no HTTP answer came back: most often a broker's data port, else
        // a server too busy to answer in time.
        _ => {
            "no HTTP answer came back: if that is a broker's port, it is not the admin \
             API; use the control port from the `control API` of the serving line \
             (default 12140)"
        }
    }
}

/// The message of an HTTP error without Embarcadero's error body: something else
/// answered at `base`.
pub fn not_the_admin_api(base: &str) -> String {
    format!(
        "no error text: is {base} the admin API of `embarcadero serve`? (the `control API` \
         address of its serving line, default 127.0.0.1:12140)"
    )
}

impl Admin {
    pub fn new(control: &str) -> Self {
        // Above the head's longest wait (a failover query waits up to 10 s).
        Self::with_timeout(control, Duration::from_secs(20))
    }

    /// Gives up on a request after `timeout` (the default is 20 s).
    pub fn with_timeout(control: &str, timeout: Duration) -> Self {
        let base = control_url(control);
        let agent = ureq::AgentBuilder::new().timeout(timeout).build();
        Self { base, agent }
    }

    pub fn control_url(&self) -> &str {
        &self.base
    }

    /// Sends `req` (with `body`), retrying a 503 for up to [`BUSY_RETRY_FOR`]: the
    /// server answers 503 only for a request it did not act on (every connection busy, a
    /// failover query that could not be answered yet), so a retry is always safe, and a
    /// `pub` or `sub` started during a burst of other clients' requests waits it out.
    fn call(
        &self,
        req: ureq::Request,
        body: Option<serde_json::Value>,
    ) -> Result<serde_json::Value> {
        let give_up = std::time::Instant::now() + BUSY_RETRY_FOR;
        let mut pause = Duration::from_millis(50);
        loop {
            let result = match &body {
                Some(b) => req.clone().send_json(b.clone()),
                None => req.clone().call(),
            };
            match result {
                Err(ureq::Error::Status(503, _)) if std::time::Instant::now() + pause < give_up => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                result => return self.answer(result),
            }
        }
    }

    /// The JSON of an answer, or the error it is.
    fn answer(
        &self,
        result: std::result::Result<ureq::Response, ureq::Error>,
    ) -> Result<serde_json::Value> {
        match result {
            Ok(resp) => resp.into_json().map_err(|e| Error::Admin {
                status: 200,
                message: format!("unreadable response: {e}"),
            }),
            Err(ureq::Error::Status(status, resp)) => {
                let message = resp
                    .into_json::<serde_json::Value>()
                    .ok()
                    .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(String::from))
                    .unwrap_or_else(|| not_the_admin_api(&self.base));
                Err(Error::Admin { status, message })
            }
            Err(e) => Err(Error::Connect {
                what: "the control plane",
                addr: self.base.clone(),
                message: format!("{e}; {}", unreachable_hint(&e)),
            }),
        }
    }

    fn get(&self, path: &str) -> Result<serde_json::Value> {
        self.call(self.agent.get(&format!("{}{path}", self.base)), None)
    }

    pub fn create_topic(&self, spec: &TopicSpec) -> Result<TopicInfo> {
        check_topic_name(&spec.name)?;
        let v = self.call(
            self.agent.post(&format!("{}/v1/topics", self.base)),
            Some(serde_json::to_value(spec).expect("serialisable")),
        )?;
        parse(v)
    }

    pub fn list_topics(&self) -> Result<Vec<TopicInfo>> {
        let v = self.get("/v1/topics")?;
        parse(v.get("topics").cloned().unwrap_or_default())
    }

    pub fn describe_topic(&self, name: &str) -> Result<TopicInfo> {
        check_topic_name(name)?;
        parse(self.get(&format!("/v1/topics/{}", escape_path_segment(name)))?)
    }

    /// The acknowledgement level publishers of topic `name` use when they choose none:
    /// the topic's `default_ack`, as `embarcadero pub` and both SDKs do. 1 for a topic
    /// the control plane does not know, which the brokers then refuse with UnknownTopic
    /// (the error every publisher of an unknown topic gets).
    pub fn default_ack(&self, name: &str) -> Result<u8> {
        match self.describe_topic(name) {
            Ok(topic) => Ok(topic.default_ack),
            Err(Error::Admin { status: 404, .. }) => Ok(1),
            Err(e) => Err(e),
        }
    }

    /// Deletes a topic: its data, memory and disk replicas go, and its connected
    /// publishers and subscribers get `TopicDeleted`. Returns the topic as it was just
    /// before. A topic created later with the same name is a new topic.
    pub fn delete_topic(&self, name: &str) -> Result<TopicInfo> {
        check_topic_name(name)?;
        let url = format!("{}/v1/topics/{}", self.base, escape_path_segment(name));
        parse(self.call(self.agent.delete(&url), None)?)
    }

    pub fn cluster(&self) -> Result<ClusterInfo> {
        parse(self.get("/v1/cluster")?)
    }

    /// After `broker` (the process `incarnation` serving it, 0: whichever serves it now)
    /// was declared dead: which of `client_id`'s batches through it
    /// (by batch id) made it into `topic`'s global order (and onto disk for ack level
    /// 2). Status 409 while the head does not consider the broker dead yet.
    pub fn failover(
        &self,
        topic: &str,
        broker: u32,
        incarnation: u64,
        client_id: u64,
        batch_ids: &[u64],
        ack_level: u8,
    ) -> Result<Vec<u64>> {
        let v = self.call(
            self.agent.post(&format!("{}/v1/failover", self.base)),
            Some(serde_json::json!({
                "topic": topic,
                "broker": broker,
                "incarnation": incarnation,
                "client_id": client_id,
                "batch_ids": batch_ids,
                "ack_level": ack_level,
            })),
        )?;
        parse(v.get("ordered").cloned().unwrap_or_default())
    }

    /// Tells the head that a `kind` service serves at `addr` (`POST /v1/services`);
    /// the head forgets it after `ttl` without another announcement. A service that
    /// folds a topic names it (`log`): a head without that very topic refuses (409).
    pub fn announce_service(
        &self,
        kind: &str,
        addr: &str,
        ttl: Duration,
        log: Option<ServiceLog>,
    ) -> Result<()> {
        let announce = ServiceAnnounce {
            kind: kind.into(),
            addr: addr.into(),
            ttl_ms: ttl.as_millis() as u64,
            log,
        };
        let body = serde_json::to_value(announce).expect("serialisable");
        self.call(
            self.agent.post(&format!("{}/v1/services", self.base)),
            Some(body),
        )?;
        Ok(())
    }

    /// The `/v1/status` document (what `embarcadero status` shows).
    pub fn status(&self) -> Result<StatusReport> {
        parse(self.get("/v1/status")?)
    }
}

/// The rules of [`embarcadero_wire::validate_topic_name`], for error messages.
pub const TOPIC_NAME_RULES: &str =
    "a topic name is 1 to 63 letters, digits, '.', '_' or '-', not starting with '.' or '-'";

/// Refuses, before any request, a name the server would refuse: unchecked, a name such
/// as `a?x` or `../status` would change the request's URL and address something else.
pub fn check_topic_name(name: &str) -> Result<()> {
    embarcadero_wire::validate_topic_name(name)
        .map_err(|e| Error::InvalidName(format!("{e} ({TOPIC_NAME_RULES})")))
}

/// `segment` percent-encoded for one URL path segment. Valid names need no escaping;
/// this keeps any other text (a future rule change) inside its segment.
fn escape_path_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn parse<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T> {
    serde_json::from_value(v).map_err(|e| Error::Admin {
        status: 200,
        message: format!("unexpected response shape: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(
            escape_path_segment("orders.v1_eu-west"),
            "orders.v1_eu-west"
        );
        assert_eq!(escape_path_segment("a?zzz"), "a%3Fzzz");
        assert_eq!(escape_path_segment("../status"), "..%2Fstatus");
        assert_eq!(escape_path_segment("é"), "%C3%A9");
    }

    #[test]
    fn bad_names_are_refused_with_the_rules() {
        for bad in ["a?zzz", "../status", "", ".hidden"] {
            let e = check_topic_name(bad).unwrap_err().to_string();
            assert!(
                e.contains("invalid topic name") && e.contains("1 to 63"),
                "{e}"
            );
        }
        assert!(check_topic_name("orders").is_ok());
    }

    #[test]
    fn a_control_address_may_be_host_port_a_url_or_a_port_of_this_host() {
        assert_eq!(control_url("10.0.0.1:12140"), "http://10.0.0.1:12140");
        assert_eq!(control_url("http://h:1/"), "http://h:1");
        assert_eq!(control_url("31140"), "http://127.0.0.1:31140");
        assert_eq!(control_url(" localhost:5 "), "http://localhost:5");
        assert_eq!(control_url("localhost"), "http://localhost:12140");
        assert_eq!(control_url("10.0.0.1"), "http://10.0.0.1:12140");
        assert_eq!(control_url("[::1]:7"), "http://[::1]:7");
    }

    /// Answers each of `answers` (status, body) to one request in turn, then stops.
    fn answering(answers: Vec<(u16, &'static str)>) -> (String, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            for (status, body) in answers {
                let (mut conn, _) = listener.accept().unwrap();
                let mut request = [0u8; 4096];
                let _ = std::io::Read::read(&mut conn, &mut request);
                let head = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let answer = [head.as_bytes(), body.as_bytes()].concat();
                std::io::Write::write_all(&mut conn, &answer).unwrap();
            }
        });
        (addr, server)
    }

    #[test]
    fn a_busy_server_is_asked_again_and_its_answer_counts() {
        let busy = (503, r#"{"error":"1024 requests are in progress"}"#);
        let (addr, server) = answering(vec![busy, busy, (200, r#"{"topics":[]}"#)]);
        assert_eq!(Admin::new(&addr).list_topics().unwrap(), vec![]);
        server.join().unwrap();
        // A refusal other than 503 is the answer at once.
        let (addr, server) = answering(vec![(409, r#"{"error":"exists"}"#)]);
        let e = Admin::new(&addr).list_topics().unwrap_err();
        assert!(e.to_string().contains("exists"), "{e}");
        server.join().unwrap();
    }

    #[test]
    fn an_http_answer_without_an_error_text_asks_whether_it_is_the_admin_api() {
        // A plain HTTP server that is not Embarcadero's: a 404 without a JSON body.
        let (addr, other) = answering(vec![(404, "")]);
        let e = Admin::new(&addr).list_topics().unwrap_err();
        other.join().unwrap();
        let text = e.to_string();
        assert!(
            text.contains("404") && text.contains("the admin API of"),
            "{text}"
        );
        // An address that is no address says how to write one.
        let e = Admin::new("127.0.0.1:99999").list_topics().unwrap_err();
        assert!(
            e.to_string().contains("give the control API as host:port"),
            "{e}"
        );
    }
}
