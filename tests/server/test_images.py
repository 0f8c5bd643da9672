"""Images over real HTTP (issue 25 §1): the server's app on a tiny Qwen3.5 checkpoint with a vision
tower, driven by the official ``openai`` client and raw httpx, one engine for the module.

- An image chat request answers, and its greedy tokens are the straight-line path's
  (``jaxserve.generate`` on the same images): the server put the image where its content part is.
- The same request again hits the prefix cache past the image (``cached_tokens``) with the same
  answer; the same text with another image hits only the text before it and answers differently;
  alternating the two never crosses. The same image fetched from a URL hits what its data: URL
  left (the cache keys on content, not on the URL).
- Every bad payload is a 400 in OpenAI's format that names the part and the problem, adds nothing
  to the engine, and leaves the server healthy.
- A text-only model, and a vision model whose tokenizer has no image token, refuse images (400).
- ``jaxserve generate --image`` (a subprocess) answers what the server answers.

The tiny checkpoint's tokenizer has Qwen's four vision special tokens at the ids its config names
(``weights/tiny.py``), as real Qwen3.5 / Qwen3-VL tokenizers have them; the plain tiny tokenizer
(no vision tokens: id 506 is a text token) stands for a checkpoint whose tokenizer lacks them.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import json
import struct
import threading
import time
import zlib

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from jaxserve.engine.flags import DEFAULT_MODEL_DIR
from jaxserve import cli
from jaxserve.engine.llm import LLM, EngineArgs, build_engine, image_input, image_placeholder
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer
from server.app import create_app
from server.async_engine import AsyncEngine
from server.limits import ImageLimits
from tests.reference.bridge import run_torch
from tests.server.harness import LOGPROB_ABS, Server, assert_pools_free, wait_idle
from weights.tiny import IMAGE_TOKENS

MODEL = "tiny-vl"
N = 6
COLD = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
# The served engine's sizes (the CLI test passes the same, so its programs are already compiled).
ENGINE = dict(num_pages=128, num_slots=16, max_prefill_length=64, max_running_requests=4)
MAX_BYTES = 64 << 10  # the main server's cap on one image's bytes
# Text before the image: with the system prompt, past the first x64 boundary, so another image still
# hits that much (the text's share) and no more.
TEXT = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the forest. "
        "A small model can learn a small language.")
QUESTION = "What colour is the image?"
GREEDY = dict(temperature=0, max_tokens=N, logprobs=True, extra_body={"ignore_eos": True})


def _png(seed: int, size=(128, 128), solid: bool = False) -> bytes:
    h, w = size
    pixels = (np.full((h, w, 3), seed * 40 % 256, np.uint8) if solid else
              np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (its pixel data is a stub)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def _gif() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def messages(url: str, text: str = TEXT, question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, image_part(url),
                                         {"type": "text", "text": question}]}]


A, B = _png(1), _png(2)


class _Files:
    """A local HTTP server of images (and of the ways fetching one goes wrong)."""

    def __init__(self):
        routes = {"/a.png": (200, A), "/text.txt": (200, b"just some text"), "/big.png": (200, b"\0" * (MAX_BYTES + 1))}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/slow.png":
                    time.sleep(3)
                status, body = routes.get(self.path, (404, b"not found"))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Quiet(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # the client of /slow.png has left when it answers

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    folder = root / "qwen3_5-vl"
    run_torch("weights.tiny", "--family", "qwen3_5", "--variant", "vl", "--out", str(folder), "--seed", "5")
    run_torch("weights.tiny_tokenizer", "--out", str(root / "plain"))
    plain = Tokenizer.from_dir(root / "plain")  # the tiny tokenizer without vision tokens
    llm = LLM.from_args(EngineArgs(model=str(folder), dtype="float32", progress=False, **ENGINE))
    engine, images = llm.engine, llm.images
    # The offline answer to the first request, from the same engine before it serves (engine = the
    # straight-line path with images: tests/engine/test_vision_engine.py), then a cold cache.
    ref = llm.generate([_prompt(engine.tokenizer, images.placeholder)], COLD, images=[[A]])[0]
    engine.scheduler.cache.flush()
    engine.check_invariants()
    aeng = AsyncEngine(engine).start()
    limits = ImageLimits(max_images=3, max_image_bytes=MAX_BYTES, allow_urls=True, fetch_timeout=1.0)
    main = Server(create_app(aeng, MODEL, images=images, image_limits=limits))
    strict = Server(create_app(aeng, MODEL, images=images))  # the defaults: no remote URLs
    no_token = dataclasses.replace(images, placeholder=None, no_placeholder=image_placeholder(plain, images.vision)[1])
    untokened = Server(create_app(aeng, MODEL, images=no_token))
    # A text-only model: its image requests are refused before the engine runs anything.
    text_engine = build_engine(EngineArgs(model=str(DEFAULT_MODEL_DIR), dtype="float32", num_pages=16, num_slots=4,
                                          max_prefill_length=32, max_running_requests=2, progress=False))
    text_aeng = AsyncEngine(text_engine).start()
    text_only = Server(create_app(text_aeng, MODEL))
    files = _Files()
    (root / "a.png").write_bytes(A)
    client = openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    http_client = httpx.Client(timeout=120)
    yield type("VL", (), dict(folder=folder, root=root, engine=engine, aeng=aeng, images=images, ref=ref, url=main.url,
                              strict_url=strict.url, untokened_url=untokened.url, text_url=text_only.url,
                              files=files, client=client, http=http_client, tokenizer=engine.tokenizer))
    http_client.close()
    files.close()
    for srv in (main, strict, untokened, text_only):
        srv.close()
    aeng.stop()
    text_aeng.stop()


def _prompt(tok, placeholder: str, text: str = TEXT, question: str = QUESTION) -> list[int]:
    """The ids the server renders for ``messages``: the image's placeholder where its part is."""
    content = text + placeholder + question
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))


