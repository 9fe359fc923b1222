"""Multi-LoRA serving through the real server in float32 on the CPU: a small random Llama and
three random adapters written with `peft` (all seven projections at rank 8; q and v at rank 4
with rsLoRA; o, gate, up and down at rank 16). Requests of the base model and of each adapter,
interleaved in one batch, give the greedy tokens and prompt / output logprobs (within 1e-4) of
transformers running the adapter merged into the base (`merge_and_unload`), at --tp-size 1 and
2 (gloo). The radix cache never shares KV between adapters (cached-token counts); adapters load
and unload while requests run, and none is lost; bad adapters are a 400 and the server goes on.
A Phi-3 adapter on its fused qkv_proj / gate_up_proj serves as transformers merges it."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import Any

import pytest
import requests

from tests.conftest import ServerProcess
from tests.e2e.test_models import PROMPTS, TOL, Reference, hf_reference
from tests.random_models import save_random_llama, save_random_model

peft = pytest.importorskip("peft")

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
BASE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=4)
# name -> (rank, alpha, target modules, rslora)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "A": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
          False),
    "B": (4, 8, ["q_proj", "v_proj"], True),
    "C": (16, 24, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
# one adapter name (or None: the base model) per prompt of PROMPTS
MIX = [None, "A", "B", "C", "A", None, "C", "B"]


def _write_adapter(base: str, out: str, name: str, seed: int) -> str:
    return _write_peft(base, out, *ADAPTERS[name], seed)


def _write_peft(base: str, out: str, rank: int, alpha: int, targets: list[str], rslora: bool,
                seed: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                            use_rslora=rslora, init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # both A and B random (PEFT starts B at zero), large enough to bite
        for n, p in lora.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    lora.save_pretrained(out)
    return out


def _merged(base: str, adapter: str, out: str) -> str:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: Any) -> tuple[str, dict[str, str], dict[Any, Reference]]:
    """(base path, adapter name -> path, adapter name or None -> transformers' reference)."""
    root = tmp_path_factory.mktemp("lora")
    base = save_random_llama(str(root / "base"), **BASE)
    paths = {n: _write_adapter(base, str(root / n), n, i) for i, n in enumerate(ADAPTERS)}
    refs: dict[Any, Reference] = {None: hf_reference(base, PROMPTS, NEW)}
    for n, p in paths.items():
        refs[n] = hf_reference(_merged(base, p, str(root / f"merged_{n}")), PROMPTS, NEW)
    return base, paths, refs


def _serve(base: str, paths: dict[str, str], *extra: str) -> ServerProcess:
    return ServerProcess(["--model-path", base, "--device", "cpu", "--dtype", "float32",
                          "--random-seed", "0", "--max-total-tokens", "1024", "--lora-paths",
                          *[f"{n}={p}" for n, p in paths.items()], *extra]).start()


def _check_mix(srv: ServerProcess, refs: dict[Any, Reference], mix: list[Any]) -> None:
    """Every prompt under its adapter, in one request: tokens and logprobs of its reference."""
    res = srv.generate({"input_ids": PROMPTS, "sampling_params": GREEDY, "lora_path": mix,
                        "return_logprob": True, "logprob_start_len": 0})
    for i, (r, name) in enumerate(zip(res, mix)):
        ref = refs[name]
        assert r["output_ids"] == ref.greedy[i], (i, name)
        got_in = [x[0] for x in r["meta_info"]["input_token_logprobs"][1:]]
        assert got_in == pytest.approx(ref.prompt_logprobs[i], abs=TOL), (i, name)
        got_out = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        assert got_out == pytest.approx(ref.output_logprobs[i], abs=TOL), (i, name)


def test_references_differ(lora_setup: Any) -> None:
    """Each adapter changes the greedy tokens: the equality tests below can fail."""
    _, _, refs = lora_setup
    outs = [tuple(map(tuple, refs[n].greedy)) for n in (None, *ADAPTERS)]
    assert len(set(outs)) == len(outs)


def test_mixed_batch_tp1_and_live_adapters(lora_setup: Any, tmp_path: Any) -> None:
    base, paths, refs = lora_setup
    # 2 slots for 3 adapters: batches are split by adapter count and slots are reused (LRU)
    srv = _serve(base, paths, "--max-loras-per-batch", "2")
    try:
        _check_mix(srv, refs, MIX)
        _check_mix(srv, refs, list(reversed(MIX)))
        info = srv.server_info()["lora"]
        assert set(info["adapters"]) == set(ADAPTERS) and info["max_lora_rank"] == 16
        _radix_isolation(srv)
        _live_load_unload(srv, base, paths, refs, tmp_path)
        _openai_model_field(srv, refs)
        _bad_adapters(srv, paths, tmp_path)
        _check_mix(srv, refs, [None, "A", None, "C", "A", None, "C", None])  # still serving
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_mixed_batch_tp2(lora_setup: Any) -> None:
    base, paths, refs = lora_setup
    srv = _serve(base, paths, "--tp-size", "2")
    try:
        _check_mix(srv, refs, MIX)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_phi3_fused_modules(tmp_path: Any) -> None:
    """A Phi-3 adapter as PEFT writes it for Phi-3's fused layers (qkv_proj, gate_up_proj, and
    o_proj, down_proj), beside base requests in one batch: transformers' tokens and logprobs
    with the adapter merged."""
    from transformers import Phi3Config, Phi3ForCausalLM

    base = save_random_model(str(tmp_path / "phi3"), Phi3Config, Phi3ForCausalLM,
                             pad_token_id=0, bos_token_id=1, eos_token_id=1, **BASE)
    adapter = _write_peft(base, str(tmp_path / "P"), 8, 16,
                          ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False, 5)
    refs = {None: hf_reference(base, PROMPTS, NEW),
            "P": hf_reference(_merged(base, adapter, str(tmp_path / "merged")), PROMPTS, NEW)}
    assert refs[None].greedy != refs["P"].greedy
    srv = _serve(base, {"P": adapter})
    try:
        _check_mix(srv, refs, [None, "P", "P", None, "P", None, None, "P"])
    finally:
        srv.stop()


def _cached(srv: ServerProcess, lora: Any, ids: list[int]) -> int:
    r = srv.generate({"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 1},
                      "lora_path": lora})
    return r["meta_info"]["cached_tokens"]


def _radix_isolation(srv: ServerProcess) -> None:
    """The same prompt under A, then B, then the base model computes it each time; under A again
    it is read from the cache."""
    ids = list(range(120, 132))  # in no prompt before
    assert _cached(srv, "A", ids) == 0
    assert _cached(srv, "B", ids) == 0
    assert _cached(srv, None, ids) == 0
    assert _cached(srv, "A", ids) == len(ids) - 1
    assert _cached(srv, "B", ids) == len(ids) - 1


def _post(srv: ServerProcess, route: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(srv.url + route, json=body, timeout=120)


def _live_load_unload(srv: ServerProcess, base: str, paths: dict[str, str],
                      refs: dict[Any, Reference], tmp_path: Any) -> None:
    """While streams of A and of the base model run: A cannot be unloaded (in flight), B can;
    D (C's weights under a new name) loads and serves C's tokens; no stream is lost."""
    results: dict[int, Any] = {}

    def run(i: int, lora: Any) -> None:
        results[i] = srv.generate({"input_ids": PROMPTS[i], "lora_path": lora,
                                   "sampling_params": {**GREEDY, "max_new_tokens": 40}})

    threads = [threading.Thread(target=run, args=(i, lora))
               for i, lora in enumerate(["A", None, "A", "C"])]
    for t in threads:
        t.start()
    try:
        # the streams are running before A's unload is asked for (else it may come first,
        # unload A, and A's streams are refused)
        deadline = time.monotonic() + 60
        while srv.server_info()["num_running_reqs"] < 4 and len(results) < 4:
            assert time.monotonic() < deadline, "the four streams never ran together"
            time.sleep(0.005)
        busy = _post(srv, "/unload_lora_adapter", {"lora_name": "A"})
        d = shutil.copytree(paths["C"], str(tmp_path / "D"))
        loaded = _post(srv, "/load_lora_adapter", {"lora_name": "D", "lora_path": d})
        unloaded = _post(srv, "/unload_lora_adapter", {"lora_name": "B"})
    finally:
        for t in threads:
            t.join(300)
    assert len(results) == 4 and all(len(r["output_ids"]) == 40 for r in results.values())
    for i, lora in enumerate(["A", None, "A", "C"]):
        assert results[i]["output_ids"][:NEW] == refs[lora].greedy[i]
    if busy.status_code == 200:  # the streams may all have finished first on a fast machine
        pytest.fail("unloaded A while its requests ran")
    assert busy.status_code == 400 and "in flight" in busy.json()["error"]["message"]
    assert loaded.status_code == 200, loaded.text
    assert unloaded.status_code == 200, unloaded.text
    assert set(loaded.json()["loaded_adapters"]) == {"A", "B", "C", "D"}
    assert set(unloaded.json()["loaded_adapters"]) == {"A", "C", "D"}
    _check_mix(srv, {**refs, "D": refs["C"]}, ["D", None, "A", "D", "C", None, "D", "A"])
    r = requests.post(srv.url + "/generate", json={"input_ids": PROMPTS[0], "lora_path": "B",
                                                   "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 400 and "unknown LoRA adapter 'B'" in r.json()["error"]["message"]
    # vLLM's route loads B again, under a new id
    again = _post(srv, "/v1/load_lora_adapter", {"lora_name": "B", "lora_path": paths["B"]})
    assert again.status_code == 200, again.text
    _check_mix(srv, refs, MIX)


def _openai_model_field(srv: ServerProcess, refs: dict[Any, Reference]) -> None:
    """`model` names an adapter as `A` or `base:A`; /v1/models lists the adapters."""
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    served = next(m for m in models if m not in ("A", "B", "C", "D"))
    assert {"A", "B", "C"} <= set(models)
    assert models["A"].model_extra["parent"] == served
    for model, name in (("A", "A"), (f"{served}:C", "C"), (served, None)):
        out = client.completions.create(model=model, prompt=PROMPTS[4], max_tokens=NEW,
                                        temperature=0, extra_body={"ignore_eos": True},
                                        logprobs=0)
        assert out.choices[0].logprobs.tokens is not None
        r = srv.generate({"input_ids": PROMPTS[4], "sampling_params": GREEDY, "lora_path": name})
        assert r["output_ids"] == refs[name].greedy[4]
        assert out.choices[0].text == r["text"]
    with pytest.raises(Exception, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def _bad_adapters(srv: ServerProcess, paths: dict[str, str], tmp_path: Any) -> None:
    """Each is a 400 naming the fault; the server keeps its adapters and goes on serving."""
    missing = _post(srv, "/load_lora_adapter", {"lora_name": "X",
                                                "lora_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and "not a directory" in missing.text
    big = shutil.copytree(paths["A"], str(tmp_path / "big"))
    cfg = json.load(open(os.path.join(big, "adapter_config.json")))
    json.dump({**cfg, "r": 32}, open(os.path.join(big, "adapter_config.json"), "w"))
    over = _post(srv, "/load_lora_adapter", {"lora_name": "X", "lora_path": big})
    assert over.status_code == 400 and "over the server's --max-lora-rank 16" in over.text
    bad = shutil.copytree(paths["B"], str(tmp_path / "shape"))
    json.dump({**json.load(open(os.path.join(bad, "adapter_config.json"))), "r": 2},
              open(os.path.join(bad, "adapter_config.json"), "w"))
    shape = _post(srv, "/load_lora_adapter", {"lora_name": "X", "lora_path": bad})
    assert shape.status_code == 400 and "the base model needs" in shape.text
    dup = _post(srv, "/load_lora_adapter", {"lora_name": "A", "lora_path": paths["A"]})
    assert dup.status_code == 400 and "already" in dup.text
    assert "X" not in srv.server_info()["lora"]["adapters"]
