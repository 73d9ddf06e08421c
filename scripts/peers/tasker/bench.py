#!/usr/bin/env python3
"""Issue 25's workflow benchmark client: the same HTTP client for Tasker and Embarcadero.

Per shape, two methods:
  poll50: Tasker's own method: POST /v1/tasks, then GET every 50 ms until
          execution_status == all_complete (50 samples by default);
  raw:    POST until the engine first reports the task complete: Embarcadero's long poll
          (GET ?wait=), Tasker polled every 1 ms (it has no long poll); 200 samples by default.
`sustained` runs closed-loop clients creating linear tasks and reports throughput and p99.
Results go to a JSON file; `table` prints two such files side by side. Standard library only.
"""

import argparse
import http.client
import json
import sys
import threading
import time
import uuid

SHAPES = {  # template name, the root's number (larger shapes overflow 64 bits when squaring 2)
    "linear": ("linear", 2),
    "diamond": ("diamond", 2),
    "complex_dag": ("complex_dag", 1),
    "tree": ("tree", 1),
    "concurrent_2x": ("linear", 2),
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

    def create(self, template, number):
        body = {
            "name": template,
            "namespace": "bench",
            "version": "1.0.0",
            # A unique field: Tasker's default identity strategy refuses an identical context.
            "context": {"even_number": number, "run": str(uuid.uuid4())},
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


def wait_complete(api, task, engine, interval):
    """Returns when the task is complete; interval None means Embarcadero's long poll."""
    path = f"/v1/tasks/{task}" + ("?wait=10" if interval is None else "")
    give_up = time.perf_counter() + STUCK_S
    while True:
        t = api.call("GET", path)
        if t["execution_status"] == "all_complete":
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
    template, number = SHAPES[shape]
    start = time.perf_counter()
    done = []
    if shape == "concurrent_2x":  # two linear tasks at once; the sample ends when both are done
        threads = [
            threading.Thread(
                target=lambda a: done.append(run_one(a, template, number, engine, interval)),
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
        done.append(run_one(apis[0], template, number, engine, interval))
    ms = (time.perf_counter() - start) * 1000
    return ms if all(done) else None


def run_one(api, template, number, engine, interval):
    return wait_complete(api, api.create(template, number), engine, interval)


def pct(sorted_ms, p):
    return sorted_ms[min(len(sorted_ms) - 1, round((len(sorted_ms) - 1) * p))]


def summary(samples):
    s = sorted(samples)
    return {"n": len(s), "p50": pct(s, 0.5), "p95": pct(s, 0.95), "p99": pct(s, 0.99)}


def sustained(address, engine, clients, seconds, interval):
    """Closed loop: each client creates a linear task and waits for it, until time is up."""
    latencies, lock, stop = [], threading.Lock(), time.perf_counter() + seconds

    def client():
        api = Api(address)
        while time.perf_counter() < stop:
            start = time.perf_counter()
            if run_one(api, "linear", 2, engine, interval):
                with lock:
                    latencies.append((time.perf_counter() - start) * 1000)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    begun = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result = summary(latencies) if latencies else {"n": 0, "p50": 0, "p95": 0, "p99": 0}
    result["tasks_per_s"] = len(latencies) / (time.perf_counter() - begun)
    result["clients"] = clients
    return result


def measure(args):
    raw_interval = None if args.engine == "embarcadero" else 0.001
    apis = [Api(args.api), Api(args.api)]
    out = {"engine": args.engine, "shapes": {}}
    for shape in args.shapes.split(","):
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
    if args.sustained_seconds > 0:
        interval = None if args.engine == "embarcadero" else args.sustained_poll_ms / 1000
        out["sustained_poll_ms"] = None if args.engine == "embarcadero" else args.sustained_poll_ms
        out["sustained"] = sustained(
            args.api, args.engine, args.clients, args.sustained_seconds, interval
        )
        print(f"{args.engine} sustained: {out['sustained']}", file=sys.stderr)
    out["create_errors"] = len(CREATE_ERRORS)
    out["stuck_tasks"] = len(STUCK)
    print(f"{args.engine}: {len(STUCK)} tasks stuck (left out)", file=sys.stderr)
    print(f"{args.engine}: {len(CREATE_ERRORS)} creations refused and retried", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def fmt(r, key):
    return f"{r[key]:8.1f}" if r else "       -"


def table(args):
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    names = [r["engine"] for r in runs]
    print(
        f"{'shape':15} {'method':7} "
        + " ".join(f"{n + ' ' + k:>18}" for n in names for k in ("p50", "p95", "p99"))
        + "   p50 first/second"
    )
    shapes = list(dict.fromkeys(s for r in runs for s in r["shapes"]))
    for shape in shapes:
        for method in ("poll50", "raw"):
            rs = [r["shapes"].get(shape, {}).get(method) for r in runs]
            cells = " ".join(f"{fmt(r, k):>18}" for r in rs for k in ("p50", "p95", "p99"))
            ratio = f"{rs[0]['p50'] / rs[1]['p50']:8.1f}x" if all(rs) and len(rs) == 2 else ""
            print(f"{shape:15} {method:7} {cells}   {ratio}")
    for r in runs:
        if r.get("create_errors"):
            print(f"{r['engine']}: {r['create_errors']} task creations refused (500) and retried")
        if r.get("stuck_tasks"):
            print(f"{r['engine']}: {r['stuck_tasks']} tasks not complete after {STUCK_S} s, "
                  "left out of the samples (n counts the samples kept)")
        if "sustained" in r:
            s = r["sustained"]
            print(
                f"sustained {r['engine']}: {s['tasks_per_s']:.1f} tasks/s with {s['clients']} "
                f"clients, p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms"
            )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure one engine")
    m.add_argument("--engine", choices=["tasker", "embarcadero"], required=True)
    m.add_argument("--api", required=True, help="HOST:PORT of the engine's REST API")
    m.add_argument("--shapes", default=",".join(SHAPES))
    m.add_argument("--poll-samples", type=int, default=50)
    m.add_argument("--raw-samples", type=int, default=200)
    m.add_argument("--sustained-seconds", type=float, default=0)
    m.add_argument("--clients", type=int, default=8)
    m.add_argument("--sustained-poll-ms", type=float, default=5, help="Tasker's poll interval")
    m.add_argument("--out", required=True)
    t = sub.add_parser("table", help="print result files side by side (first / second = ratio)")
    t.add_argument("files", nargs="+")
    args = p.parse_args()
    measure(args) if args.cmd == "measure" else table(args)


if __name__ == "__main__":
    main()
