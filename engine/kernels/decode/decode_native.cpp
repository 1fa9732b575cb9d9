// Kernel "decode_native": a few query rows against a long KV cache, reading each K/V byte once.
//
// Built by engine/kernels/native_build.py with the host compiler (-O3 -march=native) and called through
// ctypes from engine/kernels/decode_native.py, which states the contract; the pure-torch "decode" kernel is
// its fallback and tests/test_decode_native.py checks both against a float64 oracle.
//
// Shape of the work (R = G * T query rows of one KV head, read together):
//
//     for each work item (b, kv_head, keys [j0, j1))          items split B * Hkv * S evenly across threads; a
//                                                              head-major pool's pages of 2-8 KiB per head: two
//                                                              heads' items in turn, a block each; an NHD pool's:
//                                                              every head's (heads_in_turn)
//       for each block of BLOCK keys                          K/V rows read once, converted in registers; a block
//                                                              every row sees runs unmasked
//         scores  s[r][j] = q[r] . k[j]  (* k_scale[j])       4 keys at a time (AVX2: 2), NR rows a pass; the next
//                                                              block's rows asked for (into L2) a share per step
//         online softmax: m[r] running max, l[r] running sum of p = exp(s - m)
//         acc[r] = acc[r] * l_old / l_new                       acc is the output so far, normalised as it goes,
//         acc[r] += p[r][j] / l_new * v[j]  (* v_scale[j])      so it never leaves V's range (no overflow near
//                                                              the float max); Dv in register tiles, each over
//                                                              the whole block
//     merge the items of one (b, kv_head) by log-sum-exp       out = sum of acc * (item's share), lse = m + log(l)
//
// Element kinds of K and V: fp32, bf16, fp16, int8 and fp8 e4m3 (the last two with per-key scales); every
// kind is converted to fp32 in registers and accumulated in fp32. Guarantees: a key some row does not see
// never reaches that row (its V is masked out bit-wise, so NaN/inf stay out); a visible non-finite key makes
// its row NaN with lse -inf, a visible non-finite value makes its channel NaN (the reference's semantics; fp8's
// NaN codes count as non-finite); rows that see no key give 0 and lse -inf.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

// The vector paths, one per build, chosen by the compiler's target: AVX-512 (16 lanes), AVX2 + FMA + F16C (8) or
// aarch64's NEON (4); without any, or with DN_PORTABLE defined (the tests' and `run.py bench builds`' plain path), the
// portable C++ path (the compiler's own vectors).
#if defined(DN_PORTABLE)
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define DN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DN_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define DN_NEON 1
#endif
#if DN_AVX512 || DN_AVX2 || DN_NEON
#define DN_VECTORS 1
#endif
#ifndef DN_AVX512  // (0 where not chosen: the code's expressions read them too)
#define DN_AVX512 0
#endif
#ifndef DN_AVX2
#define DN_AVX2 0
#endif
#ifndef DN_NEON
#define DN_NEON 0
#endif
// Keeps a vector in a register. GCC folds a load that several FMAs use into each of them: the scores' four-key pass
// read each q vector, and each fp32 K vector, four times from L1. Kept, on an AVX-512 Zen 4 VM, one thread: from
// DRAM bf16 0.85x the time, fp32 0.96x; the two-key pass in cache (1 or 2 rows a KV head) 0.90-1.02x. The AVX2
// build keeps the folded loads where a pass has fewer than four rows (16 registers: one row a KV head took
// 1.03-1.07x; DN_IN_YMM). docs/BENCHMARKS.md, round 10.
#if DN_AVX512 && defined(__GNUC__)
#define DN_IN_REGISTER(x) asm("" : "+v"(x))
#else
#define DN_IN_REGISTER(x) ((void)0)
#endif
// The AVX2 two-key pass keeps q in a register too where it has four rows (NR): each q vector then loaded once for the
// two keys. AVX-512 Zen 4 VM, one thread, AVX2 build, G 4: fp32 / bf16 / fp16 0.94-0.98x the time from DRAM (B 1 S
// 32k), 0.94-0.95x in cache, int8 / fp8 0.98-1.01x; G 8 0.92-0.96x. With two rows (G 2) bf16 took 1.075x, with one
// 1.01-1.11x: those keep the folded loads. docs/BENCHMARKS.md, round 26.
#if DN_AVX2 && defined(__GNUC__)
#define DN_IN_YMM(x) asm("" : "+x"(x))
#else
#define DN_IN_YMM(x) ((void)0)
#endif
// bf16, int8 or fp8 e4m3 K against a q whose values are all bf16 numbers (a bf16 model's): every key value is a bf16
// number too (int8's 8 bits, e4m3's 4), and each product is exact in fp32 either way, so AVX512-BF16's pair dot
// product (vdpbf16ps) takes the scores' FMAs' place, half as many; bf16 K needs no widening, int8 / fp8 are widened
// as before and packed to bf16 (Operands::q_bf16, Item::bf16_keys). It pays only where vdpbf16ps issues about as
// fast as an FMA, so that half as many do the same products: on the AVX-512 Zen 4 (both one a cycle) it did; on
// the AVX-512 + AMX Xeon, where one costs 4 FMAs (2 a cycle), the FMAs read bf16 2-3% faster and fp8 7% (round
// 15). The library times the two once (bf16_dot_rates) and takes the dot products where one costs at most
// DOT_FMA_RATIO FMAs (decode_native_bf16_dot; decode_native_use_bf16_dot forces either way).
#if DN_AVX512 && defined(__AVX512BF16__)
#define DN_BF16_DOT 1
#endif
// fp8 e4m3 read as bf16 (F8_WORDS): every e4m3 value is a bf16 number, so two AVX512-VBMI byte lookups (vpermi2b over
// 128-entry tables of the bf16 bits' high and low bytes, the sign ORed in) turn 64 codes into 64 exact bf16 words,
// NaN codes included, where widening through fp16 took 4 instructions per 16 (e4m3_half_bits, vcvtph2ps) and a scan
// of each block for NaN codes (e4m3_nan_codes). The words come in unpack order (f8_word_channel): q and the output
// are permuted to match, as BF16_PAIRS' are.
#if DN_BF16_DOT && defined(__AVX512VBMI__)
#define DN_F8_WORDS 1
#endif
// int8 K/V on AMX tiles (amx_usable): a build for a CPU with AMX-INT8, where Linux grants the tiles
#if DN_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define DN_AMX 1
#endif
// bf16 K/V with many query rows a KV head on AMX-BF16 tiles (the section "bf16 on AMX tiles, many rows")
#if DN_AMX && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define DN_AMX_BF16 1
#endif

namespace {

constexpr int BLOCK = 64;  // keys per online-softmax step
constexpr int64_t SPLIT = 2048;  // keys per work item at most, cut at multiples of SPLIT positions (batch invariance)
constexpr int NR = 4;      // query rows per register pass
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// BF16_PAIRS is bf16 read 2 * W values at a time as two vectors, the even-indexed and the odd-indexed ones (vector
// paths, D and Dv multiples of 2 * W: vload_pair); the call's kind is BF16 either way.
// F8_WORDS is fp8 e4m3 read 64 codes at a time as bf16 words (DN_F8_WORDS; D and Dv multiples of 64).
enum Kind { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, F8E4M3 = 4, BF16_PAIRS = 5, F8_WORDS = 6 };
constexpr int64_t kind_bytes(int kind) {
    return kind == F32 ? 4 : (kind == BF16 || kind == F16 || kind == BF16_PAIRS) ? 2 : 1;
}

// what the plain path's loops call, inlined so that the compiler can make the loops its vectors
#if defined(__GNUC__)
#define DN_INLINE inline __attribute__((always_inline))
#else
#define DN_INLINE inline
#endif

// ---- scalar conversions (the readable definition of each kind) --------------------------------------------

// p rounded up to a multiple of 64 bytes: scratch the vector stores and tile loads fill, within a buffer allocated
// 64 bytes longer (a std::vector's memory is only 16-byte aligned, so 64-byte stores and tile rows could straddle
// cache lines, by an amount that changed from process to process)
template <class T> inline T* aligned64(T* p) {
    return (T*)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}
// One call's array of n Ts (q's rows, the items' states) in a buffer of this thread's, kept from call to call: a small
// call then neither allocates nor zeroes its arrays, and finds them in cache. Not zeroed: each is written before it is
// read. One over KEPT_BYTES is the call's own, freed after it. It starts on a 64-byte boundary (aligned64): the AVX2
// scores' passes load each q vector from memory for every key, and from a std::vector's 16-byte alignment every other
// 32-byte load straddled two cache lines. AVX-512 Zen 4 VM, one thread, AVX2 build, bf16 in cache: q 32 bytes past a
// 4 KiB boundary (or 0, or 64) 0.88-0.89x the time of 16 or 48 past it; the AVX-512 build, which keeps q in
// registers, 0.99-1.00x. docs/BENCHMARKS.md, round 26.
constexpr size_t KEPT_BYTES = size_t(4) << 20;
template <class T>
struct CallArray {
    static constexpr size_t PAD = 64 / sizeof(T);  // (room to start from the boundary)
    std::unique_ptr<T[]> own;
    T* data;
    CallArray(std::vector<T>& kept, size_t n) {
        if (n * sizeof(T) > KEPT_BYTES) {
            own.reset(new T[n + PAD]), data = aligned64(own.get());
        } else {
            if (kept.size() < n + PAD) kept.resize(n + PAD);
            data = aligned64(kept.data());
        }
    }
};
inline uint32_t float_bits(float x) {
    uint32_t out;
    std::memcpy(&out, &x, 4);
    return out;
}
inline float bits_float(uint32_t bits) {
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}
// A number's exponent and mantissa bits em, already in fp32's places (the mantissa left-aligned), its exponent biased
// by BIAS, as fp32: rebiased to 127 (a normal one); a subnormal one (exponent field 0) f 2^(1 - BIAS) as
// 2^(1 - BIAS) (1 + f) - 2^(1 - BIAS), an exact difference of normal numbers (no subnormal operand: no slow path, and
// a CPU flushing subnormals to zero reads them too). No branch: the case is chosen by masks, so a loop of them
// vectorises (chosen by ?:, the compiler branched around the subtraction, and the loop stayed scalar).
template <uint32_t BIAS>
DN_INLINE float rebiased(uint32_t em) {
    const uint32_t subnormal = 0u - (uint32_t)((int32_t)em < (1 << 23));  // (em < 2^31: a signed compare, SSE2's)
    return bits_float(em + ((127u - BIAS) << 23) + (subnormal & (1u << 23))) -
           bits_float(subnormal & ((128u - BIAS) << 23));
}
// fp16 bits to fp32, exactly, with no branch: rebiased from 15, inf / NaN (exponent 31) given exponent 255 with their
// mantissa kept. (Each of the three cases computed in full and one chosen by masks: 1.05x the time, SSE2's plain path.)
DN_INLINE float half_to_float(uint16_t h) {
    const uint32_t em = (uint32_t)(h & 0x7FFF) << 13, special = 0u - (uint32_t)((int32_t)em >= (31 << 23));
    return bits_float(float_bits(rebiased<15>(em)) | (special & 0x7F800000u) | ((uint32_t)(h & 0x8000) << 16));
}

// fp8 e4m3 (fn): its bits placed in fp16's layout give a half whose value is 2^-8 times the fp8 value (both
// have 3 mantissa bits left-aligned; the exponent bias moves from 7 to 15), subnormals included. The 2^8
// is folded into the per-key scale by the caller, so no lookup table is needed in registers either.
inline uint16_t e4m3_as_half_bits(uint8_t x) { return (uint16_t)(((x & 0x80) << 8) | ((x & 0x7F) << 7)); }

template <int K> DN_INLINE float load_scalar(const void* p, int64_t i);
template <> DN_INLINE float load_scalar<F32>(const void* p, int64_t i) { return ((const float*)p)[i]; }
template <> DN_INLINE float load_scalar<BF16>(const void* p, int64_t i) {
    return bits_float((uint32_t)((const uint16_t*)p)[i] << 16);
}
// fp16 bits to fp32 as the plain path reads them: on Arm by the CPU's own conversion (vectorised as fcvtl), exactly
// half_to_float's values; elsewhere half_to_float
DN_INLINE float half_value(uint16_t h) {
#if defined(__aarch64__)
    __fp16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
#else
    return half_to_float(h);
#endif
}
template <> DN_INLINE float load_scalar<F16>(const void* p, int64_t i) { return half_value(((const uint16_t*)p)[i]); }
template <> DN_INLINE float load_scalar<I8>(const void* p, int64_t i) { return (float)((const int8_t*)p)[i]; }
// fp8 e4m3 (fn) bits to fp32 as the plain path reads them, its NaN codes (the seven bits below the sign all ones)
// aside: e4m3_finite reads a code as a number (for rows that hold no NaN code: e4m3_nan_codes), load_scalar masks
// the NaN codes to NaN. On Arm through the CPU's half conversion (e4m3_as_half_bits: 2^-8 times the value;
// E4M3_UNIT). Elsewhere exactly, the seven bits rebiased from 7: on SSE2 0.86x the time of the route through fp16's
// bits and half_to_float (B 1 S 32k and B 8 S 8k, one thread, cold).
#if defined(__aarch64__)
constexpr float E4M3_UNIT = 256.0f;  // what the plain path's fp8 values are multiplied by (the per-key scales carry it)
DN_INLINE float e4m3_finite(uint32_t x) { return half_value(e4m3_as_half_bits((uint8_t)x)); }
#else
constexpr float E4M3_UNIT = 1.0f;
DN_INLINE float e4m3_finite(uint32_t x) {
    return bits_float(float_bits(rebiased<7>((x & 0x7F) << 20)) | ((x & 0x80) << 24));
}
#endif
template <> DN_INLINE float load_scalar<F8E4M3>(const void* p, int64_t i) {
    const uint32_t x = ((const uint8_t*)p)[i], nan = 0u - (uint32_t)((x & 0x7F) == 0x7F);
    return bits_float((float_bits(e4m3_finite(x)) & ~nan) | (0x7FC00000u & nan));
}
// load_scalar, fp8's codes read as numbers where the block's rows hold no NaN code (CODES false): the mask per value
// left out, the plain path's fp8 took 0.87-0.88x the time on SSE2 (B 1 S 8k and 32k, B 8 S 8k, one thread, cold)
template <int K, bool CODES>
DN_INLINE float load_lane(const void* p, int64_t i) {
    if constexpr (K == F8E4M3 && !CODES) return e4m3_finite(((const uint8_t*)p)[i]);
    else return load_scalar<K>(p, i);
}

// ---- the plain C++ path's loops --------------------------------------------------------------------------------
//
// Without the intrinsics (a CPU with neither AVX-512 nor AVX2, an Arm one, a head dim no vector width divides) the
// kernel's loops run over channels or keys with no dependence from one to the next, each marked `omp simd` (a sum's
// reassociation allowed there alone): the compiler makes them its own vectors (SSE2's or NEON's 4 lanes, AVX's 8), as
// it cannot make one running sum per row (a chain of dependent adds) without that leave. Every conversion above is
// free of branches for the same reason. Each sum is computed by one loop whatever the block, so a key's score and a
// row's sum do not depend on where a block ends.

// a * b + c, fused where the CPU has FMA (the compiler's vector FMA then), else a product and a sum. Clang fuses the
// expression itself (its -ffp-contract=on) and vectorises a sum of those, where std::fma kept its reductions scalar;
// GCC (-std=c++17: no contraction) needs std::fma.
DN_INLINE float lane_fma(float a, float b, float c) {
#if !defined(__clang__) && (defined(__FMA__) || defined(__ARM_FEATURE_FMA))
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}
// e^x for x <= 0, as vexp computes it (x <= -87 gives 0, e^-inf too): 2^n p(r), n rounded by adding and taking away
// 1.5 * 2^23, p the same degree-6 polynomial; no branch and no call, so a loop of them vectorises. x is clamped to -87
// by a bit mask, not by `x > -87 ? x : -87`: GCC 12 (its default -ftrapping-math) turns a float comparison's select
// into vector code only with AVX-512's or SVE's mask registers, so that form left the softmax step's loop of exps
// scalar on NEON, SSE2 and AVX2 (-fopt-info-vec: "control flow in loop"). Vectorised, the portable path took
// 0.86-0.96x the time on x86 (SSE2 and AVX2 code; docs/BENCHMARKS.md, round 27).
DN_INLINE float exp_lane(float x) {
    const uint32_t above = 0u - (uint32_t)(x > -87.0f);  // all ones where x > -87 (none for NaN)
    x = bits_float((float_bits(x) & above) | (float_bits(-87.0f) & ~above));
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = lane_fma(-n, 0.693359375f, x);
    r = lane_fma(-n, -2.12194440e-4f, r);
    float poly = 1.0f / 720;
    poly = lane_fma(poly, r, 1.0f / 120);
    poly = lane_fma(poly, r, 1.0f / 24);
    poly = lane_fma(poly, r, 1.0f / 6);
    poly = lane_fma(poly, r, 0.5f);
    poly = lane_fma(poly, r, 1.0f);
    poly = lane_fma(poly, r, 1.0f);
    const float y = poly * bits_float((uint32_t)((int32_t)n + 127) << 23);
    return bits_float(float_bits(y) & above);  // (a mask: no branch)
}

// tanh(x) for any float, within 3 ulp (NaN stays NaN, +-inf gives +-1): below 0.55 in magnitude x + x^3 p(x^2), p a
// degree-6 fit to (tanh x - x) / x^3 (0.7 ulp), above it (1 - t) / (1 + t) with t = e^{-2|x|} (exp_lane: 0 past 43)
// and x's sign. Both are computed and one is kept by a bit mask, as exp_lane selects, so a loop of them vectorises.
DN_INLINE float tanh_lane(float x) {
    const uint32_t sign = float_bits(x) & 0x80000000u;
    const float a = bits_float(float_bits(x) & 0x7FFFFFFFu);
    const float t = exp_lane(-2.0f * a);
    const float far = bits_float(float_bits((1.0f - t) / (1.0f + t)) | sign);
    const float u = x * x;
    float p = -0.0009236502810381353f;
    p = lane_fma(p, u, 0.003362058661878109f);
    p = lane_fma(p, u, -0.008809257298707962f);
    p = lane_fma(p, u, 0.021862400695681572f);
    p = lane_fma(p, u, -0.05396775156259537f);
    p = lane_fma(p, u, 0.13333331048488617f);
    p = lane_fma(p, u, -0.3333333432674408f);
    const float near = lane_fma(x * u, p, x);
    const uint32_t small = 0u - (uint32_t)(a < 0.55f);                      // (none for NaN)
    const uint32_t nan = 0u - (uint32_t)(float_bits(a) > 0x7F800000u);       // an integer test: NaN's bits
    const uint32_t kept = (float_bits(near) & small) | (float_bits(far) & ~small);
    return bits_float((kept & ~nan) | (float_bits(x) & nan));
}

// A score's softcap (Gemma 2's): cap * tanh(s / cap), a non-finite score left as it is (a visible non-finite key
// makes its row NaN, whatever caps the scores: the torch kernels' rule), by a bit mask as tanh_lane selects.
DN_INLINE float capped(float s, float cap) {
    const uint32_t wild = 0u - (uint32_t)((float_bits(s) & 0x7F800000u) == 0x7F800000u);  // inf or NaN
    return bits_float((float_bits(cap * tanh_lane(s / cap)) & ~wild) | (float_bits(s) & wild));
}

// ---- vectors of W fp32 lanes --------------------------------------------------------------------------------

#if DN_AVX512
constexpr int W = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(vec x) { return _mm512_reduce_add_ps(x); }
inline vec vand(vec a, vec b) { return _mm512_and_ps(a, b); }
template <int K> inline vec vload(const void* p, int64_t i);
template <> inline vec vload<F32>(const void* p, int64_t i) { return _mm512_loadu_ps((const float*)p + i); }
template <> inline vec vload<BF16>(const void* p, int64_t i) {
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <> inline vec vload<F16>(const void* p, int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)));
}
template <> inline vec vload<I8>(const void* p, int64_t i) {
    __m128i b = _mm_loadu_si128((const __m128i*)((const int8_t*)p + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
// bf16 values i .. i + 31 as two vectors from one 512-bit load (AVX2's vload_pair below, twice as wide): lanes 0 2 4
// .. 30 (HALF 0), then 1 3 .. 31 (HALF 1)
template <int HALF> inline vec vload_pair(const void* p, int64_t i) {
    const __m512i x = _mm512_loadu_si512((const void*)((const uint16_t*)p + i));
    if constexpr (HALF == 0) return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    else return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}
// e4m3_as_half_bits of 16 codes: sign-extended to 16 bits and shifted left by 7, the sign lands in bit 15 and (again)
// in bit 14, the other seven bits in 13 .. 7; clearing bit 14 leaves them (3 instructions where masking each part
// took 6: 0.86x the time of a decode from an fp8 cache). The NaN codes come out finite: a block holding one reads
// its rows with vload_e4m3_nan (Item::nan_codes).
inline __m256i e4m3_half_bits(const void* p, int64_t i) {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)((const uint8_t*)p + i)));
    return _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xBFFF));
}
template <> inline vec vload<F8E4M3>(const void* p, int64_t i) { return _mm512_cvtph_ps(e4m3_half_bits(p, i)); }
// vload<F8E4M3> with the NaN codes (the seven low bits set) read as NaN
inline vec vload_e4m3_nan(const void* p, int64_t i) {
    const __m256i bits = e4m3_half_bits(p, i), seven = _mm256_set1_epi16(0x3F80);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(bits, seven), seven);
    return _mm512_cvtph_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi16(0x7E00), nan));
}
// e^x for x <= 0 (x <= -87 gives 0; no NaN reaches it): 2^n * p(r), r = x - n ln2, a degree-6 polynomial (rel. error ~1e-7)
inline vec vexp(vec x) {
    vec x0 = x;
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    vec p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    vec y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), y);  // e^-inf = 0
}
#if DN_F8_WORDS
// The bf16 bits of the e4m3 code m of sign 0 (m < 128; 127 is NaN): 2^(e - 7) (1 + f / 8) for an exponent field
// e > 0, else f 2^-9, a normal bf16 number (f's leading bit moved into the exponent)
constexpr uint16_t e4m3_bf16_bits(int m) {
    const int e = m >> 3, f = m & 7;
    if (m == 0x7F) return 0x7FC0;
    if (e > 0) return (uint16_t)(((e - 7 + 127) << 7) | (f << 4));
    if (f == 0) return 0;
    const int top = f >= 4 ? 2 : f >= 2 ? 1 : 0;  // f = 2^top + the rest
    return (uint16_t)(((top - 9 + 127) << 7) | ((f - (1 << top)) << (7 - top)));
}
struct E4M3Tables {  // e4m3_bf16_bits' high and low bytes, code m at [m]
    alignas(64) uint8_t high[128];
    alignas(64) uint8_t low[128];
    constexpr E4M3Tables() : high(), low() {
        for (int m = 0; m < 128; ++m) high[m] = (uint8_t)(e4m3_bf16_bits(m) >> 8), low[m] = (uint8_t)e4m3_bf16_bits(m);
    }
};
constexpr E4M3Tables E4M3_TABLES{};
// codes i .. i + 63 as bf16 words, in unpack order: w0 holds codes 16 L .. 16 L + 7 of each 128-bit lane L, w1
// codes 16 L + 8 .. 16 L + 15 (f8_word_channel); a code's seven low bits index the tables, its sign is ORed in
struct E4M3Words {
    __m512i w0, w1;
};
inline E4M3Words e4m3_words(const void* p, int64_t i) {
    const __m512i codes = _mm512_loadu_si512((const void*)((const uint8_t*)p + i));
    const __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512((const void*)E4M3_TABLES.high), codes,
                                                  _mm512_load_si512((const void*)(E4M3_TABLES.high + 64)));
    const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512((const void*)E4M3_TABLES.low), codes,
                                                 _mm512_load_si512((const void*)(E4M3_TABLES.low + 64)));
    const __m512i signed_high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8((char)0x80), 0xF8);  // a|b&c
    return {_mm512_unpacklo_epi8(low, signed_high), _mm512_unpackhi_epi8(low, signed_high)};
}
#endif
#elif DN_AVX2
constexpr int W = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline float vsum(vec x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline vec vand(vec a, vec b) { return _mm256_and_ps(a, b); }
template <int K> inline vec vload(const void* p, int64_t i);
template <> inline vec vload<F32>(const void* p, int64_t i) { return _mm256_loadu_ps((const float*)p + i); }
template <> inline vec vload<BF16>(const void* p, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <> inline vec vload<F16>(const void* p, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)));
}
template <> inline vec vload<I8>(const void* p, int64_t i) {
    __m128i b = _mm_loadl_epi64((const __m128i*)((const int8_t*)p + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline __m128i e4m3_half_bits(const void* p, int64_t i) {  // (8 codes, as AVX-512's)
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)((const uint8_t*)p + i)));
    return _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xBFFF));
}
template <> inline vec vload<F8E4M3>(const void* p, int64_t i) { return _mm256_cvtph_ps(e4m3_half_bits(p, i)); }
// bf16 values i .. i + 15 (i a multiple of 16) as two vectors from one 256-bit load: each dword holds two values, the
// low one shifted up 16 bits is value 2k as fp32, the high one with the low bits cleared is value 2k + 1. One
// instruction per 8 values (the load folded in), where widening 8 (vpmovzxwd, then the shift) takes two. The lanes
// come in the order 0 2 4 .. 14 (HALF 0), 1 3 .. 15 (HALF 1): q is stored in that order and the output put back
// (paired_order), scores and weighted sums being sums over the lanes in any order.
template <int HALF> inline vec vload_pair(const void* p, int64_t i) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    if constexpr (HALF == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    else return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}
inline vec vload_e4m3_nan(const void* p, int64_t i) {
    const __m128i bits = e4m3_half_bits(p, i), seven = _mm_set1_epi16(0x3F80);
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(bits, seven), seven);
    return _mm256_cvtph_ps(_mm_blendv_epi8(bits, _mm_set1_epi16(0x7E00), nan));
}
inline vec vexp(vec x) {
    vec x0 = x;
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    vec p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    vec y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(y, _mm256_cmp_ps(x0, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));  // e^-inf = 0
}
#elif DN_NEON
constexpr int W = 4;
using vec = float32x4_t;
inline vec vzero() { return vdupq_n_f32(0.0f); }
inline vec vset(float x) { return vdupq_n_f32(x); }
inline vec vloadf(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, vec x) { vst1q_f32(p, x); }
inline vec vfma(vec a, vec b, vec c) { return vfmaq_f32(c, a, b); }
inline vec vmul(vec a, vec b) { return vmulq_f32(a, b); }
inline vec vand(vec a, vec b) {
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a), vreinterpretq_u32_f32(b)));
}
// A vector's sum as (x0 + x1) + (x2 + x3), the order sums4 adds each of its vectors in: a key's score is bitwise the
// same whichever pass computes it (batch invariance, as hsum1's on x86)
inline float hsum1(vec x) { return vpadds_f32(vget_low_f32(vpaddq_f32(x, x))); }
inline float vsum(vec x) { return hsum1(x); }
// the sums of four vectors, lane k the sum of the k-th: three pairwise adds (a transposed reduction)
inline vec sums4(vec a, vec b, vec c, vec d) { return vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)); }
inline void hsum8(vec v0, vec v1, vec v2, vec v3, vec v4, vec v5, vec v6, vec v7, float* out) {
    vst1q_f32(out, sums4(v0, v1, v2, v3));
    vst1q_f32(out + 4, sums4(v4, v5, v6, v7));
}
// K and V are read 8 values a step (Item::STEP): one load of 16 bytes (bf16, fp16) or 8 (int8, fp8), as loaded here
// (fp32's: where they lie), and its two vectors of 4 converted from it by neon_half: bf16 shifted up 16 bits, fp16 by
// the CPU's conversion (exact, subnormals included), int8 widened twice and converted, fp8 e4m3 as e4m3_halves
template <int K> struct NeonRaw { using type = int8x8_t; };
template <> struct NeonRaw<F32> { using type = const float*; };
template <> struct NeonRaw<BF16> { using type = uint16x8_t; };
template <> struct NeonRaw<F16> { using type = uint16x8_t; };
template <int K> inline typename NeonRaw<K>::type neon_load(const void* p, int64_t i) {
    if constexpr (K == F32) return (const float*)p + i;
    else if constexpr (K == BF16 || K == F16) return vld1q_u16((const uint16_t*)p + i);
    else return vld1_s8((const int8_t*)p + i);
}
// e4m3_as_half_bits of 8 codes (AVX2's e4m3_half_bits: sign-extended, shifted left by 7, bit 14 cleared); where nan,
// the NaN codes (the seven low bits set) as fp16 NaN
inline uint16x8_t e4m3_halves(int8x8_t codes, bool nan) {
    const uint16x8_t bits = vandq_u16(vshlq_n_u16(vreinterpretq_u16_s16(vmovl_s8(codes)), 7), vdupq_n_u16(0xBFFF));
    if (__builtin_expect(!nan, 1)) return bits;
    const uint16x8_t seven = vdupq_n_u16(0x3F80);
    return vbslq_u16(vceqq_u16(vandq_u16(bits, seven), seven), vdupq_n_u16(0x7E00), bits);
}
inline vec half_pair(uint16x8_t bits, int h) {  // fp16 values 4 h .. 4 h + 3 of 8
    const float16x8_t x = vreinterpretq_f16_u16(bits);
    return h == 0 ? vcvt_f32_f16(vget_low_f16(x)) : vcvt_high_f32_f16(x);
}
template <int K> inline vec neon_half(const typename NeonRaw<K>::type& x, int h, bool nan) {
    if constexpr (K == F32) {
        return vld1q_f32(x + 4 * h);
    } else if constexpr (K == BF16) {
        return vreinterpretq_f32_u32(h == 0 ? vshll_n_u16(vget_low_u16(x), 16) : vshll_high_n_u16(x, 16));
    } else if constexpr (K == F16) {
        return half_pair(x, h);
    } else if constexpr (K == I8) {
        const int16x8_t w = vmovl_s8(x);
        return vcvtq_f32_s32(h == 0 ? vmovl_s16(vget_low_s16(w)) : vmovl_high_s16(w));
    } else {
        return half_pair(e4m3_halves(x, nan), h);
    }
}
inline vec vexp(vec x) {  // (AVX-512's vexp, step for step)
    const vec x0 = x;
    x = vmaxq_f32(vdupq_n_f32(-87.0f), x);
    const vec n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
    vec r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    vec p = vdupq_n_f32(1.0f / 720);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const vec y = vmulq_f32(p, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(y), vcgtq_f32(x0, vdupq_n_f32(-87.0f))));  // e^-inf 0
}
#endif

