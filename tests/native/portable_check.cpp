// The decode kernel built for another CPU (tests/test_decode_portable.py: aarch64, its NEON path and its portable C++
// path (DN_PORTABLE), run under qemu; x86-64 without -march: the portable path in SSE2) against a float64 oracle
// written here: every fp16 and e4m3 code as the kernel reads it, then decodes over each kind, head dims no vector
// width divides, 1-6 rows, masks, 1 and 2 threads, contiguous and paged (pages of 16, shuffled); NaN / inf keys in
// full blocks and fp8 NaN codes; batch invariance, bitwise; tanh_lane, a softcap's decode and ALiBi's. Prints one line per failure and a summary; exits 1 on any
// failure.
#include "../../engine/kernels/decode/decode_native.cpp"

#include <cstdio>
#include <random>
#include <string>

namespace check {

double half_value(uint16_t h) {  // IEEE fp16, read from its fields
    const int e = (h >> 10) & 31, m = h & 1023;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 31) return m ? NAN : sign * INFINITY;
    return sign * (e == 0 ? m * std::ldexp(1.0, -24) : (1 + m / 1024.0) * std::ldexp(1.0, e - 15));
}
double e4m3_value(uint8_t x) {  // fp8 e4m3fn: no inf, 0x7F / 0xFF NaN
    const int e = (x >> 3) & 15, m = x & 7;
    const double sign = (x & 0x80) ? -1.0 : 1.0;
    if ((x & 0x7F) == 0x7F) return NAN;
    return sign * (e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7));
}
bool same(double want, double got) { return want == got || (std::isnan(want) && std::isnan(got)); }
// about the standard normal: four random bytes' sum, centred and scaled (std::normal_distribution's logs and square
// roots, in qemu's software floating point, had taken two thirds of the aarch64 run)
float normal(std::mt19937& g) {
    const uint32_t x = g();
    return (float)((int)(x & 255) + (int)(x >> 8 & 255) + (int)(x >> 16 & 255) + (int)(x >> 24) - 510) / 147.8f;
}

struct Case {
    int kind;
    int64_t D, Dv, R, S;
    bool masked, paged;
    int threads;
};

constexpr int64_t B = 2, H = 2;  // (each case's batch and KV heads)

// K and V of B sequences of S keys, H heads: in the kind's bytes, as float64 (int8 / fp8 times their per-key scales)
struct Cache {
    std::vector<uint8_t> k, v;
    std::vector<double> kd, vd;
    std::vector<float> ks, vs;
};

Cache cache(int kind, int64_t D, int64_t Dv, int64_t S, std::mt19937& g) {
    const int64_t eb = kind_bytes(kind);
    const bool scaled = kind == I8 || kind == F8E4M3;
    Cache kv{std::vector<uint8_t>(B * H * S * D * eb), std::vector<uint8_t>(B * H * S * Dv * eb),
             std::vector<double>(B * H * S * D), std::vector<double>(B * H * S * Dv), std::vector<float>(B * H * S),
             std::vector<float>(B * H * S)};
    for (auto* sc : {&kv.ks, &kv.vs})
        for (auto& x : *sc) x = 0.01f + (float)(g() % 100) / 1000.0f;
    auto fill = [&](std::vector<uint8_t>& raw, std::vector<double>& value, const std::vector<float>& sc, int64_t w) {
        for (int64_t i = 0; i < (int64_t)value.size(); ++i) {
            const double unit = scaled ? sc[i / w] : 1.0;
            if (kind == F32) {
                const float x = normal(g);
                std::memcpy(&raw[4 * i], &x, 4), value[i] = x;
            } else if (kind == BF16) {
                const uint16_t h = (uint16_t)(float_bits(normal(g)) >> 16);
                std::memcpy(&raw[2 * i], &h, 2), value[i] = bits_float((uint32_t)h << 16);
            } else if (kind == F16) {  // any sign and mantissa, exponents 0 (subnormal) to 17
                const uint16_t h = (uint16_t)((g() & 0x83FF) | ((g() % 18) << 10));
                std::memcpy(&raw[2 * i], &h, 2), value[i] = half_value(h);
            } else if (kind == I8) {
                const int8_t c = (int8_t)((int)(g() % 255) - 127);
                raw[i] = (uint8_t)c, value[i] = c * unit;
            } else {
                uint8_t c = (uint8_t)(g() & 0xFF);
                if ((c & 0x7F) == 0x7F) c = 0;
                raw[i] = c, value[i] = e4m3_value(c) * unit;
            }
        }
    };
    fill(kv.k, kv.kd, kv.ks, D);
    fill(kv.v, kv.vd, kv.vs, Dv);
    return kv;
}

