//! The control plane: the one writer of topic metadata. Topics are kept in
//! `<data-dir>/topics.json` (written atomically) and in the region's topic table.

pub use embarcadero_api::{BrokerLogInfo, TopicInfo, TopicSpec};
use embarcadero_region::{Region, TopicMeta};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A topic as `topics.json` keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct PersistedTopic {
    #[serde(flatten)]
    pub spec: TopicSpec,
    pub slot: u32,
    pub created_unix_ms: u64,
    /// Memory-only topics: no position at or above this has been or will be handed out
    /// before it is raised here (`crate::positions`); 0 in files from before ceilings.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub position_ceiling: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// What topic creation takes from the server's configuration.
#[derive(Debug, Clone, Copy)]
pub struct TopicDefaults {
    /// Disk replicas available: a topic may have up to this many plus one copies.
    pub disk_replicas: u8,
    pub retention_bytes: u64,
    pub retention_ms: u64,
    /// A subscriber whose broker has not beaten for it this long no longer holds memory
    /// (`broker.reader_stall_timeout_ms`); topics' health counts only the others.
    pub reader_stall: std::time::Duration,
}

/// Reads `<data_dir>/topics.json` (no topics if it does not exist).
pub(crate) fn load_topics(data_dir: &Path) -> Result<Vec<PersistedTopic>, TopicError> {
    let topics_file = data_dir.join("topics.json");
    match std::fs::read(&topics_file) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TopicError::Io {
            path: topics_file.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(TopicError::Io {
            path: topics_file,
            source,
        }),
    }
}

/// What to do about a topic that does not exist: the one meant, if a topic's name is
/// within two edits of it (`ordres`), else how to create it.
fn not_found_hint(name: &str, meant: Option<&str>) -> String {
    match meant {
        Some(meant) => format!(
            "did you mean {meant:?}? (`embarcadero topic list` shows the topics; `embarcadero topic create {name}` makes this one)"
        ),
        None => format!("create it with `embarcadero topic create {name} --order 2`"),
    }
}

fn not_found(topics: &[PersistedTopic], name: &str) -> TopicError {
    let names = topics.iter().map(|t| t.spec.name.as_str());
    let meant = crate::config::closest(name, names, 2).map(str::to_string);
    TopicError::NotFound(name.to_string(), meant)
}

#[derive(Debug, thiserror::Error)]
pub enum TopicError {
    #[error("{0}")]
    Invalid(String),
    #[error("topic {0:?} already exists")]
    Exists(String),
    #[error("topic {0:?} does not exist; {hint}", hint = not_found_hint(.0, .1.as_deref()))]
    NotFound(String, Option<String>),
    #[error("all {0} topic slots are in use; raise region.max_topics (EMBARCADERO_REGION_MAX_TOPICS) and restart the server (the data dir and its topics are kept)")]
    Full(u32),
    #[error("all {max} topic slots are in use, {deleted} of them by deleted topics, whose slots come free at the next start of the server; restart it, or raise region.max_topics (EMBARCADERO_REGION_MAX_TOPICS) and restart (the data dir and its topics are kept)")]
    FullOfDeleted { max: u32, deleted: u32 },
    #[error("topic {name:?} uses topic slot {slot} but region.max_topics is {max}: raise region.max_topics (EMBARCADERO_REGION_MAX_TOPICS) to at least {needed} and start again (the data dir and its topics are kept)")]
    TooFewSlots {
        name: String,
        slot: u32,
        max: u32,
        needed: u32,
    },
    #[error("{0}")]
    NoRoom(#[from] crate::reserve::ReserveError),
    #[error("cannot save topic metadata in {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub struct ControlPlane {
    region: Arc<Region>,
    /// Allocates a topic's slot before the topic is published in the region.
    reservation: crate::reserve::Reservation,
    defaults: TopicDefaults,
    topics_file: PathBuf,
    /// Serialises topic creation (admin requests only, never the data path).
    lock: parking_lot::Mutex<Vec<PersistedTopic>>,
    /// Topics deleted since this region was created (taken after `lock`): their slots are
    /// not reused before the next start, whose region is new (`docs/DESIGN.md`, "Topic
    /// delete"), and a topic created with the name of one of them gets a later creation
    /// time, which names its replica directories.
    deleted: parking_lot::Mutex<Vec<PersistedTopic>>,
}

impl ControlPlane {
    /// Loads persisted topics and publishes them into the (fresh) region.
    pub(crate) fn open(
        region: Arc<Region>,
        reservation: crate::reserve::Reservation,
        data_dir: &Path,
        defaults: TopicDefaults,
    ) -> Result<Self, TopicError> {
        let topics_file = data_dir.join("topics.json");
        let topics = load_topics(data_dir)?;
        let max = region.capacities().max_topics;
        let needed = topics.iter().map(|t| t.slot + 1).max().unwrap_or(0);
        if let Some(t) = topics.iter().find(|t| t.slot >= max) {
            return Err(TopicError::TooFewSlots {
                name: t.spec.name.clone(),
                slot: t.slot,
                max,
                needed,
            });
        }
        for t in &topics {
            reservation.topic(t.slot)?;
            region.write_topic_meta(t.slot, &meta_of(t));
        }
        Ok(Self {
            region,
            reservation,
            defaults,
            topics_file,
            lock: parking_lot::Mutex::new(topics),
            deleted: parking_lot::Mutex::new(Vec::new()),
        })
    }

    pub fn create(&self, mut spec: TopicSpec) -> Result<TopicSpec, TopicError> {
        validate_spec(&spec, self.defaults.disk_replicas)?;
        spec.retention_bytes
            .get_or_insert(self.defaults.retention_bytes);
        spec.retention_ms.get_or_insert(self.defaults.retention_ms);
        let mut topics = self.lock.lock();
        if topics.iter().any(|t| t.spec.name == spec.name) {
            return Err(TopicError::Exists(spec.name));
        }
        let deleted = self.deleted.lock();
        let max = self.region.capacities().max_topics;
        let slot = (0..max)
            .find(|s| topics.iter().chain(deleted.iter()).all(|t| t.slot != *s))
            .ok_or(match deleted.len() as u32 {
                0 => TopicError::Full(max),
                n => TopicError::FullOfDeleted { max, deleted: n },
            })?;
        // Later than any deleted topic of the same name: the creation time tells their
        // replica directories (and their previous regions' slots) apart.
        let created_unix_ms = deleted
            .iter()
            .filter(|t| t.spec.name == spec.name)
            .map(|t| t.created_unix_ms + 1)
            .fold(embarcadero_region::unix_ms(), u64::max);
        drop(deleted);
        let topic = PersistedTopic {
            // Persisted before the region shows the topic: positions 0 and up.
            position_ceiling: if spec.replication_factor == 1 {
                crate::positions::CEILING_STEP
            } else {
                0
            },
            spec: spec.clone(),
            slot,
            created_unix_ms,
        };
        // Before it is saved: a topic that cannot have its memory does not exist.
        self.reservation.topic(slot)?;
        let mut next = topics.clone();
        next.push(topic.clone());
        save(&self.topics_file, &next)?;
        self.region.write_topic_meta(slot, &meta_of(&topic));
        *topics = next;
        tracing::info!(topic = %spec.name, order = spec.order, slot, "topic created");
        Ok(spec)
    }

    /// Raises the position ceiling of every memory-only topic that has come within half
    /// a step of it (`crate::positions`): the new values are on disk before any of them
    /// is published in the region, so no process ever hands out a position that a start
    /// without the region could give again. Returns how many were raised.
    pub fn raise_ceilings(&self) -> Result<usize, TopicError> {
        let mut topics = self.lock.lock();
        let mut next = topics.clone();
        let mut raised = 0;
        for t in next.iter_mut().filter(|t| t.spec.replication_factor == 1) {
            let used = crate::positions::used_positions(&self.region, t.slot, t.spec.order);
            let step = crate::positions::CEILING_STEP;
            if let Some(c) = crate::positions::raised_ceiling(used, t.position_ceiling, step) {
                tracing::debug!(topic = %t.spec.name, used, ceiling = c, "raising the position ceiling");
                t.position_ceiling = c;
                raised += 1;
            }
        }
        if raised == 0 {
            return Ok(0);
        }
        save(&self.topics_file, &next)?;
        for t in next.iter().filter(|t| t.spec.replication_factor == 1) {
            self.region
                .control_plane()
                .position_ceiling(t.slot)
                .raise(t.position_ceiling, Ordering::AcqRel);
        }
        *topics = next;
        Ok(raised)
    }

    /// Deletes a topic: gone from `topics.json` first (so a crash after this point
    /// never brings it back), then marked deleted in the region, where brokers (local
    /// and followers), the sequencer and the replica workers see it and let go of it:
    /// connections get TopicDeleted, log segments return to their brokers' pools, replica
    /// directories are removed. Returns the topic as it was just before.
    pub fn delete(&self, name: &str) -> Result<TopicInfo, TopicError> {
        let mut topics = self.lock.lock();
        let i = topics
            .iter()
            .position(|t| t.spec.name == name)
            .ok_or_else(|| not_found(&topics, name))?;
        let mut next = topics.clone();
        let gone = next.remove(i);
        let info = self.info(&gone);
        save(&self.topics_file, &next)?;
        self.region.delete_topic(gone.slot);
        tracing::info!(topic = %gone.spec.name, slot = gone.slot, "topic deleted");
        self.deleted.lock().push(gone);
        *topics = next;
        Ok(info)
    }

    pub fn list(&self) -> Vec<TopicInfo> {
        let topics = self.lock.lock().clone();
        topics.iter().map(|t| self.info(t)).collect()
    }

    pub fn describe(&self, name: &str) -> Result<TopicInfo, TopicError> {
        let topics = self.lock.lock();
        topics
            .iter()
            .find(|t| t.spec.name == name)
            .map(|t| self.info(t))
            .ok_or_else(|| not_found(&topics, name))
    }

    fn info(&self, t: &PersistedTopic) -> TopicInfo {
        let r = &self.region;
        let seq = r.topic_seq(t.slot);
        let brokers = (0..r.capacities().brokers)
            .map(|b| {
                let log = r.log(t.slot, b);
                BrokerLogInfo {
                    broker: b,
                    written_batches: log.written_frontier.load(Ordering::Acquire),
                    messages: log.frontier_msgs.load(Ordering::Acquire),
                    ordered_batches: log.ordered_pbr.load(Ordering::Acquire),
                    durable_batches: log.durable_pbr.load(Ordering::Acquire),
                    reclaimed_batches: log.reclaimed_pbr.load(Ordering::Acquire),
                }
            })
            .collect();
        TopicInfo {
            name: t.spec.name.clone(),
            id: t.slot,
            order: t.spec.order,
            replication_factor: t.spec.replication_factor,
            default_ack: t.spec.default_ack,
            retention_bytes: t.spec.retention_bytes.unwrap_or(0),
            retention_ms: t.spec.retention_ms.unwrap_or(0),
            created_unix_ms: t.created_unix_ms,
            durable_batches: r.durable_seq(t.slot, t.spec.replication_factor),
            durable_position: r.durable_position(t.slot, t.spec.replication_factor),
            committed_batches: seq.committed_seq.load(Ordering::Acquire),
            next_position: seq.next_position.load(Ordering::Acquire),
            brokers,
            health: crate::health::topic_health(
                r,
                t.slot,
                t.spec.order,
                t.spec.replication_factor,
                self.defaults.reader_stall,
            ),
        }
    }
}

fn meta_of(t: &PersistedTopic) -> TopicMeta {
    TopicMeta {
        name: t.spec.name.clone(),
        order: t.spec.order,
        replication_factor: t.spec.replication_factor,
        default_ack: t.spec.default_ack,
        generation: 1,
        created_unix_ms: t.created_unix_ms,
        retention_bytes: t.spec.retention_bytes.unwrap_or(0),
        retention_ms: t.spec.retention_ms.unwrap_or(0),
        position_ceiling: if t.spec.replication_factor == 1 {
            t.position_ceiling
        } else {
            embarcadero_region::NO_POSITION_CEILING
        },
    }
}

/// Checks a topic specification; `disk_replicas` is how many replica directories the
/// server has.
pub fn validate_spec(spec: &TopicSpec, disk_replicas: u8) -> Result<(), TopicError> {
    embarcadero_wire::validate_topic_name(&spec.name)
        .map_err(|e| TopicError::Invalid(e.to_string()))?;
    if !matches!(spec.order, 0 | 1 | 2 | 5) {
        return Err(TopicError::Invalid(format!(
            "order {} does not exist; choose 0 (none), 1 (FIFO per broker), 2 (total order) or 5 (total order + per-session FIFO)",
            spec.order
        )));
    }
    if spec.replication_factor == 0 {
        return Err(TopicError::Invalid(
            "replication factor counts the in-memory copy and must be at least 1".into(),
        ));
    }
    if spec.replication_factor > 1 && spec.order < 2 {
        return Err(TopicError::Invalid(format!(
            "replication factor {} needs order 2 or 5: disk replicas copy the global order, which order {} does not have; use --order 2, or --rf 1",
            spec.replication_factor, spec.order
        )));
    }
    if spec.replication_factor > disk_replicas.saturating_add(1) {
        return Err(TopicError::Invalid(format!(
            "replication factor {} needs {} disk replicas but the server has {} replica directories; add directories to replication.dirs (EMBARCADERO_REPLICATION_DIRS) or lower --rf",
            spec.replication_factor,
            spec.replication_factor - 1,
            disk_replicas
        )));
    }
    if spec.default_ack > 2 {
        return Err(TopicError::Invalid(format!(
            "ack level {} does not exist; choose 0, 1 or 2",
            spec.default_ack
        )));
    }
    if spec.default_ack == 2 && spec.replication_factor < 2 {
        return Err(TopicError::Invalid(
            "default ack 2 (durable) requires a replication factor of at least 2".into(),
        ));
    }
    Ok(())
}

fn save(path: &Path, topics: &[PersistedTopic]) -> Result<(), TopicError> {
    let io = |source| TopicError::Io {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&serde_json::to_vec_pretty(topics).expect("serialisable"))
        .map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_topic_names_the_one_within_two_edits_else_says_how_to_create_it() {
        let names = ["orders", "payments"];
        let near = |word| crate::config::closest(word, names.iter().copied(), 2);
        assert_eq!(near("ordres"), Some("orders"));
        assert_eq!(near("payment"), Some("payments"));
        assert_eq!(near("invoices"), None);
        let meant = TopicError::NotFound("ordres".into(), Some("orders".into())).to_string();
        assert!(meant.contains("did you mean \"orders\"?"), "{meant}");
        let none = TopicError::NotFound("invoices".into(), None).to_string();
        assert!(none.contains("create it with"), "{none}");
    }
}
