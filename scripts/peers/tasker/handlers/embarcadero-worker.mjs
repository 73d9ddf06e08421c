// Issue 25's benchmark handlers in JavaScript for Embarcadero's workflow engine, run by our
// TypeScript SDK's Worker (sdk/typescript, its build/ and native/ made by
// install-handlers.sh): the same arithmetic as the engine's built-in handlers of the same
// names, so run.sh can time the linear and batch shapes with these against the Rust ones.
// Usage: node embarcadero-worker.mjs --control HOST:PORT [--ack 2] [--rf 2]
// Prints a readiness line to stderr and works until SIGTERM or SIGINT.
import { createRequire } from "node:module";
import { parseArgs } from "node:util";
import { csvAggregate, csvAnalyze, csvValue, square } from "./shapes.mjs";

const require = createRequire(import.meta.url);
const sdk = process.env.EMBARCADERO_TS ?? new URL("../../../../sdk/typescript", import.meta.url).pathname;
const { StepError, Worker } = require(sdk);

const permanent = (f) => (ctx) => {
  try {
    return f(ctx);
  } catch (e) {
    throw new StepError(String(e.message ?? e), { retryable: false });
  }
};

const isDecision = (r) => r !== null && typeof r === "object" && "step_names" in r;

const handlers = {
  "math.square": permanent((ctx) =>
    square(Object.values(ctx.dependencyResults).filter((r) => !isDecision(r)), ctx.context.even_number),
  ),
  "decision.choose": permanent((ctx) => {
    const names = ctx.context.branches;
    if (!Array.isArray(names)) throw new Error(`the context's branches is ${JSON.stringify(names)}`);
    return { type: "create_steps", step_names: names };
  }),
  "csv.analyze": permanent((ctx) => {
    const { cursors, rows } = csvAnalyze(ctx.context);
    return {
      type: "create_batches",
      worker_count: cursors.length,
      total_items: rows,
      cursors: cursors.map(([start, end]) => ({ start, end })),
    };
  }),
  "csv.process_batch": permanent((ctx) => {
    if (!ctx.batch) throw new Error("csv.process_batch runs as a batch_worker step");
    const { start, end } = ctx.batch.cursor;
    return { rows: end - start, value: csvValue(start, end), resumed_from: null };
  }),
  "csv.aggregate": (ctx) => csvAggregate(Object.values(ctx.dependencyResults)),
};

const { values } = parseArgs({
  options: {
    control: { type: "string" },
    namespace: { type: "string", default: "bench" },
    ack: { type: "string", default: "2" },
    rf: { type: "string", default: "2" },
    concurrency: { type: "string", default: "8" },
  },
});
if (!values.control) throw new Error("--control HOST:PORT is required");
const worker = await Worker.start({
  control: values.control,
  namespace: values.namespace,
  handlers,
  ack: Number(values.ack),
  rf: Number(values.rf),
  concurrency: Number(values.concurrency),
});
const stop = () => void worker.close();
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
console.error(`embarcadero typescript worker is running (${worker.id})`);
await worker.run(); // until closed; rejects if the worker's loop fails
console.error("embarcadero typescript worker stopped");
