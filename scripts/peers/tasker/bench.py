#!/usr/bin/env python3
"""Issue 25's workflow benchmark client: the same HTTP client for Tasker and Embarcadero.

Per shape, two methods:
  poll50: Tasker's own method: POST /v1/tasks, then GET every 50 ms until
          execution_status == all_complete (50 samples by default); for the shapes whose
          steps are created at run time (DYNAMIC) also status == complete, see wait_complete;
  raw:    POST until the engine first reports the task complete: Embarcadero's long poll
          (GET ?wait=), Tasker polled every 1 ms (it has no long poll); 200 samples by default.
`sustained` runs closed-loop clients creating linear tasks and reports throughput and p99
(Tasker polled every 50 ms by default: it has no long poll, and each poll costs it); `sweep`
runs it at several client counts and poll intervals. Several Tasker orchestration processes
(`--api A,B`) are used round-robin.
Before measuring, `measure` runs one task of each shape with a known answer and checks its
final step's result in the engine (a wrong answer stops the run).
Results go to a JSON file; `table` prints two such files side by side and `plot` draws them
as an SVG (p50/p95/p99 per shape, log scale; throughput against p99); `overhead` compares the
linear shape's p50 with Python or TypeScript handlers (`measure --handlers`) against the same
engine's Rust handlers, per step. `table` also judges issue 25's bar when given Tasker's and
our file (in that order). Standard library only.
"""

import argparse
import http.client
import json
import math
import sys
import threading
import time
import uuid

# template name, the root's number (larger shapes overflow 64 bits when squaring 2), and
# further context: the conditional's decision creates the two branches `branches` names.
SHAPES = {
    "linear": ("linear", 2, {}),
    "diamond": ("diamond", 2, {}),
    "conditional": ("conditional", 2, {"branches": ["medium", "huge"]}),
    "complex_dag": ("complex_dag", 1, {}),
    "tree": ("tree", 1, {}),
    "batch": ("batch", 2, {}),
    "concurrent_2x": ("linear", 2, {}),
}


def csv_value(rows):
    """The inventory value of the synthetic CSV's rows (csv.process_batch's arithmetic)."""
    return sum((100 + (i * 37) % 1000) * (1 + i % 9) for i in rows)


# Per shape checked before measuring: the steps that must exist, and the last step's result.
# linear: 2 -> 4 -> 16 -> 256 -> 65536; diamond: 4, 16, 16, (16*16)^2; conditional: the two
# branches created square the context's 2, the convergence (4*4)^2; batch: 1000 rows in 5.
EXPECTED = {
    "linear": (["one", "two", "three", "four"], "four", 65536),
    "diamond": (["start", "left", "right", "join"], "join", 65536),
    "conditional": (["start", "route", "medium", "huge", "converge"], "converge", 256),
    "batch": (
        ["analyze"] + [f"process_{k:03}" for k in range(1, 6)] + ["aggregate"],
        "aggregate",
        {"rows": 1000, "value": csv_value(range(1000)), "batches": 5},
    ),
}


CREATE_ERRORS = []  # refused creations (see Api.create), counted in the result file
STUCK = []  # tasks not complete STUCK_S after creation: left out of the samples, and counted
STUCK_S = 20


