"""The one configuration object of jax_dfccl: ``jax_dfccl.config``.

Entries live in four documented sections:

* ``config.<entry>``: what a user sets — ``timeout_s``, ``trace``,
  ``trace_capacity`` and the sizes of the runtime across processes;
* ``config.tuning.<entry>``: the runtimes' scheduling and GPU transport
  tuning (spin budgets, daemon geometry, pools, copy-engine thresholds);
* ``config.overlap.<entry>``: switches of the fused GEMM + communication
  kernels, read when a program is traced;
* ``config.testing.<entry>``: fault injection and test-only paths.

Assigning an entry takes effect at once in every loaded runtime, or raises:
``jax_dfccl.config.timeout_s = 2.0`` is validated by the runtimes (a value out
of range raises ``ValueError`` and changes nothing) and pushed to them; an
unknown name raises ``AttributeError``.  :func:`jax_dfccl.configure` sets
several entries at once by their flat names — the names the runtimes hold,
``overlap_`` before the overlap switches (``configure(timeout_s=2.0,
small_slots=64, overlap_tile_n=128)``) — and :func:`jax_dfccl.configured`
does so for a ``with`` block.  Nothing is read from environment variables.

This module is the one schema: the defaults below are the only ones.  Each
runtime (``_dfccl_cpu``, ``_dfccl_cuda``) holds the entries it reads under the
flat names and units, without defaults of its own; it is given every entry
when it is loaded (``jax_dfccl._src.backend.load``) and refuses to run a
collective before that.  Each reports the values it holds through its
``config()`` function (tests/test_contract.py, tests/gpu/test_gpu_contract.py
check they equal these).  Entries marked "GPU" are ignored by the CPU runtime;
entries "read when a program is traced" go into the custom calls' attributes
or choose their lowering, so a change applies to programs traced afterwards.
"""
from __future__ import annotations

import dataclasses
import types
import typing


class _Section:
  """A section of entries: an assignment goes through :func:`jax_dfccl.configure`."""
  _prefix = ""  # the entries' flat names are _prefix + field name

  def __setattr__(self, name, value):
    if not self.__dict__.get("_live"):
      object.__setattr__(self, name, value)
      return
    if name not in _ENTRY_FIELDS.get(type(self), ()):
      raise AttributeError(f"jax_dfccl.config{_SECTION_PATH[type(self)]}: no entry {name!r} "
                           f"(entries: {', '.join(sorted(_ENTRY_FIELDS[type(self)]))})")
    from jax_dfccl._src import backend
    backend.configure(**{self._prefix + name: value})

  def _live_now(self):
    object.__setattr__(self, "_live", True)


