//! `embarcadero bench --mode workflow` as a user runs it: real server, orchestrator and
//! worker processes started by the bench, every shape measured, none left running.

mod common;

use common::run_bin;
use serde_json::Value;

#[test]
fn workflow_mode_runs_every_shape_and_leaves_no_process_behind() {
    let out = run_bin(&[
        "bench",
        "--mode",
        "workflow",
        "--workflow-tasks",
        "3",
        "--clients",
        "2",
        "--workflow-sustained-tasks",
        "6",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("bench --json prints JSON");
    let shapes = v["shapes"].as_array().expect("shapes");
    let names: Vec<&str> = shapes
        .iter()
        .map(|s| s["shape"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "linear",
            "diamond",
            "conditional",
            "complex_dag",
            "tree",
            "batch",
            "concurrent_2x"
        ]
    );
    for s in shapes {
        // Each of a shape's clients runs 3 tasks (concurrent_2x: two at once).
        let clients = s["clients"].as_u64().unwrap();
        assert_eq!(s["tasks"], 3 * clients, "{s}");
        assert!(s["p50_ms"].as_f64().unwrap() <= s["p99_ms"].as_f64().unwrap());
    }
    assert_eq!(v["sustained"]["tasks"], 6);
    assert_eq!(v["sustained"]["clients"], 2);
    for (name, pid) in v["processes"].as_object().expect("processes") {
        let pid = pid.as_u64().unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "{name} (pid {pid}) is still running"
        );
    }
}
