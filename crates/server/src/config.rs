//! Server configuration: built-in defaults, then a TOML file, then `EMBARCADERO_*`
//! environment variables, then command-line flags (applied by the caller).
//!
//! Environment names: `EMBARCADERO_<KEY>` for top-level keys (`EMBARCADERO_BROKERS`)
//! and `EMBARCADERO_<SECTION>_<KEY>` for sectioned ones
//! (`EMBARCADERO_SEQUENCER_EPOCH_US`). Variables that name no setting are ignored,
//! so client-side knobs can share the prefix; `ServerConfig::unknown_env` lists them
//! for the command line to warn about.

use serde::{Deserialize, Serialize};
use std::net::{IpAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Directory for the region file and topic metadata.
    pub data_dir: PathBuf,
    /// Address every port binds to. Loopback by default.
    pub bind: String,
    /// Host (IP address or name, resolved once at start) clients reach the brokers at;
    /// empty: the bind address, which must then not be the unspecified `0.0.0.0`/`::`.
    pub advertise: String,
    /// Number of brokers in the embedded server.
    pub brokers: u32,
    /// Broker i listens on `base_port + i`; 0 picks ephemeral ports.
    pub base_port: u16,
    /// Admin HTTP API and `/metrics`; 0 picks an ephemeral port.
    pub control_port: u16,
    pub region: RegionSettings,
    pub broker: BrokerSettings,
    pub sequencer: SequencerSettings,
    pub replication: ReplicationSettings,
    pub cluster: ClusterSettings,
}

/// Cluster mode: which brokers this process runs, who orders the region, heartbeats.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSettings {
    /// Broker ids this process runs, comma-separated (`"0"`, `"0,2"`); empty: all of
    /// `0..brokers` (the embedded server). The others join as followers
    /// (`embarcadero broker --follower`).
    pub local_brokers: String,
    /// `embedded`: this process runs the sequencer; `external`: an
    /// `embarcadero sequencer` process does.
    pub sequencer: String,
    /// Followers send a heartbeat this often...
    pub heartbeat_interval_ms: u64,
    /// ...and are marked dead after this many intervals without one.
    pub heartbeat_misses: u32,
    /// The sequencer's lease on the region; a standby takes over once it expires.
    pub sequencer_lease_ms: u64,
}

