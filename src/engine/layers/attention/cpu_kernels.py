"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

`decode_attention` (csrc/decode_attention.c) reads a decode batch's K/V where they lie in the
paged pool instead of gathering them first. It is built once per machine into
`$ENGINE_CACHE_DIR/kernels` (default `~/.cache/engine/kernels`), keyed by the source, the flags,
the compiler and the CPU's instruction set. Without a C compiler (or with
`ENGINE_CPU_DECODE_KERNEL=0`) `decode_kernel()` returns None and the attention backend keeps its
pure-torch path; both give the same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import torch

logger = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("csrc") / "decode_attention.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_UNSET = object()
_kernel = _UNSET


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _build() -> Optional[ctypes.CDLL]:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.info("No C compiler found: CPU decode attention uses the torch gather path.")
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([_SRC.read_text(), " ".join(_FLAGS), version, _cpu_signature()]).encode())
    cache = Path(os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "engine") / "kernels"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build under the temp directory instead
        cache = Path(tempfile.gettempdir()) / f"engine-kernels-{os.getuid()}"
        cache.mkdir(parents=True, exist_ok=True)
    lib_path = cache / f"decode_attention-{key.hexdigest()[:16]}.so"
    if not lib_path.exists():
        # Build under a private name, then rename: concurrent processes never see half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        proc = subprocess.run([compiler, *_FLAGS, str(_SRC), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            logger.warning("Building the CPU decode attention kernel failed; using the torch gather path.\n%s",
                           proc.stderr[-2000:])
            return None
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int,
                   ptr, ptr, ctypes.c_int]
    fn.restype = None
    return lib


def decode_kernel() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None where it cannot be used (built once per process)."""
    global _kernel
    if _kernel is _UNSET:
        _kernel = None
        if os.environ.get("ENGINE_CPU_DECODE_KERNEL", "1") != "0":
            try:
                _kernel = _build()
            except Exception:  # a broken toolchain must not take the engine down: fall back
                logger.exception("Loading the CPU decode attention kernel failed; using the torch gather path.")
    return _kernel


def supports(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    return (q.is_cpu and q.dtype in _DTYPES and k_buf.dtype == q.dtype and decode_kernel() is not None)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     lens: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int, scale: float,
                     with_lse: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of one query token per request over pool slots `kv_indices[b, :lens[b]]`.

    q [bs, num_heads * head_dim]; k_buf, v_buf [num_slots, kv_heads, head_dim]; kv_indices
    [bs, max_len] int64; lens [bs] int64. Returns the output shaped like q and, with `with_lse`,
    the float32 log-sum-exp of the scaled scores, [bs, num_heads].
    """
    lib = decode_kernel()
    q = q.contiguous()
    kv_indices = kv_indices.contiguous()
    lens = lens.to(torch.int64).contiguous()
    bs = q.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty(bs, num_heads, dtype=torch.float32) if with_lse else None
    k_stride = k_buf.stride(0)
    v_stride = v_buf.stride(0)
    # Within a slot the kernel reads kv_heads * head_dim consecutive elements.
    assert k_buf.stride()[1:] == (head_dim, 1) and v_buf.stride()[1:] == (head_dim, 1)
    lib.decode_attention(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr(), lens.data_ptr(),
                         bs, num_heads, kv_heads, head_dim, kv_indices.shape[1], k_stride, v_stride, scale,
                         _DTYPES[q.dtype], out.data_ptr(), lse.data_ptr() if lse is not None else None,
                         torch.get_num_threads())
    return out, lse
