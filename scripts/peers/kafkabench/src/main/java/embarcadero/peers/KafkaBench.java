package embarcadero.peers;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.locks.LockSupport;
import org.apache.kafka.clients.producer.Callback;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.Metric;
import org.apache.kafka.common.MetricName;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * Publishes fixed-size records to one Kafka topic partition with the Java producer's
 * asynchronous send (acknowledgements collected by callbacks as they come), then prints one
 * JSON summary line in the format of natsbench and redisbench: throughput from the start to
 * the last acknowledgement, and the latency of every record to its acknowledgement.
 *
 * <p>With {@code --rate MB/s} record i is due at start + i x size / rate, a schedule fixed in
 * advance; the sender sleeps until the next record is due, sends every record that has
 * fallen due, and each record's latency runs from its due time. A send that blocks (full
 * {@code buffer.memory}) or a slow broker therefore does not excuse the records that fall due
 * meanwhile (coordinated omission). Kafka's own {@code ProducerPerformance --throughput}
 * throttles but measures from each {@code send()} call, which hides such stalls.
 *
 * <p>Without {@code --rate} (or with 0) it sends as fast as the producer accepts records and
 * measures from each {@code send()} call, as {@code ProducerPerformance} does.
 *
 * <p>{@code --warmup-records N} (with {@code --rate}) first sends N records on a schedule of
 * their own with the same producer and waits for their acknowledgements; they are left out of
 * every figure. The JVM compiles the producer's hot paths meanwhile: without it the first
 * seconds of a run (interpreted code, p50 ~170 ms in a first test) decide Kafka's p99.
 *
 * <p>It is the Kafka side of scripts/peers/run.sh's fixed-rate series; see docs/BENCHMARKS.md.
 */
public final class KafkaBench {
    private static final String USAGE =
            "usage: KafkaBench --bootstrap-server HOST:PORT --topic T [--size 1024] "
                    + "[--total-bytes N] [--rate MBps] [--warmup-records N] [--timeout-s 300] "
                    + "[--producer-props k=v ...]";

    private KafkaBench() {}

    public static void main(String[] argv) throws Exception {
        String bootstrap = null;
        String topic = null;
        int size = 1024;
        long total = 1_000_000_000L;
        double rate = 0;
        long timeoutS = 300;
        int warmup = 0;
        Properties props = new Properties();
        for (int a = 0; a < argv.length; a++) {
            switch (argv[a]) {
                case "--bootstrap-server" -> bootstrap = argv[++a];
                case "--topic" -> topic = argv[++a];
                case "--size" -> size = Integer.parseInt(argv[++a]);
                case "--total-bytes" -> total = Long.parseLong(argv[++a]);
                case "--rate" -> rate = Double.parseDouble(argv[++a]);
                case "--timeout-s" -> timeoutS = Long.parseLong(argv[++a]);
                case "--warmup-records" -> warmup = Integer.parseInt(argv[++a]);
                case "--producer-props" -> {
                    // Every remaining argument is a producer setting.
                    while (a + 1 < argv.length && !argv[a + 1].startsWith("--")) {
                        String kv = argv[++a];
                        int eq = kv.indexOf('=');
                        if (eq <= 0) {
                            fail("producer setting without '=': " + kv);
                        }
                        props.setProperty(kv.substring(0, eq), kv.substring(eq + 1));
                    }
                }
                default -> fail("unknown argument " + argv[a] + "\n" + USAGE);
            }
        }
        if (topic == null) {
            fail(USAGE);
        }
        if (bootstrap != null) {
            props.setProperty("bootstrap.servers", bootstrap);
        }
        int count = (int) Math.min(Integer.MAX_VALUE - 8, total / size);
        if (count < 1) {
            fail("total-bytes smaller than one record");
        }
        if (warmup < 0 || (warmup > 0 && rate <= 0)) {
            fail("--warmup-records needs --rate");
        }
        byte[] payload = new byte[size];
        for (int i = 0; i < size; i++) {
            payload[i] = (byte) ('a' + i % 26);
        }
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(timeoutS);
        long errors;
        try (KafkaProducer<byte[], byte[]> producer =
                new KafkaProducer<>(props, new ByteArraySerializer(), new ByteArraySerializer())) {
            // Fetch the topic's metadata before the clock starts, as the other clients
            // connect and create their stream before theirs.
            int partitions = producer.partitionsFor(topic).size();
            if (partitions != 1) {
                fail("topic " + topic + " has " + partitions + " partitions; one total order needs 1");
            }
            errors = 0;
            if (warmup > 0) {
                Run w = new Run(producer, topic, payload, warmup, rate, deadline);
                w.go();
                errors += w.errors.get();
            }
            Run run = new Run(producer, topic, payload, count, rate, deadline);
            run.go();
            errors += run.errors.get();
            System.out.println(run.summary(warmup, errors, producerMetrics(producer.metrics())));
        }
        if (errors > 0) {
            System.err.println("kafkabench: " + errors + " records failed");
            System.exit(1);
        }
    }

    /** One phase (warm-up or measured): its schedule and the callbacks' figures. */
    private static final class Run {
        final KafkaProducer<byte[], byte[]> producer;
        final String topic;
        final byte[] payload;
        final int count;
        final double rate;
        final long deadline;
        /** Latency of record i in ns, or -1 when it failed. Written by the callbacks. */
        final long[] latency;
        final AtomicLong errors = new AtomicLong();
        final AtomicLong lastAck = new AtomicLong(Long.MIN_VALUE);
        final CountDownLatch allAcked;
        long start;
        long lateMax;

