"""Residual adds fused into the RMSNorm they feed, per block family.

Two kinds of add feed a norm in a pre-LN block:

* **inside a block** (sequential blocks: GPT-2, GPT-BigCode, GPT-Neo, OPT, GPT-NeoX without
  parallel residual, Falcon-RW): ``s = attn + residual; h = ln_2(s)`` becomes one
  ``rms_norm(attn, residual=residual)`` call, (y, s) in one pass over memory;
* **at the end of a block**: ``s = residual + mlp`` (parallel blocks: ``attn + mlp + residual``,
  GPT-J, CodeGen, Phi, GPT-NeoX, Falcon) is the next block's input, normalised first thing by
  that block's input norm (or the final norm after the last block). The block computes ``s`` and
  that norm's output in one call and leaves the output on the norm (a *handoff*). The norm
  returns it only when called on that very tensor, unmodified (object identity, and the version
  counter where the tensor has one), so whatever runs between the two (the model's layer loop,
  hooks) either passes ``s`` along as it is or gets the norm computed afresh. Not while
  compiling: Inductor fuses the add itself, and a graph is better without module state.

Each fused forward reproduces one upstream block body, recognised by a fingerprint of that body
(``_body_fingerprint``) and by its parameter list: a transformers release that changes the body
leaves the block on its stock forward, unfused and correct. Additions are commutative in IEEE
arithmetic and ``rms_norm`` rounds ``s`` to the input dtype as an unfused add does, so outputs are
bitwise the stock forward's whenever the norms' own results are. BLOOM adds its residuals inside
its attention and MLP modules, so its blocks are not fused.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .ops.rms_norm import module_rms_norm

# block.__dict__[_NEXT] = (norm, next block or None): the norm the block's output feeds
_NEXT = "_normswap_next_norm"
# norm.__dict__[_PENDING] = (s, version of s, y): y = norm(s), computed by the block before it
_PENDING = "_normswap_pending"


def is_rmsnorm(module: nn.Module | None) -> bool:
    """Whether ``module`` is a normswap RMSNorm (from normswap or from a checkpoint's remote code)."""
    return bool(getattr(type(module), "is_normswap_rmsnorm", False))


def has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version  # inference tensors keep no version counter


def take_pending(norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The output the previous block computed for ``norm(x)``, if it is for this very ``x``."""
    pending = norm.__dict__.pop(_PENDING, None)
    if pending is not None and pending[0] is x and pending[1] == _version(x):
        return pending[2]
    return None


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), fused when ``norm`` is a hook-free normswap RMSNorm."""
    if is_rmsnorm(norm) and not has_hooks(norm):
        return module_rms_norm(norm, x, residual)
    s = x + residual
    return norm(s), s


def end_add(block: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``x + residual``, the block's output, with the norm it feeds computed alongside (handoff)."""
    target = block.__dict__.get(_NEXT)
    if target is None or torch.compiler.is_compiling() or block._forward_hooks:
        return x + residual
    norm, next_block = target
    if has_hooks(norm) or (next_block is not None and has_hooks(next_block)):
        return x + residual
    y, s = module_rms_norm(norm, x, residual)
    norm.__dict__[_PENDING] = (s, _version(s), y)
    return s


# --------------------------------------------------------------------------- fused forwards
# Each mirrors the upstream forward of the class named in FUSIONS, line for line, with the adds
# that feed a norm routed through add_norm / end_add.


def _require_cross_attention(block) -> None:
    """The upstream blocks' refusal of encoder states when built without cross-attention."""
    if not hasattr(block, "crossattention"):
        raise ValueError(
            f"If `encoder_hidden_states` are passed, {block} has to be instantiated with "
            "cross-attention layers by setting `config.add_cross_attention=True`"
        )


def _gpt2_block(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):  # fmt: skip
    if "past_key_values" in kwargs:  # the older name, by keyword
        cache = kwargs.pop("past_key_values")
    cache_kw = {_GPT2_CACHE_KEYWORD[0]: cache}
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), **cache_kw, attention_mask=attention_mask,
                               use_cache=use_cache, **kwargs)  # fmt: skip
    if encoder_hidden_states is not None:
        _require_cross_attention(self)
        normed, residual = add_norm(self.ln_cross_attn, attn_output, residual)
        attn_output, _ = self.crossattention(normed, **cache_kw, attention_mask=attention_mask,
                                             encoder_hidden_states=encoder_hidden_states,
                                             encoder_attention_mask=encoder_attention_mask)  # fmt: skip
    normed, residual = add_norm(self.ln_2, attn_output, residual)
    return end_add(self, self.mlp(normed), residual)


def _gpt_bigcode_block(self, hidden_states, encoder_hidden_states=None, layer_past=None, attention_mask=None,
                       encoder_attention_mask=None, use_cache=False, output_attentions=False, **kwargs):  # fmt: skip
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), layer_past=layer_past, attention_mask=attention_mask,
                               use_cache=use_cache, output_attentions=output_attentions, **kwargs)  # fmt: skip
    if encoder_hidden_states is not None:
        _require_cross_attention(self)
        normed, residual = add_norm(self.ln_cross_attn, attn_output, residual)
        attn_output, _ = self.crossattention(normed, attention_mask=attention_mask,
                                             encoder_hidden_states=encoder_hidden_states,
                                             encoder_attention_mask=encoder_attention_mask,
                                             output_attentions=output_attentions, **kwargs)  # fmt: skip
    normed, residual = add_norm(self.ln_2, attn_output, residual)
    return end_add(self, self.mlp(normed), residual)


