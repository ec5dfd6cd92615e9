"""Expert kernels, one op per module: Triton kernels, launchers, autograd Functions, ``*_ref`` twins."""
