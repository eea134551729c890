"""``@once`` next to AWS Lambda Powertools' ``@idempotent_function`` on the same local Redis, and
where the time of one ``@once`` call goes.

    python bench/powertools_bench.py --serve              # starts onceguard serve on the Redis
    python bench/powertools_bench.py --serve -n 5000 --redis redis://127.0.0.1:6379/0

It needs the ``bench`` extra (``pip install -e 'clients/python[bench]'``) and a Redis on
127.0.0.1 (default ``redis://127.0.0.1:6379/0``). The server binary is ``$ONCEGUARD_BIN``, else
``$CARGO_TARGET_DIR/release/onceguard`` or ``target/release/onceguard``, else the debug build; it
is started with ``--store redis://…?prefix=onceguard-bench-<random>:`` (and a key scan every hour
only, so that the ``/metrics`` scrapes between rounds do not read the store). Every key written
(the server's and Powertools') is under that prefix and is deleted at the end.

Cases, ``-n`` sequential calls each (default 2000), interleaved in rounds of 100 in a rotating
order, each round framed by a scrape of the server's ``/metrics`` and Redis's ``INFO
commandstats`` (outside the timed calls):

- Powertools ``@idempotent_function`` with ``CachePersistenceLayer`` (the Redis persistence
  layer; ``RedisCachePersistenceLayer`` is its older name) on a ``redis.Redis`` client,
  ``use_local_cache=False`` (its default, set explicitly), so every call goes to Redis, and a
  Lambda context registered that reports 30 s left (its in-progress expiry; ``@once`` has a
  30 s lease); first execution (fresh keys) and replay (keys stored beforehand);
- ``@once`` (defaults, heartbeat on) against the server: first execution and replay;
- ``@once`` on a client whose transport is a canned one, answering the server's
  own answers, recorded beforehand: the client's Python work without the network (first
  execution also with ``heartbeat=False``: what starting and joining the heartbeat thread takes);
- ``GET /healthz`` (the cheapest endpoint: no store, no key) on the same keep-alive client, and
  through the canned transport: their difference, less the server's own time for it, is what
  one HTTP exchange over loopback adds (sockets, HTTP parsing on both sides); the same for the
  replay's ``POST /v1/claims`` sent by ``client.claim``, whose exchange (a JSON body, a longer
  answer) is the one counted in the breakdown;
- the plain function.

The server's time per request and the store's per operation are the differences of the sums
÷ the differences of the counts of ``onceguard_http_request_duration_seconds`` (by route) and
``onceguard_store_operation_duration_seconds`` (by operation) over each case's rounds: means,
where the client figures are medians. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import time
import uuid
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx
import urllib3

import onceguard
from _shared import find_binary, fmt, percentile, serve
from onceguard._http import Response

try:
    import redis
    from aws_lambda_powertools import __version__ as powertools_version  # type: ignore[attr-defined]
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer
except ImportError as e:  # pragma: no cover
    sys.exit(f"{e}: install the bench extra: pip install -e 'clients/python[bench]'")

CHUNK = 100
LOCAL_HOSTS = ("127.0.0.1", "localhost")


# ------------------------------------------------------------------------------------------------
# What is read between rounds: the server's histograms and Redis's command counts
# ------------------------------------------------------------------------------------------------

_SAMPLE = re.compile(
    r"^onceguard_(http_request|store_operation)_duration_seconds_(sum|count)\{([^}]*)\} (\S+)$", re.MULTILINE
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
#: Store operations the server runs by itself, not for a request.
BACKGROUND_OPS = ("sweep", "purge")

Series = tuple[str, str]  # ("http", "POST /v1/claims 201") or ("store", "claim")


def server_snapshot(scraper: httpx.Client) -> dict[tuple[Series, str], float]:
    out: dict[tuple[Series, str], float] = defaultdict(float)
    for family, part, labels, value in _SAMPLE.findall(scraper.get("/metrics").text):
        lab = dict(_LABEL.findall(labels))
        if family == "http_request":
            if lab["route"] == "/metrics":
                continue
            series = ("http", f"{lab['method']} {lab['route']} {lab['status']}")
        else:
            if lab["op"] in BACKGROUND_OPS:
                continue
            series = ("store", lab["op"] if lab["result"] == "ok" else f"{lab['op']} ({lab['result']})")
        out[(series, part)] += float(value)
    return out


def redis_snapshot(r: redis.Redis) -> dict[str, tuple[int, int]]:
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in r.info("commandstats").items()
        if name != "cmdstat_info"
    }


class Tally:
    """What the server and Redis did during one case's rounds."""

    def __init__(self) -> None:
        self.calls = 0
        self.server: dict[Series, list[float]] = defaultdict(lambda: [0.0, 0.0])  # sum, count
        self.redis: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # calls, usec

    def add(self, calls: int, s0: dict, s1: dict, r0: dict, r1: dict) -> None:
        self.calls += calls
        for (series, part), value in s1.items():
            delta = value - s0.get((series, part), 0.0)
            if delta:
                self.server[series][0 if part == "sum" else 1] += delta
        for cmd, (n, usec) in r1.items():
            n0, usec0 = r0.get(cmd, (0, 0))
            if n - n0:
                self.redis[cmd][0] += n - n0
                self.redis[cmd][1] += usec - usec0

    def per_call(self, kind: str) -> tuple[float, float]:
        """(seconds, operations) per call of the series of ``kind`` (http or store)."""
        total = sum(v[0] for s, v in self.server.items() if s[0] == kind)
        count = sum(v[1] for s, v in self.server.items() if s[0] == kind)
        return total / max(1, self.calls), count / max(1, self.calls)

    def redis_per_call(self) -> tuple[float, float, str]:
        calls = sum(v[0] for v in self.redis.values())
        usec = sum(v[1] for v in self.redis.values())
        detail = ", ".join(
            f"{cmd} {v[0] / self.calls:.2f}" for cmd, v in sorted(self.redis.items(), key=lambda kv: -kv[1][0])
        )
        return calls / max(1, self.calls), usec / 1e6 / max(1, self.calls), detail


