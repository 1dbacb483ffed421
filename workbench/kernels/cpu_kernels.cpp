// CPU kernels for the eager decode and verify steps (workbench/kernels/cpu.py builds and loads this).
//
// At the embedded pair's size an eager step is a few hundred small operations, and torch's bf16
// linear on such shapes costs 20-90 us a call (oneDNN reorders the weights on every call), so the
// step is overhead, not arithmetic. These kernels do a layer's pieces in a handful of calls:
//
//   wb_linear     y = x W^T (+ residual), W packed once into blocks of 16 outputs
//   wb_rms_norm   RMSNorm, statistics in fp32
//   wb_rope       rotary embedding from a projection's two halves
//   wb_attention  absorbed-MLA attention of T new tokens over one sequence's latent cache rows
//   wb_moe_route  DeepSeek-V3 routing (sigmoid, bias, group-limited top-k) to dense weights
//   wb_swiglu     silu(gate) * up, times a routing weight per group
//   wb_row_stats  each logit row's max, first argmax and log-sum-exp (greedy steps, probabilities)
//   wb_mla_block  a whole absorbed-MLA attention (projections, norms, RoPE, cache write, attention)
//   wb_ffn_block  a whole SwiGLU MLP or dense-expert MoE (routing, experts, shared experts)
//   wb_eagle_chain  an EAGLE-3 draft's greedy chain: the first pass, k-1 more, each head's argmax
// The two blocks only sequence the kernels above over scratch buffers, so that a layer is two
// calls from Python instead of a dozen (at this size the calls, not the arithmetic, are the cost).
//
// Every output row is computed alone, in the same order, whatever the number of rows in the
// call: a one-token decode and a (k+1)-token verify give each row the same bits, so greedy
// speculative output equals plain decoding exactly in bf16 as in fp32.
//
// Element types: 0 = fp32, 1 = bf16 (raw uint16 bits). bf16 results are rounded to nearest even
// once from an fp32 accumulator, as a bf16 GEMM with fp32 accumulation does. Built only for
// AVX-512 CPUs (wb_isa() < 1 elsewhere, and the Python side then uses torch's own operations).
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define WB_AVX512 1
#else
#define WB_AVX512 0
#endif

extern "C" int wb_isa() {
#if WB_AVX512 && defined(__AVX512BF16__)
    return 2;
#elif WB_AVX512
    return 1;
#else
    return 0;
#endif
}

