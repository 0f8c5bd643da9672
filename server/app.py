"""The OpenAI-compatible HTTP API over an ``AsyncEngine``.

    app = create_app(AsyncEngine(engine).start(), served_model_name="my-model", api_key=None)

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming
or not), ``GET /health``, ``GET /metrics``, ``GET /server_info`` (for sglang-router).
``app.state.server`` is the ``ServerState`` the routes read; ``app.state.async_engine`` reaches the
engine (tests use ``call_sync(fn)`` to run ``fn(engine)`` between steps).

Contract with clients:
- Every error this app answers is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``
  with a 4xx for bad input (never a 500): 400 malformed JSON (lone surrogates included) / wrong
  types / out-of-range values / unsupported parameters (named in ``param``), 401 wrong or missing
  API key (when one is set; ``/health`` and ``/metrics`` stay open), 404 unknown model
  (``model_not_found``, checked before any tokenizing), 413 a body over ``max_body_bytes``. A
  prompt that cannot fit the context is a 400 ``context_length_exceeded``: a text prompt longer
  than ``max_prompt_chars`` is refused before it is tokenized. A bad image part is a 400 naming
  the part (server/images.py lists them), and a request is added to the engine only after all its
  images decoded. Errors of the HTTP layer below the
  app (unparsable HTTP, read timeouts, the connection limit) are JSON too: ``server/http.py``.
- The event loop never tokenizes, renders a chat template or touches an image's bytes: all of it
  (and fetching an image URL) runs in a worker thread (the tokenizer and Pillow's decoders release
  the GIL), so ``/health`` and streams stay responsive while a long prompt is prepared.
- Images (``create_app(images=ImageInput)``; chat only): each ``image_url`` part becomes the model's
  placeholder text (``<|vision_start|><|image_pad|><|vision_end|>``, what the Qwen3.5 / Qwen3-VL
  templates write for an image) where the part is, so any chat template places it; the rendered
  prompt must then hold exactly one image token per part. Each placeholder is expanded to the
  image's soft tokens (``usage.prompt_tokens`` counts them) and keyed on the image's content in the
  prefix cache.
- A request ends in the engine however the client leaves: finished, disconnected mid-stream or
  mid-wait (polled every ``DISCONNECT_POLL_S``), or the handler failing; ``abort`` is posted in a
  ``finally`` and is a no-op for a request that already finished.
- Streams hold back the last ``max(len(stop)) - 1`` characters until they cannot start a stop
  string, so a stop string is never partly streamed.
- Logprobs: the chosen token's logprob only. Completions ``logprobs: k`` returns ``tokens``,
  ``token_logprobs``, ``text_offset`` and ``top_logprobs`` holding just the chosen token; chat
  ``logprobs: true`` returns ``content[].token/logprob/bytes`` with ``top_logprobs`` holding the
  chosen token when ``top_logprobs >= 1`` (alternatives are not computed by the sampler).
- Defaults follow OpenAI: temperature 1, top_p 1; completions max_tokens 16, chat max_tokens the
  rest of the context. A random seed is drawn when none is given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import secrets
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.engine.engine import RequestOutput
from jaxserve.sampling_params import SamplingParams, check_prompt_ids
from server import images as image_parts
from server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from server.limits import ImageLimits
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, ModelCard, _Request, new_id, now,
                             parse_body, usage)

MAX_BODY_BYTES = 8 << 20
MAX_BODY_BYTES_IMAGES = 32 << 20  # the default body cap of a server that takes images (base64 inflates them 4/3)
DISCONNECT_POLL_S = 0.5


@dataclasses.dataclass
class ServerState:
    """What the routes read: fixed at start-up, except the engine's own state behind ``engine``."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Any
    vocab_size: int
    context: int  # longest prompt + output one request may have
    max_prompt_chars: int  # a text longer than this cannot fit ``context`` tokens (``max_prompt_chars``)
    token_text: Callable[[int], str]
    # Image input (jaxserve.engine.llm.ImageInput) when the server takes images, else None and
    # ``no_images`` says why (the 400 an image part gets).
    images: Any = None
    no_images: str = ""
    image_limits: ImageLimits = ImageLimits()
    # The model's vision special tokens (server.images.vision_token_ids): refused in completion prompts.
    vision_ids: dict[int, str] = dataclasses.field(default_factory=dict)


