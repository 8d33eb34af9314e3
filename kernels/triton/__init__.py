"""The Triton kernels (CUDA; on CPU under ``TRITON_INTERPRET=1`` for tests).

``quantize`` (:func:`~kvquant.kernels.triton.quantize.quantize_append`), ``decode_attention``
(:func:`~kvquant.kernels.triton.decode_attention.quantized_decode_attention`), ``_common`` (rounding
and fp8 helpers shared by both), ``backend`` (what they support, as the ``triton`` backend of
:mod:`kvquant.kernels.ops`). Importing this package imports no Triton; its kernel modules do.
"""
