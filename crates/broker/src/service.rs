//! The broker's service thread: advances the written frontier of its logs, reclaims
//! memory under pressure, raises and clears backpressure, and sends acknowledgements.
//! It is the only writer of the broker-owned line of each log's control block.

use crate::publish::{Outbox, PendingAck, PublishConn};
use crate::session::SessionView;
use crate::{Shared, StageTimes};
use embarcadero_region::backoff::Backoff;
use embarcadero_region::unix_ms;
use embarcadero_wire::{Ack, BatchFlags, ErrorCode, ErrorFrame};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most PBR slots one log advances per round, so one busy log cannot starve acks.
const MAX_SLOTS_PER_ROUND: u64 = 4096;

/// How long a log must have taken no reservation before its last, partly filled segment
/// may go back to a pool running short: a topic still being written keeps its segment
/// (and its subscribers read it from memory), and a new topic's first batch waits well
/// under `backpressure_timeout` for the segment it needs (docs/DESIGN.md, "Idle topics").
const TAIL_IDLE: Duration = Duration::from_millis(500);

/// How short the broker's segment pool is, which decides whose memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PoolPressure {
    /// At least the low watermark's share of segments free: nothing goes for the pool.
    Calm,
    /// Fewer: logs give back their oldest segment unless it is their last, and idle
    /// replicated logs their last one too (their data is on disk).
    Short,
    /// Publishers are paused (from the high watermark until the low one is reached
    /// again), or no segment is free: idle memory-only logs give back their last segment
    /// as well, less what their subscribers have not read.
    Exhausted,
}

/// What the service thread remembers about one of its logs.
struct LogState {
    order: u8,
    replication_factor: u8,
    /// Mirror of `written_frontier` and `frontier_msgs`.
    frontier: u64,
    msgs: u64,
    /// End of the last committed batch's log bytes.
    written_end: u64,
    reclaimed_pbr: u64,
    /// Logical segments below this one have been returned to the pool.
    freed_segments_below: u64,
    /// A subscriber is holding back memory its publishers need, and it has been logged
    /// (once per episode: set when logged, cleared when reclamation passes it again).
    held_by_reader: bool,
    /// The batch index at which reader pins stop reclamation under pressure, and since
    /// when (`None` while nothing is held): once it has stayed there for a stall timeout
    /// the readers below what pressure wants stop holding memory ([`held_too_long`]).
    hold: Option<(u64, Instant)>,
    /// The highest position passed that way: readers pinned at or below it hold nothing
    /// any more (only grows; positions are global for orders 2 and 5, this log's for 0
    /// and 1). A new reader pins where it starts, above what was reclaimed.
    passed: Option<u64>,
    /// The writer's reserved PBR index when last looked at under pool pressure, and
    /// since when it has stayed there: how long the log has taken no batch.
    quiet_at: u64,
    quiet_since: Instant,
}

struct AckState {
    conn: Arc<PublishConn>,
    /// A pending entry popped but not yet acknowledgeable.
    head: Option<PendingAck>,
    /// Order 5: the connection's session, whose high-water mark drives its acks.
    session: Option<SessionView>,
    /// Orders 0-2: the count last acknowledged. Acks are cumulative: one that went back
    /// would tell the client batches it was told are safe are not.
    acked: u64,
}

pub fn run(shared: Arc<Shared>, new_conns: crossbeam_channel::Receiver<Arc<PublishConn>>) {
    if let Err(e) = never_preempt_on_wakeup() {
        tracing::debug!(error = %e, "service thread keeps the default scheduling policy");
    }
    let region = shared.region.clone();
    let broker = shared.config.broker_id;
    let caps = region.capacities();
    let mut logs: Vec<Option<LogState>> = (0..caps.max_topics).map(|_| None).collect();
    // Deleted topics whose logs on this broker have been released (or held nothing).
    let mut released = vec![false; caps.max_topics as usize];
    let mut acks: Vec<AckState> = Vec::new();
    let mut backoff = Backoff::new(shared.config.idle_sleep_max);
    let bell = region.broker_bell(broker);
    let marks = Watermarks::of(&shared);
    while !shared.shutdown.load(Ordering::Relaxed) {
        if let Some(reason) = must_stop(&shared) {
            tracing::error!(broker, "{reason}");
            shared.shutdown.store(true, Ordering::SeqCst);
            shared.connections.shutdown_all();
            return;
        }
        let seen = bell.seen();
        let mut progress = false;
        while let Ok(conn) = new_conns.try_recv() {
            let session = conn.session.clone();
            acks.push(AckState {
                conn,
                head: None,
                session,
                acked: 0,
            });
        }
        progress |= tend_logs(&shared, &mut logs, &mut released, &marks);
        marks.pause_or_resume(&shared);
        let started = std::time::Instant::now();
        progress |= send_acks(&shared, &logs, &mut acks, started);
        StageTimes::lap(&shared.metrics.stages.ack_send, started);
        if progress {
            backoff.reset();
        } else {
            backoff.idle(Some((&bell, seen)));
        }
    }
}

