//! `embarcadero`: the one binary. Serves (the embedded server), administers topics,
//! publishes, subscribes, reports status, and benchmarks.
//!
//! Owns: argument parsing, human and `--json` output, progress bars, exit codes. All
//! real work is done by the server and client crates.

/// `println!` for the command's output. A reader that went away (`embarcadero status |
/// head`) ends the process quietly, as it would any Unix tool, instead of a panic; any
/// other failure to write is reported.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                eprintln!("error: cannot write to stdout: {e}");
                std::process::exit(1);
            }
            std::process::exit(0);
        }
    }};
}

mod bench;
mod chaos;
mod logging;
pub(crate) use logging::{init_logging, note};
mod cluster;
mod publish;
mod show;
mod subscribe;
mod workflow;

use clap::{Parser, Subcommand};
use embarcadero_client::{Admin, TopicSpec};
use embarcadero_server::{Server, ServerConfig};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "embarcadero",
    version,
    about = "A totally ordered shared log with pub/sub on top",
    long_about = "A totally ordered shared log with pub/sub on top.\n\nStart a server with `embarcadero serve`, create a topic with `embarcadero topic create NAME --order 2`, then `embarcadero pub` and `embarcadero sub`."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How the long-running commands (serve, broker, sequencer, orchestrator, worker)
    /// write their log to stderr: text for people, or one JSON object per line.
    #[arg(long, global = true, env = "EMBARCADERO_LOG_FORMAT", value_enum, ignore_case = true, default_value_t = logging::LogFormat::Text)]
    log_format: logging::LogFormat,
}

