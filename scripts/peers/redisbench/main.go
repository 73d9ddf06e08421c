// redisbench appends fixed-size entries to one Redis stream with XADD over a single
// connection, pipelined: commands go out in batches, with a bounded number of commands
// awaiting their replies, and one JSON summary line is printed at the end. The reply to an
// XADD is the entry's ID, sent once the entry is in the stream (and, with appendonly on,
// written to the AOF; its fsync policy decides when that reaches the disk).
//
// Without -rate it writes as fast as the window allows and measures latency per batch, from
// its flush to the reply to its last command. With -rate MB/s entry i is due at
// start + i x size / rate, a schedule fixed in advance: each time the sender wakes it writes
// every entry that has fallen due (at most -batch per flush), and each entry's latency runs
// from its due time to its own reply, so a sender held up by a full window or a slow server
// does not excuse the entries that fall due meanwhile (coordinated omission). -warmup N first
// appends N entries on a schedule of their own and waits for their replies; they are left
// out of every figure.
//
// It speaks RESP directly (no client library) so the client is not the bottleneck.
// It is the Redis side of scripts/peers/run.sh; see docs/BENCHMARKS.md.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"embarcadero/peers/loadgen"
)

type summary struct {
	// Latency percentiles: per batch without -rate (from the flush of a batch to the
	// reply to its last command), per entry with -rate (from its due time to its reply).
	loadgen.Figures
	Errors    int64 `json:"errors"`
	StreamLen int64 `json:"stream_len"`
	Window    int   `json:"window"`
	Batch     int   `json:"batch"`
	// With -rate, the lateness is that of the worst flush against the due time of its
	// first entry.
	loadgen.Schedule
}

// command encodes one RESP array of bulk strings.
func command(args ...[]byte) []byte {
	b := []byte("*" + strconv.Itoa(len(args)) + "\r\n")
	for _, a := range args {
		b = append(b, '$')
		b = strconv.AppendInt(b, int64(len(a)), 10)
		b = append(b, "\r\n"...)
		b = append(b, a...)
		b = append(b, "\r\n"...)
	}
	return b
}

// reply reads one RESP reply and returns it as text, or an error for a RESP error reply.
func reply(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	if len(line) < 3 {
		return "", fmt.Errorf("short reply %q", line)
	}
	body := line[1 : len(line)-2]
	switch line[0] {
	case '+', ':':
		return body, nil
	case '-':
		return "", fmt.Errorf("server: %s", body)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil {
			return "", err
		}
		if n < 0 {
			return "", nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	default:
		return "", fmt.Errorf("unexpected reply %q", line)
	}
}

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "server address")
	key := flag.String("key", "bench", "stream key (deleted first)")
	size := flag.Int("size", 1024, "entry payload bytes (one field)")
	total := flag.Int64("total-bytes", 1_000_000_000, "payload bytes to append (rounded down to whole batches)")
	batch := flag.Int("batch", 64, "XADD commands written per flush")
	window := flag.Int("window", 8192, "most commands awaiting replies at once (a multiple of -batch)")
	timeout := flag.Duration("timeout", 5*time.Minute, "give up after this long")
	rate := flag.Float64("rate", 0, "append at this fixed rate, MB/s of payload (10^6 B), on a schedule fixed in advance; latency per entry from its due time (0: as fast as the window allows)")
	warmup := flag.Int64("warmup", 0, "with -rate: first append this many entries on the schedule, wait for their replies, and leave them out of the figures")
	flag.Parse()
	if *warmup < 0 || (*warmup > 0 && *rate <= 0) {
		loadgen.Fail("-warmup needs -rate")
	}

	batches := *total / int64(*size) / int64(*batch)
	if batches < 1 {
		loadgen.Fail("total-bytes smaller than one batch")
	}
	count := batches * int64(*batch)
	if *rate > 0 {
		// Whole entries, not whole batches: a flush carries what has fallen due.
		count = *total / int64(*size)
	}
	conn, err := net.DialTimeout("tcp", *addr, 5*time.Second)
	if err != nil {
		loadgen.Fail("connect: %v", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(*timeout))
	r := bufio.NewReaderSize(conn, 1<<20)
	w := bufio.NewWriterSize(conn, 1<<20)
	do := func(args ...[]byte) string {
		w.Write(command(args...))
		if err := w.Flush(); err != nil {
			loadgen.Fail("write: %v", err)
		}
		s, err := reply(r)
		if err != nil {
			loadgen.Fail("%s: %v", args[0], err)
		}
		return s
	}
	do([]byte("DEL"), []byte(*key))

	payload := make([]byte, *size)
	for i := range payload {
		payload[i] = byte('a' + i%26)
	}
	xadd := command([]byte("XADD"), []byte(*key), []byte("*"), []byte("d"), payload)
	var one []byte
	for i := 0; i < *batch; i++ {
		one = append(one, xadd...)
	}

	if *rate > 0 {
		var errs int64
		if *warmup > 0 {
			errs += paced(r, w, xadd, *warmup, *size, *rate, *batch, *window).errs
		}
		res := paced(r, w, xadd, count, *size, *rate, *batch, *window)
		n, _ := strconv.ParseInt(do([]byte("XLEN"), []byte(*key)), 10, 64)
		secs := res.end.Sub(res.start).Seconds()
		out := summary{
			Figures:   loadgen.Measure(count, *size, secs, res.lat),
			Errors:    errs + res.errs,
			StreamLen: n,
			Window:    *window,
			Batch:     *batch,
			Schedule:  loadgen.FixedRate("scheduled send time, per entry", *rate, res.lateMax, *warmup),
		}
		finish(out, count+*warmup)
		return
	}

	slots := *window / *batch
	if slots < 1 {
		slots = 1
	}
	sent := make(chan time.Time, slots)
	lat := make([]int64, 0, batches)
	var errs int64
	done := make(chan time.Time)
	go func() {
		for t := range sent {
			for i := 0; i < *batch; i++ {
				if _, err := reply(r); err != nil {
					errs++
					if errs <= 5 {
						fmt.Fprintf(os.Stderr, "redisbench: XADD: %v\n", err)
					}
					if _, ok := err.(net.Error); ok || err == io.EOF {
						loadgen.Fail("connection: %v", err)
					}
				}
			}
			lat = append(lat, time.Since(t).Nanoseconds())
		}
		done <- time.Now()
	}()

	start := time.Now()
	for b := int64(0); b < batches; b++ {
		w.Write(one)
		if err := w.Flush(); err != nil {
			loadgen.Fail("write: %v", err)
		}
		// Blocks while `slots` batches await their replies.
		sent <- time.Now()
	}
	close(sent)
	end := <-done
	secs := end.Sub(start).Seconds()
	n, _ := strconv.ParseInt(do([]byte("XLEN"), []byte(*key)), 10, 64)

	out := summary{
		Figures:   loadgen.Measure(count, *size, secs, lat),
		Errors:    errs,
		StreamLen: n,
		Window:    slots * *batch,
		Batch:     *batch,
		Schedule:  loadgen.FlatOut("flush of each batch, per batch"),
	}
	finish(out, count)
}

