//! Client errors as JavaScript errors. The message is a marker followed by a JSON
//! document with the variant (`kind`), its fields, and the error's text exactly as the
//! CLI prints it; the TypeScript layer parses it into an `EmbarcaderoError` subclass.
//! (A JSON message instead of extra properties: napi-rs errors carry only a status and
//! a message across every path, sync and async alike.)

use embarcadero_client::Error;
use serde_json::{json, Value};

/// What starts the message of every error this addon raises for a client error.
pub const MARKER: &str = "embarcadero-error:";

/// The JavaScript error for `e`.
pub fn to_js(e: Error) -> napi::Error {
    napi::Error::from_reason(marked(&e))
}

/// The message of `e`'s JavaScript error: the marker and the document `translate` reads.
pub fn marked(e: &Error) -> String {
    let mut doc = fields(e);
    doc["message"] = Value::String(e.to_string());
    format!("{MARKER}{doc}")
}

/// The JavaScript error for an error answer of the workflow API (or none: status 0,
/// code `unreachable`), which `translate` makes a `WorkflowApiError`.
pub fn api_to_js(e: embarcadero_workflow::client::ApiError) -> napi::Error {
    let doc = json!({
        "kind": "WorkflowApi",
        "status": e.status,
        "code": e.code,
        "message": e.to_string(),
    });
    napi::Error::from_reason(format!("{MARKER}{doc}"))
}

/// A configuration error made here (bad argument shapes the Rust types rule out).
pub fn config(message: impl Into<String>) -> napi::Error {
    to_js(Error::Config(message.into()))
}

fn fields(e: &Error) -> Value {
    match e {
        Error::Connect { what, addr, .. } => {
            json!({"kind": "Connect", "what": what, "addr": addr})
        }
        Error::Admin { status, .. } => json!({"kind": "Admin", "status": status}),
        Error::Broker { broker, code, .. } => json!({
            "kind": "Broker",
            "broker": broker,
            "code": *code as u16,
            "codeName": format!("{code:?}"),
        }),
        Error::ConnectionLost { broker, .. } => json!({"kind": "ConnectionLost", "broker": broker}),
        Error::Protocol { peer, .. } => json!({"kind": "Protocol", "broker": peer}),
        Error::MessageTooLarge { size, max } => {
            json!({"kind": "MessageTooLarge", "size": size, "max": max})
        }
        Error::Config(_) => json!({"kind": "Config"}),
        Error::InvalidName(_) => json!({"kind": "InvalidName"}),
        Error::Timeout(d) => json!({"kind": "Timeout", "timeoutMs": d.as_millis() as u64}),
        Error::Closed => json!({"kind": "Closed"}),
        Error::NoLiveBroker => json!({"kind": "NoLiveBroker"}),
    }
}
