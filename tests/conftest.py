"""Shared pytest setup: the ``ranks`` fixture (multi-process gloo runs) and the ``heavy`` marker."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.harness import run_ranks

pytest_plugins = ["tests.s3"]  # the s3_endpoint / s3_bucket fixtures (a local moto server)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "heavy: slow multi-rank matrix; still run in CI")


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    """``ranks(fn, world_size, *args, timeout=..., **kwargs)`` -> per-rank results, rank order.

    ``fn`` must be a module-level function (see tests/harness.py)."""
    return run_ranks
