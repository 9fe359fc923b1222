"""Random EAGLE / EAGLE3 draft heads in the public checkpoint layouts, and a reference of what a
head drafts, built from transformers' own Llama layers over transformers' hidden states.

No public head can be downloaded here, so a head is written from reference modules whose
state dict names are the public ones (`fc.*`, `layers.N.*` or `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d`), and the same modules compute the reference drafts."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn


def _config(target_dir: str, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(target_dir)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    return cfg


def _randomize(module: nn.Module, std: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _causal(n: int) -> torch.Tensor:
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
    return mask[None, None]


class RefEagle(nn.Module):
    """EAGLE-1/2: fc over (embedding, feature), Llama layers (the first without its input
    norm), no final norm; the target's LM head."""

    def __init__(self, cfg: Any) -> None:
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                              LlamaRotaryEmbedding)

        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(cfg)

    def features(self, embeds: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The head's output features of rows 0..n-1 (positions 0..n-1), and what the LM head
        reads (the same: no final norm)."""
        x = self.fc(torch.cat((embeds, feats), dim=-1))[None]
        pos = torch.arange(x.shape[1])[None]
        pe = self.rotary(x, pos)
        for layer in self.layers:
            x = layer(x, attention_mask=_causal(x.shape[1]), position_ids=pos,
                      position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        return x[0], x[0]


class RefEagle3(nn.Module):
    """EAGLE3: fc over three target layers' inputs, a mid layer attending over (normed
    embedding, normed feature), a final norm and its own LM head over a draft vocabulary."""

    def __init__(self, cfg: Any, draft_vocab: int, target_vocab: int, seed: int) -> None:
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = LlamaDecoderLayer(cfg, 0)
        a = self.midlayer.self_attn
        hd = cfg.head_dim
        a.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=False)
        a.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        a.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.midlayer.hidden_norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        g = torch.Generator().manual_seed(seed + 1)
        hot = torch.randperm(target_vocab, generator=g)[:draft_vocab].sort().values
        self.register_buffer("d2t", hot - torch.arange(draft_vocab))
        t2d = torch.zeros(target_vocab, dtype=torch.bool)
        t2d[hot] = True
        self.register_buffer("t2d", t2d)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def features(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """As RefEagle's; `hidden` is already H wide (the target's through `fc`)."""
        m = self.midlayer
        x = torch.cat((m.input_layernorm(embeds), m.hidden_norm(hidden)), dim=-1)[None]
        pos = torch.arange(x.shape[1])[None]
        pe = self.rotary(x, pos)
        out = m.self_attn(hidden_states=x, attention_mask=_causal(x.shape[1]), position_ids=pos,
                          position_embeddings=pe)[0][0]
        h = hidden + out
        h = h + m.mlp(m.post_attention_layernorm(h))
        return h, self.norm(h)


def save_eagle_head(path: str, target_dir: str, kind: str = "EAGLE", seed: int = 5,
                    std: float = 0.08, **overrides: Any) -> tuple[str, nn.Module]:
    """A random head for the target under `path` (config.json and model.safetensors in the
    public layout); returns the path and the reference module of the same weights."""
    torch.manual_seed(seed)
    target_cfg = _config(target_dir)
    if kind == "EAGLE":
        cfg = _config(target_dir, num_hidden_layers=1, architectures=["LlamaForCausalLM"],
                      **overrides)
        ref: nn.Module = RefEagle(cfg)
    else:
        draft_vocab = overrides.pop("draft_vocab_size", 300)
        cfg = _config(target_dir, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                      draft_vocab_size=draft_vocab, **overrides)
        ref = RefEagle3(cfg, draft_vocab, target_cfg.vocab_size, seed)
    _randomize(ref, std, seed)
    ref.eval()
    os.makedirs(path, exist_ok=True)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file(state, os.path.join(path, "model.safetensors"))
    d = cfg.to_dict()
    d.pop("_attn_implementation", None)
    d.pop("_attn_implementation_internal", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    return path, ref


@torch.no_grad()
def reference_drafts(target: Any, head: nn.Module, kind: str, context: list[int], k: int,
                     aux_layers: tuple[int, ...] = ()) -> list[int]:
    """The k greedy drafts a head proposes after `context` (its last id sampled, not yet
    computed by the target): the head's rows at positions 0..m-2 read (context[p + 1], the
    target's feature of p); each further row (draft token, the head's feature before it).
    `aux_layers`: EAGLE3's target layers, whose inputs (transformers' hidden_states[i]) make
    the feature."""
    ids = torch.tensor([context[:-1]])
    out = target.model(ids, output_hidden_states=True)
    if kind == "EAGLE":
        feats = out.last_hidden_state[0]  # after the final norm
    else:
        feats = head.fc(torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1))
    embed = target.model.embed_tokens
    tokens = torch.tensor(context[1:])
    drafts: list[int] = []
    for _ in range(k):
        feature, to_logits = head.features(embed(tokens), feats)
        if kind == "EAGLE":
            d = int(target.lm_head(to_logits[-1]).argmax())
        else:
            d = int(head.lm_head(to_logits[-1]).argmax())
            d += int(head.d2t[d])
        drafts.append(d)
        tokens = torch.cat((tokens, torch.tensor([d])))
        feats = torch.cat((feats, feature[-1:]))
    return drafts


def reference_tree(target: Any, head: nn.Module, kind: str, context: list[int], topk: int,
                   steps: int, nodes: int,
                   aux_layers: tuple[int, ...] = ()) -> tuple[set[tuple[int, ...]], float]:
    """The draft tree a head proposes after `context` with top-k `topk`, `steps` draft steps
    and `nodes` nodes, as the set of its root-to-node token paths; and the smallest relative
    gap between the scores on the two sides of any choice made (each row's k-th / k+1-th
    token, each step's k-th / k+1-th leaf, the nodes-th / nodes+1-th candidate): where it is
    tiny, float rounding may choose the other way."""
    ids = torch.tensor([context[:-1]])
    out = target.model(ids, output_hidden_states=True)
    if kind == "EAGLE":
        feats = out.last_hidden_state[0]
    else:
        feats = head.fc(torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1))
    embed = target.model.embed_tokens
    vocab = target.config.vocab_size
    gaps: list[float] = []

    def gap(sorted_scores: torch.Tensor, k: int) -> None:
        if sorted_scores.numel() > k:
            a, b = float(sorted_scores[k - 1]), float(sorted_scores[k])
            gaps.append((a - b) / max(a, 1e-30))

    def expand(path: list[int], path_feats: list[torch.Tensor]) -> tuple[Any, Any, Any]:
        tokens = torch.tensor(context[1:] + path)
        f = torch.cat([feats] + [x[None] for x in path_feats])
        feature, to_logits = head.features(embed(tokens), f)
        if kind == "EAGLE":
            probs = torch.softmax(target.lm_head(to_logits[-1])[:vocab], -1)
        else:
            probs = torch.softmax(head.lm_head(to_logits[-1]), -1)
        top = probs.sort(descending=True)
        gap(top.values, topk)
        p, idx = top.values[:topk], top.indices[:topk]
        if kind != "EAGLE":
            idx = (idx + head.d2t[idx]).clamp(max=vocab - 1)
        return idx.tolist(), p, feature[-1]

    # candidates: (score, path, path features); leaves carry the features to expand them
    ids0, p0, f0 = expand([], [])
    cands = [(float(p0[i]), [ids0[i]]) for i in range(topk)]
    leaves = [(p0[i], [ids0[i]], [f0]) for i in range(topk)]
    for j in range(1, steps):
        new = []
        for score, path, pf in leaves:
            kids, p, h = expand(path, pf)
            for t, q in zip(kids, p):
                new.append((score * q, path + [t], pf + [h]))
        cands += [(float(sc), path) for sc, path, _ in new]
        if j < steps - 1:
            order = sorted(range(len(new)), key=lambda i: -float(new[i][0]))
            gap(torch.tensor([float(new[i][0]) for i in order]), topk)
            leaves = [new[i] for i in order[:topk]]
    order = sorted(range(len(cands)), key=lambda i: (-cands[i][0], i))
    gap(torch.tensor([cands[i][0] for i in order]), nodes)
    return {tuple(cands[i][1]) for i in order[:nodes]}, min(gaps, default=1.0)


def tree_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """A tree's root-to-node token paths (nodes after their parents)."""
    paths: list[tuple[int, ...]] = []
    for t, p in zip(tokens, parents):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    return set(paths)


def peaked_pair(path: str, kind: str, n: int = 6, scale: float = 6.0) -> tuple[str, str]:
    """A random Llama target (under path/target) whose LM head rows of n ids (at 300 or
    above) are `scale` times longer, so it almost always emits one of them, which one
    depending on the whole context; and a random head (under path/head) whose tokens are
    drawn from the same ids (an EAGLE head reads the target's LM head; an EAGLE3 head's own
    rows of those ids are lengthened too). Its top-k then holds the target's token often
    enough, and often off its first choice."""
    from safetensors.torch import load_file

    from tests.random_models import save_random_llama

    target = save_random_llama(os.path.join(path, "target"))
    head, ref = save_eagle_head(os.path.join(path, "head"), target, kind)
    if kind == "EAGLE":
        ids = torch.arange(300, 300 + n)
    else:
        hot = torch.arange(ref.d2t.numel()) + ref.d2t
        draft_ids = torch.nonzero(hot >= 300).flatten()[:n]
        ids = hot[draft_ids]
        f = os.path.join(head, "model.safetensors")
        state = load_file(f)
        state["lm_head.weight"][draft_ids] *= scale
        save_file(state, f)
    files = [os.path.join(target, x) for x in os.listdir(target) if x.endswith(".safetensors")]
    for f in files:
        state = load_file(f)
        if "lm_head.weight" in state:
            state["lm_head.weight"][ids] *= scale
            save_file(state, f, metadata={"format": "pt"})
    return target, head


def save_echo_llama(path: str, **overrides: Any) -> str:
    """A random Llama whose next token is a fixed function f of its last token: every layer's
    output projections are zero and the final norm's weight is one, so its hidden state is its
    last token's normalized embedding (an EAGLE head can compute f exactly)."""
    from transformers import AutoModelForCausalLM

    from tests.random_models import save_random_llama

    save_random_llama(path, **overrides)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path)
    return path


def near_oracle_head(path: str, target_dir: str, noise: float) -> tuple[str, Any]:
    """An EAGLE head of an echo target (save_echo_llama) that drafts f(token): fc passes the
    embedding through and its layer adds nothing; `noise` (relative) on fc makes some drafts
    wrong."""
    path, ref = save_eagle_head(path, target_dir, "EAGLE")
    h = ref.fc.weight.shape[0]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        ref.fc.weight.zero_()
        ref.fc.weight[:, :h] = torch.eye(h) + noise / h**0.5 * torch.randn(h, h, generator=g)
        ref.fc.bias.zero_()
        for layer in ref.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
              os.path.join(path, "model.safetensors"))
    return path, ref
