#!/usr/bin/env python3
"""Write the sync client and guards (``src/onceguard/_sync``) from the async ones (``_async``).

Every module of ``_async`` but ``__init__.py`` and ``_backend.py`` (each flavour has its own,
written by hand) is turned into its ``_sync`` twin by ``unasync``: ``async``/``await`` are
removed and the names of :data:`NAMES` replaced. In docstrings and comments the same names, and
the few phrases of :data:`PHRASES` that name the flavour, are replaced too.

    python scripts/unasync.py           # write the _sync files
    python scripts/unasync.py --check   # exit 1, naming the files, if any differs from what it would write

Needs the ``test`` extra (``unasync``).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# This script's name would shadow the package it uses: import that one from the environment.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

try:
    import tokenize_rt
    import unasync
except ImportError as e:  # pragma: no cover
    sys.exit(f"scripts/unasync.py needs the test extra (pip install -e 'clients/python[test]'): {e}")

ROOT = HERE.parent
PACKAGE = ROOT / "src" / "onceguard"
SOURCE = PACKAGE / "_async"
TARGET = PACKAGE / "_sync"
#: Modules each flavour writes by hand.
HAND_WRITTEN = ("__init__.py", "_backend.py")

#: Names of the async flavour and their sync twins (besides unasync's own: ``__aenter__``,
#: ``AsyncIterator``…).
NAMES = {
    "AsyncClient": "Client",
    "AsyncAttempt": "Attempt",
    "AsyncGuarded": "Guarded",
    "aclose": "close",
}

#: Phrases of docstrings and comments, in this order, then the names of :data:`NAMES`.
PHRASES = [
    ("The async client (asyncio).", "The sync client."),
    ("an async context manager", "a context manager"),
    ("an async guarded call", "a sync guarded call"),
    (" (awaited)", ""),
    ("async with ", "with "),
    ("async_client", "client"),
]

HEADER = (
    "# Generated from src/onceguard/_async/{name} by `python scripts/unasync.py` (in clients/python).\n"
    "# Do not edit it: change the async source and run the script again.\n"
)

_NAME_WORDS = re.compile(r"\b(" + "|".join(map(re.escape, NAMES)) + r")\b")


def _rewrite_text(text: str) -> str:
    for old, new in PHRASES:
        text = text.replace(old, new)
    return _NAME_WORDS.sub(lambda m: NAMES[m.group(1)], text)


def _rewrite_prose(source: str) -> str:
    """``source`` with its docstrings, other strings and comments in the sync wording."""
    tokens = tokenize_rt.src_to_tokens(source)
    for i, token in enumerate(tokens):
        if token.name in ("STRING", "COMMENT", "FSTRING_MIDDLE"):
            tokens[i] = token._replace(src=_rewrite_text(token.src))
    return tokenize_rt.tokens_to_src(tokens)


def sources() -> list[Path]:
    """The async modules that have a generated twin."""
    return sorted(p for p in SOURCE.glob("*.py") if p.name not in HAND_WRITTEN)


def generate() -> dict[str, str]:
    """The text of each generated module, by file name."""
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        src_dir = Path(tmp) / "_async"
        src_dir.mkdir()
        paths = []
        for path in sources():
            copy = src_dir / path.name
            copy.write_text(_rewrite_prose(path.read_text(encoding="utf-8")), encoding="utf-8")
            paths.append(str(copy))
        rule = unasync.Rule(fromdir="/_async/", todir="/_sync/", additional_replacements=NAMES)
        unasync.unasync_files(paths, rules=[rule])
        for path in sources():
            text = (Path(tmp) / "_sync" / path.name).read_text(encoding="utf-8")
            out[path.name] = HEADER.format(name=path.name) + text
    return out


def _is_generated(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        return f.readline().startswith("# Generated from src/onceguard/_async/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a _sync file is not up to date")
    args = parser.parse_args()

    wanted = generate()
    stale = [
        path
        for path in sorted(TARGET.glob("*.py"))
        if path.name not in wanted and path.name not in HAND_WRITTEN and _is_generated(path)
    ]
    differ = [
        TARGET / name
        for name, text in wanted.items()
        if not (TARGET / name).is_file() or (TARGET / name).read_text(encoding="utf-8") != text
    ]
    if args.check:
        for path in differ:
            print(f"{path.relative_to(ROOT)}: differs from what scripts/unasync.py writes", file=sys.stderr)
        for path in stale:
            print(f"{path.relative_to(ROOT)}: generated from an async module that no longer exists", file=sys.stderr)
        if differ or stale:
            print("run `python scripts/unasync.py` in clients/python", file=sys.stderr)
            return 1
        return 0
    TARGET.mkdir(exist_ok=True)
    for path in differ:
        path.write_text(wanted[path.name], encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