// worst error over the case's rows, as a share of the tolerance (lse: 1e-5 (1 + |lse|); out: 1e-5 (1 + max |v|)),
// over a cache made for the case's kind, D, Dv and S
double run(const Case& t, const Cache& kv, std::mt19937& g) {
    const int64_t D = t.D, Dv = t.Dv, R = t.R, S = t.S, eb = kind_bytes(t.kind);
    const bool scaled = t.kind == I8 || t.kind == F8E4M3;
    const std::vector<uint8_t>&k = kv.k, &v = kv.v;
    const std::vector<double>&kd = kv.kd, &vd = kv.vd;
    const std::vector<float>&ks = kv.ks, &vs = kv.vs;
    std::vector<float> q(B * H * R * D), out(B * H * R * Dv), lse(B * H * R);
    for (auto& x : q) x = normal(g);
    std::vector<uint8_t> visible(B * H * R * S, 1);
    if (t.masked)
        for (auto& x : visible) x = g() % 10 > 2;
    DecodeCall c{};
    c.kind = t.kind, c.threads = t.threads, c.B = B, c.H = H, c.R = R, c.S = S, c.D = D, c.Dv = Dv;
    c.q = q.data(), c.q_strides[0] = H * R * D, c.q_strides[1] = R * D, c.q_strides[2] = D;
    c.scale = 1.0 / std::sqrt((double)D);
    if (t.masked)
        c.visible = visible.data(), c.visible_strides[0] = H * R * S, c.visible_strides[1] = R * S,
        c.visible_strides[2] = S, c.visible_strides[3] = 1;
    c.out = out.data(), c.lse = lse.data(), c.io_kind = F32;
    // paged: pools [pages, 16, H, D] whose pages are the sequences' in shuffled order; else [B, H, S, D]
    const int64_t P = 16, per = (S + P - 1) / P;
    std::vector<int64_t> table(B * per), lengths(B, S);
    std::vector<uint8_t> kp, vp;
    std::vector<float> ksp, vsp;
    if (t.paged) {
        for (int64_t i = 0; i < B * per; ++i) table[i] = i;
        std::shuffle(table.begin(), table.end(), g);
        kp.assign(B * per * P * H * D * eb, 0), vp.assign(B * per * P * H * Dv * eb, 0);
        ksp.assign(B * per * P * H, 1.0f), vsp.assign(B * per * P * H, 1.0f);
        for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t j = 0; j < S; ++j) {
                    const int64_t slot = (table[b * per + j / P] * P + j % P) * H + h, row = (b * H + h) * S + j;
                    std::memcpy(&kp[slot * D * eb], &k[row * D * eb], D * eb);
                    std::memcpy(&vp[slot * Dv * eb], &v[row * Dv * eb], Dv * eb);
                    ksp[slot] = ks[row], vsp[slot] = vs[row];
                }
        c.k = kp.data(), c.k_strides[0] = P * H * D, c.k_strides[1] = H * D, c.k_strides[2] = D;
        c.v = vp.data(), c.v_strides[0] = P * H * Dv, c.v_strides[1] = H * Dv, c.v_strides[2] = Dv;
        if (scaled)
            c.k_scale = ksp.data(), c.v_scale = vsp.data(), c.k_scale_strides[0] = c.v_scale_strides[0] = P * H,
            c.k_scale_strides[1] = c.v_scale_strides[1] = H, c.k_scale_strides[2] = c.v_scale_strides[2] = 1;
        c.pages = table.data(), c.pages_stride = per, c.page_size = P, c.lengths = lengths.data();
    } else {
        c.k = k.data(), c.k_strides[0] = H * S * D, c.k_strides[1] = S * D, c.k_strides[2] = D;
        c.v = v.data(), c.v_strides[0] = H * S * Dv, c.v_strides[1] = S * Dv, c.v_strides[2] = Dv;
        if (scaled)
            c.k_scale = ks.data(), c.v_scale = vs.data(), c.k_scale_strides[0] = c.v_scale_strides[0] = H * S,
            c.k_scale_strides[1] = c.v_scale_strides[1] = S, c.k_scale_strides[2] = c.v_scale_strides[2] = 1;
    }
    if (decode_native(&c) != 0) return INFINITY;
    double worst = 0;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t r = 0; r < R; ++r) {
                const int64_t row = (b * H + h) * R + r;
                std::vector<double> s(S, -INFINITY);
                double m = -INFINITY, l = 0, vmax = 0;
                for (int64_t j = 0; j < S; ++j) {
                    if (!visible[row * S + j]) continue;
                    s[j] = 0;
                    for (int64_t d = 0; d < D; ++d) s[j] += (double)q[row * D + d] * c.scale * kd[((b * H + h) * S + j) * D + d];
                    m = std::max(m, s[j]);
                }
                std::vector<double> o(Dv, 0.0);
                for (int64_t j = 0; j < S; ++j) {
                    for (int64_t d = 0; d < Dv; ++d) vmax = std::max(vmax, std::fabs(vd[((b * H + h) * S + j) * Dv + d]));
                    if (s[j] == -INFINITY) continue;
                    const double p = std::exp(s[j] - m);
                    l += p;
                    for (int64_t d = 0; d < Dv; ++d) o[d] += p * vd[((b * H + h) * S + j) * Dv + d];
                }
                const double want_lse = l > 0 ? m + std::log(l) : -INFINITY;
                double err = l > 0 ? std::fabs(lse[row] - want_lse) / (1e-5 * (1 + std::fabs(want_lse)))
                                   : (lse[row] == -INFINITY ? 0.0 : INFINITY);
                for (int64_t d = 0; d < Dv; ++d)
                    err = std::max(err, std::fabs(out[row * Dv + d] - (l > 0 ? o[d] / l : 0.0)) / (1e-5 * (1 + vmax)));
                worst = std::max(worst, std::isnan(err) ? INFINITY : err);
            }
    return worst;
}

