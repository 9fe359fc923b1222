"""vLLM's cost of constrained decoding on the workload of `bench_constrained.py` part 1, the
anchor for srt's figure: run in vLLM's environment on the GPU machine (the peer kit), never
imported by srt.

    env $VLLM_ENV python3 benchmarks/vllm_constrained.py --tokenizer-dir .whlgr/tok --out F.json

SmolLM2-135M's shape with random bf16 weights (`load_format="dummy"`) and SmolLM2's tokenizer
from `--tokenizer-dir` (tokenizer.json and tokenizer_config.json). Per batch size, `--output-len`
tokens per request from the same prompt, greedy: free (ignore_eos) and under the regex
`[a-z ,.]+` (vLLM's structured outputs, its default backend; min_tokens = max_tokens so every
request writes exactly that many). Time per output token is (time of the batch - time of the
same batch with one output token) / (output_len - 1), the median over `--runs`: the same
formula as srt's script, so the two overheads (regex / free) compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

FREE_REGEX = r"[a-z ,.]+"  # as in bench_constrained.py
PROMPT = "Write a customer record as JSON:"
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
               rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)


def _model_dir(tokenizer_dir: str) -> str:
    import transformers

    d = tempfile.mkdtemp(prefix="vllm-constrained-")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    cfg = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   **SMOLLM2)
    cfg.save_pretrained(d)
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    t0 = time.time()
    llm = LLM(model=_model_dir(a.tokenizer_dir), load_format="dummy", dtype="bfloat16",
              max_model_len=4096, gpu_memory_utilization=0.5, seed=0)
    out: dict = {"engine": "vllm " + __import__("vllm").__version__, "shape": "smollm2-135m",
                 "startup_s": round(time.time() - t0, 1), "rows": []}

    def batch_s(n: int, tokens: int, regex: bool) -> float:
        kw: dict = dict(temperature=0.0, max_tokens=tokens)
        if regex:
            kw.update(structured_outputs=StructuredOutputsParams(regex=FREE_REGEX),
                      min_tokens=tokens)
        else:
            kw.update(ignore_eos=True)
        t = time.perf_counter()
        res = llm.generate([PROMPT] * n, [SamplingParams(**kw) for _ in range(n)], use_tqdm=False)
        dt = time.perf_counter() - t
        got = [len(r.outputs[0].token_ids) for r in res]
        assert all(g == tokens for g in got), got
        return dt

    def per_token(n: int, regex: bool) -> float:
        batch_s(n, a.output_len, regex)  # warm-up (and the pattern's compile)
        runs = []
        for _ in range(a.runs):
            one = batch_s(n, 1, regex)
            runs.append((batch_s(n, a.output_len, regex) - one) / (a.output_len - 1))
        return statistics.median(runs)

    for bs in a.batch_sizes:
        free, regex = per_token(bs, False), per_token(bs, True)
        row = {"batch": bs, "free_ms_per_tok": round(free * 1e3, 4),
               "regex_ms_per_tok": round(regex * 1e3, 4), "regex_overhead": round(regex / free, 3)}
        out["rows"].append(row)
        print(f"measured {row}", flush=True)
    print(json.dumps(out), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
