"""Ground-truth models: small hybrids we train ourselves so every answer is checkable.

``tasks`` generates the conversations (arithmetic, needle, multi-turn recall) and scores answers,
``tokenizer`` trains the byte-level BPE with Qwen-style specials and chat template, ``train``
trains a qwen3_5 / qwen3_5_moe hybrid with flax + optax + orbax and exports a Hugging Face folder
(its docstring maps the modules it is built from: ``config``, ``start``, ``architecture``,
``data``, ``forward``, ``loop``, ``export``, ``evaluate``, ``grow``). See weights/README.md.
"""