/// One pass over the logs this broker wrote: advances each one's written frontier and
/// reclaims under pressure; releases a deleted topic's log once it has no connection
/// left (`released` marks it, so it is not looked at again). Whether anything moved.
fn tend_logs(
    shared: &Shared,
    logs: &mut [Option<LogState>],
    released: &mut [bool],
    marks: &Watermarks,
) -> bool {
    let mut progress = false;
    for (topic, slot) in logs.iter_mut().enumerate() {
        let topic = topic as u32;
        // A log this broker never wrote holds nothing to release (and its
        // subscribers end themselves): slots without a writer cost one load.
        if released[topic as usize] || shared.writers[topic as usize].get().is_none() {
            continue;
        }
        if shared.region.topic_deleted(topic) {
            // Its publishers are told in `send_acks`, its subscribers by their threads.
            if shared.topic_conns[topic as usize].load(Ordering::SeqCst) == 0 {
                release_deleted(shared, topic, slot.take());
                released[topic as usize] = true;
                progress = true;
            }
            continue;
        }
        if slot.is_none() {
            *slot = log_state(shared, topic);
        }
        let Some(st) = slot.as_mut() else {
            continue;
        };
        let stages = &shared.metrics.stages;
        let started = std::time::Instant::now();
        progress |= advance_frontier(shared, topic, st);
        let advanced = StageTimes::lap(&stages.frontier, started);
        progress |= reclaim(shared, topic, st, marks.pressure(shared));
        StageTimes::lap(&stages.reclaim, advanced);
    }
    progress
}

/// Why the service thread must stop at once, if it must: its logs or its region belong
/// to another process now.
fn must_stop(shared: &Shared) -> Option<&'static str> {
    if !shared.owns_logs() {
        Some("another process has taken over this broker's logs (this one was declared dead); it stops")
    } else if shared.region.is_retired() {
        Some("a restarted head replaced the region this broker is attached to; it stops, and acknowledges nothing more (start it again to attach to the new region)")
    } else {
        None
    }
}

/// The broker's watermarks as counts of free segments: reclaim to keep usage at or
/// below the low watermark; pause publishers above the high one.
struct Watermarks {
    /// Fewer free segments than this: usage is above the low watermark.
    reclaim_below_free: u32,
    /// Fewer free segments than this: usage is above the high watermark.
    pause_below_free: u32,
}

impl Watermarks {
    fn of(shared: &Shared) -> Self {
        let total = shared.pool.total() as f64;
        let at = |mark: f64| (total * (1.0 - mark)).ceil() as u32;
        Self {
            reclaim_below_free: at(shared.config.low_watermark),
            pause_below_free: at(shared.config.high_watermark),
        }
    }

    /// How short the pool is now. Paused publishers resume only at the low watermark,
    /// so until the pool is back there it stays exhausted (else a pool between the two
    /// marks with only idle memory-only logs would keep them paused for ever); and an
    /// empty pool is exhausted whatever the high watermark (at 1.0 nothing pauses).
    fn pressure(&self, shared: &Shared) -> PoolPressure {
        let free = shared.pool.free_count();
        let paused = shared.paused.load(Ordering::Relaxed);
        if free >= self.reclaim_below_free {
            PoolPressure::Calm
        } else if paused || free < self.pause_below_free.max(1) {
            PoolPressure::Exhausted
        } else {
            PoolPressure::Short
        }
    }

    /// Pauses publishers above the high watermark and resumes them below the low one.
    fn pause_or_resume(&self, shared: &Shared) {
        let broker = shared.config.broker_id;
        let free = shared.pool.free_count();
        let paused = shared.paused.load(Ordering::Relaxed);
        if !paused && free < self.pause_below_free {
            shared.paused.store(true, Ordering::Release);
            tracing::debug!(
                broker,
                free,
                "log memory above high watermark: pausing publishers"
            );
        } else if paused && free >= self.reclaim_below_free {
            shared.paused.store(false, Ordering::Release);
            tracing::debug!(
                broker,
                free,
                "log memory below low watermark: resuming publishers"
            );
        }
    }
}

/// The service thread's view of a log it starts serving, from the region: zeros for a
/// new log, where the previous process of this broker left off for a resumed one.
/// `None` while the topic is not active.
fn log_state(shared: &Shared, topic: u32) -> Option<LogState> {
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let meta = region.topic_meta(topic)?;
    let log = region.log(topic, broker);
    let frontier = log.written_frontier.load(Ordering::Acquire);
    let (written_end, msgs) = crate::resume::written_prefix(region, topic, broker, frontier);
    Some(LogState {
        order: meta.order,
        replication_factor: meta.replication_factor,
        frontier,
        msgs,
        written_end,
        reclaimed_pbr: log.reclaimed_pbr.load(Ordering::Acquire),
        freed_segments_below: log.reclaimed_blog.load(Ordering::Acquire)
            / region.capacities().segment_bytes,
        held_by_reader: false,
        hold: None,
        passed: None,
        quiet_at: u64::MAX,
        quiet_since: Instant::now(),
    })
}

