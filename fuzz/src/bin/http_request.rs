//! The admin server's request parser (`http_server::head_end` and `parse_head`, as
//! `read_request` uses them) on the bytes of one connection; a complete request's body
//! then goes to the JSON parser of the endpoint it names. Round trip: a parsed head,
//! written out again with every field it holds, parses to the same head.
use embarcadero_server::fuzzing::{admin_body, http_request, BODY_ENDPOINTS};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Ok(Some((head, body))) = http_request(data) else {
            return;
        };
        assert_eq!(body.len(), head.content_length);
        let version = if head.http11 { "HTTP/1.1" } else { "HTTP/1.0" };
        let mut again = format!(
            "{} {} {version}\r\nContent-Length: {}\r\n",
            head.method, head.url, head.content_length
        );
        if head.expect_continue {
            again.push_str("Expect: 100-continue\r\n");
        }
        if let Some(id) = &head.last_event_id {
            again.push_str(&format!("Last-Event-ID: {id}\r\n"));
        }
        if let Some(kind) = &head.content_type {
            again.push_str(&format!("Content-Type: {kind}\r\n"));
        }
        if head.close {
            again.push_str("Connection: close\r\n");
        }
        again.push_str("\r\n");
        let mut again = again.into_bytes();
        again.extend_from_slice(body);
        let (head2, body2) = http_request(&again)
            .expect("a parsed head parses again")
            .expect("complete");
        assert_eq!(head2, head);
        assert_eq!(body2, body);
        let path = head.url.split('?').next().unwrap_or("");
        if let Some(i) = BODY_ENDPOINTS.iter().position(|e| *e == path) {
            let _ = admin_body(i, body, 2);
        }
    });
}