// finish prints the summary and fails when an XADD failed or the stream does not hold
// count entries.
func finish(out summary, count int64) {
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		loadgen.Fail("encode: %v", err)
	}
	if out.Errors > 0 || out.StreamLen != count {
		fmt.Fprintf(os.Stderr, "redisbench: %d errors, stream holds %d of %d entries\n", out.Errors, out.StreamLen, count)
		os.Exit(1)
	}
}

// flushed is one pipelined write of the fixed-rate sender: entries first..first+n-1.
type flushed struct {
	first int64
	n     int
}

type pacedResult struct {
	start, end time.Time
	lat        []int64
	errs       int64
	lateMax    time.Duration
}

// paced appends count entries on the fixed schedule: entry i is due at start + i x size /
// rate. The sender sleeps until the next entry is due, then writes every entry due by now
// (at most batch) in one flush, keeping at most window entries awaiting replies. The reader
// records, for each reply, the time since its entry's due time.
func paced(r *bufio.Reader, w *bufio.Writer, xadd []byte, count int64, size int, rate float64,
	batch, window int) pacedResult {
	interval := float64(size) / (rate * 1e6) * 1e9
	start := time.Now()
	due := func(i int64) time.Time { return start.Add(time.Duration(float64(i) * interval)) }
	sent := make(chan flushed, window)
	var outstanding atomic.Int64
	freed := make(chan struct{}, 1)
	res := pacedResult{start: start, lat: make([]int64, 0, count)}
	done := make(chan time.Time)
	go func() {
		for f := range sent {
			for k := 0; k < f.n; k++ {
				if _, err := reply(r); err != nil {
					res.errs++
					if res.errs <= 5 {
						fmt.Fprintf(os.Stderr, "redisbench: XADD: %v\n", err)
					}
					if _, ok := err.(net.Error); ok || err == io.EOF {
						loadgen.Fail("connection: %v", err)
					}
				}
				res.lat = append(res.lat, time.Since(due(f.first+int64(k))).Nanoseconds())
			}
			outstanding.Add(-int64(f.n))
			select {
			case freed <- struct{}{}:
			default:
			}
		}
		done <- time.Now()
	}()
	for i := int64(0); i < count; {
		loadgen.SleepUntil(due(i))
		now := time.Now()
		n := 1
		for n < batch && i+int64(n) < count && !due(i+int64(n)).After(now) {
			n++
		}
		for outstanding.Load()+int64(n) > int64(window) {
			<-freed
		}
		res.lateMax = max(res.lateMax, time.Since(due(i)))
		for k := 0; k < n; k++ {
			w.Write(xadd)
		}
		if err := w.Flush(); err != nil {
			loadgen.Fail("write: %v", err)
		}
		outstanding.Add(int64(n))
		sent <- flushed{i, n}
		i += int64(n)
	}
	close(sent)
	res.end = <-done
	return res
}
