// A decode step of the native kernel run `calls` times on one thread, for lab/bench/arm.py's instruction counts: B 1,
// KV heads 8 with 4 query rows each (Hq 32 / Hkv 8), D = Dv 128, S keys of one kind, contiguous [H, S, D] or in
// shuffled pages [pages, page, H, D]. The data are random, finite and fixed by a seed.
//
//     decode_driver KIND S PAGE CALLS      (KIND 0-4: fp32, bf16, fp16, int8, fp8 e4m3; PAGE 0: contiguous)
//
// The kernel's source is the working tree's, or KERNEL_SOURCE's (a quoted path: another revision's).
#ifndef KERNEL_SOURCE
#define KERNEL_SOURCE "../../../engine/kernels/decode/decode_native.cpp"
#endif
#include KERNEL_SOURCE

#include <cstdio>
#include <cstdlib>
#include <random>

int main(int argc, char** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: decode_driver KIND S PAGE CALLS\n");
        return 2;
    }
    const int kind = atoi(argv[1]);
    const int64_t S = atol(argv[2]), page = atol(argv[3]), calls = atol(argv[4]);
    const int64_t H = 8, R = 4, D = 128, eb = kind_bytes(kind);
    if (kind < F32 || kind > F8E4M3 || S < 1 || page < 0 || (page && S % page) || calls < 0) {
        fprintf(stderr, "decode_driver: KIND 0-4, S >= 1, PAGE 0 or a divisor of S, CALLS >= 0\n");
        return 2;
    }
    std::mt19937 g(1);
    std::vector<uint8_t> k(H * S * D * eb), v(H * S * D * eb);
    for (auto* bytes : {&k, &v})
        for (int64_t i = 0; i < H * S * D; ++i) {  // (values under 2 in size; no e4m3 NaN code)
            const float x = (float)((int)(g() % 2001) - 1000) / 1000.0f;
            const uint16_t bf16 = (uint16_t)(float_bits(x) >> 16);
            const uint16_t half = (uint16_t)((g() & 0x83FF) | ((g() % 16) << 10));
            const uint8_t code = (uint8_t)((g() & 0x80) | (g() % 0x7F));
            if (kind == F32) std::memcpy(&(*bytes)[4 * i], &x, 4);
            else if (kind == BF16 || kind == F16) std::memcpy(&(*bytes)[2 * i], kind == BF16 ? &bf16 : &half, 2);
            else (*bytes)[i] = code;
        }
    std::vector<float> scales(H * S, 0.01f), q(H * R * D), out(H * R * D), lse(H * R);
    for (auto& x : q) x = (float)((int)(g() % 2001) - 1000) / 1000.0f;
    DecodeCall c{};
    c.kind = kind, c.threads = 1, c.B = 1, c.H = H, c.R = R, c.S = S, c.D = D, c.Dv = D, c.scale = 0.088;
    c.q = q.data(), c.q_strides[0] = H * R * D, c.q_strides[1] = R * D, c.q_strides[2] = D;
    c.out = out.data(), c.lse = lse.data(), c.io_kind = F32;
    const int64_t pages = page ? S / page : 0;
    std::vector<int64_t> table(pages), lengths(1, S);
    const int64_t rows[3] = {page ? page * H * D : H * S * D, page ? H * D : S * D, D};  // (K's strides = V's)
    const int64_t scale_rows[3] = {page ? page * H : H * S, page ? H : S, 1};
    c.k = k.data(), c.v = v.data();
    for (int i = 0; i < 3; ++i) c.k_strides[i] = c.v_strides[i] = rows[i];
    if (kind == I8 || kind == F8E4M3) {
        c.k_scale = c.v_scale = scales.data();
        for (int i = 0; i < 3; ++i) c.k_scale_strides[i] = c.v_scale_strides[i] = scale_rows[i];
    }
    if (page) {
        for (int64_t i = 0; i < pages; ++i) table[i] = i;
        std::shuffle(table.begin(), table.end(), g);
        c.pages = table.data(), c.pages_stride = pages, c.page_size = page, c.lengths = lengths.data();
    }
    double sum = 0;
    for (int64_t i = 0; i < calls; ++i) {
        if (decode_native(&c) != 0) return 1;
        sum += out[0];
    }
    printf("%.6g\n", sum);
    return 0;
}
