//! Loading and checking templates: YAML text to a [`Template`], then the checks a
//! template must pass before it is registered (names, dependencies, cycles, handlers,
//! the input schema), each failure a [`TemplateError`] naming template, step and field.

use crate::schema::InputSchema;
use crate::template::{StepTemplate, StepType, Template, MAX_RETRY_DELAY_MS, MAX_TIMEOUT_SECONDS};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// What is wrong with a template, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateError {
    /// `namespace/name@version` when known, else what the document's `name` says.
    pub template: String,
    pub step: Option<String>,
    pub field: String,
    pub message: String,
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "template `{}`", self.template)?;
        if let Some(step) = &self.step {
            write!(f, ", step `{step}`")?;
        }
        write!(f, ", field `{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for TemplateError {}

/// Handler names a template may use; `None` checks none (the orchestrator of a
/// deployment whose workers register handlers it does not link).
pub type KnownHandlers<'a> = Option<&'a BTreeSet<String>>;

/// The most `{` and `[` a template's text may hold. libyaml's scanner takes time
/// quadratic in the depth of nested flow collections (`{{{{...`, `[{a: [...`): a 64 KiB
/// `POST /v1/templates` body of them took 6 s of CPU to refuse (found by the fuzz target
/// `workflow_template`). Depth cannot be bounded before parsing (a bracket inside a quoted
/// string does not count, and quoting is YAML's to decide), their number can: 4096 of
/// them cost at most a few hundred milliseconds, and a template of the API's 64 KiB holds
/// well under 4096 (one per 25-50 bytes in YAML and JSON alike).
pub const MAX_BRACKETS: usize = 4096;

/// Parses YAML (or JSON, which is YAML) and checks the result.
pub fn load(text: &str, handlers: KnownHandlers) -> Result<Template, TemplateError> {
    let brackets = text.bytes().filter(|b| matches!(b, b'{' | b'[')).count();
    if brackets > MAX_BRACKETS {
        return Err(TemplateError {
            template: "?".into(),
            step: None,
            field: "(document)".into(),
            message: format!("{brackets} `{{` and `[`; a template may hold at most {MAX_BRACKETS}"),
        });
    }
    let value: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).map_err(|e| TemplateError {
        template: "?".into(),
        step: None,
        field: "(document)".into(),
        message: format!("not YAML: {e}"),
    })?;
    // From the text, not the value: only then do serde_yaml_ng's errors carry the path.
    let template: Template =
        serde_yaml_ng::from_str(text).map_err(|e| shape_error(&value, &e.to_string()))?;
    check(&template, handlers)?;
    Ok(template)
}

/// A serde error located: serde_yaml_ng says `steps[1].retry: unknown field ...`; the
/// step index is turned into the step's name when the document has one.
fn shape_error(doc: &serde_yaml_ng::Value, text: &str) -> TemplateError {
    let template = doc
        .get("name")
        .and_then(|n| n.as_str())
        .unwrap_or("?")
        .to_string();
    let (path, message) = match text.split_once(": ") {
        Some((p, m)) if !p.contains(' ') => (p.to_string(), m.to_string()),
        _ => (String::new(), text.to_string()),
    };
    let (step, field) = match path.strip_prefix("steps[") {
        Some(rest) => {
            let (index, field) = rest.split_once(']').unwrap_or((rest, ""));
            let name = index
                .parse::<usize>()
                .ok()
                .and_then(|i| doc.get("steps")?.get(i)?.get("name")?.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| format!("#{index}"));
            (Some(name), field.trim_start_matches('.').to_string())
        }
        None => (None, path),
    };
    let field = if field.is_empty() {
        field_in(&message)
    } else {
        field
    };
    TemplateError {
        template,
        step,
        field,
        message,
    }
}

/// The field a serde message names (``unknown field `x` `` or ``missing field `x` ``).
fn field_in(message: &str) -> String {
    message
        .split('`')
        .nth(1)
        .map(str::to_string)
        .unwrap_or_else(|| "(document)".into())
}

