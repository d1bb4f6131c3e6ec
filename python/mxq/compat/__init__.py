"""Drop-in replacements of other projects' quantization functions, computed by mxq:

- mxq.compat.vllm_qdq: the vllm-qdq-plugin's mxfp4_qdq and mxfp8_qdq (Intel neural-compressor,
  benchmark/vllm-qdq-plugin);
- mxq.compat.qutlass: QuTLASS's fusedQuantizeMx, fusedQuantizeNv and to_blocked (IST-DASLab).

Each keeps its original's signature, argument checks, output shapes and dtypes. Where mxq's
documented numerics differ from the original's reference, docs/python.md lists the difference and
tests/python/test_compat.py asserts exactly it.
"""
