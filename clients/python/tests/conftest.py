"""The test session's server: a real ``onceguard serve``, started once, stopped at the end.

The binary is ``$ONCEGUARD_BIN``, else ``$CARGO_TARGET_DIR/debug/onceguard``, else
``<repo>/target/debug/onceguard``. Each server runs in a temporary working directory, where it
writes its admin key (``onceguard-data/admin.key``); tests use an agent key created through the
API, and the admin key where a call needs it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

import onceguard

REPO = Path(__file__).resolve().parents[3]


def find_binary() -> Path:
    """The onceguard binary to test, or a failure that says how to build it."""
    explicit = os.environ.get("ONCEGUARD_BIN")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            pytest.fail(f"ONCEGUARD_BIN={explicit} does not exist; run `cargo build -p onceguard`", pytrace=False)
        return path
    candidates = []
    if os.environ.get("CARGO_TARGET_DIR"):
        candidates.append(Path(os.environ["CARGO_TARGET_DIR"]) / "debug" / "onceguard")
    candidates.append(REPO / "target" / "debug" / "onceguard")
    for path in candidates:
        if path.is_file():
            return path
    pytest.fail(
        "no onceguard binary at " + " or ".join(str(c) for c in candidates)
        + ": run `cargo build -p onceguard` (or set ONCEGUARD_BIN)",
        pytrace=False,
    )


def thread_stopped(stat: Path) -> bool:
    """Whether the thread of this ``/proc/<pid>/task/<tid>/stat`` is stopped (or gone: exited,
    a zombie, dead)."""
    try:
        text = stat.read_text()
    except OSError:  # the thread has exited
        return True
    end = text.rfind(")")
    return end < 0 or text[end + 2 : end + 3] in ("T", "t", "Z", "X", "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``onceguard serve`` process on 127.0.0.1 in its own working directory."""

    def __init__(
        self,
        binary: Path,
        store: str = "memory://",
        port: int | None = None,
        env: dict[str, str] | None = None,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.binary = binary
        self.store = store
        self.extra_env = env or {}
        self.tls = tls  # the certificate chain and key it serves https with
        self.port = port or free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="onceguard-py-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def admin_key(self) -> str:
        return (self.workdir / "onceguard-data" / "admin.key").read_text().strip()

    def start(self, timeout: float = 20.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEGUARD_")}
        env.update(self.extra_env)
        log = open(self.workdir / "serve.log", "ab")
        tls = ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])] if self.tls else []
        self.proc = subprocess.Popen(
            [str(self.binary), "serve", "--store", self.store, "--listen", f"127.0.0.1:{self.port}", "--log-format", "json"]
            + tls,
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"onceguard serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1.0, verify=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"onceguard serve was not ready within {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test paused it
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """Stop the process (SIGSTOP): it accepts connections but answers nothing. Returns once
        every thread of it is stopped: one thread takes the signal and stops the others when it next
        runs, after the signal is sent, and until then they go on answering."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        if not tasks.is_dir():  # no /proc here: a short wait in its place
            time.sleep(0.1)
            return
        deadline = time.monotonic() + 5.0
        while not all(thread_stopped(stat) for stat in tasks.glob("*/stat")):
            if time.monotonic() > deadline:
                raise RuntimeError("onceguard serve did not stop within 5 s of SIGSTOP")
            time.sleep(0.002)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.workdir / "serve.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def binary() -> Path:
    return find_binary()


@pytest.fixture(scope="session")
def server(binary: Path) -> Iterator[Server]:
    srv = Server(binary)
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="session")
def admin(server: Server) -> Iterator[onceguard.Client]:
    with onceguard.Client(server.url, server.admin_key) as client:
        yield client


@pytest.fixture(scope="session")
def agent_key(admin: onceguard.Client) -> str:
    key = admin.create_api_key("agent", "python-client-tests")
    assert key.token
    return key.token


@pytest.fixture(scope="session")
def client(server: Server, agent_key: str) -> Iterator[onceguard.Client]:
    with onceguard.Client(server.url, agent_key) as c:
        yield c


@pytest.fixture
async def aclient(server: Server, agent_key: str) -> AsyncIterator[onceguard.AsyncClient]:
    async with onceguard.AsyncClient(server.url, agent_key) as c:
        yield c


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    """A namespace of this test's own."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:40].strip("-")
    return f"pytest/{name}-{uuid.uuid4().hex[:8]}"
