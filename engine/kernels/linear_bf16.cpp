// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in bfloat16 with fp32 accumulation, AVX512-BF16.
//
// Why: torch's bf16 linear (oneDNN) streams a decode step's weights from memory at a third
// of the bandwidth that an fp32 GEMV gets on the same machine, and at small M it is
// memory-bound: a decode step of a small model is mostly this. Tiles of NR weight rows by
// MR input rows; every weight row is read from memory once per call (the tile stays in L1
// while the M blocks pass over it); the tiles are split over OpenMP threads.
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); the
// Python side checks that the symbol exists.

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

inline float bf16_to_float(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

template <int MR, int NR>
inline void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K,
                 float* out) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[NR];
        for (int j = 0; j < NR; ++j)
            wv[j] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + j * K + k));
        for (int i = 0; i < MR; ++i) {
            const __m512bh xv =
                (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + i * x_stride + k));
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (k < K) {
        const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
        __m512bh wv[NR];
        for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + k);
        for (int i = 0; i < MR; ++i) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * x_stride + k);
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) out[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}

constexpr int NR = 4;
constexpr int MR = 4;

template <int R>
inline void rows(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, int64_t nr,
                 const uint16_t* bias, uint16_t* y, int64_t y_stride) {
    float out[R * NR];
    if (nr == NR) {
        tile<R, NR>(x, x_stride, w, K, out);
    } else {
        for (int64_t j = 0; j < nr; ++j) {
            float col[R];
            tile<R, 1>(x, x_stride, w + j * K, K, col);
            for (int i = 0; i < R; ++i) out[i * NR + j] = col[i];
        }
    }
    for (int i = 0; i < R; ++i)
        for (int64_t j = 0; j < nr; ++j) {
            // as torch: the fp32 result is rounded to bf16, then the bias is added in bf16
            float v = bf16_to_float(float_to_bf16(out[i * NR + j]));
            if (bias != nullptr) v = bf16_to_float(float_to_bf16(v + bf16_to_float(bias[j])));
            y[i * y_stride + j] = float_to_bf16(v);
        }
}

}  // namespace

extern "C" {

void tierserve_linear_bf16(const uint16_t* x, int64_t x_stride, int64_t M, int64_t K,
                           const uint16_t* w, int64_t N, const uint16_t* bias, uint16_t* y,
                           int64_t y_stride, int num_threads) {
    const int64_t num_tiles = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t n = t * NR;
        const int64_t nr = N - n < NR ? N - n : NR;
        const uint16_t* wt = w + n * K;
        const uint16_t* bt = bias != nullptr ? bias + n : nullptr;
        int64_t m = 0;
        for (; m + MR <= M; m += MR)
            rows<MR>(x + m * x_stride, x_stride, wt, K, nr, bt, y + m * y_stride + n, y_stride);
        switch (M - m) {
            case 3: rows<3>(x + m * x_stride, x_stride, wt, K, nr, bt, y + m * y_stride + n, y_stride); break;
            case 2: rows<2>(x + m * x_stride, x_stride, wt, K, nr, bt, y + m * y_stride + n, y_stride); break;
            case 1: rows<1>(x + m * x_stride, x_stride, wt, K, nr, bt, y + m * y_stride + n, y_stride); break;
            default: break;
        }
    }
}

}  // extern "C"

#endif
