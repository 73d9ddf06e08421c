//! The start-up raise of the open-files limit, and the warning when the connection
//! limits could outgrow it.
//!
//! Every broker connection holds two or three file descriptors, and `serve` allows
//! `broker.max_connections` of them per broker besides the admin API's 1024. Under the
//! common default soft limit (1024) a few hundred idle connections used every descriptor
//! and the server could accept no one, the admin API included, long before the
//! connection limits refused anybody (an adversarial run, session 33). So the process
//! raises its soft limit to the hard one, as most servers do, and says at start when
//! even that is below what its limits allow.

use crate::ServerConfig;

/// Descriptors one broker connection may hold at once (its socket, the clone its ack
/// path writes through, and a shared-memory channel's memfd or feed).
const FDS_PER_CONNECTION: u64 = 3;
/// The admin API's connections, the region, the replicas' files and the rest.
const FDS_BESIDE_BROKERS: u64 = 1024 + 1024;

/// Raises the soft open-files limit to the hard one; returns the limit now in force,
/// or `None` when it cannot be read.
pub fn raise_open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the call to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit; raising a soft limit up to the hard one
        // needs no privilege, and a failure leaves the old limit in force.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Some(limit.rlim_cur)
}

/// Descriptors `config`'s limits allow this process to hold at once.
pub fn descriptors_needed(config: &ServerConfig) -> u64 {
    let brokers = config
        .local_broker_ids()
        .map_or(u64::from(config.brokers), |ids| ids.len() as u64);
    brokers
        .saturating_mul(config.broker.max_connections)
        .saturating_mul(FDS_PER_CONNECTION)
        .saturating_add(FDS_BESIDE_BROKERS)
}

/// Raises the limit and warns when it is below what the connection limits allow.
pub(crate) fn prepare(config: &ServerConfig) {
    let Some(limit) = raise_open_files_limit() else {
        return;
    };
    let needed = descriptors_needed(config);
    if limit < needed {
        tracing::warn!(
            limit,
            needed,
            "the open-files limit ({limit}) is below the {needed} descriptors broker.max_connections ({}) allows: past it new connections, the admin API's included, fail until others close; raise the hard limit (ulimit -Hn, systemd LimitNOFILE=) or lower broker.max_connections",
            config.broker.max_connections
        );
    }
    assert!(needed >= FDS_BESIDE_BROKERS, "the estimate counts the rest");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current() -> libc::rlimit {
        let mut now = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `now` is a valid, writable rlimit for the call to fill.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) }, 0);
        now
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let hard = current().rlim_max;
        // Lowered first (not below what this test process's other tests may hold), so
        // that there is something to raise.
        let lowered = libc::rlimit {
            rlim_cur: (hard / 2).max(1024).min(hard),
            rlim_max: hard,
        };
        // SAFETY: `lowered` is a valid rlimit within the hard limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
        assert_eq!(raise_open_files_limit(), Some(hard));
        let now = current();
        assert_eq!((now.rlim_cur, now.rlim_max), (hard, hard));
    }

    #[test]
    fn the_estimate_grows_with_the_brokers_and_their_connection_limit() {
        let mut config = ServerConfig::default();
        let four = descriptors_needed(&config);
        config.cluster.local_brokers = "0".into();
        let one = descriptors_needed(&config);
        assert_eq!(
            four - one,
            3 * config.broker.max_connections * FDS_PER_CONNECTION
        );
        config.broker.max_connections = 10;
        assert_eq!(descriptors_needed(&config), 30 + FDS_BESIDE_BROKERS);
    }
}
