//! Measures sequencer failover with real processes and the default settings: the active
//! `embarcadero sequencer` is SIGKILLed with a standby waiting; reported is the time from
//! the kill until a new batch is acknowledged. Broker failover under load is measured by
//! `embarcadero bench --mode failure` (same cluster code: `embarcadero_cli::local_cluster`).
//!
//! Usage (release build, so the `embarcadero` binary sits next to this example):
//! `cargo build --release -p embarcadero-cli --bins --examples &&
//!  target/release/examples/failover_time [RUNS]`

use embarcadero_cli::local_cluster::{ClusterSpec, LocalCluster};
use embarcadero_client::{Admin, Publisher, PublisherConfig, TopicSpec};

/// `target/<profile>/embarcadero`, next to this example's directory.
fn binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("own path");
    exe.parent()
        .and_then(|examples| examples.parent())
        .map(|dir| dir.join("embarcadero"))
        .expect("target directory")
}

/// Seconds from the active sequencer's SIGKILL until a new batch is acknowledged.
fn sequencer_failover() -> Result<f64, String> {
    let mut spec = ClusterSpec::new(binary(), 3);
    spec.external_sequencer = true;
    let mut cluster = LocalCluster::start(&spec)?;
    let active = cluster.start_sequencer(false)?;
    cluster.start_sequencer(true)?;
    Admin::new(&cluster.control)
        .create_topic(&TopicSpec::new("t", 2))
        .map_err(|e| e.to_string())?;
    let publisher = Publisher::connect(&cluster.control, "t", PublisherConfig::default())
        .map_err(|e| e.to_string())?;
    publisher.publish(b"before").map_err(|e| e.to_string())?;
    publisher.flush().map_err(|e| e.to_string())?;
    let killed = cluster.kill_sequencer(active)?;
    publisher.publish(b"after").map_err(|e| e.to_string())?;
    publisher
        .flush()
        .map_err(|e| format!("not ordered by the standby: {e}"))?;
    Ok(killed.elapsed().as_secs_f64())
}

fn main() -> Result<(), String> {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    for run in 1..=runs {
        println!(
            "run {run}: sequencer kill to next ack: {:.3} s",
            sequencer_failover()?
        );
    }
    Ok(())
}
