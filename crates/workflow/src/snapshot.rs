//! Snapshots of the fold: the orchestrator's [`State`] written to a file under its data
//! directory together with the log position it covers, so that a restart folds only the
//! tail of the log after it. Owns the file format, writing one (durably: temporary
//! file, fsync, rename, fsync of the directory), loading the newest valid one (damaged
//! or foreign ones are skipped with a log line) and the [`Snapshotter`] thread that
//! writes them off the fold's path. Touches only files named `snapshot-*.snap` (and
//! their `.tmp`) in the directory it is given, and the shared state only to clone it.
//!
//! A snapshot is a cache of the log, never a source of truth: deleting every snapshot
//! only makes the next start replay the whole log. File layout (integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `EMBWFSNP` |
//! | 8 | 4 | format version ([`FORMAT_VERSION`]) |
//! | 12 | 4 | reserved, 0 |
//! | 16 | 8 | position: the state covers the log up to, not including, it |
//! | 24 | 8 | body length |
//! | 32 | 32 | SHA-256 of the body |
//! | 64 | .. | body: the state as JSON ([`Image`]) |

use crate::log::Shared;
use crate::state::{State, Task};
use crate::template::{Template, TemplateKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"EMBWFSNP";
/// Bumped whenever the body's meaning changes; a reader skips other versions (and then
/// replays the whole log), it never guesses.
pub const FORMAT_VERSION: u32 = 1;
const HEADER: usize = 64;
/// Snapshots kept: the newest and one before it, in case the newest is damaged.
const KEEP: usize = 2;

/// The state as read back: the fields the API's serialized form of a task leaves out
/// (template, spec indices, dependencies, batch parents) are carried beside it. Written
/// as an [`ImageOut`], the same fields borrowed from the state.
#[derive(Deserialize)]
struct Image {
    /// Which log this is a snapshot of (the orchestrator's: the topic's name and its
    /// creation time, which a recreated topic does not share).
    log: String,
    templates: Vec<Template>,
    tasks: Vec<TaskImage>,
    idempotency: imbl::OrdMap<String, String>,
    next_position: u64,
    rejected: u64,
    leader: crate::leadership::Leader,
}

#[derive(Deserialize)]
struct TaskImage {
    template: TemplateKey,
    specs: Vec<usize>,
    parents: Vec<Option<usize>>,
    deps: Vec<Vec<usize>>,
    /// Steps whose result is JSON `null`: in the task's serialized form a `null` result
    /// reads back as no result, and a dependency's null result is still a result.
    null_results: Vec<usize>,
    task: Task,
}

/// [`Image`] as written: borrowed from the state (which a snapshot shares with the
/// fold, [`crate::state::TaskMap`]), so encoding copies no task.
#[derive(Serialize)]
struct ImageOut<'a> {
    log: &'a str,
    templates: Vec<&'a Template>,
    tasks: Vec<TaskImageOut<'a>>,
    idempotency: &'a imbl::OrdMap<String, String>,
    next_position: u64,
    rejected: u64,
    leader: &'a crate::leadership::Leader,
}

#[derive(Serialize)]
struct TaskImageOut<'a> {
    template: TemplateKey,
    specs: Vec<usize>,
    parents: Vec<Option<usize>>,
    deps: &'a [Vec<usize>],
    null_results: Vec<usize>,
    task: &'a Task,
}

impl<'a> ImageOut<'a> {
    fn of(log: &'a str, state: &'a State) -> Self {
        let tasks = state.tasks.values().map(|task| TaskImageOut {
            template: task.template.key(),
            specs: task.steps.iter().map(|s| s.spec).collect(),
            parents: task
                .steps
                .iter()
                .map(|s| s.batch.as_ref().map(|b| b.parent))
                .collect(),
            deps: &task.deps,
            null_results: (0..task.steps.len())
                .filter(|&i| task.steps[i].result == Some(serde_json::Value::Null))
                .collect(),
            task,
        });
        Self {
            log,
            templates: state.templates.values().map(|t| &**t).collect(),
            tasks: tasks.collect(),
            idempotency: &state.idempotency,
            next_position: state.next_position,
            rejected: state.rejected,
            leader: &state.leader,
        }
    }
}