/// Moves `written_frontier` over newly committed slots, numbering their messages.
///
/// Orders 0 and 1: the numbers are the topic's per-broker positions, so none may reach
/// the topic's position ceiling (`Region::position_ceiling`): a batch that would waits
/// here, holding back the ones behind it, until the control plane raises the ceiling,
/// which it does long before (one load per round and one compare per batch).
fn advance_frontier(shared: &Shared, topic: u32, st: &mut LogState) -> bool {
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let seg = region.capacities().segment_bytes;
    let start = st.frontier;
    let ceiling = if st.order <= 1 {
        region.position_ceiling(topic).load(Ordering::Acquire)
    } else {
        // Orders 2 and 5 number messages per broker too, but their positions are the
        // sequencer's, which it checks against the ceiling itself.
        embarcadero_region::NO_POSITION_CEILING
    };
    while st.frontier - start < MAX_SLOTS_PER_ROUND {
        let Some(h) = region.pbr_read(topic, broker, st.frontier) else {
            break;
        };
        assert!(
            h.pbr_index == st.frontier && h.log_offset >= st.written_end,
            "log ({topic}, {broker}): slot {} names index {} at offset {}, before the bytes written up to {}",
            st.frontier,
            h.pbr_index,
            h.log_offset,
            st.written_end
        );
        // Reservations never straddle a segment; a slot that says otherwise would send
        // readers, retention and the segment pool past the end of its memory.
        assert!(
            h.log_offset % seg + h.total_size <= seg,
            "log ({topic}, {broker}): slot {} spans segments ({} bytes at {})",
            st.frontier,
            h.total_size,
            h.log_offset
        );
        let valid = h.flags & BatchFlags::VALID != 0;
        if valid && st.msgs.saturating_add(h.num_msg as u64) > ceiling {
            shared
                .metrics
                .ceiling_stalls
                .fetch_add(1, Ordering::Relaxed);
            break;
        }
        region.pbr_set_start_offset(topic, broker, st.frontier, st.msgs);
        if valid {
            st.msgs += h.num_msg as u64;
        }
        st.written_end = h.log_offset + h.total_size;
        st.frontier += 1;
    }
    if st.frontier == start {
        return false;
    }
    // Only reserved slots are committed: a frontier past the reservations would let
    // reclamation free slots and bytes a connection is still writing.
    if let Some(w) = shared.writers[topic as usize].get() {
        assert!(
            st.frontier <= w.reserved_pbr() && st.written_end <= w.reserved_tail(),
            "log ({topic}, {broker}): written up to slot {} (byte {}) past the reservations",
            st.frontier,
            st.written_end
        );
    }
    let line = region.broker_line(topic, broker);
    line.frontier_msgs.store(st.msgs, Ordering::Release);
    line.written_frontier
        .advance(st.frontier, Ordering::Release);
    if st.order <= 1 {
        region.topic_bell(topic).ring();
    }
    true
}

/// Releases the oldest batches of a log when memory is needed: ring pressure, a
/// sequencer request (it must reuse GOI slots), or the broker's segment pool running
/// low. Only batches every consumer is done with are eligible: written, ordered
/// (orders 2 and 5), durable (replicated topics), and read by every pinned subscriber.
/// An idle log whose last segment may go (`tail_may_retire`) lets go of all of that and
/// then of the segment itself.
fn reclaim(shared: &Shared, topic: u32, st: &mut LogState, pressure: PoolPressure) -> bool {
    let log = shared.region.log(topic, shared.config.broker_id);
    let eligible = eligible_below(st, &log);
    let retire = tail_may_retire(shared, topic, st, pressure);
    let segment_pressure = pressure > PoolPressure::Calm;
    let (wanted, pressed) = wanted_below(shared, topic, st, eligible, segment_pressure);
    let wanted = if retire {
        eligible
    } else {
        wanted.min(eligible)
    };
    if wanted <= st.reclaimed_pbr {
        // Nothing wanted: a hold timed before does not go on counting.
        st.hold = None;
    }
    let mut progress =
        wanted > st.reclaimed_pbr && release_unpinned(shared, topic, st, wanted, pressed);
    if retire {
        progress |= retire_tail(shared, topic, st);
    }
    progress
}

/// Releases the batches below `wanted` that no connected subscriber still needs;
/// returns whether any went.
fn release_unpinned(
    shared: &Shared,
    topic: u32,
    st: &mut LogState,
    wanted: u64,
    pressed: bool,
) -> bool {
    // Memory-only topics: from before the pins are read until the frontiers moved.
    let _pass = (st.replication_factor < 2)
        .then(|| PinnedPass::begin(shared.region.broker_line(topic, shared.config.broker_id)));
    let floor = reader_pin_floor(shared, topic, st, st.passed);
    let mut target = below_floor(shared, topic, st, wanted, floor);
    let held = pressed && target < wanted;
    if held_too_long(shared, topic, st, held, target) {
        if let Some(last) = last_position_below(shared, topic, st, wanted) {
            st.passed = st.passed.max(Some(last));
            let floor = reader_pin_floor(shared, topic, st, st.passed);
            let before = target;
            target = below_floor(shared, topic, st, wanted, floor);
            assert!(target >= before, "passing readers never lowers the target");
        }
    }
    note_reader_hold(shared, topic, st, held);
    if target <= st.reclaimed_pbr {
        return false;
    }
    release_below(shared, topic, st, target);
    true
}

/// Whether this log's last segment may go back to the pool: the pool is short enough
/// for the log's kind (replicated: `Short`; memory-only, whose unread data would be
/// lost: `Exhausted`), the segment is partly filled, and the log has taken no
/// reservation for `TAIL_IDLE`. Idleness is timed only under pressure, so the clock is
/// read only then. Paused publishers reserve nothing, so after `TAIL_IDLE` of a pause
/// every log counts as idle: a pause that long means reclaiming older segments did not
/// free enough, and the last ones (less what subscribers still pin) are all that is left.
fn tail_may_retire(shared: &Shared, topic: u32, st: &mut LogState, pressure: PoolPressure) -> bool {
    let needed = if st.replication_factor >= 2 {
        PoolPressure::Short
    } else {
        PoolPressure::Exhausted
    };
    let Some(writer) = shared.writers[topic as usize].get() else {
        return false;
    };
    if pressure < needed {
        return false;
    }
    let (reserved, tail) = writer.reserved();
    let now = Instant::now();
    if reserved != st.quiet_at {
        st.quiet_at = reserved;
        st.quiet_since = now;
        return false;
    }
    // A last segment filled to its end is behind the tail, and goes the usual way.
    let partly_filled = !tail.is_multiple_of(shared.region.capacities().segment_bytes);
    partly_filled && now.duration_since(st.quiet_since) >= TAIL_IDLE
}

