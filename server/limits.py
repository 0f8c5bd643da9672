"""What one client may hold of the HTTP server, with the defaults ``jaxserve serve``'s flags show.

Imports nothing heavy, so the CLI can read the defaults without the server's dependencies;
``server/http.py`` applies them (its docstring says which layer answers what).
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
