"""A prompt's images on the host: placeholder expansion, multimodal rotary positions, the rows a
prefill window scatters, and content-keyed cache ids. Token ids in, numpy out; no JAX.

Invariants:
- Image i owns the i-th ``num_tokens(i)`` placeholder tokens of the prompt, in order, and its
  soft-token row j is the j-th of them. Placeholder runs are separated by the vision start / end
  tokens in every chat template; a run may still hold several images back to back.
- ``cache_ids`` (ARCHITECTURE.md invariant 5): ``input_ids`` with every placeholder replaced by an id
  derived from its image's blake2b digest and its position inside the image, all in
  [CACHE_ID_BASE, 2 * CACHE_ID_BASE), above every vocabulary. Same image at the same place: same
  ids, a hit; a different image: different ids from its first placeholder on, a miss. When the
  placeholder count and the images disagree, every placeholder is keyed on one combined digest of
  all the images and its index among all placeholders: coarser, never wrong.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

CACHE_ID_BASE = 1 << 30


def expand_placeholders(ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[int]:
    """Replace the i-th image placeholder token (one per image, as the chat template writes it)
    by ``counts[i]`` copies. A prompt that names a different number of images than it is given
    is a ``ValueError`` (a 400 upstream)."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(counts):
        raise ValueError(f"the prompt has {found} image placeholders for {len(counts)} images")
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == image_token_id else [t])
    return out


def digest(pixels: np.ndarray, grid: Sequence[int]) -> bytes:
    """An image's content key: blake2b over its uint8 patches and grid, all the tower sees of it
    (the normalisation levels are the model's, the same for every image a server takes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(grid, np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


def mrope_positions(ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]],
                    merge_size: int) -> tuple[np.ndarray, int]:
    """Multimodal rotary positions [L, 3] (t, h, w) of a prompt with its placeholders expanded, and
    the delta that continues them: token ``p >= L`` sits at ``p + delta`` on every axis.

    Text advances all three axes by one a token; image i (t, h, w patches) places its soft tokens on
    the (t, h/m, w/m) grid starting at the position it begins at, and the text after it resumes
    ``max(h, w) / m`` further on (transformers' ``get_rope_index``)."""
    ids = np.asarray(ids)
    L = len(ids)
    pos = np.empty((L, 3), np.int64)
    cur, i, image = 0, 0, 0
    while i < L:
        if ids[i] == image_token_id:
            if image >= len(grids):
                raise ValueError(f"the prompt has more image placeholders than the {len(grids)} images' tokens")
            t, h, w = (int(g) for g in grids[image])
            gh, gw = h // merge_size, w // merge_size
            n = t * gh * gw
            if i + n > L or not np.all(ids[i:i + n] == image_token_id):
                raise ValueError(f"image {image} needs {n} consecutive placeholders at token {i}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pos[i:i + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()], -1) + cur
            cur += max(gh, gw)
            i += n
            image += 1
        else:
            j = i + 1
            while j < L and ids[j] != image_token_id:
                j += 1
            pos[i:j] = (cur + np.arange(j - i))[:, None]
            cur += j - i
            i = j
    if image != len(grids):
        raise ValueError(f"the prompt has placeholders for {image} images, not {len(grids)}")
    delta = int(pos.max()) + 1 - L if L else 0
    return pos.astype(np.int32), delta


def placeholder_positions(ids: Sequence[int], image_token_id: int) -> np.ndarray:
    """Token index of every placeholder, in order: entry j is image row j (all images concatenated)."""
    return np.flatnonzero(np.asarray(ids) == image_token_id).astype(np.int32)


def window_rows(placeholders: np.ndarray, start: int, end: int) -> tuple[int, int]:
    """The image rows [a, b) whose placeholders lie in the token window [start, end): what a
    prefill chunk (or the rest of a prompt after a prefix hit) scatters; rows before ``a`` were
    consumed by earlier chunks or by the hit."""
    return int(np.searchsorted(placeholders, start)), int(np.searchsorted(placeholders, end))


def cache_ids(ids: Sequence[int], image_token_id: int, digests: Sequence[bytes],
              counts: Sequence[int]) -> list[int]:
    """The radix tree's keys for a prompt (module docstring). ``counts[i]``: placeholders of image
    i; ``digests[i]``: its ``digest``."""
    ids = list(ids)
    places = placeholder_positions(ids, image_token_id)
    if not len(places):
        return ids
    if len(digests) == len(counts) and sum(counts) == len(places):
        keys = [(d, j) for d, n in zip(digests, counts) for j in range(n)]
    else:
        combined = hashlib.blake2b(b"".join(digests), digest_size=16).digest()
        keys = [(combined, j) for j in range(len(places))]
    for p, (d, j) in zip(places, keys):
        ids[p] = CACHE_ID_BASE + (int.from_bytes(d[:8], "little") + j) % CACHE_ID_BASE
    return ids


class ImagePrompt:
    """What the engine carries for a prompt with images: its preprocessed images (``PixelPatches``,
    in prompt order), every placeholder's token index (image row j sits at ``placeholders[j]``),
    where each image's rows start (image i owns rows ``image_starts[i]:image_starts[i + 1]``) and
    the multimodal rotary positions. ``encoded`` holds the tower's output per image once the executor
    has computed it (``jaxserve.models.vision.EncodedImage``, device arrays the host only passes on)."""

    def __init__(self, ids: Sequence[int], images: Sequence, image_token_id: int, merge_size: int):
        self.images = list(images)
        self.placeholders = placeholder_positions(ids, image_token_id)
        self.image_starts = np.cumsum([0] + [im.num_tokens(merge_size) for im in self.images])
        self.rope_pos, self.delta = mrope_positions(ids, image_token_id, [im.grid for im in images], merge_size)
        self.encoded = None

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """Rotary (t, h, w) of tokens [start, end); past the prompt, ``p + delta`` on every axis."""
        L = len(self.rope_pos)
        tail = np.arange(max(start, L), max(end, L), dtype=np.int32) + self.delta
        return np.concatenate([self.rope_pos[start:min(end, L)], np.repeat(tail[:, None], 3, 1)])


def prepare(ids: Sequence[int], images: Sequence, image_token_id: int, merge_size: int):
    """A tokenized prompt with one placeholder per image -> (expanded ids, cache ids, ImagePrompt)."""
    counts = [im.num_tokens(merge_size) for im in images]
    expanded = expand_placeholders(ids, image_token_id, counts)
    keys = cache_ids(expanded, image_token_id, [digest(im.pixels, im.grid) for im in images], counts)
    return expanded, keys, ImagePrompt(expanded, images, image_token_id, merge_size)