/// Disk replicas (topics with a replication factor of 2 or more).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicationSettings {
    /// One directory per disk replica (put them on different disks); a topic may have
    /// up to `len + 1` copies. Empty means `<data_dir>/replica-1` and
    /// `<data_dir>/replica-2` (replication factor up to 3). In the environment: a
    /// comma-separated list.
    pub dirs: Vec<PathBuf>,
    /// Size at which a disk segment is closed; retention removes whole closed segments.
    pub segment_bytes: u64,
    /// Group commit: most bytes written between two fdatasyncs.
    pub group_commit_bytes: u64,
    /// Group commit: once caught up, wait this long for more batches before the
    /// fdatasync (0: at once, the lowest ack-2 latency).
    pub group_commit_wait_us: u64,
    /// Default retention of new topics on disk: bytes per replica (0: no limit)...
    pub retention_bytes: u64,
    /// ...and age in milliseconds (0: no limit).
    pub retention_ms: u64,
    /// After a disk error, retry after this long.
    pub retry_after_error_ms: u64,
    /// Fault injection for experiments: while this file exists, every replica write
    /// fails with ENOSPC (as if the disk were full). Empty: off.
    pub fault_enospc_flag: PathBuf,
    /// Fault injection for experiments: while this file exists, every replica fdatasync
    /// first waits 100 ms (a slow disk). Empty: off.
    pub fault_slow_disk_flag: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RegionSettings {
    /// Region file; empty means `<data_dir>/region`. A tmpfs path (`/dev/shm/...`)
    /// keeps the kernel from writing the region back to disk.
    pub path: PathBuf,
    pub max_topics: u32,
    pub goi_slots: u64,
    pub pbr_slots: u64,
    pub segment_bytes: u64,
    pub segments_per_broker: u32,
    /// Allocate and map every page of a new region at start instead of on first touch:
    /// the region then takes its full size in memory at once, and the data path takes
    /// no page faults (a fresh 4-broker region otherwise faults ~200 000 times).
    pub prefault: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerSettings {
    pub max_message_bytes: u64,
    pub max_batch_bytes: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub backpressure_timeout_ms: u64,
    /// Longest a batch's payload may take to arrive after its header (SlowPayload).
    pub payload_timeout_ms: u64,
    /// Connections a broker accepts at once; more are refused (TooManyConnections).
    pub max_connections: u64,
    /// Connections a broker accepts at once from one client address.
    pub max_connections_per_address: u64,
    /// Subscribers of one topic from one client address that hold a reader slot, over
    /// every broker; at most `READER_SLOTS` / 8, so eight addresses are needed to take
    /// every slot.
    pub max_subscribers_per_address: u32,
    /// Serve publishers on this host over shared-memory channels too (docs/DESIGN.md,
    /// "Local shared-memory transport").
    pub shm: bool,
    /// Uids besides the server's own that may open a shared-memory channel; anyone else
    /// is refused with ShmRefused (and publishes over TCP).
    pub shm_allowed_uids: Vec<u32>,
    /// Largest data ring a client's channel may bring (a power of two, at most 1 GiB).
    pub shm_max_ring_bytes: u64,
    /// Bytes of the ring of a subscriber's shared-memory feed (a power of two, 64 KiB
    /// to 1 GiB). Larger: a subscriber that is slow for a moment holds the broker back
    /// less; each feed's memory is this much.
    pub shm_feed_bytes: u64,
    pub idle_sleep_max_us: u64,
    /// A subscriber that makes no progress for this long stops holding memory.
    pub reader_stall_timeout_ms: u64,
    /// Fault injection for experiments: the broker (by id) that misbehaves, -1 for none.
    pub fault_broker: i64,
    /// Fraction of that broker's batches delayed by `fault_delay_us` before they reach
    /// its ring.
    pub fault_delay_fraction: f64,
    pub fault_delay_us: u64,
    /// Fraction of that broker's batches dropped before they reach its ring (they are
    /// committed as void, so the client is never acknowledged for them).
    pub fault_drop_fraction: f64,
    /// Most batches dropped by fault injection in all (0: no limit).
    pub fault_drop_limit: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SequencerSettings {
    pub epoch_us: u64,
    /// Order 5: batches a session may have in flight above its committed high-water
    /// mark; the sequencer holds at most this many per session.
    pub session_window: u64,
    /// Order 5: how long a gap at the head of a session may last before it is fenced.
    pub session_lease_ms: u64,
    /// Order 5: a session idle this long may give up its slot in the topic's session
    /// table (256 slots) when a new session needs one.
    pub session_idle_evict_secs: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("embarcadero-data"),
            bind: "127.0.0.1".into(),
            advertise: String::new(),
            brokers: 4,
            base_port: 1214,
            control_port: 12140,
            region: RegionSettings::default(),
            broker: BrokerSettings::default(),
            sequencer: SequencerSettings::default(),
            replication: ReplicationSettings::default(),
            cluster: ClusterSettings::default(),
        }
    }
}

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            local_brokers: String::new(),
            sequencer: "embedded".into(),
            heartbeat_interval_ms: 200,
            heartbeat_misses: 3,
            sequencer_lease_ms: 2000,
        }
    }
}

impl Default for ReplicationSettings {
    fn default() -> Self {
        Self {
            dirs: Vec::new(),
            segment_bytes: 64 << 20,
            group_commit_bytes: 8 << 20,
            group_commit_wait_us: 0,
            retention_bytes: 0,
            retention_ms: 0,
            retry_after_error_ms: 500,
            fault_enospc_flag: PathBuf::new(),
            fault_slow_disk_flag: PathBuf::new(),
        }
    }
}

impl Default for RegionSettings {
    fn default() -> Self {
        let c = embarcadero_region::Capacities::default();
        Self {
            path: PathBuf::new(),
            max_topics: c.max_topics,
            goi_slots: c.goi_slots,
            pbr_slots: c.pbr_slots,
            segment_bytes: c.segment_bytes,
            segments_per_broker: c.segments_per_broker,
            prefault: false,
        }
    }
}