def _gpt_neo_block(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False,
                   output_attentions=False, **kwargs):  # fmt: skip
    residual = hidden_states
    attn_output, attn_weights = self.attn(self.ln_1(hidden_states), layer_past=layer_past,
                                          attention_mask=attention_mask, use_cache=use_cache,
                                          output_attentions=output_attentions)  # fmt: skip
    normed, residual = add_norm(self.ln_2, attn_output, residual)
    return end_add(self, self.mlp(normed), residual), attn_weights


def _gptj_block(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):  # fmt: skip
    """GPT-J and CodeGen (the same body): attention and MLP in parallel from one norm."""
    residual = hidden_states
    hidden_states = self.ln_1(hidden_states)
    attn_output, _ = self.attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                               attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                               use_cache=use_cache, **kwargs)  # fmt: skip
    return end_add(self, attn_output + self.mlp(hidden_states), residual)


def _gpt_neox_layer(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False,
                    layer_past=None, position_embeddings=None, **kwargs):  # fmt: skip
    attn_output, _ = self.attention(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                    position_ids=position_ids, layer_past=layer_past, use_cache=use_cache,
                                    position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    attn_output = self.post_attention_dropout(attn_output)
    if self.use_parallel_residual:
        mlp_output = self.post_mlp_dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
        return end_add(self, mlp_output + attn_output, hidden_states)
    normed, attn_output = add_norm(self.post_attention_layernorm, attn_output, hidden_states)
    return end_add(self, self.post_mlp_dropout(self.mlp(normed)), attn_output)


def _opt_layer(self, hidden_states, attention_mask=None, cache=None, use_cache=False, position_ids=None, **kwargs):
    """Pre-LN OPT layers only (``do_layer_norm_before``; see ``FUSIONS``)."""
    if "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.self_attn_layer_norm(hidden_states), cache=cache,
                                      position_ids=position_ids, attention_mask=attention_mask, **kwargs)  # fmt: skip
    hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
    normed, residual = add_norm(self.final_layer_norm, hidden_states, residual)
    shape = residual.shape
    hidden_states = self.fc2(self.activation_fn(self.fc1(normed.reshape(-1, shape[-1])))).view(shape)
    return end_add(self, F.dropout(hidden_states, p=self.dropout, training=self.training), residual)


def _phi_layer(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
               position_embeddings=None, **kwargs):  # fmt: skip
    if "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    attn_outputs, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                     position_ids=position_ids, cache=cache, use_cache=use_cache,
                                     position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    attn_outputs = self.resid_dropout(attn_outputs)
    return end_add(self, attn_outputs + self.resid_dropout(self.mlp(hidden_states)), residual)


def _falcon_layer(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                  output_attentions=False, position_embeddings=None, **kwargs):  # fmt: skip
    # transformers up to 5.24: the model computes ALiBi and hands it to every block
    return _falcon_body(self, hidden_states, dict(
        layer_past=layer_past, attention_mask=attention_mask, position_ids=position_ids, alibi=alibi,
        use_cache=use_cache, output_attentions=output_attentions, position_embeddings=position_embeddings,
    ))  # fmt: skip