// One head-major decode of B 1 (H KV heads, R rows each, S keys, D = Dv, one thread), K / V already in the kind's
// bytes, scales of 0.05 for int8 / fp8; visible [H, R, S] or none. False when the kernel refused the call.
bool decode(int kind, int64_t H, int64_t R, int64_t S, int64_t D, const std::vector<uint8_t>& k,
            const std::vector<uint8_t>& v, const std::vector<float>& q, const uint8_t* visible,
            std::vector<float>& out, std::vector<float>& lse, double softcap = 0.0) {
    static std::vector<float> scales;
    scales.assign(H * S, 0.05f);
    out.assign(H * R * D, 0.0f), lse.assign(H * R, 0.0f);
    DecodeCall c{};
    c.kind = kind, c.threads = 1, c.B = 1, c.H = H, c.R = R, c.S = S, c.D = D, c.Dv = D, c.scale = 0.125;
    c.q = q.data(), c.q_strides[0] = H * R * D, c.q_strides[1] = R * D, c.q_strides[2] = D;
    c.k = k.data(), c.k_strides[0] = H * S * D, c.k_strides[1] = S * D, c.k_strides[2] = D;
    c.v = v.data(), c.v_strides[0] = H * S * D, c.v_strides[1] = S * D, c.v_strides[2] = D;
    if (kind == I8 || kind == F8E4M3)
        c.k_scale = c.v_scale = scales.data(), c.k_scale_strides[0] = c.v_scale_strides[0] = H * S,
        c.k_scale_strides[1] = c.v_scale_strides[1] = S, c.k_scale_strides[2] = c.v_scale_strides[2] = 1;
    if (visible)
        c.visible = visible, c.visible_strides[0] = H * R * S, c.visible_strides[1] = R * S, c.visible_strides[2] = S,
        c.visible_strides[3] = 1;
    c.out = out.data(), c.lse = lse.data(), c.io_kind = F32, c.softcap = softcap;
    return decode_native(&c) == 0;
}
// n random values' bytes of the kind: finite, |x| < 2 (fp32 / bf16 / fp16), any int8, any e4m3 but its NaN codes
std::vector<uint8_t> random_bytes(int kind, int64_t n, std::mt19937& g) {
    const int64_t eb = kind_bytes(kind);
    std::vector<uint8_t> raw(n * eb);
    for (int64_t i = 0; i < n; ++i) {
        const float x = (float)((int)(g() % 4001) - 2000) / 1000.0f;
        const uint16_t half = (uint16_t)((g() & 0x83FF) | ((g() % 16) << 10));  // (exponents 0 to 15: |x| < 2)
        const uint16_t top = (uint16_t)(float_bits(x) >> 16);  // (x as bf16)
        uint8_t code = (uint8_t)(g() & 0xFF);
        if (kind == F8E4M3 && (code & 0x7F) == 0x7F) code = 0;
        if (kind == F32) std::memcpy(&raw[4 * i], &x, 4);
        else if (kind == BF16) std::memcpy(&raw[2 * i], &top, 2);
        else if (kind == F16) std::memcpy(&raw[2 * i], &half, 2);
        else raw[i] = code;
    }
    return raw;
}