@dataclasses.dataclass(repr=False)
class Tuning(_Section):
  """``jax_dfccl.config.tuning``: scheduling and GPU transport tuning."""
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
  #: GPU: thread blocks (SMs) of the daemon kernel, its control block included
  #: (2..64).
  max_blocks: int = 16
  #: GPU: blocking collectives whose per-rank buffer (the larger of input and
  #: output) has at least this many bytes (the ``*_start`` forms: never) are
  #: moved by the GPUs' copy engines, driven
  #: by a host thread once every rank's input is ready (no daemon, no SMs held
  #: but a short combine kernel for reductions); smaller ones run on the daemon
  #: kernel.  Reductions (psum/pmax/pmin/psum_scatter) take it on 2-GPU groups
  #: only, from ``copy_engine_reduce_min_bytes`` (a 16 MiB psum was faster on
  #: the daemon's direct path, 150 vs 130 GB/s).  On 2xH200, all_gather: 176
  #: vs 145 GB/s (jax.lax) at 16 MiB, 349 vs 234 at 1 GiB.  -1: never.  The
  #: mover's pipelining unit and combine-kernel blocks are
  #: ``copy_engine_chunk_bytes`` and ``copy_engine_blocks``.  The choice is
  #: made when a program is lowered (the copy-engine path has its own FFI
  #: targets, which do host work per call and stay out of XLA's command
  #: buffers), so a change applies to programs traced afterwards.
  copy_engine_min_bytes: int = 4 << 20
  copy_engine_reduce_min_bytes: int = 64 << 20
  copy_engine_chunk_bytes: int = 8 << 20
  copy_engine_blocks: int = 32
  #: GPU: on the copy-engine path each rank's engines write its data into the
  #: peers' buffers (push); False: each rank's engines read what it needs from
  #: the peers (pull).
  copy_engine_push: bool = True
  #: GPU: cap of the proxy's backoff between relaunches of a daemon that quit
  #: while tasks were pending (it doubles from 20 us).
  relaunch_max_us: float = 2000.0
  #: GPU: a task is split into lanes (one worker block each) of at least this
  #: many bytes (a multiple of 16 or 16 at least).
  lane_min_bytes: int = 4096
  #: GPU, pool 0 (small messages, per communicator): staging slots, lanes per
  #: instance (1..64) and staging bytes per lane (a multiple of 16; with the LL
  #: protocol half of it is data).  Matched by identity (``small_by_identity``)
  #: the slots form buckets of 8 (16 by default): a key's instances use the
  #: ways of its bucket, and a sender waits for a free way at a receiver.  In
  #: the match table they are instances in flight (the last slot is kept for an
  #: instance every rank has started, so that instances started ahead never
  #: starve one whose ranks are all there: xla_ffi/device/match.cuh).  Applies to
  #: communicators created later.
  small_slots: int = 128
  small_lanes: int = 16
  small_chunk: int = 16384
  #: GPU: pool 0 uses the low-latency protocol (a flag inside each 16-byte line
  #: pushed into the receiver's staging, no fences); False: every message takes
  #: pool 1.
  ll: bool = True
  #: GPU: pool-0 (small) collectives are matched by identity in the receivers'
  #: staging: the (key, sequence number) picks the instance slot and the LL
  #: flag on every rank alike, so a rank writes its message to its peers at
  #: once, and a blocking collective that completes inside
  #: ``submit_inline_us`` takes no ticket and leaves nothing to the daemon
  #: (xla_ffi/device/task.h, "identity").  False: the match table (a slot
  #: claimed under a lock in rank 0's memory; for measurements).  Every process
  #: of a group must agree.  Applies to communicators created later.
  small_by_identity: bool = True
  #: GPU: pool-1 messages take the direct path (lanes read and write the peers'
  #: XLA buffers in place over NVLink, device/direct.cuh; across processes
  #: through mappings of the allocations that hold them, runtime/ipc.h); False:
  #: staged chunks with credits (the protocol that needs no peer addresses).
  #: Applies to communicators created later.
  direct: bool = True
  #: Groups spanning hosts of several ranks each (consecutive in the group):
  #: blocking psum (sum), all_gather and psum_scatter run in two levels, inside
  #: each host and then across hosts, so a rank sends 1/L of its data between
  #: hosts (L ranks per host).  Every rank must then run such a collective in the
  #: blocking form (its start form over such a group is refused when lowered: a
  #: start form of the key on another rank would never meet the two-level one).
  #: Read when a program is lowered.
  two_level_plans: bool = False
  #: GPU, pool 1 (larger messages): instances in flight when staged
  #: (``direct=False``; each holds staging memory) and on the direct path
  #: (flags and addresses only), lanes per instance (1..64), staging depth and
  #: chunk bytes (a multiple of 16).  Applies to communicators created later.
  large_slots: int = 16
  direct_slots: int = 256
  large_lanes: int = 64
  large_depth: int = 2
  large_chunk: int = 65536
  #: GPU: while a task whose per-peer message has at least ``large_threshold``
  #: bytes is pending, the daemon runs with ``large_max_blocks`` blocks (control
  #: block included, 2..64; the larger of it and ``max_blocks``), relaunched if
  #: needed.
  large_max_blocks: int = 64
  large_threshold: int = 4 << 20

  #: GPU: how long (µs) the submit kernel of a blocking collective on the LL
  #: pool (small messages) runs it itself once its instance is matched — the
  #: peers' side being their own submit kernels or daemons — before it leaves
  #: the rest to the daemon (which resumes the lanes where they stopped).
  #: Saves the daemon's ingest, scheduling and completion handoffs on the
  #: latency path; 0: the daemon runs every collective.  Read at each call.
  submit_inline_us: float = 20.0
  #: GPU: the kernels a collective puts on XLA's stream (submit, inline submit,
  #: done wait) are launched with programmatic stream serialization: a kernel's
  #: launch, its sequence number and its prefetch of the communicator overlap
  #: the end of the stream's previous kernel, and it waits for that kernel's
  #: completion (``griddepcontrol.wait``) before it reads the input or signals
  #: anything (xla_ffi/device/task.h, "site").  False (the default): plain
  #: stream order.  Measured on one H200 (two processes under MPS, chains of
  #: 4 KiB psums): no gain enqueued ahead, and awaited chains 20-21 us per op
  #: with it against 14-15 without (XLA re-records its command buffers every
  #: execution there).  Read at each call.
  submit_pdl: bool = False


