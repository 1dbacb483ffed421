// The 16-lane helpers of workbench/kernels/cpu_kernels.cpp against scalar models of the AVX-512
// instructions the kernels were first written with (test_cpu_build.py compiles and runs this for
// this CPU's own target and for AVX2). Both ISAs' builds are held to the same scalar model, so
// they give the same bits: GCC's _mm512_reduce_{add,max}_ps trees, exp_neg with vrndscaleps and
// vscalefps (nearbyintf and ldexpf), bf16 rounding, tail loads and stores that touch only their
// lanes. Prints the number of mismatches and exits non-zero when there is one.
#include "../../workbench/kernels/cpu_kernels.cpp"

#include <cstdio>
#include <random>

#if WB_SIMD
namespace {

float tree_add(const float* v) {  // hi256 + lo256, hi128 + lo128, lanes {0,1} + {2,3}, lane 0 + lane 1
    float a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = v[8 + i] + v[i];
    for (int i = 0; i < 4; ++i) b[i] = a[4 + i] + a[i];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

float maxps(float a, float b) { return a > b ? a : b; }  // vmaxps: the second operand unless a > b

float tree_max(const float* v) {
    float a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = maxps(v[8 + i], v[i]);
    for (int i = 0; i < 4; ++i) b[i] = maxps(a[4 + i], a[i]);
    return maxps(maxps(b[0], b[2]), maxps(b[1], b[3]));
}

float exp_model(float x) {
    const bool under = x < -87.0f;
    x = maxps(x, -87.0f);
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = fmaf(p, r, c);
    p = fmaf(p, r * r, r + 1.0f);
    return under ? 0.0f : ldexpf(p, int(n));  // vscalefps: p * 2^n, rounded once
}

bool same(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

}  // namespace
#endif

int main() {
#if WB_SIMD
    std::mt19937 gen(1);
    std::normal_distribution<float> normal(0.0f, 10.0f);
    std::uniform_real_distribution<float> negative(-100.0f, 0.0f);
    long bad = 0;
    for (int it = 0; it < 100000; ++it) {
        alignas(64) float v[16], out[16];
        for (float& f : v) f = normal(gen) * ((it & 3) == 0 ? 1e-3f : 1.0f);
        if (it % 7 == 0) v[it % 16] = (it & 8) ? 0.0f : -0.0f;
        if (it % 11 == 0)
            for (int i = 0; i < 16; ++i) v[i] = (i & 1) ? 0.0f : -0.0f;  // max's signed zeros
        bad += !same(reduce_add(loadf(v)), tree_add(v)) + !same(reduce_max(loadf(v)), tree_max(v));

        for (float& f : v) f = negative(gen);
        if (it % 5 == 0) {
            int at = it % 9;
            for (float f : {-INFINITY, -87.0f, -87.3f, 0.0f, -0.0f, -1e-30f, -86.9f}) v[at++] = f;
        }
        storef(out, exp_neg(loadf(v)));
        for (int i = 0; i < 16; ++i) bad += !same(out[i], exp_model(v[i]));

        uint32_t bits32[16];  // any bit pattern, NaNs included
        for (int i = 0; i < 16; ++i) bits32[i] = uint32_t(gen()), std::memcpy(&v[i], &bits32[i], 4);
        alignas(64) uint16_t b[16];
        store16n(b, 1, 0, loadf(v), 16);
        storef(out, round16(loadf(v), 1));
        for (int i = 0; i < 16; ++i) bad += (b[i] != f32_to_bf16(v[i])) + !same(out[i], bf16_to_f32(b[i]));

        const int left = 1 + it % 16;
        bad += bits(lanes(left)) != (left >= 16 ? 0xffffu : (1u << left) - 1);
        for (int dtype = 0; dtype < 2; ++dtype) {  // the first `left` lanes in, zeros after; out, nothing after
            const size_t es = dtype ? 2 : 4;
            alignas(64) char src[64], dst[80];
            for (char& c : src) c = char(gen() % 50);
            std::memset(dst, 0x7f, sizeof dst);
            const V16 t = load16n(src, dtype, 0, left);
            storef(out, t);
            for (int i = 0; i < 16; ++i) bad += !same(out[i], i < left ? load(src, dtype, i) : 0.0f);
            store16n(dst, dtype, 0, t, left);
            bad += std::memcmp(dst, src, left * es) != 0;
            for (size_t i = left * es; i < sizeof dst; ++i) bad += dst[i] != 0x7f;
        }
    }
    std::printf("wb_isa %d: %ld mismatches\n", wb_isa(), bad);
    return bad != 0;
#else
    std::printf("wb_isa %d: no 16-lane helpers in this build\n", wb_isa());
    return 2;
#endif
}
