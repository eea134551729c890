"""What the benchmarks in this folder share: finding the server binary, starting ``onceguard serve``
on a free 127.0.0.1 port, percentiles and the printing of durations."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import httpx


def find_binary(builds: Sequence[str] = ("debug",)) -> Path:
    """``$ONCEGUARD_BIN``, else the first of ``builds`` (``release``, ``debug``) found under
    ``$CARGO_TARGET_DIR``, then under the repository's ``target/``."""
    if os.environ.get("ONCEGUARD_BIN"):
        return Path(os.environ["ONCEGUARD_BIN"])
    repo = Path(__file__).resolve().parents[3]
    roots = [Path(os.environ["CARGO_TARGET_DIR"])] if os.environ.get("CARGO_TARGET_DIR") else []
    roots.append(repo / "target")
    for build in builds:
        for root in roots:
            candidate = root / build / "onceguard"
            if candidate.is_file():
                return candidate
    sys.exit(f"no onceguard binary: run `cargo build -p onceguard{' --release' if builds[0] == 'release' else ''}` "
             "(or set ONCEGUARD_BIN)")


def serve(
    store: str, *, binary: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str, str, Path]:
    """Starts ``onceguard serve --store STORE`` in a fresh folder, with ``env`` (``ONCEGUARD_*``
    settings) over the defaults; answers the process, its URL, the admin key it wrote and the
    folder."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = Path(tempfile.mkdtemp(prefix="onceguard-bench-"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ONCEGUARD_")}
    environ["ONCEGUARD_LOG"] = "warn"
    environ.update(env or {})
    proc = subprocess.Popen(
        [str(binary or find_binary()), "serve", "--store", store, "--listen", f"127.0.0.1:{port}", "--log-format", "json"],
        cwd=workdir,
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            sys.exit(f"onceguard serve exited ({proc.returncode}) before it was ready")
        time.sleep(0.05)
    else:
        proc.kill()
        sys.exit("onceguard serve did not become ready")
    return proc, url, (workdir / "onceguard-data" / "admin.key").read_text().strip(), workdir


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}µs"
    return f"{seconds * 1e3:.2f}ms"