#if DN_VECTORS
constexpr int W_ = W;
#else
constexpr int W_ = 1;
#endif
// what D and Dv must be multiples of for the vector path (NEON's reads 8 values a step: two vectors)
constexpr int64_t VECTOR_DIMS = DN_NEON ? 2 * W_ : W_;
// whether the scores have the four-key pass (32 registers: AVX-512's, NEON's), else two keys a pass at most
constexpr bool FOUR_KEYS = DN_AVX512 || DN_NEON;

#if DN_AVX512 || DN_AVX2
// The sums of eight vectors at once (a transposed reduction: 7 horizontal adds, not 8 separate reductions).
inline __m256 to_ymm(vec x) {
#if DN_AVX512
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
#else
    return x;
#endif
}
// The sum of one vector in hsum8's order, so a key's score is bitwise the same whichever pass computes it (the 4-key
// pass, or the 2- and 1-key passes at a block's end: batch invariance when padding follows a row's last key).
inline float hsum1(vec v) {
    __m256 y = to_ymm(v);
    y = _mm256_add_ps(y, _mm256_permute_ps(y, 0xB1));  // lanes 0, 2: x0+x1, x2+x3 (in-lane swaps, not hadd's uops)
    y = _mm256_add_ps(y, _mm256_permute_ps(y, 0x4E));  // lane 0: (x0+x1)+(x2+x3), lane 4: (x4+x5)+(x6+x7)
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)));
}
inline void hsum8(vec v0, vec v1, vec v2, vec v3, vec v4, vec v5, vec v6, vec v7, float* out) {
    const __m256 h01 = _mm256_hadd_ps(to_ymm(v0), to_ymm(v1)), h23 = _mm256_hadd_ps(to_ymm(v2), to_ymm(v3));
    const __m256 h45 = _mm256_hadd_ps(to_ymm(v4), to_ymm(v5)), h67 = _mm256_hadd_ps(to_ymm(v6), to_ymm(v7));
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

#if DN_AVX512
// The sums of sixteen vectors a[k][r] (4 keys x 4 rows) in one vector, lane 4 r + k (row-major, as s is laid out), each
// added in hsum1's order (bitwise the same as the 2- and 1-key passes' sums): lane i + lane i + 8, then neighbours,
// then neighbouring pairs, then the two halves. A transposed reduction: 30 shuffles and 15 adds, where two hsum8
// take 44 shuffles and 30 adds; with the scales' multiply and the stores in vectors too, one thread from DRAM: int8
// and fp8 0.95-0.96x the time, a 16-node tree 0.97x, fp32 / bf16 0.99-1.00x (bitwise the same).
inline __m512 hsum16_rows(const __m512 (&a)[4][4]) {
    __m512 y[8], z[4], w[2];
    for (int i = 0; i < 8; ++i) {  // [x_i + x_i+8 of vector 2i | of vector 2i + 1], vectors in order v = 4 k + r
        const __m512 u = a[(2 * i) / 4][(2 * i) % 4], v = a[(2 * i + 1) / 4][(2 * i + 1) % 4];
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x44), _mm512_shuffle_f32x4(u, v, 0xEE));
    }
    // neighbours summed, twice (per 128-bit lane: the even lanes of two vectors plus their odd lanes): z holds four
    // vectors' sums of pairs, w eight vectors' sums of fours (each half of a vector in its own 128-bit lane)
    for (int i = 0; i < 4; ++i)
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xDD));
    // halves summed: [v0 v2 v4 v6 | v1 v3 v5 v7 | v8 v10 v12 v14 | v9 v11 v13 v15]
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    // to lane 4 r + k, vector v = 4 k + r
    const __m512i order = _mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 1, 3, 9, 11, 5, 7, 13, 15);
    return _mm512_permutexvar_ps(order, sums);
}
#endif

#endif

// Whether rows[0 .. n) (each `bytes` long) hold an e4m3 NaN code: x | 0x80 is 0xFF for those alone, so the bytes'
// running unsigned max tells (two instructions per vector of bytes; without the intrinsics, a loop the compiler
// vectorises).
inline bool e4m3_nan_codes(const char* const* rows, int n, int64_t bytes) {
#if DN_AVX512 || DN_AVX2
    const __m128i sign = _mm_set1_epi8((char)0x80);
    __m128i top = _mm_setzero_si128();
#if DN_AVX512
    __m512i wide = _mm512_setzero_si512();
#else
    __m256i wide = _mm256_setzero_si256();
#endif
    for (int jj = 0; jj < n; ++jj) {
        const char* row = rows[jj];
        int64_t b = 0;
#if DN_AVX512
        for (; b + 64 <= bytes; b += 64)
            wide = _mm512_max_epu8(wide, _mm512_or_si512(_mm512_loadu_si512(row + b), _mm512_set1_epi8((char)0x80)));
#else
        for (; b + 32 <= bytes; b += 32)
            wide = _mm256_max_epu8(wide, _mm256_or_si256(_mm256_loadu_si256((const __m256i*)(row + b)),
                                                         _mm256_set1_epi8((char)0x80)));
#endif
        for (; b + 16 <= bytes; b += 16)
            top = _mm_max_epu8(top, _mm_or_si128(_mm_loadu_si128((const __m128i*)(row + b)), sign));
        for (; b + 8 <= bytes; b += 8)
            top = _mm_max_epu8(top, _mm_or_si128(_mm_loadl_epi64((const __m128i*)(row + b)), sign));
        for (; b < bytes; ++b)  // (the plain path's rows: D need not be a multiple of 8)
            if ((row[b] | 0x80) == (char)0xFF) return true;
    }
#if DN_AVX512
    const __m256i half = _mm256_max_epu8(_mm512_castsi512_si256(wide), _mm512_extracti64x4_epi64(wide, 1));
#else
    const __m256i half = wide;
#endif
    top = _mm_max_epu8(top, _mm_max_epu8(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1)));
    return _mm_movemask_epi8(_mm_cmpeq_epi8(top, _mm_set1_epi8((char)0xFF))) != 0;
#elif DN_NEON
    const uint8x16_t sign = vdupq_n_u8(0x80);
    uint8x16_t tops[4] = {vdupq_n_u8(0), vdupq_n_u8(0), vdupq_n_u8(0), vdupq_n_u8(0)};
    for (int jj = 0; jj < n; ++jj) {
        const uint8_t* row = (const uint8_t*)rows[jj];
        int64_t b = 0;
        for (; b + 64 <= bytes; b += 64) {  // (one load of four vectors, four running maxima)
            const uint8x16x4_t x = vld1q_u8_x4(row + b);
            for (int i = 0; i < 4; ++i) tops[i] = vmaxq_u8(tops[i], vorrq_u8(x.val[i], sign));
        }
        for (; b + 16 <= bytes; b += 16) tops[0] = vmaxq_u8(tops[0], vorrq_u8(vld1q_u8(row + b), sign));
        for (; b < bytes; ++b)  // (the plain path's rows: D need not be a multiple of 16)
            if ((row[b] | 0x80) == 0xFF) return true;
    }
    return vmaxvq_u8(vmaxq_u8(vmaxq_u8(tops[0], tops[1]), vmaxq_u8(tops[2], tops[3]))) == 0xFF;
#else
    uint8_t top = 0;
    for (int jj = 0; jj < n; ++jj) {
        const uint8_t* row = (const uint8_t*)rows[jj];
#pragma omp simd reduction(max : top)
        for (int64_t b = 0; b < bytes; ++b) top = std::max<uint8_t>(top, (uint8_t)(row[b] | 0x80));
    }
    return top == 0xFF;
#endif
}

#if DN_AMX
// ---- int8 on AMX tiles ----------------------------------------------------------------------------------------
//
// An int8 key row times a q row is an integer dot product once q is in fixed point: q / 2^e rounded to an integer
// of at most 26 bits (2^e the power of two that puts the row's largest |q| in [2^25, 2^26)), written in four signed
// base-128 digits of [-64, 63] (digits4). One TDPBSSD then computes 16 keys x 64 channels against all four digits of
// four query rows (the B tile's 16 columns: row r's digit p in column 4 r + p), exactly, in int32; the digits'
// sums are weighted by 2^21, 2^14, 2^7, 1 in fp32 and scaled by 2^e. The values likewise: a block's weights p (times
// the value scales, >= 0), per row in fixed point against the block's largest, as three unsigned base-256 digits
// (24 bits), one TDPBUSD against V rows in the tile layout it takes (4 keys' bytes of one channel in each 32-bit
// lane: amx_v_tiles). (Four signed digits for p, as q's, took 1.12-1.20x the time in L2, 1.04-1.08x from DRAM.)
// The only rounding before fp32's is q's to 2^-26 and p's to 2^-24 of their row's largest: the error is at or below
// fp32's own in a dot product of D terms.
// Tiles: 0, 4, 5, 6 sums; 1 and 7 key rows; 2 and 3 q's digits (64 channels each); then 1, 2, 3 V and 7 p's digits
// (rows 3 r + p, p = 0 .. 2). More than four rows a KV head (AMX_ROWS) go four at a time: each group's q digits,
// scores, p digits and products after the last group's, over the block's same K rows and V tiles.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
constexpr int AMX_MAX_D = 128;  // q's digits in tiles 2 and 3
// query rows a KV head on the int8 tiles: groups of NR, each its own q digits' tiles and p digits' A tile, one after
// the other over the same K rows and V tiles (a G 8 decode: Llama 3 70B's; G 12; G 16 where the bf16 tiles do not
// take it: a q of values not all bf16 numbers, or batch-invariant mode)
constexpr int AMX_ROWS = 4 * NR;

// Linux hands a process the tiles' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once.
inline bool amx_granted() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
}

// Every tile 16 rows of 64 bytes, for this thread (released after its items: Tiles in decode_native's worker)
inline void amx_configure() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

// The tile unit sleeps after about a thousand TSC ticks (0.4 us) without a tile instruction, and the next one then
// stalls the core some 450 ticks while it wakes (rdtsc in the int8 path: the V rows laid out from DRAM take 20 ticks a
// key, 1,300 a block, after the softmax's 550; the first products then took 900 ticks a block, with the unit kept awake
// 450). A long vector phase keeps it awake with a product that nothing reads: into sums tile C (zeroed before its next
// use) from any two tiles (amx_configure gives every tile one shape), whatever they hold (integer products: no
// exception, no assist). The int8 tiles' V layout and the score tiles' vector passes (tiles_awake) both take it.
// One every 24 keys of the int8 V layout: from DRAM 0.97x the time (one and two threads), in cache the same; one every
// 4 keys gained no more from DRAM and took 0.97-1.09x in cache (docs/BENCHMARKS.md, round 24).
#define DN_AMX_AWAKE(C) _tile_dpbusd(C, 7, 1)

// tile C = 16 key rows (base, stride apart) . q's digits (tiles 2 and 3), 64 channels a product (A tiles 1 and 7)
#define DN_AMX_DOT(C, base, stride, D)                 \
    do {                                               \
        _tile_zero(C);                                 \
        _tile_loadd(1, (base), (stride));              \
        _tile_dpbssd(C, 1, 2);                         \
        if ((D) > 64) {                                \
            _tile_loadd(7, (base) + 64, (stride));     \
            _tile_dpbssd(C, 7, 3);                     \
        }                                              \
    } while (0)

// 16 integers x (|x| < 2^27) each as sum of digit p * 128^(3 - p), every digit in [-64, 63]: digit p of lane i to
// out[p * stride + i]
inline void digits4(__m512i x, int8_t* out, int64_t stride) {
    for (int p = 3; p > 0; --p) {
        const __m512i low = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(x, _mm512_set1_epi32(64)),
                                                              _mm512_set1_epi32(127)), _mm512_set1_epi32(64));
        _mm_storeu_si128((__m128i*)(out + p * stride), _mm512_cvtepi32_epi8(low));
        x = _mm512_srai_epi32(_mm512_sub_epi32(x, low), 7);
    }
    _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(x));
}

// The power of two 2^e that puts max_abs (> 0, finite) in [2^(BITS - 1), 2^BITS) once divided by it (so every
// |x| <= max_abs rounds to at most 2^BITS - 1): 2^(ilogb - BITS + 1); 0 where max_abs < 2^-100 (2^e would leave
// fp32's normal range: such rows take the vector path). From the exponent's bits: ilogbf and ldexpf are library
// calls, two a row a block in the int8 tiles' values.
template <int BITS>
inline float fixed_point_unit(float max_abs) {
    const int e = (int)(float_bits(max_abs) >> 23) - 127;  // (ilogb for a normal max_abs; a subnormal's is below -100)
    return e < -100 ? 0.0f : bits_float((uint32_t)(e - BITS + 1 + 127) << 23);
}

// Four vectors of sums [16 x 16] int32 (rows i .. i + 3 of a stored sums tile, lanes 4 r + p) to one vector, lane
// 4 r + a: sum over p of row (i + a)'s lane 4 r + p times 128^(3 - p)
inline __m512 digit_sums(const int32_t* rows) {
    __m512 y[4];
    for (int a = 0; a < 4; ++a) y[a] = _mm512_cvtepi32_ps(_mm512_loadu_si512(rows + 16 * a));
    const __m512 t0 = _mm512_unpacklo_ps(y[0], y[1]), t1 = _mm512_unpackhi_ps(y[0], y[1]);
    const __m512 t2 = _mm512_unpacklo_ps(y[2], y[3]), t3 = _mm512_unpackhi_ps(y[2], y[3]);
    const __m512 p0 = _mm512_shuffle_ps(t0, t2, 0x44), p1 = _mm512_shuffle_ps(t0, t2, 0xEE);
    const __m512 p2 = _mm512_shuffle_ps(t1, t3, 0x44), p3 = _mm512_shuffle_ps(t1, t3, 0xEE);
    __m512 sum = _mm512_fmadd_ps(p2, _mm512_set1_ps(128.0f), p3);
    sum = _mm512_fmadd_ps(p1, _mm512_set1_ps(16384.0f), sum);
    return _mm512_fmadd_ps(p0, _mm512_set1_ps(2097152.0f), sum);
}
#endif

#if DN_AMX_BF16
// ---- bf16 on AMX tiles, many rows ---------------------------------------------------------------------------------
//
// A latent (absorbed MLA: 16-128 query heads on one latent row), a tree verify (nodes x G rows) or a top-k prefill
// gives many query rows per key, where the vector path is bound by its FMAs (docs/BENCHMARKS.md, "Many rows per
// key"). A bf16 q value times a bf16 key value is exact in fp32, and one TDPBF16PS takes 16 keys x 32 channels
// against 16 query rows, summing in fp32: the scores' A tiles are the key rows as they lie (16 rows a stride apart),
// the B tiles q's rows two channels to a 32-bit lane (built once a call: q_tiles). The sums come out [key][row], so
// the softmax runs with a row group's 16 rows in the lanes (tile_softmax) and the weights are transposed into s. The
// weights p (fp32) go in as bf16 pieces (p = hi + mid + lo, 24 bits: an fp32's significand; hi + lo for a bf16
// output) against V's rows laid two keys to a 32-bit lane (v_words), the pieces' products summed in fp32 per 16 rows
// x 16 channels. Taken where q's values are all bf16 numbers (a bf16 model's: the scale applied to the sums), for
// blocks whose rows all see the same keys (a hidden key's value row is never read, its weight 0); a block whose rows
// see different keys runs the vector path, where a hidden key's value never meets a row (not even times 0). The
// tiles flush subnormal inputs and products to zero (below 2^-126). int8 and fp8 e4m3 K/V are widened to bf16 words
// first (exactly: 8 and 4 significant bits), their scales applied as on the vector path.
// bf16 K/V of 8-15 rows a KV head (a G 8 decode: Llama 3 70B's) take the tiles for their scores alone (scores_only:
// the sums transposed into s, then the vector path's softmax and values, so any block, masked or not): the vector
// path's 128 FMAs a key and KV head at 8 rows leave it bound by them (G 8 read at 0.65x G 4's rate). One thread,
// from DRAM, B 1 S 32k: G 8 0.86x the time, G 12 0.77x; at G 4 1.12-1.17x and G 6 1.04x (so not below 8 rows).
constexpr int TILE_ROWS = 16;  // query rows a tile; calls with at least this many rows a KV head take the tiles
constexpr int SCORE_TILE_ROWS = 8;  // bf16 K/V of this many rows up to TILE_ROWS: the scores alone on the tiles
// and 16 rows of Dv up to this: a G 16 decode (Qwen3-235B's 64 / 4) took 0.88x the whole tiles' time, B 1 S 32k, one
// thread (24 rows 0.96x, 32 rows 1.14x); a latent's 16 rows of Dv 512 keep the whole tiles, where the values
// weigh most (16 x 512 channels a key)
constexpr int64_t SCORE_TILE_DV = 128;
// fp8 e4m3 K/V (read as F8_WORDS: D and Dv multiples of 64) of this many rows up to TILE_ROWS: the scores alone on the
// tiles too, each K row widened by e4m3_words into a tile row (q's tiles in the words' channel order), the tile unit
// kept awake through the vector passes (tiles_awake). One thread from DRAM, B 1 S 32k, against the vector path: G 4
// 0.93x the time, G 6 0.89x, G 8 0.74x; G 3 1.02x, G 1-2 1.09-1.10x (docs/BENCHMARKS.md, round 24). Without the
// unit kept awake, G 4 took 1.00-1.02x (round 23). A short call pays for it: each work item's first products wait for
// the tile unit's latency, where the vector path would have finished (B 8, Hkv 8, G 4, bf16 q, one thread, warm: S 16
// 1.43x the time, 64 1.38x, 128 1.06-1.11x, 256 0.94x, 512 0.86x; bf16's score tiles at G 8 alike: S 16 1.34x, 64
// 1.16x, 128 0.94x). The choice is not made by the call's keys: a request would then run one path alone and the other
// beside a longer one, and its bits would depend on its batch (tests/test_decode_score_tiles.py).
constexpr int F8_SCORE_TILE_ROWS = 4;
// bf16 pieces of each weight: 3 (24 bits, as fp32); 2 where the output is bf16 (16 bits: each weight within 2^-17 of
// its own, 2^-8 of the output's rounding)
constexpr int P_PIECES = 3;
std::atomic<int> bf16_tiles_mode{-1};  // -1: on where AMX is granted; 0: off (decode_native_use_bf16_tiles)

