"""End-to-end tests of `onceguard mcp` with the official MCP Python SDK (`mcp`) and `fastmcp`
clients, in both protocol eras, against a real fastmcp server (tool_server.py) started here.

Each tool with a side effect appends a line to an effects file, so every test checks how often
the effect really ran, whatever the clients were told. Run by scripts/mcp-tests, which makes the
virtualenv and builds the binary (found at $CARGO_TARGET_DIR/debug/onceguard, or $ONCEGUARD_BIN).
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2
import mcp_types
import pytest
from fastmcp import Client as FastMCPClient
from fastmcp.client.transports import StreamableHttpTransport
from mcp.client import Client as SdkClient
from mcp.client.streamable_http import streamable_http_client
from processes import Gateway, free_port, onceguard, wait_port

HERE = Path(__file__).resolve().parent
UPSTREAM_NAME = "tools"
TENANT = "acme"
KEY_META = "dev.onceguard/idempotency-key"
RUN_META = "dev.onceguard/run-id"
REPLAYED = "dev.onceguard/replayed"

# (library, connect mode): the legacy era (initialize, Mcp-Session-Id) and the 2026-07-28 era
# (stateless POSTs, server/discover), as each client negotiates them.
CLIENTS = [
    ("mcp", "legacy"),
    ("mcp", "2026-07-28"),
    ("fastmcp", "legacy"),
    ("fastmcp", "auto"),
]
IDS = [f"{lib}-{mode}" for lib, mode in CLIENTS]


def gateway(world_store: str, upstream: str, workdir: str) -> Gateway:
    """The suite's gateway: a lease of 5 s, duplicates waiting 10 s."""
    return Gateway(world_store, upstream, workdir, UPSTREAM_NAME, "--lease", "5s", "--wait", "10s")


