"""The sync client and guards, generated from :mod:`onceguard._async` by ``scripts/unasync.py``
(every module but ``_backend``, which is written by hand)."""