/// Gives a log's last, partly filled segment back to the pool once everything in the
/// log is reclaimed: the writer's tail moves to the segment's end unless a reservation
/// came in meanwhile (`LogWriter::retire_tail`), so its next batch opens a fresh
/// segment. Without this each log keeps its last segment as long as it exists, and a
/// broker with more idle topics than segments holds every new topic's batches back.
fn retire_tail(shared: &Shared, topic: u32, st: &mut LogState) -> bool {
    let Some(writer) = shared.writers[topic as usize].get() else {
        return false;
    };
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let seg = region.capacities().segment_bytes;
    let (next, tail) = writer.reserved();
    // Every reserved slot committed and reclaimed: nothing in the segment is live.
    if st.frontier != next || st.reclaimed_pbr != next || tail.is_multiple_of(seg) {
        return false;
    }
    let line = region.broker_line(topic, broker);
    assert!(
        st.written_end == tail && line.reclaimed_blog.load(Ordering::Acquire) == tail,
        "log ({topic}, {broker}): all {next} slots reclaimed, yet bytes written to {} and reclaimed to {} against a tail at {tail}",
        st.written_end,
        line.reclaimed_blog.load(Ordering::Acquire)
    );
    // Checked at each round's start too; again here, just before the one step that
    // moves a frontier past bytes a successor (the process that took these logs over)
    // might be writing.
    if !shared.owns_logs() {
        return false;
    }
    let Some(end) = writer.retire_tail(next, tail) else {
        return false;
    };
    // As after a restart (`resume::written_prefix`): a log reclaimed whole ends where its
    // reclaimed bytes do.
    line.reclaimed_blog.advance(end, Ordering::Release);
    st.written_end = end;
    give_back_segments_below(shared, topic, st, end);
    shared.metrics.retired_tails.fetch_add(1, Ordering::Relaxed);
    true
}

/// The PBR index below which every batch is written, ordered (orders 2, 5) and durable
/// (replicated topics): nothing at or above it may be reclaimed.
fn eligible_below(st: &LogState, log: &embarcadero_region::LogControl<'_>) -> u64 {
    let mut eligible = st.frontier;
    if st.order >= 2 {
        eligible = eligible.min(log.ordered_pbr.load(Ordering::Acquire));
    }
    if st.replication_factor >= 2 {
        eligible = eligible.min(log.durable_pbr.load(Ordering::Acquire));
    }
    eligible
}

/// How far memory pressure asks to reclaim (ring above its high-water mark, the
/// sequencer's request, the segment pool low), and whether the ring or pool is pressed.
fn wanted_below(
    shared: &Shared,
    topic: u32,
    st: &LogState,
    eligible: u64,
    segment_pressure: bool,
) -> (u64, bool) {
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let caps = region.capacities();
    let log = region.log(topic, broker);
    let mut target = st.reclaimed_pbr;
    let reserved = shared.writers[topic as usize]
        .get()
        .map_or(0, |w| w.reserved_pbr());
    // Unsigned below: a reclaimed frontier past the reservations would wrap the ring's
    // use into "pressed" and ask to reclaim everything.
    assert!(
        reserved >= st.reclaimed_pbr,
        "log ({topic}, {broker}): reclaimed up to {}, reserved up to {reserved}",
        st.reclaimed_pbr
    );
    let ring_high = (caps.pbr_slots as f64 * shared.config.high_watermark) as u64;
    let ring_low = (caps.pbr_slots as f64 * shared.config.low_watermark) as u64;
    let ring_pressed = reserved - st.reclaimed_pbr > ring_high;
    if ring_pressed {
        target = target.max(reserved - ring_low);
    }
    target = target.max(log.reclaim_request.load(Ordering::Acquire));
    if segment_pressure {
        // Free this log's oldest segment if it is not the one being written.
        let seg = caps.segment_bytes;
        let oldest_end = (log.reclaimed_blog.load(Ordering::Relaxed) / seg + 1) * seg;
        if oldest_end <= st.written_end {
            let mut i = target.max(st.reclaimed_pbr);
            while i < eligible {
                match region.pbr_read(topic, broker, i) {
                    Some(h) if h.log_offset < oldest_end => i += 1,
                    _ => break,
                }
            }
            target = target.max(i);
        }
    }
    (target, segment_pressure || ring_pressed)
}

/// A reclamation pass that honours reader pins, announced on the log's `reclaim_pass`
/// word (odd while it lasts) so that a reader who pins just as the pass reads the pins
/// waits for the pass to end before it looks for its batch
/// (`Region::await_reclaim_passes`).
struct PinnedPass<'a> {
    word: embarcadero_region::MonotonicU64<'a>,
}

impl<'a> PinnedPass<'a> {
    fn begin(line: embarcadero_region::BrokerLine<'a>) -> Self {
        let word = line.reclaim_pass;
        let before = word.add(1, Ordering::SeqCst);
        assert!(
            before.is_multiple_of(2),
            "a reclamation pass is already under way"
        );
        // Orders the odd word before the pin loads, against the reader's fence between
        // its pin stores and its load of this word.
        std::sync::atomic::fence(Ordering::SeqCst);
        Self { word }
    }
}

