"""Tests of the wire codec (srt.managers.io_struct) and of SamplingParams validation."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from srt.managers import io_struct
import srt.managers.io_struct as io
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenIdOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    ImageInput,
    LoadLoraReq,
    LogprobOptions,
    LoraOut,
    SpecCounts,
    StatsOut,
    StepInput,
    StepOutput,
    StrOut,
    TokenizedGenerateReq,
    TokenLogprobs,
    TokenOut,
    UnloadLoraReq,
    decode,
    encode,
    registered_messages,
)
from srt.sampling_params import SamplingParamError, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# JSON-like sampling params as the HTTP process sends them (lists, not tuples, on the wire)
SP = {**SamplingParams().to_dict(), "stop": ["\n\n", "END"], "stop_regex": [r"\d+\."],
      "stop_token_ids": [2, 7],
      "temperature": 0.7, "seed": 123}


def token_out(rid: str, finish: dict[str, Any] | None = None) -> TokenOut:
    return TokenOut(rid=rid, new_ids=[5, 6, 7], prompt_tokens=12, cached_tokens=4,
                    completion_tokens=3, finish_reason=finish, skip_special_tokens=False,
                    spaces_between_special_tokens=True, stop=["</s>", "ü😀"], no_stop_trim=True)


# The first prompt token has no logprob; float32 values, ids, per-position top lists.
PROMPT_LP = TokenLogprobs([None, -1.25, -0.0078125], [1, 2, 3], [None, [-0.5, -1.5], [-0.25, -3.0]],
                          [None, [9, 2], [3, 7]])
TEXT_LP = TokenLogprobs([-0.1], [5], [[-0.1]], [[5]], texts=["ü😀"], top_texts=[["ü😀"]])


def samples() -> dict[str, list[Any]]:
    """At least one instance of every registered message, nested ones included."""
    options = LogprobOptions(logprob_start_len=2, top_logprobs_num=20, return_text_in_logprobs=True)
    gen = TokenizedGenerateReq(rid="a1", input_ids=[1, 2, 3, 65535, 2**40], sampling_params=SP,
                               stream=True, group="g-1", logprob=options)
    image = ImageInput(bytes(range(256)) * 3, [3, 8, 8], "0f" * 32)
    with_image = TokenizedGenerateReq("im", [1, 49152, 2], SP, image=image, lora_id=7)
    with_lp = dataclasses.replace(token_out("e5"), input_logprobs=PROMPT_LP,
                                  output_logprobs=TokenLogprobs([-2.5, -0.75, -0.125], [5, 6, 7],
                                                                [[], [], []], [[], [], []]),
                                  return_text_in_logprobs=True)
    spec = SpecCounts(verify_ct=7, draft_tokens=20, accepted_tokens=13)
    tout = [token_out("a1"), token_out("b2", {"type": "stop", "matched": 2}),
            token_out("c3", {"type": "length", "length": 3}),
            token_out("d4", {"type": "stop", "matched": "END"}), with_lp,
            dataclasses.replace(token_out("s6"), spec=spec)]
    return {
        "LogprobOptions": [options, LogprobOptions()],
        "SpecCounts": [spec, SpecCounts()],
        "TokenLogprobs": [PROMPT_LP, TEXT_LP, TokenLogprobs()],
        "TokenizedGenerateReq": [gen, TokenizedGenerateReq("x", [], {}), with_image],
        "ImageInput": [image],
        "AbortReq": [AbortReq("a1"), AbortReq("b", message="client gone ✓")],
        "FlushCacheReq": [FlushCacheReq("f")],
        "GetStatsReq": [GetStatsReq("s")],
        "LoadLoraReq": [LoadLoraReq("l", 3, "sql", "/adapters/sql ✓")],
        "UnloadLoraReq": [UnloadLoraReq("u", 3, "sql")],
        "LoraOut": [LoraOut("l", False, "rank 64 is over --max-lora-rank 16")],
        "StepInput": [
            StepInput(),
            StepInput(reqs=[gen, TokenizedGenerateReq("y", [9], SP, group=None)],
                      aborts=[AbortReq("z", "bye")],
                      controls=[FlushCacheReq("f1"), GetStatsReq("s1")]),
        ],
        "TokenOut": tout,
        "BatchTokenIdOut": [BatchTokenIdOut(tout), BatchTokenIdOut([])],
        "FlushCacheOut": [FlushCacheOut("f1", False, "requests are running")],
        "StatsOut": [StatsOut("s1", {"num_running_reqs": 3, "ratio": 0.25, "nested": {"a": [1, 2]},
                                      "none": None, "flag": True})],
        "StepOutput": [
            StepOutput(None),
            StepOutput(BatchTokenIdOut(tout),
                       controls=[FlushCacheOut("f1", True, "ok"), StatsOut("s1", {"x": 1.5})],
                       has_work=True),
        ],
        "StrOut": [StrOut("a1", "héllo 中文 😀", [1, 2], 3, 0, 2, {"type": "abort", "message": "x"}),
                   StrOut("b", "x", [5], 3, 0, 1, None, PROMPT_LP, TEXT_LP)],
        "BatchStrOut": [BatchStrOut([StrOut("a", "", [], 0, 0, 0)]), BatchStrOut([])],
        # the links between nodes (--nnodes > 1)
        "NodeHello": [io.NodeHello(1, 4, 2, "host-b ✓"), io.NodeHello(3, 8, 4)],
        "NodeWelcome": [io.NodeWelcome()],
        "NodeReady": [io.NodeReady()],
        "NodeHeartbeat": [io.NodeHeartbeat()],
        "NodeFailure": [io.NodeFailure("node 1 (TP rank 1): the model process died")],
        "NodeShutdown": [io.NodeShutdown()],
        "RankHello": [io.RankHello(3)],
    }


def test_samples_cover_every_registered_message() -> None:
    assert set(samples()) == set(registered_messages())


@pytest.mark.parametrize("name", sorted(registered_messages()))
def test_every_message_round_trips(name: str) -> None:
    for msg in samples()[name]:
        data = encode(msg)
        assert isinstance(data, bytes)
        back = decode(data)
        assert type(back) is type(msg)
        assert back == msg


def test_nested_types_are_rebuilt() -> None:
    step_in = samples()["StepInput"][1]
    back = decode(encode(step_in))
    assert isinstance(back.reqs[0], TokenizedGenerateReq)
    assert isinstance(back.aborts[0], AbortReq)
    assert [type(c) for c in back.controls] == [FlushCacheReq, GetStatsReq]
    step_out = decode(encode(samples()["StepOutput"][1]))
    assert isinstance(step_out.token_out, BatchTokenIdOut)
    assert all(isinstance(t, TokenOut) for t in step_out.token_out.outs)
    assert [type(c) for c in step_out.controls] == [FlushCacheOut, StatsOut]
    assert step_out.token_out.outs[1].finish_reason == {"type": "stop", "matched": 2}
    lp = step_out.token_out.outs[4].input_logprobs
    assert isinstance(lp, TokenLogprobs) and lp == PROMPT_LP
    assert isinstance(decode(encode(samples()["TokenizedGenerateReq"][0])).logprob,
                      LogprobOptions)


def test_token_logprobs_since_and_extend() -> None:
    lp = TokenLogprobs([-1.0, -2.0], [4, 5], [[-1.0], [-0.5]], [[4], [6]])
    tail = lp.since(1)
    assert tail == TokenLogprobs([-2.0], [5], [[-0.5]], [[6]])
    tail.logprobs[0] = 0.0  # a copy: the source is unchanged
    assert lp.logprobs == [-1.0, -2.0]
    lp.extend(TokenLogprobs([-3.0], [7], [[-3.0]], [[7]]))
    assert lp.token_ids == [4, 5, 7] and lp.top_ids == [[4], [6], [7]]


def test_sampling_params_survive_the_wire() -> None:
    params = SamplingParams.from_dict({"temperature": 0.3, "stop": ["a", "b"],
                                       "stop_token_ids": [3], "seed": 9, "max_new_tokens": 17})
    msg = TokenizedGenerateReq("r", [1, 2], params.to_dict())
    back = decode(encode(msg))
    assert SamplingParams.from_dict(back.sampling_params) == params


def test_a_list_of_messages_round_trips() -> None:
    msgs = [AbortReq("a"), GetStatsReq("b"), {"plain": [1, "x"]}, 3, None]
    assert decode(encode(msgs)) == msgs


def test_unknown_message_type_is_rejected() -> None:
    data = msgpack.packb({"__t__": "Popen", "args": ["rm", "-rf", "/"]}, use_bin_type=True)
    with pytest.raises(ValueError, match="unknown message type"):
        decode(data)
    nested = msgpack.packb({"__t__": "StepInput", "reqs": [{"__t__": "os.system", "x": 1}],
                            "aborts": [], "controls": []}, use_bin_type=True)
    with pytest.raises(ValueError):
        decode(nested)


@dataclass
class NotAMessage:
    x: int = 1


class Plain:
    pass


@pytest.mark.parametrize("obj", [NotAMessage(), Plain(), {1, 2}, object(), AbortReq,
                                 StepInput(controls=[NotAMessage()])])
def test_encoding_an_unregistered_object_raises_type_error(obj: Any) -> None:
    with pytest.raises(TypeError):
        encode(obj)


def test_duplicate_registration_is_refused() -> None:
    @dataclass
    class AbortReq:  # noqa: F811 - same name as a registered message on purpose
        rid: str

    with pytest.raises(ValueError):
        io_struct.message(AbortReq)
    assert registered_messages()["AbortReq"] is io_struct.AbortReq


class _Boom:
    triggered = False

    def __reduce__(self) -> Any:
        return (_trigger, ())


def _trigger() -> None:  # pragma: no cover - must never run
    _Boom.triggered = True


@pytest.mark.parametrize("proto", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_decode_of_a_pickle_payload_fails_without_running_it(proto: int) -> None:
    payload = pickle.dumps(AbortReq("x"), protocol=proto)
    with pytest.raises(Exception):
        decode(payload)
    evil = pickle.dumps({"msg": _Boom()}, protocol=proto)
    try:
        out = decode(evil)
    except Exception:
        out = None
    assert not _Boom.triggered
    assert not isinstance(out, AbortReq)


def test_no_pickle_on_any_socket() -> None:
    """No srt module uses pickle or pyzmq's pickling helpers."""
    pattern = re.compile(r"\bimport\s+(c?pickle|dill|cloudpickle)\b|\bfrom\s+(c?pickle|dill)\b"
                         r"|_pyobj\b|\bpickle\.loads?\b")
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "srt")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path, encoding="utf-8") as fh:
                    for i, line in enumerate(fh, 1):
                        if pattern.search(line):
                            offenders.append(f"{path}:{i}: {line.strip()}")
    assert not offenders, offenders


