"""Image content parts of a chat request: from the URL a client sent to the tower's input, or a 400.

    check_count(parts, limits); check_url(part, limits)             # on the event loop: no I/O, no decoding
    patches = await in_worker(load_images, parts, image_input, limits)  # fetch, decode, preprocess

What a part's URL may be:
- ``data:image/png;base64,...`` (any ``image/*`` media type, or none: the bytes decide the format,
  which must be PNG, JPEG or WebP). The base64 is checked strictly (standard alphabet, whitespace
  and missing padding tolerated) and its size estimated before it is decoded.
- ``http(s)://...`` only when the server runs with ``--allow-image-urls`` (``ImageLimits.allow_urls``;
  off by default, since it lets any client make the server fetch any URL it can reach): fetched
  with httpx in an image worker thread, ``fetch_timeout`` seconds for the whole transfer, at most
  ``max_image_bytes`` read, at most ``MAX_REDIRECTS`` redirects, anything but a 200 refused.
- anything else (``file:``, ``ftp:``, a bare path) is refused.

Every problem is an ``APIError`` 400 in OpenAI's format whose ``param`` names the part
(``messages.I.content.J.image_url.url``) and whose message names the problem: malformed base64,
zero bytes, an image over ``max_image_bytes``, a payload that is not a PNG / JPEG / WebP image,
a truncated or corrupt one, a zero-sized one, one above the decoder's pixel cap
(``jaxserve.multimodal.preprocess.MAX_DECODED_PIXELS``: the bytes of a decompression bomb are
never expanded), an aspect ratio the processor refuses, a failed fetch. Nothing of a bad image
reaches the engine: a request is added only after all its images decoded and preprocessed.
Codes: ``invalid_image_url`` (the URL: scheme, data: syntax, base64, remote refused or failed),
``invalid_image`` (the bytes), ``too_many_images``, ``image_input_not_supported`` (the model
takes no images).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import functools
import time
from typing import Any, Callable, Sequence

from server.limits import ImageLimits
from server.protocol import APIError, ImagePart

MAX_REDIRECTS = 3
MAX_DATA_URL_HEAD = 256  # characters of "data:<media type>;base64" before the comma
_WHITESPACE = b" \t\r\n\f\v"
# Image work (fetching, decoding, preprocessing, hashing) runs in its own threads, so slow fetches or
# large decodes cannot take the threads that tokenize other requests.
IMAGE_WORKERS = 8
_executor: concurrent.futures.ThreadPoolExecutor | None = None


async def in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in an image worker thread (never on the event loop)."""
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(IMAGE_WORKERS, thread_name_prefix="jaxserve-image")
    return await asyncio.get_running_loop().run_in_executor(_executor, functools.partial(fn, *args))


def refused(model: str, why: str, part: ImagePart) -> APIError:
    """The 400 for an image sent to a server that cannot take images (``why``: the reason)."""
    return APIError(400, f"The model '{model}' does not take images: {why}. Send text content parts only.",
                    param=part.part, code="image_input_not_supported")


def vision_token_ids(vision, tokenizer) -> dict[int, str]:
    """The vision special tokens a prompt without images must not hold, id -> what it is: the image
    placeholder, the vision start and the vision end of a model with a tower (``vision``: its
    ``VisionConfig``; None: no tower, no such tokens). Only where the tokenizer has them as special
    tokens (or there is no tokenizer): where they are ordinary text tokens, as in a tokenizer without
    vision tokens, any text may produce them and they mean nothing more."""
    if vision is None:
        return {}
    roles = {vision.image_token_id: "the image placeholder", vision.vision_start_token_id: "the vision start token",
             vision.vision_end_token_id: "the vision end token"}
    if tokenizer is None:
        return roles

    def special(tid: int) -> bool:
        return (0 <= tid < tokenizer.vocab_size and tokenizer.id_to_token(tid) is not None
                and tokenizer.decode([tid], skip_special_tokens=True) == "")

    return {tid: f"{role} {tokenizer.id_to_token(tid)}" for tid, role in roles.items() if special(tid)}


def refuse_vision_tokens(prompt_ids: Sequence[int], vision_ids: dict[int, str]) -> None:
    """A 400 for a prompt that carries no image but holds a vision special token (``vision_token_ids``):
    the engine would take an image placeholder for an image row that does not exist."""
    if not vision_ids or vision_ids.keys().isdisjoint(prompt_ids):
        return
    at, tid = next((i, t) for i, t in enumerate(prompt_ids) if t in vision_ids)
    raise APIError(400, f"Prompt token {at} (id {tid}) is {vision_ids[tid]}, which only an image may bring, and "
                        f"/v1/completions takes no images: send images as image_url content parts to "
                        f"/v1/chat/completions.", param="prompt", code="invalid_value")


def check_count(parts: Sequence[ImagePart], limits: ImageLimits) -> None:
    """At most ``limits.max_images`` image parts."""
    if len(parts) > limits.max_images:
        raise APIError(400, f"The request has {len(parts)} images, more than the {limits.max_images} a request may "
                            f"carry on this server (--max-images-per-request).", param="messages",
                       code="too_many_images")


def _bad_url(part: ImagePart, message: str) -> APIError:
    return APIError(400, f"Invalid image URL in '{part.param}': {message}.", param=part.param, code="invalid_image_url")