# ------------------------------------------------------------------------------------------------
# The client without the network: the server's answers, recorded, then replayed
# ------------------------------------------------------------------------------------------------


class Recorder:
    """A client's transport, passing requests on and keeping the last answer of each kind
    ("POST /v1/claims 201", …)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.answers: dict[str, Response] = {}

    def send(self, method: str, path: str, *rest: Any, **named: Any) -> Response:
        response: Response = self.inner.send(method, path, *rest, **named)
        self.answers[f"{method} {path} {response.status_code}"] = response
        return response

    def close(self) -> None:
        self.inner.close()


class Canned:
    """A transport answering ``METHOD PATH`` with the recorded answer of that request, without
    the network."""

    def __init__(self, answers: dict[str, Response]) -> None:
        self.by_request = {" ".join(kind.split()[:2]): answer for kind, answer in answers.items()}

    def send(self, method: str, path: str, *rest: Any, **named: Any) -> Response:
        return self.by_request[f"{method} {path}"]

    def close(self) -> None:
        pass


def with_transport(client: onceguard.Client, transport: Any) -> onceguard.Client:
    """``client`` sending through ``transport`` instead of its own (which has no connection
    yet, or which ``transport`` wraps)."""
    client._transport = transport
    return client


def healthz(client: onceguard.Client) -> Response:
    """``GET /healthz`` through the client's transport (no store, no key: the cheapest request)."""
    return client._transport.send("GET", "/healthz", None, None, None, client.timeout, idempotent=True)


# ------------------------------------------------------------------------------------------------


