//! The workflow engine's event log: the input is messages of the event topic, one per
//! line (each the bytes `event::decode` reads: the version byte, then JSON; a JSON event
//! holds no raw line break), folded in order into one `State` as `log::fold_batch` does
//! (a message that does not decode is refused and counted), then the orchestrator's
//! decisions on the result applied as it would publish them (three rounds). Asserts
//! that nothing panics, that a refused event changes nothing but the count and audit of
//! refusals, and that a snapshot of the final state decodes to the same state (an
//! orchestrator restarted from it folds on from where a replay would be).
use embarcadero_workflow::decide::{decide, Clock};
use embarcadero_workflow::event::{decode, Envelope};
use embarcadero_workflow::snapshot;
use embarcadero_workflow::{State, Task};
use std::sync::Arc;

/// The fold of one message, as `log::fold_one` makes it.
fn fold_one(state: &mut State, position: u64, message: &[u8]) {
    match decode(message) {
        Ok(env) => apply_checked(state, position, &env),
        Err(e) => {
            let _ = state.refuse(position, e.to_string());
        }
    }
}

fn apply_checked(state: &mut State, position: u64, env: &Envelope) {
    let before = state.clone();
    if let Err(why) = state.apply(position, env) {
        assert_eq!(state.rejected, before.rejected + 1);
        assert!(
            same_but_audit(&before, state),
            "refused ({why}), yet the state changed: {:?}",
            env.event.kind()
        );
    }
}

/// Whether two states are equal but for what a refusal may change: the count, the next
/// position and the steps' audit of refused events (tasks still shared are equal).
fn same_but_audit(a: &State, b: &State) -> bool {
    let task = |x: &Arc<Task>| {
        let mut t = Task::clone(x);
        t.steps.iter_mut().for_each(|s| s.refused.clear());
        t
    };
    a.templates == b.templates
        && a.idempotency == b.idempotency
        && a.open == b.open
        && a.leader == b.leader
        && a.tasks.len() == b.tasks.len()
        && a.tasks
            .iter()
            .zip(b.tasks.iter())
            .all(|((ka, ta), (kb, tb))| ka == kb && (Arc::ptr_eq(ta, tb) || task(ta) == task(tb)))
}

/// What the orchestrator decides at `now_ms`, applied in its own term, `rounds` times.
fn decide_rounds(state: &mut State, now_ms: u64, rounds: usize) {
    let clock = Clock {
        now_ms,
        lease_ms: 100,
        claimed_at: &|_| Some(0),
        worker_seen: &|_| Some(0),
    };
    for _ in 0..rounds {
        let (events, _) = decide(state, &clock);
        if events.is_empty() {
            return;
        }
        let term = (state.leader.term > 0).then_some(state.leader.term);
        for event in events {
            let env = Envelope {
                ts_ms: now_ms,
                term,
                event,
            };
            apply_checked(state, state.next_position, &env);
        }
    }
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let mut state = State::default();
        let mut last_ts = 0;
        for (position, message) in data.split(|&b| b == b'\n').enumerate() {
            fold_one(&mut state, position as u64, message);
            if let Ok(env) = decode(message) {
                last_ts = env.ts_ms;
            }
        }
        decide_rounds(&mut state, last_ts.saturating_add(1000), 3);
        let snapshot = snapshot::encode("wf", state.clone());
        let restored = snapshot::decode(&snapshot, "wf");
        assert!(
            restored.as_ref() == Ok(&state),
            "a snapshot decodes to its state"
        );
    });
}
