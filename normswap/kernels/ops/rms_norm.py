"""RMSNorm op: ``torch.library`` custom ops, autograd, and the public function.

``rms_norm(x, weight, bias, eps, residual)`` runs the Triton kernels (``_triton_rms_norm.py``,
launched by ``launch.py``) on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how
the tests exercise them); everywhere else it runs the exact torch fallback (``fallback.py``).

Under autograd the kernel path goes through two custom ops, ``normswap::rms_norm_fwd`` and
``normswap::rms_norm_bwd``, each with a fake (meta) implementation, and the forward op has a
registered autograd formula; ``eps`` is a runtime float, so new eps values do not recompile.
Eager inference calls skip the custom-op dispatch (``launch.forward_eager``). Inside
``torch.compile`` the op is, by ``set_compile_path``, either the fallback's torch ops (the
default: Inductor fuses them with the residual add and the casts around them) or the custom op
(normswap's kernel, opaque to Inductor); both trace with ``fullgraph=True``. Eager calls take
the native ops where ``launch.DispatchConfig.native`` says (``crossover``).

Rounding points (identical to ``normswap.modeling.remote.RMSNorm`` preceded by an unfused add)::

    s    = round_dtype(float32(x) + float32(residual))      # stored; what is normalised
    rstd = rsqrt(sum(float32(s)**2) / N + eps)               # float32
    y    = round_dtype(float32(s) * rstd * float32(w) + float32(b))
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import warnings
from dataclasses import dataclass

import torch

from normswap.extras import install_hint

from . import launch
from .fallback import (
    add_rms_norm_torch,
    forward_native,
    forward_torch,
    needs_graph,
    rms_norm_backward_native,
    rms_norm_backward_torch,
    rms_norm_rstd_torch,
    rms_norm_torch,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpret_mode() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_kernels(x: torch.Tensor) -> bool:
    """Whether ``rms_norm`` sends ``x`` to the Triton kernels rather than the torch fallback."""
    if not (x.is_cuda or (x.is_cpu and interpret_mode())):  # the common CPU exit first
        return False
    if not HAS_TRITON:
        _warn_no_triton()
        return False
    return x.dtype in KERNEL_DTYPES and x.dim() >= 1 and x.shape[-1] >= 1


@functools.cache
def _warn_no_triton() -> None:

    warnings.warn(f"normswap: Triton is not installed, so RMSNorm runs on the torch fallback; "
                  f"the fused kernels come with the 'kernels' extra: {install_hint('kernels')}", stacklevel=3)


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("normswap::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, s, rstd): s = x + residual (empty without a residual), y = RMSNorm(s), rstd per row."""
    if use_kernels(x):
        y, s, rstd = launch.forward(x, weight, bias, residual, eps)
        return y, (s if s is not None else x.new_empty(0)), rstd
    if residual is None:
        y, s = rms_norm_torch(x, weight, bias, eps), x
    else:
        y, s = add_rms_norm_torch(x, residual, weight, bias, eps)
    rstd = rms_norm_rstd_torch(s, eps).float()  # the schema's dtype, even for float64 x
    s = s.contiguous() if residual is not None else x.new_empty(0)
    return y.contiguous(), s, rstd


