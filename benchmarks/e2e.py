"""End-to-end serving benchmark on the GPU: a real-size random checkpoint, ``jaxserve serve`` over
HTTP, ``jaxserve bench`` workloads, and HF transformers' ``generate`` on the same checkpoint as the
torch reference row. Device-only; one JSON file of rows (``--out``).

    python benchmarks/e2e.py --config benchmarks/configs/qwen3_5_moe-6b.json --ckpt runs/e2e-ck \
        --out $OUT/e2e.json [--rows decode1,decode32,prefix,prefill] [--hf] [--restart] [-- extra serve flags]

Each row: workload, concurrency, output and total tok/s, TTFT/TPOT p50/p99, the roofline of the row
(HBM bytes a step must read / measured bandwidth) and the share of it reached. Start-up (load,
compile) is timed from the server's log; `--restart` starts it a second time, its programs from the persistent
compile cache. The checkpoint is written once (numpy, ~1 min for 6 B
parameters) and reused while the machine stays warm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COPY_BYTES_PER_S = {"H200": 4.0e12, "H100": 3.0e12}  # measured elementwise copy (benchmarks/RESULTS.md)


def hbm_bytes_per_s() -> float:
    """The card's measured copy bandwidth, by its name (nvidia-smi: this process must not start
    JAX on the GPU beside the server); the H200's when the name is neither."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        name = ""
    return next((bw for card, bw in COPY_BYTES_PER_S.items() if card in name), COPY_BYTES_PER_S["H200"])


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def active_bytes(cfg, tokens_per_step: int) -> float:
    """HBM bytes one decode step must read: embeddings rows aside, every dense weight once, and the
    experts the step's tokens route to (expected distinct experts of ``tokens_per_step`` tokens each
    picking top-k of E uniformly)."""
    from jaxserve.models.params import hf_shapes

    total, expert = 0, 0
    for name, shape in hf_shapes(cfg).items():
        n = int(np.prod(shape)) * 2
        if "embed_tokens" in name:
            continue
        if ".experts." in name or name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            expert += n
        else:
            total += n
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    used = E * (1 - (1 - k / E) ** tokens_per_step) if E else 0
    return total + (expert * used / E if E else expert)


def ensure_checkpoint(config: Path, ckpt: Path) -> None:
    if (ckpt / "model.safetensors").exists():
        log(f"checkpoint {ckpt} exists")
        return
    from weights.random_checkpoint import write_random_checkpoint

    t0 = time.time()
    write_random_checkpoint(json.loads(config.read_text()), ckpt)
    log(f"wrote {ckpt} in {time.time() - t0:.0f}s")


