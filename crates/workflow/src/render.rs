//! A template's DAG as text (stages in dependency order) and as Graphviz DOT, for
//! `embarcadero template show`. Reads a [`Template`]; touches nothing else.
//!
//! A validated template has no cycle and names only its own steps as dependencies
//! (`validate`), and only validated templates reach the CLI; a template that breaks
//! either is still rendered, without looping (a step whose stage cannot be found is
//! put after every other), so that no input can hang the renderer.

use crate::template::{StepTemplate, StepType};
use crate::Template;
use std::collections::HashMap;
use std::fmt::Write;

/// Each step's stage: 1 for a step without dependencies, else one more than its
/// deepest dependency's. Steps on a cycle or after an unknown name get the stage after
/// all the others.
pub fn stages(t: &Template) -> Vec<usize> {
    let index: HashMap<&str, usize> = t
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    let mut stage: Vec<Option<usize>> = vec![None; t.steps.len()];
    // At most one pass per step settles every acyclic one (longest chain).
    for _ in 0..t.steps.len() {
        for (i, s) in t.steps.iter().enumerate() {
            let deps: Option<Vec<usize>> = s
                .dependencies
                .iter()
                .map(|d| index.get(d.as_str()).and_then(|&j| stage[j]))
                .collect();
            stage[i] = deps.map(|d| d.into_iter().max().unwrap_or(0) + 1);
        }
    }
    let last = stage.iter().flatten().max().copied().unwrap_or(0) + 1;
    let stages: Vec<usize> = stage.into_iter().map(|s| s.unwrap_or(last)).collect();
    debug_assert!(stages.iter().all(|&s| s >= 1), "stages count from 1");
    stages
}

fn type_name(s: &StepTemplate) -> &'static str {
    match s.step_type {
        StepType::Standard => "standard",
        StepType::Decision => "decision",
        StepType::DeferredConvergence => "deferred_convergence",
        StepType::Batchable => "batchable",
        StepType::BatchWorker => "batch_worker",
    }
}

/// One line per step, by stage, then in the template's order: stage, name, type,
/// handler and what it waits for.
pub fn text(t: &Template) -> String {
    let stages = stages(t);
    let mut order: Vec<usize> = (0..t.steps.len()).collect();
    order.sort_by_key(|&i| (stages[i], i));
    let width = t.steps.iter().map(|s| s.name.len()).max().unwrap_or(0);
    let mut out = format!(
        "{}/{}@{}: {} steps in {} stages\n",
        t.namespace,
        t.name,
        t.version,
        t.steps.len(),
        stages.iter().max().copied().unwrap_or(0)
    );
    for i in order {
        let s = &t.steps[i];
        let after = match s.dependencies.is_empty() {
            true => "(start)".to_string(),
            false => s.dependencies.join(", "),
        };
        let _ = writeln!(
            out,
            "  {:>2}  {:<width$}  {:<20}  {:<16}  after {after}",
            stages[i],
            s.name,
            type_name(s),
            s.handler.callable,
        );
    }
    out
}

/// A DOT string literal.
fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The DAG as a Graphviz digraph: a node per step (labelled with its type where it is
/// not standard), an edge from each dependency to its dependent.
pub fn dot(t: &Template) -> String {
    let title = format!("{}/{}@{}", t.namespace, t.name, t.version);
    let mut out = format!("digraph {} {{\n  rankdir=LR;\n", quoted(&title));
    for s in &t.steps {
        let label = match s.step_type {
            StepType::Standard => s.name.clone(),
            _ => format!("{}\\n({})", s.name, type_name(s)),
        };
        let _ = writeln!(out, "  {} [label={}];", quoted(&s.name), quoted(&label));
    }
    for s in &t.steps {
        for d in &s.dependencies {
            let _ = writeln!(out, "  {} -> {};", quoted(d), quoted(&s.name));
        }
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIAMOND: &str = "name: d\nnamespace: n\nversion: '1'\nsteps:\n  - {name: a, handler: {callable: x}}\n  - {name: b, dependencies: [a], handler: {callable: x}}\n  - {name: c, type: decision, dependencies: [a], handler: {callable: y}}\n  - {name: d, dependencies: [b, c], handler: {callable: x}}\n";

    #[test]
    fn a_step_is_one_stage_after_its_deepest_dependency() {
        let t = crate::validate::load(DIAMOND, None).unwrap();
        assert_eq!(stages(&t), vec![1, 2, 2, 3]);
        let text = text(&t);
        assert!(text.starts_with("n/d@1: 4 steps in 3 stages\n"), "{text}");
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert!(lines[0].trim_start().starts_with("1  a "), "{text}");
        assert!(lines[2].contains("decision") && lines[2].contains("after a"));
        assert!(lines[3].contains("after b, c"), "{text}");
    }

    #[test]
    fn dot_has_a_node_per_step_and_an_edge_per_dependency_with_strings_escaped() {
        let t = crate::validate::load(DIAMOND, None).unwrap();
        let dot = dot(&t);
        assert!(dot.starts_with("digraph \"n/d@1\" {"), "{dot}");
        assert_eq!(dot.matches("->").count(), 4, "{dot}");
        assert!(dot.contains("\"a\" -> \"b\";"));
        assert!(dot.contains("\"c\" -> \"d\";"), "{dot}");
        // Validated names cannot hold them, but a quote or a backslash stays inside its string.
        assert_eq!(quoted("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert!(dot.contains("label=\"c\\\\n(decision)\""), "{dot}");
        assert!(dot.trim_end().ends_with('}'));
    }

    #[test]
    fn a_cycle_is_rendered_after_the_rest_not_looped_on() {
        let mut t = crate::validate::load(DIAMOND, None).unwrap();
        // a after d: every step is on the cycle, so none has a stage of its own.
        t.steps[0].dependencies = vec!["d".into()];
        assert_eq!(stages(&t), vec![1, 1, 1, 1]);
        t.steps[0].dependencies = vec!["nowhere".into()];
        assert_eq!(
            stages(&t),
            vec![1, 1, 1, 1],
            "an unknown name: after the rest"
        );
        assert!(text(&t).contains("after nowhere"));
    }
}