// fp8 NaN codes reach exactly the outputs that see them (the paths read a block's codes as numbers unless its rows
// hold a NaN code: e4m3_nan_codes): a K code in head 0, hidden from its row 1, makes row 0 all NaN; a V code in head
// 1's last channel makes that channel of both its rows NaN; every other output finite. D 36, which no vector width
// divides, and 64 (the vector paths). The rows wrong.
int nan_rows(std::mt19937& g, int64_t D) {
    const int64_t H = 3, R = 2, S = 150;
    std::vector<uint8_t> k = random_bytes(F8E4M3, H * S * D, g), v = random_bytes(F8E4M3, H * S * D, g);
    k[(0 * S + 100) * D + 7] = 0x7F, v[(1 * S + 20) * D + D - 1] = 0xFF;
    std::vector<float> q(H * R * D, 0.5f), out, lse;
    std::vector<uint8_t> visible(H * R * S, 1);
    visible[(0 * R + 1) * S + 100] = 0;
    if (!decode(F8E4M3, H, R, S, D, k, v, q, visible.data(), out, lse)) return (int)(H * R);
    int wrong = 0;
    for (int64_t row = 0; row < H * R; ++row) {
        bool right = true;
        for (int64_t d = 0; d < D; ++d)
            right &= (bool)std::isnan(out[row * D + d]) == (row == 0 || ((row == 2 || row == 3) && d == D - 1));
        wrong += !right;
    }
    return wrong;
}

