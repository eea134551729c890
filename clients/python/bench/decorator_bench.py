"""What ``@once`` costs a call: calls/s and p50/p99 latency of a decorated function on its first
execution (fresh keys: claim + complete) and on replay (one claim answering the stored result),
next to the same function undecorated, measured in the same run, with the ratios.

    python bench/decorator_bench.py --serve                 # starts onceguard serve (memory store)
    python bench/decorator_bench.py --url URL --api-key KEY # against a running server

Calls are sequential (one caller, one keep-alive connection): the figures are per-call latency
over loopback HTTP, not the server's throughput (see `onceguard bench` for that).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from typing import Any, Callable

import urllib3

import onceguard
from _shared import fmt, percentile, serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("ONCEGUARD_URL"))
    parser.add_argument("--api-key", default=os.environ.get("ONCEGUARD_API_KEY"))
    parser.add_argument("--serve", action="store_true", help="start onceguard serve for the run")
    parser.add_argument("--store", default="memory://", help="the store of --serve (default memory://)")
    parser.add_argument("-n", "--calls", type=int, default=2000, help="calls per case (default 2000)")
    args = parser.parse_args()

    proc = workdir = None
    if args.serve or not args.url:
        proc, args.url, args.api_key, workdir = serve(args.store)
    try:
        run(args.url, args.api_key, args.calls, args.store if proc else "(external)")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def run(url: str, api_key: str, n: int, store: str) -> None:
    namespace = f"bench/decorator-{uuid.uuid4().hex[:8]}"
    with onceguard.Client(url, api_key) as client:

        def plain(order: int, amount: int) -> dict[str, Any]:
            return {"order": order, "amount": amount, "status": "refunded"}

        first = onceguard.once(client, namespace, name="refund")(plain)
        no_heartbeat = onceguard.once(client, namespace, name="refund-no-heartbeat", heartbeat=False)(plain)
        replayed = onceguard.once(client, namespace, name="refund-replayed")(plain)
        for i in range(n):  # the keys the replay case reads: stored beforehand, not timed
            replayed(i, 25)
        for i in range(50):  # warm-up: connection, server
            first(-1 - i, 25)

        def claim_only(i: int) -> Any:
            return client.claim(namespace, f"raw-{i}", request={"order": i, "amount": 25})

        cases: dict[str, Callable[[int], Any]] = {
            "plain function (undecorated)": lambda i: plain(i, 25),
            "client.claim alone (one HTTP call)": claim_only,
            "@once first execution": lambda i: first(i, 25),
            "@once first execution, heartbeat=False": lambda i: no_heartbeat(i, 25),
            "@once replay": lambda i: replayed(i, 25),
        }
        # Interleaved in rounds, in a rotating order, so that a slower moment of the machine
        # does not land on one case only.
        latencies: dict[str, list[float]] = {name: [] for name in cases}
        chunk = 100
        names = list(cases)
        for r, lo in enumerate(range(0, n, chunk)):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                for i in range(lo, min(n, lo + chunk)):
                    start = time.perf_counter()
                    cases[name](i)
                    latencies[name].append(time.perf_counter() - start)

    print(f"onceguard @once benchmark: {n} sequential calls per case, server {url}, store {store}")
    print(f"python {sys.version.split()[0]}, urllib3 {urllib3.__version__}")
    print()
    print(f"{'case':42} {'calls/s':>10} {'p50':>10} {'p99':>10}")
    stats = {}
    for name, lat in latencies.items():
        rate = len(lat) / sum(lat)
        stats[name] = (rate, percentile(lat, 50), percentile(lat, 99))
        print(f"{name:42} {rate:10.0f} {fmt(stats[name][1]):>10} {fmt(stats[name][2]):>10}")
    print()
    plain_p50 = stats["plain function (undecorated)"][1]
    claim_p50 = stats["client.claim alone (one HTTP call)"][1]
    first_p50, replay_p50 = stats["@once first execution"][1], stats["@once replay"][1]
    nohb_p50 = stats["@once first execution, heartbeat=False"][1]
    print("ratios (p50 latency):")
    print(f"  first execution / plain call        {first_p50 / plain_p50:10.0f}x")
    print(f"  replay / plain call                 {replay_p50 / plain_p50:10.0f}x")
    print(f"  first execution / replay            {first_p50 / replay_p50:10.2f}x  (claim + complete vs one claim)")
    print(f"  replay / client.claim alone         {replay_p50 / claim_p50:10.2f}x  (the decorator's own work on a replay)")
    print(f"  first / first without heartbeat     {first_p50 / nohb_p50:10.2f}x  (starting and joining the heartbeat thread)")


if __name__ == "__main__":
    main()
