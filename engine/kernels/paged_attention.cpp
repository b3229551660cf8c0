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
#elif TIERSERVE_AVX2
    if constexpr (DIM > 0 && DIM % 8 == 0) {
        // The same two passes with 8-wide vectors (AVX2 + FMA CPUs): pass 1 reads each K
        // row once for all `groups` heads; pass 2 runs one head at a time, so its DIM / 8
        // accumulators stay in the 16 vector registers.
        constexpr int C = DIM / 8;
        for (int64_t j = 0; j < n; ++j) {
            const T* k = key_row(kv, table, lo + j, block_size, block_stride, k_offset,
                                 token_stride);
            __m256 kr[C];
            for (int c = 0; c < C; ++c) kr[c] = load8(k + 8 * c);
            for (int64_t g = 0; g < groups; ++g) {
                const float* qg = qf + g * DIM;
                __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qg), kr[0]);
                __m256 s1 = _mm256_setzero_ps();
                for (int c = 1; c < C; ++c) {
                    if (c & 1) s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), kr[c], s1);
                    else s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), kr[c], s0);
                }
                scores[g * score_stride + j] = hsum8(_mm256_add_ps(s0, s1));
            }
        }
        for (int64_t g = 0; g < groups; ++g) {
            float* s = scores + g * score_stride;
            float m = s[0];
            for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
            const __m256 mv = _mm256_set1_ps(m);
            __m256 sum = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
                _mm256_storeu_ps(s + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            float tail = 0.f;
            for (; j < n; ++j) { s[j] = std::exp(s[j] - m); tail += s[j]; }
            const __m256 inv = _mm256_set1_ps(1.f / (hsum8(sum) + tail));
            __m256 a[C];
            for (int c = 0; c < C; ++c) a[c] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; ++t) {
                const T* v = key_row(kv, table, lo + t, block_size, block_stride, v_offset,
                                     token_stride);
                const __m256 p = _mm256_set1_ps(s[t]);
                for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(p, load8(v + 8 * c), a[c]);
            }
            for (int c = 0; c < C; ++c)
                _mm256_storeu_ps(acc + g * DIM + 8 * c, _mm256_mul_ps(a[c], inv));
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


#if defined(__AVX512BF16__) && TIERSERVE_AVX512
// The bf16 path on CPUs with AVX512-BF16: one task per query row covers all of its KV
// heads, so a block's K (and then V) rows are read front to back once; q.k by VDPBF16PS
// on the pool's own layout, the 16 keys of a tile reduced together (a transpose-and-add
// butterfly instead of 16 horizontal sums); P.V by VDPBF16PS on pairs of V rows
// interleaved in registers (unpack lo/hi: the output lanes come out in a fixed
// permutation, undone at the store). P is rounded to bf16 for P.V, as in flash attention.

// 16 vectors -> one vector of their 16 horizontal sums. Lane 4a + b holds the sum of
// v[4b + a] (a 4x4 transpose: the caller stores key i's products in v[(i % 4) * 4 + i / 4]).
inline __m512 reduce16(__m512 v[16]) {
    // level 1: pairs (2i, 2i+1) -> 8 vectors, each lane block of 256 bits half-summed
    __m512 a[8];
    for (int i = 0; i < 8; ++i) {
        const __m512 x = v[2 * i], y = v[2 * i + 1];
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    // now a[i] = [x01 | x23 | y01 | y23] in 128-bit blocks where x01 = x.b0 + x.b2 etc.
    __m512 b[4];
    for (int i = 0; i < 4; ++i) {
        const __m512 x = a[2 * i], y = a[2 * i + 1];
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    }
    // b[i]: 4 blocks of 128 bits, one per source vector (order v4i, v4i+1, v4i+2, v4i+3),
    // each still 4 lanes to sum
    __m512 c[2];
    for (int i = 0; i < 2; ++i) {
        const __m512 x = b[2 * i], y = b[2 * i + 1];
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    }
    const __m512 x = c[0], y = c[1];
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

template <int D>
void attend_rows_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv,
                      int64_t block_stride, int64_t layer_offset, int64_t v_offset,
                      int64_t token_stride, const int32_t* block_tables, int64_t table_stride,
                      const int32_t* row_seq, const int32_t* row_pos, int64_t num_rows,
                      int64_t num_q_heads, int64_t num_kv_heads, int64_t block_size,
                      int64_t window, float scale, uint16_t* out, int num_threads) {
    constexpr int C2 = D / 32;             // zmm of bf16 per head row
    constexpr int GB = 24 / (D / 16);      // query heads whose P.V accumulators fit registers
    const int64_t groups = num_q_heads / num_kv_heads;
    int64_t max_keys = 1;
    for (int64_t r = 0; r < num_rows; ++r) max_keys = std::max<int64_t>(max_keys, row_pos[r] + 1);
    if (window > 0) max_keys = std::min(max_keys, window + 15);
    const int64_t stride = (max_keys + 31) / 16 * 16 + 16;  // tiles from lo rounded down
    // rows split over heads when there are fewer rows than threads (batch 1)
    const int64_t split = num_rows < num_threads ? num_kv_heads : 1;
    const int64_t heads_per_task = num_kv_heads / split;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);

#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores(num_q_heads * stride);
        std::vector<uint16_t> probs(num_q_heads * stride + 32);
        std::vector<const uint16_t*> keys(stride);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_rows * split; ++task) {
            const int64_t r = task / split;
            const int64_t h0 = (task % split) * heads_per_task, h1 = h0 + heads_per_task;
            const int64_t pos = row_pos[r];
            const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
            const int64_t j0 = lo / 16 * 16, num_tiles = (pos - j0) / 16 + 1;
            const int64_t n = num_tiles * 16;  // keys j0 .. j0 + n - 1, masked outside [lo, pos]
            const int32_t* table = block_tables + row_seq[r] * table_stride;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t j = std::min(std::max(j0 + i, lo), pos);  // valid address
                keys[i] = kv + table[j / block_size] * block_stride + layer_offset +
                          (j % block_size) * token_stride;
            }
            const uint16_t* qrow = q + r * q_row_stride;
            // pass 1: scores, masked, scaled
            for (int64_t t = 0; t < num_tiles; ++t) {
                const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j0 + 16 * t)), lane);
                const __mmask16 ok =
                    _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos))) &
                    _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo)));
                for (int64_t h = h0; h < h1; ++h) {
                    for (int64_t g = 0; g < groups; ++g) {
                        const int64_t qh = h * groups + g;
                        __m512bh qv[C2];
                        for (int c = 0; c < C2; ++c)
                            qv[c] = (__m512bh)_mm512_loadu_si512(qrow + qh * D + 32 * c);
                        __m512 acc[16];
                        for (int i = 0; i < 16; ++i) {
                            const uint16_t* k = keys[16 * t + i] + h * D;
                            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                                        (__m512bh)_mm512_loadu_si512(k));
                            for (int c = 1; c < C2; ++c)
                                a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
                            acc[(i % 4) * 4 + i / 4] = a;
                        }
                        const __m512 sv = reduce16(acc);
                        _mm512_storeu_ps(scores.data() + qh * stride + 16 * t,
                                         _mm512_mask_mul_ps(neg_inf, ok, sv, _mm512_set1_ps(scale)));
                    }
                }
            }
            // softmax: bf16 probabilities (masked keys 0) and 1 / sum per query head
            float inv[64 * 8];
            for (int64_t h = h0; h < h1; ++h)
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t qh = h * groups + g;
                    float* s = scores.data() + qh * stride;
                    __m512 mv = neg_inf;
                    for (int64_t i = 0; i < n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
                    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
                    __m512 sum = _mm512_setzero_ps();
                    uint16_t* pr = probs.data() + qh * stride;
                    for (int64_t i = 0; i < n; i += 16) {
                        const __m512 e = round_bf16x16(exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m)));
                        sum = _mm512_add_ps(sum, e);
                        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + i), to_bf16x16(e));
                    }
                    inv[qh] = 1.f / _mm512_reduce_add_ps(sum);
                }
            // pass 2: P.V over pairs of keys
            for (int64_t h = h0; h < h1; ++h) {
                for (int64_t gb = 0; gb < groups; gb += GB) {
                    const int64_t ng = std::min<int64_t>(GB, groups - gb);
                    __m512 acc[GB][2 * C2];
                    for (int g = 0; g < GB; ++g)
                        for (int c = 0; c < 2 * C2; ++c) acc[g][c] = _mm512_setzero_ps();
                    for (int64_t i = 0; i < n; i += 2) {
                        const uint16_t* va = keys[i] + v_offset + h * D;
                        const uint16_t* vb = keys[i + 1] + v_offset + h * D;
                        __m512bh pairs[2 * C2];
                        for (int c = 0; c < C2; ++c) {
                            const __m512i x = _mm512_loadu_si512(va + 32 * c);
                            const __m512i y = _mm512_loadu_si512(vb + 32 * c);
                            pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                            pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
                        }
                        for (int g = 0; g < GB; ++g) {
                            if (g >= ng) break;
                            const uint16_t* pr = probs.data() + (h * groups + gb + g) * stride + i;
                            uint32_t pp;
                            std::memcpy(&pp, pr, sizeof pp);
                            const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp));
                            for (int c = 0; c < 2 * C2; ++c)
                                acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pv, pairs[c]);
                        }
                    }
                    for (int g = 0; g < ng; ++g) {
                        const int64_t qh = h * groups + gb + g;
                        alignas(64) float tmp[2 * C2][16];
                        const __m512 iv = _mm512_set1_ps(inv[qh]);
                        for (int c = 0; c < 2 * C2; ++c) _mm512_store_ps(tmp[c], _mm512_mul_ps(acc[g][c], iv));
                        uint16_t* o = out + r * num_q_heads * D + qh * D;
                        // unpack lo/hi lane order: in 128-bit block L, lo holds d = 8L..8L+3
                        // and hi d = 8L+4..8L+7 of each 32-wide chunk
                        for (int c = 0; c < C2; ++c)
                            for (int i = 0; i < 16; ++i) {
                                const int L = i / 4, m = i % 4;
                                o[32 * c + 8 * L + m] = f32_to_bf16(tmp[2 * c][i]);
                                o[32 * c + 8 * L + 4 + m] = f32_to_bf16(tmp[2 * c + 1][i]);
                            }
                    }
                }
            }
        }
    }
}
#endif

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
TIERSERVE_ATTENTION(tierserve_paged_attention_bf16_generic, uint16_t)

