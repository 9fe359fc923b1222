"""LLaVA served from a small random checkpoint (transformers' LlavaForConditionalGeneration
with a tiny CLIP vision tower and the SmolLM2 tokenizer plus an `<image>` token) in float32 on
the CPU, against transformers as the oracle:

- greedy tokens with images equal transformers' and prompt/output logprobs agree within 1e-4
  (image positions included: the logprob of each pad id under transformers' logits);
- the same image twice hits the radix cache for the image's whole span and gives the same
  output; different images give different outputs; a cache hit that covers only part of an
  image span (forced with logprob_start_len) computes the rest of the image correctly;
- bad images (undecodable, too many bytes or pixels, a path or URL where none is allowed, a
  misplaced image token) are 400s naming the field, and the server keeps serving;
- a local path under --allowed-local-media-path and an http URL with --allow-image-urls (a
  server on 127.0.0.1) give the same answer as the same image in base64 (this server runs at
  --tp-size 2 and is checked against transformers too);
- /v1/chat/completions with an image_url data URI through the official openai client;
- a GPTQ checkpoint (language model in int4, act order) equals transformers holding its
  dequantized weights.
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import requests

from tests.conftest import ServerProcess
from tests.random_models import IMAGE_TOKEN, save_random_llava

IMAGE_SIZE = 56  # 4 x 4 patches of 14: an image fills 16 positions
IMAGE_POSITIONS = (IMAGE_SIZE // 14) ** 2
NEW_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
TOL = 1e-4
MAX_BYTES = 100_000
MAX_PIXELS = 1_000_000
PROMPTS = [
    f"{IMAGE_TOKEN}\nWhat is in the picture?",
    f"Describe {IMAGE_TOKEN} in a few words.",
    f"A photo: {IMAGE_TOKEN}",
    f"Question: what colour dominates here {IMAGE_TOKEN}? Answer:",
]


def png(seed: int, width: int, height: int, mode: str = "RGB") -> bytes:
    """A random-noise image with a smooth colour gradient, as PNG bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) * 127 / (width + height)], -1)
    a = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(a)
    if mode == "RGBA":
        alpha = (rng.random((height, width)) * 255).astype(np.uint8)
        img = Image.fromarray(np.dstack([a, alpha]), "RGBA")
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


# Different sizes and aspect ratios (resize + crop differ), one with transparency.
IMAGES = [png(0, 70, 40), png(1, 48, 90), png(2, 56, 56), png(3, 100, 64, "RGBA")]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any, smollm2_dir: str) -> str:
    return save_random_llava(str(tmp_path_factory.mktemp("llava")), smollm2_dir,
                             image_size=IMAGE_SIZE)


@dataclass
class Oracle:
    """transformers' LLaVA on the same checkpoint."""

    model: Any
    processor: Any
    tokenizer: Any
    image_token_id: int

    def expanded(self, ids: list[int]) -> list[int]:
        """The prompt as transformers takes it: the image token once per image position."""
        i = ids.index(self.image_token_id)
        return ids[:i] + [self.image_token_id] * IMAGE_POSITIONS + ids[i + 1 :]

    def pixels(self, image: bytes) -> Any:
        from PIL import Image

        return self.processor(images=Image.open(io.BytesIO(image)),
                              return_tensors="pt")["pixel_values"]

    def run(self, ids: list[int], image: bytes, n: int) -> tuple[list[int], Any]:
        """Greedy continuation (argmax of full forwards, no eos stop) and the log_softmax of
        every position of prompt + continuation."""
        import torch

        seq, pixels = self.expanded(ids), self.pixels(image)
        start = len(seq)
        with torch.no_grad():
            for _ in range(n):
                logits = self.model(input_ids=torch.tensor([seq]), pixel_values=pixels).logits
                seq.append(int(logits[0, -1].argmax()))
            logits = self.model(input_ids=torch.tensor([seq]), pixel_values=pixels).logits
        return seq[start:], torch.log_softmax(logits[0].float(), -1)


def load_oracle(path: str) -> Oracle:
    import torch
    import transformers
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    # The Pillow backend: what our preprocessing reproduces (the torchvision one, when
    # installed, resizes slightly differently).
    proc_cls = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return Oracle(model, proc_cls.from_pretrained(path), tok,
                  tok.convert_tokens_to_ids(IMAGE_TOKEN))


