"""Tokenizer, chat template and streaming detokenizer, read from a Hugging Face checkpoint folder.

The contract is fidelity to transformers (v5), which is what the model was trained and evaluated
with: ``encode`` returns ``AutoTokenizer(...)(text)["input_ids"]``, ``decode`` its ``decode``, and
``apply_chat_template`` its ``apply_chat_template(..., tokenize=False)``, byte for byte. The tests
check all three against transformers on the same files. Where this module deviates it says so.

Files read (as transformers reads them):
- ``tokenizer.json`` (required): the ``tokenizers`` pipeline, used as is. Its post-processor decides
  whether a BOS/EOS is added: transformers v5 drops ``add_bos_token``/``add_eos_token`` from
  tokenizer_config.json whenever tokenizer.json exists, so we ignore them too. Truncation and
  padding stored in tokenizer.json are switched off, as ``tokenizer(text)`` does.
- ``tokenizer_config.json``: named special tokens (for the template's ``bos_token`` etc. and for
  EOS), ``split_special_tokens``, ``clean_up_tokenization_spaces`` and a chat template.
- ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (what v5 writes): when present
  they take priority over templates in tokenizer_config.json, as in transformers; the legacy
  ``chat_template.json`` (processor format) is the last resort.
- ``generation_config.json``: its ``eos_token_id`` (int or list) joins ``eos_token_ids``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _compile_template(source: str):
    """Compile a chat template the way transformers does (chat_template_utils._compile_jinja_template):
    an immutable sandbox with trim_blocks/lstrip_blocks and loop controls; ``tojson`` without
    HTML escaping and with indent/separators/sort_keys; ``raise_exception``; ``strftime_now``.
    Chat templates come from the Hub, so they are untrusted code: the sandbox is not optional."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant spans for training masks in
        transformers; for serving it only has to render its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A checkpoint's tokenizer. Build with ``Tokenizer.from_dir(folder)``."""

    def __init__(
        self,
        backend,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
        source: str = "<memory>",
    ):
        self._tok = backend
        self._tok.no_truncation()
        self._tok.no_padding()
        self.special_tokens = dict(special_tokens or {})
        self.chat_templates = dict(chat_templates or {})
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.source = source
        # transformers skips the clean-up for BPE models (it corrupts them); so do we.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        self._compiled: dict[str, Any] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as _Backend

        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{tok_file}: no tokenizer.json in {folder} (only fast tokenizers are supported)")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{tok_file}: cannot be read by the tokenizers library ({e})") from None

        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        special = {k: c for k in SPECIAL_TOKEN_ATTRIBUTES if (c := _token_content(config.get(k))) is not None}
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        eos_ids: set[int] = set()
        if "eos_token" in special:
            eos_id = backend.token_to_id(special["eos_token"])
            if eos_id is None:
                raise ValueError(f"{config_file}: eos_token {special['eos_token']!r} is not in {tok_file}")
            eos_ids.add(eos_id)
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            gen_eos = _read_json(gen_file).get("eos_token_id")
            eos_ids.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])

        return cls(
            backend,
            special_tokens=special,
            chat_templates=cls._find_chat_templates(folder, config),
            eos_token_ids=eos_ids,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            source=str(folder),
        )

    @staticmethod
    def _find_chat_templates(folder: Path, config: dict) -> dict[str, str]:
        """Named templates ("default" for the main one), in transformers' priority order."""
        templates: dict[str, str] = {}
        main = folder / "chat_template.jinja"
        if main.is_file():
            templates["default"] = main.read_text(encoding="utf-8")
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                templates[f.stem] = f.read_text(encoding="utf-8")
        if templates:
            return templates
        raw = config.get("chat_template")
        if raw is None and (folder / "chat_template.json").is_file():
            raw = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(raw, str):
            return {"default": raw}
        if isinstance(raw, list):
            return {t["name"]: t["template"] for t in raw}
        return {}

    # -- text <-> ids -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (regular + added tokens), i.e. ``len(hf_tokenizer)``.
        The model's embedding may have more rows (padding); it never has fewer."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # The batch call gives the same ids and, unlike ``encode``, releases the GIL while it works:
        # a server tokenizing a long prompt in a worker thread keeps its event loop running.
        return self._tok.encode_batch_fast([text], add_special_tokens=True)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -- chat -----------------------------------------------------------------------------------

    def get_chat_template(self, name: str | None = None, tools: list | None = None) -> str:
        """The template source transformers would pick: ``name`` if it names one of the checkpoint's
        templates, else ``name`` itself as template source; with no name, ``tool_use`` when tools
        are given and it exists, else ``default``."""
        if name is not None:
            return self.chat_templates.get(name, name)
        if not self.chat_templates:
            raise ValueError(
                f"{self.source}: no chat template (looked in chat_template.jinja, tokenizer_config.json "
                "and chat_template.json); this checkpoint is not a chat model or ships its template elsewhere"
            )
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise ValueError(f"{self.source}: several chat templates and no default: {sorted(self.chat_templates)}")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list | None = None,
        documents: list | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to a prompt string, as transformers'
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` does: keys whose
        value is None are dropped from each message (templates crash on ``content: None``), the
        reasoning aliases (``reasoning_content``/``thinking``/``reasoning``) are filled in from one
        another, and the named special tokens are template variables, overridable by ``kwargs``.
        ``chat_template`` may name one of the checkpoint's templates or be a template. (Not supported:
        ``continue_final_message`` and callables as tools; pass JSON-schema dicts.)"""
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        source = self.get_chat_template(chat_template, tools)
        if source not in self._compiled:
            self._compiled[source] = _compile_template(source)
        chat = []
        for m in messages:
            m = {k: v for k, v in dict(m).items() if v is not None}
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        variables = {**self.special_tokens, **kwargs}
        return self._compiled[source].render(
            messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
        )


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (for WordPiece-era tokenizers that ask for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class IncrementalDecoder:
    """Streaming detokenizer: ``feed(id)`` returns the text completed by that id ('' if none yet),
    ``flush()`` returns whatever is left at the end.

    Invariant: ``"".join(feed(i) for i in ids) + flush() == tokenizer.decode(ids)``, and no piece
    ends inside a multi-byte UTF-8 character (a piece is withheld while the decoded text ends in
    U+FFFD, which is how an incomplete byte sequence decodes).

    How: the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is new. Decoding from
    ``prefix`` (the start of the previous emitted piece) rather than from ``read`` gives decoders
    that depend on context (a Metaspace decoder drops the leading space of a sequence) the same
    context in both decodes, and every window starts where an earlier piece ended on a complete
    character, so lossy UTF-8 decoding of the window agrees with that of the whole. Cost per token
    is the length of one or two pieces, not of the whole sequence. (tokenizers' own DecodeStream
    uses the same scheme but has no flush: trailing invalid bytes would be lost.)

    Exact for decoders whose output for a sequence extends their output for its prefixes (byte-level
    BPE, Metaspace, WordPiece without clean-up); not for ``clean_up_tokenization_spaces`` tokenizers.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this have been emitted
        self._prefix_text = ""  # decode(ids[prefix:read]), refreshed when a piece is emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, new_text: str) -> str:
        piece = new_text[len(self._prefix_text) :]
        del self._ids[: self._read]  # ids before the new window are never decoded again
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return piece

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            return self._advance(new_text)
        return ""

    def flush(self) -> str:
        """The rest (possibly ending in U+FFFD for a truncated character); a second flush returns ''."""
        return self._advance(self._decode(self._ids[self._prefix :]))
