// MXFP4 (E2M1 codes, one E8M0 scale per 32) to bf16 with integer bit moves and one bf16x2
// multiply per pair: no table, no per-element branches. Shared by the prefill GEMMs (dequantise
// into shared memory) and the decode GEMVs (dequantise straight into MMA fragments).
//
// Bit trick: an E2M1 code s|e1 e0|m placed in a bf16 as sign bit 15, e1 e0 in the two lowest
// exponent bits (8:7) and m in the top mantissa bit (6) reads as 2^-126 times its value, for
// every code: e > 0 gives 2^(e-127)·(1 + m/2) = 2^-126 · 2^(e-1)·(1 + m/2), and e = 0 gives the
// subnormal m·2^-127 = 2^-126 · (m/2). The bf16x2 multiply (which keeps subnormals) by
// 2^126 · 2^(b-127) = 2^(b-1) then gives the exact dequantised value, rounded once, as the
// fp32 reference's round-to-bf16 does.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace k3 {
namespace moe {

constexpr int kMxGroup = 32;  // MXFP4 elements per E8M0 scale

// The E8M0 scale byte b as one or two bf16x2 factors whose product is 2^(b-1): one factor
// while 2^(b-1) is a bf16 (b <= 128, every practical weight scale), two above; b = 255 is NaN.
struct Mxfp4Scale {
  __nv_bfloat162 first, second;
  bool two_steps;
};

__device__ __forceinline__ __nv_bfloat162 bf16x2_from_bits(uint32_t bits) {
  return *reinterpret_cast<const __nv_bfloat162*>(&bits);
}

__device__ __forceinline__ Mxfp4Scale mxfp4_scale(uint32_t b) {
  Mxfp4Scale s;
  if (b <= 128u) {  // 2^(b-1): exponent field b + 126
    const uint32_t e = (b + 126u) << 7;
    s.first = bf16x2_from_bits(e | (e << 16));
    s.two_steps = false;
  } else {
    const uint32_t e1 = 253u << 7;                       // 2^126
    const uint32_t e2 = b == 255u ? 0x7FC0u : b << 7;    // 2^(b-127), or NaN
    s.first = bf16x2_from_bits(e1 | (e1 << 16));
    s.second = bf16x2_from_bits(e2 | (e2 << 16));
    s.two_steps = true;
  }
  return s;
}

// Eight codes (element 2m in the low nibble of byte m of `packed`) -> four bf16x2 words,
// word m = (element 2m, element 2m + 1), times the scale; kTwoSteps must equal s.two_steps
// (callers branch once per row and k-step, not per word).
template <bool kTwoSteps>
__device__ __forceinline__ void mxfp4_dequant8(uint32_t packed, const Mxfp4Scale& s, uint32_t (&out)[4]) {
  const uint32_t odd = packed & 0xF0F0F0F0u;          // odd elements: high nibble of each byte
  const uint32_t even = (packed << 4) & 0xF0F0F0F0u;  // even elements moved to the high nibble
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    // bytes 1 and 3 of x: even.byte m and odd.byte m, so the codes sit in bits 15:12 and 31:28
    const uint32_t sel = m | (m << 4) | ((4 + m) << 8) | ((4 + m) << 12);
    uint32_t x;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(x) : "r"(even), "r"(odd), "r"(sel));
    const uint32_t bits = (x & 0x80008000u) | ((x >> 6) & 0x01C001C0u);
    __nv_bfloat162 v = __hmul2(bf16x2_from_bits(bits), s.first);
    if constexpr (kTwoSteps) v = __hmul2(v, s.second);
    out[m] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

__device__ __forceinline__ void mxfp4_dequant8(uint32_t packed, const Mxfp4Scale& s, uint32_t (&out)[4]) {
  if (s.two_steps) {
    mxfp4_dequant8<true>(packed, s, out);
  } else {
    mxfp4_dequant8<false>(packed, s, out);
  }
}

// Table form for the decode GEMVs (fewer instructions than the bit moves; session 18: GEMVs
// dequantising in registers, with the bit moves or a form of 12 integer operations per 8 codes,
// measured 5-24% slower): one shared-memory load yields both bf16 values of a code byte, so a
// pair costs a byte extract, an address and a load instead of five integer operations. Entry
// (byte, lane) at word
// byte·32 + lane: every lane reads its own bank, so arbitrary bytes never conflict (32 KiB).
// The values are exact E2M1 in bf16, so one multiply by the bf16 scale 2^(b-127) (a bf16 for
// every byte b, subnormal at 0, NaN at 255) finishes them; the scale bytes go through a second,
// 256-word table (a warp's 16 scale bytes per lookup are a few distinct values in practice, and
// lanes reading the same word share one access).
struct alignas(16) Mxfp4DecodeTable {  // filled with 16-byte stores (mxfp4_table_fill)
  uint32_t pairs[256 * 32];
  uint32_t scales[256];
};

__device__ __forceinline__ uint32_t e2m1_bf16_bits(uint32_t code) {
  const uint32_t mag = code & 7u;  // 0, 0.5, then (1 + m/2)·2^(e-1): exponent field e + 126
  const uint32_t bits = mag == 0u ? 0u : mag == 1u ? 0x3F00u : (((mag >> 1) + 126u) << 7) | ((mag & 1u) << 6);
  return bits | ((code & 8u) << 12);
}

__device__ __forceinline__ uint32_t mxfp4_scale_bf16x2_bits(uint32_t b) {
  const uint32_t e = b == 255u ? 0x7FC0u : b == 0u ? 0x0040u : b << 7;
  return e | (e << 16);
}

// All threads of the CTA; the caller syncs before the first lookup. The 32 copies of a byte's
// entry are equal, so each thread writes four of them with one 16-byte store.
__device__ __forceinline__ void mxfp4_table_fill(Mxfp4DecodeTable& t) {
  for (int i = threadIdx.x; i < 256 * 8; i += blockDim.x) {
    const uint32_t byte = i / 8;
    const uint32_t v = e2m1_bf16_bits(byte & 15u) | (e2m1_bf16_bits(byte >> 4) << 16);
    reinterpret_cast<uint4*>(t.pairs)[i] = make_uint4(v, v, v, v);
  }
  for (int i = threadIdx.x; i < 256; i += blockDim.x) t.scales[i] = mxfp4_scale_bf16x2_bits(i);
}

// A lane's view of the table: its column of pairs (the table's byte address + 4·lane) and the
// scales, so a lookup is one byte extract, one multiply-add and one 4-byte shared load.
struct Mxfp4LaneTable {
  const char* pairs;
  const uint32_t* scales;
};

__device__ __forceinline__ __nv_bfloat162 mxfp4_scale_lookup(uint32_t b, const Mxfp4LaneTable& t) {
  return bf16x2_from_bits(t.scales[b]);
}

// As mxfp4_dequant8, through the table.
__device__ __forceinline__ void mxfp4_dequant8_table(uint32_t packed, const Mxfp4LaneTable& t,
                                                     __nv_bfloat162 scale, uint32_t (&out)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t byte = __byte_perm(packed, 0u, 0x4440u | m);
    __nv_bfloat162 v = __hmul2(bf16x2_from_bits(*reinterpret_cast<const uint32_t*>(t.pairs + 128u * byte)), scale);
    out[m] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

}  // namespace moe
}  // namespace k3