class Api:
    """One keep-alive HTTP connection (one per client thread)."""

    def __init__(self, address):
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.conn = None

    def call(self, method, path, body=None):
        for attempt in (1, 2):  # a server may close an idle keep-alive connection
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
                data = json.dumps(body) if body is not None else None
                self.conn.request(method, path, data, {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                raw = resp.read()
                if resp.status >= 300:
                    raise RuntimeError(f"{method} {path}: {resp.status} {raw[:300]!r}")
                return json.loads(raw)
            except (http.client.HTTPException, ConnectionError):
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def create(self, template, number, extra=None):
        body = {
            "name": template,
            "namespace": "bench",
            "version": "1.0.0",
            # A unique field: Tasker's default identity strategy refuses an identical context.
            "context": {"even_number": number, "run": str(uuid.uuid4()), **(extra or {})},
            "initiator": "bench",
            "source_system": "bench",
            "reason": "issue 25 benchmark",
        }
        # Tasker 0.1.8 races its own API path against its task-readiness enqueuer on a fresh task
        # (both take Pending -> Initializing; the loser's insert hits the unique index
        # idx_task_transitions_uuid_most_recent) and answers 500 DATABASE_ERROR, although the
        # task runs on. The client never learns that task's uuid, so it creates another (the
        # sample's clock keeps running: the failed round trip counts against the engine), and
        # the refusals are counted and reported.
        for attempt in range(5):
            try:
                return self.call("POST", "/v1/tasks", body)["task_uuid"]
            except RuntimeError as e:
                if "DATABASE_ERROR" not in str(e) or attempt == 4:
                    raise
                CREATE_ERRORS.append(str(e))
                body["context"]["run"] = str(uuid.uuid4())
        raise AssertionError("unreachable")


# Shapes whose steps a decision or batchable step creates at run time. Tasker 0.1.8 reports
# execution_status all_complete in the window between such a step's completion and the
# creation of the steps it asks for (its task is then still `evaluating_results`), so for
# these shapes a task is done only once its status is also `complete`, in both engines.
DYNAMIC = {"conditional", "batch"}


def wait_complete(api, task, engine, interval, dynamic=False):
    """Returns when the task is complete; interval None means Embarcadero's long poll."""
    path = f"/v1/tasks/{task}" + ("?wait=10" if interval is None else "")
    give_up = time.perf_counter() + STUCK_S
    while True:
        t = api.call("GET", path)
        if t["execution_status"] == "all_complete" and (not dynamic or t["status"] == "complete"):
            return True
        if time.perf_counter() > give_up:
            STUCK.append(task)
            print(f"{engine} task {task} not complete after {STUCK_S} s: {t.get('status')}",
                  file=sys.stderr)
            return False
        if t.get("status") in ("error", "cancelled", "blocked_by_failures"):
            raise RuntimeError(f"{engine} task {task} ended {t['status']}")
        if interval:
            time.sleep(interval)


def one_sample(apis, shape, engine, interval):
    """The sample's milliseconds, or None when a task of it got stuck (see STUCK)."""
    template, number, extra = SHAPES[shape]
    start = time.perf_counter()
    done = []
    if shape == "concurrent_2x":  # two linear tasks at once; the sample ends when both are done
        threads = [
            threading.Thread(
                target=lambda a: done.append(
                    run_one(a, template, number, engine, interval, extra)
                ),
                args=(a,),
            )
            for a in apis[:2]
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(done) != 2:  # a thread raised (its traceback is printed): fail, do not drop it
            raise RuntimeError(f"{engine} concurrent_2x: a task failed")
    else:
        done.append(run_one(apis[0], template, number, engine, interval, extra))
    ms = (time.perf_counter() - start) * 1000
    return ms if all(done) else None


def run_one(api, template, number, engine, interval, extra=None):
    task = api.create(template, number, extra)
    return wait_complete(api, task, engine, interval, template in DYNAMIC)


def step_results(api, engine, task, handlers="rust"):
    """{step name: result} of a finished task, as each engine reports it. Tasker's Python
    handlers must return a dict: they return a number n as {"result": n} (Tasker's own
    convention, handlers/tasker_worker.py), unwrapped here."""
    if engine == "embarcadero":
        return {s["name"]: s.get("result") for s in api.call("GET", f"/v1/tasks/{task}")["steps"]}
    steps = api.call("GET", f"/v1/tasks/{task}/workflow_steps")
    if isinstance(steps, dict):  # a wrapped list
        steps = next(v for v in steps.values() if isinstance(v, list))
    out = {}
    for s in steps:
        r = s.get("results")
        # Tasker stores the whole StepExecutionResult; the handler's value is its `result`.
        if isinstance(r, dict) and "result" in r and ("success" in r or "step_uuid" in r):
            r = r["result"]
        if handlers == "python" and isinstance(r, dict) and list(r) == ["result"]:
            r = r["result"]
        out[s["name"]] = r
    return out


def check(api, engine, shape, handlers="rust"):
    """Runs one task of `shape` and fails unless its steps and last result are as expected."""
    template, number, extra = SHAPES[shape]
    names, last, want = EXPECTED[shape]
    task = api.create(template, number, extra)
    if not wait_complete(api, task, engine, 0.01, template in DYNAMIC):
        raise RuntimeError(f"{engine} {shape}: check task {task} did not complete")
    got = step_results(api, engine, task, handlers)
    if sorted(got) != sorted(names) or got[last] != want:
        raise RuntimeError(f"{engine} {shape}: steps {got}, want {names} and {last} = {want}")
    print(f"{engine} {shape}: checked, {last} = {json.dumps(got[last])}", file=sys.stderr)


def pct(sorted_ms, p):
    return sorted_ms[min(len(sorted_ms) - 1, round((len(sorted_ms) - 1) * p))]


def summary(samples):
    """n and p50/p95/p99 in ms; the percentiles are None when no sample was kept (every task
    of the method got stuck), which `table` prints as "-" and `plot` leaves out."""
    s = sorted(samples)
    if not s:
        return {"n": 0, "p50": None, "p95": None, "p99": None}
    return {"n": len(s), "p50": pct(s, 0.5), "p95": pct(s, 0.95), "p99": pct(s, 0.99)}


def sustained(addresses, engine, clients, seconds, interval):
    """Closed loop: each client creates a linear task and waits for it, until time is up.
    Client i talks to addresses[i % len(addresses)] (several Tasker orchestration processes
    share the load round-robin, as in the seed's cluster run)."""
    latencies, lock, stop = [], threading.Lock(), time.perf_counter() + seconds

    def client(address):
        api = Api(address)
        while time.perf_counter() < stop:
            start = time.perf_counter()
            if run_one(api, "linear", 2, engine, interval):
                with lock:
                    latencies.append((time.perf_counter() - start) * 1000)

    threads = [
        threading.Thread(target=client, args=(addresses[i % len(addresses)],))
        for i in range(clients)
    ]
    begun = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result = summary(latencies)
    result["tasks_per_s"] = len(latencies) / (time.perf_counter() - begun)
    result["clients"] = clients
    return result


def save(out, path):
    """Writes the result file; measure calls it after every shape, so a run that fails later
    (or is stopped) keeps what it measured."""
    out["create_errors"] = len(CREATE_ERRORS)
    out["stuck_tasks"] = len(STUCK)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def measure(args):
    raw_interval = None if args.engine == "embarcadero" else 0.001
    addresses = args.api.split(",")
    # concurrent_2x's two tasks go to two orchestration processes when there are two.
    apis = [Api(addresses[0]), Api(addresses[1 % len(addresses)])]
    out = {"engine": args.engine, "handlers": args.handlers, "shapes": {}, "checked": [],
           "api_processes": len(addresses)}
    for shape in filter(None, args.shapes.split(",")):
        if shape in EXPECTED:
            check(apis[0], args.engine, shape, args.handlers)
            out["checked"].append(shape)
        one_sample(apis, shape, args.engine, raw_interval)  # warm-up, not counted
        poll = [one_sample(apis, shape, args.engine, 0.05) for _ in range(args.poll_samples)]
        raw = [one_sample(apis, shape, args.engine, raw_interval) for _ in range(args.raw_samples)]
        poll, raw = [ms for ms in poll if ms is not None], [ms for ms in raw if ms is not None]
        out["shapes"][shape] = {"poll50": summary(poll), "raw": summary(raw)}
        print(
            f"{args.engine} {shape}: poll50 {out['shapes'][shape]['poll50']} "
            f"raw {out['shapes'][shape]['raw']}",
            file=sys.stderr,
        )
        save(out, args.out)
    if args.sustained_seconds > 0:
        # Tasker has no long poll: its clients poll every sustained_poll_ms (see --help).
        interval = None if args.engine == "embarcadero" else args.sustained_poll_ms / 1000
        out["sustained_poll_ms"] = None if args.engine == "embarcadero" else args.sustained_poll_ms
        out["sustained"] = sustained(
            addresses, args.engine, args.clients, args.sustained_seconds, interval
        )
        print(f"{args.engine} sustained: {out['sustained']}", file=sys.stderr)
    save(out, args.out)
    print(f"{args.engine}: {len(STUCK)} tasks stuck (left out)", file=sys.stderr)
    print(f"{args.engine}: {len(CREATE_ERRORS)} creations refused and retried", file=sys.stderr)


def sweep(args):
    """Sustained runs at each client count and poll interval, one line each: where an
    engine's throughput peaks, and what polling does to it (Tasker has no long poll)."""
    addresses = args.api.split(",")
    rows = []
    print(f"{'clients':>7} {'poll ms':>7} {'tasks/s':>8} {'n':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for clients in (int(c) for c in args.clients.split(",")):
        for poll in args.poll_ms.split(","):
            interval = None if poll == "long" else float(poll) / 1000
            r = sustained(addresses, args.engine, clients, args.seconds, interval)
            r["poll_ms"] = poll
            rows.append(r)
            p50 = f"{r['p50']:8.1f}" if r["n"] else "       -"
            p99 = f"{r['p99']:8.1f}" if r["n"] else "       -"
            print(f"{clients:7} {poll:>7} {r['tasks_per_s']:8.2f} {r['n']:6} {p50} {p99}",
                  flush=True)
    out = {"engine": args.engine, "api_processes": len(addresses), "seconds": args.seconds,
           "runs": rows, "create_errors": len(CREATE_ERRORS), "stuck_tasks": len(STUCK)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def label(run):
    """An engine's name, with its handlers' language unless they are Rust."""
    handlers = run.get("handlers", "rust")
    return run["engine"] if handlers == "rust" else f"{run['engine']}-{handlers}"


def overhead(args):
    """Per engine, the linear shape's p50 with each language's handlers against the same
    engine's Rust handlers: the difference over the 4 steps, per step, and in percent."""
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    print(f"{'engine':12} {'handlers':11} {'method':7} {'n':>4} {'p50 ms':>9} "
          f"{'+ms/step':>9} {'vs rust':>8}")
    for engine in dict.fromkeys(r["engine"] for r in runs):
        mine = [r for r in runs if r["engine"] == engine and "linear" in r["shapes"]]
        base = next((r for r in mine if r.get("handlers", "rust") == "rust"), None)
        for method in ("poll50", "raw"):
            for r in mine:
                s = r["shapes"]["linear"][method]
                b = base["shapes"]["linear"][method]["p50"] if base else None
                if b is None or s["p50"] is None:
                    extra = "        -        -"
                else:
                    extra = f"{(s['p50'] - b) / 4:9.2f} {(s['p50'] / b - 1) * 100:7.0f}%"
                print(f"{engine:12} {r.get('handlers', 'rust'):11} {method:7} {s['n']:4} "
                      f"{fmt(s, 'p50'):>9} {extra}")


def fmt(r, key):
    return f"{r[key]:8.1f}" if r and r.get(key) is not None else "       -"


# The bar, for a table of Tasker (first) against ours (second): our p50 at least this
# many times lower per method, and sustained throughput at least 20x Tasker's with our p99
# under 100 ms.
BAR = {"raw": 20, "poll50": 4}
BAR_SUSTAINED, BAR_P99_MS = 20, 100


def verdict(ratio, need):
    return f"{'met' if ratio >= need else 'NOT met'} (>= {need}x)"


def is_bar_pair(runs):
    return len(runs) == 2 and [label(r) for r in runs] == ["tasker", "embarcadero"]


def sustained_verdict(runs):
    """The sustained bar's line, or None when the pair or a sustained run is missing."""
    if not is_bar_pair(runs) or not all(r.get("sustained", {}).get("n") for r in runs):
        return None
    theirs, ours = runs[0]["sustained"], runs[1]["sustained"]
    ratio = ours["tasks_per_s"] / theirs["tasks_per_s"]
    met = ratio >= BAR_SUSTAINED and ours["p99"] < BAR_P99_MS
    return (f"sustained bar: ours {ratio:.1f}x Tasker's throughput at our p99 {ours['p99']:.1f} ms: "
            f"{'met' if met else 'NOT met'} (>= {BAR_SUSTAINED}x at p99 < {BAR_P99_MS} ms)")


def table(args):
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    names = [label(r) for r in runs]
    bar = is_bar_pair(runs)
    print(
        f"{'shape':15} {'method':7} "
        + " ".join(f"{n + ' ' + k:>18}" for n in names for k in ("p50", "p95", "p99"))
        + "   p50 first/second" + ("   bar" if bar else "")
    )
    shapes = list(dict.fromkeys(s for r in runs for s in r["shapes"]))
    for shape in shapes:
        for method in ("poll50", "raw"):
            rs = [r["shapes"].get(shape, {}).get(method) for r in runs]
            cells = " ".join(f"{fmt(r, k):>18}" for r in rs for k in ("p50", "p95", "p99"))
            ratio = ""
            if len(rs) == 2 and all(r and r.get("p50") for r in rs):
                x = rs[0]["p50"] / rs[1]["p50"]
                ratio = f"{x:8.1f}x" + (f"   {verdict(x, BAR[method])}" if bar else "")
            print(f"{shape:15} {method:7} {cells}   {ratio}")
    for r in runs:
        if r.get("create_errors"):
            print(f"{label(r)}: {r['create_errors']} task creations refused (500) and retried")
        if r.get("stuck_tasks"):
            print(f"{label(r)}: {r['stuck_tasks']} tasks not complete after {STUCK_S} s, "
                  "left out of the samples (n counts the samples kept)")
        if r.get("sustained", {}).get("n"):
            s = r["sustained"]
            poll = r.get("sustained_poll_ms")
            how = f", polled every {poll:g} ms" if poll else ""
            procs = r.get("api_processes", 1)
            how += f", {procs} orchestration processes" if procs > 1 else ""
            print(
                f"sustained {label(r)}: {s['tasks_per_s']:.1f} tasks/s with {s['clients']} "
                f"clients{how}, p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms"
            )
    line = sustained_verdict(runs)
    if line:
        print(line)


# The plot: hand-written SVG (standard library only). Colours per engine, shades per percentile.
COLOURS = {
    "tasker": ("#f4a582", "#d6604d", "#b2182b"),
    "embarcadero": ("#92c5de", "#4393c3", "#2166ac"),
}
PCTS = ("p50", "p95", "p99")


def log_axis(lo, hi):
    """Decade bounds covering [lo, hi] (ms or tasks/s, all > 0)."""
    return 10 ** math.floor(math.log10(max(lo, 1e-3))), 10 ** math.ceil(math.log10(max(hi, 1e-3)))


def svg_text(x, y, text, size=11, anchor="middle", extra=""):
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-family="sans-serif" {extra}>{text}</text>')


def log_y_grid(x0, y0, w, h, lo, hi, label):
    """Horizontal decade lines and labels of a log-scale y axis; returns (elements, y of value)."""
    span = math.log10(hi) - math.log10(lo)

    def y(v):
        return y0 + h - (math.log10(max(v, lo)) - math.log10(lo)) / span * h

    out = []
    for k in range(round(span) + 1):
        v = lo * 10**k
        out.append(f'<line x1="{x0}" y1="{y(v):.1f}" x2="{x0 + w}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(svg_text(x0 - 4, y(v) + 4, f"{v:g}", anchor="end"))
    turn = f'transform="rotate(-90 {x0 - 44} {y0 + h / 2})"'
    out.append(svg_text(x0 - 44, y0 + h / 2, label, extra=turn))
    return out, y


def latency_panel(runs, method, x0, y0, w, h):
    """Bars of p50/p95/p99 per shape and engine for one method, log-scale milliseconds."""
    shapes = list(dict.fromkeys(s for r in runs for s in r["shapes"]))
    values = [r["shapes"][s][method][p] for r in runs for s in r["shapes"] for p in PCTS]
    values = [v for v in values if v is not None] or [1.0]  # None: no sample kept
    lo, hi = log_axis(min(values), max(values))
    out, y = log_y_grid(x0, y0, w, h, lo, hi, "ms (log)")
    out.append(svg_text(x0 + w / 2, y0 - 10, f"latency per shape, method {method}", 13))
    group = w / max(len(shapes), 1)
    bar = group * 0.8 / (3 * len(runs))
    for i, shape in enumerate(shapes):
        gx = x0 + i * group + group * 0.1
        for j, r in enumerate(runs):
            res = r["shapes"].get(shape, {}).get(method)
            for k, p in enumerate(PCTS):
                if not res or res.get(p) is None:
                    continue
                bx, top = gx + (j * 3 + k) * bar, y(res[p])
                fill = COLOURS.get(r["engine"], ("#ccc",) * 3)[k]
                out.append(f'<rect x="{bx:.1f}" y="{top:.1f}" width="{bar - 1:.1f}" '
                           f'height="{y0 + h - top:.1f}" fill="{fill}"><title>{label(r)} '
                           f'{shape} {p} {res[p]:.1f} ms</title></rect>')
        out.append(svg_text(x0 + i * group + group / 2, y0 + h + 14, shape))
    return out


def sustained_panel(runs, x0, y0, w, h):
    """One point per engine: sustained throughput (x, log) against its p99 (y, log)."""
    pts = [(r["engine"], dict(r["sustained"], poll=r.get("sustained_poll_ms"),
                              procs=r.get("api_processes", 1)))
           for r in runs if r.get("sustained", {}).get("n")]
    if not pts:
        return [svg_text(x0 + w / 2, y0 + h / 2, "no sustained run")]
    rates, p99s = [s["tasks_per_s"] for _, s in pts], [s["p99"] for _, s in pts]
    xlo, xhi = log_axis(min(rates), max(rates))
    out, y = log_y_grid(x0, y0, w, h, *log_axis(min(p99s), max(p99s)), "p99 ms (log)")
    xspan = math.log10(xhi) - math.log10(xlo)

    def x(v):
        return x0 + (math.log10(v) - math.log10(xlo)) / xspan * w

    for k in range(round(xspan) + 1):
        v = xlo * 10**k
        out.append(f'<line x1="{x(v):.1f}" y1="{y0}" x2="{x(v):.1f}" y2="{y0 + h}" stroke="#ddd"/>')
        out.append(svg_text(x(v), y0 + h + 14, f"{v:g}"))
    out.append(svg_text(x0 + w / 2, y0 + h + 30, "tasks/s (log)"))
    out.append(svg_text(x0 + w / 2, y0 - 10, "sustained: throughput against p99", 13))
    for engine, s in pts:
        px, py = x(s["tasks_per_s"]), y(s["p99"])
        fill = COLOURS.get(engine, ("#888",) * 3)[2]
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{fill}"/>')
        how = f", polled every {s['poll']:g} ms" if s["poll"] else ""
        how += f", {s['procs']} orchestrators" if s["procs"] > 1 else ""
        text = (f"{engine}: {s['tasks_per_s']:.1f}/s, p99 {s['p99']:.0f} ms "
                f"({s['clients']} clients{how})")
        right = px > x0 + w / 2  # a label right of a point in the right half would be cut off
        tx, anchor = (px - 8, "end") if right else (px + 8, "start")
        out.append(svg_text(tx, py - 6, text, anchor=anchor))
    return out


def legend(runs, x0, y0):
    out = []
    for j, r in enumerate(runs):
        for k, p in enumerate(PCTS):
            fill = COLOURS.get(r["engine"], ("#ccc",) * 3)[k]
            x = x0 + (j * 3 + k) * 130
            out.append(f'<rect x="{x}" y="{y0}" width="12" height="12" fill="{fill}"/>')
            out.append(svg_text(x + 16, y0 + 10, f"{label(r)} {p}", anchor="start"))
    return out


def plot(args):
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    width, panel = 960, 260
    body = legend(runs, 80, 12)
    body += latency_panel(runs, "raw", 80, 60, width - 110, panel)
    body += latency_panel(runs, "poll50", 80, 60 + panel + 70, width - 110, panel)
    body += sustained_panel(runs, 80, 60 + 2 * (panel + 70), width - 110, panel)
    height = 60 + 3 * (panel + 70)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}"><rect width="100%" height="100%" fill="white"/>\n'
           + "\n".join(body) + "\n</svg>\n")
    with open(args.out, "w") as f:
        f.write(svg)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure one engine")
    m.add_argument("--engine", choices=["tasker", "embarcadero"], required=True)
    m.add_argument("--api", required=True, help="HOST:PORT of the engine's REST API; several, "
                   "comma-separated, for several Tasker orchestration processes (round-robin)")
    m.add_argument("--shapes", default=",".join(SHAPES))
    m.add_argument("--poll-samples", type=int, default=50)
    m.add_argument("--raw-samples", type=int, default=200)
    m.add_argument("--sustained-seconds", type=float, default=0)
    m.add_argument("--clients", type=int, default=8)
    m.add_argument("--sustained-poll-ms", type=float, default=50,
                   help="Tasker's poll interval in the sustained run (it has no long poll); "
                   "50 ms as in its own method: faster polling costs it throughput (`sweep`)")
    m.add_argument("--handlers", default="rust", choices=["rust", "python", "typescript"],
                   help="the language of the worker's handlers (recorded in the result file)")
    m.add_argument("--out", required=True)
    w = sub.add_parser("sweep", help="sustained runs at several client counts and poll "
                       "intervals (linear tasks, closed loop)")
    w.add_argument("--engine", choices=["tasker", "embarcadero"], required=True)
    w.add_argument("--api", required=True, help="as for measure")
    w.add_argument("--clients", default="1,2,4,8", help="comma-separated client counts")
    w.add_argument("--poll-ms", default="50", help="comma-separated poll intervals in ms, "
                   "or `long` (Embarcadero's long poll)")
    w.add_argument("--seconds", type=float, default=15, help="per client count and interval")
    w.add_argument("--out", help="a JSON file for the rows")
    o = sub.add_parser("overhead", help="per-step handler overhead of each language against "
                       "the same engine's Rust handlers (linear shape, p50)")
    o.add_argument("files", nargs="+")
    t = sub.add_parser("table", help="print result files side by side (first / second = ratio)")
    t.add_argument("files", nargs="+")
    g = sub.add_parser("plot", help="draw result files as an SVG")
    g.add_argument("files", nargs="+")
    g.add_argument("--out", required=True, help="the SVG file to write")
    args = p.parse_args()
    {"measure": measure, "sweep": sweep, "table": table, "plot": plot,
     "overhead": overhead}[args.cmd](args)


if __name__ == "__main__":
    main()