/// What a task deserializes with before [`Image::into_state`] puts its template back.
pub(crate) fn unset_template() -> Arc<Template> {
    static UNSET: std::sync::OnceLock<Arc<Template>> = std::sync::OnceLock::new();
    UNSET
        .get_or_init(|| {
            Arc::new(Template {
                name: String::new(),
                namespace: String::new(),
                version: String::new(),
                description: None,
                input_schema: None,
                steps: Vec::new(),
                identity_strategy: Default::default(),
                lifecycle: None,
                metadata: None,
            })
        })
        .clone()
}

impl Image {
    /// The state back, every index checked against its template and task (a snapshot
    /// that passed its checksum may still come from a buggy writer).
    fn into_state(self) -> Result<State, String> {
        let templates: BTreeMap<TemplateKey, Arc<Template>> = self
            .templates
            .into_iter()
            .map(|t| (t.key(), Arc::new(t)))
            .collect();
        let mut tasks = crate::state::TaskMap::new();
        for image in self.tasks {
            let task = restore_task(image, &templates)?;
            tasks.insert(task.uuid.clone(), Arc::new(task));
        }
        let mut state = State {
            templates,
            tasks,
            idempotency: self.idempotency,
            next_position: self.next_position,
            rejected: self.rejected,
            open: Default::default(),
            leader: self.leader,
        };
        // The open-task index is derived, not stored: rebuilt from the tasks.
        state.reindex();
        Ok(state)
    }
}

fn restore_task(
    image: TaskImage,
    templates: &BTreeMap<TemplateKey, Arc<Template>>,
) -> Result<Task, String> {
    let TaskImage {
        template,
        specs,
        parents,
        deps,
        null_results,
        mut task,
    } = image;
    let uuid = task.uuid.clone();
    task.template = templates
        .get(&template)
        .cloned()
        .ok_or_else(|| format!("task {uuid}: no template {template}"))?;
    let n = task.steps.len();
    if specs.len() != n || parents.len() != n || deps.len() != n {
        return Err(format!("task {uuid}: {n} steps but other lengths"));
    }
    let templated = task.template.steps.len();
    if specs.iter().any(|&s| s >= templated) || deps.iter().flatten().any(|&d| d >= n) {
        return Err(format!("task {uuid}: a step index out of range"));
    }
    for ((step, spec), parent) in task.steps.iter_mut().zip(specs).zip(parents) {
        step.spec = spec;
        match (&mut step.batch, parent) {
            (Some(slot), Some(p)) if p < n => slot.parent = p,
            (None, None) => {}
            _ => return Err(format!("task {uuid}, step {}: bad batch parent", step.name)),
        }
    }
    for i in null_results {
        let step = task
            .steps
            .get_mut(i)
            .ok_or_else(|| format!("task {uuid}: no step {i}"))?;
        step.result = Some(serde_json::Value::Null);
    }
    task.deps = deps;
    Ok(task)
}

/// Encodes `state` as a snapshot file's bytes; `log` names the log it was folded from.
pub fn encode(log: &str, state: State) -> Vec<u8> {
    let position = state.next_position;
    // Serializing these types cannot fail: every map key is a string.
    let body = serde_json::to_vec(&ImageOut::of(log, &state)).expect("the state serializes");
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&position.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&body));
    debug_assert_eq!(out.len(), HEADER);
    out.extend_from_slice(&body);
    out
}

/// Decodes a snapshot of the log `log`, checking everything before trusting anything.
pub fn decode(bytes: &[u8], log: &str) -> Result<State, String> {
    if bytes.len() < HEADER {
        return Err(format!("{} bytes, shorter than the header", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("not a workflow snapshot (bad magic)".into());
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(format!(
            "format version {version}, this reader knows {FORMAT_VERSION}"
        ));
    }
    let (position, len) = (word(16), word(24));
    let body = &bytes[HEADER..];
    if len != body.len() as u64 {
        return Err(format!("body of {} bytes, header says {len}", body.len()));
    }
    if Sha256::digest(body)[..] != bytes[32..64] {
        return Err("checksum mismatch".into());
    }
    let image: Image = serde_json::from_slice(body).map_err(|e| format!("body: {e}"))?;
    if image.log != log {
        return Err(format!("a snapshot of log {}, not of {log}", image.log));
    }
    if image.next_position != position {
        return Err(format!(
            "header position {position}, body {}",
            image.next_position
        ));
    }
    image.into_state()
}

fn file_name(position: u64) -> String {
    format!("snapshot-{position:020}.snap")
}

/// The position a snapshot file's name gives, if it is one.
fn position_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("snapshot-")?.strip_suffix(".snap")?;
    (digits.len() == 20).then(|| digits.parse().ok()).flatten()
}

/// Snapshot files in `dir`, newest (highest position) first.
fn snapshots(dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if let Some(p) = name.to_str().and_then(position_of) {
            found.push((p, entry.path()));
        }
    }
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    Ok(found)
}

