"""The async client and guards (asyncio): the source of :mod:`onceguard._sync`.

``scripts/unasync.py`` writes ``_sync`` from these files (every module but ``_backend``); what
truly differs between the two flavours (sleeping, the heartbeat's task or thread) is in each
flavour's ``_backend``.
"""
