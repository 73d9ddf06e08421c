// natsbench publishes fixed-size messages to one JetStream stream with asynchronous publishes
// and a bounded window of unacknowledged messages, then prints one JSON summary line:
// throughput between the first publish and the last acknowledgement, and the latency of
// each message to its acknowledgement (a JetStream PubAck, sent once the stream has stored
// the message).
//
// Without -rate it publishes as fast as the window allows and latency runs from each
// publish call. With -rate MB/s message i is due at start + i x size / rate, a schedule
// fixed in advance, and its latency runs from that due time: a publisher held up by a full
// window or a slow server does not excuse the messages that fall due meanwhile
// (coordinated omission). -warmup N first publishes N messages on a schedule of their own
// and waits for their acknowledgements; they are left out of every figure.
//
// It is the NATS side of scripts/peers/run.sh; see docs/BENCHMARKS.md.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"embarcadero/peers/loadgen"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

type summary struct {
	loadgen.Figures
	Errors     int64  `json:"errors"`
	StreamMsgs uint64 `json:"stream_msgs"`
	Window     int    `json:"window"`
	Storage    string `json:"storage"`
	loadgen.Schedule
}

type inflight struct {
	fut jetstream.PubAckFuture
	// The message's due time with -rate, else the time of its publish call.
	from time.Time
}

func main() {
	url := flag.String("url", nats.DefaultURL, "server URL")
	stream := flag.String("stream", "BENCH", "stream name (recreated)")
	subject := flag.String("subject", "bench", "the stream's only subject")
	size := flag.Int("size", 1024, "message payload bytes")
	total := flag.Int64("total-bytes", 1_000_000_000, "payload bytes to publish (rounded down to whole messages)")
	window := flag.Int("window", 8192, "most unacknowledged publishes at once")
	storage := flag.String("storage", "file", "stream storage: file or memory")
	timeout := flag.Duration("timeout", 5*time.Minute, "give up after this long")
	rate := flag.Float64("rate", 0, "publish at this fixed rate, MB/s of payload (10^6 B), on a schedule fixed in advance; latency from each message's due time (0: as fast as the window allows)")
	warmup := flag.Int64("warmup", 0, "with -rate: first publish this many messages on the schedule, wait for their acknowledgements, and leave them out of the figures")
	flag.Parse()
	if *warmup < 0 || (*warmup > 0 && *rate <= 0) {
		loadgen.Fail("-warmup needs -rate")
	}

	count := *total / int64(*size)
	if count < 1 {
		loadgen.Fail("total-bytes smaller than one message")
	}
	nc, err := nats.Connect(*url, nats.Name("natsbench"))
	if err != nil {
		loadgen.Fail("connect: %v", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(*window+1))
	if err != nil {
		loadgen.Fail("jetstream: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	st := jetstream.FileStorage
	if *storage == "memory" {
		st = jetstream.MemoryStorage
	}
	_ = js.DeleteStream(ctx, *stream)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:      *stream,
		Subjects:  []string{*subject},
		Storage:   st,
		Replicas:  1,
		Retention: jetstream.LimitsPolicy,
		Discard:   jetstream.DiscardOld,
	})
	if err != nil {
		loadgen.Fail("create stream: %v", err)
	}

	payload := make([]byte, *size)
	for i := range payload {
		payload[i] = byte('a' + i%26)
	}

	// With -rate, message i of a phase is due at its start + i x interval.
	interval := 0.0
	if *rate > 0 {
		interval = float64(*size) / (*rate * 1e6) * 1e9
	}
	var errs int64
	if *warmup > 0 {
		// Warm-up: published and acknowledged, not measured.
		errs += publish(ctx, js, *subject, payload, *warmup, *window, interval).errs
	}
	ph := publish(ctx, js, *subject, payload, count, *window, interval)
	errs += ph.errs
	lat, lateMax := ph.lat, ph.lateMax
	secs := ph.end.Sub(ph.start).Seconds()

	info, err := s.Info(ctx)
	if err != nil {
		loadgen.Fail("stream info: %v", err)
	}
	out := summary{
		Figures:    loadgen.Measure(count, *size, secs, lat),
		Errors:     errs,
		StreamMsgs: info.State.Msgs,
		Window:     *window,
		Storage:    *storage,
		Schedule:   loadgen.FlatOut("publish call"),
	}
	if interval > 0 {
		out.Schedule = loadgen.FixedRate("scheduled send time", *rate, lateMax, *warmup)
	}
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(out); err != nil {
		loadgen.Fail("encode: %v", err)
	}
	if errs > 0 || info.State.Msgs != uint64(count+*warmup) {
		fmt.Fprintf(os.Stderr, "natsbench: %d errors, stream holds %d of %d messages\n", errs, info.State.Msgs, count+*warmup)
		os.Exit(1)
	}
}

// phase is what one call of publish measured.
type phase struct {
	lat        []int64
	errs       int64
	start, end time.Time // the first message's due time (or publish), the last ack
	lateMax    time.Duration
}

// publish sends count messages, at most window unacknowledged, on the schedule
// start + i x interval when interval > 0 (else as fast as the window allows), and waits
// for every acknowledgement. Latency runs from each message's due time (else its publish
// call) to its PubAck.
func publish(ctx context.Context, js jetstream.JetStream, subject string, payload []byte,
	count int64, window int, interval float64) phase {
	ph := phase{lat: make([]int64, 0, count)}
	sem := make(chan struct{}, window)
	pending := make(chan inflight, window)
	done := make(chan time.Time)
	// Acknowledgements come back in publish order (one stream, one connection), so they
	// are collected in that order.
	go func() {
		for f := range pending {
			select {
			case <-f.fut.Ok():
				ph.lat = append(ph.lat, time.Since(f.from).Nanoseconds())
			case err := <-f.fut.Err():
				ph.errs++
				if ph.errs <= 5 {
					fmt.Fprintf(os.Stderr, "natsbench: publish error: %v\n", err)
				}
			case <-ctx.Done():
				loadgen.Fail("timed out waiting for acknowledgements")
			}
			<-sem
		}
		done <- time.Now()
	}()

	ph.start = time.Now()
	for i := int64(0); i < count; i++ {
		var due time.Time
		if interval > 0 {
			due = ph.start.Add(time.Duration(float64(i) * interval))
			loadgen.SleepUntil(due)
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			loadgen.Fail("timed out publishing")
		}
		t := time.Now()
		fut, err := js.PublishAsync(subject, payload)
		if err != nil {
			loadgen.Fail("publish %d: %v", i, err)
		}
		if interval > 0 {
			ph.lateMax = max(ph.lateMax, t.Sub(due))
			t = due
		}
		pending <- inflight{fut, t}
	}
	close(pending)
	ph.end = <-done
	return ph
}