#if WB_AVX512
namespace {

inline float bf16_to_f32(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

inline float load(const void* p, int dtype, size_t i) {
    return dtype ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline float round_to(float v, int dtype) { return dtype ? bf16_to_f32(f32_to_bf16(v)) : v; }

inline void store(void* p, int dtype, size_t i, float v) {
    if (dtype) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else static_cast<float*>(p)[i] = v;
}

inline __m512 load16(const void* p, int dtype, size_t i) {  // 16 values as fp32
    if (dtype) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

inline __m512 load16m(const void* p, int dtype, size_t i, __mmask16 m) {  // masked lanes read as 0
    if (dtype) {
        __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
}

inline __mmask16 tail_mask(int left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

void store16(void* p, int dtype, size_t i, __m512 v, __mmask16 m) {
    if (dtype) {  // round to nearest even (NaN kept quiet), as torch's float -> bfloat16
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, _mm512_cvtepi32_epi16(r));
    } else {
        _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, v);
    }
}

inline __m512 round16(__m512 v, int dtype) {  // v rounded to dtype and back to fp32
    if (!dtype) return v;
    alignas(64) uint16_t b[16];
    store16(b, 1, 0, v, 0xffff);
    return load16(b, 1, 0);
}

// exp for x <= 0 (softmax after subtracting the max): 2^n * p(r), |r| <= ln2/2, degree-6
// polynomial; relative error ~2e-7. Inputs below -87 give 0 (exp(-87) ~ 1.6e-38).
inline __m512 exp_neg(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(p, n));
}

// ---- linear -------------------------------------------------------------------------------
// fp32 W is packed [N/16][K][16]; bf16 W [N/16][K/2][16][2] (k-pairs per lane, vdpbf16ps's
// layout; K is padded to even). Tiles of NB blocks (16*NB outputs) by up to 4 rows: the
// weights are read once for those rows, each output accumulates over k in order.
constexpr int NB = 4;

template <int MB, int B>
void tile_f32(const float* __restrict w, size_t bstride, const float* __restrict x, int K, __m512 (&acc)[4][NB]) {
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < B; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int k = 0; k < K; ++k) {
        __m512 wv[B];
        for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_ps(w + b * bstride + size_t(k) * 16);
        for (int m = 0; m < MB; ++m) {
            const __m512 xv = _mm512_set1_ps(x[size_t(m) * K + k]);
            for (int b = 0; b < B; ++b) acc[m][b] = _mm512_fmadd_ps(wv[b], xv, acc[m][b]);
        }
    }
}

template <int MB, int B>
void tile_bf16(const uint16_t* __restrict w, size_t bstride, const uint16_t* __restrict x, int K,
               __m512 (&acc)[4][NB]) {
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < B; ++b) acc[m][b] = _mm512_setzero_ps();
    const int K2 = K / 2;
    for (int kk = 0; kk < K2; ++kk) {
        __m512i wv[B];
        for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + b * bstride + size_t(kk) * 32);
        for (int m = 0; m < MB; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + size_t(m) * K + 2 * kk, 4);
            const __m512i xv = _mm512_set1_epi32(pair);
#if defined(__AVX512BF16__)
            for (int b = 0; b < B; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)wv[b], (__m512bh)xv);
#else  // the same pairs, k then k+1, each an fp32 fma
            const __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));
            const __m512 x1 = _mm512_castsi512_ps(_mm512_and_si512(xv, _mm512_set1_epi32(int(0xffff0000u))));
            for (int b = 0; b < B; ++b) {
                const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(wv[b], 16));
                const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(wv[b], _mm512_set1_epi32(int(0xffff0000u))));
                acc[m][b] = _mm512_fmadd_ps(w1, x1, _mm512_fmadd_ps(w0, x0, acc[m][b]));
            }
#endif
        }
    }
}

template <int MB, int B>
void run_tile(const void* w, size_t bstride, const void* x, int K, int dtype, __m512 (&acc)[4][NB]) {
    if (dtype) tile_bf16<MB, B>(static_cast<const uint16_t*>(w), bstride, static_cast<const uint16_t*>(x), K, acc);
    else tile_f32<MB, B>(static_cast<const float*>(w), bstride, static_cast<const float*>(x), K, acc);
}

template <int MB>
void run_rows(const void* w, size_t bstride, const void* x, int K, int dtype, int blocks, __m512 (&acc)[4][NB]) {
    switch (blocks) {
        case 1: run_tile<MB, 1>(w, bstride, x, K, dtype, acc); break;
        case 2: run_tile<MB, 2>(w, bstride, x, K, dtype, acc); break;
        case 3: run_tile<MB, 3>(w, bstride, x, K, dtype, acc); break;
        default: run_tile<MB, 4>(w, bstride, x, K, dtype, acc); break;
    }
}

}  // namespace
#endif

