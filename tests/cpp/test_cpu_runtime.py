"""The CPU runtime (_dfccl_cpu) driven directly through jax.ffi.ffi_call.

Independent of the JAX layer in jax_dfccl/_src: every op, dtype and reduction
against a numpy reference, rank-dependent start orders, errors (mismatch,
timeout, unknown ticket), reset(), memory (no instance left behind) and a
throughput smoke test.  Targets are registered under private names.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dfccl import _dfccl_cpu as rt
from jax_dfccl._src.core import KIND, REDUCE as RED  # the runtime's op table
from jax_dfccl.config import Config

N = 8
_registered = False


def _register():
  global _registered
  if not _registered:
    regs = rt.registrations()
    jax.ffi.register_ffi_target("dfccl_rt_test_start", regs["dfccl_start"], platform="cpu")
    jax.ffi.register_ffi_target("dfccl_rt_test_done", regs["dfccl_done"], platform="cpu")
    _registered = True


@pytest.fixture(scope="module")
def mesh():
  _register()
  return Mesh(np.array(jax.devices("cpu")[:N]), ("x",))


@pytest.fixture(autouse=True)
def clean_runtime():
  rt.reset()
  # Every entry (the runtime has no defaults of its own and runs nothing before).
  rt.configure(dict(Config().as_dict(), timeout_s=300.0, trace=False))
  yield
  try:  # drop the failed runtime tokens of programs that were expected to fail
    jax.effects_barrier()
  except Exception:
    pass
  rt.reset()
  rt.configure({"timeout_s": 300.0, "trace": False})


def _hash(key):
  return int(np.frombuffer(key.encode().ljust(8, b"\0")[:8], np.int64)[0]) ^ len(key) * 7919


def _site(key):
  # The start op's id in the program (start/done pairing); one start per key here.
  return _hash(key) & 0x7FFFFFFF


def _start(x, pid, mesh, kind, key, reduce="sum", perm=((-1, -1),), out_len=None):
  n = N
  out_len = {"all_gather": n * x.shape[0], "reduce_scatter": x.shape[0] // n}.get(kind, x.shape[0])
  sds = jax.ShapeDtypeStruct
  call = jax.ffi.ffi_call("dfccl_rt_test_start",
                          (sds((out_len,), x.dtype), sds(x.shape, x.dtype), sds((), jnp.int64)),
                          has_side_effect=True, input_output_aliases={0: 1})
  return call(x, pid, kind=np.int32(KIND[kind]), reduce_op=np.int32(RED[reduce]), key=key,
              key_hash=np.int64(_hash(key)), site=np.int64(_site(key)), group_size=np.int32(n),
              groups=np.arange(n, dtype=np.int32),
              device_ids=np.array([d.id for d in mesh.devices.flat], np.int64),
              perm=np.asarray(perm, np.int32).reshape(-1))


def _done(h, key):
  out, xa, t = h
  call = jax.ffi.ffi_call("dfccl_rt_test_done", jax.ShapeDtypeStruct(out.shape, out.dtype),
                          has_side_effect=True, input_output_aliases={0: 0})
  return call(out, xa, t, key=key, site=np.int64(_site(key)))


def _pid():
  return jax.lax.axis_index("x").astype(jnp.int32)


def _settled_stats(pred, timeout=2.0):
  """stats() once pred holds: XLA may raise one device's error before the others returned."""
  t0 = time.time()
  while True:
    s = rt.stats()
    if pred(s) or time.time() - t0 > timeout:
      return s
    time.sleep(0.01)


def _run(mesh, body, *xs):
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * len(xs), out_specs=P("x"),
                    check_vma=False)
  return np.asarray(jax.jit(f)(*[jax.device_put(x, NamedSharding(mesh, P("x"))) for x in xs]))


DTYPES = [np.float32, np.float64, np.int32, jnp.bfloat16, np.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["sum", "max", "min"])
def test_all_reduce(mesh, dtype, reduce):
  E = 37
  rng = np.random.default_rng(0)
  x = (rng.integers(-50, 50, size=(N, E)) * (1 if dtype == np.int32 else 0.37)).astype(dtype)
  with jax.enable_x64(dtype == np.float64):
    out = _run(mesh, lambda v: _done(_start(v, _pid(), mesh, "all_reduce", "ar", reduce), "ar"),
               x.reshape(-1))
  assert out.dtype == np.dtype(dtype)
  acc = x.astype(np.float64 if dtype == np.float64 else (np.int64 if dtype == np.int32 else np.float32))
  ref = {"sum": lambda a: functools_reduce(np.add, a), "max": lambda a: a.max(0), "min": lambda a: a.min(0)}
  want = ref[reduce](acc).astype(dtype)
  np.testing.assert_array_equal(out.reshape(N, E), np.broadcast_to(want, (N, E)))


