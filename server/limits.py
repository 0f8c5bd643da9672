"""What one client may hold of the HTTP server (connections, and the images a request carries),
with the defaults ``jaxserve serve``'s flags show.

Imports nothing heavy, so the CLI can read the defaults without the server's dependencies;
``server/http.py`` applies ``HTTPLimits`` (its docstring says which layer answers what),
``server/images.py`` ``ImageLimits``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HTTPLimits:
    timeout_keep_alive: int = 5  # s an idle kept-alive connection stays open (uvicorn's default)
    request_read_timeout: float = 30.0  # s from a request's first byte until its headers and body are all in
    limit_concurrency: int = 1024  # open connections or requests in progress; beyond: 503

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What one chat request may carry as images (server/images.py applies them)."""

    max_images: int = 32  # image parts per request; beyond: 400 too_many_images
    max_image_bytes: int = 20 << 20  # encoded bytes of one image (a data: URL is also bounded by the body cap)
    allow_urls: bool = False  # fetch http(s) image URLs (off: a 400 asks for a data: URL)
    fetch_timeout: float = 10.0  # s a whole fetch may take (connect, each read, and the transfer)

    def __post_init__(self):
        for name in ("max_images", "max_image_bytes", "fetch_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
