"""Fused Triton kernels for the TT linear layer and the TTM lookup, and the one dispatch point.

- ``dispatch``: which implementation runs (Triton on CUDA, the ``tensor.contract`` reference
  elsewhere; ``use_backend`` / ``COMERA_KERNELS`` force one). Only ``dispatch`` is imported by
  the layers; it imports triton lazily, on the Triton path.
- ``ops``: the ``comera::tt_linear`` / ``comera::ttm_lookup`` custom ops (fake + autograd).
- ``tt_linear_kernel``, ``ttm_lookup_kernel``: the kernels and their launch wrappers.

Testing: ``launch/test.sh tests/kernels`` runs every kernel against the reference in Triton's
interpreter on CPU (fp32), and compiles every launched variant to an sm_90 cubin without a GPU.
On a CUDA machine, ``TRITON_INTERPRET=0 python -m pytest tests/kernels`` runs the same comparisons
natively on the GPU plus the ``gpu``-marked fp32/bf16 tests at paper shapes (launch/test.sh forces
the interpreter). The benchmark is ``python -m comera_dist.bench kernels --json PATH`` (GPU only). No GPU was available while these kernels were written: the native compile, the
bf16 numerics and the speed targets (1.5x over the torch path, 5x over the naive lookup chain)
are unverified until someone runs those two commands on a GPU.
"""
