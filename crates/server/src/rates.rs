//! Rates over the last few seconds for `status`: each broker's publish and subscribe
//! throughput and backpressure waits, and each topic's messages written per second.
//!
//! Owns a short history of counter samples, taken once a second by the server's
//! `rates` monitor thread; it reads counters (broker metrics, the region's per-log
//! message counts) and writes nothing anyone else reads.

use crate::Inner;
use parking_lot::Mutex;
use serde_json::json;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How often a sample is taken, and how far back rates look.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);
pub const WINDOW: Duration = Duration::from_secs(5);

/// Counters of one moment.
#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    /// Per local broker: id, then `BROKER_COUNTERS` in order.
    brokers: Vec<(u32, [u64; BROKER_COUNTERS.len()])>,
    /// Per topic: name and messages written over all brokers.
    topics: Vec<(String, u64)>,
}

/// The broker counters rates are reported for, with the name of their rate.
const BROKER_COUNTERS: [&str; 4] = [
    "publish_bytes_per_s",
    "publish_messages_per_s",
    "subscribe_bytes_per_s",
    "backpressure_waits_per_s",
];

#[derive(Default)]
pub struct Rates {
    /// Oldest first; never more than covers `WINDOW` plus one sample.
    samples: Mutex<VecDeque<Sample>>,
}

impl Rates {
    /// Takes a sample now and forgets those older than the window needs.
    pub(crate) fn sample(&self, inner: &Inner) {
        let sample = take(inner);
        let mut samples = self.samples.lock();
        if let Some(last) = samples.back() {
            assert!(sample.at >= last.at, "samples are taken in time order");
        }
        samples.push_back(sample);
        while samples.len() > 2 && samples[1].at.elapsed() >= WINDOW {
            samples.pop_front();
        }
    }

    /// The rates between the oldest sample in the window and the newest, as JSON
    /// (`{"window_ms", "brokers": [{id, ...}], "topics": {name: messages_per_s}}`);
    /// empty until two samples exist.
    pub(crate) fn report(&self) -> serde_json::Value {
        let samples = self.samples.lock();
        let (Some(first), Some(last)) = (samples.front(), samples.back()) else {
            return json!({});
        };
        let secs = last.at.duration_since(first.at).as_secs_f64();
        if secs <= 0.0 {
            return json!({});
        }
        let per_s = |now: u64, then: u64| (now.saturating_sub(then) as f64 / secs).round() as u64;
        let brokers: Vec<_> = last
            .brokers
            .iter()
            .map(|(id, now)| {
                let then = first.brokers.iter().find(|(b, _)| b == id).map(|(_, c)| *c);
                let mut entry = json!({ "id": id });
                for (i, name) in BROKER_COUNTERS.iter().enumerate() {
                    entry[*name] = json!(per_s(now[i], then.map_or(now[i], |c| c[i])));
                }
                entry
            })
            .collect();
        let mut topics = serde_json::Map::new();
        for (name, now) in &last.topics {
            let then = first
                .topics
                .iter()
                .find(|(t, _)| t == name)
                .map_or(*now, |t| t.1);
            topics.insert(name.clone(), json!(per_s(*now, then)));
        }
        json!({ "window_ms": (secs * 1000.0) as u64, "brokers": brokers, "topics": topics })
    }
}

fn take(inner: &Inner) -> Sample {
    let brokers = inner
        .brokers
        .iter()
        .map(|b| {
            let m = &b.metrics;
            let counters = [
                m.publish_bytes.load(Ordering::Relaxed),
                m.publish_messages.load(Ordering::Relaxed),
                m.subscribe_bytes.load(Ordering::Relaxed),
                m.backpressure_waits.load(Ordering::Relaxed),
            ];
            (b.id, counters)
        })
        .collect();
    let topics = inner
        .control
        .list()
        .into_iter()
        .map(|t| (t.name, t.brokers.iter().map(|b| b.messages).sum()))
        .collect();
    Sample {
        at: Instant::now(),
        brokers,
        topics,
    }
}

/// The `rates` monitor: one sample a second until `stop`.
pub(crate) fn watch(inner: &Inner, stop: &std::sync::atomic::AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        inner.rates.sample(inner);
        // A period, not a wait for an event: `stop` unparks it.
        std::thread::park_timeout(SAMPLE_EVERY);
    }
}
