"""Build a whole engine from a checkpoint folder, and the offline ``LLM`` API in vLLM's spirit.

    llm = LLM("path/to/checkpoint", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
    outs[0].output_ids, outs[0].text, outs[0].finish_reason, outs[0].cached_tokens

``EngineArgs`` carries the flags the CLI and the server share (names follow vLLM / SGLang), and
their defaults: the CLI's flags show these (``jaxserve/cli.py`` reads them, never repeats them).

This module is the engine's assembly, the one place that puts the parts together: checkpoint
loading (``weights.loader``, which sits above the models and below this module), the memory plan,
the pools, the scheduler and the runner. The rest of ``jaxserve.engine`` never imports ``weights``
(``tests/test_layering.py``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxserve.cache.allocator import PageAllocator, SlotAllocator
from jaxserve.config import LINEAR_ATTENTION, SNAPSHOT_INTERVAL, ModelConfig
from jaxserve.cache.radix import HybridRadixCache
from jaxserve.engine.engine import Engine, RequestOutput
from jaxserve.engine.policy import make_policy
from jaxserve.engine import program_store, startup
from jaxserve.engine.pools import MiB, device_budget, init_pools
from jaxserve.engine.runner import Batch, Buckets, DeviceExecutor, Executables, Placement, warmup
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams
from jaxserve.models import backends, decoder
from jaxserve.models.gated_deltanet import use_conv_kernel, use_decode_kernel, use_prefill_kernel
from jaxserve.models.layers import use_attention_kernel
from jaxserve.models.params import abstract_params
from jaxserve.models.vision import compile_buckets, encode_need_bytes
from jaxserve.multimodal.preprocess import (MAX_PIXELS_ENV, ImageProcessing, PixelPatches, decode, default_max_pixels,
                                            preprocess)
from jaxserve.multimodal.prompt import prepare
from jaxserve.parallel import distributed
from jaxserve.parallel.tensor import TensorParallel
from jaxserve.tokenizer import Tokenizer
from weights.loader import check_checkpoint, load_model

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
    # Tokens between the linear-state snapshots a request leaves in the prefix cache (a multiple of
    # the kernels' 64-token chunk). A hit resumes from the last snapshot at or before the shared
    # prefix's end, so a larger interval recomputes up to interval - 1 more tokens a hit; each
    # snapshot is a state of every linear-attention layer (37 MiB for the real-size qwen3_5_moe),
    # so a larger interval writes interval / 64 times fewer of them and holds that many fewer slots.
    snapshot_interval: int = SNAPSHOT_INTERVAL
    policy: str = "fcfs"
    kernels: str = "auto"  # ModelConfig.kernels (jaxserve/models/backends.py)
    # Scan over the repeating layers (stacked params, decoder module doc): each step program holds
    # each distinct layer once, so compiling does not grow with depth (CPU: 2.4-4x faster), and on
    # the H100 the real-size qwen3_5_moe's batch-32 decode step took 10-11 ms against the list
    # layout's 23 ms, batch 1 no slower (benchmarks/RESULTS.md). False: the layers as a list.
    scan_layers: bool = True
    # A mixed program of one row per token bucket beside the full-width one (runner.Buckets): a
    # prompt alone in its step (an idle server, a long prompt's chunks while nothing decodes) then
    # pays for no padding rows. False: half the mixed programs to compile, slower lone prompts.
    one_row_programs: bool = True
    overlap_schedule: bool = True  # plan and dispatch step N+1 while step N runs (Engine docstring)
    debug_snapshot_checksums: bool = False
    progress: bool = True
    # Compile every step program (Buckets.programs()) before returning, so no request waits for a
    # compile (serve: on). Off, a program compiles when a step first needs it.
    compile_all: bool = False
    compile_workers: int | None = None  # programs compiled at once by compile_all; None: startup.default_compile_workers()
    # JAX's persistent compilation cache (startup.enable_compile_cache): True = $JAXSERVE_COMPILE_CACHE,
    # else ~/.cache/jaxserve/xla; False = off; or a directory.
    compile_cache: str | bool = True
    # The resize clamp of image input (jaxserve/multimodal/preprocess.py): None = $JAXSERVE_IMAGE_MAX_PIXELS
    # or ~1 Mpx.
    image_max_pixels: int | None = None
    # Split the model over this many local devices (jaxserve/parallel/tensor.py says how); 1 = one
    # device, no mesh. expert_parallel: split routed experts by expert id instead of by intermediate.
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    # Several processes (hosts) as one runtime (jaxserve/parallel/distributed.py; serve: process 0 leads):
    # all three, or none for the JAXSERVE_* variables or one process. tensor_parallel_size then
    # counts every process's devices.
    coordinator_address: str | None = None  # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None


# Fields that may differ between the processes of one runtime (paths, this process's role, output);
# every other field must be the same in each (``join_processes``).
PER_PROCESS_FIELDS = ("model", "compile_cache", "compile_workers", "progress", "coordinator_address", "process_id")


def join_processes(args: EngineArgs) -> EngineArgs:
    """Join the runtime of several processes ``args`` (or the ``JAXSERVE_*`` variables) name, before
    anything touches a device, and check that every process got the same engine arguments. Returns
    ``args`` with progress output off outside process 0 (its errors still reach stderr); ``args``
    itself in a single process. Idempotent."""
    spec = distributed.DistributedSpec.resolve(args.coordinator_address, args.num_processes, args.process_id)
    if spec is None:
        return args
    distributed.initialize(spec)
    shared = {k: v for k, v in dataclasses.asdict(args).items() if k not in PER_PROCESS_FIELDS}
    distributed.require_same("engine arguments", repr(sorted(shared.items())))
    return dataclasses.replace(args, progress=args.progress and distributed.is_main_process())


def _log(args: EngineArgs, msg: str) -> None:
    if args.progress:
        print(f"jaxserve: {msg}", file=sys.stderr, flush=True)


def _budget(args: EngineArgs, param_bytes: int) -> tuple[int | None, str | None]:
    """(budget in bytes for params + pools + a step's needs, why nothing is measured or None).

    A device that reports its memory gets ``mem_fraction`` of it, measured against (also with
    explicit pool sizes: they must fit beside the step). A CPU reports none: explicit sizes are
    taken as they are, otherwise the pools get ``CPU_BUDGET_BYTES``; nothing is reserved there.

    Over several processes the measured budget is the smallest of any process's (in whole MiB), so
    every process plans the same pools and prefill buckets from it (``distributed``'s docstring)."""
    try:
        budget = device_budget(args.mem_fraction)
    except ValueError:
        pass
    else:
        if jax.process_count() > 1:
            budget = distributed.min_over_processes([budget // MiB])[0] * MiB
        return budget, None
    if args.num_pages is not None and args.num_slots is not None:
        return None, "explicit pool sizes on a device that reports no memory"
    return CPU_BUDGET_BYTES + param_bytes, f"the device reports no memory; pools get {CPU_BUDGET_BYTES >> 20} MiB"


def _compile_all(args: EngineArgs, compiler: startup.StepCompiler, loaded: Callable[[], dict], plan,
                 memory: startup.MemoryPlan, dtype):
    """Compile every program of ``memory.buckets`` against the planned pools' shapes, then (with the
    params ``loaded()`` returns: it waits for a load running meanwhile) allocate the pools, run
    programs once on them (``warmup``) and log what it took. Returns (params, pools, the
    executables: the step calls them directly, ``runner.Executables``).

    Which programs run: with a measured reserve (a device that reports its memory), all of them, so
    the largest steps have run for real before the port opens (on a GPU that costs seconds). On a
    CPU only the smallest of each kind: enough to prove the ahead-of-time executables are the ones
    ``step`` runs (a step or sampler compile during the warm-up would mean they are not), where running the
    8192-token step of even the 7 M-parameter default model takes many seconds.

    A warm-up that fails while programs came from the program store drops the store's programs of
    this build (``ProgramStore.clear``), compiles every program again and runs the warm-up once
    more: a stored program that no longer runs (a platform that did not keep all of it) costs that
    start its speed, never the start itself."""
    cfg, buckets = compiler.cfg, memory.buckets
    programs, samples = buckets.programs(), buckets.sample_programs()
    t0, hits0 = time.perf_counter(), startup.step_cache_hits()
    stored0 = 0 if compiler.store is None else compiler.store.loaded["step"]
    placement = compiler.placement
    run = programs if memory.reserve_bytes else [next(p for p in programs if p[3] == kind) for kind in (False, True)]

    def compile_all() -> tuple[Executables, list]:
        keep = Executables(cfg)
        mems = startup.compile_programs(compiler, startup.pool_structs(cfg, dtype, plan), programs, samples=samples,
                                        workers=args.compile_workers or startup.default_compile_workers(),
                                        progress=args.progress, keep=keep)
        return keep, mems

    executables, mems = compile_all()
    hits, t1 = startup.step_cache_hits() - hits0, time.perf_counter()
    stored = None if compiler.store is None else compiler.store.loaded["step"] - stored0
    params = loaded()
    before = startup.step_compiles() + startup.sample_compiles()
    pools = init_pools(plan, cfg, dtype, None if placement is None else placement.pools)
    try:
        pools = warmup(params, cfg, pools, buckets, programs=run, placement=placement, executables=executables)
    except Exception as e:  # noqa: BLE001 - only a stored program is forgiven: anything else is re-raised
        if compiler.store is None or not sum(compiler.store.loaded.values()):
            raise
        _log(args, f"WARNING: the warm-up failed with programs from the program store ({e!r}); dropping them "
                   f"({compiler.store.dir}) and compiling every program")
        compiler.store.clear()
        for x in jax.tree.leaves(pools):
            if not x.is_deleted():
                x.delete()
        hits0 = startup.step_cache_hits()
        executables, mems = compile_all()
        hits, stored = startup.step_cache_hits() - hits0, 0
        pools = warmup(params, cfg, init_pools(plan, cfg, dtype, None if placement is None else placement.pools),
                       buckets, programs=run, placement=placement, executables=executables)
    again = startup.step_compiles() + startup.sample_compiles() - before
    largest = max((m for m in mems if m is not None), key=lambda m: m.need_bytes, default=None)
    msg = (f"compiled {len(programs)} step programs in {t1 - t0:.1f}s ("
           f"{'' if stored is None else f'{stored} ready-made from the program store, '}{hits} loaded from the compile cache) and "
           f"{len(samples)} sampler programs, ran {'each' if run == programs else f'{len(run)} of them'} once in "
           f"{time.perf_counter() - t1:.1f}s")
    if largest is not None:
        msg += f"; the largest: {largest.describe()} beside params and pools"
        if memory.reserve_bytes:
            msg += f" (reserved {startup.fmt_bytes(memory.reserve_bytes)})"
    _log(args, msg)
    if largest is not None and memory.reserve_bytes and largest.need_bytes > memory.reserve_bytes:
        _log(args, f"WARNING: {largest.describe()}, more than the {startup.fmt_bytes(memory.reserve_bytes)} reserved "
                   f"from {memory.probe.describe()}: steps may run out of memory under load")
    if again:
        _log(args, f"WARNING: {again} step or sampler programs compiled again at warm-up (the ahead-of-time compile "
                   f"missed their cache keys: runner.lower_step / lower_sample no longer match runner.step)")
    return params, pools, executables


def _tensor_parallel(args: EngineArgs) -> TensorParallel | None:
    """The mesh ``args`` ask for (None: one device), its shape checks run on config.json before any
    weight is read, so a size that does not divide the heads fails at once. Over several processes
    there is always a mesh, over every process's devices (``TensorParallel.make``)."""
    if args.tensor_parallel_size == 1 and not args.expert_parallel and jax.process_count() == 1:
        return None
    if args.expert_parallel and args.tensor_parallel_size < 2:
        raise ValueError("expert_parallel splits experts over the tensor-parallel devices: "
                         "give tensor_parallel_size > 1")
    tp = TensorParallel.make(args.tensor_parallel_size, args.expert_parallel)
    tp.configure(dataclasses.replace(ModelConfig.from_file(Path(args.model) / "config.json"), kernels=args.kernels))
    return tp


def _load_in_background(args: EngineArgs, tp: TensorParallel | None):
    """(config, future of ``load_model``) when the weights can load while the step programs compile:
    ``compile_all`` on one device, a text-only model (``abstract_params`` covers the text stack;
    under tensor parallelism the placement is made from the loaded arrays). Compiling needs only
    the params' shapes and takes longer than loading a real-size checkpoint (on the H100 machine
    ~5 min against ~35 s), so the load hides under it. The checkpoint's headers are checked first,
    so a broken checkpoint fails at once, as without the overlap. None: load first."""
    if not args.compile_all or tp is not None:
        return None
    cfg = check_checkpoint(args.model)
    if cfg.vision is not None:
        return None
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-load")
    load = pool.submit(_timed_load, args, None)
    pool.shutdown(wait=False)
    return dataclasses.replace(cfg, kernels=args.kernels), load


def _timed_load(args: EngineArgs, tp: TensorParallel | None):
    """``load_model`` with the engine's settings, its time logged once the arrays are on the device
    (a start-up's phases are then told apart: the load, the compiles, the warm-up)."""
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, progress=args.progress, tensor_parallel=tp,
                       stacked=args.scan_layers)
    jax.block_until_ready(model.params)
    size = sum(x.nbytes for x in jax.tree.leaves(model.params))
    seconds = time.perf_counter() - t0
    _log(args, f"weights loaded in {seconds:.1f}s ({size / 1e9:.2f} GB, {size / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
    return model


def build_engine(args: EngineArgs) -> Engine:
    """Load the checkpoint, plan memory (measuring the largest step where the device reports its
    memory), allocate pools, compile every step program if ``compile_all`` (the weights loading
    meanwhile where they can: ``_load_in_background``), and wire the engine.
    Joins the runtime of several processes first when ``args`` name one (``join_processes``)."""
    args = join_processes(args)
    backends.validate(args.kernels)
    tp = _tensor_parallel(args)
    cache_dir = startup.enable_compile_cache(args.compile_cache)

    dtype = jnp.dtype(args.dtype)
    loading = _load_in_background(args, tp)
    if loading is None:
        model = _timed_load(args, tp)
        cfg, params = dataclasses.replace(model.config, kernels=args.kernels if tp is None else model.config.kernels), model.params
        loaded = lambda: params  # noqa: E731
    else:  # compile against the weights' shapes while the weights load
        cfg, load = loading
        params = abstract_params(cfg, dtype)
        if args.scan_layers:
            params = decoder.stack_layers(cfg, params, decoder.stack_structs)
        loaded = lambda: load.result().params  # noqa: E731
    tokenizer = Tokenizer.from_dir(args.model)
    # "pallas" on shapes a kernel cannot take: one clear error now, not a trace-time one at warm-up
    if cfg.is_hybrid:
        use_decode_kernel(cfg, dtype)
        use_prefill_kernel(cfg)
        use_conv_kernel(cfg)
    if any(t != LINEAR_ATTENTION for t in cfg.layer_types):
        use_attention_kernel(cfg, dtype, args.page_size)
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    buckets = Buckets.for_limits(max_prefill_tokens=args.max_prefill_length, max_seqs=args.max_running_requests,
                                 max_model_len=max_len, page_size=args.page_size,
                                 snapshot_interval=args.snapshot_interval, one_row_programs=args.one_row_programs)
    # the scheduler's promise to the GDN / KDA layers: few rows of more than one token per step
    cfg = dataclasses.replace(cfg, chunked_rows=buckets.chunked_rows)
    placement = None if tp is None else Placement(params, tp.pool_shardings(cfg))
    store_root = program_store.store_dir(cache_dir) if args.compile_all and placement is None else None
    compiler = startup.StepCompiler(params, cfg, buckets, placement, store=program_store.open_store(store_root))
    param_bytes = compiler.param_bytes  # one device's share under tensor parallelism, as is the budget
    budget, unmeasured = _budget(args, param_bytes)
    if args.progress and not unmeasured:
        _log(args, f"measuring the largest step ({buckets.tokens[-1]} tokens) for the memory plan ...")
    memory = startup.plan_memory(
        cfg if tp is None else tp.shard_config(cfg), dtype, buckets, startup.PoolLimits(args.page_size, args.max_running_requests, args.num_pages,
                                                args.num_slots, args.snapshot_fraction),
        budget=budget, param_bytes=param_bytes, log=lambda msg: _log(args, msg),
        measure=None if unmeasured else lambda program, plan: compiler.compile(
            program, startup.pool_structs(cfg, dtype, plan)),
        between_steps=None if unmeasured else _tower_need(args, cfg, params))
    plan, buckets = memory.pools, memory.buckets
    distributed.require_same("memory plan (pool sizes and prefill buckets)", repr((plan, buckets)))
    _log(args, f"{cfg.model_type} ({cfg.num_layers} layers), {args.dtype}{f', {tp.describe()}' if tp else ''}, "
               f"{plan.describe()}{' per device' if tp else ''}; {memory.note}"
               f"{f' ({unmeasured})' if unmeasured else ''}; max prefill {buckets.tokens[-1]} tokens per step, "
               f"{len(buckets.programs())} step programs; compile cache {cache_dir or 'off'}")
    executables = None
    if args.compile_all:
        params, pools, executables = _compile_all(args, compiler, loaded, plan, memory, dtype)
    else:
        params, pools = loaded(), init_pools(plan, cfg, dtype, None if placement is None else placement.pools)
    pages = PageAllocator(plan.num_pages)
    slots = SlotAllocator(plan.num_slots) if cfg.is_hybrid else None
    cache = HybridRadixCache(pages, slots, args.page_size, hybrid=cfg.is_hybrid, snapshot_interval=args.snapshot_interval,
                             max_snapshots_per_path=args.max_snapshots_per_path)
    eos = tuple(sorted(set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids)))
    scheduler = Scheduler(pages=pages, slots=slots, cache=cache, page_size=args.page_size,
                          max_prefill_tokens=buckets.tokens[-1], max_running=args.max_running_requests,
                          max_pages_per_seq=min(buckets.pages_per_seq, -(-max_len // args.page_size)),
                          eos_token_ids=eos, policy=make_policy(args.policy), max_chunked_rows=buckets.chunked_rows,
                          snapshot_interval=args.snapshot_interval)
    executor = DeviceExecutor(params, cfg, pools, buckets, placement, executables)
    engine = Engine(scheduler, executor, vocab_size=cfg.vocab_size, tokenizer=tokenizer,
                    debug_snapshot_checksums=args.debug_snapshot_checksums, overlap=args.overlap_schedule)
    return engine


def lead(engine: Engine) -> distributed.Channel:
    """Make process 0's ``engine`` lead the other processes (``serve``; distributed.py says how):
    its executor sends every device program it runs to the followers (``follow``) first. Returns
    the channel, for the last message: ``channel.send("stop")`` once the engine has stopped (or
    ``"fail"`` when process 0 fails), from the thread that ran the engine or after it ended."""
    channel = distributed.Channel()
    engine.executor.announce = lambda program, batch: channel.send(
        program, None if batch is None else batch._asdict())
    return channel


def follow(engine: Engine) -> None:
    """Run, on a process other than 0, every device program process 0's engine runs (``lead``),
    until process 0 says stop. Only ``engine.executor`` is used: the scheduler lives in process 0.
    Raises ``RuntimeError`` when process 0 failed, ``ConnectionError`` when it is gone.

    A step that fails here is reported and left, as process 0's engine does with its own: the
    same step fails there, and process 0 then sends the reset it decides on, if any."""
    executor, channel = engine.executor, distributed.Channel()
    while True:
        program, arrays = channel.receive()
        if program == "step":
            try:
                executor.launch(Batch(**arrays))
            except Exception:  # noqa: BLE001 - process 0 meets the same failure and decides
                traceback.print_exc()
        elif program == "reset":
            executor.reset()
        elif program == "stop":
            executor.barrier()
            return
        else:
            raise RuntimeError("process 0 failed (its log says why)" if program == "fail" else
                               f"unknown message {program!r} from process 0")


class LLM:
    """Offline batch generation over the full engine (continuous batching, prefix cache)."""

    def __init__(self, model: str, **kwargs):
        self._init(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm._init(args)
        return llm

    def _init(self, args: EngineArgs) -> None:
        args = join_processes(args)
        self.engine = build_engine(args)
        self.images = image_input(args, self.engine)  # None: the model takes no images

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 stop: Sequence[str] = (), images: Sequence[Sequence] | None = None) -> list[RequestOutput]:
        """``images[i]``: prompt i's images (Pillow images, encoded PNG / JPEG / WebP bytes, or
        ``self.images.load``'s output), one per image placeholder token in the prompt (``<|image_pad|>``,
        as the chat template writes it: ``self.images.placeholder``).

        Over several processes every process must call this with the same arguments (checked:
        ``distributed.require_same``); each gets the same outputs."""
        if not images or not any(images):
            distributed.require_same("prompts, sampling parameters and stop strings",
                                     repr((list(prompts), sampling_params, list(stop))))
            return self.engine.generate(prompts, sampling_params, stop)
        if self.images is None:
            raise ValueError("this model has no vision tower; it takes no images")
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
        ids, keys, image_prompts = [], [], []
        for prompt, imgs in zip(prompts, images):
            prompt_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            expanded, cache_ids, image_prompt = self.images.prepare(prompt_ids, imgs or ())
            ids.append(expanded)
            keys.append(cache_ids)
            image_prompts.append(image_prompt if imgs else None)
        distributed.require_same("prompts, images, sampling parameters and stop strings",  # cache ids key the images
                                 repr((ids, keys, sampling_params, list(stop))))
        return self.engine.generate(ids, sampling_params, stop, cache_ids=keys, images=image_prompts)


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """A model's image input: the clamped processor settings, the tower's tokens, and the text a
    chat template writes for one image (``placeholder``: ``<|vision_start|><|image_pad|><|vision_end|>``
    as the Qwen3.5 / Qwen3-VL templates emit it), or None with ``no_placeholder`` saying why, when
    the tokenizer has no such special tokens (a prompt can then carry images only as token ids)."""

    processing: ImageProcessing
    vision: object  # jaxserve.config.VisionConfig
    placeholder: str | None = None
    no_placeholder: str = ""

    def load(self, image) -> PixelPatches:
        """One image (a Pillow image or encoded PNG / JPEG / WebP bytes) -> the tower's input.
        Raises ``ImageError`` naming the problem."""
        if isinstance(image, PixelPatches):
            return image
        if isinstance(image, (bytes, bytearray, memoryview)):
            decoded = decode(bytes(image))
            try:
                return preprocess(decoded, self.processing)
            finally:
                decoded.close()
        return preprocess(image, self.processing)

    def prepare(self, ids: Sequence[int], images: Sequence):
        """Tokenized prompt + its images (Pillow images, encoded bytes or ``load``'s output) ->
        (expanded ids, cache ids, ImagePrompt) for ``Engine.add_request``. Raises ``ImageError`` /
        ``ValueError`` on bad input."""
        patches = [self.load(im) for im in images]
        return prepare(ids, patches, self.vision.image_token_id, self.vision.spatial_merge_size)


def image_placeholder(tokenizer, vision) -> tuple[str | None, str]:
    """(the text of one image's placeholder, None and why not). The vision start, image and vision
    end ids must be special tokens of the tokenizer (skipped when decoding), so that no text can
    tokenize to an image placeholder and every placeholder comes from an image."""
    ids = (vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id)
    names = ("vision start", "image", "vision end")
    parts = []
    for tid, name in zip(ids, names):
        token = tokenizer.id_to_token(tid) if 0 <= tid < tokenizer.vocab_size else None
        if token is None:
            return None, f"its {name} token id {tid} is not in the tokenizer"
        if tokenizer.decode([tid], skip_special_tokens=True) != "":
            return None, (f"its {name} token id {tid} is the text token {tokenizer.decode([tid])!r}, not a special "
                          f"token like <|image_pad|>")
        parts.append(token)
    text = "".join(parts)
    if [t for t in tokenizer.encode(text) if t in ids] != list(ids):
        return None, f"{text!r} does not tokenize to the ids {list(ids)}"
    return text, ""


def _image_processing(args: EngineArgs, vision) -> tuple[ImageProcessing, int, str]:
    """(the checkpoint's image processing under the resize clamp, the clamp, where it came from)."""
    if args.image_max_pixels is not None and args.image_max_pixels < 1:
        raise ValueError(f"image_max_pixels must be >= 1, got {args.image_max_pixels}")
    max_pixels = args.image_max_pixels or default_max_pixels()
    source = ("image_max_pixels" if args.image_max_pixels else
              f"${MAX_PIXELS_ENV}" if os.environ.get(MAX_PIXELS_ENV) else "the default")
    return ImageProcessing.from_checkpoint(args.model, vision).clamped(max_pixels), max_pixels, source


def _tower_need(args: EngineArgs, cfg, params) -> tuple[str, int] | None:
    """What the vision tower's largest program (an image at the resize clamp) needs, for the memory
    plan (``startup.plan_memory``'s ``between_steps``); None without a tower or a memory analysis."""
    if cfg.vision is None or "vision" not in params:
        return None
    processing = _image_processing(args, cfg.vision)[0]
    need = encode_need_bytes(params["vision"], cfg.vision, processing.max_pixels // processing.patch_size**2)
    return None if need is None else (f"the vision tower at {need[0]} patches", need[1])


def image_input(args: EngineArgs, engine: Engine) -> ImageInput | None:
    """The image input of ``args.model`` (None without a vision tower), its resize clamp said once:
    ``args.image_max_pixels``, else ``$JAXSERVE_IMAGE_MAX_PIXELS``, else ~1 Mpx."""
    vision = engine.executor.cfg.vision
    if vision is None:
        return None
    processing, max_pixels, source = _image_processing(args, vision)
    placeholder, why = image_placeholder(engine.tokenizer, vision) if engine.tokenizer is not None else (None, "no tokenizer")
    _log(args, f"images: resized to at most {processing.max_pixels} pixels ({max_pixels} from {source}; "
               f"{processing.factor}x{processing.factor} pixels per soft token, so at most "
               f"{processing.max_pixels // processing.factor**2} soft tokens an image)"
               + ("" if placeholder else f"; chat prompts cannot take images: {why}"))
    if args.compile_all:  # every tower program an image up to the clamp needs, before serving
        compile_buckets(engine.executor.params["vision"], vision, processing.max_pixels // processing.patch_size**2, engine.executor.buckets.tokens)
    return ImageInput(processing, vision, placeholder, why)
