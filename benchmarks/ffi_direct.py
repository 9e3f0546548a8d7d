"""Direct use of the CUDA backend's custom calls, without the jax_dfccl Python layer.

Used by the benchmark (its fallback when the public API is unusable) and by the GPU smoke test
(tests/gpu/smoke.py imports it from here), so the backend can be checked on its own.
Collectives run over a 1-D mesh axis spanning all local GPUs (flat partition id = rank).
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jax_dfccl._src.core import KIND as KINDS, REDUCE  # the op and reduction ids (no backend is loaded)

ROOT = pathlib.Path(__file__).resolve().parents[1]
_site = itertools.count(1)
_mod = None


def module():
    """Loads jax_dfccl/_dfccl_cuda*.so by path and registers its targets for CUDA."""
    global _mod
    if _mod is None:
        so = sorted((ROOT / "jax_dfccl").glob("_dfccl_cuda*.so"))[0]
        spec = importlib.util.spec_from_file_location("_dfccl_cuda", so)
        _mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_mod)
        for name, cap in _mod.registrations().items():
            jax.ffi.register_ffi_target(name, cap, platform="CUDA")
        from jax_dfccl.config import Config  # the runtime has no defaults of its own: every entry
        _mod.configure(Config().as_dict())
    return _mod


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def start(x, op, axis, n, *, reduce="sum", key="k", perm=None):
    """Starts a collective inside shard_map over `axis` (n ranks); returns a handle."""
    module()
    site = next(_site)
    e = x.size
    out_elems = {"all_reduce": e, "ppermute": e, "all_gather": n * e,
                 "reduce_scatter": e // n, "all_to_all": e}[op]
    pairs = np.array([v for p in (perm or [(-1, -1)]) for v in p], np.int32)
    attrs = dict(kind=np.int32(KINDS[op]), reduce_op=np.int32(REDUCE[reduce]), key=key,
                 key_hash=np.int64(key_hash(key)), site=np.int64(site), group_size=np.int32(n),
                 groups=np.arange(n, dtype=np.int32),
                 device_ids=np.array([d.id for d in jax.devices()[:n]], np.int64), perm=pairs)
    pid = jax.lax.axis_index(axis).astype(jnp.int32)
    flat = x.reshape(-1)
    out, xa, ticket = jax.ffi.ffi_call(
        "dfccl_start",
        (jax.ShapeDtypeStruct((out_elems,), x.dtype), jax.ShapeDtypeStruct(flat.shape, x.dtype),
         jax.ShapeDtypeStruct((), jnp.int32)),
        has_side_effect=True, input_output_aliases={0: 1})(flat, pid, **attrs)
    return (out, xa, ticket, key, site)


def done(h):
    out, xa, ticket, key, site = h
    return jax.ffi.ffi_call("dfccl_done", jax.ShapeDtypeStruct(out.shape, out.dtype),
                            has_side_effect=True, input_output_aliases={0: 0})(
        out, xa, ticket, key=key, site=np.int64(site))


def collective(x, op, axis, n, **kw):
    return done(start(x, op, axis, n, **kw))