class FakeLambdaContext:
    """What Powertools reads of a Lambda context: the time left, for its in-progress expiry."""

    function_name = "powertools-bench"

    def get_remaining_time_in_millis(self) -> int:
        return 30_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="start onceguard serve on the Redis (the only mode)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the Redis of both (on 127.0.0.1)")
    parser.add_argument("-n", "--calls", type=int, default=2000, help="calls per case (default 2000)")
    args = parser.parse_args()
    parts = urlsplit(args.redis)
    if parts.scheme != "redis" or parts.hostname not in LOCAL_HOSTS or parts.query:
        sys.exit("--redis must be redis://127.0.0.1[:port][/db], without a query")
    if args.calls < CHUNK:
        sys.exit(f"-n must be at least {CHUNK}")

    prefix = f"onceguard-bench-{uuid.uuid4().hex[:12]}:"
    r = redis.Redis.from_url(args.redis, decode_responses=True)
    r.ping()
    binary = find_binary(("release", "debug"))
    proc, url, api_key, workdir = serve(
        f"{args.redis}?prefix={prefix}og:", binary=binary, env={"ONCEGUARD_METRICS__REFRESH_INTERVAL": "1h"}
    )
    try:
        run(url, api_key, r, prefix, args.calls, binary, args.redis)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
        deleted = 0
        for _ in range(10_000):  # bounded: SCAN until no key under the prefix is left
            keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
            if not keys:
                break
            for i in range(0, len(keys), 500):
                deleted += r.delete(*keys[i : i + 500])
        print(f"\ndeleted {deleted} Redis keys under {prefix}*")
        r.close()


def run(url: str, api_key: str, r: redis.Redis, prefix: str, n: int, binary: Path, redis_url: str) -> None:
    namespace = f"bench/powertools-{uuid.uuid4().hex[:8]}"

    def plain(order: int, amount: int) -> dict[str, Any]:
        return {"order": order, "amount": amount, "status": "refunded"}

    # -- Powertools ------------------------------------------------------------------------------
    # CachePersistenceLayer is RedisCachePersistenceLayer, which warns of its own name.
    warnings.filterwarnings("ignore", message="RedisCachePersistenceLayer will be removed", category=DeprecationWarning)
    config = IdempotencyConfig(use_local_cache=False)
    config.register_lambda_context(FakeLambdaContext())  # type: ignore[arg-type]

    def powertools(name: str) -> Callable[..., Any]:
        @idempotent_function(
            data_keyword_argument="order",
            persistence_store=CachePersistenceLayer(client=r),  # type: ignore[arg-type]  # redis-py's wider set()
            config=config,
            key_prefix=f"{prefix}pt:{name}",
        )
        def refund(order: dict[str, int]) -> dict[str, Any]:
            return plain(order["order"], order["amount"])

        return refund

    pt_first, pt_replayed = powertools("first"), powertools("replayed")

    # -- @once: recording the server's answers for the canned transport -------------------------------
    rec = onceguard.Client(url, api_key)
    recorder = Recorder(rec._transport)
    with with_transport(rec, recorder):
        recorded = onceguard.once(rec, namespace, name="recorded")(plain)
        recorded(0, 25)  # claim (201) + complete
        recorded(0, 25)  # claim (200: replay)
        healthz(rec)
    answers = recorder.answers
    first_answers = {k: v for k, v in answers.items() if k in ("POST /v1/claims 201", "POST /v1/claims/complete 200")}
    replay_answers = {k: v for k, v in answers.items() if k in ("POST /v1/claims 200", "GET /healthz 200")}
    assert len(first_answers) == 2 and len(replay_answers) == 2, sorted(answers)

    with (
        onceguard.Client(url, api_key) as client,
        with_transport(onceguard.Client(url, api_key), Canned(first_answers)) as mock_first,
        with_transport(onceguard.Client(url, api_key), Canned(replay_answers)) as mock_replay,
        httpx.Client(base_url=url) as scraper,
    ):
        first = onceguard.once(client, namespace, name="refund")(plain)
        replayed = onceguard.once(client, namespace, name="refund-replayed")(plain)
        # The async client, each call run to its end on one event loop (the loop's own step is
        # timed apart, as "event loop step").
        loop = asyncio.new_event_loop()
        aclient = onceguard.AsyncClient(url, api_key)

        async def aplain(order: int, amount: int) -> dict[str, Any]:
            return plain(order, amount)

        async def noop() -> None:
            pass

        afirst = onceguard.once(aclient, namespace, name="refund-async")(aplain)
        areplayed = onceguard.once(aclient, namespace, name="refund-async-replayed")(aplain)
        first_mock = onceguard.once(mock_first, namespace, name="refund")(plain)
        first_mock_nohb = onceguard.once(mock_first, namespace, name="refund", heartbeat=False)(plain)
        replay_mock = onceguard.once(mock_replay, namespace, name="refund-replayed")(plain)
        for i in range(n):  # the keys the replay cases read: stored beforehand, not timed
            replayed(i, 25)
            loop.run_until_complete(areplayed(i, 25))
            pt_replayed(order={"order": i, "amount": 25})

        def claim_replay(c: onceguard.Client) -> Callable[[int], Any]:
            # The claim @once sends for a replay, without the decorator: one POST answered from the store.
            request = {"order": 0, "amount": 25}
            return lambda i: c.claim(namespace, "replayed-raw", request=request, lease=30.0, wait=10.0)

        stored = client.claim(namespace, "replayed-raw", request={"order": 0, "amount": 25}, lease=30.0)
        assert isinstance(stored, onceguard.Acquired), stored
        client.complete(namespace, "replayed-raw", stored.fence, plain(0, 25))

        cases: dict[str, Callable[[int], Any]] = {
            "plain function (undecorated)": lambda i: plain(i, 25),
            "Powertools first execution": lambda i: pt_first(order={"order": i, "amount": 25}),
            "Powertools replay": lambda i: pt_replayed(order={"order": i, "amount": 25}),
            "@once first execution": lambda i: first(i, 25),
            "@once replay": lambda i: replayed(i, 25),
            "async @once first execution": lambda i: loop.run_until_complete(afirst(i, 25)),
            "async @once replay": lambda i: loop.run_until_complete(areplayed(i, 25)),
            "event loop step": lambda i: loop.run_until_complete(noop()),
            "@once first, canned transport": lambda i: first_mock(i, 25),
            "@once first, no heartbeat, Mock": lambda i: first_mock_nohb(i, 25),
            "@once replay, canned transport": lambda i: replay_mock(i, 25),
            "client.claim replay (one POST)": claim_replay(client),
            "client.claim replay, Mock": claim_replay(mock_replay),
            "GET /healthz": lambda i: healthz(client),
            "GET /healthz, canned transport": lambda i: healthz(mock_replay),
        }
        for j in range(50):  # warm-up: connections, server, caches (keys apart from the timed ones)
            for case in cases.values():
                case(-1 - j)
        assert pt_replayed(order={"order": 0, "amount": 25}) == plain(0, 25)
        assert replay_mock(0, 25) == plain(0, 25)

        latencies: dict[str, list[float]] = {name: [] for name in cases}
        tallies: dict[str, Tally] = {name: Tally() for name in cases}
        names = list(cases)
        for rnd, lo in enumerate(range(0, n, CHUNK)):
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                case, lat = cases[name], latencies[name]
                hi = min(n, lo + CHUNK)
                s0, r0 = server_snapshot(scraper), redis_snapshot(r)
                for i in range(lo, hi):
                    start = time.perf_counter()
                    case(i)
                    lat.append(time.perf_counter() - start)
                r1, s1 = redis_snapshot(r), server_snapshot(scraper)
                tallies[name].add(hi - lo, s0, s1, r0, r1)
        loop.run_until_complete(aclient.aclose())
        loop.close()

    report(n, url, binary, redis_url, r, latencies, tallies)


