//! The workflow commands: `orchestrator` and `worker` (long-running processes of the
//! engine in `embarcadero-workflow`), and `task` and `template` (clients of its API).
//! Owns their arguments and output; the engine does the work.

mod announce;
mod commands;
mod manage;
pub mod measure;
mod serve;

pub use commands::{task, template, TaskCommand, TemplateCommand};
pub use serve::{orchestrator, worker, OrchestratorArgs, WorkerArgs};

/// `status`'s lines for the workflow engines that announced themselves to the head: each
/// one's address, then its task and step counts and queue lag (as `task stats`).
pub fn engines_text(services: &[embarcadero_client::ServiceInfo]) -> String {
    let mut out = String::new();
    for s in services.iter().filter(|s| s.kind == announce::KIND) {
        let log = s.log.as_ref().map(|l| format!("   log {}", l.topic));
        out.push_str(&format!(
            "workflow engine   API http://{}{}\n",
            s.addr,
            log.unwrap_or_default()
        ));
        let client = embarcadero_workflow::client::ApiClient::new(&s.addr);
        let summary = match client.metrics() {
            Ok(metrics) => manage::stats(&metrics),
            // Not the server's hint: this address is the orchestrator's own.
            Err(e) if e.code == "unreachable" => format!(
                "unreachable: nothing answers at {}: the orchestrator that announced itself \
                 there has stopped (start it again, `embarcadero orchestrator`) or is starting",
                s.addr
            ),
            Err(e) => format!("unreachable: {e}"),
        };
        for line in summary.lines() {
            out.push_str(&format!("  {line}\n"));
        }
    }
    out
}

/// Where the workflow API is; shared by `task` and `template`.
#[derive(clap::Args, Clone)]
pub struct ApiArg {
    /// Address of the workflow API (host:port) [default: the control address, whose
    /// port forwards the API to the orchestrator]; or the orchestrator's own address, as
    /// its "serving" line says (one hop fewer, and kept-alive connections).
    #[arg(long, env = "EMBARCADERO_WORKFLOW_API")]
    pub api: Option<String>,
    #[command(flatten)]
    pub control: crate::ControlArg,
}

impl ApiArg {
    /// `--api` if given, else the control address.
    pub fn addr(&self) -> &str {
        self.api.as_deref().unwrap_or(&self.control.control)
    }
}

/// Where the event log is; shared by `orchestrator` and `worker`.
#[derive(clap::Args, Clone)]
pub struct LogArgs {
    #[command(flatten)]
    pub control: crate::ControlArg,
    /// The order-5 topic holding the engine's events (created if missing).
    #[arg(long, default_value = "workflow.events")]
    pub topic: String,
    /// Acknowledgement level of the engine's events: 1 ordered, 2 durable (needs --rf 2).
    /// Durable by default: the log is the engine's only state.
    #[arg(long, default_value_t = 2)]
    pub ack: u8,
    /// Replication factor of the topic when it is created here: 2 keeps the events on
    /// disk across a server restart; 1 keeps them in memory only (a restart loses every
    /// template and task).
    #[arg(long, default_value_t = 2)]
    pub rf: u8,
    /// A worker not heard from for this many milliseconds loses its claims (the
    /// orchestrator's; it tells workers, and a worker given a longer one heartbeats by
    /// the orchestrator's).
    #[arg(long, default_value_t = 3000)]
    pub lease_ms: u64,
    /// How long (microseconds) an event the process publishes may wait for others to
    /// join its batch; 0: sent as soon as a sender is free.
    #[arg(long, default_value_t = 0)]
    pub linger_us: u64,
    /// When the server is not there (not started yet, restarting, gone), keep trying to
    /// reach it for this many seconds, then exit with an error; 0: exit at once.
    /// Default: keep trying for as long as the process lives.
    #[arg(long, value_name = "SECS")]
    pub retry_for: Option<u64>,
}

impl LogArgs {
    /// `--retry-for` as a duration; `None`: for ever.
    fn retry_for(&self) -> Option<std::time::Duration> {
        self.retry_for.map(std::time::Duration::from_secs)
    }

    fn log_config(&self) -> Result<embarcadero_workflow::log::LogConfig, String> {
        if self.ack == 2 && self.rf < 2 {
            return Err(format!(
                "--rf {} keeps the event log in memory only, and --ack 2 (durable, the default) needs it on disk (--rf 2 or more): add --ack 1 to keep it in memory (a server restart then loses every template and task), or leave --rf at 2",
                self.rf
            ));
        }
        let mut c = embarcadero_workflow::log::LogConfig::new(&self.control.control, &self.topic);
        c.ack = self.ack;
        c.replication_factor = self.rf;
        c.linger = std::time::Duration::from_micros(self.linger_us);
        Ok(c)
    }
}
