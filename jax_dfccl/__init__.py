"""jax_dfccl: deadlock-free, order-free collectives for JAX.

Collectives are matched across ranks by identity (key + sequence number),
never by issue order, and run by a daemon per device that preempts a
collective waiting for peers.  Drop-in for the jax.lax collectives inside
``jax.shard_map``; every op also has a ``*_start`` form returning a handle for
:func:`done`.
"""
from jax_dfccl.config import config
from jax_dfccl._src.backend import configure, configured, stats, reset, pending, raise_if_failed
from jax_dfccl._src.plan import done, Handle
from jax_dfccl._src.psum import psum, pmean, pmax, pmin, psum_start, pmean_start, pmax_start, pmin_start
from jax_dfccl._src.all_gather import all_gather, all_gather_start
from jax_dfccl._src.psum_scatter import psum_scatter, psum_scatter_start
from jax_dfccl._src.all_to_all import all_to_all, all_to_all_start
from jax_dfccl._src.ppermute import ppermute, ppermute_start
from jax_dfccl._src.pbroadcast import pbroadcast, pbroadcast_start
from jax_dfccl._src.ragged_all_to_all import ragged_all_to_all, ragged_all_to_all_start
from jax_dfccl._src.overlap import all_gather_matmul, matmul_reduce_scatter, matmul_psum
from jax_dfccl._src.patch import patch_lax
from jax_dfccl._src.distributed import initialize
from jax_dfccl._src.p2p import send, recv, send_start, recv_start
from jax_dfccl._src.keys import DefaultKeyInBranchWarning
from jax_dfccl.trace import export_trace
__version__ = "0.1.0"

__all__ = [
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute",
    "psum_start", "pmean_start", "pmax_start", "pmin_start", "all_gather_start", "psum_scatter_start",
    "all_to_all_start", "ppermute_start", "pbroadcast", "pbroadcast_start", "ragged_all_to_all",
    "ragged_all_to_all_start", "done", "Handle",
    "all_gather_matmul", "matmul_reduce_scatter", "matmul_psum",
    "config", "configure", "configured", "stats", "reset", "pending", "raise_if_failed", "export_trace", "patch_lax",
    "initialize", "send", "recv", "send_start", "recv_start",
    "DefaultKeyInBranchWarning",
]
