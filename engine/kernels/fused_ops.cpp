// Fused elementwise steps of a decoder layer for bfloat16 on CPU, and a greedy argmax.
//
// Why: each of these is several torch ops in bf16 (a conversion to fp32, the op, a
// conversion back, a temporary each), and a small model's step pays ~30 such ops a layer.
// Each kernel here is one pass over its rows and rounds to bf16 where torch's ops round:
//
//   add_rms_norm:  x += delta (bf16 add; skipped when delta is null);
//                  out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))      (transformers' norm)
//   silu_mul:      out = bf16(bf16(silu(gate)) * up)                   (gate|up side by side)
//   rope_store:    q, k rotated in place, x * cos + rotate_half(x) * sin with each product
//                  rounded to bf16 (transformers' op order); k and v copied into the pool
//   argmax_f32:    the first index of each row's maximum (a NaN counts as the maximum, as in
//                  torch.max)
//
// The mean of squares is summed in another order than torch's, so a norm can differ from
// transformers' in the last bit of its fp32 statistics; float32 models keep torch's ops
// (engine.forward), so their greedy tokens stay identical to generate().

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

using namespace tierserve;

extern "C" {

void tierserve_add_rms_norm_bf16(uint16_t* x, const uint16_t* delta, const uint16_t* weight,
                                 uint16_t* out, int64_t rows, int64_t dim, float eps,
                                 int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t* xr = x + r * dim;
        uint16_t* o = out + r * dim;
        const uint16_t* dr = delta != nullptr ? delta + r * dim : nullptr;
        int64_t i = 0;
        float sum = 0.f;
#if TIERSERVE_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= dim; i += 16) {
            __m512 v = load16(xr + i);
            if (dr != nullptr) {
                v = round_bf16x16(_mm512_add_ps(v, load16(dr + i)));
                store16(xr + i, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        sum = _mm512_reduce_add_ps(acc);
#endif
        for (; i < dim; ++i) {
            float v = bf16_to_f32(xr[i]);
            if (dr != nullptr) {
                v = round_bf16(v + bf16_to_f32(dr[i]));
                xr[i] = f32_to_bf16(v);
            }
            sum += v * v;
        }
        const float scale = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
        i = 0;
#if TIERSERVE_AVX512
        const __m512 sv = _mm512_set1_ps(scale);
        for (; i + 16 <= dim; i += 16)
            store16(o + i, _mm512_mul_ps(load16(weight + i),
                                         round_bf16x16(_mm512_mul_ps(load16(xr + i), sv))));
#endif
        for (; i < dim; ++i)
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(xr[i]) * scale));
    }
}

void tierserve_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows,
                             int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* g = gate_up + r * 2 * inter;
        const uint16_t* u = g + inter;
        uint16_t* o = out + r * inter;
        int64_t i = 0;
#if TIERSERVE_AVX512
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= inter; i += 16) {
            const __m512 a = load16(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
            const __m512 s = round_bf16x16(_mm512_div_ps(a, _mm512_add_ps(one, e)));
            store16(o + i, _mm512_mul_ps(s, load16(u + i)));
        }
#endif
        for (; i < inter; ++i) {
            const float a = bf16_to_f32(g[i]);
            const float s = round_bf16(a / (1.f + std::exp(-a)));
            o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}

// qkv: [rows][(hq + 2 hkv) * d] (q heads, k heads, v heads), rows contiguous; cos, sin:
// [rows][d] bf16 (the model's rotary tables at each row's position). Rotates the q and k
// heads in place, then copies each row's k and v into the pool viewed as rows of
// [hkv][d]: K at slot_rows[r] + k_offset, V at slot_rows[r] + v_offset.
void tierserve_rope_store_bf16(uint16_t* qkv, int64_t rows, int64_t hq, int64_t hkv,
                               int64_t d, const uint16_t* cos, const uint16_t* sin,
                               uint16_t* pool, const int64_t* slot_rows, int64_t k_offset,
                               int64_t v_offset, int num_threads) {
    const int64_t half = d / 2, width = (hq + 2 * hkv) * d;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t* row = qkv + r * width;
        const uint16_t* c = cos + r * d;
        const uint16_t* s = sin + r * d;
        for (int64_t h = 0; h < hq + hkv; ++h) {
            uint16_t* x = row + h * d;
            int64_t i = 0;
#if TIERSERVE_AVX512
            for (; i + 16 <= half; i += 16) {
                const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
                const __m512 o1 = _mm512_add_ps(
                    round_bf16x16(_mm512_mul_ps(x1, load16(c + i))),
                    round_bf16x16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                load16(s + i))));
                const __m512 o2 = _mm512_add_ps(
                    round_bf16x16(_mm512_mul_ps(x2, load16(c + i + half))),
                    round_bf16x16(_mm512_mul_ps(x1, load16(s + i + half))));
                store16(x + i, o1);
                store16(x + i + half, o2);
            }
#endif
            for (; i < half; ++i) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                const float o1 = round_bf16(x1 * bf16_to_f32(c[i])) +
                                 round_bf16(-x2 * bf16_to_f32(s[i]));
                const float o2 = round_bf16(x2 * bf16_to_f32(c[i + half])) +
                                 round_bf16(x1 * bf16_to_f32(s[i + half]));
                x[i] = f32_to_bf16(o1);
                x[i + half] = f32_to_bf16(o2);
            }
        }
        const int64_t n = hkv * d;
        std::memcpy(pool + (slot_rows[r] + k_offset) * n, row + hq * d, n * sizeof(uint16_t));
        std::memcpy(pool + (slot_rows[r] + v_offset) * n, row + (hq + hkv) * d,
                    n * sizeof(uint16_t));
    }
}

void tierserve_argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                          int64_t* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float* v = x + r * row_stride;
        // the maximum first (vectorized), then its first position, or the first NaN's
        float m = v[0];
        bool nan = false;
        int64_t i = 0;
#if TIERSERVE_AVX512
        __m512 mv = _mm512_set1_ps(v[0]);
        __mmask16 any_nan = 0;
        for (; i + 16 <= cols; i += 16) {
            const __m512 a = _mm512_loadu_ps(v + i);
            any_nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            mv = _mm512_max_ps(mv, a);
        }
        m = _mm512_reduce_max_ps(mv);
        nan = any_nan != 0;
#endif
        for (; i < cols; ++i) {
            m = v[i] > m ? v[i] : m;
            nan |= v[i] != v[i];
        }
        int64_t index = 0;
        for (i = 0; i < cols; ++i) {
            if (nan ? v[i] != v[i] : v[i] == m) {
                index = i;
                break;
            }
        }
        out[r] = index;
    }
}

}  // extern "C"
