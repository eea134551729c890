"""What one HTTP exchange with the server costs the caller, per HTTP client: the replay's claim
(``POST /v1/claims`` of a stored key) sent through httpx, urllib3, ``http.client``, pycurl and
aiohttp, and through the client's own ``claim`` (sync on each of its transports, and async),
against the same server in one run.

    python bench/transport_bench.py --serve -n 3000     # starts onceguard serve (memory store)

Each case makes ``-n`` sequential calls (one caller, one keep-alive connection), the cases
taking turns in rounds of 100 after a warm-up; printed per case: p50 and p99 latency and the
caller's own CPU per call (this process's user+system time over the case's rounds ÷ its calls),
which does not move with whatever else runs on the machine the way latency does.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import shutil
import sys
import time
import uuid
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp
import httpx
import pycurl
import urllib3

import onceguard
from onceguard._http import headers_of
from onceguard._sync import _backend
from _shared import fmt, percentile, serve

ROUND = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="start onceguard serve for the run (the only mode)")
    parser.add_argument("--store", default="memory://", help="the server's store (default memory://)")
    parser.add_argument("-n", "--calls", type=int, default=3000, help="calls per case (default 3000)")
    args = parser.parse_args()
    proc, url, api_key, workdir = serve(args.store)
    try:
        run(url, api_key, args.calls, args.store)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def run(url: str, api_key: str, n: int, store: str) -> None:
    namespace, key, request = f"bench/transport-{uuid.uuid4().hex[:8]}", "stored", {"order": 1, "amount": 25}
    body = json.dumps({"namespace": namespace, "key": key, "request": request}).encode()
    headers = {"content-type": "application/json", "accept": "application/json", "authorization": f"Bearer {api_key}"}
    parts = urlsplit(url)
    loop = asyncio.new_event_loop()

    with onceguard.Client(url, api_key) as client:
        held = client.claim(namespace, key, request=request)
        assert isinstance(held, onceguard.Acquired), held
        client.complete(namespace, key, held.fence, {"ok": True})

        hx = httpx.Client(base_url=url, headers=headers)
        pool = urllib3.HTTPConnectionPool(parts.hostname, parts.port, maxsize=4)
        conn = http.client.HTTPConnection(parts.hostname, parts.port)
        ahx = httpx.AsyncClient(base_url=url, headers=headers)
        aclient = onceguard.AsyncClient(url, api_key)
        with_urllib3 = onceguard.Client(url, api_key)
        with_urllib3._transport.close()
        with_urllib3._transport = _backend.Urllib3Transport(
            with_urllib3.base_url, headers_of(api_key, None), max_connections=4, verify=True
        )
        curl = pycurl.Curl()
        curl_headers = [f"{name}: {value}" for name, value in headers.items()] + ["Expect:"]

        async def session() -> aiohttp.ClientSession:
            return aiohttp.ClientSession(url, headers=headers)

        aio = loop.run_until_complete(session())

        def via_http_client(i: int) -> bytes:
            conn.request("POST", "/v1/claims", body=body, headers=headers)
            return conn.getresponse().read()

        def via_pycurl(i: int) -> bytes:
            chunks: list[bytes] = []
            curl.setopt(pycurl.URL, url + "/v1/claims")
            curl.setopt(pycurl.POSTFIELDS, body)
            curl.setopt(pycurl.HTTPHEADER, curl_headers)
            curl.setopt(pycurl.WRITEFUNCTION, chunks.append)
            curl.perform()
            return b"".join(chunks)

        async def via_aiohttp() -> bytes:
            async with aio.post("/v1/claims", data=body) as answer:
                return await answer.read()

        cases: dict[str, Callable[[int], Any]] = {
            "httpx Client": lambda i: hx.post("/v1/claims", content=body).read(),
            "urllib3 HTTPConnectionPool": lambda i: pool.urlopen("POST", "/v1/claims", body=body, headers=headers).data,
            "http.client (no pool)": via_http_client,
            "pycurl (one handle)": via_pycurl,
            "onceguard Client.claim": lambda i: client.claim(namespace, key, request=request),
            "Client.claim on urllib3": lambda i: with_urllib3.claim(namespace, key, request=request),
            "httpx AsyncClient": lambda i: loop.run_until_complete(ahx.post("/v1/claims", content=body)),
            "aiohttp ClientSession": lambda i: loop.run_until_complete(via_aiohttp()),
            "onceguard AsyncClient.claim": lambda i: loop.run_until_complete(
                aclient.claim(namespace, key, request=request)
            ),
        }
        for name, case in cases.items():  # warm-up, and each answers the stored key's replay
            for i in range(300):
                case(i)
        assert isinstance(client.claim(namespace, key, request=request), onceguard.Replay)

        latencies: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, float] = {name: 0.0 for name in cases}
        names = list(cases)
        for r, lo in enumerate(range(0, n, ROUND)):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                case, lat = cases[name], latencies[name]
                c0 = time.process_time()
                for i in range(lo, min(n, lo + ROUND)):
                    start = time.perf_counter()
                    case(i)
                    lat.append(time.perf_counter() - start)
                cpu[name] += time.process_time() - c0

        hx.close()
        pool.close()
        conn.close()
        curl.close()
        with_urllib3.close()
        loop.run_until_complete(ahx.aclose())
        loop.run_until_complete(aio.close())
        loop.run_until_complete(aclient.aclose())
        loop.close()

    print(f"one replay claim per call: {n} sequential calls per case, server {url}, store {store}")
    print(
        f"python {sys.version.split()[0]}, httpx {httpx.__version__}, urllib3 {urllib3.__version__}, "
        f"{pycurl.version.split()[0]} ({pycurl.version.split()[1]}), aiohttp {aiohttp.__version__} "
        "(async cases: each call run to its end on one event loop)"
    )
    print()
    print(f"{'case':30} {'p50':>10} {'p99':>10} {'CPU/call':>10}")
    for name, lat in latencies.items():
        print(
            f"{name:30} {fmt(percentile(lat, 50)):>10} {fmt(percentile(lat, 99)):>10} {fmt(cpu[name] / len(lat)):>10}"
        )
    print()
    per_call = {name: cpu[name] / len(latencies[name]) for name in cases}
    print("the client's claim over its transport, CPU per call:")
    print(f"  sync:  {fmt(per_call['onceguard Client.claim'] - per_call['pycurl (one handle)'])} over pycurl alone")
    print(
        f"  sync on urllib3: {fmt(per_call['Client.claim on urllib3'] - per_call['urllib3 HTTPConnectionPool'])}"
        " over urllib3 alone"
    )
    print(f"  async: {fmt(per_call['onceguard AsyncClient.claim'] - per_call['aiohttp ClientSession'])} over aiohttp alone")


if __name__ == "__main__":
    main()
