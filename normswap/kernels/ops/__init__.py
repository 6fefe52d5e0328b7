"""Raw Triton kernels and their autograd / custom-op glue (``rms_norm``: the RMSNorm op)."""
