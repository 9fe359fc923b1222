"""srt: an LLM serving runtime. `srt.Engine` runs it in-process; `python -m srt.server` over HTTP."""

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # Lazy: `import srt` stays cheap for the processes that never use the Engine.
    if name == "Engine":
        from srt.engine import Engine

        return Engine
    raise AttributeError(f"module 'srt' has no attribute {name!r}")