// 16 vectors x[i] (row i) transposed in place: x[j] lane i = old x[i] lane j
inline void transpose16(__m512 (&x)[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i + 1 at columns 4L, 4L + 1 (lo), 4L + 2, 4L + 3
        t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // x[4 i + c], lane L: column 4 L + c of rows 4 i .. 4 i + 3
        x[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        x[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        x[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        x[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {  // column 4 L + c: 128-bit lane L of x[c], x[4 + c], x[8 + c], x[12 + c]
        const __m512 ab02 = _mm512_shuffle_f32x4(x[c], x[4 + c], 0x88);
        const __m512 ab13 = _mm512_shuffle_f32x4(x[c], x[4 + c], 0xDD);
        const __m512 cd02 = _mm512_shuffle_f32x4(x[8 + c], x[12 + c], 0x88);
        const __m512 cd13 = _mm512_shuffle_f32x4(x[8 + c], x[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(ab02, cd02, 0x88), t[8 + c] = _mm512_shuffle_f32x4(ab02, cd02, 0xDD);
        t[4 + c] = _mm512_shuffle_f32x4(ab13, cd13, 0x88), t[12 + c] = _mm512_shuffle_f32x4(ab13, cd13, 0xDD);
    }
    for (int i = 0; i < 16; ++i) x[i] = t[i];
}

// bf16 words (32) to the fp32 values of the low 16 (HALF 0) or the high 16 (HALF 1)
template <int HALF>
inline __m512 bf16_half(__m512i w) {
    const __m256i h = HALF == 0 ? _mm512_castsi512_si256(w) : _mm512_extracti64x4_epi64(w, 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// q's B tiles of one call: [B * Hkv][rows / 16][D / 32][16][32] words, lane (32-bit) r of row k2 holding channels
// 2 k2, 2 k2 + 1 of query row r (rows past R zero); q's rows (fp32 holding bf16 numbers, unscaled) at q, row r of
// (b, h) at b * qs[0] + h * qs[1] + r * qs[2]
inline std::vector<uint16_t> q_tile_words(const float* q, const int64_t (&qs)[3], int64_t B, int64_t H, int64_t R,
                                          int64_t D) {
    const int64_t groups = (R + TILE_ROWS - 1) / TILE_ROWS, chunks = D / 32;
    std::vector<uint16_t> out(B * H * groups * chunks * 512, 0);
    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(16));
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t r = 0; r < R; ++r) {
                const float* row = q + b * qs[0] + h * qs[1] + r * qs[2];
                uint16_t* tiles = &out[((b * H + h) * groups + r / TILE_ROWS) * chunks * 512];
                for (int64_t c = 0; c < chunks; ++c) {
                    const __m512bh w =
                        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 32 * c + 16), _mm512_loadu_ps(row + 32 * c));
                    _mm512_i32scatter_epi32(tiles + c * 512 + 2 * (r % TILE_ROWS), lanes, (__m512i)w, 4);
                }
            }
    return out;
}
#endif

// Where channel d of q (and of the output) sits for BF16_PAIRS: within each 2 * W, the even ones first (vload_pair).
// With W = 8: channels 0 1 2 3 .. 15 sit at 0 8 1 9 .. 15.
constexpr int64_t PAIR = 2 * W_;
constexpr int64_t paired_order(int64_t d) { return (d & ~(PAIR - 1)) | ((d & 1) * W_) | ((d & (PAIR - 1)) >> 1); }
// Which channel of its 64 sits at place p (0 .. 63) for F8_WORDS: of the words e4m3_words makes (q's bf16 bits: w0
// then w1), and of the fp32 vectors the kernel splits them into (q, the output: even words of w0, odd ones, then
// w1's), vector h's lane k being word 2 k + h % 2 of w[h / 2].
constexpr int64_t f8_word_channel(int64_t p) { return 16 * (p % 32 / 8) + 8 * (p / 32) + p % 8; }
constexpr int64_t f8_lane_channel(int64_t p) { return f8_word_channel(32 * (p / 32) + 2 * (p % 16) + p / 16 % 2); }
#if DN_F8_WORDS
// out[i] = in[from(i)] * factor for 64 floats, from a permutation of 0 .. 63: per 16 outputs two vpermt2ps (each over
// 32 of the inputs) and a blend. F8_WORDS' q (from = f8_lane_channel) and output (its inverse) each a row at a time:
// the loops with the index arithmetic per value took 5 us of a 20 us call (B 1, Hkv 8, 4 rows, 16 keys).
struct Permute64 {
    __m512i index[4];
    __mmask16 upper[4];  // (lanes whose input is one of the upper 32)
    template <class From>
    explicit Permute64(From from) {
        for (int j = 0; j < 4; ++j) {
            alignas(64) int32_t lanes[16];
            upper[j] = 0;
            for (int l = 0; l < 16; ++l) {
                const int i = (int)from(16 * j + l);
                lanes[l] = i % 32;
                if (i >= 32) upper[j] |= (__mmask16)(1u << l);
            }
            index[j] = _mm512_load_si512(lanes);
        }
    }
    void apply(const float* in, float* out, float factor) const {
        const __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + 16), c = _mm512_loadu_ps(in + 32),
                     d = _mm512_loadu_ps(in + 48), f = _mm512_set1_ps(factor);
        for (int j = 0; j < 4; ++j)
            _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(_mm512_mask_blend_ps(upper[j], _mm512_permutex2var_ps(
                                 a, index[j], b), _mm512_permutex2var_ps(c, index[j], d)), f));
    }
};
inline const Permute64& f8_q_order() {  // q's channels in f8_lane_channel's order
    static const Permute64 order([](int i) { return f8_lane_channel(i); });
    return order;
}
inline const Permute64& f8_word_order() {  // and in f8_word_channel's (the score tiles' q: q_tile_words)
    static const Permute64 order([](int i) { return f8_word_channel(i); });
    return order;
}
inline const Permute64& f8_output_order() {  // and back
    static const Permute64 order([](int i) {
        int d = 0;
        while (f8_lane_channel(d) != i) ++d;
        return d;
    });
    return order;
}
#endif

// q's row (D values at src) times factor into dst in the order the kind's kernel reads it: F8_WORDS' each 64 channels
// in f8_lane_channel's order, BF16_PAIRS' each PAIR in paired_order, the others' as they are; false when a value is
// NaN or inf. Each order is its own loop, so the compiler vectorises them: one loop that chose the order per value
// took 4 us of a 23 us call (B 8, Hq 9 / Hkv 3, D 64, 16 keys), a fifth of the kernel's time in a small model's step.
inline bool scale_q_row(const float* src, float* dst, int64_t D, float factor, bool pairs, bool words) {
    uint32_t special = 0;  // (an exponent of all ones: inf or NaN)
    for (int64_t d = 0; d < D; ++d) {
        uint32_t bits;
        std::memcpy(&bits, &src[d], 4);
        special |= (bits & 0x7F800000u) == 0x7F800000u;
    }
    if (words) {
#if DN_F8_WORDS
        for (int64_t d0 = 0; d0 < D; d0 += 64) f8_q_order().apply(src + d0, dst + d0, factor);
#endif
    } else if (pairs) {  // source channels 2 i and 2 i + 1 of each PAIR to places i and W + i (paired_order)
        for (int64_t d0 = 0; d0 < D; d0 += PAIR)
            for (int64_t i = 0; i < W_; ++i)
                dst[d0 + i] = src[d0 + 2 * i] * factor, dst[d0 + W_ + i] = src[d0 + 2 * i + 1] * factor;
    } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * factor;
    }
    return special == 0;
}

// n bf16 values (their bits at src) as fp32 into dst: exact, the bits shifted up
inline void widen_bf16_row(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        std::memcpy(&dst[i], &bits, 4);
    }
}

// n fp32 values to bf16 bits, as torch converts them: rounded to nearest, ties to even; NaN as 0x7FC0
inline void round_bf16(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &src[i], 4);
        const uint16_t rounded = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
        dst[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : rounded;
    }
}

// whether every one of the n values at x is a bf16 number (its low 16 bits zero)
inline bool bf16_row(const float* x, int64_t n) {
    uint32_t low = 0;
    for (int64_t d = 0; d < n; ++d) {
        uint32_t bits;
        std::memcpy(&bits, &x[d], 4);
        low |= bits & 0xFFFFu;
    }
    return low == 0;
}

// q's row (D values at src, each a bf16 number: bf16_row) as bf16 bits into out, in the order the kind's scores read
// them (F8_WORDS': each 64 in f8_word_channel's order)
inline void q_row_bits(const float* src, uint16_t* out, int64_t D, bool words) {
    for (int64_t d = 0; d < D; ++d) {
        uint32_t bits;
        std::memcpy(&bits, &src[words ? (d & ~int64_t(63)) | f8_word_channel(d & 63) : d], 4);
        out[d] = (uint16_t)(bits >> 16);
    }
}

#if DN_BF16_DOT
// ---- whether vdpbf16ps pays here (decode_native_bf16_dot) ----------------------------------------------------

constexpr double DOT_FMA_RATIO = 1.5;  // vdpbf16ps pays where one costs at most this many FMAs' time (it does twice
                                       // an FMA's products): Zen 4 1.0, where it paid; the AMX Xeon 4.0, where not

// ns per instruction of 16 independent chains (enough to cover either's latency) of vdpbf16ps or FMAs, `rounds` each
template <bool DOT>
__attribute__((noinline)) double chain_ns(int rounds) {
    constexpr int CHAINS = 16;
    __m512 a[CHAINS];
    for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_set1_ps(1e-3f * (float)i);
    const __m512 x = _mm512_set1_ps(0.5f);
    const __m512bh xb = (__m512bh)_mm512_set1_epi16(0x3F00);  // bf16 0.5
    const auto start = std::chrono::steady_clock::now();
    for (int n = 0; n < rounds; ++n)
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; ++i) {  // (all in registers: a register barrier here kept them in memory, and
                                            // timed the stores' forwarding instead)
            if constexpr (DOT) a[i] = _mm512_dpbf16_ps(a[i], xb, xb);
            else a[i] = _mm512_fmadd_ps(a[i], x, x);
        }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    float sum = 0.0f;
    for (int i = 0; i < CHAINS; ++i) sum += _mm512_reduce_add_ps(a[i]);
    asm volatile("" : : "x"(sum));  // (the chains are used)
    return ns / (CHAINS * (double)rounds);
}

struct DotRates {
    double dot_ns, fma_ns;  // per instruction, the fastest of the tries
};

// Timed once per process (about 0.5 ms): 8 tries of each, alternated, the fastest kept; the first pair warms
// the vector units up
inline const DotRates& bf16_dot_rates() {
    static const DotRates rates = [] {
        DotRates r{1e30, 1e30};
        for (int t = 0; t < 8; ++t) {
            const double fma = chain_ns<false>(2048), dot = chain_ns<true>(2048);
            if (t > 0) r.fma_ns = std::min(r.fma_ns, fma), r.dot_ns = std::min(r.dot_ns, dot);
        }
        return r;
    }();
    return rates;
}
#endif

std::atomic<int> bf16_dot_mode{-1};  // -1: as bf16_dot_rates decide; 0 / 1: forced (decode_native_use_bf16_dot)

// ---- the call: one descriptor, the whole boundary with Python ------------------------------------------------

}  // namespace

extern "C" {

// Everything one call needs. Declared once more, field for field, as DecodeCall in decode_native.py; the library
// reports each field's offset (decode_native_layout) and Python refuses a library whose layout differs.
struct DecodeCall {
    int64_t kind;                   // element kind of K and V (F32 .. F8E4M3 below)
    int64_t threads;                // runs to cut the keys into (at most)
    int64_t B, H, R, S, D, Dv;      // batch, KV heads, query rows per KV head (G * T), keys, head dims
    const void* k;                  // [B, Hkv, S, D] unit stride on the last axis
    int64_t k_strides[3];           // elements, of b, h, s
    const float* k_scale;           // [B, Hkv, S] per-key scales (int8 / fp8), or null
    int64_t k_scale_strides[3];
    const void* v;                  // [B, Hkv, S, Dv]
    int64_t v_strides[3];
    const float* v_scale;
    int64_t v_scale_strides[3];
    const void* q;                  // [B, Hkv, R, D] fp32 (bf16: io_kind), unit stride on the last axis (not yet
                                    // scaled)
    int64_t q_strides[3];
    double scale;                   // the softmax scale, applied to q here
    const uint8_t* visible;         // [B, Hkv, R, S] bytes (0 strides where broadcast), or null: all visible
    int64_t visible_strides[4];
    void* out;                      // [B, Hkv, R, Dv] fp32 (bf16: io_kind), contiguous: written whole
    float* lse;                     // [B, Hkv, R] fp32, contiguous: written whole; or null: not wanted
    // A paged cache (null pages: k / v hold [B, Hkv, S, D] as above): k and v are pools [num_pages, page_size,
    // Hkv, D] with k_strides / v_strides those of (page, slot, head), scales (int8 / fp8) pools [num_pages,
    // page_size, Hkv] likewise; key j of sequence b is slot j % page_size of page pages[b * pages_stride +
    // j / page_size]; sequence b has lengths[b] keys (S is the longest).
    const int64_t* pages;
    int64_t pages_stride;
    int64_t page_size;
    const int64_t* lengths;
    // The position of key 0 in its sequence (a contiguous call cut to the span some row sees: a multiple of
    // BLOCK; 0 for a paged cache). Work items end at multiples of SPLIT positions, so a sequence's keys are cut the
    // same way whatever else shares the call, however many threads run it, contiguous or paged.
    int64_t key_offset;
    // q's and out's element kind: F32, or BF16 (a bf16 model's: q read and its output written in bf16, where the
    // caller's conversions to and from fp32 took 6 of a small step's 33 us)
    int64_t io_kind;
    // 1: each row computed as alone, whatever other rows share the call (batch-invariant mode: a prefill's rows
    // bitwise the same chunked or whole), so not on the AMX-BF16 tiles, which take a call's rows 16 at a time
    int64_t rows_alone;
    // > 0: every score capped, softcap * tanh(score / softcap) (Gemma 2's attention), before the softmax; not on the
    // AMX-BF16 tiles (their softmax reads the sums as they come)
    double softcap;
    // ALiBi (null: none): score += -alibi[b, head] * |key_pos - query_pos| after the softcap, each row's slope its
    // query head's (row r of KV head h: query head h * R / queries + r / queries, query r % queries); slopes fp32
    // [B|1, Hq] (batch stride alibi_stride), query_pos fp32 [B|1, queries] and key_pos fp32 [B|1, S] (batch strides
    // alongside; a paged step's keys: 0 .. S-1 shared), positions below 2^24 (exact in fp32)
    const float* alibi;
    int64_t alibi_stride;
    int64_t queries;
    const float* query_pos;
    int64_t query_pos_stride;
    const float* key_pos;
    int64_t key_pos_stride;
    // a bias (null: none): score += bias[b, head, query, key] after the softcap and ALiBi, fp32 with element strides
    // (0 where broadcast; heads and queries as ALiBi's: queries rows a query head)
    const float* bias;
    int64_t bias_strides[4];
};

}  // extern "C"

namespace {

struct Operands {
    const void *k, *v;              // [B, Hkv, S, D] / [B, Hkv, S, Dv], unit stride on the last axis
    int64_t ks[3], vs[3];           // strides (elements) of b, h, s
    const float *k_scale, *v_scale; // [B, Hkv, S] per-key scales, or null (strides kss / vss)
    int64_t kss[3], vss[3];
    const float* q;                 // [B, Hkv, R, D] fp32, contiguous, already multiplied by the softmax scale
                                    // (the entry point's scaled copy of the caller's q), or unscaled with q_bf16
    const uint16_t* q_bf16;         // [B, Hkv, R, D] q's bf16 bits in channel order, or null: where every value of q
                                    // is a bf16 number, R a multiple of NR and K bf16 (read as BF16_PAIRS), int8 or
                                    // fp8 (DN_BF16_DOT); then q is unscaled and k_unit holds the scale
    const uint8_t* visible;         // [B, Hkv, R, S] (strides vis, 0 where broadcast), or null: all visible
    int64_t vis[4];
    int64_t B, H, R, S, D, Dv;
    float k_unit, v_unit;           // constant factor of every key / value (fp8 read through fp16: 2^8; else 1)
    const int64_t* pages;           // a paged cache's page table (DecodeCall), or null
    int64_t pages_stride, page_size;
    const int64_t* lengths;         // keys per sequence, or null: S each
    bool shared;                    // V is a prefix of K's rows (same rows, Dv <= D: a latent cache): V's rows are
                                    // K's, already asked for, so only K's are requested
    const uint16_t* q_tiles;        // bf16 K/V on AMX tiles (DN_AMX_BF16): q's B tiles (q_tile_words), or null
    float tile_unit;                // what the tiles' sums are multiplied by (the softmax scale)
    int64_t p_pieces;               // bf16 pieces of each weight on the tiles (P_PIECES, or 2 for a bf16 output)
    bool scores_only;               // the tiles take the scores alone (score_tiles), the vectors the rest
    float softcap;                  // > 0: scores capped at +-softcap by tanh (softmax_step), else 0
    const float *alibi, *query_pos, *key_pos;  // ALiBi (DecodeCall's), or alibi null
    int64_t alibi_stride, queries, query_pos_stride, key_pos_stride;
    const float* bias;              // a bias (DecodeCall's), or null
    int64_t bias_strides[4];
};

#if DN_AMX
// int8 K/V on AMX tiles: q's rows in the columns of one tile per group of NR rows (R <= AMX_ROWS), D in 64-channel
// tiles (up to AMX_MAX_D), Dv in 64-channel halves, K and V their own rows, the call not on the bf16 tiles (16 rows
// of a bf16 q: those and the int8 tiles' four groups took the same time, 1.00-1.04x); and Linux granting the tiles
inline bool amx_usable(const Operands& o) {
    return o.R >= 1 && o.R <= AMX_ROWS && !o.q_tiles && o.D % 64 == 0 && o.D <= AMX_MAX_D && o.Dv % 64 == 0 &&
           !o.shared && amx_granted();
}
#endif

struct Partial {                    // one work item's online-softmax state (in the call's buffers: decode_native)
    int64_t bh, j0, j1;
    float *m, *l, *acc;             // [R], [R], [R * Dv]
    uint8_t* bad;                   // [R]: the row saw a non-finite key
};

// ---- one work item -----------------------------------------------------------------------------------------

template <int KIND, bool SIMD>
struct Item {
    const Operands& o;
    Partial& part;
    const void *kb, *vb;
    const float *ksc, *vsc;
    const int64_t* table;           // this sequence's pages (a paged cache), else null
    int64_t head, end;              // this item's KV head; its last key + 1 (clamped to the sequence's length)
    int64_t seq_end;                // the sequence's keys (a contiguous item's last block asks for the next keys)
    const char* krows[BLOCK];       // where each key / value row of the current block starts (block_rows)
    const char* vrows[BLOCK];
    const char* ahead_k[BLOCK + 16]; // rows of the next block to ask for (block_rows; heads side by side: run_items)
    const char* ahead_v[BLOCK + 16];
    bool group_asks = false;        // run_items fills ahead_k / ahead_v for this item (group_rows of them)
    int group_rows = 0;
    Item* successor = nullptr;      // the item this thread runs after this one (run_items), whose first block this
                                    // one's last asks for where its own keys end (first_block_rows)
    bool first_asked = false;       // this item's first block was asked for by the item before it
    float kunit[BLOCK] = {};        // each key's dequantisation factor (1 for fp32 / bf16 / fp16), from block_rows
    const uint8_t* visb;
    const float* slopes = nullptr;  // ALiBi: this KV head's query heads' slopes, or null; its queries' and keys'
    const float *qpos = nullptr, *kpos = nullptr;  // positions
    const float* biasb = nullptr;   // a bias: this (b, KV head)'s first query head's
    const float* qb;
    const uint16_t* qh;             // (o.q_bf16's rows of this item's KV head, or null)
    bool nan_codes = false;         // (fp8) the block's rows hold an e4m3 NaN code: read with vload_e4m3_nan (the
                                    // vector paths) or load_scalar (the plain path's load_lane)
    // Block scratch, in one allocation from a 64-byte boundary (scratch; five had taken a tenth of a small call, B 8
    // Hkv 3 S 16): scores / probabilities s [R][BLOCK], visibility keep [R][BLOCK] as 0 / all-ones bit masks, the
    // values' scales vscale [BLOCK], kept [R] (below), which keys some row sees seen_key [BLOCK] (bytes)
    std::vector<float> scratch;
    float *s, *keep, *vscale;
    // Each row's output so far is rescaled once a block (softmax_step's l_old / l_new): by the value tiles as they load
    // it (kept[r], 1 where unchanged), not in a pass of its own, on the vector paths the value pass covers whole
    // (not AMX's). Bitwise the same. AVX-512 Zen 4 VM, one thread, in cache: fp32 / bf16 / fp16 / int8 0.97-0.99x the
    // time; from DRAM 0.97-1.03x.
    float* kept;
    bool rescale_in_tiles = SIMD;
    uint8_t* seen_key;

