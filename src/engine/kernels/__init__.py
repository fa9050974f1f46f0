"""The native CPU kernel library: C sources (csrc/), compiled on first use and loaded with ctypes.

- library.py: build, cache and load the library; one accessor per kernel family.
- boundary.py: the typed boundary, read from and checked against csrc/engine_kernels.h.
- attention.py, ops.py, linear.py, decoder_layers.py: each family at the tensor level, used by the
  layers (engine/layers) where it applies; each falls back to the layers' torch code.
"""
