"""Image preprocessing equal to the checkpoint's Qwen2-VL-style processor (transformers'
``Qwen2VLImageProcessorPil``, which Qwen3-VL and Qwen3.5 use):

1. convert to RGB (transparency composited onto white);
2. smart resize: height and width become multiples of ``patch_size * merge_size`` with the aspect
   ratio kept as well as it can be and the pixel count inside [min_pixels, max_pixels]; Pillow's
   bicubic resample on the uint8 image;
3. patching: the image becomes ``grid_h * grid_w`` rows of ``C * patch**2`` values, ordered merge
   block by merge block so that every ``merge_size**2`` consecutive rows form one soft token;
4. rescale to [0, 1] (in float64, then float32) and normalise per channel with the processor's
   mean and std, and repeat the one frame over the temporal patch: ``patch_values``.

The host keeps steps 1-3 only, as uint8 (``PixelPatches``: 3 bytes a pixel); step 4 is a lookup
of each uint8 level in a [C, 256] table computed with the processor's exact arithmetic
(``PixelPatches.levels``), done on the device by the tower (``jaxserve.models.vision.encode``), so a
1 Mpx image costs the host 3 MB instead of the 25 MB of its float32 patches, and the values the
tower sees are bit for bit the processor's.

The resize clamp (issue 25 §3): ``ImageProcessing.clamped`` lowers ``max_pixels`` (default
``DEFAULT_MAX_PIXELS``, ~1 Mpx; ``--image-max-pixels`` / ``JAXSERVE_IMAGE_MAX_PIXELS``), so a 4K
screenshot costs ~1k soft tokens instead of ~8k.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

# transformers' Qwen2-VL processor defaults, used when a checkpoint ships no preprocessor_config.json.
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200  # the processor refuses longer / shorter images

DEFAULT_MAX_PIXELS = 1024 * 1024  # the clamp: ~1 Mpx
MAX_PIXELS_ENV = "JAXSERVE_IMAGE_MAX_PIXELS"


class ImageError(ValueError):
    """An image that cannot be used; the message says why (for a 400)."""


def default_max_pixels() -> int:
    """The clamp from ``JAXSERVE_IMAGE_MAX_PIXELS``, else ``DEFAULT_MAX_PIXELS``."""
    raw = os.environ.get(MAX_PIXELS_ENV)
    if not raw:
        return DEFAULT_MAX_PIXELS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_PIXELS_ENV}={raw!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{MAX_PIXELS_ENV} must be positive, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class ImageProcessing:
    """The processor's settings (``preprocessor_config.json``, else the vision config and
    transformers' defaults)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = _DEFAULT_MIN_PIXELS
    max_pixels: int = _DEFAULT_MAX_PIXELS
    image_mean: tuple[float, ...] = _OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = _OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Pixels per soft token along each side."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_checkpoint(cls, folder: str | Path, vision) -> "ImageProcessing":
        """``vision``: the checkpoint's ``jaxserve.config.VisionConfig``."""
        base = cls(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return base
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        return dataclasses.replace(
            base,
            patch_size=raw.get("patch_size", base.patch_size),
            temporal_patch_size=raw.get("temporal_patch_size", base.temporal_patch_size),
            merge_size=raw.get("merge_size", base.merge_size),
            min_pixels=size.get("shortest_edge", raw.get("min_pixels", base.min_pixels)),
            max_pixels=size.get("longest_edge", raw.get("max_pixels", base.max_pixels)),
            image_mean=tuple(raw.get("image_mean", base.image_mean)),
            image_std=tuple(raw.get("image_std", base.image_std)),
            rescale_factor=raw.get("rescale_factor", base.rescale_factor),
        )

    def clamped(self, max_pixels: int) -> "ImageProcessing":
        """The resize bounds clamped to at most ``max_pixels`` (never raised)."""
        top = max(min(self.max_pixels, max_pixels), self.factor**2)
        return dataclasses.replace(self, max_pixels=top, min_pixels=min(self.min_pixels, top))


class PixelPatches(NamedTuple):
    """One preprocessed image as the host keeps it: ``pixels`` [grid_h * grid_w, C * p * p] uint8 in
    merge-block order (one frame: the temporal repeat is the device's), ``grid`` (t, grid_h,
    grid_w) in patches, ``levels`` [C, 256] float32: the processor's value of each uint8 level per
    channel (``levels``). ``patch_values`` turns them into what transformers' processor outputs."""

    pixels: np.ndarray
    grid: tuple[int, int, int]
    levels: np.ndarray

    def num_tokens(self, merge_size: int) -> int:
        """Soft tokens (placeholders) this image takes in the prompt."""
        t, h, w = self.grid
        return t * h * w // merge_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width), multiples of ``factor``, pixel count within [min_pixels, max_pixels], aspect
    ratio kept as closely as possible (transformers' ``smart_resize``, the same float arithmetic)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 is above the "
                         f"{MAX_ASPECT_RATIO}:1 the model's processor accepts")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image):
    """A Pillow image as RGB, transparency composited onto white (the processor's ``convert_to_rgb``)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def resize(image, proc: ImageProcessing) -> np.ndarray:
    """RGB Pillow image -> smart-resized uint8 [3, H, W] (bicubic, as the processor resamples)."""
    from PIL import Image

    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, proc.factor, proc.min_pixels, proc.max_pixels)
    resized = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
    return np.moveaxis(np.asarray(resized, dtype=np.uint8), -1, 0)


def normalize(chw: np.ndarray, proc: ImageProcessing) -> np.ndarray:
    """uint8 [C, H, W] -> float32, rescaled then normalised per channel."""
    x = (chw.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    mean = np.asarray(proc.image_mean, np.float32)[:, None, None]
    std = np.asarray(proc.image_std, np.float32)[:, None, None]
    return (x - mean) / std


def levels(proc: ImageProcessing, channels: int = 3) -> np.ndarray:
    """[C, 256] float32: ``normalize`` of every uint8 level on every channel (a lookup table
    equal, value for value, to normalising the image)."""
    ramp = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256))
    return np.ascontiguousarray(normalize(ramp, proc)[:, 0, :])


def patchify(chw: np.ndarray, proc: ImageProcessing) -> PixelPatches:
    """uint8 [C, H, W] (H, W multiples of ``proc.factor``) -> uint8 patches in merge-block order."""
    c, height, width = chw.shape
    p, m = proc.patch_size, proc.merge_size
    gh, gw = height // p, width // p
    x = chw.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, ph, pw)
    return PixelPatches(np.ascontiguousarray(x.reshape(gh * gw, c * p * p), dtype=np.uint8), (1, gh, gw),
                        levels(proc, c))


def patch_values(pixels, levels, temporal_patch_size: int):
    """uint8 patches [n, C * p * p] and their ``levels`` [C, 256] -> the processor's float32 patches
    [n, C * tp * p * p] (each value looked up for its channel, the frame repeated ``tp`` times).
    Indexing and ``repeat`` only, so it runs on numpy arrays and, inside the tower, on JAX arrays."""
    n, width = pixels.shape
    channels = levels.shape[0]
    channel = np.repeat(np.arange(channels), width // channels)[None, :]
    values = levels[channel, pixels].reshape(n, channels, 1, width // channels)
    return values.repeat(temporal_patch_size, axis=2).reshape(n, channels * temporal_patch_size * (width // channels))


def preprocess(image, proc: ImageProcessing) -> PixelPatches:
    """A decoded Pillow image -> the tower's input (uint8 patches and their levels)."""
    return patchify(resize(image, proc), proc)