def _falcon_layer_no_alibi(self, hidden_states, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                           output_attentions=False, position_embeddings=None, **kwargs):  # fmt: skip
    # transformers 5.25: the attention computes ALiBi itself
    return _falcon_body(self, hidden_states, dict(
        layer_past=layer_past, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
        output_attentions=output_attentions, position_embeddings=position_embeddings,
    ))  # fmt: skip


def _falcon_body(self, hidden_states, attention_kwargs: dict):
    config = self.config
    residual = hidden_states
    two_norms = config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2
    attention_layernorm_out = (self.ln_attn if two_norms else self.input_layernorm)(hidden_states)
    mlp_layernorm_out = self.ln_mlp(hidden_states) if two_norms else attention_layernorm_out
    attention_output, attn_weights = self.self_attention(attention_layernorm_out, **attention_kwargs)
    if not config.new_decoder_architecture and not config.parallel_attn:
        attention_output = F.dropout(attention_output, p=config.attention_dropout, training=self.training)
        mlp_layernorm_out, residual = add_norm(self.post_attention_layernorm, attention_output, residual)
    mlp_output = self.mlp(mlp_layernorm_out)
    if config.new_decoder_architecture or config.parallel_attn:
        mlp_output += attention_output
    output = F.dropout(mlp_output, p=config.hidden_dropout, training=self.training)
    return end_add(self, output, residual), attn_weights


def _falcon_input_norm(block: nn.Module) -> nn.Module | None:
    config = block.config
    if config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2:
        return block.ln_attn
    return block.input_layernorm


# --------------------------------------------------------------------------- recognition


@dataclass(frozen=True)
class BlockFusion:
    """One upstream block class, the fused forward that replaces its ``forward``, and the
    fingerprints of the upstream bodies that forward reproduces."""

    family: str
    module: str
    cls: str
    forward: Callable
    fingerprints: frozenset[str]
    input_norm: Callable[[nn.Module], nn.Module | None]  # what the block normalises its input with
    applies: Callable[[nn.Module], bool] = lambda block: True
    same_parameters: bool = True  # the fused forward's parameter list is the upstream one


def _attr(name: str) -> Callable[[nn.Module], nn.Module | None]:
    return lambda block: getattr(block, name, None)


def _fp(*digests: str) -> frozenset[str]:
    return frozenset(digests)


# sha256 of the normalised upstream bodies (see _body_fingerprint) of transformers 5.24, which are
# also 5.25's but for Falcon's (its second entry); GPT-2's, GPT-BigCode's, GPT-Neo's, GPT-NeoX's
# and Falcon's first are also 5.17's (there OPT and Phi name the cache parameter past_key_values,
# and GPT-J and CodeGen take layer_past: left unfused). A family may have one entry per upstream
# body; the first whose body is installed applies.
FUSIONS = [
    BlockFusion("gpt2", "gpt2", "GPT2Block", _gpt2_block,
                _fp("fa66fdfb9d827387fde13d26ee7ad3931c58554f8da3ada79163121e663518c4"), _attr("ln_1"),
                same_parameters=False),
    BlockFusion("gpt_bigcode", "gpt_bigcode", "GPTBigCodeBlock", _gpt_bigcode_block,
                _fp("e743fe880563cc6f781af505e519eaa8c71fe8e6ddedf1af64dc982ca52e85fd"), _attr("ln_1")),
    BlockFusion("gpt_neo", "gpt_neo", "GPTNeoBlock", _gpt_neo_block,
                _fp("6937a20c3e6a42f25435d3b53f922de2ed37b589bf4b88d123804730a4810966"), _attr("ln_1")),
    BlockFusion("gptj", "gptj", "GPTJBlock", _gptj_block,
                _fp("2ac8383a757a40e101cf40b2865d11dc794c678855b6810dbc7514833eb13a47"), _attr("ln_1")),
    BlockFusion("codegen", "codegen", "CodeGenBlock", _gptj_block,
                _fp("2ac8383a757a40e101cf40b2865d11dc794c678855b6810dbc7514833eb13a47"), _attr("ln_1")),
    BlockFusion("gpt_neox", "gpt_neox", "GPTNeoXLayer", _gpt_neox_layer,
                _fp("1a5c5c026db298ed0fb1af81aa5f5072be5ed5c2736dde284c1782dc6dba1b87"), _attr("input_layernorm")),
    BlockFusion("opt", "opt", "OPTDecoderLayer", _opt_layer,
                _fp("8b2e4c663b44df6883334f6dd1e1caa7dbc9b5b6a6862e90b021c3a6e5fdcb85"), _attr("self_attn_layer_norm"),
                applies=lambda block: bool(block.do_layer_norm_before)),
    BlockFusion("phi", "phi", "PhiDecoderLayer", _phi_layer,
                _fp("b0e926743629715e6aca3e17c097e795ebe9aa272dbedbf8ab026f415a10eb9e"), _attr("input_layernorm")),
    BlockFusion("falcon", "falcon", "FalconDecoderLayer", _falcon_layer,
                _fp("50b2ee92f759733031050cfb06f586d6fbf28942a1455de9d9f1782b83b2377d"), _falcon_input_norm),
    BlockFusion("falcon", "falcon", "FalconDecoderLayer", _falcon_layer_no_alibi,
                _fp("be6619b75a9cd6b5a718cb11b1dbbca67fb2e9d6b558cb0dd60f2d642bc8c91a"), _falcon_input_norm),
]  # fmt: skip
_CACHE_NAMES = ("cache", "past_key_values")
# the installed GPT2Block's cache keyword, set when a block is recognised (a plain global, which
# torch.compile reads as a constant)
_GPT2_CACHE_KEYWORD = ["cache"]


