// Causal attention of one prefill chunk over the paged pool, bfloat16, AVX512-BF16.
//
// Why: torch's CPU flash attention runs ~55 GFLOP/s in bf16 on a 2,000-token prompt (its
// small per-head GEMMs go through a generic path) and a chunk with a cached prefix needs
// its blocks gathered first; a 2k prefill of a small model spent ~45% of its time there.
//
// How: for each KV head, the chunk's keys (prefix and chunk, read through the block
// table; the caller has written the chunk's K and V into the pool) are packed once into
// the pair-interleaved layout VDPBF16PS wants: K as [tile of 16 keys][D/2 pairs][16 keys]
// so one instruction adds a d-pair's products to 16 keys' scores, V as [key pair][D/16]
// [16 d][2 keys]. Query rows (token, query head of this KV head) go in groups of RG whose
// output stays in registers over all key tiles, with an online softmax in fp32 (P is
// rounded to bf16 for the P.V products, as torch's flash kernel does).
//
// Query t (position first_pos + t) attends keys [lo, first_pos + t], lo = pos - window + 1
// with a sliding window, else 0.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

#if defined(__AVX512BF16__) && TIERSERVE_AVX512

namespace {

using namespace tierserve;

constexpr int TK = 16;  // keys per tile

inline uint32_t pair_at(const uint16_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <int D>
void attend_chunk(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv,
                  int64_t block_stride, int64_t layer_offset, int64_t v_offset,
                  int64_t token_stride, const int32_t* table, int64_t num_queries,
                  int64_t first_pos, int64_t hq, int64_t hkv, int64_t block_size,
                  int64_t window, float scale, uint16_t* out, int64_t out_row_stride,
                  int num_threads) {
    constexpr int C = D / 16;        // zmm per row of D
    constexpr int RG = 24 / C;       // query rows per group (their output in registers)
    const int64_t groups = hq / hkv;
    const int64_t num_keys = first_pos + num_queries;
    const int64_t num_tiles = (num_keys + TK - 1) / TK;
    const int64_t padded = num_tiles * TK;
    // packed K and V of every head: [hkv][tiles][D/2][16] and [hkv][padded/2][C][16][2]
    std::vector<uint32_t> kpack(hkv * padded * (D / 2));
    std::vector<uint16_t> vpack(hkv * padded * D);

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t h = 0; h < hkv; ++h) {
        uint32_t* kp = kpack.data() + h * padded * (D / 2);
        uint16_t* vp = vpack.data() + h * padded * D;
        for (int64_t j = 0; j < padded; ++j) {
            const int64_t tile = j / TK, jj = j % TK;
            uint32_t* kdst = kp + tile * (D / 2) * TK + jj;
            const int64_t pair = j / 2, odd = j % 2;
            uint16_t* vdst = vp + pair * D * 2 + odd;
            if (j < num_keys) {
                const uint16_t* src = kv + table[j / block_size] * block_stride + layer_offset +
                                      (j % block_size) * token_stride + h * D;
                for (int p = 0; p < D / 2; ++p) kdst[p * TK] = pair_at(src + 2 * p);
                const uint16_t* vsrc = src + v_offset;
                for (int d = 0; d < D; ++d) vdst[d * 2] = vsrc[d];
            } else {
                for (int p = 0; p < D / 2; ++p) kdst[p * TK] = 0;
                for (int d = 0; d < D; ++d) vdst[d * 2] = 0;
            }
        }
    }

    const int64_t rows_per_head = num_queries * groups;
    const int64_t groups_per_head = (rows_per_head + RG - 1) / RG;
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512 scale_v = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < hkv * groups_per_head; ++task) {
        const int64_t h = task / groups_per_head;
        const int64_t r0 = (task % groups_per_head) * RG;
        const int nr = static_cast<int>(std::min<int64_t>(RG, rows_per_head - r0));
        const uint32_t* kp = kpack.data() + h * padded * (D / 2);
        const uint16_t* vp = vpack.data() + h * padded * D;
        const uint16_t* qrow[RG];
        uint16_t* orow[RG];
        int64_t pos[RG], lo[RG];
        int64_t lo_min = num_keys, pos_max = 0;
        for (int i = 0; i < RG; ++i) {
            const int64_t r = r0 + std::min(i, nr - 1);  // short group: repeat the last row
            const int64_t t = r / groups, g = r % groups;
            qrow[i] = q + t * q_row_stride + (h * groups + g) * D;
            orow[i] = out + t * out_row_stride + (h * groups + g) * D;
            pos[i] = first_pos + t;
            lo[i] = window > 0 ? std::max<int64_t>(0, pos[i] - window + 1) : 0;
            lo_min = std::min(lo_min, lo[i]);
            pos_max = std::max(pos_max, pos[i]);
        }
        __m512 acc[RG][C];
        float m[RG], l[RG];
        for (int i = 0; i < RG; ++i) {
            m[i] = -INFINITY;
            l[i] = 0.f;
            for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
        }
        alignas(64) uint16_t pbuf[RG][TK];
        for (int64_t tile = lo_min / TK; tile <= pos_max / TK; ++tile) {
            const uint32_t* kt = kp + tile * (D / 2) * TK;
            __m512 s[RG];
            for (int i = 0; i < RG; ++i) s[i] = _mm512_setzero_ps();
            for (int p = 0; p < D / 2; ++p) {
                const __m512bh kv2 = (__m512bh)_mm512_loadu_si512(kt + p * TK);
                for (int i = 0; i < RG; ++i) {
                    const __m512bh qb = (__m512bh)_mm512_set1_epi32(
                        static_cast<int>(pair_at(qrow[i] + 2 * p)));
                    s[i] = _mm512_dpbf16_ps(s[i], qb, kv2);
                }
            }
            const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(tile * TK)), lane);
            bool any = false;
            for (int i = 0; i < RG; ++i) {
                const __mmask16 ok =
                    _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos[i]))) &
                    _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo[i])));
                const __m512 sc = _mm512_mask_mul_ps(neg_inf, ok, s[i], scale_v);
                const float tile_max = _mm512_reduce_max_ps(sc);
                if (ok == 0) {
                    std::memset(pbuf[i], 0, sizeof pbuf[i]);
                    continue;
                }
                any = true;
                const float m_new = std::max(m[i], tile_max);
                const float correction = std::exp(m[i] - m_new);  // 0 on the first tile
                const __m512 p = _mm512_maskz_mov_ps(ok, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
                l[i] = l[i] * correction + _mm512_reduce_add_ps(p);
                m[i] = m_new;
                const __m512 cv = _mm512_set1_ps(correction);
                for (int c = 0; c < C; ++c) acc[i][c] = _mm512_mul_ps(acc[i][c], cv);
                _mm256_store_si256(reinterpret_cast<__m256i*>(pbuf[i]), to_bf16x16(p));
            }
            if (!any) continue;
            const uint16_t* vt = vp + tile * TK * D;
            for (int k = 0; k < TK / 2; ++k) {
                __m512bh vv[C];
                for (int c = 0; c < C; ++c)
                    vv[c] = (__m512bh)_mm512_loadu_si512(vt + (k * C + c) * 32);
                for (int i = 0; i < RG; ++i) {
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32(
                        static_cast<int>(pair_at(pbuf[i] + 2 * k)));
                    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pb, vv[c]);
                }
            }
        }
        for (int i = 0; i < nr; ++i) {
            const __m512 inv = _mm512_set1_ps(1.f / l[i]);
            for (int c = 0; c < C; ++c) store16(orow[i] + 16 * c, _mm512_mul_ps(acc[i][c], inv));
        }
    }
}

}  // namespace

extern "C" {

// Returns 0 when done, -1 for a head_dim it has no kernel for (64 and 128 only).
int tierserve_prefill_attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv,
                                     int64_t block_stride, int64_t layer_offset,
                                     int64_t v_offset, int64_t token_stride,
                                     const int32_t* table, int64_t num_queries,
                                     int64_t first_pos, int64_t num_q_heads,
                                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                     int64_t window, float scale, uint16_t* out,
                                     int64_t out_row_stride, int num_threads) {
    if (head_dim == 64)
        attend_chunk<64>(q, q_row_stride, kv, block_stride, layer_offset, v_offset, token_stride,
                         table, num_queries, first_pos, num_q_heads, num_kv_heads, block_size,
                         window, scale, out, out_row_stride, num_threads);
    else if (head_dim == 128)
        attend_chunk<128>(q, q_row_stride, kv, block_stride, layer_offset, v_offset, token_stride,
                          table, num_queries, first_pos, num_q_heads, num_kv_heads, block_size,
                          window, scale, out, out_row_stride, num_threads);
    else
        return -1;
    return 0;
}

}  // extern "C"

#endif
