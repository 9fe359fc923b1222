"""Our layers against torch / transformers references on random inputs.

RMSNorm and rotary against transformers' Llama modules; the torch attention backend against a
plain float64 causal softmax attention (GQA, ragged lengths, shuffled slots, NaN-poisoned pool);
a tiny random Llama through ModelRunner against transformers' logits and greedy generate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf_llama

from srt.layers.attention.torch_backend import TorchAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context
from srt.layers.layernorm import RMSNorm
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary import RotaryEmbedding
from srt.memory_pool import ReqToTokenPool, TokenToKVPool
from srt.model_config import ModelConfig, rope_params


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ====================================================================== RMSNorm


@pytest.mark.parametrize("hidden,eps", [(64, 1e-6), (48, 1e-5)])
def test_rmsnorm_matches_transformers(hidden: int, eps: float) -> None:
    g = gen(hidden)
    weight = torch.rand(hidden, generator=g) + 0.5
    ours = RMSNorm(hidden, eps)
    ref = hf_llama.LlamaRMSNorm(hidden, eps)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
    x = torch.randn(7, hidden, generator=g) * 3 + 0.5
    res = torch.randn(7, hidden, generator=g)
    x_before, res_before = x.clone(), res.clone()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)
        out, new_res = ours(x, res)
        torch.testing.assert_close(out, ref(x + res), rtol=1e-6, atol=1e-6)
        assert torch.equal(new_res, x + res)
    # inputs are not modified in place
    assert torch.equal(x, x_before) and torch.equal(res, res_before)


def test_rmsnorm_half_precision_computes_in_float32() -> None:
    g = gen(0)
    hidden = 32
    weight = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16)
    x = (torch.randn(5, hidden, generator=g) * 4).to(torch.bfloat16)
    ours = RMSNorm(hidden, 1e-6).to(torch.bfloat16)
    ref = hf_llama.LlamaRMSNorm(hidden, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
        assert torch.equal(ours(x), ref(x))


# ====================================================================== rotary

ROPE_CASES = {
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    max_position_embeddings=4096),
    "llama3": dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        max_position_embeddings=16384,
    ),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rotary_matches_transformers(case: str) -> None:
    heads, kv_heads, head_dim = 4, 2, 64
    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, **ROPE_CASES[case])
    theta, scaling = rope_params(cfg)
    if case == "default":
        assert scaling is None and theta == 10000.0
    else:
        assert scaling is not None and scaling["rope_type"] == "llama3"
    max_pos = cfg.max_position_embeddings
    ours = RotaryEmbedding(head_dim, max_pos, theta, scaling)
    ref = hf_llama.LlamaRotaryEmbedding(cfg)
    if case == "llama3":
        # the test must exercise all three llama3 bands: scaled, smoothed and kept frequencies
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        wavelen = 2 * math.pi / inv
        assert (wavelen > 8192).any() and (wavelen < 8192 / 4).any()
        assert ((wavelen >= 8192 / 4) & (wavelen <= 8192)).any()
        assert not torch.allclose(ref.inv_freq, inv)

    g = gen(7)
    T = 40
    positions = torch.cat([torch.tensor([0, 1, 2, max_pos - 1]),
                           torch.randint(0, max_pos, (T - 4,), generator=g)])
    q = torch.randn(T, heads, head_dim, generator=g)
    k = torch.randn(T, kv_heads, head_dim, generator=g)
    q_ours, k_ours = ours(positions, q.clone(), k.clone())

    cos, sin = ref(q, positions.unsqueeze(0))  # [1, T, d]
    q_ref, k_ref = hf_llama.apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin, unsqueeze_dim=1
    )  # [1, heads, T, d]
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    # position 0 is the identity, other positions are not
    torch.testing.assert_close(q_ours[0], q[0])
    assert not torch.allclose(q_ours[1], q[1])


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_matches_transformers_on_each_side(partial: float) -> None:
    """Phi-3's LongRoPE: positions below the original context rotate as transformers does
    for a sequence within it (the short factors), positions from it on as transformers does
    for a longer one (the long factors), both scaled by the attention factor; with a partial
    rotary factor only the leading dimensions rotate."""
    from transformers import Phi3Config
    from transformers.models.phi3 import modeling_phi3 as hf_phi3

    from srt.model_config import rotary_dim

    heads, head_dim, original = 4, 32, 256
    rot = int(head_dim * partial)
    cfg = Phi3Config(hidden_size=heads * head_dim, num_attention_heads=heads,
                     num_key_value_heads=2, max_position_embeddings=4 * original,
                     original_max_position_embeddings=original, partial_rotary_factor=partial,
                     rope_scaling={"type": "longrope",
                                   "short_factor": [1.0 + 0.1 * i for i in range(rot // 2)],
                                   "long_factor": [3.0 + 0.7 * i for i in range(rot // 2)]})
    theta, scaling = rope_params(cfg)
    ours = RotaryEmbedding(head_dim, 4 * original, theta, scaling, rotary_dim(cfg, head_dim))
    ref = hf_phi3.Phi3RotaryEmbedding(cfg)
    g = gen(8)
    for positions in (torch.arange(0, original, 7), torch.arange(original, 4 * original, 29)):
        q = torch.randn(len(positions), heads, head_dim, generator=g)
        k = torch.randn(len(positions), 2, head_dim, generator=g)
        q_ours, k_ours = ours(positions, q.clone(), k.clone())
        # transformers picks the factors by the sequence's length: its last position + 1
        cos, sin = ref(q, positions.unsqueeze(0))
        q_ref, k_ref = hf_phi3.apply_rotary_pos_emb(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin,
            unsqueeze_dim=1)
        torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert ref.attention_scaling > 1.0


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError):
        RotaryEmbedding(16, 32, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RotaryEmbedding(16, 32, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_rotary_caches_are_shared_by_equal_settings() -> None:
    """Layers of equal rotary settings hold one cos / sin cache (a cache a layer cost Qwen3-MoE
    2 GB of the KV pool); other settings get their own."""
    a = RotaryEmbedding(16, 64, 10000.0)
    b = RotaryEmbedding(16, 64, 10000.0)
    assert a.cos_cache.data_ptr() == b.cos_cache.data_ptr()
    assert a.sin_cache.data_ptr() == b.sin_cache.data_ptr()
    for other in (RotaryEmbedding(16, 64, 500000.0), RotaryEmbedding(16, 64, 10000.0,
                                                                     interleaved=True),
                  RotaryEmbedding(16, 64, 10000.0, {"rope_type": "linear", "factor": 2.0})):
        assert other.cos_cache.data_ptr() != a.cos_cache.data_ptr()
        assert not torch.equal(other.cos_cache, a.cos_cache)


def test_yarn_equals_transformers() -> None:
    """YaRN's inverse frequencies and cos / sin factor (DeepSeek's mscale / mscale_all_dim)
    equal transformers' for DeepSeek-V2's parameters."""
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from srt.layers.rotary import _yarn

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 0.707}
    cfg = DeepseekV2Config(qk_rope_head_dim=64, head_dim=64, max_position_embeddings=163840,
                           rope_parameters=dict(rope))
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    inv, factor = _yarn(64, 10000.0, rope, 163840)
    torch.testing.assert_close(inv, want_inv.float())
    assert factor == pytest.approx(want_factor) and factor != 1.0


# ====================================================================== attention backend


@dataclass
class AttnCase:
    fb: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor  # [new tokens, heads, d]
    k: torch.Tensor  # [new tokens, kv_heads, d]
    v: torch.Tensor
    ctx_k: list[torch.Tensor]  # per request [seq, kv_heads, d] (prefix + new)
    ctx_v: list[torch.Tensor]
    pool: TokenToKVPool


def build_attn_case(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
                    seed: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                    pool_size: int = 96, layer_id: int = 1) -> AttnCase:
    g = gen(seed)
    bs = len(prefix_lens)
    pool = TokenToKVPool(pool_size, 2, kv_heads, head_dim, torch.float32, "cpu")
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(float("nan"))  # poison: reading a slot nobody wrote shows up as NaN
    req_pool = ReqToTokenPool(10, 64, "cpu")
    # shuffled slots and rows, as after a while of serving
    perm = torch.randperm(pool_size, generator=g)
    rows = torch.randperm(10, generator=g)[:bs]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    assert sum(seq_lens) <= pool_size
    used = perm[: sum(seq_lens)]
    # stale entries of earlier occupants beyond each row's length (all written slots)
    req_pool.req_to_token.copy_(
        used[torch.randint(0, len(used), req_pool.req_to_token.shape, generator=g)].int()
    )
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    off = 0
    ctx_k, ctx_v, new_slots = [], [], []
    for i in range(bs):
        slots = used[off: off + seq_lens[i]]
        off += seq_lens[i]
        req_pool.req_to_token[rows[i], : seq_lens[i]] = slots.int()
        kk = torch.randn(seq_lens[i], kv_heads, head_dim, generator=g)
        vv = torch.randn(seq_lens[i], kv_heads, head_dim, generator=g)
        pre = prefix_lens[i]
        k_buf[slots[:pre]] = kk[:pre]  # the cached prefix, written by earlier steps
        v_buf[slots[:pre]] = vv[:pre]
        ctx_k.append(kk)
        ctx_v.append(vv)
        new_slots.append(slots[pre:])
    k = torch.cat([kk[p:] for kk, p in zip(ctx_k, prefix_lens)])
    v = torch.cat([vv[p:] for vv, p in zip(ctx_v, prefix_lens)])
    q = torch.randn(k.shape[0], heads, head_dim, generator=g)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(k.shape[0], dtype=torch.int64),
        positions=positions,
        out_cache_loc=torch.cat(new_slots),
        req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
        attn_backend=TorchAttnBackend(),
    )
    layer = RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, layer_id)
    return AttnCase(fb, layer, q, k, v, ctx_k, ctx_v, pool)


def reference_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, pre: int,
                        scale: float) -> torch.Tensor:
    """q: [ext, H, d] at positions pre..; ctx: [seq, KH, d]. Plain float64 causal softmax."""
    ext, heads, _ = q.shape
    seq, kv_heads, _ = ctx_k.shape
    group = heads // kv_heads
    out = torch.empty(ext, heads, q.shape[2], dtype=torch.float64)
    for h in range(heads):
        kh = h // group
        scores = q[:, h].double() @ ctx_k[:, kh].double().T * scale  # [ext, seq]
        allowed = torch.arange(seq)[None, :] <= (pre + torch.arange(ext))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = scores.softmax(-1) @ ctx_v[:, kh].double()
    return out


def run_attention(case: AttnCase) -> torch.Tensor:
    fb = case.fb
    fb.attn_backend.init_forward_metadata(fb)
    heads, d = case.layer.num_heads, case.layer.head_dim
    with forward_context(fb):
        out = case.layer(case.q.reshape(-1, heads * d), case.k.reshape(-1, case.k.shape[1] * d),
                         case.v.reshape(-1, case.v.shape[1] * d))
    return out.view(-1, heads, d)


def check_attention(case: AttnCase, out: torch.Tensor, before: list[torch.Tensor]) -> None:
    fb = case.fb
    start = 0
    for i in range(fb.batch_size):
        pre, ext = fb.prefix_lens_cpu[i], fb.extend_lens_cpu[i]
        want = reference_attention(case.q[start: start + ext], case.ctx_k[i], case.ctx_v[i], pre,
                                   case.layer.scaling)
        got = out[start: start + ext]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        start += ext
    # K/V written exactly at out_cache_loc of this layer; nothing else in the pool changed
    k_buf, v_buf = case.pool.get_kv_buffer(case.layer.layer_id)
    assert torch.equal(k_buf[fb.out_cache_loc], case.k)
    assert torch.equal(v_buf[fb.out_cache_loc], case.v)
    touched = torch.zeros(k_buf.shape[0], dtype=torch.bool)
    touched[fb.out_cache_loc] = True
    after = case.pool.k_buffer + case.pool.v_buffer
    for j, (b0, b1) in enumerate(zip(before, after)):
        layer = j % len(case.pool.k_buffer)
        keep = ~touched if layer == case.layer.layer_id else torch.ones_like(touched)
        assert torch.equal(b0[keep].isnan(), b1[keep].isnan())
        assert torch.equal(b0[keep].nan_to_num(), b1[keep].nan_to_num())


@pytest.mark.parametrize(
    "mode,prefix_lens,extend_lens",
    [
        (ForwardMode.EXTEND, [0, 6, 3, 9], [5, 3, 1, 7]),
        (ForwardMode.EXTEND, [11], [4]),
        (ForwardMode.PREFILL, [0, 0, 0], [1, 8, 3]),
    ],
)
def test_torch_backend_extend_matches_reference(mode: ForwardMode, prefix_lens: list[int],
                                                extend_lens: list[int]) -> None:
    case = build_attn_case(mode, prefix_lens, extend_lens, seed=sum(extend_lens))
    before = [b.clone() for b in case.pool.k_buffer + case.pool.v_buffer]
    out = run_attention(case)
    assert out.shape == case.q.shape
    check_attention(case, out, before)


@pytest.mark.parametrize("seq_lens", [[1, 7, 3, 12, 5], [9], [4, 4]])
def test_torch_backend_decode_matches_reference(seq_lens: list[int]) -> None:
    prefix = [s - 1 for s in seq_lens]
    case = build_attn_case(ForwardMode.DECODE, prefix, [1] * len(seq_lens), seed=len(seq_lens))
    before = [b.clone() for b in case.pool.k_buffer + case.pool.v_buffer]
    out = run_attention(case)
    assert out.shape == case.q.shape
    check_attention(case, out, before)


def test_attention_outside_forward_context_raises() -> None:
    layer = RadixAttention(2, 4, 0.5, 2, 0)
    with pytest.raises(RuntimeError):
        layer(torch.randn(1, 8), torch.randn(1, 8), torch.randn(1, 8))


# ====================================================================== tiny Llama end to end


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    from transformers import LlamaForCausalLM as HFLlama

    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = HFLlama(cfg).float().eval()
    g = gen(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)  # not ones: loading is checked
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def runner(tiny_llama):
    from srt.model_process.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    path, _ = tiny_llama
    args = ServerArgs(model_path=path, max_total_tokens=256, random_seed=0)
    config = ModelConfig.load(path)
    r = ModelRunner(args, config, 0)
    assert r.device.type == "cpu" and r.dtype == torch.float32
    assert r.max_total_num_tokens == 256
    return r


class Seq:
    """One request's row and slots in the runner's pools (what the KV manager does, by hand)."""

    def __init__(self, runner, ids: list[int]) -> None:
        self.runner = runner
        self.ids = list(ids)
        self.row = runner.req_to_token_pool.alloc()
        assert self.row is not None
        self.kv_len = 0  # tokens whose KV is in the pool

    def table(self) -> torch.Tensor:
        return self.runner.req_to_token_pool.req_to_token


def run_extend(runner, seqs: list[Seq], prefixes: list[torch.Tensor] | None = None,
               prompt_logprobs=None) -> torch.Tensor:
    """Fill every sequence's uncomputed tokens (after an optional shared prefix of slots)."""
    prefixes = prefixes or [torch.empty(0, dtype=torch.int64)] * len(seqs)
    ids, positions, locs, pre_lens, ext_lens = [], [], [], [], []
    for s, pre_slots in zip(seqs, prefixes):
        pre = len(pre_slots)
        if pre:
            s.table()[s.row, :pre] = pre_slots.int()
        ext = len(s.ids) - pre
        slots = runner.token_to_kv_pool.alloc(ext)
        s.table()[s.row, pre: pre + ext] = slots.int()
        ids += s.ids[pre:]
        positions += list(range(pre, pre + ext))
        locs.append(slots)
        pre_lens.append(pre)
        ext_lens.append(ext)
        s.kv_len = len(s.ids)
    seq_lens = [p + e for p, e in zip(pre_lens, ext_lens)]
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND if any(pre_lens) else ForwardMode.PREFILL,
        batch_size=len(seqs),
        input_ids=torch.tensor(ids), positions=torch.tensor(positions),
        out_cache_loc=torch.cat(locs),
        req_pool_indices=torch.tensor([s.row for s in seqs]),
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
        prefix_lens_cpu=pre_lens, extend_lens_cpu=ext_lens,
        req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool,
        attn_backend=runner.attn_backend, prompt_logprobs=prompt_logprobs,
    )
    return runner.forward(fb)