// A visible NaN key (head 0) and inf key (head 1) inside full blocks no row masks (the vector paths' finite_max)
// make their heads' rows NaN with lse -inf; head 2's rows stay finite. fp32 and fp16, D 36 and 64. The rows wrong.
int nonfinite_rows(std::mt19937& g, int kind, int64_t D) {
    const int64_t H = 3, R = 4, S = 192, eb = kind_bytes(kind);
    std::vector<uint8_t> k = random_bytes(kind, H * S * D, g), v = random_bytes(kind, H * S * D, g);
    const float nan = NAN, inf = INFINITY;
    const uint16_t half_nan = 0x7E00, half_inf = 0x7C00;
    std::memcpy(&k[((0 * S + 70) * D + 5) * eb], kind == F32 ? (const void*)&nan : &half_nan, eb);
    for (int64_t d = 0; d < D; ++d)
        std::memcpy(&k[((1 * S + 130) * D + d) * eb], kind == F32 ? (const void*)&inf : &half_inf, eb);
    std::vector<float> q(H * R * D), out, lse;
    for (auto& x : q) x = (float)((int)(g() % 2001) - 1000) / 1000.0f;
    if (!decode(kind, H, R, S, D, k, v, q, nullptr, out, lse)) return (int)(H * R);
    int wrong = 0;
    for (int64_t row = 0; row < H * R; ++row) {
        const bool poisoned = row < 2 * R;
        bool right = poisoned ? lse[row] == -INFINITY : std::isfinite(lse[row]);
        for (int64_t d = 0; d < D; ++d)
            right &= poisoned ? std::isnan(out[row * D + d]) : std::isfinite(out[row * D + d]);
        wrong += !right;
    }
    return wrong;
}

float value_at(int kind, const void* row, int64_t d) {  // (as the kernel's plain path reads it)
    switch (kind) {
        case F32: return load_scalar<F32>(row, d);
        case BF16: return load_scalar<BF16>(row, d);
        case F16: return load_scalar<F16>(row, d);
        case I8: return load_scalar<I8>(row, d);
        default: return load_scalar<F8E4M3>(row, d);
    }
}

// Batch invariance: rows that see keys 0 .. 68 of 69 give bitwise the same outputs and lse with 1, 2, 3 or 9 hidden
// keys after them: the second block's last seen keys are then summed by other passes (key 68 by the one-key pass of
// 69 keys, the two-key pass of 70, the four-key pass of 72). Rows 0 and 2 are key 68 itself, so that its score is
// their max and a last bit of it shows in their lse (a key among many weighs too little to show). Each kind, D 128
// and 36. The cases that differ.
int invariance_cases(std::mt19937& g) {
    const int64_t H = 2, R = 4, seen = 69;
    int wrong = 0;
    for (int kind = F32; kind <= F8E4M3; ++kind)
        for (int64_t D : {128, 36}) {
            const int64_t eb = kind_bytes(kind), most = seen + 9;
            const std::vector<uint8_t> k = random_bytes(kind, H * most * D, g), v = random_bytes(kind, H * most * D, g);
            std::vector<float> q(H * R * D), want_out, want_lse, out, lse;
            for (auto& x : q) x = (float)((int)(g() % 2001) - 1000) / 1000.0f;
            for (int64_t h = 0; h < H; ++h)
                for (int64_t r : {0, 2})
                    for (int64_t d = 0; d < D; ++d)
                        q[(h * R + r) * D + d] = value_at(kind, &k[(h * most + seen - 1) * D * eb], d);
            auto keys = [&](const std::vector<uint8_t>& all, int64_t S) {  // each head's first S of `most` rows
                std::vector<uint8_t> part(H * S * D * eb);
                for (int64_t h = 0; h < H; ++h)
                    std::memcpy(&part[h * S * D * eb], &all[h * most * D * eb], S * D * eb);
                return part;
            };
            if (!decode(kind, H, R, seen, D, keys(k, seen), keys(v, seen), q, nullptr, want_out, want_lse)) ++wrong;
            for (int64_t pad : {1, 2, 3, 9}) {
                const int64_t S = seen + pad;
                std::vector<uint8_t> visible(H * R * S);
                for (int64_t i = 0; i < H * R * S; ++i) visible[i] = i % S < seen;
                const bool ran = decode(kind, H, R, S, D, keys(k, S), keys(v, S), q, visible.data(), out, lse);
                const bool same = ran && std::memcmp(out.data(), want_out.data(), out.size() * 4) == 0 &&
                                  std::memcmp(lse.data(), want_lse.data(), lse.size() * 4) == 0;
                if (!same && wrong++ < 10)
                    printf("invariance: kind %d D %ld pad %ld differs\n", kind, (long)D, (long)pad);
            }
        }
    return wrong;
}

