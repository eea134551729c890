"""The sync :class:`Client` and the async :class:`AsyncClient` of the HTTP API.

Each holds one keep-alive connection pool (urllib3's for the sync client, an aiohttp session for
the async one); share one client per process (the sync client may be used from many threads). Both retry the client's own transport failures with a
bounded exponential backoff (:class:`Retry`):

- a request that was never sent (connect error, connect timeout) is retried for every call;
- a request that may have been sent (read timeout, dropped connection) is retried for the calls
  that are idempotent by key and fence, or by nature: every claim and fenced call, reads,
  purges, budgets, settings, engaging a switch, starting a rollback, claiming a compensation —
  not creating API keys or tenants, nor releasing a switch (a second release would answer 404);
- a ``503`` (``store-unavailable``: nothing was decided) is retried for every call.

After the last try, a transport failure raises :class:`onceguard.TransportError` and a 503 raises
:class:`onceguard.StoreUnavailable`.

Why retrying a claim is safe: a claim whose answer was lost may have acquired the key; its retry
then answers ``in_flight`` (the lost holder's lease), never a second ``acquired`` while that lease
lives, and after the lease passes the next claim is a recovery. Nothing runs twice unnoticed.
"""

from __future__ import annotations

# AsyncClient is written in _async/client.py; Client is generated from it (scripts/unasync.py).
from ._async.client import AsyncClient
from ._http import DEFAULT_URL, NO_RETRY, USER_AGENT, Retry, Timeout  # the URL and agent: importable here, as before
from ._sync.client import Client

__all__ = ["AsyncClient", "Client", "Retry", "NO_RETRY", "Timeout"]
