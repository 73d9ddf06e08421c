// redisbench appends fixed-size entries to one Redis stream with XADD over a single
// connection, pipelined: commands go out in batches, with a bounded number of commands
// awaiting their replies, and one JSON summary line is printed at the end. The reply to an
// XADD is the entry's ID, sent once the entry is in the stream (and, with appendonly on,
// written to the AOF; its fsync policy decides when that reaches the disk).
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
	"sort"
	"strconv"
	"time"
)

type summary struct {
	Messages  int64              `json:"messages"`
	Bytes     int64              `json:"bytes"`
	Seconds   float64            `json:"seconds"`
	MBPerS    float64            `json:"mb_per_s"`
	MsgsPerS  float64            `json:"msgs_per_s"`
	LatencyMs map[string]float64 `json:"latency_ms"`
	Errors    int64              `json:"errors"`
	StreamLen int64              `json:"stream_len"`
	Window    int                `json:"window"`
	Batch     int                `json:"batch"`
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
	flag.Parse()

	batches := *total / int64(*size) / int64(*batch)
	if batches < 1 {
		fail("total-bytes smaller than one batch")
	}
	count := batches * int64(*batch)
	conn, err := net.DialTimeout("tcp", *addr, 5*time.Second)
	if err != nil {
		fail("connect: %v", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(*timeout))
	r := bufio.NewReaderSize(conn, 1<<20)
	w := bufio.NewWriterSize(conn, 1<<20)
	do := func(args ...[]byte) string {
		w.Write(command(args...))
		if err := w.Flush(); err != nil {
			fail("write: %v", err)
		}
		s, err := reply(r)
		if err != nil {
			fail("%s: %v", args[0], err)
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
						fail("connection: %v", err)
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
			fail("write: %v", err)
		}
		// Blocks while `slots` batches await their replies.
		sent <- time.Now()
	}
	close(sent)
	end := <-done
	secs := end.Sub(start).Seconds()
	n, _ := strconv.ParseInt(do([]byte("XLEN"), []byte(*key)), 10, 64)

	bytes := count * int64(*size)
	out := summary{
		Messages:  count,
		Bytes:     bytes,
		Seconds:   secs,
		MBPerS:    float64(bytes) / secs / 1e6,
		MsgsPerS:  float64(count) / secs,
		LatencyMs: percentiles(lat),
		Errors:    errs,
		StreamLen: n,
		Window:    slots * *batch,
		Batch:     *batch,
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail("encode: %v", err)
	}
	if errs > 0 || n != count {
		fmt.Fprintf(os.Stderr, "redisbench: %d errors, stream holds %d of %d entries\n", errs, n, count)
		os.Exit(1)
	}
}

// percentiles of the per-batch latencies: from the flush of a batch to the reply to its last
// command.
func percentiles(ns []int64) map[string]float64 {
	if len(ns) == 0 {
		return nil
	}
	sort.Slice(ns, func(a, b int) bool { return ns[a] < ns[b] })
	at := func(q float64) float64 { return float64(ns[int(q*float64(len(ns)-1))]) / 1e6 }
	var sum float64
	for _, v := range ns {
		sum += float64(v)
	}
	return map[string]float64{
		"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "p99_9": at(0.999),
		"max": float64(ns[len(ns)-1]) / 1e6, "mean": sum / float64(len(ns)) / 1e6,
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "redisbench: "+format+"\n", args...)
	os.Exit(1)
}