impl Drop for PinnedPass<'_> {
    fn drop(&mut self) {
        // Release: the frontiers the pass moved are visible to whoever sees it end.
        let before = self.word.add(1, Ordering::Release);
        // The pair of `begin`: only the pass that made the word odd makes it even.
        assert!(!before.is_multiple_of(2), "a reclamation pass ended twice");
    }
}

/// The first position a connected subscriber of this log has not read yet, not counting
/// those at or below `passed` (`u64::MAX`: none, or a replicated topic, whose
/// subscribers read from disk once memory lets go).
fn reader_pin_floor(shared: &Shared, topic: u32, st: &LogState, passed: Option<u64>) -> u64 {
    if st.replication_factor >= 2 {
        return u64::MAX;
    }
    let broker = shared.config.broker_id;
    let pin_index = if st.order >= 2 { 0 } else { broker };
    let stall = shared.config.reader_stall_timeout;
    shared
        .region
        .reader_floor_past(topic, pin_index, stall, passed)
}

/// Whether reader pins have held reclamation back under pressure (`held`) at batch
/// `target` for a whole stall timeout, so that every reader below what pressure wants
/// should stop holding memory. Each reader is dropped after a stall timeout without
/// progress, but readers that attach at old positions one after another, each leaving
/// before its own timeout (at one position, or at neighbouring ones so that the
/// lowest pin keeps changing), would otherwise hold a memory-only topic's publishers
/// for ever. Timed on the batch where reclamation stops, which a reader that reads
/// moves on (a round at most 2 MiB) and fresh readers at old positions do not.
fn held_too_long(shared: &Shared, topic: u32, st: &mut LogState, held: bool, target: u64) -> bool {
    assert!(
        target >= st.reclaimed_pbr,
        "pins stop reclamation at or above what it reclaimed: {target} < {}",
        st.reclaimed_pbr
    );
    if !held {
        st.hold = None;
        return false;
    }
    let now = Instant::now();
    let since = match st.hold {
        Some((at, since)) if at == target => since,
        _ => {
            st.hold = Some((target, now));
            return false;
        }
    };
    let stall = shared.config.reader_stall_timeout;
    if now.duration_since(since) < stall {
        return false;
    }
    let name = shared
        .region
        .topic_meta(topic)
        .map(|m| m.name)
        .unwrap_or_default();
    tracing::warn!(
        topic = %name,
        broker = shared.config.broker_id,
        "subscribers have held publishers back for {stall:?} (broker.reader_stall_timeout_ms) without reclamation moving: those below what the publishers need stop holding memory, and are told if it is reclaimed before they read it"
    );
    st.hold = None;
    true
}

/// The highest position of the valid batches of this log from the reclaimed frontier
/// to batch index `wanted` (`None` when there is none). Run once per pass of
/// [`held_too_long`], so a scan of the batches is affordable.
fn last_position_below(shared: &Shared, topic: u32, st: &LogState, wanted: u64) -> Option<u64> {
    let broker = shared.config.broker_id;
    let last_of = |i| {
        let h = shared.region.pbr_read(topic, broker, i)?;
        let valid = h.flags & BatchFlags::VALID != 0 && h.num_msg > 0;
        let first = if st.order >= 2 {
            h.total_order
        } else {
            h.start_logical_offset
        };
        valid.then(|| first + h.num_msg as u64 - 1)
    };
    (st.reclaimed_pbr..wanted).filter_map(last_of).max()
}

/// `target`, lowered to the first batch at or above `floor` (a reader pin).
fn below_floor(shared: &Shared, topic: u32, st: &LogState, target: u64, floor: u64) -> u64 {
    if floor == u64::MAX {
        return target;
    }
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let mut i = st.reclaimed_pbr;
    while i < target {
        let Some(h) = region.pbr_read(topic, broker, i) else {
            break;
        };
        let first = if st.order >= 2 {
            h.total_order
        } else {
            h.start_logical_offset
        };
        let n = if h.flags & BatchFlags::VALID != 0 {
            h.num_msg as u64
        } else {
            0
        };
        if n > 0 && first + n > floor {
            break;
        }
        i += 1;
    }
    i
}

/// Moves the log's reclaimed frontiers to `target` and gives the segments wholly below
/// it back to the pool.
fn release_below(shared: &Shared, topic: u32, st: &mut LogState, target: u64) {
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let log = region.log(topic, broker);
    assert!(target > st.reclaimed_pbr, "reclamation only moves forward");
    assert!(
        target <= eligible_below(st, &log),
        "reclamation passes no batch that is not written, ordered and durable: {target} > {}",
        eligible_below(st, &log)
    );
    let new_blog = if target < st.frontier {
        region
            .pbr_read(topic, broker, target)
            .map(|h| h.log_offset)
            .expect("committed slot below the frontier is readable by its owner")
    } else {
        st.written_end
    };
    // The bytes let go of are written ones: below `written_end` every byte belongs to a
    // committed slot no consumer needs any more.
    assert!(
        new_blog <= st.written_end,
        "log ({topic}, {broker}): reclaiming bytes up to {new_blog}, written up to {}",
        st.written_end
    );
    // Readers re-check these after copying, so they must move before the memory is
    // handed out again. Both only grow (`advance` asserts it).
    let line = region.broker_line(topic, broker);
    line.reclaimed_blog.advance(new_blog, Ordering::Release);
    line.reclaimed_pbr.advance(target, Ordering::Release);
    give_back_segments_below(shared, topic, st, new_blog);
    shared
        .metrics
        .reclaimed_batches
        .fetch_add(target - st.reclaimed_pbr, Ordering::Relaxed);
    st.reclaimed_pbr = target;
}

