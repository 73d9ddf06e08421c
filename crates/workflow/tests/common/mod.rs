//! What the workflow crate's integration tests share: states compared without what a
//! refused event may change.

use embarcadero_workflow::{State, Task};
use std::sync::Arc;

/// A state without what a refusal may change: the rejection count, the next position
/// and the steps' audit of refused events.
pub fn without_audit(s: &State) -> State {
    let mut s = s.clone();
    s.rejected = 0;
    s.next_position = 0;
    let tasks = s
        .tasks
        .iter()
        .map(|(uuid, t)| (uuid.clone(), Arc::new(without_refusals(t))));
    s.tasks = tasks.collect();
    s
}

/// A task without its steps' audit of refused events (which a finished task keeps
/// collecting: late results are recorded, not applied).
pub fn without_refusals(t: &Task) -> Task {
    let mut t = t.clone();
    for s in &mut t.steps {
        s.refused.clear();
    }
    t
}