def run_decode(runner, seqs: list[Seq], next_ids: list[int]) -> torch.Tensor:
    slots = runner.token_to_kv_pool.alloc(len(seqs))
    positions = []
    for s, tok, slot in zip(seqs, next_ids, slots.tolist()):
        s.ids.append(tok)
        pos = len(s.ids) - 1
        s.table()[s.row, pos] = slot
        positions.append(pos)
        s.kv_len = len(s.ids)
    seq_lens = [p + 1 for p in positions]
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(seqs),
        input_ids=torch.tensor(next_ids), positions=torch.tensor(positions),
        out_cache_loc=slots, req_pool_indices=torch.tensor([s.row for s in seqs]),
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
        prefix_lens_cpu=positions, extend_lens_cpu=[1] * len(seqs),
        req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool,
        attn_backend=runner.attn_backend,
    )
    return runner.forward(fb)


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


PROMPT = [5, 17, 99, 3, 64, 42, 8, 120, 77, 31, 1]


def test_tiny_llama_prefill_and_greedy_decode_match_transformers(tiny_llama, runner) -> None:
    _, hf = tiny_llama
    seq = Seq(runner, PROMPT)
    logits = run_extend(runner, [seq])
    assert logits.shape == (1, 128) and logits.dtype == torch.float32
    want = hf_last_logits(hf, PROMPT)
    assert want.std() > 0.1  # logits far from flat: greedy choices are meaningful
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)

    ours = []
    for _ in range(8):
        tok = int(logits[0].argmax())
        ours.append(tok)
        if len(ours) == 8:
            break
        logits = run_decode(runner, [seq], [tok])
        torch.testing.assert_close(logits[0], hf_last_logits(hf, seq.ids), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out[0, len(PROMPT):].tolist() == ours


def test_tiny_llama_ragged_batch_and_shared_prefix_match_transformers(tiny_llama, runner) -> None:
    _, hf = tiny_llama
    a = Seq(runner, [9, 8, 7, 6, 5, 4, 3, 2, 11])
    b = Seq(runner, [100, 101, 102])
    logits = run_extend(runner, [a, b])
    torch.testing.assert_close(logits[0], hf_last_logits(hf, a.ids), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf, b.ids), rtol=1e-4, atol=1e-4)
    # batched decode of ragged lengths
    nxt = logits.argmax(-1).tolist()
    logits = run_decode(runner, [a, b], nxt)
    torch.testing.assert_close(logits[0], hf_last_logits(hf, a.ids), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf, b.ids), rtol=1e-4, atol=1e-4)
    # EXTEND: c reuses a's first 6 KV slots (a radix-cache hit), d has no prefix
    table = runner.req_to_token_pool.req_to_token
    shared = table[a.row, :6].long().clone()
    c = Seq(runner, a.ids[:6] + [50, 51, 52, 53])
    d = Seq(runner, [60, 61, 62, 63, 64])
    logits = run_extend(runner, [c, d], [shared, torch.empty(0, dtype=torch.int64)])
    torch.testing.assert_close(logits[0], hf_last_logits(hf, c.ids), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf, d.ids), rtol=1e-4, atol=1e-4)


