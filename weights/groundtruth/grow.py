"""Function-preserving growth of a dense ground-truth model: more layers, more attention heads.

``--init-from EXPORT --grow`` starts a run whose config may differ from the export's in
``GROW_KEYS`` only; ``grow_tensors`` maps the export's tensors into the bigger model so that it
computes **exactly the export's function at step 0**, and ``new_elements`` marks which weights are
new so the optimiser can move them faster (``--grow-lr-scale``) than the trained ones.

- Layers: the export's layers are matched, in order, to the new ``layer_types`` (the first new
  layer of the same type takes each old one: ``layer_map``). A new (unmatched) layer is random
  (``init_tensors``) except its output projections -- attention ``o_proj``, GDN ``out_proj`` and
  the MLP's ``down_proj`` -- which are 0: both residual branches add exactly 0, so the layer is
  the identity until they train (they get gradients at once, the rest after them).
- Heads: ``num_attention_heads`` and ``num_key_value_heads`` may grow by the same factor (so
  query head h keeps reading KV head h // (heads / kv_heads) for every old head). Old heads keep
  their rows of q_proj (query and gate rows per head), k_proj and v_proj; new heads get random
  rows and 0 columns of o_proj, so they add exactly 0. q_norm/k_norm act per head_dim and are shared.

Why: the default model's needle misses are selection failures (another line's code), and three
anneals had flattened out at 93 %: more retrieval capacity, grown
from the trained model rather than trained from scratch, keeps everything it already does.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig

# Config keys in which a grown model may differ from the export it grows from.
GROW_KEYS = ("num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads")

# Output projections of each layer's residual branches (zero in a new layer: it adds nothing).
_OUTPUTS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


def layer_map(old_types: list[str], new_types: list[str]) -> list[int | None]:
    """For every new layer, the old layer it continues (None: a new layer). Old layers are taken
    in order, each by the first remaining new layer of its type; ValueError if they do not all fit."""
    out: list[int | None] = []
    j = 0
    for t in new_types:
        if j < len(old_types) and old_types[j] == t:
            out.append(j)
            j += 1
        else:
            out.append(None)
    if j != len(old_types):
        raise ValueError(f"cannot grow layer_types {old_types} into {new_types}: the old layers must "
                         "appear in order among the new ones")
    return out


def check_growth(old: dict, new: dict) -> None:
    """ValueError unless the config ``new`` grows ``old`` (HF config dicts) as this module can."""
    differ = sorted(k for k in new if k not in GROW_KEYS + ("torch_dtype", "dtype") and old.get(k) != new[k])
    if differ:
        raise ValueError(f"--grow: the export's config differs in {differ}; only {list(GROW_KEYS)} may grow")
    if old.get("model_type") != "qwen3_5_text":
        raise ValueError(f"--grow grows dense qwen3_5_text models, not {old.get('model_type')!r}")
    h0, kv0, h1, kv1 = (old["num_attention_heads"], old["num_key_value_heads"],
                        new["num_attention_heads"], new["num_key_value_heads"])
    if h1 < h0 or kv1 < kv0 or h1 * kv0 != h0 * kv1:
        raise ValueError(f"--grow: heads {h0}/{kv0} -> {h1}/{kv1}: query and KV heads must grow by the same factor")
    layer_map(old["layer_types"], new["layer_types"])


def _rows(a: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``a`` with its leading rows (and columns, where ``old`` is narrower) replaced by ``old``."""
    a = a.copy()
    a[tuple(slice(0, n) for n in old.shape)] = old
    return a


def grow_tensors(old_t: dict[str, np.ndarray], old_cfg: ModelConfig, cfg: ModelConfig,
                 fresh: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named tensors of the grown model ``cfg`` computing exactly the function of ``old_t``
    (the export of ``old_cfg``); ``fresh`` are random tensors of ``cfg`` for the new parts."""
    hd, h0, kv0 = old_cfg.head_dim, old_cfg.num_heads, old_cfg.num_kv_heads
    out = {k: v for k, v in fresh.items() if not k.startswith("model.layers.")}
    out.update({k: old_t[k] for k in out})  # embeddings, final norm
    for i, j in enumerate(layer_map(list(old_cfg.layer_types), list(cfg.layer_types))):
        pre = f"model.layers.{i}."
        mine = {k[len(pre):]: v for k, v in fresh.items() if k.startswith(pre)}
        if j is None:
            for name, v in mine.items():
                out[pre + name] = np.zeros_like(v) if name in _OUTPUTS else v
            continue
        for name, v in mine.items():
            o = old_t[f"model.layers.{j}.{name}"]
            if name == "self_attn.o_proj.weight":  # [H, heads*hd]: new heads' columns 0
                v = _rows(np.zeros_like(v), o)
            elif name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                per_head = o.shape[0] // (h0 if name.startswith("self_attn.q") else kv0)
                assert per_head in (hd, 2 * hd) and o.shape[1] == v.shape[1]
                v = _rows(v, o)  # old heads first, in the old order: head h's rows stay rows of head h
            else:
                assert o.shape == v.shape, name
                v = o
            out[pre + name] = v
    assert out.keys() == fresh.keys() and all(out[k].shape == fresh[k].shape for k in fresh)
    return out


def new_elements(grown: dict[str, np.ndarray], old_t: dict[str, np.ndarray], old_cfg: ModelConfig,
                 cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Per tensor of ``grown``, 1.0 where the element is new (not the export's), else 0.0: the
    same names and shapes, so ``build_params`` arranges it like the weights."""
    mask = {k: np.ones(v.shape, np.float32) for k, v in grown.items()}
    for k in (k for k in grown if not k.startswith("model.layers.")):
        mask[k][...] = 0.0
    for i, j in enumerate(layer_map(list(old_cfg.layer_types), list(cfg.layer_types))):
        if j is None:
            continue
        pre, old_pre = f"model.layers.{i}.", f"model.layers.{j}."
        for k in (k for k in grown if k.startswith(pre)):
            mask[k][tuple(slice(0, n) for n in old_t[old_pre + k[len(pre):]].shape)] = 0.0
    return mask