def start_server(ckpt: Path, port: int, extra: list[str], logfile: Path) -> tuple[subprocess.Popen, dict]:
    import httpx

    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(ckpt), "--port", str(port),
           "--dtype", "bfloat16", "--max-running-requests", "32", "--log-level", "warning", *extra]
    log("starting: " + " ".join(cmd))
    t0 = time.time()
    f = open(logfile, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    while time.time() - t0 < 540:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n" + logfile.read_text()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        raise RuntimeError("server did not become healthy:\n" + logfile.read_text()[-3000:])
    return proc, {"ready_s": round(time.time() - t0, 1)}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(port: int, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "jaxserve.cli", "bench", "--url", f"http://127.0.0.1:{port}", "--json", str(out),
           "--quiet", "--token-ids", "1000", "150000", *args]
    log("bench " + " ".join(args))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"bench failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(out.read_text())


def row_from(result: dict, name: str, cfg, step_tokens: int) -> dict:
    s = result["runs"][-1]["summary"]
    roof = hbm_bytes_per_s() / active_bytes(cfg, step_tokens) * step_tokens
    row = {"workload": name, "concurrency": result["runs"][-1].get("max_concurrency"), **s,
           "roofline_decode_tok_s": round(roof), "share_of_roofline": round(s.get("output_throughput", 0) / roof, 3)}
    log(json.dumps({k: row.get(k) for k in ("workload", "concurrency", "output_throughput", "ttft_ms", "tpot_ms",
                                              "completed", "errors", "share_of_roofline")}))
    return row


def hf_reference(ckpt: Path, batch: int, prompt_len: int, new: int) -> dict:
    """transformers' generate (torch, CUDA, bf16) on the same checkpoint: the peer row."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(1000, 150000, (batch, prompt_len), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.time()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
    dt = time.time() - t0
    del model
    torch.cuda.empty_cache()
    return {"workload": f"hf-transformers generate {prompt_len}/{new}", "concurrency": batch,
            "output_throughput": round(batch * new / dt, 1), "e2e_s": round(dt, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=ROOT / "benchmarks/configs/qwen3_5_moe-6b.json")
    ap.add_argument("--ckpt", type=Path, default=ROOT / "runs/e2e-ck")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--rows", default="decode1,decode32,prefix,prefill")
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate (batch 1 and 32)")
    ap.add_argument("--restart", action="store_true",
                    help="after the rows, start the server again: the start-up with the persistent compile cache warm")
    ap.add_argument("--label", default="")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    from jaxserve.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads(args.config.read_text()))
    ensure_checkpoint(args.config, args.ckpt)
    work = args.out.parent
    result = {"label": args.label, "config": str(args.config), "serve_args": args.serve_args, "rows": []}
    proc, startup = start_server(args.ckpt, args.port, args.serve_args, work / "server.log")
    result["startup"] = startup
    rows = set(args.rows.split(","))
    try:
        if "decode1" in rows:
            r = bench(args.port, work / "b1.json", "--num-prompts", "4", "--input-len", "512", "--output-len", "128",
                      "--max-concurrency", "1", "--seed", "1")  # each row its own ids: no row hits another's prompts
            result["rows"].append(row_from(r, "random 512/128", cfg, 1))
        if "decode32" in rows:
            r = bench(args.port, work / "b32.json", "--num-prompts", "64", "--input-len", "512", "--output-len", "128",
                      "--max-concurrency", "32", "--seed", "32")
            result["rows"].append(row_from(r, "random 512/128", cfg, 32))
        if "prefix" in rows:
            r = bench(args.port, work / "bp.json", "--workload", "shared-prefix", "--num-groups", "1", "--prefix-len",
                      "2048", "--input-len", "1", "--output-len", "8", "--num-prompts", "5", "--max-concurrency", "1")
            row = row_from(r, "shared-prefix 2048+1/8 (TTFT of repeats)", cfg, 1)
            reqs = r["runs"][-1]["requests"]
            for key in ("ttft_ms", "e2e_ms"):  # a record without a time (a failed request) gives None, not a crash
                cold, hits = reqs[0][key], [q[key] for q in reqs[1:] if q[key] is not None]
                row[f"{key[:-3]}_cold_ms"] = None if cold is None else round(cold, 1)
                row[f"{key[:-3]}_hit_ms_p50"] = round(float(np.median(hits)), 1) if hits else None
            row["cached_tokens_of_repeats"] = [q["cached_tokens"] for q in reqs[1:]]
            result["rows"].append(row)
        if "prefill" in rows:
            for n in (8192, 32768):
                r = bench(args.port, work / f"bf{n}.json", "--num-prompts", "2", "--input-len", str(n), "--output-len",
                          "1", "--max-concurrency", "1", "--seed", str(n))
                row = row_from(r, f"prefill {n}/1", cfg, 1)
                result["rows"].append(row)
    finally:
        stop(proc)
        result["server_log_tail"] = (work / "server.log").read_text()[-4000:]
        args.out.write_text(json.dumps(result, indent=1))
    if args.restart:  # same flags, same cache directory: every program should load from the cache
        proc, again = start_server(args.ckpt, args.port, args.serve_args, work / "server-restart.log")
        stop(proc)
        text = (work / "server-restart.log").read_text()
        again["log"] = [line for line in text.splitlines()
                        if "compil" in line or "ready" in line or "weights loaded" in line][-9:]
        result["restart"] = again
        log(f"restart: {json.dumps(again)}")
        args.out.write_text(json.dumps(result, indent=1))
    if args.hf:
        for b in (1, 32):
            try:
                result["rows"].append(hf_reference(args.ckpt, b, 512, 128))
                log(json.dumps(result["rows"][-1]))
            except Exception as e:  # noqa: BLE001 - a missing family in the device's transformers
                result["rows"].append({"workload": "hf-transformers", "concurrency": b, "error": repr(e)[:500]})
                log(f"hf reference failed: {e!r}")
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