@pytest.fixture(scope="module")
def oracle(model_dir: str) -> Oracle:
    return load_oracle(model_dir)


def _serve(path: str, *extra: str) -> ServerProcess:
    return ServerProcess(["--model-path", path, "--device", "cpu", "--dtype", "float32",
                          "--random-seed", "0", "--max-total-tokens", "4096",
                          "--max-image-bytes", str(MAX_BYTES),
                          "--max-image-pixels", str(MAX_PIXELS), *extra]).start()


@pytest.fixture(scope="module")
def server(model_dir: str) -> Any:
    srv = _serve(model_dir)
    yield srv
    srv.stop()


def _generate(srv: ServerProcess, body: dict[str, Any]) -> Any:
    return srv.generate({"sampling_params": GREEDY, **body})


# ---------------------------------------------------------------------- correctness


def test_greedy_and_logprobs_equal_transformers(server: ServerProcess, oracle: Oracle) -> None:
    res = _generate(server, {"text": PROMPTS, "image_data": [b64(i) for i in IMAGES],
                             "return_logprob": True, "logprob_start_len": 0})
    for prompt, image, r in zip(PROMPTS, IMAGES, res):
        _assert_equals_oracle(r, oracle, prompt, image)


def _assert_equals_oracle(r: dict[str, Any], oracle: Oracle, prompt: str, image: bytes) -> None:
    """One answer (greedy, logprobs from 0) against the oracle: output ids equal, every prompt
    and output logprob within TOL, the image token expanded into hashed pad ids."""
    vocab = oracle.model.config.text_config.vocab_size
    ids = oracle.tokenizer.encode(prompt)
    greedy, lp = oracle.run(ids, image, NEW_TOKENS)
    assert r["output_ids"] == greedy
    got = r["meta_info"]["input_token_logprobs"]
    got_ids = [t[1] for t in got]
    # The image token became the image's pad ids: the token itself, then ids < vocab.
    at = ids.index(oracle.image_token_id)
    assert r["meta_info"]["prompt_tokens"] == len(ids) - 1 + IMAGE_POSITIONS
    assert got_ids[:at] == ids[:at] and got_ids[at + IMAGE_POSITIONS:] == ids[at + 1:]
    pads = got_ids[at : at + IMAGE_POSITIONS]
    assert pads[0] == oracle.image_token_id and all(0 <= t < vocab for t in pads)
    assert len(set(pads)) > IMAGE_POSITIONS // 2  # drawn from the hash, not one repeated id
    # Every prompt position, image positions included, within TOL of transformers.
    assert got[0][0] is None
    want = [float(lp[p - 1, got_ids[p]]) for p in range(1, len(got_ids))]
    assert [t[0] for t in got[1:]] == pytest.approx(want, abs=TOL)
    out = [t[0] for t in r["meta_info"]["output_token_logprobs"]]
    n = len(got_ids)
    assert out == pytest.approx([float(lp[n - 1 + k, greedy[k]]) for k in range(NEW_TOKENS)],
                                abs=TOL)


