//! `NativeSubscriber`: a Rust `Subscriber` that a thread of its own polls ahead
//! (`embarcadero_client::ReadAhead`), one poll of messages per crossing: JavaScript takes a
//! poll that is ready without leaving its thread (`takeBatch`), and when none is, waits on a
//! promise the reading thread resolves (`wakeWhenReady`). No payload is copied: each delivery buffer the
//! Rust subscriber lends (`Subscriber::poll_shared`) becomes a Node `Buffer` that views it and keeps it
//! alive (its finalizer drops the Rust owner, after which the subscriber reuses the
//! buffer). What JavaScript needs to find each message is packed compactly: per message
//! only where its payload lies (two u32s); per run of messages from one delivery, the
//! fields they share (broker, batch, client, first position and index); the counter and
//! publish time stay in the message headers inside the delivery, where the TypeScript
//! layer reads them when asked. It builds `Message` objects over these lazily.

use crate::error::config;
use crate::{blocking, Waker};
use embarcadero_client::{
    Admin, Collect, Cursor, Error, MessageRef, Polled, ReadAhead, SharedBatch, Subscriber,
    SubscriberConfig,
};
use embarcadero_wire::MESSAGE_HEADER_LEN;
use napi::bindgen_prelude::{
    ArrayBuffer, BigInt, BigUint64Array, BufferSlice, External, Float64Array, JsValue, ToNapiValue,
    TypeName, Uint32Array,
};
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};
use napi::{sys, Env, Status, ValueType};
use napi_derive::napi;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Numbers per message in `NativeBatch::spans`: payload offset and payload length, in
/// bytes within its delivery.
pub const SPAN_FIELDS: usize = 2;
/// Numbers per run in `NativeBatch::runs`: which of `NativeBatch::data` the run's messages
/// are in, its first message (an index into the poll's messages), first position, broker
/// id, batch seq, and index in batch of its first message. A run is a stretch of messages
/// of one delivery with consecutive positions and indexes in batch: a delivery is one
/// batch, so a run is usually a whole delivery.
pub const RUN_FIELDS: usize = 6;
/// Where the publisher's counter and publish time lie in a message header
/// (`BlogMessageHeader`, crates/wire/src/message.rs), relative to the start of the
/// payload that follows it: the TypeScript layer reads them from the delivery.
#[napi]
pub const COUNTER_FROM_PAYLOAD: i32 = 16 - MESSAGE_HEADER_LEN as i32;
#[napi]
pub const PUBLISH_TS_FROM_PAYLOAD: i32 = 8 - MESSAGE_HEADER_LEN as i32;

/// A poll hands JavaScript deliveries until they hold this many bytes (whole deliveries,
/// at least one; the usual delivery is a 512 KiB batch). Small on purpose: JavaScript
/// keeps every delivery of a poll until it has read the poll's last message, and
/// V8 frees a delivery's `Buffer` at a young-generation collection only if it died
/// before surviving two of them; deliveries of a poll of many MiB lived through several,
/// were promoted, and came back to the subscriber only at a full collection, so it read
/// into 64-128 MiB of fresh pages first (page faults; a cold cache). One delivery per
/// poll cut faults per MB from 76-78 to 17-18 and CPU per GB by about a fifth
/// (docs/PERFORMANCE.md, "Session 22"); the crossing it adds per 512 KiB costs less.
const GATHER_BYTES: usize = 512 << 10;
/// The poll size while JavaScript reads by `pollBatch`: a `MessageBatch` that is released
/// gives its deliveries back at once, so larger polls cost no promotion, and they halve
/// the crossings and hand-offs per GB (PERFORMANCE.md, "Session 35").
const BATCH_GATHER_BYTES: usize = 1 << 20;
/// Polls the thread reads ahead before it waits for JavaScript to take one (4 MiB of the
/// usual deliveries, held by the read-ahead, away from the subscriber's buffer reuse).
const READ_AHEAD: usize = 8;
/// While JavaScript reads by batches on its own thread, it does so only while it holds at
/// most this many bytes of earlier polls; past that, it waits for the reading thread's
/// polls, and so for the event loop, which is where Node runs the finalizers that give
/// deliveries back. Without it, a caller that keeps its batches (no `release`) in a loop
/// that never yields would have the subscriber read into new buffers without end.
const MAX_HELD_READING_HERE: usize = 32 << 20;

