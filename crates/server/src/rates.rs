//! Rates over the last few seconds for `status`: each broker's publish and subscribe
//! throughput and backpressure waits, and each topic's messages written per second.
//!
//! Owns a short history of counter samples, taken once a second by the server's
//! `rates` monitor thread; it reads counters (broker metrics, the region's per-log
//! message counts) and writes nothing anyone else reads.

use crate::Inner;
use embarcadero_api::{BrokerRates, RatesReport};
use parking_lot::Mutex;
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
    /// Per local broker: id, then its `BROKER_COUNTERS` counters.
    brokers: Vec<(u32, [u64; BROKER_COUNTERS])>,
    /// Per topic: name and messages written over all brokers.
    topics: Vec<(String, u64)>,
}

/// How many broker counters a sample holds: publish bytes, publish messages, subscribe
/// bytes, backpressure waits (in `BrokerRates`' order).
const BROKER_COUNTERS: usize = 4;

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

    /// The rates between the oldest sample in the window and the newest; empty until
    /// two samples exist.
    pub(crate) fn report(&self) -> RatesReport {
        let samples = self.samples.lock();
        let (Some(first), Some(last)) = (samples.front(), samples.back()) else {
            return RatesReport::default();
        };
        let secs = last.at.duration_since(first.at).as_secs_f64();
        if secs <= 0.0 {
            return RatesReport::default();
        }
        let per_s = |now: u64, then: u64| (now.saturating_sub(then) as f64 / secs).round() as u64;
        let brokers = last
            .brokers
            .iter()
            .map(|(id, now)| {
                let then = first
                    .brokers
                    .iter()
                    .find(|(b, _)| b == id)
                    .map_or(*now, |(_, c)| *c);
                let rate = |i: usize| per_s(now[i], then[i]);
                BrokerRates {
                    id: *id,
                    publish_bytes_per_s: rate(0),
                    publish_messages_per_s: rate(1),
                    subscribe_bytes_per_s: rate(2),
                    backpressure_waits_per_s: rate(3),
                }
            })
            .collect();
        let topics = last
            .topics
            .iter()
            .map(|(name, now)| {
                let then = first
                    .topics
                    .iter()
                    .find(|(t, _)| t == name)
                    .map_or(*now, |t| t.1);
                (name.clone(), per_s(*now, then))
            })
            .collect();
        RatesReport {
            window_ms: (secs * 1000.0) as u64,
            brokers,
            topics,
        }
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