def _bad_image(part: ImagePart, message: str) -> APIError:
    return APIError(400, f"Invalid image in '{part.param}': {message}.", param=part.param, code="invalid_image")


def _too_big(size: int, limits: ImageLimits, about: bool = False) -> str:
    return (f"the image is {'about ' if about else ''}{size} bytes, more than the {limits.max_image_bytes} bytes "
            f"one image may have")


def check_url(part: ImagePart, limits: ImageLimits) -> None:
    """The checks of a URL that need no I/O (on the event loop, before any work is queued)."""
    url = part.url
    if _is_data_url(url):
        if url.find(",", 5, MAX_DATA_URL_HEAD) < 0:
            raise _bad_url(part, "a data: URL needs a comma after its media type (data:image/png;base64,...)")
        return
    if url[:8].lower().startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise _bad_url(part, "remote image URLs are not accepted by this server (it runs without "
                                 "--allow-image-urls); send the image inline as a data: URL, e.g. "
                                 "data:image/png;base64,<the PNG's bytes in base64>")
        return
    shown = url[:32] + ("..." if len(url) > 32 else "")
    raise _bad_url(part, f"{shown!r} is neither a data: URL (data:image/png;base64,...) nor an http(s) URL")


def _is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def data_url_bytes(part: ImagePart, limits: ImageLimits) -> bytes:
    """The bytes of a ``data:`` URL (``check_url`` passed it): base64 only, an image media type (or
    none). Linear-time C calls on the payload only: it may be tens of MB."""
    comma = part.url.find(",", 5, MAX_DATA_URL_HEAD)
    head = part.url[5:comma].split(";")
    media, params = head[0].strip().lower(), [p.strip().lower() for p in head[1:]]
    if "base64" not in params:
        raise _bad_url(part, "a data: URL must carry base64 (data:image/png;base64,...)")
    if media and not media.startswith("image/"):
        raise _bad_url(part, f"the data: URL's media type {media!r} is not an image type (image/png, image/jpeg, "
                             f"image/webp)")
    try:
        data = part.url[comma + 1:].encode("ascii")
    except UnicodeEncodeError:
        raise _bad_url(part, "malformed base64: it holds non-ASCII characters") from None
    if any(c in data for c in _WHITESPACE):
        data = data.translate(None, _WHITESPACE)
    if not data:
        raise _bad_image(part, "the image is empty (0 bytes)")
    if len(data) * 3 // 4 > limits.max_image_bytes:
        raise _bad_image(part, _too_big(len(data) * 3 // 4, limits, about=True))
    if len(data) % 4 == 1:
        raise _bad_url(part, "malformed base64: its length leaves one character over (truncated?)")
    try:
        return base64.b64decode(data + b"=" * (-len(data) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad_url(part, f"malformed base64 ({e}; the standard alphabet A-Z a-z 0-9 + / with = padding)") from None


def fetch(part: ImagePart, limits: ImageLimits) -> bytes:
    """An http(s) image's bytes (blocking: call from a worker thread)."""
    import httpx

    deadline = time.monotonic() + limits.fetch_timeout
    cap = limits.max_image_bytes
    try:
        with httpx.Client(timeout=limits.fetch_timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS) as client:
            with client.stream("GET", part.url, headers={"Accept": "image/png, image/jpeg, image/webp",
                                                         "Accept-Encoding": "identity"}) as r:
                if r.status_code != 200:
                    raise _bad_url(part, f"fetching it failed: HTTP {r.status_code} {r.reason_phrase}".rstrip())
                length = r.headers.get("content-length", "")
                if length.isdigit() and int(length) > cap:
                    raise _bad_image(part, _too_big(int(length), limits))
                buf = bytearray()
                for chunk in r.iter_bytes():
                    buf += chunk
                    if len(buf) > cap:
                        raise _bad_image(part, f"the image is more than the {cap} bytes one image may have")
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the transfer took too long")
                return bytes(buf)
    except httpx.TimeoutException:
        raise _bad_url(part, f"fetching it timed out after {limits.fetch_timeout:g} s") from None
    except httpx.TooManyRedirects:
        raise _bad_url(part, f"fetching it took more than {MAX_REDIRECTS} redirects") from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise _bad_url(part, f"fetching it failed: {e}") from None


def load_images(parts: Sequence[ImagePart], images, limits: ImageLimits) -> list:
    """Every part's image, decoded and preprocessed (``images``: the model's
    ``jaxserve.engine.llm.ImageInput``) -> ``PixelPatches`` in order. Blocking: run in a worker
    thread. The first bad part raises its 400."""
    from jaxserve.multimodal.preprocess import ImageError

    out = []
    for part in parts:
        check_url(part, limits)
        data = data_url_bytes(part, limits) if _is_data_url(part.url) else fetch(part, limits)
        if not data:
            raise _bad_image(part, "the image is empty (0 bytes)")
        if len(data) > limits.max_image_bytes:
            raise _bad_image(part, _too_big(len(data), limits))
        try:
            out.append(images.load(data))
        except ImageError as e:
            raise _bad_image(part, str(e)) from None
        except Exception as e:  # noqa: BLE001 - whatever Pillow raises on a hostile file is the client's 400
            raise _bad_image(part, f"the image cannot be processed ({type(e).__name__}: {e})") from None
    return out
