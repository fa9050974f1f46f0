"""The native CPU kernel library (csrc/), compiled on first use with the system C compiler and loaded
with ctypes.

One library holds every kernel family: attention (engine/kernels/attention.py), the fused
element-wise ops (ops.py), the bf16 linears (linear.py), a batch's LoRA deltas (engine/lora/backend.py)
and a decode step's decoder layers in one call (decoder_layers.py). It is built once per machine into
`$ENGINE_CACHE_DIR/kernels` (default `~/.cache/engine/kernels`), keyed by the source, the flags,
the compiler and the CPU's instruction set. Each family has an accessor here (`ops()`, `linear()`,
`lora()`, `attention()`, `decoder_layers()`) typed by its protocol (boundary.py), and a switch
(`ENGINE_CPU_KERNEL_<FAMILY>=0`, Family); an accessor returns None where its family is off or there
is no library (no C compiler, a failed build), and the callers keep their pure-torch paths, which
give the same results.

Loading a shared library runs its code in the server, so only a library nobody else can have
written is loaded: the cache directory must be a real directory (not a symbolic link) owned by
this user and not writable by group or others (it is created 0700), and so must the library file.
Every directory above it (after symbolic links in `$ENGINE_CACHE_DIR` itself are resolved) must be
owned by this user or root and not writable by group or others unless it is sticky (like /tmp):
whoever can rename an entry of a parent could swap the whole cache for a directory of theirs.
The directories are opened one by one without following links and the library is opened with
O_NOFOLLOW, checked on its descriptor (fstat) and loaded through that descriptor
(/proc/self/fd/N), so what is loaded is the file that was checked, not whatever the path names a
moment later. A cache that fails a check is refused with a warning and the kernel is built in a
fresh private temporary directory for this process. The compiler runs under a timeout
(COMPILE_TIMEOUT_S).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Union, cast

from engine.kernels.boundary import (AttentionKernels, DecoderLayersKernels, LibraryKernels, LinearKernels,
                                     LoRAKernels, OpsKernels, bind)

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# engine_kernels.h: everything the library exports (the boundary, boundary.py); decode_attention.c:
# the decode kernel; extend_attention.c: prefill attention (bf16); cpu_ops.c: the fused element-wise
# ops of a decoder layer (ops.py); linear_bf16.c: bf16 linears (linear.py);
# linear_q8.c: linears over int8 / fp8 weights (layers/quantization.py); linear_w8a8.c: int8 weights by int8
# activations (the same); linear_q4.c: over 4-bit AWQ / GPTQ
# weights (layers/int4.py); linear_mxfp4.c: over gpt-oss's MXFP4 experts (layers/mxfp4.py); lora_delta.c: a
# batch's LoRA deltas of one projection (engine/lora/backend.py); decoder_layers.c: a decode
# step's layers in one call (decoder_layers.py); thread_pool.c: the threads they run on; library.c:
# what the build holds; cpu_common.h: what they share; amx.h: the AMX tiles; attend_step.h: the
# attention step of prefills and cascade prefixes. One library holds them all.
_SOURCES = [_CSRC / "decode_attention.c", _CSRC / "extend_attention.c", _CSRC / "cpu_ops.c", _CSRC / "linear_bf16.c",
            _CSRC / "linear_q8.c", _CSRC / "linear_w8a8.c", _CSRC / "linear_q4.c", _CSRC / "linear_mxfp4.c",
            _CSRC / "lora_delta.c", _CSRC / "moe.c", _CSRC / "decoder_layers.c", _CSRC / "thread_pool.c", _CSRC / "library.c"]
_HEADERS = [_CSRC / "engine_kernels.h", _CSRC / "cpu_common.h", _CSRC / "amx.h", _CSRC / "attend_step.h"]
# -fopenmp-simd: the `omp simd` hints only; the threads are the library's own (csrc/thread_pool.c).
# -fvisibility=hidden: only engine_kernels.h's ENGINE_API functions are exported.
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11", "-pthread", "-fvisibility=hidden"]
# The portable build (ENGINE_CPU_KERNEL_PORTABLE=1, build(portable=True)): the generic C paths only,
# whatever the CPU. The kernels' ISA-specific code is all behind __AVX512F__, __AVX512BF16__ and the
# AMX macros (engine_kernels_isa() reports which were compiled), and these flags leave them undefined
# (-mno-avx512f takes every AVX-512 extension with it, VNNI included; HAVE_AMX needs the AMX tile and bf16
# macros, the int8 tiles __AMX_INT8__ too); other
# architectures have none of them.
_PORTABLE_FLAGS = ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"] if platform.machine() in ("x86_64", "AMD64") else []
# A build takes about a second; a compiler stuck for this long costs the kernel, not the server.
COMPILE_TIMEOUT_S = 120.0


class _Unset:
    """The kernel was not looked for yet (None: looked for, not available)."""


@dataclass(frozen=True)
class Kernels:
    """The loaded library's functions by family, each typed by its protocol (boundary.py)."""

    cdll: ctypes.CDLL  # what they were bound from (its tests ask it for symbols)
    library: LibraryKernels
    ops: OpsKernels
    linear: LinearKernels
    lora: LoRAKernels
    attention: AttentionKernels
    decoder_layers: DecoderLayersKernels