@rms_norm_fwd.register_fake
def _(x, weight, bias, residual, eps):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else x.new_empty(0)
    return y, s, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("normswap::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor,
    xs: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    ds: torch.Tensor | None,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of y = xs * rstd * w + b, plus ds (the gradient reaching s) into dx.

    dx has xs's dtype; dw and db are float32 sums over rows (the caller casts them); db is
    empty when there is no bias.
    """
    if use_kernels(xs):
        return launch.backward(dy, xs, rstd, weight, ds, has_bias)
    dx, dw, db = rms_norm_backward_torch(dy, xs, rstd, weight, ds)
    return dx.contiguous(), dw, db if has_bias else db.new_empty(0)


@rms_norm_bwd.register_fake
def _(dy, xs, rstd, weight, ds, has_bias):
    n = xs.shape[-1]
    dx = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device)
    return dx, xs.new_empty(n, dtype=torch.float32), xs.new_empty(n if has_bias else 0, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _eps = inputs
    _y, s, rstd = output
    ctx.save_for_backward(s if residual is not None else x, weight, rstd)
    ctx.has_residual = residual is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    # decided with the forward, under the dispatch configuration the forward ran with
    ctx.native_backward = use_kernels(x) and launch.backward_native(x, weight)


def _backward(ctx, dy, ds, _drstd):
    xs, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(xs)
    ds = ds if ctx.has_residual and ds is not None and ds.numel() else None
    if ctx.native_backward:  # the backward autograd runs through F.rms_norm, on the saved rstd
        dx, dw, db = rms_norm_backward_native(dy, xs, rstd, weight, ds)
    else:
        dx, dw, db = torch.ops.normswap.rms_norm_bwd(dy, xs, rstd, weight, ds, ctx.bias_dtype is not None)
    dweight = dw.to(weight.dtype) if weight is not None else None
    dbias = db.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    return dx, dweight, dbias, (dx if ctx.has_residual else None), None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public function


COMPILE_PATHS = launch.COMPILE_PATHS


def set_compile_path(path: str) -> None:
    """Choose how compiled graphs compute the norm (``COMPILE_PATHS``: "decompose", the torch ops
    Inductor fuses with their neighbours, or "kernel", normswap's kernel as an opaque custom op);
    recompile afterwards. The ``compile_path`` of ``launch.DispatchConfig``."""
    if path not in COMPILE_PATHS:
        raise ValueError(f"compile path must be one of {COMPILE_PATHS}, not {path!r}")
    launch.configure(compile_path=path)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    Without ``residual``: ``y = x / sqrt(mean(x**2) + eps) * weight + bias``.
    With ``residual``: ``s = x + residual`` and returns ``(y, s)`` with y the RMSNorm of s, in
    one pass over memory on the kernel path. Statistics, weight multiply and bias add are in
    float32; s and y are each rounded once to x's dtype (see the module docstring).
    """
    _check_arguments(x, weight, bias, eps, residual)
    return rms_norm_checked(x, weight, bias, eps, residual)


def rms_norm_checked(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` for arguments already checked (``_check_arguments``, or
    ``module_rms_norm``'s checks): the door's checks cost about a microsecond per decode call."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        s = x + residual  # broadcasting or type promotion: leave it to torch, then normalise
        return rms_norm_checked(s, weight, bias, eps), s
    if use_kernels(x):
        if torch.compiler.is_compiling():
            if launch.CONFIG.compile_path == "kernel":
                y, s, _ = torch.ops.normswap.rms_norm_fwd(x, weight, bias, residual, float(eps))
                return (y, s) if residual is not None else y
        elif needs_graph(x, weight, bias, residual):
            y, s, _ = torch.ops.normswap.rms_norm_fwd(x, weight, bias, residual, float(eps))
            return (y, s) if residual is not None else y
        else:
            # eager inference: no custom-op dispatch, a cached launch plan (host time is what
            # decode steps pay)
            return launch.forward_eager(x, weight, bias, residual, float(eps))
    return forward_torch(x, weight, bias, residual, eps)


def _check_arguments(x, weight, bias, eps, residual) -> None:
    """``rms_norm``'s arguments at the door: tensors where tensors belong, gains and biases of the
    normalised size, a finite ``eps`` >= 0 (a few isinstance checks: nothing a kernel launch notices)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rms_norm: x must be a torch.Tensor, not {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension (the one normalised)")
    for name, value in (("weight", weight), ("bias", bias), ("residual", residual)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"rms_norm: {name} must be a torch.Tensor or None, not {type(value).__name__}")
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and tuple(value.shape) != (x.shape[-1],):
            raise ValueError(f"rms_norm: {name} must have shape ({x.shape[-1]},) to match x's last dimension, "
                             f"not {tuple(value.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"rms_norm: eps must be a float, not {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"rms_norm: eps must be a finite number >= 0, not {eps}")


# norm.__dict__[_EAGER_PLANS] = {call key: _ModulePlan}: one norm module's eager plans, at most
# MAX_MODULE_PLANS of them (prefill with ever-new lengths adds one per shape; decode reuses one)
_EAGER_PLANS = "_normswap_eager_plans"
MAX_MODULE_PLANS = 64


@dataclass
class _ModulePlan:
    """How a norm module computes one kind of eager call: ``launch_plan`` (None: the torch
    fallback) and, computed once, the kernel's arguments after the tensors with the module's eps."""

    launch_plan: launch._Plan | None
    eps: float
    native: bool = False
    tail: tuple = ()

    def __post_init__(self) -> None:
        if self.launch_plan is not None:
            self.native = self.launch_plan.native
            self.tail = self.launch_plan.tail(self.eps)

    def run(self, x, weight, bias, residual):
        if self.launch_plan is None:
            return forward_torch(x, weight, bias, residual, self.eps)
        if self.native and launch.native_now(self.launch_plan):
            return forward_native(x, weight, residual, self.eps)
        return launch.run_eager(self.launch_plan, x, weight, bias, residual, self.tail)


def module_rms_norm(
    norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` with a norm module's own weight, bias and eps.

    An eager inference call looks its plan up on the module by the call's key (shapes, strides,
    dtypes, device, x's and the residual's pointer alignment, the weight's and bias's pointers,
    dtypes and shapes, eps, ``launch.generation``): a repeated call runs the plan and nothing
    else. The first call of a key runs the door's checks (``_module_arguments_ok``); anything
    they do not pass goes through ``rms_norm`` and its message, and is not cached. Calls under
    autograd or while compiling take the checked path each time.
    """
    params = norm._parameters
    weight = params["weight"] if "weight" in params else getattr(norm, "weight", None)
    bias = params["bias"] if "bias" in params else getattr(norm, "bias", None)
    eps = norm.eps
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and _grad_wanted(x, weight, bias, residual)):
        return _module_checked(x, weight, bias, eps, residual)
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
               None if residual is None else (residual.shape, residual.stride(), residual.dtype,
                                              residual.data_ptr() & 15),
               None if weight is None else (weight.data_ptr(), weight.dtype, weight.shape),
               None if bias is None else (bias.data_ptr(), bias.dtype, bias.shape),
               eps, launch.generation)  # fmt: skip
        plan = norm.__dict__[_EAGER_PLANS][key]
    except (AttributeError, TypeError):  # not tensors, or an unhashable eps: the door says which
        return rms_norm(x, weight, bias, eps, residual=residual)
    except KeyError:
        return _first_call(norm, key, x, weight, bias, eps, residual)
    return plan.run(x, weight, bias, residual)


def _grad_wanted(x, weight, bias, residual) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, weight, bias, residual))


def _module_arguments_ok(x, weight, bias, eps, residual) -> bool:
    """The door's checks as a module's call needs them (its weight and bias are its tensors, its
    residual the block's), in a fraction of their time."""
    if isinstance(x, torch.Tensor) and x.dim() and (residual is None or isinstance(residual, torch.Tensor)):
        last = x.shape[-1:]
        return ((weight is None or (isinstance(weight, torch.Tensor) and weight.shape == last))
                and (bias is None or (isinstance(bias, torch.Tensor) and bias.shape == last))
                and type(eps) is float and 0 <= eps < math.inf)  # fmt: skip
    return False


def _module_checked(x, weight, bias, eps, residual):
    if _module_arguments_ok(x, weight, bias, eps, residual):
        return rms_norm_checked(x, weight, bias, eps, residual)
    return rms_norm(x, weight, bias, eps, residual=residual)


def _first_call(norm, key, x, weight, bias, eps, residual):
    """The first eager call of ``key`` on ``norm``: the checks, then a plan cached on the module."""
    if not _module_arguments_ok(x, weight, bias, eps, residual):
        return rms_norm(x, weight, bias, eps, residual=residual)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return rms_norm_checked(x, weight, bias, eps, residual)  # broadcasting: not planned
    plan = _ModulePlan(launch.eager_plan(x, weight, bias, residual) if use_kernels(x) else None, eps)
    plans = norm.__dict__.setdefault(_EAGER_PLANS, {})
    if len(plans) >= MAX_MODULE_PLANS:
        del plans[next(iter(plans))]  # the oldest
    plans[key] = plan
    return plan.run(x, weight, bias, residual)
