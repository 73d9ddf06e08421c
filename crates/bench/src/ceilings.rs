//! The machine's own ceilings: loopback TCP, memory copy and durable-write
//! bandwidth, measured in-process so the system's throughput has honest
//! numbers to be compared against.
//!
//! Every figure is bytes moved divided by wall time, with MB = 1e6 bytes.
//! For memcpy a "byte" is one byte copied (read once and written once).

use serde::Serialize;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::hint::black_box;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Socket buffer size the product uses for its data connections.
const SOCKET_BUFFER_BYTES: usize = 4 << 20;
const MIB: u64 = 1 << 20;
/// Brokers of the default server, and the log of each in its region: 24 segments of
/// 8 MiB.
const DEFAULT_BROKERS: usize = 4;
const DEFAULT_BROKER_LOG_BYTES: usize = 24 * (8 << 20);

/// One measured ceiling.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ceiling {
    pub name: String,
    pub bytes: u64,
    pub seconds: f64,
    /// Throughput in MB/s, MB = 1e6 bytes.
    pub mb_per_s: f64,
    /// Median latency of one operation (fdatasync, round trip), microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50_us: Option<f64>,
    /// 99th-percentile latency of one operation (fdatasync, round trip), microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<f64>,
}

impl Ceiling {
    fn new(name: String, bytes: u64, elapsed: Duration) -> Self {
        let seconds = elapsed.as_secs_f64().max(1e-9);
        Self {
            name,
            bytes,
            seconds,
            mb_per_s: bytes as f64 / 1e6 / seconds,
            p50_us: None,
            p99_us: None,
        }
    }
}

/// Loopback TCP: `streams` connections on 127.0.0.1, each with its own sender
/// and receiver thread, socket options as in the product (TCP_NODELAY, 4 MiB
/// buffers), every receive into the same `chunk_bytes` buffer, which stays in the
/// cache. Time runs from the first byte sent to the last byte received.
pub fn loopback_tcp(total_bytes: u64, chunk_bytes: usize, streams: usize) -> io::Result<Ceiling> {
    let chunk_bytes = chunk_bytes.max(1);
    let streams = streams.max(1);
    let c = loopback(total_bytes, chunk_bytes, streams, chunk_bytes)?;
    let name = format!("loopback_tcp streams={streams} chunk={chunk_bytes}");
    Ok(Ceiling::new(name, c.0, c.1))
}

/// Loopback TCP as [`loopback_tcp`], but received the way brokers receive into their
/// logs: each read of a stream lands right after the previous one in that stream's own
/// `ring_bytes` buffer (written before the clock starts, as the server prefaults its
/// region), wrapping at its end. With rings larger than the cache every byte is written
/// to memory that is not cached, which the hot-buffer ceiling never pays.
pub fn loopback_tcp_into_rings(
    total_bytes: u64,
    chunk_bytes: usize,
    streams: usize,
    ring_bytes: usize,
) -> io::Result<Ceiling> {
    let chunk_bytes = chunk_bytes.max(1);
    let streams = streams.max(1);
    let ring_bytes = ring_bytes.max(chunk_bytes);
    let c = loopback(total_bytes, chunk_bytes, streams, ring_bytes)?;
    let name = format!("loopback_tcp_ring streams={streams} chunk={chunk_bytes} ring={ring_bytes}");
    Ok(Ceiling::new(name, c.0, c.1))
}

