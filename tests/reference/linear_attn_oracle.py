"""Torch side of the linear-attention reference tests: fla's naive ops and transformers' fallbacks.

Run in the torch environment (see ``bridge.run_torch``)::

    python -m tests.reference.linear_attn_oracle IN.npz OUT.npz

IN holds cases keyed ``<family>/<case>/<array>``; OUT gets ``<family>/<case>/<impl>/<array>``,
all float32, every sequence of a ragged case run on its own (batch 1, its own initial state) and
the results concatenated back in the packed layout.

* ``gdn``: q, k ``[T, Hk, dk]``, v ``[T, Hv, dv]``, g, beta ``[T, Hv]``, cu_seqlens, initial_state
  ``[N, Hv, dk, dv]``, use_qk_l2norm (0/1) -> impls ``hf_chunk``, ``hf_recurrent`` (transformers'
  Qwen3-Next ``torch_*_gated_delta_rule``), ``fla_chunk``, ``fla_recurrent`` (fla's
  ``naive_*_gated_delta_rule``), each with ``o`` and ``state`` ``[N, Hv, dk, dv]``.
* ``kda``: same with g ``[T, Hv, dk]`` -> ``fla_chunk``, ``fla_recurrent`` (``naive_*_kda``) and,
  when Hk == Hv (Kimi-Linear's only layout), ``hf_chunk``, ``hf_recurrent`` (transformers'
  ``chunk_/recurrent_kimi_delta_attention``).
* ``conv``: x ``[T, C]``, weight ``[C, K]``, bias ``[C]`` (optional), cu_seqlens, initial_state
  ``[N, C, K-1]`` -> ``hf_prefill`` (transformers' cached prefill: the state, widened to K columns,
  concatenated in front of x, then ``causal_conv1d_fn``) and ``hf_update`` (``causal_conv1d_update``
  token by token), each with ``y`` and ``state`` ``[N, C, K-1]`` (transformers' ``[.., K]`` state
  with its oldest column dropped).

fla's naive ops take q/k as given and have no grouped heads for GDN, so this side applies fla's
l2norm (``x / sqrt(sum(x²) + 1e-6)``) and ``repeat_interleave`` itself where needed.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def _fla_package_dir() -> Path:
    spec = importlib.util.find_spec("fla")
    return Path(spec.origin).parent


def _load_by_path(relpath: str):
    """Load an fla naive-reference file by path: ``import fla.ops`` would need triton."""
    path = _fla_package_dir() / relpath
    spec = importlib.util.spec_from_file_location(f"_fla_naive_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fla_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm kernel: ``x / sqrt(sum(x²) + eps)`` (eps inside the root)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.float32)


def _sequences(cu_seqlens: np.ndarray):
    return [slice(int(a), int(b)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]


def _pad_to_multiple(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad along ``dim``: with g = beta = k = 0 the padding leaves the state untouched."""
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _delta_rule_case(case: dict, impls: dict) -> dict:
    """Run every impl on every sequence of a GDN/KDA case; returns ``{impl/o, impl/state}``."""
    out = defaultdict(list)
    for n, seq in enumerate(_sequences(case["cu_seqlens"])):
        args = {name: _t(case[name][seq])[None] for name in ("q", "k", "v", "g", "beta")}
        h0 = _t(case["initial_state"][n : n + 1])
        for impl, fn in impls.items():
            o, state = fn(**args, h0=h0, l2=bool(case["use_qk_l2norm"]))
            out[f"{impl}/o"].append(o[0].float().numpy())
            out[f"{impl}/state"].append(state[0].float().numpy())
    return {key: np.concatenate(parts) if key.endswith("/o") else np.stack(parts) for key, parts in out.items()}


def _fla_inputs(q, k, l2, group):
    if l2:
        q, k = fla_l2norm(q), fla_l2norm(k)
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)


