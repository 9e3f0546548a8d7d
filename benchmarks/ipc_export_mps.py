"""Another process's XLA buffers on the GPU: exported by CUDA IPC, or staged through runtime memory?

Run by tools/mps_testbed.sh (two processes on one GPU; it sets DFCCL_TESTBED_RANK/NPROC/COORD):

    tools/mps_testbed.sh -n 2 -- python3 benchmarks/ipc_export_mps.py --json ipc_export.json
    tools/mps_testbed.sh -n 2 -- python3 benchmarks/ipc_export_mps.py --allocator platform --json F

A collective between processes reads or writes arrays that XLA allocated in another process.  Two
ways to reach them: export the allocation that holds a buffer (its base from cuMemGetAddressRange,
exported once per base and mapped once per base by the peer, cached: by cudaIpcGetMemHandle where
the allocation came from cudaMalloc, or, where it came from cuMemCreate with the POSIX
file-descriptor handle type allowed, as a file descriptor — cuMemRetainAllocationHandle and
cuMemExportToShareableHandle, sent over a Unix socket, mapped by cuMemImportFromShareableHandle,
cuMemMap and cuMemSetAccess), or stage: the owner copies the buffer into memory the runtime allocated and shared at
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
import socket
import sys
import tempfile
import time
import traceback

SIZES = "4K,64K,1M,16M,64M"
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10  # cuda.h
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17
CU_MEM_HANDLE_TYPE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


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

  # Allocations made with cuMemCreate (virtual memory management) are shared as a file descriptor.
  def export_fd(self, base: int) -> int:
    """A POSIX file descriptor of the physical allocation mapped at ``base``."""
    h, fd = ctypes.c_uint64(), ctypes.c_int(-1)
    self._check(self._cu.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(base)), "cuMemRetainAllocationHandle")
    try:
      self._check(self._cu.cuMemExportToShareableHandle(ctypes.byref(fd), h, ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FD),
                                                        ctypes.c_uint64(0)), "cuMemExportToShareableHandle")
    finally:
      self._cu.cuMemRelease(h)
    return fd.value

  def import_fd(self, fd: int, size: int, device: int):
    """Maps the allocation behind ``fd`` (``size`` bytes) into this process, readable and writable
    by ``device``: (address, handle) for ``unmap``."""
    h, va = ctypes.c_uint64(), ctypes.c_uint64()
    self._check(self._cu.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd),
                                                        ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FD)), "cuMemImportFromShareableHandle")
    self._check(self._cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                             ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
    self._check(self._cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_uint64(0)), "cuMemMap")
    desc = (ctypes.c_int * 3)(CU_MEM_LOCATION_TYPE_DEVICE, device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)  # CUmemAccessDesc
    self._check(self._cu.cuMemSetAccess(va, ctypes.c_size_t(size), desc, ctypes.c_size_t(1)), "cuMemSetAccess")
    return va.value, h.value

  def unmap(self, va: int, size: int, handle: int):
    self._check(self._cu.cuMemUnmap(ctypes.c_uint64(va), ctypes.c_size_t(size)), "cuMemUnmap")
    self._check(self._cu.cuMemAddressFree(ctypes.c_uint64(va), ctypes.c_size_t(size)), "cuMemAddressFree")
    self._check(self._cu.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")


def measure(a, kv, res, arrays, cp, rt, np, drv):
  """Rank 1: maps rank 0's allocations (each way it could export them), checks the values and times
  the direct and the staged moves (into ``res``)."""
  path = os.path.join(os.environ.get("DFCCL_TESTBED_TMP") or tempfile.gettempdir(), f"ipc_export_{os.getpid()}.sock")
  srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  srv.bind(path)
  srv.listen(1)
  kv.put("sock", path.encode())  # rank 0 sends its file descriptors there (SCM_RIGHTS)
  got = json.loads(kv.get("meta"))
  srv.settimeout(120)
  conn, _ = srv.accept()
  _, fds, _, _ = socket.recv_fds(conn, 16, max(1, len(got["fd_bases"])))
  conn.close()
  srv.close()
  os.unlink(path)
  legacy = {int(k): bytes.fromhex(v) for k, v in got["handles"].items()}
  fd_of = dict(zip(got["fd_bases"], fds))
  stage = rt.ipcOpenMemHandle(kv.get("stage"))
  opened = {}  # (way, base index) -> mapped address of the allocation
  vmm_maps = []
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

  def open_base(way, b, e):
    if (way, b) not in opened:
      t0 = time.perf_counter()
      if way == "legacy":
        opened[way, b] = rt.ipcOpenMemHandle(legacy[b])
      else:
        size = got["meta"][b]["range_bytes"]
        va, h = drv.import_fd(fd_of[b], size, 0)
        vmm_maps.append((va, size, h))
        opened[way, b] = va
      e[f"{way}_open_us"] = round((time.perf_counter() - t0) * 1e6, 1)
    return opened[way, b]

  for i, (n, x) in enumerate(zip(a.size_list, arrays)):
    e = res["sizes"][i]
    b = got["meta"][i]["base_of"]
    dst = view(x.unsafe_buffer_pointer(), n)  # rank 1's own XLA buffer of the same size
    stg = view(stage, n)
    for way, have in (("legacy", legacy), ("vmm", fd_of)):
      if b is None or b not in have:
        e[f"{way}_peer"] = "not exported"
        continue
      try:
        src = view(open_base(way, b, e) + got["meta"][i]["offset"], n)
        with stream:
          dst.fill(0)
          cp.copyto(dst, src)
        stream.synchronize()
        e[f"{way}_exact"] = bool(np.array_equal(cp.asnumpy(dst), pattern(n // 4, i)))
        print(f"ipc_export_mps: rank 1: {n} bytes read through the {way} mapping (exact: {e[f'{way}_exact']})", flush=True)
      except Exception as ex:  # noqa: BLE001 - reported
        e[f"{way}_peer"] = str(ex)[:300]
        continue
      if "direct_memcpy_us" in e:
        continue  # one mapping of a buffer is timed (the copies do not depend on how it was shared)
      e["timed_through"] = way
      with stream:
        e["direct_memcpy_us"] = timed(lambda: rt.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3, stream.ptr))
        e["staged_memcpy_us"] = timed(lambda: (rt.memcpyAsync(stg.data.ptr, src.data.ptr, n, 3, stream.ptr),
                                               rt.memcpyAsync(dst.data.ptr, stg.data.ptr, n, 3, stream.ptr)))
        e["direct_sm_us"] = timed(lambda: cp.copyto(dst, src))
        e["staged_sm_us"] = timed(lambda: (cp.copyto(stg, src), cp.copyto(dst, stg)))
  stream.synchronize()
  for (way, _), ptr in opened.items():
    if way == "legacy":
      rt.ipcCloseMemHandle(ptr)
  for va, size, h in vmm_maps:
    drv.unmap(va, size, h)
  for fd in fds:
    os.close(fd)
  rt.ipcCloseMemHandle(stage)


def run_gpu(a, jax, kv) -> dict:
  import cupy as cp
  import numpy as np
  rt = cp.cuda.runtime
  cp.cuda.Device(0).use()
  rt.free(rt.malloc(256))  # the primary context, XLA's too, is current on this thread
  drv = Driver()
  dev = jax.local_devices()[0]  # this process's GPU (jax.devices()[0] is rank 0's everywhere)
  res = {"rank": a.rank, "jax": jax.__version__, "device": dev.device_kind, "sizes": []}

  # Both ranks allocate the same buffers; rank 0's carry the pattern (rank 1's are what it reads into).
  arrays = []
  for i, n in enumerate(a.size_list):
    x = jax.device_put(pattern(n // 4, i) if a.rank == 0 else np.zeros(n // 4, np.uint32), dev)
    x.block_until_ready()
    arrays.append(x)
  bases = {}  # base -> (index of the first buffer in it, its legacy handle or None, its fd or None)
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
        handle = fd = None
        t0 = time.perf_counter()
        try:  # cudaIpcGetMemHandle: allocations made by cudaMalloc
          handle = bytes(rt.ipcGetMemHandle(base))
          e["legacy_export_us"] = round((time.perf_counter() - t0) * 1e6, 1)
        except Exception as ex:  # noqa: BLE001 - reported
          e["legacy_export_error"] = str(ex)[:300]
        t0 = time.perf_counter()
        try:  # a file descriptor: allocations made by cuMemCreate with that handle type allowed
          fd = drv.export_fd(base)
          e["vmm_export_us"] = round((time.perf_counter() - t0) * 1e6, 1)
        except Exception as ex:  # noqa: BLE001 - reported
          e["vmm_export_error"] = str(ex)[:300]
        bases[base] = (i, handle, fd)
        e["base_of"] = i
    except Exception as ex:  # noqa: BLE001 - reported
      e["error"] = str(ex)[:300]
    res["sizes"].append(e)
  res["distinct_bases"] = len(bases)
  if a.rank == 0:
    meta = [{"base_of": e.get("base_of"), "offset": e.get("offset"), "range_bytes": e.get("range_bytes")}
            for e in res["sizes"]]
    handles = {str(i): h.hex() for i, h, _ in bases.values() if h is not None}
    with_fd = [(i, fd) for i, _, fd in bases.values() if fd is not None]
    kv.put("meta", json.dumps({"meta": meta, "handles": handles, "fd_bases": [i for i, _ in with_fd]}).encode())
    # Shared runtime buffer of the staged path: a cudaMalloc exported once (as the runtime's pools).
    stage = rt.malloc(max(a.size_list))
    kv.put("stage", bytes(rt.ipcGetMemHandle(stage)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
      sock.connect(kv.get("sock").decode())
      socket.send_fds(sock, [b"fds"], [fd for _, fd in with_fd])
    for _, fd in with_fd:
      os.close(fd)  # rank 1 holds its own copies
    print("ipc_export_mps: rank 0 exported; waiting for rank 1's measurements", flush=True)
    kv.barrier("measured")  # rank 1 reads and times while rank 0 holds its buffers
    print("ipc_export_mps: rank 0 past the barrier", flush=True)
    rt.free(stage)
    return res

  try:  # whatever fails here is reported in the figures: rank 0 waits at the barrier below
    measure(a, kv, res, arrays, cp, rt, np, drv)
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
        "what": "rank 0 owns XLA buffers with a pattern; rank 1 maps them (one export per allocation "
                "range: a cudaIpc handle, legacy_*, or a file descriptor of a cuMemCreate allocation, "
                "vmm_*) and moves each into its own XLA buffer: directly, or staged through a shared "
                "cudaMalloc buffer (two copies); µs are medians of CUDA-event times on one stream",
        "rank0": res, "rank1": peer,
    }
    if a.json:
      write_json(a.json, doc)
      print(f"ipc_export_mps: wrote {a.json}")
    for e in peer.get("sizes", []):
      print("ipc_export_mps:", json.dumps(e))
  except BaseException:
    traceback.print_exc()  # now: the shutdown below ends the process if the peer is gone
    sys.stderr.flush()
    raise
  finally:
    kv.close()


if __name__ == "__main__":
  main()
