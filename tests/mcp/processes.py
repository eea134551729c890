"""What the MCP and A2A end-to-end suites share (the standard library only, so that each suite's
own virtualenv can import it): the binary, free ports, the operator CLI, and gateway processes
(`onceguard mcp`, `onceguard a2a`).
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", HERE.parent.parent / "target"))
BINARY = Path(os.environ.get("ONCEGUARD_BIN", TARGET / "debug" / "onceguard"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def onceguard(store: str, *args: str) -> str:
    """Runs an operator command; answers its output."""
    out = subprocess.run([str(BINARY), "--log-format", "json", "--store", store, *args], capture_output=True, text=True)
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["(no output)"])[0]
        raise RuntimeError(f"onceguard {' '.join(args)} failed: {first}")
    return out.stdout


class Gateway:
    """A running gateway process (`onceguard mcp`, or `command`) on `store` in front of
    `upstream`, with `args` added; its `url` is the address it logged with `path` (the endpoint)."""

    def __init__(self, store: str, upstream: str, workdir: str, name: str, *args: str, command: str = "mcp",
                 path: str = "/mcp") -> None:
        command_line = [
            str(BINARY), "--log-format", "json", "--store", store, command, "--listen", "127.0.0.1:0",
            "--upstream", upstream, "--upstream-name", name, *args,
        ]
        self.process = subprocess.Popen(command_line, cwd=workdir, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.logs: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:
            for line in self.process.stderr:
                self.logs.append(line)
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if "addr" in event and not found.is_set():
                    self.url = f"http://{event['addr']}{path}"
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(60):
            self.process.kill()
            raise RuntimeError("the gateway did not start:\n" + "".join(self.logs))

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
