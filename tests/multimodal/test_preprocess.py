"""Image preprocessing against transformers' Qwen2-VL processor (tests/reference/vision_oracle.py),
the resize clamp, the processor config and decoding's refusals.

One torch subprocess: transformers' ``smart_resize`` over a few hundred (size, factor, bounds) rows,
and its rescale + normalise + ``patchify`` of our resized images (equal to our uint8 patches looked up
in their levels, on the device as the tower does it and on the host), for both normalisations the
checkpoints use (CLIP's mean/std, Qwen3-VL's 0.5/0.5) and images in RGB, RGBA, L and P modes.
"""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from jaxserve.config import VisionConfig
from jaxserve.multimodal import preprocess as pp
from tests.reference.bridge import run_torch

CLIP = pp.ImageProcessing(patch_size=8, temporal_patch_size=2, merge_size=2)
HALF = pp.ImageProcessing(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=28 * 28,
                          max_pixels=160 * 160, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def _images() -> list[tuple[Image.Image, pp.ImageProcessing]]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    rgba = rng.integers(0, 256, (64, 40, 4), dtype=np.uint8)
    rgba[::3, :, 3] = 0  # fully transparent rows: composited onto white
    gray = Image.fromarray(rng.integers(0, 256, (30, 90), dtype=np.uint8), mode="L")
    big = Image.fromarray(rng.integers(0, 256, (300, 210, 3), dtype=np.uint8))
    return [(rgb, CLIP), (Image.fromarray(rgba, mode="RGBA"), CLIP), (gray, HALF), (rgb.convert("P"), HALF),
            (big, HALF), (big, HALF.clamped(100 * 100))]


def _sizes() -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(300):
        factor = int(rng.choice([16, 28, 32]))
        lo = int(rng.integers(1, 64)) * factor * factor // 4
        hi = lo + int(rng.integers(0, 4000)) * factor
        rows.append((int(rng.integers(1, 5000)), int(rng.integers(1, 5000)), factor, lo, hi))
    rows += [(10, 2500, 28, 3136, 1003520), (2160, 3840, 32, 65536, 1 << 20), (1, 1, 16, 256, 1 << 20)]
    return np.asarray(rows, np.int64)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    d = tmp_path_factory.mktemp("preprocess")
    for name, base in (("clip", CLIP), ("half", HALF)):  # one payload per normalisation, one subprocess
        payload = {"sizes": _sizes(), "mean": np.asarray(base.image_mean), "std": np.asarray(base.image_std),
                   "patch_merge_temporal": np.asarray([base.patch_size, base.merge_size, base.temporal_patch_size])}
        for i, (image, proc) in enumerate(_images()):
            if proc.image_mean == base.image_mean:
                payload[f"image_{i}"] = pp.resize(image, proc)
        np.savez(d / f"in_{name}.npz", **payload)
    outs = {}
    run_torch("tests.reference.vision_oracle", "processor", str(d / "in_clip.npz"), str(d / "out_clip.npz"),
              str(d / "in_half.npz"), str(d / "out_half.npz"))
    for name in ("clip", "half"):
        outs[name] = dict(np.load(d / f"out_{name}.npz"))
    return outs


def test_smart_resize_matches_transformers(oracle):
    for (h, w, factor, lo, hi), ref in zip(_sizes().tolist(), oracle["clip"]["resized"].tolist()):
        if ref == [-1, -1]:
            with pytest.raises(pp.ImageError, match="aspect ratio"):
                pp.smart_resize(h, w, factor, lo, hi)
        else:
            assert list(pp.smart_resize(h, w, factor, lo, hi)) == ref, (h, w, factor, lo, hi)


def test_pixels_match_transformers(oracle):
    for i, (image, proc) in enumerate(_images()):
        ref = oracle["clip" if proc.image_mean == CLIP.image_mean else "half"]
        ours = pp.preprocess(image, proc)
        assert list(ours.grid) == ref[f"grid_{i}"].tolist()
        assert ours.pixels.dtype == np.uint8 and ours.pixels.nbytes == 3 * ours.grid[1] * ours.grid[2] * proc.patch_size**2
        # What the tower computes on the device from the host's uint8 patches is the processor's output.
        on_device = jax.jit(pp.patch_values, static_argnums=2)(ours.pixels, ours.levels, proc.temporal_patch_size)
        np.testing.assert_array_equal(np.asarray(on_device), ref[f"pixels_{i}"])
        np.testing.assert_array_equal(pp.patch_values(ours.pixels, ours.levels, proc.temporal_patch_size),
                                      ref[f"pixels_{i}"])
        t, h, w = ours.grid
        assert ours.num_tokens(proc.merge_size) == h * w // 4


def test_clamp_bounds_the_soft_tokens():
    screenshot = Image.new("RGB", (3840, 2160), (10, 20, 30))
    qwen3_vl = pp.ImageProcessing(16, 2, 2, min_pixels=65536, max_pixels=16777216, image_mean=(0.5,) * 3,
                                  image_std=(0.5,) * 3)
    unclamped = pp.smart_resize(2160, 3840, 32, qwen3_vl.min_pixels, qwen3_vl.max_pixels)
    assert unclamped[0] * unclamped[1] // 32**2 > 8000  # ~8k soft tokens without the clamp
    clamped = qwen3_vl.clamped(pp.DEFAULT_MAX_PIXELS)
    patches = pp.preprocess(screenshot, clamped)
    assert 900 <= patches.num_tokens(2) <= 1024
    assert clamped.clamped(10**9) == clamped  # the clamp never raises the bounds
    assert qwen3_vl.clamped(1).max_pixels == 32 * 32  # and never goes below one soft token


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 4000), w=st.integers(1, 4000), factor=st.sampled_from([16, 28, 32]),
       lo_tokens=st.integers(1, 16), hi_tokens=st.integers(64, 4096))