impl Default for BrokerSettings {
    fn default() -> Self {
        Self {
            max_message_bytes: 1 << 20,
            max_batch_bytes: 4 << 20,
            high_watermark: 0.90,
            low_watermark: 0.75,
            backpressure_timeout_ms: 5000,
            payload_timeout_ms: 30_000,
            max_connections: 4096,
            max_connections_per_address: 1024,
            max_subscribers_per_address: 128,
            shm: true,
            shm_allowed_uids: Vec::new(),
            shm_max_ring_bytes: 256 << 20,
            shm_feed_bytes: embarcadero_shm::layout::FEED_CAPACITY as u64,
            idle_sleep_max_us: 20_000,
            reader_stall_timeout_ms: 30_000,
            fault_broker: -1,
            fault_delay_fraction: 0.0,
            fault_delay_us: 0,
            fault_drop_fraction: 0.0,
            fault_drop_limit: 0,
        }
    }
}

impl Default for SequencerSettings {
    fn default() -> Self {
        Self {
            epoch_us: 500,
            session_window: 4096,
            session_lease_ms: 30_000,
            session_idle_evict_secs: 600,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("environment variable {name}={value:?} is not valid: {message}")]
    Env {
        name: String,
        value: String,
        message: String,
    },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl ServerConfig {
    /// Defaults, overridden by `file` (if given), overridden by the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with_env(file, std::env::vars())
    }

    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut value = toml::Value::try_from(ServerConfig::default()).expect("defaults serialise");
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            let from_file: toml::Value = toml::from_str(&text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            merge(&mut value, from_file);
        }
        let before_env = value.clone();
        let mut applied = Vec::new();
        for (name, raw) in env {
            let Some(slot) = env_slot(&mut value, &name) else {
                continue;
            };
            *slot = parse_like(slot, &raw).map_err(|message| ConfigError::Env {
                name: name.clone(),
                value: raw.clone(),
                message,
            })?;
            applied.push((name, raw));
        }
        let config: ServerConfig = match value.try_into() {
            Ok(config) => config,
            Err(e) => return Err(Self::blame(file, before_env, &applied, e)),
        };
        config.validate()?;
        Ok(config)
    }

