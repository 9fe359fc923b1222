"""EAGLE and EAGLE3 speculative decoding on a model process stepped in this process, float32 on
the CPU: every chain of drafts srt proposes equals what a reference head built from
transformers' Llama layers over transformers' hidden states drafts after the same tokens
(random heads, and a head that agrees with its target most of the time, so that verification
steps keep every number of rows); greedy output equal to decoding without drafts on a mixed
workload (stops, logprobs, n = 2, penalties, min_new_tokens), overlapped and not, with chunks
and mixed steps; start-up refusals."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReq
from srt.model_process.speculative import Speculator, main_path
from srt.models.llama_eagle import eagle3_aux_layers
from srt.server_args import ServerArgs
from tests.eagle_heads import (near_oracle_head, reference_drafts, reference_tree,
                                peaked_pair, save_eagle_head, save_echo_llama,
                                tree_paths)
from tests.model_process import branch_counter, cpu_model_server, kv_is_free, serve_all
from tests.unit.test_standalone import _check_equal

AUX = (1, 2, 3)  # the EAGLE3 heads below name layer outputs 0, 1, 2: the inputs of 1, 2, 3


def _spec(kind: str, head: str, **extra: Any) -> dict[str, Any]:
    return {"speculative_algorithm": kind, "speculative_draft_model_path": head, **extra}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: Any) -> str:
    from tests.random_models import save_random_llama

    return save_random_llama(str(tmp_path_factory.mktemp("eagle_target")))


@pytest.fixture(scope="module")
def echo_target_dir(tmp_path_factory: Any) -> str:
    return save_echo_llama(str(tmp_path_factory.mktemp("eagle_echo")))


def _record(server: Any) -> list[tuple[list[list[int]], list[list[int]], Any]]:
    """Each verification round's contexts (the requests' tokens, the last not yet computed),
    drafts and tree parents (None: chains), recorded around the real Speculator."""
    rounds: list[tuple[list[list[int]], list[list[int]], Any]] = []
    spec: Speculator = server.spec
    original = spec.drafts

    def drafts(batch: Any, room: int, alloc: Any, free: Any) -> Any:
        out = original(batch, room, alloc, free)
        if out is not None:
            rounds.append(([list(r.fill_ids) for r in batch.reqs], out.drafts,
                           [list(p) for p in out.parents] if out.parents else None))
        return out

    spec.drafts = drafts  # type: ignore[method-assign]
    return rounds


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    # distinct first tokens: no prefix is shared in the radix cache
    return [[10 + i] + torch.randint(2, 500, (length - 1,), generator=g).tolist()
            for i in range(n)]


def _check_drafts(target_dir: str, head_dir: str, ref: Any, kind: str,
                  **flags: Any) -> dict[str, int]:
    from transformers import AutoModelForCausalLM

    server = cpu_model_server(target_dir, **_spec(kind, head_dir, **flags))
    rounds = _record(server)
    reqs = [TokenizedGenerateReq(f"r{i}", p, {"temperature": 0, "max_new_tokens": 24 + 3 * i,
                                              "ignore_eos": True})
            for i, p in enumerate(_prompts(4, 9))]
    outs = serve_all(server, reqs)
    assert kv_is_free(server)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    checked = 0
    for contexts, drafts, _ in rounds:
        for ctx, d in zip(contexts, drafts):
            if d:
                assert d == reference_drafts(target, ref, kind, ctx, len(d), AUX), (ctx, d)
                checked += 1
    assert checked > 10
    counts = [o[-1].spec for o in outs.values()]
    return {"drafted": sum(c.draft_tokens for c in counts),
            "accepted": sum(c.accepted_tokens for c in counts),
            "steps": sum(c.verify_ct for c in counts)}


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_drafts_equal_a_reference_head(target_dir: str, tmp_path: Any, kind: str) -> None:
    """A random head: every proposed chain is the reference's after the same context (the
    head's KV of every earlier position holds the target's features of it)."""
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}} \
        if kind == "EAGLE3" else {}
    head, ref = save_eagle_head(str(tmp_path / "head"), target_dir, kind, **extra)
    _check_drafts(target_dir, head, ref, kind)


@pytest.mark.parametrize("overlap", [True, False])
def test_accepted_drafts_continue_from_the_kept_row(echo_target_dir: str, tmp_path: Any,
                                                    overlap: bool) -> None:
    """A head that agrees with its target most of the time: verification steps keep some,
    all or none of the drafts, and the next chain still equals the reference's, so the head's
    first draft and feature come from each request's last kept row."""
    head, ref = near_oracle_head(str(tmp_path / "head"), echo_target_dir, 0.35)
    r = _check_drafts(echo_target_dir, head, ref, "EAGLE", speculative_num_steps=4,
                      disable_overlap_schedule=not overlap)
    assert 0.3 * r["drafted"] < r["accepted"] < r["drafted"], r