@dataclasses.dataclass(repr=False)
class Overlap(_Section):
  """``jax_dfccl.config.overlap``: the fused GEMM + communication kernels (flat names ``overlap_<entry>``)."""
  _prefix = "overlap_"
  #: GPU (sm90, bfloat16/float16): per-shard ``all_gather_matmul`` /
  #: ``matmul_reduce_scatter`` run the fused tile-signaling GEMM kernels of the
  #: ``_dfccl_cuda`` extension when it is built with them (read at trace time; the
  #: context manager ``jax_dfccl._src.overlap_gpu.fused`` overrides it).
  fused: bool = True
  #: Fused AG+GEMM: move the rows to the peers with the copy engine
  #: (cudaMemcpyAsync over NVLink on a side stream, gated by the peer's ready
  #: flag; no SMs taken from the GEMM) once every rank's buffers exist; False:
  #: always the SM push kernel (16 SMs).  Read when a program is traced.
  copy_engine: bool = True
  #: Fused GEMM+RS: signal a partial tile with one system fence per CTA after a
  #: barrier of the storing threads (cumulative release); False: every storing
  #: thread runs its own system fence first (the first version's scheme).
  #: Read when a program is traced.
  cta_fence: bool = True
  #: Fused GEMM+RS on 2 ranks: when the peer's block of partial results is at
  #: least this many bytes, its tiles are stored locally and moved by the copy
  #: engine once the block is complete (side stream, gated by a tile counter)
  #: instead of NVLink stores from the epilogue; 0: always, -1: never.  On
  #: 2xH200 the copy engine won with 16 MiB blocks (0.48 vs 0.70 ms for
  #: 4096x4096x14336) and lost with 4 MiB blocks (0.59 vs 0.39 ms).  Read when a program is traced.
  rs_copy_engine_min_bytes: int = 8 << 20
  #: Fused GEMMs (both kinds): CTAs per cluster along M, 1 or 2.  2: clusters
  #: of two CTAs compute pairs of vertically adjacent tiles of one row block
  #: and load each weight tile once per pair (TMA multicast to both CTAs),
  #: which cuts the mainloop's L2 traffic by a third; the grid is whole
  #: clusters.  The GEMM alone on one H200 (benchmarks/overlap_gemm.py):
  #: within -3%..+4% of 1 over the 18 benchmark shapes, so 1 stays the default
  #: (not yet measured with communication on 2 GPUs).  0: chosen per launch
  #: by the host (xla_ffi/overlap/plan.cc, PlanLaunch): 1 when the last
  #: wave is split (overlap_split_last_wave) or the tiles fit in one wave,
  #: else 2.  Read (and checked) at trace time.
  cluster_m: int = 1
  #: Fused GEMMs: the tile width (columns of a 128-row tile): 128, 192 or
  #: 256, or 0 (default): the host picks one per shape, the least estimated
  #: time of a per-width model of waves, k iterations and a partial last
  #: wave's split, fitted to measurements on one H200
  #: (xla_ffi/overlap/plan.cc, ChooseTileN; narrower tiles fill the SMs
  #: better on small GEMMs, wider ones stream fewer operand bytes per flop).
  #: Read (and checked) at trace time.
  tile_n: int = 0
  #: Fused GEMMs: the order of a row block's tiles over the CTAs (for
  #: measurements): 0 (default) the plan's, n tiles in groups of 8 with m
  #: outer; 1..6 force an order of xla_ffi/overlap/protocol.h kRasters (2:
  #: m tiles inner, one n column at a time, CUTLASS's "along M").  Read (and
  #: checked) at trace time.
  raster: int = 0
  #: Fused GEMMs on 1x1 clusters: the epilogue stores the tiles whose
  #: destination is the rank's own output (AG; RS on one rank) with bulk
  #: tensor stores (TMA) from the staging tile, so the consumers go on to
  #: the next tile instead of storing it thread by thread.  None (default):
  #: the host picks them per launch (xla_ffi/overlap/plan.cc, PlanLaunch)
  #: when the tiles take more than one wave, so the next tile hides a tile's
  #: stores (one H200, the GEMM alone: 3-5% faster at K = 4096, 0.5% on
  #: average at larger K; 0-7% slower on a single wave).  True / False force
  #: them on / off.  Read (and checked) at trace time.
  tma_store: bool | None = None
  #: Fused GEMMs: the ping-pong schedule (1x1 clusters, 128-column tiles):
  #: the two consumer warp groups of a CTA compute a tile each and take turns
  #: on the tensor cores, so one's epilogue runs while the other's mainloop
  #: does.  False (default): the cooperative schedule (both groups on one
  #: tile, the epilogue between two mainloops), which was faster on one H200
  #: for the GEMM alone (xla_ffi/overlap/plan.cc, Pingpong).  True: ping-pong
  #: (then ``tile_n`` must be 0 or 128 and ``cluster_m`` 0
  #: or 1).  Read (and checked) at trace time.
  pingpong: bool = False
  #: Fused GEMMs on 1x1 clusters: split a partial last wave.  When
  #: the last wave of whole tiles would leave at least half of the SMs idle,
  #: its tiles are split into 2-4 equal k ranges, one CTA each; the last range
  #: adds the others' f32 partials and runs the tile's epilogue (its signal
  #: covers the whole tile).  The host chooses it per launch from the tile
  #: count, the SMs and K (xla_ffi/overlap/plan.cc, Schedule); False:
  #: whole tiles only.  Read when a program is traced.
  split_last_wave: bool = True
  #: Fused GEMMs: launched with programmatic stream serialization, so that a
  #: launch and its prologue (barriers, descriptor prefetch) overlap the end of
  #: the stream's previous kernel; each CTA that takes no more tiles lets the
  #: stream's next kernel launch, whose CTAs fill the SMs the last wave leaves
  #: (every such kernel waits for this one's completion before it touches
  #: memory).  1x1 clusters only (with 2x1 clusters it was slower).  On one
  #: H200 it saves 1-3 us per GEMM at M <= 2048.  False: plain stream order.
  #: Read when a program is traced.
  pdl: bool = True


