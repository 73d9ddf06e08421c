//! Workflow latency measurement shared by `task bench` and `bench --mode workflow`:
//! closed-loop clients creating tasks and awaiting each by long poll. Owns only the
//! timing and its percentiles; it touches nothing but the workflow API.

use super::commands::{api_error, finished_ok, text};
use embarcadero_workflow::client::ApiClient;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// When each closed-loop client stops.
#[derive(Clone, Copy)]
pub enum Until {
    /// This many tasks between all the clients.
    Tasks(usize),
    /// Start no task after this long.
    Elapsed(Duration),
}

/// The figures of one measurement, in milliseconds.
pub struct Measured {
    pub tasks: usize,
    pub clients: usize,
    pub tasks_per_s: f64,
    /// POST to complete: p50, p95, p99.
    pub total: [f64; 3],
    /// The POST alone: p50, p95, p99.
    pub create: [f64; 3],
}

impl Measured {
    pub fn to_json(&self) -> Value {
        let [p50, p95, p99] = self.total;
        json!({"tasks": self.tasks, "clients": self.clients, "tasks_per_s": self.tasks_per_s,
            "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
            "create_p50_ms": self.create[0], "create_p99_ms": self.create[2]})
    }
}

/// Tasks from `POST` to the long poll's answer that they completed: `clients` closed
/// loops, each its next task once its last one completed.
pub fn measure(
    api: &str,
    template: [&str; 3],
    context: &Value,
    until: Until,
    clients: usize,
) -> Result<Measured, String> {
    assert!(clients > 0, "at least one client");
    let start = Instant::now();
    let runs: Vec<Result<Vec<(u64, u64)>, String>> = std::thread::scope(|scope| {
        let loops: Vec<_> = (0..clients)
            .map(|i| {
                let share = match until {
                    // The first `count % clients` loops run one task more.
                    Until::Tasks(n) => Until::Tasks(n / clients + usize::from(i < n % clients)),
                    elapsed => elapsed,
                };
                scope.spawn(move || bench_loop(&ApiClient::new(api), template, context, share))
            })
            .collect();
        let joined = loops.into_iter().map(|l| l.join());
        joined
            .map(|r| r.unwrap_or_else(|_| Err("a bench client panicked".into())))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let (mut micros, mut creates) = (Vec::new(), Vec::new());
    for run in runs {
        let run = run?;
        micros.extend(run.iter().map(|(total, _)| *total));
        creates.extend(run.iter().map(|(_, create)| *create));
    }
    if micros.is_empty() {
        return Err("no task completed in the time given".into());
    }
    Ok(Measured {
        tasks: micros.len(),
        clients,
        tasks_per_s: micros.len() as f64 / seconds,
        total: percentiles(&mut micros),
        create: percentiles(&mut creates),
    })
}

/// p50, p95 and p99 of `micros` (not empty), in milliseconds.
fn percentiles(micros: &mut [u64]) -> [f64; 3] {
    micros.sort_unstable();
    let pct = |p: f64| micros[((micros.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0;
    [pct(0.50), pct(0.95), pct(0.99)]
}

/// One client's tasks, one after another: each one's microseconds, from the `POST` to
/// complete and to the `POST`'s answer.
fn bench_loop(
    client: &ApiClient,
    [ns, name, version]: [&str; 3],
    context: &Value,
    until: Until,
) -> Result<Vec<(u64, u64)>, String> {
    let began = Instant::now();
    let mut micros = Vec::new();
    while match until {
        Until::Tasks(n) => micros.len() < n,
        Until::Elapsed(d) => began.elapsed() < d,
    } {
        // A fresh key per task: under the `strict` identity strategy the same context
        // would otherwise name the first task again.
        let key = format!("bench-{}", embarcadero_workflow::ids::new_uuid());
        let start = Instant::now();
        let t = client
            .create_task(ns, name, version, context.clone(), Some(&key))
            .map_err(api_error)?;
        let created = start.elapsed().as_micros() as u64;
        let uuid = text(&t["task_uuid"]);
        let t = if t["status"] == "complete" {
            t
        } else {
            client.get_task(&uuid, 60).map_err(api_error)?
        };
        finished_ok(&t, true)?;
        micros.push((start.elapsed().as_micros() as u64, created));
    }
    Ok(micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank_in_milliseconds() {
        let mut micros: Vec<u64> = (1..=100).rev().map(|i| i * 1000).collect();
        assert_eq!(percentiles(&mut micros), [51.0, 95.0, 99.0]);
        assert_eq!(percentiles(&mut [7000]), [7.0, 7.0, 7.0]);
    }
}
