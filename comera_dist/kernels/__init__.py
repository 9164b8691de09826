"""Fused Triton kernels for the TT linear layer and the TTM lookup, and the one dispatch point.

- ``dispatch``: which implementation runs (the ``tensor.contract`` reference by default, on
  CUDA too: on an H200 both kernels measured slower than it; Triton only for shapes a recorded
  measurement shows faster; ``use_backend`` / ``COMERA_KERNELS`` force one). Only ``dispatch``
  is imported by the layers; it imports triton lazily, on the Triton path.
- ``ops``: the ``comera::tt_linear`` / ``comera::ttm_lookup`` custom ops (fake + autograd).
- ``tt_linear_kernel``, ``ttm_lookup_kernel``: the kernels and their launch wrappers.

Testing: ``launch/test.sh tests/kernels`` runs every kernel against the reference in Triton's
interpreter on CPU (fp32), and compiles every launched variant to an sm_90 cubin without a GPU.
On a CUDA machine, ``TRITON_INTERPRET=0 python -m pytest tests/kernels`` runs the same comparisons
natively on the GPU plus the ``gpu``-marked fp32/bf16 tests at paper shapes (launch/test.sh forces
the interpreter). bf16 is judged as FlashAttention's tests do: the kernel's error against an fp64
reference may be at most twice the torch bf16 path's own (``kernels_testlib.bf16_error_vs_torch``).
The benchmark is ``python -m comera_dist.bench kernels --json PATH`` (GPU only). The first GPU run
(H200) measured the fused TT linear at 0.32x and the fused lookup at 0.56x of the paths they
were meant to beat, so neither is on the default path (``dispatch``).
"""