def _chat(vl, url: str, **kw):
    return vl.client.chat.completions.create(model=MODEL, messages=messages(url), **{**GREEDY, **kw})


def _logprobs(r) -> list[float]:
    return [t.logprob for t in r.choices[0].logprobs.content]


# ---------------------------------------------------------------------- answers and the prefix cache


def test_image_chat_equals_offline_and_repeat_hits(vl):
    ids = _prompt(vl.tokenizer, vl.images.placeholder)
    expanded, _, _ = vl.images.prepare(ids, [A])
    assert len(expanded) == len(ids) + 64 - 1  # 128x128 pixels: 8x8 soft tokens of 16x16
    first = _chat(vl, data_url(A))
    assert first.choices[0].message.content == vl.ref.text
    assert _logprobs(first) == pytest.approx(vl.ref.logprobs, abs=LOGPROB_ABS)
    assert first.usage.prompt_tokens == len(expanded) and first.usage.prompt_tokens_details.cached_tokens == 0
    again = _chat(vl, data_url(A))
    assert again.usage.prompt_tokens_details.cached_tokens == (len(expanded) - 1) // 64 * 64 > ids.index(
        IMAGE_TOKENS["image_token_id"])  # past the image
    assert again.choices[0].message.content == first.choices[0].message.content
    assert _logprobs(again) == pytest.approx(_logprobs(first), abs=LOGPROB_ABS)