extern "C" {

// y [M, N] = x [M, K] W^T (+ residual [M, N]); x, y, residual are row-major in `dtype`; K even for bf16.
int wb_linear(const void* w, const void* x, void* y, const void* residual, int M, int N, int K, int dtype) {
#if WB_AVX512
    const size_t esize = dtype ? 2 : 4;
    const size_t bstride = size_t(K) * 16;  // elements per 16-output block
    const int nblk = (N + 15) / 16;
    for (int b0 = 0; b0 < nblk; b0 += NB) {
        const int blocks = nblk - b0 < NB ? nblk - b0 : NB;
        const char* wp = static_cast<const char*>(w) + size_t(b0) * bstride * esize;
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int mb = M - m0 < 4 ? M - m0 : 4;
            const char* xp = static_cast<const char*>(x) + size_t(m0) * K * esize;
            __m512 acc[4][NB];
            switch (mb) {
                case 1: run_rows<1>(wp, bstride, xp, K, dtype, blocks, acc); break;
                case 2: run_rows<2>(wp, bstride, xp, K, dtype, blocks, acc); break;
                case 3: run_rows<3>(wp, bstride, xp, K, dtype, blocks, acc); break;
                default: run_rows<4>(wp, bstride, xp, K, dtype, blocks, acc); break;
            }
            for (int m = 0; m < mb; ++m)
                for (int b = 0; b < blocks; ++b) {
                    const int n0 = (b0 + b) * 16;
                    const __mmask16 mask = tail_mask(N - n0);
                    const size_t at = size_t(m0 + m) * N + n0;
                    __m512 v = acc[m][b];
                    if (residual) {  // rounded, then added and rounded: `h + linear(x)` in dtype
                        alignas(64) float f[16];
                        _mm512_store_ps(f, v);
                        for (int l = 0; l < 16; ++l)
                            if (mask >> l & 1) f[l] = round_to(f[l], dtype) + load(residual, dtype, at + l);
                        v = _mm512_load_ps(f);
                    }
                    store16(y, dtype, at, v, mask);
                }
        }
    }
    return 0;
#else
    return -1;
#endif
}

// y [M, H] = weight * round(x * rsqrt(mean(x^2) + eps)): RMSNorm as workbench/models/norm.py
// computes it. x rows are x_stride elements apart, y rows y_stride (y may be a cache row's slice).
int wb_rms_norm(const void* x, long x_stride, const void* weight, void* y, long y_stride, int M, int H, float eps,
                int dtype) {
#if WB_AVX512
    for (int m = 0; m < M; ++m) {
        const size_t row = size_t(m) * x_stride, out = size_t(m) * y_stride;
        __m512 ss = _mm512_setzero_ps();
        for (int h = 0; h < H; h += 16) {
            const __m512 v = load16m(x, dtype, row + h, tail_mask(H - h));
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(H) + eps);
        for (int h = 0; h < H; ++h)
            store(y, dtype, out + h, round_to(load(x, dtype, row + h) * inv, dtype) * load(weight, dtype, h));
    }
    return 0;
#else
    return -1;
#endif
}

// RoPE from a projection's two halves (RotaryEmbedding.as_rows): y = a * cos + b * sin, each
// product and the sum rounded in dtype as torch's `a * cos + b * sin` rounds them. a and b are
// [T, N, R] with ab_stride elements between tokens (heads contiguous), cos and sin [T, R],
// y [T, N, R] with y_stride between tokens (y may be a cache row's slice).
int wb_rope(const void* a, const void* b, long ab_stride, const void* cos, const void* sin, void* y, long y_stride,
            int T, int N, int R, int dtype) {
#if WB_AVX512
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < N; ++h)
            for (int r = 0; r < R; ++r) {
                const size_t i = size_t(t) * ab_stride + size_t(h) * R + r, c = size_t(t) * R + r;
                const float v = round_to(load(a, dtype, i) * load(cos, dtype, c), dtype) +
                                round_to(load(b, dtype, i) * load(sin, dtype, c), dtype);
                store(y, dtype, size_t(t) * y_stride + size_t(h) * R + r, v);
            }
    return 0;
#else
    return -1;
#endif
}

