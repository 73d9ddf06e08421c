//! Task input checking: a template's `input_schema` compiled once (JSON Schema, by the
//! `jsonschema` crate without its network and file resolvers), and a task's context
//! checked against it on submit.

use serde_json::Value;

/// A compiled input schema.
pub struct InputSchema {
    validator: jsonschema::Validator,
}

impl InputSchema {
    /// Compiles `schema`; the error says why it is not a valid JSON Schema.
    pub fn compile(schema: &Value) -> Result<Self, String> {
        jsonschema::validator_for(schema)
            .map(|validator| Self { validator })
            .map_err(|e| format!("not a valid JSON Schema: {e}"))
    }

    /// Every way `input` fails the schema, each with where (a JSON pointer).
    pub fn problems(&self, input: &Value) -> Vec<String> {
        self.validator
            .iter_errors(input)
            .map(|e| {
                let at = e.instance_path().to_string();
                let at = if at.is_empty() { "/".to_string() } else { at };
                format!("{at}: {e}")
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_is_checked_and_problems_say_where() {
        let s = InputSchema::compile(&json!({
            "type": "object",
            "required": ["even_number"],
            "properties": {"even_number": {"type": "integer", "multipleOf": 2}}
        }))
        .unwrap();
        assert!(s.problems(&json!({"even_number": 6})).is_empty());
        let p = s.problems(&json!({"even_number": 7}));
        assert!(p[0].starts_with("/even_number"), "{p:?}");
        assert_eq!(s.problems(&json!({})).len(), 1);
    }
}
