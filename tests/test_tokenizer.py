"""jaxserve.tokenizer against transformers' AutoTokenizer on the tiny tokenizer.

The torch side (tests/reference/tokenizer_oracle.py) writes the tokenizer with
weights.tiny_tokenizer, so the files are exactly what ``save_pretrained`` writes, and answers every
case below; our Tokenizer must give the same ids, the same text and the same rendered chats.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.tokenizer import IncrementalDecoder, Tokenizer
from tests.reference.bridge import run_torch

VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines",
    "Numbers: 3.14159, 1024, -42, 2024-06-01 12:30:45, $19.99",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 中文字符, 日本語, 한국어",
    "emoji: 👋🌍 🎉👨‍👩‍👧‍👦 🇫🇷 ✔️",
    "combining: e\u0301 vs \u00e9, A\u030a",  # NFC normaliser
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "not special: <|im_ <|im_end| |im_end|> <|unknown|>",
    "code:\n    def f(x):\n        return x * 2  # double\n",
    "\u0000\u0001 control \u007f chars and \ufffd replacement",
]

# Default template (the one tiny_tokenizer ships) on several conversations.
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and ünïcode."},
    ],
    [{"role": "user", "content": "multi\nline\n\n  content  "}],
]

# A template in the style of Qwen3's: tools, namespace, tojson with options, loop controls,
# raise_exception, {% generation %}, reasoning aliases, plain ({% %}) tags so trim/lstrip matter.
RICH_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{% for message in messages %}
    {% if message.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}
    {% if message.role == 'system' and tools %}{% continue %}{% endif %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
{{ '<|im_start|>' + message.role + '\\n' }}
    {%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}
<think>
{{ message.reasoning_content }}
</think>

    {% endif %}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content | default('') }}{% endgeneration %}
    {%- elif message.content is string %}{{ message.content }}
    {%- else %}{% for part in message.content %}[{{ part.type }}:{{ part.text | default('') }}]{% endfor %}
    {%- endif %}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}

<tool_call>
{{ call.function | tojson(indent=2, sort_keys=True) }}
</tool_call>
        {%- endfor %}
    {%- endif %}
{{ '<|im_end|>' }}
{% endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
{{- '[pad=' + pad_token + ']' if show_pad | default(false) else '' }}
{{- '[bos=' + (bos_token | default('none')) + ']' }}
{{- '' if strftime_now('%Y') | length == 4 else 'bad year' }}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, e.g. Zürich",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

RICH_CHATS = [
    {"messages": [{"role": "user", "content": "Hi <b>&</b>"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "weather in Zürich?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "need a tool",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
            },
            {"role": "tool", "content": "{\"temp\": 7}"},
        ],
        "tools": TOOLS,
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False, "show_pad": True},
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]},
            {"role": "assistant", "content": "ok", "thinking": "alias of reasoning_content"},
            {"role": "stop", "content": "x"},
            {"role": "user", "content": "never rendered"},
        ],
        "add_generation_prompt": False,
    },
    {"messages": [{"role": "user", "content": "a"}, {"role": "bad", "content": "b"}], "add_generation_prompt": True},
]


def _id_lists() -> list[list[int]]:
    rng = random.Random(0)
    lists = [[], [VOCAB - 1], [VOCAB - 3, 5, VOCAB - 2]]
    for n in (1, 2, 3, 7, 20, 64):
        for _ in range(4):
            lists.append([rng.randrange(VOCAB) for _ in range(n)])
    return lists


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    base = tmp_path_factory.mktemp("tokenizer")
    chats = [{"messages": m, "add_generation_prompt": g} for m in CONVERSATIONS for g in (True, False)]
    chats += [{**c, "chat_template": RICH_TEMPLATE} for c in RICH_CHATS]
    cases = {"vocab_size": VOCAB, "texts": TEXTS, "id_lists": _id_lists(), "chats": chats}
    (base / "cases.json").write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
    run_torch(
        "tests.reference.tokenizer_oracle",
        "--cases", str(base / "cases.json"), "--out-dir", str(base / "tok"), "--result", str(base / "result.json"),
    )
    result = json.loads((base / "result.json").read_text(encoding="utf-8"))
    return cases, result, base / "tok"


@pytest.fixture(scope="module")
def tok(oracle):
    return Tokenizer.from_dir(oracle[2])


def test_tiny_tokenizer_files(oracle, tok):
    _, result, folder = oracle
    assert result["deterministic"], "weights.tiny_tokenizer wrote different files on two runs"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(result["files"])
    assert result["len"] == VOCAB == tok.vocab_size
    assert [tok.token_to_id(s) for s in SPECIALS] == [VOCAB - 3, VOCAB - 2, VOCAB - 1]
    assert tok.eos_token_ids == {result["eos_token_id"]} == {VOCAB - 1}
    # The corpus is big enough that common words are single tokens.
    assert len(tok.encode(" the")) == 1 and len(tok.encode(" and")) == 1


def test_encode_matches_transformers(oracle, tok):
    cases, result, _ = oracle
    for text, expected in zip(cases["texts"], result["encode"], strict=True):
        assert tok.encode(text) == expected, text


def test_decode_matches_transformers(oracle, tok):
    cases, result, _ = oracle
    for ids, skip, keep in zip(cases["id_lists"], result["decode_skip"], result["decode_keep"], strict=True):
        assert tok.decode(ids) == skip, ids
        assert tok.decode(ids, skip_special_tokens=False) == keep, ids


def test_chat_template_matches_transformers(oracle, tok):
    cases, result, _ = oracle
    for case, expected in zip(cases["chats"], result["chats"], strict=True):
        kwargs = dict(case.get("kwargs", {}), tools=case.get("tools"), chat_template=case.get("chat_template"))
        if "error" in expected:
            with pytest.raises(Exception) as info:
                tok.apply_chat_template(case["messages"], case["add_generation_prompt"], **kwargs)
            assert type(info.value).__name__ == expected["error"] and str(info.value) == expected["message"]
        else:
            assert tok.apply_chat_template(case["messages"], case["add_generation_prompt"], **kwargs) == expected["text"]


def test_chat_template_default_shape(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_sources_and_eos(oracle, tmp_path):
    """chat_template.jinja beats tokenizer_config.json (as in transformers v5); the legacy
    tokenizer_config entry (string or named list) works alone; generation_config adds EOS ids."""
    src = oracle[2]
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    msgs = [{"role": "user", "content": "x"}]

    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "CONFIG {{ messages[0].content }}"}))
    assert Tokenizer.from_dir(folder).apply_chat_template(msgs) == "CONFIG x"
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    assert Tokenizer.from_dir(folder).apply_chat_template(msgs) == "FILE x"
    (folder / "chat_template.jinja").unlink()

    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    t = Tokenizer.from_dir(folder)
    assert t.apply_chat_template(msgs) == "D"
    assert t.apply_chat_template(msgs, tools=TOOLS) == "T"
    assert t.apply_chat_template(msgs, chat_template="tool_use") == "T"

    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [VOCAB - 3, VOCAB - 1]}))
    assert Tokenizer.from_dir(folder).eos_token_ids == {VOCAB - 3, VOCAB - 1}


def test_errors_name_the_file(oracle, tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((oracle[2] / "tokenizer.json").read_bytes())
    t = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json: still encodes
    assert t.encode("hello") and t.eos_token_ids == set()
    with pytest.raises(ValueError, match=f"{tmp_path}.*no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="empty conversation"):
        Tokenizer.from_dir(oracle[2]).apply_chat_template([])


# -- streaming detokenizer ----------------------------------------------------------------------


def _stream(tok, ids, skip):
    dec = IncrementalDecoder(tok, skip_special_tokens=skip)
    pieces = [dec.feed(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=40), skip=st.booleans())
def test_incremental_decoder_reproduces_decode(tok, ids, skip):
    assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_incremental_decoder_never_splits_characters(tok, text):
    """Each byte-level token may carry part of a character; streamed pieces never do."""
    ids = tok.encode(text)
    pieces = _stream(tok, ids, True)
    assert "".join(pieces) == tok.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_emoji_pieces(tok):
    ids = tok.encode("a👋b")
    assert len(ids) > 3  # the emoji's 4 bytes span several tokens
    pieces = _stream(tok, ids, True)
    assert "".join(pieces) == "a👋b" and "👋" in pieces and pieces[-1] == ""
