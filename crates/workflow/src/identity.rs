//! A new task's identity under its template's [`IdentityStrategy`] (Tasker's): the key
//! by which a second submission of the same task is recognised and answered with the
//! first. The identity is computed by the API and recorded in the `task_created` event,
//! so the fold only compares recorded identities: replaying an old log gives the same
//! state even if the way identities are computed changes later.

use crate::template::{IdentityStrategy, Template};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// Why a task request has no identity its template accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("template {template} has identity_strategy caller_provided: the request needs an idempotency_key")]
pub struct MissingKey {
    pub template: String,
}

/// The identity of a task of `template` with `context` and the caller's key: `None`
/// when the task is never deduplicated (`always_unique`).
///
/// `strict`: SHA-256 of the canonical JSON of `{namespace, name, version, context}`, or,
/// when the caller gave an `idempotency_key`, of `{namespace, name, version,
/// idempotency_key}` (the key says which submissions are the same task better than
/// the context can). `caller_provided`: the latter, the key being required.
pub fn identity(
    template: &Template,
    context: &Value,
    idempotency_key: Option<&str>,
) -> Result<Option<String>, MissingKey> {
    let (namespace, name, version) = (&template.namespace, &template.name, &template.version);
    let by_key = idempotency_key.map(
        |k| json!({"namespace": namespace, "name": name, "version": version, "idempotency_key": k}),
    );
    let named = match (template.identity_strategy, by_key) {
        (IdentityStrategy::AlwaysUnique, _) => return Ok(None),
        (_, Some(named)) => named,
        (IdentityStrategy::CallerProvided, None) => {
            return Err(MissingKey {
                template: template.key().to_string(),
            })
        }
        (IdentityStrategy::Strict, None) => {
            json!({"namespace": namespace, "name": name, "version": version, "context": context})
        }
    };
    Ok(Some(format!(
        "sha256:{}",
        sha256_hex(&canonical_json(&named))
    )))
}

fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// JSON with every object's keys sorted (by their UTF-8 bytes) and no whitespace;
/// strings and numbers as serde_json writes them (so `1` and `1.0` differ).
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (key, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(strategy: &str) -> Template {
        let yaml = format!(
            "{{name: t, namespace: n, version: '1', identity_strategy: {strategy}, \
             steps: [{{name: a, handler: {{callable: math.square}}}}]}}"
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_depth_and_has_no_whitespace() {
        let v: Value =
            serde_json::from_str(r#"{ "b": [ {"z":1, "a":"x y"} ], "a": 2.5 }"#).unwrap();
        assert_eq!(canonical_json(&v), r#"{"a":2.5,"b":[{"a":"x y","z":1}]}"#);
    }

    #[test]
    fn strict_hashes_the_canonical_template_and_context() {
        let t = template("strict");
        let context = json!({"y": 1, "x": [true, null]});
        // `printf %s '{"context":{"x":[true,null],"y":1},"name":"t","namespace":"n","version":"1"}' | sha256sum`
        let expected = "sha256:bc1544027fc3eb7ebd179ef14f85a3e850234e4b7aad42b051a09d261dfd0aa1";
        let got = identity(&t, &context, None).unwrap().unwrap();
        assert_eq!(got, expected);
        let reordered: Value = serde_json::from_str(r#"{"x":[true,null],"y":1}"#).unwrap();
        assert_eq!(identity(&t, &reordered, None).unwrap().unwrap(), got);
        assert_ne!(identity(&t, &json!({"y": 2}), None).unwrap().unwrap(), got);
    }

    #[test]
    fn caller_provided_needs_a_key_and_always_unique_has_no_identity() {
        let caller = template("caller_provided");
        assert!(identity(&caller, &json!({}), None).is_err());
        let a = identity(&caller, &json!({"x": 1}), Some("k")).unwrap();
        let b = identity(&caller, &json!({"x": 2}), Some("k")).unwrap();
        assert_eq!(a, b, "the key alone names the task");
        let unique = template("always_unique");
        assert_eq!(identity(&unique, &json!({}), Some("k")).unwrap(), None);
    }
}
