//! `NativePublisher`: a Rust `Publisher` fed so that `publish` never waits on the
//! JavaScript thread. `stage` and `stageArray` append on the event loop what the
//! publisher takes without waiting (`Publisher::try_publish_all`, when nothing is staged
//! before them), and copy the rest into one byte buffer and start a drain job on the
//! blocking pool, which hands them, in order, to `Publisher::publish_all` (that is where
//! batching, queueing, deflect-when-full and backpressure happen, and where it may
//! block). Staging tells the caller when it left messages staged, and the TypeScript
//! layer then waits (`wake_when_handed`) until the drain has handed them over before
//! its promise resolves: memory stays bounded and a producer that awaits is paced by the
//! network, not by a blocked event loop.

use crate::error::{config, to_js};
use crate::{blocking, millis, Waker};
use embarcadero_client::{Error, Publisher, PublisherConfig, PublisherStats};
use embarcadero_wire::SESSION_KEY_LEN;
use napi::bindgen_prelude::{BigInt, Buffer, BufferSlice, Function};
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};
use napi::{Env, Status};
use napi_derive::napi;
use parking_lot::{Condvar, Mutex};
use serde_json::Value;
use std::sync::Arc;

/// Messages the drain hands to the Rust publisher per call (`publish_all`: one lock of
/// its batch builder for them all, where `publish` takes it per message). The linger
/// timer needs the same lock: it waits for one group's copy, 64 KiB of 1 KiB messages
/// (a few microseconds), more for larger messages.
const GROUP: usize = 64;
/// How long a drain that emptied the stage waits for more before it stops.
const DRAIN_LINGER: std::time::Duration = std::time::Duration::from_millis(1);

/// Every `PublisherConfig` option, as JavaScript passes them (camelCase, milliseconds).
#[napi(object)]
pub struct NativePublisherConfig {
    pub ack_level: Option<u8>,
    pub batch_bytes: Option<u32>,
    pub linger_ms: Option<f64>,
    pub linger_backstop_ms: Option<f64>,
    pub threads_per_broker: Option<u32>,
    pub queue_depth: Option<u32>,
    pub max_inflight_batches: Option<u32>,
    pub client_id: Option<BigInt>,
    pub session_key: Option<Buffer>,
    pub flush_timeout_ms: Option<f64>,
    pub session_epoch: Option<BigInt>,
    pub deflect: Option<bool>,
    pub slow_queue_index: Option<u32>,
    pub slow_queue_ms: Option<f64>,
    pub failover: Option<bool>,
    pub membership_refresh_ms: Option<f64>,
    pub max_joined_brokers: Option<u32>,
    /// Publish to these broker addresses directly instead of asking the control plane
    /// (`Publisher::connect_brokers`: no failover, which needs the control plane).
    pub brokers: Option<Vec<String>>,
    /// `"auto"` (the default), `"tcp"` or `"shm"`: `PublisherConfig::transport`.
    pub transport: Option<String>,
}

fn u64_of(name: &str, v: BigInt) -> napi::Result<u64> {
    let (signed, value, lossless) = v.get_u64();
    if signed || !lossless {
        return Err(config(format!("{name} must be an unsigned 64-bit integer")));
    }
    Ok(value)
}