# Decoding ------------------------------------------------------------------------------------------

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP")
MAX_DECODED_PIXELS = 64 * 1024 * 1024  # decompression-bomb guard: refuse before decoding the pixels


def decode(data: bytes):
    """Encoded PNG / JPEG / WebP bytes -> a fully decoded Pillow image; ``ImageError`` naming the
    problem for anything else (not an image, another format, truncated, zero-sized, too large)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("image is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt, (width, height) = probe.format, probe.size
    except UnidentifiedImageError:
        raise ImageError(_unidentified(data)) from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"image is too large to decode: {e}") from None
    except (OSError, ValueError) as e:
        raise ImageError(f"image cannot be read: {e}") from None
    if fmt not in ACCEPTED_FORMATS:
        raise ImageError(f"image format {fmt} is not accepted (use PNG, JPEG or WebP)")
    if width <= 0 or height <= 0:
        raise ImageError(f"image has zero size ({width}x{height})")
    if width * height > MAX_DECODED_PIXELS:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, above the "
                         f"{MAX_DECODED_PIXELS} this server decodes")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: a truncated file fails here, not later inside the engine
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"image is corrupt or truncated: {e}") from None
    return image


def _unidentified(data: bytes) -> str:
    """Why Pillow could not identify ``data``: a PNG / JPEG / WebP signature whose header is bad
    (zero-sized, or cut short) is named as such; anything else is not an image we take."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        if len(data) >= 24 and data[12:16] == b"IHDR":
            width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
            if width == 0 or height == 0:
                return f"image has zero size ({width}x{height})"
        return "PNG image is corrupt or truncated (its header cannot be read)"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG image is corrupt or truncated (its header cannot be read)"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP image is corrupt or truncated (its header cannot be read)"
    return "payload is not a PNG, JPEG or WebP image"
