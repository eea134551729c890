"""How keys and request fingerprints are derived from a call's arguments.

The rule (the same for :func:`onceguard.once` and the framework helpers):

1. The arguments are **bound** to the function's signature with their defaults applied, so
   ``f(1, b=2)``, ``f(a=1, b=2)`` and ``f(1)`` (when ``b`` defaults to 2) are one call. A first
   parameter named ``self`` or ``cls`` and the names in ``ignore`` are left out.
2. They are made JSON (:func:`jsonable`) and written as **RFC 8785 canonical JSON**
   (:func:`canonical_json`): key order, whitespace and number spelling do not matter.
3. The key is ``<name>:<version>:<sha256 hex>`` of the canonical JSON of
   ``{"function": name, "version": version, "arguments": arguments}``. ``name`` defaults to the
   function's ``__qualname__``; ``version`` is a label you choose (``"v1"``).

So renaming a local variable, reformatting, or reordering keyword arguments at a call site keeps
the keys; changing an argument's value, the version label or the name gives new ones. Bump the
version when the function's effect changes meaning, so that old outcomes stop replaying.

The request sent with the claim (whose fingerprint catches a key reused for another request) is
the JSON arguments themselves.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import inspect
import json
import re
import uuid
from collections.abc import Mapping, Sequence, Set
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, Callable

import rfc8785

__all__ = ["canonical_json", "derive_key", "digest", "jsonable", "bound_arguments", "check_key"]

_PRINTABLE = re.compile(r"^[\x20-\x7e]+$")
MAX_KEY_BYTES = 255


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON values (dict, list, str, int, float, bool, None).

    Converted: tuples and lists, sets (sorted by canonical JSON), mappings with string keys,
    dataclasses, pydantic models (``model_dump(mode="json")``), enums (their value), ``bytes``
    (base64), ``datetime``/``date``/``time`` (ISO 8601), ``timedelta`` (seconds), ``UUID`` and
    ``Decimal`` (strings). Anything else raises ``TypeError``: pass a ``key`` (and ``request``)
    yourself, or leave the argument out with ``ignore``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if isinstance(k, enum.Enum):
                k = k.value
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"a mapping key must be a string to be JSON, not {type(k).__name__}")
            out[str(k)] = jsonable(v)
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump) and not isinstance(value, type):
        return jsonable(model_dump(mode="json"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (uuid.UUID, Decimal)):
        return str(value)
    if isinstance(value, Set):
        items = [jsonable(v) for v in value]
        return sorted(items, key=canonical_json)
    if isinstance(value, Sequence):
        return [jsonable(v) for v in value]
    raise TypeError(
        f"{type(value).__name__} is not JSON: give the guard a key (and request) yourself, "
        "or leave this argument out with ignore=(...)"
    )


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 canonical JSON of ``value`` (made :func:`jsonable` first)."""
    return _canonical(jsonable(value))


#: RFC 8785 writes integers as IEEE doubles: beyond this they are not exact (``rfc8785`` refuses them).
_SAFE_INT = 2**53 - 1


def _plain(value: Any) -> bool:
    """Whether ``json``'s sorted, compact text of the JSON value ``value`` is its RFC 8785 form:
    no floats (written differently), integers within ±(2^53 - 1), and object keys below U+D800,
    whose code point order (``json``'s) is their UTF-16 order (RFC 8785's). Strings are escaped
    alike by both (the same table: ``"``, ``\\``, and control characters only)."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return bool(-_SAFE_INT <= value <= _SAFE_INT)
    if kind is dict:
        return all(
            type(k) is str and (k.isascii() or max(k, default="") < "\ud800") and _plain(v) for k, v in value.items()
        )
    if kind is list:
        return all(_plain(v) for v in value)
    return False


def _canonical(value: Any) -> bytes:
    """The RFC 8785 canonical JSON of a JSON value: ``json``'s C encoder where its text is the
    same (:func:`_plain`), else ``rfc8785``'s."""
    if _plain(value):
        try:
            return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: rfc8785 refuses it as before
            pass
    return bytes(rfc8785.dumps(value))


def digest(value: Any) -> str:
    """The SHA-256 (hex) of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def check_key(key: str) -> str:
    """``key`` if it is a valid idempotency key (1 to 255 bytes of printable ASCII)."""
    if not isinstance(key, str) or not _PRINTABLE.match(key) or len(key) > MAX_KEY_BYTES:
        raise ValueError(f"an idempotency key is 1 to 255 bytes of printable ASCII, not {key!r}")
    return key


def check_label(what: str, label: str, max_len: int) -> str:
    """``label`` (a function name or version) if it can stand in a key: printable ASCII, no ':'."""
    if not isinstance(label, str) or not _PRINTABLE.match(label) or ":" in label or len(label) > max_len:
        raise ValueError(f"{what} must be 1 to {max_len} printable ASCII characters without ':', not {label!r}")
    return label


def derive_key(name: str, version: str, arguments: Any) -> str:
    """The key of a call: ``<name>:<version>:<sha256 of the canonical call>``."""
    check_label("name", name, 128)
    check_label("version", version, 32)
    return key_of_json(name, version, jsonable(arguments))


def key_of_json(name: str, version: str, arguments: Any) -> str:
    """:func:`derive_key` of arguments that are JSON values already (:func:`bound_arguments`'
    answer), with a name and version checked already: what ``@once`` computes on every call,
    without making the arguments JSON a second time."""
    call = {"function": name, "version": version, "arguments": arguments}
    return f"{name}:{version}:{hashlib.sha256(_canonical(call)).hexdigest()}"


def bound_arguments(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any], ignore: Sequence[str] = ()
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied, as JSON values.

    ``*args`` become a list and ``**kwargs`` an object under their parameter's name. A first
    parameter named ``self`` or ``cls`` and the names in ``ignore`` are left out.
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    params = list(signature.parameters)
    skip = set(ignore)
    if params and params[0] in ("self", "cls"):
        skip.add(params[0])
    out = {name: value for name, value in bound.arguments.items() if name not in skip}
    result = jsonable(out)
    assert isinstance(result, dict)
    return result


def function_name(func: Callable[..., Any]) -> str:
    """The default name of a guarded function: its ``__qualname__``."""
    return str(getattr(func, "__qualname__", getattr(func, "__name__", "function")))