void tierserve_paged_attention_bf16(const void* q, int64_t q_row_stride, const void* kv,
                                    int64_t block_stride, int64_t layer_offset,
                                    int64_t v_offset, int64_t token_stride,
                                    const int32_t* block_tables, int64_t table_stride,
                                    const int32_t* row_seq, const int32_t* row_pos,
                                    int64_t num_rows, int64_t num_q_heads,
                                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t window, float scale, void* out, int num_threads) {
#if defined(__AVX512BF16__) && TIERSERVE_AVX512
    if ((head_dim == 64 || head_dim == 128) && num_q_heads <= 512 && q_row_stride % 2 == 0) {
        auto* qb = static_cast<const uint16_t*>(q);
        auto* kvb = static_cast<const uint16_t*>(kv);
        auto* ob = static_cast<uint16_t*>(out);
        if (head_dim == 64)
            attend_rows_bf16<64>(qb, q_row_stride, kvb, block_stride, layer_offset, v_offset,
                                 token_stride, block_tables, table_stride, row_seq, row_pos,
                                 num_rows, num_q_heads, num_kv_heads, block_size, window, scale,
                                 ob, num_threads);
        else
            attend_rows_bf16<128>(qb, q_row_stride, kvb, block_stride, layer_offset, v_offset,
                                  token_stride, block_tables, table_stride, row_seq, row_pos,
                                  num_rows, num_q_heads, num_kv_heads, block_size, window,
                                  scale, ob, num_threads);
        return;
    }
#endif
    tierserve_paged_attention_bf16_generic(q, q_row_stride, kv, block_stride, layer_offset,
                                           v_offset, token_stride, block_tables, table_stride,
                                           row_seq, row_pos, num_rows, num_q_heads,
                                           num_kv_heads, head_dim, block_size, window, scale,
                                           out, num_threads);
}

}  // extern "C"