def max_prompt_chars(tokenizer, context: int) -> int:
    """The longest text that might still fit ``context`` tokens: ``2 * context * L``, L the longest
    vocabulary entry. An entry of a byte-level BPE has one character per byte (a SentencePiece
    one, per character), so a text's normalized UTF-8 bytes need at least bytes / L tokens, and
    Unicode normalization (NFC, NFKC) composes at most 4 characters into one 3-byte character, so
    a text of c characters keeps at least 3c/4 bytes: the factor 2 covers that. Only a normalizer
    that deletes characters outright could make this refuse a prompt that fits."""
    longest = max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))
    return 2 * context * max(1, longest)


def create_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int | None = None, images=None,
               image_limits: ImageLimits = ImageLimits()) -> FastAPI:
    """``images``: the model's ``jaxserve.engine.llm.ImageInput`` (``image_input``) to take images in
    chat requests; None takes none. ``max_body_bytes``: default ``MAX_BODY_BYTES``, or
    ``MAX_BODY_BYTES_IMAGES`` when the server takes images."""
    engine = async_engine.engine
    sched = engine.scheduler
    context = min(sched.max_pages_per_seq, sched.pages.capacity) * sched.page_size  # page table, and whole pool
    tokenizer = engine.tokenizer
    has_tower = getattr(getattr(getattr(engine, "executor", None), "cfg", None), "vision", None) is not None
    no_images = ("it has no vision tower" if not has_tower else "this server was started without image input"
                 if images is None else "" if images.placeholder else
                 f"its tokenizer has no image placeholder token ({images.no_placeholder}), so a chat prompt "
                 f"cannot mark where an image goes")
    if max_body_bytes is None:
        max_body_bytes = MAX_BODY_BYTES_IMAGES if not no_images else MAX_BODY_BYTES
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine = async_engine
    app.state.server = ServerState(
        engine=async_engine, model_name=served_model_name, tokenizer=tokenizer, vocab_size=engine.vocab_size,
        context=context, max_prompt_chars=max_prompt_chars(tokenizer, context),
        token_text=_TokenText(tokenizer), images=None if no_images else images, no_images=no_images,
        image_limits=image_limits, vision_ids=image_parts.vision_token_ids(engine.executor.cfg.vision if has_tower
                                                                            else None, tokenizer))
    for exc in (APIError, StarletteHTTPException, EngineDeadError, RequestFailedError, Exception):
        app.add_exception_handler(exc, _error_response)
    app.include_router(router)
    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


# ---------------------------------------------------------------------- errors


