// CRC32C (Castagnoli) for block checksums.
//
// Kept free of Python headers so it can be compiled and tested on its own (e.g. cross-compiled
// for aarch64). The checksum of the pool is always CRC32C, whichever implementation computes it,
// so blocks written by one build verify with any other.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvstore {

// Standard CRC32C: reflected polynomial 0x82F63B78, init ~0, final xor ~0, so
// crc32c(0, "123456789", 9) == 0xE3069283. Pass a previous result as `crc` to continue it
// over more data (crc32c(crc32c(0, a), b) == crc32c(0, a + b)).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

// Copies n bytes from src to dst (not overlapping) and returns crc32c(crc, src, n), reading the
// source once where the CPU allows (x86-64 with AVX2; elsewhere a CRC pass, then the copy).
// `streaming`: non-temporal stores, as the copy engine's (x86-64); a store fence before it returns.
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n, bool streaming);

// Same function, always the portable table-driven (slice-by-8) implementation.
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);

// Name of the implementation crc32c() dispatches to: "sse4.2-3way", "armv8-crc-3way" or "table".
const char* crc32c_impl();

// True when crc32c() uses CPU CRC instructions (decided once, at load time, by a CPU check).
bool crc32c_hardware();

}  // namespace kvstore