class World:
    """The fastmcp server, a SQLite store with a tenant and an agent API key, and a gateway."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="onceguard-mcp-")
        self.effects = os.path.join(self.dir, "effects.log")
        self.store = f"sqlite://{self.dir}/onceguard.db"
        port = free_port()
        self.server = subprocess.Popen(
            [sys.executable, str(HERE / "tool_server.py"), "--port", str(port), "--effects", self.effects],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "server.log"), "w"),
        )
        self.upstream = f"http://127.0.0.1:{port}/mcp"
        onceguard(self.store, "tenants", "create", TENANT)
        self.token = json.loads(onceguard(self.store, "api-keys", "create", "--tenant", TENANT, "--label", "e2e"))["token"]
        wait_port(port)
        self.gateway = gateway(self.store, self.upstream, self.dir)

    def executions(self, tool: str, **match) -> int:
        if not os.path.exists(self.effects):
            return 0
        with open(self.effects) as f:
            rows = [json.loads(line) for line in f]
        return sum(1 for r in rows if r["tool"] == tool and all(r.get(k) == v for k, v in match.items()))

    def close(self) -> None:
        self.gateway.stop()
        self.server.terminate()
        self.server.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def world():
    w = World()
    yield w
    w.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Tools:
    """One interface over both client libraries."""

    def __init__(self, lib: str, client) -> None:
        self.lib, self.client = lib, client

    async def list_tools(self) -> list[str]:
        tools = await self.client.list_tools()
        return [t.name for t in (tools.tools if self.lib == "mcp" else tools)]

    async def call(self, name: str, arguments: dict, key: str | None = None, run: str | None = None, progress=None):
        meta = {}
        if key is not None:
            meta[KEY_META] = key
        if run is not None:
            meta[RUN_META] = run
        if self.lib == "mcp":
            return await self.client.call_tool(name, arguments, meta=meta or None, progress_callback=progress)
        return await self.client.call_tool_mcp(name, arguments, meta=meta or None, progress_handler=progress)

    @property
    def version(self) -> str:
        if self.lib == "mcp":
            return self.client.session.protocol_version
        return self.client.session.protocol_version


@asynccontextmanager
async def connect(world: World, lib: str, mode: str, url: str | None = None, on_elicit=None):
    url = url or world.gateway.url
    headers = {"X-Onceguard-Key": world.token}
    if lib == "mcp":
        http = httpx2.AsyncClient(headers=headers, timeout=30)
        kwargs = {}
        if on_elicit is not None:
            async def elicit(ctx, params):
                return mcp_types.ElicitResult(action="accept", content=await on_elicit(params.message))
            kwargs["elicitation_callback"] = elicit
        async with SdkClient(streamable_http_client(url, http_client=http), mode=mode, **kwargs) as client:
            yield Tools(lib, client)
        await http.aclose()
    else:
        kwargs = {}
        if on_elicit is not None:
            async def elicit(message, response_type, params, context):
                return await on_elicit(message)
            kwargs["elicitation_handler"] = elicit
        transport = StreamableHttpTransport(url, headers=headers)
        async with FastMCPClient(transport, mode=mode, timeout=30, **kwargs) as client:
            yield Tools(lib, client)


def structured(result) -> dict:
    return result.structured_content


def meta(result) -> dict:
    return result.meta or {}


def error_code(exc: BaseException):
    """The JSON-RPC error code of a client exception (both libraries)."""
    for e in [exc, getattr(exc, "__cause__", None), getattr(exc, "__context__", None)]:
        if e is None:
            continue
        code = getattr(e, "code", None) or getattr(getattr(e, "error", None), "code", None)
        if isinstance(code, int):
            return code
    return None


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("lib,mode", CLIENTS, ids=IDS)
def test_a_repeated_call_executes_once_and_replays_identically(world, lib, mode):
    to, key = unique("to"), unique("key")

    async def go():
        async with connect(world, lib, mode) as tools:
            era = tools.version
            first = await tools.call("send_email", {"to": to, "body": "hello"}, key=key)
            second = await tools.call("send_email", {"to": to, "body": "hello"}, key=key)
        # A retry from a new connection (a new session, new JSON-RPC ids) replays too.
        async with connect(world, lib, mode) as tools:
            third = await tools.call("send_email", {"to": to, "body": "hello"}, key=key)
        return era, first, second, third

    era, first, second, third = run(go())
    assert era == ("2026-07-28" if mode != "legacy" else "2025-11-25")
    assert REPLAYED not in meta(first)
    for replay in (second, third):
        assert meta(replay)[REPLAYED] is True
        assert structured(replay) == structured(first)
        assert [c.text for c in replay.content] == [c.text for c in first.content]
        assert replay.is_error == first.is_error
    assert world.executions("send_email", to=to) == 1


@pytest.mark.parametrize("lib,mode", CLIENTS, ids=IDS)
def test_parallel_duplicates_execute_once(world, lib, mode):
    tag, key = unique("par"), unique("key")

    async def go():
        async with connect(world, lib, mode) as tools:
            calls = [tools.call("slow_job", {"steps": 3, "tag": tag}, key=key) for _ in range(6)]
            return await asyncio.gather(*calls)

    results = run(go())
    assert {json.dumps(structured(r), sort_keys=True) for r in results} == {json.dumps(structured(results[0]), sort_keys=True)}
    assert sum(1 for r in results if meta(r).get(REPLAYED)) >= 5
    assert world.executions("slow_job", tag=tag) == 1


MODERN = [(lib, mode) for lib, mode in CLIENTS if mode != "legacy"]


@pytest.mark.parametrize("lib,mode", MODERN, ids=[f"{lib}-{mode}" for lib, mode in MODERN])
def test_a_request_reissued_after_its_stream_was_cut_gets_the_first_ones_result(world, lib, mode):
    """2026-07-28 has no stream resumption: a client whose answer was cut re-issues the request
    (a new id). The gateway keeps the first call running, and the re-issued one waits for it
    (`mcp.wait`) and gets its result: the tool ran once."""
    tag, key = unique("cut"), unique("key")

    async def go():
        async with connect(world, lib, mode) as tools:
            with pytest.raises((TimeoutError, asyncio.TimeoutError)):
                await asyncio.wait_for(tools.call("slow_job", {"steps": 10, "tag": tag}, key=key), 0.3)
        async with connect(world, lib, mode) as tools:
            return await tools.call("slow_job", {"steps": 10, "tag": tag}, key=key)

    again = run(go())
    assert structured(again)["tag"] == tag
    assert meta(again)[REPLAYED] is True
    assert world.executions("slow_job", tag=tag) == 1


@pytest.mark.parametrize("lib,mode", CLIENTS, ids=IDS)
def test_a_key_reused_with_other_arguments_is_refused(world, lib, mode):
    to, key = unique("to"), unique("key")

    async def go():
        async with connect(world, lib, mode) as tools:
            await tools.call("send_email", {"to": to, "body": "one"}, key=key)
            with pytest.raises(Exception) as refused:
                await tools.call("send_email", {"to": to, "body": "two"}, key=key)
            with pytest.raises(Exception) as missing:
                await tools.call("send_email", {"to": to, "body": "three"})
            return refused.value, missing.value

    refused, missing = run(go())
    assert error_code(refused) == 42201, repr(refused)
    assert error_code(missing) == 40001, repr(missing)
    assert world.executions("send_email", to=to) == 1


@pytest.mark.parametrize("lib,mode", CLIENTS, ids=IDS)
def test_a_read_only_tool_passes_through(world, lib, mode):
    async def go():
        async with connect(world, lib, mode) as tools:
            assert "count_effects" in await tools.list_tools()
            first = await tools.call("count_effects", {})
            await tools.call("send_email", {"to": unique("to"), "body": "x"}, key=unique("key"))
            second = await tools.call("count_effects", {})
            return first, second

    first, second = run(go())
    assert REPLAYED not in meta(first) and REPLAYED not in meta(second)
    assert structured(second)["result"] == structured(first)["result"] + 1, "not stored: it ran again"


@pytest.mark.parametrize("lib,mode", CLIENTS, ids=IDS)
def test_progress_notifications_stream_through(world, lib, mode):
    tag, key = unique("prog"), unique("key")
    seen = []

    async def progress(p, total, message):
        seen.append((p, total))
        # The tool goes on to its next step only once this file exists: if the gateway held
        # notifications back until the result, the tool would work with none acknowledged.
        open(os.path.join(world.dir, f"ack-{tag}-{int(p)}"), "w").close()

    async def go():
        async with connect(world, lib, mode) as tools:
            result = await tools.call("paced_job", {"steps": 4, "tag": tag}, key=key, progress=progress)
            streamed = list(seen)
            replay = await tools.call("paced_job", {"steps": 4, "tag": tag}, key=key)
            return result, streamed, replay

    result, streamed, replay = run(go())
    assert streamed == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert structured(result)["acknowledged"] == [True] * 4, "progress came with the result, not as the tool worked"
    assert structured(replay) == structured(result) and meta(replay)[REPLAYED] is True
    assert world.executions("paced_job", tag=tag) == 1


@pytest.mark.parametrize("lib,mode", [c for c in CLIENTS if c[1] != "legacy"], ids=[i for i in IDS if "legacy" not in i])
def test_an_input_required_round_trip_executes_once(world, lib, mode):
    tag, key = unique("xfer"), unique("key")
    asked = []

    async def on_elicit(message):
        asked.append(message)
        return {"ok": True}

    async def go():
        async with connect(world, lib, mode, on_elicit=on_elicit) as tools:
            assert tools.version == "2026-07-28"
            first = await tools.call("transfer", {"amount": 5, "tag": tag}, key=key)
            second = await tools.call("transfer", {"amount": 5, "tag": tag}, key=key)
            return first, second

    first, second = run(go())
    assert structured(first)["transferred"] is True
    assert asked == ["Transfer 5?"], "asked once; the replay asks nothing"
    assert structured(second) == structured(first) and meta(second)[REPLAYED] is True
    assert world.executions("transfer", tag=tag) == 1


@pytest.mark.parametrize("lib,mode", CLIENTS, ids=IDS)
def test_budget_exhaustion_and_a_kill_switch_refuse(world, lib, mode):
    run_id = unique("run")
    onceguard(world.store, "runs", "budget", "--tenant", TENANT, run_id, "--max-effects", "2")
    tos = [unique("to") for _ in range(3)]
    tool_ns = f"mcp/{UPSTREAM_NAME}/send_email"

    async def go():
        async with connect(world, lib, mode) as tools:
            for to in tos[:2]:
                await tools.call("send_email", {"to": to, "body": "b"}, key=to, run=run_id)
            replay = await tools.call("send_email", {"to": tos[0], "body": "b"}, key=tos[0], run=run_id)
            assert meta(replay)[REPLAYED] is True, "a replay is not charged"
            with pytest.raises(Exception) as spent:
                await tools.call("send_email", {"to": tos[2], "body": "b"}, key=tos[2], run=run_id)
            assert error_code(spent.value) == 42901, repr(spent.value)

            onceguard(world.store, "switch", "engage", "--tenant", TENANT, "--namespace", tool_ns, "--reason", "e2e")
            try:
                to = unique("to")
                deadline = time.monotonic() + 3
                while True:
                    try:
                        await tools.call("send_email", {"to": to, "body": "s"}, key=unique("key"))
                    except Exception as e:
                        assert error_code(e) == 42301, repr(e)
                        break
                    assert time.monotonic() < deadline, "the switch did not refuse within 3 s"
                    await asyncio.sleep(0.2)
                # Other tools of the upstream still run.
                await tools.call("slow_job", {"steps": 1, "tag": unique("t")}, key=unique("key"))
            finally:
                onceguard(world.store, "switch", "release", "--tenant", TENANT, "--namespace", tool_ns)
                await asyncio.sleep(1.0)  # every instance sees a release within a second

    run(go())
    assert sum(world.executions("send_email", to=to) for to in tos) == 2
    usage = json.loads(onceguard(world.store, "runs", "get", "--tenant", TENANT, run_id))["usage"]
    assert usage["effects"] == 2


@pytest.mark.parametrize("lib,mode", CLIENTS, ids=IDS)
def test_the_gateway_killed_and_restarted_still_replays(world, lib, mode):
    instance = gateway(world.store, world.upstream, world.dir)
    to, key = unique("to"), unique("key")

    async def call(url):
        async with connect(world, lib, mode, url=url) as tools:
            return await tools.call("send_email", {"to": to, "body": "kill"}, key=key)

    try:
        first = run(call(instance.url))
        instance.kill9()
        instance = gateway(world.store, world.upstream, world.dir)
        replay = run(call(instance.url))
    finally:
        instance.stop()
    assert meta(replay)[REPLAYED] is True
    assert structured(replay) == structured(first)
    assert world.executions("send_email", to=to) == 1


def test_a_request_reusing_an_id_in_flight_in_its_session_is_refused(world):
    """A legacy session (2025-11-25) spoken over plain HTTP to the fastmcp server: while a guarded
    call with id 77 runs, a second request of the session with id 77 is refused (40001) and never
    reaches the server; once the call ended, the id is free again. The server's effects log counts
    each tool's executions."""
    tag, to = unique("tag"), unique("to")

    async def scenario():
        headers = {"X-Onceguard-Key": world.token, "Accept": "application/json, text/event-stream"}
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
            init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "raw", "version": "1"}}}
            opened = await http.post(world.gateway.url, json=init)
            session = {"Mcp-Session-Id": opened.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}
            initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            await http.post(world.gateway.url, json=initialized, headers=session)

            def call(name, arguments, key):
                params = {"name": name, "arguments": arguments, "_meta": {KEY_META: key}}
                return {"jsonrpc": "2.0", "id": 77, "method": "tools/call", "params": params}

            def answer(response) -> dict:
                if response.headers["content-type"].startswith("text/event-stream"):
                    data = [line[5:] for line in response.text.splitlines() if line.startswith("data:")]
                    return next(m for m in map(json.loads, data) if m.get("id") == 77)
                return response.json()

            slow = asyncio.create_task(
                http.post(world.gateway.url, json=call("slow_job", {"steps": 15, "tag": tag}, unique("key")),
                          headers=session))
            await asyncio.sleep(0.5)
            reused = answer(await http.post(world.gateway.url, json=call("send_email", {"to": to, "body": "b"},
                                                                           unique("key")), headers=session))
            first = answer(await slow)
            again = answer(await http.post(world.gateway.url, json=call("send_email", {"to": to, "body": "b"},
                                                                          unique("key")), headers=session))
            return reused, first, again

    reused, first, again = run(scenario())
    assert reused["error"]["code"] == 40001, reused
    assert "in use by a request still in flight" in reused["error"]["message"], reused
    assert first["result"]["structuredContent"]["tag"] == tag, first
    assert "result" in again and not again["result"].get("isError"), again
    assert world.executions("slow_job", tag=tag) == 1
    assert world.executions("send_email", to=to) == 1, "the refused request never reached the server"
