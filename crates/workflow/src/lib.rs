//! The workflow engine on the ordered log (see docs/WORKFLOW.md): templates, events,
//! the fold that turns the event log into the engine's state, the orchestrator's
//! decisions, Rust step handlers, the worker and orchestrator that run them, and the
//! supervisor that replaces a worker whose log was lost.

pub mod api;
pub mod batch;
pub mod branch;
mod builtin;
pub mod client;
pub mod decide;
pub mod event;
#[cfg(test)]
mod fixtures;
pub mod handler;
pub mod identity;
pub mod ids;
pub mod leadership;
pub mod log;
pub mod machine;
mod manual;
pub mod metrics;
pub mod orchestrator;
pub mod render;
pub mod schema;
pub mod settle;
pub mod snapshot;
pub mod staleness;
pub mod state;
mod step_events;
pub mod supervisor;
pub mod task_events;
mod task_routes;
pub mod template;
mod threads;
pub mod trace;
pub mod unclaimed;
pub mod validate;
mod view;
pub mod wide_ints;
pub mod worker;

pub use api::{Api, Reply};
pub use event::{Envelope, Event, Outcome, StepRef};
pub use handler::{Registry, StepContext, StepError, StepHandler};
pub use machine::{StepState, TaskState};
pub use orchestrator::{Orchestrator, OrchestratorConfig};
pub use state::{Rejected, State, Task};
pub use supervisor::{RestartPolicy, SupervisedWorker, WorkerEvent};
pub use template::{Template, TemplateKey};
pub use worker::{Worker, WorkerConfig};
