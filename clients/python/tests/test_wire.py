"""The client's JSON shortcuts give what the general code gives: canonical JSON through ``json``'s
encoder where its text is RFC 8785's, and a replay's result cut from the end of its answer."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import rfc8785

from onceguard import _wire
from onceguard.keys import _canonical, canonical_json

STRINGS = ["", "a", "é", "日本", "\U0001f600", "\ue000", "\u2028", "a\"b\\c", "\n\t\x00\x1f\x7f", "z" * 40]


def value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice([0, -1, 7, 2**53 - 1, -(2**53 - 1), 10**20])
    if pick == 3:
        return rng.choice([0.0, 1.0, 1.5, 1e21, -2.5e-7])
    if pick in (4, 5):
        return rng.choice(STRINGS)
    if pick == 6:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(STRINGS) + rng.choice(STRINGS): value(rng, depth + 1) for _ in range(rng.randrange(5))}


def test_canonical_json_is_rfc8785_for_every_value() -> None:
    rng = random.Random(8785)
    for _ in range(3000):
        v = value(rng)
        try:
            expected = bytes(rfc8785.dumps(v))
        except rfc8785.CanonicalizationError as e:
            with pytest.raises(type(e)):
                _canonical(v)
            continue
        assert _canonical(v) == expected, v
    # Keys whose code point order is not their UTF-16 order go through rfc8785.
    assert _canonical({"\ue000": 1, "\U0001f600": 2}) == bytes(rfc8785.dumps({"\ue000": 1, "\U0001f600": 2}))
    assert canonical_json({"b": 1.0, "a": [True, None]}) == b'{"a":[true,null],"b":1}'


@pytest.mark.parametrize(
    "result",
    [
        '{"v":[1.50, 2e0]}',
        "[0.10,0.2]",
        '"result\\":x"',
        "1.0",
        '{"result":5}',
        '{"a":{"result":[1,{"result":2}]}}',
        '["\\"result\\":1}"]',
        "null",
    ],
)
@pytest.mark.parametrize("last", [True, False])
def test_a_replays_result_is_cut_out_exactly(result: str, last: bool) -> None:
    head = '{"outcome":"replay","fence":3,"content_type":"application/json"'
    text = f'{head},"result":{result}}}' if last else f'{head},"result":{result},"status":"success"}}'
    assert _wire.raw_member(text, "result") == result.encode()
    spans = _wire.member_spans(text)
    assert text[slice(*spans["result"])] == result
    assert json.loads(text)["result"] == json.loads(result)


def test_a_member_that_is_not_there_or_spaced_out() -> None:
    assert _wire.raw_member('{"a":{"result":1}}', "result") is None
    assert _wire.raw_member('{"a":1, "result" : [1, 2] }', "result") == b"[1, 2]"
