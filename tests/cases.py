"""Random inputs for the engine tests: reproducible from a seed derived from each case's parameters."""

from __future__ import annotations

import zlib

import torch

# The engine's formats under test: name -> (weight_format, group_size); group 0 = per-row scales.
FORMATS = {
    "bf16": ("bf16", 128),
    "int8-g32": ("int8", 32),
    "int8-g64": ("int8", 64),
    "int8-g128": ("int8", 128),
    "int8-row": ("int8", 0),
    "int4-g32": ("int4", 32),
    "int4-g64": ("int4", 64),
    "int4-g128": ("int4", 128),
    "int4-row": ("int4", 0),
}

WEIGHT_STD = 0.02  # gaussian expert weights, like a freshly initialised (or typical trained) MoE layer


def seed_of(*params) -> int:
    """A fixed seed for a parameter combination (stable across runs, unlike hash())."""
    return zlib.crc32(repr(params).encode())


def generator(*params) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(*params))


def make_weights(E: int, H: int, I: int, *params):
    """Gaussian gate, up [E, I, H] and down [E, H, I] (fp32)."""
    gen = generator("weights", E, H, I, *params)
    gate = torch.randn(E, I, H, generator=gen) * WEIGHT_STD
    up = torch.randn(E, I, H, generator=gen) * WEIGHT_STD
    down = torch.randn(E, H, I, generator=gen) * WEIGHT_STD
    return gate, up, down


def make_x(T: int, H: int, *params) -> torch.Tensor:
    return torch.randn(T, H, generator=generator("x", T, H, *params))


def make_routing(T: int, k: int, E: int, *params, n_cold: int = 2, p_skip: float = 0.15, hot_share: float = 0.0):
    """topk_ids [T, k] int64 and topk_weights [T, k] fp32 (positive).

    Each token picks k distinct experts among E - n_cold "hot" ones (the n_cold others receive no token);
    about p_skip of the entries are -1, except entry [0, 0] so the output is never all zero. With
    hot_share > 0, that fraction of the tokens put one favourite expert first (skewed prefill routing).
    """
    gen = generator("routing", T, k, E, n_cold, p_skip, hot_share, *params)
    if k > E - n_cold:
        raise ValueError(f"k={k} needs at least {k} hot experts, have {E - n_cold}")
    scores = torch.rand(T, E, generator=gen)
    cold = torch.randperm(E, generator=gen)[:n_cold]
    scores[:, cold] = -1.0
    if hot_share > 0:
        favourite = int(torch.randint(E, (1,), generator=gen))
        while favourite in cold.tolist():
            favourite = (favourite + 1) % E
        scores[torch.rand(T, generator=gen) < hot_share, favourite] = 2.0
    ids = scores.topk(k, dim=1).indices
    skip = torch.rand(T, k, generator=gen) < p_skip
    if T:
        skip[0, 0] = False
    ids[skip] = -1
    weights = torch.rand(T, k, generator=gen) + 0.05
    return ids, weights