def gdn_impls(num_k_heads: int, num_v_heads: int) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    naive = _load_by_path("ops/gated_delta_rule/naive.py")
    group = num_v_heads // num_k_heads

    def hf(fn):
        def run(q, k, v, g, beta, h0, l2):
            return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=l2)
        return run

    def fla_recurrent(q, k, v, g, beta, h0, l2):
        q, k = _fla_inputs(q, k, l2, group)
        return naive.naive_recurrent_gated_delta_rule(q=q, k=k, v=v, beta=beta, g=g, initial_state=h0,
                                                      output_final_state=True)

    def fla_chunk(q, k, v, g, beta, h0, l2):
        q, k = _fla_inputs(q, k, l2, group)
        return naive.naive_chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, chunk_size=64,
                                                  initial_state=h0, output_final_state=True)

    return {"hf_chunk": hf(torch_chunk_gated_delta_rule), "hf_recurrent": hf(torch_recurrent_gated_delta_rule),
            "fla_chunk": fla_chunk, "fla_recurrent": fla_recurrent}


def kda_impls(num_k_heads: int, num_v_heads: int) -> dict:
    naive = _load_by_path("ops/kda/naive.py")

    def fla_recurrent(q, k, v, g, beta, h0, l2):
        q, k = _fla_inputs(q, k, l2, 1)  # naive_recurrent_kda expands the heads itself
        return naive.naive_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True)

    def fla_chunk(q, k, v, g, beta, h0, l2):
        q, k = _fla_inputs(q, k, l2, 1)
        T = q.shape[1]
        q, k, v, g, beta = (_pad_to_multiple(x, 1, 64) for x in (q, k, v, g, beta))  # naive_chunk_kda asserts T % 64 == 0
        o, state = naive.naive_chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
                                         output_final_state=True, chunk_size=64)
        return o[:, :T], state

    impls = {"fla_chunk": fla_chunk, "fla_recurrent": fla_recurrent}
    if num_k_heads == num_v_heads:
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            chunk_kimi_delta_attention,
            recurrent_kimi_delta_attention,
        )

        def hf(fn):
            def run(q, k, v, g, beta, h0, l2):
                return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2)
            return run

        impls |= {"hf_chunk": hf(chunk_kimi_delta_attention), "hf_recurrent": hf(recurrent_kimi_delta_attention)}
    return impls


def conv_case(case: dict) -> dict:
    """transformers' cached conv paths on each sequence; states mapped to our ``[C, K-1]`` layout."""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, causal_conv1d_update

    weight = _t(case["weight"])
    bias = _t(case["bias"]) if "bias" in case else None
    out = defaultdict(list)
    for n, seq in enumerate(_sequences(case["cu_seqlens"])):
        x = _t(case["x"][seq]).T[None]                                 # [1, C, L]
        hf_state = F.pad(_t(case["initial_state"][n])[None], (1, 0))   # [1, C, K]: oldest column unused
        full = torch.cat([hf_state, x], dim=-1)                        # what cache.update_conv_state returns
        y = causal_conv1d_fn(full, weight, bias, activation="silu")[:, :, full.shape[-1] - x.shape[-1]:]
        out["hf_prefill/y"].append(y[0].T.numpy())
        out["hf_prefill/state"].append(full[0, :, -(weight.shape[-1] - 1):].numpy())

        state = hf_state.clone()
        ys = [causal_conv1d_update(x[:, :, i : i + 1], state, weight, bias, activation="silu")
              for i in range(x.shape[-1])]
        out["hf_update/y"].append(torch.cat(ys, dim=-1)[0].T.numpy() if ys else np.zeros((0, x.shape[1]), np.float32))
        out["hf_update/state"].append(state[0, :, 1:].numpy())
    return {key: np.concatenate(parts) if key.endswith("/y") else np.stack(parts) for key, parts in out.items()}


def main(in_path: str, out_path: str) -> None:
    torch.manual_seed(0)
    cases = defaultdict(dict)
    with np.load(in_path) as data:
        for key in data.files:
            family, case, name = key.split("/")
            cases[(family, case)][name] = data[key]
    results = {}
    for (family, name), case in sorted(cases.items()):
        if family == "conv":
            outputs = conv_case(case)
        else:
            heads = (case["q"].shape[1], case["v"].shape[1])
            impls = gdn_impls(*heads) if family == "gdn" else kda_impls(*heads)
            outputs = _delta_rule_case(case, impls)
        results |= {f"{family}/{name}/{key}": np.asarray(value, np.float32) for key, value in outputs.items()}
    np.savez(out_path, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