// tanh_lane against tanh in double, in a loop the compiler vectorises as the kernel's softcap loop: every 9973rd float
// from -20 to 20 (both branches, the 0.55 seam, subnormals, zeros) within 3 ulp; +-inf to +-1, NaN to NaN. The values
// wrong.
int tanh_values() {
    std::vector<float> x;
    for (uint32_t b = 0; b < 0x41A00000u; b += 9973) x.push_back(bits_float(b)), x.push_back(-bits_float(b));
    for (float special : {0.55f, std::nextafter(0.55f, 0.0f), INFINITY, -INFINITY, NAN}) x.push_back(special);
    std::vector<float> y(x.size());
    const int64_t n = (int64_t)x.size();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = tanh_lane(x[i]);
    int wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double want = std::tanh((double)x[i]);
        const double ulp = std::ldexp(1.0, std::max(std::ilogb((float)want), -126) - 23);
        const bool right = std::isnan(want) ? std::isnan(y[i]) : std::fabs(y[i] - want) <= 3 * ulp;
        if (!right && wrong++ < 5) printf("tanh_lane(%a) = %a, tanh: %a\n", x[i], y[i], want);
    }
    return wrong;
}

// A softcap (cap * tanh(score / cap)) against a float64 oracle, fp32 K/V, D 36 and 64, 5 rows: head 0 holds a
// visible NaN key, head 1 an inf one (their rows NaN, lse -inf: a visible non-finite key's rule, capped or not), head
// 2 none. The rows wrong.
int softcap_rows(std::mt19937& g, int64_t D) {
    const int64_t H = 3, R = 5, S = 150;
    const double cap = 2.5;
    std::vector<uint8_t> k = random_bytes(F32, H * S * D, g), v = random_bytes(F32, H * S * D, g);
    const float nan = NAN, inf = INFINITY;
    std::memcpy(&k[((0 * S + 33) * D + 3) * 4], &nan, 4);
    std::memcpy(&k[((1 * S + 140) * D + 0) * 4], &inf, 4);
    std::vector<float> q(H * R * D), out, lse;
    for (auto& x : q) x = (float)((int)(g() % 4001) - 2000) / 500.0f;
    for (int64_t r = 0; r < R; ++r) q[(1 * R + r) * D] = r % 2 ? 0.75f : -0.75f;  // (the inf key: +-inf scores)
    if (!decode(F32, H, R, S, D, k, v, q, nullptr, out, lse, cap)) return (int)(H * R);
    int wrong = 0;
    auto at = [](const std::vector<uint8_t>& raw, int64_t i) { float x; std::memcpy(&x, &raw[4 * i], 4); return x; };
    for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t row = h * R + r;
            std::vector<double> score(S);
            double top = -INFINITY;
            bool bad = false;
            for (int64_t j = 0; j < S; ++j) {
                double dot = 0;
                for (int64_t d = 0; d < D; ++d) dot += (double)q[row * D + d] * at(k, (h * S + j) * D + d);
                bad |= !std::isfinite(dot);
                score[j] = cap * std::tanh(dot * 0.125 / cap);
                top = std::max(top, score[j]);
            }
            bool right;
            if (bad) {
                right = lse[row] == -INFINITY;
                for (int64_t d = 0; d < D; ++d) right &= (bool)std::isnan(out[row * D + d]);
            } else {
                double l = 0;
                std::vector<double> o(D, 0.0);
                for (int64_t j = 0; j < S; ++j) {
                    const double p = std::exp(score[j] - top);
                    l += p;
                    for (int64_t d = 0; d < D; ++d) o[d] += p * at(v, (h * S + j) * D + d);
                }
                right = std::fabs(lse[row] - (top + std::log(l))) <= 1e-5 * (1 + std::fabs(lse[row]));
                for (int64_t d = 0; d < D; ++d) right &= std::fabs(out[row * D + d] - o[d] / l) <= 1e-5 * 3;
            }
            wrong += !right;
        }
    return wrong;
}

