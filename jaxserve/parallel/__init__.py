"""Tensor and expert parallelism over a ``jax.sharding.Mesh`` (axis ``"tp"``).

``layout``: the two facts the model code needs (how many shards the ambient mesh has, and how a
fused projection whose pieces are split per shard is cut back into its pieces); it imports nothing
of jaxserve, so the models may import it. ``tensor``: the placement of one model on a mesh (the
sharding rules of every param and pool, in one place; the start-up checks; loading onto the mesh).
``distributed``: several processes (hosts) joined by ``jax.distributed``, so a mesh spans them.

Kept light: importing the package imports none of them.
"""
