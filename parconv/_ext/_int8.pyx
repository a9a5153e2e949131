"""int8 convolution and linear kernels (uint8 activations, int8 weights, int32 accumulation)."""

cdef extern from "pc_int8.h":
    pass


def path():
    """Which int8 dot-product path this build level and CPU run."""
    return "portable"