        Run(KafkaProducer<byte[], byte[]> producer, String topic, byte[] payload, int count,
                double rate, long deadline) {
            this.producer = producer;
            this.topic = topic;
            this.payload = payload;
            this.count = count;
            this.rate = rate;
            this.deadline = deadline;
            this.latency = new long[count];
            this.allAcked = new CountDownLatch(count);
        }

        /** The callback of record i, whose latency runs from {@code from} (nanoTime). */
        final class Ack implements Callback {
            final int i;
            final long from;

            Ack(int i, long from) {
                this.i = i;
                this.from = from;
            }

            @Override
            public void onCompletion(RecordMetadata metadata, Exception e) {
                long now = System.nanoTime();
                if (e != null) {
                    latency[i] = -1;
                    if (errors.incrementAndGet() <= 5) {
                        System.err.println("kafkabench: record " + i + ": " + e);
                    }
                } else {
                    latency[i] = now - from;
                }
                lastAck.accumulateAndGet(now, Math::max);
                // The latch orders every write above before the main thread's reads.
                allAcked.countDown();
            }
        }

        /** Sends every record on the schedule and waits for every acknowledgement. */
        void go() throws InterruptedException {
            double intervalNs = rate > 0 ? payload.length / (rate * 1e6) * 1e9 : 0;
            start = System.nanoTime();
            for (int i = 0; i < count; i++) {
                long from;
                if (intervalNs > 0) {
                    long due = start + (long) (i * intervalNs);
                    long now;
                    // parkNanos sleeps on a kernel timer (futex); it may return early.
                    while ((now = System.nanoTime()) < due) {
                        LockSupport.parkNanos(due - now);
                    }
                    lateMax = Math.max(lateMax, now - due);
                    from = due;
                    if ((i & 1023) == 0 && now > deadline) {
                        fail("timed out publishing");
                    }
                } else {
                    from = System.nanoTime();
                }
                producer.send(new ProducerRecord<>(topic, payload), new Ack(i, from));
            }
            producer.flush();
            long left = deadline - System.nanoTime();
            if (!allAcked.await(Math.max(left, 0), TimeUnit.NANOSECONDS)) {
                fail("timed out waiting for acknowledgements (" + allAcked.getCount() + " left)");
            }
        }

        String summary(int warmup, long allErrors, String metrics) {
            double secs = (lastAck.get() - start) / 1e9;
            long bytes = (long) count * payload.length;
            long[] ok = Arrays.stream(latency).filter(v -> v >= 0).sorted().toArray();
            StringBuilder j = new StringBuilder("{");
            kv(j, "messages", Long.toString(count));
            kv(j, "bytes", Long.toString(bytes));
            kv(j, "seconds", num(secs));
            kv(j, "mb_per_s", num(bytes / secs / 1e6));
            kv(j, "msgs_per_s", num(count / secs));
            kv(j, "latency_ms", percentiles(ok));
            kv(j, "errors", Long.toString(allErrors));
            kv(j, "offered_mb_per_s", rate > 0 ? num(rate) : "null");
            kv(j, "latency_from", rate > 0 ? "\"scheduled send time\"" : "\"send() call\"");
            if (rate > 0) {
                kv(j, "schedule_max_lateness_ms", num(lateMax / 1e6));
            }
            kv(j, "warmup_messages", Integer.toString(warmup));
            kv(j, "producer_metrics", metrics);
            j.setLength(j.length() - 1);
            return j.append('}').toString();
        }
    }

    /** p50/p90/p99/p99.9/max/mean in ms: the element at q x (n-1) of the sorted latencies,
     * as natsbench and redisbench compute them. */
    static String percentiles(long[] ns) {
        if (ns.length == 0) {
            return "null";
        }
        double sum = 0;
        for (long v : ns) {
            sum += v;
        }
        StringBuilder j = new StringBuilder("{");
        for (Object[] q : new Object[][] {{"p50", 0.5}, {"p90", 0.9}, {"p99", 0.99}, {"p99_9", 0.999}}) {
            kv(j, (String) q[0], num(ns[(int) ((Double) q[1] * (ns.length - 1))] / 1e6));
        }
        kv(j, "max", num(ns[ns.length - 1] / 1e6));
        kv(j, "mean", num(sum / ns.length / 1e6));
        j.setLength(j.length() - 1);
        return j.append('}').toString();
    }

    /** A few of the producer's own figures, to explain a result: how full its batches were
     * and how long records waited in its buffer and requests took. */
    static String producerMetrics(Map<MetricName, ? extends Metric> metrics) {
        List<String> wanted = List.of("batch-size-avg", "records-per-request-avg",
                "record-queue-time-avg", "record-queue-time-max", "request-latency-avg",
                "request-latency-max", "requests-in-flight", "bufferpool-wait-time-ns-total");
        List<String> out = new ArrayList<>();
        for (var e : metrics.entrySet()) {
            MetricName n = e.getKey();
            if (n.group().equals("producer-metrics") && wanted.contains(n.name())) {
                Object v = e.getValue().metricValue();
                if (v instanceof Number x && Double.isFinite(x.doubleValue())) {
                    out.add("\"" + n.name() + "\":" + num(x.doubleValue()));
                }
            }
        }
        out.sort(null);
        return "{" + String.join(",", out) + "}";
    }

    static void kv(StringBuilder j, String k, String v) {
        j.append('"').append(k).append("\":").append(v).append(',');
    }

    static String num(double v) {
        return String.format(Locale.ROOT, "%.6f", v);
    }

    static void fail(String msg) {
        System.err.println("kafkabench: " + msg);
        System.exit(1);
    }
}
