"""The request bodies of /generate, /v1/* and /abort_request as pydantic models, for the OpenAPI
schema only.

The handlers keep reading the raw body and validating it themselves (their 400s name the field
in the envelope), so these models describe the API without changing it: `describe` attaches
them to the routes' OpenAPI request bodies, and every operation documents the error envelope.
Constraints here are the ones the handlers enforce.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel



TopCount = Annotated[int, Field(ge=0, le=20)]
TokenId = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsBody(_Strict):
    max_new_tokens: int | None = Field(None, ge=0, description="Tokens to generate (128).")
    min_new_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, description="0: greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1: off; 0 is refused.")
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    stop: Union[str, list[str], None] = None
    stop_regex: Union[str, list[str], None] = Field(
        None, description="Regexes; the output stops at the first match (trimmed like stop).")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = Field(None, ge=1, le=128)
    seed: int | None = None
    sampling_seed: int | None = Field(None, description="SGLang's name of seed.")
    stream_interval: int | None = Field(None, ge=1, description="Tokens per streamed chunk.")
    regex: str | None = None
    json_schema: Union[dict[str, Any], str, None] = None


class _GenerateFields(_Strict):
    model: str | None = Field(None, description="null, 'default' or the served model.")
    sampling_params: Union[SamplingParamsBody, list[SamplingParamsBody], None] = None
    stream: bool = False  # null is refused, unlike the other optional fields
    rid: Union[str, list[str], None] = None
    return_logprob: Union[bool, list[bool], None] = None
    logprob_start_len: Union[int, list[int], None] = None
    top_logprobs_num: Union[TopCount, list[TopCount], None] = None
    return_text_in_logprobs: Union[bool, list[bool], None] = None


class GenerateText(_GenerateFields):
    text: Union[str, list[str]] = Field(description="A prompt, or a batch of prompts.")


class GenerateIds(_GenerateFields):
    input_ids: Union[list[TokenId], list[list[TokenId]]] = Field(
        description="A prompt's token ids, or a batch of them.")


class GenerateBody(RootModel[Union[GenerateText, GenerateIds]]):
    """Exactly one of text and input_ids."""


class _OpenAICommon(_Strict):
    model: str = Field(description="The served model name, or 'default'.")
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    rid: str | None = None
    # SGLang's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: Union[str, list[str], None] = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: Union[dict[str, Any], str, None] = None


class CompletionBody(_OpenAICommon):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]


class ChatCompletionBody(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeBody(_Strict):
    model: str | None = None
    prompt: Union[str, list[str], None] = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: Union[list[TokenId], list[list[TokenId]]]
    skip_special_tokens: bool | None = None


class EmbeddingsBody(_Strict):
    model: str
    input: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class EncodeBody(_Strict):
    text: Union[str, list[str], None] = None
    input_ids: Union[list[TokenId], list[list[TokenId]], None] = None
    rid: str | None = None


class AbortBody(BaseModel):
    rid: str = Field(min_length=1)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(BaseModel):
    error: ErrorDetail


REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/generate"): GenerateBody,
    ("POST", "/v1/completions"): CompletionBody,
    ("POST", "/v1/chat/completions"): ChatCompletionBody,
    ("POST", "/abort_request"): AbortBody,
    ("POST", "/tokenize"): TokenizeBody,
    ("POST", "/detokenize"): DetokenizeBody,
    ("POST", "/v1/embeddings"): EmbeddingsBody,
    ("POST", "/encode"): EncodeBody,
}


def describe(app: Any) -> None:
    """Make `app.openapi()` describe the request bodies and the error envelope."""
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models = [*REQUEST_BODIES.values(), ErrorEnvelope]
        _, defs = models_json_schema([(m, "validation") for m in models],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(
            defs.get("$defs", {}))
        error = {"description": "Error", "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}}
        for path, item in schema.get("paths", {}).items():
            for method, op in item.items():
                model = REQUEST_BODIES.get((method.upper(), path))
                if model is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
                op.setdefault("responses", {})["default"] = error
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
