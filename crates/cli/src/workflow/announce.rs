//! The orchestrator's announcements to the head (`POST /v1/services`), so that
//! `embarcadero status` finds the engine without being told where it is.
//!
//! Owns one thread that announces every `EVERY` until stopped; it touches nothing else.
//! A failed announcement is logged once per run of failures and retried: the engine
//! works without the head knowing it, only `status` loses sight of it.

use embarcadero_client::{Admin, ServiceLog};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The kind `status` looks for.
pub const KIND: &str = "workflow";
const EVERY: Duration = Duration::from_secs(1);
/// Three missed announcements and the head forgets the engine.
const TTL: Duration = Duration::from_secs(3);

pub struct Announcer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Announcer {
    /// Starts announcing to the head at `control` that the engine folding `log` serves
    /// its API at `addr`.
    pub fn start(control: &str, addr: String, log: ServiceLog) -> std::io::Result<Self> {
        let admin = Admin::with_timeout(control, EVERY);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("announce".into())
            .spawn(move || announce_until(&admin, &addr, &log, &stopping))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

fn announce_until(admin: &Admin, addr: &str, log: &ServiceLog, stop: &AtomicBool) {
    let mut failing = false;
    // `None` once a head from before the field refused it.
    let mut naming = Some(log.clone());
    while !stop.load(Ordering::Acquire) {
        let result = admin.announce_service(KIND, addr, TTL, naming.clone());
        if naming.is_some() && refuses_the_log_field(&result) {
            tracing::warn!("the head at {} is older than this orchestrator (it refuses the `log` field of an announcement): announcing without it; upgrade the head", admin.control_url());
            naming = None;
            continue;
        }
        match result {
            Ok(()) if failing => {
                tracing::info!("the head at {} knows the engine again", admin.control_url());
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!("cannot announce the engine to the head ({e}); `embarcadero status` will not show it until this succeeds");
                failing = true;
            }
            Err(_) => {}
        }
        // A head that went away may come back upgraded, or another on its port: name the
        // log again until a head refuses it again.
        if failing {
            naming = Some(log.clone());
        }
        // A period, not a wait for an event: `drop` unparks it.
        std::thread::park_timeout(EVERY);
    }
}

/// A head from before `ServiceAnnounce::log` refuses unknown fields with a 400 naming it.
fn refuses_the_log_field(result: &embarcadero_client::Result<()>) -> bool {
    matches!(
        result,
        Err(embarcadero_client::Error::Admin { status: 400, message })
            if message.contains("unknown field `log`")
    )
}

impl Drop for Announcer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a head from before the field answers: its `ServiceAnnounce` refused unknown
    /// fields, and the head wraps serde's message.
    #[test]
    fn an_older_heads_refusal_of_the_log_field_is_recognised_and_nothing_else_is() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct OldAnnounce {
            kind: String,
            addr: String,
            ttl_ms: u64,
        }
        let new = embarcadero_client::ServiceAnnounce {
            kind: KIND.into(),
            addr: "127.0.0.1:1".into(),
            ttl_ms: 3000,
            log: Some(ServiceLog {
                topic: "workflow.events".into(),
                created_unix_ms: 1,
            }),
        };
        let refusal =
            serde_json::from_value::<OldAnnounce>(serde_json::to_value(new).unwrap()).unwrap_err();
        let old_head =
            |status, message: String| Err(embarcadero_client::Error::Admin { status, message });
        let message =
            format!("request body is not valid for /v1/services: {refusal}; expected {{}}");
        assert!(refuses_the_log_field(&old_head(400, message.clone())));
        assert!(!refuses_the_log_field(&old_head(409, message)));
        assert!(!refuses_the_log_field(&old_head(
            400,
            "ttl_ms 1 is outside".into()
        )));
        assert!(!refuses_the_log_field(&Ok(())));
    }
}
