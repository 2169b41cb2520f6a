"""The type names the conversion CLIs offer, apart from :mod:`.tensor_types` (which imports
numpy and gguf) so that ``--help`` stays fast."""
from __future__ import annotations

OUTTYPES = ("f16", "bf16", "f32", "q4_0", "q8_0")  # pi-convert --outtype
PREDICTOR_TYPES = ("f16", "q8_0", "q4_0")  # --predictor-type
DEFAULT_PREDICTOR_TYPE = "q8_0"
QUANTIZE_TYPES = ("q4_0", "q8_0")  # pi-quantize TYPE (= powerinfer.quant.types.WRITE_TYPES, checked by a test)
