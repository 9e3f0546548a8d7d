"""Another process's XLA buffers on the GPU: exported by CUDA IPC, or staged through runtime memory?

Run by tools/mps_testbed.sh (two processes on one GPU; it sets DFCCL_TESTBED_RANK/NPROC/COORD):

    tools/mps_testbed.sh -n 2 -- python3 benchmarks/ipc_export_mps.py --json ipc_export.json
    tools/mps_testbed.sh -n 2 -- python3 benchmarks/ipc_export_mps.py --allocator platform --json F

A collective between processes reads or writes arrays that XLA allocated in another process.  Two
ways to reach them: export the allocation that holds a buffer (its base from
cuMemGetAddressRange, one cudaIpcGetMemHandle per base, opened once per base by the peer and
cached), or stage: the owner copies the buffer into memory the runtime allocated and shared at
setup, and the peer copies it from there (one copy more, no handle per buffer).  This measures what
decides between them, for XLA's allocator as configured (`--allocator`, `--preallocate`: the
XLA_PYTHON_CLIENT_* variables, set before jax is imported):

  per buffer size   whether the pointer's allocation can be exported at all
                    (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE; the allowed handle types and
                    whether it comes from a memory pool, for allocators where it cannot), its
                    base and how many buffers share one base; the export's and the open's host
                    time; whether the peer reads exactly the owner's values through the mapping;
  then, in rank 1   the time of moving the buffer into a local array: directly from the peer's
                    mapped XLA buffer, against staged (the owner's buffer into a shared runtime
                    buffer, then into the local array), both as copy-engine copies (cudaMemcpyAsync)
                    and as SM copies (a CuPy kernel), medians of --reps, CUDA events on one stream.

Rank 0 fills each buffer with a pattern only it and the checker know (word i: i * 2654435761 + size
index); the peer compares what it reads with numpy.  The handles and offsets go through the
jax.distributed key-value store.  `--dry-run`: no GPU (the exchange, the barriers and the JSON).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import traceback

SIZES = "4K,64K,1M,16M,64M"
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10  # cuda.h
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17


def parse():
  env = os.environ.get
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", default=SIZES, help=f"buffer sizes in bytes (default {SIZES}; multiples of 4)")
  ap.add_argument("--reps", type=int, default=50, help="timed copies per size and path (default 50)")
  ap.add_argument("--allocator", default="", help="XLA_PYTHON_CLIENT_ALLOCATOR (default: XLA's, the BFC allocator)")
  ap.add_argument("--preallocate", choices=("false", "true"), default="false",
                  help="XLA_PYTHON_CLIENT_PREALLOCATE (true: with --mem-fraction, one region per process)")
  ap.add_argument("--mem-fraction", default="0.3", help="XLA_PYTHON_CLIENT_MEM_FRACTION with --preallocate true")
  ap.add_argument("--json", help="write the figures there (rank 0)")
  ap.add_argument("--rank", type=int, default=int(env("DFCCL_TESTBED_RANK", "-1")))
  ap.add_argument("--nproc", type=int, default=int(env("DFCCL_TESTBED_NPROC", "2")))
  ap.add_argument("--coord", default=env("DFCCL_TESTBED_COORD"))
  ap.add_argument("--dry-run", action="store_true", help="no GPU: the exchange, the barriers and the JSON")
  a = ap.parse_args()
  if a.rank not in (0, 1) or a.nproc != 2:
    ap.error(f"needs exactly two ranks (got --rank {a.rank} --nproc {a.nproc}); run it under tools/mps_testbed.sh -n 2")
  if not a.coord:
    ap.error("needs --coord (or DFCCL_TESTBED_COORD): the handles go through jax.distributed's key-value store")
  if a.reps < 1:
    ap.error("--reps must be at least 1")
  return a


def pattern(n_words: int, index: int):
  import numpy as np
  return (np.arange(n_words, dtype=np.uint64) * 2654435761 + index).astype(np.uint32)


class Driver:
  """The few driver calls CuPy does not wrap (ctypes on libcuda; the caller's context is current)."""

  def __init__(self):
    self._cu = ctypes.CDLL("libcuda.so.1")

  def _check(self, r, what):
    if r != 0:
      raise RuntimeError(f"{what}: CUresult {r}")

  def address_range(self, ptr: int):
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    self._check(self._cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
                "cuMemGetAddressRange")
    return base.value, size.value

  def attribute(self, ptr: int, attr: int, ctype=ctypes.c_int):
    v = ctype()
    self._check(self._cu.cuPointerGetAttribute(ctypes.byref(v), ctypes.c_int(attr), ctypes.c_uint64(ptr)),
                f"cuPointerGetAttribute({attr})")
    return v.value


def measure(a, kv, res, arrays, cp, rt, np):
  """Rank 1: opens rank 0's handles, checks the values and times both paths (into ``res``)."""
  got = json.loads(kv.get("meta"))
  handles = {int(k): bytes.fromhex(v) for k, v in got["handles"].items()}
  stage = rt.ipcOpenMemHandle(kv.get("stage"))
  opened = {}
  stream = cp.cuda.Stream(non_blocking=True)

  def view(ptr, n):
    mem = cp.cuda.UnownedMemory(ptr, n, None, 0)
    return cp.ndarray((n // 4,), cp.uint32, cp.cuda.MemoryPointer(mem, 0))

  def timed(fn):
    ts = []
    for _ in range(a.reps + 3):
      s, e = cp.cuda.Event(), cp.cuda.Event()
      s.record(stream)
      fn()
      e.record(stream)
      e.synchronize()
      ts.append(cp.cuda.get_elapsed_time(s, e))
    return round(float(np.median(ts[3:])) * 1e3, 2)  # µs

  for i, (n, x) in enumerate(zip(a.size_list, arrays)):
    e = res["sizes"][i]
    m = got["meta"][i]
    b = m["base_of"]
    if b is None or b not in handles:
      e["peer"] = "not exported"
      continue
    if b not in opened:
      t0 = time.perf_counter()
      opened[b] = rt.ipcOpenMemHandle(handles[b])
      e["open_us"] = round((time.perf_counter() - t0) * 1e6, 1)
    src = view(opened[b] + m["offset"], n)
    dst = view(x.unsafe_buffer_pointer(), n)  # rank 1's own XLA buffer of the same size
    stg = view(stage, n)
    with stream:
      dst.fill(0)
      cp.copyto(dst, src)
    stream.synchronize()
    e["exact"] = bool(np.array_equal(cp.asnumpy(dst), pattern(n // 4, i)))
    print(f"ipc_export_mps: rank 1: {n} bytes read through the mapping (exact: {e['exact']}); timing", flush=True)
    with stream:
      e["direct_memcpy_us"] = timed(lambda: rt.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3, stream.ptr))
      e["staged_memcpy_us"] = timed(lambda: (rt.memcpyAsync(stg.data.ptr, src.data.ptr, n, 3, stream.ptr),
                                             rt.memcpyAsync(dst.data.ptr, stg.data.ptr, n, 3, stream.ptr)))
      e["direct_sm_us"] = timed(lambda: cp.copyto(dst, src))
      e["staged_sm_us"] = timed(lambda: (cp.copyto(stg, src), cp.copyto(dst, stg)))
  for ptr in opened.values():
    rt.ipcCloseMemHandle(ptr)
  rt.ipcCloseMemHandle(stage)


def run_gpu(a, jax, kv) -> dict:
  import cupy as cp
  import numpy as np
  rt = cp.cuda.runtime
  cp.cuda.Device(0).use()
  rt.free(rt.malloc(256))  # the primary context, XLA's too, is current on this thread
  drv = Driver()
  dev = jax.devices()[0]
  res = {"rank": a.rank, "jax": jax.__version__, "device": dev.device_kind, "sizes": []}

  # Both ranks allocate the same buffers; rank 0's carry the pattern (rank 1's are what it reads into).
  arrays = []
  for i, n in enumerate(a.size_list):
    x = jax.device_put(pattern(n // 4, i) if a.rank == 0 else np.zeros(n // 4, np.uint32), dev)
    x.block_until_ready()
    arrays.append(x)
  bases = {}  # base -> (index of the first buffer in it, its handle or None)
  for i, (n, x) in enumerate(zip(a.size_list, arrays)):
    ptr = x.unsafe_buffer_pointer()
    e = {"bytes": n}
    try:
      e["ipc_capable"] = bool(drv.attribute(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE))
      e["allowed_handle_types"] = drv.attribute(ptr, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES)
      e["from_mempool"] = bool(drv.attribute(ptr, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ctypes.c_void_p))
      base, size = drv.address_range(ptr)
      e.update(offset=ptr - base, range_bytes=size)
      if base in bases:
        e["base_of"] = bases[base][0]
      else:
        t0 = time.perf_counter()
        try:
          handle = bytes(rt.ipcGetMemHandle(base))
          e["export_us"] = round((time.perf_counter() - t0) * 1e6, 1)
        except Exception as ex:  # noqa: BLE001 - reported
          handle, e["export_error"] = None, str(ex)[:300]
        bases[base] = (i, handle)
        e["base_of"] = i
    except Exception as ex:  # noqa: BLE001 - reported
      e["error"] = str(ex)[:300]
    res["sizes"].append(e)
  res["distinct_bases"] = len(bases)
  if a.rank == 0:
    meta = [{"base_of": e.get("base_of"), "offset": e.get("offset")} for e in res["sizes"]]
    handles = {str(i): h.hex() for i, h in bases.values() if h is not None}
    kv.put("meta", json.dumps({"meta": meta, "handles": handles}).encode())
    # Shared runtime buffer of the staged path: a cudaMalloc exported once (as the runtime's pools).
    stage = rt.malloc(max(a.size_list))
    kv.put("stage", bytes(rt.ipcGetMemHandle(stage)))
    print("ipc_export_mps: rank 0 exported; waiting for rank 1's measurements", flush=True)
    kv.barrier("measured")  # rank 1 reads and times while rank 0 holds its buffers
    print("ipc_export_mps: rank 0 past the barrier", flush=True)
    rt.free(stage)
    return res

  try:  # whatever fails here is reported in the figures: rank 0 waits at the barrier below
    measure(a, kv, res, arrays, cp, rt, np)
  except Exception:  # noqa: BLE001 - reported
    res["error"] = traceback.format_exc()[-3000:]
    print("ipc_export_mps: rank 1 failed:", res["error"], flush=True)
  kv.barrier("measured")
  return res


def main():
  a = parse()
  if a.allocator:
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = a.allocator
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = a.preallocate
  if a.preallocate == "true":
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = a.mem_fraction
  if a.dry_run:
    os.environ["JAX_PLATFORMS"] = "cpu"
  from common import KvExchange, parse_sizes, testbed_header, write_json  # noqa: PLC0415 - imports jax: after the environment above
  import jax
  a.size_list = parse_sizes(a.sizes)
  if not a.size_list or any(n <= 0 or n % 4 for n in a.size_list):
    sys.exit("ipc_export_mps: --sizes: positive multiples of 4 bytes")
  import faulthandler  # noqa: PLC0415
  faulthandler.dump_traceback_later(90, exit=False)  # where a stuck rank is
  kv = KvExchange(a.coord, a.nproc, a.rank, "dfccl_ipc_export")
  try:
    if a.dry_run:
      if a.rank == 0:
        kv.put("meta", json.dumps({"meta": [], "handles": {}}).encode())
      else:
        assert json.loads(kv.get("meta")) == {"meta": [], "handles": {}}
      kv.barrier("measured")
      res = {"rank": a.rank, "dry_run": True}
    else:
      res = run_gpu(a, jax, kv)
    if a.rank == 1:
      print("ipc_export_mps: rank 1", json.dumps(res), flush=True)  # in its log, whatever rank 0 does
      kv.put("result1", json.dumps(res).encode())
      return
    peer = json.loads(kv.get("result1"))
    doc = {
        **testbed_header("ipc_export_mps", res.get("device")),
        "allocator": a.allocator or "(XLA's default)", "preallocate": a.preallocate, "reps": a.reps,
        "what": "rank 0 owns XLA buffers with a pattern; rank 1 maps them by CUDA IPC (one handle per "
                "allocation base) and moves each into its own XLA buffer: directly, or staged through a "
                "shared cudaMalloc buffer (two copies); µs are medians of CUDA-event times on one stream",
        "rank0": res, "rank1": peer,
    }
    if a.json:
      write_json(a.json, doc)
      print(f"ipc_export_mps: wrote {a.json}")
    for e in peer.get("sizes", []):
      print("ipc_export_mps:", json.dumps(e))
  finally:
    kv.close()


if __name__ == "__main__":
  main()
