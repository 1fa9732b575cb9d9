"""The ``flex`` kernel: FlexAttention (``flex``) on a BlockMask built from the masks' own tile bounds
(``block_mask``)."""