def functools_reduce(f, a):
  acc = a[0]
  for r in range(1, a.shape[0]):
    acc = f(acc, a[r])  # rank order, in the accumulator type
  return acc


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_data_movement_and_reduce_scatter(mesh, dtype):
  E = 5
  x = np.arange(N * N * E).astype(dtype).reshape(N, N * E)  # rank r: x[r]
  ag = _run(mesh, lambda v: _done(_start(v, _pid(), mesh, "all_gather", "ag"), "ag"),
            x[:, :E].reshape(-1))
  np.testing.assert_array_equal(ag.reshape(N, N * E), np.broadcast_to(x[:, :E].reshape(-1), (N, N * E)))
  a2a = _run(mesh, lambda v: _done(_start(v, _pid(), mesh, "all_to_all", "a2a"), "a2a"), x.reshape(-1))
  blocks = x.reshape(N, N, E)  # [src, dst]
  np.testing.assert_array_equal(a2a.reshape(N, N, E), blocks.transpose(1, 0, 2))
  rs = _run(mesh, lambda v: _done(_start(v, _pid(), mesh, "reduce_scatter", "rs"), "rs"), x.reshape(-1))
  want = blocks.astype(np.float32 if dtype != np.int32 else np.int64).sum(0).astype(dtype)
  np.testing.assert_array_equal(rs.reshape(N, E), want)


def test_ppermute_with_missing_source(mesh):
  E = 3
  x = np.arange(N * E, dtype=np.float32)
  perm = [(i, i + 1) for i in range(N - 1)]  # rank 0 receives nothing -> zeros
  out = _run(mesh, lambda v: _done(_start(v, _pid(), mesh, "ppermute", "pp", perm=perm), "pp"), x)
  want = np.concatenate([np.zeros(E, np.float32), x[:-E]])
  np.testing.assert_array_equal(out, want)


def test_rank_dependent_order_and_reentry(mesh):
  """Every rank starts 4 keys in its own order, inside a loop (seq > 0), done in reverse."""
  keys = ["k0", "k1", "k2", "k3"]
  x = np.arange(N * 4, dtype=np.float32)

  def body(v):
    def step(i, acc):
      def branch(order):
        def f(v):
          hs = {k: _start(v * (j + 1), _pid(), mesh, "all_reduce", k) for k in order
                for j in [keys.index(k)]}
          return sum(_done(hs[k], k) for k in reversed(order))
        return f
      orders = [keys[r % 4:] + keys[:r % 4] if r % 2 else list(reversed(keys)) for r in range(N)]
      return acc + jax.lax.switch(_pid(), [branch(o) for o in orders], v)
    return jax.lax.fori_loop(0, 10, step, jnp.zeros_like(v))
  rt.configure({"trace": True})
  out = _run(mesh, body, x)
  col = x.reshape(N, 4).sum(0)
  np.testing.assert_allclose(out.reshape(N, 4), np.broadcast_to(10 * 10 * col, (N, 4)))
  s = rt.stats()
  assert s["started"] == s["completed"] == 10 * 4 * N and s["failed"] == 0, s
  assert s["instances_live"] == 0 and s["pending"] == 0, s
  assert s["key_counters"] == 4, s
  # Every input and output copy released: a task's output copy goes with the task, which the
  # runtime's own threads may still hold for a moment after the program returned.
  s = _settled_stats(lambda s: s["tickets"] == 0 and s["staging_bytes"] == 0, timeout=5.0)
  assert s["tickets"] == 0 and s["staging_bytes"] == 0, s
  ev = rt.trace_records()
  assert {e[3] for e in ev} >= {"start", "run", "finish"}
  assert all(isinstance(e[4], int) for e in ev) and len(ev) == s["trace_records"]


def _two_shapes(mesh, v, key):
  def small(v):
    return jnp.concatenate([_done(_start(v[:4], _pid(), mesh, "all_reduce", key), key), v[4:]])
  def big(v):
    return _done(_start(v, _pid(), mesh, "all_reduce", key), key)
  return jax.lax.cond(_pid() == 3, small, big, v)


