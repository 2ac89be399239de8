"""The Triton kernels compile for sm_90 (H100/H200) on this CPU-only machine.

Uses Triton's bundled ptxas in a subprocess (see ``sm90_compile_checks.py``): no GPU needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.kernels.sm90_compile_checks import NO_SPILL, SPILL_LIMIT, VARIANTS

REPO_ROOT = Path(__file__).resolve().parents[3]
H100_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (dev extra); the compile checks need it",
)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.kernels.sm90_compile_checks"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_compiles_for_sm90_within_shared_memory(
    compiled: dict[str, dict], name: str
) -> None:
    result = compiled[name]
    if "error" in result and "ptxas" in result["error"] and "No such file" in result["error"]:
        pytest.skip("this Triton wheel ships no ptxas")
    assert "error" not in result, result.get("error")
    assert result["shared"] <= H100_MAX_SHARED, result
    if name in NO_SPILL:
        assert result["spill_bytes"] == 0, f"{name} spills registers: {result}"
    if name in SPILL_LIMIT:
        assert result["spill_bytes"] <= SPILL_LIMIT[name], f"{name} spills more than measured: {result}"
