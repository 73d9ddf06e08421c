//! `NativeSubscriber`: a Rust `Subscriber` polled on the blocking pool, one batch of
//! messages per crossing. Each poll copies the delivered payloads once, back to back,
//! into one buffer that becomes a Node `Buffer` without a further copy, and packs the
//! per-message fields into two typed arrays (numbers, and the u64s JavaScript needs as
//! bigints); the TypeScript layer builds `Message` objects over them lazily.

use crate::blocking;
use crate::error::config;
use embarcadero_client::{Admin, Cursor, Error, MessageRef, Subscriber, SubscriberConfig};
use napi::bindgen_prelude::{BigInt, BigUint64Array, Buffer, Float64Array};
use napi_derive::napi;
use parking_lot::Mutex;
use std::sync::Arc;

/// Numbers per message in `NativeBatch::nums`: position, batch seq, broker id, index in
/// batch, payload offset, payload length, counter.
pub const NUMS_PER_MESSAGE: usize = 7;
/// Bigints per message in `NativeBatch::bigs`: client id, publish time (ns).
pub const BIGS_PER_MESSAGE: usize = 2;

/// A poll hands JavaScript up to this many payload bytes at once (more when one
/// delivery is larger).
const GATHER_BYTES: usize = 4 << 20;
/// How long a poll that has messages waits for the next delivery to gather it too:
/// long enough to take what is already in the socket, short enough not to hold up
/// a reader at the tail of the topic.
const GATHER_WAIT: std::time::Duration = std::time::Duration::from_micros(100);

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
    /// Read from these broker addresses directly instead of asking the control plane.
    pub brokers: Option<Vec<String>>,
}

/// Messages delivered by one poll.
#[napi(object)]
pub struct NativeBatch {
    pub count: u32,
    pub data: Buffer,
    pub nums: Float64Array,
    pub bigs: BigUint64Array,
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
    /// `None` once closed. Polls hold the lock while they wait, off the JS thread.
    inner: Arc<Mutex<Option<Subscriber>>>,
    order: u8,
    start: Cursor,
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
        start: match &start {
            Start::From(c) => c.clone(),
            Start::End => None,
        },
        client_id,
        max_reconnects: config
            .max_reconnects
            .unwrap_or(SubscriberConfig::default().max_reconnects),
    };
    let brokers = config.brokers;
    let sub = blocking(move || {
        let mut sub = match brokers {
            Some(b) => Subscriber::connect_brokers(&b, &topic, cfg)?,
            None => Subscriber::connect(&control, &topic, cfg)?,
        };
        if let Start::End = start {
            let end = end_of_topic(&control, &topic, &sub)?;
            sub.seek(end)?;
        }
        Ok(sub)
    })
    .await?;
    Ok(NativeSubscriber {
        order: sub.order(),
        start: Subscriber::position(&sub),
        inner: Arc::new(Mutex::new(Some(sub))),
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

    /// Waits up to `timeout_ms` for messages; `None` when none came.
    #[napi]
    pub async fn poll_batch(&self, timeout_ms: f64) -> napi::Result<Option<NativeBatch>> {
        let inner = self.inner.clone();
        let timeout = crate::millis(timeout_ms);
        blocking(move || {
            let mut guard = inner.lock();
            let sub = guard.as_mut().ok_or(Error::Closed)?;
            let mut packed = Packed::default();
            // Whatever else has already arrived comes along (up to GATHER_BYTES): a
            // crossing back to JavaScript costs two thread hand-offs, which on a busy
            // machine cost far more than the messages of one batch.
            let mut more = sub.poll_with(timeout, |m| packed.push(&m))?;
            while more > 0 && packed.data.len() < GATHER_BYTES {
                more = sub.poll_with(GATHER_WAIT, |m| packed.push(&m))?;
            }
            Ok(packed.finish(&Subscriber::position(sub)))
        })
        .await
    }

    /// Continues from `cursor` (`end`: the end of the topic now).
    #[napi]
    pub async fn seek(
        &self,
        control: String,
        topic: String,
        cursor: NativeCursor,
    ) -> napi::Result<NativeCursor> {
        let inner = self.inner.clone();
        let start = start_of(Some(cursor))?;
        blocking(move || {
            let mut guard = inner.lock();
            let sub = guard.as_mut().ok_or(Error::Closed)?;
            let cursor = match start {
                Start::From(Some(c)) => c,
                Start::From(None) => return Ok(js_cursor(&Subscriber::position(sub))),
                Start::End => end_of_topic(&control, &topic, sub)?,
            };
            sub.seek(cursor)?;
            Ok(js_cursor(&Subscriber::position(sub)))
        })
        .await
    }

    /// Disconnects (once any poll under way has returned).
    #[napi]
    pub async fn close(&self) -> napi::Result<()> {
        let inner = self.inner.clone();
        blocking(move || {
            inner.lock().take();
            Ok(())
        })
        .await
    }
}

/// Messages of one poll, packed for JavaScript.
#[derive(Default)]
struct Packed {
    data: Vec<u8>,
    nums: Vec<f64>,
    bigs: Vec<u64>,
}

impl Packed {
    fn push(&mut self, m: &MessageRef<'_>) {
        if self.data.capacity() == 0 {
            // One allocation for a typical gather instead of a dozen doublings.
            self.data.reserve(GATHER_BYTES);
        }
        let offset = self.data.len();
        self.data.extend_from_slice(m.payload);
        self.nums.extend_from_slice(&[
            m.position as f64,
            m.batch_seq as f64,
            m.broker_id as f64,
            m.index_in_batch as f64,
            offset as f64,
            m.payload.len() as f64,
            m.counter as f64,
        ]);
        self.bigs.extend_from_slice(&[m.client_id, m.publish_ts_ns]);
    }

    fn finish(self, next: &Cursor) -> Option<NativeBatch> {
        let count = self.nums.len() / NUMS_PER_MESSAGE;
        if count == 0 {
            return None;
        }
        debug_assert_eq!(self.bigs.len(), count * BIGS_PER_MESSAGE);
        // An empty payload region still needs a real allocation behind the Buffer.
        let mut data = self.data;
        if data.is_empty() {
            data.reserve(1);
        } else if data.capacity() > 2 * data.len() {
            // A small gather does not keep the whole reservation alive in JavaScript.
            data.shrink_to_fit();
        }
        Some(NativeBatch {
            count: count as u32,
            data: data.into(),
            nums: self.nums.into(),
            bigs: self.bigs.into(),
            next: js_cursor(next),
        })
    }
}
