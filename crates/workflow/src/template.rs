//! Task templates: the YAML document a user registers (Tasker's fields), parsed into
//! typed structs. Checking a parsed template (dependencies, cycles, handlers, schema)
//! is [`crate::validate`]'s job; this module owns only the shape and its defaults.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt;

/// A registered template, the same in YAML, in the API's JSON and in the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub name: String,
    #[serde(alias = "namespace_name")]
    pub namespace: String,
    pub version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema every task's context must satisfy on submit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
    pub steps: Vec<StepTemplate>,
    /// How a new task's identity is derived, for deduplication (see [`crate::identity`]).
    #[serde(default, skip_serializing_if = "IdentityStrategy::is_default")]
    pub identity_strategy: IdentityStrategy,
    /// Staleness thresholds (Tasker's `lifecycle`), acted on by [`crate::staleness`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<Lifecycle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// Tasker's identity strategies: which submissions of a template are the same task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdentityStrategy {
    /// Same template and same context (or same `idempotency_key`): the same task.
    #[default]
    Strict,
    /// The caller names the task with an `idempotency_key`, which is then required.
    CallerProvided,
    /// Every submission is a new task.
    AlwaysUnique,
}

impl IdentityStrategy {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Where a template is found: namespace, name and version.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TemplateKey {
    pub namespace: String,
    pub name: String,
    pub version: String,
}

impl fmt::Display for TemplateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.namespace, self.name, self.version)
    }
}

/// Orders two template versions as a user reads them: dot-separated parts compared
/// numerically where both are numbers (`1.10.0` after `1.9.0`), as text otherwise; a
/// version with a pre-release suffix (`1.0.0-rc1`) before the same version without one,
/// as in SemVer. Used to find a template's newest version.
pub fn version_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn parts(v: &str) -> (Vec<&str>, Option<&str>) {
        let (core, pre) = match v.split_once('-') {
            Some((core, pre)) => (core, Some(pre)),
            None => (v, None),
        };
        (core.split('.').collect(), pre)
    }
    fn part(a: &str, b: &str) -> std::cmp::Ordering {
        match (a.parse::<u64>(), b.parse::<u64>()) {
            (Ok(x), Ok(y)) => x.cmp(&y),
            _ => a.cmp(b),
        }
    }
    let ((a_core, a_pre), (b_core, b_pre)) = (parts(a), parts(b));
    let by_core = a_core
        .iter()
        .zip(&b_core)
        .map(|(x, y)| part(x, y))
        .find(|o| o.is_ne())
        .unwrap_or_else(|| a_core.len().cmp(&b_core.len()));
    by_core.then_with(|| match (a_pre, b_pre) {
        (None, None) => std::cmp::Ordering::Equal,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (Some(_), None) => std::cmp::Ordering::Less,
        (Some(x), Some(y)) => x.cmp(y),
    })
}

impl Template {
    pub fn key(&self) -> TemplateKey {
        TemplateKey {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            version: self.version.clone(),
        }
    }

    /// The index of the step called `name`.
    pub fn step_index(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepTemplate {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, rename = "type")]
    pub step_type: StepType,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dependencies: Vec<String>,
    pub handler: HandlerSpec,
    #[serde(default)]
    pub retry: RetryPolicy,
    /// The longest one attempt may run; enforced by the worker and the orchestrator.
    #[serde(default = "default_timeout_seconds")]
    pub timeout_seconds: u64,
    /// Batch steps (phase 2): kept as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_config: Option<Value>,
}

fn default_timeout_seconds() -> u64 {
    30
}

/// The longest `timeout_seconds` a template may give a step: a week. Registration
/// refuses more; [`StepTemplate::timeout`] clamps a template registered before the limit,
/// so a deadline computed from it can never overflow a clock.
pub const MAX_TIMEOUT_SECONDS: u64 = 7 * 24 * 3600;