def test_smart_resize_properties(h, w, factor, lo_tokens, hi_tokens):
    """What the clamp relies on: sides are multiples of the factor, and an image whose downscaled
    short side still spans a soft token never exceeds max_pixels."""
    lo, hi = lo_tokens * factor**2, hi_tokens * factor**2
    if max(h, w) / min(h, w) > pp.MAX_ASPECT_RATIO:
        with pytest.raises(pp.ImageError):
            pp.smart_resize(h, w, factor, lo, hi)
        return
    rh, rw = pp.smart_resize(h, w, factor, lo, hi)
    assert rh % factor == 0 and rw % factor == 0 and rh >= factor and rw >= factor
    if min(h, w) * (hi / (h * w)) ** 0.5 >= factor:
        assert rh * rw <= hi


def test_processor_config_from_checkpoint(tmp_path):
    vision = VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                          temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=64,
                          num_position_embeddings=16, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh",
                          image_token_id=1, vision_start_token_id=2, vision_end_token_id=3)
    assert pp.ImageProcessing.from_checkpoint(tmp_path, vision) == pp.ImageProcessing(16, 2, 2)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    proc = pp.ImageProcessing.from_checkpoint(tmp_path, vision)
    assert (proc.min_pixels, proc.max_pixels, proc.image_mean) == (65536, 16777216, (0.5, 0.5, 0.5))


def test_max_pixels_env(monkeypatch):
    monkeypatch.delenv(pp.MAX_PIXELS_ENV, raising=False)
    assert pp.default_max_pixels() == pp.DEFAULT_MAX_PIXELS
    monkeypatch.setenv(pp.MAX_PIXELS_ENV, "4000000")
    assert pp.default_max_pixels() == 4_000_000
    monkeypatch.setenv(pp.MAX_PIXELS_ENV, "lots")
    with pytest.raises(ValueError, match=pp.MAX_PIXELS_ENV):
        pp.default_max_pixels()


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (its pixel data is a stub)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def test_decode_accepts_png_jpeg_webp():
    image = Image.new("RGB", (20, 12), (200, 10, 10))
    for fmt in ("PNG", "JPEG", "WEBP"):
        decoded = pp.decode(_encoded(image, fmt))
        assert decoded.size == (20, 12)


@pytest.mark.parametrize("payload,match", [
    (b"", "empty"),
    (b"definitely not an image", "not a PNG, JPEG or WebP"),
    (_encoded(Image.new("RGB", (40, 40), (1, 2, 3)), "PNG")[:60], "corrupt or truncated|cannot be read"),
    (_encoded(Image.new("RGB", (8, 8)), "GIF"), "GIF is not accepted"),
    (_encoded(Image.new("1", (9000, 8000)), "PNG"), "above the"),
    (_encoded(Image.new("RGB", (40, 40)), "PNG")[:12], "PNG image is corrupt or truncated"),
    (_encoded(Image.new("RGB", (40, 40)), "JPEG")[:40], "(?i)truncated"),
    (_png_header(0, 0), r"zero size \(0x0\)"),
    (_png_header(7, 0), r"zero size \(7x0\)"),
    (_png_header(30000, 30000), "too large to decode"),
])
def test_decode_refuses_bad_payloads(payload, match):
    with pytest.raises(pp.ImageError, match=match):
        pp.decode(payload)