impl NativePublisherConfig {
    fn into_client(self) -> napi::Result<(PublisherConfig, Option<Vec<String>>)> {
        let d = PublisherConfig::default();
        let session_key = match self.session_key {
            None => None,
            Some(k) => Some(<[u8; SESSION_KEY_LEN]>::try_from(&k[..]).map_err(|_| {
                config(format!(
                    "sessionKey must be {SESSION_KEY_LEN} bytes, not {}",
                    k.len()
                ))
            })?),
        };
        let slow_queue = match (self.slow_queue_index, self.slow_queue_ms) {
            (Some(q), Some(ms)) => Some((q as usize, millis(ms))),
            _ => None,
        };
        let cfg = PublisherConfig {
            ack_level: self.ack_level.unwrap_or(d.ack_level),
            batch_bytes: self.batch_bytes.map_or(d.batch_bytes, |b| b as usize),
            linger: self.linger_ms.map_or(d.linger, millis),
            linger_backstop: self.linger_backstop_ms.map_or(d.linger_backstop, millis),
            threads_per_broker: self
                .threads_per_broker
                .map_or(d.threads_per_broker, |t| t as usize),
            queue_depth: self.queue_depth.map_or(d.queue_depth, |q| q as usize),
            max_inflight_batches: self
                .max_inflight_batches
                .map_or(d.max_inflight_batches, |m| m as usize),
            client_id: self.client_id.map(|c| u64_of("clientId", c)).transpose()?,
            session_key,
            flush_timeout: self.flush_timeout_ms.map_or(d.flush_timeout, millis),
            session_epoch: match self.session_epoch {
                Some(e) => u64_of("sessionEpoch", e)?,
                None => d.session_epoch,
            },
            deflect: self.deflect.unwrap_or(d.deflect),
            slow_queue,
            failover: self.failover.unwrap_or(d.failover),
            membership_refresh: self
                .membership_refresh_ms
                .map_or(d.membership_refresh, millis),
            max_joined_brokers: self
                .max_joined_brokers
                .map_or(d.max_joined_brokers, |m| m as usize),
            transport: crate::transport(self.transport)?,
            shm_ring_bytes: d.shm_ring_bytes,
        };
        Ok((cfg, self.brokers))
    }
}

/// Messages waiting for the drain job, and what the job left behind.
#[derive(Default)]
struct Stage {
    bytes: Vec<u8>,
    /// End offset in `bytes` of each staged message.
    ends: Vec<usize>,
    /// A drain job is running (at most one: it keeps the messages in order).
    draining: bool,
    /// The drain is handing a chunk it took to the Rust publisher (set and cleared under
    /// this lock): until it is done, nothing may be appended before its messages.
    publishing: bool,
    /// `close` has begun: nothing more is staged.
    closed: bool,
    /// Callers waiting for the drain to stop (`flush`, `close`): it does not linger then.
    awaiting_drain: usize,
    /// JavaScript waits until everything staged is in the publisher (`wake_when_handed`):
    /// the drain calls the waker once it is, or on an error, or when it stops.
    handed_wanted: bool,
    /// The first error a drain met; every later call reports it, as the Rust
    /// publisher reports its first error.
    error: Option<Error>,
}

struct Shared {
    /// Taken by `close` (which consumes the Rust publisher); drains clone the `Arc`.
    publisher: Mutex<Option<Arc<Publisher>>>,
    stage: Mutex<Stage>,
    /// Signalled whenever the drain takes a chunk or stops.
    progress: Condvar,
    /// Signalled when messages are staged (or a caller waits for the drain), for a
    /// drain lingering on an empty stage.
    staged: Condvar,
    max_message: usize,
    /// What `wake_when_handed` has the drain call (`set_waker`); taken by `close`.
    waker: Mutex<Option<Waker>>,
}

#[napi]
pub struct NativePublisher {
    shared: Arc<Shared>,
    client_id: u64,
    /// The statistics `close` returned, reported by `stats` from then on.
    final_stats: Arc<Mutex<Option<PublisherStats>>>,
}

/// Connects a publisher (discovering the brokers through `control` unless the config
/// names them).
#[napi]
pub async fn connect_publisher(
    control: String,
    topic: String,
    config: NativePublisherConfig,
) -> napi::Result<NativePublisher> {
    let topic_ack = config.ack_level.is_none();
    let (cfg, brokers) = config.into_client()?;
    let publisher = blocking(move || match brokers {
        Some(b) => Publisher::connect_brokers(&b, &topic, cfg),
        None => {
            let mut cfg = cfg;
            if topic_ack {
                cfg.ack_level = embarcadero_client::Admin::new(&control).default_ack(&topic)?;
            }
            Publisher::connect(&control, &topic, cfg)
        }
    })
    .await?;
    Ok(NativePublisher {
        client_id: publisher.client_id(),
        shared: Arc::new(Shared {
            max_message: publisher.max_message_bytes(),
            publisher: Mutex::new(Some(Arc::new(publisher))),
            stage: Mutex::new(Stage::default()),
            progress: Condvar::new(),
            staged: Condvar::new(),
            waker: Mutex::new(None),
        }),
        final_stats: Arc::default(),
    })
}