/// Where the control plane is; shared by the client subcommands.
#[derive(clap::Args, Clone)]
pub struct ControlArg {
    /// Address of the server's control API (host:port).
    #[arg(long, env = "EMBARCADERO_CONTROL", default_value = "127.0.0.1:12140")]
    pub control: String,
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded server: control plane, brokers and sequencer in one process.
    Serve(ServeArgs),
    /// Create, list, describe and delete topics.
    #[command(subcommand)]
    Topic(TopicCommand),
    /// Publish messages: one per line from stdin, or generated load with --count.
    Pub(publish::PubArgs),
    /// Print a topic's messages in order.
    Sub(subscribe::SubArgs),
    /// Show brokers, sequencer and topics of a running server.
    Status {
        #[command(flatten)]
        control: ControlArg,
        /// Print the raw status document as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Measure throughput and latency, next to the machine's own ceilings.
    Bench(bench::BenchArgs),
    /// Fault campaign: cycles of faults against a cluster of processes, each cycle's
    /// history of sends, acknowledgements and deliveries checked for anomalies.
    Chaos(chaos::ChaosArgs),
    /// Cluster mode: run the head (control plane and its own brokers) or a follower
    /// broker in its own process.
    Broker(cluster::BrokerArgs),
    /// Cluster mode: run the sequencer in its own process (active, or --standby).
    Sequencer(cluster::SequencerArgs),
    /// Workflow engine: run the orchestrator and its API (docs/WORKFLOW.md).
    Orchestrator(workflow::OrchestratorArgs),
    /// Workflow engine: run a worker with the built-in Rust step handlers (SIGINT or
    /// SIGTERM drains it: no new claim, running attempts publish their results; a second
    /// signal exits at once).
    Worker(workflow::WorkerArgs),
    /// Workflow tasks: create, get, wait, list, steps, cancel, rerun, resolve, reset-step, resolve-step, dlq, stats, bench.
    #[command(subcommand)]
    Task(workflow::TaskCommand),
    /// Workflow templates: register, list, show, validate.
    #[command(subcommand)]
    Template(workflow::TemplateCommand),
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// TOML config file; see `embarcadero serve --print-config` for every key.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Directory for the region file and topic metadata [default: embarcadero-data].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Number of brokers [default: 4].
    #[arg(long)]
    brokers: Option<u32>,
    /// Address to listen on [default: 127.0.0.1]; 0.0.0.0 (every interface) needs
    /// --advertise.
    #[arg(long)]
    bind: Option<String>,
    /// Host (IP address or name) clients reach the brokers at, as the server tells
    /// them [default: the --bind address]. A follower also takes HOST:PORT.
    #[arg(long, env = "EMBARCADERO_ADVERTISE")]
    advertise: Option<String>,
    /// Broker i listens on base-port + i; 0 for ephemeral ports [default: 1214].
    #[arg(long)]
    base_port: Option<u16>,
    /// Port of the admin API and /metrics [default: 12140].
    #[arg(long)]
    control_port: Option<u16>,
    /// Sequencer epoch in microseconds, at least 50 [default: 500].
    #[arg(long)]
    epoch_us: Option<u64>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

impl ServeArgs {
    /// The options given that only a server or a head reads (a follower takes its
    /// settings from the head and its own flags), by their flag names.
    pub fn head_only_given(&self) -> Vec<&'static str> {
        [
            ("--config", self.config.is_some()),
            ("--data-dir", self.data_dir.is_some()),
            ("--brokers", self.brokers.is_some()),
            ("--base-port", self.base_port.is_some()),
            ("--control-port", self.control_port.is_some()),
            ("--epoch-us", self.epoch_us.is_some()),
            ("--print-config", self.print_config),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }
}

#[derive(Subcommand)]
enum TopicCommand {
    /// Create a topic.
    Create {
        /// Topic name: 1 to 63 letters, digits, '.', '_' or '-', not starting with '.' or '-'.
        name: String,
        /// 0: no order; 1: FIFO per broker; 2: total order (the same for every subscriber,
        /// not necessarily a publisher's own); 5: total order keeping each publisher's order.
        #[arg(long, default_value_t = 2)]
        order: u8,
        /// Replication factor, counting the in-memory copy. Default: 2 (one disk replica:
        /// the data survives restarts) for orders 2 and 5; 1 for orders 0 and 1, which
        /// have no global order to replicate.
        #[arg(long, conflicts_with = "memory_only")]
        rf: Option<u8>,
        /// Keep the topic in memory only (--rf 1): faster, but its data is gone after a
        /// restart of the server.
        #[arg(long)]
        memory_only: bool,
        /// Acknowledgement level `embarcadero pub` uses when not given `--ack` (library
        /// publishers set theirs in `PublisherConfig::ack_level`).
        #[arg(long, default_value_t = 1)]
        default_ack: u8,
        /// Keep at most this many bytes per disk replica (0: no limit). Default: the
        /// server's replication.retention_bytes.
        #[arg(long)]
        retention_bytes: Option<u64>,
        /// Keep data on disk this many milliseconds (0: no limit). Default: the
        /// server's replication.retention_ms.
        #[arg(long)]
        retention_ms: Option<u64>,
        #[command(flatten)]
        control: ControlArg,
        /// Print the result as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// List topics.
    List {
        #[command(flatten)]
        control: ControlArg,
        /// Print the API's document, `{"topics": [...]}`, as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Delete a topic: its data, memory and disk replicas go at once, and its connected
    /// publishers and subscribers are told (TopicDeleted). A topic created later with
    /// the same name is a new topic, whose positions start at 0.
    Delete {
        /// Topic name.
        name: String,
        #[command(flatten)]
        control: ControlArg,
        /// Print the deleted topic as JSON on stdout (with "deleted": true).
        #[arg(long)]
        json: bool,
    },
    /// Describe one topic with its counters.
    Describe {
        /// Topic name.
        name: String,
        #[command(flatten)]
        control: ControlArg,
        /// Print the result as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::set_log_format(cli.log_format);
    // A misspelt variable (EMBARCADERO_CONTROLL) would otherwise be ignored without a
    // word; `serve` and `broker --head` warn while loading their configuration.
    if matches!(
        cli.command,
        Command::Topic(_) | Command::Pub(_) | Command::Sub(_) | Command::Status { .. }
    ) {
        warn_about_unknown_env();
    }
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Topic(cmd) => topic(cmd),
        Command::Pub(args) => publish::run(args),
        Command::Sub(args) => subscribe::run(args),
        Command::Status { control, json } => status(&control, json),
        Command::Bench(args) => bench::run(args),
        Command::Chaos(args) => chaos::run(args),
        Command::Broker(args) => cluster::broker(args),
        Command::Sequencer(args) => cluster::sequencer(args),
        Command::Orchestrator(args) => workflow::orchestrator(args),
        Command::Worker(args) => workflow::worker(args),
        Command::Task(cmd) => workflow::task(cmd),
        Command::Template(cmd) => workflow::template(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            logging::note_line("ERROR", format_args!("error: {message}"));
            ExitCode::from(FAILURE_CODE.load(std::sync::atomic::Ordering::Relaxed))
        }
    }
}

pub type CliResult = Result<(), String>;

/// The exit code of a failed command: 1, unless the command said otherwise
/// ([`fail_with`]).
static FAILURE_CODE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(1);

/// A failure that exits with `code` instead of 1 (`task wait`: 124 when the wait ran out
/// with the task still running, so that a script can tell it from a task that failed).
pub fn fail_with(code: u8, message: String) -> CliResult {
    assert!(code > 1, "0 is success and 1 every other failure");
    FAILURE_CODE.store(code, std::sync::atomic::Ordering::Relaxed);
    Err(message)
}

/// A pause between attempts to reach a server that is down, doubling up to 1 s.
pub fn retry_pause(pause: &mut std::time::Duration) {
    // A retry interval while the server is down, not a wait for an event.
    std::thread::sleep(*pause);
    *pause = (*pause * 2).min(std::time::Duration::from_secs(1));
}

/// `n` with the noun in the right number: "1 message", "2 messages", "0 batches".
pub fn count_of(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Value parser for counts and sizes that must be 1 or more.
pub fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn serve(args: ServeArgs) -> CliResult {
    let Some(config) = serve_config(args, |_| {})? else {
        return Ok(());
    };
    run_server(config)
}

/// The server configuration of `args` (file, environment, then flags), after `adjust`
/// (the head's own defaults). `None` when the user only asked to print it.
pub fn serve_config(
    args: ServeArgs,
    adjust: impl FnOnce(&mut ServerConfig),
) -> Result<Option<ServerConfig>, String> {
    let mut config = ServerConfig::load(args.config.as_deref()).map_err(|e| e.to_string())?;
    warn_about_unknown_env();
    adjust(&mut config);
    if let Some(v) = args.data_dir {
        config.data_dir = v;
    }
    if let Some(v) = args.brokers {
        config.brokers = v;
    }
    if let Some(v) = args.bind {
        config.bind = v;
    }
    if let Some(v) = args.advertise {
        config.advertise = v;
    }
    if let Some(v) = args.base_port {
        config.base_port = v;
    }
    if let Some(v) = args.control_port {
        config.control_port = v;
    }
    if let Some(v) = args.epoch_us {
        config.sequencer.epoch_us = v;
    }
    config.validate().map_err(|e| e.to_string())?;
    config.advertised_ip().map_err(|e| e.to_string())?;
    if args.print_config {
        say!("{}", config.to_toml().trim_end_matches('\n'));
        return Ok(None);
    }
    Ok(Some(config))
}

/// `EMBARCADERO_*` variables that are not server settings but are read elsewhere: by this
/// command line, the client library, or the scripts under `scripts/`.
const NON_SERVER_ENV: &[&str] = &[
    "EMBARCADERO_CONTROL",
    "EMBARCADERO_LOG",
    "EMBARCADERO_LOG_FORMAT",
    "EMBARCADERO_ETCD",
    "EMBARCADERO_SLOW_CONSUMER_QUEUE",
    "EMBARCADERO_SLOW_CONSUMER_MS",
    "EMBARCADERO_BIN",
    "EMBARCADERO_LINGER_US",
    "EMBARCADERO_EPOCH_US",
    "EMBARCADERO_WORKFLOW_API",
    "EMBARCADERO_WORKFLOW_RUN_LOG",
    "EMBARCADERO_TRANSPORT",
];

/// A misspelt variable would otherwise be ignored without a word.
fn warn_about_unknown_env() {
    for (name, meant) in ServerConfig::unknown_env(std::env::vars(), NON_SERVER_ENV) {
        match meant {
            Some(meant) => eprintln!(
                "warning: {name} names no setting and is ignored; did you mean {meant}?"
            ),
            None => eprintln!(
                "warning: {name} names no setting and is ignored (see the configuration table in the README)"
            ),
        }
    }
}

/// Runs a server until SIGINT, SIGTERM or SIGHUP.
pub fn run_server(config: ServerConfig) -> CliResult {
    init_logging();
    let stop = stop_signal()?;
    let mut server = Server::start(config).map_err(|e| e.to_string())?;
    // Where clients reach the admin API: the advertised host, as for the brokers.
    let control = match server.config().advertised_ip() {
        Ok(ip) => std::net::SocketAddr::new(ip, server.control_addr().port()),
        Err(_) => server.control_addr(),
    };
    note!(
        "embarcadero is serving: control API http://{control}  brokers {}",
        server
            .broker_addrs()
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    loop {
        match stop.recv_timeout(std::time::Duration::from_millis(100)) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if server.region().is_retired() => {
                // Another head was started on this region file (two heads configured with
                // one `region.path`): it rebuilt the region, and this one's brokers stopped.
                server.stop();
                return Err(format!(
                    "another head was started on the region file {} and replaced it; this server stopped. Give each head its own region.path",
                    server.region().path().display()
                ));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    note!("shutting down");
    server.stop();
    Ok(())
}

/// A channel that receives once SIGINT, SIGTERM or SIGHUP arrives (`ctrlc`'s
/// `termination` feature): each stops a long-running command gracefully.
pub fn stop_signal() -> Result<std::sync::mpsc::Receiver<()>, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .map_err(|e| format!("cannot install the signal handler: {e}"))?;
    Ok(rx)
}

/// The replication factor `topic create` asks for: durable by default where the order
/// allows disk replicas (orders 2 and 5), memory only when asked for or for orders 0/1.
fn replication_factor(order: u8, rf: Option<u8>, memory_only: bool) -> u8 {
    match (rf, memory_only) {
        (Some(rf), _) => rf,
        (None, true) => 1,
        (None, false) if order >= 2 => 2,
        (None, false) => {
            eprintln!(
                "note: order {order} topics are memory only (disk replicas copy the global \
                 order, which orders 0 and 1 do not have): their data does not survive a \
                 restart; use --order 2 for a durable topic"
            );
            1
        }
    }
}

fn topic_list(control: &ControlArg, json: bool) -> CliResult {
    let topics = Admin::new(&control.control)
        .list_topics()
        .map_err(|e| e.to_string())?;
    if json {
        // The document `GET /v1/topics` answers, as `template list --json` and
        // `status --json` print theirs: an object a later field can join.
        let document = serde_json::json!({ "topics": topics });
        say!("{}", serde_json::to_string_pretty(&document).expect("json"));
    } else {
        say!("{}", show::topic_table(&topics, None).trim_end());
    }
    Ok(())
}

fn topic(cmd: TopicCommand) -> CliResult {
    match cmd {
        TopicCommand::Create {
            name,
            order,
            rf,
            memory_only,
            default_ack,
            retention_bytes,
            retention_ms,
            control,
            json,
        } => {
            let rf = replication_factor(order, rf, memory_only);
            let info = Admin::new(&control.control)
                .create_topic(&TopicSpec {
                    name,
                    order,
                    replication_factor: rf,
                    default_ack,
                    retention_bytes,
                    retention_ms,
                })
                .map_err(|e| e.to_string())?;
            if json {
                say!("{}", serde_json::to_string_pretty(&info).expect("json"));
            } else {
                say!(
                    "created topic {} (order {}, rf {}, default ack {})",
                    info.name,
                    info.order,
                    info.replication_factor,
                    info.default_ack
                );
            }
        }
        TopicCommand::List { control, json } => topic_list(&control, json)?,
        TopicCommand::Delete {
            name,
            control,
            json,
        } => topic_delete(&name, &control, json)?,
        TopicCommand::Describe {
            name,
            control,
            json,
        } => {
            let t = Admin::new(&control.control)
                .describe_topic(&name)
                .map_err(|e| e.to_string())?;
            if json {
                say!("{}", serde_json::to_string_pretty(&t).expect("json"));
            } else {
                say!("{}", show::topic_text(&t).trim_end());
            }
        }
    }
    Ok(())
}

/// `topic delete NAME`: one line saying what went, or the deleted topic as JSON.
fn topic_delete(name: &str, control: &ControlArg, json: bool) -> CliResult {
    let t = Admin::new(&control.control)
        .delete_topic(name)
        .map_err(|e| e.to_string())?;
    if json {
        let mut v = serde_json::to_value(&t).expect("json");
        v["deleted"] = serde_json::Value::Bool(true);
        say!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        let freed = if t.replication_factor >= 2 {
            "data, memory and disk replicas"
        } else {
            "data and memory"
        };
        say!(
            "deleted topic {} (order {}, rf {}): its {freed} are freed; connected clients were told",
            t.name,
            t.order,
            t.replication_factor
        );
    }
    Ok(())
}

fn status(control: &ControlArg, json: bool) -> CliResult {
    let s = Admin::new(&control.control)
        .status()
        .map_err(|e| e.to_string())?;
    if json {
        say!("{}", serde_json::to_string_pretty(&s).expect("json"));
    } else {
        let engines = workflow::engines_text(&s.services);
        say!("{}", show::status_text(&s, &control.control).trim_end());
        if !engines.is_empty() {
            say!("\n{}", engines.trim_end());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every subcommand, argument and option says in `--help` what it is for.
    #[test]
    fn every_argument_has_a_description() {
        fn missing(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let builtin = matches!(arg.get_id().as_str(), "help" | "version");
                if !builtin && arg.get_help().is_none() && arg.get_long_help().is_none() {
                    out.push(format!("{path} {}", arg.get_id()));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_about().is_none() && sub.get_long_about().is_none() {
                    out.push(format!("{path} {} (the subcommand)", sub.get_name()));
                }
                missing(sub, &format!("{path} {}", sub.get_name()), out);
            }
        }
        let cmd = Cli::command();
        cmd.clone().debug_assert();
        let mut out = Vec::new();
        missing(&cmd, "embarcadero", &mut out);
        assert!(out.is_empty(), "no --help text for: {out:#?}");
    }

    /// A variable an option reads is never called a misspelt setting (the warning
    /// `EMBARCADERO_TRANSPORT=tcp` got while `pub` used TCP, an operator's first days).
    #[test]
    fn no_variable_an_option_reads_is_warned_about() {
        fn envs(cmd: &clap::Command, out: &mut Vec<(String, String)>) {
            for arg in cmd.get_arguments() {
                if let Some(name) = arg.get_env() {
                    out.push((name.to_string_lossy().into_owned(), "x".into()));
                }
            }
            for sub in cmd.get_subcommands() {
                envs(sub, out);
            }
        }
        let mut read = Vec::new();
        envs(&Cli::command(), &mut read);
        assert!(read.iter().any(|(n, _)| n == "EMBARCADERO_TRANSPORT"));
        let warned = ServerConfig::unknown_env(read, NON_SERVER_ENV);
        assert!(warned.is_empty(), "warned about: {warned:?}");
    }
}