    Item(const Item&) = delete;  // (its pointers point into its own scratch)
    Item(Item&&) = default;      // (the scratch's memory moves with it)
    Item(const Operands& o_, Partial& p_)
        : o(o_), part(p_), scratch(2 * o_.R * BLOCK + BLOCK + o_.R + BLOCK / 4 + 16, 0.0f),
          s(aligned64(scratch.data())),
          keep(s + o_.R * BLOCK), vscale(keep + o_.R * BLOCK), kept(vscale + BLOCK),
          seen_key((uint8_t*)(kept + o_.R)) {
        std::fill(kept, kept + o.R, 1.0f);
        std::fill(p_.m, p_.m + o.R, NEG_INF);  // (the state starts here, on the thread that runs the item)
        std::fill(p_.l, p_.l + o.R, 0.0f);
        std::fill(p_.acc, p_.acc + o.R * o.Dv, 0.0f);
        std::fill(p_.bad, p_.bad + o.R, uint8_t(0));
        const int64_t b = p_.bh / o.H, h = p_.bh % o.H;
        kb = (const char*)o.k + elem_size() * (b * o.ks[0] + h * o.ks[1]);
        vb = (const char*)o.v + elem_size() * (b * o.vs[0] + h * o.vs[1]);
        table = o.pages ? o.pages + b * o.pages_stride : nullptr;
        // scales: [B, Hkv, S] rows, or a paged cache's pool [num_pages, page_size, Hkv] (block_rows walks it)
        ksc = !o.k_scale ? nullptr : table ? o.k_scale : o.k_scale + b * o.kss[0] + h * o.kss[1];
        vsc = !o.v_scale ? nullptr : table ? o.v_scale : o.v_scale + b * o.vss[0] + h * o.vss[1];
        head = h;
        end = o.lengths ? std::min<int64_t>(p_.j1, std::max<int64_t>(p_.j0, o.lengths[b])) : p_.j1;
        seq_end = o.lengths ? std::min<int64_t>(o.S, o.lengths[b]) : o.S;
        visb = o.visible ? o.visible + b * o.vis[0] + h * o.vis[1] : nullptr;
        if (o.alibi) {  // this (b, h)'s slopes (its G query heads'), its queries' and keys' positions
            slopes = o.alibi + b * o.alibi_stride + h * (o.R / o.queries);
            qpos = o.query_pos + b * o.query_pos_stride;
            kpos = o.key_pos + b * o.key_pos_stride;
        }
        if (o.bias) biasb = o.bias + b * o.bias_strides[0] + h * (o.R / o.queries) * o.bias_strides[1];
        qb = o.q + p_.bh * o.R * o.D;
        qh = o.q_bf16 ? o.q_bf16 + p_.bh * o.R * o.D : nullptr;
        // value tiles ask for a decode's rows (one pass of rows: many passes' scores already span the block), every
        // ask_mask + 1 keys, about 32 times a block whatever Dv and the vector width (for_row_groups)
        const int64_t tiles = o.Dv / W_ / TILE;
        values_ask = SIMD && (o.R / NR == 1 || (o.R < NR && o.R > 0)) && tiles > 0;
        // fp32 with one full pass of rows: every 8 keys, so the scores' steps ask a larger share (AVX-512 Zen 4 VM,
        // one thread, B 1 S 32k from DRAM: 0.86x the time; bf16 1.06-1.1x, and 1 or 2 rows 1.00-1.02x: not there)
        if (KIND == F32 && o.R == NR) ask_mask = 7;
        while (values_ask && (ask_mask + 1) * 2 < 4 * tiles) ask_mask = ask_mask * 2 + 1;
#if DN_AMX
        if constexpr (KIND == I8 && SIMD) {
            amx = amx_usable(o);
            if (amx) amx = amx_digits();
            rescale_in_tiles = !amx;
            if (amx) {
                // (this thread's, shared by its items: each uses them within one block; not zeroed, written first;
                // from a 64-byte boundary: left where std::vector put it, int8 in cache took 0.297-0.328 ms from run
                // to run, B 2, S 1k, and 0.297-0.303 aligned; from DRAM the same either way. p's digits and the sums
                // tiles here too, not in each item: two heads in turn (pages of 16) then hold 10 KiB less in L1 a
                // block, and took 0.92-0.93x the time in cache, 0.96x from DRAM; contiguous 0.98x from DRAM)
                static thread_local std::vector<int8_t> scratch;
                const size_t bytes = 64 * (o.D + o.Dv) + sizeof(int8_t[AMX_ROWS / NR][16 * 64]) +
                                     sizeof(int32_t[4][16 * 16]) + 64;
                if (scratch.size() < bytes) scratch.resize(bytes);
                k_rows = aligned64(scratch.data()), v_tiles = k_rows + 64 * o.D, p_digits = v_tiles + 64 * o.Dv;
                sums = (int32_t(*)[16 * 16])(p_digits + 16 * 64);
                more_p_digits = (int8_t*)(sums + 4);  // (after the sums: a decode's 1-4 rows find them as before)
            }
        }
#endif
#if DN_AMX_BF16
        if constexpr (ON_TILES) {
            bf16_tiles = o.q_tiles != nullptr;
            scores_only = bf16_tiles && o.scores_only;
            if (scores_only) values_ask = true;  // (the asks spread over the value passes too: score_tiles_step)
            if (bf16_tiles) {  // (this thread's, as int8's; each item uses it within one block)
                static thread_local std::vector<uint16_t> tile_scratch;
                const int64_t groups = (o.R + TILE_ROWS - 1) / TILE_ROWS;
                const size_t words = 2048 + 64 * SLICE + 512 * 2 * o.p_pieces * groups + BLOCK * o.D + 32;
                if (tile_scratch.size() < words) tile_scratch.resize(words);
                c_out = (float*)aligned64(tile_scratch.data()), v_words = (uint16_t*)(c_out + 1024);
                p_words = v_words + 64 * SLICE, k_copy = p_words + 512 * 2 * o.p_pieces * groups;
            }
        }
#endif
    }

#if DN_AVX512 || DN_AVX2
    static vec load(const void* row, int64_t d, bool nan) {
        if constexpr (KIND == F8E4M3)
            if (nan) return vload_e4m3_nan(row, d);
        return vload<KIND>(row, d);
    }
    // Vectors are read STEP at a time: vector h of the STEP at channel d (d a multiple of STEP * W). BF16_PAIRS reads
    // its two from one load (vload_pair); F8_WORDS its four from one conversion of 64 codes (e4m3_words, each word
    // vector's even and odd words); the other kinds read vector d + h * W.
    static constexpr int STEP = KIND == BF16_PAIRS ? 2 : KIND == F8_WORDS ? 4 : 1;
    static vec load_at(const void* row, int64_t d, int h, bool nan) {
        if constexpr (KIND == BF16_PAIRS) return h == 0 ? vload_pair<0>(row, d) : vload_pair<1>(row, d);
        else return load(row, d + h * W, nan);
    }
    // A step as read once (raw_at) and its vectors taken from it (from_raw): F8_WORDS' words, or the row and channel
    // each vector is loaded from
    struct RowAt {
        const void* row;
        int64_t d;
    };
#if DN_F8_WORDS
    using Raw = std::conditional_t<KIND == F8_WORDS, E4M3Words, RowAt>;
#else
    using Raw = RowAt;
#endif
    static Raw raw_at(const void* row, int64_t d) {
#if DN_F8_WORDS
        if constexpr (KIND == F8_WORDS) return e4m3_words(row, d);
        else
#endif
            return RowAt{row, d};
    }
    static vec from_raw(const Raw& x, int h, bool nan) {
#if DN_F8_WORDS
        if constexpr (KIND == F8_WORDS) {  // (bf16 words to fp32: the even ones shifted up, the odd ones as they lie)
            const __m512i w = h < 2 ? x.w0 : x.w1;
            return _mm512_castsi512_ps(h % 2 == 0 ? _mm512_slli_epi32(w, 16)
                                                  : _mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
        } else
#endif
            return load_at(x.row, x.d, h, nan);
    }
#elif DN_NEON
    // 8 values a step, two vectors from one load (neon_load, neon_half): D and Dv multiples of 8 (VECTOR_DIMS)
    static constexpr int STEP = 2;
    using Raw = typename NeonRaw<KIND>::type;
    static Raw raw_at(const void* row, int64_t d) { return neon_load<KIND>(row, d); }
    static vec from_raw(const Raw& x, int h, bool nan) { return neon_half<KIND>(x, h, nan); }
#endif
    static constexpr int64_t elem_size() { return kind_bytes(KIND); }

    // Where key (value) j of this item's sequence and head starts in an unpaged [S, D] (a paged cache's rows come
    // from block_rows' walk of the pages).
    const char* key_row(int64_t j) const { return (const char*)kb + elem_size() * j * o.ks[2]; }
    const char* value_row(int64_t j) const { return (const char*)vb + elem_size() * j * o.vs[2]; }

    // The rows of keys j0 .. j0 + n - 1 and their scales (kunit, vscale), and the next block's rows to ask for while
    // this block computes (ask_next; its first block asks for its own rows at once). A paged pool is walked a run of
    // keys in one page at a time (one address per run, no division per key). Every layout asks, 2 MiB pages too:
    // with the requests spread over the scores' steps, rows on 2 MiB pages took 0.92-0.97x the time of leaving them
    // to the hardware prefetcher (AVX-512 + AMX Xeon VM, B 1 S 32k and B 8 S 8k, fp32 / bf16 / fp16, 1 and 2 threads).
    // Asked for all at once at the block's start they had taken 1.15-1.2x (49-51 ns per key and head against 58-61).
    void block_rows(int64_t j0, int n) {
        if (!table) {
            for (int jj = 0; jj < n; ++jj) krows[jj] = key_row(j0 + jj), vrows[jj] = value_row(j0 + jj);
            fill_units(kunit, ksc ? ksc + j0 * o.kss[2] : nullptr, o.kss[2], n, o.k_unit);
            if (vscale_needed()) fill_units(vscale, vsc ? vsc + j0 * o.vss[2] : nullptr, o.vss[2], n, o.v_unit);
        } else {
            page_rows(j0, n, krows, vrows, true);
        }
        if (j0 == part.j0 && !first_asked) {  // the first block, asked for by no item before
            for (int jj = 0; jj < n; ++jj) prefetch_row(krows[jj], o.D);
            if (!o.shared)
                for (int jj = 0; jj < n; ++jj) prefetch_row(vrows[jj], o.Dv);
        }
        if (group_asks) {
            asked = 0, ahead_rows = group_rows;
            return;
        }
        const int64_t stop = table ? end : seq_end;
        int ahead = (int)std::max<int64_t>(0, std::min<int64_t>(stop, j0 + n + BLOCK) - (j0 + n));
        rows_to_ask(j0 + n, ahead, ahead_k, ahead_v);
        if (ahead == 0 && successor)  // this item's last block: the next item's first
            ahead = successor->first_block_rows(ahead_k, ahead_v);
        asked = 0, ahead_rows = ahead;  // (asked for by the scores' passes: for_row_groups)
    }

    // The rows of keys j0 .. j0 + n - 1 into k / v to be asked for ahead, their scales asked for (a contiguous
    // cache's) or noted for read_next_scales (a paged pool's: page_rows)
    void rows_to_ask(int64_t j0, int n, const char** k, const char** v) {
        if (table) {
            page_rows(j0, n, k, v, false);
            return;
        }
        for (int jj = 0; jj < n; ++jj) k[jj] = key_row(j0 + jj), v[jj] = value_row(j0 + jj);
        if (ksc) each_scale_line(ksc + j0 * o.kss[2], n, o.kss[2], [](const float* x) { __builtin_prefetch(x, 0, 3); });
        if (vsc && !o.shared)
            each_scale_line(vsc + j0 * o.vss[2], n, o.vss[2], [](const float* x) { __builtin_prefetch(x, 0, 3); });
    }

    // The rows of this item's first block into k / v for the item before it to ask for (block_rows); how many. Each
    // item's first block had been asked for only as it began (AVX-512 Zen 4 VM, one thread, B 8 S 8k, shuffled pages
    // of 16: work items of 8k keys instead of 2k took 0.95x the time in bf16, 0.97x in int8).
    int first_block_rows(const char** k, const char** v) {
        const int n = (int)std::max<int64_t>(0, std::min<int64_t>(BLOCK, end - part.j0));
        rows_to_ask(part.j0, n, k, v);
        first_asked = n > 0;
        return n;
    }

    // The next block's rows asked for (rows ahead_k / ahead_v, from block_rows). The scores' passes and the value
    // pass's tiles ask a share at each step of keys (ask_next; for_row_groups), so the requests do not all wait for
    // fill buffers at the block's start while the arithmetic stalls (measured on an AVX-512 + AMX Xeon VM, one
    // thread: a 16-node tree's 64 rows over S 4k, fp32, had 57% of the kernel's non-arithmetic time on those
    // requests), nor leave the memory idle while the value pass runs.
    int asked = 0, ahead_rows = 0, ask_step = 0;
    int64_t ask_rate = 0;           // rows per step, in 1/65536ths (no division per step)
    bool pass_asks = false;         // the current rows pass asks (for_row_groups)
    bool values_ask = false;        // and its value tiles too, every ask_mask + 1 keys (decided once: the constructor)
    int ask_mask = 3;
    void ask_next() { ask_upto((int)std::min<int64_t>(ahead_rows, (++ask_step * ask_rate) >> 16)); }
    void ask_upto(int upto) {
        for (; asked < upto; ++asked) {  // into L2 (T1): 0.96-0.99x the time of T0 for a decode's 4 rows, paged or not
            prefetch_row<2>(ahead_k[asked], o.D);
            if (!o.shared) prefetch_row<2>(ahead_v[asked], o.Dv);
        }
    }

    // Rows of keys j0 .. j0 + n - 1 of a paged pool into kout / vout, a run of keys in one page at a time; with
    // `scales` their dequantisation factors into kunit / vscale, else their scales' runs noted for read_next_scales
    // (the next block's).
    void page_rows(int64_t j0, int n, const char** kout, const char** vout, bool scales) {
        if (!scales) scale_runs_read = scale_run_count = 0;
        int64_t index = j0 / o.page_size, slot = j0 % o.page_size;
        // Pages of one key whose numbers follow on (a packed cache read as pages of one token: transformers'
        // continuous batching through engine.integrations.transformers) are one run, a page stride apart, where
        // each key had been a run of its own (one layer, 32 requests of 256-768 keys: 0.75x the time on one thread,
        // 0.77x on two; bitwise the same); not for scaled pools, whose runs read_next_scales walks a slot stride apart
        const bool follow_on = o.page_size == 1 && !ksc && !vsc;
        const int64_t k_step = follow_on ? o.ks[0] : o.ks[1], v_step = follow_on ? o.vs[0] : o.vs[1];
        for (int jj = 0; jj < n; ++index, slot = 0) {
            const int64_t page = table[index];
            int64_t run = std::min<int64_t>(o.page_size - slot, n - jj);
            if (follow_on) {
                while (jj + run < n && table[index + run] == page + run) ++run;
                index += run - 1;
            }
            const char* kp = (const char*)o.k + elem_size() * (page * o.ks[0] + slot * o.ks[1] + head * o.ks[2]);
            const char* vp = (const char*)o.v + elem_size() * (page * o.vs[0] + slot * o.vs[1] + head * o.vs[2]);
            const float* kq = ksc ? ksc + page * o.kss[0] + slot * o.kss[1] + head * o.kss[2] : nullptr;
            const float* vq = vsc ? vsc + page * o.vss[0] + slot * o.vss[1] + head * o.vss[2] : nullptr;
            if (!scales && (kq || vq)) scale_runs[scale_run_count++] = {kq, vq, run};
            if (scales && run >= 16) {  // a run of 16 or more: its scales in a loop of their own (fill_units; pages
                                        // of 256, int8, one thread from DRAM: 0.98x the time; pages of 16, since
                                        // read_next_scales: int8 0.94-0.98x in cache, 0.96-0.99x from DRAM, fp8
                                        // 0.97-0.98x, NHD 0.99x; shorter runs stay as below)
                for (int64_t r = 0; r < run; ++r)
                    kout[jj + r] = kp + elem_size() * r * k_step, vout[jj + r] = vp + elem_size() * r * v_step;
                fill_units(kunit + jj, kq, o.kss[1], (int)run, o.k_unit);
                if (vscale_needed()) fill_units(vscale + jj, vq, o.vss[1], (int)run, o.v_unit);
                jj += (int)run;
                continue;
            }
            for (int64_t r = 0; r < run; ++r, ++jj) {
                kout[jj] = kp + elem_size() * r * k_step;
                vout[jj] = vp + elem_size() * r * v_step;
                if (!scales) continue;
                kunit[jj] = o.k_unit * (kq ? kq[r * o.kss[1]] : 1.0f);
                if (vscale_needed()) vscale[jj] = o.v_unit * (vq ? vq[r * o.vss[1]] : 1.0f);
            }
        }
    }
    bool vscale_needed() const { return vsc || o.v_unit != 1.0f; }

    // A paged pool's scales of the next block (page_rows' runs), read a line at a time by plain loads halfway through
    // this block (after its softmax step): asked for by prefetches as its rows are, they were still missing when the
    // block came, and their loads took 15% of an int8 decode's time over pages of 16 (a build reading no scales took
    // 0.84-0.86x the time); read this way, 0.91-0.92x (AVX-512 Zen 4 VM, one thread, B 8 S 8k, Hkv 8, shuffled pages).
    struct ScaleRun {  // (o.kss[1] / o.vss[1] apart: a pool's slots)
        const float *k, *v;
        int64_t count;
    };
    ScaleRun scale_runs[BLOCK];
    int scale_run_count = 0, scale_runs_read = 0;
    void read_next_scales() {
        if (successor && successor->first_asked) successor->read_next_scales();  // (its first block's)
        float sum = 0.0f;
        const auto read = [&sum](const float* x) { sum += *x; };
        for (; scale_runs_read < scale_run_count; ++scale_runs_read) {
            const ScaleRun& run = scale_runs[scale_runs_read];
            if (run.k) each_scale_line(run.k, run.count, o.kss[1], read);
            if (run.v && !o.shared) each_scale_line(run.v, run.count, o.vss[1], read);
        }
        scale_sink = sum;
    }
    volatile float scale_sink = 0.0f;

    // dst[0 .. n) = unit * src[i * stride] (src null: unit), unit strides in a loop of their own that the compiler
    // vectorises: int8 / fp8 caches' contiguous scales, one thread from DRAM, 0.96x / 0.98x the time of the per-key
    // loop (AVX2 build: int8 0.97x); a paged pool's runs of 16 or more too (page_rows)
    static void fill_units(float* dst, const float* src, int64_t stride, int n, float unit) {
        if (!src) {
            for (int i = 0; i < n; ++i) dst[i] = unit;
        } else if (stride == 1) {
            for (int i = 0; i < n; ++i) dst[i] = unit * src[i];
        } else {
            for (int i = 0; i < n; ++i) dst[i] = unit * src[i * stride];
        }
    }

    // f(scale) for one scale in each cache line a run of `count` per-key scales `stride` floats apart touches, and the
    // last: to ask for them (a contiguous cache's) or read them (read_next_scales)
    template <class F>
    static void each_scale_line(const float* first, int64_t count, int64_t stride, F&& f) {
        if (count <= 0) return;
        const int64_t step = std::max<int64_t>(1, 16 / std::max<int64_t>(1, stride));
        for (int64_t r = 0; r < count; r += step) f(first + r * stride);
        f(first + (count - 1) * stride);
    }
    template <int LOCALITY = 3>  // __builtin_prefetch's: 3 T0 (into L1), 2 T1 (L2)
    static void prefetch_row(const char* row, int64_t width) {
        for (int64_t b = 0; b < elem_size() * width; b += 64) __builtin_prefetch(row + b, 0, LOCALITY);
    }
    // fp32 rows are also asked for into L1 NEAR keys ahead of the pass reading them (K's by the scores' passes, each
    // value tile's channels by the tile), on top of the next block's asks into L2 (AVX-512 only). AVX-512 Zen 4 VM,
    // one thread, fp32 from DRAM (B 1, S 32k): 4 rows a KV head 0.90-0.93x the time, 1 row 0.86x; 4, 12 or 16 keys
    // ahead, or 16 for V: 0.95-0.98x; in cache (S 1k) 1.04x. Not for bf16 / fp16 / int8 rows (half or a quarter of
    // fp32's bytes: 0.99-1.06x), nor the AVX2 build (1.04-1.06x), nor calls of under 8 MiB of K/V, which likely
    // come from cache (the 135M model's small call: 1.01x). docs/BENCHMARKS.md, round 11.
    static constexpr int NEAR = 8;
    const bool near_asks = KIND == F32 && W_ == 16 && o.B * o.H * o.S * (o.D + o.Dv) * 4 >= (int64_t(8) << 20);

    // s[r][jj] = q[r] . k[j0 + jj] * key scale, rows r0 .. r0 + N; two keys per pass (2N independent sums)
    template <int N>
    void scores_rows(int64_t r0, int64_t j0, int n) {
        const int64_t D = o.D;
        const bool nan = nan_codes;
        int jj = 0;
        if constexpr (SIMD) {
#if DN_AVX512 || DN_NEON
            // four keys per pass where 32 registers hold the 16 sums (AVX-512's, NEON's): a q vector loaded serves
            // 4 keys (many rows, as a shared prefix's pass has, are bound by these loads, not by memory). 2 or 3 rows
            // too: their sums in one transposed reduction (store_sums) cost less than hsum1's one by one (AVX-512 Zen
            // 4 VM, one thread: 3 rows of D 64 over 128 keys in cache 0.88x the time; from DRAM, D 128, 2 / 3 rows
            // 0.90-0.97x)
            if constexpr (N >= 2) {
#if DN_BF16_DOT
                // q and K as bf16: 32 channels of a row and a key in one vdpbf16ps (each lane sums two products)
                if (N == 4 && (KIND == BF16_PAIRS || KIND == I8 || KIND == F8E4M3 || KIND == F8_WORDS) && qh)
                    for (; jj + 4 <= n; jj += 4) {
                        __m512i x[4][WORDS];
                        vec a[4][4];  // [key][row]
                        for (int k = 0; k < 4; ++k)
                            for (int r = 0; r < 4; ++r) a[k][r] = vzero();
                        for (int64_t d = 0; d < D; d += 32 * WORDS) {
                            for (int k = 0; k < 4; ++k) {
                                bf16_keys(krows[jj + k], d, nan, x[k]);
                                for (int w = 0; w < WORDS; ++w) DN_IN_REGISTER(x[k][w]);
                            }
                            for (int w = 0; w < WORDS; ++w)
                                for (int r = 0; r < N; ++r) {
                                    __m512i qv = _mm512_loadu_si512((const void*)(qh + (r0 + r) * D + d + 32 * w));
                                    DN_IN_REGISTER(qv);
                                    for (int k = 0; k < 4; ++k)
                                        a[k][r] = _mm512_dpbf16_ps(a[k][r], (__m512bh)qv, (__m512bh)x[k][w]);
                                }
                        }
                        if (pass_asks) ask_next();
                        store_sums<N>(a, r0, jj);
                    }
#endif
                for (; jj + 4 <= n; jj += 4) {
                    const void* kr[4] = {krows[jj], krows[jj + 1], krows[jj + 2], krows[jj + 3]};
                    if (near_asks && jj + NEAR + 4 <= n)
                        for (int k = NEAR; k < NEAR + 4; ++k) prefetch_row(krows[jj + k], D);
                    vec a[4][4];  // [key][row] (rows N .. 3 stay 0)
                    for (int k = 0; k < 4; ++k)
                        for (int r = 0; r < 4; ++r) a[k][r] = vzero();
                    for (int64_t d = 0; d < D; d += STEP * W) {
                        Raw raw[4];
                        for (int k = 0; k < 4; ++k) raw[k] = raw_at(kr[k], d);
                        for (int h = 0; h < STEP; ++h) {
                            vec x[4];
                            for (int k = 0; k < 4; ++k) {
                                x[k] = from_raw(raw[k], h, nan);
                                DN_IN_REGISTER(x[k]);
                            }
                            for (int r = 0; r < N; ++r) {
                                vec qv = vloadf(qb + (r0 + r) * D + d + h * W);
                                DN_IN_REGISTER(qv);
                                for (int k = 0; k < 4; ++k) a[k][r] = vfma(qv, x[k], a[k][r]);
                            }
                        }
                    }
                    if (pass_asks) {
                        ask_next();
                        if constexpr (N < 4) ask_next();  // (fewer rows: asks as often as the two-key pass)
                    }
                    store_sums<N>(a, r0, jj);
                }
            }
#endif
#if DN_VECTORS
            for (; jj + 2 <= n; jj += 2) {
                const void* k0 = krows[jj];
                const void* k1 = krows[jj + 1];
                if (near_asks && jj + NEAR + 2 <= n)
                    prefetch_row(krows[jj + NEAR], D), prefetch_row(krows[jj + NEAR + 1], D);
                vec a0[N], a1[N];
                for (int r = 0; r < N; ++r) a0[r] = a1[r] = vzero();
                for (int64_t d = 0; d < D; d += STEP * W) {
                    const Raw raw0 = raw_at(k0, d), raw1 = raw_at(k1, d);
                    for (int h = 0; h < STEP; ++h) {
                        vec x0 = from_raw(raw0, h, nan), x1 = from_raw(raw1, h, nan);
                        DN_IN_REGISTER(x0);
                        DN_IN_REGISTER(x1);
                        for (int r = 0; r < N; ++r) {
                            vec qv = vloadf(qb + (r0 + r) * D + d + h * W);
                            DN_IN_REGISTER(qv);
                            if constexpr (N == NR) DN_IN_YMM(qv);
                            a0[r] = vfma(qv, x0, a0[r]);
                            a1[r] = vfma(qv, x1, a1[r]);
                        }
                    }
                }
                if (pass_asks) ask_next();
                const float u0 = kunit[jj], u1 = kunit[jj + 1];
                if constexpr (N == 4) {
                    float sums[8];
                    hsum8(a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3], sums);
                    for (int r = 0; r < N; ++r) {
                        s[(r0 + r) * BLOCK + jj] = sums[r] * u0;
                        s[(r0 + r) * BLOCK + jj + 1] = sums[4 + r] * u1;
                    }
                } else {
                    for (int r = 0; r < N; ++r) {
                        s[(r0 + r) * BLOCK + jj] = hsum1(a0[r]) * u0;
                        s[(r0 + r) * BLOCK + jj + 1] = hsum1(a1[r]) * u1;
                    }
                }
            }
            for (; jj < n; ++jj) {
                const void* k0 = krows[jj];
                vec a0[N];
                for (int r = 0; r < N; ++r) a0[r] = vzero();
                for (int64_t d = 0; d < D; d += STEP * W) {
                    const Raw raw0 = raw_at(k0, d);
                    for (int h = 0; h < STEP; ++h) {
                        const vec x0 = from_raw(raw0, h, nan);
                        for (int r = 0; r < N; ++r) a0[r] = vfma(vloadf(qb + (r0 + r) * D + d + h * W), x0, a0[r]);
                    }
                }
                const float u0 = kunit[jj];
                for (int r = 0; r < N; ++r) s[(r0 + r) * BLOCK + jj] = hsum1(a0[r]) * u0;
            }
#endif
        } else {
            scores_lanes<N>(r0, n);
        }
    }

