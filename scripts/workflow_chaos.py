#!/usr/bin/env python3
"""The workflow engine's chaos test (issue 27): a head and a follower broker, the
workflow topic at rf 2 / ack 2, one orchestrator (with --standby two: the active one
and a standby that takes over when it dies) and several workers, a few hundred
tasks of every shape, while a nemesis SIGKILLs a worker, the orchestrator or the
follower at random moments and restarts it. Then checks, task by task, against the
API's audit trail and the workers' run log (`worker --run-log`: one line `task step
attempt worker` before each handler run):

- every task is `complete`;
- every step was completed once, and accepted exactly one result per attempt that
  returned (`enqueued_for_orchestration` entered 1 + failures times);
- every attempt but the last was lost or failed: attempts == 1 + failures + lease losses;
- no attempt's handler ran twice; the last attempt ran once, on the worker whose claim
  the audit shows as the winner; a run of an earlier attempt is allowed only as one of
  the attempts the audit shows lost (lease losses) or failed, and is reported as on a
  worker the nemesis killed or on a live one (a lease that ran out while it lived);
- no handler ran on a worker whose claim the audit shows refused (`lost to`).

Run through scripts/workflow-chaos.sh; exits 1 on any violation or unplanned exit.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A follower is dead after 3 x 100 ms (as in the cluster tests), so clients move on fast.
FAST_CLUSTER = {
    "EMBARCADERO_CLUSTER_HEARTBEAT_INTERVAL_MS": "100",
    "EMBARCADERO_CLUSTER_SEQUENCER_LEASE_MS": "400",
}

# Shapes beyond Tasker's four benchmark templates (read from crates/cli/src/bench/workflow) and
# the conditional one (testdata/workflow, shared with crates/cli/tests/workflow.rs):
# the CSV batch with checkpoints, retries, and a chain of sleeps (steps long enough to
# be killed in).
EXTRA_TEMPLATES = [
    """name: csv
namespace: bench
version: 1.0.0
steps:
  - {name: analyze, type: batchable, handler: {callable: csv.analyze}}
  - name: process
    type: batch_worker
    dependencies: [analyze]
    handler: {callable: csv.process_batch, initialization: {pause_ms: 60}}
  - {name: aggregate, type: deferred_convergence, dependencies: [process], handler: {callable: csv.aggregate}}
""",
    """name: flaky
namespace: bench
version: 1.0.0
steps:
  - name: once
    handler: {callable: test.fail_times, initialization: {failures: 1}}
    retry: {max_attempts: 3, backoff: linear, backoff_base_ms: 50}
  - {name: after, dependencies: [once], handler: {callable: test.fail_times, initialization: {failures: 0}}}
""",
    """name: sleepy
namespace: bench
version: 1.0.0
steps:
  - {name: nap, handler: {callable: test.sleep, initialization: {ms: 400}}}
  - {name: doze, dependencies: [nap], handler: {callable: test.sleep, initialization: {ms: 400}}}