/// Bytes received and the time from the first byte sent to the last received.
fn loopback(
    total_bytes: u64,
    chunk_bytes: usize,
    streams: usize,
    ring_bytes: usize,
) -> io::Result<(u64, Duration)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    // Connect and allocate everything first, so a failure cannot strand threads at
    // the barrier and no allocation runs on the clock.
    let mut pairs = Vec::with_capacity(streams);
    for _ in 0..streams {
        let tx = TcpStream::connect(addr)?;
        let (rx, _) = listener.accept()?;
        tune_socket(&tx);
        tune_socket(&rx);
        // Non-zero fill: every page is written, so none faults on the clock.
        pairs.push((tx, rx, vec![0xa5_u8; ring_bytes]));
    }
    let barrier = Arc::new(Barrier::new(streams));
    let mut senders = Vec::with_capacity(streams);
    let mut receivers = Vec::with_capacity(streams);
    for (i, (tx, rx, ring)) in pairs.into_iter().enumerate() {
        let share =
            total_bytes / streams as u64 + u64::from((i as u64) < total_bytes % streams as u64);
        let barrier = Arc::clone(&barrier);
        senders.push(thread::spawn(move || {
            send(tx, share, chunk_bytes, &barrier)
        }));
        receivers.push(thread::spawn(move || receive(rx, share, chunk_bytes, ring)));
    }
    let mut first_sent: Option<Instant> = None;
    for handle in senders {
        let t = join(handle)?;
        first_sent = Some(first_sent.map_or(t, |f| f.min(t)));
    }
    let (mut bytes, mut last_received) = (0, None::<Instant>);
    for handle in receivers {
        let (n, t) = join(handle)?;
        bytes += n;
        last_received = Some(last_received.map_or(t, |l| l.max(t)));
    }
    let elapsed = match (first_sent, last_received) {
        (Some(first), Some(last)) => last.saturating_duration_since(first),
        _ => Duration::ZERO,
    };
    Ok((bytes, elapsed))
}

fn tune_socket(stream: &TcpStream) {
    let sock = socket2::SockRef::from(stream);
    let _ = sock.set_nodelay(true);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
}

/// Size of the next piece of at most `chunk` bytes out of `left`.
fn next_piece(left: u64, chunk: usize) -> usize {
    usize::try_from(left).map_or(chunk, |l| l.min(chunk))
}

fn send(mut stream: TcpStream, bytes: u64, chunk: usize, start: &Barrier) -> io::Result<Instant> {
    let buf = vec![0x5a_u8; chunk];
    start.wait();
    let first = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = next_piece(left, chunk);
        stream.write_all(&buf[..n])?;
        left -= n as u64;
    }
    stream.shutdown(Shutdown::Write)?;
    Ok(first)
}

/// Reads `bytes` in pieces of at most `chunk`, each right after the previous one in
/// `ring` (at least `chunk` long), starting over at its start when the next piece
/// would not fit.
fn receive(
    mut stream: TcpStream,
    bytes: u64,
    chunk: usize,
    mut ring: Vec<u8>,
) -> io::Result<(u64, Instant)> {
    debug_assert!(ring.len() >= chunk);
    let mut left = bytes;
    let mut at = 0;
    while left > 0 {
        let n = next_piece(left, chunk);
        if at + n > ring.len() {
            at = 0;
        }
        stream.read_exact(&mut ring[at..at + n])?;
        at += n;
        left -= n as u64;
    }
    black_box(&ring);
    Ok((bytes, Instant::now()))
}

fn join<T>(handle: JoinHandle<io::Result<T>>) -> io::Result<T> {
    handle
        .join()
        .map_err(|_| io::Error::other("measurement thread panicked"))?
}

