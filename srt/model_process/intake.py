"""What arrives from the router, as the model process takes it in: new requests and controls."""

from __future__ import annotations

from srt.managers.io_struct import FlushCacheOut, FlushCacheReq, TokenizedGenerateReq
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
               image=image)


def flush_cache(c: FlushCacheReq, kv: KVManager, running: int, waiting: int) -> FlushCacheOut:
    """Empty the radix cache, only while no request runs or waits."""
    if running or waiting:
        return FlushCacheOut(c.rid, False, f"cache not flushed: {running} running and "
                             f"{waiting} waiting requests")
    kv.tree.reset()
    return FlushCacheOut(c.rid, True, "cache flushed")
