"""Where a run starts: its tokenizer files and its first weights, as HF-named fp32 tensors.

A fresh run trains the task tokenizer and draws random weights (``init_tensors``). With
``init_from`` it starts from an earlier export instead (``export_tensors``: its weights and its
own tokenizer files, since the BPE ids follow the task corpus of the day it was trained): the
same model, or with ``moe`` a dense export upcycled into the MoE variant
(``upcycle_dense_mlp``), or with ``grow`` a bigger model grown from it (``grown_tensors``);
``extend_vocab`` appends one token per needle NAME to an export's tokenizer that splits names.
Each of these starts computes exactly the export's function at step 0 (tests check it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.params import hf_shapes
from weights.groundtruth import grow as gt_grow
from weights.groundtruth import tasks
from weights.groundtruth import tokenizer as gt_tokenizer


def prepare_tokenizer(export_dir: Path, init_from: str | Path | None, extend_vocab: bool) -> None:
    """Write the run's tokenizer files into ``export_dir`` unless they are there: a resumed run
    keeps the tokenizer it was trained with, a continued one (``init_from``) takes its export's
    (with the name tokens appended under ``extend_vocab``), a fresh one trains the task tokenizer."""
    if (export_dir / "tokenizer.json").exists():
        return
    if init_from is not None:
        export_dir.mkdir(parents=True, exist_ok=True)
        for name in gt_tokenizer.FILES:
            shutil.copyfile(Path(init_from) / name, export_dir / name)
        if extend_vocab:
            from tokenizers import Tokenizer as RawTokenizer

            raw = RawTokenizer.from_file(str(Path(init_from) / "tokenizer.json"))
            gt_tokenizer.with_single_token_names(raw).save(str(export_dir / "tokenizer.json"))
    else:
        gt_tokenizer.save(export_dir, seed=tasks.TRAIN_SEED)


def init_tensors(cfg: ModelConfig, seed: int, init_std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-named fp32 tensors at random (normal weights, zero-centred norms 0, GDN norm 1,
    A_log = log U(1, 16), dt_bias 1), in the canonical names/shapes of ``hf_shapes``."""
    from weights.random_checkpoint import _value

    rng = np.random.default_rng(seed)
    return {name: _value(name, shape, cfg, rng, init_std) for name, shape in hf_shapes(cfg).items()}


# Config keys in which the MoE variant and the dense model it upcycles from may differ.
UPCYCLE_KEYS = ("architectures", "model_type", "intermediate_size", "moe_intermediate_size", "num_experts",
                "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef", "shared_expert_intermediate_size")


