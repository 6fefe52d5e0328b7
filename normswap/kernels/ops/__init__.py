"""Raw Triton kernels and their autograd / custom-op glue.

- ``rms_norm``: the RMSNorm op: custom ops, autograd, the public function.
- ``launch``: the host side: row layouts, launch configurations, cached launches, dispatch.
- ``crossover``: where a native op beats a Triton launch, from measured GPU rows.
- ``_triton_rms_norm``: the Triton kernels, imported lazily.
- ``fallback``: the pure-torch RMSNorm where Triton cannot run.
"""
