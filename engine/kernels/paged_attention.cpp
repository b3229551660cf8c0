// Paged attention on CPU: each query row attends to its sequence's keys through the block
// table, straight from the block-major pool (no gather, no padding, no mask tensor).
//
// Pool layout (engine/block_pool.py): kv[num_blocks][num_layers][2][block_size][Hkv][D].
// Row r of the queries (q + r * q_row_stride: [Hq][D]) belongs to sequence row_seq[r] and sits at position row_pos[r]: it
// attends to keys [lo, row_pos[r]] with lo = row_pos[r] - window + 1 (window > 0) or 0,
// i.e. causal attention, with a sliding window when one is given. The keys of the row's
// own step must already be in the pool (the caller writes K/V first).
//
// The query heads of one KV head are processed together (grouped-query attention), so each
// K and V row is read once per (query row, KV head). Scores are exact (two passes: scores,
// then softmax and the weighted sum of V), accumulated in fp32.
//
// Built and loaded by engine/kernels/__init__.py (g++ -O3 -march=native, OpenMP); plain C ABI.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>

#include "simd.h"

namespace {

using namespace tierserve;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return bf16_to_f32(x); }
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) { *out = f32_to_bf16(x); }

template <typename T>
inline const T* key_row(const T* kv, const int32_t* table, int64_t t, int64_t block_size,
                        int64_t block_stride, int64_t offset, int64_t token_stride) {
    return kv + table[t / block_size] * block_stride + offset + (t % block_size) * token_stride;
}

// One (query row, KV head) task: `groups` query heads of head_dim DIM (0: runtime head_dim).
template <typename T, int DIM>
void attend_task(const T* qrow, const T* kv, const int32_t* table, int64_t lo, int64_t n,
                 int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,
                 int64_t token_stride, int64_t groups, int64_t runtime_dim, float scale,
                 float* scores, int64_t score_stride, float* qf, float* acc, T* orow) {
    const int64_t D = DIM > 0 ? DIM : runtime_dim;
    for (int64_t i = 0; i < groups * D; ++i) qf[i] = to_float(qrow[i]) * scale;
#if TIERSERVE_AVX512
    if constexpr (DIM > 0 && DIM % 16 == 0) {
        constexpr int C = DIM / 16;
        // pass 1: scores
        for (int64_t j = 0; j < n; ++j) {
            const T* k = key_row(kv, table, lo + j, block_size, block_stride, k_offset,
                                 token_stride);
            __m512 kr[C];
            for (int c = 0; c < C; ++c) kr[c] = load16(k + 16 * c);
            for (int64_t g = 0; g < groups; ++g) {
                const float* qg = qf + g * DIM;
                __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), kr[0]);
                for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kr[c], s);
                scores[g * score_stride + j] = _mm512_reduce_add_ps(s);
            }
        }
        // softmax numerators and sums
        float inv[64];
        for (int64_t g = 0; g < groups; ++g) {
            float* s = scores + g * score_stride;
            float m = s[0];
            for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
            const __m512 mv = _mm512_set1_ps(m);
            __m512 sum = _mm512_setzero_ps();
            int64_t j = 0;
            for (; j + 16 <= n; j += 16) {
                const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
                _mm512_storeu_ps(s + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            if (j < n) {
                const __mmask16 mask = static_cast<__mmask16>((1u << (n - j)) - 1u);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), mv));
                _mm512_mask_storeu_ps(s + j, mask, e);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
            }
            inv[g] = 1.f / _mm512_reduce_add_ps(sum);
        }
        // pass 2: weighted sum of V
        __m512 a[8][C];
        for (int64_t g = 0; g < groups; ++g)
            for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            const T* v = key_row(kv, table, lo + j, block_size, block_stride, v_offset,
                                 token_stride);
            __m512 vr[C];
            for (int c = 0; c < C; ++c) vr[c] = load16(v + 16 * c);
            for (int64_t g = 0; g < groups; ++g) {
                const __m512 p = _mm512_set1_ps(scores[g * score_stride + j]);
                for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(p, vr[c], a[g][c]);
            }
        }
        for (int64_t g = 0; g < groups; ++g) {
            const __m512 iv = _mm512_set1_ps(inv[g]);
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * DIM + 16 * c, _mm512_mul_ps(a[g][c], iv));
        }
        for (int64_t i = 0; i < groups * DIM; ++i) from_float(acc[i], orow + i);
        return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
        const T* k = key_row(kv, table, lo + j, block_size, block_stride, k_offset, token_stride);
        for (int64_t g = 0; g < groups; ++g) {
            const float* qg = qf + g * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(k[d]);
            scores[g * score_stride + j] = s;
        }
    }
    for (int64_t i = 0; i < groups * D; ++i) acc[i] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
        float* s = scores + g * score_stride;
        float m = s[0];
        for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
        const float inv = 1.f / sum;
        float* a = acc + g * D;
        for (int64_t j = 0; j < n; ++j) {
            const T* v = key_row(kv, table, lo + j, block_size, block_stride, v_offset,
                                 token_stride);
            const float p = s[j] * inv;
            for (int64_t d = 0; d < D; ++d) a[d] += p * to_float(v[d]);
        }
    }
    for (int64_t i = 0; i < groups * D; ++i) from_float(acc[i], orow + i);
}

