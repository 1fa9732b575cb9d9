"""The CUDA kernel ``sdpa_cuda``: PyTorch's fused CUDA attention where the rule is one of its patterns."""