    // the plain path's scores: one key at a time, its channels in one loop for all N rows (fp8's NaN codes masked
    // where the block's rows hold one: load_lane)
    template <int N>
    void scores_lanes(int64_t r0, int n) {
        if constexpr (KIND == F8E4M3)  // (the other kinds' one loop: load_lane is load_scalar either way)
            if (!nan_codes) return scores_lanes<N, false>(r0, n);
        scores_lanes<N, true>(r0, n);
    }
    template <int N, bool CODES>
    void scores_lanes(int64_t r0, int n) {
        const int64_t D = o.D;
        const float* q = qb + r0 * D;
        for (int jj = 0; jj < n; ++jj) {
            const void* krow = krows[jj];
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t d = 0; d < D; ++d) {
                const float x = load_lane<KIND, CODES>(krow, d);
                a0 = lane_fma(q[d], x, a0);
                if constexpr (N > 1) a1 = lane_fma(q[D + d], x, a1);
                if constexpr (N > 2) a2 = lane_fma(q[2 * D + d], x, a2);
                if constexpr (N > 3) a3 = lane_fma(q[3 * D + d], x, a3);
            }
            if (pass_asks) ask_next();
            const float dots[4] = {a0, a1, a2, a3};
            for (int r = 0; r < N; ++r) s[(r0 + r) * BLOCK + jj] = dots[r] * kunit[jj];
        }
    }

#if DN_BF16_DOT
    // K's channels d .. d + 32 WORDS - 1 as WORDS vectors of bf16: bf16 as stored; int8 / fp8 widened to fp32 (exact)
    // and packed; F8_WORDS' two vectors of words (e4m3_words)
    static constexpr int WORDS = KIND == F8_WORDS ? 2 : 1;
    static void bf16_keys(const void* row, int64_t d, bool nan, __m512i (&x)[WORDS]) {
        if constexpr (KIND == BF16_PAIRS) {
            x[0] = _mm512_loadu_si512((const void*)((const uint16_t*)row + d));
        } else if constexpr (WORDS == 2) {
            const Raw words = raw_at(row, d);
            x[0] = words.w0, x[WORDS - 1] = words.w1;
        } else {
            const vec lo = load(row, d, nan), hi = load(row, d + 16, nan);
            x[0] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
    }
#endif
#if DN_NEON
    // the four-key pass's [key][row] sums into s, times each key's scale: a row's four keys in one vector (sums4)
    template <int N>
    void store_sums(const vec (&a)[4][4], int64_t r0, int jj) {
        const vec units = vld1q_f32(&kunit[jj]);
        for (int r = 0; r < N; ++r)
            vst1q_f32(&s[(r0 + r) * BLOCK + jj], vmulq_f32(sums4(a[0][r], a[1][r], a[2][r], a[3][r]), units));
    }
#endif
#if DN_AVX512
    // the four-key pass's [key][row] sums into s, times each key's scale, N rows of four keys stored at once
    template <int N>
    void store_sums(const __m512 (&a)[4][4], int64_t r0, int jj) {
        const __m512 units = _mm512_broadcast_f32x4(_mm_loadu_ps(&kunit[jj]));
        const __m512 scaled = _mm512_mul_ps(hsum16_rows(a), units);
        float* row = &s[r0 * BLOCK + jj];  // (the lane index must be a constant: no loop over r)
        _mm_storeu_ps(row, _mm512_castps512_ps128(scaled));
        if constexpr (N > 1) _mm_storeu_ps(row + BLOCK, _mm512_extractf32x4_ps(scaled, 1));
        if constexpr (N > 2) _mm_storeu_ps(row + 2 * BLOCK, _mm512_extractf32x4_ps(scaled, 2));
        if constexpr (N > 3) _mm_storeu_ps(row + 3 * BLOCK, _mm512_extractf32x4_ps(scaled, 3));
    }
#endif

    // vectors of Dv per row in registers: 4 with AVX-512's or NEON's 32 registers, 2 with AVX2's 16
    static constexpr int TILE = FOUR_KEYS ? 4 : 2;

    // the score tiles' unit kept awake between the value passes' register tiles (score_tiles_step)
    DN_INLINE void awake_between_tiles() {
#if DN_AMX_BF16
        if constexpr (ON_TILES)
            if (scores_only) tiles_awake();
#endif
    }

    // acc[r] += p[r][jj] * v[j0 + jj] for rows r0 .. r0 + N (p already holds the value scale; keep masks it)
    template <int N, bool MASKED>
    void accumulate_rows(int64_t r0, int64_t j0, int n) {
        if constexpr (SIMD) {
            // (BF16_PAIRS: Dv / W is even, so every tile is TILE's 2 vectors, a pair from one load)
            const int64_t vectors = o.Dv / W_;
            // One register tile over all the block's keys, then the next: the rows were asked for ahead (block_rows),
            // so they come from cache, and each tile's accumulators are loaded and stored once a block. (Chunks of
            // 4 KiB of V rows, every tile of each, were for rows left to the hardware prefetcher; with the rows asked
            // for, whole blocks took 0.95-0.975x their time for a decode's 4 rows, and a latent's 16 rows of Dv 512
            // had 4 keys a chunk.)
            int64_t t0 = 0;
            if (pass_asks && values_ask)  // (its tiles ask for the next block's rows: for_row_groups)
                for (; t0 + TILE <= vectors; t0 += TILE) {
                    accumulate_tile<N, MASKED, TILE, true>(r0, n, t0 * W_);
                    awake_between_tiles();
                }
            for (; t0 + TILE <= vectors; t0 += TILE) {
                accumulate_tile<N, MASKED, TILE>(r0, n, t0 * W_);
                awake_between_tiles();
            }
            switch (vectors - t0) {
                case 3: accumulate_tile<N, MASKED, 3>(r0, n, t0 * W_); break;
                case 2: accumulate_tile<N, MASKED, 2>(r0, n, t0 * W_); break;
                case 1: accumulate_tile<N, MASKED, 1>(r0, n, t0 * W_); break;
                default: break;
            }
        } else {
            accumulate_lanes<N, MASKED>(r0, n);
        }
    }

    // the plain path's values: four keys at a time into each row's output, channel by channel (a block every row sees
    // whole); else a key at a time, each row that sees it (a hidden key's value may be NaN)
    template <int N, bool MASKED>
    void accumulate_lanes(int64_t r0, int n) {
        if constexpr (KIND == F8E4M3)
            if (!nan_codes) return accumulate_lanes<N, MASKED, false>(r0, n);
        accumulate_lanes<N, MASKED, true>(r0, n);
    }
    template <int N, bool MASKED, bool CODES>
    void accumulate_lanes(int64_t r0, int n) {
        const int64_t Dv = o.Dv;
        float* acc = part.acc + r0 * Dv;
        const float* p = s + r0 * BLOCK;
        int jj = 0;
        if constexpr (!MASKED)
            for (; jj + 4 <= n; jj += 4) {
                const void *v0 = vrows[jj], *v1 = vrows[jj + 1], *v2 = vrows[jj + 2], *v3 = vrows[jj + 3];
                float w[N][4];
                for (int r = 0; r < N; ++r)
                    for (int k = 0; k < 4; ++k) w[r][k] = p[r * BLOCK + jj + k];
#pragma omp simd
                for (int64_t d = 0; d < Dv; ++d) {
                    const float x0 = load_lane<KIND, CODES>(v0, d), x1 = load_lane<KIND, CODES>(v1, d);
                    const float x2 = load_lane<KIND, CODES>(v2, d), x3 = load_lane<KIND, CODES>(v3, d);
                    for (int r = 0; r < N; ++r)
                        acc[r * Dv + d] = lane_fma(w[r][3], x3, lane_fma(w[r][2], x2, lane_fma(w[r][1], x1,
                                                   lane_fma(w[r][0], x0, acc[r * Dv + d]))));
                }
            }
        for (; jj < n; ++jj) {
            if (MASKED && !seen_key[jj]) continue;
            const void* vrow = vrows[jj];
            for (int r = 0; r < N; ++r) {
                if (MASKED && !_bits(keep[(r0 + r) * BLOCK + jj])) continue;
                const float w = p[r * BLOCK + jj];
                float* a = acc + r * Dv;
#pragma omp simd
                for (int64_t d = 0; d < Dv; ++d) a[d] = lane_fma(w, load_lane<KIND, CODES>(vrow, d), a[d]);
            }
        }
    }

    // the register tile: channels d0 .. d0 + TILES * W of N rows, over the block's keys (ASK: a share of the next
    // block's rows asked for every ask_mask + 1 keys)
    template <int N, bool MASKED, int TILES, bool ASK = false>
    void accumulate_tile(int64_t r0, int n, int64_t d0) {
#if DN_VECTORS
        const int64_t Dv = o.Dv;
        const bool nan = nan_codes;
        float* acc = part.acc;
        vec a[N][TILES];
        for (int r = 0; r < N; ++r)
            for (int t = 0; t < TILES; ++t) a[r][t] = vmul(vloadf(acc + (r0 + r) * Dv + d0 + t * W), vset(kept[r0 + r]));
        for (int jj = 0; jj < n; ++jj) {
            if (ASK && (jj & ask_mask) == ask_mask) ask_next();
            if (near_asks && jj + NEAR < n)  // (this tile's channels of the row NEAR keys on)
                prefetch_row((const char*)vrows[jj + NEAR] + elem_size() * d0, TILES * W);
            if (MASKED && !seen_key[jj]) continue;
            const void* vrow = vrows[jj];
            vec vv[TILES];
            for (int t = 0; t < TILES; t += STEP) {
                const Raw raw = raw_at(vrow, d0 + t * W);
                for (int h = 0; h < STEP && t + h < TILES; ++h) vv[t + h] = from_raw(raw, h, nan);
            }
            for (int r = 0; r < N; ++r) {
                const vec p = vset(s[(r0 + r) * BLOCK + jj]);
                if (MASKED) {  // a hidden key adds 0 * 0 (its value may be NaN); a seen one the unmasked FMA
                    const vec m = vset(keep[(r0 + r) * BLOCK + jj]), pm = vand(p, m);
                    for (int t = 0; t < TILES; ++t) a[r][t] = vfma(pm, vand(vv[t], m), a[r][t]);
                } else {
                    for (int t = 0; t < TILES; ++t) a[r][t] = vfma(p, vv[t], a[r][t]);
                }
            }
        }
        for (int r = 0; r < N; ++r)
            for (int t = 0; t < TILES; ++t) vstore(acc + (r0 + r) * Dv + d0 + t * W, a[r][t]);
#endif
    }

#if DN_AVX512
    static vec _add(vec a, vec b) { return _mm512_add_ps(a, b); }
#elif DN_AVX2
    static vec _add(vec a, vec b) { return _mm256_add_ps(a, b); }
#elif DN_NEON
    static vec _add(vec a, vec b) { return vaddq_f32(a, b); }
#endif

    template <int N>
    void rows_pass(int64_t r0, int64_t j0, int n, bool masked, bool scores) {
        if (scores) {
            scores_rows<N>(r0, j0, n);
        } else if (masked) {
            accumulate_rows<N, true>(r0, j0, n);
        } else {
            accumulate_rows<N, false>(r0, j0, n);
        }
    }

    void for_row_groups(int64_t j0, int n, bool masked, bool scores) {
        int64_t r0 = 0;
        // The next block's rows are asked for a share at a time through the passes' scores and value tiles, one share
        // per step of keys: the full passes', or with fewer rows than one pass, the one pass's (the rest after the
        // asking value passes; the portable C++ path's scores ask a share per key, its values none). One thread,
        // against asking at the start of each pass: trees of 64 rows, latents of 16 and 128 rows, top-k prefill of 16:
        // 0.84-0.99x the time; a decode's 4 rows (G 4): 0.74-0.89x, paged or contiguous, fp32 / bf16 / int8. The value
        // tiles asking too, against the scores alone (from DRAM, one thread, B 1 S 32k and B 8 S 8k, contiguous or
        // pages of 16 or 256): fp32 / bf16 / fp16 0.89-0.91, int8 0.95, fp8 0.99, one row a KV head (MHA) 0.81, many
        // rows (trees, latents) 1.00 (one tile alone asking: fp32 and bf16 0.92, int8 1.0; every 2 keys: 1.03; every
        // tile of a many-row call, or on AVX2 every 4 keys: 1.02-1.06). docs/BENCHMARKS.md, round 8.
        const int64_t rest = o.R % NR;
        const int passes = (int)(o.R / NR), asking_passes = passes > 0 ? passes : rest > 0;
        // (scores_rows' passes: the portable path's one key each)
        const int scores_steps = !SIMD ? n : FOUR_KEYS && passes > 0 ? n / 4 + n % 4 / 2 : n / 2;
        if (scores) {
            const int values_steps = values_ask ? n / (ask_mask + 1) * (int)(o.Dv / W_ / TILE) : 0;
            const int steps = asking_passes * scores_steps + values_steps + 1;
            ask_step = 0, ask_rate = ((int64_t)ahead_rows << 16) / steps;
        }
        const bool asking = asking_passes > 0, finish = scores != asking;
        pass_asks = asking;
        for (; r0 + NR <= o.R; r0 += NR) rows_pass<NR>(r0, j0, n, masked, scores);
        if (finish && (passes > 0 || !asking)) ask_upto(ahead_rows);
        pass_asks = asking && passes == 0;
        switch (rest) {
            case 3: rows_pass<3>(r0, j0, n, masked, scores); break;
            case 2: rows_pass<2>(r0, j0, n, masked, scores); break;
            case 1: rows_pass<1>(r0, j0, n, masked, scores); break;
            default: break;
        }
        if (finish && passes == 0 && asking) ask_upto(ahead_rows);
    }

    // Which keys of the block each row sees (keep, seen_key): NONE when no row sees any, ALL when every row sees
    // every one (the block then runs unmasked, bitwise the same: a tree's cached keys, a mask of mostly ones), else
    // SOME. The ALL check reads a row's bytes in vectors before any per-key mask is built.
    enum Seen { NONE, SOME, ALL };
    bool uniform = false;           // (block_visibility, SOME) every row sees the same keys of the block
    Seen block_visibility(int64_t j0, int n) {
        if (o.vis[3] == 1) {
            bool all = true;
            const int64_t rows = o.vis[2] == 0 ? 1 : o.R;  // (one mask row broadcast to every query row)
            for (int64_t r = 0; r < rows && all; ++r) {
                const uint8_t* row = visb + r * o.vis[2] + j0;
                uint8_t zero = 0;
                for (int jj = 0; jj < n; ++jj) zero |= (uint8_t)(row[jj] == 0);
                all = zero == 0;
            }
            if (all) return ALL;
        }
        bool any = false;
        std::fill(seen_key, seen_key + n, 0);
        for (int64_t r = 0; r < o.R; ++r) {
            const uint8_t* row = visb + r * o.vis[2];
            for (int jj = 0; jj < n; ++jj) {
                const bool sees = row[(j0 + jj) * o.vis[3]] != 0;
                uint32_t bits = sees ? 0xFFFFFFFFu : 0u;
                std::memcpy(&keep[r * BLOCK + jj], &bits, 4);
                seen_key[jj] |= sees;
                any |= sees;
            }
        }
#if DN_AMX_BF16
        if constexpr (ON_TILES) {
            uniform = bf16_tiles && !scores_only;  // (the score tiles take any block)
            for (int64_t r = 0; r < o.R && uniform; ++r)
                for (int jj = 0; jj < n && uniform; ++jj) uniform = _bits(keep[r * BLOCK + jj]) == (seen_key[jj] != 0);
        }
#endif
        return any ? SOME : NONE;
    }

    // The max of a full block of scores, true when all are finite (else the caller takes the scalar loop).
    static bool finite_max(const float* sr, float& out) {
#if DN_AVX512
        __m512 m = _mm512_loadu_ps(sr);
        __mmask16 ok = 0xFFFF;
        for (int jj = 0; jj < BLOCK; jj += W) {
            const __m512 x = _mm512_loadu_ps(sr + jj);
            ok &= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_EQ_OQ);  // x - x = 0: finite
            m = _mm512_max_ps(m, x);
        }
        out = _mm512_reduce_max_ps(m);
        return ok == 0xFFFF;
#elif DN_AVX2
        __m256 m = _mm256_loadu_ps(sr), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (int jj = 0; jj < BLOCK; jj += W) {
            const __m256 x = _mm256_loadu_ps(sr + jj);
            ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_EQ_OQ));
            m = _mm256_max_ps(m, x);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        out = _mm_cvtss_f32(h);
        return _mm256_movemask_ps(ok) == 0xFF;
#elif DN_NEON
        vec m = vld1q_f32(sr);
        uint32x4_t ok = vdupq_n_u32(~0u);
        for (int jj = 0; jj < BLOCK; jj += W) {
            const vec x = vld1q_f32(sr + jj);
            ok = vandq_u32(ok, vceqq_f32(vsubq_f32(x, x), vdupq_n_f32(0.0f)));  // x - x = 0: finite
            m = vmaxq_f32(m, x);
        }
        out = vmaxvq_f32(m);
        return vminvq_u32(ok) == ~0u;
#else
        (void)sr;
        (void)out;
        return false;
#endif
    }

    void softmax_step(int64_t j0, int n, bool masked) {
        const int64_t R = o.R, Dv = o.Dv;
        // The exp and the sum run over the whole block in vectors (keys past n weigh 0), so a key's weight and a
        // row's sum do not depend on where the block ends (the sequence's end, padding, a work item's cut)
        for (int64_t r = 0; r < R; ++r) {
            float* sr = &s[r * BLOCK];
            if (o.softcap > 0.0f) {  // the scores capped before anything reads them
                const float cap = o.softcap;
#pragma omp simd
                for (int jj = 0; jj < BLOCK; ++jj) sr[jj] = capped(sr[jj], cap);
            }
            if (slopes) {  // ALiBi: - slope * |key_pos - query_pos|, as the torch kernels add it (keys past n: -inf below)
                const float slope = slopes[r / o.queries], at = qpos[r % o.queries];
                const float* kp = kpos + j0;
#pragma omp simd
                for (int jj = 0; jj < n; ++jj) sr[jj] += slope * -std::fabs(kp[jj] - at);
            }
            if (biasb) {  // a bias: its row (query head r / queries, query r % queries) from key j0 on
                const int64_t step = o.bias_strides[3];
                const float* br = biasb + (r / o.queries) * o.bias_strides[1] + (r % o.queries) * o.bias_strides[2] +
                                  j0 * step;
                if (step == 1) {
#pragma omp simd
                    for (int jj = 0; jj < n; ++jj) sr[jj] += br[jj];
                } else {
                    for (int jj = 0; jj < n; ++jj) sr[jj] += br[jj * step];
                }
            }
            for (int jj = n; jj < BLOCK; ++jj) sr[jj] = NEG_INF;
            float block_max = NEG_INF;
            if (!(SIMD && !masked && n == BLOCK && finite_max(sr, block_max))) {
                block_max = NEG_INF;
                for (int jj = 0; jj < n; ++jj) {
                    if (masked && !_bits(keep[r * BLOCK + jj])) {
                        sr[jj] = NEG_INF;
                        continue;
                    }
                    if (!std::isfinite(sr[jj])) {  // a visible non-finite key: the row is NaN, lse -inf
                        part.bad[r] = 1;
                        sr[jj] = NEG_INF;
                    }
                    block_max = std::max(block_max, sr[jj]);
                }
            }
            const float m_old = part.m[r];
            const float m_new = std::max(m_old, block_max);
            if (m_new == NEG_INF) {  // nothing seen yet: p = 0 (masked products are dropped by keep)
                for (int jj = 0; jj < n; ++jj) sr[jj] = 0.0f;
                kept[r] = 1.0f;
                continue;
            }
            const float alpha = m_new > m_old ? std::exp(m_old - m_new) : 1.0f;  // 0 when m_old = -inf
            float sum = 0.0f;
#if DN_VECTORS
            if (SIMD) {
                vec mv = vset(m_new);
                vec acc = vzero();
                for (int jj = 0; jj + W <= BLOCK; jj += W) {
                    vec p = vexp(_sub(vloadf(sr + jj), mv));
                    vstore(sr + jj, p);
                    acc = _add(acc, p);
                }
                sum = vsum(acc);
            }
#endif
            if (!SIMD) {  // (the whole block in one loop, as the vectors do)
#pragma omp simd reduction(+ : sum)
                for (int j = 0; j < BLOCK; ++j) {
                    sr[j] = exp_lane(sr[j] - m_new);
                    sum += sr[j];
                }
            }
            // acc stays normalised (the output so far, within max|v|: no overflow for values near the float
            // max): rescale it to the new sum and add this block's weights divided by that sum
            const float l_old = part.l[r] * alpha, l_new = l_old + sum;  // l_new >= 1: the max's own weight
            const float keep_old = l_old / l_new, inv = 1.0f / l_new;
            part.l[r] = l_new;
            part.m[r] = m_new;
            if (rescale_in_tiles) {
                kept[r] = keep_old;
            } else if (keep_old != 1.0f) {
                float* a = &part.acc[r * Dv];
                for (int64_t d = 0; d < Dv; ++d) a[d] *= keep_old;
            }
            if (vsc || o.v_unit != 1.0f) {
                for (int jj2 = 0; jj2 < n; ++jj2) sr[jj2] *= vscale[jj2] * inv;
            } else {
                for (int jj2 = 0; jj2 < n; ++jj2) sr[jj2] *= inv;
            }
        }
    }

