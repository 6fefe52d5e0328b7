"""CodeGen: GPT-J's parallel block with a fused ``qkv_proj``; rotary positions; head with a bias.

Everything but the attention's input is GPT-J's (see gptj.py): ``ln_1`` is read by ``qkv_proj``
(no bias: β stays in the norm as β/γ) and ``fc_in``; the writers are the token table,
``out_proj`` (no bias) and ``fc_out``. ``ln_f``'s β folds into the ``lm_head`` bias.
"""

from __future__ import annotations

from dataclasses import replace

from normswap.architectures.facts import StateDict, sole_class
from normswap.architectures.gptj import GPTJ, H, parallel_block_facts, parallel_block_norms
from normswap.architectures.spec import linear_reader, pattern


def _attention(state: StateDict, attention: str, d: int) -> None:
    state.linear(attention + ".out_proj", d, d, bias=False).linear(attention + ".qkv_proj", d, 3 * d, bias=False)


CODEGEN = replace(
    GPTJ,
    model_types=("codegen",),
    norms=parallel_block_norms(linear_reader(H + ".attn.qkv_proj", bias=False)),
    ignore=(pattern(H + ".attn.{causal_mask|masked_bias}"),),
    **sole_class("CodeGenForCausalLM", parallel_block_facts(_attention)),
    tie_default=False,
    shared_context=True,
)
