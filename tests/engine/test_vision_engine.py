"""Images through the whole engine (issue 25 §2 and §4), on a tiny Qwen3.5 checkpoint with a tower.

Against the straight-line ``jaxserve.generate`` path with images (itself checked against
transformers in tests/models/test_vision.py):
- chunked = unchunked: 32-token prefill chunks put a chunk boundary inside every image span, and
  the images' span is wider than a chunk, yet the greedy tokens are the unchunked ones;
- a hit inside an image span = cold: a prompt ending with its image hits its first ×64 boundary,
  which lies inside the image, and gives the cold tokens;
- same text, different image: no hit past the text before the image, and that image's own answer.
The invariant battery runs after every step; the pools drain to free.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from jaxserve.engine.llm import LLM
from jaxserve.generate import generate
from jaxserve.sampling_params import SamplingParams
from jaxserve.multimodal import preprocess as pp
from jaxserve.multimodal import prompt as mm
from tests.engine.checks import assert_pools_free_after_flush, drive
from tests.reference.bridge import run_torch
from weights.tiny import IMAGE_TOKENS

IMAGE, START, END = IMAGE_TOKENS["image_token_id"], IMAGE_TOKENS["vision_start_token_id"], IMAGE_TOKENS["vision_end_token_id"]
NEW = 6


def _image(seed: int, h: int, w: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vl") / "qwen3_5-vl"
    run_torch("weights.tiny", "--family", "qwen3_5", "--variant", "vl", "--out", str(folder), "--seed", "5")
    return LLM(str(folder), dtype="float32", page_size=16, max_prefill_length=32, max_running_requests=4,
               num_pages=64, num_slots=24, debug_snapshot_checksums=True, progress=False)


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def _submit(llm, ids, images):
    expanded, keys, prompt = llm.images.prepare(ids, images)
    rid = llm.engine.add_request(expanded, SamplingParams(max_tokens=NEW, ignore_eos=True), cache_ids=keys,
                                 images=prompt)
    return rid, expanded, prompt


def _cold(llm, expanded, prompt):
    ex = llm.engine.executor
    return generate(ex.params, ex.cfg, expanded, SamplingParams(max_tokens=NEW, ignore_eos=True), images=prompt.images)


def _same(out, cold) -> None:
    """The engine's greedy tokens and their logprobs are the straight-line path's."""
    assert out.output_ids == cold.output_ids
    np.testing.assert_allclose(out.logprobs, cold.logprobs, atol=1e-4)


def test_chunked_equals_unchunked_across_image_spans(llm):
    a, b = _image(1, 64, 64), _image(2, 40, 100)  # 16 and 18 soft tokens
    ids = _text(0, 20) + [START, IMAGE, END] + _text(1, 9) + [START, IMAGE, END] + _text(2, 5)
    rid, expanded, prompt = _submit(llm, ids, [a, b])
    neighbour = llm.engine.add_request(_text(3, 40), SamplingParams(max_tokens=20, ignore_eos=True))
    places = prompt.placeholders
    assert places[-1] - places[0] > 32  # the images' span is wider than a chunk
    assert any(p0 < c <= p1 for c in (32, 64) for p0, p1 in ((places[0], places[15]), (places[16], places[-1])))
    outs = drive(llm.engine)
    _same(outs[rid], _cold(llm, expanded, prompt))
    assert outs[rid].cached_tokens == 0 and outs[neighbour].finished
    assert_pools_free_after_flush(llm.engine)


def test_hit_inside_an_image_span_equals_cold_and_another_image_misses(llm):
    ids = _text(4, 50) + [START, IMAGE, END]  # the prompt ends with its image (tokens 51..68)
    first, expanded, prompt = _submit(llm, ids, [_image(5, 40, 100)])
    cold = _cold(llm, expanded, prompt)
    _same(drive(llm.engine)[first], cold)
    again, _, _ = _submit(llm, ids, [_image(5, 40, 100)])
    out = drive(llm.engine)[again]
    assert out.cached_tokens == 64 and 51 < 64 < 69  # the hit ends inside the image span
    _same(out, cold)
    # Same text, another image of the same shape: no hit past the text, and its own answer.
    other, expanded_b, prompt_b = _submit(llm, ids, [_image(6, 40, 100)])
    out_b = drive(llm.engine)[other]
    assert expanded_b == expanded and out_b.cached_tokens <= int(prompt.placeholders[0])
    _same(out_b, _cold(llm, expanded_b, prompt_b))
    keys_a = mm.cache_ids(expanded, IMAGE, [mm.digest(p.pixels, p.grid) for p in prompt.images], [18])
    keys_b = mm.cache_ids(expanded, IMAGE, [mm.digest(p.pixels, p.grid) for p in prompt_b.images], [18])
    assert keys_a[:51] == keys_b[:51] and keys_a[51] != keys_b[51]
    assert_pools_free_after_flush(llm.engine)


def test_llm_generate_with_images_and_bad_counts(llm):
    ids = _text(7, 10) + [START, IMAGE, END] + _text(8, 4)
    png = pp.decode(_png(_image(9, 48, 80)))
    out = llm.generate([ids], SamplingParams(max_tokens=NEW, ignore_eos=True), images=[[_png(_image(9, 48, 80))]])[0]
    expanded, _, prompt = llm.images.prepare(ids, [png])
    _same(out, _cold(llm, expanded, prompt))
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        llm.generate([ids], SamplingParams(max_tokens=2), images=[[png, png]])


def _png(image: Image.Image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_new_image_sizes_compile_nothing_after_the_tower_buckets(llm):
    """Issue 25's bounded compiles through the whole engine: once start-up has run every step program
    (``warmup``) and ``compile_buckets`` has compiled the tower and its step tables, as serve does,
    images of three sizes in one bucket (72, 80 and 96 patches, all padded to 128) are served
    without a single XLA compile, and still give the straight-line path's tokens."""
    from jaxserve.engine import startup
    from jaxserve.engine.runner import warmup
    from jaxserve.models.vision import compile_buckets

    ex = llm.engine.executor
    ex.pools = warmup(ex.params, ex.cfg, ex.pools, ex.buckets)
    compile_buckets(ex.params["vision"], ex.cfg.vision, max_patches=128 * 128 // 64, table_rows=ex.buckets.tokens)
    ids = _text(10, 12) + [START, IMAGE, END] + _text(11, 3)
    before, served = startup.backend_compiles(), []
    for seed, (h, w) in enumerate(((40, 100), (64, 80), (48, 128)), start=13):
        rid, expanded, prompt = _submit(llm, ids, [_image(seed, h, w)])
        served.append((drive(llm.engine)[rid], expanded, prompt))
        assert startup.backend_compiles() == before, f"{h}x{w} compiled"
    assert [p.images[0].pixels.shape[0] for _, _, p in served] == [72, 80, 96]
    for out, expanded, prompt in served:  # the straight-line reference compiles its own programs: after
        _same(out, _cold(llm, expanded, prompt))
    assert_pools_free_after_flush(llm.engine)