#if DN_AVX512
    static vec _sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
#elif DN_AVX2
    static vec _sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
#elif DN_NEON
    static vec _sub(vec a, vec b) { return vsubq_f32(a, b); }
#endif
    static bool _bits(float x) {
        uint32_t b;
        std::memcpy(&b, &x, 4);
        return b != 0;
    }

#if DN_AMX
    // int8 on AMX tiles (the section "int8 on AMX tiles" above): decided once per item, like the asks
    bool amx = false;
    // [D / 64][16][64]: q's digits as B tiles, a group of NR rows each (row 4 g + r's p: column 4 r + p), the first
    // group's here, the others' (R > NR) in more_digits: an item of 1-4 rows, as a decode's at G 4, stays as small
    // as before them (with room for four groups here, int8 from DRAM took 1.01x the time)
    alignas(64) int8_t q_digits[16 * AMX_MAX_D];
    std::vector<int8_t> more_digits;
    int8_t* digits_of(int64_t r) {  // (row r's group's)
        return r < NR ? q_digits : aligned64(more_digits.data()) + (r / NR - 1) * 16 * o.D;
    }
    float q_unit[AMX_ROWS] = {};    // 2^e of each row's fixed point
    int8_t* k_rows = nullptr;       // [4][16][D]: a group of 16 keys whose rows are not evenly spaced, or the last
    int8_t* v_tiles = nullptr;      // [Dv / 16][16][64]: the block's V rows as B tiles (4 keys' bytes a lane)
    int8_t* p_digits = nullptr;     // [16][64]: p's digits as an A tile (row 3 r + p), this thread's (the constructor)
    int8_t* more_p_digits = nullptr;  // [group - 1][16][64]: the next groups' (R > NR), this thread's too
    int8_t* p_digits_of(int64_t r) { return r < NR ? p_digits : more_p_digits + (r / NR - 1) * 1024; }
    int32_t (*sums)[16 * 16] = nullptr;  // [4][16 * 16]: the sums tiles, stored (this thread's too)

    // false where a row's largest |q| is below 2^-100 (fixed_point_unit)
    bool amx_digits() {  // (in vectors: per work item, this took 2 ns per key and head as scalar code)
        const int64_t D = o.D;
        if (o.R > NR) more_digits.resize((o.R - 1) / NR * 16 * D + 64);
        for (int64_t r0 = 0; r0 < o.R; r0 += NR)  // (a group of NR rows writes every byte of its tiles below)
            if (o.R - r0 < NR) std::memset(digits_of(r0), 0, 16 * D);
        for (int64_t r = 0; r < o.R; ++r) {
            const float* q = qb + r * D;
            int8_t* tiles = digits_of(r);
            const int64_t column = r % NR;
            __m512 top = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(q + d)));
            const float t = _mm512_reduce_max_ps(top);
            q_unit[r] = t > 0.0f ? fixed_point_unit<26>(t) : 1.0f;
            if (q_unit[r] == 0.0f) return false;
            const __m512 inv = _mm512_set1_ps(1.0f / q_unit[r]);
            for (int64_t d = 0; d < D; d += 16) {
                alignas(16) int8_t digit[4 * 16];
                digits4(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inv)), digit, 16);
                // channels d + 4 g .. + 3, digits 0 .. 3: 16 bytes at row (d % 64) / 4 + g of tile d / 64, from
                // column 4 * column (the digits' rows, 4 dwords each, transposed; bytes as the scalar loop placed)
                __m128 x[4];
                for (int q4 = 0; q4 < 4; ++q4) x[q4] = _mm_castsi128_ps(_mm_load_si128((const __m128i*)&digit[16 * q4]));
                _MM_TRANSPOSE4_PS(x[0], x[1], x[2], x[3]);
                for (int g = 0; g < 4; ++g)
                    _mm_storeu_ps((float*)&tiles[(d / 64) * 1024 + ((d % 64) / 4 + g) * 64 + 16 * column], x[g]);
            }
        }
        return true;
    }

    // the scores of the block's keys, 16 at a time: 16 key rows x 64 channels a TDPBSSD against q's digits; the
    // block's four groups each in its own sums tile, so their products overlap (tiles are not renamed), then their
    // sums read back, weighted, scaled and stored (s[r][jj]). This and amx_values are kept out of line: inlined into
    // the one function that runs an item's blocks (28 KiB of code), int8 from DRAM took 1.07x the time (B 8, S 16k,
    // one thread, contiguous; in cache the same), for no cause found without the CPU's counters (docs/BENCHMARKS.md,
    // round 17)
    __attribute__((noinline)) void amx_scores(int n) {
        const int64_t D = o.D;
        amx_q_tiles(0);
        const int groups = (n + 15) / 16;
        const char* bases[4];
        int64_t strides[4];
        for (int g = 0; g < groups; ++g) {
            const int jj = 16 * g, m = std::min(16, n - jj);
            const char* base = krows[jj];
            int64_t stride = m > 1 ? krows[jj + 1] - base : 0;
            bool even = m == 16 && stride > 0;
            for (int i = 2; even && i < 16; ++i) even = krows[jj + i] == base + i * stride;
            if (!even) {  // copied into 16 evenly spaced rows (a tile's rows are one stride apart)
                int8_t* rows = &k_rows[g * 16 * D];
                for (int i = 0; i < 16; ++i) {
                    if (i < m) std::memcpy(rows + i * D, krows[jj + i], D);
                    else std::memset(rows + i * D, 0, D);
                }
                base = (const char*)rows, stride = D;
            }
            amx_dot(g, bases[g] = base, strides[g] = stride);
        }
        amx_sums_to_scores(0, n);
        for (int64_t r0 = NR; r0 < o.R; r0 += NR) {  // (the next groups of rows: the same K rows again, from cache)
            amx_q_tiles(r0);
            for (int g = 0; g < groups; ++g) amx_dot(g, bases[g], strides[g]);
            amx_sums_to_scores(r0, n);
        }
    }
    // q's digits of rows r0 .. r0 + NR - 1 into tiles 2 and 3
    DN_INLINE void amx_q_tiles(int64_t r0) {
        const int8_t* tiles = digits_of(r0);
        _tile_loadd(2, tiles, 64);
        if (o.D > 64) _tile_loadd(3, tiles + 1024, 64);
    }
    // key group g's sums tile: its 16 rows (base, stride apart) . q's digits
    DN_INLINE void amx_dot(int g, const char* base, int64_t stride) {
        const int64_t D = o.D;
        switch (g) {  // (tile numbers are constants: the intrinsics name the registers)
            case 0: DN_AMX_DOT(0, base, stride, D); break;
            case 1: DN_AMX_DOT(4, base, stride, D); break;
            case 2: DN_AMX_DOT(5, base, stride, D); break;
            default: DN_AMX_DOT(6, base, stride, D); break;
        }
    }
    // the sums tiles read back, weighted, scaled and stored: rows r0 .. r0 + NR - 1 (those below R) of s
    DN_INLINE void amx_sums_to_scores(int64_t r0, int n) {
        const int64_t rows = std::min<int64_t>(NR, o.R - r0);
        const int groups = (n + 15) / 16;
        const float* u = q_unit + r0;
        const __m512 row_units = _mm512_setr_ps(u[0], u[0], u[0], u[0], u[1], u[1], u[1], u[1], u[2], u[2], u[2], u[2],
                                                u[3], u[3], u[3], u[3]);
        for (int g = 0; g < groups; ++g) {
            switch (g) {
                case 0: _tile_stored(0, sums[0], 64); break;
                case 1: _tile_stored(4, sums[1], 64); break;
                case 2: _tile_stored(5, sums[2], 64); break;
                default: _tile_stored(6, sums[3], 64); break;
            }
            const int jj = 16 * g, m = std::min(16, n - jj);
            for (int i = 0; i < m; i += 4) {  // lane 4 r + a: row r, key jj + i + a (keys past n: softmax_step's -inf)
                const __m512 units = _mm512_broadcast_f32x4(_mm_loadu_ps(&kunit[jj + i]));
                const __m512 scores = _mm512_mul_ps(_mm512_mul_ps(digit_sums(&sums[g][16 * i]), row_units), units);
                float* row = &s[r0 * BLOCK + jj + i];
                _mm_storeu_ps(row, _mm512_castps512_ps128(scores));
                if (rows > 1) _mm_storeu_ps(row + BLOCK, _mm512_extractf32x4_ps(scores, 1));
                if (rows > 2) _mm_storeu_ps(row + 2 * BLOCK, _mm512_extractf32x4_ps(scores, 2));
                if (rows > 3) _mm_storeu_ps(row + 3 * BLOCK, _mm512_extractf32x4_ps(scores, 3));
            }
            if (pass_asks && r0 == 0) ask_next();  // (the asks' shares: amx_step)
        }
    }
    // acc[r] += p[r] . V of the block (p: softmax_step's weights times the value scales), one TDPBUSD per 16 channels;
    // false (nothing added) when a visible weight is not finite or below 0 (a NaN / inf / negative value scale) or a
    // row's are all below 2^-100: the vector pass then adds them, NaN and all
    __attribute__((noinline)) bool amx_values(int n, bool masked) {
        const int64_t R = o.R, Dv = o.Dv, halves = Dv / 64;
        float p_unit[AMX_ROWS] = {};
        for (int64_t r0 = 0; r0 < R; r0 += NR) {  // (each group's tile: rows past its own 3 per row zero)
            const int64_t rows = std::min<int64_t>(NR, R - r0);
            std::memset(p_digits_of(r0) + 64 * 3 * rows, 0, 64 * (16 - 3 * rows));
        }
        for (int64_t r = 0; r < R; ++r) {
            __m512 x[4], top = _mm512_setzero_ps();
            __mmask16 fits = 0xFFFF;  // finite and >= 0 (a negative value scale: the vector path)
            for (int v = 0; v < 4; ++v) {
                x[v] = _mm512_maskz_loadu_ps(n >= 16 * (v + 1) ? 0xFFFF : n <= 16 * v ? 0 : (1u << (n - 16 * v)) - 1,
                                             &s[r * BLOCK + 16 * v]);  // (keys past n weigh 0)
                if (masked) x[v] = _mm512_and_ps(x[v], _mm512_loadu_ps(&keep[r * BLOCK + 16 * v]));
                fits &= _mm512_cmp_ps_mask(_mm512_sub_ps(x[v], x[v]), _mm512_setzero_ps(), _CMP_EQ_OQ) &
                        _mm512_cmp_ps_mask(x[v], _mm512_setzero_ps(), _CMP_GE_OQ);
                top = _mm512_max_ps(top, x[v]);
            }
            if (fits != 0xFFFF) return false;
            const float t = _mm512_reduce_max_ps(top);
            p_unit[r] = t > 0.0f ? fixed_point_unit<24>(t) : 1.0f;
            if (p_unit[r] == 0.0f) return false;
            const __m512 inv = _mm512_set1_ps(1.0f / p_unit[r]);
            for (int v = 0; v < 4; ++v) {  // three unsigned base-256 digits, rows 3 r .. 3 r + 2
                const __m512i x24 = _mm512_cvtps_epi32(_mm512_mul_ps(x[v], inv));
                int8_t* out = p_digits_of(r) + 3 * (r % NR) * 64 + 16 * v;
                _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(_mm512_srli_epi32(x24, 16)));
                _mm_storeu_si128((__m128i*)(out + 64), _mm512_cvtepi32_epi8(_mm512_srli_epi32(x24, 8)));
                _mm_storeu_si128((__m128i*)(out + 128), _mm512_cvtepi32_epi8(x24));
            }
        }
        amx_v_tiles(n);
        const bool one_group = R <= NR;  // (its digits loaded once; else each group's before its products)
        if (one_group) _tile_loadd(7, p_digits, 64);
        for (int64_t h = 0; h < halves; ++h)
            for (int64_t r0 = 0; r0 < R; r0 += NR) {
                if (!one_group) _tile_loadd(7, p_digits_of(r0), 64);
                amx_products(&v_tiles[4 * h * 1024]);
                _tile_stored(0, sums[0], 64);
                _tile_stored(4, sums[1], 64);
                _tile_stored(5, sums[2], 64);
                _tile_stored(6, sums[3], 64);
                if (pass_asks && r0 == 0) ask_next(), ask_next(), ask_next(), ask_next();
                amx_add_rows(r0, h, p_unit);
            }
        return true;
    }
    // acc of rows r0 .. r0 + NR - 1 (those below R), channels 64 h .. 64 h + 63, plus the sums tiles' digits weighted
    DN_INLINE void amx_add_rows(int64_t r0, int64_t h, const float* p_unit) {
        const int64_t Dv = o.Dv, R = std::min<int64_t>(o.R, r0 + NR);
        for (int64_t r = r0; r < R; ++r) {
            __m512 y[4];  // tile q's channels of row r: digits weighted and summed
            for (int q = 0; q < 4; ++q) {
                const int32_t* d = &sums[q][3 * (r - r0) * 16];
                const __m512 low = _mm512_cvtepi32_ps(_mm512_loadu_si512(d + 32));
                const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(d + 16)),
                                                   _mm512_set1_ps(256.0f), low);
                y[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(d)), _mm512_set1_ps(65536.0f), sum);
            }
            // 128-bit block L of tile q is channels 16 L + 4 q .. + 3: transposed, vector L is channels 16 L ..
            const __m512 t01 = _mm512_shuffle_f32x4(y[0], y[1], 0x44), t23 = _mm512_shuffle_f32x4(y[2], y[3], 0x44);
            const __m512 u01 = _mm512_shuffle_f32x4(y[0], y[1], 0xEE), u23 = _mm512_shuffle_f32x4(y[2], y[3], 0xEE);
            const __m512 z[4] = {_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD),
                                 _mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD)};
            float* acc = &part.acc[r * Dv + 64 * h];
            const __m512 unit = _mm512_set1_ps(p_unit[r]);
            for (int c = 0; c < 4; ++c)
                _mm512_storeu_ps(acc + 16 * c, _mm512_fmadd_ps(z[c], unit, _mm512_loadu_ps(acc + 16 * c)));
        }
    }

    // the four products of p's digits (tile 7, unsigned) with one 64-channel half's V tiles, each in its own sums tile
    static void amx_products(const int8_t* tiles) {
        _tile_zero(0);
        _tile_loadd(1, tiles, 64);
        _tile_dpbusd(0, 7, 1);
        _tile_zero(4);
        _tile_loadd(2, tiles + 1024, 64);
        _tile_dpbusd(4, 7, 2);
        _tile_zero(5);
        _tile_loadd(3, tiles + 2048, 64);
        _tile_dpbusd(5, 7, 3);
        _tile_zero(6);
        _tile_loadd(1, tiles + 3072, 64);
        _tile_dpbusd(6, 7, 1);
    }

    void amx_v_tiles(int n) {
        const int64_t halves = o.Dv / 64;
        // V rows to B tiles: 4 keys' rows interleaved bytewise, then by pairs: lane 4 L + i of tile (h, q) holds
        // channel 64 h + 16 L + 4 q + i of keys 4 g .. 4 g + 3 (row g)
        for (int g = 0; g < 16; ++g) {
            if (pass_asks) ask_next();
            if (g % 6 == 0) DN_AMX_AWAKE(0);  // (tile 0 is zeroed before its products: amx_products, DN_AMX_DOT)
            for (int64_t h = 0; h < halves; ++h) {
                __m512i v[4];
                for (int a = 0; a < 4; ++a)
                    v[a] = 4 * g + a < n ? _mm512_loadu_si512(vrows[4 * g + a] + 64 * h) : _mm512_setzero_si512();
                const __m512i lo01 = _mm512_unpacklo_epi8(v[0], v[1]), hi01 = _mm512_unpackhi_epi8(v[0], v[1]);
                const __m512i lo23 = _mm512_unpacklo_epi8(v[2], v[3]), hi23 = _mm512_unpackhi_epi8(v[2], v[3]);
                int8_t* tile = &v_tiles[(4 * h * 16 + g) * 64];
                _mm512_storeu_si512(tile, _mm512_unpacklo_epi16(lo01, lo23));
                _mm512_storeu_si512(tile + 1024, _mm512_unpackhi_epi16(lo01, lo23));
                _mm512_storeu_si512(tile + 2048, _mm512_unpacklo_epi16(hi01, hi23));
                _mm512_storeu_si512(tile + 3072, _mm512_unpackhi_epi16(hi01, hi23));
            }
        }
    }

    void amx_step(int64_t j0, int n, bool masked) {
        ask_step = 0;
        // a share of the next block's rows asked for at each of these steps: a group of scores, 4 keys' V rows to
        // tiles, a product of V; where fewer, larger shares (asking at the scores' groups and the products alone)
        // took 1.07x the time, more, smaller ones (every 4 keys' scores, or every 4 keys and 64 channels of V)
        // 1.07-1.12x, and all asked by 40-80% of the block 1.08-1.21x
        const int64_t steps = (n + 15) / 16 + 16 + o.Dv / 16 + 1;
        ask_rate = ((int64_t)ahead_rows << 16) / steps;
        pass_asks = true;
        amx_scores(n);
        softmax_step(j0, n, masked);
        read_next_scales();
        if (!amx_values(n, masked)) {
            pass_asks = false;
            ask_upto(ahead_rows);
            for_row_groups(j0, n, masked, false);
        }
        ask_upto(ahead_rows);
    }
#endif