/// Loopback TCP round trips, the floor under any acknowledgement's latency: one
/// connection with the product's socket options, a client thread that writes
/// `request_bytes` and waits for `reply_bytes`, a server thread that reads the request
/// whole and replies, one at a time. The first tenth are a warm-up, left out of the
/// figures. p50/p99 are per round trip; MB/s counts request bytes.
pub fn loopback_round_trips(
    request_bytes: usize,
    reply_bytes: usize,
    round_trips: usize,
) -> io::Result<Ceiling> {
    let (request_bytes, reply_bytes) = (request_bytes.max(1), reply_bytes.max(1));
    let round_trips = round_trips.max(1);
    let warmup = round_trips / 10;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let mut client = TcpStream::connect(listener.local_addr()?)?;
    let (mut server, _) = listener.accept()?;
    tune_socket(&client);
    tune_socket(&server);
    let total = warmup + round_trips;
    let echo = thread::spawn(move || -> io::Result<()> {
        let (mut request, reply) = (vec![0u8; request_bytes], vec![0x3c_u8; reply_bytes]);
        for _ in 0..total {
            server.read_exact(&mut request)?;
            server.write_all(&reply)?;
        }
        Ok(())
    });
    let (request, mut reply) = (vec![0xa5_u8; request_bytes], vec![0u8; reply_bytes]);
    let mut latencies = Vec::with_capacity(round_trips);
    let mut start = Instant::now();
    for i in 0..total {
        if i == warmup {
            start = Instant::now();
        }
        let t = Instant::now();
        client.write_all(&request)?;
        client.read_exact(&mut reply)?;
        if i >= warmup {
            latencies.push(t.elapsed());
        }
    }
    let elapsed = start.elapsed();
    join(echo)?;
    latencies.sort_unstable();
    let mut ceiling = Ceiling::new(
        format!("loopback_round_trip request={request_bytes} reply={reply_bytes}"),
        (round_trips * request_bytes) as u64,
        elapsed,
    );
    ceiling.p50_us = percentile_us(&latencies, 50.0);
    ceiling.p99_us = percentile_us(&latencies, 99.0);
    Ok(ceiling)
}

/// Memory copy: `total_bytes` copied, `buffer_bytes` at a time, between two
/// buffers that are written (so faulted in) before the clock starts.
pub fn memcpy_bandwidth(buffer_bytes: usize, total_bytes: u64) -> Ceiling {
    let buffer_bytes = buffer_bytes.max(1);
    // Non-zero fill: a zeroed allocation may come back as untouched pages.
    let src = vec![0xa5_u8; buffer_bytes];
    let mut dst = vec![0x5a_u8; buffer_bytes];
    let start = Instant::now();
    let mut left = total_bytes;
    while left > 0 {
        let n = next_piece(left, buffer_bytes);
        black_box(&mut dst[..n]).copy_from_slice(black_box(&src[..n]));
        left -= n as u64;
    }
    let elapsed = start.elapsed();
    black_box(&dst);
    Ceiling::new(
        format!("memcpy buffer={buffer_bytes}"),
        total_bytes,
        elapsed,
    )
}