/// A position in a topic as JavaScript passes it: one global position (orders 2, 5),
/// one per broker (orders 0, 1), or the end of the topic when the call is made.
#[napi(object)]
pub struct NativeCursor {
    pub global: Option<f64>,
    pub per_broker: Option<Vec<f64>>,
    pub end: Option<bool>,
}

#[napi(object)]
pub struct NativeSubscriberConfig {
    pub start: Option<NativeCursor>,
    pub client_id: Option<BigInt>,
    pub max_reconnects: Option<u32>,
    /// `SubscriberConfig::retry_for`, in milliseconds.
    pub retry_for_ms: Option<f64>,
    /// Read from these broker addresses directly instead of asking the control plane.
    pub brokers: Option<Vec<String>>,
    /// `"auto"` (the default), `"tcp"` or `"shm"`: `SubscriberConfig::transport`.
    pub transport: Option<String>,
}

/// Messages delivered by one poll.
#[napi(object, object_from_js = false)]
pub struct NativeBatch {
    pub count: u32,
    /// The deliveries the messages are in, each viewed without a copy.
    #[napi(ts_type = "Buffer[]")]
    pub data: LentBuffers,
    /// The Rust owners of `data`'s deliveries, for `detach_deliveries`.
    #[napi(ts_type = "ExternalObject<'Lease'>")]
    pub lease: External<Lease>,
    /// `SPAN_FIELDS` per message.
    pub spans: Uint32Array,
    /// `RUN_FIELDS` per run of messages, in order.
    pub runs: Float64Array,
    /// The client id of each run.
    pub clients: BigUint64Array,
    /// The subscriber's position after the last of these messages.
    pub next: NativeCursor,
}

/// Where a subscriber starts, resolved before any blocking work.
enum Start {
    From(Option<Cursor>),
    End,
}

fn start_of(c: Option<NativeCursor>) -> napi::Result<Start> {
    let Some(c) = c else {
        return Ok(Start::From(None));
    };
    match (c.global, c.per_broker, c.end) {
        (_, _, Some(true)) => Ok(Start::End),
        (Some(p), None, _) => Ok(Start::From(Some(Cursor::Global(position(p)?)))),
        (None, Some(v), _) => {
            let v = v.into_iter().map(position).collect::<napi::Result<_>>()?;
            Ok(Start::From(Some(Cursor::PerBroker(v))))
        }
        (None, None, _) => Ok(Start::From(None)),
        (Some(_), Some(_), _) => Err(config(
            "give one global position or one per broker, not both",
        )),
    }
}

/// `cursor` in the form the topic's order needs, or a `ConfigError` that says which (the
/// CLI's words for `--from`, in this package's syntax).
fn fitted(sub: &Subscriber, topic: &str, cursor: Cursor) -> Result<Cursor, Error> {
    sub.fit(cursor)
        .map_err(|m| Error::Config(m.explain(topic, "from", from_option)))
}

/// `cursor` as the `from` option takes it.
fn from_option(cursor: &Cursor) -> String {
    match cursor {
        Cursor::Global(p) => format!("from: {p}"),
        Cursor::PerBroker(v) => format!("from: {v:?}"),
    }
}

fn position(p: f64) -> napi::Result<u64> {
    if p.is_finite() && p >= 0.0 && p.fract() == 0.0 && p <= 9_007_199_254_740_991.0 {
        Ok(p as u64)
    } else {
        Err(config(format!(
            "position {p}: positions count from 0 at the start of the topic and are whole numbers"
        )))
    }
}

fn js_cursor(c: &Cursor) -> NativeCursor {
    match c {
        Cursor::Global(p) => NativeCursor {
            global: Some(*p as f64),
            per_broker: None,
            end: None,
        },
        Cursor::PerBroker(v) => NativeCursor {
            global: None,
            per_broker: Some(v.iter().map(|&p| p as f64).collect()),
            end: None,
        },
    }
}

/// The position after the last message of the topic now: the next global position
/// (orders 2, 5), or each broker's count of messages written (orders 0, 1); as the
/// CLI's `sub --from end` finds it.
fn end_of_topic(control: &str, topic: &str, sub: &Subscriber) -> Result<Cursor, Error> {
    let info = Admin::new(control).describe_topic(topic)?;
    if sub.order() >= 2 {
        return Ok(Cursor::Global(info.next_position));
    }
    let ends: Vec<u64> = info.brokers.iter().map(|b| b.messages).collect();
    if ends.is_empty() {
        return Err(Error::Config(format!(
            "the server did not describe the end of each broker's log of topic {topic}; \
             start from one position per broker instead"
        )));
    }
    Ok(Cursor::PerBroker(ends))
}

