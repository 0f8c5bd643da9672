"""The vision towers and the full models with images, against transformers (torch, fp32).

One torch subprocess (tests/reference/vision_oracle.py) writes a tiny random checkpoint with a
tower for Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-VL (deepstack) and records, for three images of
different shapes (one needing bucket padding in the tower), the tower's soft tokens and deepstack
features, and for prompts with 1, 2 and 3 images (adjacent or apart) the full forward's logits
and 8 greedy tokens. Prompts share one length so each model compiles once.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import VisionConfig
from jaxserve.generate import generate
from jaxserve.sampling_params import SamplingParams
from jaxserve.models import decoder, vision
from jaxserve.multimodal import preprocess as pp
from jaxserve.multimodal import prompt as mm
from tests.reference.bridge import run_torch
from weights import load_model
from weights.tiny import IMAGE_TOKENS, VOCAB

CHECKPOINTS = [("qwen3_5", "vl"), ("qwen3_5_moe", "vl"), ("qwen3_vl", "vl")]
PROMPT_LEN, NEW_TOKENS, MAX_LEN = 80, 8, 128
REL_TOL = 1e-4
IMAGE, START, END = IMAGE_TOKENS["image_token_id"], IMAGE_TOKENS["vision_start_token_id"], IMAGE_TOKENS["vision_end_token_id"]
PROC = pp.ImageProcessing(patch_size=8, temporal_patch_size=2, merge_size=2)  # the tiny towers' processor


def _images() -> list[pp.PixelPatches]:
    """16, 15 and 18 soft tokens: 64, 60 (padded to 64) and 72 (padded to 128) patches."""
    rng = np.random.default_rng(7)
    from PIL import Image

    return [pp.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), PROC)
            for h, w in ((64, 64), (48, 80), (40, 100))]


# name -> layout: text run lengths at even entries, image indices (into _images()) at odd ones; a text
# run of 0 puts two images back to back.
LAYOUTS = {"one": [6, 0, 5], "two_adjacent": [4, 0, 0, 1, 6], "three_apart": [3, 2, 7, 0, 4, 1, 3]}


def _prompt(layout: list, patches: list[pp.PixelPatches], rng) -> tuple[list[int], list[int]]:
    """(expanded ids of PROMPT_LEN tokens, images used in order)."""
    ids, used = [], []
    for i, part in enumerate(layout):
        if i % 2 == 0:
            ids += rng.integers(0, VOCAB - 8, part).tolist()
        else:
            ids += [START, IMAGE, END]
            used.append(part)
    ids += rng.integers(0, VOCAB - 8, PROMPT_LEN).tolist()
    counts = [patches[u].num_tokens(PROC.merge_size) for u in used]
    return mm.expand_placeholders(ids, IMAGE, counts)[:PROMPT_LEN], used


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision")
    patches = _images()
    np.savez(d / "images.npz", **{f"pixels_{i}": pp.patch_values(p.pixels, p.levels, 2) for i, p in enumerate(patches)},
             **{f"grid_{i}": np.asarray(p.grid) for i, p in enumerate(patches)})
    rng = np.random.default_rng(3)
    prompts = {}
    for name, layout in LAYOUTS.items():
        ids, used = _prompt(layout, patches, rng)
        assert ids.count(IMAGE) == sum(patches[u].num_tokens(2) for u in used)  # no image cut by the length
        prompts[name] = {"ids": ids, "images": used}
    spec = {"checkpoints": [{"family": f, "variant": v, "seed": 20 + i} for i, (f, v) in enumerate(CHECKPOINTS)],
            "images": str(d / "images.npz"), "prompts": prompts, "new_tokens": NEW_TOKENS}
    (d / "spec.json").write_text(json.dumps(spec))
    run_torch("tests.reference.vision_oracle", "models", str(d / "spec.json"), str(d))
    return d, patches, prompts


@pytest.fixture(scope="module", params=[f"{f}-{v}" for f, v in CHECKPOINTS])
def case(request, setup):
    d, patches, prompts = setup
    model = load_model(d / request.param, dtype="float32", progress=False)
    return model, dict(np.load(d / request.param / "oracle.npz")), patches, prompts


def _close(ours, theirs, tol=REL_TOL):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    scale = np.max(np.abs(theirs))
    err = np.max(np.abs(ours - theirs))
    assert err <= tol * scale, f"max |Δ| {err:.3g} > {tol} · max |ref| {scale:.3g}"


def test_config_and_tower_loaded(case):
    model, _, _, _ = case
    vcfg = model.config.vision
    assert vcfg is not None and model.config.mrope_section and "vision" in model.params
    assert vcfg.image_token_id == IMAGE and len(model.params["vision"]["blocks"]) == vcfg.depth
    assert len(vcfg.deepstack_layers) == (2 if model.config.model_type == "qwen3" else 0)


def test_tower_matches_transformers(case):
    model, rec, patches, _ = case
    for i, p in enumerate(patches):
        embeds, deep = vision.encode_image(model.params["vision"], model.config.vision, p)
        _close(embeds, rec[f"embeds_{i}"])
        if deep.shape[0]:
            _close(deep, rec[f"deepstack_{i}"])
        else:
            assert rec[f"deepstack_{i}"].size == 0


def test_logits_with_images_match_transformers(case):
    model, rec, patches, prompts = case
    for name, prompt in prompts.items():
        ids, used = prompt["ids"], [patches[u] for u in prompt["images"]]
        images, _ = vision.dense_images(model.params, model.config, ids, used)
        state = decoder.init_state(model.config, 1, MAX_LEN, jnp.float32)
        logits, _ = decoder.forward(model.params, model.config, jnp.asarray([ids], jnp.int32),
                                    jnp.arange(len(ids), dtype=jnp.int32)[None], state, images=images)
        _close(logits[0], rec[f"logits_{name}"])


def test_greedy_with_images_matches_transformers(case):
    model, rec, patches, prompts = case
    for name, prompt in prompts.items():
        out = generate(model.params, model.config, prompt["ids"], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                       images=[patches[u] for u in prompt["images"]])
        assert out.output_ids == rec[f"greedy_{name}"].tolist(), name


def test_a_different_image_changes_the_answer(case):
    """The scatter is real: the same text with another image of the same shape gives other logits."""
    model, rec, patches, prompts = case
    ids, used = prompts["one"]["ids"], [patches[u] for u in prompts["one"]["images"]]
    other = used[0]._replace(pixels=used[0].pixels[::-1].copy())
    images, _ = vision.dense_images(model.params, model.config, ids, [other])
    state = decoder.init_state(model.config, 1, MAX_LEN, jnp.float32)
    logits, _ = decoder.forward(model.params, model.config, jnp.asarray([ids], jnp.int32),
                                jnp.arange(len(ids), dtype=jnp.int32)[None], state, images=images)
    assert np.max(np.abs(np.asarray(logits[0, -1]) - rec["logits_one"][-1])) > 1e-2


# ---------------------------------------------------------------------- bucketed tower, step tables

TOWER = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
                     spatial_merge_size=2, in_channels=3, out_hidden_size=48, num_position_embeddings=16,
                     rope_theta=10000.0, hidden_act="gelu_pytorch_tanh", image_token_id=IMAGE,
                     vision_start_token_id=START, vision_end_token_id=END, deepstack_layers=(0,))


@pytest.fixture(scope="module")
def tower():
    """A random fp32 tower (deepstack included), built through the checkpoint path's ``build_params``."""
    rng = np.random.default_rng(11)
    tensors = {name: rng.normal(0, 0.1, shape).astype(np.float32) for name, shape in vision.hf_shapes(TOWER).items()}
    return vision.build_params(TOWER, tensors, jnp.asarray)


