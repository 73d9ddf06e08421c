//! The layout of one shared-memory channel, in the style of Aeron's
//! `LogBufferDescriptor`: every word's offset, its single writer and the ordering of its
//! stores and loads, stated here and nowhere else.
//!
//! A channel is one sealed memfd the client creates and hands to its broker:
//!
//! ```text
//! 0     descriptor line   magic, version, data_capacity, ack_capacity     [client, before the handshake; read once by the broker]
//! 128   DATA producer     tail u64, data_bell u32, space_waiters u32      [client]
//! 256   DATA consumer     head u64, space_bell u32, data_waiters u32      [broker]
//! 384   ACK producer      tail u64, data_bell u32, space_waiters u32      [broker]
//! 512   ACK consumer      head u64, space_bell u32, data_waiters u32      [client]
//! 4096  DATA ring bytes   data_capacity (power of two): batches in wire form, [BatchHeader][messages]   [client]
//! 4096+data_capacity      ACK ring bytes, ACK_CAPACITY: broker frames (Ack, Error)                        [broker]
//! ```
//!
//! Each ring is a single-producer single-consumer byte pipe. `tail` and `head` count
//! bytes since the channel opened and only grow; the byte at position `p` lives at
//! `p & (capacity - 1)`. The producer copies bytes in, then stores `tail` (Release);
//! the consumer loads `tail` (Acquire) before reading bytes, and stores `head`
//! (Release) once it has copied them out, after which the producer may overwrite them.
//! Producer and consumer words sit on lines of their own (128 bytes: the adjacent-line
//! prefetcher pairs 64-byte lines), so neither side's stores invalidate the other's.
//!
//! Doorbells are event counts on futex words, one per direction of wake-up: a producer
//! rings `data_bell` after storing `tail` and calls `futex_wake` only if the consumer
//! announced itself in `data_waiters`; a consumer rings `space_bell` after storing
//! `head`, waking the producer if `space_waiters` says it waits for room. Bells and
//! waiter flags are SeqCst, so a waiter either sees the new count or is seen.
//!
//! Nothing here is trusted by the other side: the broker keeps its own `head` and the
//! last `tail` it saw, and checks every `tail` it loads (`ring::Consumer::available`).
//!
//! A subscriber's channel (a *feed*) is two memfds, so that each side can write only
//! its own words. The broker creates the feed, maps it writable, then seals it against
//! any further writable mapping (`F_SEAL_FUTURE_WRITE`) before handing it over: the
//! subscriber can only map it read-only, and the kernel refuses `mprotect` to writable
//! and `write(2)`. The subscriber creates its cursor page and the broker maps that
//! read-only. Both are sealed against shrinking and growing (a mapped page past the end
//! of the file would raise SIGBUS in the mapper).
//!
//! ```text
//! feed (broker's memfd; read-only to the subscriber)
//! 0     descriptor line   FEED_MAGIC, VERSION, feed capacity (u64 at D_DATA_CAPACITY)   [broker, before the handover]
//! 128   producer line     tail u64, data_bell u32, space_waiters u32                     [broker]
//! 4096  ring bytes        capacity (power of two): the subscription's frames as over TCP:
//!                         Delivery (FrameHeader, DeliveryHeader, payload), BatchOk, Error [broker]
//! cursor page (subscriber's memfd, CURSOR_PAGE_BYTES; read-only to the broker)
//! 0     CURSOR_MAGIC                                                                       [subscriber]
//! 128   consumer line     head u64, space_bell u32, data_waiters u32                      [subscriber]
//! ```

/// `b"EMBSHM01"` as a little-endian word: the descriptor's first word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"EMBSHM01");
/// Layout version; a broker refuses any other.
pub const VERSION: u32 = 1;

/// Bytes between words two different processes write.
pub const LINE: usize = 128;

/// Descriptor: magic (u64).
pub const D_MAGIC: usize = 0;
/// Descriptor: layout version (u32).
pub const D_VERSION: usize = 8;
/// Descriptor: bytes of the client-to-broker ring (u64, a power of two).
pub const D_DATA_CAPACITY: usize = 16;
/// Descriptor: bytes of the broker-to-client ring (u64, [`ACK_CAPACITY`]).
pub const D_ACK_CAPACITY: usize = 24;

/// The producer line of the client-to-broker ring (written by the client).
pub const DATA_PRODUCER: usize = LINE;
/// The consumer line of the client-to-broker ring (written by the broker).
pub const DATA_CONSUMER: usize = 2 * LINE;
/// The producer line of the broker-to-client ring (written by the broker).
pub const ACK_PRODUCER: usize = 3 * LINE;
/// The consumer line of the broker-to-client ring (written by the client).
pub const ACK_CONSUMER: usize = 4 * LINE;

/// Producer line: bytes written so far (u64, only grows; Release after the bytes).
pub const P_TAIL: usize = 0;
/// Producer line: the data doorbell's count (u32 futex word), rung after `tail`.
pub const P_DATA_BELL: usize = 8;
/// Producer line: nonzero while the producer sleeps waiting for room (u32).
pub const P_SPACE_WAITERS: usize = 12;
/// Producer line: while `space_waiters` is set, the consumer `head` (its low 32 bits,
/// compared with wrapping) below which the producer cannot have the room it waits for,
/// so a consumer does not wake it before (u32; written before `space_waiters`; 0: wake at
/// any move, as a producer that never writes it expects). A hint only: a wrong one costs
/// a needless wake-up or a sleep until the producer's next look.
pub const P_SPACE_WAKE_AT: usize = 16;
/// Consumer line: bytes consumed so far (u64, only grows; Release after the copy out).
pub const C_HEAD: usize = 0;
/// Consumer line: the space doorbell's count (u32 futex word), rung after `head`.
pub const C_SPACE_BELL: usize = 8;
/// Consumer line: nonzero while the consumer sleeps waiting for data (u32).
pub const C_DATA_WAITERS: usize = 12;

