"""What arrives from the router, as the model process takes it in: new requests and controls."""

from __future__ import annotations

from typing import Any

from srt.lora.adapter import LoraError
from srt.managers.io_struct import (FlushCacheOut, FlushCacheReq, GetStatsReq, LoadLoraReq,
                                    LoraOut, StatsOut, TokenizedGenerateReq, UnloadLoraReq)
from srt.model_config import ModelConfig
from srt.model_process.image_pads import ReqImage
from srt.model_process.kv import KVManager
from srt.model_process.req import Req
from srt.sampling_params import SamplingParams


def new_req(r: TokenizedGenerateReq, arrival: int, config: ModelConfig) -> Req:
    """The model process's request for a tokenized one (its image's pad ids in the prompt)."""
    params = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in r.sampling_params.items()})
    ids, image = list(r.input_ids), None
    if r.image is not None:
        # The HTTP process checked that the prompt holds the image token exactly once.
        ids, image = ReqImage.expand_prompt(ids, r.image, config.image_token_id,
                                            config.image_tokens, config.vocab_size)
    return Req(r.rid, ids, params, r.stream, r.group, arrival=arrival, logprob=r.logprob,
               image=image, lora_id=r.lora_id)


def flush_cache(c: FlushCacheReq, kv: KVManager, running: int, waiting: int) -> FlushCacheOut:
    """Empty the radix cache, only while no request runs or waits."""
    if running or waiting:
        return FlushCacheOut(c.rid, False, f"cache not flushed: {running} running and "
                             f"{waiting} waiting requests")
    kv.tree.reset()
    return FlushCacheOut(c.rid, True, "cache flushed")


def handle_control(c: Any, p: Any) -> Any:
    """The answer to a control message; `p` is the model process's loop (its kv, runner,
    waiting and running requests, stats)."""
    if isinstance(c, FlushCacheReq):
        return flush_cache(c, p.kv, len(p.running), len(p.waiting))
    if isinstance(c, GetStatsReq):
        return StatsOut(c.rid, p.stats())
    if isinstance(c, LoadLoraReq):
        if p.runner.lora is None:
            return LoraOut(c.rid, False, "this server was started without --enable-lora")
        try:
            adapter = p.runner.lora.load(c.lora_id, c.name, c.path)
        except LoraError as e:
            return LoraOut(c.rid, False, str(e))
        return LoraOut(c.rid, True, f"loaded LoRA adapter {c.name!r} (rank {adapter.rank}, "
                       f"{', '.join(adapter.targets)})")
    if isinstance(c, UnloadLoraReq):
        users = sum(r.lora_id == c.lora_id for r in p.waiting + p.running)
        if p.runner.lora is None or c.lora_id not in p.runner.lora.adapters:
            return LoraOut(c.rid, False, f"LoRA adapter {c.name!r} is not loaded")
        if users:
            return LoraOut(c.rid, False, f"LoRA adapter {c.name!r} has {users} request(s) "
                           "in flight")
        p.runner.lora.unload(c.lora_id)
        p.kv.tree.drop_namespace(c.lora_id)  # its cached prefixes: no later request reads them
        return LoraOut(c.rid, True, f"unloaded LoRA adapter {c.name!r}")
    raise ValueError(f"unknown control message {type(c).__name__}")
