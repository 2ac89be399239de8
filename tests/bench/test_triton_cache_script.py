"""scripts/triton_cache.sh: a Triton cache packed by one GPU run unpacks into the next run's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "triton_cache.sh"


def _run(*args: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "TRITON_CACHE_DIR": str(cache), **env},
                          capture_output=True, text=True, check=True)  # fmt: skip


def test_pack_then_unpack_restores_the_cache(tmp_path: Path) -> None:
    first = tmp_path / "first"
    (first / "ab12").mkdir(parents=True)
    (first / "ab12" / "_kernel.cubin").write_bytes(os.urandom(4096))
    (first / "ab12" / "__grp___kernel.json").write_text('{"child_paths": {}}')
    tar = tmp_path / "triton-cache.tar.gz"
    assert "packed" in _run("pack", str(tar), cache=first).stdout and tar.is_file()
    second = tmp_path / "second"  # a fresh machine's (missing) cache folder
    out = _run("unpack", str(tar), cache=second).stdout
    assert "2 files" in out
    for name in ("_kernel.cubin", "__grp___kernel.json"):
        assert (second / "ab12" / name).read_bytes() == (first / "ab12" / name).read_bytes()


def test_a_cache_too_large_is_not_packed_and_a_missing_one_is_compiled(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "big.cubin").write_bytes(os.urandom(2 << 20))  # 2 MiB that do not compress
    tar = tmp_path / "out.tar.gz"
    out = _run("pack", str(tar), cache=cache, TRITON_CACHE_MAX_MB="1").stdout
    assert "not packed" in out and not tar.exists()
    assert "compiling" in _run("unpack", str(tmp_path / "none.tar.gz"), cache=tmp_path / "fresh").stdout