def test_gptq_language_model_in_act_order(model_dir: str, oracle: Oracle,
                                          tmp_path: Any) -> None:
    """A GPTQ checkpoint of the LLaVA (the language model's decoder layers in int4, v1
    asymmetric, group 32, act order; the vision tower and projector in float32, as GPTQ tools
    leave them) equals transformers holding the dequantized weights."""
    import shutil

    from safetensors.torch import save_file

    from tests.e2e.test_quantization import gptq_dequantized_state, write_gptq_checkpoint

    ckpt, plain = str(tmp_path / "gptq"), str(tmp_path / "dequantized")
    write_gptq_checkpoint(model_dir, ckpt, 32, sym=False, v2=False, act_order=True,
                          select=lambda name: "language_model" in name)
    shutil.copytree(model_dir, plain)
    state = {k: t.contiguous() for k, t in gptq_dequantized_state(ckpt, v2=False).items()}
    save_file(state, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    ref = load_oracle(plain)
    ids = ref.tokenizer.encode(PROMPTS[0])
    _, lp_ref = ref.run(ids, IMAGES[0], NEW_TOKENS)
    _, lp_unquantized = oracle.run(ids, IMAGES[0], NEW_TOKENS)
    assert float((lp_ref - lp_unquantized).abs().max()) > 100 * TOL  # the check can tell
    srv = _serve(ckpt)
    try:
        assert srv.server_info()["quantization"] == "gptq (int4, group 32)"
        assert "GPTQ checkpoint (gptq): 8 linear layers load in int4, group 32" in srv.log()
        res = _generate(srv, {"text": PROMPTS[:2], "image_data": [b64(i) for i in IMAGES[:2]],
                              "return_logprob": True, "logprob_start_len": 0})
        for prompt, image, r in zip(PROMPTS, IMAGES, res):
            _assert_equals_oracle(r, ref, prompt, image)
    finally:
        srv.stop()


def test_same_image_hits_cache_for_its_whole_span(server: ServerProcess,
                                                   oracle: Oracle) -> None:
    prompt = "Once more: " + IMAGE_TOKEN + " What is it?"
    first = _generate(server, {"text": prompt, "image_data": b64(IMAGES[2])})
    # The same pixels in another encoding (a data URI) are the same image.
    again = _generate(server, {"text": prompt, "image_data": data_uri(IMAGES[2])})
    meta = again["meta_info"]
    assert again["output_ids"] == first["output_ids"]
    # All but the last prompt token (it is computed for its logits) come from the cache.
    assert meta["cached_tokens"] == meta["prompt_tokens"] - 1
    other = _generate(server, {"text": prompt, "image_data": b64(IMAGES[0])})
    assert other["output_ids"] != first["output_ids"]
    # Only the text before the image is shared: the other image's span is not matched.
    at = oracle.tokenizer.encode(prompt).index(oracle.image_token_id)
    assert other["meta_info"]["cached_tokens"] == at


@pytest.mark.parametrize("cut", [2, 9])
def test_partial_cache_hit_inside_image_span(server: ServerProcess, oracle: Oracle,
                                             cut: int) -> None:
    """A prompt whose image span is cached, asked for logprobs from inside the span: the match
    is cut there, and the step computes only the rest of the image's positions."""
    prompt = f"Partial {IMAGE_TOKEN} hits"
    ids = oracle.tokenizer.encode(prompt)
    at = ids.index(oracle.image_token_id)
    _generate(server, {"text": prompt, "image_data": b64(IMAGES[1])})  # caches the whole span
    start = at + cut
    r = _generate(server, {"text": prompt, "image_data": b64(IMAGES[1]), "return_logprob": True,
                           "logprob_start_len": start})
    # The match may reach start - 1; one covering fewer than 4 image positions (cut 2 -> 1
    # position) is cut back to the start of the span.
    assert r["meta_info"]["cached_tokens"] == (start - 1 if cut - 1 >= 4 else at)
    greedy, lp = oracle.run(ids, IMAGES[1], NEW_TOKENS)
    assert r["output_ids"] == greedy
    got = r["meta_info"]["input_token_logprobs"]
    assert [t[0] for t in got] == pytest.approx(
        [float(lp[p - 1, t[1]]) for p, t in enumerate(got, start)], abs=TOL)


# ---------------------------------------------------------------------- bad input


def _bad(srv: ServerProcess, body: dict[str, Any], code: str,
         param: str = "image_data") -> None:
    r = requests.post(srv.url + "/generate", timeout=60,
                      json={"sampling_params": GREEDY, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


def test_bad_images_are_400s_and_the_server_keeps_serving(server: ServerProcess,
                                                          tmp_path: Any) -> None:
    from PIL import Image

    prompt = PROMPTS[0]
    big_noise = png(7, 300, 300)  # noise compresses badly: > MAX_BYTES
    assert len(big_noise) > MAX_BYTES
    buf = io.BytesIO()
    Image.new("RGB", (1200, 1000), (10, 200, 30)).save(buf, "PNG")  # few bytes, many pixels
    assert len(buf.getvalue()) < MAX_BYTES
    on_disk = tmp_path / "img.png"
    on_disk.write_bytes(IMAGES[0])
    cases = [
        ({"image_data": b64(b"this is not an image at all")}, "image_not_decodable"),
        ({"image_data": "%%% not base64 %%%"}, "image_not_decodable"),
        ({"image_data": b64(IMAGES[0][: len(IMAGES[0]) // 2])}, "image_not_decodable"),
        ({"image_data": "data:image/png,rawbytes"}, "image_not_decodable"),
        ({"image_data": b64(big_noise)}, "image_too_large"),
        ({"image_data": b64(buf.getvalue())}, "image_too_many_pixels"),
        # no file or URL access unless the server was started with it
        ({"image_data": str(on_disk)}, "image_source_not_allowed"),
        ({"image_data": "file://" + str(on_disk)}, "image_source_not_allowed"),
        ({"image_data": "http://127.0.0.1:9/x.png"}, "image_source_not_allowed"),
        ({"image_data": 5}, "invalid_type"),
        ({"image_data": [b64(IMAGES[0])] * 2}, "invalid_type"),
    ]
    for body, code in cases:
        _bad(server, {"text": prompt, **body}, code)
    # the image token and image_data must come together, the token once
    _bad(server, {"text": "no image token", "image_data": b64(IMAGES[0])}, "invalid_value",
         "text")
    _bad(server, {"text": prompt + IMAGE_TOKEN, "image_data": b64(IMAGES[0])},
         "invalid_value", "text")
    _bad(server, {"text": prompt}, "invalid_value", "text")
    # still serving, and correctly
    ok = _generate(server, {"text": prompt, "image_data": b64(IMAGES[0])})
    assert len(ok["output_ids"]) == NEW_TOKENS


# ---------------------------------------------------------------------- sources


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def test_local_path_and_url_when_allowed_at_tp2(model_dir: str, oracle: Oracle,
                                               tmp_path: Any) -> None:
    """Also under --tp-size 2 (gloo): the language model sharded, the vision tower on both
    ranks."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(IMAGES[3])
    (tmp_path / "secret.png").write_bytes(IMAGES[3])
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    handler = functools.partial(_QuietHandler, directory=str(allowed))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    srv = _serve(model_dir, "--allowed-local-media-path", str(allowed), "--allow-image-urls",
                 "--tp-size", "2")
    try:
        assert srv.server_info()["tp_size"] == 2
        want = _generate(srv, {"text": PROMPTS[1], "image_data": b64(IMAGES[3])})
        greedy, _ = oracle.run(oracle.tokenizer.encode(PROMPTS[1]), IMAGES[3], NEW_TOKENS)
        assert want["output_ids"] == greedy
        url = f"http://127.0.0.1:{httpd.server_address[1]}/a.png"
        for source in (str(allowed / "a.png"), "file://" + str(allowed / "a.png"), url):
            got = _generate(srv, {"text": PROMPTS[1], "image_data": source})
            assert got["output_ids"] == want["output_ids"], source
            assert got["meta_info"]["cached_tokens"] == got["meta_info"]["prompt_tokens"] - 1
        for outside in (str(tmp_path / "secret.png"), str(allowed / ".." / "secret.png"),
                        str(allowed / "link.png")):
            _bad(srv, {"text": PROMPTS[1], "image_data": outside}, "image_source_not_allowed")
        _bad(srv, {"text": PROMPTS[1], "image_data": str(allowed / "missing.png")},
             "image_not_found")
        _bad(srv, {"text": PROMPTS[1], "image_data": url.replace("a.png", "missing.png")},
             "image_fetch_failed")
        srv.assert_kv_invariant()
    finally:
        srv.stop()
        httpd.shutdown()


# ---------------------------------------------------------------------- OpenAI chat


def test_chat_with_image_url_data_uri(server: ServerProcess, oracle: Oracle) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    question = "What is in this picture?"
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(IMAGES[1])}},
        {"type": "text", "text": question}]}]
    out = client.chat.completions.create(model="default", messages=messages, temperature=0,
                                         max_tokens=NEW_TOKENS,
                                         extra_body={"ignore_eos": True})
    # SmolLM2's template takes string contents: the image token goes where the part was.
    ids = oracle.tokenizer.apply_chat_template(
        [{"role": "user", "content": IMAGE_TOKEN + question}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    greedy, _ = oracle.run(ids, IMAGES[1], NEW_TOKENS)
    assert out.choices[0].message.content == oracle.tokenizer.decode(greedy,
                                                                     skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids) - 1 + IMAGE_POSITIONS
    assert out.usage.completion_tokens == NEW_TOKENS
    # a bad image is a 400 naming messages; two images are refused
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "data:image/png;base64,AAAA"}},
                                         {"type": "text", "text": "hi"}]}])
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "image_not_decodable"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", max_tokens=4, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_uri(IMAGES[0])}},
                {"type": "image_url", "image_url": {"url": data_uri(IMAGES[1])}}]}])
    assert e.value.body["param"] == "messages"