def test_mismatch_fails_all_ranks(mesh):
  x = np.arange(N * 8, dtype=np.float32)
  with pytest.raises(Exception, match=r"collective 'mm' \(seq 0\) mismatch: rank \d all_reduce\(sum\) "
                                      r"dtype=11 elems=(8|4) vs rank \d"):
    _run(mesh, lambda v: _two_shapes(mesh, v, "mm"), x)
  s = _settled_stats(lambda s: s["failed"] == N)
  assert s["failed"] == N and s["pending"] == 0 and s["instances_live"] == 0, s


def test_timeout_names_missing_ranks_then_reset(mesh):
  rt.configure({"timeout_s": 0.3})
  x = np.arange(N, dtype=np.float32)
  def body(v):
    lonely = lambda v: _done(_start(v, _pid(), mesh, "all_reduce", "lonely"), "lonely")
    return jax.lax.cond(_pid() < 2, lonely, lambda v: v, v)
  t0 = time.time()
  with pytest.raises(Exception, match=r"'lonely' \(seq 0\) timed out after 0.3 s on rank [01]: "
                                      r"ranks \[2 \(device 2\), 3 \(device 3\).*7 \(device 7\)\] never started"):
    _run(mesh, body, x)
  assert time.time() - t0 < 5
  s = _settled_stats(lambda s: s["failed"] == 2)
  # The failed instance left the table; its tombstone remembers the ranks that never started it.
  assert s["failed"] == 2 and s["pending"] == 0 and s["instances_live"] == 0 and s["tombstones"] == 1, s
  rt.reset()
  s = rt.stats()
  assert s["instances_live"] == 0 and s["key_counters"] == 0 and s["started"] == 0, s
  rt.configure({"timeout_s": 300.0})
  out = _run(mesh, lambda v: _done(_start(v, _pid(), mesh, "all_reduce", "lonely"), "lonely"), x)
  np.testing.assert_array_equal(out, np.full(N, 28.0, np.float32))


def test_failed_instance_does_not_trap_later_executions(mesh):
  """Ranks 0, 1 start 'late' alone and time out.  A later execution in which only ranks 2.. start
  it does not join that failed instance (they skip the sequence number they missed in the earlier
  execution): it times out at seq 1, naming ranks 0 and 1.  A third execution in which every rank
  starts it is exact: every rank skipped exactly what it missed."""
  rt.configure({"timeout_s": 0.2})
  x = np.arange(N, dtype=np.float32)
  def body(v):
    h = _start(v, _pid(), mesh, "all_reduce", "late")
    return _done(h, "late")
  def first(v):
    return jax.lax.cond(_pid() < 2, lambda v: body(v), lambda v: v, v)
  with pytest.raises(Exception, match=r"'late' \(seq 0\) timed out"):
    _run(mesh, first, x)
  def second(v):
    return jax.lax.cond(_pid() < 2, lambda v: v, lambda v: body(v), v)
  with pytest.raises(Exception, match=r"'late' \(seq 1\) timed out .*ranks \[0 \(device 0\), 1 \(device 1\)\]"):
    _run(mesh, second, x)
  s = _settled_stats(lambda s: s["failed"] == N)
  assert s["failed"] == N and s["instances_live"] == 0 and s["pending"] == 0 and s["tombstones"] == 1, s  # seq 0: every missing rank moved past it
  rt.configure({"timeout_s": 300.0})
  np.testing.assert_array_equal(_run(mesh, body, x), np.full(N, 28.0, np.float32))
  s = rt.stats()
  assert s["tombstones"] == 0 and s["instances_live"] == 0, s


def test_unknown_ticket():
  _register()
  z = jnp.zeros(4, jnp.float32)
  call = jax.ffi.ffi_call("dfccl_rt_test_done", jax.ShapeDtypeStruct((4,), jnp.float32),
                          has_side_effect=True, input_output_aliases={0: 0})
  with jax.enable_x64(True), pytest.raises(Exception, match="handle done twice or never started"):
    np.asarray(jax.jit(lambda z: call(z, z, jnp.int64(987654321), key="nope", site=np.int64(1)))(z))