@dataclasses.dataclass(repr=False)
class TestHooks(_Section):
  """``jax_dfccl.config.testing``: fault injection and test-only paths."""
  __test__ = False  # not a test class (pytest collects classes named Test*)

  #: Collectives over a group of one rank (a mesh axis of size 1) go through
  #: the runtime like any other (a custom call, the daemon) instead of lowering
  #: to plain HLO.  For tests and measurements of the runtime on one device
  #: only: results are the same, slower.  Read when a program is traced.
  runtime_for_groups_of_one: bool = False

  #: Fault injection, for tests (off by default): the device whose global
  #: id this is (-1: none) starts every collective ``fault_start_delay_us``
  #: late (its XLA thread waits: a slow or, past ``timeout_s``, a stuck rank)
  #: and computes each one ``fault_compute_delay_us`` late (a slow daemon).
  #: CPU backend.
  fault_device: int = -1
  fault_start_delay_us: float = 0.0
  fault_compute_delay_us: float = 0.0

  #: Hosts simulated on one machine: every ``processes_per_host`` consecutive
  #: process indices count as one host (0: every process is on its own machine's
  #: host).  A GPU group whose ranks are on more than one host is matched by
  #: announcements (docs/design/announce.md), the way groups spanning machines
  #: are.  Every process must set the same value; read when a group is set up
  #: (when the first program using it is lowered).
  processes_per_host: int = 0
  #: Microseconds each put of a group spanning hosts waits before it goes to a rank
  #: of another host: the network's latency, simulated (on one machine, with
  #: ``processes_per_host``).  Read when a group is set up.
  cross_host_latency_us: float = 0.0
  #: Bytes of a rank's input above which a blocking collective runs as several over
  #: pieces of it, on any backend (0: only where a group spans hosts, above its
  #: receive slot's section).  Read when a program is lowered.
  piece_bytes: int = 0


