//! Templates as `POST /v1/templates` reads them: the body (YAML or JSON, read as UTF-8
//! with replacement, as the API does) through `validate::load` (YAML parse, shape, every
//! check, the input schema compiled), once checking handler names and once not. A
//! template that loads survives the log's encoding (`template_registered` decodes equal),
//! its input schema checks a context, and a task of it is created and decided on by the
//! fold (protocols 1 and 2) without a panic.
use embarcadero_workflow::decide::{decide, Clock};
use embarcadero_workflow::event::{decode, encode, Envelope};
use embarcadero_workflow::schema::InputSchema;
use embarcadero_workflow::validate::load;
use embarcadero_workflow::{Event, State, Template};
use std::collections::BTreeSet;

fn fold(template: &Template) {
    let mut state = State::default();
    let apply = |state: &mut State, event: Event| {
        let env = Envelope {
            ts_ms: 1,
            term: None,
            event,
        };
        let decoded = decode(&encode(&env)).expect("an encoded event decodes");
        assert_eq!(decoded, env, "an event round-trips through the log");
        let _ = state.apply(state.next_position, &decoded);
    };
    apply(
        &mut state,
        Event::TemplateRegistered {
            template: template.clone(),
        },
    );
    for (task, protocol) in [("t1", None), ("t2", Some(2))] {
        let created = Event::TaskCreated {
            task: task.into(),
            namespace: template.namespace.clone(),
            name: template.name.clone(),
            version: template.version.clone(),
            context: serde_json::json!({}),
            idempotency_key: Some(task.into()),
            identity: None,
            protocol,
        };
        apply(&mut state, created);
    }
    let clock = Clock {
        now_ms: 1000,
        lease_ms: 100,
        claimed_at: &|_| Some(0),
        worker_seen: &|_| Some(0),
    };
    for event in decide(&state, &clock).0 {
        apply(&mut state, event);
    }
}

fn main() {
    let known: BTreeSet<String> = ["x".to_string(), "math.square".to_string()].into();
    afl::fuzz!(|data: &[u8]| {
        let text = String::from_utf8_lossy(data);
        let _ = load(&text, Some(&known));
        let Ok(template) = load(&text, None) else {
            return;
        };
        if let Some(schema) = &template.input_schema {
            let compiled = InputSchema::compile(schema).expect("load compiled it");
            let _ = compiled.problems(&serde_json::json!({"n": 1, "s": "x"}));
        }
        fold(&template);
    });
}
