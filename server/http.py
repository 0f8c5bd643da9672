"""The HTTP layer under the app: uvicorn's h11 protocol, made to answer in OpenAI's error JSON and
to bound what a connection may hold.

Which layer answers what:
- ``JSONErrorProtocol`` (this module), each answer OpenAI's JSON error, then the connection closes:
  - 400 ``invalid_http``: bytes that are not HTTP/1.1 (a bad request line or header, a missing
    ``Host``, a bad ``Content-Length`` or chunk size, a request line or header block over
    ``H11_MAX_EVENT_BYTES``); the message is h11's reason;
  - 408 ``request_timeout``: a request whose headers and body have not all arrived within
    ``HTTPLimits.request_read_timeout`` seconds of its first byte (or of the connection opening): slowloris
    clients cannot hold connections forever. Reading a response (a long stream) is not timed;
  - 503 ``too_many_connections``: more than ``HTTPLimits.limit_concurrency`` connections open or requests in
    progress.
- uvicorn: an idle kept-alive connection is closed after ``HTTPLimits.timeout_keep_alive`` seconds.
- the app (``server/app.py``): everything about a well-formed request.

``uvicorn_config`` builds a server with these; ``bind_socket`` takes the address early (``jaxserve
serve`` binds before loading the model, so a busy port fails at once, not after the compile) and
``serve`` runs the server on it.
"""

from __future__ import annotations

import json
import logging
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.limits import HTTPLimits
from server.protocol import APIError

H11_MAX_EVENT_BYTES = 16 * 1024  # h11's default; a longer request line or header block is a 400
LINGER_S = 2.0  # after an error answer, how long input is drained before the connection is closed


class _Connection(h11.Connection):
    """An h11 connection that remembers the client's last protocol error (to say what it was)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise


class JSONErrorProtocol(H11Protocol):
    """uvicorn's h11 protocol with JSON errors, a request read timeout and a JSON connection limit
    (see the module docstring). ``uvicorn_config`` sets the class attributes."""

    read_timeout: float = HTTPLimits.request_read_timeout
    max_concurrency: int = HTTPLimits.limit_concurrency

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _Connection(h11.SERVER, config.h11_max_incomplete_event_size or H11_MAX_EVENT_BYTES)
        self.limit_concurrency = None  # uvicorn's own limit answers in text/plain; ``_admit`` answers instead
        self._app, self.app = self.app, self._admit
        self._read_timer = None
        self._discarding = False  # an error was answered: input is dropped until the connection closes

    # ------------------------------------------------------------------ read timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_read_timer()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm_read_timer()  # the request is all in (or the connection is done)

    def connection_lost(self, exc) -> None:
        self._disarm_read_timer()
        super().connection_lost(exc)

    def _arm_read_timer(self) -> None:
        self._disarm_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.logger.warning("Closing a connection whose request was not received in %.1f s.", self.read_timeout)
            self._send_error(APIError(408, f"The request's headers and body were not received within "
                                           f"{self.read_timeout:g} seconds.", code="request_timeout"))

    # ------------------------------------------------------------------ errors

    def send_400_response(self, msg: str) -> None:
        err = self.conn.last_error
        status = getattr(err, "error_status_hint", 400) or 400
        why = str(err) if err is not None and str(err) else "malformed request"
        self._send_error(APIError(status, f"Invalid HTTP request: {why}.", code="invalid_http"))

    def _send_error(self, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=err.status, headers=headers), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            self.transport.close()  # a response had already started: closing is all that is left to say
            return
        # Lingering close: closing a socket with unread input resets the connection, and a client
        # still sending (a 1 MiB URL) would lose the answer. Stop writing, drop what still comes,
        # and close when the client does, or after LINGER_S.
        self._discarding = True
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    async def _admit(self, scope, receive, send) -> None:
        """The app, unless over the limit (this request's task and connection already counted)."""
        limit = self.max_concurrency
        if len(self.connections) > limit or len(self.tasks) > limit:
            self.logger.warning("Exceeded concurrency limit.")
            err = APIError(503, f"The server is at its limit of {limit} concurrent connections; retry later.",
                           type="server_error", code="too_many_connections")
            body = json.dumps(err.body()).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self._app(scope, receive, send)


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 0, limits: HTTPLimits = HTTPLimits(),
                   log_level: str = "info") -> uvicorn.Config:
    """A uvicorn config that serves ``app`` through ``JSONErrorProtocol`` within ``limits``."""
    protocol = type("JaxserveH11Protocol", (JSONErrorProtocol,),
                    {"read_timeout": limits.request_read_timeout, "max_concurrency": limits.limit_concurrency})
    return uvicorn.Config(app, host=host, port=port, http=protocol, ws="none", lifespan="off",
                          timeout_keep_alive=limits.timeout_keep_alive, log_level=log_level)


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (``OSError`` if the address is taken); uvicorn listens on it
    when it starts, so until then connections are refused rather than left waiting."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets and not self.should_exit:  # uvicorn logs this only for sockets it opened itself
            host, port = sockets[0].getsockname()[:2]
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                    f"[{host}]" if ":" in host else host, port)


def serve(config: uvicorn.Config, sock: socket.socket) -> None:
    """Serve on ``sock`` (from ``bind_socket``) until SIGINT/SIGTERM, as ``uvicorn.run`` does."""
    try:
        _Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