""",
]

# (namespace, template, context) per shape; contexts keep math.square's products
# within 64 bits.
SHAPES = [
    ("bench", "linear", {"even_number": 2}),
    ("bench", "diamond", {"even_number": 2}),
    ("bench", "complex_dag", {"even_number": 1}),
    ("bench", "tree", {"even_number": 1}),
    ("demo", "conditional", {"even_number": 2, "branches": ["small", "large"]}),
    ("bench", "csv", {"rows": 200, "worker_count": 4, "checkpoint_every": 10}),
    ("bench", "flaky", {"even_number": 2}),
    ("bench", "sleepy", {}),
]


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Proc:
    """An `embarcadero` process with its stderr and stdout in a file, so that its ready
    line can be waited for and nothing blocks on a full pipe."""

    def __init__(self, binary, args, out_path, env=None):
        self.out_path = out_path
        self.out = open(out_path, "ab")
        full_env = dict(os.environ, **(env or {}))
        self.p = subprocess.Popen([binary] + args, stdout=self.out, stderr=self.out, env=full_env)

    def wait_line(self, pattern, timeout=60.0):
        """The first line of this process's output (since its start) matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.out_path, errors="replace") as f:
                for line in f.read().splitlines():
                    if re.search(pattern, line):
                        return line
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.out_path}: exited {self.p.returncode} before {pattern!r}")
            time.sleep(0.02)
        raise RuntimeError(f"{self.out_path}: no {pattern!r} within {timeout} s")

    def sigkill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=30)

    def exited(self):
        return self.p.poll() is not None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(api, method, path, body=None, content_type="application/json", timeout=30):
    """(status, JSON) of one request; raises OSError when the API is unreachable."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(f"http://{api}{path}", data=data, method=method)
    req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def retrying(what, fn, timeout=90.0):
    """Calls `fn` until it returns a value (not None) or raises nothing retryable,
    through orchestrator restarts (connection refused, 503), for at most `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value is not None:
                return value
        except (OSError, urllib.error.URLError) as e:
            last = e
        time.sleep(0.1)
    raise RuntimeError(f"{what}: no answer within {timeout} s (last: {last})")


class Cluster:
    """The processes under test, each restartable after a SIGKILL: the head (never
    killed: it holds the disk replicas and the sequencer), follower broker 1, the
    orchestrator (on a fixed API port, so clients find it again), with `standby` a
    second one on its own port (one holds the lease and decides, the other folds the
    log and takes over when the first dies), and the workers."""

    def __init__(self, binary, workdir, lease_ms, workers, standby=False):
        self.binary, self.dir, self.lease_ms = binary, workdir, str(lease_ms)
        self.run_log = os.path.join(workdir, "runs.log")
        # Every orchestrator's API answers every route (a standby's too).
        self.apis = [f"127.0.0.1:{free_port()}" for _ in range(2 if standby else 1)]
        self.api = self.apis[0]
        self.starts = defaultdict(int)
        self.head = self.spawn("head", FAST_CLUSTER, [
            "broker", "--head", "--brokers", "2", "--base-port", "0", "--control-port", "0",
            "--data-dir", os.path.join(workdir, "head")])
        line = self.head.wait_line("embarcadero is serving")
        self.control = re.search(r"control API http://(\S+)", line).group(1)
        self.follower = self.start_follower()
        self.orchestrators = [self.start_orchestrator(api) for api in self.apis]
        self.takeovers = 0
        self.workers = {}
        self.killed_workers = set()
        for _ in range(workers):
            self.start_worker()

    def spawn(self, role, env, args):
        self.starts[role] += 1
        out = os.path.join(self.dir, f"{role}-{self.starts[role]}.log")
        return Proc(self.binary, args, out, env)

    def log_args(self):
        return ["--control", self.control, "--lease-ms", self.lease_ms, "--rf", "2", "--ack", "2"]

    def start_follower(self):
        p = self.spawn("follower", FAST_CLUSTER, [
            "broker", "--follower", "--head-addr", self.control, "--broker-id", "1"])
        p.wait_line("is serving at")
        return p

    def start_orchestrator(self, api):
        # A restarted orchestrator (or the standby) waits out its killed predecessor's
        # lease before it decides: keep that as short as the workers' lease.
        args = ["orchestrator", "--listen", api, "--failover-ms", "1000"]
        p = self.spawn("orchestrator", {}, args + self.log_args())
        p.wait_line("workflow orchestrator is serving")
        return p

    def active_orchestrator(self):
        """The index of the orchestrator that says it holds the lease (0 if none says
        so, or there is one only)."""
        for i, api in enumerate(self.apis if len(self.apis) > 1 else []):
            try:
                with urllib.request.urlopen(f"http://{api}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except (OSError, urllib.error.URLError):
                continue
            if "embarcadero_workflow_orchestrator_active 1" in text:
                return i
        return 0

    def start_worker(self):
        p = self.spawn("worker", {}, ["worker", "--run-log", self.run_log, "--concurrency", "4"]
                       + self.log_args())
        wid = re.search(r"workflow worker (\S+) is running", p.wait_line("is running")).group(1)
        self.workers[wid] = p
        return wid

    def kill(self, victim):
        """SIGKILLs `victim` ("worker", "orchestrator" or "follower") and restarts it."""
        if victim == "worker":
            wid = random.choice(sorted(self.workers))
            self.workers.pop(wid).sigkill()
            self.killed_workers.add(wid)
            return f"worker {wid} -> {self.start_worker()}"
        if victim == "orchestrator":
            # With a standby, the active one first and mostly: its death is the
            # takeover; the standby a quarter of the time after that.
            i = self.active_orchestrator()
            if len(self.apis) > 1 and self.takeovers > 0 and random.random() < 0.25:
                i = 1 - i
            active = len(self.apis) > 1 and i == self.active_orchestrator()
            self.orchestrators[i].sigkill()
            self.orchestrators[i] = self.start_orchestrator(self.apis[i])
            if len(self.apis) == 1:
                return "orchestrator"
            self.takeovers += int(active)
            return f"orchestrator {i} ({'active' if active else 'standby'})"
        self.follower.sigkill()
        self.follower = self.start_follower()
        return "follower broker 1"

    def unplanned_exits(self):
        """Processes that ended without being killed; each is restarted (and reported)."""
        found = []
        if self.head.exited():
            raise RuntimeError(f"the head exited; see {self.head.out_path}")
        if self.follower.exited():
            found.append(self.follower.out_path)
            self.follower = self.start_follower()
        for i, p in enumerate(self.orchestrators):
            if p.exited():
                found.append(p.out_path)
                self.orchestrators[i] = self.start_orchestrator(self.apis[i])
        for wid, p in list(self.workers.items()):
            if p.exited():
                found.append(p.out_path)
                del self.workers[wid]
                self.start_worker()
        return found

    def stop(self):
        procs = self.orchestrators + [self.follower, self.head] + list(self.workers.values())
        for p in procs:
            if not p.exited():
                p.p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.sigkill()


def register_templates(api):
    folder = os.path.join(ROOT, "crates", "cli", "src", "bench", "workflow")
    texts = [open(os.path.join(folder, f)).read() for f in sorted(os.listdir(folder))]
    texts.append(open(os.path.join(ROOT, "testdata", "workflow", "conditional.yaml")).read())
    for yaml in texts + EXTRA_TEMPLATES:
        status, body = retrying("register a template",
                                lambda: http(api, "POST", "/v1/templates", yaml.encode(), "application/yaml"))
        if status not in (200, 201):
            raise RuntimeError(f"template refused: {status} {body}")


def submit(apis, i):
    """Task `i` (shapes in turn), with an idempotency key, so that a retry after an
    answer lost to an orchestrator kill finds the task instead of making a second one.
    With several orchestrators, tasks go to each in turn, and a retry to the next."""
    namespace, name, context = SHAPES[i % len(SHAPES)]
    body = {"namespace": namespace, "name": name, "version": "1.0.0", "context": context,
            "idempotency_key": f"chaos-{i}"}
    tries = [i]

    def attempt():
        api = apis[tries[0] % len(apis)]
        tries[0] += 1
        status, answer = http(api, "POST", "/v1/tasks", body)
        if status in (200, 201):
            return answer["task_uuid"]
        if status != 503:
            raise RuntimeError(f"task {i} refused: {status} {answer}")
        return None
    return retrying(f"submit task {i}", attempt)


class Submitter(threading.Thread):
    """Submits `count` tasks at `rate` a second, through the nemesis' kills."""

    def __init__(self, apis, count, rate):
        super().__init__(daemon=True)
        self.apis, self.count, self.rate = apis, count, rate
        self.uuids, self.error = {}, None

    def run(self):
        try:
            for i in range(self.count):
                self.uuids[i] = submit(self.apis, i)
                time.sleep(1.0 / self.rate)  # pacing the load, not synchronisation
        except Exception as e:  # reported by the main thread
            self.error = e


def count_in(api, status):
    """How many tasks are in `status`, or None while the API does not answer."""
    code, body = http(api, "GET", f"/v1/tasks?status={status}&per_page=1")
    return body["pagination"]["total_count"] if code == 200 else None


VICTIMS = ["worker", "orchestrator", "follower"]


def nemesis(cluster, submitter, min_secs, gap, counts, anomalies):
    """Kills and restarts a random victim every `gap` (random range) seconds until the
    submitter is done and `min_secs` have passed."""
    end = time.monotonic() + min_secs
    hard_end = end + 3600
    # Every kind of victim once first (in a random order), so that even a short run
    # kills each; then at random, workers three times as often.
    first = random.sample(VICTIMS, len(VICTIMS))
    while (submitter.is_alive() or time.monotonic() < end or first) and time.monotonic() < hard_end:
        time.sleep(random.uniform(*gap))  # the random moment of the next kill
        anomalies.extend(cluster.unplanned_exits())
        victim = first.pop() if first else random.choices(VICTIMS, [3, 1, 1])[0]
        log(f"SIGKILL {cluster.kill(victim)}")
        counts[victim] += 1


def wait_for_all(cluster, count, timeout, anomalies):
    """Waits until `count` tasks are finished (complete or error) or `timeout` s passed;
    returns how many are complete."""
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        anomalies.extend(cluster.unplanned_exits())
        try:
            done, failed = count_in(cluster.api, "complete"), count_in(cluster.api, "error")
            if done is not None and failed is not None and done + failed >= count:
                return done
        except OSError:
            pass
        time.sleep(0.5)
    return done or 0


def read_runs(path):
    """(task, step) -> [(attempt, worker)] from the workers' run log."""
    runs = defaultdict(list)
    with open(path) as f:
        for line in f:
            task, step, attempt, worker = line.split()
            runs[(task, step)].append((int(attempt), worker))
    return runs


def entered(step, state):
    return sum(1 for t in step["transitions"] if t["to"] == state)


def check_step(task, step, runs, killed, stats):
    """The violations of one step of a finished task (see the module's comment)."""
    where = f"task {task} step {step['name']}"
    bad = []
    if step["current_state"] != "complete" or entered(step, "complete") != 1:
        bad.append(f"{where}: {step['current_state']}, entered complete {entered(step, 'complete')} times")
    failures, losses, attempts = step["failures"], step["lease_losses"], step["attempts"]
    # Every attempt comes back once (its result, or the orchestrator's expiry of it).
    if entered(step, "enqueued_for_orchestration") != attempts:
        bad.append(f"{where}: {entered(step, 'enqueued_for_orchestration')} attempts came back "
                   f"of {attempts}")
    if attempts != 1 + failures + losses:
        bad.append(f"{where}: attempt {attempts} after {failures} failures and {losses} lease losses")
    by_attempt = defaultdict(list)
    for attempt, worker in runs:
        by_attempt[attempt].append(worker)
    for attempt, workers in sorted(by_attempt.items()):
        if len(workers) > 1:
            bad.append(f"{where}: attempt {attempt} ran {len(workers)} times, on {workers}")
        for w in workers:
            if any(f"claim of attempt {attempt} of {step['name']} by {w} lost" in r
                   for r in step["refused_events"]):
                bad.append(f"{where}: attempt {attempt} ran on {w}, whose claim was refused")
    if by_attempt.get(attempts) != [step["worker"]]:
        bad.append(f"{where}: the accepted attempt {attempts} of {step['worker']} ran on "
                   f"{by_attempt.get(attempts)}")
    earlier = [(a, w) for a, ws in by_attempt.items() if a != attempts for w in ws]
    if any(a > attempts for a, _ in earlier) or len(earlier) > failures + losses:
        bad.append(f"{where}: earlier runs {sorted(earlier)} beyond {failures} failures "
                   f"and {losses} lease losses")
    stats["runs"] += len(runs)
    stats["steps"] += 1
    stats["lease_losses"] += losses
    stats["failures"] += failures
    stats["reruns"] += len(earlier)
    stats["reruns_on_killed_workers"] += sum(1 for _, w in earlier if w in killed)
    return bad


def check(api, uuids, run_log, killed, audit):
    """Checks every task (each written to `audit`, one JSON a line, for post-mortems);
    returns (violations, stats)."""
    runs = read_runs(run_log)
    stats = defaultdict(int)
    bad = []
    checked = set()
    for i, uuid in sorted(uuids.items()):
        status, task = retrying(f"get task {uuid}", lambda: http(api, "GET", f"/v1/tasks/{uuid}"))
        audit.write(json.dumps(task) + "\n")
        if status != 200 or task["status"] != "complete":
            bad.append(f"task {i} {uuid}: {status} {task.get('status')}")
            continue
        stats["tasks"] += 1
        checked.add(uuid)
        for step in task["steps"]:
            bad += check_step(uuid, step, runs.pop((uuid, step["name"]), []), killed, stats)
    for (task, step), r in sorted(runs.items()):
        if task in checked:
                bad.append(f"task {task} step {step}: {len(r)} runs of a step the API does not show")
    return bad, stats


def parse_args():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--bin", default=os.path.join(ROOT, "target", "debug", "embarcadero"))
    a.add_argument("--tasks", type=int, default=400)
    a.add_argument("--rate", type=float, default=15.0, help="tasks submitted a second")
    a.add_argument("--workers", type=int, default=3)
    a.add_argument("--lease-ms", type=int, default=1000)
    a.add_argument("--min-secs", type=float, default=20.0, help="least time under the nemesis")
    a.add_argument("--gap", type=float, nargs=2, default=[1.0, 3.0], help="seconds between kills")
    a.add_argument("--finish-secs", type=float, default=180.0, help="deadline to complete after it")
    a.add_argument("--seed", type=int, default=None)
    a.add_argument("--standby", action="store_true",
                   help="a second orchestrator beside the first: a standby that takes over "
                        "when the active one is killed (killed itself a quarter of the time)")
    a.add_argument("--keep", action="store_true",
                   help="keep the working directory after a pass (a failed run's is always kept)")
    return a.parse_args()


def report(args, counts, done, anomalies, bad, stats, workdir, takeovers=0):
    log(f"kills: {dict(counts)}; tasks complete {done}/{args.tasks}")
    if args.standby:
        log(f"standby: {takeovers} kills of the active orchestrator (takeovers by the standby)")
    log(f"checked {stats['tasks']} tasks, {stats['steps']} steps, {stats['runs']} handler runs; "
        f"{stats['failures']} failures, {stats['lease_losses']} lease losses; "
        f"{stats['reruns']} runs of earlier attempts (failed or lost): "
        f"{stats['reruns_on_killed_workers']} on workers later killed, "
        f"{stats['reruns'] - stats['reruns_on_killed_workers']} on live ones")
    for a in anomalies:
        log(f"UNPLANNED EXIT: {a}")
    for b in bad[:50]:
        log(f"VIOLATION: {b}")
    ok = not bad and not anomalies and done >= args.tasks
    log(f"{'PASSED' if ok else 'FAILED'} ({len(bad)} violations, {len(anomalies)} unplanned exits); "
        f"logs in {workdir}")
    return ok


def main():
    args = parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    random.seed(seed)
    workdir = tempfile.mkdtemp(prefix="workflow-chaos-")
    log(f"seed {seed}; working directory {workdir}")
    cluster = Cluster(args.bin, workdir, args.lease_ms, args.workers, args.standby)
    counts, anomalies = defaultdict(int), []
    ok = False
    try:
        register_templates(cluster.api)
        submitter = Submitter(cluster.apis, args.tasks, args.rate)
        submitter.start()
        nemesis(cluster, submitter, args.min_secs, args.gap, counts, anomalies)
        submitter.join(timeout=120)
        if submitter.error or submitter.is_alive():
            raise RuntimeError(f"the submitter failed: {submitter.error}")
        log(f"{len(submitter.uuids)} tasks submitted; nemesis stopped; waiting for completion")
        done = wait_for_all(cluster, args.tasks, args.finish_secs, anomalies)
        with open(os.path.join(workdir, "tasks.jsonl"), "w") as audit:
            bad, stats = check(cluster.api, submitter.uuids, cluster.run_log,
                               cluster.killed_workers, audit)
        ok = report(args, counts, done, anomalies, bad, stats, workdir, cluster.takeovers)
    finally:
        cluster.stop()
    if ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        log(f"removed {workdir} (--keep keeps it)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