# ====================================================================== SamplingParams


def test_defaults() -> None:
    for d in (None, {}, {"temperature": None, "stop": None}):
        p = SamplingParams.from_dict(d)
        assert p == SamplingParams()
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.n, p.stop) == (
        128, 1.0, 1.0, -1, 1, ())


def test_valid_values_and_coercion() -> None:
    p = SamplingParams.from_dict({
        "temperature": 0, "top_p": 1, "top_k": 1, "max_new_tokens": 0, "min_new_tokens": 0,
        "stop": "###", "stop_token_ids": [0, 5], "n": 128, "seed": 0, "ignore_eos": True,
        "min_p": 1, "frequency_penalty": -2, "presence_penalty": 2, "repetition_penalty": 2,
    })
    assert p.stop == ("###",)
    assert p.stop_token_ids == (0, 5)
    assert isinstance(p.temperature, float) and p.temperature == 0.0
    assert isinstance(p.top_p, float)
    assert p.is_greedy and p.uses_penalties
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ("a", "b")
    assert SamplingParams.from_dict({"top_k": -1}).top_k == -1
    # frozen, hashable
    assert hash(p) == hash(SamplingParams.from_dict(p.to_dict() | {"stop": ["###"],
                                                                    "stop_token_ids": [0, 5]}))