def test_a_matching_head_has_every_draft_accepted(echo_target_dir: str, tmp_path: Any) -> None:
    head, ref = near_oracle_head(str(tmp_path / "head"), echo_target_dir, 0.0)
    r = _check_drafts(echo_target_dir, head, ref, "EAGLE", speculative_num_steps=5)
    assert r["drafted"] > 40 and r["accepted"] == r["drafted"], r


@pytest.mark.parametrize("kind,flags", [
    ("EAGLE", {}),
    ("EAGLE", {"disable_overlap_schedule": True}),
    ("EAGLE3", {"chunked_prefill_size": 16, "enable_mixed_chunk": True}),
])
def test_greedy_output_unchanged(target_dir: str, tmp_path: Any, kind: str,
                                 flags: dict[str, Any]) -> None:
    head, _ = save_eagle_head(str(tmp_path / "head"), target_dir, kind)
    r = _check_equal(target_dir, head, kind, **flags)
    assert r["stats"]["verify_steps"] > 0 and r["stats"]["draft_tokens"] > 0, r


def test_eagle3_feature_layers() -> None:
    class Cfg:
        eagle_config = None

    assert eagle3_aux_layers(Cfg(), 32) == (2, 16, 29)
    Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    assert eagle3_aux_layers(Cfg(), 32) == (2, 16, 29)
    Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 40, 28]}
    with pytest.raises(ValueError, match="do not fit"):
        eagle3_aux_layers(Cfg(), 32)


def test_start_up_refusals(target_dir: str, tmp_path: Any) -> None:
    eagle, _ = save_eagle_head(str(tmp_path / "e"), target_dir, "EAGLE")
    eagle3, _ = save_eagle_head(str(tmp_path / "e3"), target_dir, "EAGLE3")
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(model_path=target_dir, speculative_algorithm="EAGLE").validate()
    with pytest.raises(ValueError, match=r"must be in 2\.\.7 with --speculative-num-steps 2"):
        ServerArgs(model_path=target_dir, **_spec(
            "EAGLE", eagle, speculative_eagle_topk=2, speculative_num_steps=2,
            speculative_num_draft_tokens=8)).validate()
    with pytest.raises(ValueError, match="--speculative-eagle-topk must be in 1..16"):
        ServerArgs(model_path=target_dir, **_spec("EAGLE", eagle,
                                                  speculative_eagle_topk=17)).validate()
    tree = ServerArgs(model_path=target_dir, **_spec("EAGLE", eagle, speculative_eagle_topk=4))
    tree.validate()
    assert (tree.speculative_steps, tree.speculative_draft_tokens) == (3, 12)  # the defaults
    with pytest.raises(ValueError, match="is not an EAGLE3 head"):
        cpu_model_server(target_dir, **_spec("EAGLE3", eagle))
    with pytest.raises(ValueError, match="is not an EAGLE head"):
        cpu_model_server(target_dir, **_spec("EAGLE", eagle3))
    from tests.random_models import save_random_llama

    wide = save_random_llama(str(tmp_path / "wide"), hidden_size=128, intermediate_size=256,
                             num_attention_heads=4, num_key_value_heads=2)
    other, _ = save_eagle_head(str(tmp_path / "o"), wide, "EAGLE")
    with pytest.raises(ValueError, match="hidden size"):
        cpu_model_server(target_dir, **_spec("EAGLE", other))


# ---------------------------------------------------------------- tree drafts (top-k > 1)

TREE = {"speculative_eagle_topk": 3, "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 8}


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_tree_drafts_equal_a_reference_head(target_dir: str, tmp_path: Any, kind: str) -> None:
    """Top-k 3, 3 steps, 7 nodes: every tree srt proposes holds the paths of the reference's
    tree after the same context (the k best next tokens of each leaf, the k best-scored leaves
    of each step, the best-scored candidates), except where the reference's own choice is
    within rounding (a relative score gap under 1e-4 at some choice)."""
    from transformers import AutoModelForCausalLM

    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}} \
        if kind == "EAGLE3" else {}
    head, ref = save_eagle_head(str(tmp_path / "head"), target_dir, kind, **extra)
    server = cpu_model_server(target_dir, **_spec(kind, head, **TREE))
    rounds = _record(server)
    reqs = [TokenizedGenerateReq(f"r{i}", p, {"temperature": 0, "max_new_tokens": 12 + 3 * i,
                                              "ignore_eos": True})
            for i, p in enumerate(_prompts(3, 9))]
    serve_all(server, reqs)
    assert kv_is_free(server)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    checked = near_ties = branched = 0
    for contexts, drafts, parents in rounds:
        assert parents is not None
        for ctx, d, par in zip(contexts, drafts, parents):
            if not d:
                continue
            with torch.no_grad():
                want, gap = reference_tree(target, ref, kind, ctx, 3, 3, len(d), AUX)
            if gap < 1e-4:
                near_ties += 1
                continue
            assert tree_paths(d, par) == want, (ctx, d, par)
            branched += len(main_path(par)) < len(d)
            checked += 1
    assert checked > 10 and near_ties < checked and branched > checked // 2, \
        (checked, near_ties, branched)


