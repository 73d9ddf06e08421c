//! `embarcadero broker --head | --follower` and `embarcadero sequencer`: the cluster's
//! processes.

use crate::{init_logging, run_server, serve_config, stop_signal, CliResult, ServeArgs};
use embarcadero_server::follower::{Follower, FollowerConfig};
use embarcadero_server::sequencer_process::{SequencerProcess, SequencerProcessConfig};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("role").required(true).args(["head", "follower"])))]
pub struct BrokerArgs {
    /// Run the head: the control plane (topics, membership, cluster status), the disk
    /// replicas, its local brokers (`--local-brokers`, default broker 0) and, unless
    /// `--external-sequencer`, the sequencer. Takes every `serve` option.
    #[arg(long)]
    head: bool,
    /// Run one broker that attaches to the head's region and joins its cluster.
    #[arg(long)]
    follower: bool,
    /// Head: broker ids this process serves, comma-separated [default: 0].
    #[arg(long)]
    local_brokers: Option<String>,
    /// Head: leave ordering to an `embarcadero sequencer` process.
    #[arg(long)]
    external_sequencer: bool,
    #[command(flatten)]
    serve: ServeArgs,
    /// Follower: the head's control address (host:port).
    #[arg(long, required_if_eq("follower", "true"))]
    head_addr: Option<String>,
    /// Follower: the broker id to serve (1..brokers on a head that serves broker 0).
    #[arg(long, required_if_eq("follower", "true"))]
    broker_id: Option<u32>,
    /// Follower: data port; 0 for an ephemeral port.
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Follower: the head's region file as this host sees it [default: the head's path].
    #[arg(long)]
    region: Option<PathBuf>,
    /// Follower: port of this broker's /metrics; 0 for an ephemeral port.
    #[arg(long, default_value_t = 0)]
    metrics_port: u16,
}

pub fn broker(args: BrokerArgs) -> CliResult {
    if args.head {
        head(args)
    } else {
        follower(args)
    }
}

/// `broker --head`: the embedded server with the head's defaults.
fn head(args: BrokerArgs) -> CliResult {
    let local = args.local_brokers.clone();
    let external = args.external_sequencer;
    let Some(config) = serve_config(args.serve, |c| {
        // The flag, else the file's or the environment's setting, else broker 0.
        match local {
            Some(local) => c.cluster.local_brokers = local,
            None if c.cluster.local_brokers.trim().is_empty() => {
                c.cluster.local_brokers = "0".into()
            }
            None => {}
        }
        if external {
            c.cluster.sequencer = "external".into();
        }
    })?
    else {
        return Ok(());
    };
    run_server(config)
}

/// `broker --follower`: one broker attached to the head's region, until a stop signal.
fn follower(args: BrokerArgs) -> CliResult {
    let ignored = args.serve.head_only_given();
    if !ignored.is_empty() {
        let verb = if ignored.len() == 1 {
            "applies"
        } else {
            "apply"
        };
        return Err(format!(
            "{} {verb} to `broker --head` and `serve` only; a follower takes its settings from the head (--head-addr) and its own flags (--broker-id, --port, --metrics-port, --region, --bind, --advertise)",
            ignored.join(", ")
        ));
    }
    let bind: IpAddr = args
        .serve
        .bind
        .as_deref()
        .unwrap_or("127.0.0.1")
        .parse()
        .map_err(|e| format!("--bind is not an IP address: {e}"))?;
    let advertise = follower_advertise(args.serve.advertise.as_deref(), bind)?;
    init_logging();
    let stop = stop_signal()?;
    let follower = Follower::start(FollowerConfig {
        head: args.head_addr.expect("required for --follower"),
        broker_id: args.broker_id.expect("required for --follower"),
        listen: SocketAddr::new(bind, args.port),
        advertise,
        region_path: args.region,
        metrics_listen: SocketAddr::new(bind, args.metrics_port),
    })
    .map_err(|e| e.to_string())?;
    crate::note!(
        "embarcadero follower broker {} is serving at {}  metrics http://{}/metrics",
        follower.id(),
        follower.addr(),
        follower.metrics_addr()
    );
    serve_follower(follower, &stop)
}

