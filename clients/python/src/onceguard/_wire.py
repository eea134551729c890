"""How values cross the wire: durations, timestamps, JSON text and the raw bytes of stored results.

Nothing here does I/O; the sync and the async client share it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any, Union

#: A duration as the API takes it: seconds (``float``/``int``), a ``timedelta``, or the server's
#: own spelling (``"500ms"``, ``"30s"``, ``"2m"``, ``"24h"``, ``"7d"``).
Duration = Union[float, int, timedelta, str]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_TEXT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")


def duration_seconds(value: Duration) -> float:
    """A duration in seconds."""
    if isinstance(value, bool):
        raise TypeError("a duration is seconds, a timedelta or a string such as '30s'")
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)):
        return float(value)
    match = _DURATION_TEXT.match(value)
    if match is None:
        raise ValueError(f"not a duration: {value!r} (use e.g. '500ms', '30s', '2m', '24h', '7d')")
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_duration(value: Duration) -> str:
    """The server's spelling of a duration: whole seconds as ``"30s"``, anything else in ms."""
    if isinstance(value, str):
        duration_seconds(value)  # refuse a typo here rather than as a 400 later
        return value.strip()
    millis = round(duration_seconds(value) * 1000)
    if millis < 0:
        raise ValueError("a duration cannot be negative")
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def parse_time(text: str) -> datetime:
    """An RFC 3339 timestamp of the server (``2026-11-29T11:37:52.654Z``) as an aware datetime.

    Python 3.10's ``fromisoformat`` takes neither ``Z`` nor more than six fraction digits.
    """
    s = text.strip()
    if len(s) == 24 and s[19] == "." and s[23] in "Zz":  # the server's own: milliseconds, UTC
        return datetime.fromisoformat(s[:23] + "+00:00")
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    match = re.match(r"^(.*T\d{2}:\d{2}:\d{2})(\.\d+)?(.*)$", s)
    if match and match.group(2):
        s = match.group(1) + match.group(2)[:7].ljust(7, "0") + match.group(3)
    parsed = datetime.fromisoformat(s)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def parse_optional_time(text: Any) -> datetime | None:
    """``parse_time`` for a field that may be ``null``."""
    return None if text is None else parse_time(str(text))


def format_time(value: datetime | str) -> str:
    """An RFC 3339 timestamp in UTC; a naive datetime is taken to be UTC."""
    if isinstance(value, str):
        return value
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


#: The encoder of :func:`dumps`, made once (``json.dumps`` with options makes one per call).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(value: Any) -> str:
    """The client's JSON text of a value: compact, UTF-8, no NaN or infinity (not JSON)."""
    return _ENCODER.encode(value)


class RawJson:
    """JSON text sent exactly as given (e.g. a result whose stored bytes must be known)."""

    __slots__ = ("text",)

    def __init__(self, text: str | bytes) -> None:
        self.text = text.decode("utf-8") if isinstance(text, bytes) else text

    def __repr__(self) -> str:
        return f"RawJson({self.text!r})"


def body(fields: dict[str, Any]) -> bytes:
    """A request body: the fields whose value is not ``None``; ``RawJson`` values spliced verbatim."""
    present = {name: value for name, value in fields.items() if value is not None}
    if not any(isinstance(value, RawJson) for value in present.values()):
        return dumps(present).encode("utf-8")  # one pass of the C encoder
    parts = []
    for name, value in present.items():
        text = value.text if isinstance(value, RawJson) else dumps(value)
        parts.append(f"{dumps(name)}:{text}")
    return ("{" + ",".join(parts) + "}").encode("utf-8")


_WS = " \t\n\r"
DECODER = json.JSONDecoder()


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def member_spans(s: str, i: int = 0) -> dict[str, tuple[int, int]]:
    """Where each member's value of the JSON object starting at ``s[i]`` lies in ``s``.

    ``json`` gives values, not their text; a stored result must replay byte for byte, so its text
    is cut out of the answer where the server put it (the server writes the stored bytes verbatim).
    """
    i = _skip(s, i)
    if s[i : i + 1] != "{":
        raise ValueError("not a JSON object")
    spans: dict[str, tuple[int, int]] = {}
    i = _skip(s, i + 1)
    if s[i : i + 1] == "}":
        return spans
    while True:
        if s[i : i + 1] != '"':
            raise ValueError("expected a member name")
        name, i = scanstring(s, i + 1)
        i = _skip(s, i)
        if s[i : i + 1] != ":":
            raise ValueError("expected ':'")
        i = _skip(s, i + 1)
        _, end = DECODER.raw_decode(s, i)
        spans[name] = (i, end)
        i = _skip(s, end)
        if s[i : i + 1] == ",":
            i = _skip(s, i + 1)
            continue
        if s[i : i + 1] == "}":
            return spans
        raise ValueError("expected ',' or '}'")


def element_spans(s: str, i: int = 0) -> list[tuple[int, int]]:
    """Where each element of the JSON array starting at ``s[i]`` lies in ``s`` (as
    :func:`member_spans` for an object)."""
    i = _skip(s, i)
    if s[i : i + 1] != "[":
        raise ValueError("not a JSON array")
    spans: list[tuple[int, int]] = []
    i = _skip(s, i + 1)
    if s[i : i + 1] == "]":
        return spans
    while True:
        _, end = DECODER.raw_decode(s, i)
        spans.append((i, end))
        i = _skip(s, end)
        if s[i : i + 1] == ",":
            i = _skip(s, i + 1)
            continue
        if s[i : i + 1] == "]":
            return spans
        raise ValueError("expected ',' or ']'")


def _last_member(text: str, name: str) -> tuple[int, int] | None:
    """Where the value of the member ``name`` of the JSON object ``text`` lies when it is the
    object's last member, written compactly as the server writes its answers; else ``None``.

    Only a member of the outer object can end where the outer object ends: a member of a nested
    object or array ends before its own container closes. And ``"name":`` after ``,`` or ``{``
    is a member name, never the inside of a string (where ``"`` is escaped).
    """
    marker = f'"{name}":'
    at = text.rfind(marker)
    last = len(text) - 1
    if at <= 0 or text[at - 1] not in ",{" or text[last : last + 1] != "}":
        return None
    start = at + len(marker)
    try:
        _, end = DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return (start, end) if end == last else None


def raw_member(text: str, *path: str) -> bytes | None:
    """The exact UTF-8 bytes of the value at ``path`` (object members) in the JSON ``text``."""
    if len(path) == 1 and '"' not in path[0] and "\\" not in path[0]:
        span = _last_member(text, path[0])  # a replay's answer: its result is the last member
        if span is not None:
            return text[span[0] : span[1]].encode("utf-8")
    start, end = 0, len(text)
    for name in path:
        spans = member_spans(text, start)
        if name not in spans:
            return None
        start, end = spans[name]
    return text[start:end].encode("utf-8")
