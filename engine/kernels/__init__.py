"""Attention kernels. Each takes resolved ``AttentionInputs`` and returns ``(out, lse)``.

- ``reference``: the dense, materialising path (the seed's listing, made safe); the oracle for the rest.
- ``dispatch``: picks a kernel for the inputs and says why.
"""
