"""EAGLE / EAGLE3 on a GPU (GPU only): float32, Triton attention, the target's decode and
verification steps from CUDA graphs (its features come out of the graphs), the head eager, the
overlapped loop. A head that computes its target's next token exactly has every draft accepted
and the ids of decoding without drafts, in and beyond the largest graph; a random EAGLE3 head
keeps the output of decoding without drafts on a mixed workload."""

from __future__ import annotations

from typing import Any

import pytest

from tests.eagle_heads import near_oracle_head, save_eagle_head, save_echo_llama
from tests.gpu.test_spec_gpu import _free, _server
from tests.overlap_cases import assert_same, mixed_requests, serve
from tests.unit.test_speculative import _greedy_only, _repeating_requests

pytestmark = pytest.mark.gpu


def _check_equal(target: str, n: int, repeating: bool, greedy: bool = False,
                 **spec: Any) -> dict[str, Any]:
    """Greedy ids of decoding with `spec` equal to decoding without, on `n` mixed requests
    (and the repeating ones; `greedy`: every request greedy and at least 24 tokens long, so
    that drafts past a request's end do not count as rejected); the speculative totals."""
    plain = _server(target)
    server = _server(target, speculative_disable_by_batch_size=4096, **spec)
    vocab = plain.config.vocab_size

    def reqs() -> list[Any]:
        out = mixed_requests(vocab, n, 5, None) + (
            _repeating_requests(vocab, None) if repeating else [])
        for r in out if greedy else []:
            r.sampling_params["temperature"] = 0
            r.sampling_params["max_new_tokens"] = max(24, r.sampling_params["max_new_tokens"])
        return out

    want = serve(plain, reqs())
    r = reqs()
    got = serve(server, r)
    assert_same(_greedy_only(got, r), _greedy_only(want, r))
    assert _free(plain) and _free(server)
    return {"stats": server.stats()["speculative"], "server": server}


@pytest.mark.parametrize("n", [10, 40])  # verification rows within / beyond 32 graph rows
def test_matching_eagle_head_accepts_every_draft(tmp_path: Any, n: int) -> None:
    target = save_echo_llama(str(tmp_path / "t"), vocab_size=6000)
    head, _ = near_oracle_head(str(tmp_path / "h"), target, 0.0)
    # every request greedy: a sampled one keeps a draft only with the target's probability
    r = _check_equal(target, n, False, greedy=True, speculative_algorithm="EAGLE",
                     speculative_draft_model_path=head, speculative_num_steps=4)
    s = r["stats"]
    # (every draft accepted: the n requests' few hundred tokens take few verifications)
    assert s["verify_steps"] > 0 and s["draft_tokens"] > 3 * n, s
    assert s["accepted_tokens"] > 0.95 * s["draft_tokens"], s
    graphs = r["server"].runner.graph_runner
    assert graphs is not None and graphs.hidden


def test_random_eagle3_head_keeps_the_output(tmp_path: Any) -> None:
    from tests.random_models import save_random_llama

    target = save_random_llama(str(tmp_path / "t"), vocab_size=6000)
    head, _ = save_eagle_head(str(tmp_path / "h"), target, "EAGLE3")
    s = _check_equal(target, 40, True, speculative_algorithm="EAGLE3",
                     speculative_draft_model_path=head)["stats"]
    assert s["verify_steps"] > 0 and s["draft_tokens"] > 0, s


@pytest.mark.parametrize("kind,n", [("EAGLE", 3), ("EAGLE", 10), ("EAGLE3", 10)])
def test_tree_drafts_keep_the_output(tmp_path: Any, monkeypatch: Any, kind: str,
                                     n: int) -> None:
    """Top-k 3 trees of 7 nodes from a head drafting among the 6 ids its target emits
    (`peaked_pair`): verification rows from CUDA graphs (3 requests: 24 rows, within the
    graphs; 10: beyond), scratch rows for the branches, accepted paths off the first-child
    path; the ids of decoding without drafts."""
    from tests.eagle_heads import peaked_pair
    from tests.model_process import branch_counter
    from tests.unit.test_eagle import TREE

    target, head = peaked_pair(str(tmp_path), kind)
    seen = branch_counter(monkeypatch)
    s = _check_equal(target, n, False, speculative_algorithm=kind,
                     speculative_draft_model_path=head, **TREE)["stats"]
    assert s["verify_steps"] > 0, s
    # 10 requests: accepted paths leave the first-child path. (With 3, in bf16 on one H100,
    # the 11 verification steps accepted no draft at all: the output check above is what
    # that case adds.)
    assert n < 10 or seen["off_main"] > 0, (s, seen)
