"""Fixtures of the loader's tests."""

import pytest

from hetmoe.load.checkpoint import Checkpoint


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight read (``Checkpoint.get``, and ``_read`` under it) fails the test: for errors that must come before
    the first one."""
    def get(self, name):
        raise AssertionError(f"weight {name} was read")

    monkeypatch.setattr(Checkpoint, "get", get)
    monkeypatch.setattr(Checkpoint, "_read", get)