/// Returns to the pool the log's segments wholly below byte `reclaimed`, the reclaimed
/// frontier just moved there (readers re-check it after copying, so it moves first).
fn give_back_segments_below(shared: &Shared, topic: u32, st: &mut LogState, reclaimed: u64) {
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let seg = region.capacities().segment_bytes;
    assert!(
        region.broker_line(topic, broker).reclaimed_blog.load(Ordering::Acquire) >= reclaimed,
        "log ({topic}, {broker}): segments given back below byte {reclaimed} before the reclaimed frontier passed it"
    );
    while st.freed_segments_below < reclaimed / seg {
        let logical = st.freed_segments_below;
        if let Some(physical) = region.seg_map_lookup(topic, broker, logical) {
            shared.pool.push(physical);
        }
        st.freed_segments_below += 1;
    }
}

/// Logs, once per episode, that a subscriber keeps memory its publishers are waiting
/// for: without this a paused subscriber stalls a topic and nobody is told who.
fn note_reader_hold(shared: &Shared, topic: u32, st: &mut LogState, held: bool) {
    if held == st.held_by_reader {
        return;
    }
    st.held_by_reader = held;
    let broker = shared.config.broker_id;
    let name = shared
        .region
        .topic_meta(topic)
        .map(|m| m.name)
        .unwrap_or_default();
    if !held {
        tracing::info!(topic = %name, broker, "the subscriber that held back memory has moved on or was dropped");
        return;
    }
    let index = if st.order >= 2 { 0 } else { broker };
    let stall = shared.config.reader_stall_timeout;
    let Some(r) = shared.region.slowest_reader(topic, index, stall) else {
        return;
    };
    tracing::warn!(
        topic = %name,
        broker,
        reader_slot = r.slot,
        reader_broker = ?r.broker,
        position = r.position,
        "publishers of this topic wait for memory a subscriber has not read yet (it still needs position {}); it is dropped after {:?} without reading (broker.reader_stall_timeout_ms); a replicated topic (order 2 or 5, rf 2) lets subscribers fall behind without holding memory",
        r.position,
        stall
    );
}

/// Lets go of a deleted topic's log on this broker, once none of its connections is on
/// the topic (so nothing of this broker writes to the log or reads it any more): every
/// segment the log still holds goes back to the pool. The reclaimed frontiers move to
/// the end first, as in `reclaim`, so a subscriber of another broker that is reading the
/// log finds its copy invalid before the memory is handed out again.
fn release_deleted(shared: &Shared, topic: u32, st: Option<LogState>) {
    let Some(writer) = shared.writers[topic as usize].get() else {
        return;
    };
    let region = &shared.region;
    let broker = shared.config.broker_id;
    let seg = region.capacities().segment_bytes;
    let log = region.log(topic, broker);
    let freed_below = st.map_or_else(
        || log.reclaimed_blog.load(Ordering::Acquire) / seg,
        |st| st.freed_segments_below,
    );
    let tail = writer.reserved_tail();
    // Segments are freed only below the reclaimed bytes, which never pass the tail:
    // otherwise the loop below would keep segments the log still maps.
    assert!(
        freed_below <= tail.div_ceil(seg),
        "log ({topic}, {broker}): segments freed below {freed_below}, reserved bytes end at {tail}"
    );
    let line = region.broker_line(topic, broker);
    line.reclaimed_blog.advance(tail, Ordering::Release);
    line.reclaimed_pbr
        .advance(writer.reserved_pbr(), Ordering::Release);
    let mut freed = 0;
    for logical in freed_below..tail.div_ceil(seg) {
        if let Some(physical) = region.seg_map_lookup(topic, broker, logical) {
            shared.pool.push(physical);
            freed += 1;
        }
    }
    tracing::info!(
        broker,
        topic,
        segments = freed,
        "released the log of a deleted topic"
    );
}

/// Order 5: acknowledges up to the session's committed high-water mark (acks are
/// cumulative per session, and every broker relays them from the region, so no broker
/// is a single point of failure for them). A fenced epoch gets SessionFenced and the
/// connection is closed. Returns whether to keep the connection.
fn ack_session(
    shared: &Shared,
    conn: &PublishConn,
    head: &mut Option<PendingAck>,
    session: &mut SessionView,
    progress: &mut bool,
    now: Instant,
) -> bool {
    let status = session.status(&shared.region);
    let Ok(mut out) = conn.out.try_lock() else {
        return true;
    };
    if conn.closed.load(Ordering::Acquire) {
        return false;
    }
    // After reading the session's status and before telling the client anything from
    // it; the service loop stops the broker at its next round.
    if shared.region.is_retired() {
        return false;
    }
    if let Some(error) = session_refusal(shared, conn, head, session, &status) {
        close_with(shared, conn, &mut out, error);
        *progress = true;
        return false;
    }
    // Ack 2 waits until the batches are on every disk replica, not just ordered.
    let hwm = status.acked_hwm(conn.ack_level);
    let acked = take_session_acked(shared, conn, head, hwm, now);
    let result = if acked {
        *progress = true;
        shared.metrics.acks_sent.fetch_add(1, Ordering::Relaxed);
        out.send_nonblocking(
            &Ack {
                level: conn.ack_level,
                count: hwm,
            }
            .encode(),
        )
    } else if !out.unsent.is_empty() {
        out.send_nonblocking(&[])
    } else {
        Ok(())
    };
    if result.is_err() {
        out.shutdown();
        conn.closed.store(true, Ordering::Release);
        return false;
    }
    true
}