#[napi]
pub struct NativeSubscriber {
    /// The subscriber and its read-ahead thread (which also keeps what the subscriber
    /// last said of itself, for the getters, without waiting for a poll under way).
    reader: Arc<ReadAhead<Packed>>,
    order: u8,
    start: Cursor,
    /// The JavaScript function `wake_when_ready` has the reading thread call (`set_waker`).
    waker: parking_lot::Mutex<Option<Arc<Waker>>>,
    /// Whether JavaScript reads by batches (`read_batches`): `take_batch` then reads on the
    /// JavaScript thread what has arrived (`ReadAhead::try_read_here`).
    batches: AtomicBool,
}

/// The skipped range `[from, to)` as JavaScript gets it.
#[napi(object)]
pub struct NativeSkipped {
    pub from: f64,
    pub to: f64,
}

/// Connects a subscriber and places it at its start.
#[napi]
pub async fn connect_subscriber(
    control: String,
    topic: String,
    config: NativeSubscriberConfig,
) -> napi::Result<NativeSubscriber> {
    let start = start_of(config.start)?;
    let client_id = match config.client_id {
        Some(c) => {
            let (signed, v, lossless) = c.get_u64();
            if signed || !lossless {
                return Err(crate::error::config(
                    "clientId must be an unsigned 64-bit integer",
                ));
            }
            Some(v)
        }
        None => None,
    };
    let cfg = SubscriberConfig {
        // A position is fitted to the topic's order once the broker has said which.
        start: None,
        client_id,
        max_reconnects: config
            .max_reconnects
            .unwrap_or(SubscriberConfig::default().max_reconnects),
        transport: crate::transport(config.transport)?,
        retry_for: config.retry_for_ms.map(crate::millis),
    };
    let brokers = config.brokers;
    let sub = blocking(move || {
        let mut sub = match brokers {
            Some(b) => Subscriber::connect_brokers(&b, &topic, cfg)?,
            None => Subscriber::connect(&control, &topic, cfg)?,
        };
        match start {
            Start::From(None) => {}
            Start::From(Some(c)) => {
                let c = fitted(&sub, &topic, c)?;
                sub.seek(c)?;
            }
            Start::End => {
                let end = end_of_topic(&control, &topic, &sub)?;
                sub.seek(end)?;
            }
        }
        Ok(sub)
    })
    .await?;
    Ok(NativeSubscriber {
        waker: parking_lot::Mutex::new(None),
        batches: AtomicBool::new(false),
        order: sub.order(),
        start: Subscriber::position(&sub),
        reader: Arc::new(ReadAhead::new(sub, READ_AHEAD, GATHER_BYTES)),
    })
}

#[napi]
impl NativeSubscriber {
    /// The topic's order level.
    #[napi(getter)]
    pub fn order(&self) -> u8 {
        self.order
    }

    /// Where the subscriber was placed when it connected.
    #[napi(getter)]
    pub fn start(&self) -> NativeCursor {
        js_cursor(&self.start)
    }

    /// Orders 2 and 5, a subscriber from the beginning: the positions `[from, to)` that
    /// were reclaimed before its start (`Subscriber::skipped`); `None` if nothing was.
    #[napi]
    pub fn skipped(&self) -> Option<NativeSkipped> {
        self.reader
            .status()
            .skipped
            .map(|(from, to)| NativeSkipped {
                from: from as f64,
                to: to as f64,
            })
    }

