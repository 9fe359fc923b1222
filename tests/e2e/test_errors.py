"""Bad input to the real server: every row is answered 400 with an OpenAI-style error body that
names the offending field, nothing is ever answered 422 or 500, and the server keeps serving good
requests (also while bad ones arrive). Plus the small informational endpoints and /flush_cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from typing import Any

import pytest
import requests

GOOD_PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
GOOD_BODY = {"text": "The capital of France is", "sampling_params": GOOD_PARAMS}
VOCAB = 49152  # SmolLM2
CONTEXT = 8192  # SmolLM2


def body(**params: Any) -> dict[str, Any]:
    """A good /generate body with `params` merged into its sampling_params."""
    return {"text": "Hello", "sampling_params": {**GOOD_PARAMS, **params}}


# (id, JSON body, expected param, a substring the message must contain or None)
BAD_JSON_ROWS: list[tuple[str, Any, Any, str | None]] = [
    # temperature
    ("temperature_negative", body(temperature=-0.5), "temperature", None),
    ("temperature_tiny_negative", body(temperature=-1e-9), "temperature", None),
    ("temperature_string", body(temperature="hot"), "temperature", None),
    ("temperature_bool", body(temperature=True), "temperature", None),
    ("temperature_list", body(temperature=[1.0]), "temperature", None),
    # top_p
    ("top_p_zero", body(top_p=0), "top_p", None),
    ("top_p_1.5", body(top_p=1.5), "top_p", None),
    ("top_p_negative", body(top_p=-0.1), "top_p", None),
    ("top_p_string", body(top_p="0.5"), "top_p", None),
    # top_k
    ("top_k_zero", body(top_k=0), "top_k", None),
    ("top_k_minus_2", body(top_k=-2), "top_k", None),
    ("top_k_float", body(top_k=1.5), "top_k", None),
    # max_new_tokens
    ("max_new_tokens_negative", body(max_new_tokens=-1), "max_new_tokens", None),
    ("max_new_tokens_1.5", body(max_new_tokens=1.5), "max_new_tokens", None),
    ("max_new_tokens_string", body(max_new_tokens="10"), "max_new_tokens", None),
    ("max_new_tokens_bool", body(max_new_tokens=True), "max_new_tokens", None),
    ("max_new_tokens_9000", body(max_new_tokens=9000), "max_new_tokens", "context"),
    ("max_new_tokens_context", body(max_new_tokens=CONTEXT), "max_new_tokens", "context"),
    ("max_new_tokens_huge", body(max_new_tokens=10**12), "max_new_tokens", None),
    ("max_new_tokens_2**64", body(max_new_tokens=2**64), "max_new_tokens", None),
    ("long_text_prompt", {"text": "hello " * 10_000, "sampling_params": GOOD_PARAMS},
     ("text", "max_new_tokens"), "context"),
    ("long_input_ids_plus_500",
     {"input_ids": [28] * 8000, "sampling_params": {**GOOD_PARAMS, "max_new_tokens": 500}},
     "max_new_tokens", "context"),
    # min_new_tokens
    ("min_new_tokens_negative", body(min_new_tokens=-1), "min_new_tokens", None),
    ("min_new_tokens_above_max", body(min_new_tokens=5, max_new_tokens=4), "min_new_tokens",
     None),
    # n
    ("n_zero", body(n=0), "n", None),
    ("n_negative", body(n=-3), "n", None),
    ("n_float", body(n=2.0), "n", None),
    ("n_too_many", body(n=129), "n", None),
    # other numeric sampling parameters
    ("min_p_above_1", body(min_p=1.5), "min_p", None),
    ("frequency_penalty_3", body(frequency_penalty=3.0), "frequency_penalty", None),
    ("presence_penalty_minus_3", body(presence_penalty=-3.0), "presence_penalty", None),
    ("repetition_penalty_zero", body(repetition_penalty=0), "repetition_penalty", None),
    ("seed_string", body(seed="abc"), "seed", None),
    ("seed_float", body(seed=1.5), "seed", None),
    ("seed_2**64", body(seed=2**64), "seed", None),
    ("seed_minus_2**64", body(seed=-(2**64)), "seed", None),
    ("top_k_2**63", body(top_k=2**63), "top_k", None),
    ("n_huge", body(n=2**40), "n", None),
    ("min_new_tokens_huge", body(min_new_tokens=2**40), "min_new_tokens", None),
    # stop / stop_token_ids
    ("stop_int", body(stop=5), "stop", None),
    ("stop_list_of_int", body(stop=["a", 5]), "stop", None),
    ("stop_empty_string", body(stop=[""]), "stop", None),
    ("stop_token_ids_negative", body(stop_token_ids=[-1]), "stop_token_ids", None),
    ("stop_token_ids_string", body(stop_token_ids="2"), "stop_token_ids", None),
    ("stop_token_ids_2**64", body(stop_token_ids=[2**64]), "stop_token_ids", None),
    ("stop_token_ids_bool", body(stop_token_ids=[True]), "stop_token_ids", None),
    # booleans
    ("ignore_eos_string", body(ignore_eos="no"), "ignore_eos", None),
    ("ignore_eos_int", body(ignore_eos=0), "ignore_eos", None),
    ("skip_special_tokens_string", body(skip_special_tokens="false"), "skip_special_tokens",
     None),
    ("no_stop_trim_int", body(no_stop_trim=1), "no_stop_trim", None),
    # unknown sampling parameter
    ("unknown_sampling_param", body(foo=1), "foo", None),
    ("unknown_sampling_param_typo", body(max_tokens=4), "max_tokens", None),
    # prompt: empty
    ("text_empty", {"text": "", "sampling_params": GOOD_PARAMS}, "text", None),
    ("text_list_with_empty", {"text": ["a", ""], "sampling_params": GOOD_PARAMS}, "text", None),
    ("text_empty_list", {"text": [], "sampling_params": GOOD_PARAMS}, "text", None),
    ("input_ids_empty", {"input_ids": [], "sampling_params": GOOD_PARAMS}, "input_ids", None),
    ("input_ids_batch_with_empty", {"input_ids": [[1, 2], []], "sampling_params": GOOD_PARAMS},
     "input_ids", None),
    # prompt: both / neither
    ("text_and_input_ids", {"text": "Hi", "input_ids": [1, 2], "sampling_params": GOOD_PARAMS},
     ("text", "input_ids"), None),
    ("neither_text_nor_input_ids", {"sampling_params": GOOD_PARAMS}, ("text", "input_ids"),
     None),
    ("empty_object", {}, ("text", "input_ids"), None),
    ("text_null", {"text": None}, ("text", "input_ids"), None),
    # token ids outside the vocabulary
    ("input_ids_vocab_size", {"input_ids": [1, VOCAB], "sampling_params": GOOD_PARAMS},
     "input_ids", None),
    ("input_ids_minus_1", {"input_ids": [1, -1], "sampling_params": GOOD_PARAMS}, "input_ids",
     None),
    ("input_ids_huge", {"input_ids": [10**30], "sampling_params": GOOD_PARAMS}, "input_ids",
     None),
    ("input_ids_batch_out_of_vocab", {"input_ids": [[1], [VOCAB]], "sampling_params":
                                      GOOD_PARAMS}, "input_ids", None),
    # wrong types of top-level fields
    ("text_int", {"text": 123, "sampling_params": GOOD_PARAMS}, "text", None),
    ("text_object", {"text": {"a": 1}, "sampling_params": GOOD_PARAMS}, "text", None),
    ("text_list_with_int", {"text": ["a", 1], "sampling_params": GOOD_PARAMS}, "text", None),
    ("input_ids_string", {"input_ids": "abc", "sampling_params": GOOD_PARAMS}, "input_ids",
     None),
    ("input_ids_floats", {"input_ids": [1.5, 2], "sampling_params": GOOD_PARAMS}, "input_ids",
     None),
    ("input_ids_bools", {"input_ids": [True, False], "sampling_params": GOOD_PARAMS},
     "input_ids", None),
    ("input_ids_strings", {"input_ids": ["1", "2"], "sampling_params": GOOD_PARAMS},
     "input_ids", None),
    ("sampling_params_string", {"text": "Hi", "sampling_params": "x"}, "sampling_params", None),
    ("sampling_params_int", {"text": "Hi", "sampling_params": 3}, "sampling_params", None),
    ("sampling_params_list_wrong_length",
     {"text": ["a", "b"], "sampling_params": [GOOD_PARAMS]}, "sampling_params", None),
    ("sampling_params_list_for_single_prompt",
     {"text": "a", "sampling_params": [GOOD_PARAMS, GOOD_PARAMS]}, "sampling_params", None),
    ("sampling_params_list_bad_entry",
     {"text": ["a", "b"], "sampling_params": [GOOD_PARAMS, {**GOOD_PARAMS, "top_k": 0}]},
     "top_k", None),
    ("stream_string", {**GOOD_BODY, "stream": "yes"}, "stream", None),
    ("stream_int", {**GOOD_BODY, "stream": 1}, "stream", None),
    ("stream_true_with_bad_param", {**body(top_p=0), "stream": True}, "top_p", None),
    ("stream_true_out_of_vocab", {"input_ids": [VOCAB], "stream": True}, "input_ids", None),
    ("rid_int", {**GOOD_BODY, "rid": 7}, "rid", None),
    ("rid_empty", {**GOOD_BODY, "rid": ""}, "rid", None),
    ("rid_list_duplicates", {"text": ["a", "b"], "sampling_params": GOOD_PARAMS,
                             "rid": ["x", "x"]}, "rid", None),
    ("rid_list_wrong_length", {"text": ["a", "b"], "sampling_params": GOOD_PARAMS,
                               "rid": ["x"]}, "rid", None),
    ("unknown_top_level_field", {**GOOD_BODY, "prompt": "Hi"}, "prompt", None),
    # logprob fields
    ("return_logprob_string", {**GOOD_BODY, "return_logprob": "yes"}, "return_logprob", None),
    ("return_logprob_int", {**GOOD_BODY, "return_logprob": 1}, "return_logprob", None),
    ("logprob_start_len_minus_2", {**GOOD_BODY, "return_logprob": True,
                                   "logprob_start_len": -2}, "logprob_start_len", None),
    ("logprob_start_len_float", {**GOOD_BODY, "return_logprob": True,
                                 "logprob_start_len": 1.5}, "logprob_start_len", None),
    ("logprob_start_len_past_prompt", {**GOOD_BODY, "return_logprob": True,
                                       "logprob_start_len": 5}, "logprob_start_len", None),
    ("logprob_start_len_per_prompt_past_one",
     {"text": ["a b c d e f", "a"], "sampling_params": GOOD_PARAMS, "return_logprob": True,
      "logprob_start_len": [3, 3]}, "logprob_start_len", None),
    ("top_logprobs_num_21", {**GOOD_BODY, "return_logprob": True, "top_logprobs_num": 21},
     "top_logprobs_num", None),
    ("top_logprobs_num_negative", {**GOOD_BODY, "return_logprob": True,
                                   "top_logprobs_num": -1}, "top_logprobs_num", None),
    ("top_logprobs_num_string", {**GOOD_BODY, "return_logprob": True, "top_logprobs_num": "3"},
     "top_logprobs_num", None),
    ("return_text_in_logprobs_int", {**GOOD_BODY, "return_logprob": True,
                                     "return_text_in_logprobs": 1}, "return_text_in_logprobs",
     None),
    ("return_logprob_list_wrong_length", {"text": ["a", "b"], "sampling_params": GOOD_PARAMS,
                                          "return_logprob": [True]}, "return_logprob", None),
]

# (id, raw request body bytes, expected param): not a JSON object (param null), or numbers that
# Python's json module reads but that are not finite.
BAD_RAW_ROWS: list[tuple[str, bytes, str | None]] = [
    ("truncated_json", b'{"text": ', None),
    ("empty_body", b"", None),
    ("not_json", b"hello", None),
    ("trailing_garbage", b'{"text": "Hi"} x', None),
    ("invalid_utf8", b'{"text": "\xff\xfe"}', None),
    ("json_array", b'[{"text": "Hi"}]', None),
    ("json_string", b'"Hi"', None),
    ("json_null", b"null", None),
    ("deeply_nested_json", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    # valid JSON escapes that decode to lone UTF-16 surrogates: not encodable text
    ("text_lone_surrogate", b'{"text": "\\ud800"}', "text"),
    ("text_batch_lone_surrogate", b'{"text": ["fine", "a\\udfffb"]}', "text"),
    ("stop_lone_surrogate",
     b'{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "stop": ["\\ud800"]}}', "stop"),
    ("rid_lone_surrogate", b'{"text": "Hi", "rid": "\\ud800", "sampling_params": '
                           b'{"max_new_tokens": 2}}', "rid"),
    ("temperature_nan", b'{"text": "Hi", "sampling_params": {"temperature": NaN}}',
     "temperature"),
    ("top_p_infinity", b'{"text": "Hi", "sampling_params": {"top_p": Infinity}}', "top_p"),
    ("frequency_penalty_minus_infinity",
     b'{"text": "Hi", "sampling_params": {"frequency_penalty": -Infinity}}',
     "frequency_penalty"),
    ("max_new_tokens_1e400", b'{"text": "Hi", "sampling_params": {"max_new_tokens": 1e400}}',
     "max_new_tokens"),
]


def post_json(server: Any, payload: Any) -> requests.Response:
    return requests.post(server.url + "/generate", json=payload, timeout=120)


def post_raw(server: Any, raw: bytes) -> requests.Response:
    return requests.post(server.url + "/generate", data=raw,
                         headers={"Content-Type": "application/json"}, timeout=120)


def assert_error(r: requests.Response, param: Any, message_has: str | None = None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    data = r.json()
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == "invalid_request_error", err
    assert isinstance(err["code"], str) and err["code"], err
    if isinstance(param, tuple):
        assert err["param"] in param, err
    else:
        assert err["param"] == param, err
    if message_has is not None:
        assert message_has in err["message"].lower(), err
    return err


def assert_serves(server: Any) -> None:
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    out = server.generate(GOOD_BODY)
    assert out["meta_info"]["completion_tokens"] == 4
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


@pytest.fixture(scope="module")
def reference(server: Any) -> dict[str, Any]:
    """The greedy answer to GOOD_BODY before any bad request was sent."""
    return server.generate(GOOD_BODY)


@pytest.mark.parametrize("payload,param,message_has",
                         [pytest.param(b, p, m, id=i) for i, b, p, m in BAD_JSON_ROWS])
def test_bad_json_body_is_400(server: Any, payload: Any, param: Any,
                              message_has: str | None) -> None:
    assert_error(post_json(server, payload), param, message_has)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("raw,param", [pytest.param(b, p, id=i) for i, b, p in BAD_RAW_ROWS])
def test_bad_raw_body_is_400(server: Any, raw: bytes, param: str | None) -> None:
    assert_error(post_raw(server, raw), param)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


def test_malformed_json_code(server: Any) -> None:
    err = assert_error(post_raw(server, b'{"text": '), None)
    assert err["code"] == "invalid_json", err


def test_context_length_messages(server: Any) -> None:
    err = assert_error(post_json(server, body(max_new_tokens=9000)), "max_new_tokens", "context")
    assert str(CONTEXT) in err["message"], err
    err = assert_error(post_json(server, {"input_ids": [28] * 8000, "sampling_params":
                                          {**GOOD_PARAMS, "max_new_tokens": 500}}),
                       "max_new_tokens", "context")
    assert "8000" in err["message"] and str(CONTEXT) in err["message"], err


def test_context_length_boundary(server: Any) -> None:
    """prompt + max_new_tokens == context length is accepted; one more token is not."""
    assert_error(post_json(server, {"input_ids": [28, 28], "sampling_params":
                                    {**GOOD_PARAMS, "max_new_tokens": CONTEXT - 1}}),
                 "max_new_tokens", "context")
    first = server.generate({"input_ids": [28, 28], "sampling_params":
                             {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}})
    tok = first["output_ids"][0]
    # the largest allowed budget; the greedy first token is a stop token, so it ends at once
    out = server.generate({"input_ids": [28, 28], "sampling_params":
                           {"temperature": 0, "max_new_tokens": CONTEXT - 2,
                            "stop_token_ids": [tok]}})
    assert out["output_ids"] == [tok]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}


def test_bad_requests_do_not_disturb_others(server: Any, reference: dict[str, Any]) -> None:
    """A good request in flight while many bad ones arrive gets exactly its normal answer."""
    good = {"text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
    expected = server.generate(good)
    with cf.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(server.generate, good) for _ in range(2)]
        bads = [pool.submit(post_json, server, b) for _, b, _, _ in BAD_JSON_ROWS]
        raws = [pool.submit(post_raw, server, b) for _, b, _ in BAD_RAW_ROWS]
        for f in goods:
            out = f.result()
            assert out["output_ids"] == expected["output_ids"]
            assert out["text"] == expected["text"]
        for (name, _, param, msg), f in zip(BAD_JSON_ROWS, bads):
            assert_error(f.result(), param, msg)
        for (name, _, param), f in zip(BAD_RAW_ROWS, raws):
            assert_error(f.result(), param)
    # and the very first answer is unchanged too
    again = server.generate(GOOD_BODY)
    assert again["output_ids"] == reference["output_ids"]
    assert again["text"] == reference["text"]


def test_rid_in_use_is_400(server: Any) -> None:
    """A rid that an in-flight request holds is refused; the running request is unaffected."""
    long_body = {"text": "Count slowly from one to one hundred:", "rid": "rid-in-use",
                 "stream": True,
                 "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}}
    with requests.post(server.url + "/generate", json=long_body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = r.iter_lines()
        first = next(line for line in lines if line)  # it is registered and running now
        assert first.startswith(b"data: {"), first
        dup = post_json(server, {**GOOD_BODY, "rid": "rid-in-use"})
        assert_error(dup, "rid")
        dup = post_json(server, {"text": ["a", "b"], "sampling_params": GOOD_PARAMS,
                                 "rid": ["other", "rid-in-use"]})
        assert_error(dup, "rid")
        last = None
        for line in lines:
            if line.startswith(b"data: {"):
                last = json.loads(line[len(b"data: "):])
    assert last is not None
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 48}, last
    assert last["meta_info"]["id"] == "rid-in-use"
    # once finished, the rid is free again
    out = server.generate({**GOOD_BODY, "rid": "rid-in-use"})
    assert out["meta_info"]["id"] == "rid-in-use"


def test_rejected_request_leaves_no_state(server: Any) -> None:
    """A request refused with 400 does not keep its rid: the same rid works right after."""
    bad = (b'{"text": "Hi", "rid": "rid-after-400", "sampling_params": '
           b'{"max_new_tokens": 2, "stop": ["\\ud800"]}}')
    assert_error(post_raw(server, bad), "stop")
    assert_error(post_json(server, {**body(top_k=0), "rid": "rid-after-400"}), "top_k")
    out = server.generate({**GOOD_BODY, "rid": "rid-after-400"})
    assert out["meta_info"]["id"] == "rid-after-400"


def test_batch_with_one_bad_entry_runs_nothing(server: Any) -> None:
    """A batch is validated as a whole: one bad prompt rejects it before anything runs."""
    before = server.wait_idle()
    r = post_json(server, {"text": ["fine", "also fine"],
                           "sampling_params": [GOOD_PARAMS, {**GOOD_PARAMS, "top_p": 2}]})
    assert_error(r, "top_p")
    after = server.wait_idle()
    assert after["available_kv_tokens"] + after["evictable_kv_tokens"] == \
        before["available_kv_tokens"] + before["evictable_kv_tokens"]


@pytest.mark.parametrize("method,path", [
    ("get", "/generate"),
    ("post", "/health"),
    ("get", "/no_such_endpoint"),
    ("post", "/get_model_info"),
])
def test_wrong_method_or_path_is_not_422_or_500(server: Any, method: str, path: str) -> None:
    r = requests.request(method, server.url + path, timeout=30)
    assert r.status_code in (404, 405), (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err


def test_health(server: Any) -> None:
    r = requests.get(server.url + "/health", timeout=30)
    assert r.status_code == 200, r.text


def test_get_model_info(server: Any, smollm2_dir: str) -> None:
    r = requests.get(server.url + "/get_model_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["is_generation"] is True
    assert isinstance(info["model_path"], str) and info["model_path"]
    import os

    assert os.path.realpath(info["model_path"]) == os.path.realpath(smollm2_dir)


def test_get_server_info(server: Any) -> None:
    server.generate(GOOD_BODY)
    info = server.wait_idle()
    for key in ("max_total_num_tokens", "available_kv_tokens", "evictable_kv_tokens",
                "num_running_reqs", "num_waiting_reqs"):
        assert isinstance(info[key], int) and not isinstance(info[key], bool), (key, info)
        assert info[key] >= 0, (key, info)
    assert info["max_total_num_tokens"] == 32768  # --max-total-tokens of the fixture
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["available_kv_tokens"] + info["evictable_kv_tokens"] <= \
        info["max_total_num_tokens"]
    assert isinstance(info["cache_hit_rate"], float) and 0.0 <= info["cache_hit_rate"] <= 1.0
    # server arguments
    assert info["tp_size"] == 1
    assert info["device"] == "cpu"
    assert info["dtype"] == "float32"
    assert info["random_seed"] == 1234
    assert isinstance(info["model_path"], str) and info["model_path"]
    # the model process gives its free heap pages back once idle after work (glibc)
    deadline = time.monotonic() + 30
    while info["heap"]["trims"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
        info = server.wait_idle()
    assert info["heap"]["trims"] >= 1, info["heap"]
    assert 0 <= info["heap"]["free_mb"] <= info["heap"]["arena_mb"], info["heap"]
    # what the model process held at the end of start-up is out of the collector's reach
    gcs = info["gc"]
    assert gcs["frozen_objects"] > 10_000, gcs
    assert len(gcs["collections"]) == 3 and min(gcs["collections"]) >= 0, gcs
    assert gcs["pause_ms_max"] >= 0 and len(gcs["pause_ms_total"]) == 3, gcs
    assert info["slow_rounds"]["threshold_ms"] == 100.0
    assert info["slow_rounds"]["count"] == len(info["slow_rounds"]["longest"]) or \
        len(info["slow_rounds"]["longest"]) == 50


def test_flush_cache_when_idle(server: Any) -> None:
    server.generate({"text": "Something to cache: the quick brown fox",
                     "sampling_params": GOOD_PARAMS})
    info = server.wait_idle()
    assert info["evictable_kv_tokens"] > 0, info
    r = requests.post(server.url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    info = server.wait_idle()
    assert info["evictable_kv_tokens"] == 0, info
    assert info["available_kv_tokens"] == info["max_total_num_tokens"], info
    # a prompt seen before the flush is computed from scratch again
    out = server.generate({"text": "Something to cache: the quick brown fox",
                           "sampling_params": GOOD_PARAMS})
    assert out["meta_info"]["cached_tokens"] == 0, out


def test_serves_after_everything(server: Any, reference: dict[str, Any]) -> None:
    assert_serves(server)
    out = server.generate(GOOD_BODY)
    assert out["output_ids"] == reference["output_ids"]
