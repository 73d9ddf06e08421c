package loadgen

import "testing"

func TestPercentilesReadTheSortedSamples(t *testing.T) {
	ns := []int64{5e6, 1e6, 3e6, 2e6, 4e6}
	p := Percentiles(ns)
	if p["p50"] != 3 || p["max"] != 5 || p["mean"] != 3 {
		t.Fatalf("got %v", p)
	}
	if Percentiles(nil) != nil {
		t.Fatal("no samples, no percentiles")
	}
}
