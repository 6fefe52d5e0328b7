"""RMSNorm models for checkpoints written by normswap.

This file is copied verbatim into every converted checkpoint as ``modeling_normswap.py`` and is
what ``from_pretrained(..., trust_remote_code=True)`` runs. It therefore imports only torch and
transformers, never normswap, and needs no network.

A converted model is the stock transformers class for its family with every ``nn.LayerNorm``
replaced by ``RMSNorm``. That is exact because normswap centred every tensor that writes the
residual stream: a norm's input then has zero mean, and LayerNorm(x) = RMSNorm(x), eps included.
A few families need a small structural change, which the checkpoint's ``config.normswap.structure``
states and ``apply_structure`` performs: ``identity`` (modules replaced by ``nn.Identity``, e.g.
BLOOM's embedding norm, baked into the embedding table), ``centre_input`` (modules whose first input
is centred explicitly: Whisper's encoder, whose stream starts as ``gelu(conv(...)) + positions``, a
value no weight folding can centre), ``centre_output`` (modules whose output is centred explicitly:
CLIP's ``pre_layrnorm``, a norm whose output *is* the residual stream) and ``gain_plus_one`` (norms
that store γ - 1 and compute with γ: Nemotron's ``LayerNorm1P``).

With ``--online-hadamard`` every MLP down projection's input is turned by H/√n at run time, its
weight stored with H folded in (``config.normswap.rotation.online_hadamard``, ``apply_online_hadamard``).

The norms swapped are every ``nn.LayerNorm`` and every leaf module of a class named
``*LayerNorm`` (a family's own LayerNorm: OLMo's weightless one, Cohere's bias-free one that may
normalise per head); ``layer_norm_like`` says which.

Classes are made on demand: ``NormswapGPT2LMHeadModel`` is ``GPT2LMHeadModel`` with RMSNorms, and
``NormswapBloomConfig`` is ``BloomConfig`` under the model type ``normswap_bloom`` (used when the
stock class cannot hold the converted weights, so that stock loading refuses instead of silently
computing something else).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

CLASS_PREFIX = "Normswap"
OWN_TYPE_PREFIX = "NormswapOnly"  # classes of checkpoints under their own model type (config class too)
MODEL_TYPE_PREFIX = "normswap_"


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x**2) + eps) * weight + bias over the last dimension.

    Statistics, the weight multiply and the bias add are done in float32 (float64 for float64
    inputs), rounded once to x's dtype at the end, as torch's LayerNorm kernels do. ``weight`` and
    ``bias`` are LayerNorm's names, so converted state dicts load unchanged."""

    is_normswap_rmsnorm = True

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, weight: bool = True,
                 bias: bool = True, device: torch.device | None = None, dtype: torch.dtype | None = None, *,
                 weight_shape: tuple[int, ...] | None = None, gain_offset: float = 0.0) -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        if len(self.normalized_shape) != 1:
            raise ValueError("RMSNorm normalises over the last dimension only")
        self.eps = float(eps)
        # the gain multiplies as (weight + gain_offset): 1 for a norm that stores γ - 1
        self.gain_offset = float(gain_offset)
        # a per-head norm holds one gain per head: [heads, head_dim], broadcast over the input
        shape = tuple(weight_shape) if weight_shape is not None else self.normalized_shape
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(shape, **factory)) if weight else None
        self.bias = nn.Parameter(torch.zeros(shape, **factory)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * (self.weight.to(compute) + self.gain_offset)
        if self.bias is not None:
            y = y + self.bias.to(compute)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, weight={self.weight is not None}, bias={self.bias is not None}"


def layer_norm_like(module: nn.Module) -> bool:
    """An ``nn.LayerNorm``, or a leaf module of a family's own class named ``*LayerNorm``."""
    if isinstance(module, nn.LayerNorm):
        return True
    return (type(module).__name__.endswith("LayerNorm") and not getattr(module, "is_normswap_rmsnorm", False)
            and next(module.children(), None) is None)


def rmsnorm_like(layer_norm: nn.Module) -> RMSNorm:
    """An RMSNorm with the same width, eps, γ, β, device and dtype as ``layer_norm``.

    A family's own LayerNorm class is read by what it holds: ``weight``/``bias`` (a gain of shape
    [heads, head_dim] normalises each head over its last dimension), ``eps`` or
    ``variance_epsilon``, else F.layer_norm's 1e-5. On the meta device (while a model is being
    built for loading) there are no values to copy.
    """
    weight, bias = getattr(layer_norm, "weight", None), getattr(layer_norm, "bias", None)
    reference = weight if weight is not None else bias
    shape = tuple(getattr(layer_norm, "normalized_shape", ()) or reference.shape)
    own_class = not isinstance(layer_norm, nn.LayerNorm)
    factory = {} if reference is None else {"device": reference.device, "dtype": reference.dtype}
    eps = getattr(layer_norm, "eps", getattr(layer_norm, "variance_epsilon", 1e-5))
    norm = RMSNorm(shape[-1:] if own_class else shape, eps=eps, weight=weight is not None, bias=bias is not None,
                   weight_shape=None if reference is None else tuple(reference.shape), **factory)
    if reference is not None and not reference.is_meta:
        with torch.no_grad():
            for name in ("weight", "bias"):
                if getattr(layer_norm, name, None) is not None:
                    getattr(norm, name).copy_(getattr(layer_norm, name))
    return norm


def _centre_last_dim(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True)


def _centre_input_hook(module, args, kwargs):
    if args:
        return (_centre_last_dim(args[0]), *args[1:]), kwargs
    kwargs["hidden_states"] = _centre_last_dim(kwargs["hidden_states"])
    return args, kwargs


def _centre_output_hook(module, args, output):
    if isinstance(output, tuple):
        return (_centre_last_dim(output[0]), *output[1:])
    return _centre_last_dim(output)


def swap_layer_norms(model: nn.Module) -> int:
    """Replace every LayerNorm (``layer_norm_like``) in ``model`` by an equivalent ``RMSNorm``;
    returns the count."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if layer_norm_like(child):
                setattr(parent, name, rmsnorm_like(child))
                swapped += 1
    return swapped


class UnknownModule(LookupError):
    """config.json's normswap block names a module the model does not have."""


def _module(model: nn.Module, path: str, key: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise UnknownModule(f"normswap.{key} names the module {path!r:.80}, which {type(model).__name__} "
                            "does not have") from None


def apply_structure(model: nn.Module, structure: dict | None) -> None:
    """Apply a converted checkpoint's structural changes (see the module docstring)."""
    structure = structure or {}
    for path in structure.get("identity", []):
        _module(model, path, "structure.identity")
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, nn.Identity())
    for path in structure.get("centre_input", []):
        _module(model, path, "structure.centre_input").register_forward_pre_hook(_centre_input_hook, with_kwargs=True)
    for path in structure.get("centre_output", []):
        _module(model, path, "structure.centre_output").register_forward_hook(_centre_output_hook)
    for path in structure.get("gain_plus_one", []):
        _module(model, path, "structure.gain_plus_one").gain_offset = 1.0


def hadamard_transform(x: torch.Tensor, factor: torch.Tensor, twos: int) -> torch.Tensor:
    """x·H/√n along the last axis for H = H₂^⊗twos ⊗ F (F ±1 of order m, n = 2^twos·m), in
    O(n·(twos + m)): with x's last axis as a 2^twos × m matrix X, x·(S ⊗ F) = Sᵀ·X·F, one m×m
    product and twos butterflies (a, b) → (a + b, a - b). Half precision runs in float32."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    y = x.to(dtype).reshape(-1, 2**twos, factor.shape[0]) @ factor.to(x.device, dtype)
    for bit in range(twos):
        pairs = y.view(y.shape[0], -1, 2, 2**bit, factor.shape[0])
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
    return (y.reshape(x.shape) / x.shape[-1] ** 0.5).to(x.dtype)


def online_hadamard_factor(model: nn.Module, spec: object) -> tuple[torch.Tensor, int]:
    """(F, twos) of a recorded online Hadamard the model can run, else ValueError in one line: its
    modules exist with input size n = 2^twos·m, F is m rows of m signs, F₀₀ = + and F·Fᵀ = m·I."""
    spec = spec if isinstance(spec, dict) else {}
    named, rows, twos = dict(model.named_modules()), spec.get("factor"), spec.get("twos")
    paths = spec.get("modules") if isinstance(spec.get("modules"), list) else []
    sizes = {getattr(named.get(p) if isinstance(p, str) else None, "in_features", None) or
             getattr(named.get(p) if isinstance(p, str) else None, "nx", None) for p in paths}
    fits = (len(sizes) == 1 and type(twos) is int and 0 <= twos < 64 and isinstance(rows, list) and rows != []
            and spec.get("size") == len(rows) << twos == sizes.pop()
            and all(isinstance(row, str) and len(row) == len(rows) and set(row) <= {"+", "-"} for row in rows)
            and rows[0][0] == "+")  # as in every Hadamard matrix normswap builds
    factor = torch.tensor([[1.0 if s == "+" else -1.0 for s in row] for row in rows], device="cpu") if fits else None
    if factor is None or not torch.equal(factor @ factor.T, len(rows) * torch.eye(len(rows), device="cpu")):
        raise ValueError("online_hadamard: the record's modules, size, twos and factor do not fit the model")
    return factor, twos


def apply_online_hadamard(model: nn.Module, spec: dict | None) -> None:
    """x ← x·H/√n at the input of each of ``spec["modules"]``, the record checked first."""
    if spec is not None:
        factor, twos = online_hadamard_factor(model, spec)
        for path in spec["modules"]:
            model.get_submodule(path).register_forward_pre_hook(
                lambda _module, args: (hadamard_transform(args[0], factor, twos), *args[1:]))


class Shortcut(nn.Module):
    """The residual path of a sliced model: the block adds x·S (S = P_inᵀ·P_out, k×k) instead of x.

    A sliced stream has its own basis at every norm input; where a branch's output joins the
    residual, the residual must change basis too. The block's forward adds the residual itself, so
    the branch's output gets x·S - x added (x captured at the norm that reads the residual), which
    makes the sum branch + x·S. The weight is a parameter so it loads with the checkpoint."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, size))
        self.residual: torch.Tensor | None = None

    def capture(self, module, args, kwargs):
        self.residual = args[0] if args else kwargs["hidden_states"]

    def join(self, module, args, output):
        x, self.residual = self.residual, None
        if x is None:
            raise RuntimeError("a sliced block's branch ran without its norm: the residual is unknown")
        change = (x @ self.weight.to(x.dtype)) - x
        if isinstance(output, tuple):
            return (output[0] + change, *output[1:])
        return output + change


def _resize_parameter(model: nn.Module, name: str, axis: int, size: int) -> None:
    parent_path, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, leaf)
    shape = list(old.shape)
    shape[axis] = size
    setattr(parent, leaf, nn.Parameter(torch.empty(shape, device=old.device, dtype=old.dtype),
                                       requires_grad=old.requires_grad))