@pytest.mark.parametrize(
    "d,param",
    [
        ({"temperature": -0.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"max_new_tokens": "3"}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens"),
        ({"min_new_tokens": 200}, "min_new_tokens"),  # > default max_new_tokens 128
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"bogus_key": 1}, "bogus_key"),
        ({"temperature": 0.5, "zzz": 1, "aaa": 2}, "aaa"),
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ("a",)}, "stop"),  # JSON has no tuples: only str or list
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_invalid_values_name_the_param(d: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamError) as exc:
        SamplingParams.from_dict(d)
    assert exc.value.param == param
    assert isinstance(exc.value, ValueError)
    assert str(exc.value)


@pytest.mark.parametrize(
    "d,param",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**64}, "top_k"),
        ({"stop_token_ids": [1, 2**64]}, "stop_token_ids"),
    ],
)
def test_accepted_params_can_cross_the_wire(d: dict[str, Any], param: str) -> None:
    """from_dict is the only validation before the request is encoded for the router: whatever it
    accepts must be encodable (else the HTTP process fails in `submit` with a 500 after having
    registered the request's state). Out-of-range integers must be rejected naming the field."""
    try:
        p = SamplingParams.from_dict(d)
    except SamplingParamError as e:
        assert e.param == param
        return
    msg = TokenizedGenerateReq("r", [1, 2], p.to_dict())
    back = decode(encode(msg))
    assert SamplingParams.from_dict(back.sampling_params) == p


@pytest.mark.parametrize("d", [[], "temperature=1", 3])
def test_non_object_is_rejected(d: Any) -> None:
    with pytest.raises(SamplingParamError) as exc:
        SamplingParams.from_dict(d)
    assert exc.value.param == "sampling_params"


def test_to_dict_round_trips_through_from_dict() -> None:
    p = SamplingParams(max_new_tokens=9, min_new_tokens=2, temperature=0.5, top_p=0.9, top_k=4,
                       stop=("x",), stop_token_ids=(1,), seed=5)
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in p.to_dict().items()}
    assert SamplingParams.from_dict(d) == p
    assert set(d) == {f.name for f in dataclasses.fields(SamplingParams)}