def upcycle_dense_mlp(dense: dict[str, np.ndarray], cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Sparse upcycling: HF-named tensors of the MoE model ``cfg`` that compute exactly the function
    of the dense model whose tensors are ``dense`` (same config but the MLP, its intermediate_size
    ``cfg.shared_expert_intermediate_size``). A MoE layer outputs ``routed(x) + sigmoid(x @
    shared_expert_gate) * shared_expert(x)`` (``layers.moe``), and here
      - the shared expert is the dense MLP with down_proj doubled and ``shared_expert_gate`` is 0:
        sigmoid(0) = 0.5 exactly, and 0.5 * (2 * down) = down (scaling by powers of two is exact
        in fp32 and bf16), so the shared path is the dense MLP's output;
      - every routed expert's down projection is 0: the routed sum is exactly 0 whichever experts
        the router picks (the down projections get gradients at once, the rest after them);
      - the router and the experts' gate/up projections are ``init_tensors(cfg, seed)``'s (random,
        so the experts differ once they train);
      - every other tensor is the dense model's.
    Non-MoE layers of ``cfg`` (none in qwen3_5_moe) keep the dense MLP."""
    fresh = init_tensors(cfg, seed)
    out = {name: dense.get(name, value) for name, value in fresh.items()}
    for i in (i for i, is_moe in enumerate(cfg.moe_layers) if is_moe):
        m = f"model.layers.{i}.mlp"
        for k in ("gate_proj", "up_proj"):
            out[f"{m}.shared_expert.{k}.weight"] = dense[f"{m}.{k}.weight"]
        out[f"{m}.shared_expert.down_proj.weight"] = 2 * dense[f"{m}.down_proj.weight"]
        out[f"{m}.shared_expert_gate.weight"] = np.zeros_like(fresh[f"{m}.shared_expert_gate.weight"])
        out[f"{m}.experts.down_proj"] = np.zeros_like(fresh[f"{m}.experts.down_proj"])
    assert all(k in dense for k in fresh if ".mlp." not in k) and all(out[k].shape == v.shape for k, v in fresh.items())
    return out


def export_tensors(folder: str | Path, cfg: ModelConfig, config: dict, tok=None, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named fp32 tensors of an earlier export of this very model (``--init-from``). With ``tok``
    (``--extend-vocab``: the export's tokenizer plus appended tokens, ``config``'s vocab larger than
    the export's), the embedding rows of the appended tokens start as the mean of the rows of the
    pieces the export's tokenizer splits them into; every other tensor and row is the export's.
    A dense (qwen3_5_text) export of this MoE (qwen3_5_moe_text) model's config -- equal but for
    ``UPCYCLE_KEYS``, its intermediate_size this model's shared_expert_intermediate_size -- is
    upcycled (``upcycle_dense_mlp``, random parts from ``seed``): same function, new experts.
    Any other difference raises ValueError."""
    from weights.loader import load_tensors

    with open(Path(folder) / "config.json") as f:
        theirs = json.load(f)
    upcycle = config["model_type"] == "qwen3_5_moe_text" and theirs.get("model_type") == "qwen3_5_text"
    ignored = {"torch_dtype", "dtype"} | ({"vocab_size"} if tok else set()) | (set(UPCYCLE_KEYS) if upcycle else set())
    differ = sorted(k for k in config if k not in ignored and theirs.get(k) != config[k])
    if differ:
        raise ValueError(f"--init-from {folder}: its config differs from this model's in {differ}")
    if upcycle and tok is not None:
        raise ValueError(f"--init-from {folder}: upcycling a dense export into --moe does not support --extend-vocab")
    if upcycle and theirs.get("intermediate_size") != config["shared_expert_intermediate_size"]:
        raise ValueError(f"--init-from {folder}: upcycling needs the dense intermediate_size "
                         f"({theirs.get('intermediate_size')}) == shared_expert_intermediate_size "
                         f"({config['shared_expert_intermediate_size']})")
    old_v = theirs["vocab_size"]
    if old_v != config["vocab_size"] and tok is None:
        raise ValueError(f"--init-from {folder}: vocab {old_v} != {config['vocab_size']}")
    old_cfg = ModelConfig.from_hf({**(theirs if upcycle else config), "vocab_size": old_v})
    tensors = load_tensors(folder, hf_shapes(old_cfg), "float32", tie_word_embeddings=cfg.tie_word_embeddings)
    if upcycle:
        return upcycle_dense_mlp(tensors, cfg, seed)
    if old_v == config["vocab_size"]:
        return tensors
    from jaxserve.tokenizer import Tokenizer

    old_tok = Tokenizer.from_dir(folder)
    for key in [k for k in tensors if k.endswith("embed_tokens.weight") or k == "lm_head.weight"]:
        old = tensors[key]
        rows = [old[old_tok.encode(tok.decode([j], skip_special_tokens=False))].mean(0)
                for j in range(old_v, config["vocab_size"])]
        tensors[key] = np.concatenate([old, np.stack(rows).astype(old.dtype)])
    return tensors


def grown_tensors(folder: str | Path, cfg: ModelConfig, config: dict, seed: int):
    """``--init-from EXPORT --grow``: (tensors, new-element masks) of the bigger model ``config``
    computing exactly the export's function (``grow.grow_tensors``; new parts random from ``seed``)."""
    from weights.loader import load_tensors

    with open(Path(folder) / "config.json") as f:
        theirs = json.load(f)
    gt_grow.check_growth(theirs, config)
    old_cfg = ModelConfig.from_hf(theirs)
    old = load_tensors(folder, hf_shapes(old_cfg), "float32", tie_word_embeddings=old_cfg.tie_word_embeddings)
    grown = gt_grow.grow_tensors(old, old_cfg, cfg, init_tensors(cfg, seed))
    return grown, gt_grow.new_elements(grown, old, old_cfg, cfg)