/// Why the session's connection must be closed, if it must: the session expired, is
/// bound to another key, is fenced, or the sequencer dropped its batch for want of a
/// table slot. Otherwise marks the session active (its client is connected) and loads
/// the connection's oldest unacknowledged batch into `head`.
fn session_refusal(
    shared: &Shared,
    conn: &PublishConn,
    head: &mut Option<PendingAck>,
    session: &mut SessionView,
    status: &crate::session::SessionStatus,
) -> Option<ErrorFrame> {
    if status.expired {
        return Some(ErrorFrame {
            code: ErrorCode::SessionExpired,
            batch_seq: status.acked_hwm(conn.ack_level),
            session_epoch: 0,
            message: crate::session::expired_message(shared.config.session_idle_evict),
        });
    }
    if status.foreign_key {
        // Another key bound the session first (the hello found it unbound): nothing the
        // session commits is this connection's, so it must never be told it is acked.
        let refusal = crate::publish::refuse_foreign_key(shared, session.client_id());
        return Some(ErrorFrame {
            code: refusal.code,
            batch_seq: u64::MAX,
            session_epoch: 0,
            message: refusal.message,
        });
    }
    // The client is connected: its session is not idle, even when it sends nothing.
    session.touch(&shared.region, unix_ms());
    if status.fenced {
        return Some(ErrorFrame::session_fenced(
            conn.session_epoch,
            status.acked_hwm(conn.ack_level),
            status.epoch,
        ));
    }
    if head.is_none() {
        *head = conn.pending.pop();
    }
    let broker = shared.config.broker_id;
    let dropped_without_slot = match head.as_ref() {
        Some(h) => session.dropped_without_slot(&shared.region, broker, h.pbr_index),
        None => false,
    };
    if dropped_without_slot {
        let name = shared
            .region
            .topic_meta(conn.topic)
            .map_or_else(String::new, |m| m.name);
        return Some(ErrorFrame {
            code: ErrorCode::SessionsExhausted,
            batch_seq: 0,
            session_epoch: 0,
            message: crate::session::exhausted_message(&name, shared.config.session_idle_evict),
        });
    }
    None
}

/// Takes off the connection's queue every batch below the session's acknowledged
/// mark `hwm` (recording how long each waited); returns whether there was one.
fn take_session_acked(
    shared: &Shared,
    conn: &PublishConn,
    head: &mut Option<PendingAck>,
    hwm: u64,
    now: Instant,
) -> bool {
    let mut acked = false;
    let mut waited = AckWait::default();
    loop {
        if head.is_none() {
            *head = conn.pending.pop();
        }
        match *head {
            Some(p) if p.batch_seq < hwm => {
                acked = true;
                waited.add(p, now);
                *head = None;
            }
            _ => break,
        }
    }
    waited.record(shared);
    acked
}

/// Takes off the connection's queue every batch whose PBR slot is below `limit`
/// (recording how long each waited); returns the count to acknowledge, if any.
fn take_acked_below(
    shared: &Shared,
    conn: &PublishConn,
    head: &mut Option<PendingAck>,
    limit: u64,
    now: Instant,
) -> Option<u64> {
    let mut count = None;
    let mut waited = AckWait::default();
    loop {
        if head.is_none() {
            *head = conn.pending.pop();
        }
        match *head {
            Some(p) if p.pbr_index < limit => {
                // Queued in connection order, each batch numbered after the last.
                assert!(
                    count.is_none_or(|c| p.batch_seq >= c),
                    "a connection's acknowledged count only grows"
                );
                count = Some(p.batch_seq + 1);
                waited.add(p, now);
                *head = None;
            }
            _ => break,
        }
    }
    waited.record(shared);
    count
}

/// Sends an error frame on a session's connection and closes it for good. Closing also
/// ends its connection thread's wait for room in the ack queue, which the entries of a
/// fenced or crowded-out session would never make.
fn close_with(shared: &Shared, conn: &PublishConn, out: &mut Outbox, error: ErrorFrame) {
    let frame = error.encode();
    let _ = out.send_nonblocking(&frame);
    out.shutdown();
    conn.closed.store(true, Ordering::Release);
    shared.metrics.errors_sent.fetch_add(1, Ordering::Relaxed);
}

/// Tells a publisher its topic was deleted and closes its connection; false if its
/// connection thread holds the outbox (tried again next round).
fn tell_deleted(shared: &Shared, conn: &PublishConn, progress: &mut bool) -> bool {
    let Ok(mut out) = conn.out.try_lock() else {
        return false;
    };
    if !conn.closed.load(Ordering::Acquire) {
        // The meta is gone with the deletion; the name was only needed for the text.
        close_with(
            shared,
            conn,
            &mut out,
            crate::net::topic_deleted(&conn.topic_name),
        );
        *progress = true;
    }
    true
}

