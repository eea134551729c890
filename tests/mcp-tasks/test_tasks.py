"""End-to-end tests of keys delegated to tasks: `onceguard mcp` in front of a fastmcp server whose
tool runs as a task (the 2026-07-28 tasks extension, `fastmcp-tasks`), called by fastmcp's own
client, which polls the task through the gateway. Run by scripts/mcp-tests (its own virtualenv:
`fastmcp-tasks` pins a fastmcp of its own).
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.client.transports import StreamableHttpTransport
# The client's own senders of tasks/get and tasks/cancel, to name a task id as another caller.
from fastmcp_tasks.client import _send_cancel, _send_get, call_tool_task

HERE = Path(__file__).resolve().parent
# The suites' shared helpers (the standard library only).
sys.path.insert(0, str(HERE.parent / "mcp"))
from processes import Gateway, free_port, onceguard, wait_port  # noqa: E402
KEY_META = "dev.onceguard/idempotency-key"
REPLAYED = "dev.onceguard/replayed"


class World:
    """The task server, a SQLite store with one tenant and two API keys, and a gateway."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="onceguard-tasks-")
        self.effects = os.path.join(self.dir, "effects.log")
        store = f"sqlite://{self.dir}/onceguard.db"
        port = self.port = free_port()
        self.start_server()
        onceguard(store, "tenants", "create", "acme")
        self.tokens = [
            json.loads(onceguard(store, "api-keys", "create", "--tenant", "acme", "--label", f"e2e-{n}"))["token"]
            for n in range(2)
        ]
        wait_port(port)
        self.store = store
        self.gateways: list[Gateway] = []
        self.url = self.start_gateway()

    def start_gateway(self) -> str:
        """Another `onceguard mcp` instance on the same store; answers its URL."""
        gateway = Gateway(self.store, f"http://127.0.0.1:{self.port}/mcp", self.dir, "tasks", "--lease", "5s")
        self.gateways.append(gateway)
        return gateway.url

    def executions(self, tag: str) -> int:
        if not os.path.exists(self.effects):
            return 0
        with open(self.effects) as f:
            return sum(1 for line in f if json.loads(line)["tag"] == tag)

    def start_server(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, str(HERE / "task_server.py"), "--port", str(self.port), "--effects", self.effects],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "server.log"), "a"),
        )

    def restart_server(self) -> None:
        """A new server process: its tasks (kept in memory) are gone, as after their TTL."""
        self.stop_server()
        self.start_server()
        wait_port(self.port)

    def stop_server(self) -> None:
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(10)

    def close(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        self.stop_server()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


def client(world: World, token: int = 0, url: str | None = None) -> Client:
    transport = StreamableHttpTransport(url or world.url, headers={"X-Onceguard-Key": world.tokens[token]})
    return Client(transport, timeout=30)


def run(coro):
    return asyncio.run(coro)


def test_a_retried_task_call_gets_the_same_task_and_pays_once(world):
    tag, key = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario():
        async with client(world) as c:
            task = await call_tool_task(c, "pay", {"amount": 5, "tag": tag}, meta={KEY_META: key})
            assert task.task_id.startswith("ogt1."), task.task_id
            # The client retries the call (a lost answer, a repeated tool call): the same task.
            again = await call_tool_task(c, "pay", {"amount": 5, "tag": tag}, meta={KEY_META: key})
            assert again.task_id == task.task_id
            first = await task.result()
            assert first.structured_content == {"paid": 5, "tag": tag}
            # A plain call_tool with the key (the client polls the task to its end): the result.
            third = await c.call_tool("pay", {"amount": 5, "tag": tag}, meta={KEY_META: key})
            assert third.structured_content == {"paid": 5, "tag": tag}

    run(scenario())
    assert world.executions(tag) == 1


def test_another_principal_cannot_poll_or_cancel_the_task(world):
    tag, key = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario():
        async with client(world, 0) as owner, client(world, 1) as other:
            task = await call_tool_task(owner, "pay", {"amount": 7, "tag": tag, "seconds": 1.0}, meta={KEY_META: key})
            # Another API key of the same tenant names the owner's task id: it does not exist.
            for send in (_send_get, _send_cancel):
                with pytest.raises(Exception) as refused:
                    await send(other.session, task.task_id)
                assert "no such task" in str(refused.value).lower(), refused.value
            result = await task.result()
            assert result.structured_content == {"paid": 7, "tag": tag}

    run(scenario())
    assert world.executions(tag) == 1


def test_the_result_outlives_the_servers_task(world):
    tag, key = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario_before():
        async with client(world) as c:
            task = await call_tool_task(c, "pay", {"amount": 9, "tag": tag}, meta={KEY_META: key})
            result = await task.result()
            assert result.structured_content == {"paid": 9, "tag": tag}
            return task.task_id

    task_id = run(scenario_before())
    world.restart_server()

    async def scenario_after():
        async with client(world) as c:
            # The server no longer knows the task; the gateway answers from the store.
            got = await _send_get(c.session, task_id)
            assert got.status == "completed", got
            replay = await c.call_tool("pay", {"amount": 9, "tag": tag}, meta={KEY_META: key})
            assert replay.structured_content == {"paid": 9, "tag": tag}
            assert (replay.meta or {}).get(REPLAYED) is True

    run(scenario_after())
    assert world.executions(tag) == 1


def test_another_gateway_instance_serves_the_task_from_the_shared_store(world):
    tag, key = uuid.uuid4().hex, uuid.uuid4().hex
    other_url = world.start_gateway()

    async def scenario():
        async with client(world) as first, client(world, url=other_url) as second:
            task = await call_tool_task(first, "pay", {"amount": 3, "tag": tag}, meta={KEY_META: key})
            # The retry reaches the other instance: the same task.
            again = await call_tool_task(second, "pay", {"amount": 3, "tag": tag}, meta={KEY_META: key})
            assert again.task_id == task.task_id
            # The other instance polls it to its end and captures the result.
            result = await again.result()
            assert result.structured_content == {"paid": 3, "tag": tag}
            got = await _send_get(first.session, task.task_id)
            assert got.status == "completed"

    run(scenario())
    assert world.executions(tag) == 1


def test_a_kill_switch_that_revokes_leases_cancels_the_task(world):
    tag, key = uuid.uuid4().hex, uuid.uuid4().hex

    async def started():
        async with client(world) as c:
            task = await call_tool_task(c, "pay", {"amount": 4, "tag": tag, "seconds": 5.0}, meta={KEY_META: key})
            return task.task_id

    task_id = run(started())
    onceguard(world.store, "switch", "engage", "--tenant", "acme", "--namespace", "mcp/tasks", "--reason", "runaway",
              "--revoke-leases")
    try:
        async def status():
            async with client(world) as c:
                for _ in range(100):
                    got = await _send_get(c.session, task_id)
                    if got.status != "working":
                        return got.status
                    await asyncio.sleep(0.1)
                return got.status

        assert run(status()) == "cancelled"
    finally:
        onceguard(world.store, "switch", "release", "--tenant", "acme", "--namespace", "mcp/tasks")

    async def retried():
        async with client(world) as c:
            # Each gateway sees the release within a second.
            for _ in range(20):
                with pytest.raises(Exception) as refused:
                    await c.call_tool("pay", {"amount": 4, "tag": tag, "seconds": 5.0}, meta={KEY_META: key})
                if "kill switch" not in str(refused.value):
                    break
                await asyncio.sleep(0.25)
            return str(refused.value)

    assert "not run again" in run(retried())
    time.sleep(5.5)
    assert world.executions(tag) == 0, "the task was cancelled before it paid, and never run again"


@pytest.mark.parametrize("delay", [0.0, 0.45, 0.6])
def test_a_cancel_racing_completion_never_loses_the_outcome(world, delay):
    """The owner cancels as the task ends. Whatever won, the key agrees with the effects log: a
    payment that happened replays, one that did not is refused as unknown; never a second run."""
    tag, key = uuid.uuid4().hex, uuid.uuid4().hex
    args = {"amount": 2, "tag": tag, "seconds": 0.5}

    async def race():
        async with client(world) as c:
            task = await call_tool_task(c, "pay", args, meta={KEY_META: key})
            await asyncio.sleep(delay)
            await _send_cancel(c.session, task.task_id)
            await asyncio.sleep(1.0)
            try:
                replay = await c.call_tool("pay", args, meta={KEY_META: key})
                return "replayed", replay.structured_content
            except Exception as refused:  # noqa: BLE001 (the refusal is the answer)
                return "refused", str(refused)

    outcome, detail = run(race())
    paid = world.executions(tag)
    print(f"cancel after {delay}s: {paid} payment(s), retry {outcome}")
    assert paid <= 1
    if paid == 1:
        assert (outcome, detail) == ("replayed", {"paid": 2, "tag": tag})
    else:
        assert outcome == "refused" and "not run again" in detail, detail
