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

from jaxserve.generate import SamplingParams, generate
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
    np.savez(d / "images.npz", **{f"pixels_{i}": p.pixels for i, p in enumerate(patches)},
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
        embeds, deep = vision.encode_image(model.params["vision"], model.config.vision, p.pixels, p.grid)
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
    other = pp.PixelPatches(used[0].pixels[::-1].copy(), used[0].grid)
    images, _ = vision.dense_images(model.params, model.config, ids, [other])
    state = decoder.init_state(model.config, 1, MAX_LEN, jnp.float32)
    logits, _ = decoder.forward(model.params, model.config, jnp.asarray([ids], jnp.int32),
                                jnp.arange(len(ids), dtype=jnp.int32)[None], state, images=images)
    assert np.max(np.abs(np.asarray(logits[0, -1]) - rec["logits_one"][-1])) > 1e-2