#if DN_AMX_BF16
    // bf16 K/V on AMX tiles (the section "bf16 on AMX tiles, many rows" above), decided once a call (q_tiles); int8
    // and fp8 e4m3 K/V too, widened to bf16 exactly (int8's 8 bits, e4m3's 4), their scales applied as the vector
    // path's are (the scores times kunit, the weights times vscale)
    static constexpr bool ON_TILES =
        (KIND == BF16 || KIND == BF16_PAIRS || KIND == I8 || KIND == F8E4M3 || KIND == F8_WORDS) && SIMD;
    static constexpr bool BF16_ROWS = KIND == BF16 || KIND == BF16_PAIRS;  // (rows the tiles read as they lie)
    bool bf16_tiles = false;
    bool scores_only = false;  // (Operands::scores_only: the scores on the tiles, the rest as the vector path's)
    // channels d .. d + 31 of a row as bf16 words (NaN codes read as NaN)
    static __m512i tile_words(const void* row, int64_t d) {
        if constexpr (BF16_ROWS) return _mm512_loadu_si512((const void*)((const uint16_t*)row + d));
        else return (__m512i)_mm512_cvtne2ps_pbh(load(row, d + 16, true), load(row, d, true));
    }
    // a key row as a tile's row of bf16 words (F8_WORDS: in e4m3_words' order, as q's tiles are: q_tile_words)
    void tile_row(uint16_t* out, const void* row) const {
        if constexpr (BF16_ROWS) {
            std::memcpy(out, row, 2 * o.D);
#if DN_F8_WORDS
        } else if constexpr (KIND == F8_WORDS) {
            for (int64_t d = 0; d < o.D; d += 64) {
                const E4M3Words w = e4m3_words(row, d);
                _mm512_store_si512(out + d, w.w0);
                _mm512_store_si512(out + d + 32, w.w1);
            }
#endif
        } else {
            for (int64_t d = 0; d < o.D; d += 32) _mm512_store_si512(out + d, tile_words(row, d));
        }
    }
    float* c_out = nullptr;         // [4][16][16]: sums tiles, stored
    uint16_t* v_words = nullptr;    // [SLICE / 16][2][16][32]: a slice of the block's V rows as B tiles (half h:
                                    // keys 32 h ..)
    uint16_t* p_words = nullptr;    // [rows / 16][2][p_pieces][16][32]: the weights as A tiles (group, half, piece)
    uint16_t* k_copy = nullptr;     // [BLOCK][D]: key rows not a stride apart, copied

    // the block's scores, q[r] . k[jj] * tile_unit * kunit[jj]: 16 keys x 32 channels x 16 rows a TDPBF16PS, the
    // block's four groups of keys each in its own sums tile (their products overlap: tiles are not renamed); then
    // each row group's softmax (tile_softmax), which leaves the weights in s[r][jj]
    __attribute__((noinline)) void tile_scores(int n, bool masked) {
        const int64_t D = o.D, chunks = D / 32, groups = (o.R + TILE_ROWS - 1) / TILE_ROWS;
        const int kgroups = (n + 15) / 16;
        const char* base[4] = {};
        int64_t stride[4] = {};
        for (int g = 0; g < kgroups; ++g) {
            const int jj = 16 * g, m = std::min(16, n - jj);
            base[g] = krows[jj];
            stride[g] = m > 1 ? krows[jj + 1] - base[g] : 0;
            bool even = BF16_ROWS && m == 16 && stride[g] > 0;
            for (int i = 2; even && i < 16; ++i) even = krows[jj + i] == base[g] + i * stride[g];
            if (!even) {  // copied (int8 / fp8: widened) into 16 rows a stride apart (rows past n zero)
                uint16_t* rows = k_copy + jj * D;
                for (int i = 0; i < 16; ++i) {
                    if (i < m) tile_row(rows + i * D, krows[jj + i]);
                    else std::memset(rows + i * D, 0, 2 * D);
                }
                base[g] = (const char*)rows, stride[g] = 2 * D;
            }
        }
        const uint16_t* qt = o.q_tiles + part.bh * groups * chunks * 512;
        for (int64_t g = 0; g < groups; ++g) {
            _tile_zero(0);
            if (kgroups > 1) _tile_zero(1);
            if (kgroups > 2) _tile_zero(2);
            if (kgroups > 3) _tile_zero(3);
            for (int64_t c = 0; c < chunks; ++c) {
                _tile_loadd(4, qt + (g * chunks + c) * 512, 64);
                _tile_loadd(5, base[0] + 64 * c, stride[0]);
                _tile_dpbf16ps(0, 5, 4);
                if (kgroups > 1) {
                    _tile_loadd(6, base[1] + 64 * c, stride[1]);
                    _tile_dpbf16ps(1, 6, 4);
                }
                if (kgroups > 2) {
                    _tile_loadd(7, base[2] + 64 * c, stride[2]);
                    _tile_dpbf16ps(2, 7, 4);
                }
                if (kgroups > 3) {
                    _tile_loadd(5, base[3] + 64 * c, stride[3]);
                    _tile_dpbf16ps(3, 5, 4);
                }
            }
            _tile_stored(0, c_out, 64);
            if (kgroups > 1) _tile_stored(1, c_out + 256, 64);
            if (kgroups > 2) _tile_stored(2, c_out + 512, 64);
            if (kgroups > 3) _tile_stored(3, c_out + 768, 64);
            if (scores_only) {
                tile_sums_to_s(n, kgroups);
                continue;
            }
            tile_softmax(g, n, masked, kgroups);
            if (pass_asks) ask_next();
        }
    }

    // the sums tiles' [key][row] (R <= 16 rows) scaled into s[row][key], as the vector path's scores leave them
    void tile_sums_to_s(int n, int kgroups) {
        const __m512 unit = _mm512_set1_ps(o.tile_unit);
        for (int kg = 0; kg < kgroups; ++kg) {
            __m512 x[16];
            for (int i = 0; i < 16; ++i) x[i] = _mm512_load_ps(c_out + 256 * kg + 16 * i);
            transpose16(x);
            const __m512 units = _mm512_mul_ps(unit, _mm512_loadu_ps(&kunit[16 * kg]));
            for (int64_t r = 0; r < o.R; ++r) _mm512_storeu_ps(&s[r * BLOCK + 16 * kg], _mm512_mul_ps(x[r], units));
            if (pass_asks) ask_next();
        }
    }

    // softmax_step for row group g on the tiles' sums (c_out [key group][key][row]: each key's 16 rows a vector, so
    // the rows' maxima, sums and rescales are lanes, not horizontal reductions), the weights transposed into s[row]
    // for the values' pieces; the same rules as softmax_step's (keys past n or hidden from every row weigh 0, a
    // visible non-finite key makes its row NaN, a row that has seen nothing keeps m -inf and gets 0 weights)
    void tile_softmax(int64_t g, int n, bool masked, int kgroups) {
        const int64_t r0 = TILE_ROWS * g, rows = std::min<int64_t>(TILE_ROWS, o.R - r0);
        const __mmask16 live = rows == 16 ? 0xFFFF : (__mmask16)((1u << rows) - 1);
        const __m512 neg_inf = _mm512_set1_ps(NEG_INF), unit = _mm512_set1_ps(o.tile_unit);
        const int keys = 16 * kgroups;
        __mmask16 bad = 0;
        __m512 top = neg_inf;
        for (int jj = 0; jj < keys; ++jj) {  // scaled, hidden keys -inf, non-finite ones noted and -inf, the max
            __m512 x = _mm512_mul_ps(_mm512_load_ps(c_out + 16 * jj), _mm512_mul_ps(unit, _mm512_set1_ps(kunit[jj])));
            if (jj >= n || (masked && !seen_key[jj])) {
                x = neg_inf;
            } else {
                const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_EQ_OQ);
                bad |= (__mmask16)~finite;
                x = _mm512_mask_mov_ps(neg_inf, finite, x);
            }
            _mm512_store_ps(c_out + 16 * jj, x);
            top = _mm512_max_ps(top, x);
        }
        bad &= live;
        for (int64_t r = 0; r < rows; ++r)
            if ((bad >> r) & 1) part.bad[r0 + r] = 1;
        const __m512 m_old = _mm512_mask_loadu_ps(neg_inf, live, part.m + r0);
        const __m512 m_new = _mm512_max_ps(m_old, top);
        const __mmask16 seen = _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ) & live;  // (else: nothing seen yet)
        const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), _mm512_cmp_ps_mask(m_new, m_old, _CMP_GT_OQ),
                                                vexp(_mm512_sub_ps(m_old, m_new)));  // (0 where m_old = -inf)
        __m512 sum = _mm512_setzero_ps();
        for (int jj = 0; jj < keys; ++jj) {  // (in key order, keys past n adding 0: the same sums whatever follows)
            const __m512 p = _mm512_maskz_mov_ps(seen, vexp(_mm512_sub_ps(_mm512_load_ps(c_out + 16 * jj), m_new)));
            _mm512_store_ps(c_out + 16 * jj, p);
            sum = _mm512_add_ps(sum, p);
        }
        const __m512 l_old = _mm512_mul_ps(_mm512_mask_loadu_ps(_mm512_setzero_ps(), live, part.l + r0), alpha);
        const __m512 l_new = _mm512_add_ps(l_old, sum);
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l_new);
        _mm512_mask_storeu_ps(part.l + r0, seen, l_new);
        _mm512_mask_storeu_ps(part.m + r0, seen, m_new);
        _mm512_mask_storeu_ps(kept + r0, live,
                              _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), seen, _mm512_div_ps(l_old, l_new)));
        const bool scaled = vsc || o.v_unit != 1.0f;
        for (int kg = 0; kg < kgroups; ++kg) {  // p / l_new (times the values' scales), [key][row] to s[row][key]
            __m512 x[16];
            for (int i = 0; i < 16; ++i) {  // (a hidden key's weight 0 whatever its scale: NaN stays out)
                const int jj = 16 * kg + i;
                const bool hidden = jj >= n || (masked && !seen_key[jj]);
                x[i] = hidden ? _mm512_setzero_ps()
                              : _mm512_mul_ps(_mm512_load_ps(c_out + 16 * jj),
                                              scaled ? _mm512_mul_ps(inv, _mm512_set1_ps(vscale[jj])) : inv);
            }
            transpose16(x);
            for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(&s[(r0 + r) * BLOCK + 16 * kg], x[r]);
        }
    }

    // acc[r] = acc[r] * kept[r] + p[r] . V of the block: each row group's weights in bf16 pieces (p_words), then V a
    // slice of SLICE channels at a time, its rows two keys to a 32-bit lane (v_words: 16 KiB, in L1 while every row
    // group reads it), 16 rows x 16 channels x 32 keys a TDPBF16PS, four channel tiles at a time
    static constexpr int64_t SLICE = 128;
    __attribute__((noinline)) void tile_values(int n, bool masked) {
        const int64_t R = o.R, Dv = o.Dv, groups = (R + TILE_ROWS - 1) / TILE_ROWS, P = o.p_pieces;
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t rows = std::min<int64_t>(TILE_ROWS, R - TILE_ROWS * g);
            for (int64_t r = 0; r < TILE_ROWS; ++r)  // the weights' pieces: p rounded, then what is left, rounded
                for (int h = 0; h < 2; ++h) {
                    __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                    if (r < rows) {  // (keys past n weigh 0)
                        const int k0 = 32 * h, k1 = k0 + 16;
                        const float* row = &s[(TILE_ROWS * g + r) * BLOCK];
                        const __mmask16 m0 = n >= k1 ? 0xFFFF : n <= k0 ? 0 : (1u << (n - k0)) - 1;
                        const __mmask16 m1 = n >= k1 + 16 ? 0xFFFF : n <= k1 ? 0 : (1u << (n - k1)) - 1;
                        x0 = _mm512_maskz_loadu_ps(m0, row + k0), x1 = _mm512_maskz_loadu_ps(m1, row + k1);
                    }
                    for (int64_t p = 0; p < P; ++p) {
                        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
                        _mm512_store_si512(p_words + (((g * 2 + h) * P + p) * 16 + r) * 32, w);
                        x0 = _mm512_sub_ps(x0, bf16_half<0>(w)), x1 = _mm512_sub_ps(x1, bf16_half<1>(w));
                    }
                }
        }
        // word 2 i + a of a B tile row: channel i of key a (the pair's first or second) of 16 channels
        const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                             0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                             0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int64_t c0 = 0; c0 < Dv; c0 += SLICE) {
            const int64_t width = std::min<int64_t>(SLICE, Dv - c0), ctiles = width / 16;
            for (int h = 0; h < 2; ++h)
                for (int k2 = 0; k2 < 16; ++k2) {
                    const int a = 32 * h + 2 * k2;
                    const char* v0 = a < n && (!masked || seen_key[a]) ? vrows[a] : nullptr;  // (else 0)
                    const char* v1 = a + 1 < n && (!masked || seen_key[a + 1]) ? vrows[a + 1] : nullptr;
                    for (int64_t m = 0; m < width / 32; ++m) {
                        const __m512i x0 = v0 ? tile_words(v0, c0 + 32 * m) : _mm512_setzero_si512();
                        const __m512i x1 = v1 ? tile_words(v1, c0 + 32 * m) : _mm512_setzero_si512();
                        _mm512_store_si512(v_words + ((4 * m + h) * 16 + k2) * 32,
                                           _mm512_permutex2var_epi16(x0, lo, x1));
                        _mm512_store_si512(v_words + ((4 * m + 2 + h) * 16 + k2) * 32,
                                           _mm512_permutex2var_epi16(x0, hi, x1));
                    }
                }
            if (pass_asks) ask_next();
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t rows = std::min<int64_t>(TILE_ROWS, R - TILE_ROWS * g);
                for (int64_t t0 = 0; t0 < ctiles; t0 += 4) {
                    const int64_t nt = std::min<int64_t>(4, ctiles - t0);
                    _tile_zero(0);
                    if (nt > 1) _tile_zero(1);
                    if (nt > 2) _tile_zero(2);
                    if (nt > 3) _tile_zero(3);
                    for (int h = 0; h < 2; ++h)
                        for (int64_t p = 0; p < P; ++p) {
                            _tile_loadd(4, p_words + ((g * 2 + h) * P + p) * 512, 64);
                            _tile_loadd(5, v_words + (t0 * 2 + h) * 512, 64);
                            _tile_dpbf16ps(0, 4, 5);
                            if (nt > 1) {
                                _tile_loadd(6, v_words + ((t0 + 1) * 2 + h) * 512, 64);
                                _tile_dpbf16ps(1, 4, 6);
                            }
                            if (nt > 2) {
                                _tile_loadd(7, v_words + ((t0 + 2) * 2 + h) * 512, 64);
                                _tile_dpbf16ps(2, 4, 7);
                            }
                            if (nt > 3) {
                                _tile_loadd(5, v_words + ((t0 + 3) * 2 + h) * 512, 64);
                                _tile_dpbf16ps(3, 4, 5);
                            }
                        }
                    _tile_stored(0, c_out, 64);
                    if (nt > 1) _tile_stored(1, c_out + 256, 64);
                    if (nt > 2) _tile_stored(2, c_out + 512, 64);
                    if (nt > 3) _tile_stored(3, c_out + 768, 64);
                    for (int64_t r = 0; r < rows; ++r) {
                        const int64_t row = TILE_ROWS * g + r;
                        const __m512 k = _mm512_set1_ps(kept[row]);
                        float* acc = &part.acc[row * Dv + c0 + 16 * t0];
                        for (int64_t i = 0; i < nt; ++i)
                            _mm512_storeu_ps(acc + 16 * i, _mm512_fmadd_ps(_mm512_loadu_ps(acc + 16 * i), k,
                                                                           _mm512_load_ps(c_out + 256 * i + 16 * r)));
                    }
                    if (pass_asks) ask_next();
                }
            }
        }
    }

    // the scores on the tiles, the softmax and values as the vector path's (scores_only); the tile unit kept awake
    // through the vector passes (tiles_awake: before them, between the value passes' register tiles, after them)
    void score_tiles_step(int64_t j0, int n, bool masked) {
        ask_step = 0;
        const int64_t values_steps = (o.R + NR - 1) / NR * (n / (ask_mask + 1)) * (o.Dv / W_ / TILE);
        ask_rate = ((int64_t)ahead_rows << 16) / ((n + 15) / 16 + values_steps + 1);
        pass_asks = true;
        tile_scores(n, masked);
        softmax_step(j0, n, masked);
        read_next_scales();
        tiles_awake();
        for_row_groups(j0, n, masked, false);
        tiles_awake();
        ask_upto(ahead_rows);
    }
    // into sums tile 0, which tile_scores zeroes before its products
    static void tiles_awake() { DN_AMX_AWAKE(0); }

    // (masked: keys no row sees, whose rows are never read for the values: block_visibility's uniform)
    void tile_step(int64_t j0, int n, bool masked) {
        ask_step = 0;
        const int64_t groups = (o.R + TILE_ROWS - 1) / TILE_ROWS;
        const int64_t slices = (o.Dv + SLICE - 1) / SLICE;  // (tile_scores' and tile_values' asks)
        const int64_t steps = groups + slices + groups * ((o.Dv / 16 + 3) / 4) + 1;
        ask_rate = ((int64_t)ahead_rows << 16) / steps;
        pass_asks = true;
        tile_scores(n, masked);  // (and the softmax: tile_softmax)
        read_next_scales();
        tile_values(n, masked);
        ask_upto(ahead_rows);
    }
#endif

    // the block of keys j0 .. j0 + BLOCK - 1 (clamped to end)
    void step(int64_t j0) {
        const int n = (int)std::min<int64_t>(BLOCK, end - j0);
        const Seen seen = visb ? block_visibility(j0, n) : ALL;
        if (seen == NONE) return;  // no row sees these keys: never read
        const bool masked = seen == SOME;
        block_rows(j0, n);
#if DN_AMX
        if constexpr (KIND == I8 && SIMD)  // (the tile passes built for int8 alone)
            if (amx) {
                amx_step(j0, n, masked);
                return;
            }
#endif
#if DN_AMX_BF16
        if constexpr (ON_TILES) {  // (a block whose rows see different keys: the vector path below)
            if (scores_only) {
                score_tiles_step(j0, n, masked);
                return;
            }
            if constexpr (KIND != F8_WORDS)  // (F8_WORDS' scores alone: f8_score_tiles)
                if (bf16_tiles && (!masked || uniform)) {
                    tile_step(j0, n, masked);
                    return;
                }
        }
#endif
        if constexpr (KIND == F8E4M3)  // (the vector paths' vload_e4m3_nan, the plain path's load_scalar)
            nan_codes = e4m3_nan_codes(krows, n, o.D) || (!o.shared && e4m3_nan_codes(vrows, n, o.Dv));
        for_row_groups(j0, n, masked, true);
        softmax_step(j0, n, masked);
        read_next_scales();
        for_row_groups(j0, n, masked, false);
    }
};

// A paged pool whose slots hold every head's row side by side (NHD: [page, slot, head, D] in memory).
bool heads_side_by_side(const Operands& o) {
    return o.pages && o.page_size >= 2 && o.H >= 2 && o.ks[2] > 0 && o.ks[2] < o.ks[1] && o.vs[2] > 0 &&
           o.vs[2] < o.vs[1];
}

// A group's items (the same sequence and keys, consecutive KV heads) a block at a time in turn, so the heads'
// rows of a page are read close together (heads_in_turn); each item computes exactly as alone. With the heads side
// by side, the next block's rows are asked for in address order (every head's row of a key, then the next key's),
// item i asking for its slice of the keys while its scores run: NHD pools of pages of 16, B 8, S 8k, Hkv 8, one
// thread, took 0.78x the time in fp32 and 0.72x in bf16 (each item asking for its own head's rows: 0.96-1.04x).
template <int KIND, bool SIMD>
void run_group(const Operands& o, std::vector<Item<KIND, SIMD>>& group) {
    const int count = (int)group.size();
    const bool ordered = count > 1 && heads_side_by_side(o);
    std::vector<const char*> rows_k(ordered ? count * BLOCK : 0), rows_v(rows_k.size());  // [head][key]
    for (auto& item : group) item.group_asks = ordered;
    for (int64_t j0 = group[0].part.j0; j0 < group[0].end; j0 += BLOCK) {
        if (ordered) {
            const int m = (int)std::max<int64_t>(0, std::min<int64_t>(group[0].end, j0 + 2 * BLOCK) - (j0 + BLOCK));
            for (int h = 0; h < count; ++h) group[h].page_rows(j0 + BLOCK, m, &rows_k[h * BLOCK], &rows_v[h * BLOCK], false);
            const int share = (m + count - 1) / count;  // keys a slice (its rows: share * count <= BLOCK + 15)
            for (int i = 0; i < count; ++i) {
                int r = 0;
                for (int jj = i * share; jj < std::min(m, (i + 1) * share); ++jj)
                    for (int h = 0; h < count; ++h, ++r)
                        group[i].ahead_k[r] = rows_k[h * BLOCK + jj], group[i].ahead_v[r] = rows_v[h * BLOCK + jj];
                group[i].group_rows = r;
            }
        }
        for (auto& item : group) item.step(j0);
    }
}

// One thread's items p[0 .. n), a group at a time: an item and the next heads' items of the same keys, up to in_turn
// of them (heads_in_turn); each group made before the one ahead of it runs, so each item's last block asks for its
// successor's first (Item::successor) in calls of 8 MiB of K/V or more. AVX-512 Zen 4 VM, B 8 S 8k, both builds in
// one process: shuffled pages of 16, one thread, bf16 0.955-0.97x the time, fp32 0.966x, int8 1.00-1.02x; 2 threads
// bf16 0.971x; pages of 256 bf16 0.978x; contiguous 0.99-1.01x. The 135M model's small call, in cache, took 1.013x.
template <int KIND, bool SIMD>
void run_items(const Operands& o, Partial* p, size_t n, int64_t in_turn) {
    auto group_size = [&](size_t i) {
        size_t count = 1;
        while ((int64_t)count < in_turn && i + count < n && p[i + count].bh == p[i].bh + (int64_t)count &&
               p[i + count].j0 == p[i].j0 && p[i].bh % o.H + (int64_t)count < o.H)
            ++count;
        return count;
    };
    auto make = [&](std::vector<Item<KIND, SIMD>>& group, size_t i, size_t count) {
        group.clear();
        group.reserve(count);
        for (size_t c = 0; c < count; ++c) group.emplace_back(o, p[i + c]);
    };
    const bool chain = o.B * o.H * o.S * (o.D + o.Dv) * kind_bytes(KIND) >= (int64_t(8) << 20);
    std::vector<Item<KIND, SIMD>> group, next;
    size_t i = 0, count = n > 0 ? group_size(0) : 0;
    make(group, i, count);
    while (i < n) {
        const size_t j = i + count, next_count = j < n ? group_size(j) : 0;
        make(next, j, next_count);
        for (size_t c = 0; c < count; ++c) group[c].successor = chain && c < next_count ? &next[c] : nullptr;
        run_group(o, group);
        std::swap(group, next);
        i = j, count = next_count;
    }
}

template <bool SIMD>
void dispatch_kind(int kind, const Operands& o, Partial* p, size_t n, int64_t in_turn) {
    switch (kind) {
        case F32: run_items<F32, SIMD>(o, p, n, in_turn); break;
        case BF16: run_items<BF16, SIMD>(o, p, n, in_turn); break;
#if DN_AVX512 || DN_AVX2
        case BF16_PAIRS:
            if constexpr (SIMD) run_items<BF16_PAIRS, SIMD>(o, p, n, in_turn);
            break;
#endif
        case F16: run_items<F16, SIMD>(o, p, n, in_turn); break;
        case I8: run_items<I8, SIMD>(o, p, n, in_turn); break;
        case F8E4M3: run_items<F8E4M3, SIMD>(o, p, n, in_turn); break;
#if DN_F8_WORDS
        case F8_WORDS:
            if constexpr (SIMD) run_items<F8_WORDS, SIMD>(o, p, n, in_turn);
            break;
#endif
        default: break;
    }
}

// How many KV heads of a paged pool run in turn (run_items), at most 16: every head where a slot holds every head's
// row side by side (NHD; run_items asks for their rows in address order); 2 where a head's rows of one page are one
// run shorter than 16 KiB (a head-major pool, [page, head, slot, D] in memory); else 1. Alone, a head-major run of
// 2-8 KiB read slower than longer runs (int8 pages of 32, 4 KiB runs: 1.02x contiguous where pages of 16 took 1.19x),
// likely as the hardware prefetcher fetches past it into the next head's run; read together, the two heads use it.
// Measured on an AVX-512 + AMX Xeon VM, one thread, B 8, S 8k, Hq 32 / Hkv 8, D 128, shuffled pages of 16: int8
// 0.84-0.89x the time, bf16 0.95x, fp32 0.95x (more heads, or asking in address order: 1.02-1.2x). Not for
// contiguous K/V or pages of one key: each head its own stream, heads in turn took 1.25-1.9x the time. int8 on AMX
// tiles (`tiles`) pairs only pages of fewer than 32 keys: the pairs cost its tiles 5-7% in cache (B 2, S 1k), and
// from DRAM its pages of 32 and 64 (4 and 8 KiB runs) read alone in 0.969-0.988x the time (B 8, S 16k, one thread,
// shuffled), where pages of 16 alone took 1.10x, and bf16 pages of 32 alone 1.02x. bf16 and fp16 run four heads in
// turn: against two, on an AVX-512 Zen 4 VM (B 8, S 8k, shuffled; one thread / two), bf16 pages of 16 took
// 0.932-0.939x / 0.951-0.980x the time, pages of 32 0.972x / 1.018x; fp16 pages of 16 0.951-0.992x / 0.928-0.956x,
// pages of 32 0.978x / 0.981x (fp32 1.00x / 0.98x and int8 0.966x / 1.003x: kept at two); on the AMX Xeon four bf16
// heads had taken 1.00x (docs/BENCHMARKS.md, rounds 16 and 25).
int64_t heads_in_turn(const Operands& o, int64_t elem, bool tiles) {
    if (heads_side_by_side(o)) return std::min<int64_t>(o.H, 16);
    if (!o.pages || o.H < 2 || o.page_size < 2 || (tiles && o.page_size >= 32)) return 1;
    const int64_t strides[2][2] = {{o.ks[1], o.ks[2]}, {o.vs[1], o.vs[2]}};  // (slot, head) of K and V
    for (const auto& st : strides) {
        const int64_t slot = st[0], head = st[1];
        if (slot <= 0 || head != o.page_size * slot || head * elem >= 16384) return 1;
    }
    return elem == 2 ? std::min<int64_t>(o.H, 4) : 2;
}

}  // namespace