    /// The error of settings that do not make a configuration (a value out of its type's
    /// range, say): the file's when what it gave (`before_env`) is wrong already, else
    /// that of the first environment variable that breaks it.
    fn blame(
        file: Option<&Path>,
        mut before_env: toml::Value,
        applied: &[(String, String)],
        e: toml::de::Error,
    ) -> ConfigError {
        let file_alone = before_env.clone().try_into::<ServerConfig>().err();
        for (name, raw) in applied.iter().filter(|_| file_alone.is_none()) {
            let slot = env_slot(&mut before_env, name).expect("applied above");
            *slot = parse_like(slot, raw).expect("parsed above");
            if let Err(e) = before_env.clone().try_into::<ServerConfig>() {
                return ConfigError::Env {
                    name: name.clone(),
                    value: raw.clone(),
                    message: e.to_string().trim().replace('\n', " "),
                };
            }
        }
        let e = file_alone.unwrap_or(e);
        match file {
            Some(path) => ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            },
            None => ConfigError::Invalid(e.to_string()),
        }
    }

    /// The `EMBARCADERO_*` names in `env` that name neither a server setting nor one of
    /// `also_known` (variables read elsewhere: the command line, the client, scripts),
    /// each with the variable it most likely meant (if any is close). For a warning, not
    /// an error: a misspelt name would otherwise be ignored without a word.
    pub fn unknown_env(
        env: impl IntoIterator<Item = (String, String)>,
        also_known: &[&str],
    ) -> Vec<(String, Option<String>)> {
        let mut defaults =
            toml::Value::try_from(ServerConfig::default()).expect("defaults serialise");
        let mut known = env_names(&defaults);
        known.extend(also_known.iter().map(|name| name.to_string()));
        env.into_iter()
            .map(|(name, _)| name)
            .filter(|name| name.starts_with("EMBARCADERO_"))
            .filter(|name| !also_known.contains(&name.as_str()))
            .filter(|name| env_slot(&mut defaults, name).is_none())
            .map(|name| {
                let closest = closest(&name, known.iter().map(String::as_str), 3);
                (name, closest.map(str::to_string))
            })
            .collect()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.brokers == 0 || self.brokers > embarcadero_region::MAX_BROKERS {
            return Err(ConfigError::Invalid(format!(
                "brokers must be between 1 and {}, got {}",
                embarcadero_region::MAX_BROKERS,
                self.brokers
            )));
        }
        self.check_broker().map_err(ConfigError::Invalid)?;
        self.check_sequencer().map_err(ConfigError::Invalid)?;
        self.check_replication().map_err(ConfigError::Invalid)?;
        self.check_cluster().map_err(ConfigError::Invalid)?;
        let local = self.local_broker_ids()?;
        self.check_ports(&local).map_err(ConfigError::Invalid)?;
        self.capacities()
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    /// That the local brokers' ports (`base_port + id`) exist and leave the control port
    /// alone: a clash would fail at start as 'is another server running?'.
    fn check_ports(&self, local: &[u32]) -> Result<(), String> {
        if self.base_port == 0 {
            return Ok(());
        }
        for &id in local {
            let port = u32::from(self.base_port) + id;
            if port > u32::from(u16::MAX) {
                return Err(format!(
                    "broker {id} would listen on port {port} (base_port {} + {id}), past 65535: lower base_port",
                    self.base_port
                ));
            }
            if port == u32::from(self.control_port) {
                return Err(format!(
                    "control_port {} is broker {id}'s port (base_port {} + {id}): choose a control port outside {}..={}",
                    self.control_port,
                    self.base_port,
                    self.base_port,
                    u32::from(self.base_port) + local.iter().max().copied().unwrap_or(0)
                ));
            }
        }
        Ok(())
    }

    /// The `[broker]` settings, and that a batch fits in a region segment: what is
    /// wrong with the first that is out of range.
    fn check_broker(&self) -> Result<(), String> {
        let b = &self.broker;
        if !(0.0 < b.low_watermark && b.low_watermark < b.high_watermark && b.high_watermark <= 1.0)
        {
            return Err(format!(
                "watermarks must satisfy 0 < low ({}) < high ({}) <= 1",
                b.low_watermark, b.high_watermark
            ));
        }
        if b.max_message_bytes == 0 || b.max_message_bytes + 128 > b.max_batch_bytes {
            return Err(format!(
                "broker.max_batch_bytes ({}) must hold one message of broker.max_message_bytes ({}) plus its header",
                b.max_batch_bytes, b.max_message_bytes
            ));
        }
        if b.payload_timeout_ms == 0 {
            return Err("broker.payload_timeout_ms must be above 0".into());
        }
        let most_subscribers = embarcadero_region::READER_SLOTS / 8;
        if b.max_subscribers_per_address == 0 || b.max_subscribers_per_address > most_subscribers {
            return Err(format!(
                "broker.max_subscribers_per_address must be 1..={most_subscribers} (an eighth of the {} reader slots of a topic), got {}",
                embarcadero_region::READER_SLOTS,
                b.max_subscribers_per_address
            ));
        }
        if let Err(e) = embarcadero_shm::layout::check_data_capacity(b.shm_max_ring_bytes) {
            return Err(format!("broker.shm_max_ring_bytes: {e}"));
        }
        if let Err(e) = embarcadero_shm::layout::check_data_capacity(b.shm_feed_bytes) {
            return Err(format!("broker.shm_feed_bytes: {e}"));
        }
        if b.max_connections == 0 || b.max_connections_per_address == 0 {
            return Err(
                "broker.max_connections and broker.max_connections_per_address must be above 0"
                    .into(),
            );
        }
        if b.max_batch_bytes > self.region.segment_bytes {
            return Err(format!(
                "broker.max_batch_bytes ({}) must not exceed region.segment_bytes ({})",
                b.max_batch_bytes, self.region.segment_bytes
            ));
        }
        Ok(())
    }

    /// The `[sequencer]` settings: what is wrong with the first that is out of range.
    fn check_sequencer(&self) -> Result<(), String> {
        let epoch = std::time::Duration::from_micros(self.sequencer.epoch_us);
        if epoch < embarcadero_sequencer::MIN_EPOCH {
            return Err(format!(
                "sequencer.epoch_us must be at least {}, got {}",
                embarcadero_sequencer::MIN_EPOCH.as_micros(),
                self.sequencer.epoch_us
            ));
        }
        // No batch of a session could ever be ordered: every order-5 publisher would stall.
        if self.sequencer.session_window == 0 {
            return Err("sequencer.session_window must be at least 1 (batches a session may have in flight; default 4096)".into());
        }
        // A broker raises a connected session's stamp once a second: a shorter threshold
        // would end sessions whose clients are connected.
        if self.sequencer.session_idle_evict_secs < 2 {
            return Err(format!(
                "sequencer.session_idle_evict_secs must be at least 2, got {}",
                self.sequencer.session_idle_evict_secs
            ));
        }
        Ok(())
    }

    /// The `[replication]` settings: what is wrong with the first that is out of range.
    fn check_replication(&self) -> Result<(), String> {
        let r = &self.replication;
        if r.dirs.len() > embarcadero_region::MAX_REPLICAS as usize {
            return Err(format!(
                "replication.dirs lists {} directories; at most {} disk replicas are supported",
                r.dirs.len(),
                embarcadero_region::MAX_REPLICAS
            ));
        }
        if r.segment_bytes < 4096 || r.group_commit_bytes == 0 {
            return Err(
                "replication.segment_bytes must be at least 4096 and group_commit_bytes above 0"
                    .into(),
            );
        }
        Ok(())
    }

    /// The `[cluster]` settings: what is wrong with the first that is out of range.
    fn check_cluster(&self) -> Result<(), String> {
        let c = &self.cluster;
        if c.sequencer != "embedded" && c.sequencer != "external" {
            return Err(format!(
                "cluster.sequencer must be \"embedded\" or \"external\", got {:?}",
                c.sequencer
            ));
        }
        if c.heartbeat_interval_ms == 0 || c.heartbeat_misses == 0 || c.sequencer_lease_ms < 30 {
            return Err("cluster.heartbeat_interval_ms and heartbeat_misses must be above 0 and sequencer_lease_ms at least 30".into());
        }
        Ok(())
    }

    /// The IP address brokers are advertised at to clients (in `/v1/cluster` and
    /// `/v1/status`): `advertise`, or else the bind address. Binding every interface
    /// (`0.0.0.0`) without `advertise` is refused: clients cannot connect to 0.0.0.0.
    pub fn advertised_ip(&self) -> Result<IpAddr, ConfigError> {
        let host = self.advertise.trim();
        if host.is_empty() {
            let bind: IpAddr = self.bind.parse().map_err(|e| {
                ConfigError::Invalid(format!(
                    "bind address {:?} is not an IP address: {e}",
                    self.bind
                ))
            })?;
            if bind.is_unspecified() {
                return Err(ConfigError::Invalid(format!(
                    "bind = {bind} listens on every interface, but clients cannot connect to {bind}: pass --advertise HOST (config key advertise, EMBARCADERO_ADVERTISE) with the address clients reach this server at"
                )));
            }
            return Ok(bind);
        }
        let ip = resolve_host(host)?;
        if ip.is_unspecified() {
            return Err(ConfigError::Invalid(format!(
                "advertise = {host}: clients cannot connect to {ip}; give the address clients reach this server at"
            )));
        }
        Ok(ip)
    }

    /// The broker ids this process runs (`cluster.local_brokers`), in order.
    pub fn local_broker_ids(&self) -> Result<Vec<u32>, ConfigError> {
        let text = self.cluster.local_brokers.trim();
        if text.is_empty() {
            return Ok((0..self.brokers).collect());
        }
        let mut ids = Vec::new();
        for part in text.split(',') {
            let id: u32 = part.trim().parse().map_err(|_| {
                ConfigError::Invalid(format!(
                    "cluster.local_brokers: {part:?} is not a broker id (expected a comma-separated list such as \"0\" or \"0,2\")"
                ))
            })?;
            if id >= self.brokers {
                return Err(ConfigError::Invalid(format!(
                    "cluster.local_brokers names broker {id}, but the cluster has brokers 0..{} (raise `brokers`)",
                    self.brokers
                )));
            }
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    /// The disk replicas' directories, replica 1 first.
    pub fn replica_dirs(&self) -> Vec<PathBuf> {
        if self.replication.dirs.is_empty() {
            (1..=2)
                .map(|r| self.data_dir.join(format!("replica-{r}")))
                .collect()
        } else {
            self.replication.dirs.clone()
        }
    }

    /// Where the region file lives.
    pub fn region_path(&self) -> PathBuf {
        if self.region.path.as_os_str().is_empty() {
            self.data_dir.join("region")
        } else {
            self.region.path.clone()
        }
    }

    pub fn capacities(&self) -> embarcadero_region::Capacities {
        let r = &self.region;
        embarcadero_region::Capacities {
            max_topics: r.max_topics,
            brokers: self.brokers,
            goi_slots: r.goi_slots,
            pbr_slots: r.pbr_slots,
            segment_bytes: r.segment_bytes,
            segments_per_broker: r.segments_per_broker,
            seg_map_slots: (r.segments_per_broker as u64 + 1)
                .next_power_of_two()
                .max(8),
        }
    }

    /// The configuration as a TOML file (`embarcadero serve --print-config`), headed by comments that resolve the settings
    /// left empty (they are derived from `data_dir` at start; the file keeps them empty
    /// so that it still follows a changed `data_dir`).
    pub fn to_toml(&self) -> String {
        let dirs: Vec<String> = self
            .replica_dirs()
            .iter()
            .map(|d| comment_text(&d.display().to_string()))
            .collect();
        let mut derived = String::new();
        if self.region.path.as_os_str().is_empty() {
            let path = comment_text(&self.region_path().display().to_string());
            derived += &format!("#   region.path = \"\" means {path}\n");
        }
        if self.replication.dirs.is_empty() {
            derived += &format!("#   replication.dirs = [] means {}\n", dirs.join(", "));
        }
        if !derived.is_empty() {
            derived.insert_str(0, "# Empty settings are derived from data_dir at start:\n");
        }
        derived + &toml::to_string_pretty(self).expect("config serialises")
    }
}

/// `host` as an IP address: itself, or the first address its name resolves to.
pub fn resolve_host(host: &str) -> Result<IpAddr, ConfigError> {
    if let Ok(ip) = host.parse() {
        return Ok(ip);
    }
    let unresolved = |why: String| {
        ConfigError::Invalid(format!(
            "advertise = {host:?} is neither an IP address nor a name that resolves ({why})"
        ))
    };
    (host, 0)
        .to_socket_addrs()
        .map_err(|e| unresolved(e.to_string()))?
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| unresolved("no address".into()))
}

/// `text` fit for a TOML comment: control characters (a line break would end the
/// comment, a carriage return is not allowed in one) written as escapes.
fn comment_text(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

fn merge(base: &mut toml::Value, overlay: toml::Value) {
    match (base, overlay) {
        (toml::Value::Table(b), toml::Value::Table(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(existing) if existing.is_table() && v.is_table() => merge(existing, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// The setting an environment variable names: `EMBARCADERO_<KEY>` for a top-level key,
/// `EMBARCADERO_<SECTION>_<KEY>` for a sectioned one.
fn env_slot<'a>(config: &'a mut toml::Value, name: &str) -> Option<&'a mut toml::Value> {
    let key = name.strip_prefix("EMBARCADERO_")?.to_ascii_lowercase();
    let table = config.as_table_mut().expect("config is a table");
    if table.get(&key).is_some_and(|v| !v.is_table()) {
        return table.get_mut(&key);
    }
    let (section, field) = key.split_once('_')?;
    table.get_mut(section)?.as_table_mut()?.get_mut(field)
}

/// Every variable name `env_slot` accepts.
fn env_names(config: &toml::Value) -> Vec<String> {
    let mut names = Vec::new();
    for (key, v) in config.as_table().expect("config is a table") {
        match v.as_table() {
            Some(section) => names.extend(
                section
                    .keys()
                    .map(|field| format!("EMBARCADERO_{key}_{field}").to_ascii_uppercase()),
            ),
            None => names.push(format!("EMBARCADERO_{key}").to_ascii_uppercase()),
        }
    }
    names
}

/// The candidate nearest to `word` within `max` edits (of equals, the one that sorts
/// first), for
/// suggesting what a misspelt name meant (a variable, a topic).
pub(crate) fn closest<'a>(
    word: &str,
    candidates: impl Iterator<Item = &'a str>,
    max: usize,
) -> Option<&'a str> {
    candidates
        .map(|c| (edit_distance(c, word), c))
        .min()
        .filter(|(d, _)| *d <= max)
        .map(|(_, c)| c)
}

/// Levenshtein distance.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substituted = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substituted.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// A boolean as people write it in an environment: `1`/`0` and `yes`/`no` as well as
/// `true`/`false` (any case), since shells and service files use all of them.
fn parse_bool(raw: &str) -> Result<bool, String> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err("expected a boolean: 1, 0, true, false, yes, no, on or off".into()),
    }
}

/// Parses `raw` as the same TOML type as the default in `like`.
fn parse_like(like: &toml::Value, raw: &str) -> Result<toml::Value, String> {
    Ok(match like {
        toml::Value::Integer(_) => toml::Value::Integer(
            raw.trim()
                .parse()
                .map_err(|e| format!("expected an integer: {e}"))?,
        ),
        toml::Value::Float(_) => toml::Value::Float(
            raw.trim()
                .parse()
                .map_err(|e| format!("expected a number: {e}"))?,
        ),
        toml::Value::Boolean(_) => toml::Value::Boolean(parse_bool(raw)?),
        toml::Value::Array(_) => toml::Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| toml::Value::String(s.to_string()))
                .collect(),
        ),
        _ => toml::Value::String(raw.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing (`fuzz/`, target `config_toml`): a data_dir with a carriage
    /// return or a line break went raw into the comments of `to_toml`, so the printed
    /// configuration did not load (or, with a line break, held a line of its own). And
    /// in session 23: 256 or more quotes in a row overflowed the `u8` run counter of
    /// `toml_write` 0.1.2 (toml 0.8), a panic with overflow checks and a wrong choice of
    /// string style without; toml 0.9's `toml_writer` saturates it.
    #[test]
    fn printed_configuration_loads_whatever_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        for data_dir in [
            "emb\rcadero-data".to_string(),
            "x\n[broker]\nmax_connections = 1".to_string(),
            "plain".to_string(),
            "'".repeat(300),
            "\"".repeat(300),
            format!("a{}b{}", "'".repeat(256), "\"".repeat(513)),
        ] {
            let config = ServerConfig {
                data_dir: data_dir.as_str().into(),
                ..Default::default()
            };
            let path = dir.path().join("printed.toml");
            std::fs::write(&path, config.to_toml()).unwrap();
            let again = ServerConfig::load_with_env(Some(&path), Vec::new()).unwrap();
            assert_eq!(again, config, "{data_dir:?}");
        }
    }

    #[test]
    fn a_control_port_among_the_brokers_ports_or_a_port_past_65535_is_refused() {
        let with = |base_port, control_port| ServerConfig {
            base_port,
            control_port,
            ..Default::default()
        };
        let clash = with(43300, 43302).validate().unwrap_err().to_string();
        assert!(
            clash.contains("control_port 43302 is broker 2's port"),
            "{clash}"
        );
        assert!(clash.contains("outside 43300..=43303"), "{clash}");
        let past = with(65534, 1).validate().unwrap_err().to_string();
        assert!(past.contains("port 65536"), "{past}");
        assert!(with(43300, 43304).validate().is_ok());
        assert!(with(0, 0).validate().is_ok(), "ephemeral ports never clash");
    }

    #[test]
    fn misspelt_environment_names_are_listed_with_the_setting_they_meant() {
        let unknown = ServerConfig::unknown_env(
            env(&[
                ("EMBARCADERO_SEQUENCER_EPOCHUS", "100"),
                ("EMBARCADERO_BROKER", "2"),
                ("EMBARCADERO_BROKERS", "2"),
                ("EMBARCADERO_REGION_MAX_TOPICS", "8"),
                ("EMBARCADERO_SOMETHING_ELSE_ENTIRELY", "x"),
                ("EMBARCADERO_CONTROL", "h:1"),
                ("EMBARCADERO_CONTROLL", "h:1"),
                ("PATH", "/bin"),
            ]),
            &["EMBARCADERO_CONTROL"],
        );
        let suggestion = |name: &str| {
            unknown
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("{name} not listed in {unknown:?}"))
                .1
                .clone()
        };
        assert_eq!(unknown.len(), 4, "{unknown:?}");
        assert_eq!(
            suggestion("EMBARCADERO_CONTROLL").as_deref(),
            Some("EMBARCADERO_CONTROL")
        );
        assert_eq!(
            suggestion("EMBARCADERO_SEQUENCER_EPOCHUS").as_deref(),
            Some("EMBARCADERO_SEQUENCER_EPOCH_US")
        );
        assert_eq!(
            suggestion("EMBARCADERO_BROKER").as_deref(),
            Some("EMBARCADERO_BROKERS")
        );
        assert_eq!(suggestion("EMBARCADERO_SOMETHING_ELSE_ENTIRELY"), None);
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn booleans_in_the_environment_take_the_usual_spellings() {
        for (raw, want) in [("1", true), ("yes", true), ("TRUE", true), ("0", false)] {
            let c = ServerConfig::load_with_env(None, env(&[("EMBARCADERO_REGION_PREFAULT", raw)]))
                .unwrap();
            assert_eq!(c.region.prefault, want, "{raw}");
        }
        for raw in ["no", "false", "off"] {
            assert_eq!(parse_bool(raw), Ok(false), "{raw}");
        }
        let e = ServerConfig::load_with_env(None, env(&[("EMBARCADERO_REGION_PREFAULT", "2")]))
            .unwrap_err();
        assert!(e.to_string().contains("1, 0, true, false, yes, no"), "{e}");
    }

    #[test]
    fn every_interface_needs_an_advertised_host() {
        let mut c = ServerConfig {
            bind: "0.0.0.0".into(),
            ..ServerConfig::default()
        };
        let e = c.advertised_ip().unwrap_err().to_string();
        assert!(e.contains("--advertise"), "{e}");
        c.advertise = "10.1.2.3".into();
        assert_eq!(
            c.advertised_ip().unwrap(),
            "10.1.2.3".parse::<IpAddr>().unwrap()
        );
        c.advertise = "localhost".into();
        assert!(c.advertised_ip().unwrap().is_loopback());
        c.advertise = "0.0.0.0".into();
        assert!(c.advertised_ip().is_err());
        assert_eq!(
            ServerConfig::default().advertised_ip().unwrap(),
            "127.0.0.1".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn the_feed_size_comes_from_the_environment_and_only_a_ring_size_is_taken() {
        let name = "EMBARCADERO_BROKER_SHM_FEED_BYTES";
        let c = ServerConfig::load_with_env(None, env(&[(name, "1048576")])).unwrap();
        assert_eq!(c.broker.shm_feed_bytes, 1 << 20);
        // Not a power of two, below 64 KiB, above 1 GiB.
        for bad in ["1000000", "4096", "2147483648"] {
            let e = ServerConfig::load_with_env(None, env(&[(name, bad)])).unwrap_err();
            assert!(
                e.to_string().contains("broker.shm_feed_bytes"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn defaults_are_valid() {
        let c = ServerConfig::load_with_env(None, env(&[])).unwrap();
        assert_eq!(c, ServerConfig::default());
    }

    #[test]
    fn file_then_env_override_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "brokers = 2\n[sequencer]\nepoch_us = 200\n").unwrap();
        let c = ServerConfig::load_with_env(
            Some(&path),
            env(&[
                ("EMBARCADERO_SEQUENCER_EPOCH_US", "100"),
                ("EMBARCADERO_DATA_DIR", "/tmp/x"),
                ("EMBARCADERO_SLOW_CONSUMER_QUEUE", "3"),
                ("EMBARCADERO_REPLICATION_DIRS", "/disk1/r, /disk2/r"),
                ("EMBARCADERO_REPLICATION_GROUP_COMMIT_WAIT_US", "250"),
            ]),
        )
        .unwrap();
        assert_eq!(
            c.replica_dirs(),
            vec![PathBuf::from("/disk1/r"), PathBuf::from("/disk2/r")]
        );
        assert_eq!(c.replication.group_commit_wait_us, 250);
        assert_eq!(c.brokers, 2);
        assert_eq!(c.sequencer.epoch_us, 100);
        assert_eq!(c.data_dir, PathBuf::from("/tmp/x"));
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let e =
            ServerConfig::load_with_env(None, env(&[("EMBARCADERO_BROKERS", "many")])).unwrap_err();
        assert!(e.to_string().contains("EMBARCADERO_BROKERS"), "{e}");
        let e = ServerConfig::load_with_env(None, env(&[("EMBARCADERO_SEQUENCER_EPOCH_US", "10")]))
            .unwrap_err();
        assert!(e.to_string().contains("epoch_us"), "{e}");
        let e = ServerConfig::load_with_env(
            None,
            env(&[("EMBARCADERO_SEQUENCER_SESSION_IDLE_EVICT_SECS", "1")]),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("session_idle_evict_secs must be at least 2"),
            "{e}"
        );
        let e = ServerConfig::load_with_env(
            None,
            env(&[("EMBARCADERO_SEQUENCER_SESSION_WINDOW", "0")]),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("session_window must be at least 1"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "brokerz = 2\n").unwrap();
        let e = ServerConfig::load_with_env(Some(&path), env(&[])).unwrap_err();
        assert!(e.to_string().contains("brokerz"), "{e}");
    }
}
