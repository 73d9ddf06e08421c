"""The benchmark's arithmetic, shared by the Python handlers of both engines
(embarcadero_worker.py, tasker_worker.py) and identical to the Rust handlers'
(crates/workflow/src/builtin.rs, scripts/peers/tasker/worker/src/): each engine's handler
only unpacks its own context and wraps its own result envelope around these. Pure functions.
"""

I64 = (-(2**63), 2**63 - 1)


def square(dependency_results, even_number):
    """The square of the product of the dependencies' integer results, or of `even_number`
    when there are none. Overflowing 64 bits is an error, as in Rust."""
    product = None
    for r in dependency_results:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"a dependency's result is {r!r}, not an integer")
        product = (1 if product is None else product) * r
        if not I64[0] <= product <= I64[1]:
            raise ValueError("the product overflows 64 bits")
    n = even_number if product is None else product
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"context field `even_number` is {n!r}, not an integer")
    if not I64[0] <= n * n <= I64[1]:
        raise ValueError(f"{n} squared overflows 64 bits")
    return n * n


def csv_analyze(context):
    """`rows` rows (default 1000) in `worker_count` (default 5) contiguous ranges:
    ([(start, end), ...], rows)."""
    rows = context.get("rows", 1000)
    workers = max(1, min(context.get("worker_count", 5), max(rows, 1)))
    return [(rows * k // workers, rows * (k + 1) // workers) for k in range(workers)], rows


def csv_value(start, end):
    """The inventory value in cents of rows start..end of the synthetic product CSV
    (row i: price 100 + 37i mod 1000 cents, quantity 1 + i mod 9)."""
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
        raise ValueError(f"cursor {start!r}..{end!r} is not a range of rows")
    return sum((100 + (i * 37) % 1000) * (1 + i % 9) for i in range(start, end))


def csv_aggregate(results):
    """The rows and value of every batch result ({rows, value}); others are skipped."""
    rows = value = batches = 0
    for r in results:
        if isinstance(r, dict) and isinstance(r.get("rows"), int) and isinstance(r.get("value"), int):
            rows, value, batches = rows + r["rows"], value + r["value"], batches + 1
    return {"rows": rows, "value": value, "batches": batches}