/// Acknowledges, per connection, every pending batch that reached the ack level.
fn send_acks(
    shared: &Shared,
    logs: &[Option<LogState>],
    acks: &mut Vec<AckState>,
    now: Instant,
) -> bool {
    let mut progress = false;
    acks.retain_mut(|a| ack_connection(shared, logs, a, &mut progress, now));
    progress
}

/// One connection's part of [`send_acks`]: acknowledges what reached its ack level.
/// Returns whether to keep the connection.
#[inline]
fn ack_connection(
    shared: &Shared,
    logs: &[Option<LogState>],
    a: &mut AckState,
    progress: &mut bool,
    now: Instant,
) -> bool {
    let region = &shared.region;
    let conn = &a.conn;
    if conn.closed.load(Ordering::Acquire) {
        return false;
    }
    if region.topic_deleted(conn.topic) {
        return !tell_deleted(shared, conn, progress);
    }
    let log = region.log(conn.topic, shared.config.broker_id);
    if let Some(session) = &mut a.session {
        return ack_session(shared, a.conn.as_ref(), &mut a.head, session, progress, now);
    }
    let limit = ack_limit(conn, &log, logs);
    let count = take_acked_below(shared, conn, &mut a.head, limit, now);
    // Never wait on a connection thread that is writing to its own client.
    let Ok(mut out) = conn.out.try_lock() else {
        if let Some(count) = count {
            // Acknowledged at the next round; the wait until then counts again.
            a.head = Some(PendingAck {
                batch_seq: count - 1,
                pbr_index: 0,
                queued_at: now,
            });
        }
        return true;
    };
    if conn.closed.load(Ordering::Acquire) {
        return false;
    }
    // After reading what the ack reports and before sending it; the service loop
    // stops the broker at its next round.
    if count.is_some() && region.is_retired() {
        return false;
    }
    send_ack(shared, conn, &mut out, &mut a.acked, count, progress)
}

/// Orders 0-2: the PBR index below which a connection's batches have reached its ack
/// level (`log`: its topic's log on this broker).
#[inline]
fn ack_limit(
    conn: &PublishConn,
    log: &embarcadero_region::LogControl<'_>,
    logs: &[Option<LogState>],
) -> u64 {
    let written = logs[conn.topic as usize].as_ref().map_or(0, |s| s.frontier);
    // PBR indices below `limit` have reached the connection's ack level.
    match (conn.ack_level, conn.order) {
        (2, _) => log.durable_pbr.load(Ordering::Acquire),
        (_, 0) => u64::MAX,
        (_, 1) => written,
        _ => log.ordered_pbr.load(Ordering::Acquire),
    }
}

/// Sends the ack of `count` batches, if any, through `out` (else what a previous send
/// left unsent); `acked`: the count last acknowledged on the connection. Returns
/// whether to keep the connection: one whose client stopped reading its acks is closed.
#[inline]
fn send_ack(
    shared: &Shared,
    conn: &PublishConn,
    out: &mut Outbox,
    acked: &mut u64,
    count: Option<u64>,
    progress: &mut bool,
) -> bool {
    let result = match count {
        Some(count) => {
            assert!(
                count >= *acked,
                "topic {}: the acknowledged count would go back from {} to {count}",
                conn.topic,
                *acked
            );
            *acked = count;
            *progress = true;
            shared.metrics.acks_sent.fetch_add(1, Ordering::Relaxed);
            out.send_nonblocking(
                &Ack {
                    level: conn.ack_level,
                    count,
                }
                .encode(),
            )
        }
        None if !out.unsent.is_empty() => out.send_nonblocking(&[]),
        None => Ok(()),
    };
    if result.is_err() {
        // The client stopped reading its acks: close it rather than leave it waiting.
        out.shutdown();
        conn.closed.store(true, Ordering::Release);
        return false;
    }
    true
}

/// Sums, over the batches one round acknowledges, the time from queueing to being
/// found acknowledgeable: the `ack_wait` stage, one counter update per connection.
#[derive(Default)]
struct AckWait(u64);

impl AckWait {
    fn add(&mut self, p: PendingAck, now: Instant) {
        self.0 += now.saturating_duration_since(p.queued_at).as_nanos() as u64;
    }

    fn record(self, shared: &Shared) {
        if self.0 != 0 {
            shared
                .metrics
                .stages
                .ack_wait
                .fetch_add(self.0, Ordering::Relaxed);
        }
    }
}

/// Puts the calling thread under `SCHED_BATCH`, whose wake-ups do not preempt the
/// thread that woke it. The service thread is woken by the sequencer's bell every
/// epoch and by the connection threads' order-0 commits; with the default policy the
/// sequencer's epoch seal, which rings every broker's bell in turn, took 3.5 times as
/// long in wall time (`docs/PERFORMANCE.md`, session 7). Any thread may choose this
/// policy for itself without privileges; it leaves the thread's share of the CPU alone.
fn never_preempt_on_wakeup() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; the kernel only reads `param`, which lives
    // for the call. SCHED_BATCH takes priority 0 and needs no capability.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_threads_policy_is_batch_and_stays_with_its_thread() {
        let policy = || {
            // SAFETY: pid 0 is the calling thread; the call reads nothing from us.
            unsafe { libc::sched_getscheduler(0) }
        };
        let before = policy();
        let inside = std::thread::spawn(move || {
            never_preempt_on_wakeup().unwrap();
            policy()
        })
        .join()
        .unwrap();
        assert_eq!(inside, libc::SCHED_BATCH);
        assert_eq!(policy(), before, "other threads keep their policy");
    }
}