// Absorbed MLA over one sequence: q_lat [T, N, L], q_pe [T, N, R] (q_stride / pe_stride elements
// between tokens, heads contiguous within), cache rows [>= start+T, L+R]; new token t sits at
// position start+t and sees rows 0..start+t. out [T, N, L] in dtype.
// score = scale * (q_lat . c_kv + q_pe . k_pe); softmax in fp32; out = sum_j p_j c_kv_j / sum_j p_j.
int wb_attention(const void* q_lat, const void* q_pe, long q_stride, long pe_stride, const void* rows, void* out,
                 int T, int N, int L, int R, int start, float scale, int dtype) {
#if WB_AVX512
    const int D = L + R, Dp = (L + 15) / 16 * 16 + (R + 15) / 16 * 16;  // q: latent, then rope, each padded
    float* s = new float[start + T + 16];
    alignas(64) float q[1024];
    if (Dp > 1024) { delete[] s; return -2; }
    for (int t = 0; t < T; ++t) {
        const int n = start + t + 1;
        for (int hd = 0; hd < N; ++hd) {
            const int Lp = (L + 15) / 16 * 16;
            for (int d = 0; d < Dp; ++d) q[d] = 0.f;
            for (int l = 0; l < L; ++l) q[l] = load(q_lat, dtype, size_t(t) * q_stride + size_t(hd) * L + l);
            for (int r = 0; r < R; ++r) q[Lp + r] = load(q_pe, dtype, size_t(t) * pe_stride + size_t(hd) * R + r);
            float mx = -INFINITY;
            for (int j = 0; j < n; ++j) {
                const size_t row = size_t(j) * D;
                __m512 acc = _mm512_setzero_ps();
                for (int d = 0; d < L; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_load_ps(q + d), load16m(rows, dtype, row + d, tail_mask(L - d)), acc);
                for (int d = 0; d < R; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_load_ps(q + Lp + d), load16m(rows, dtype, row + L + d, tail_mask(R - d)), acc);
                s[j] = _mm512_reduce_add_ps(acc) * scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            __m512 sumv = _mm512_setzero_ps();
            for (int j = 0; j < n; j += 16) {
                const __mmask16 m = tail_mask(n - j);
                const __m512 e = _mm512_maskz_mov_ps(
                    m, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(mx))));
                _mm512_mask_storeu_ps(s + j, m, e);
                sumv = _mm512_add_ps(sumv, e);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sumv));
            const size_t o = (size_t(t) * N + hd) * L;
            for (int l = 0; l < L; l += 16) {
                const __mmask16 m = tail_mask(L - l);
                __m512 acc = _mm512_setzero_ps();
                for (int j = 0; j < n; ++j)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), load16m(rows, dtype, size_t(j) * D + l, m), acc);
                store16(out, dtype, o + l, _mm512_mul_ps(acc, inv), m);
            }
        }
    }
    delete[] s;
    return 0;
#else
    return -1;
#endif
}

