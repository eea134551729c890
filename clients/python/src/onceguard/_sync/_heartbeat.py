# Generated from src/onceguard/_async/_heartbeat.py by `python scripts/unasync.py` (in clients/python).
# Do not edit it: change the async source and run the script again.
"""The heartbeat of an attempt that holds a claim: it extends the lease every third of it, in
the background, until it is stopped. The guards (:mod:`.guard`) and the compensation worker
(:mod:`.rollback`) each run their attempts under one."""

from __future__ import annotations

import logging

from .. import _calls
from .._attempts import AttemptBase, interval
from .._http import NO_RETRY
from ..errors import OnceguardError, StaleFence
from . import _backend
from .client import Client

__all__ = ["Heartbeat"]

log = logging.getLogger("onceguard")


class Heartbeat:
    """Extends the lease every third of it, in the background (``_backend.Periodic``), until
    stopped (and waited for)."""

    def __init__(self, client: Client, attempt: AttemptBase, lease: float) -> None:
        self._client = client
        self._attempt = attempt
        self._call = _calls.extend(attempt.namespace, attempt.key, attempt.fence, lease)
        self._periodic = _backend.Periodic(self._beat, interval(lease), name=f"onceguard-heartbeat {attempt.key[:48]}")

    def start(self) -> None:
        self._periodic.start()

    def _beat(self) -> bool:
        """Extend the lease once; ``False`` (no more beats) if it was taken over."""
        a = self._attempt
        try:
            self._client.send(self._call, retry=NO_RETRY)
        except StaleFence as e:
            a._lost = e
            log.warning("onceguard: lease of %s/%s (fence %d) was taken over: %s", a.namespace, a.key, a.fence, e)
            return False
        except OnceguardError as e:  # the next beat tries again
            log.warning("onceguard: could not extend the lease of %s/%s: %s", a.namespace, a.key, e)
        return True

    def stop(self) -> None:
        self._periodic.stop()