extern "C" {

// The vector width this build uses (16: AVX-512, 8: AVX2 + FMA + F16C, 4: NEON, 1: the portable C++, vectorised by
// the compiler).
int decode_native_lanes() {
#if DN_VECTORS
    return W;
#else
    return 1;
#endif
}

// 1: DecodeCall.softcap is read (a library built from an older source ignores it: Python checks this first); and
// DecodeCall's ALiBi fields
int decode_native_softcap() { return 1; }
int decode_native_alibi() { return 1; }
int decode_native_bias() { return 1; }

// 1 when the runs go to OpenMP's workers (torch's), 0 when to threads of the library's own (a build without OpenMP)
int decode_native_openmp() {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

// 1 when int8 K/V run on AMX tiles where they fit (amx_usable): built for a CPU with AMX-INT8 and granted the tiles
int decode_native_amx() {
#if DN_AMX
    return amx_granted() ? 1 : 0;
#else
    return 0;
#endif
}

// 1 when bf16, int8 or fp8 K/V with at least TILE_ROWS query rows a KV head, and bf16 K/V's scores from
// SCORE_TILE_ROWS (a q of bf16 numbers), run on AMX-BF16 tiles: built for a CPU with AMX-BF16, granted the tiles, and
// not turned off (decode_native_use_bf16_tiles)
int decode_native_bf16_tiles() {
#if DN_AMX_BF16
    return amx_granted() && bf16_tiles_mode.load(std::memory_order_relaxed) != 0 ? 1 : 0;
#else
    return 0;
#endif
}

// Turns the bf16 tiles off (0) or back on (1, -1) for this process's later calls (tests, A/B timings); returns
// decode_native_bf16_tiles() after
int decode_native_use_bf16_tiles(int mode) {
#if DN_AMX_BF16
    bf16_tiles_mode.store(mode == 0 ? 0 : -1, std::memory_order_relaxed);
#else
    (void)mode;
#endif
    return decode_native_bf16_tiles();
}

// 1 when bf16 K's scores run as AVX512-BF16 pair dot products against a q of bf16 numbers (DN_BF16_DOT): where
// vdpbf16ps costs at most DOT_FMA_RATIO FMAs (bf16_dot_rates, timed at the first ask), or as forced
int decode_native_bf16_dot() {
#if DN_BF16_DOT
    const int mode = bf16_dot_mode.load(std::memory_order_relaxed);
    if (mode >= 0) return mode;
    const DotRates& r = bf16_dot_rates();
    return r.dot_ns <= DOT_FMA_RATIO * r.fma_ns ? 1 : 0;
#else
    return 0;
#endif
}

// What decode_native_bf16_dot decides by: ns per vdpbf16ps and per FMA (out[0], out[1]) and the ratio it allows
// (out[2]); returns 0 and writes nothing where the library has no AVX512-BF16 path
int decode_native_bf16_dot_rates(double* out) {
#if DN_BF16_DOT
    const DotRates& r = bf16_dot_rates();
    out[0] = r.dot_ns, out[1] = r.fma_ns, out[2] = DOT_FMA_RATIO;
    return 1;
#else
    (void)out;
    return 0;
#endif
}

// Forces the scores' path for this process's later calls (tests, A/B timings): 1 vdpbf16ps where it applies, 0 the
// FMAs, -1 as the rates decide; returns decode_native_bf16_dot() after (0 without an AVX512-BF16 path)
int decode_native_use_bf16_dot(int mode) {
    bf16_dot_mode.store(mode < 0 ? -1 : mode > 0 ? 1 : 0, std::memory_order_relaxed);
    return decode_native_bf16_dot();
}

// Offsets of DecodeCall's fields in declaration order, for Python to check its copy against; returns the count.
int decode_native_layout(int64_t* offsets, int capacity) {
    const int64_t all[] = {
        (int64_t)offsetof(DecodeCall, kind), (int64_t)offsetof(DecodeCall, threads), (int64_t)offsetof(DecodeCall, B),
        (int64_t)offsetof(DecodeCall, H), (int64_t)offsetof(DecodeCall, R), (int64_t)offsetof(DecodeCall, S),
        (int64_t)offsetof(DecodeCall, D), (int64_t)offsetof(DecodeCall, Dv), (int64_t)offsetof(DecodeCall, k),
        (int64_t)offsetof(DecodeCall, k_strides), (int64_t)offsetof(DecodeCall, k_scale),
        (int64_t)offsetof(DecodeCall, k_scale_strides), (int64_t)offsetof(DecodeCall, v),
        (int64_t)offsetof(DecodeCall, v_strides), (int64_t)offsetof(DecodeCall, v_scale),
        (int64_t)offsetof(DecodeCall, v_scale_strides), (int64_t)offsetof(DecodeCall, q),
        (int64_t)offsetof(DecodeCall, q_strides), (int64_t)offsetof(DecodeCall, scale),
        (int64_t)offsetof(DecodeCall, visible), (int64_t)offsetof(DecodeCall, visible_strides),
        (int64_t)offsetof(DecodeCall, out), (int64_t)offsetof(DecodeCall, lse), (int64_t)offsetof(DecodeCall, pages),
        (int64_t)offsetof(DecodeCall, pages_stride), (int64_t)offsetof(DecodeCall, page_size),
        (int64_t)offsetof(DecodeCall, lengths), (int64_t)offsetof(DecodeCall, key_offset),
        (int64_t)offsetof(DecodeCall, io_kind), (int64_t)offsetof(DecodeCall, rows_alone),
        (int64_t)offsetof(DecodeCall, softcap), (int64_t)offsetof(DecodeCall, alibi),
        (int64_t)offsetof(DecodeCall, alibi_stride), (int64_t)offsetof(DecodeCall, queries),
        (int64_t)offsetof(DecodeCall, query_pos), (int64_t)offsetof(DecodeCall, query_pos_stride),
        (int64_t)offsetof(DecodeCall, key_pos), (int64_t)offsetof(DecodeCall, key_pos_stride),
        (int64_t)offsetof(DecodeCall, bias), (int64_t)offsetof(DecodeCall, bias_strides), (int64_t)sizeof(DecodeCall)};
    const int n = (int)(sizeof(all) / sizeof(all[0]));
    for (int i = 0; i < n && i < capacity; ++i) offsets[i] = all[i];
    return n;
}

// Returns 0; 1 on an unknown kind; 2 when q holds NaN/inf (nothing is written: the caller runs the torch kernels,
// which keep a bad query to its own row).
int decode_native(const DecodeCall* call) {
    const DecodeCall& c = *call;
    const int kind = (int)c.kind;
    if (kind < F32 || kind > F8E4M3 || (c.io_kind != F32 && c.io_kind != BF16)) return 1;
    if (c.alibi && (!c.query_pos || !c.key_pos || c.queries < 1 || c.R % c.queries)) return 1;  // (ALiBi's operands)
    if (c.bias && (c.queries < 1 || c.R % c.queries)) return 1;
    const int64_t B = c.B, H = c.H, R = c.R, S = c.S, D = c.D, Dv = c.Dv;
    // q's rows are read one at a time (q_row): a bf16 q's widened (exactly) into row_wide, an fp32 q's where they lie;
    // a bf16 output is computed in fp32 and rounded once at the end (round_bf16)
    const bool io_bf16 = c.io_kind == BF16;
    const int64_t qs[3] = {c.q_strides[0], c.q_strides[1], c.q_strides[2]}, rows = B * H * R;
    static thread_local std::vector<float> kept_row, kept_q, kept_states;
    CallArray<float> row_wide(kept_row, io_bf16 ? D : 0);
    auto q_row = [&](int64_t b, int64_t h, int64_t r) -> const float* {
        const int64_t at = b * qs[0] + h * qs[1] + r * qs[2];
        if (!io_bf16) return (const float*)c.q + at;
        widen_bf16_row((const uint16_t*)c.q + at, row_wide.data, D);
        return row_wide.data;
    };
#if DN_VECTORS
    const bool simd = D % VECTOR_DIMS == 0 && Dv % VECTOR_DIMS == 0;
#else
    const bool simd = false;
#endif
#if DN_AMX_BF16
    // bf16 K/V of many rows on AMX tiles: where q's values are all bf16 numbers (checked below; a bf16 q's are); of
    // 8-15 rows (or 16 of Dv up to SCORE_TILE_DV) the scores alone (score_tiles), the values on the vectors
    const bool tiled = simd && D % 32 == 0 && Dv % 32 == 0 && !c.rows_alone && !(c.softcap > 0) && !c.alibi &&
                       !c.bias && decode_native_bf16_tiles();
#if DN_F8_WORDS
    // fp8 e4m3 K/V read as F8_WORDS, of fewer rows than the whole tiles take: the scores alone on the tiles too
    const bool f8_score_tiles = kind == F8E4M3 && D % 64 == 0 && Dv % 64 == 0 && R >= F8_SCORE_TILE_ROWS &&
                                R < TILE_ROWS;
#else
    const bool f8_score_tiles = false;
#endif
    const bool score_tiles = tiled && ((kind == BF16 && R >= SCORE_TILE_ROWS &&
                                        (R < TILE_ROWS || (R == TILE_ROWS && Dv <= SCORE_TILE_DV))) || f8_score_tiles);
    bool bf16_tiles = tiled && (kind == BF16 || kind == I8 || kind == F8E4M3) && R >= TILE_ROWS && !score_tiles;
    bool q_tiled = bf16_tiles || score_tiles;
    for (int64_t b = 0; b < B && q_tiled && !io_bf16; ++b)
        for (int64_t h = 0; h < H && q_tiled; ++h)
            for (int64_t r = 0; r < R && q_tiled; ++r) q_tiled = bf16_row(q_row(b, h, r), D);
    bf16_tiles = bf16_tiles && q_tiled;
#else
    const bool bf16_tiles = false, q_tiled = false;
#endif
    const bool pairs = (DN_AVX512 || DN_AVX2) && simd && kind == BF16 && D % PAIR == 0 && Dv % PAIR == 0 &&
                       !bf16_tiles;  // read as BF16_PAIRS (x86's vectors)
#if DN_F8_WORDS
    const bool words = simd && kind == F8E4M3 && D % 64 == 0 && Dv % 64 == 0 && !bf16_tiles;  // read as F8_WORDS
#else
    const bool words = false;
#endif
    const float scale = (float)c.scale;
#if DN_BF16_DOT
    // every q value a bf16 number (its low 16 bits zero; a bf16 q's are): its bits in q_bits, q left unscaled
    bool q_bf16 = decode_native_bf16_dot() && (pairs || kind == F8E4M3 || (kind == I8 && !decode_native_amx())) &&
                  simd && R % NR == 0 && D % 32 == 0 && !q_tiled;  // (the tiles' scores: q's scale on their sums)
    for (int64_t b = 0; b < B && q_bf16 && !io_bf16; ++b)
        for (int64_t h = 0; h < H && q_bf16; ++h)
            for (int64_t r = 0; r < R && q_bf16; ++r) q_bf16 = bf16_row(q_row(b, h, r), D);
    static thread_local std::vector<uint16_t> kept_bits;
    CallArray<uint16_t> q_bits(kept_bits, q_bf16 ? rows * D : 0);
#else
    const bool q_bf16 = false;
#endif
    // q rows times the scale, contiguous [B, Hkv, R, D] (tiny: R rows per KV head), checked finite on the way, in
    // the order the kind's kernel reads them (scale_q_row)
    const float q_factor = q_bf16 ? 1.0f : scale;
    CallArray<float> q_scaled(kept_q, rows * D);
    bool q_finite = true;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t r = 0; r < R; ++r) {
                const float* src = q_row(b, h, r);
                const int64_t at = ((b * H + h) * R + r) * D;
#if DN_BF16_DOT
                if (q_bf16) q_row_bits(src, &q_bits.data[at], D, words);
#endif
                q_finite &= scale_q_row(src, &q_scaled.data[at], D, q_factor, pairs, words);
            }
    if (!q_finite) return 2;
    int threads = (int)c.threads;
    Operands o{};
    o.k = c.k;
    o.v = c.v;
    for (int i = 0; i < 3; ++i) {
        o.ks[i] = c.k_strides[i];
        o.vs[i] = c.v_strides[i];
        o.kss[i] = c.k_scale ? c.k_scale_strides[i] : 0;
        o.vss[i] = c.v_scale ? c.v_scale_strides[i] : 0;
    }
    o.k_scale = c.k_scale;
    o.v_scale = c.v_scale;
    o.q = q_scaled.data;
    o.visible = c.visible;
    for (int i = 0; i < 4; ++i) o.vis[i] = c.visible ? c.visible_strides[i] : 0;
    o.B = B, o.H = H, o.R = R, o.S = S, o.D = D, o.Dv = Dv;
    // (the vector paths' e4m3_half_bits are 2^-8 times the value, F8_WORDS' exact; the plain path's: E4M3_UNIT)
    o.k_unit = o.v_unit = kind != F8E4M3 || words ? 1.0f : simd ? 256.0f : E4M3_UNIT;
#if DN_BF16_DOT
    if (q_bf16) o.q_bf16 = q_bits.data, o.k_unit *= scale;
#endif
    o.pages = c.pages, o.pages_stride = c.pages_stride, o.page_size = c.page_size, o.lengths = c.lengths;
    o.softcap = c.softcap > 0 ? (float)c.softcap : 0.0f;
    o.alibi = c.alibi, o.alibi_stride = c.alibi_stride, o.queries = c.queries > 0 ? c.queries : 1;
    o.query_pos = c.query_pos, o.query_pos_stride = c.query_pos_stride;
    o.key_pos = c.key_pos, o.key_pos_stride = c.key_pos_stride;
    o.bias = c.bias;
    for (int i = 0; i < 4; ++i) o.bias_strides[i] = c.bias ? c.bias_strides[i] : 0;
    o.shared = o.v == o.k && Dv <= D && o.v_scale == o.k_scale;
    for (int i = 0; i < 3; ++i) o.shared = o.shared && o.vs[i] == o.ks[i] && o.vss[i] == o.kss[i];
#if DN_AMX_BF16
    std::vector<uint16_t> q_tiles;
    if (q_tiled) {  // (a bf16 q widened whole first; F8_WORDS' in e4m3_words' channel order, as its K rows)
        const bool whole = io_bf16 || words;
        std::vector<float> q_wide(whole ? rows * D : 0);
        for (int64_t row = 0; row < rows && whole; ++row) {
            const float* from = q_row(row / (H * R), row / R % H, row % R);
            if (!words) std::memcpy(&q_wide[row * D], from, D * sizeof(float));
#if DN_F8_WORDS
            for (int64_t d = 0; d < D && words; d += 64) f8_word_order().apply(from + d, &q_wide[row * D + d], 1.0f);
#endif
        }
        const int64_t wide_s[3] = {H * R * D, R * D, D};
        q_tiles = q_tile_words(whole ? q_wide.data() : (const float*)c.q, whole ? wide_s : qs, B, H, R, D);
    }
    if (q_tiled) o.q_tiles = q_tiles.data(), o.tile_unit = scale, o.p_pieces = io_bf16 ? 2 : P_PIECES;
    o.scores_only = q_tiled && !bf16_tiles;
#endif

    // Work items: each (b, kv_head)'s keys cut at multiples of SPLIT positions (from key_offset), in order; a
    // sequence's keys past its length (paged) make none. The items go to the threads in runs of about equal keys,
    // and are merged below in this order whatever thread ran them: the result of a row depends on its own keys
    // alone (batch invariance), not on the batch, the thread count or the cache's layout.
    // With heads run in turn (heads_in_turn > 1), a sequence's items go chunk by chunk, each chunk's heads side by
    // side; the merge below reads each head's items in the same order either way.
#if DN_AMX
    const bool on_tiles = simd && kind == I8 && amx_usable(o);  // (int8 on the tiles: heads_in_turn, the workers)
#else
    const bool on_tiles = false;
#endif
    const int64_t in_turn = heads_in_turn(o, kind_bytes(kind), on_tiles);
    std::vector<Partial> items;
    int64_t total = 0;
    std::vector<std::pair<int64_t, int64_t>> chunks;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t stop = c.lengths ? std::min<int64_t>(S, c.lengths[b]) : S;
        chunks.clear();
        for (int64_t j0 = 0; j0 < stop;) {
            const int64_t j1 = std::min<int64_t>(stop, (((c.key_offset + j0) / SPLIT) + 1) * SPLIT - c.key_offset);
            chunks.emplace_back(j0, j1);
            j0 = j1;
        }
        if (chunks.empty()) continue;  // (a paged sequence of no keys: no items)
        const size_t per_head = in_turn > 1 ? 1 : chunks.size(), groups = chunks.size() / per_head;
        for (size_t g = 0; g < groups; ++g)
            for (int64_t h = 0; h < H; ++h)
                for (size_t i = g * per_head; i < (g + 1) * per_head; ++i) {
                    items.push_back(Partial{b * H + h, chunks[i].first, chunks[i].second, nullptr, nullptr, nullptr,
                                            nullptr});
                    total += chunks[i].second - chunks[i].first;
                }
    }
    // every item's state in two arrays, set (m -inf, l and acc 0, bad 0) by the Item that runs it; each item's acc
    // from a 64-byte boundary (its value tiles' loads and stores within cache lines)
    const int64_t state = (R * Dv + 2 * R + 15) / 16 * 16;
    static thread_local std::vector<uint8_t> kept_bad;
    CallArray<float> states(kept_states, items.size() * state);
    CallArray<uint8_t> bads(kept_bad, items.size() * R);
    for (size_t i = 0; i < items.size(); ++i) {
        float* x = states.data + i * state;
        items[i].acc = x, items[i].m = x + R * Dv, items[i].l = x + R * Dv + R, items[i].bad = bads.data + i * R;
    }
    threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, (int64_t)items.size(),
                                                            total / (4 * BLOCK)}));
    std::vector<size_t> first(threads + 1, items.size());  // thread t runs items first[t] .. first[t + 1] - 1
    first[0] = 0;
    for (size_t i = 0, t = 1, keys = 0; i < items.size() && t < (size_t)threads; ++i) {
        keys += items[i].j1 - items[i].j0;
        if (keys * threads >= total * t) first[t++] = i + 1;
    }
    auto worker = [&](int t) {
#if DN_AMX
        struct Tiles {  // this thread's tiles configured for its items (once a call: 1 us a time), released after
            bool held;
            explicit Tiles(bool on) : held(on) { if (held) amx_configure(); }
            ~Tiles() { if (held) _tile_release(); }
        } tiles(on_tiles || q_tiled);
#endif
        Partial* run = items.data() + first[t];
        const size_t n = first[t + 1] - first[t];
        if (simd) dispatch_kind<true>(pairs ? BF16_PAIRS : words ? F8_WORDS : kind, o, run, n, in_turn);
        else dispatch_kind<false>(kind, o, run, n, in_turn);
    };
    // The runs go to torch's own OpenMP threads: this library links the libgomp.so.1 torch has loaded (one
    // runtime per process), so its workers, often still spinning after the torch ops before this call, take
    // the runs at once instead of sharing their cores with threads of ours (measured: 9 ms vs 13-18 ms for
    // B = 1, S = 32k, bf16 on 2 cores). Built without OpenMP, plain threads do the same.
    // One run (a small call: fewer than 8 blocks of keys) runs here, without waking any worker.
    if (threads == 1) {
        worker(0);
    } else {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; ++t) worker(t);
#else
        std::vector<std::thread> pool;
        for (int t = 1; t < threads; ++t) pool.emplace_back(worker, t);
        worker(0);
        for (auto& th : pool) th.join();
#endif
    }

    // Each row's items merged by log-sum-exp: each item's output is normalised, and so is the merged one (shares of
    // the items' sums that add up to 1), so no step leaves the values' range. Row by row: the items in the order
    // they were made (a head's in key order: by_head) into a buffer of Dv (merged), then its channels put back in
    // order (BF16_PAIRS', F8_WORDS'), NaN and 0 where the reference has them, and stored in the output's kind. A row
    // that one item saw (S up to SPLIT keys) is that item's output as it is: the merge would give it times 1 plus 0.
    std::vector<int64_t> first_of(B * H + 1, 0), by_head(items.size());  // head bh's: first_of[bh] .. first_of[bh + 1]
    for (const Partial& p : items) ++first_of[p.bh + 1];
    for (int64_t bh = 0; bh < B * H; ++bh) first_of[bh + 1] += first_of[bh];
    {
        std::vector<int64_t> at(first_of.begin(), first_of.end() - 1);
        for (size_t i = 0; i < items.size(); ++i) by_head[at[items[i].bh]++] = (int64_t)i;
    }
    std::vector<float> merged(Dv), ordered(Dv);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t row = 0; row < rows; ++row) {
        const int64_t bh = row / R, r = row % R;
        float m = NEG_INF, l = 0.0f;
        bool bad = false;
        int64_t seen_by = -1, seers = 0;  // (the item that saw the row, of how many)
        for (int64_t i = first_of[bh]; i < first_of[bh + 1]; ++i) {
            const Partial& p = items[by_head[i]];
            bad |= p.bad[r] != 0;
            if (p.m[r] != NEG_INF) seen_by = by_head[i], ++seers;
        }
        const float* x = merged.data();
        const bool alone = seers == 1 && std::isfinite(items[seen_by].m[r]) && items[seen_by].l[r] > 0.0f &&
                           std::isfinite(items[seen_by].l[r]);
        if (alone) {
            m = items[seen_by].m[r], l = items[seen_by].l[r], x = &items[seen_by].acc[r * Dv];
        } else {
            std::fill(merged.begin(), merged.end(), 0.0f);
            for (int64_t i = first_of[bh]; i < first_of[bh + 1]; ++i) {
                const Partial& p = items[by_head[i]];
                if (p.m[r] == NEG_INF) continue;  // this item saw nothing for the row
                const float m_new = std::max(m, p.m[r]);
                const float l_old = l * std::exp(m - m_new), l_item = p.l[r] * std::exp(p.m[r] - m_new);
                const float l_new = l_old + l_item;
                const float a_old = l_old / l_new, a_new = l_item / l_new;
                const float* src = &p.acc[r * Dv];
                for (int64_t d = 0; d < Dv; ++d) merged[d] = merged[d] * a_old + src[d] * a_new;
                l = l_new;
                m = m_new;
            }
        }
        if (pairs) {  // each PAIR channels back from paired_order (places i and W + i to channels 2 i and 2 i + 1)
            for (int64_t d0 = 0; d0 < Dv; d0 += PAIR)
                for (int64_t i = 0; i < W_; ++i)
                    ordered[d0 + 2 * i] = x[d0 + i], ordered[d0 + 2 * i + 1] = x[d0 + W_ + i];
            x = ordered.data();
        } else if (words) {  // each 64 channels back from f8_lane_channel's order
#if DN_F8_WORDS
            for (int64_t d0 = 0; d0 < Dv; d0 += 64) f8_output_order().apply(x + d0, ordered.data() + d0, 1.0f);
#endif
            x = ordered.data();
        }
        // the row's values into the output (fp32), or into a buffer that x is not (bf16, rounded into the output)
        float* dst = io_bf16 ? (x == merged.data() ? ordered.data() : merged.data()) : (float*)c.out + row * Dv;
        const float plus = alone ? 0.0f : -0.0f;  // (x + 0: the merge's 0 * 0 + x * 1, -0 to 0; x + -0: x as it is)
        float row_lse = NEG_INF;
        if (bad) {
            for (int64_t d = 0; d < Dv; ++d) dst[d] = nan;
        } else if (l > 0.0f) {  // a non-finite channel met a visible NaN/inf value: NaN, as the reference
            for (int64_t d = 0; d < Dv; ++d) dst[d] = std::isfinite(x[d]) ? x[d] + plus : nan;
            row_lse = m + std::log(l);
        } else {
            for (int64_t d = 0; d < Dv; ++d) dst[d] = std::isfinite(x[d]) ? 0.0f : nan;
        }
        if (io_bf16) round_bf16(dst, (uint16_t*)c.out + row * Dv, Dv);
        if (c.lse) c.lse[row] = row_lse;
    }
    return 0;
}


// The page table of a list of keys (engine/kernels/decode/native_listed.py). Rows r = (b, l, t) of B x L x T; row
// r's K listed key indices are idx[b * idx_b + (l * T + t) * K + i] (idx_b = 0: one list for every batch row). An
// index is kept where 0 <= index < S, visible[r * K + i] is nonzero (visible null: every one) and, with key_pos,
// key_pos[b * kp_b + index] <= query_pos[b * qp_b + t] (the position rule). The kept ones, each once and in
// ascending order, go into pages[r * K ..] as base[r] + index (base null: 0; the rest of the row: base[r], never
// read), their count into lengths[r]. One bit per key of S in each thread's bitmap: O(K + S / 64) a row, no sort. Returns 0.
int decode_native_listed_tables(const int64_t* idx, int64_t idx_b, const uint8_t* visible, int64_t rows, int64_t K,
                                int64_t S, const int64_t* base, int64_t* pages, int64_t* lengths, int threads,
                                const int64_t* key_pos, int64_t kp_b, const int64_t* query_pos, int64_t qp_b,
                                int64_t T, int64_t L) {
    const int64_t words = (S + 63) / 64;
#pragma omp parallel num_threads(threads)
    {
        std::vector<uint64_t> bits((size_t)words, 0);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t b = r / (L * T), t = r % T;
            const int64_t* in = idx + b * idx_b + (r % (L * T)) * K;
            const uint8_t* seen = visible ? visible + r * K : nullptr;
            const int64_t* kp = key_pos ? key_pos + b * kp_b : nullptr;
            const int64_t qp = key_pos ? query_pos[b * qp_b + t] : 0;
            const int64_t first = base ? base[r] : 0;
            int64_t lo = words, hi = -1;
            for (int64_t i = 0; i < K; ++i) {
                const int64_t j = in[i];
                if (j < 0 || j >= S || (seen && !seen[i]) || (kp && kp[j] > qp)) continue;
                bits[(size_t)(j >> 6)] |= uint64_t(1) << (j & 63);
                lo = std::min(lo, j >> 6);
                hi = std::max(hi, j >> 6);
            }
            int64_t* out = pages + r * K;
            int64_t n = 0;
            for (int64_t w = lo; w <= hi; ++w) {
                uint64_t word = bits[(size_t)w];
                bits[(size_t)w] = 0;
                while (word) {
                    out[n++] = first + w * 64 + __builtin_ctzll(word);
                    word &= word - 1;
                }
            }
            lengths[r] = n;
            for (int64_t i = n; i < K; ++i) out[i] = first;
        }
    }
    return 0;
}

}  // extern "C"
