"""The undo registry: which function runs the compensation of each name, in this process.

``@once(..., undo=fn)`` and ``guarded(..., undo=fn)`` register ``fn`` here under the
compensation's name, so that a worker of the same process (``run_compensations``) finds it by
the name a task carries. The name is ``undo_name`` if given, else :func:`undo_name` of the
function (its ``__qualname__``): a worker in another process finds the function once it imports
the module that declares the guard.

One name, one function: registering another function under a name taken by a function of
another module or name raises ``ValueError`` (give ``undo_name=``); a function redefined under
its own module and name (a module reloaded, a function defined in a loop) replaces the old one.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any, Callable

from .keys import function_name

__all__ = ["check_undo_name", "register_undo", "undo_handlers", "undo_name"]

#: A compensation's name: 1 to 128 bytes of printable ASCII.
_NAME = re.compile(r"^[\x20-\x7e]{1,128}$")

_lock = threading.Lock()
_handlers: dict[str, Callable[..., Any]] = {}


def check_undo_name(name: str) -> str:
    """``name`` if it can name a compensation (1 to 128 bytes of printable ASCII)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"a compensation's name is 1 to 128 bytes of printable ASCII, not {name!r}")
    return name


def undo_name(func: Callable[..., Any]) -> str:
    """The compensation name of an undo function: its ``__qualname__``, or, where that is not 1
    to 128 bytes of printable ASCII, its printable part with a digest of the whole. A lambda
    has no name of its own (every lambda is ``<lambda>``): it raises ``ValueError``."""
    name = function_name(func)
    if name == "<lambda>" or name.endswith(".<lambda>"):
        raise ValueError("an undo lambda has no name of its own: give undo_name=, or define a function")
    if _NAME.match(name):
        return name
    printable = "".join(ch if " " <= ch <= "~" else "_" for ch in name)
    return f"{printable[:111]}~{hashlib.sha256(name.encode('utf-8')).hexdigest()[:16]}"


def _origin(func: Callable[..., Any]) -> tuple[str, str]:
    return str(getattr(func, "__module__", "")), function_name(func)


def register_undo(func: Callable[..., Any], name: str | None = None) -> str:
    """Register ``func`` as the handler of the compensation ``name`` (default
    :func:`undo_name`) and answer the name. ``func`` is called with the compensation's data."""
    if not callable(func):
        raise TypeError(f"an undo function is callable, not {func!r}")
    name = check_undo_name(name) if name is not None else undo_name(func)
    with _lock:
        known = _handlers.get(name)
        if known is not None and known is not func and _origin(known) != _origin(func):
            module, qualname = _origin(known)
            raise ValueError(
                f"the compensation name {name!r} is registered for {module}.{qualname}: "
                "give this undo another name (undo_name=)"
            )
        _handlers[name] = func
    return name


def undo_handlers() -> dict[str, Callable[..., Any]]:
    """The registered undo functions, by compensation name (a copy)."""
    with _lock:
        return dict(_handlers)


def find_undo(name: str) -> Callable[..., Any] | None:
    """The undo function registered under ``name``, if any."""
    with _lock:
        return _handlers.get(name)