def _body_fingerprint(fn) -> str:
    """sha256 of ``fn``'s body as ``ast.unparse`` writes it, the cache keyword's name made
    uniform; comments, annotations and decorators do not count."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in _CACHE_NAMES:
            node.id = "CACHE"
        elif isinstance(node, ast.keyword) and node.arg in _CACHE_NAMES:
            node.arg = "CACHE"
    body = "\n".join(ast.unparse(stmt) for stmt in tree.body[0].body)
    return hashlib.sha256(body.encode()).hexdigest()


@functools.cache
def upstream_class(fusion: BlockFusion) -> type | None:
    """The installed upstream class when its forward is one ``fusion.forward`` reproduces."""
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{fusion.module}.modeling_{fusion.module}"),
                      fusion.cls)  # fmt: skip
        stock = inspect.unwrap(cls.forward)
        params = list(inspect.signature(stock).parameters)
        if _body_fingerprint(stock) not in fusion.fingerprints:
            return None
    except (ImportError, AttributeError, OSError, TypeError, SyntaxError):  # no such class, or no source
        return None
    if fusion.same_parameters and params != list(inspect.signature(fusion.forward).parameters):
        return None
    if fusion.family == "gpt2":
        if len(params) < 3 or params[2] not in _CACHE_NAMES:
            return None
        _GPT2_CACHE_KEYWORD[0] = params[2]
    return cls


def fusion_for(module: nn.Module) -> BlockFusion | None:
    """The fusion for ``module`` (an instance of exactly a recognised upstream class whose norms
    are normswap RMSNorms), or None."""
    name = type(module).__name__
    for fusion in FUSIONS:
        if fusion.cls == name and type(module) is upstream_class(fusion) and fusion.applies(module):
            return fusion if is_rmsnorm(fusion.input_norm(module)) else None
    return None


_FINAL_NORMS = ("ln_f", "final_layer_norm", "final_layernorm", "norm")


def link_handoffs(model: nn.Module, fused: dict[nn.Module, BlockFusion]) -> None:
    """Point each fused block in a layer stack at the norm its output feeds: the next block's
    input norm, or after the last block the stack's owner's final norm."""
    for parent in model.modules():
        for child in parent.children():
            if not isinstance(child, nn.ModuleList) or not child or not all(b in fused for b in child):
                continue
            blocks = list(child)
            for i, block in enumerate(blocks):
                if i + 1 < len(blocks):
                    norm, next_block = fused[blocks[i + 1]].input_norm(blocks[i + 1]), blocks[i + 1]
                else:
                    norm = next((getattr(parent, n) for n in _FINAL_NORMS if is_rmsnorm(getattr(parent, n, None))),
                                None)  # fmt: skip
                    next_block = None
                if is_rmsnorm(norm):
                    block.__dict__[_NEXT] = (norm, next_block)