// ALiBi and a bias against a float64 oracle: fp32 K/V, D 36 and 64, 2 KV heads of 2 query heads of 2 queries (row r:
// query head r / 2, query r % 2), keys at positions 3 j + 1, every key visible (no causal rule here: |key - query|
// both ways), a bias [4 heads, 2 queries, S]. The rows wrong.
int alibi_rows(std::mt19937& g, int64_t D) {
    const int64_t H = 2, R = 4, S = 150, T = 2;
    const std::vector<uint8_t> k = random_bytes(F32, H * S * D, g), v = random_bytes(F32, H * S * D, g);
    std::vector<float> q(H * R * D), out(H * R * D), lse(H * R), slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
    std::vector<float> key_pos(S), query_pos = {440.0f, 452.0f};
    for (int64_t j = 0; j < S; ++j) key_pos[j] = (float)(3 * j + 1);
    for (auto& x : q) x = (float)((int)(g() % 2001) - 1000) / 1000.0f;
    DecodeCall c{};
    c.kind = F32, c.threads = 1, c.B = 1, c.H = H, c.R = R, c.S = S, c.D = D, c.Dv = D, c.scale = 0.125;
    c.q = q.data(), c.q_strides[0] = H * R * D, c.q_strides[1] = R * D, c.q_strides[2] = D;
    c.k = k.data(), c.k_strides[0] = H * S * D, c.k_strides[1] = S * D, c.k_strides[2] = D;
    c.v = v.data(), c.v_strides[0] = H * S * D, c.v_strides[1] = S * D, c.v_strides[2] = D;
    c.out = out.data(), c.lse = lse.data(), c.io_kind = F32;
    c.alibi = slopes.data(), c.queries = T, c.query_pos = query_pos.data(), c.key_pos = key_pos.data();
    std::vector<float> bias(H * (R / T) * T * S);
    for (auto& x : bias) x = (float)((int)(g() % 2001) - 1000) / 500.0f;
    c.bias = bias.data(), c.bias_strides[0] = 0, c.bias_strides[1] = T * S, c.bias_strides[2] = S, c.bias_strides[3] = 1;
    if (decode_native(&c) != 0) return (int)(H * R);
    auto at = [](const std::vector<uint8_t>& raw, int64_t i) { float x; std::memcpy(&x, &raw[4 * i], 4); return x; };
    int wrong = 0;
    for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t row = h * R + r;
            const double slope = slopes[h * (R / T) + r / T], here = query_pos[r % T];
            std::vector<double> score(S);
            double top = -INFINITY, l = 0;
            for (int64_t j = 0; j < S; ++j) {
                double dot = 0;
                for (int64_t d = 0; d < D; ++d) dot += (double)q[row * D + d] * at(k, (h * S + j) * D + d);
                score[j] = dot * 0.125 - slope * std::fabs(key_pos[j] - here) +
                           bias[((h * (R / T) + r / T) * T + r % T) * S + j];
                top = std::max(top, score[j]);
            }
            std::vector<double> o(D, 0.0);
            for (int64_t j = 0; j < S; ++j) {
                const double p = std::exp(score[j] - top);
                l += p;
                for (int64_t d = 0; d < D; ++d) o[d] += p * at(v, (h * S + j) * D + d);
            }
            bool right = std::fabs(lse[row] - (top + std::log(l))) <= 1e-5 * (1 + std::fabs(lse[row]));
            for (int64_t d = 0; d < D; ++d) right &= std::fabs(out[row * D + d] - o[d] / l) <= 3e-5;
            wrong += !right;
        }
    return wrong;
}

}  // namespace check