/// Where the ring bytes start: one page of header lines.
pub const HEADER_BYTES: usize = 4096;
/// Bytes of the broker-to-client ring: acks are 16 bytes, errors at most a few hundred;
/// the broker disconnects a client that leaves more than 64 KiB of them unread.
pub const ACK_CAPACITY: usize = 64 * 1024;
/// Smallest and largest client-to-broker ring a broker maps.
pub const MIN_DATA_CAPACITY: usize = 64 * 1024;
pub const MAX_DATA_CAPACITY: usize = 1 << 30;

const _: () = assert!(ACK_CONSUMER + LINE <= HEADER_BYTES);
const _: () = assert!(D_ACK_CAPACITY + 8 <= DATA_PRODUCER);
const _: () = assert!(C_DATA_WAITERS + 4 <= LINE && P_SPACE_WAITERS + 4 <= LINE);
const _: () = assert!(P_SPACE_WAKE_AT >= P_SPACE_WAITERS + 4 && P_SPACE_WAKE_AT + 4 <= LINE);
const _: () = assert!(P_SPACE_WAKE_AT.is_multiple_of(4));
const _: () = assert!(P_TAIL.is_multiple_of(8) && C_HEAD.is_multiple_of(8));
const _: () = assert!(P_DATA_BELL.is_multiple_of(4) && C_SPACE_BELL.is_multiple_of(4));
const _: () = assert!(ACK_CAPACITY.is_power_of_two() && MIN_DATA_CAPACITY.is_power_of_two());
const _: () = assert!(MAX_DATA_CAPACITY.is_power_of_two());
const _: () = assert!(HEADER_BYTES.is_multiple_of(4096));

/// `b"EMBFEED1"`: the first word of a subscriber's feed.
pub const FEED_MAGIC: u64 = u64::from_le_bytes(*b"EMBFEED1");
/// `b"EMBCURS1"`: the first word of a subscriber's cursor page.
pub const CURSOR_MAGIC: u64 = u64::from_le_bytes(*b"EMBCURS1");
/// Bytes of a subscriber's cursor page.
pub const CURSOR_PAGE_BYTES: usize = 4096;
/// The consumer line in the cursor page.
pub const CURSOR_LINE: usize = LINE;
/// The producer line in the feed.
pub const FEED_PRODUCER: usize = LINE;
/// Bytes of the ring a broker gives a subscriber by default (`broker.shm_feed_bytes`):
/// a round of deliveries is at most 2 MiB (or one larger batch), and the subscriber
/// copies frames out as they come, so the ring holds several rounds and neither side
/// waits for the other while a reader keeps up.
pub const FEED_CAPACITY: usize = 8 << 20;

const _: () = assert!(CURSOR_LINE + LINE <= CURSOR_PAGE_BYTES);
const _: () = assert!(FEED_PRODUCER + LINE <= HEADER_BYTES);
const _: () = assert!(FEED_CAPACITY.is_power_of_two());
const _: () = assert!(FEED_CAPACITY >= MIN_DATA_CAPACITY && FEED_CAPACITY <= MAX_DATA_CAPACITY);

/// A feed's length for a ring of `capacity` bytes.
pub fn feed_len(capacity: usize) -> usize {
    HEADER_BYTES + capacity
}

/// The ring of a feed: producer line and bytes in the feed, consumer line in the
/// cursor page.
pub fn feed_ring(capacity: usize) -> RingPlace {
    RingPlace {
        producer_line: FEED_PRODUCER,
        consumer_line: CURSOR_LINE,
        bytes: HEADER_BYTES,
        capacity,
    }
}

/// One ring's place in the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingPlace {
    pub producer_line: usize,
    pub consumer_line: usize,
    pub bytes: usize,
    pub capacity: usize,
}

/// The channel's size and its two rings, for a data ring of `data_capacity` bytes.
pub fn channel_len(data_capacity: usize) -> usize {
    HEADER_BYTES + data_capacity + ACK_CAPACITY
}

/// The client-to-broker ring.
pub fn data_ring(data_capacity: usize) -> RingPlace {
    RingPlace {
        producer_line: DATA_PRODUCER,
        consumer_line: DATA_CONSUMER,
        bytes: HEADER_BYTES,
        capacity: data_capacity,
    }
}

/// The broker-to-client ring.
pub fn ack_ring(data_capacity: usize) -> RingPlace {
    RingPlace {
        producer_line: ACK_PRODUCER,
        consumer_line: ACK_CONSUMER,
        bytes: HEADER_BYTES + data_capacity,
        capacity: ACK_CAPACITY,
    }
}

/// Whether a broker maps a data ring of `capacity` bytes; `Err` says why not.
pub fn check_data_capacity(capacity: u64) -> Result<usize, String> {
    if !capacity.is_power_of_two()
        || capacity < MIN_DATA_CAPACITY as u64
        || capacity > MAX_DATA_CAPACITY as u64
    {
        return Err(format!(
            "shared-memory ring of {capacity} bytes: it must be a power of two from {MIN_DATA_CAPACITY} to {MAX_DATA_CAPACITY}"
        ));
    }
    Ok(capacity as usize)
}
