"""The OpenAI-compatible HTTP API over an ``AsyncEngine``.

    app = create_app(AsyncEngine(engine).start(), served_model_name="my-model", api_key=None)

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming
or not), ``GET /health``, ``GET /metrics``. ``app.state.async_engine`` reaches the engine (tests use
``app.state.async_engine.call_sync(fn)`` to run ``fn(engine)`` between steps).

Contract with clients:
- Every error is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx for
  bad input (never a 500): 400 malformed JSON / wrong types / bad values / unsupported parameters
  (named in ``param``), 401 wrong or missing API key (when one is set; ``/health`` and
  ``/metrics`` stay open), 404 unknown model (``model_not_found``), 413 a body over
  ``max_body_bytes``. A prompt that does not fit the context is a 400 ``context_length_exceeded``.
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
import json
import secrets
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.engine.engine import RequestOutput
from jaxserve.generate import SamplingParams
from server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, ModelCard, _Request, new_id, now,
                             usage)

MAX_BODY_BYTES = 8 << 20
DISCONNECT_POLL_S = 0.5


# ---------------------------------------------------------------------- middleware: auth and body size


class _Gate:
    """ASGI middleware: 401 for a wrong/missing API key on /v1/*, 413 for a body over the cap (the
    body is read here, up to the cap, and replayed to the app)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.api_key}":
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                return await _send_error(err, scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = dict(scope["headers"]).get(b"content-length")
            too_big = APIError(413, f"Request body exceeds {self.max_body} bytes.", code="request_too_large")
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
            # OpenAI's API reads the body as JSON whatever the Content-Type (curl -d sends a form type).
            hdrs = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=hdrs + [(b"content-type", b"application/json")])

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


async def _send_error(err: APIError, scope, receive, send):
    await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)


# ---------------------------------------------------------------------- app


def create_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine = async_engine
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    sched = engine.scheduler
    # Longest prompt + output one request may have: its page-table width, and the whole pool.
    context = min(sched.max_pages_per_seq, sched.pages.capacity) * sched.page_size
    token_text = _TokenText(tokenizer)

    # ------------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(APIError(400, f"Malformed JSON body: {first.get('msg', '')}",
                                         code="invalid_json").body(), status_code=400)
        # pydantic puts union member tags ("str", "list[int]", "function-after[...]") in loc: not params
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not (
            isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "list", "dict", "none")))]
        param = ".".join(loc) or None
        if first.get("type") == "missing":
            msg = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        else:
            msg = f"Invalid value for '{param}': {first.get('msg', 'invalid')}." if param else \
                f"Invalid request body: {first.get('msg', 'invalid')}."
            code = "invalid_type"
        return JSONResponse(APIError(400, msg, param=param, code=code).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=code).body(), status_code=exc.status_code)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_req, exc: EngineDeadError):
        return JSONResponse(APIError(503, str(exc), type="server_error", code="engine_dead").body(), status_code=503)

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_req, exc: RequestFailedError):
        return JSONResponse(APIError(500, str(exc), type="server_error", code="step_failed").body(), status_code=500)

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):
        return JSONResponse(APIError(500, f"Internal server error: {exc!r}", type="server_error").body(), status_code=500)

    # ------------------------------------------------------------------ plain routes

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            return JSONResponse({"status": "unhealthy", "error": repr(async_engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(async_engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def card() -> dict:
        return ModelCard(id=served_model_name, max_model_len=context).model_dump()

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        check_model(model)
        return card()

    def check_model(model: str) -> None:
        if model != served_model_name:
            raise APIError(404, f"The model '{model}' does not exist. This server serves '{served_model_name}'.",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------ shared request handling

    def sampling_for(body: _Request, prompt_len: int, max_tokens: int | None, prompt_param: str,
                     default_max: int | None) -> tuple[SamplingParams, tuple[str, ...]]:
        for param, why in body.unsupported():
            raise APIError(400, f"Unsupported parameter '{param}': {why}.", param=param, code="unsupported_parameter")
        check_model(body.model)
        if prompt_len >= context:
            raise APIError(400, f"This model's maximum context length is {context} tokens; the prompt has {prompt_len} "
                                f"tokens (at least one must be left for the output).", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else context - prompt_len
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens",
                           code="invalid_value")
        if prompt_len + max_tokens > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens; the prompt ({prompt_len}) "
                                f"plus max_tokens ({max_tokens}) exceeds it.", param="max_tokens",
                           code="context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        seed = body.seed if body.seed is not None else (secrets.randbits(31) if temperature > 0 else 0)
        top_k = body.top_k if body.top_k is not None else 0
        if top_k == -1:  # vLLM's "disabled"
            top_k = 0
        checks = [("temperature", 0 <= temperature <= 2, "must be in [0, 2]"),
                  ("top_p", body.top_p is None or 0 < body.top_p <= 1, "must be in (0, 1]"),
                  ("top_k", top_k >= 0, "must be >= 0 (or -1 for disabled)")]
        for param, ok, why in checks:
            if not ok:
                raise APIError(400, f"Invalid value for '{param}': {why}.", param=param, code="invalid_value")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop = tuple(s for s in stop if s)
        stop_ids = tuple(body.stop_token_ids or ())
        if any(not 0 <= t < engine.vocab_size for t in stop_ids):
            raise APIError(400, f"stop_token_ids must be in [0, {engine.vocab_size}).", param="stop_token_ids",
                           code="invalid_value")
        try:
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k, seed=seed & 0x7FFFFFFF,
                                ignore_eos=bool(body.ignore_eos), stop_token_ids=stop_ids)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return sp, stop

    async def submit(prompt_ids: list[int], sp: SamplingParams, stop: tuple[str, ...], prompt_param: str):
        try:
            return await async_engine.add(prompt_ids, sp, stop)
        except ValueError as e:
            raise APIError(400, str(e), param=prompt_param, code="invalid_value") from None

    async def outputs(request: Request, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
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

    async def collect(request: Request, q: asyncio.Queue, rid: str) -> RequestOutput:
        """Wait for the finished output of a non-streaming request; abort it if the client leaves."""
        final = None
        try:
            async for out in outputs(request, q):
                final = out
        except _Disconnected:
            raise APIError(499, "Client disconnected.", code="client_disconnected") from None
        finally:
            async_engine.abort(rid)
        return final

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    # ------------------------------------------------------------------ /v1/completions

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "Batched prompts (a list of several prompts) are not supported: send one prompt per "
                                    "request (concurrent requests are batched by the engine).", param="prompt",
                               code="unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt) if prompt else []
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
        if min(prompt_ids) < 0 or max(prompt_ids) >= engine.vocab_size:
            raise APIError(400, f"Prompt token ids must be in [0, {engine.vocab_size}).", param="prompt",
                           code="invalid_value")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, "logprobs must be in [0, 20].", param="logprobs", code="invalid_value")
        sp, stop = sampling_for(body, len(prompt_ids), body.max_tokens, "prompt", default_max=16)
        rid, q = await submit(prompt_ids, sp, stop, "prompt")
        cid, created = new_id("cmpl"), now()
        want_lp = body.logprobs is not None

        def logprobs_obj(ids, lps, offset0: int) -> dict:
            toks = [token_text(t) for t in ids]
            offsets, off = [], offset0
            for t in toks:
                offsets.append(off)
                off += len(t)
            return {"tokens": toks, "token_logprobs": list(lps), "text_offset": offsets,
                    "top_logprobs": [{t: lp} for t, lp in zip(toks, lps)] if body.logprobs else None}

        chunk = _response_builder("text_completion", cid, created, served_model_name)

        if not body.stream:
            final = await collect(request, q, rid)
            choice = {"index": 0, "text": final.text, "finish_reason": final.finish_reason,
                      "logprobs": logprobs_obj(final.output_ids, final.logprobs, 0) if want_lp else None}
            return chunk([choice], usage(len(prompt_ids), len(final.output_ids), final.cached_tokens), True)

        include_usage = body.include_usage()

        async def stream():
            cursor = _TextCursor(stop)
            text_off = 0
            async for out in outputs(request, q):
                piece = cursor.advance(out)
                lp = None
                if want_lp and out.new_ids:
                    n = len(out.new_ids)
                    lp = logprobs_obj(out.new_ids, out.logprobs[-n:], text_off)
                    text_off += sum(len(t) for t in lp["tokens"])
                if piece or lp:
                    yield sse(chunk([{"index": 0, "text": piece, "logprobs": lp, "finish_reason": None}],
                                    None, include_usage))
                if out.finished:
                    yield sse(chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": out.finish_reason}],
                                    None, include_usage))
                    if include_usage:
                        yield sse(chunk([], usage(len(prompt_ids), len(out.output_ids), out.cached_tokens), True))
            yield "data: [DONE]\n\n"

        return _stream_response(stream(), lambda: async_engine.abort(rid))

    # ------------------------------------------------------------------ /v1/chat/completions

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if not body.messages:
            raise APIError(400, "'messages' must be a non-empty list.", param="messages", code="invalid_value")
        messages = []
        for i, m in enumerate(body.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"Unsupported content part type {part.get('type')!r}: only text parts are "
                                            f"supported.", param=f"messages.{i}.content", code="unsupported_parameter")
                    texts.append(part["text"])
                msg["content"] = "".join(texts)
            elif m.content is None:
                msg["content"] = ""
            messages.append(msg)
        try:
            prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception (e.g. roles out of order) is the client's error
            raise APIError(400, f"The chat template rejected the messages: {e}", param="messages",
                           code="invalid_value") from None
        prompt_ids = tokenizer.encode(prompt_text)
        if not prompt_ids:
            raise APIError(400, "The rendered prompt is empty.", param="messages", code="invalid_value")
        if body.top_logprobs is not None:
            if not 0 <= body.top_logprobs <= 20:
                raise APIError(400, "top_logprobs must be in [0, 20].", param="top_logprobs", code="invalid_value")
            if not body.logprobs:
                raise APIError(400, "top_logprobs requires logprobs=true.", param="top_logprobs", code="invalid_value")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        try:
            sp, stop = sampling_for(body, len(prompt_ids), max_tokens, "messages", default_max=None)
        except APIError as e:
            if e.param == "max_tokens":
                e.param = param
            raise
        rid, q = await submit(prompt_ids, sp, stop, "messages")
        cid, created = new_id("chatcmpl"), now()

        def logprobs_obj(ids, lps) -> dict:
            content = []
            for t, lp in zip(ids, lps):
                tok = token_text(t)
                entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
                entry["top_logprobs"] = [dict(entry)] if body.top_logprobs else []
                content.append(entry)
            return {"content": content}

        chunk = _response_builder("chat.completion.chunk", cid, created, served_model_name)

        if not body.stream:
            final = await collect(request, q, rid)
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                      "logprobs": logprobs_obj(final.output_ids, final.logprobs) if body.logprobs else None,
                      "finish_reason": final.finish_reason}
            return _response_builder("chat.completion", cid, created, served_model_name)(
                [choice], usage(len(prompt_ids), len(final.output_ids), final.cached_tokens), True)

        include_usage = body.include_usage()

        async def stream():
            yield sse(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], None, include_usage))
            cursor = _TextCursor(stop)
            async for out in outputs(request, q):
                piece = cursor.advance(out)
                lp = None
                if body.logprobs and out.new_ids:
                    n = len(out.new_ids)
                    lp = logprobs_obj(out.new_ids, out.logprobs[-n:])
                if piece or lp:
                    yield sse(chunk([{"index": 0, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None}],
                                    None, include_usage))
                if out.finished:
                    yield sse(chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason}],
                                    None, include_usage))
                    if include_usage:
                        yield sse(chunk([], usage(len(prompt_ids), len(out.output_ids), out.cached_tokens), True))
            yield "data: [DONE]\n\n"

        return _stream_response(stream(), lambda: async_engine.abort(rid))

    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


class _Disconnected(Exception):
    pass


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


def _response_builder(kind: str, cid: str, created: int, model: str) -> Callable[..., dict]:
    """OpenAI's response envelope for one request: ``build(choices, usage, with_usage)``. The usage
    key appears only when asked for (a streamed usage chunk carries it, other chunks do not)."""

    def build(choices: list, usage_obj: dict | None = None, with_usage: bool = False) -> dict:
        obj = {"id": cid, "object": kind, "created": created, "model": model, "system_fingerprint": None,
               "choices": choices}
        if with_usage:
            obj["usage"] = usage_obj
        return obj

    return build


def _stream_response(gen: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    async def body():
        try:
            async for item in gen:
                yield item
        except _Disconnected:
            return
        except EngineDeadError as e:
            err = APIError(503, str(e), type="server_error", code="engine_dead")
            yield f"data: {json.dumps(err.body())}\n\n"
        except RequestFailedError as e:
            err = APIError(500, str(e), type="server_error", code="step_failed")
            yield f"data: {json.dumps(err.body())}\n\n"
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