/// Stages `payloads` (all or none, so a too-large one refuses them all): appends here
/// what the publisher takes without waiting, copies the rest for the drain job. True when
/// anything is left staged: the caller then waits until the drain has handed it to the
/// publisher (`wake_when_handed`), as a blocking `publish` waits for room, so that its
/// next call finds the stage empty and appends here again (PERFORMANCE "Session 37":
/// a caller that went on staging kept the drain busy copying, its copies the slowest).
fn stage_all<'a>(
    shared: &Arc<Shared>,
    payloads: impl Iterator<Item = &'a [u8]> + Clone,
) -> napi::Result<bool> {
    let mut st = shared.stage.lock();
    check_open(&st).map_err(to_js)?;
    let max = shared.max_message;
    if let Some(p) = payloads.clone().find(|p| p.len() > max) {
        return Err(to_js(Error::MessageTooLarge { size: p.len(), max }));
    }
    // Nothing staged and no chunk being published: everything before is in the Rust
    // publisher, so this thread appends what it can without waiting, and stages only the
    // rest (one copy, where staging copies twice, and no thread in between).
    let appended = if st.ends.is_empty() && !st.publishing {
        append_here(shared, payloads.clone())?
    } else {
        0
    };
    for p in payloads.skip(appended) {
        st.bytes.extend_from_slice(p);
        let end = st.bytes.len();
        st.ends.push(end);
    }
    if st.ends.is_empty() {
        return Ok(false);
    }
    if st.draining {
        shared.staged.notify_one();
    } else {
        st.draining = true;
        let shared = shared.clone();
        napi::bindgen_prelude::spawn_blocking(move || drain(&shared));
    }
    Ok(true)
}

