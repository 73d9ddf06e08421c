#!/usr/bin/env python3
"""Does a server give back what abusive clients made it take? (issue 28, resource limits)

Starts `embarcadero serve` on ephemeral ports, then runs ROUNDS rounds of CASES abusive
connections each (random bytes, truncated and malformed hellos and batch headers,
subscribers that leave at once or talk after their hello, half-sent admin requests and
garbage HTTP), with a little real publishing in between. After each round it waits until
the brokers report no open connections, then records the process's anonymous memory
(RssAnon: heap and stacks; the region's mapped pages are RssFile and are not growth) and
thread count. Memory is bounded if the later rounds stay at the level the first reached.

Usage: scripts/abuse-memory.py [--bin target/release/embarcadero] [--rounds 4] [--cases 5000]
Prints one line per round and a verdict; exits 1 if anonymous memory keeps growing by more
than 10% a round after the first, or threads do not return to their idle count.
"""

import argparse
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MAGIC = b"EMBD"


def start_server(binary, data_dir):
    proc = subprocess.Popen(
        [binary, "serve", "--base-port", "0", "--control-port", "0", "--data-dir", data_dir],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if "embarcadero is serving" in line:
            control = re.search(r"control API http://(\S+)", line).group(1)
            brokers = line.split("brokers", 1)[1].split()
            # The log goes on; someone must read it or the server blocks writing it.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, control, brokers
    raise SystemExit("the server did not start")


def status_of(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    kib = lambda k: int(fields.get(k, "0 kB").split()[0])
    return kib("RssAnon"), kib("RssFile"), int(fields["Threads"])


def metric(control, name):
    text = urllib.request.urlopen(f"http://{control}/metrics", timeout=10).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name))


def send_and_close(addr, data, linger=False):
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            if data:
                s.sendall(data)
            if linger:
                s.settimeout(0.05)
                try:
                    s.recv(4096)
                except OSError:
                    pass
    except OSError:
        pass  # a refusal is an answer too


def abusive_case(rng, brokers, control):
    broker = rng.choice(brokers)
    kind = rng.randrange(6)
    if kind == 0:  # random bytes
        send_and_close(broker, rng.randbytes(rng.randrange(1, 512)))
    elif kind == 1:  # a frame header that promises more than it sends
        send_and_close(broker, MAGIC + rng.randbytes(rng.randrange(4, 60)))
    elif kind == 2:  # connect and leave at once
        send_and_close(broker, b"")
    elif kind == 3:  # talk, wait for an answer, leave
        send_and_close(broker, MAGIC + rng.randbytes(200), linger=True)
    elif kind == 4:  # half an HTTP request to the admin API
        send_and_close(control, b"POST /v1/topics HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    else:  # HTTP garbage
        send_and_close(control, rng.randbytes(rng.randrange(1, 300)) + b"\r\n\r\n", linger=True)


def wait_for_quiet(control, deadline_s=120):
    end = time.time() + deadline_s
    while time.time() < end:
        if metric(control, "embarcadero_connections_open") == 0:
            return True
        time.sleep(0.2)
    return False


def publish_some(binary, control):
    subprocess.run(
        [binary, "pub", "abuse", "--count", "20000", "--size", "100", "--control", control],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get("EMBARCADERO_BIN", "target/release/embarcadero"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cases", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=28)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as data:
        proc, control, brokers = start_server(args.bin, os.path.join(data, "d"))
        try:
            subprocess.run(
                [args.bin, "topic", "create", "abuse", "--order", "2", "--control", control],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            publish_some(args.bin, control)
            idle = status_of(proc.pid)
            print(f"start: RssAnon {idle[0]} KiB, RssFile {idle[1]} KiB, {idle[2]} threads")
            rounds = []
            for r in range(1, args.rounds + 1):
                for _ in range(args.cases):
                    abusive_case(rng, brokers, control)
                publish_some(args.bin, control)
                quiet = wait_for_quiet(control)
                anon, file_, threads = status_of(proc.pid)
                rounds.append((anon, threads))
                print(f"round {r}: {args.cases} cases; connections closed: {quiet}; "
                      f"RssAnon {anon} KiB, RssFile {file_} KiB, {threads} threads")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    first = rounds[0][0]
    growing = any(later > first * 1.10 + 4096 for later, _ in rounds[1:])
    threads_back = all(t <= idle[2] + 2 for _, t in rounds)
    print("verdict:", "bounded" if not growing and threads_back else "GROWS")
    sys.exit(1 if growing or not threads_back else 0)


if __name__ == "__main__":
    main()
