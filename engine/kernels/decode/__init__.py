"""The decode kernels, few queries against a long KV cache: ``decode_native`` (C++ in ``decode_native.cpp``, built
by ``native_build``), ``decode`` (the fused torch op over split keys) and ``dequantized`` (a quantized cache
dequantised a chunk at a time: the readable twin of the native kernel's quantized path)."""
