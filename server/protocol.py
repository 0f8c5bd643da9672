"""Request and response bodies in OpenAI's shapes (strict pydantic models), and OpenAI's error JSON.

Parsing (``parse_body``) runs pydantic's own JSON parser on the raw body, so:
- types are strict: ``"stream": "yes"``, ``"max_tokens": "10"`` or ``"logprobs": "yes"`` is a 400
  naming the field, never coerced (an int is still a valid float);
- every number has a range it can be represented in downstream (``INT32_MAX`` for what becomes an
  int32 on the device, finite floats only): an out-of-range value is a 400, so no request's data
  can reach the engine and fail there;
- text is text: a lone UTF-16 surrogate escape (``"\\ud800"``) anywhere in the body, keys included,
  is malformed JSON (400), so nothing downstream (model check, chat template, tokenizer, UTF-8
  encoding of logprob bytes) ever sees one.

Requests ignore fields they do not know (as vLLM does: clients send vendor extensions), but a
field we know and cannot honour (n > 1, best_of, logit_bias, tools, echo, penalties, ...) is a
400 that names it: silently ignoring it would return something the client did not ask for.
Extensions beyond OpenAI's API, with vLLM's names: ``top_k``, ``ignore_eos``, ``stop_token_ids``.

Chat content parts: ``text`` and ``image_url`` (OpenAI's ``{"type": "image_url", "image_url": {"url":
..., "detail": ...}}``; ``detail``, any string, is accepted and ignored: the resize clamp decides an
image's size). ``message_text`` writes an image part as the model's placeholder text and collects
it; server/images.py turns its URL into the engine's input, or a 400.

To add a request field: declare it on the model with its constraints; to add a chat content part
type: ``message_text`` is the one place that reads content parts.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, NamedTuple, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

INT32_MAX = 2**31 - 1
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20

# Strict types everywhere; floats must be finite (JSON has no inf/NaN, but 1e400 parses as inf).
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class APIError(Exception):
    """An error with OpenAI's JSON body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------- requests

Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Positive32 = Annotated[int, Field(ge=1, le=INT32_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="ignore")
    include_usage: Optional[bool] = None


class _Request(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="ignore")

    model: str
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, Annotated[list[str], Field(max_length=MAX_STOP)]]] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, le=INT32_MAX)  # extension; -1 (vLLM) or 0 = off
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1)  # int64; the sampler uses its low 31 bits
    n: Optional[Positive32] = 1
    max_tokens: Optional[Positive32] = None
    ignore_eos: Optional[bool] = False  # extension
    stop_token_ids: Optional[Annotated[list[Int32], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None  # extension
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # also the tenant that --policy fair shares by
    priority: Optional[Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]] = None  # lower first (--policy priority)

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for every field set to something this server cannot do."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", "only n=1 is supported"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                out.append((name, f"{name} is not supported (only 0)"))
        if self.repetition_penalty not in (None, 1, 1.0):
            out.append(("repetition_penalty", "repetition_penalty is not supported (only 1)"))
        return out

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stop if s)


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = False
    best_of: Optional[Positive32] = None
    suffix: Optional[str] = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of is not supported (only 1)"))
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        return out


class ChatMessage(BaseModel):
    """A message as the chat template sees it; fields beyond these (tool_calls, ...) pass through."""

    model_config = ConfigDict(**_STRICT, extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Positive32] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                out.append((name, f"{name} (function calling) is not supported"))
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                out.append((name, f"{name} is not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "response_format other than {\"type\": \"text\"} is not supported"))
        return out

    def template_messages(self, image_placeholder: str = "") -> tuple[list[dict[str, Any]], list["ImagePart"]]:
        """The messages as dicts for the chat template, content parts joined to text (each image part
        as ``image_placeholder``), and the image parts in prompt order."""
        out, images = [], []
        for i, m in enumerate(self.messages):
            msg = m.model_dump(exclude_none=True)
            msg["content"] = message_text(m.content, param=f"messages.{i}.content", images=images,
                                          image_placeholder=image_placeholder)
            out.append(msg)
        return out, images


class ImagePart(NamedTuple):
    """An ``image_url`` content part: its URL (``data:`` or ``http(s):``, checked later by
    server/images.py) and where it is (``messages.I.content.J``, for errors)."""

    url: str
    part: str

    @property
    def param(self) -> str:
        return f"{self.part}.image_url.url"


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; any string is accepted and ignored (the clamp decides the size)


def message_text(content: str | list[dict[str, Any]] | None, param: str, images: list[ImagePart] | None = None,
                 image_placeholder: str = "") -> str:
    """A message's content as text: a string, or OpenAI's content parts joined. ``{"type": "text",
    "text": ...}`` is its text; ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``
    is appended to ``images`` and written as ``image_placeholder`` (the model's placeholder text, so
    the chat template puts it where the part is). Any other part, a malformed one, or an image part
    where ``images`` is None, is a 400 naming the part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind, where = part.get("type"), f"{param}.{j}"
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"Invalid value for '{where}.text': a text part needs a string 'text'.",
                               param=f"{where}.text", code="invalid_value")
            texts.append(part["text"])
        elif kind == "image_url" and images is not None:
            spec = part.get("image_url")
            url = spec if isinstance(spec, str) else spec.get("url") if isinstance(spec, dict) else None
            if not isinstance(url, str) or not url:
                raise APIError(400, f"Invalid value for '{where}.image_url': an image_url part needs "
                                    f"{{\"url\": \"data:image/png;base64,...\"}} (a data: URL or an http(s) URL).",
                               param=f"{where}.image_url.url", code="invalid_value")
            detail = spec.get("detail") if isinstance(spec, dict) else None
            if detail is not None and not isinstance(detail, str):
                raise APIError(400, f"Invalid type for '{where}.image_url.detail': a string (e.g. "
                                    f"{', '.join(IMAGE_DETAILS)}), got {detail!r}.", param=f"{where}.image_url.detail",
                               code="invalid_type")
            images.append(ImagePart(url, where))
            texts.append(image_placeholder)
        else:
            accepted = "text and image_url" if images is not None else "text"
            raise APIError(400, f"Unsupported content part type {kind!r}: only {accepted} parts are supported.",
                           param=where if kind is None else f"{where}.type", code="unsupported_parameter")
    return "".join(texts)


R = TypeVar("R", bound=BaseModel)

# pydantic puts union member tags ("str", "list[int]", "function-after[...]") in an error's loc: not params
_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def parse_body(model: type[R], raw: bytes) -> R:
    """Validate a raw JSON body; any failure is a 400 ``APIError`` naming the offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


def _validation_error(errors: list[dict]) -> APIError:
    # Of a union's errors, the one of the member whose type matched says what is wrong (for
    # ``stop: [5 strings]`` "at most 4 items", not "should be a valid string").
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0]) if errors else {}
    kind, msg = first.get("type"), first.get("msg", "invalid")
    if kind == "json_invalid":
        hint = (" (a \\uD800-\\uDFFF escape must be half of a surrogate pair: a lone surrogate is not text)"
                if "surrogate" in msg or "hex escape" in msg else "")
        return APIError(400, f"Malformed JSON body: {msg}{hint}.", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]
    param = ".".join(loc) or None
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    text = f"Invalid value for '{param}': {msg}." if param else f"Invalid request body: {msg}."
    return APIError(400, text, param=param, code="invalid_type" if kind and kind.endswith("_type") else "invalid_value")


# ---------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "jaxserve"
    max_model_len: Optional[int] = None
