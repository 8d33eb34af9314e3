"""kvquant: KV-cache quantization for Hugging Face transformers.

``import kvquant`` registers the ``"kvquant"`` attention (and its mask function) with transformers.

Example::

    from kvquant import KVQuantCache
    from kvquant.models import load_model

    model, tok = load_model()  # the embedded SmolLM2-135M-Instruct
    inputs = tok("The capital of France is", return_tensors="pt")
    cache = KVQuantCache(model, "int4")
    out = model.generate(**inputs, cache=cache, max_new_tokens=32)

    kvquant.enable(model)  # fused decode attention over the quantized store
"""

from __future__ import annotations

from kvquant.attention import enable, register
from kvquant.cache import KVQuantCache
from kvquant.config import KVQuantConfig, preset_names
from kvquant.models import load_model

__version__ = "0.1.0"
__all__ = ["KVQuantCache", "KVQuantConfig", "enable", "load_model", "preset_names", "register", "__version__"]

register()