// DeepSeek-V3 routing for T tokens x [T, H] (dtype) against router weights [E, H] (fp32):
// scores = sigmoid (or softmax) of x W^T in fp32; the choice adds `bias`; with n_group > 1 only
// the topk_group groups whose two best choices sum highest stay; the top_k choices' scores
// (renormalised when norm, times scaling) go to dense [T, E + extra] fp32, zeros elsewhere, and
// the `extra` trailing columns (shared experts) are 1. Ties go to the lower index.
int wb_moe_route(const void* x, const float* weight, const float* bias, float* dense, int T, int H, int E,
                 int extra, int n_group, int topk_group, int top_k, int norm, float scaling, int sigmoid, int dtype) {
#if WB_AVX512
    if (E > 256 || top_k > E) return -2;
    float score[256], choice[256];
    bool keep[256];
    for (int t = 0; t < T; ++t) {
        for (int e = 0; e < E; ++e) {
            float acc = 0.f;
            for (int h = 0; h < H; ++h) acc += load(x, dtype, size_t(t) * H + h) * weight[size_t(e) * H + h];
            score[e] = acc;
        }
        if (sigmoid) {
            for (int e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-score[e]));
        } else {
            float mx = -INFINITY, sum = 0.f;
            for (int e = 0; e < E; ++e) mx = score[e] > mx ? score[e] : mx;
            for (int e = 0; e < E; ++e) sum += (score[e] = std::exp(score[e] - mx));
            for (int e = 0; e < E; ++e) score[e] /= sum;
        }
        for (int e = 0; e < E; ++e) choice[e] = score[e] + (bias ? bias[e] : 0.f), keep[e] = true;
        if (n_group > 1) {
            const int per = E / n_group;
            float gscore[256];
            for (int g = 0; g < n_group; ++g) {  // sum of the group's two best choices (one if it has one)
                float a = -INFINITY, b = -INFINITY;
                for (int e = g * per; e < (g + 1) * per; ++e) {
                    if (choice[e] > a) b = a, a = choice[e];
                    else if (choice[e] > b) b = choice[e];
                }
                gscore[g] = per > 1 ? a + b : a;
            }
            bool gkeep[256] = {false};
            for (int r = 0; r < topk_group; ++r) {
                int best = -1;
                for (int g = 0; g < n_group; ++g)
                    if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
                gkeep[best] = true;
            }
            for (int e = 0; e < E; ++e) keep[e] = gkeep[e / per];
        }
        float* row = dense + size_t(t) * (E + extra);
        for (int e = 0; e < E + extra; ++e) row[e] = e < E ? 0.f : 1.f;
        int chosen[256];
        float total = 0.f;
        for (int r = 0; r < top_k; ++r) {
            int best = -1;
            for (int e = 0; e < E; ++e)
                if (keep[e] && (best < 0 || choice[e] > choice[best])) best = e;
            keep[best] = false;
            chosen[r] = best;
            total += score[best];
        }
        const float denom = (norm && top_k > 1) ? total + 1e-20f : 1.0f;
        for (int r = 0; r < top_k; ++r) row[chosen[r]] = score[chosen[r]] / denom * scaling;
    }
    return 0;
#else
    return -1;
#endif
}

// out [T, G*I] = silu(gate) * up (* weight[t, g]) from h [T, G, 2, I] (gate then up per group),
// rounded as torch rounds each step in dtype; a group whose weight is 0 gives exact zeros.
int wb_swiglu(const void* h, const float* weight, void* out, int T, int G, int I, int dtype) {
#if WB_AVX512
    for (int t = 0; t < T; ++t)
        for (int g = 0; g < G; ++g) {
            const float wg = weight ? weight[size_t(t) * G + g] : 1.0f;
            const size_t in = (size_t(t) * G + g) * 2 * I, o = (size_t(t) * G + g) * I;
            for (int i = 0; i < I; i += 16) {
                const __mmask16 m = tail_mask(I - i);
                if (wg == 0.0f) { store16(out, dtype, o + i, _mm512_setzero_ps(), m); continue; }
                const __m512 gate = load16m(h, dtype, in + i, m), up = load16m(h, dtype, in + I + i, m);
                // silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) <= 1 on either side of 0
                const __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));
                const __m512 one = _mm512_set1_ps(1.0f);
                const __mmask16 neg = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
                const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), _mm512_add_ps(one, e));
                __m512 a = round16(_mm512_mul_ps(round16(_mm512_mul_ps(gate, sig), dtype), up), dtype);
                if (weight) a = _mm512_mul_ps(a, _mm512_set1_ps(wg));
                store16(out, dtype, o + i, a, m);
            }
        }
    return 0;
#else
    return -1;
#endif
}