    /// How the current connection reaches its broker: "tcp", "shm", or "none" between
    /// connections (`Subscriber::transport`).
    #[napi(getter)]
    pub fn transport(&self) -> &'static str {
        self.reader.status().transport
    }

    /// Whether JavaScript reads by batches (`pollBatch`): the polls read from now on are
    /// sized for it (`BATCH_GATHER_BYTES`) or for messages one at a time (`GATHER_BYTES`),
    /// and by batches `take_batch` reads on the JavaScript thread what a shared-memory feed
    /// holds already, where one at a time the thread reads ahead (docs/DESIGN.md, "Reading
    /// on the caller's thread").
    #[napi]
    pub fn read_batches(&self, batches: bool) {
        let bytes = if batches {
            BATCH_GATHER_BYTES
        } else {
            GATHER_BYTES
        };
        self.reader.set_poll_bytes(bytes);
        self.batches.store(batches, Ordering::Relaxed);
        self.reader.set_caller_reads(batches);
    }

    /// The next poll's messages if one has been read ahead or, reading by batches, has
    /// arrived; never waits: `None` when none is ready yet (JavaScript then waits for the
    /// reading thread, `wake_when_ready`).
    #[napi]
    pub fn take_batch(&self) -> napi::Result<Option<NativeBatch>> {
        let polled = if self.batches.load(Ordering::Relaxed) {
            self.reader.try_read_here(MAX_HELD_READING_HERE)
        } else {
            self.reader.try_next()
        };
        match polled {
            None => Ok(None),
            Some(polled) => taken(polled).map_err(crate::error::to_js),
        }
    }

    /// The function `wake_when_ready` calls (on the event loop's thread, with no
    /// arguments) once a poll can be taken.
    // The type is spelled out: napi's type generator does not follow aliases.
    #[napi]
    #[allow(clippy::type_complexity)]
    pub fn set_waker(&self, waker: ThreadsafeFunction<(), (), (), Status, false, true>) {
        *self.waker.lock() = Some(Arc::new(waker));
    }

    /// When `take_batch` found nothing: has the reading thread call the waker once the next
    /// poll (or its error) is queued, or the subscriber stops. False when one is ready
    /// already (take it), or when no waker was set. JavaScript then waits on a promise,
    /// not on a thread of the blocking pool: one wake-up per poll instead of two, and no
    /// pool thread (PERFORMANCE.md, "Session 35").
    #[napi]
    pub fn wake_when_ready(&self) -> bool {
        let Some(waker) = self.waker.lock().clone() else {
            return false;
        };
        self.reader.wake_when_ready(move || {
            // NonBlocking: the queue is unbounded, and this thread must not wait on JavaScript.
            waker.call((), ThreadsafeFunctionCallMode::NonBlocking);
        })
    }

    /// Continues from `cursor` (`end`: the end of the topic now), dropping what was read
    /// ahead; returns where the next message will come from.
    #[napi]
    pub async fn seek(
        &self,
        control: String,
        topic: String,
        cursor: NativeCursor,
    ) -> napi::Result<NativeCursor> {
        let reader = self.reader.clone();
        let start = start_of(Some(cursor))?;
        blocking(move || {
            let cursor = match start {
                Start::From(Some(c)) => reader.with_sub(|s| fitted(s, &topic, c))?,
                // No position: the start, the first message still retained.
                Start::From(None) => return Ok(js_cursor(&reader.seek_start()?)),
                Start::End => reader.with_sub(|s| end_of_topic(&control, &topic, s))?,
            };
            Ok(js_cursor(&reader.seek(cursor)?))
        })
        .await
    }

    /// Disconnects (once any poll under way has returned).
    #[napi]
    pub async fn close(&self) -> napi::Result<()> {
        let reader = self.reader.clone();
        // The waker goes after the close has called any wake pending (which holds a clone).
        let waker = self.waker.lock().take();
        blocking(move || {
            reader.close();
            drop(waker);
            Ok(())
        })
        .await
    }
}

/// A poll taken from the read-ahead, for JavaScript: its messages packed (`None` if it
/// brought none).
fn taken(polled: Result<Polled<Packed>, Error>) -> Result<Option<NativeBatch>, Error> {
    let Polled { messages, next } = polled?;
    Ok(messages.into_batch(&next))
}

/// Messages of one poll, packed for JavaScript.
#[derive(Default)]
struct Packed {
    /// The deliveries the messages are in, in order; each once.
    batches: Vec<SharedBatch>,
    bytes: usize,
    count: usize,
    spans: Vec<u32>,
    runs: Vec<f64>,
    clients: Vec<u64>,
    /// What the next message must have to continue the last run: delivery, broker, batch
    /// seq, client, position, index in batch.
    follows: Option<(usize, u16, u64, u64, u64, u32)>,
}

impl Collect for Packed {
    fn collect(&mut self, batch: &SharedBatch, m: MessageRef<'_>) {
        self.push(batch, &m);
    }

    fn count(&self) -> usize {
        self.count
    }

