"""The one configuration object of jax_dfccl.

Every tunable lives here, documented; nothing is read from environment
variables.  Change entries with :func:`jax_dfccl.configure` (which also pushes
them to the loaded runtimes); read them from ``jax_dfccl.config``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Config:
  #: A collective whose peers have not all started it after this many seconds
  #: fails with an error naming the key, the sequence number and the missing
  #: ranks (instead of hanging).
  timeout_s: float = 300.0
  #: How long a collective waiting for peers keeps its worker (daemon thread
  #: on CPU, daemon block on GPU) before it is preempted and another runs.
  spin_budget_us: float = 20.0
  #: The larger budget used once a peer has been seen progressing on the same
  #: collective ("stickiness"), so that ranks gang-schedule without a coordinator.
  sticky_budget_us: float = 500.0
  #: GPU: the daemon kernel exits after this much idle time, freeing its SMs; a
  #: host proxy thread relaunches it when work arrives.
  idle_quit_us: float = 1000.0
  #: GPU: the daemon exits (and is relaunched) after this long without any
  #: progress even with tasks pending, so that no stream operation can wait on
  #: a spinning kernel forever.
  stall_quit_us: float = 50000.0
  #: GPU: thread blocks (SMs) of the daemon kernel.
  max_blocks: int = 16
  #: GPU: collectives whose per-rank buffer (the larger of input and output)
  #: has at least this many bytes are moved by the GPUs' copy engines, driven
  #: by a host thread once every rank's input is ready (no daemon, no SMs held
  #: but a short combine kernel for reductions); smaller ones run on the daemon
  #: kernel.  Reductions (psum/pmax/pmin/psum_scatter) take it on 2-GPU groups
  #: only, from ``copy_engine_reduce_min_bytes`` (a 16 MiB psum was faster on
  #: the daemon's direct path, 150 vs 130 GB/s).  On 2xH200, all_gather: 176
  #: vs 145 GB/s (jax.lax) at 16 MiB, 349 vs 234 at 1 GiB.  -1: never.  The
  #: mover's pipelining unit and combine-kernel blocks are
  #: ``copy_engine_chunk_bytes`` and ``copy_engine_blocks``.
  copy_engine_min_bytes: int = 4 << 20
  copy_engine_reduce_min_bytes: int = 64 << 20
  copy_engine_chunk_bytes: int = 8 << 20
  copy_engine_blocks: int = 32
  #: GPU: on the copy-engine path each rank's engines write its data into the
  #: peers' buffers (push); False: each rank's engines read what it needs from
  #: the peers (pull).
  copy_engine_push: bool = True
  #: Record start/preempt/resume/finish events for :func:`jax_dfccl.export_trace`.
  trace: bool = False
  #: Trace ring-buffer capacity (events per runtime).
  trace_capacity: int = 65536
  #: GPU (sm90, bfloat16/float16): per-shard ``all_gather_matmul`` /
  #: ``matmul_reduce_scatter`` run the fused tile-signaling GEMM kernels of the
  #: ``_dfccl_overlap`` extension when it is built (read at trace time; the
  #: context manager ``jax_dfccl._src.overlap_gpu.fused`` overrides it).
  overlap_fused: bool = True
  #: Bound of every cross-rank wait inside the fused overlap kernels; a wait
  #: past it records an error naming the op and ranks (raised at the next call
  #: and by ``overlap_gpu.check()``) instead of hanging.  Read at trace time.
  overlap_wait_timeout_s: float = 10.0
  #: Fused AG+GEMM: move the rows to the peers with the copy engine
  #: (cudaMemcpyAsync over NVLink on a side stream, gated by the peer's ready
  #: flag; no SMs taken from the GEMM) once every rank's buffers exist; False:
  #: always the SM push kernel (16 SMs).  Read at trace time.
  overlap_copy_engine: bool = True
  #: Fused GEMM+RS: signal a partial tile with one system fence per CTA after a
  #: barrier of the storing threads (cumulative release); False: every storing
  #: thread runs its own system fence first (the first version's scheme).
  #: Read at trace time.
  overlap_cta_fence: bool = True
  #: Fused GEMM+RS on 2 ranks: when the peer's block of partial results is at
  #: least this many bytes, its tiles are stored locally and moved by the copy
  #: engine once the block is complete (side stream, gated by a tile counter)
  #: instead of NVLink stores from the epilogue; 0: always, -1: never.  On
  #: 2xH200 the copy engine won with 16 MiB blocks (0.48 vs 0.70 ms for
  #: 4096x4096x14336) and lost with 4 MiB blocks (0.59 vs 0.39 ms).  Read at trace time.
  overlap_rs_copy_engine_min_bytes: int = 8 << 20
  #: Fused GEMMs (both kinds): CTAs per cluster along M, 1 or 2.  2: clusters
  #: of two CTAs compute pairs of vertically adjacent tiles of one row block
  #: and load each weight tile once per pair (TMA multicast to both CTAs),
  #: which cuts the mainloop's L2 traffic by a third; the grid is whole
  #: clusters.  The GEMM alone on one H200 (benchmarks/overlap_gemm.py):
  #: within -3%..+4% of 1 over the 18 benchmark shapes, so 1 stays the default
  #: (not yet measured with communication on 2 GPUs).  Read (and checked) at trace time.
  overlap_cluster_m: int = 1
  #: CPU across processes (:func:`jax_dfccl.initialize`): bytes of each
  #: process's shared staging arena (a POSIX shared-memory segment mapped by
  #: every process of the job; tmpfs pages are used only once touched).  Every
  #: rank of a group spanning processes copies its input there at start; the
  #: copy is held until every rank has read it.  A start that finds the arena
  #: full fails with an error naming this entry.  Read by initialize().
  shm_arena_bytes: int = 1 << 30
  #: CPU across processes: collective instances that may be in flight at once
  #: across the job (entries of the shared instance table).  Read by initialize().
  shm_max_instances: int = 2048

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


config = Config()