/// The longest pause before a retry, whoever asks for it (`backoff_base_ms`,
/// `max_backoff_ms`, a handler's `retry_after_ms`): a day.
pub const MAX_RETRY_DELAY_MS: u64 = 24 * 3600 * 1000;

impl StepTemplate {
    /// How long one attempt may run, at most [`MAX_TIMEOUT_SECONDS`].
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.timeout_seconds.min(MAX_TIMEOUT_SECONDS))
    }
}

/// Tasker's step types. Phase 1 executes `standard` only; registration refuses others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepType {
    #[default]
    Standard,
    Decision,
    DeferredConvergence,
    Batchable,
    BatchWorker,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandlerSpec {
    /// The handler's registered name.
    pub callable: String,
    /// Configuration handed to the handler with every call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    pub retryable: bool,
    /// Attempts in all, counting the first (so 1 means no retry).
    pub max_attempts: u32,
    pub backoff: Backoff,
    pub backoff_base_ms: u64,
    pub max_backoff_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            retryable: true,
            max_attempts: 3,
            backoff: Backoff::Exponential,
            backoff_base_ms: 100,
            max_backoff_ms: 10_000,
        }
    }
}

impl RetryPolicy {
    /// The pause before the retry that follows the `failures`-th failure (1-based).
    pub fn delay_ms(&self, failures: u32) -> u64 {
        let n = failures.max(1) as u64;
        let raw = match self.backoff {
            Backoff::None => 0,
            Backoff::Linear => self.backoff_base_ms.saturating_mul(n),
            Backoff::Exponential => {
                let shift = (n - 1).min(32) as u32;
                self.backoff_base_ms.saturating_mul(1u64 << shift)
            }
        };
        raw.min(self.max_backoff_ms).min(MAX_RETRY_DELAY_MS)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backoff {
    None,
    Linear,
    Exponential,
}

/// Tasker's staleness thresholds, in minutes (fractions allowed); see
/// [`crate::staleness`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lifecycle {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps_in_process_minutes: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting_for_retry_minutes: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting_for_dependencies_minutes: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_duration_minutes: Option<f64>,
}

impl Lifecycle {
    /// Each threshold by its field name.
    pub fn thresholds(&self) -> [(&'static str, Option<f64>); 4] {
        [
            (
                "max_steps_in_process_minutes",
                self.max_steps_in_process_minutes,
            ),
            (
                "max_waiting_for_retry_minutes",
                self.max_waiting_for_retry_minutes,
            ),
            (
                "max_waiting_for_dependencies_minutes",
                self.max_waiting_for_dependencies_minutes,
            ),
            ("max_duration_minutes", self.max_duration_minutes),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_by_numeric_parts_with_a_pre_release_first() {
        use std::cmp::Ordering::*;
        let cases = [
            ("1.10.0", "1.9.0", Greater),
            ("2", "1.9.9", Greater),
            ("1.0", "1.0.0", Less),
            ("1.0.0-rc1", "1.0.0", Less),
            ("1.0.0-rc2", "1.0.0-rc1", Greater),
            ("1.0.0", "1.0.0", Equal),
            ("1.a", "1.b", Less),
        ];
        for (a, b, want) in cases {
            assert_eq!(version_order(a, b), want, "{a} against {b}");
            assert_eq!(version_order(b, a), want.reverse(), "{b} against {a}");
        }
    }

    #[test]
    fn backoff_grows_as_the_policy_says_and_stops_at_the_cap() {
        let mut p = RetryPolicy {
            backoff_base_ms: 100,
            max_backoff_ms: 350,
            ..RetryPolicy::default()
        };
        assert_eq!([1, 2, 3].map(|n| p.delay_ms(n)), [100, 200, 350]);
        p.backoff = Backoff::Linear;
        assert_eq!([1, 2, 3, 4].map(|n| p.delay_ms(n)), [100, 200, 300, 350]);
        p.backoff = Backoff::None;
        assert_eq!(p.delay_ms(5), 0);
    }
}
