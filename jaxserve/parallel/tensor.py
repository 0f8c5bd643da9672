"""One model on a mesh of local devices: the sharding rules of every param and pool, in one place.

    tp = TensorParallel.make(size=4, expert_parallel=False)
    cfg = tp.configure(cfg)              # start-up checks; the config the sharded model runs
    params = tp.place(cfg, host_params)  # host numpy pytree (params.build_params) -> sharded arrays
    pools = init_pools(plan, cfg, dtype, tp.pool_shardings(cfg))  # allocated split by head

Megatron-style tensor parallelism, expressed as ``NamedSharding``s over the mesh axis ``"tp"``;
XLA SPMD (GSPMD) inserts every collective but the expert-parallel ``psum`` (below). Weights are
``[in, out]``:

- column-parallel (out split, a whole set of heads per device): attention ``q_proj`` / ``k_proj`` /
  ``v_proj`` (and MLA's ``q_b_proj`` / ``kv_b_proj``), the SwiGLU MLPs' ``gate_up_proj`` (gate | up,
  shard-major: ``layout``), the GDN's in-projection ``in_proj`` (q k v | z | b | a, shard-major),
  KDA's ``in_proj_qkv`` (shard-major), ``f_b`` / ``g_b`` / ``b``, with their per-head vectors
  (``conv_w`` rows, ``A_log``, ``dt_bias``);
- row-parallel (in split; XLA all-reduces the partial sums): ``o_proj``, ``down_proj``, ``out_proj``;
- replicated: norms, low-rank / latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``, ``f_a``,
  ``g_a``), the router (with Qwen's shared expert gate), the vision tower, and ``embed``;
- routed experts: split by intermediate (``gate_up`` shard-major on its last axis, ``down`` on its
  middle one; tensor parallel) or, with ``expert_parallel``, by expert id (axis 0, whole experts in
  the checkpoint's layout). Then ``configure`` sets ``ModelConfig.expert_parallel`` and
  ``layers.expert_parallel`` runs the grouped matmul under ``shard_map``, each device over the
  (token, slot) pairs routed to its own experts (tokens and routing are replicated), then ``psum``s
  the partial outputs; no device gathers another's experts (tests/parallel/test_expert_parallel.py
  checks the compiled step);
- ``lm_head`` split by vocabulary (when it divides; the largest matmul of a decode step and its
  weight, split; the sampler's softmax / top-k over the gathered logits is XLA's). ``embed`` is
  replicated: its use is a row gather (a vocab-split table costs an all-reduce of every token's
  hidden state) and a tied ``lm_head`` is the same array, which one sharding must serve.

Pools split by head: KV ``[L, pages, ps, kv_heads, d]`` on ``kv_heads``, the conv state
``[L, slots, conv_dim, K-1]`` on channels (shard-major like ``in_proj_qkv``, so device d holds its
heads' channels), the recurrent state ``[L, slots, Hv, dk, dv]`` on ``Hv``. Attention with fewer KV
heads than devices replicates them (``configure``: each KV head repeated ``size / kv_heads``
times, which keeps every query head on its own group's KV), as vLLM does.

Kernels: under TP the jnp backends run (``kernels`` ``auto`` becomes ``jnp``); asking for the
Pallas kernels is a start-up error until they are wrapped in ``shard_map`` (follow-up). The
expert-parallel ``shard_map`` body runs ``lax.ragged_dot``, not the MoE kernel: the kernel's
un-sort does not yet drop the pairs of other devices' experts, and Mosaic GPU's interpreter cannot
run it on several devices, so a per-shard kernel would go unchecked on the CPU.

Loading: the checkpoint is built as host arrays and each leaf goes to the devices already split
(``jax.device_put`` with its sharding), so no device ever holds more than its shard; the host holds
the model once while placing (at TP=1 the loader streams leaf by leaf instead).
"""

from __future__ import annotations

import dataclasses
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models.decoder import Pools, num_layers_of_kind
from jaxserve.parallel.layout import AXIS, shard_major

