//! Writes Tasker's configuration (one TOML file, read from TASKER_CONFIG_PATH) from the crates'
//! own defaults. The published crates do not ship Tasker's config/tasker/*.toml, so the defaults
//! compiled into tasker-shared are the closest thing to Tasker's own set-up. Changed: the REST
//! API is on (at the address given) and gRPC is off, since the benchmark drives the REST API;
//! the database pool has the 25 connections of Tasker's own base configuration.
//! Usage: tasker-config ORCHESTRATION_BIND_ADDRESS > tasker.toml

use tasker_shared::config::tasker::{
    CommonConfig, OrchestrationConfig, OrchestrationWebConfig, TaskerConfig, WorkerConfig,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bind = std::env::args()
        .nth(1)
        .ok_or("usage: tasker-config ORCHESTRATION_BIND_ADDRESS")?;
    let common = CommonConfig {
        system: Default::default(),
        database: Default::default(),
        queues: Default::default(),
        circuit_breakers: Default::default(),
        mpsc_channels: Default::default(),
        execution: Default::default(),
        backoff: Default::default(),
        task_templates: Default::default(),
        cache: None,
        pgmq_database: None,
    };
    let web = OrchestrationWebConfig {
        bind_address: bind,
        auth: None,
        ..Default::default()
    };
    let orchestration = OrchestrationConfig {
        web: Some(web),
        grpc: None,
        ..Default::default()
    };
    let worker = WorkerConfig {
        web: None,
        grpc: None,
        ..Default::default()
    };
    let config = TaskerConfig {
        common,
        orchestration: Some(orchestration),
        worker: Some(worker),
    };
    // TOML has no null or unit: the unit metadata of the generic event systems
    // (`EventSystemConfig<()>`, `#[serde(default)]`) serialises as JSON null, so go through JSON
    // and drop nulls; the loader fills those fields back in from their defaults.
    let mut value = serde_json::to_value(&config)?;
    drop_nulls(&mut value);
    // The crate's default pool is 10 connections; Tasker's own base configuration
    // (tasker-core config/tasker/base/common.toml) sets 25. With 10, three pgmq long polls
    // (pgmq.read_with_poll holds a connection up to 5 s) and 8 concurrent clients starve it.
    value["common"]["database"]["pool"]["max_connections"] = 25.into();
    print!("{}", toml::to_string(&toml::Value::try_from(value)?)?);
    Ok(())
}

fn drop_nulls(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(drop_nulls);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}