_UNSET = _Unset()
_kernel: Union[Kernels, None, _Unset] = _UNSET


class _UntrustedPath(Exception):
    """A cache directory or library file that someone other than this user could have written."""


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _check_owned(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid():
        raise _UntrustedPath(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _UntrustedPath(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _check_ancestor(path: Path, st: os.stat_result) -> None:
    """A directory above the cache: whoever can rename its entries could swap the cache."""
    if st.st_uid not in (os.getuid(), 0):
        raise _UntrustedPath(f"{path} (above the cache) is owned by uid {st.st_uid}, neither this user nor root")
    # A sticky directory (/tmp) lets others add entries but not rename or remove ours.
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise _UntrustedPath(f"{path} (above the cache) is writable by group or others and not sticky "
                             f"(mode {stat.S_IMODE(st.st_mode):o})")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_nofollow(name: str, dir_fd: int, flags: int, shown: Path) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a symbolic link, or not a directory
            kind = "directory" if flags & os.O_DIRECTORY else "regular file"
            raise _UntrustedPath(f"{shown} is a symbolic link or not a {kind}") from e
        raise


def _open_trusted_root(root: Path) -> int:
    """A descriptor of `root`, walked from / one directory at a time without following links,
    each checked with _check_ancestor. Links in `root` itself are resolved first: where they lead
    is what gets checked."""
    real = Path(os.path.realpath(root))
    fd = os.open("/", _DIR_FLAGS)
    try:
        _check_ancestor(Path("/"), os.fstat(fd))
        walked = Path("/")
        for part in real.parts[1:]:
            walked = walked / part
            child = _open_nofollow(part, fd, _DIR_FLAGS, walked)
            os.close(fd)
            fd = child
            _check_ancestor(walked, os.fstat(fd))
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_private_dir(name: str, parent_fd: int, shown: Path) -> int:
    fd = _open_nofollow(name, parent_fd, _DIR_FLAGS, shown)
    try:
        _check_owned(shown, os.fstat(fd))
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_library(name: str, dir_fd: int, shown: Path) -> int:
    """The library's descriptor, opened without following a link and checked on that descriptor."""
    fd = _open_nofollow(name, dir_fd, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, shown)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _UntrustedPath(f"{shown} is not a regular file")
        _check_owned(shown, st)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _load_checked(fd: int, shown: Path) -> ctypes.CDLL:
    """dlopen the file behind `fd`, the one that was checked, whatever its path names by now.

    The descriptor is never closed: the dynamic loader remembers a library by the name it was
    opened under and hands back the library already loaded for a name it has seen, so the name
    /proc/self/fd/N must keep meaning this file for as long as the process runs (one descriptor
    per process: the kernel is loaded once)."""
    by_fd = f"/proc/self/fd/{fd}"
    if os.path.exists(by_fd):
        return ctypes.CDLL(by_fd)
    os.close(fd)  # no /proc: the checked path chain is private to this user, load it by path
    return ctypes.CDLL(str(shown))


def _cache_dir() -> Path:
    return Path(os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "engine") / "kernels"


def _compile(compiler: str, out: Path, flags: List[str]) -> bool:
    try:
        proc = subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(out), "-lm"], capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.warning("Building the CPU kernel library timed out after %.0f s; every layer keeps its torch "
                       "path.", COMPILE_TIMEOUT_S)
        return False
    if proc.returncode != 0:
        logger.warning("Building the CPU kernel library failed; every layer keeps its torch path.\n%s",
                       proc.stderr[-2000:])
        return False
    os.chmod(out, 0o700)  # whatever the umask: never group- or world-writable
    return True


def _load_from_cache(cache: Path, name: str, compiler: str, flags: List[str]) -> Optional[ctypes.CDLL]:
    """Load (building it first if missing) `cache/name`; raises _UntrustedPath for a foreign cache."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    root_fd = _open_trusted_root(cache.parent)
    try:
        try:
            os.mkdir(cache.name, mode=0o700, dir_fd=root_fd)
        except FileExistsError:
            pass
        cache_fd = _open_private_dir(cache.name, root_fd, cache)
    finally:
        os.close(root_fd)
    try:
        # Every directory up to here is this user's (or root's) alone: paths under the cache's
        # real path now name what was checked, so the compiler may write to them.
        real_cache = Path(os.path.realpath(cache.parent)) / cache.name
        try:
            lib_fd = _open_library(name, cache_fd, cache / name)
        except FileNotFoundError:
            # Build under a private name, then rename: concurrent processes never see half a file.
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=real_cache)
            os.close(fd)
            if not _compile(compiler, Path(tmp), flags):
                os.unlink(tmp)
                return None
            os.replace(os.path.basename(tmp), name, src_dir_fd=cache_fd, dst_dir_fd=cache_fd)
            lib_fd = _open_library(name, cache_fd, cache / name)
    finally:
        os.close(cache_fd)
    return _load_checked(lib_fd, real_cache / name)


def _load_private_build(name: str, compiler: str, flags: List[str]) -> Optional[ctypes.CDLL]:
    """Build into a fresh temporary directory only this process knows, load, then remove it."""
    private = Path(tempfile.mkdtemp(prefix="engine-kernels-"))  # mode 0700, unpredictable name
    try:
        lib_path = private / name
        if not _compile(compiler, lib_path, flags):
            return None
        dir_fd = os.open(private, _DIR_FLAGS)
        try:
            lib_fd = _open_library(name, dir_fd, lib_path)
        finally:
            os.close(dir_fd)
        return _load_checked(lib_fd, lib_path)  # the mapping outlives the file
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _build(flags: List[str]) -> Optional[ctypes.CDLL]:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.info("No C compiler found: the CPU kernels are not built; every layer keeps its torch path.")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=COMPILE_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired:
        logger.warning("`%s --version` timed out after %.0f s; every layer keeps its torch path.", compiler,
                       COMPILE_TIMEOUT_S)
        return None
    sources = "\0".join(p.read_text() for p in _SOURCES + _HEADERS)
    key = hashlib.sha256("\0".join([sources, " ".join(flags), version, _cpu_signature()]).encode())
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    cache = _cache_dir()
    try:
        lib = _load_from_cache(cache, name, compiler, flags)
    except _UntrustedPath as e:
        logger.warning("Not using the CPU kernel cache: %s (make it private to this user, or remove it). "
                       "Building the kernel in a private temporary directory instead.", e)
    except OSError as e:  # a read-only home, say
        logger.info("The CPU kernel cache %s is unusable (%s); building in a private temporary directory.",
                    cache, e)
    else:
        return lib
    return _load_private_build(name, compiler, flags)


def _declare(lib: ctypes.CDLL) -> Kernels:
    # The protocols type what bind() builds from the header after checking them against it.
    families = bind(lib)
    kernels = Kernels(cdll=lib, library=cast(LibraryKernels, families["library"]), ops=cast(OpsKernels, families["ops"]),
                      linear=cast(LinearKernels, families["linear"]), lora=cast(LoRAKernels, families["lora"]),
                      attention=cast(AttentionKernels, families["attention"]),
                      decoder_layers=cast(DecoderLayersKernels, families["decoder_layers"]))
    kernels.library.amx_set(int(os.environ.get("ENGINE_CPU_AMX", "1") != "0"))
    return kernels


class Family(enum.Enum):
    """A kernel family, switched on and off as a whole (ENGINE_CPU_KERNEL_<NAME>=0 turns it off)."""

    ATTENTION = "ATTENTION"  # decode and prefill attention (attention.py)
    LINEAR = "LINEAR"  # the bf16 linears (linear.py)
    OPS = "OPS"  # the fused element-wise ops and the greedy argmax (ops.py)
    DECODER_LAYERS = "DECODER_LAYERS"  # a bf16 decode step's layers in one call (decoder_layers.py)
    LORA = "LORA"  # a batch's LoRA deltas, one call per projection (engine/lora/backend.py)


# The families whose work the one decode-step call (decoder_layers) does itself: it runs only with all
# of them on. Not LORA: a batch with adapter rows never takes that call (the modules add the deltas).
_CHAINED = (Family.ATTENTION, Family.LINEAR, Family.OPS, Family.DECODER_LAYERS)


# The names of before the families, still honoured: ENGINE_CPU_DECODE_KERNEL=0 turns every family
# off (nothing is built); ENGINE_CPU_FUSED_OPS=0 turns off ops, linear and decoder_layers (all there was
# but attention).
_LEGACY_OFF = {"ENGINE_CPU_DECODE_KERNEL": tuple(Family),
               "ENGINE_CPU_FUSED_OPS": (Family.OPS, Family.LINEAR, Family.DECODER_LAYERS)}
_switches: Optional[Dict[Family, bool]] = None


def switches() -> Dict[Family, bool]:
    """Which families are on, read from the environment once per process. A family is on unless its
    own variable or an old name that covers it is "0". (Tests flip one with monkeypatch.setitem.)"""
    global _switches
    if _switches is None:
        on = {f: os.environ.get(f"ENGINE_CPU_KERNEL_{f.value}", "1") != "0" for f in Family}
        for name, families in _LEGACY_OFF.items():
            if os.environ.get(name, "1") == "0":
                on.update({f: False for f in families})
        _switches = on
    return _switches


def _kernels() -> Optional[Kernels]:
    """The compiled kernel library, or None where it cannot be used (built once per process; not
    at all with every family off)."""
    global _kernel
    if isinstance(_kernel, _Unset):
        _kernel = None
        if any(switches().values()):
            _kernel = build(portable=os.environ.get("ENGINE_CPU_KERNEL_PORTABLE", "0") == "1")
    return _kernel


def build(portable: bool = False) -> Optional[Kernels]:
    """Builds (or finds in the cache) and loads the library; None where that fails (logged). The
    process's own library is `_kernels()`'s; tests load the portable build beside it with this."""
    try:
        lib = _build(_FLAGS + _PORTABLE_FLAGS if portable else _FLAGS)
        return _declare(lib) if lib is not None else None
    except Exception:  # a broken toolchain must not take the engine down: fall back
        logger.exception("Loading the CPU kernel library failed; every layer keeps its torch path.")
        return None


# One accessor per family: None where the family is off or the library is not available; the
# callers then keep their torch paths.
def library_info() -> Optional[LibraryKernels]:
    """What the build holds and the AMX setting (no switch: used by all the bf16 families)."""
    k = _kernels()
    return None if k is None else k.library


def ops() -> Optional[OpsKernels]:
    k = _kernels()
    return None if k is None or not switches()[Family.OPS] else k.ops


def linear() -> Optional[LinearKernels]:
    k = _kernels()
    return None if k is None or not switches()[Family.LINEAR] else k.linear


def lora() -> Optional[LoRAKernels]:
    k = _kernels()
    return None if k is None or not switches()[Family.LORA] else k.lora


def attention() -> Optional[AttentionKernels]:
    k = _kernels()
    return None if k is None or not switches()[Family.ATTENTION] else k.attention


def decoder_layers() -> Optional[DecoderLayersKernels]:
    """Only with the families it chains on too: the one call computes what the modules compute
    with those kernels, so with any of them off the modules (and their torch paths) must run."""
    k = _kernels()
    return None if k is None or not all(switches()[f] for f in _CHAINED) else k.decoder_layers


def load() -> bool:
    """Builds and loads the library now (not in the first forward); whether it is available."""
    return _kernels() is not None
