// The benchmark's arithmetic, shared by the JavaScript handlers of both engines
// (embarcadero-worker.mjs, tasker-worker.mjs) and identical to the Rust and Python handlers'
// (shapes.py): each engine's handler only unpacks its own context and wraps its own result
// envelope around these. Pure functions. JavaScript numbers are exact only up to 2^53, so a
// result beyond that is an error here (Rust's limit is 2^63; the benchmark stays far below).

const exact = (n) => Number.isSafeInteger(n);

/** The square of the product of the dependencies' integer results, or of `evenNumber`. */
export function square(dependencyResults, evenNumber) {
  let product = null;
  for (const r of dependencyResults) {
    if (!exact(r)) throw new Error(`a dependency's result is ${JSON.stringify(r)}, not an integer`);
    product = (product ?? 1) * r;
    if (!exact(product)) throw new Error("the product overflows 2^53");
  }
  const n = product ?? evenNumber;
  if (!exact(n)) throw new Error(`context field even_number is ${JSON.stringify(n)}, not an integer`);
  if (!exact(n * n)) throw new Error(`${n} squared overflows 2^53`);
  return n * n;
}

/** `rows` rows (default 1000) in `worker_count` (default 5) ranges: {cursors: [[start, end]], rows}. */
export function csvAnalyze(context) {
  const rows = context.rows ?? 1000;
  const workers = Math.max(1, Math.min(context.worker_count ?? 5, Math.max(rows, 1)));
  const cursors = [];
  for (let k = 0; k < workers; k++) {
    cursors.push([Math.floor((rows * k) / workers), Math.floor((rows * (k + 1)) / workers)]);
  }
  return { cursors, rows };
}

/** The inventory value in cents of rows start..end of the synthetic product CSV. */
export function csvValue(start, end) {
  if (!(exact(start) && exact(end) && 0 <= start && start <= end)) {
    throw new Error(`cursor ${start}..${end} is not a range of rows`);
  }
  let value = 0;
  for (let i = start; i < end; i++) value += (100 + ((i * 37) % 1000)) * (1 + (i % 9));
  return value;
}

/** The rows and value of every batch result ({rows, value}); others are skipped. */
export function csvAggregate(results) {
  let rows = 0, value = 0, batches = 0;
  for (const r of results) {
    if (r && exact(r.rows) && exact(r.value)) {
      rows += r.rows;
      value += r.value;
      batches += 1;
    }
  }
  return { rows, value, batches };
}