/// Durable sequential writes: `write_bytes` at a time to a new file in `dir`,
/// fdatasync after every write. Also reports p50/p99 of the fdatasync calls.
/// The file is removed afterwards, also on error.
pub fn fdatasync_bandwidth(
    dir: &Path,
    total_bytes: u64,
    write_bytes: usize,
) -> io::Result<Ceiling> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let write_bytes = write_bytes.max(1);
    let path = dir.join(format!(
        ".embarcadero-ceiling-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    let _remove = RemoveOnDrop(path);
    let buf = vec![0xc3_u8; write_bytes];
    let mut latencies = Vec::new();
    let start = Instant::now();
    let mut left = total_bytes;
    while left > 0 {
        let n = next_piece(left, write_bytes);
        file.write_all(&buf[..n])?;
        let t = Instant::now();
        // SAFETY: the descriptor belongs to `file`, which is open for the whole call.
        if unsafe { libc::fdatasync(file.as_raw_fd()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        latencies.push(t.elapsed());
        left -= n as u64;
    }
    let elapsed = start.elapsed();
    latencies.sort_unstable();
    let mut ceiling = Ceiling::new(
        format!("fdatasync write={write_bytes}"),
        total_bytes,
        elapsed,
    );
    ceiling.p50_us = percentile_us(&latencies, 50.0);
    ceiling.p99_us = percentile_us(&latencies, 99.0);
    Ok(ceiling)
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Nearest-rank percentile of sorted durations, in microseconds.
fn percentile_us(sorted: &[Duration], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    let i = rank.clamp(1, sorted.len()) - 1;
    Some(sorted[i].as_secs_f64() * 1e6)
}

/// What to measure: the sizes the product itself uses, so that a ratio to a
/// ceiling compares like with like.
#[derive(Debug, Clone)]
pub struct CeilingPlan {
    /// Small sizes, well under two seconds in all (tests).
    pub quick: bool,
    /// Bytes per `write` on the loopback streams: the publisher's batch size.
    pub tcp_chunk_bytes: usize,
    /// Streams of the `loopback_tcp_ring` ceiling: one per broker; 0 leaves it out.
    pub ring_streams: usize,
    /// Size of the ring each of those streams receives into: one broker's segments.
    pub ring_bytes: usize,
    /// Where the fdatasync file goes: the disk the replicas write to.
    pub sync_dir: PathBuf,
    /// One fdatasync ceiling per size: bytes written between two fdatasyncs
    /// (1 MiB, and the replicas' group-commit size).
    pub sync_write_bytes: Vec<usize>,
    /// Request size of the round-trip ceiling: the bench's message size (0 leaves it
    /// out). The reply is an acknowledgement frame's size.
    pub round_trip_request_bytes: usize,
}

/// Reply of the round-trip ceiling: an Ack frame, a bare 16-byte frame header.
const ROUND_TRIP_REPLY_BYTES: usize = 16;

impl CeilingPlan {
    pub fn new(sync_dir: &Path, quick: bool) -> Self {
        Self {
            quick,
            tcp_chunk_bytes: MIB as usize,
            ring_streams: DEFAULT_BROKERS,
            ring_bytes: if quick {
                4 * MIB as usize
            } else {
                DEFAULT_BROKER_LOG_BYTES
            },
            sync_dir: sync_dir.to_path_buf(),
            sync_write_bytes: vec![MIB as usize],
            round_trip_request_bytes: 1024,
        }
    }
}

/// All ceilings of `plan`. Full size: 2 GiB over TCP (one stream, the streams into
/// rings, then two streams), 20 000 round trips, 4 GiB memcpy through 64 MiB buffers
/// and 512 MiB of fdatasync'd writes per write size; `quick` uses 32 MiB (rings of 4
/// MiB), 200 round trips, 64 MiB through 8 MiB and 4 MiB.
pub fn measure_all(plan: &CeilingPlan) -> io::Result<Vec<Ceiling>> {
    let (tcp, round_trips, memcpy_buffer, memcpy, sync) = if plan.quick {
        (32 * MIB, 200, 8 * MIB, 64 * MIB, 4 * MIB)
    } else {
        (2048 * MIB, 20_000, 64 * MIB, 4096 * MIB, 512 * MIB)
    };
    let mut out = vec![loopback_tcp(tcp, plan.tcp_chunk_bytes, 1)?];
    if plan.ring_streams > 0 {
        out.push(loopback_tcp_into_rings(
            tcp,
            plan.tcp_chunk_bytes,
            plan.ring_streams,
            plan.ring_bytes,
        )?);
    }
    if !plan.quick {
        out.push(loopback_tcp(tcp, plan.tcp_chunk_bytes, 2)?);
    }
    if plan.round_trip_request_bytes > 0 {
        out.push(loopback_round_trips(
            plan.round_trip_request_bytes,
            ROUND_TRIP_REPLY_BYTES,
            round_trips,
        )?);
    }
    out.push(memcpy_bandwidth(memcpy_buffer as usize, memcpy));
    for &write in &plan.sync_write_bytes {
        out.push(fdatasync_bandwidth(&plan.sync_dir, sync, write)?);
    }
    Ok(out)
}

/// A plain-text table of ceilings, one per line after a header.
pub fn format_table(ceilings: &[Ceiling]) -> String {
    let width = ceilings
        .iter()
        .map(|c| c.name.len())
        .max()
        .unwrap_or(0)
        .max(4);
    let mut out = format!(
        "{:<width$} {:>14} {:>9} {:>10} {:>10} {:>10}\n",
        "name", "bytes", "seconds", "MB/s", "p50 us", "p99 us"
    );
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.0}"));
    for c in ceilings {
        let _ = writeln!(
            out,
            "{:<width$} {:>14} {:>9.3} {:>10.1} {:>10} {:>10}",
            c.name,
            c.bytes,
            c.seconds,
            c.mb_per_s,
            us(c.p50_us),
            us(c.p99_us)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_sane(c: &Ceiling, bytes: u64) {
        assert_eq!(c.bytes, bytes, "{c:?}");
        assert!(c.seconds > 0.0 && c.mb_per_s > 0.0, "{c:?}");
    }

    #[test]
    fn tcp_single_stream_moves_every_byte() {
        let total = MIB + 123;
        assert_sane(&loopback_tcp(total, 64 << 10, 1).unwrap(), total);
    }

    #[test]
    fn tcp_uneven_split_over_streams() {
        let total = 3 * MIB + 7;
        let c = loopback_tcp(total, 100_000, 3).unwrap();
        assert_sane(&c, total);
        assert!(c.name.contains("streams=3"));
    }

    #[test]
    fn tcp_into_rings_wraps_and_moves_every_byte() {
        // 100 KB pieces into 250 KB rings: two fit, the third starts over at 0.
        let total = 3 * MIB + 123;
        let c = loopback_tcp_into_rings(total, 100_000, 2, 250_000).unwrap();
        assert_sane(&c, total);
        assert_eq!(
            c.name,
            "loopback_tcp_ring streams=2 chunk=100000 ring=250000"
        );
        // A ring smaller than one piece is raised to one piece.
        assert_sane(
            &loopback_tcp_into_rings(total, 100_000, 1, 10).unwrap(),
            total,
        );
    }

    #[test]
    fn round_trips_time_each_exchange_after_the_warm_up() {
        let c = loopback_round_trips(1000, 64, 50).unwrap();
        assert_sane(&c, 50 * 1000);
        assert_eq!(c.name, "loopback_round_trip request=1000 reply=64");
        let (p50, p99) = (c.p50_us.unwrap(), c.p99_us.unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{c:?}");
    }

    #[test]
    fn memcpy_counts_partial_last_copy() {
        let total = 3 * MIB + 7;
        assert_sane(&memcpy_bandwidth(MIB as usize, total), total);
    }

    #[test]
    fn fdatasync_reports_latency_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let total = 2 * (256 << 10) + 5;
        let c = fdatasync_bandwidth(dir.path(), total, 256 << 10).unwrap();
        assert_sane(&c, total);
        let (p50, p99) = (c.p50_us.unwrap(), c.p99_us.unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{c:?}");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn fdatasync_into_missing_dir_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(fdatasync_bandwidth(&dir.path().join("absent"), 10, 4).is_err());
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let d: Vec<_> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile_us(&d, 50.0), Some(50.0));
        assert_eq!(percentile_us(&d, 99.0), Some(99.0));
        assert_eq!(percentile_us(&d[..1], 99.0), Some(1.0));
        assert_eq!(percentile_us(&[], 50.0), None);
    }

    #[test]
    fn quick_measure_all_formats_and_serializes() {
        let dir = tempfile::tempdir().unwrap();
        let all = measure_all(&CeilingPlan::new(dir.path(), true)).unwrap();
        assert_eq!(all.len(), 5);
        let expected = [32 * MIB, 32 * MIB, 200 * 1024, 64 * MIB, 4 * MIB];
        for (c, bytes) in all.iter().zip(expected) {
            assert_sane(c, bytes);
        }
        let table = format_table(&all);
        assert_eq!(table.lines().count(), 6);
        assert!(all.iter().all(|c| table.contains(&c.name)));
        let json = serde_json::to_value(&all).unwrap();
        assert!(json[0].get("p50_us").is_none());
        assert!(json[2]["p50_us"].as_f64().unwrap() > 0.0);
        assert!(json[4]["p99_us"].as_f64().unwrap() > 0.0);
    }
}