def as_api_error(exc: BaseException) -> APIError:
    """Any exception a route or stream can meet, as the OpenAI error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type="server_error", code="step_failed")
    return APIError(500, f"Internal server error: {exc!r}", type="server_error")


async def _error_response(_req, exc: Exception) -> JSONResponse:
    err = as_api_error(exc)
    return JSONResponse(err.body(), status_code=err.status)


# ---------------------------------------------------------------------- middleware: auth and body size


class _Gate:
    """ASGI middleware: 401 for a wrong/missing API key on /v1/* (compared in constant time), 413 for
    a body over the cap (the body is read here, up to the cap, and replayed to the app)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body = app, max_body_bytes
        self.expected_auth = None if api_key is None else b"Bearer " + api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected_auth is not None and scope["path"].startswith("/v1"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected_auth):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                return await _send_error(err, scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"Request body exceeds {self.max_body} bytes.", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _send_error(too_big, scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await _send_error(too_big, scope, receive, send)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _send_error(err: APIError, scope, receive, send):
    await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)


# ---------------------------------------------------------------------- plain routes

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request):
    eng = _state(request).engine
    if not eng.alive:
        return JSONResponse({"status": "unhealthy", "error": repr(eng.error)}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    registry = _state(request).engine.metrics
    return Response(registry.render(), media_type=registry.content_type)


def _card(st: ServerState) -> dict:
    return ModelCard(id=st.model_name, max_model_len=st.context).model_dump()


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_card(_state(request))]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request):
    st = _state(request)
    _check_model(st, model)
    return _card(st)


@router.get("/server_info")
async def server_info(request: Request):
    """The route sglang-router reads when a worker registers (SGLang's name; it falls back to
    ``/get_server_info``): the model id it lists on its own ``/v1/models`` is ``served_model_name``.
    Without it the router lists ``unknown``, which clients (``jaxserve bench`` among them) would send."""
    st = _state(request)
    return {"served_model_name": st.model_name}


def _check_model(st: ServerState, model: str) -> None:
    if model != st.model_name:
        raise APIError(404, f"The model '{model}' does not exist. This server serves '{st.model_name}'.",
                       param="model", code="model_not_found")


# ---------------------------------------------------------------------- /v1/completions


@router.post("/v1/completions")
async def completions(request: Request):
    st = _state(request)
    body = parse_body(CompletionRequest, await request.body())
    _check_request(st, body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "Batched prompts (a list of several prompts) are not supported: send one prompt per "
                                "request (concurrent requests are batched by the engine).", param="prompt",
                           code="unsupported_parameter")
        prompt = prompt[0]
    prompt_ids = await _encode(st, prompt, "prompt") if isinstance(prompt, str) else list(prompt)
    try:
        check_prompt_ids(prompt_ids, st.vocab_size)
    except ValueError as e:
        raise APIError(400, f"The {e}.", param="prompt", code="invalid_value") from None
    image_parts.refuse_vision_tokens(prompt_ids, st.vision_ids)
    sp = _sampling(st, body, len(prompt_ids), body.max_tokens, "max_tokens", "prompt", default_max=16)
    return await _respond(request, st, body, prompt_ids, sp, "prompt", _CompletionShape(st, body.logprobs))


class _CompletionShape:
    """Completions' choices: streamed deltas, the end, and the whole answer."""

    stream_object = whole_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, st: ServerState, logprobs: int | None):
        self.token_text, self.logprobs, self.text_offset = st.token_text, logprobs, 0

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float]) -> dict | None:
        if self.logprobs is None:
            return None
        toks = [self.token_text(t) for t in ids]
        offsets = []
        for t in toks:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        return {"tokens": toks, "token_logprobs": list(lps), "text_offset": offsets,
                "top_logprobs": [{t: lp} for t, lp in zip(toks, lps)] if self.logprobs else None}

    def head(self) -> list[dict]:
        return []

    def delta(self, piece: str, ids: Sequence[int], lps: Sequence[float]) -> dict | None:
        lp = self._logprobs(ids, lps) if ids else None
        return {"index": 0, "text": piece, "logprobs": lp, "finish_reason": None} if piece or lp else None

    def end(self, reason: str) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

    def whole(self, final: RequestOutput) -> dict:
        return {"index": 0, "text": final.text, "finish_reason": final.finish_reason,
                "logprobs": self._logprobs(final.output_ids, final.logprobs)}


# ---------------------------------------------------------------------- /v1/chat/completions


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    st = _state(request)
    body = parse_body(ChatCompletionRequest, await request.body())
    _check_request(st, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true.", param="top_logprobs", code="invalid_value")
    messages, parts = body.template_messages(st.images.placeholder if st.images else "")
    if parts:  # the checks that need no I/O, before any work is queued
        if st.images is None:
            raise image_parts.refused(st.model_name, st.no_images, parts[0])
        image_parts.check_count(parts, st.image_limits)
        for part in parts:
            image_parts.check_url(part, st.image_limits)

    def render() -> str:
        try:
            return st.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception (e.g. roles out of order) is the client's error
            raise APIError(400, f"The chat template rejected the messages: {e}", param="messages",
                           code="invalid_value") from None

    prompt_ids = await _encode(st, await asyncio.to_thread(render), "messages")
    if not prompt_ids:
        raise APIError(400, "The rendered prompt is empty.", param="messages", code="invalid_value")
    cache_ids = image_prompt = None
    if st.images is not None:
        prompt_ids, cache_ids, image_prompt = await _with_images(st, prompt_ids, parts)
    if body.max_completion_tokens is not None:
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = body.max_tokens, "max_tokens"
    sp = _sampling(st, body, len(prompt_ids), max_tokens, param, "messages", default_max=None)
    return await _respond(request, st, body, prompt_ids, sp, "messages", _ChatShape(st, body), cache_ids=cache_ids,
                          images=image_prompt)


async def _with_images(st: ServerState, prompt_ids: list[int], parts: list) -> tuple[list[int], Any, Any]:
    """A rendered chat prompt of a server that takes images, and its image parts -> (ids with each
    image's placeholder expanded to its soft tokens, content-keyed cache ids, ImagePrompt); without
    images, the ids as they are. Every image part became one placeholder token where the template
    put it; a prompt with any other count (the template dropped a part, or the text itself holds the
    placeholder token) is a 400 before any image is decoded."""
    vision = st.images.vision
    found = prompt_ids.count(vision.image_token_id)
    if found != len(parts):
        raise APIError(400, f"The rendered prompt has {found} image placeholders for {len(parts)} images: the text "
                            f"must not contain the image placeholder {st.images.placeholder!r} itself"
                            f"{', and the chat template must keep every image part' if found < len(parts) else ''}.",
                       param="messages", code="invalid_value")
    if not parts:
        return prompt_ids, None, None
    patches = await image_parts.in_worker(image_parts.load_images, parts, st.images, st.image_limits)
    try:  # digests (blake2b over the patches) and rotary positions: off the event loop too
        return await image_parts.in_worker(st.images.prepare, prompt_ids, patches)
    except ValueError as e:
        raise APIError(400, f"The images do not fit the prompt: {e}.", param="messages", code="invalid_value") from None


class _ChatShape:
    """Chat's choices: the role chunk, streamed deltas, the end, and the whole answer."""

    stream_object, whole_object = "chat.completion.chunk", "chat.completion"
    id_prefix = "chatcmpl"

    def __init__(self, st: ServerState, body: ChatCompletionRequest):
        self.token_text, self.logprobs, self.top = st.token_text, bool(body.logprobs), bool(body.top_logprobs)

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float]) -> dict | None:
        if not self.logprobs:
            return None
        content = []
        for t, lp in zip(ids, lps):
            tok = self.token_text(t)
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            entry["top_logprobs"] = [dict(entry)] if self.top else []
            content.append(entry)
        return {"content": content}

    def head(self) -> list[dict]:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def delta(self, piece: str, ids: Sequence[int], lps: Sequence[float]) -> dict | None:
        lp = self._logprobs(ids, lps) if ids else None
        return {"index": 0, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None} if piece or lp else None

    def end(self, reason: str) -> dict:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}

    def whole(self, final: RequestOutput) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": final.text},
                "logprobs": self._logprobs(final.output_ids, final.logprobs), "finish_reason": final.finish_reason}


# ---------------------------------------------------------------------- shared request handling


def _check_request(st: ServerState, body: _Request) -> None:
    """The checks that need no prompt, in the order a client fixes them: what we cannot do, then
    the model (before any tokenizing), then values only the server knows the range of."""
    for param, why in body.unsupported():
        raise APIError(400, f"Unsupported parameter '{param}': {why}.", param=param, code="unsupported_parameter")
    _check_model(st, body.model)
    if any(t >= st.vocab_size for t in body.stop_token_ids or ()):
        raise APIError(400, f"stop_token_ids must be in [0, {st.vocab_size}).", param="stop_token_ids",
                       code="invalid_value")


async def _encode(st: ServerState, text: str, param: str) -> list[int]:
    """Token ids of ``text``, tokenized in a worker thread; a text too long to fit is refused first."""
    if len(text) > st.max_prompt_chars:
        raise APIError(400, f"This model's maximum context length is {st.context} tokens; the prompt has {len(text)} "
                            f"characters, more than {st.context} tokens can hold (at most {st.max_prompt_chars}).",
                       param=param, code="context_length_exceeded")
    return await asyncio.to_thread(st.tokenizer.encode, text) if text else []


def _sampling(st: ServerState, body: _Request, prompt_len: int, max_tokens: int | None, max_param: str,
              prompt_param: str, default_max: int | None) -> SamplingParams:
    context = st.context
    if prompt_len >= context:
        raise APIError(400, f"This model's maximum context length is {context} tokens; the prompt has {prompt_len} "
                            f"tokens (at least one must be left for the output).", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else context - prompt_len
    if prompt_len + max_tokens > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens; the prompt ({prompt_len}) "
                            f"plus {max_param} ({max_tokens}) exceeds it.", param=max_param,
                       code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed if body.seed is not None else (secrets.randbits(31) if temperature > 0 else 0)
    top_k = body.top_k if body.top_k not in (None, -1) else 0  # -1: vLLM's "disabled"
    top_p = 1.0 if body.top_p is None else body.top_p
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed & 0x7FFFFFFF, ignore_eos=bool(body.ignore_eos),
                          stop_token_ids=tuple(body.stop_token_ids or ()), priority=body.priority or 0,
                          tenant=body.user or "")


async def _respond(request: Request, st: ServerState, body: _Request, prompt_ids: list[int], sp: SamplingParams,
                   prompt_param: str, shape, cache_ids: list[int] | None = None, images: Any = None) -> Any:
    """Submit the request and answer it: the whole JSON, or an SSE stream of ``shape``'s chunks."""
    stop = body.stop_strings()
    try:
        rid, q = await st.engine.add(prompt_ids, sp, stop, cache_ids=cache_ids, images=images)
    except ValueError as e:
        raise APIError(400, str(e), param=prompt_param, code="invalid_value") from None
    cid, created, n_prompt = new_id(shape.id_prefix), now(), len(prompt_ids)

    def envelope(kind: str, choices: list, usage_obj: dict | None = None, with_usage: bool = False) -> dict:
        """OpenAI's response envelope; the usage key appears only when asked for (a streamed usage
        chunk carries it, other chunks do not)."""
        obj = {"id": cid, "object": kind, "created": created, "model": st.model_name, "system_fingerprint": None,
               "choices": choices}
        if with_usage:
            obj["usage"] = usage_obj
        return obj

    if not body.stream:
        final = None
        try:
            async for out in _outputs(request, q):
                final = out
        except _Disconnected:
            raise APIError(499, "Client disconnected.", code="client_disconnected") from None
        finally:
            st.engine.abort(rid)
        return envelope(shape.whole_object, [shape.whole(final)],
                        usage(n_prompt, len(final.output_ids), final.cached_tokens), True)

    include_usage = body.include_usage()

    def sse(choices: list, usage_obj: dict | None = None) -> str:
        obj = envelope(shape.stream_object, choices, usage_obj, include_usage)
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def events() -> AsyncIterator[str]:
        for choice in shape.head():
            yield sse([choice])
        cursor = _TextCursor(stop)
        async for out in _outputs(request, q):
            n = len(out.new_ids)
            choice = shape.delta(cursor.advance(out), out.new_ids, out.logprobs[-n:] if n else [])
            if choice is not None:
                yield sse([choice])
            if out.finished:
                yield sse([shape.end(out.finish_reason)])
                if include_usage:
                    yield sse([], usage(n_prompt, len(out.output_ids), out.cached_tokens))
        yield "data: [DONE]\n\n"

    return _stream_response(events(), lambda: st.engine.abort(rid))


class _Disconnected(Exception):
    pass


async def _outputs(request: Request, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """The request's outputs until it finishes; stops (raising ``_Disconnected``) if the client leaves."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    while True:
        try:
            out = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            out = None
        if loop.time() >= next_check:  # also while tokens flow: a non-streaming wait sends nothing
            if await request.is_disconnected():
                raise _Disconnected() from None
            next_check = loop.time() + DISCONNECT_POLL_S
        if out is None:
            continue
        if isinstance(out, BaseException):
            raise out
        yield out
        if out.finished:
            return


class _TokenText:
    """A token's text for logprobs (special tokens included), memoised."""

    def __init__(self, tokenizer):
        self._tok, self._memo = tokenizer, {}

    def __call__(self, tid: int) -> str:
        s = self._memo.get(tid)
        if s is None:
            s = self._memo[tid] = self._tok.decode([tid], skip_special_tokens=False)
        return s


class _TextCursor:
    """How much of a request's text has been streamed; holds back what could still begin a stop string."""

    def __init__(self, stop: tuple[str, ...]):
        self.sent = 0
        self.holdback = max(map(len, stop)) - 1 if stop else 0

    def advance(self, out: RequestOutput) -> str:
        end = len(out.text) if out.finished else max(self.sent, len(out.text) - self.holdback)
        piece, self.sent = out.text[self.sent:end], end
        return piece


def _stream_response(gen: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    """An SSE response of ``gen``; an engine error mid-stream becomes a final error event."""

    async def body():
        try:
            async for item in gen:
                yield item
        except _Disconnected:
            return
        except (EngineDeadError, RequestFailedError) as e:
            yield f"data: {json.dumps(as_api_error(e).body())}\n\n"
        finally:
            on_close()

    return _AbortingStreamingResponse(body(), on_close, media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _AbortingStreamingResponse(StreamingResponse):
    """Calls ``on_close`` however the response ends, even if the body never started (a client that
    left before the first chunk)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
