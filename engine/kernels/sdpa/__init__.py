"""The kernels on PyTorch's fused CPU flash op: ``sdpa`` (one call, where the rule is one of the op's two
patterns) and ``sdpa_tiles`` (the op on the tiles the mask leaves, merged by log-sum-exp).

``fused_op``: the op, wrapped once (what it is given, when it fits); ``calls``: the fused calls covering a mask's
visible tiles; ``run_calls``: runs those calls forward and backward.
"""
