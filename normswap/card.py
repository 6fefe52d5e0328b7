"""The model card (README.md) written into every converted checkpoint."""

MODEL_CARD = """\
---
library_name: transformers
tags:
- normswap
- rmsnorm
---
# RMSNorm conversion of `{source}`

This checkpoint was written by [normswap](https://pypi.org/project/normswap/) {version}. It computes
the same function as `{source}` with every LayerNorm replaced by an RMSNorm.

## What was done

- **Centred the residual writers** ({writers} tensors: embeddings, attention and MLP output
  projections and their biases) in float64, by applying C = I − 11ᵀ/d along the hidden
  dimension. Every write into the residual stream is then orthogonal to the all-ones vector, the
  stream has zero mean, and LayerNorm(x) = RMSNorm(x) exactly, eps included.
- **Untied:** {untied}. The head reads the stream; it does not write it, so it keeps the original
  matrix.
- **Swapped {norms} norms** for RMSNorm (same eps; γ and β kept as weight and bias).
- **Folded gains:** {fold_gains} ({folded} norms folded into the layers that read them).
- Method `{method}`, weights stored as `{dtype}`.

## Loading

```python
from transformers import {auto_class}
model = {auto_class}.from_pretrained(PATH)                           # stock classes
model = {auto_class}.from_pretrained(PATH, trust_remote_code=True)   # RMSNorm modules

import normswap
model = normswap.load(PATH)                                                   # RMSNorm + fused kernels
```

{stock}

## Verification

The original and this checkpoint were run on the same probe ({probe} tokens), both computed in
float32. Tolerance on max |Δ|: {tolerance:.3g}.

{table}
"""
