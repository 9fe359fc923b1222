"""Jump-forward inside the decode batch on a GPU (GPU only): the step after a jump runs as a
DECODE step with one row per new token, replayed from a CUDA graph when it fits one. Its greedy
ids equal those of the same step run eagerly (float32, Triton attention), the outputs match
their patterns, and the KV is all given back.

SmolLM2's tokenizer (byte-level, as constrained decoding needs) comes from $SRT_TOKENIZER_DIR, or
the default model's directory; the weights are random."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import jsonschema
import pytest

from tests.e2e.test_jump_forward import LONG_KEYS
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    from transformers import AutoTokenizer

    tok_dir = os.environ.get("SRT_TOKENIZER_DIR")
    if not tok_dir:
        from srt.default_model import ensure_default_model

        tok_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    path = str(tmp_path_factory.mktemp("jump_gpu"))
    save_random_llama(path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            os.remove(os.path.join(path, name))
    for name in os.listdir(tok_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tok_dir, name), path)
    return path


def _run(model_dir: str, **extra: Any) -> tuple[dict[str, Any], Any, list[tuple[int, int]]]:
    """(results of test_jump_in_batch's requests, server, (forward rows, running requests) of
    every graph replay)."""
    from tests.gpu.driver import ModelProcessDriver
    from tests.unit.test_jump_in_batch import _requests, _serve

    server = ModelProcessDriver(model_dir, "triton", "float32", **extra).server
    replays: list[tuple[int, int]] = []
    runner = server.runner.graph_runner
    if runner is not None:
        real = runner.replay

        def counted(fb: Any) -> Any:
            replays.append((fb.batch_size, len(server.running)))
            return real(fb)

        runner.replay = counted  # observe which steps replay a graph
    return _serve(server, _requests(server.tokenizer)), server, replays


def test_jump_steps_replay_graphs_and_equal_eager(model_dir: str) -> None:
    from tests.model_process import kv_is_free
    from tests.unit.test_jump_in_batch import REGEXES

    graphs, server, replays = _run(model_dir, cuda_graph_max_bs=64)
    eager, eager_server, _ = _run(model_dir, disable_cuda_graph=True)
    assert server.mixed_steps_total >= 1
    # a step after a jump: more forward rows than running requests, from a graph
    assert any(rows > running for rows, running in replays), replays
    for rid in graphs:
        assert graphs[rid][:4] == eager[rid][:4], rid
        assert graphs[rid][4] == pytest.approx(eager[rid][4], abs=1e-4), rid
    text = {rid: server.tokenizer.decode(v[0]) for rid, v in graphs.items()}
    jsonschema.validate(json.loads(text["schema"]), LONG_KEYS)
    assert re.fullmatch(REGEXES[0], text["regex0"]), text["regex0"]
    assert re.fullmatch(REGEXES[1], text["regex1"]), text["regex1"]
    for rid in ("schema", "regex0", "regex1"):  # forced tokens took no forward of their own
        assert graphs[rid][2] < graphs[rid][3], (rid, graphs[rid][2:4])
    assert kv_is_free(server) and kv_is_free(eager_server)