def _patches(seed: int, h: int, w: int) -> pp.PixelPatches:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return pp.preprocess(Image.fromarray(rgb), PROC)


def test_padding_to_a_bucket_leaves_the_real_rows_unchanged(tower):
    """72 patches padded to 128: the soft tokens and deepstack features equal the unpadded run's."""
    image = _patches(1, 40, 100)
    n = image.pixels.shape[0]
    assert (n, vision.bucket_patches(n, 2)) == (72, 128)
    exact = vision.encode(tower, TOWER, image.pixels, image.levels, vision.tower_inputs(TOWER, image.grid))
    padded = vision.encode_padded(tower, TOWER, image)
    assert padded.embeds.shape[0] == 32 and padded.tokens == 18
    np.testing.assert_allclose(padded.embeds[:18], exact[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(padded.deepstack[:, :18], exact[1], rtol=1e-5, atol=1e-5)
    # Garbage in the padding patches changes nothing either: they are never keys of a real patch.
    noisy = np.pad(image.pixels, ((0, 56), (0, 0)), constant_values=255)
    inputs = vision.tower_inputs(TOWER, image.grid, 128)
    np.testing.assert_allclose(vision.encode(tower, TOWER, noisy, image.levels, inputs)[0][:18], exact[0],
                               rtol=1e-5, atol=1e-5)


def test_step_table_places_each_window_and_new_sizes_compile_nothing(tower):
    """After ``compile_buckets``, three images of new sizes inside one bucket (72, 80 and 96 patches:
    all pad to 128) build their step tables without a single compile, and each table row is the
    image row its placeholder names (windows crossing image boundaries, two prompts in one step)."""
    from jaxserve.engine import startup

    assert vision.patch_buckets(256, 2) == (4, 8, 16, 32, 64, 128, 256)
    vision.compile_buckets(tower, TOWER, max_patches=256, table_rows=(32, 64))
    images = [_patches(2, 40, 100), _patches(3, 64, 80), _patches(4, 48, 128)]
    assert [im.pixels.shape[0] for im in images] == [72, 80, 96]
    ids = [START, IMAGE, END, 7, START, IMAGE, END, 9]
    first = mm.prepare(ids, images[:2], IMAGE, 2)[2]  # 18 + 20 rows
    second = mm.prepare(ids[:4], images[2:], IMAGE, 2)[2]  # 24 rows
    before = startup.backend_compiles()
    windows = [(first, 10, 30), (second, 0, 24)]  # image 0 rows 10..17, image 1 rows 0..11; image 2 rows 0..23
    embeds, deep = vision.step_image_table(tower, TOWER, windows, 64)
    assert startup.backend_compiles() == before
    rows = {k: vision.encode_image(tower, TOWER, im) for k, im in enumerate(images)}
    want = np.concatenate([rows[0][0][10:], rows[1][0][:12], rows[2][0], np.zeros((20, 48), np.float32)])
    want_deep = np.concatenate([rows[0][1][:, 10:], rows[1][1][:, :12], rows[2][1], np.zeros((1, 20, 48))], axis=1)
    np.testing.assert_array_equal(np.asarray(embeds), want)
    np.testing.assert_array_equal(np.asarray(deep), want_deep)
    with pytest.raises(ValueError, match="do not fit a table of 32"):
        vision.step_image_table(tower, TOWER, windows, 32)


def test_tower_need_is_its_largest_bucket_and_covers_its_outputs(tower):
    """What start-up reserves for the tower: the largest bucket an image under the clamp pads to,
    at least that program's outputs (soft tokens and deepstack rows), growing with the bucket."""
    bucket, need = vision.encode_need_bytes(tower, TOWER, max_patches=200)
    assert bucket == vision.patch_buckets(200, 2)[-1] == 256
    rows, width, depth = bucket // 4, TOWER.out_hidden_size, len(TOWER.deepstack_layers)
    assert need >= rows * width * (1 + depth) * 4  # float32 tower
    assert vision.encode_need_bytes(tower, TOWER, max_patches=1024)[1] > need