def test_tiny_llama_prompt_logprobs_match_transformers(tiny_llama, runner) -> None:
    """The logits processor's prompt rows (EXTEND with a cached prefix, two requests, one of which
    asks nothing) equal transformers' log_softmax at the same positions."""
    from srt.layers.logprobs import PromptLogprobRequest, row_width

    _, hf = tiny_llama
    a = Seq(runner, [3, 9, 27, 81, 15, 45, 7, 21, 63])
    run_extend(runner, [a])
    shared = runner.req_to_token_pool.req_to_token[a.row, :2].long().clone()
    b = Seq(runner, a.ids[:2] + [11, 22, 33, 44, 55, 66])
    c = Seq(runner, [100, 90, 80, 70])
    # b asks for tokens 3.. (positions 2.. predict them), c for nothing
    rows = torch.tensor([p - 1 - 2 for p in range(3, 8)])
    k = 4
    out = torch.full((5, row_width(k)), float("nan"), dtype=torch.float64)
    req = PromptLogprobRequest(rows, torch.tensor(b.ids[3:8]), k, out)
    logits = run_extend(runner, [b, c], [shared, torch.empty(0, dtype=torch.int64)], req)
    torch.testing.assert_close(logits[0], hf_last_logits(hf, b.ids), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([b.ids])).logits[0].float(), dim=-1)
    for j, p in enumerate(range(3, 8)):
        want = ref[p - 1]
        assert out[j, 0].item() == pytest.approx(want[b.ids[p]].item(), abs=1e-4)
        values, ids = want.topk(k)
        torch.testing.assert_close(out[j, 1 : 1 + k].float(), values, rtol=0, atol=1e-4)
        assert out[j, 1 + k :].long().tolist() == ids.tolist()
