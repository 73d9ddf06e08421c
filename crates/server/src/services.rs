//! The head's registry of services that run beside the log (`/v1/services`): each says
//! where it serves and how long to believe it; `status` lists the live ones.
//!
//! Owns only its table. Bounded: at most `MAX_SERVICES` entries, each field checked, so
//! a client cannot grow the head's memory through it.

use embarcadero_api::{ServiceAnnounce, ServiceInfo};
use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// Live services the head keeps at most; an announcement beyond it is refused.
pub const MAX_SERVICES: usize = 64;
const MAX_KIND_LEN: usize = 32;
const MAX_ADDR_LEN: usize = 256;
const TTL_MS: std::ops::RangeInclusive<u64> = 100..=60_000;

#[derive(Debug)]
struct Entry {
    announce: ServiceAnnounce,
    last_seen: Instant,
    /// When this kind and address began announcing (kept across refreshes, reset once
    /// it expired): the newest is where the control port forwards the workflow API.
    first_seen: Instant,
}

impl Entry {
    fn expired(&self, now: Instant) -> bool {
        now.duration_since(self.last_seen) > Duration::from_millis(self.announce.ttl_ms)
    }
}

/// Why an announcement was refused (the text says what to change).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ServiceError {
    #[error("{0}")]
    Invalid(String),
    #[error("the head already keeps {MAX_SERVICES} services; stop one or wait for a silent one to expire")]
    Full,
}

#[derive(Debug, Default)]
pub struct Services {
    entries: Mutex<Vec<Entry>>,
}

impl Services {
    /// Records (or refreshes, by kind and address) one announcement.
    pub fn announce(&self, announce: ServiceAnnounce) -> Result<(), ServiceError> {
        validate(&announce)?;
        let now = Instant::now();
        let mut entries = self.entries.lock();
        entries.retain(|e| !e.expired(now));
        let same =
            |e: &&mut Entry| e.announce.kind == announce.kind && e.announce.addr == announce.addr;
        if let Some(entry) = entries.iter_mut().find(same) {
            entry.announce = announce;
            entry.last_seen = now;
        } else if entries.len() >= MAX_SERVICES {
            return Err(ServiceError::Full);
        } else {
            entries.push(Entry {
                announce,
                last_seen: now,
                first_seen: now,
            });
        }
        assert!(entries.len() <= MAX_SERVICES, "the registry stays bounded");
        Ok(())
    }

    /// The services whose last announcement is within their ttl, oldest first.
    pub fn live(&self) -> Vec<ServiceInfo> {
        let now = Instant::now();
        let mut entries = self.entries.lock();
        entries.retain(|e| !e.expired(now));
        entries
            .iter()
            .map(|e| ServiceInfo {
                kind: e.announce.kind.clone(),
                addr: e.announce.addr.clone(),
                last_seen_ms: now.duration_since(e.last_seen).as_millis() as u64,
                ttl_ms: e.announce.ttl_ms,
                log: e.announce.log.clone(),
            })
            .collect()
    }
}

impl Services {
    /// The addresses of the live services of `kind`, the one that began announcing most
    /// recently first (a standby orchestrator that took over after the active one died
    /// began after it; a dead one is forgotten after its ttl, and skipped by the caller
    /// when its address refuses connections meanwhile).
    pub fn newest_first(&self, kind: &str) -> Vec<String> {
        let now = Instant::now();
        let mut entries = self.entries.lock();
        entries.retain(|e| !e.expired(now));
        let mut found: Vec<&Entry> = entries.iter().filter(|e| e.announce.kind == kind).collect();
        found.sort_by_key(|e| std::cmp::Reverse(e.first_seen));
        found.iter().map(|e| e.announce.addr.clone()).collect()
    }
}

