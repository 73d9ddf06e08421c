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
    while !stop.load(Ordering::Acquire) {
        match admin.announce_service(KIND, addr, TTL, Some(log.clone())) {
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
        // A period, not a wait for an event: `drop` unparks it.
        std::thread::park_timeout(EVERY);
    }
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
