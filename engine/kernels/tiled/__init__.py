"""The ``tiled`` kernel: online softmax over query x key tiles in plain torch ops (``tiled``), every option, any
device; ``backward``: its gradients by tiles from the saved log-sum-exp (also used by ``sdpa_tiles`` and context
parallelism)."""