@pytest.mark.parametrize("kind,flags", [
    ("EAGLE", {}),
    ("EAGLE", {"disable_overlap_schedule": True}),
    ("EAGLE3", {"chunked_prefill_size": 16, "enable_mixed_chunk": True}),
])
def test_tree_greedy_output_unchanged(tmp_path: Any, monkeypatch: Any, kind: str,
                                      flags: dict[str, Any]) -> None:
    """A random target that emits one of 6 ids, which one depending on the context through
    attention, and a random head drafting among them (`peaked_pair`): its top-3 trees often
    hold the target's token off the main path, so accepted paths leave it, and the KV of those rows must move into the request's row for
    what follows to equal decoding without drafts (ids, finish reasons, logprobs; stops,
    n = 2, penalties, min_new_tokens, sampled rows' lengths)."""
    target, head = peaked_pair(str(tmp_path), kind)
    seen = branch_counter(monkeypatch)
    r = _check_equal(target, head, kind, **flags, **TREE)
    assert r["stats"]["verify_steps"] > 0 and seen["off_main"] >= 5, (r, seen)


def _first_child_sampler(logits: Any, info: Any, children: Any, generator: Any = None) -> Any:
    """A wrong verification sampler: a row emits its first child whenever it has one."""
    from srt.layers.sampler import verify_sample

    drawn = verify_sample(logits, info, torch.full_like(children, -1), generator)
    first = children[:, 0] if children.dim() == 2 else children
    return torch.where(first >= 0, first, drawn)


@pytest.mark.parametrize("sampler", ["exact", "first_child"])
def test_tree_sampling_keeps_the_model_distribution(tmp_path: Any, monkeypatch: Any,
                                                    sampler: str) -> None:
    """Temperature 1, top-k 3, trees of top-k 3 over 2 steps (6 nodes) from a random head
    over 32 ids (so its children often fall in the target's top 3): the second and third tokens come from one verification
    (the root's row given its 3 children, then the row of the child it kept given that
    child's children), so the joint distribution of the first three tokens tests rejection
    child after child and the row each token is read from. It equals transformers' within a
    chi-square test at p = 0.001; a sampler that takes the first child whenever there is one
    fails the same test."""
    from transformers import AutoModelForCausalLM

    if sampler == "first_child":
        monkeypatch.setattr("srt.model_process.executor.verify_sample", _first_child_sampler)
    from tests.random_models import save_random_llama

    target = save_random_llama(str(tmp_path / "t"), vocab_size=32)
    head, _ = save_eagle_head(str(tmp_path / "h"), target, "EAGLE")
    prompt = [5, 17, 9, 30, 2, 11, 26, 14]
    params = {"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True}
    n = 1200
    server = cpu_model_server(target, **_spec(
        "EAGLE", head, speculative_eagle_topk=3, speculative_num_steps=2,
        speculative_num_draft_tokens=7, speculative_disable_by_batch_size=4096))
    seen = branch_counter(monkeypatch)
    outs = serve_all(server, [TokenizedGenerateReq(f"s{i}", prompt, dict(params))
                              for i in range(n)])
    triples = Counter(tuple([i for t in o for i in t.new_ids]) for o in outs.values())
    assert kv_is_free(server)
    assert all(o[-1].spec.draft_tokens > 0 for o in outs.values())
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)

    def top3(ids: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            v, i = model(torch.tensor([ids])).logits[0, -1].topk(3)
        return list(zip(i.tolist(), torch.softmax(v, -1).tolist()))

    expected: dict[tuple[int, ...], float] = {}
    for a, pa in top3(prompt):
        for b, pb in top3(prompt + [a]):
            for c, pc in top3(prompt + [a, b]):
                expected[(a, b, c)] = pa * pb * pc
    # cells expected fewer than 5 times are pooled into one
    big = {k for k, p in expected.items() if n * p >= 5}
    small = sum(p for k, p in expected.items() if k not in big)
    stat = math.inf if set(triples) - set(expected) else sum(
        (triples.get(k, 0) - n * expected[k]) ** 2 / (n * expected[k]) for k in big)
    if small * n >= 5:
        got = sum(c for k, c in triples.items() if k not in big)
        stat += (got - n * small) ** 2 / (n * small)
    df = len(big) - (0 if small * n >= 5 else 1)
    # chi-square at p = 0.001 (Wilson-Hilferty approximation of the quantile)
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert len(big) >= 8, expected
    if sampler == "exact":
        # drafts were accepted, also off the first-child path
        assert seen["paths"] > n // 4 and seen["off_main"] > n // 10, seen
        assert stat < critical, (stat, critical, triples, expected)
    else:
        assert stat > critical, (stat, critical)
