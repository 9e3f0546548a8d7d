"""Costs of memory-ordering operations on the GPU (one thread, 1000 repetitions, %globaltimer):
fences, release stores, acquire/acq_rel atomics at GPU and system scope, loads and stores of
host-mapped memory (issue cost: repetitions that need not wait for each other may overlap); then
latencies: 1000 repetitions each of which depends on the one before (the next address is computed
from the value returned), the cost of one round trip on the submit path.  Needs CuPy.
python tools/ordering_costs.py"""
import cupy as cp, numpy as np
src = r'''
extern "C" __global__ void k(unsigned int* dmem, unsigned int* hmem, unsigned long long* out, int iters) {
  unsigned long long t0, t1;
  #define T(i, body) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)); for (int j = 0; j < iters; ++j) { body; } asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); out[i] = (t1 - t0); }
  T(0, atomicCAS_system(dmem, 5u, 6u));
  T(1, atomicCAS(dmem, 5u, 6u));
  T(2, __threadfence_system());
  T(3, __threadfence());
  T(4, { unsigned int o; asm volatile("atom.acquire.sys.global.cas.b32 %0, [%1], %2, %3;" : "=r"(o) : "l"(dmem), "r"(5u), "r"(6u) : "memory"); });
  T(5, asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(dmem + 32), "r"(j) : "memory"));
  T(6, { *(volatile unsigned int*)(hmem + 64) = j; });
  T(7, { *(volatile unsigned int*)(hmem + 64) = j; __threadfence_system(); });
  T(8, { volatile unsigned int v = *(volatile unsigned int*)(hmem + 96); (void)v; });
  T(9, { unsigned int v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(dmem + 64) : "memory"); });
  T(10, { *(volatile unsigned int*)(hmem + 64) = j; asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(dmem + 32), "r"(j) : "memory"); });
  T(11, { *(volatile unsigned int*)(dmem + 128) = j; __threadfence_system(); });
  T(12, atomicAdd_system(dmem + 160, 1u));
  T(13, { unsigned int o; asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;" : "=r"(o) : "l"(dmem + 192), "r"(1u) : "memory"); });
}
// Dependent chains: every value read is 0, and the next address adds it (v & 1), so each
// operation waits for the one before.
extern "C" __global__ void lat(unsigned int* dmem, unsigned long long* out, int iters) {
  unsigned long long t0, t1;
  unsigned int v = 0;
  #define L(i, body) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)); for (int j = 0; j < iters; ++j) { body; } asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); out[i] = (t1 - t0); }
  L(0, v = *(volatile unsigned int*)(dmem + 256 + (v & 1)));
  L(1, v = atomicAdd(dmem + 288 + (v & 1), 0u));
  L(2, v = atomicAdd_system(dmem + 320 + (v & 1), 0u));
  L(3, asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], %2, %3;" : "=r"(v) : "l"(dmem + 352 + (v & 1)), "r"(1u), "r"(1u) : "memory"));
  L(4, asm volatile("atom.acquire.sys.global.cas.b32 %0, [%1], %2, %3;" : "=r"(v) : "l"(dmem + 384 + (v & 1)), "r"(1u), "r"(1u) : "memory"));
  L(5, asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(dmem + 416 + (v & 1)) : "memory"));
  L(6, { *(volatile unsigned int*)(dmem + 448 + (v & 1)) = 0u; __threadfence(); v = *(volatile unsigned int*)(dmem + 480); });
  L(7, { asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(dmem + 512 + (v & 1)), "r"(0u) : "memory"); v = *(volatile unsigned int*)(dmem + 544); });
  L(8, asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(v) : "l"(dmem + 576 + (v & 1)), "r"(0u) : "memory"));
  L(9, asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;" : "=r"(v) : "l"(dmem + 608 + (v & 1)), "r"(0u) : "memory"));
  L(10, { *(volatile unsigned int*)(dmem + 640 + (v & 1)) = 0u; __threadfence_system(); v = *(volatile unsigned int*)(dmem + 672); });
  if (v == 12345u) out[15] = v;
}
'''
mod = cp.RawModule(code=src)
k = mod.get_function("k")
lat = mod.get_function("lat")
d = cp.zeros(1024, cp.uint32)
h = cp.cuda.alloc_pinned_memory(4096)
hp = np.frombuffer(h, np.uint32, 1024)
hdev = h.ptr  # UVA: pinned memory is mapped at the same address
out = cp.zeros(16, cp.uint64)
names = ["atomicCAS_system dev", "atomicCAS gpu dev", "fence.sc.sys", "fence.gpu", "atom.acquire.sys.cas", "st.release.sys dev",
         "host-mapped store", "host store + fence.sys", "host-mapped load", "ld.acquire.sys dev", "host store + st.release.sys dev",
         "dev store + fence.sys", "atomicAdd_system", "atom.acq_rel.sys.add"]
for rep in range(2):
  k((1,), (1,), (d, cp.uint64(hdev), out, np.int32(1000)))
  cp.cuda.Device().synchronize()
o = out.get()
for i, n in enumerate(names):
  print(f"{n:35s} {o[i] / 1000:.0f} ns")
lat_names = ["ld.volatile (L2)", "atom.add gpu", "atom.add sys", "atom.acquire.gpu.cas", "atom.acquire.sys.cas",
             "ld.acquire.gpu", "st + fence.gpu + ld", "st.release.gpu + ld", "atom.acq_rel.gpu.add", "atom.acq_rel.sys.add",
             "st + fence.sys + ld"]
for rep in range(2):
  lat((1,), (1,), (d, out, np.int32(1000)))
  cp.cuda.Device().synchronize()
o = out.get()
print("dependent latency:")
for i, n in enumerate(lat_names):
  print(f"{n:35s} {o[i] / 1000:.0f} ns")