def test_another_image_hits_only_the_text_before_it(vl):
    ids = _prompt(vl.tokenizer, vl.images.placeholder)
    place = ids.index(IMAGE_TOKENS["image_token_id"])
    assert place > 64  # the text before the image spans a x64 boundary
    a = _chat(vl, data_url(A))  # cached by the test before, or now
    b = _chat(vl, data_url(B))
    cached_b = b.usage.prompt_tokens_details.cached_tokens
    assert 64 <= cached_b <= place  # the text's share, nothing of the image
    assert b.usage.prompt_tokens == a.usage.prompt_tokens
    assert (b.choices[0].message.content != a.choices[0].message.content
            or max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) > 1e-3)
    # Alternating: each hits its own prompt in full and keeps its own answer.
    for url, ref in ((data_url(A), a), (data_url(B), b), (data_url(A), a)):
        r = _chat(vl, url)
        assert r.usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens - 1) // 64 * 64
        assert r.choices[0].message.content == ref.choices[0].message.content
        assert _logprobs(r) == pytest.approx(_logprobs(ref), abs=LOGPROB_ABS)


def test_streaming_jpeg_and_webp(vl):
    image = Image.open(io.BytesIO(A))
    for fmt, media in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        buf = io.BytesIO()
        image.save(buf, format=fmt)
        url = data_url(buf.getvalue(), media)
        whole = _chat(vl, url)
        chunks = list(vl.client.chat.completions.create(model=MODEL, messages=messages(url), stream=True,
                                                        stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the streamed repeat hits


def test_image_url_fetched_when_allowed_hits_its_data_url(vl):
    ref = _chat(vl, data_url(A))
    r = _chat(vl, vl.files.url + "/a.png")
    assert r.choices[0].message.content == ref.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens - 1) // 64 * 64


def test_two_images_in_one_message(vl):
    content = [image_part(data_url(A)), {"type": "text", "text": "and"}, image_part(data_url(B)),
               {"type": "text", "text": QUESTION}]
    r = vl.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **GREEDY)
    tok = vl.tokenizer
    ph = vl.images.placeholder
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": ph + "and" + ph + QUESTION}],
                                             add_generation_prompt=True))
    assert r.usage.prompt_tokens == len(ids) + 2 * 63 and r.usage.completion_tokens == N


# ---------------------------------------------------------------------- bad input


