"""Torch side of the image tests (runs in the torch reference environment).

    python -m tests.reference.vision_oracle processor IN.npz OUT.npz [IN2.npz OUT2.npz ...]
    python -m tests.reference.vision_oracle models SPEC.json OUT_DIR

``processor``: transformers' Qwen2-VL image processing, the steps that run without Pillow (the
torch environment has none): ``smart_resize`` for every (height, width, factor, min, max) row of
``sizes``, and, for each already-resized uint8 [C, H, W] image ``image_<key>``, the processor's
rescale + normalise (``transformers.image_transforms``) and its ``patchify``. ``smart_resize`` and
``patchify`` are taken from transformers' ``image_processing_pil_qwen2_vl.py`` source (that module
cannot be imported without Pillow); the resample itself is Pillow's bicubic on both sides.

``models``: for every checkpoint of SPEC (family, variant, seed) writes the folder with
weights.tiny (OUT_DIR/<family>-<variant>) and, with transformers in fp32, records in oracle.npz:
the tower's soft tokens and deepstack features for each image of SPEC's ``images`` npz
(``pixels_<i>``, ``grid_<i>``), and for every prompt (expanded ``ids``, the images it uses in
order): the full forward's logits and ``new_tokens`` greedy tokens from ``generate``.
"""

from __future__ import annotations

import ast
import json
import math
import sys
from pathlib import Path

import numpy as np


def _hf_functions() -> dict:
    """``smart_resize`` and ``Qwen2VLImageProcessorPil.patchify`` from transformers' own source."""
    import transformers

    path = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "image_processing_pil_qwen2_vl.py"
    tree = ast.parse(path.read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLImageProcessorPil")
    wanted += [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify"]
    for fn in wanted:
        fn.decorator_list = []
        if fn.name == "patchify":  # a method that never uses self
            fn.args.args = fn.args.args[1:]
            for a in fn.args.args:
                a.annotation = None
    namespace = {"math": math, "np": np}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def processor(*paths: str) -> None:
    fns = _hf_functions()
    for in_path, out_path in zip(paths[::2], paths[1::2]):
        _processor(fns, in_path, out_path)


def _processor(fns: dict, in_path: str, out_path: str) -> None:
    from transformers.image_transforms import normalize, rescale
    from transformers.image_utils import ChannelDimension

    data = dict(np.load(in_path))
    out = {}
    resized = []
    for h, w, factor, lo, hi in data["sizes"].tolist():
        try:
            resized.append(fns["smart_resize"](h, w, factor=factor, min_pixels=lo, max_pixels=hi))
        except ValueError:
            resized.append((-1, -1))
    out["resized"] = np.asarray(resized, np.int64)
    p, m, tp = (int(v) for v in data["patch_merge_temporal"])
    mean, std = data["mean"].tolist(), data["std"].tolist()
    for key in (k for k in data if k.startswith("image_")):
        i = key.removeprefix("image_")
        x = rescale(data[key], 1 / 255, input_data_format=ChannelDimension.FIRST)
        x = normalize(x, mean, std, input_data_format=ChannelDimension.FIRST)
        patches, gh, gw = fns["patchify"](x, patch_size=p, merge_size=m, temporal_patch_size=tp)
        out[f"pixels_{i}"], out[f"grid_{i}"] = np.asarray(patches), np.asarray([1, gh, gw])
    np.savez(out_path, **out)


def _load(folder: Path):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    cls = {"qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
           "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[config.model_type]
    return cls.from_pretrained(folder, dtype=torch.float32).eval(), config


def models(spec_path: str, out_dir: str) -> None:
    import torch

    from weights.tiny import write

    torch.set_grad_enabled(False)
    spec = json.loads(Path(spec_path).read_text())
    images = dict(np.load(spec["images"]))
    n_images = sum(1 for k in images if k.startswith("pixels_"))
    for ck in spec["checkpoints"]:
        folder = Path(out_dir) / f"{ck['family']}-{ck['variant']}"
        write(ck["family"], ck["variant"], str(folder), ck.get("seed", 0))
        model, config = _load(folder)
        record = {}
        for i in range(n_images):
            pixels = torch.from_numpy(images[f"pixels_{i}"])
            grid = torch.from_numpy(images[f"grid_{i}"]).long()[None]
            out = model.model.visual(pixels, grid_thw=grid)
            record[f"embeds_{i}"] = out.pooler_output.numpy()
            deep = getattr(out, "deepstack_features", None) or []
            record[f"deepstack_{i}"] = np.stack([d.numpy() for d in deep]) if deep else np.zeros((0,))
        for name, prompt in spec["prompts"].items():
            ids = torch.tensor(prompt["ids"], dtype=torch.long)[None]
            used = prompt["images"]
            kwargs = dict(
                pixel_values=torch.cat([torch.from_numpy(images[f"pixels_{i}"]) for i in used]),
                image_grid_thw=torch.stack([torch.from_numpy(images[f"grid_{i}"]).long() for i in used]),
                mm_token_type_ids=(ids == config.image_token_id).int(),
            )
            record[f"logits_{name}"] = model(input_ids=ids, **kwargs).logits[0].numpy()
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new_tokens"],
                                 min_new_tokens=spec["new_tokens"], do_sample=False, eos_token_id=None,
                                 pad_token_id=0, **kwargs)
            record[f"greedy_{name}"] = gen[0, ids.shape[1]:].numpy()
        np.savez(folder / "oracle.npz", **record)
        print(f"{folder.name}: {len(record)} records", file=sys.stderr)


if __name__ == "__main__":
    {"processor": processor, "models": models}[sys.argv[1]](*sys.argv[2:])
