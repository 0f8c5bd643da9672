"""What a request asks for, checked once where it enters: ``SamplingParams`` and prompt-id checks.

The bottom of the package (ARCHITECTURE.md, "Imports point down"): plain Python, no JAX and no model
code, so the request type, the scheduler, the server's protocol layer and the simulator can all use
it without loading the models. ``tests/test_layering.py`` keeps it that way.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Scheduling, read only by policies (jaxserve/engine/policy.py): lower priority values go first
    # under ``--policy priority`` (vLLM's convention); ``tenant`` is whom ``--policy fair`` shares by.
    priority: int = 0
    tenant: str = ""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``prompt_ids`` is a non-empty run of ids in ``[0, vocab_size)``:
    an id outside the vocabulary has no embedding row, and a jitted step indexing past the table
    does not raise, so the check happens here, before the request is queued."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