/// Every check a parsed template must pass.
pub fn check(t: &Template, handlers: KnownHandlers) -> Result<(), TemplateError> {
    let err = |step: Option<&str>, field: &str, message: String| TemplateError {
        template: t.key().to_string(),
        step: step.map(str::to_string),
        field: field.into(),
        message,
    };
    for (field, value) in [
        ("name", &t.name),
        ("namespace", &t.namespace),
        ("version", &t.version),
    ] {
        if !is_identifier(value) {
            return Err(err(
                None,
                field,
                format!("`{value}` must be 1-128 ASCII letters, digits, '.', '_' or '-'"),
            ));
        }
    }
    if t.steps.is_empty() {
        return Err(err(
            None,
            "steps",
            "a template needs at least one step".into(),
        ));
    }
    if let Some(schema) = &t.input_schema {
        InputSchema::compile(schema).map_err(|m| err(None, "input_schema", m))?;
    }
    let thresholds = t.lifecycle.iter().flat_map(|l| l.thresholds());
    for (field, minutes) in thresholds {
        if minutes.is_some_and(|m| !(m.is_finite() && m > 0.0)) {
            let field = format!("lifecycle.{field}");
            return Err(err(
                None,
                &field,
                "must be a number of minutes above 0".into(),
            ));
        }
    }
    check_steps(t, handlers).map_err(|(step, field, m)| err(Some(&step), field, m))?;
    if let Some(cycle) = find_cycle(t) {
        let (first, path) = (cycle[0].clone(), cycle.join(" -> "));
        return Err(err(
            Some(&first),
            "dependencies",
            format!("dependency cycle: {path}"),
        ));
    }
    Ok(())
}