// For each row of logits [T, V]: its max, the first index holding it, and (with_lse) log(sum(exp(x -
// max))) + max, in fp32. A row with a NaN gets max NaN (and argmax 0); +inf gives +inf; all -inf gives -inf.
int wb_row_stats(const void* logits, long stride, int T, int V, float* mx_out, long* arg_out, float* lse_out,
                 int with_lse, int dtype) {
#if WB_AVX512
    for (int t = 0; t < T; ++t) {
        const size_t row = size_t(t) * stride;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int v = 0; v < V; v += 16) {
            const __mmask16 m = tail_mask(V - v);
            const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, load16m(logits, dtype, row + v, m));
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            mv = _mm512_max_ps(mv, x);
        }
        float mx = _mm512_reduce_max_ps(mv);
        long arg = 0;
        if (nan) {
            mx = NAN;
        } else {
            for (int v = 0; v < V; v += 16) {  // the first lane equal to the max
                const __mmask16 m = tail_mask(V - v);
                const __mmask16 eq = _mm512_mask_cmp_ps_mask(m, load16m(logits, dtype, row + v, m), _mm512_set1_ps(mx), _CMP_EQ_OQ);
                if (eq) { arg = v + __builtin_ctz(unsigned(eq)); break; }
            }
        }
        float lse = mx;
        if (with_lse && std::isfinite(mx)) {
            __m512 sum = _mm512_setzero_ps();
            for (int v = 0; v < V; v += 16) {
                const __mmask16 m = tail_mask(V - v);
                const __m512 x = load16m(logits, dtype, row + v, m);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, exp_neg(_mm512_sub_ps(x, _mm512_set1_ps(mx)))));
            }
            lse = mx + std::log(_mm512_reduce_add_ps(sum));
        }
        mx_out[t] = mx, arg_out[t] = arg, lse_out[t] = lse;
    }
    return 0;
#else
    return -1;
#endif
}

// ---- blocks ---------------------------------------------------------------------------------
// Weights and sizes of one attention or FFN, filled once per module (workbench/kernels/cpu.py).
struct MlaPlan {
    const void* w_a;   // x -> [c_q (q_lora) or q (q_out) | c_kv (L) | k_pe halves (R, R)]
    const void* w_q;   // c_q -> q, or null when q comes from w_a (no q_lora)
    const void* w_o;   // latent outputs [N*L] -> hidden
    const void* q_norm;  // q_a_layernorm weight (with q_lora)
    const void* kv_norm;
    float q_eps, kv_eps, scale;
    int in_features, hidden, q_lora, N, L, R, dtype;
};

struct FfnPlan {
    const void* w_gate_up;  // x -> G groups of [gate (I) | up (I)]
    const void* w_down;     // [G*I] -> hidden
    const float* router;    // [E, H] fp32, or null for a plain MLP (G = 1)
    const float* bias;      // [E]
    int hidden, groups, inter, experts, n_group, topk_group, top_k, norm, sigmoid, dtype;
    float scaling;
};

namespace {
thread_local std::vector<char> scratch_buf;
char* scratch(size_t bytes) {
    if (scratch_buf.size() < bytes) scratch_buf.resize(bytes);
    return scratch_buf.data();
}
}  // namespace

// out [T, hidden] = o_proj(attention) for normed x [T, in] of one sequence whose cache rows [S, L+R]
// hold positions 0..start-1; the T new rows are written at start.. first. cos2, sin2 [T, R].
int wb_mla_block(const MlaPlan* p, const void* x, int T, void* rows, int start, const void* cos2, const void* sin2,
                 void* out) {
#if WB_AVX512
    const size_t es = p->dtype ? 2 : 4;
    const int N = p->N, L = p->L, R = p->R, D = L + R;
    const int q_out = N * (L + 2 * R);
    const int a_out = (p->w_q ? p->q_lora : q_out) + L + 2 * R;
    const size_t a_bytes = size_t(T) * a_out * es, c_bytes = size_t(T) * (p->q_lora + 1) * es;
    const size_t q_bytes = size_t(T) * q_out * es, pe_bytes = size_t(T) * N * R * es;
    char* buf = scratch(a_bytes + c_bytes + q_bytes + pe_bytes + size_t(T) * N * L * es + 64 * 5);
    auto at = [](char* b) { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b) + 63) & ~uintptr_t(63)); };
    char* A = at(buf);
    char* C = at(A + a_bytes);
    char* Q = at(C + c_bytes);
    char* PE = at(Q + q_bytes);
    char* O = at(PE + pe_bytes);
    int rc = wb_linear(p->w_a, x, A, nullptr, T, a_out, p->in_features, p->dtype);
    const int head = p->w_q ? p->q_lora : q_out;  // where c_kv starts in a row of A
    const char* q;
    long q_stride;
    if (p->w_q) {
        rc |= wb_rms_norm(A, a_out, p->q_norm, C, p->q_lora, T, p->q_lora, p->q_eps, p->dtype);
        rc |= wb_linear(p->w_q, C, Q, nullptr, T, q_out, p->q_lora, p->dtype);
        q = Q, q_stride = q_out;
    } else {
        q = A, q_stride = a_out;
    }
    char* row0 = static_cast<char*>(rows) + size_t(start) * D * es;
    rc |= wb_rms_norm(A + head * es, a_out, p->kv_norm, row0, D, T, L, p->kv_eps, p->dtype);
    rc |= wb_rope(A + (head + L) * es, A + (head + L + R) * es, a_out, cos2, sin2, row0 + L * es, D, T, 1, R, p->dtype);
    rc |= wb_rope(q + N * L * es, q + (N * L + N * R) * es, q_stride, cos2, sin2, PE, N * R, T, N, R, p->dtype);
    rc |= wb_attention(q, PE, q_stride, N * R, rows, O, T, N, L, R, start, p->scale, p->dtype);
    rc |= wb_linear(p->w_o, O, out, nullptr, T, p->hidden, N * L, p->dtype);
    return rc;
