//! `NativeAdmin`: topics and cluster status through the control plane's HTTP API, each
//! request on the blocking pool (the Rust `Admin` is a blocking HTTP client).

use crate::blocking;
use embarcadero_client::{Admin, TopicSpec};
use napi_derive::napi;
use serde_json::Value;

/// A topic to create, as the TypeScript layer resolved it (defaults applied there).
#[napi(object)]
pub struct NativeTopicSpec {
    pub name: String,
    pub order: u8,
    pub replication_factor: u8,
    pub default_ack: u8,
    pub retention_bytes: Option<f64>,
    pub retention_ms: Option<f64>,
}

#[napi]
pub struct NativeAdmin {
    admin: Admin,
}

#[napi]
impl NativeAdmin {
    /// `control` is `host:port` or an `http://` URL; `timeout_ms` bounds each request.
    #[napi(constructor)]
    pub fn new(control: String, timeout_ms: Option<f64>) -> Self {
        let admin = match timeout_ms {
            Some(ms) => Admin::with_timeout(&control, crate::millis(ms)),
            None => Admin::new(&control),
        };
        Self { admin }
    }

    #[napi]
    pub async fn create_topic(&self, spec: NativeTopicSpec) -> napi::Result<Value> {
        let admin = self.admin.clone();
        let spec = TopicSpec {
            name: spec.name,
            order: spec.order,
            replication_factor: spec.replication_factor,
            default_ack: spec.default_ack,
            retention_bytes: spec.retention_bytes.map(|b| b as u64),
            retention_ms: spec.retention_ms.map(|m| m as u64),
        };
        blocking(move || admin.create_topic(&spec).map(json)).await
    }

    #[napi]
    pub async fn list_topics(&self) -> napi::Result<Value> {
        let admin = self.admin.clone();
        blocking(move || admin.list_topics().map(json)).await
    }

    #[napi]
    pub async fn describe_topic(&self, name: String) -> napi::Result<Value> {
        let admin = self.admin.clone();
        blocking(move || admin.describe_topic(&name).map(json)).await
    }

    #[napi]
    pub async fn delete_topic(&self, name: String) -> napi::Result<Value> {
        let admin = self.admin.clone();
        blocking(move || admin.delete_topic(&name).map(json)).await
    }

    #[napi]
    pub async fn cluster(&self) -> napi::Result<Value> {
        let admin = self.admin.clone();
        blocking(move || admin.cluster().map(json)).await
    }

    #[napi]
    pub async fn status(&self) -> napi::Result<Value> {
        let admin = self.admin.clone();
        blocking(move || admin.status().map(json)).await
    }
}

fn json<T: serde::Serialize>(v: T) -> Value {
    serde_json::to_value(v).expect("the client's types serialise")
}
