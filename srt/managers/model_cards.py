"""The models a server answers for, as OpenAI's /v1/models lists them: the served model and each
LoRA adapter loaded on it (its `parent` the served model), and which of them a request's `model`
field names."""

from __future__ import annotations

from typing import Any

from srt.managers.request_types import RequestError


class ModelCards:
    def __init__(self, served_model_name: str, tm: Any) -> None:
        """`tm`: the TokenizerManager (its `loras`, the adapter table, None when LoRA is off;
        its `limits`)."""
        self.model = served_model_name
        self.tm = tm

    def models(self) -> dict[str, Any]:
        """The served model, then each ready LoRA adapter."""
        loras = self.tm.loras.ready() if self.tm.loras is not None else []
        return {"object": "list", "data": [self.model_card()] + [
            {"id": r.name, "object": "model", "created": 0, "owned_by": "srt", "root": r.path,
             "parent": self.model, "max_model_len": self.tm.limits.context_length}
            for r in loras]}

    def model_card(self, model_id: str | None = None) -> dict[str, Any]:
        """The entry of /v1/models for `model_id` (None: the served model); another id is a 404
        (RequestError)."""
        # A path's empty segments are dropped (srt/http/auth.py): "/a/b" arrives as "a/b".
        wanted = None if model_id is None else model_id.strip("/")
        if wanted is not None and self.tm.loras is not None and wanted in self.tm.loras.refs:
            return next(m for m in self.models()["data"] if m["id"] == wanted)
        if wanted is not None and wanted != self.model.strip("/"):
            raise RequestError(f"the model {model_id!r} does not exist; this server serves "
                               f"{self.model!r}", "model", "model_not_found", status=404)
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "srt",
                "root": self.model, "max_model_len": self.tm.limits.context_length}

    def adapter_of(self, model: str) -> str | None:
        """The LoRA adapter a `model` field names: `adapter` or `served-name:adapter` (None:
        the base model; a 404 RequestError for a name that is neither)."""
        if model in (self.model, "default"):
            return None
        loras = self.tm.loras
        if loras is not None:
            bare = model.partition(":")[2] if model.startswith(self.model + ":") else None
            for name in (model, bare):
                if name and name in loras.refs:
                    return name
        raise RequestError(f"the model {model!r} does not exist; this server serves "
                           f"{self.model!r}" + (" and its LoRA adapters" if loras else ""),
                           "model", "model_not_found", status=404)
