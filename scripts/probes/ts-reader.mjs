// Probe (issue 24, session 22): where a TypeScript reader's time goes. Each mode reads a
// whole topic from the start with a subscriber of its own and prints MB/s, the process's CPU
// seconds per GB and its minor page faults per MB of payload.
//
//   node scripts/probes/ts-reader.mjs PKG CONTROL TOPIC [--fill MIB] MODE...
//
// PKG: a built copy of sdk/typescript (release addon, `npm run build:ts`). --fill first makes
// TOPIC (order 2, memory-only) and publishes MIB MiB of 1 KiB messages into it. Modes:
//   raw                 the native polls alone, awaited one after another (no read-ahead),
//                       summing payload lengths from the packed spans: no Message at all;
//   forawait            `for await (const m of sub)`, touching `m.payload.length` (bench.mjs);
//   forawait-nopayload  the same without making the payload views;
//   pollmany            a `pollMany()` loop touching each payload;
//   warm-forawait       one subscriber reads the topic, seeks to 0 and reads it again; only
//                       the second pass is timed (its delivery buffers exist already).
const [pkg, control, topic, ...rest] = process.argv.slice(2);
const { Admin, Publisher, Subscriber } = await import(`${pkg}/build/ts/index.js`);
const { native } = await import(`${pkg}/build/ts/native.js`);
let modes = rest;
let count = 0;
if (rest[0] === "--fill") {
  await new Admin(control).createTopic(topic, { order: 2, memoryOnly: true });
  const p = await Publisher.connect(topic, { control, ackLevel: 1 });
  const chunk = Array.from({ length: 256 }, (_, i) => Buffer.alloc(1024, i));
  for (let sent = 0; sent < Number(rest[1]) * 1024; sent += 256) await p.publishMany(chunk);
  await p.close();
  modes = rest.slice(2);
}
count = Number((await new Admin(control).describeTopic(topic)).nextPosition);

function line(mode, bytes, seconds, cpu, faults, note = "") {
  const c = (cpu.user + cpu.system) / 1e6 / (bytes / 1e9);
  console.log(`${mode.padEnd(20)} ${(bytes / seconds / 1e6).toFixed(0).padStart(6)} MB/s ${c.toFixed(2)} s/GB faults/MB=${(faults / (bytes / 1e6)).toFixed(1)}${note}`);
}

async function readAll(sub, touch) {
  let n = 0, bytes = 0;
  for await (const m of sub) {
    bytes += touch ? m.payload.length : m.size;
    if (++n === count) break;
  }
  return bytes;
}

async function run(mode) {
  const f0 = process.resourceUsage().minorPageFault;
  const cpu = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  let bytes = 0;
  if (mode === "raw") {
    const s = await native.connectSubscriber(control, topic, {});
    for (let n = 0; n < count; ) {
      const b = await s.pollBatch(1000);
      if (!b) continue;
      for (let i = 0; i < b.count; i++) bytes += b.spans[i * 2 + 1];
      n += b.count;
    }
    await s.close();
  } else if (mode === "forawait" || mode === "forawait-nopayload") {
    const sub = await Subscriber.connect(topic, { control });
    bytes = await readAll(sub, mode === "forawait");
    await sub.close();
  } else if (mode === "pollmany") {
    const sub = await Subscriber.connect(topic, { control });
    for (let n = 0; n < count; ) for (const m of await sub.pollMany()) { bytes += m.payload.length; n++; }
    await sub.close();
  } else if (mode === "warm-forawait") {
    const sub = await Subscriber.connect(topic, { control });
    await readAll(sub, false);
    await sub.seek(0);
    const f1 = process.resourceUsage().minorPageFault, c1 = process.cpuUsage(), t1 = process.hrtime.bigint();
    bytes = await readAll(sub, true);
    const s = Number(process.hrtime.bigint() - t1) / 1e9;
    line(mode, bytes, s, process.cpuUsage(c1), process.resourceUsage().minorPageFault - f1, " (second pass)");
    await sub.close();
    return;
  } else {
    throw new Error(`unknown mode ${mode}`);
  }
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  line(mode, bytes, s, process.cpuUsage(cpu), process.resourceUsage().minorPageFault - f0);
}
for (const m of modes) await run(m);