COLUMN = {"q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_up_proj", "in_proj", "in_proj_qkv",
          "f_b", "g_b", "b"}
ROW = {"o_proj", "down_proj", "out_proj"}
PER_HEAD = {"A_log", "dt_bias", "conv_w"}  # linear-attention vectors / rows indexed by head or channel


@dataclasses.dataclass(frozen=True, eq=False)
class TensorParallel:
    """A mesh of ``size`` local devices on axis ``"tp"``; experts split by id if ``expert_parallel``."""

    mesh: Mesh
    expert_parallel: bool = False

    @classmethod
    def make(cls, size: int, expert_parallel: bool = False) -> "TensorParallel":
        devices = jax.devices()  # every process's, after jax.distributed.initialize (parallel/distributed.py)
        if size < 1 or size > len(devices):
            where = "this host has" if jax.process_count() == 1 else f"the {jax.process_count()} processes have"
            raise ValueError(f"tensor_parallel_size={size}, but {where} {len(devices)} "
                             f"{devices[0].platform} device(s)")
        if jax.process_count() > 1 and size != len(devices):  # a process outside the mesh would have no step to run
            raise ValueError(f"over {jax.process_count()} processes the model is split over every process's devices: "
                             f"give tensor_parallel_size={len(devices)}, not {size}")
        mesh = Mesh(np.array(devices[:size]), (AXIS,), axis_types=(AxisType.Auto,))
        return cls(mesh, expert_parallel)

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    def sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding()

    def describe(self) -> str:
        experts = ", experts split by id" if self.expert_parallel else ""
        return f"tensor parallel over {self.size} {self.mesh.devices.flat[0].platform} devices{experts}"

    # ------------------------------------------------------------------------------ start-up

    def configure(self, cfg: ModelConfig) -> ModelConfig:
        """Check that every split divides and return the config the sharded model runs: KV heads
        replicated up to the device count where there are fewer, the jnp backends,
        ``expert_parallel``. Raises ``ValueError`` naming the first shape that cannot be split."""
        n = self.size
        kernels = cfg.kernels
        if kernels not in ("auto", "jnp"):
            raise ValueError(f"kernels={kernels!r} with tensor_parallel_size={n}: the Pallas kernels do not run "
                             f"under tensor parallelism yet (shard_map is a follow-up); use --kernels jnp or auto")
        n_attn, n_linear = num_layers_of_kind(cfg)
        need: list[tuple[str, int]] = []
        kv_heads = cfg.num_kv_heads
        if n_attn:
            need.append(("attention heads", cfg.num_heads))
            if cfg.is_mla or kv_heads >= n:
                need.append(("KV heads", kv_heads))
        if n_linear:
            need += [("linear-attention key heads", cfg.linear_num_key_heads),
                     ("linear-attention value heads", cfg.linear_num_value_heads)]
        if not all(cfg.moe_layers) or not cfg.moe_layers:
            need.append(("MLP intermediate size", cfg.intermediate_size))
        if any(cfg.moe_layers):
            need.append(("shared expert intermediate size", cfg.shared_expert_intermediate_size))
            need.append(("experts", cfg.num_experts) if self.expert_parallel
                        else ("expert intermediate size", cfg.moe_intermediate_size))
        elif self.expert_parallel:
            raise ValueError(f"expert_parallel: {cfg.model_type} has no routed experts")
        for what, count in need:
            if count % n:
                raise ValueError(f"tensor_parallel_size={n} does not divide the {count} {what} of this "
                                 f"{cfg.model_type} checkpoint; choose a size that divides it")
        if n_attn and not cfg.is_mla and kv_heads < n:  # replicated: each device keeps its group's KV head
            if n % kv_heads:
                raise ValueError(f"tensor_parallel_size={n}: the {kv_heads} KV heads can be replicated only to a "
                                 f"device count they divide")
            kv_heads = n
        return dataclasses.replace(cfg, num_kv_heads=kv_heads, kernels="jnp", expert_parallel=self.expert_parallel)

    def shard_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config whose pools are one device's share (for sizing pools from a per-device budget)."""
        n = self.size
        return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // n,
                                   linear_num_key_heads=cfg.linear_num_key_heads // n,
                                   linear_num_value_heads=cfg.linear_num_value_heads // n)

    # ------------------------------------------------------------------------------ params

    def _rule(self, cfg: ModelConfig, path: tuple[str, ...], x: np.ndarray, kv_from: int) -> tuple[P, np.ndarray]:
        """(spec, the host array in its sharded layout) of the leaf at ``path`` (the module doc's rules)."""
        n, leaf = self.size, path[-1]
        if path[0] == "lm_head":
            return (P(None, AXIS) if x.shape[1] % n == 0 else P()), x
        if path[0] != "layers":  # embed, norm, vision tower
            return P(), x
        if leaf in ("gate_up", "down"):  # routed experts [E, in, out]
            if self.expert_parallel:  # whole experts per device: the checkpoint's layout
                return P(AXIS), x
            if leaf == "gate_up":
                x = shard_major(x, (x.shape[-1] // 2,) * 2, n)
            return (P(None, None, AXIS) if leaf == "gate_up" else P(None, AXIS)), x
        kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
        if leaf in PER_HEAD:
            if leaf == "conv_w":
                x = shard_major(x, (kd, kd, vd), n, axis=0)
            return P(AXIS), x
        if leaf not in ("w", "b"):  # norms, router (+ shared expert gate), router bias
            return P(), x
        name = path[-2]
        if name in ("k_proj", "v_proj") and kv_from < cfg.num_kv_heads and not cfg.is_mla:  # replicate KV heads
            heads = x.reshape(*x.shape[:-1], kv_from, -1)
            x = np.repeat(heads, cfg.num_kv_heads // kv_from, axis=-2).reshape(*x.shape[:-1], -1)
        if name == "in_proj_qkv":  # KDA's q k v
            x = shard_major(x, (kd, kd, vd), n)
        if name == "in_proj":  # GDN's q k v | z | b | a
            hv = cfg.linear_num_value_heads
            x = shard_major(x, (kd, kd, vd, vd, hv, hv), n)
        if name == "gate_up_proj":  # a SwiGLU MLP's gate | up
            x = shard_major(x, (x.shape[-1] // 2,) * 2, n)
        if name in COLUMN:
            return (P(None, AXIS) if leaf == "w" else P(AXIS)), x
        if name in ROW:
            return (P(AXIS) if leaf == "w" else P()), x
        return P(), x

    def place(self, cfg: ModelConfig, params: dict, kv_heads: int | None = None) -> dict:
        """Put a host pytree (``build_params`` with numpy leaves, in the checkpoint's layout; the
        list or the stacked layout of ``decoder.stack_layers``, whose stacked leaves keep their
        leading layer axis whole on every device) on the mesh leaf by leaf. ``cfg`` is ``configure``'s; ``kv_heads`` the checkpoint's KV head count
        when ``configure`` replicated them."""
        kv_from = kv_heads or cfg.num_kv_heads

        def put(path, x):
            keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            if keys[:2] == ("layers", "period"):  # stacked [n, ...]: each layer's rule, the leading axis unsplit
                ruled = [self._rule(cfg, keys, row, kv_from) for row in np.asarray(x)]
                spec, x = P(None, *ruled[0][0]), np.stack([row for _, row in ruled])
            else:
                spec, x = self._rule(cfg, keys, np.asarray(x), kv_from)
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        return jax.tree_util.tree_map_with_path(put, params)

    # ------------------------------------------------------------------------------ pools

    def pool_shardings(self, cfg: ModelConfig) -> Pools:
        """KV on heads, conv state on channels, recurrent state on value heads (module doc)."""
        n_attn, n_linear = num_layers_of_kind(cfg)
        kv = self.sharding(None, None, None, AXIS) if n_attn else self.replicated  # empty pools: nothing to split
        state = self.sharding(None, None, AXIS) if n_linear else self.replicated
        return Pools(k=kv, v=kv, conv=state, rec=state)