def test_configure_and_stats_shape():
  rt.configure({"spin_budget_us": 10, "sticky_budget_us": 100.0, "trace": 1, "trace_capacity": 4,
                "unknown_entry": object()})
  s = rt.stats()
  for k in ("started", "completed", "failed", "preemptions", "pending", "daemon_threads",
            "instances_live", "key_counters", "trace_records"):
    assert isinstance(s[k], int), k
  c = rt.config()
  assert c["spin_budget_us"] == 10 and c["sticky_budget_us"] == 100 and c["trace"] is True
  assert c["trace_capacity"] == 4 and isinstance(c["trace_capacity"], int)
  with pytest.raises(ValueError):
    rt.configure({"timeout_s": -1})
  with pytest.raises(ValueError):  # all or nothing: the valid entry is not applied either
    rt.configure({"spin_budget_us": 7.0, "trace_capacity": 0})
  assert rt.config()["spin_budget_us"] == 10
  rt.configure({"spin_budget_us": 20.0, "sticky_budget_us": 500.0, "trace_capacity": 65536})


def test_trace_ring_is_bounded(mesh):
  rt.configure({"trace": True, "trace_capacity": 16})
  x = np.arange(N, dtype=np.float32)
  _run(mesh, lambda v: jax.lax.fori_loop(
      0, 20, lambda i, a: a + _done(_start(v, _pid(), mesh, "all_reduce", "ring"), "ring"), v), x)
  ev = rt.trace_records()
  assert len(ev) == 16 and all(ev[i][4] <= ev[i + 1][4] for i in range(15))
  rt.configure({"trace_capacity": 65536})


def test_throughput(mesh):
  """1000 small all-reduces in one program on 8 CPU devices."""
  x = np.arange(N * 16, dtype=np.float32)
  f = lambda v: jax.lax.fori_loop(
      0, 1000, lambda i, a: _done(_start(a, _pid(), mesh, "all_reduce", "tp"), "tp") * 0.125, v)
  _run(mesh, f, x)  # compile + warm
  t0 = time.perf_counter()
  out = _run(mesh, f, x)
  dt = time.perf_counter() - t0
  print(f"\n1000 all-reduces: {dt * 1e3:.1f} ms ({dt * 1e3:.1f} us per collective)")
  np.testing.assert_allclose(out.reshape(N, 16), np.broadcast_to(x.reshape(N, 16).mean(0), (N, 16)),
                             rtol=1e-5)
  assert rt.stats()["instances_live"] == 0


def _build_and_run_sanitized(tmp_path, sanitizer, sources, includes=()):
  """Builds `sources` (paths under the repository; `includes`: folders searched first) with
  -fsanitize=`sanitizer` and runs the program: it must print OK and the sanitizer nothing."""
  import os
  import shutil
  import subprocess
  cxx = shutil.which("g++") or shutil.which("c++")
  if cxx is None:
    pytest.skip("no C++ compiler")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  exe = tmp_path / "stress"
  build = subprocess.run(
      [cxx, "-std=c++20", "-O1", "-g", f"-fsanitize={sanitizer}", *(f"-I{root}/{i}" for i in includes),
       f"-I{root}/xla_ffi/include",
       f"-I{root}/xla_ffi", *(f"{root}/{s}" for s in sources), "-o", str(exe), "-lpthread"],
      capture_output=True, text=True)
  if build.returncode != 0 and "sanitize" in build.stderr:
    pytest.skip(f"-fsanitize={sanitizer} unavailable: {build.stderr[-300:]}")
  assert build.returncode == 0, build.stderr[-3000:]
  run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and "OK" in run.stdout and "Sanitizer" not in run.stderr \
      and "runtime error" not in run.stderr, \
      run.stdout[-2000:] + run.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_runtime_stress_sanitized(tmp_path, sanitizer):
  """tests/cpp/runtime_stress.cc: random orders, inputs freed right after done(), under TSan/ASan."""
  _build_and_run_sanitized(tmp_path, sanitizer, [
      "tests/cpp/runtime_stress.cc", "xla_ffi/cpu/runtime.cc", "xla_ffi/cpu/inspect.cc", "xla_ffi/cpu/daemon.cc",
      "xla_ffi/cpu/multiprocess.cc", "xla_ffi/cpu/shm.cc", "xla_ffi/cpu/staging.cc"])


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_shm_protocol_stress_sanitized(tmp_path, sanitizer):
  """tests/cpp/shm_stress.cc: the shared-memory matching protocol (xla_ffi/cpu/shm.h)
  with threads as ranks of three processes, random orders, a mismatch per round."""
  _build_and_run_sanitized(tmp_path, sanitizer, ["tests/cpp/shm_stress.cc", "xla_ffi/cpu/shm.cc"])


def test_identity_layout_sanitized(tmp_path):
  """tests/cpp/identity_layout.cc: the small-message identity layout of xla_ffi/device/task.h
  (a key's bucket of slots inside the pool, the same for every sequence number, keys spread over
  the buckets; tags never 0 and distinct over 2^20 sequence numbers of a key), under UBSan."""
  _build_and_run_sanitized(tmp_path, "undefined", ["tests/cpp/identity_layout.cc"])


