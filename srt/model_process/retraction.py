"""Room for the next decode step: evict from the tree, then retract running requests."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from srt.model_process.policy import retraction_victim

if TYPE_CHECKING:
    from srt.model_process.loop import ModelProcess

logger = logging.getLogger(__name__)


def make_room(p: ModelProcess) -> None:
    """Make room for the next step's tokens (one per running request, more after a jump):
    evict, then retract. Nothing is in flight."""
    need = p.batch.mixed_rows
    free = p.kv.pool.available_size()
    if free >= need():
        return
    p.kv.tree.evict(need() - free)
    retracted = 0
    while p.kv.pool.available_size() < need() and len(p.batch) > 1:
        p.retract(retraction_victim(p.running))
        retracted += 1
        p.kv.tree.evict(max(0, need() - p.kv.pool.available_size()))
    # Last resort: the request between prefill chunks gives its KV back to the tree.
    while p.kv.pool.available_size() < need() and p.release_chunked():
        p.kv.tree.evict(max(0, need() - p.kv.pool.available_size()))
    if p.kv.pool.available_size() < need():
        raise RuntimeError("a single request does not fit the KV pool (admission is broken)")
    if retracted:
        p.ratio.after_retraction(p.running)
        p.counters.retracted += retracted
        logger.warning(
            "KV pool full: retracted %d request(s) to the waiting queue (%d running, "
            "new_token_ratio now %.3f)", retracted, len(p.running), p.ratio.value)