/// Writes `state` durably as the snapshot of its position and drops all but the newest
/// [`KEEP`]. Returns the file written.
pub fn write(dir: &Path, log: &str, state: State) -> std::io::Result<PathBuf> {
    let position = state.next_position;
    let bytes = encode(log, state);
    let path = dir.join(file_name(position));
    let tmp = dir.join(format!("{}.tmp", file_name(position)));
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, &path)?;
    // The rename is durable only once the directory is.
    std::fs::File::open(dir)?.sync_all()?;
    for (_, old) in snapshots(dir)?.into_iter().skip(KEEP) {
        if let Err(e) = std::fs::remove_file(&old) {
            tracing::warn!("cannot remove the old snapshot {}: {e}", old.display());
        }
    }
    Ok(path)
}

/// The newest valid snapshot of `log` in `dir` that does not reach past `log_end` (one
/// that does belongs to another log, e.g. a server started afresh); damaged and foreign
/// ones are skipped with a warning. `None`: replay the whole log.
pub fn load_newest(dir: &Path, log: &str, log_end: u64) -> Option<(State, PathBuf)> {
    let found = match snapshots(dir) {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(
                "cannot list snapshots in {}: {e}; replaying the whole log",
                dir.display()
            );
            return None;
        }
    };
    for (_, path) in found {
        let loaded = std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|bytes| decode(&bytes, log));
        match loaded {
            Ok(state) if state.next_position > log_end => tracing::warn!(
                "skipping snapshot {}: it covers up to position {}, past the log's end {log_end} (another log?)",
                path.display(),
                state.next_position
            ),
            Ok(state) => return Some((state, path)),
            Err(e) => tracing::warn!("skipping damaged snapshot {}: {e}", path.display()),
        }
    }
    None
}

/// Where and how often to snapshot.
#[derive(Debug, Clone)]
pub struct SnapshotConfig {
    pub dir: PathBuf,
    /// A snapshot is written once this many events were folded since the last one.
    pub every_events: u64,
}

/// How often the snapshot thread looks at the fold's position.
const CHECK: Duration = Duration::from_millis(100);

/// What the snapshot thread reports (for `/metrics`).
#[derive(Debug, Default)]
pub struct SnapshotStats {
    /// The position of the last snapshot written by this process (0: none yet).
    pub position: AtomicU64,
    pub written: AtomicU64,
    /// How long the last snapshot held the state's lock (to clone it), in microseconds.
    pub lock_us: AtomicU64,
}

