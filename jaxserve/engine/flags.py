"""The engine's command-line flags, shared by every command that builds an engine (``serve``,
``generate``, ``sim calibrate`` / ``validate``): one parser section whose defaults are
``EngineArgs``', and its checked conversion back to ``EngineArgs``. Importing it loads no JAX (the
engine's modules load when a command uses them), so ``--help`` and host-only commands stay light."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "weights" / "default"


class UsageError(Exception):
    """A command line that cannot run (exit status 2, no traceback)."""


def engine_args(args: argparse.Namespace, progress: bool):
    """``EngineArgs`` from a parser ``add_engine_flags`` built (``args.command``: the command that
    parsed them, ``serve`` compiles everything); a bad value is a ``UsageError`` before anything loads."""
    from jaxserve.engine.llm import EngineArgs

    if not 0 < args.mem_fraction <= 1:
        raise UsageError(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    if args.compile_workers is not None and args.compile_workers < 1:
        raise UsageError(f"--compile-workers must be >= 1, got {args.compile_workers}")
    if args.tensor_parallel_size < 1 or (args.expert_parallel and args.tensor_parallel_size < 2):
        raise UsageError(f"--tensor-parallel-size must be >= 1 (and >= 2 with --expert-parallel), "
                         f"got {args.tensor_parallel_size}")
    if args.snapshot_interval < 64 or args.snapshot_interval % 64:
        raise UsageError(f"--snapshot-interval must be a multiple of 64 (the linear-attention kernels' chunk), "
                         f"got {args.snapshot_interval}")
    if args.image_max_pixels is not None and args.image_max_pixels < 1:
        raise UsageError(f"--image-max-pixels must be >= 1, got {args.image_max_pixels}")
    from jaxserve.engine.policy import make_policy

    make_policy(args.policy)  # an unknown policy is a usage error before anything loads
    return EngineArgs(
        model=args.model or str(DEFAULT_MODEL_DIR), dtype=args.dtype, page_size=args.page_size,
        max_prefill_length=args.max_prefill_length, max_running_requests=args.max_running_requests,
        num_pages=args.num_pages, num_slots=args.num_slots, policy=args.policy, kernels=args.kernels,
        snapshot_interval=args.snapshot_interval,
        scan_layers=args.scan_layers, one_row_programs=args.one_row_programs,
        overlap_schedule=not args.disable_overlap_schedule, mem_fraction=args.mem_fraction,
        compile_all=args.command == "serve", compile_workers=args.compile_workers,
        compile_cache=False if args.no_compile_cache else (args.compile_cache or True),
        image_max_pixels=args.image_max_pixels, tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel, progress=progress, coordinator_address=args.coordinator_address,
        num_processes=args.num_processes, process_id=args.process_id,
        **({"max_model_len": args.max_model_len, "debug_snapshot_checksums": args.debug_snapshot_checksums}
           if args.command == "serve" else {}))


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags (serve and generate); their defaults are ``EngineArgs``'."""
    from jaxserve.engine.llm import EngineArgs

    d = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    p.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the model shipped in weights/default)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d["dtype"],
                   help="parameter and activation dtype (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=d["page_size"], metavar="N",
                   help="tokens per KV page; 64 must be a multiple of it (default: %(default)s)")
    p.add_argument("--max-prefill-length", type=int, default=d["max_prefill_length"], metavar="N",
                   help="tokens per step: the chunked-prefill budget (default: %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=d["max_running_requests"], metavar="N",
                   help="requests in one step's batch (default: %(default)s)")
    p.add_argument("--num-pages", type=int, default=d["num_pages"], metavar="N",
                   help="KV pages (default: from the memory budget)")
    p.add_argument("--num-slots", type=int, default=d["num_slots"], metavar="N",
                   help="linear-state slots (default: from the memory budget)")
    p.add_argument("--snapshot-interval", type=int, default=d["snapshot_interval"], metavar="N",
                   help="tokens between the linear-attention state snapshots a request leaves in the prefix cache, "
                        "a multiple of 64: larger writes N/64 times fewer (each a state of every linear layer) "
                        "and holds fewer slots, but a hit recomputes up to N-1 more tokens (default: %(default)s)")
    p.add_argument("--policy", default=d["policy"],
                   help="scheduling policy: fcfs, lpm, dfs-weight, priority, spjf, fair, or a plug-in "
                        "package.module:ClassName (jaxserve/engine/policy.py) (default: %(default)s)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="plan each step only after the previous one finished (default: step N+1 is planned and "
                        "dispatched while step N runs, hiding the host's time)")
    p.add_argument("--kernels", default=d["kernels"],
                   help="mixer backends: auto (on a GPU, the kernels verified there), jnp, pallas (the Pallas "
                        "Mosaic GPU kernels but prefill_fused, prefill_prep and linear), or a list of them from "
                        "gdn_decode, gdn_prefill, paged_attention, conv1d, moe, linear (a decode step's dense "
                        "projections), prefill_fused (the whole-chunk GDN / KDA prefill in one kernel; instead of "
                        "gdn_prefill), prefill_prep (GDN's intra-chunk terms by a kernel, not yet run on a GPU; "
                        "instead of gdn_prefill), e.g. prefill_fused,gdn_decode (default: %(default)s)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=d["scan_layers"],
                   help="run the repeating layers as one scan over stacked weights: step programs compile "
                        "2.4-4x faster (CPU) and the real-size MoE's batch-32 decode step ran 2x faster on an "
                        "H100; --no-scan-layers runs them as a list (default: %(default)s)")
    p.add_argument("--one-row-programs", action=argparse.BooleanOptionalAction, default=d["one_row_programs"],
                   help="also compile a one-row program per prefill token bucket, so a prompt alone in its step "
                        "(an idle server, a long prompt) pays for no padding rows; --no-one-row-programs "
                        "compiles half the prefill programs (default: %(default)s)")
    p.add_argument("--mem-fraction", type=float, default=d["mem_fraction"], metavar="F",
                   help="share of the device's memory for params, pools and the largest step's temporaries "
                        "(measured at start-up); ignored on a CPU (default: %(default)s)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache (default: $JAXSERVE_COMPILE_CACHE, else "
                        "~/.cache/jaxserve/xla), and the program store beside it (DIR-programs): a second start "
                        "loads the compiled programs ready-made instead of compiling them")
    p.add_argument("--no-compile-cache", action="store_true", help="no persistent compilation cache, no program store")
    p.add_argument("--compile-workers", type=int, default=d["compile_workers"], metavar="N",
                   help="serve: step programs compiled at once at start-up (default: half the CPU cores, "
                        "at most 8)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=d["tensor_parallel_size"], metavar="N",
                   help="split the model over N devices (over several processes: all of every process's): "
                        "heads, MLP and expert intermediates, KV pages and linear-state slots by head (the jnp "
                        "backends run; default: %(default)s)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: split routed experts by expert id instead of by intermediate")
    hosts = ("several processes (hosts) as one runtime (serve: process 0 serves HTTP, the others follow its "
             "steps); all three or none")
    p.add_argument("--coordinator-address", default=d["coordinator_address"], metavar="HOST:PORT",
                   help=f"{hosts}: process 0's address, reachable from every process (default: "
                        f"$JAXSERVE_COORDINATOR_ADDRESS); --tensor-parallel-size then counts every process's devices")
    p.add_argument("--num-processes", type=int, default=d["num_processes"], metavar="N",
                   help=f"{hosts}: processes in all (default: $JAXSERVE_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=d["process_id"], metavar="I",
                   help=f"{hosts}: this process, 0..N-1; 0 prints the results or serves (default: $JAXSERVE_PROCESS_ID)")
    from jaxserve.multimodal.preprocess import DEFAULT_MAX_PIXELS, MAX_PIXELS_ENV

    p.add_argument("--image-max-pixels", type=int, default=d["image_max_pixels"], metavar="N",
                   help=f"models with a vision tower: an image larger than N pixels is resized down to at most N "
                        f"(aspect kept), bounding its soft tokens (default: ${MAX_PIXELS_ENV}, else "
                        f"{DEFAULT_MAX_PIXELS} = ~1 Mpx)")
