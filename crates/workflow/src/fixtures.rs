//! Test support shared by the crate's unit tests: a one-step template and the event that
//! creates a task of it. Test only; touches nothing.

use crate::event::Event;
use crate::template::Template;

/// A template `n/one@1` of one step `s` (handler `x`).
pub const ONE_STEP: &str =
    "name: one\nnamespace: n\nversion: '1'\nsteps:\n  - {name: s, handler: {callable: x}}\n";

/// [`ONE_STEP`], validated.
pub fn one_step_template() -> Template {
    crate::validate::load(ONE_STEP, None).expect("the fixture is a valid template")
}

/// `task_created` of task `task` from [`ONE_STEP`], with an empty context.
pub fn task_created(task: &str, protocol: Option<u8>) -> Event {
    Event::TaskCreated {
        task: task.into(),
        namespace: "n".into(),
        name: "one".into(),
        version: "1".into(),
        context: serde_json::json!({}),
        idempotency_key: None,
        identity: None,
        protocol,
    }
}
