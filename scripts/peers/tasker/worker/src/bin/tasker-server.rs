//! Tasker's orchestration server: the same library entry point as the crate's own
//! `tasker-server` binary (OrchestrationBootstrap with the REST API), built here so that
//! one cargo build compiles Tasker's dependency graph once for the server and the worker.

use tasker_orchestration::orchestration::bootstrap::OrchestrationBootstrap;
use tokio::signal::unix::{signal, SignalKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tasker_shared::logging::init_tracing();
    let mut handle = OrchestrationBootstrap::bootstrap()
        .await
        .map_err(|e| format!("failed to bootstrap orchestration: {e}"))?;
    // The run script waits for this line before it submits work.
    eprintln!("tasker-server is running");
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    handle.stop().await?;
    Ok(())
}
