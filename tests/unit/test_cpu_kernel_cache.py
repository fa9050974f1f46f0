"""Where the native CPU kernel is built and loaded from: only a private directory and a library
file of our own are trusted. Another local user must not be able to plant a library we load."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.kernels import library

# The compiler of this machine, fixed before any test points CC elsewhere.
REAL_COMPILER = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")

pytestmark = [pytest.mark.skipif(not REAL_COMPILER, reason="no C compiler: the kernel is never built"),
              pytest.mark.slow]  # the module builds the library once (~11 s)

PLANTED_SRC = "int planted_by_someone_else = 1;\nvoid decode_attention(void) {}\n"

# A stand-in compiler for the tests of where the library goes (not of how it is compiled): it
# answers --version as the real one (so the library keeps its name) and "builds" by copying the
# library the module built once. library._compile runs as ever around it (temporary name, chmod,
# rename), so every check of the cache and of the file loaded sees what a real build leaves.
COPYING_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then exec {real} --version; fi
while [ $# -gt 0 ]; do
    if [ "$1" = "-o" ]; then exec cp {built} "$2"; fi
    shift
done
exit 1
"""


def _compiler() -> str:
    assert REAL_COMPILER is not None  # the module is skipped without one
    return REAL_COMPILER


def _load_fresh(monkeypatch, cache_root: Path):
    """The library as a new process would load it, with ENGINE_CACHE_DIR=cache_root."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(cache_root))
    for name in ("ENGINE_CPU_DECODE_KERNEL", "ENGINE_CPU_FUSED_OPS", "ENGINE_CPU_KERNEL_ATTENTION", "ENGINE_CPU_KERNEL_LINEAR",
                 "ENGINE_CPU_KERNEL_OPS", "ENGINE_CPU_KERNEL_DECODER_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(library, "_switches", None)
    monkeypatch.setattr(library, "_kernel", library._UNSET)
    return library._kernels()


def _is_planted(lib: library.Kernels) -> bool:
    return hasattr(lib.cdll, "planted_by_someone_else")


@pytest.fixture(scope="module")
def reference_library(tmp_path_factory) -> Path:
    """The library built once by the real compiler; its file name is keyed by source, flags,
    compiler and CPU."""
    root = tmp_path_factory.mktemp("reference-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CC", _compiler())
        lib = _load_fresh(mp, root)
    assert lib is not None
    paths = list((root / "kernels").iterdir())
    assert len(paths) == 1 and paths[0].name.endswith(".so"), paths
    return paths[0]


@pytest.fixture
def library_name(monkeypatch, tmp_path_factory, reference_library) -> str:
    """The reference library's file name; this test's builds copy it (COPYING_COMPILER)."""
    import shlex

    script = tmp_path_factory.mktemp("copying-cc") / "cc"
    script.write_text(COPYING_COMPILER.format(real=shlex.quote(_compiler()), built=shlex.quote(str(reference_library))))
    script.chmod(0o700)
    monkeypatch.setenv("CC", str(script))
    return reference_library.name


def _plant(path: Path, tmp_path: Path) -> None:
    src = tmp_path / "planted.c"
    src.write_text(PLANTED_SRC)
    subprocess.run([_compiler(), "-shared", "-fPIC", str(src), "-o", str(path)], check=True, timeout=120)


def test_a_fresh_cache_directory_is_private(monkeypatch, tmp_path, library_name):
    lib = _load_fresh(monkeypatch, tmp_path / "cache")
    assert lib is not None and not _is_planted(lib)
    kernels = tmp_path / "cache" / "kernels"
    assert (kernels.stat().st_mode & 0o777) == 0o700
    so = kernels / library_name
    assert so.stat().st_uid == os.getuid() and (so.stat().st_mode & 0o022) == 0


def test_a_world_writable_cache_directory_is_refused(monkeypatch, tmp_path, library_name, caplog):
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True)
    kernels.chmod(0o777)
    _plant(kernels / library_name, tmp_path)
    lib = _load_fresh(monkeypatch, tmp_path / "cache")
    assert lib is not None, "refusing the directory must build elsewhere, not lose the kernel"
    assert not _is_planted(lib)
    assert "writable by group or others" in caplog.text


def test_a_symlinked_cache_directory_is_refused(monkeypatch, tmp_path, library_name, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    _plant(elsewhere / library_name, tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(elsewhere)
    lib = _load_fresh(monkeypatch, tmp_path / "cache")
    assert lib is not None and not _is_planted(lib)
    assert "symbolic link" in caplog.text


def test_a_group_writable_library_in_a_private_directory_is_refused(monkeypatch, tmp_path, library_name, caplog):
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    _plant(kernels / library_name, tmp_path)
    (kernels / library_name).chmod(0o775)
    lib = _load_fresh(monkeypatch, tmp_path / "cache")
    assert lib is not None and not _is_planted(lib)
    assert "writable by group or others" in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_library_owned_by_another_user_is_refused(monkeypatch, tmp_path, library_name, caplog):
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    _plant(kernels / library_name, tmp_path)
    os.chown(kernels / library_name, 65534, 65534)
    lib = _load_fresh(monkeypatch, tmp_path / "cache")
    assert lib is not None and not _is_planted(lib)
    assert "owned by uid 65534" in caplog.text


def test_a_compiler_that_hangs_is_stopped(monkeypatch, tmp_path, caplog):
    """The build runs under a timeout: a stuck compiler costs the kernel, not the server start."""
    fake = tmp_path / "hanging-cc"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo fake-cc 1.0; exit 0; fi\nexec sleep 600\n')
    fake.chmod(0o700)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(library, "COMPILE_TIMEOUT_S", 0.5)
    assert _load_fresh(monkeypatch, tmp_path / "cache") is None
    assert "Building the CPU kernel library timed out" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").iterdir())  # no half-built file left behind


# ---------------------------------------------------------------------- the directories above the cache
def test_a_cache_under_a_world_writable_parent_is_refused(monkeypatch, tmp_path, library_name, caplog):
    """Whoever can rename entries of a parent can swap the whole private cache for theirs: a
    parent writable by others (and not sticky) makes the cache untrusted, however private it is."""
    shared = tmp_path / "shared"
    kernels = shared / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)
    _plant(kernels / library_name, tmp_path)
    (kernels / library_name).chmod(0o700)
    lib = _load_fresh(monkeypatch, shared)
    assert lib is not None and not _is_planted(lib)
    assert "above the cache" in caplog.text and "not sticky" in caplog.text


def test_a_cache_under_a_sticky_parent_is_used(monkeypatch, tmp_path, library_name):
    """Like /tmp: others may add entries to a sticky directory but not rename ours."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    lib = _load_fresh(monkeypatch, sticky)
    assert lib is not None and not _is_planted(lib)
    assert (sticky / "kernels" / library_name).is_file()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_under_a_parent_owned_by_another_user_is_refused(monkeypatch, tmp_path, library_name, caplog):
    theirs = tmp_path / "theirs"
    kernels = theirs / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    _plant(kernels / library_name, tmp_path)
    (kernels / library_name).chmod(0o700)
    os.chown(theirs, 65534, 65534)
    lib = _load_fresh(monkeypatch, theirs)
    assert lib is not None and not _is_planted(lib)
    assert "owned by uid 65534" in caplog.text


def test_the_library_loaded_is_the_one_checked(monkeypatch, tmp_path, library_name):
    """A file swapped in after the checks (the race of a path opened twice) is not what gets
    loaded: the library is opened once and loaded through that descriptor."""
    planted = tmp_path / "planted.so"
    _plant(planted, tmp_path)
    planted.chmod(0o700)
    target = tmp_path / "cache" / "kernels" / library_name
    real_cdll = ctypes.CDLL

    def swap_then_load(name, *args, **kwargs):
        if os.path.exists(target) and not os.path.samefile(target, planted):
            os.replace(planted, target)  # the attacker wins the race right before dlopen
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", swap_then_load)
    lib = _load_fresh(monkeypatch, tmp_path / "cache")
    assert lib is not None and not _is_planted(lib)
    assert hasattr(lib.cdll, "decode_attention")


def test_a_symlinked_library_file_is_refused(monkeypatch, tmp_path, library_name, caplog):
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    _plant(tmp_path / "elsewhere.so", tmp_path)
    (kernels / library_name).symlink_to(tmp_path / "elsewhere.so")
    lib = _load_fresh(monkeypatch, tmp_path / "cache")
    assert lib is not None and not _is_planted(lib)
    assert "Not using the CPU kernel cache" in caplog.text