/// Checks every field of an announcement (also the fuzz target's entry point).
pub(crate) fn validate(a: &ServiceAnnounce) -> Result<(), ServiceError> {
    let kind_ok = (1..=MAX_KIND_LEN).contains(&a.kind.len())
        && a.kind
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !kind_ok {
        return Err(ServiceError::Invalid(format!(
            "service kind {:?} must be 1 to {MAX_KIND_LEN} lower-case letters, digits, '-' or '_'",
            a.kind
        )));
    }
    if a.addr.is_empty() || a.addr.len() > MAX_ADDR_LEN || a.addr.chars().any(char::is_whitespace) {
        return Err(ServiceError::Invalid(format!(
            "service address must be host:port, 1 to {MAX_ADDR_LEN} bytes with no spaces"
        )));
    }
    if !TTL_MS.contains(&a.ttl_ms) {
        return Err(ServiceError::Invalid(format!(
            "ttl_ms {} is outside {}..={} ms",
            a.ttl_ms,
            TTL_MS.start(),
            TTL_MS.end()
        )));
    }
    if let Some(log) = &a.log {
        embarcadero_wire::validate_topic_name(&log.topic)
            .map_err(|e| ServiceError::Invalid(format!("the service's log: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workflow(addr: &str, ttl_ms: u64) -> ServiceAnnounce {
        ServiceAnnounce {
            kind: "workflow".into(),
            addr: addr.into(),
            ttl_ms,
            log: None,
        }
    }

    #[test]
    fn an_announcement_is_refreshed_in_place_and_listed_while_live() {
        let s = Services::default();
        s.announce(workflow("127.0.0.1:7411", 60_000)).unwrap();
        s.announce(workflow("127.0.0.1:7411", 60_000)).unwrap();
        s.announce(workflow("127.0.0.1:7412", 60_000)).unwrap();
        let live = s.live();
        assert_eq!(live.len(), 2, "{live:?}");
        assert_eq!(live[0].addr, "127.0.0.1:7411");
    }

    #[test]
    fn newest_first_lists_one_kind_by_when_each_began_announcing() {
        let s = Services::default();
        s.announce(workflow("127.0.0.1:1", 60_000)).unwrap();
        s.announce(workflow("127.0.0.1:2", 60_000)).unwrap();
        let other = ServiceAnnounce {
            kind: "other".into(),
            ..workflow("127.0.0.1:3", 60_000)
        };
        s.announce(other).unwrap();
        // Backdate instead of sleeping: the order is a function of the recorded instants.
        s.entries.lock()[1].first_seen -= Duration::from_secs(5);
        s.entries.lock()[0].first_seen -= Duration::from_secs(1);
        // A refresh keeps the entry's first announcement.
        s.announce(workflow("127.0.0.1:2", 60_000)).unwrap();
        assert_eq!(s.newest_first("workflow"), ["127.0.0.1:1", "127.0.0.1:2"]);
        assert_eq!(s.newest_first("other"), ["127.0.0.1:3"]);
        assert!(s.newest_first("none").is_empty());
    }

    #[test]
    fn a_silent_service_expires_after_its_ttl() {
        let s = Services::default();
        s.announce(workflow("127.0.0.1:7411", 100)).unwrap();
        // Backdate the entry instead of sleeping: expiry is a pure function of the clock.
        s.entries.lock()[0].last_seen -= Duration::from_millis(101);
        assert!(s.live().is_empty());
    }

    #[test]
    fn the_registry_is_bounded_and_checks_every_field() {
        let s = Services::default();
        for port in 0..MAX_SERVICES {
            s.announce(workflow(&format!("h:{port}"), 60_000)).unwrap();
        }
        assert_eq!(s.announce(workflow("h:x", 60_000)), Err(ServiceError::Full));
        let bad_kind = ServiceAnnounce {
            kind: "Work Flow".into(),
            ..workflow("h:1", 1000)
        };
        assert!(matches!(
            s.announce(bad_kind),
            Err(ServiceError::Invalid(_))
        ));
        assert!(matches!(
            s.announce(workflow(&"x".repeat(257), 1000)),
            Err(ServiceError::Invalid(_))
        ));
        assert!(matches!(
            s.announce(workflow("h:1", 99)),
            Err(ServiceError::Invalid(_))
        ));
        assert!(matches!(
            s.announce(workflow("h:1", 60_001)),
            Err(ServiceError::Invalid(_))
        ));
        let bad_log = ServiceAnnounce {
            log: Some(embarcadero_api::ServiceLog {
                topic: "x".repeat(10_000),
                created_unix_ms: 1,
            }),
            ..workflow("h:1", 1000)
        };
        assert!(matches!(s.announce(bad_log), Err(ServiceError::Invalid(_))));
    }
}