def _content(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


_TEXT = {"type": "text", "text": QUESTION}
_PH = "<|vision_start|><|image_pad|><|vision_end|>"
_URL = "messages.0.content.1.image_url.url"

# (name, server, messages, code, param, what the message must say)
BAD = [
    ("malformed base64", "main", messages("data:image/png;base64,iVBORw0KGgo$$$$"), "invalid_image_url", _URL,
     "malformed base64"),
    ("base64 cut mid-quantum", "main", messages("data:image/png;base64,AAAAA"), "invalid_image_url", _URL,
     "malformed base64"),
    ("empty image", "main", messages("data:image/png;base64,"), "invalid_image", _URL, "empty (0 bytes)"),
    ("truncated png", "main", messages(data_url(A[: len(A) // 2])), "invalid_image", _URL, "truncated"),
    ("zero-sized png", "main", messages(data_url(_png_header(0, 0))), "invalid_image", _URL, "zero size"),
    ("gigantic png", "main", messages(data_url(_png_header(9000, 8000))), "invalid_image", _URL,
     "72000000 pixels, above the"),
    ("decompression bomb", "main", messages(data_url(_png_header(30000, 30000))), "invalid_image", _URL,
     "too large to decode"),
    ("over the byte cap", "main", messages(data_url(b"\0" * (MAX_BYTES + 3))), "invalid_image", _URL,
     f"more than the {MAX_BYTES} bytes"),
    ("not an image", "main", messages(data_url(b"just some text")), "invalid_image", _URL,
     "not a PNG, JPEG or WebP image"),
    ("gif", "main", messages(data_url(_gif(), "image/gif")), "invalid_image", _URL, "GIF is not accepted"),
    ("extreme aspect ratio", "main", messages(data_url(_png(3, (1, 300), solid=True))), "invalid_image", _URL,
     "aspect ratio"),
    ("text media type", "main", messages("data:text/plain;base64,aGVsbG8="), "invalid_image_url", _URL,
     "not an image type"),
    ("data url without base64", "main", messages("data:image/png,abc"), "invalid_image_url", _URL,
     "must carry base64"),
    ("data url without a comma", "main", messages("data:image/png;base64"), "invalid_image_url", _URL,
     "needs a comma"),
    ("non-ascii base64", "main", messages("data:image/png;base64,iVBORw0KGgoé"), "invalid_image_url", _URL,
     "non-ASCII"),
    ("file url", "main", messages("file:///etc/passwd"), "invalid_image_url", _URL, "neither a data: URL"),
    ("remote url without --allow-image-urls", "strict", messages("https://example.com/cat.png"), "invalid_image_url",
     _URL, "--allow-image-urls"),
    ("remote 404", "main", messages("{files}/missing.png"), "invalid_image_url", _URL, "HTTP 404"),
    ("remote over the byte cap", "main", messages("{files}/big.png"), "invalid_image", _URL,
     f"more than the {MAX_BYTES} bytes"),
    ("remote too slow", "main", messages("{files}/slow.png"), "invalid_image_url", _URL, "timed out after 1 s"),
    ("remote not an image", "main", messages("{files}/text.txt"), "invalid_image", _URL, "not a PNG"),
    ("remote unreachable", "main", messages("http://127.0.0.1:9/a.png"), "invalid_image_url", _URL,
     "fetching it failed"),
    ("too many images", "main", _content(*[image_part(data_url(A))] * 4, _TEXT), "too_many_images", "messages",
     "4 images, more than the 3"),
    ("image_url without url", "main", _content(_TEXT, {"type": "image_url", "image_url": {}}), "invalid_value", _URL,
     "needs"),
    ("detail not a string", "main", _content(_TEXT, {"type": "image_url", "image_url": {"url": data_url(A),
                                                                                          "detail": 5}}),
     "invalid_type", "messages.0.content.1.image_url.detail", "got 5"),
    ("unknown part type", "main", _content(_TEXT, {"type": "input_audio", "input_audio": {}}),
     "unsupported_parameter", "messages.0.content.1.type", "text and image_url"),
    ("placeholder typed beside an image", "main", _content({"type": "text", "text": _PH}, image_part(data_url(A))),
     "invalid_value", "messages", "2 image placeholders for 1 images"),
    ("placeholder typed without an image", "main", [{"role": "user", "content": _PH + QUESTION}], "invalid_value",
     "messages", "1 image placeholders for 0 images"),
    ("image too big for the context", "main", messages(data_url(_png(4, (1000, 1000), solid=True))),
     "context_length_exceeded", "messages", "maximum context length is"),
    ("text-only model", "text", messages(data_url(A)), "image_input_not_supported", "messages.0.content.1",
     "no vision tower"),
    ("no image token in the tokenizer", "untokened", messages(data_url(A)), "image_input_not_supported",
     "messages.0.content.1", "no image placeholder token (its vision start token id 506 is the text token ' sh'"),
]


@pytest.mark.parametrize("name, server, msgs, code, param, says", BAD, ids=[b[0] for b in BAD])
def test_bad_image_gets_400_and_never_reaches_the_engine(vl, name, server, msgs, code, param, says):
    url = {"main": vl.url, "strict": vl.strict_url, "text": vl.text_url, "untokened": vl.untokened_url}[server]
    body = json.loads(json.dumps({"model": MODEL, "messages": msgs, "max_tokens": 2}).replace("{files}", vl.files.url))
    added = vl.aeng.metrics.value("jaxserve_prompt_tokens_total")
    r = vl.http.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert (err["code"], err["param"]) == (code, param), err
    assert says in err["message"], err["message"]
    assert vl.aeng.metrics.value("jaxserve_prompt_tokens_total") == added  # nothing was added to the engine
    assert vl.http.get(url + "/health").json() == {"status": "ok"}


def test_the_openai_client_raises_and_the_server_serves_on(vl):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(vl, data_url(b"just some text"))
    assert e.value.body["code"] == "invalid_image" and e.value.body["param"] == _URL
    _chat(vl, data_url(A))
    ok = _chat(vl, data_url(A))
    assert ok.usage.completion_tokens == N and ok.usage.prompt_tokens_details.cached_tokens > 0
    assert vl.http.get(vl.url + "/health").json() == {"status": "ok"}
    wait_idle(vl)
    assert_pools_free(vl)


# ---------------------------------------------------------------------- completions take no images

_IDS = [10, 20, 30]
VISION_IN_PROMPT = [
    ("image placeholder id", _IDS + [IMAGE_TOKENS["image_token_id"]] + _IDS, "Prompt token 3 (id 508) is the image "
     "placeholder <|image_pad|>"),
    ("vision start id", [IMAGE_TOKENS["vision_start_token_id"]] + _IDS, "Prompt token 0 (id 506) is the vision start"),
    ("placeholder typed as text", "Look: <|vision_start|><|image_pad|><|vision_end|>", "is the vision start token "
     "<|vision_start|>"),
    ("batched form", [_IDS + [IMAGE_TOKENS["vision_end_token_id"]]], "(id 505) is the vision end token"),
]


@pytest.mark.parametrize("name, prompt, says", VISION_IN_PROMPT, ids=[v[0] for v in VISION_IN_PROMPT])
def test_completion_with_vision_token_ids_gets_400(vl, name, prompt, says):
    """/v1/completions carries no image: a prompt (ids or text) holding a vision special token is a
    400 naming the token and where it is, and never reaches the engine."""
    added = vl.aeng.metrics.value("jaxserve_prompt_tokens_total")
    r = vl.http.post(vl.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_value", "prompt") and says in err["message"], err
    assert "/v1/chat/completions" in err["message"]
    assert vl.aeng.metrics.value("jaxserve_prompt_tokens_total") == added
    ok = vl.http.post(vl.url + "/v1/completions", json={"model": MODEL, "prompt": _IDS, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------- the clamp and the CLI


def test_image_max_pixels_clamp(vl, monkeypatch):
    args = EngineArgs(model=str(vl.folder), progress=False)
    small = image_input(dataclasses.replace(args, image_max_pixels=64 * 64), vl.engine)
    expanded, _, _ = small.prepare(_prompt(vl.tokenizer, vl.images.placeholder), [A])
    assert small.processing.max_pixels == 64 * 64 and len(expanded) == len(_prompt(vl.tokenizer, vl.images.placeholder)) + 16 - 1
    monkeypatch.setenv("JAXSERVE_IMAGE_MAX_PIXELS", str(32 * 32))
    assert image_input(args, vl.engine).processing.max_pixels == 32 * 32
    with pytest.raises(ValueError, match="image_max_pixels must be >= 1"):
        image_input(dataclasses.replace(args, image_max_pixels=0), vl.engine)


def test_generate_image_cli_answers_what_the_server_answers(vl, capsys):
    """``jaxserve generate --image`` in this process (``cli.main``): the served engine's sizes, so its
    step programs are compiled already."""
    served = vl.client.chat.completions.create(model=MODEL, messages=_content(image_part(data_url(A)), _TEXT), **GREEDY)
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    argv = ["generate", "--model", str(vl.folder), "--prompt", QUESTION, "--chat", "--image", str(vl.root / "a.png"),
            "--max-tokens", str(N), "--temperature", "0", "--ignore-eos", "--json", "--dtype", "float32", *sizes]
    capsys.readouterr()
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == served.choices[0].message.content and out["prompt_tokens"] == served.usage.prompt_tokens
    assert out["logprobs"] == pytest.approx(_logprobs(served), abs=LOGPROB_ABS)
    for bad, says in ((["--image", str(vl.root / "nope.png")], "nope.png: cannot read it"),
                      (["--image", str(vl.root / "a.png"), "--image-max-pixels", "0"], "--image-max-pixels must be >= 1")):
        assert cli.main(["generate", "--model", str(vl.folder), "--prompt", "hi", *bad]) == 2
        assert says in capsys.readouterr().err