#else
    return -1;
#endif
}

// out [T, hidden] = down(silu(gate) * up, weighted per group by the routing when a router is given)
// for normed x [T, hidden].
int wb_ffn_block(const FfnPlan* p, const void* x, int T, void* out) {
#if WB_AVX512
    const size_t es = p->dtype ? 2 : 4;
    const int G = p->groups, I = p->inter;
    const size_t d_bytes = size_t(T) * G * 4 + 64, g_bytes = size_t(T) * G * 2 * I * es + 64;
    char* buf = scratch(d_bytes + g_bytes + size_t(T) * G * I * es + 64);
    float* dense = reinterpret_cast<float*>(buf);
    char* H = buf + (d_bytes + 63) / 64 * 64;
    char* act = H + (g_bytes + 63) / 64 * 64;
    int rc = 0;
    if (p->router)
        rc |= wb_moe_route(x, p->router, p->bias, dense, T, p->hidden, p->experts, G - p->experts, p->n_group,
                           p->topk_group, p->top_k, p->norm, p->scaling, p->sigmoid, p->dtype);
    rc |= wb_linear(p->w_gate_up, x, H, nullptr, T, G * 2 * I, p->hidden, p->dtype);
    rc |= wb_swiglu(H, p->router ? dense : nullptr, act, T, G, I, p->dtype);
    rc |= wb_linear(p->w_down, act, out, nullptr, T, p->hidden, G * I, p->dtype);
    return rc;
#else
    return -1;
#endif
}

// ---- the EAGLE-3 greedy chain ----------------------------------------------------------------
struct EaglePlan {
    const MlaPlan* attn;
    const FfnPlan* mlp;
    const void* input_norm;   // on the token embeddings
    const void* hidden_norm;  // on the fused / fed-back state
    const void* post_norm;    // before the MLP
    const void* final_norm;
    const void* embed;        // [vocab, H] in dtype
    const void* head;         // packed [draft_vocab, H]
    const int64_t* d2t;       // [draft_vocab] target id - draft id, or null
    const void* cos;          // RoPE tables [limit, R] (RotaryEmbedding.halves)
    const void* sin;
    float input_eps, hidden_eps, post_eps, final_eps;
    int hidden, draft_vocab, limit, norm_before_residual, norm_output, dtype;
};

#if WB_AVX512
namespace {
thread_local std::vector<char> chain_buf;

// a = round(a + b) elementwise in dtype (a residual add as torch's `a + b`)
void add_into(void* a, const void* b, size_t n, int dtype) {
    for (size_t i = 0; i < n; ++i) store(a, dtype, i, load(a, dtype, i) + load(b, dtype, i));
}
}  // namespace
#endif