@pytest.mark.parametrize("sanitizer", ["address", "undefined"])
def test_device_wait_helper_sanitized(tmp_path, sanitizer):
  """tests/cpp/wait_helper.cc: the device's one wait (xla_ffi/device/wait.cuh, compiled for the
  host through tests/cpp/device_shim): the policies' back-off and clock cadences as the waits had
  them before, no clock read when a wait is over at once, the poll index, the abort check's
  cadence, the bound, and the fatal form (report, then trap)."""
  _build_and_run_sanitized(tmp_path, sanitizer, ["tests/cpp/wait_helper.cc"], includes=["tests/cpp/device_shim"])


@pytest.mark.parametrize("sanitizer", ["address", "undefined"])
def test_gpu_execution_book_sanitized(tmp_path, sanitizer):
  """tests/cpp/run_book_test.cc: the GPU runtime's execution book (the host's side,
  xla_ffi/runtime/run_book.h, with the device's arithmetic, dfccl/execution.h) — how many starts of a
  key a process's failed executions left behind, from its starts' launch ids: whole and partial
  executions, programs booked apart, the 32-bit wrap, processes with one history skipping alike, a
  failed process's tombstones taking the sequence numbers its peers' execution took, replays from a
  command buffer, lines reused and a full table."""
  _build_and_run_sanitized(tmp_path, sanitizer, ["tests/cpp/run_book_test.cc"])


@pytest.mark.parametrize("sanitizer", ["address", "undefined"])
def test_submit_kernels_execution_book_sanitized(tmp_path, sanitizer):
  """tests/cpp/submit_book_test.cc: the submit kernels' side of the execution book
  (xla_ffi/device/submit.cuh SubmitBook and its tombstones, compiled for the host through
  tests/cpp/device_shim) run as one GPU's stream: the sequence numbers tombstones and starts take,
  tombstones without buffers arriving failed, the host's records, a replayed start's launch id from
  the initialize stage's word, what the host found owed, and the cap on one start's tombstones."""
  _build_and_run_sanitized(tmp_path, sanitizer, ["tests/cpp/submit_book_test.cc"], includes=["tests/cpp/device_shim"])


@pytest.mark.parametrize("sanitizer", ["address", "undefined"])
def test_device_match_protocol_stress_sanitized(tmp_path, sanitizer):
  """tests/cpp/match_stress.cc: the GPU runtime's instance matching (xla_ffi/device/match.cuh,
  compiled for the host through tests/cpp/device_shim) with threads as ranks: rank-specific
  orders, fewer slots than instances, one crowded bucket, mismatches, and first (one thread) the
  launch-id check of protocol "run" (the same execution, another program or an unknown id pair; an
  execution ahead fails both ranks naming it; a tombstone fails its peer); every rank sees the same
  slot and epoch, no slot serves two instances at once, the table ends empty.  (Not TSan: the
  protocol's volatile accesses and its dependency-ordered reuse of an entry are races in C++'s
  model; task.h gives the GPU ordering argument.)"""
  _build_and_run_sanitized(tmp_path, sanitizer, ["tests/cpp/match_stress.cc"], includes=["tests/cpp/device_shim"])


@pytest.mark.parametrize("sanitizer", ["thread", "address", "undefined"])
def test_announce_protocol_stress_sanitized(tmp_path, sanitizer):
  """tests/cpp/announce_stress.cc: protocol C for communicators spanning hosts
  (xla_ffi/transport/announce.cuh over a transport of xla_ffi/transport/transport.cuh, compiled for the
  host through tests/cpp/device_shim) with threads as ranks, 2 hosts x 2 ranks (one run with 20 us
  between hosts) and 4 x 1: rank-specific orders on fewer receive slots than instances (the home's
  reserve grants), sums through the announced slots against a reference, mismatches named alike on
  every rank, the instance cap refused at once, the home's timeout verdict and a late start meeting
  its tombstone, a dead rank (the home in one run) named by every other rank, everything empty at
  the end.  TSan too: every word two ranks share is a std::atomic access or ordered by one
  (release/acquire), except in the run over StoreTransport, whose fence TSan does not model
  (that run is left out under TSan)."""
  _build_and_run_sanitized(tmp_path, sanitizer, ["tests/cpp/announce_stress.cc"], includes=["tests/cpp/device_shim"])
