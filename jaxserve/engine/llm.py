"""Build a whole engine from a checkpoint folder, and the offline ``LLM`` API in vLLM's spirit.

    llm = LLM("path/to/checkpoint", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
    outs[0].output_ids, outs[0].text, outs[0].finish_reason, outs[0].cached_tokens

``EngineArgs`` carries the flags the CLI and the server share (names follow vLLM / SGLang).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxserve.cache.allocator import PageAllocator, SlotAllocator
from jaxserve.config import LINEAR_ATTENTION
from jaxserve.cache.radix import HybridRadixCache
from jaxserve.engine.engine import Engine, RequestOutput
from jaxserve.engine.policy import make_policy
from jaxserve.engine.pools import device_budget, init_pools, plan_pools
from jaxserve.engine.runner import Buckets, DeviceExecutor
from jaxserve.engine.scheduler import Scheduler
from jaxserve.generate import SamplingParams
from jaxserve.models import backends
from jaxserve.models.gated_deltanet import use_conv_kernel, use_decode_kernel, use_prefill_kernel
from jaxserve.models.layers import use_attention_kernel
from jaxserve.tokenizer import Tokenizer

CPU_BUDGET_BYTES = 512 << 20  # a CPU device reports no memory; pools default to this budget there


@dataclasses.dataclass
class EngineArgs:
    model: str
    dtype: str = "bfloat16"
    page_size: int = 16
    max_prefill_length: int = 8192  # tokens per step (chunked prefill budget)
    max_running_requests: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    mem_fraction: float = 0.85  # of device memory for params + pools (GPU)
    num_pages: int | None = None
    num_slots: int | None = None
    snapshot_fraction: float = 0.25
    max_snapshots_per_path: int | None = None  # bound the tree's snapshots on any root..leaf path
    policy: str = "fcfs"
    kernels: str = "auto"  # ModelConfig.kernels (jaxserve/models/backends.py)
    debug_snapshot_checksums: bool = False
    debug_fault: str | None = None  # TEST ONLY: "stale-snapshot" / "wrong-snapshot" corrupt every hit (Scheduler)
    progress: bool = True


def build_engine(args: EngineArgs) -> Engine:
    from weights import load_model

    backends.validate(args.kernels)

    model = load_model(args.model, dtype=args.dtype, progress=args.progress)
    cfg, params = dataclasses.replace(model.config, kernels=args.kernels), model.params
    tokenizer = Tokenizer.from_dir(args.model)
    dtype = jnp.dtype(args.dtype)
    # "pallas" on shapes a kernel cannot take: one clear error now, not a trace-time one at warm-up
    if cfg.is_hybrid:
        use_decode_kernel(cfg, dtype)
        use_prefill_kernel(cfg)
        use_conv_kernel(cfg)
    if any(t != LINEAR_ATTENTION for t in cfg.layer_types):
        use_attention_kernel(cfg, dtype, args.page_size)
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    mem_bytes = None
    if args.num_pages is None or args.num_slots is None:
        try:
            mem_bytes = device_budget(args.mem_fraction)
        except ValueError:
            mem_bytes = CPU_BUDGET_BYTES + param_bytes
    plan = plan_pools(cfg, dtype, page_size=args.page_size, max_seqs=args.max_running_requests, mem_bytes=mem_bytes,
                      param_bytes=param_bytes if mem_bytes else 0, num_pages=args.num_pages, num_slots=args.num_slots,
                      snapshot_fraction=args.snapshot_fraction)
    if args.progress:
        print(f"jaxserve: {cfg.model_type} ({cfg.num_layers} layers), {args.dtype}, {plan.describe()}", file=sys.stderr)
    pools = init_pools(plan, cfg, dtype)
    buckets = Buckets.for_limits(max_prefill_tokens=args.max_prefill_length, max_seqs=args.max_running_requests,
                                 max_model_len=max_len, page_size=args.page_size)
    pages = PageAllocator(plan.num_pages)
    slots = SlotAllocator(plan.num_slots) if cfg.is_hybrid else None
    cache = HybridRadixCache(pages, slots, args.page_size, hybrid=cfg.is_hybrid,
                             max_snapshots_per_path=args.max_snapshots_per_path)
    eos = tuple(sorted(set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids)))
    scheduler = Scheduler(pages=pages, slots=slots, cache=cache, page_size=args.page_size,
                          max_prefill_tokens=args.max_prefill_length, max_running=args.max_running_requests,
                          max_pages_per_seq=min(buckets.pages_per_seq, -(-max_len // args.page_size)),
                          eos_token_ids=eos, policy=make_policy(args.policy))
    scheduler.debug_fault = args.debug_fault
    executor = DeviceExecutor(params, cfg, pools, buckets)
    engine = Engine(scheduler, executor, vocab_size=cfg.vocab_size, tokenizer=tokenizer,
                    debug_snapshot_checksums=args.debug_snapshot_checksums)
    return engine


class LLM:
    """Offline batch generation over the full engine (continuous batching, prefix cache)."""

    def __init__(self, model: str, **kwargs):
        self.engine = build_engine(EngineArgs(model=model, **kwargs))

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 stop: Sequence[str] = ()) -> list[RequestOutput]:
        return self.engine.generate(prompts, sampling_params, stop)