def _refresh_sizes(module: nn.Module) -> None:
    """Make a module's size attributes agree with its resized weight."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = weight.shape
    elif isinstance(module, nn.Embedding):
        module.embedding_dim = weight.shape[1]
    elif hasattr(module, "nf") and weight.dim() == 2:  # transformers' Conv1D: weight [in, out]
        module.nf = weight.shape[1]
    elif hasattr(module, "normalized_shape"):
        module.normalized_shape = tuple(weight.shape)


def apply_slicing(model: nn.Module, slicing: dict | None) -> None:
    """Shape a model for a sliced checkpoint (``config.normswap.slicing``), before its weights load.

    ``hidden_size`` is the kept stream width k; every parameter matching a ``stream_axes``
    pattern has its stream axis cut to k; every block of ``blocks`` gets one ``Shortcut`` per
    ``branches`` entry (norm, branch), named ``shortcut_<branch>``. The config keeps the original
    width (attention and MLP inner sizes derive from it) and the norms' eps is already the one for
    k dimensions.
    """
    import re

    if not slicing:
        return
    size = int(slicing["hidden_size"])
    patterns = [(re.compile(pattern), int(axis)) for pattern, axis in slicing["stream_axes"]]
    resized = set()
    for name, _ in list(model.named_parameters(remove_duplicate=False)):
        axis = next((axis for pattern, axis in patterns if pattern.fullmatch(name)), None)
        if axis is not None:
            _resize_parameter(model, name, axis, size)
            resized.add(name.rpartition(".")[0])
    for path in resized:
        _refresh_sizes(model.get_submodule(path))
    for block in _module(model, slicing["blocks"], "slicing.blocks"):
        for norm_name, branch_name in slicing["branches"]:
            shortcut = Shortcut(size)
            block.add_module(f"shortcut_{branch_name}", shortcut)
            _module(block, norm_name, "slicing.branches").register_forward_pre_hook(shortcut.capture, with_kwargs=True)
            _module(block, branch_name, "slicing.branches").register_forward_hook(shortcut.join)


def to_rmsnorm_model(model: nn.Module, config) -> nn.Module:
    """Turn a stock model built from a converted config into its RMSNorm form, in place."""
    block = getattr(config, "normswap", None) or {}
    # swap first: a centring hook registered on a LayerNorm must land on the RMSNorm replacing it
    swap_layer_norms(model)
    apply_structure(model, block.get("structure"))
    apply_slicing(model, block.get("slicing"))
    apply_online_hadamard(model, (block.get("rotation") or {}).get("online_hadamard"))
    return model


def rms_class(base: type, own_type: bool = False) -> type:
    """The RMSNorm subclass of a stock transformers model class; with ``own_type`` its config class
    is the ``normswap_<type>`` one (see ``normswap_config_class``)."""

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        to_rmsnorm_model(self, config)

    namespace = {"__init__": __init__, "__module__": __name__}
    if own_type:
        namespace["config_class"] = _lookup(CLASS_PREFIX + base.config_class.__name__)
    prefix = OWN_TYPE_PREFIX if own_type else CLASS_PREFIX
    made = type(prefix + base.__name__, (base,), namespace)
    list_for_pipelines(made.__name__, base.__name__)
    return made


def list_for_pipelines(name: str, base_name: str) -> None:
    """Name a model class beside its stock base in the task tables transformers' pipelines check
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ...; keyed by class name, which no Auto class reaches),
    so that ``pipeline("text-generation", model=...)`` does not log that it is unsupported."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:  # a transformers without this module checks no names either
        return
    for table_name, table in vars(modeling_auto).items():
        if not (table_name.endswith("_MAPPING_NAMES") and isinstance(table, dict)):
            continue
        if any(value == base_name or (isinstance(value, (tuple, list)) and base_name in value) for value in table.values()):
            table.setdefault(name, name)


def normswap_config_class(base: type) -> type:
    """A stock config class under the model type ``normswap_<type>``."""
    return type(CLASS_PREFIX + base.__name__, (base,), {"model_type": MODEL_TYPE_PREFIX + base.model_type,
                                                         "__module__": __name__})


_made: dict[str, type] = {}


def _lookup(name: str) -> type:
    """The class called ``name``: NormswapOnlyX, NormswapX (model or config), made once."""
    if name not in _made:
        own_type = name.startswith(OWN_TYPE_PREFIX)
        base_name = name[len(OWN_TYPE_PREFIX if own_type else CLASS_PREFIX):]
        base = getattr(transformers, base_name, None)
        if not isinstance(base, type):
            raise AttributeError(name)
        if issubclass(base, transformers.PretrainedConfig):
            _made[name] = normswap_config_class(base)
        else:
            _made[name] = rms_class(base, own_type=own_type)
    return _made[name]


def __getattr__(name: str) -> type:
    # transformers resolves auto_map entries with getattr(module, class_name); build them lazily.
    if not name.startswith(CLASS_PREFIX):
        raise AttributeError(name)
    return _lookup(name)
