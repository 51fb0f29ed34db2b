"""A quantized frozen base (QLoRA's): Linear weights stored in 8 or 4 bits, dequantized on the fly.

    weights.py  the formats (int8, int8-block, nf4, fp8, fp8-row): quantize_weight, dequantize_weight and
                their plain `reference_*` beside them
    layer.py    QuantLinear, quantize_base(model, fmt) -> QuantReport

    quantize_base(unet, "nf4")     # every frozen nn.Linear / lora_lab.Linear -> QuantLinear
"""

from .layer import QuantLinear, QuantReport, quantize_base, quantized_layers
from .weights import FORMATS, QuantizationError, dequantize_weight, quantize_weight, warm_tables

__all__ = ["FORMATS", "QuantLinear", "QuantReport", "QuantizationError", "dequantize_weight", "quantize_base",
           "quantize_weight", "quantized_layers", "warm_tables"]
