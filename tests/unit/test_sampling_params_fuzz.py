"""Hypothesis against SamplingParams.from_dict: any JSON-like object is either accepted as
params that satisfy every documented bound, or refused with SamplingParamError naming a field
of the object; nothing else is ever raised, and accepted params survive the wire round trip."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from srt.sampling_params import SamplingParamError, SamplingParams

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=8)

# values near the bounds of each field, so that acceptance is reached often
plausible = {
    "max_new_tokens": st.integers(-2, 300), "min_new_tokens": st.integers(-2, 300),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 50), "min_p": st.floats(-0.5, 1.5),
    "frequency_penalty": st.floats(-3, 3), "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-0.5, 3), "n": st.integers(-1, 200),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, 2**32), max_size=3),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(), "regex": st.sampled_from(["", "a+", "[0-9]{2}"]),
}
params_dicts = st.fixed_dictionaries({}, optional=plausible)
any_dicts = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values,
                            max_size=5)


def check_bounds(p: SamplingParams) -> None:
    assert 0 <= p.min_new_tokens <= p.max_new_tokens
    assert p.temperature >= 0 and math.isfinite(p.temperature)
    assert 0 < p.top_p <= 1
    assert p.top_k == -1 or p.top_k >= 1
    assert 0 <= p.min_p <= 1
    assert -2 <= p.frequency_penalty <= 2 and -2 <= p.presence_penalty <= 2
    assert 0 < p.repetition_penalty <= 2
    assert 1 <= p.n <= 128
    assert all(isinstance(s, str) and s for s in p.stop)
    assert all(isinstance(t, int) and 0 <= t < 2**31 for t in p.stop_token_ids)
    assert p.regex is None or p.json_schema is None
    assert p.seed is None or -(2**63) <= p.seed < 2**63


def judge(d: Any) -> bool:
    try:
        p = SamplingParams.from_dict(d)
    except SamplingParamError as e:
        assert isinstance(d, dict) and (e.param in d or e.param in FIELDS), (e.param, d)
        return False
    check_bounds(p)
    # as the dict travels (JSON / msgpack: tuples become lists)
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    return True


@settings(max_examples=400, deadline=None)
@given(params_dicts)
def test_plausible_params_accepted_or_named(d: dict[str, Any]) -> None:
    judge(d)


@settings(max_examples=300, deadline=None)
@given(any_dicts | json_values)
def test_any_json_accepted_or_named(d: Any) -> None:
    if not isinstance(d, dict) and d is not None:
        try:
            SamplingParams.from_dict(d)
        except SamplingParamError as e:
            assert e.param == "sampling_params"
            return
        raise AssertionError(f"{d!r} was accepted")
    judge(d)


def test_some_are_accepted() -> None:
    assert judge({"temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x"]})
    assert not judge({"top_p": 0})
