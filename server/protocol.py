"""Request and response bodies in OpenAI's shapes (pydantic), and OpenAI's error JSON.

Requests ignore fields they do not know (as vLLM does: clients send vendor extensions), but a
field we know and cannot honour (n > 1, best_of, logit_bias, tools, echo, penalties, ...) is a
400 that names it: silently ignoring it would return something the client did not ask for.
Extensions beyond OpenAI's API, with vLLM's names: ``top_k``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error with OpenAI's JSON body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Optional[Union[str, list[str]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # extension
    seed: Optional[int] = None
    n: Optional[int] = 1
    max_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = False  # extension
    stop_token_ids: Optional[list[int]] = None  # extension
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

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
        return bool(self.stream and self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    best_of: Optional[int] = None
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
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
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