    /// Each message's broker and position, from its run's first position and broker.
    fn positions(&self) -> Vec<(u16, u64)> {
        let runs: Vec<&[f64]> = self.runs.chunks(RUN_FIELDS).collect();
        let mut out = Vec::with_capacity(self.count);
        for (r, run) in runs.iter().enumerate() {
            let end = runs.get(r + 1).map_or(self.count, |n| n[1] as usize);
            let (first, position, broker) = (run[1] as usize, run[2] as u64, run[3] as u16);
            out.extend((0..end - first).map(|k| (broker, position + k as u64)));
        }
        out
    }
}

impl Packed {
    fn push(&mut self, batch: &SharedBatch, m: &MessageRef<'_>) {
        let same = |b: &SharedBatch| b.as_mut_ptr() == batch.as_mut_ptr();
        if !self.batches.last().is_some_and(same) {
            self.bytes += batch.len();
            self.batches.push(batch.clone());
        }
        let delivery = self.batches.len() - 1;
        let key = (delivery, m.broker_id, m.batch_seq, m.client_id);
        let expected = (key.0, key.1, key.2, key.3, m.position, m.index_in_batch);
        if self.follows != Some(expected) {
            self.runs.extend_from_slice(&[
                delivery as f64,
                self.count as f64,
                m.position as f64,
                m.broker_id as f64,
                m.batch_seq as f64,
                m.index_in_batch as f64,
            ]);
            self.clients.push(m.client_id);
        }
        self.follows = Some((
            key.0,
            key.1,
            key.2,
            key.3,
            m.position + 1,
            m.index_in_batch + 1,
        ));
        let range = batch.range_of(m.payload);
        // A delivery is at most MAX_DELIVERY_BYTES (256 MiB), checked when it was read, and
        // every payload lies after its header within it (`range_of` asserts the latter).
        let start = u32::try_from(range.start).expect("a delivery is under 4 GiB");
        assert!(
            start as usize >= MESSAGE_HEADER_LEN,
            "a payload follows its header"
        );
        self.spans.extend_from_slice(&[start, range.len() as u32]);
        self.count += 1;
    }

    /// The messages as JavaScript takes them; `None` if there are none.
    fn into_batch(self, next: &Cursor) -> Option<NativeBatch> {
        if self.count == 0 {
            return None;
        }
        assert_eq!(self.spans.len(), self.count * SPAN_FIELDS);
        assert_eq!(self.runs.len(), self.clients.len() * RUN_FIELDS);
        let lent: Vec<Arc<Lent>> = self.batches.into_iter().map(Lent::new).collect();
        Some(NativeBatch {
            count: self.count as u32,
            data: LentBuffers(lent.clone()),
            lease: External::new(Lease(lent)),
            spans: self.spans.into(),
            runs: self.runs.into(),
            clients: self.clients.into(),
            next: js_cursor(next),
        })
    }
}

/// A delivery lent to JavaScript: its `Buffer`'s finalizer owns it, and so does the poll's
/// [`Lease`], through which `detach_deliveries` gives it back as soon as it has detached
/// that `Buffer` (the finalizer runs only at a later turn of the event loop).
pub struct Lent {
    /// Where its bytes start: how `detach_deliveries` knows an `ArrayBuffer` for it.
    at: usize,
    /// `None` once given back.
    batch: parking_lot::Mutex<Option<SharedBatch>>,
}

impl Lent {
    fn new(batch: SharedBatch) -> Arc<Self> {
        Arc::new(Self {
            at: batch.as_mut_ptr() as usize,
            batch: parking_lot::Mutex::new(Some(batch)),
        })
    }
}

/// The deliveries of one poll, as JavaScript holds them beside their `Buffer`s.
pub struct Lease(Vec<Arc<Lent>>);

/// Delivery buffers lent by the Rust subscriber, on their way to JavaScript: each
/// becomes a `Buffer` over its bytes that owns it until JavaScript lets go.
pub struct LentBuffers(Vec<Arc<Lent>>);

impl TypeName for LentBuffers {
    fn type_name() -> &'static str {
        "Buffer[]"
    }

    fn value_type() -> ValueType {
        ValueType::Object
    }
}