#[napi]
impl NativePublisher {
    /// A function that stages its arguments (each a Buffer) in one crossing, all or none,
    /// and returns true when some are left staged (the caller then waits until they are
    /// handed over: `wake_when_handed`). Read once per publisher. Arguments, not an array:
    /// napi reads an array's elements one `napi_get_element` at a time, a generic property
    /// lookup; with the buffer lookups the array's conversion was about 23% of the
    /// JavaScript thread's time in a `publishMany` loop, the arguments' 12% (a call's
    /// arguments come in one `napi_get_cb_info`; docs/PERFORMANCE.md, "Session 37"). And a
    /// bound function, not a method: napi-rs unwraps and registers a borrow of a method's
    /// `this` on every call, three quarters of a 1 KiB `publish` (session 26).
    #[napi(getter, ts_return_type = "(...payloads: Buffer[]) => boolean")]
    pub fn stage<'e>(&self, env: &'e Env) -> napi::Result<Function<'e, (), bool>> {
        let shared = self.shared.clone();
        env.create_function_from_closure("stage", move |call| {
            let payloads = call.arguments::<BufferSlice>()?;
            stage_all(&shared, payloads.iter().map(|p| &p[..]))
        })
    }

    /// As [`NativePublisher::stage`], for an array too long to pass as arguments (each
    /// takes a slot of the JavaScript stack).
    #[napi(getter, ts_return_type = "(payloads: Buffer[]) => boolean")]
    pub fn stage_array<'e>(&self, env: &'e Env) -> napi::Result<Function<'e, (), bool>> {
        let shared = self.shared.clone();
        env.create_function_from_closure("stageArray", move |call| {
            let payloads = call.first_arg::<Vec<BufferSlice>>()?;
            stage_all(&shared, payloads.iter().map(|p| &p[..]))
        })
    }

    /// The function `wake_when_handed` has the drain call (on the event loop's thread,
    /// with no arguments).
    #[napi]
    pub fn set_waker(&self, waker: ThreadsafeFunction<(), (), (), Status, false, true>) {
        *self.shared.waker.lock() = Some(waker);
    }

    /// Whether something staged is not yet in the Rust publisher: then the drain calls the
    /// waker once it all is, or on an error, or when it stops, and JavaScript waits on a
    /// promise, holding no thread (a wait on the blocking pool held one, and 512 waiting
    /// publishers would have held them all, their drains queued behind). Throws the error
    /// a drain met.
    #[napi]
    pub fn wake_when_handed(&self) -> napi::Result<bool> {
        let mut st = self.shared.stage.lock();
        if let Some(e) = &st.error {
            return Err(to_js(e.clone()));
        }
        let pending = !st.ends.is_empty() || st.publishing;
        // An error, not an assertion: a panic here would abort the user's process (napi-rs
        // catches none in a synchronous method), and a wait for no drain would never end.
        if pending && !st.draining {
            return Err(napi::Error::from_reason(
                "internal error: messages staged without a drain job",
            ));
        }
        st.handed_wanted |= pending;
        Ok(pending)
    }

    /// Everything published so far handed to the Rust publisher, then its `flush`.
    #[napi]
    pub async fn flush(&self) -> napi::Result<()> {
        let shared = self.shared.clone();
        blocking(move || {
            wait_drained(&shared)?;
            let publisher = shared.publisher.lock().clone().ok_or(Error::Closed)?;
            publisher.flush()
        })
        .await
    }

    /// Refuses further messages, publishes the staged ones, then closes the Rust
    /// publisher (flush and disconnect) and returns its statistics.
    #[napi]
    pub async fn close(&self) -> napi::Result<Value> {
        let shared = self.shared.clone();
        {
            let mut st = shared.stage.lock();
            if st.closed {
                return Err(to_js(Error::Closed));
            }
            st.closed = true;
        }
        let final_stats = self.final_stats.clone();
        let client_id = self.client_id;
        blocking(move || {
            let drained = wait_drained(&shared);
            // After the drain's last wake (queued under the stage's lock before it stopped).
            drop(shared.waker.lock().take());
            let publisher = take_sole(&shared).ok_or(Error::Closed)?;
            let stats = publisher.close()?;
            drained?;
            *final_stats.lock() = Some(stats.clone());
            Ok(stats_json(&stats, client_id))
        })
        .await
    }

    /// Counters and latency summaries (those `close` returned, once closed).
    #[napi]
    pub fn stats(&self) -> Value {
        if let Some(stats) = self.final_stats.lock().as_ref() {
            return stats_json(stats, self.client_id);
        }
        let publisher = self.shared.publisher.lock().clone();
        match publisher {
            Some(p) => stats_json(&p.stats(), self.client_id),
            // Between `close` taking the publisher and storing its statistics.
            None => Value::Null,
        }
    }

    #[napi(getter)]
    pub fn client_id(&self) -> BigInt {
        BigInt::from(self.client_id)
    }

    #[napi(getter)]
    pub fn max_message_bytes(&self) -> u32 {
        self.shared.max_message.min(u32::MAX as usize) as u32
    }
}

/// Appends on this thread what the Rust publisher takes without waiting
/// (`Publisher::try_publish_all`); how many.
fn append_here<'a>(
    shared: &Shared,
    payloads: impl Iterator<Item = &'a [u8]>,
) -> napi::Result<usize> {
    let Some(publisher) = shared.publisher.lock().clone() else {
        return Ok(0);
    };
    let payloads: Vec<&[u8]> = payloads.collect();
    publisher.try_publish_all(&payloads).map_err(to_js)
}

fn check_open(st: &Stage) -> Result<(), Error> {
    if let Some(e) = &st.error {
        return Err(e.clone());
    }
    if st.closed {
        return Err(Error::Closed);
    }
    Ok(())
}

