"""Tiers, markers and the fixtures several test folders share.

Tiers: the per-commit tier (``python -m pytest -q tests``, what ``.ci/run`` runs) skips tests marked ``slow``;
``HETMOE_TEST_ALL=1`` runs them too (CI's second step, and the GPU machine). Tests marked ``gpu`` are skipped
where torch sees no CUDA device. Layout: each folder tests the package folder of its name (tests/README.md).
``paths.py`` names the engine's numerical paths and the bounds between them.
"""

from __future__ import annotations

import os

import pytest
import torch

from paths import PATHS, ids

RUN_ALL = os.environ.get("HETMOE_TEST_ALL", "") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # Triton kernels (where triton is installed) run in its interpreter, chosen when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Parity tests compare with Transformers' own PyTorch modeling code. Transformers >= 5.2x otherwise swaps layers for
# kernels fetched from the Hugging Face Hub on CUDA (and refuses to load without a matching `kernels` package).
os.environ.setdefault("USE_HUB_KERNELS", "0")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow tier: set HETMOE_TEST_ALL=1 to run it")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not RUN_ALL:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


# ---------------------------------------------------------------- engine paths


@pytest.fixture(params=list(PATHS.values()), ids=ids(PATHS.values()))
def engine_path(request):
    """Every numerical path of the CPU expert engine this machine runs (tests/paths.py), one at a time."""
    return request.param


# ---------------------------------------------------------------- engine pools and streams


@pytest.fixture(scope="module")
def pool():
    """A two-thread WorkerPool of the test module's own (not the process-wide shared pool), so pending counts and
    job order are the module's alone."""
    from hetmoe.cpu import WorkerPool

    return WorkerPool(2)


@pytest.fixture
def stream():
    """A ``_C.FakeStream``: a thread that runs host functions in stream order, standing in for a CUDA stream on
    machines without one; resumed and drained after the test."""
    from hetmoe import _C

    fs = _C.FakeStream()
    yield fs
    fs.resume()
    fs.synchronize()


# ---------------------------------------------------------------- checkpoints and caches


class CheckpointFactory:
    """Tiny random checkpoints (hetmoe.load.random_weights.write_checkpoint), each written once per session."""

    def __init__(self, root):
        self.root = root
        self._made = {}

    def __call__(self, arch: str, overrides: dict | None = None, seed: int = 0, dtype: str = "float32", **kw):
        pytest.importorskip("transformers")
        from hetmoe.load.random_weights import write_checkpoint

        key = (arch, repr(sorted((overrides or {}).items())), seed, dtype, repr(sorted(kw.items())))
        if key not in self._made:
            path = self.root / f"{arch}-{len(self._made)}"
            self._made[key] = write_checkpoint(path, arch, overrides, seed=seed, dtype=dtype, **kw)
        return self._made[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """``checkpoints(arch, overrides, seed=, dtype=)``: a tiny random checkpoint directory, shared by every test
    of the session that asks for the same one (tests only read them)."""
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """``hf_checkpoints(family, overrides, seed=, tokenizer=)``: a tiny random checkpoint directory written by
    Transformers' own class with save_pretrained (tests/transformers_tiny.py ``save_tiny``), shared by every test of
    the session that asks for the same one (tests only read them; copy one to change it)."""
    root = tmp_path_factory.mktemp("hf-checkpoints")
    made = {}

    def get(family: str, overrides: dict | None = None, seed: int = 0, tokenizer: bool = False):
        pytest.importorskip("transformers")
        from transformers_tiny import save_tiny

        key = (family, repr(sorted((overrides or {}).items())), seed, tokenizer)
        if key not in made:
            made[key] = save_tiny(family, root / f"{family}-{len(made)}", seed=seed, tokenizer=tokenizer,
                                  overrides=overrides)
        return made[key]

    return get


@pytest.fixture(scope="module")
def qwen3_checkpoint(checkpoints):
    """The tiny qwen3_moe checkpoint (fp32, seed 1) that the command, runner and server tests run."""
    return checkpoints("qwen3_moe", seed=1)


@pytest.fixture(scope="module")
def isolated_env(tmp_path_factory):
    """Environment for subprocesses: the expert cache (XDG_CACHE_HOME) in a fresh tmp dir, never ~/.cache."""
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg-cache"))}
