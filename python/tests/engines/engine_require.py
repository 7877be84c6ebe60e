"""Imports an engine's interface for the engine tests: a missing one skips the test module,
or fails it when GPUCACHE_REQUIRE_ENGINES=1 (CI, after scripts/setup.sh engines)."""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str):
    """The module, imported; skips (or fails under GPUCACHE_REQUIRE_ENGINES=1) without it."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # an engine's import can fail on any missing piece below it
        why = f"{module} does not import ({type(e).__name__}: {e})"
        if os.environ.get("GPUCACHE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"GPUCACHE_REQUIRE_ENGINES=1 but {why}; run scripts/setup.sh engines",
                        pytrace=False)
        pytest.skip(why, allow_module_level=True)