/// The drain job: hands staged chunks to the Rust publisher until none is left.
fn drain(shared: &Shared) {
    let mut chunk = (Vec::new(), Vec::new());
    loop {
        {
            let mut st = shared.stage.lock();
            if st.ends.is_empty() && !st.closed && st.awaiting_drain == 0 {
                // A drain that stops is started again by the next call that stages, a hop
                // through the blocking pool; a caller whose queues are still full stages
                // again within a millisecond, so a short wait keeps the drain for it.
                shared.staged.wait_for(&mut st, DRAIN_LINGER);
            }
            if st.ends.is_empty() {
                st.draining = false;
                shared.progress.notify_all();
                wake_if_handed(shared, &mut st);
                return;
            }
            // Swap in the emptied buffers of the previous chunk (no new allocation).
            chunk.0.clear();
            chunk.1.clear();
            std::mem::swap(&mut st.bytes, &mut chunk.0);
            std::mem::swap(&mut st.ends, &mut chunk.1);
            st.publishing = true;
            shared.progress.notify_all();
        }
        let published = publish_chunk(shared, &chunk.0, &chunk.1);
        let mut st = shared.stage.lock();
        st.publishing = false;
        if let Err(e) = published {
            st.error.get_or_insert(e);
            st.bytes.clear();
            st.ends.clear();
            st.draining = false;
            shared.progress.notify_all();
            wake_if_handed(shared, &mut st);
            return;
        }
        wake_if_handed(shared, &mut st);
    }
}

/// Calls the waker if JavaScript waits for everything staged to be in the publisher and
/// it is, or the drain failed or stops (`wake_when_handed`). Under the stage's lock, so a
/// wait asked for is never missed; the call only queues.
fn wake_if_handed(shared: &Shared, st: &mut Stage) {
    let handed = st.ends.is_empty() && !st.publishing;
    if st.handed_wanted && (handed || st.error.is_some() || !st.draining) {
        st.handed_wanted = false;
        if let Some(waker) = shared.waker.lock().as_ref() {
            waker.call((), ThreadsafeFunctionCallMode::NonBlocking);
        }
    }
}

fn publish_chunk(shared: &Shared, bytes: &[u8], ends: &[usize]) -> Result<(), Error> {
    let publisher = shared.publisher.lock().clone().ok_or(Error::Closed)?;
    let mut start = 0;
    let mut group = Vec::with_capacity(GROUP.min(ends.len()));
    for ends in ends.chunks(GROUP) {
        group.clear();
        for &end in ends {
            group.push(&bytes[start..end]);
            start = end;
        }
        publisher.publish_all(&group)?;
    }
    Ok(())
}

/// Waits until the drain job has published everything staged (or failed).
fn wait_drained(shared: &Shared) -> Result<(), Error> {
    let mut st = shared.stage.lock();
    st.awaiting_drain += 1;
    shared.staged.notify_all();
    while st.draining {
        shared.progress.wait(&mut st);
    }
    st.awaiting_drain -= 1;
    st.error.clone().map_or(Ok(()), Err)
}

/// The publisher itself, once no drain or `stats` call holds a clone of it (they hold
/// it only for a call; nothing is staged any more when this runs).
fn take_sole(shared: &Shared) -> Option<Publisher> {
    let mut arc = shared.publisher.lock().take()?;
    loop {
        match Arc::try_unwrap(arc) {
            Ok(p) => return Some(p),
            Err(again) => {
                arc = again;
                std::thread::yield_now();
            }
        }
    }
}

/// The statistics as JSON, the client id as a decimal string (it is a u64, and the
/// TypeScript layer makes a bigint of it).
fn stats_json(stats: &PublisherStats, client_id: u64) -> Value {
    let mut v = serde_json::to_value(stats).expect("stats serialise");
    v["client_id"] = Value::String(client_id.to_string());
    v["session_epoch"] = Value::String(stats.session_epoch.to_string());
    v
}