impl ToNapiValue for LentBuffers {
    unsafe fn to_napi_value(raw_env: sys::napi_env, val: Self) -> napi::Result<sys::napi_value> {
        let env = Env::from_raw(raw_env);
        let mut array = std::ptr::null_mut();
        // SAFETY: `raw_env` is the live env napi-rs converts this value in (the trait's
        // contract), and `array` is a valid out-pointer.
        let status =
            unsafe { sys::napi_create_array_with_length(raw_env, val.0.len(), &mut array) };
        napi::check_status!(status, "cannot make the array of deliveries")?;
        for (i, batch) in val.0.into_iter().enumerate() {
            let buffer = external_buffer(&env, batch)?;
            // SAFETY: as above; `buffer` is a value of this env, `array` has room for i.
            let status = unsafe { sys::napi_set_element(raw_env, array, i as u32, buffer) };
            napi::check_status!(status, "cannot fill the array of deliveries")?;
        }
        Ok(array)
    }
}

/// Detaches each of `deliveries` (the `ArrayBuffer`s of delivery `Buffer`s of the poll
/// `lease` came with), then gives its Rust owner back: every view of one has length 0
/// from then on, so nothing can read the bytes, and the subscriber reuses the buffer at
/// its next read, while it is still in the cache (`MessageBatch.release`), rather than
/// after the finalizer, which Node runs at a later turn of the event loop (a caller that
/// reads without yielding would never let it run). One already detached is left as it
/// is; one whose bytes are not a delivery of this lease (a copy) is left to the collector.
#[napi(ts_args_type = "deliveries: ArrayBuffer[], lease: ExternalObject<'Lease'>")]
pub fn detach_deliveries(
    deliveries: Vec<ArrayBuffer<'_>>,
    lease: &External<Lease>,
) -> napi::Result<()> {
    for delivery in deliveries {
        if delivery.is_detached()? {
            continue;
        }
        // None for a copy napi-rs made (its owner was given back when it was made).
        let at = delivery.as_ptr() as usize;
        let Some(lent) = lease.0.iter().find(|l| l.at == at) else {
            continue;
        };
        delivery.detach()?;
        // Detached: no view of these bytes is left in JavaScript, so they may be reused.
        drop(lent.batch.lock().take());
    }
    Ok(())
}

/// A `Buffer` viewing `lent`'s bytes, which it owns: its finalizer drops `lent`.
fn external_buffer(env: &Env, lent: Arc<Lent>) -> napi::Result<sys::napi_value> {
    let (data, len) = {
        let batch = lent.batch.lock();
        let batch = batch
            .as_ref()
            .expect("a delivery is given back only once detached");
        // A pointer that may be written through: JavaScript can write into any `Buffer`.
        (batch.as_mut_ptr(), batch.len())
    };
    assert!(len > 0, "a delivery with messages has bytes");
    // SAFETY: `data..data + len` is the heap buffer of `lent`'s batch, which lives until
    // the finalizer drops its clone of `lent` (when the `Buffer` is collected) and the
    // lease's goes or is emptied by `detach_deliveries` (only once it has detached this
    // `Buffer`'s `ArrayBuffer`, after which no view can reach the bytes), so the memory
    // outlives every view of it. JavaScript may write it (the README asks it not to;
    // nothing stops it), which `SharedBatch::as_mut_ptr` allows because the bytes are in
    // `UnsafeCell`s, on its conditions: the `poll_shared` that lent the batch has returned
    // (this runs after the poll, on the JavaScript thread); no Rust code reads these bytes
    // while the `Buffer` lives (the lease and the finalizer only drop their holds, and the
    // subscriber keeps a clone only to see when it is dropped, reading nothing); and only the JavaScript thread touches them, so nothing races. The subscriber
    // reuses the buffer only once the last clone is dropped.
    let owner = lent.clone();
    let buffer =
        unsafe { BufferSlice::from_external(env, data, len, owner, |_, owner| drop(owner)) }?;
    if buffer.as_ptr() != data.cast_const() {
        // External buffers not allowed (some runtimes): napi-rs copied the bytes and dropped
        // the `Buffer`'s owner already; the lease's is not needed either.
        drop(lent.batch.lock().take());
    }
    // No `napi_adjust_external_memory`: V8 counts an external `ArrayBuffer`'s bytes as
    // external memory by itself (`process.memoryUsage().external` shows them without it),
    // so telling it again counted every delivery twice, and its full collections, which
    // external memory paces, came twice as often: a quarter of a profile's samples were
    // marking and sweeping, and CPU per GB fell by a third without it (docs/PERFORMANCE.md).
    Ok(buffer.raw())
}