/// Serves until `stop`, or until the head gives the broker away or replaces the region.
fn serve_follower(mut follower: Follower, stop: &std::sync::mpsc::Receiver<()>) -> CliResult {
    loop {
        match stop.recv_timeout(Duration::from_millis(100)) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) if follower.is_evicted() => {
                follower.stop();
                return Err(format!(
                    "broker {} was given to another process by the head; stopped",
                    follower.id()
                ));
            }
            Err(RecvTimeoutError::Timeout) if follower.region_retired() => {
                follower.stop();
                return Err(format!(
                    "broker {}: the head restarted and replaced the region this process was attached to; stopped. Start it again to attach to the new region",
                    follower.id()
                ));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
    crate::note!("shutting down");
    follower.stop();
    Ok(())
}

/// A follower's `--advertise`: HOST:PORT, or HOST with the port it binds (port 0 tells
/// the follower so). Without it the bound address is advertised, which must then be
/// one clients can connect to.
fn follower_advertise(advertise: Option<&str>, bind: IpAddr) -> Result<Option<SocketAddr>, String> {
    let Some(text) = advertise else {
        if bind.is_unspecified() {
            return Err(format!(
                "--bind {bind} listens on every interface, but clients cannot connect to {bind}: pass --advertise HOST (or HOST:PORT) with the address clients reach this broker at"
            ));
        }
        return Ok(None);
    };
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(Some(addr));
    }
    let ip = embarcadero_server::config::resolve_host(text).map_err(|e| e.to_string())?;
    Ok(Some(SocketAddr::new(ip, 0)))
}

#[derive(clap::Args)]
pub struct SequencerArgs {
    /// The head's control address (host:port).
    #[arg(long)]
    head_addr: String,
    /// The head's region file as this host sees it [default: the head's path].
    #[arg(long)]
    region: Option<PathBuf>,
    /// Wait for the active sequencer's lease to expire, then take over.
    #[arg(long)]
    standby: bool,
    /// etcd endpoint (http://host:2379) for leader election across hosts.
    #[arg(long, env = "EMBARCADERO_ETCD")]
    etcd: Option<String>,
    /// Name of this cluster in etcd (the election key is /embarcadero/NAME/sequencer).
    #[arg(long, default_value = "default")]
    cluster_name: String,
    /// Address to serve /metrics and /healthz on.
    #[arg(long, default_value = "127.0.0.1")]
    bind: IpAddr,
    /// Port of this sequencer's /metrics; 0 for an ephemeral port.
    #[arg(long, default_value_t = 0)]
    metrics_port: u16,
}

pub fn sequencer(args: SequencerArgs) -> CliResult {
    init_logging();
    let stop = stop_signal()?;
    let give_up = Arc::new(AtomicBool::new(false));
    // While a standby waits for the lease, a signal must still end it.
    let waiter = {
        let give_up = give_up.clone();
        std::thread::spawn(move || {
            let _ = stop.recv();
            give_up.store(true, Ordering::Release);
        })
    };
    let config = SequencerProcessConfig {
        head: args.head_addr,
        region_path: args.region,
        standby: args.standby,
        etcd: args.etcd,
        cluster_name: args.cluster_name,
        metrics_listen: SocketAddr::new(args.bind, args.metrics_port),
    };
    let Some(mut sequencer) =
        SequencerProcess::start(&config, &give_up).map_err(|e| e.to_string())?
    else {
        return Ok(());
    };
    crate::note!(
        "embarcadero sequencer is active (fencing epoch {})  metrics http://{}/metrics",
        sequencer.fencing_epoch(),
        sequencer.metrics_addr()
    );
    while !give_up.load(Ordering::Acquire) {
        if sequencer.lost_lease() {
            sequencer.stop();
            return Err("another sequencer took over this region's lease; stopped".into());
        }
        if sequencer.region_retired() {
            sequencer.stop();
            return Err("the head restarted and replaced the region this sequencer ordered; stopped. Start it again to attach to the new region".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(waiter);
    crate::note!("shutting down");
    sequencer.stop();
    Ok(())
}
