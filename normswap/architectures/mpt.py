"""MPT: pre-LN blocks with a fused ``Wqkv``, ALiBi, bias-free layers, tied head.

``norm_1`` is read by ``attn.Wqkv``, ``norm_2`` by ``ffn.up_proj``; the writers are the token
table, ``attn.out_proj`` and ``ffn.down_proj`` (the MLP adds the residual itself). No layer has
a bias slot, so a norm's β (``no_bias`` false) stays as β/γ when folded. ``clip_qkv`` clamps
Wqkv's output, which folding leaves unchanged.
"""

from __future__ import annotations

from normswap.architectures.layouts import decoder
from normswap.architectures.spec import assemble, linear_reader

MPT = assemble(
    "mpt", "AutoModelForCausalLM",
    decoder("transformer.wte.weight", "transformer.blocks", "transformer.norm_f", tied_to="transformer.wte.weight",
            writes="{attn.out_proj|ffn.down_proj}",
            norm_1=linear_reader("attn.Wqkv", bias=False), norm_2=linear_reader("ffn.up_proj", bias=False)),
    blocks="transformer.blocks",
)