@dataclasses.dataclass(repr=False)
class Config(_Section):
  """``jax_dfccl.config``: what a user sets; the other sections as attributes."""
  #: A collective whose peers have not all started it after this many seconds
  #: fails with an error naming the key, the sequence number and the missing
  #: ranks (instead of hanging); the fused overlap ops too (their kernels' every
  #: cross-rank wait is bounded by it).
  timeout_s: float = 300.0
  #: Record start/preempt/resume/finish events for :func:`jax_dfccl.export_trace`.
  trace: bool = False
  #: Trace ring-buffer capacity (events per runtime).
  trace_capacity: int = 65536
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
  #: GPUs across hosts (:func:`jax_dfccl.initialize`): how a group whose ranks
  #: are on more than one host reaches its peers.  ``"auto"``: over NVSHMEM when
  #: the job's processes are on more than one machine (initialize() sets NVSHMEM
  #: up then), by direct stores (CUDA IPC) between hosts simulated on one machine
  #: (``config.testing.processes_per_host``); ``"nvshmem"``: over NVSHMEM in every
  #: job of several processes, also between simulated hosts; ``"stores"``: never
  #: NVSHMEM (a group spanning machines is then refused, naming this entry).
  #: Every process must set the same value.  Read by initialize().
  cross_host_transport: str = "auto"
  #: GPUs across hosts over NVSHMEM: bytes of NVSHMEM's symmetric heap that each
  #: process sets aside for its groups spanning hosts (each group's region per
  #: rank is about 16 x 64 KiB per member plus its rings: 4.3 MiB for a group of
  #: four).  NVSHMEM_SYMMETRIC_SIZE must hold it.  Read by initialize().
  cross_host_region_bytes: int = 64 << 20
  #: GPUs across hosts: a process of another host whose heartbeat (each process
  #: writes one to the job's key-value store every ``lost_after_s / 8``) stops
  #: for this many seconds, or that exited, is lost: the pending collectives with
  #: a rank there fail naming it, without waiting for ``timeout_s``.  Peers on
  #: this host are watched by their pids instead.  Read by initialize().
  lost_after_s: float = 2.0
  #: Scheduling and GPU transport tuning.
  tuning: Tuning = dataclasses.field(default_factory=Tuning)
  #: The fused GEMM + communication kernels.
  overlap: Overlap = dataclasses.field(default_factory=Overlap)
  #: Fault injection and test-only paths.
  testing: TestHooks = dataclasses.field(default_factory=TestHooks)

  def sections(self) -> dict:
    """``{path: section}``: ``""`` for the user entries, then ``"tuning"``, ``"overlap"``, ``"testing"``."""
    return {"": self, "tuning": self.tuning, "overlap": self.overlap, "testing": self.testing}

  def as_dict(self) -> dict:
    """Every entry by its flat name (the runtimes' names), with its value."""
    return {flat: getattr(sec, field) for flat, (sec, field) in self._flat().items()}

  def _flat(self) -> dict:
    return {flat: (self.sections()[path], field) for flat, (path, field) in FLAT.items()}

  def _set_flat(self, flat: str, value) -> None:
    """Sets an entry without pushing it (jax_dfccl._src.backend.configure does the push)."""
    sec, field = self._flat()[flat]
    object.__setattr__(sec, field, value)

  def __repr__(self):
    return f"jax_dfccl.Config({self.as_dict()})"

  @staticmethod
  def coerce(name: str, value):
    """`value` as the type of the entry with flat name `name` (``int``, ``float``, ``bool``);
    ``None`` kept where the entry allows it (``bool | None``)."""
    hint = TYPES[name]
    if name in CHOICES and value not in CHOICES[name]:
      raise ValueError(f"jax_dfccl.config: {name} must be one of {', '.join(map(repr, CHOICES[name]))}, "
                       f"not {value!r}")
    if isinstance(hint, types.UnionType):
      if value is None and type(None) in hint.__args__:
        return None
      hint = next(a for a in hint.__args__ if a is not type(None))
    return hint(value)


