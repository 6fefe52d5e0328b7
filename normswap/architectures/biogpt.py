"""BioGPT: a pre-LN decoder with scaled token embeddings, learned positions (offset 2), tied head.

Writers: the token and position tables (every row of the position table, the two offset rows
included), each ``self_attn.out_proj`` and ``fc2``. ``layer_norm`` is read by the bias-free
``output_projection`` (β stays as β/γ when folded). Only the causal-LM class is accepted: the
classification heads read the final stream at one token in their own way.
"""

from __future__ import annotations

from normswap.architectures.layouts import bart_blocks
from normswap.architectures.spec import assemble, embeddings, lm_head, only_classes

BIOGPT = assemble(
    "biogpt", "AutoModelForCausalLM",
    embeddings("biogpt.{embed_tokens|embed_positions}.weight"),
    bart_blocks("biogpt.layers"),
    lm_head("biogpt.layer_norm", head="output_projection", tied_to="biogpt.embed_tokens.weight"),
    refuse=only_classes("BioGptForCausalLM"),
    blocks="biogpt.layers",
)
