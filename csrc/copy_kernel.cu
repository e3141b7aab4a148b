// The CUDA copy kernel (cuda_copy.cpp, KVSTORE_CUDA_COPY_KERNEL=1): a copy's runs, moved between the
// pinned pool and device memory by the GPU's threads instead of its copy engines. The engines pay a
// cost per run: on an H100 they moved 16 KiB runs at 0.15-0.48 and 64 KiB runs at 0.7-0.85 of a
// contiguous copy, and a vLLM layout's are 32 KiB (benchmarks/results/README.md). Each thread block
// takes a run at a time and moves it in 16-byte words, four in flight per thread (reads of host
// memory cross PCIe: the more in flight, the closer to its bandwidth). Built to PTX by csrc/generate_ptx.py into
// copy_kernel_ptx.h, which is committed: building kvstore needs no CUDA toolkit.

struct Run {  // kvstore_native.h's Run
  unsigned long long src, dst, size;
};

extern "C" __global__ void kvstore_copy_runs(const Run* runs, unsigned long long n) {
  for (unsigned long long r = blockIdx.x; r < n; r += gridDim.x) {
    const Run run = runs[r];
    const unsigned long long step = blockDim.x;
    if (((run.src | run.dst | run.size) & 15) == 0) {
      const uint4* src = reinterpret_cast<const uint4*>(run.src);
      uint4* dst = reinterpret_cast<uint4*>(run.dst);
      const unsigned long long words = run.size / 16;
      unsigned long long i = threadIdx.x;
      for (; i + 3 * step < words; i += 4 * step) {
        const uint4 a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
        dst[i] = a;
        dst[i + step] = b;
        dst[i + 2 * step] = c;
        dst[i + 3 * step] = d;
      }
      for (; i < words; i += step) dst[i] = src[i];
    } else {  // (unaligned: byte by byte; kvstore's layouts have none)
      const unsigned char* src = reinterpret_cast<const unsigned char*>(run.src);
      unsigned char* dst = reinterpret_cast<unsigned char*>(run.dst);
      for (unsigned long long i = threadIdx.x; i < run.size; i += step) dst[i] = src[i];
    }
  }
}