/// A thread that snapshots the shared state every [`SnapshotConfig::every_events`]
/// events. The fold waits only while the state is cloned; encoding, checksumming and
/// writing happen on the clone, off the lock.
pub struct Snapshotter {
    pub stats: Arc<SnapshotStats>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Snapshotter {
    /// `log` names the log (see [`encode`]); `from`: the position of the state loaded.
    pub fn start(
        cfg: SnapshotConfig,
        log: String,
        shared: Arc<Shared>,
        from: u64,
    ) -> std::io::Result<Self> {
        assert!(cfg.every_events > 0, "snapshots every 0 events");
        std::fs::create_dir_all(&cfg.dir)?;
        let stats = Arc::new(SnapshotStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (stats.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("wf-snapshot".into())
            .spawn(move || run(&cfg, &log, &shared, from, &s, &st))?;
        Ok(Self {
            stats,
            stop,
            thread: Some(thread),
        })
    }
}

fn run(
    cfg: &SnapshotConfig,
    log: &str,
    shared: &Shared,
    from: u64,
    stats: &SnapshotStats,
    stop: &AtomicBool,
) {
    let mut last = from;
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(CHECK);
        if shared.lock().next_position < last.saturating_add(cfg.every_events) {
            continue;
        }
        let locked = Instant::now();
        let state = shared.lock().clone();
        let lock_us = locked.elapsed().as_micros() as u64;
        let position = state.next_position;
        match write(&cfg.dir, log, state) {
            Ok(path) => {
                tracing::debug!(
                    "snapshot {} written (state lock held {lock_us} µs)",
                    path.display()
                );
                stats.position.store(position, Ordering::Release);
                stats.written.fetch_add(1, Ordering::AcqRel);
                stats.lock_us.store(lock_us, Ordering::Release);
            }
            Err(e) => tracing::warn!("cannot write a snapshot into {}: {e}", cfg.dir.display()),
        }
        // After a failure too: retry only after as many events again, not in a loop.
        last = position;
    }
}

impl Drop for Snapshotter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state_at(position: u64) -> State {
        State {
            next_position: position,
            rejected: position / 2,
            ..State::default()
        }
    }

    #[test]
    fn the_newest_valid_snapshot_is_loaded_and_a_damaged_one_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "wf", state_at(10)).unwrap();
        let newest = write(dir.path(), "wf", state_at(20)).unwrap();
        let (state, path) = load_newest(dir.path(), "wf", 100).unwrap();
        assert_eq!((state, path), (state_at(20), newest.clone()));
        // One flipped bit in the body: the checksum catches it, the older one is used.
        let mut bytes = std::fs::read(&newest).unwrap();
        let last = bytes.len() - 2;
        bytes[last] ^= 1;
        std::fs::write(&newest, &bytes).unwrap();
        assert_eq!(load_newest(dir.path(), "wf", 100).unwrap().0, state_at(10));
        // A log shorter than the snapshot (another log): skipped as well.
        assert!(load_newest(dir.path(), "wf", 9).is_none());
        // Another log's snapshots are not this one's.
        assert!(load_newest(dir.path(), "other", 100).is_none());
    }

    #[test]
    fn truncated_foreign_or_newer_format_snapshots_are_refused_with_the_reason() {
        let good = encode("wf", state_at(5));
        assert_eq!(decode(&good, "wf"), Ok(state_at(5)));
        let short = decode(&good[..good.len() - 1], "wf").unwrap_err();
        assert!(short.contains("header says"), "{short}");
        assert!(decode(&good[..10], "wf").unwrap_err().contains("shorter"));
        let mut newer = good.clone();
        newer[8] = 2;
        assert!(decode(&newer, "wf")
            .unwrap_err()
            .contains("format version 2"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(decode(&magic, "wf").unwrap_err().contains("magic"));
        let mut moved = good.clone();
        moved[16] = 6;
        assert!(decode(&moved, "wf")
            .unwrap_err()
            .contains("header position 6"));
    }

    #[test]
    fn a_task_whose_step_returned_null_survives_a_snapshot_unchanged() {
        use crate::event::{Envelope, Event, Outcome, StepRef};
        let yaml = "name: one\nnamespace: p\nversion: '1'\nsteps:\n  - {name: a, handler: {callable: x}}\n  - {name: b, dependencies: [a], handler: {callable: x}}\n";
        let template = crate::validate::load(yaml, None).unwrap();
        let at = StepRef {
            task: "t".into(),
            step: "a".into(),
            attempt: 1,
        };
        let events = [
            Event::TemplateRegistered { template },
            Event::TaskCreated {
                task: "t".into(),
                namespace: "p".into(),
                name: "one".into(),
                version: "1".into(),
                context: serde_json::json!({}),
                idempotency_key: None,
                identity: None,
                protocol: Some(2),
            },
            Event::StepClaimed {
                at: at.clone(),
                worker: "w".into(),
            },
            Event::StepResult {
                at,
                worker: "w".into(),
                outcome: Outcome::Success {
                    result: serde_json::Value::Null,
                },
            },
        ];
        let mut state = State::default();
        for (i, event) in events.into_iter().enumerate() {
            let env = Envelope {
                ts_ms: 1,
                term: None,
                event,
            };
            state.apply(i as u64, &env).unwrap();
        }
        assert_eq!(
            state.tasks["t"].steps[0].result,
            Some(serde_json::Value::Null)
        );
        let back = decode(&encode("wf", state.clone()), "wf").unwrap();
        assert_eq!(back, state);
    }

    #[test]
    fn only_the_newest_two_are_kept_and_names_parse_only_when_exact() {
        let dir = tempfile::tempdir().unwrap();
        for p in [1, 2, 3, 4] {
            write(dir.path(), "wf", state_at(p)).unwrap();
        }
        let kept: Vec<u64> = snapshots(dir.path())
            .unwrap()
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(kept, vec![4, 3]);
        assert_eq!(position_of(&file_name(42)), Some(42));
        assert_eq!(position_of("snapshot-42.snap"), None);
        assert_eq!(position_of(&format!("{}.tmp", file_name(42))), None);
    }
}
