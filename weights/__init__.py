"""Hugging Face checkpoint loading and tiny-checkpoint helpers.

The exports are resolved lazily (PEP 562): ``weights.tiny`` and ``weights.tiny_tokenizer`` run in
the torch reference environment, which has no JAX, and importing them must not import the loader.
"""

from __future__ import annotations

__all__ = ["load_model", "LoadedModel", "CheckpointError"]


def __getattr__(name: str):
    if name in __all__:
        from weights import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'weights' has no attribute {name!r}")