type StepProblem = (String, &'static str, String);

fn check_steps(t: &Template, handlers: KnownHandlers) -> Result<(), StepProblem> {
    let mut seen = BTreeSet::new();
    for s in &t.steps {
        let fail = |field, message: String| Err((s.name.clone(), field, message));
        if !is_identifier(&s.name) {
            return fail(
                "name",
                "must be 1-128 ASCII letters, digits, '.', '_' or '-'".into(),
            );
        }
        if !seen.insert(s.name.as_str()) {
            return fail("name", "two steps have this name".into());
        }
        if let Some((field, m)) = check_kind(t, s) {
            return fail(field, m);
        }
        for d in &s.dependencies {
            if t.step_index(d).is_none() {
                return fail("dependencies", format!("no step is called `{d}`"));
            }
        }
        if let Some(known) = handlers {
            if !known.contains(&s.handler.callable) {
                let list: Vec<_> = known.iter().map(String::as_str).collect();
                return fail(
                    "handler.callable",
                    format!(
                        "no handler `{}` is registered (known: {}); handlers of Python or TypeScript workers are not known to the orchestrator: start it with --any-handler to accept any name",
                        s.handler.callable,
                        list.join(", ")
                    ),
                );
            }
        }
        if s.retry.max_attempts == 0 {
            return fail(
                "retry.max_attempts",
                "must be at least 1 (the first attempt counts)".into(),
            );
        }
        if s.timeout_seconds == 0 || s.timeout_seconds > MAX_TIMEOUT_SECONDS {
            let most = MAX_TIMEOUT_SECONDS;
            return fail(
                "timeout_seconds",
                format!("must be from 1 to {most} (a week)"),
            );
        }
        for (field, ms) in [
            ("retry.backoff_base_ms", s.retry.backoff_base_ms),
            ("retry.max_backoff_ms", s.retry.max_backoff_ms),
        ] {
            if ms > MAX_RETRY_DELAY_MS {
                return fail(
                    field,
                    format!("must be at most {MAX_RETRY_DELAY_MS} (a day)"),
                );
            }
        }
    }
    Ok(())
}

/// The rules of the step types: a convergence converges something; a batch worker
/// runs after exactly one batchable step and only convergences follow it (its
/// instances' number is known only at run time); a batchable step's failure strategy
/// is one of Tasker's.
fn check_kind(t: &Template, s: &StepTemplate) -> Option<(&'static str, String)> {
    let kind_of = |name: &str| t.steps.iter().find(|x| x.name == name).map(|x| x.step_type);
    match s.step_type {
        StepType::DeferredConvergence if s.dependencies.is_empty() => Some((
            "dependencies",
            "a deferred_convergence step converges dependencies; it has none".into(),
        )),
        StepType::BatchWorker => {
            let one_batchable = s.dependencies.len() == 1
                && kind_of(&s.dependencies[0]) == Some(StepType::Batchable);
            if !one_batchable {
                return Some((
                    "dependencies",
                    "a batch_worker step depends on exactly one batchable step".into(),
                ));
            }
            let after = t.steps.iter().find(|x| {
                x.dependencies.contains(&s.name) && x.step_type != StepType::DeferredConvergence
            });
            after.map(|x| {
                let m = format!("step `{}` depends on it; only a deferred_convergence may follow a batch_worker", x.name);
                ("type", m)
            })
        }
        StepType::Batchable if crate::batch::strategy_of(s.batch_config.as_ref()).is_none() => {
            Some((
                "batch_config.failure_strategy",
                "must be continue_on_failure, fail_fast or isolate".into(),
            ))
        }
        _ => None,
    }
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// A dependency cycle as step names (first repeated at the end), if there is one.
fn find_cycle(t: &Template) -> Option<Vec<String>> {
    let deps: BTreeMap<&str, &[String]> = t
        .steps
        .iter()
        .map(|s| (s.name.as_str(), s.dependencies.as_slice()))
        .collect();
    // 0: unvisited, 1: on the current path, 2: done.
    let mut mark: BTreeMap<&str, u8> = BTreeMap::new();
    let mut path = Vec::new();
    for s in &t.steps {
        if let Some(c) = visit(&s.name, &deps, &mut mark, &mut path) {
            return Some(c);
        }
    }
    None
}

fn visit<'a>(
    node: &'a str,
    deps: &BTreeMap<&'a str, &'a [String]>,
    mark: &mut BTreeMap<&'a str, u8>,
    path: &mut Vec<&'a str>,
) -> Option<Vec<String>> {
    match mark.get(node).copied().unwrap_or(0) {
        2 => return None,
        1 => {
            let start = path.iter().position(|n| *n == node).unwrap_or(0);
            let mut cycle: Vec<String> = path[start..].iter().map(|s| s.to_string()).collect();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        _ => {}
    }
    mark.insert(node, 1);
    path.push(node);
    for d in deps.get(node).copied().unwrap_or_default() {
        if let Some(c) = visit(d.as_str(), deps, mark, path) {
            return Some(c);
        }
    }
    path.pop();
    mark.insert(node, 2);
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "name: lin\nnamespace: demo\nversion: 1.0.0\nsteps:\n";

    fn load_err(steps: &str) -> TemplateError {
        let known: BTreeSet<String> = ["math.square".to_string()].into();
        load(&format!("{BASE}{steps}"), Some(&known)).unwrap_err()
    }

    #[test]
    fn a_good_template_loads() {
        let t = load(
            &format!("{BASE}  - name: a\n    handler: {{callable: math.square}}\n  - name: b\n    dependencies: [a]\n    handler: {{callable: math.square}}\n"),
            None,
        )
        .unwrap();
        assert_eq!(t.steps[1].dependencies, ["a"]);
        assert_eq!(t.steps[1].retry.max_attempts, 3);
    }

    #[test]
    fn errors_name_template_step_and_field() {
        let e =
            load_err("  - name: a\n    dependencies: [zz]\n    handler: {callable: math.square}\n");
        assert_eq!(
            (e.step.as_deref(), e.field.as_str()),
            (Some("a"), "dependencies")
        );
        assert!(
            e.to_string().contains("demo/lin@1.0.0") && e.message.contains("zz"),
            "{e}"
        );

        let e = load_err("  - name: a\n    handler: {callable: nope}\n");
        assert_eq!(e.field, "handler.callable");

        let e = load_err("  - name: a\n    dependencies: [b]\n    handler: {callable: math.square}\n  - name: b\n    dependencies: [a]\n    handler: {callable: math.square}\n");
        assert!(e.message.contains("a -> b -> a"), "{e}");

        let e = load_err("  - name: a\n    handler: {callable: math.square}\n  - name: a\n    handler: {callable: math.square}\n");
        assert_eq!((e.step.as_deref(), e.field.as_str()), (Some("a"), "name"));
    }

    #[test]
    fn bad_fields_are_located_by_step_name() {
        let e = load_err("  - name: a\n    handler: {callable: math.square}\n  - name: b\n    handler: {callable: math.square}\n    retry: {backoff: fast}\n");
        assert_eq!(e.template, "lin");
        assert_eq!(e.step.as_deref(), Some("b"), "{e}");
        assert!(e.field.starts_with("retry"), "{e}");
        let e = load_err("  - name: a\n    handlr: {callable: math.square}\n");
        assert_eq!(
            (e.step.as_deref(), e.field.as_str()),
            (Some("a"), "handlr"),
            "{e}"
        );
    }

    #[test]
    fn a_timeout_or_a_backoff_no_clock_can_hold_is_refused_at_load() {
        // A step with timeout_seconds 2^64 - 1 made every worker that claimed it panic
        // (its deadline overflowed an Instant), and the orchestrator time it out at once.
        let e = load_err("  - name: a\n    handler: {callable: math.square}\n    timeout_seconds: 18446744073709551615\n");
        assert_eq!(e.field, "timeout_seconds", "{e}");
        assert!(e.message.contains("604800"), "{e}");
        let e = load_err("  - name: a\n    handler: {callable: math.square}\n    retry: {backoff_base_ms: 18446744073709551615}\n");
        assert_eq!(e.field, "retry.backoff_base_ms", "{e}");
        let e = load_err("  - name: a\n    handler: {callable: math.square}\n    retry: {max_backoff_ms: 86400001}\n");
        assert_eq!(e.field, "retry.max_backoff_ms", "{e}");
    }

    #[test]
    fn step_types_are_checked_at_load() {
        let e = load_err("  - name: a\n    handler: {callable: math.square}\n  - name: w\n    type: batch_worker\n    dependencies: [a]\n    handler: {callable: math.square}\n");
        assert_eq!(
            (e.step.as_deref(), e.field.as_str()),
            (Some("w"), "dependencies"),
            "{e}"
        );
        let e = load_err("  - name: a\n    type: batchable\n    batch_config: {failure_strategy: shrug}\n    handler: {callable: math.square}\n");
        assert_eq!(e.field, "batch_config.failure_strategy", "{e}");
        let e = load_err("  - name: a\n    type: batchable\n    handler: {callable: math.square}\n  - name: w\n    type: batch_worker\n    dependencies: [a]\n    handler: {callable: math.square}\n  - name: z\n    dependencies: [w]\n    handler: {callable: math.square}\n");
        assert_eq!(
            (e.step.as_deref(), e.field.as_str()),
            (Some("w"), "type"),
            "{e}"
        );
        let e = load_err(
            "  - name: j\n    type: deferred_convergence\n    handler: {callable: math.square}\n",
        );
        assert_eq!(
            (e.step.as_deref(), e.field.as_str()),
            (Some("j"), "dependencies"),
            "{e}"
        );
    }

    #[test]
    fn a_document_of_more_than_4096_brackets_is_refused_before_it_is_parsed() {
        // 60,000 `[` after `retry: ` took libyaml 6 s (release) to refuse as too deep.
        let deep = format!(
            "{BASE}  - {{name: a, handler: {{callable: x}}, retry: {}}}\n",
            "[".repeat(60_000)
        );
        let started = std::time::Instant::now();
        let e = load(&deep, None).unwrap_err();
        assert!(
            started.elapsed() < std::time::Duration::from_millis(500),
            "{e}"
        );
        assert_eq!(e.field, "(document)", "{e}");
        assert!(e.message.contains("at most 4096"), "{e}");
        let wide = (0..MAX_BRACKETS / 2 - 1)
            .map(|i| format!("  - {{name: s{i}, handler: {{callable: x}}}}\n"))
            .collect::<String>();
        let t = load(&format!("{BASE}{wide}"), None).unwrap();
        assert_eq!(t.steps.len(), MAX_BRACKETS / 2 - 1, "4094 brackets load");
    }

    #[test]
    fn a_bad_input_schema_is_refused_at_load() {
        let e = load(
            &format!(
                "{BASE}  - name: a\n    handler: {{callable: x}}\ninput_schema: {{type: 12}}\n"
            ),
            None,
        )
        .unwrap_err();
        assert_eq!(e.field, "input_schema", "{e}");
    }
}
