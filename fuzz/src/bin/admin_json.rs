//! The admin API's JSON bodies: `endpoint u8 | disk_replicas u8 | body`, parsed as the
//! endpoint does (topic creation also validated as the control plane does). A topic
//! spec that parses survives a serialise -> parse round trip.
use embarcadero_server::fuzzing::{admin_body, BODY_ENDPOINTS};
use embarcadero_server::TopicSpec;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        if data.len() < 2 {
            return;
        }
        let body = &data[2..];
        let _ = admin_body(data[0] as usize, body, data[1]);
        // `admin_body` picks the endpoint as `data[0] % BODY_ENDPOINTS.len()`; this was
        // `% 5` from before `/v1/services` made it six, so most topic bodies skipped the
        // round trip (and some failover bodies were tried as topic specs).
        if BODY_ENDPOINTS[data[0] as usize % BODY_ENDPOINTS.len()] == "/v1/topics" {
            if let Ok(spec) = serde_json::from_slice::<TopicSpec>(body) {
                let text = serde_json::to_string(&spec).unwrap();
                assert_eq!(serde_json::from_str::<TopicSpec>(&text).unwrap(), spec);
            }
        }
    });
}
