// A benchmark, not a test: the TypeScript client's publish and subscribe throughput
// against a running server, for comparison with `embarcadero bench` (the Rust client) on
// the same server in the same run (docs/PERFORMANCE.md, "TypeScript client").
//
//   node bench.mjs --control 127.0.0.1:12140 [--mb 1024] [--sub-mb 256] [--size 1024] [--order 2] [--ack 1]
//                  [--only publishMany|publish|subscribe] [--json]
//
// Four figures, MB/s of payload (10^6 bytes), each on a fresh memory-only topic:
//   publishMany: chunks of 256 messages per call, timed from the first call until
//                close() resolves (every message acknowledged at the ack level);
//   publish:     one awaited publish() per message, timed the same way;
//   subscribe:   a topic of --sub-mb filled with publishMany, then one ordered subscriber
//                reading it from the start with `for await`, touching each payload, timed
//                from its first poll to the last message (as `bench --mode subscribe`
//                times it). A memory-only topic keeps only about the region's log memory:
//                keep --sub-mb below that (256 is);
//   pollMany:    the same topic read again, by a subscriber looping over `pollMany()`;
//   pollBatch:   read again, a `MessageBatch` at a time (`pollBatch()`), taking each
//                message's payload length (`batch.size(i)`) without making a `Message`,
//                then `release()`s it.
// --only runs one of publishMany, publish or subscribe (the last with the three readers);
// --json prints one JSON object of MB/s per figure instead of the lines
// (scripts/sdk-bench.py runs it that way, interleaved with the Rust client).
// Run `npm run build:native:release && npm run build:ts` first (`npm run bench` does).
import { Admin, Publisher, Subscriber } from "./build/ts/index.js";

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
}

const control = arg("control", process.env.EMBARCADERO_CONTROL ?? "127.0.0.1:12140");
const totalBytes = Number(arg("mb", "1024")) * 1024 * 1024;
const size = Number(arg("size", "1024"));
const order = Number(arg("order", "2"));
const ackLevel = Number(arg("ack", "1"));
const count = Math.floor(totalBytes / size);
const subCount = Math.floor(Number(arg("sub-mb", "256")) * 1024 * 1024 / size);
const CHUNK = 256;
const only = arg("only", "");
const json = process.argv.includes("--json");
const figures = {};

const admin = new Admin(control);
const stamp = `${process.pid}-${Date.now()}`;

async function topic(kind) {
  const name = `tsbench-${kind}-${stamp}`;
  await admin.createTopic(name, { order, memoryOnly: true });
  return name;
}

/** CPU seconds of this process (every thread: the addon's too) since `from` (process.cpuUsage()). */
function cpuSince(from) {
  const used = process.cpuUsage(from);
  return (used.user + used.system) / 1e6;
}

function report(what, bytes, seconds, extra = "", cpu = undefined) {
  const mbs = bytes / seconds / 1e6;
  figures[what] = mbs;
  if (cpu !== undefined) {
    figures[`${what} cpu s/GB`] = cpu / (bytes / 1e9);
    extra += `, ${(cpu / (bytes / 1e9)).toFixed(2)} CPU s/GB`;
  }
  if (!json) console.log(`${what.padEnd(12)} ${mbs.toFixed(1).padStart(8)} MB/s  (${(bytes / 1e6).toFixed(0)} MB in ${seconds.toFixed(2)} s)${extra}`);
  return mbs;
}

async function publishMany(count, kind = "many", quiet = false) {
  const name = await topic(kind);
  const p = await Publisher.connect(name, { control, ackLevel });
  const chunk = Array.from({ length: CHUNK }, (_, i) => Buffer.alloc(size, i));
  const cpu = process.cpuUsage();
  const start = process.hrtime.bigint();
  let sent = 0;
  while (sent < count) {
    const n = Math.min(CHUNK, count - sent);
    await p.publishMany(n === CHUNK ? chunk : chunk.slice(0, n));
    sent += n;
  }
  const stats = await p.close();
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  if (!quiet) report("publishMany", stats.bytes, seconds, `, ${stats.batches} batches`, cpuSince(cpu));
  return name;
}

async function publishOne() {
  const name = await topic("one");
  const p = await Publisher.connect(name, { control, ackLevel });
  const payload = Buffer.alloc(size, 7);
  const start = process.hrtime.bigint();
  for (let i = 0; i < count; i++) await p.publish(payload);
  const stats = await p.close();
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  report("publish", stats.bytes, seconds, `, ${stats.batches} batches`);
}

/** Fails the run when the topic's start was reclaimed before the reader came: the messages
 * it is waiting for would never come. Known once the first delivery has arrived. */
function refuseSkipped(sub) {
  const s = sub.skipped();
  if (s) {
    throw new Error(
      `positions ${s.from}..${s.to} were reclaimed before the subscriber started: a memory-only ` +
        "topic keeps about three quarters of each broker's log memory; lower --sub-mb",
    );
  }
}

async function subscribe(name, count) {
  const sub = await Subscriber.connect(name, { control });
  const cpu = process.cpuUsage();
  const start = process.hrtime.bigint();
  let bytes = 0;
  let n = 0;
  for await (const m of sub) {
    bytes += m.payload.length;
    if (++n === count) break;
    if (n === 1) refuseSkipped(sub);
  }
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  const used = cpuSince(cpu);
  await sub.close();
  report("subscribe", bytes, seconds, "", used);
}

async function subscribeMany(name, count) {
  const sub = await Subscriber.connect(name, { control });
  const cpu = process.cpuUsage();
  const start = process.hrtime.bigint();
  let bytes = 0;
  let n = 0;
  let checked = false;
  while (n < count) {
    for (const m of await sub.pollMany()) {
      bytes += m.payload.length;
      n++;
    }
    if (n > 0 && !checked) {
      refuseSkipped(sub); // once: it asks the native subscriber
      checked = true;
    }
  }
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  const used = cpuSince(cpu);
  await sub.close();
  report("pollMany", bytes, seconds, "", used);
}

async function subscribeBatches(name, count) {
  const sub = await Subscriber.connect(name, { control });
  const cpu = process.cpuUsage();
  const start = process.hrtime.bigint();
  let bytes = 0;
  let n = 0;
  while (n < count) {
    const batch = await sub.pollBatch();
    for (let i = 0; i < batch.length; i++) bytes += batch.size(i);
    n += batch.length;
    batch.release();
    if (n > 0 && n === batch.length) refuseSkipped(sub); // once, on the first batch
  }
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  const used = cpuSince(cpu);
  await sub.close();
  report("pollBatch", bytes, seconds, "", used);
}

if (!json) console.log(`TypeScript client: ${count} messages of ${size} bytes, order ${order}, ack ${ackLevel}, server ${control}`);
if (only === "" || only === "publishMany") await publishMany(count);
if (only === "" || only === "publish") await publishOne();
if (only === "" || only === "subscribe") {
  const subTopic = await publishMany(subCount, "sub", true);
  await subscribe(subTopic, subCount);
  await subscribeMany(subTopic, subCount);
  await subscribeBatches(subTopic, subCount);
}
if (json) console.log(JSON.stringify(figures));