def report(
    n: int,
    url: str,
    binary: Path,
    redis_url: str,
    r: redis.Redis,
    latencies: dict[str, list[float]],
    tallies: dict[str, Tally],
) -> None:
    print(f"@once vs Powertools @idempotent_function: {n} sequential calls per case, interleaved in rounds of {CHUNK}")
    print(f"server {url} ({binary}), store and Powertools on {redis_url} (Redis {r.info('server')['redis_version']})")
    print(
        f"python {sys.version.split()[0]}, urllib3 {urllib3.__version__}, aws-lambda-powertools {powertools_version}, "
        f"redis-py {redis.__version__}; load average {os.getloadavg()[0]:.2f} at the end (cores: {os.cpu_count()})"
    )
    print()
    print(f"{'case':33} {'calls/s':>9} {'p50':>9} {'p99':>9}  {'mean':>9}  Redis commands per call")
    stats: dict[str, tuple[float, float, float, float]] = {}
    for name, lat in latencies.items():
        mean = sum(lat) / len(lat)
        stats[name] = (1 / mean, percentile(lat, 50), percentile(lat, 99), mean)
        commands, _, detail = tallies[name].redis_per_call()
        redis_col = f"{commands:.2f} ({detail})" if commands >= 0.005 else "-"
        print(
            f"{name:33} {stats[name][0]:9.0f} {fmt(stats[name][1]):>9} {fmt(stats[name][2]):>9}  "
            f"{fmt(mean):>9}  {redis_col}"
        )
    print()
    print("@once ÷ Powertools (calls/s):")
    for kind in ("first execution", "replay"):
        ratio = stats[f"@once {kind}"][0] / stats[f"Powertools {kind}"][0]
        print(f"  {kind:18} {ratio:6.2f}x")
    step = stats["event loop step"][3]
    for kind in ("first execution", "replay"):
        mean = stats[f"async @once {kind}"][3]
        ratio = stats[f"Powertools {kind}"][3] / mean
        print(f"  async, {kind:11} {ratio:6.2f}x ({stats[f'Powertools {kind}'][3] / (mean - step):.2f}x less the loop's step)")

    # -- the server's own figures ----------------------------------------------------------------
    print()
    print("the server's time (mean per request / store operation over the case's rounds, × per call):")
    for name in ("@once first execution", "@once replay", "client.claim replay (one POST)", "GET /healthz"):
        t = tallies[name]
        parts = [
            f"{series[1]} {fmt(s / c)} ×{c / t.calls:.2f}"
            for series, (s, c) in sorted(t.server.items())
            if c
        ]
        print(f"  {name:30} " + "; ".join(parts))

    # -- where the time of one call goes ---------------------------------------------------------
    p50 = {name: v[1] for name, v in stats.items()}
    health_server = tallies["GET /healthz"].per_call("http")[0]
    exchange = p50["GET /healthz"] - p50["GET /healthz, canned transport"] - health_server
    claim_server = tallies["client.claim replay (one POST)"].per_call("http")[0]
    post_exchange = p50["client.claim replay (one POST)"] - p50["client.claim replay, Mock"] - claim_server
    print()
    print(
        f"GET /healthz: {fmt(p50['GET /healthz'])} on the keep-alive client, {fmt(p50['GET /healthz, canned transport'])} "
        f"through the canned transport, {fmt(health_server)} in the server:"
    )
    print(f"  one HTTP exchange over loopback adds {fmt(exchange)} (sockets, HTTP on both sides)")
    print(
        f"POST /v1/claims (replay): {fmt(p50['client.claim replay (one POST)'])}, "
        f"{fmt(p50['client.claim replay, Mock'])} through the canned transport, {fmt(claim_server)} in the server:"
    )
    print(f"  its exchange adds {fmt(post_exchange)} (a body both ways, longer headers)")
    print()
    print("where the time of one @once call goes (µs; client parts are medians, server parts means):")
    print(f"  {'':36} {'first execution':>16} {'replay':>10}")
    rows: dict[str, list[float]] = defaultdict(list)
    for kind in ("first", "replay"):
        t = tallies["@once first execution" if kind == "first" else "@once replay"]
        server, requests = t.per_call("http")
        store, _ = t.per_call("store")
        _, redis_time, _ = t.redis_per_call()
        client = p50[f"@once {kind}, canned transport"]
        heartbeat = client - p50["@once first, no heartbeat, Mock"] if kind == "first" else 0.0
        measured = p50["@once first execution" if kind == "first" else "@once replay"]
        total = client + requests * post_exchange + server
        rows["client Python (canned transport)"].append(client)
        rows["  of which the heartbeat thread"].append(heartbeat)
        rows["HTTP + loopback (as POST /v1/claims)"].append(requests * post_exchange)
        rows["  of which as GET /healthz"].append(requests * exchange)
        rows["server (outside the store)"].append(server - store)
        rows["store"].append(store)
        rows["  of which Redis executing commands"].append(redis_time)
        rows["sum"].append(total)
        rows["measured p50"].append(measured)
        rows["rest (measured - sum)"].append(measured - total)
        rows["HTTP requests per call"].append(requests)
    for label, values in rows.items():
        if label == "HTTP requests per call":
            print(f"  {label:36} {values[0]:16.2f} {values[1]:10.2f}")
        else:
            print(f"  {label:36} {values[0] * 1e6:16.0f} {values[1] * 1e6:10.0f}")


if __name__ == "__main__":
    main()
