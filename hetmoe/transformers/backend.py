"""The ``"hetmoe"`` experts implementation of Transformers' experts interface.

Transformers (5.x) decorates the routed-experts module of most MoE families with ``@use_experts_implementation``;
its forward then dispatches on ``config._experts_implementation`` to a registered function that receives
``(module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``, routing and shared experts being the
model's. ``register()`` adds ``hetmoe_experts_forward`` under the name ``"hetmoe"``: a module with a
``CPUExperts`` attached (``attach``) computes there; any other module runs Transformers' own (eager) forward.

The engine computes ``sum_j w[t, j] * down_e(silu(gate_e x) * up_e x)`` and nothing else, so ``unsupported`` names
every variant it cannot compute exactly (expert biases, a custom gate such as gpt-oss's clamped SwiGLU, another
activation, no gate, a post-expert norm); those modules keep Transformers' implementation (one warning at load).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

NAME = "hetmoe"
ENGINE_ATTR = "_hetmoe_experts"  # the CPUExperts of a module computed by hetmoe
# The Transformers versions this backend runs (pyproject's test extra says the same; docs/transformers.md): 5.7 is
# the first whose experts modules carry every attribute read here (``has_gate`` came in 5.3, ``is_concatenated`` in
# 5.7); a 6.x is unknown. tests/transformers pass on 5.7, 5.17 and 5.25.
MIN_VERSION, BELOW_VERSION = (5, 7), (6, 0)
SUPPORTED = ">=5.7,<6"


class FallbackWarning(UserWarning):
    """Experts modules the engine cannot compute exactly run with Transformers' own implementation."""


def check_version(version: str) -> None:
    """An ImportError naming the supported range when Transformers ``version`` is outside it."""
    try:
        got = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        got = None  # a local build with an odd version string: let it run
    if got is not None and not MIN_VERSION <= got < BELOW_VERSION:
        raise ImportError(f"hetmoe.transformers runs transformers {SUPPORTED}; transformers {version} is installed "
                          f"(pip install 'transformers{SUPPORTED}')")


def register() -> None:
    """Register ``"hetmoe"`` in Transformers' experts interface (idempotent); an ImportError where the installed
    Transformers is outside the supported versions."""
    import transformers

    check_version(transformers.__version__)  # before importing what an older one may not have
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, hetmoe_experts_forward)


def is_experts_module(module: nn.Module) -> bool:
    """A module decorated with ``@use_experts_implementation`` (its forward dispatches through the interface)."""
    return hasattr(module, "is_transposed") and hasattr(module, "has_gate") and \
        hasattr(type(module).forward, "__wrapped__")


def _is_silu(act) -> bool:
    if act is F.silu or isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover - older transformers
        return False
    return isinstance(act, SiLUActivation)


def unsupported(module: nn.Module) -> Optional[str]:
    """Why the engine cannot compute ``module`` exactly, every reason joined (None: it can)."""
    from transformers.integrations.moe import _default_apply_gate

    why = []
    if not module.has_gate:
        why.append("no gate projection (act(up x) experts)")
    if module.has_bias:
        why.append("expert biases")
    if getattr(module, "has_post_expert_norm", False):
        why.append("a norm after each expert")
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        why.append(f"its own gate function ({type(module).__name__}._apply_gate, e.g. a clamped SwiGLU)")
    elif module.has_gate and not _is_silu(getattr(module, "act_fn", None)):
        act = getattr(module, "act_fn", None)
        why.append(f"activation {getattr(act, '__name__', type(act).__name__)} (the engine computes SiLU-gated "
                   "experts)")
    for name in ("gate_up_proj", "down_proj") if module.has_gate else ():
        p = getattr(module, name, None)
        if not isinstance(p, torch.Tensor) or p.dim() != 3:
            why.append(f"no 3-D {name} parameter")
    return "; ".join(why) or None


def expert_shape(module: nn.Module) -> tuple:
    """(E, H, I) of a decorated experts module from its parameters' shapes (meta or real)."""
    gu, down = module.gate_up_proj, module.down_proj
    if module.is_transposed:  # gate_up [E, H, 2I], down [E, I, H]
        E, H, I2 = gu.shape
    else:  # gate_up [E, 2I, H], down [E, H, I]
        E, I2, H = gu.shape
    I = I2 // 2
    want = (E, I, H) if module.is_transposed else (E, H, I)
    if I2 % 2 or tuple(down.shape) != want:
        raise ValueError(f"{type(module).__name__}: gate_up_proj {tuple(gu.shape)} and down_proj "
                         f"{tuple(down.shape)} do not describe gated experts")
    return E, H, I


def attach(module: nn.Module, experts) -> None:
    """Compute ``module`` on ``experts`` (a loaded CPUExperts) from now on; its expert parameters are dropped (they
    live packed in the engine), so a moved model never copies them."""
    for name in ("gate_up_proj", "down_proj"):
        module._parameters.pop(name, None)
    module.__dict__[ENGINE_ATTR] = experts


def engine_of(module: nn.Module):
    return module.__dict__.get(ENGINE_ATTR)


def _original_forward(module: nn.Module):
    return inspect.unwrap(type(module).forward)


def hetmoe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of one MoE layer on the CPU engine: hidden_states [T, H] (any device), top_k_index [T, k],
    top_k_weights [T, k] or [T, E] (a dense row per token: the weights of the chosen experts are gathered) ->
    [T, H] on hidden_states' device and dtype."""
    experts = engine_of(self)
    if experts is None:  # Transformers' own, where the module's weights are (a rule may place them elsewhere)
        where = self.down_proj.device
        if where == hidden_states.device:
            return _original_forward(self)(self, hidden_states, top_k_index, top_k_weights)
        out = _original_forward(self)(self, hidden_states.to(where), top_k_index.to(where), top_k_weights.to(where))
        return out.to(hidden_states.device)
    E = experts.num_experts
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    T = x.shape[0]
    ids = top_k_index.reshape(T, -1)
    k = ids.shape[1]
    w = top_k_weights.reshape(T, -1)
    if w.shape[1] != k:
        if w.shape[1] != E:
            raise ValueError(f"top_k_weights has shape {tuple(top_k_weights.shape)}; expected [T={T}, k={k}] or "
                             f"[T, E={E}]")
        w = w.gather(1, ids.clamp(0, E - 1))  # [T, k]
    ids = ids.to("cpu", torch.int64)
    ids = torch.where((ids < 0) | (ids >= E), torch.full_like(ids, -1), ids).contiguous()  # EP sentinels: skip
    w = w.detach().to("cpu", torch.float32).contiguous()
    engine_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    xc = x.detach().to("cpu", engine_dtype).contiguous()
    out = experts.forward(xc, ids, w)
    return out.to(hidden_states.device, hidden_states.dtype).reshape(shape)
