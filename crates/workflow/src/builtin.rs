//! The built-in handlers: Tasker's benchmark arithmetic (square the number), a decision
//! that routes by the task's input, and the test handlers the engine's own tests use to
//! fail, sleep and record attempts.

use crate::handler::{Registry, StepContext, StepError};
use serde_json::{json, Value};
use std::time::Duration;

pub fn register_all(r: &mut Registry) {
    r.register("math.square", square);
    r.register("test.fail_times", fail_times);
    r.register("test.sleep", sleep);
    r.register("decision.choose", choose);
}

/// Squares the product of the direct dependencies' results (a decision's outcome is
/// not a number and is skipped; a dependency never created has no result), or, when
/// there is no such result, the context's number (field `initialization.input`,
/// default `even_number`).
fn square(ctx: &StepContext) -> Result<Value, StepError> {
    let mut product: Option<i64> = None;
    for name in &ctx.dependencies {
        let Some(v) = ctx.ancestors.get(name) else {
            continue;
        };
        if v.get("step_names").is_some() {
            continue;
        }
        let n = number(v, name)?;
        product = Some(
            product
                .unwrap_or(1)
                .checked_mul(n)
                .ok_or_else(|| StepError::permanent("the product overflows 64 bits"))?,
        );
    }
    let input = match product {
        Some(p) => p,
        None => {
            let field = ctx.initialization["input"]
                .as_str()
                .unwrap_or("even_number");
            number(&ctx.context[field], field)?
        }
    };
    let squared = input
        .checked_mul(input)
        .ok_or_else(|| StepError::permanent(format!("{input} squared overflows 64 bits")))?;
    Ok(json!(squared))
}

fn number(v: &Value, what: &str) -> Result<i64, StepError> {
    v.as_i64()
        .ok_or_else(|| StepError::permanent(format!("`{what}` is {v}, not an integer")))
}

/// Fails the first `initialization.failures` attempts (retryable unless
/// `initialization.retryable` is false), then returns the attempt number.
fn fail_times(ctx: &StepContext) -> Result<Value, StepError> {
    let failures = ctx.initialization["failures"].as_u64().unwrap_or(u64::MAX);
    if u64::from(ctx.attempt) <= failures {
        let message = format!("planned failure of attempt {}", ctx.attempt);
        return Err(match ctx.initialization["retryable"].as_bool() {
            Some(false) => StepError::permanent(message),
            _ => StepError::retryable(message),
        });
    }
    Ok(json!({"attempt": ctx.attempt}))
}

/// A decision: creates the branches the context's field `initialization.field`
/// (default `branches`) lists, an array of step names.
fn choose(ctx: &StepContext) -> Result<Value, StepError> {
    let field = ctx.initialization["field"].as_str().unwrap_or("branches");
    match ctx.context[field].as_array() {
        Some(names) => Ok(json!({"type": "create_steps", "step_names": names})),
        None => Err(StepError::permanent(format!(
            "the context's `{field}` is {}, not a list of step names",
            ctx.context[field]
        ))),
    }
}

/// Sleeps `initialization.ms`, then returns the attempt number and its dependencies'
/// results (so a chain of sleeps still carries data).
fn sleep(ctx: &StepContext) -> Result<Value, StepError> {
    let ms = ctx.initialization["ms"].as_u64().unwrap_or(0);
    std::thread::sleep(Duration::from_millis(ms));
    Ok(json!({"attempt": ctx.attempt, "slept_ms": ms}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(deps: &[(&str, Value)], context: Value) -> StepContext {
        StepContext {
            task_uuid: "t".into(),
            step_name: "s".into(),
            attempt: 1,
            context,
            initialization: Value::Null,
            ancestors: deps
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            dependencies: deps.iter().map(|(k, _)| k.to_string()).collect(),
        }
    }

    #[test]
    fn square_takes_the_context_or_the_product_of_dependencies() {
        assert_eq!(square(&ctx(&[], json!({"even_number": 6}))), Ok(json!(36)));
        assert_eq!(
            square(&ctx(&[("a", json!(2)), ("b", json!(3))], json!({}))),
            Ok(json!(36))
        );
        assert!(!square(&ctx(&[], json!({}))).unwrap_err().retryable);
        let after_decision = ctx(
            &[("decide", json!({"step_names": ["x"]}))],
            json!({"even_number": 3}),
        );
        assert_eq!(square(&after_decision), Ok(json!(9)));
    }

    #[test]
    fn choose_names_the_branches_the_context_lists() {
        let c = ctx(&[], json!({"branches": ["a", "c"]}));
        assert_eq!(choose(&c).unwrap()["step_names"], json!(["a", "c"]));
        assert!(!choose(&ctx(&[], json!({}))).unwrap_err().retryable);
    }
}