_SECTIONS = {"": Config, "tuning": Tuning, "overlap": Overlap, "testing": TestHooks}
_SECTION_PATH = {cls: (f".{path}" if path else "") for path, cls in _SECTIONS.items()}
_ENTRY_FIELDS = {cls: {f.name for f in dataclasses.fields(cls) if f.default_factory not in _SECTIONS.values()}
                 for cls in _SECTIONS.values()}  # the entries (Config's section fields excluded)

#: Every entry: flat name -> (section path, field name).
FLAT: dict[str, tuple[str, str]] = {
    cls._prefix + name: (path, name) for path, cls in _SECTIONS.items() for name in sorted(_ENTRY_FIELDS[cls])}
#: Every entry's type, by flat name.
TYPES: dict[str, type] = {
    cls._prefix + name: t for cls in _SECTIONS.values()
    for name, t in typing.get_type_hints(cls).items() if name in _ENTRY_FIELDS[cls]}
#: Every entry's default, by flat name.
DEFAULTS: dict[str, object] = {}


def _fresh() -> Config:
  c = Config()
  for sec in c.sections().values():
    sec._live_now()
  return c


config = _fresh()
DEFAULTS.update(Config().as_dict())

#: The entries only the CPU runtime reads (the GPU runtime's table has the rest but these,
#: INIT_ENTRIES and TRACE_TIME_ENTRIES).
CPU_ONLY_ENTRIES = frozenset({"trace_capacity", "fault_device", "fault_start_delay_us", "fault_compute_delay_us"})

#: The entries read by jax_dfccl.initialize() (the runtime across processes), not by the runtimes.
INIT_ENTRIES = frozenset({"shm_arena_bytes", "shm_max_instances", "cross_host_transport", "cross_host_region_bytes",
                          "lost_after_s"})

#: Entries whose values are one of a few names.
CHOICES: dict[str, tuple[str, ...]] = {"cross_host_transport": ("auto", "nvshmem", "stores")}

#: The entries read when a program is traced or lowered (by the Python layer), not by the runtimes.
TRACE_TIME_ENTRIES = frozenset({f for f, (path, _) in FLAT.items() if path == "overlap"}
                               | {"runtime_for_groups_of_one", "processes_per_host", "cross_host_latency_us", "piece_bytes",
                                  "two_level_plans"})
