"""Where numba caches the compiled kernels (cost/backend.py, [Note: numba cache]): the
user's cache directory, never the installed package; no disk cache where none can be written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wrapopt.cost.backend import numba_cache_dir


def test_numba_cache_dir_respects_the_environment(tmp_path, monkeypatch):
    """NUMBA_CACHE_DIR wins; else $XDG_CACHE_HOME, else ~/.cache, under wrapopt/numba;
    None where the directory cannot be created or written."""
    given = tmp_path / "mine"
    assert numba_cache_dir({"NUMBA_CACHE_DIR": str(given), "XDG_CACHE_HOME": str(tmp_path)}) == str(given)
    assert given.is_dir()
    assert numba_cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == str(tmp_path / "xdg" / "wrapopt" / "numba")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert numba_cache_dir({}) == str(tmp_path / "home" / ".cache" / "wrapopt" / "numba")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert numba_cache_dir({"XDG_CACHE_HOME": str(blocker)}) is None  # cannot create a directory under a file
    assert numba_cache_dir({"NUMBA_CACHE_DIR": str(blocker / "numba")}) is None


def test_compiled_kernels_are_cached_outside_the_package(tmp_path):
    """A process that compiles the kernels writes numba's cache under $XDG_CACHE_HOME, none
    beside wrapopt's sources."""
    pytest.importorskip("numba")
    import wrapopt.cost.kernels as kernels

    pycache = os.path.join(os.path.dirname(kernels.__file__), "__pycache__")
    before = set(os.listdir(pycache)) if os.path.isdir(pycache) else set()
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "WRAPOPT_JIT")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    code = ("import numpy as np; from wrapopt.cost.backend import compile_kernels; "
            "k = compile_kernels(); print(k.lookup(np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([2.0]))[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(kernels.__file__))))
    assert out.stdout.split() == ["0"]
    cached = [f for _d, _s, files in os.walk(tmp_path / "wrapopt" / "numba") for f in files]
    assert any(f.startswith("kernels.lookup") and f.endswith(".nbi") for f in cached), cached
    after = set(os.listdir(pycache)) if os.path.isdir(pycache) else set()
    assert not [f for f in after - before if f.endswith((".nbi", ".nbc"))]