template <typename T>
void attend(const T* q, int64_t q_row_stride, const T* kv, int64_t block_stride,
            int64_t layer_offset, int64_t v_offset, int64_t token_stride, const int32_t* block_tables,
            int64_t table_stride, const int32_t* row_seq, const int32_t* row_pos,
            int64_t num_rows, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, int64_t window, float scale, T* out, int num_threads) {
    const int64_t groups = num_q_heads / num_kv_heads;
    const int64_t num_tasks = num_rows * num_kv_heads;
    int64_t max_keys = 1;
    for (int64_t r = 0; r < num_rows; ++r) max_keys = std::max<int64_t>(max_keys, row_pos[r] + 1);
    if (window > 0) max_keys = std::min(max_keys, window);
    const int64_t score_stride = (max_keys + 15) / 16 * 16;
    const bool fast = groups <= 8 && (head_dim == 64 || head_dim == 128);

#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores(groups * score_stride);
        std::vector<float> qf(groups * head_dim), acc(groups * head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
            const int64_t pos = row_pos[r];
            const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
            const int32_t* table = block_tables + row_seq[r] * table_stride;
            const T* qrow = q + r * q_row_stride + h * groups * head_dim;
            T* orow = out + (r * num_q_heads + h * groups) * head_dim;
            const int64_t kof = layer_offset + h * head_dim, vof = kof + v_offset;
            if (fast && head_dim == 64)
                attend_task<T, 64>(qrow, kv, table, lo, pos - lo + 1, block_size, block_stride,
                                   kof, vof, token_stride, groups, head_dim, scale,
                                   scores.data(), score_stride, qf.data(), acc.data(), orow);
            else if (fast)
                attend_task<T, 128>(qrow, kv, table, lo, pos - lo + 1, block_size, block_stride,
                                    kof, vof, token_stride, groups, head_dim, scale,
                                    scores.data(), score_stride, qf.data(), acc.data(), orow);
            else
                attend_task<T, 0>(qrow, kv, table, lo, pos - lo + 1, block_size, block_stride,
                                  kof, vof, token_stride, groups, head_dim, scale,
                                  scores.data(), score_stride, qf.data(), acc.data(), orow);
        }
    }
}

}  // namespace

extern "C" {

int tierserve_kernels_version() { return 2; }

#define TIERSERVE_ATTENTION(NAME, T)                                                       \
    void NAME(const void* q, int64_t q_row_stride, const void* kv, int64_t block_stride,   \
              int64_t layer_offset, int64_t v_offset, int64_t token_stride,                \
              const int32_t* block_tables, int64_t table_stride, const int32_t* row_seq,   \
              const int32_t* row_pos, int64_t num_rows, int64_t num_q_heads,               \
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,  \
              float scale, void* out, int num_threads) {                                   \
        attend<T>(static_cast<const T*>(q), q_row_stride, static_cast<const T*>(kv),       \
                  block_stride, layer_offset, v_offset, token_stride, block_tables,        \
                  table_stride, row_seq, row_pos, num_rows, num_q_heads, num_kv_heads,     \
                  head_dim, block_size, window, scale, static_cast<T*>(out), num_threads); \
    }

TIERSERVE_ATTENTION(tierserve_paged_attention_f32, float)
TIERSERVE_ATTENTION(tierserve_paged_attention_bf16, uint16_t)

}  // extern "C"
