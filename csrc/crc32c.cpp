// CRC32C: hardware (x86-64 SSE4.2 or AArch64 CRC) with runtime dispatch, table-driven fallback.
//
// No -march flags are needed: each hardware routine enables its instruction set with a function
// attribute, and is only called when the CPU check at load time says the instructions exist.

#include "crc32c.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define KV_CRC_X86 1
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#elif defined(__aarch64__) && defined(__linux__)
#include <arm_acle.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define KV_CRC_ARM 1
#endif

namespace kvstore {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C, bit-reflected
// Lane lengths of the 3-way hardware loop; the zero-shift tables below are built for these.
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;

struct Tables {
  uint32_t slice[8][256];        // slice-by-8: slice[k][b] = raw CRC of byte b followed by k zeros
  uint32_t shift_long[4][256];   // advance a raw state over kLong zero bytes, a byte at a time
  uint32_t shift_short[4][256];  // same for kShort
};
Tables g_tables;

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof w);  // unaligned-safe; compiles to a plain load
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);
#endif
  return w;
}

// Raw (no inversion) CRC update, slice-by-8: ~1-2 GB/s, used when there is no CRC instruction.
uint32_t raw_table(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = g_tables.slice;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    crc = t[0][(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
    --n;
  }
  while (n >= 8) {
    uint64_t w = load_le64(p) ^ crc;
    crc = t[7][w & 0xFFu] ^ t[6][(w >> 8) & 0xFFu] ^ t[5][(w >> 16) & 0xFFu] ^ t[4][(w >> 24) & 0xFFu] ^
          t[3][(w >> 32) & 0xFFu] ^ t[2][(w >> 40) & 0xFFu] ^ t[1][(w >> 48) & 0xFFu] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    crc = t[0][(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
    --n;
  }
  return crc;
}

// Raw state after feeding `len` zero bytes into state `c` (the operator is linear, so four
// byte-indexed lookups suffice).
inline uint32_t shift_state(const uint32_t (&t)[4][256], uint32_t c) {
  return t[0][c & 0xFFu] ^ t[1][(c >> 8) & 0xFFu] ^ t[2][(c >> 16) & 0xFFu] ^ t[3][c >> 24];
}

void build_shift_table(uint32_t (&t)[4][256], size_t len) {
  static const uint8_t zeros[kLong] = {};
  uint32_t basis[32];  // image of each single-bit state after `len` zero bytes
  for (int b = 0; b < 32; ++b) basis[b] = raw_table(1u << b, zeros, len);
  for (int k = 0; k < 4; ++k) {
    for (uint32_t v = 0; v < 256; ++v) {
      uint32_t r = 0;
      for (int i = 0; i < 8; ++i) {
        if (v & (1u << i)) r ^= basis[8 * k + i];
      }
      t[k][v] = r;
    }
  }
}

#if defined(KV_CRC_X86)
#define KV_CRC_FN raw_sse42
#define KV_CRC_ATTR __attribute__((target("sse4.2")))
#define KV_CRC64(c, w) _mm_crc32_u64((c), (w))
#define KV_CRC8(c, b) _mm_crc32_u8((c), (b))
#if defined(__x86_64__)
#include "crc32c_3way.inc"
#else
// 32-bit x86 has no 64-bit crc32 form: compose it from two 32-bit steps.
#undef KV_CRC64
#define KV_CRC64(c, w) \
  _mm_crc32_u32(_mm_crc32_u32(static_cast<uint32_t>(c), static_cast<uint32_t>(w)), static_cast<uint32_t>((w) >> 32))
#include "crc32c_3way.inc"
#endif
#undef KV_CRC_FN
#undef KV_CRC_ATTR
#undef KV_CRC64
#undef KV_CRC8
#endif

#if defined(KV_CRC_ARM)
#define KV_CRC_FN raw_armv8
#define KV_CRC_ATTR __attribute__((target("+crc")))
#define KV_CRC64(c, w) __crc32cd(static_cast<uint32_t>(c), (w))
#define KV_CRC8(c, b) __crc32cb((c), (b))
#include "crc32c_3way.inc"
#undef KV_CRC_FN
#undef KV_CRC_ATTR
#undef KV_CRC64
#undef KV_CRC8
#endif

#if defined(KV_CRC_X86) && defined(__x86_64__)
// The four words of v, from its register (reading them again from memory, behind the stores, ran
// at a tenth of the speed).
__attribute__((target("avx2,sse4.2"))) inline uint64_t crc_words(uint64_t c, __m256i v) {
  c = _mm_crc32_u64(c, _mm256_extract_epi64(v, 0));
  c = _mm_crc32_u64(c, _mm256_extract_epi64(v, 1));
  c = _mm_crc32_u64(c, _mm256_extract_epi64(v, 2));
  return _mm_crc32_u64(c, _mm256_extract_epi64(v, 3));
}

// A copy that takes the CRC of what it copies (a load's checksum sample), reading the source once:
// three lanes of kLong bytes at a time, 32 bytes of each per step, copied (streaming: non-temporal
// stores, as the copy engine's) and fed to three CRC chains, which the CRC unit runs side by side
// while the copy waits on memory. 256 KiB blocks, one thread, 2-vCPU VM: 11.2 GB/s against the
// copy's 12.0; a CRC pass then the copy: 7.7 (benchmarks/results/cpu-copies-s21-2026-11-27.log).
__attribute__((target("avx2,sse4.2"))) uint32_t raw_copy_avx2(uint32_t state, uint8_t* dst, const uint8_t* src,
                                                              size_t n, bool streaming) {
  // Up to a 32-byte aligned destination (the lanes' stores are aligned), and the tail: CRC then copy.
  size_t head = std::min<size_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  uint64_t c0 = raw_sse42(state, src, head);
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 3 * kLong; dst += 3 * kLong, src += 3 * kLong, n -= 3 * kLong) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t o = 0; o < kLong; o += 32) {
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o));
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kLong + o));
      __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * kLong + o));
      auto* da = reinterpret_cast<__m256i*>(dst + o);
      auto* db = reinterpret_cast<__m256i*>(dst + kLong + o);
      auto* dc = reinterpret_cast<__m256i*>(dst + 2 * kLong + o);
      if (streaming) {
        _mm256_stream_si256(da, a), _mm256_stream_si256(db, b), _mm256_stream_si256(dc, c);
      } else {
        _mm256_store_si256(da, a), _mm256_store_si256(db, b), _mm256_store_si256(dc, c);
      }
      c0 = crc_words(c0, a), c1 = crc_words(c1, b), c2 = crc_words(c2, c);  // (three chains side by side)
    }
    c0 = shift_state(g_tables.shift_long, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = shift_state(g_tables.shift_long, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
  }
  c0 = raw_sse42(static_cast<uint32_t>(c0), src, n);
  std::memcpy(dst, src, n);
  if (streaming) _mm_sfence();
  return static_cast<uint32_t>(c0);
}
const bool g_copy_avx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("sse4.2"));
#endif

using RawFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);

struct Dispatch {
  RawFn fn = raw_table;
  const char* name = "table";

  Dispatch() {
    // Tables first: the hardware routines use the shift tables.
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int j = 0; j < 8; ++j) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      g_tables.slice[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int k = 1; k < 8; ++k) {
        uint32_t prev = g_tables.slice[k - 1][i];
        g_tables.slice[k][i] = (prev >> 8) ^ g_tables.slice[0][prev & 0xFFu];
      }
    }
    build_shift_table(g_tables.shift_long, kLong);
    build_shift_table(g_tables.shift_short, kShort);
#if defined(KV_CRC_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
      fn = raw_sse42;
      name = "sse4.2-3way";
    }
#elif defined(KV_CRC_ARM)
    if (getauxval(AT_HWCAP) & HWCAP_CRC32) {
      fn = raw_armv8;
      name = "armv8-crc-3way";
    }
#endif
  }
};
// Built when the shared object is loaded (well under a millisecond), before any call.
const Dispatch g_dispatch;

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  return ~g_dispatch.fn(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  return ~raw_table(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n, bool streaming) {
#if defined(KV_CRC_X86) && defined(__x86_64__)
  if (g_copy_avx2) {
    return ~raw_copy_avx2(~crc, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, streaming);
  }
#endif
  (void)streaming;
  crc = crc32c(crc, src, n);
  std::memcpy(dst, src, n);
  return crc;
}

const char* crc32c_impl() { return g_dispatch.name; }

bool crc32c_hardware() { return g_dispatch.fn != raw_table; }

}  // namespace kvstore
