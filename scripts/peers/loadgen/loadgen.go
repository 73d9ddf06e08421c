// Package loadgen holds what the Go load generators (natsbench, redisbench) share: the
// schedule's sleep, the latency percentiles they report and how they fail.
package loadgen

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"
)

// SleepUntil blocks the calling thread in nanosleep until t (if t is still ahead). Go's
// time.Sleep wakes up about 1 ms late on this kernel for sub-millisecond sleeps (the
// runtime's poller waits in milliseconds); nanosleep wakes within the kernel's timer slack
// (~50-100 us), as Rust's thread::sleep and Java's parkNanos do in the other generators.
// Messages that fall due while it sleeps go out together when it wakes.
func SleepUntil(t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	ts := syscall.NsecToTimespec(d.Nanoseconds())
	for syscall.Nanosleep(&ts, &ts) == syscall.EINTR {
	}
}

// Percentiles of latencies given in nanoseconds, in milliseconds: p50, p90, p99, p99_9,
// max and mean (nil for no samples). Sorts ns in place.
func Percentiles(ns []int64) map[string]float64 {
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

// Figures are what every generator reports of a run: how much, how fast, how late.
type Figures struct {
	Messages  int64              `json:"messages"`
	Bytes     int64              `json:"bytes"`
	Seconds   float64            `json:"seconds"`
	MBPerS    float64            `json:"mb_per_s"`
	MsgsPerS  float64            `json:"msgs_per_s"`
	LatencyMs map[string]float64 `json:"latency_ms"`
}

// Measure computes the Figures of count messages of size bytes in secs seconds, with
// their latencies in nanoseconds (sorted in place).
func Measure(count int64, size int, secs float64, latNs []int64) Figures {
	bytes := count * int64(size)
	return Figures{
		Messages:  count,
		Bytes:     bytes,
		Seconds:   secs,
		MBPerS:    float64(bytes) / secs / 1e6,
		MsgsPerS:  float64(count) / secs,
		LatencyMs: Percentiles(latNs),
	}
}

// Schedule is what a generator says about how its latency was measured: from what, and
// for fixed-rate runs the offered rate, how late the worst send was against its due time
// (the sender's own lag: sleep wake-ups, a full window) and the warm-up left out.
type Schedule struct {
	OfferedMBPerS     *float64 `json:"offered_mb_per_s"`
	LatencyFrom       string   `json:"latency_from"`
	ScheduleMaxLateMs *float64 `json:"schedule_max_lateness_ms,omitempty"`
	// Messages published (and acknowledged) before the measured ones, not counted.
	Warmup int64 `json:"warmup_messages"`
}

// FlatOut is the Schedule of a run as fast as the window allows.
func FlatOut(latencyFrom string) Schedule {
	return Schedule{LatencyFrom: latencyFrom}
}

// FixedRate is the Schedule of a run offered rate MB/s, whose worst send was lateMax late.
func FixedRate(latencyFrom string, rate float64, lateMax time.Duration, warmup int64) Schedule {
	late := float64(lateMax.Nanoseconds()) / 1e6
	return Schedule{OfferedMBPerS: &rate, LatencyFrom: latencyFrom, ScheduleMaxLateMs: &late, Warmup: warmup}
}

// Fail prints the program's name and the message to stderr and exits 1.
func Fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, filepath.Base(os.Args[0])+": "+format+"\n", args...)
	os.Exit(1)
}
