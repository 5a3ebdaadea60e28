"""Hot-path kernels: Triton on CUDA, plain-torch twins elsewhere, one dispatch point per op."""

from kernels import ops, reference

__all__ = ["ops", "reference"]