// "quick" as the argument: of the four variants of each case (masked or not, paged or not, 1 or 2 threads) the first
// and the last alone (contiguous unmasked on 1 thread; paged masked on 2): half the decodes, for a run under an
// emulator (qemu: 24 s for all 540 on the NEON path)
int main(int argc, char** argv) {
    const bool quick = argc > 1 && std::string(argv[1]) == "quick";
    int wrong = 0;
    for (int h = 0; h < 65536; ++h) {
        const uint16_t code = (uint16_t)h;
        if (!check::same(check::half_value(code), load_scalar<F16>(&code, 0)) && wrong++ < 5) printf("fp16 %04x\n", h);
    }
    for (int x = 0; x < 256; ++x) {  // (the kernel reads e4m3 as E4M3_UNIT's inverse times its value)
        const uint8_t code = (uint8_t)x;
        if (!check::same(check::e4m3_value(code), load_scalar<F8E4M3>(&code, 0) * (double)E4M3_UNIT) && wrong++ < 10)
            printf("e4m3 %02x\n", x);
    }
    std::mt19937 g(7);
    int cases = 0;
    double worst = 0;
    const int64_t dims[][2] = {{128, 128}, {72, 40}, {36, 20}};
    for (int kind = F32; kind <= F8E4M3; ++kind)
        for (const auto& dd : dims)
            for (int64_t S : {1, 70, 2100}) {
                const check::Cache kv = check::cache(kind, dd[0], dd[1], S, g);  // (the same K / V for each R)
                for (int64_t R : {1, 4, 6})
                    for (int variant = 0; variant < 4; variant += quick && variant == 0 ? 3 : 1) {
                        const check::Case t{kind, dd[0], dd[1], R, S, variant % 2 == 1, variant >= 2, 1 + variant % 2};
                        const double err = check::run(t, kv, g);
                        ++cases, worst = std::max(worst, err);
                        if (!(err <= 1.0) && wrong++ < 30)
                            printf("kind %d D %ld Dv %ld R %ld S %ld masked %d paged %d threads %d: %g of tolerance\n",
                                   kind, (long)t.D, (long)t.Dv, (long)R, (long)S, t.masked, t.paged, t.threads, err);
                    }
            }
    for (int64_t D : {36, 64}) {
        const int nan_wrong = check::nan_rows(g, D);
        if (nan_wrong) printf("fp8 NaN codes, D %ld: %d rows wrong\n", (long)D, nan_wrong);
        wrong += nan_wrong;
        for (int kind : {F32, F16}) {
            const int bad = check::nonfinite_rows(g, kind, D);
            if (bad) printf("non-finite keys, kind %d D %ld: %d rows wrong\n", kind, (long)D, bad);
            wrong += bad;
        }
    }
    wrong += check::invariance_cases(g);
    const int tanh_wrong = check::tanh_values();
    if (tanh_wrong) printf("tanh_lane: %d values wrong\n", tanh_wrong);
    wrong += tanh_wrong;
    for (int64_t D : {36, 64}) {
        const int bad = check::softcap_rows(g, D), off = check::alibi_rows(g, D);
        if (bad) printf("softcap, D %ld: %d rows wrong\n", (long)D, bad);
        if (off) printf("ALiBi, D %ld: %d rows wrong\n", (long)D, off);
        wrong += bad + off;
    }
    printf("lanes %d; %d cases, worst %.3f of tolerance; %d wrong\n", decode_native_lanes(), cases, worst, wrong);
    return wrong != 0;
}
