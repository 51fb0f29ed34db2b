"""Plain tensor maths: tensors in, tensors out, no modules and no state (the bottom layer above errors.py).

    lowrank.py    lowrank_delta(down, up, scale): the low-rank update s B A as a weight-sized fp32 matrix
    dora.py       DoRA's formula: weight_norm, factors, weight_change, merged_weight, unmerged_weight
    blockwise.py  block-wise 8-bit quantization: dynamic_map, quantize_blockwise, dequantize_blockwise
    adam.py       the Adam/AdamW update once (adam_math_), one step on fp32 or 8-bit moments (adam_step_)
"""

from . import dora
from .adam import AdamHyper, adam_math_, adam_step_
from .blockwise import BLOCK_SIZE, dequantize_blockwise, dynamic_map, quantize_blockwise
from .lowrank import lowrank_delta

__all__ = ["BLOCK_SIZE", "AdamHyper", "adam_math_", "adam_step_", "dequantize_blockwise", "dora",
           "dynamic_map", "lowrank_delta", "quantize_blockwise"]