// Proposals tokens_out [k] and each one's draft probability probs_out [k] for ids [T] (the tokens
// after the verified positions start..start+T-1, as Eagle3Draft.greedy_chain's first pass takes
// them) with the fused state [T, H] (fc over the verifier's aux states). Writes the draft cache
// rows start..start+T+k-2; the caller checks they fit and sets the cache's length.
int wb_eagle_chain(const EaglePlan* p, const int64_t* ids, int T, const void* state_in, void* rows, int start, int k,
                   int64_t* tokens_out, float* probs_out) {
#if WB_AVX512
    const int H = p->hidden, dt = p->dtype, R = p->attn->R;
    const size_t es = dt ? 2 : 4, row = size_t(H) * es;
    if (start + T + k - 1 > p->limit) return -3;
    const size_t n = size_t(T) * row;
    if (chain_buf.size() < 10 * n + size_t(p->draft_vocab) * es + 640) chain_buf.resize(10 * n + size_t(p->draft_vocab) * es + 640);
    char* base = chain_buf.data();
    auto take = [&](size_t bytes) { char* q = base; base += (bytes + 63) / 64 * 64; return q; };
    char *h = take(n), *e = take(n), *x = take(2 * n), *a = take(n), *r = take(n), *yin = take(n), *pre = take(n),
         *post = take(n), *logits = take(size_t(p->draft_vocab) * es);
    int rc = 0;
    std::memcpy(h, state_in, n);
    const int64_t* tok = ids;
    int64_t next;
    int pos = start;
    for (int step = 0; step < k; ++step) {
        for (int t = 0; t < T; ++t) std::memcpy(e + t * row, static_cast<const char*>(p->embed) + size_t(tok[t]) * row, row);
        // x = [input_norm(embeds) | hidden_norm(h)], the embedding first
        rc |= wb_rms_norm(e, H, p->input_norm, x, 2 * H, T, H, p->input_eps, dt);
        rc |= wb_rms_norm(h, H, p->hidden_norm, x + row, 2 * H, T, H, p->hidden_eps, dt);
        const char* residual_in = p->norm_before_residual ? x + row : h;
        // r = residual + attention(x); pre = r + mlp(post_norm(r)); x's second half is strided, so copy
        if (p->norm_before_residual)
            for (int t = 0; t < T; ++t) std::memcpy(r + t * row, residual_in + t * 2 * row, row);
        else
            std::memcpy(r, residual_in, size_t(T) * row);
        rc |= wb_mla_block(p->attn, x, T, rows, pos, static_cast<const char*>(p->cos) + size_t(pos) * R * es,
                           static_cast<const char*>(p->sin) + size_t(pos) * R * es, a);
        add_into(r, a, size_t(T) * H, dt);
        rc |= wb_rms_norm(r, H, p->post_norm, yin, H, T, H, p->post_eps, dt);
        rc |= wb_ffn_block(p->mlp, yin, T, pre);
        add_into(pre, r, size_t(T) * H, dt);  // pre = r + mlp(...): the same sum in either order
        rc |= wb_rms_norm(pre, H, p->final_norm, post, H, T, H, p->final_eps, dt);
        // the head over the last row, its argmax and that token's probability
        const char* last = post + size_t(T - 1) * row;
        rc |= wb_linear(p->head, last, logits, nullptr, 1, p->draft_vocab, H, dt);
        float mx, lse;
        int64_t arg;
        rc |= wb_row_stats(logits, p->draft_vocab, 1, p->draft_vocab, &mx, reinterpret_cast<long*>(&arg), &lse, 1, dt);
        tokens_out[step] = arg + (p->d2t ? p->d2t[arg] : 0);
        probs_out[step] = float(std::exp(double(mx) - double(lse)));  // as Python: math.exp of the two floats
        // the next pass: the proposal, fed the last row's state, at the next position
        std::memcpy(h, (p->norm_output ? post : pre) + size_t(T - 1) * row, row);
        pos += T;
        next = tokens_out[step];
        tok = &next;
        T = 1;
    }
    return rc;
#else
    return -1;
#endif
}

}  // extern "C"
