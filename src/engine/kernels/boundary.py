"""The typed boundary between Python and the native kernel library (csrc/engine_kernels.h).

The header is the one statement of the boundary: every source includes it (the compiler holds each C
definition to its prototype there), and this module reads it when the library loads to

- declare every exported function's ctypes argtypes and restype from its prototype (nothing is typed
  by hand, so nothing can drift from the C side);
- check the typed Python side against it: each family protocol below (what mypy checks the callers
  against) must declare exactly the header's functions of that family, parameter by parameter (same
  names in the same order, types that convert: int for int/int64_t, float for float, int or None for
  a data pointer, the Structure mirror for a struct pointer), and each Structure mirror must have the
  header struct's fields (names, order, ctypes types). With the same fields of the same types,
  ctypes lays them out as the C compiler does; tests/unit/test_kernel_boundary.py also compares the
  offsets with C's `offsetof`.

A mismatch raises BoundaryMismatch: the library is not used (the layers keep their torch paths) and
the error says what differs. The parser reads the subset of C the header keeps to (its comment).
"""

from __future__ import annotations

import ctypes
import inspect
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Tuple, Type

HEADER = Path(__file__).with_name("csrc") / "engine_kernels.h"

# The C scalar types of the header and their ctypes; any pointer to a non-struct is a c_void_p.
_SCALARS: Dict[str, Optional[type]] = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64,
                                       "float": ctypes.c_float}
_PY_SCALARS: Dict[str, object] = {"int": int, "int64_t": int, "float": float, "void": type(None)}


class BoundaryMismatch(Exception):
    """The Python side of the boundary disagrees with csrc/engine_kernels.h."""


# ---------------------------------------------------------------------------------- Structure mirrors
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# Each mirror declares `__slots__ = ()`: without an instance dict, assigning (or passing as a keyword)
# a field the struct lacks raises AttributeError instead of setting an attribute C never sees.


class DecodeAttentionArgs(ctypes.Structure):  # decode_attention_args_t
    __slots__ = ()
    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("kv_indices", _P), ("lens", _P), ("max_len", _I64), ("bs", _I64),
                ("heads", _I64), ("kv_heads", _I64), ("dim", _I64), ("k_stride", _I64), ("v_stride", _I64),
                ("scale", _F32), ("dtype", _INT), ("kv_dtype", _INT), ("k_scale", _F32), ("v_scale", _F32),
                ("out", _P), ("num_groups", _I64), ("group_offsets", _P),
                ("group_members", _P), ("prefix_indices", _P), ("prefix_lens", _P), ("max_prefix", _I64),
                ("group_of", _P), ("kept", _P), ("kept_tokens", _P), ("logit_cap", _F32), ("sinks", _P),
                ("row_of", _P), ("starts", _P), ("num_threads", _INT)]


class ExtendAttentionArgs(ctypes.Structure):  # extend_attention_args_t
    __slots__ = ()
    _fields_ = [("q", _P), ("q_stride", _I64), ("k", _P), ("v", _P), ("k_stride", _I64), ("v_stride", _I64),
                ("kv_indices", _P), ("max_seq", _I64), ("q_starts", _P), ("ext_lens", _P), ("prefix_lens", _P),
                ("bs", _I64), ("heads", _I64), ("kv_heads", _I64), ("dim", _I64), ("scale", _F32), ("out", _P),
                ("out_stride", _I64), ("num_threads", _INT)]


class Layer(ctypes.Structure):  # layer_t
    __slots__ = ()
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
                ("qkv_bias", _P), ("o_bias", _P), ("gate_up_bias", _P), ("down_bias", _P), ("cos_sin", _P),
                ("k_pool", _P), ("v_pool", _P), ("k_stride", _I64), ("v_stride", _I64), ("eps", _F32),
                ("scale", _F32), ("q_norm", _P), ("k_norm", _P), ("qk_eps", _F32), ("qkv_format", _INT),
                ("o_format", _INT), ("gate_up_format", _INT), ("down_format", _INT), ("qkv_scale", _P), ("o_scale", _P),
                ("gate_up_scale", _P), ("down_scale", _P), ("qkv_offset", _P), ("o_offset", _P), ("gate_up_offset", _P),
                ("down_offset", _P), ("qkv_group", _I64), ("o_group", _I64), ("gate_up_group", _I64), ("down_group", _I64),
                ("router", _P), ("experts_format", _INT), ("experts_gate_up", _P), ("experts_gate_up_scale", _P),
                ("experts_down", _P), ("experts_down_scale", _P), ("moe_intermediate", _I64)]


class Step(ctypes.Structure):  # step_t
    __slots__ = ()
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("rotary_dim", _I64),
                ("intermediate", _I64), ("bs", _I64), ("positions", _P), ("out_loc", _P), ("kv_indices", _P),
                ("lens", _P), ("max_len", _I64), ("num_groups", _I64), ("group_offsets", _P), ("group_members", _P),
                ("prefix_indices", _P), ("prefix_lens", _P), ("max_prefix", _I64), ("group_of", _P), ("kept", _P),
                ("kept_tokens", _P), ("normed", _P), ("qkv", _P), ("q", _P), ("attn", _P), ("o", _P), ("mlp", _P),
                ("gate_up", _P), ("num_experts", _I64), ("top_k", _I64), ("renormalize", _INT), ("router_logits", _P),
                ("moe_weights", _P), ("moe_ids", _P), ("num_threads", _INT)]


MIRRORS: Dict[str, Type[ctypes.Structure]] = {
    "decode_attention_args_t": DecodeAttentionArgs, "extend_attention_args_t": ExtendAttentionArgs,
    "layer_t": Layer, "step_t": Step}


# ------------------------------------------------------------------------- the families' protocols
# Parameters are positional-only: ctypes functions take no keywords. Data pointers are addresses
# (Tensor.data_ptr()); Optional where the C side takes NULL.
class LibraryKernels(Protocol):
    def engine_kernels_isa(self) -> int: ...
    def amx_set(self, on: int, /) -> None: ...
    def amx_active(self) -> int: ...


class OpsKernels(Protocol):
    def rms_norm(self, x: int, residual: Optional[int], weight: int, out: int, res_out: Optional[int], rows: int,
                 n: int, eps: float, dtype: int, num_threads: int, /) -> None: ...

    def rope_neox(self, positions: int, q: int, q_stride: int, q_heads: int, k: int, k_stride: int, k_heads: int,
                  cos_sin: int, head_size: int, rot: int, tokens: int, dtype: int, num_threads: int, /) -> None: ...

    def silu_and_mul(self, x: int, out: int, tokens: int, d: int, dtype: int, num_threads: int, /) -> None: ...

    def store_kv(self, k: int, k_stride: int, v: int, v_stride: int, k_pool: int, v_pool: int, slot_stride: int,
                 loc: int, tokens: int, width: int, elem_size: int, num_threads: int, /) -> None: ...

    def argmax_rows(self, x: int, rows: int, n: int, stride: int, out: int, num_threads: int, /) -> None: ...

    def moe_route(self, logits: int, tokens: int, num_experts: int, top_k: int, renormalize: int, dtype: int,
                  weights: int, ids: int, /) -> None: ...


class LinearKernels(Protocol):
    def linear_bf16_available(self) -> int: ...
    def pack_linear_bf16(self, w: int, n: int, k: int, packed: int, num_threads: int, /) -> None: ...

    def linear_bf16(self, x: int, m: int, k: int, packed: int, n: int, bias: Optional[int], out: int,
                    num_threads: int, /) -> None: ...

    def linear_bf16_silu_mul(self, x: int, m: int, k: int, packed: int, n: int, bias: Optional[int], out: int,
                             num_threads: int, /) -> None: ...

    def moe_experts(self, x: int, tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, weights: int,
                    ids: int, format: int, gate_up: int, gate_up_scale: Optional[int], down: int,
                    down_scale: Optional[int], out: int, num_threads: int, /) -> int: ...

    def linear_q8(self, x: int, m: int, k: int, w: int, w_format: int, scale: Optional[int], bias: Optional[int],
                  n: int, out: int, dtype: int, num_threads: int, /) -> int: ...

    def linear_fp8_block(self, x: int, m: int, k: int, w: int, scale: int, block_n: int, block_k: int,
                         bias: Optional[int], n: int, out: int, dtype: int, num_threads: int, /) -> int: ...

    def linear_w8a8(self, x: int, m: int, k: int, w: int, scale: int, bias: Optional[int], n: int, out: int,
                    dtype: int, x_scale: Optional[int], num_threads: int, /) -> int: ...

    def linear_q4(self, x: int, m: int, k: int, w: int, scale: int, bias: int, group: int, n: int, out: int,
                  num_threads: int, /) -> None: ...

    def linear_w4a8(self, x: int, m: int, k: int, w: int, scale: int, bias: int, group: int, n: int, out: int,
                    num_threads: int, /) -> int: ...

    def linear_mxfp4(self, x: int, m: int, k: int, blocks: int, scales: int, bias: Optional[int], n: int, out: int,
                     num_threads: int, /) -> int: ...


class LoRAKernels(Protocol):
    def lora_delta(self, x: int, x_stride: int, out: int, out_stride: int, m: int, k: int, row_slots: int,
                   num_slots: int, a: int, b: int, w_dtype: int, rank: int, sections: int, num_sections: int, n: int,
                   dtype: int, num_threads: int, /) -> int: ...


class AttentionKernels(Protocol):
    def decode_attention(self, args: DecodeAttentionArgs, /) -> None: ...
    def extend_attention_available(self) -> int: ...
    def extend_attention(self, args: ExtendAttentionArgs, /) -> None: ...
    def kept_prefix_elems(self, n: int, kv_heads: int, dim: int, /) -> int: ...


class DecoderLayersKernels(Protocol):
    def decode_layers(self, layers: "ctypes.Array[Layer]", num_layers: int, step: Step, hidden_in: int,
                      hidden_out: int, residual_out: int, /) -> None: ...


# The header's `Family:` names and the protocol each binds to.
FAMILIES: Dict[str, type] = {"library": LibraryKernels, "ops": OpsKernels, "linear": LinearKernels,
                             "lora": LoRAKernels, "attention": AttentionKernels,
                             "decoder_layers": DecoderLayersKernels}


# ------------------------------------------------------------------------------------- the header
@dataclass(frozen=True)
class CType:
    base: str  # int, int64_t, float, void, uint16_t, or a struct typedef's name
    pointer: bool


@dataclass(frozen=True)
class Prototype:
    family: str
    ret: CType
    params: Tuple[Tuple[str, CType], ...]


@dataclass(frozen=True)
class Header:
    functions: Dict[str, Prototype]
    structs: Dict[str, Tuple[Tuple[str, CType], ...]]


def _declarators(decl: str, where: str) -> List[Tuple[str, CType]]:
    """`const int64_t *a, *b` -> [(a, int64_t*), (b, int64_t*)]; one base type, several names."""
    decl = " ".join(decl.replace("const ", " ").replace("*", " * ").split())
    first, *rest = [d.strip() for d in decl.split(",")]
    tokens = first.split()
    if len(tokens) < 2:
        raise BoundaryMismatch(f"engine_kernels.h: cannot read `{decl}` in {where}")
    base, out = tokens[0], []
    for d in [" ".join(tokens[1:]), *rest]:
        parts = d.split()
        stars = parts.count("*")
        names = [p for p in parts if p != "*"]
        if len(names) != 1 or stars > 1 or not re.fullmatch(r"[A-Za-z_]\w*", names[0]):
            raise BoundaryMismatch(f"engine_kernels.h: cannot read `{decl}` in {where}")
        out.append((names[0], CType(base, stars == 1)))
    return out


def parse_header(text: str) -> Header:
    """The functions (with their `Family:`) and structs declared in engine_kernels.h's text."""
    family = ""
    # Comments go, except the family markers, which become tokens of their own.
    text = re.sub(r"/\*\s*Family:\s*(\w+).*?\*/", r" @family \1 ; ", text, flags=re.S)
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    structs: Dict[str, Tuple[Tuple[str, CType], ...]] = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        fields: List[Tuple[str, CType]] = []
        for decl in body.split(";"):
            if decl.strip():
                fields.extend(_declarators(decl, name))
        structs[name] = tuple(fields)
    text = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", text, flags=re.S)
    functions: Dict[str, Prototype] = {}
    for stmt in text.split(";"):
        stmt = " ".join(stmt.split())
        if not stmt:
            continue
        marker = re.fullmatch(r"@family (\w+)", stmt)
        if marker:
            family = marker.group(1)
            continue
        m = re.fullmatch(r"ENGINE_API (.+?)\((.*)\)", stmt)
        if m is None:
            raise BoundaryMismatch(f"engine_kernels.h: cannot read `{stmt}`")
        [(name, ret)] = _declarators(m.group(1), "a return type")
        params = () if m.group(2).strip() in ("", "void") else tuple(
            p for decl in m.group(2).split(",") for p in _declarators(decl, name))
        if not family:
            raise BoundaryMismatch(f"engine_kernels.h: {name} comes before any `Family:` comment")
        functions[name] = Prototype(family, ret, params)
    return Header(functions, structs)


def read_header() -> Header:
    return parse_header(HEADER.read_text())


# ---------------------------------------------------------------------------------- the checks
def _ctype(t: CType, header: Header) -> Optional[type]:
    """The ctypes type of a parameter or field: pointers to structs point to their mirror."""
    if t.pointer:
        if t.base in header.structs:
            return ctypes.POINTER(MIRRORS[t.base])
        return ctypes.c_void_p
    if t.base not in _SCALARS:
        raise BoundaryMismatch(f"engine_kernels.h: the type {t.base} is not one the boundary passes")
    return _SCALARS[t.base]


def check_mirror(name: str, mirror: Type[ctypes.Structure], header: Header) -> List[str]:
    """How `mirror` differs from the header's struct `name` (empty: it agrees)."""
    if name not in header.structs:
        return [f"{mirror.__name__} mirrors {name}, which engine_kernels.h does not declare"]
    slots = [] if vars(mirror).get("__slots__") == () else [f"{mirror.__name__} does not declare __slots__ = ()"]
    want = [(f, _ctype(t, header)) for f, t in header.structs[name]]
    have = [(f[0], f[1]) for f in mirror._fields_]
    if want == have:
        return slots
    problems = slots + [f"{mirror.__name__} ({name}): field {i} is {h[0]}: {getattr(h[1], '__name__', h[1])}, the header "
                f"has {w[0]}: {getattr(w[1], '__name__', w[1])}"
                for i, (w, h) in enumerate(zip(want, have)) if w != h]
    if len(want) != len(have):
        problems.append(f"{mirror.__name__} ({name}) has {len(have)} fields, the header {len(want)}")
    return problems


def _accepts(t: CType, hint: object, header: Header) -> bool:
    """Whether a Python value of type `hint` converts to the C type `t` as the protocol means it."""
    if t.pointer and t.base in header.structs:
        mirror = MIRRORS[t.base]
        return hint is mirror or (typing.get_origin(hint) is ctypes.Array and typing.get_args(hint) == (mirror,))
    if t.pointer:
        return hint in (int, Optional[int])
    return hint is _PY_SCALARS.get(t.base)


def check_protocol(family: str, protocol: type, header: Header) -> List[str]:
    """How `protocol`'s methods differ from the header's functions of `family` (empty: they agree)."""
    problems: List[str] = []
    declared = {n for n, p in header.functions.items() if p.family == family}
    methods = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    for name in sorted(declared - methods):
        problems.append(f"{protocol.__name__} lacks {name}, which engine_kernels.h declares in family {family}")
    for name in sorted(methods - declared):
        problems.append(f"{protocol.__name__}.{name} is not declared in engine_kernels.h's family {family}")
    for name in sorted(declared & methods):
        proto = header.functions[name]
        method = getattr(protocol, name)
        hints = typing.get_type_hints(method)  # resolved in the protocol's module
        params = list(inspect.signature(method).parameters.values())[1:]  # past self
        names = [p.name for p in params]
        want = [n for n, _ in proto.params]
        if names != want:
            problems.append(f"{protocol.__name__}.{name} takes ({', '.join(names)}), the header "
                            f"({', '.join(want)})")
            continue
        for p, (pname, ctype) in zip(params, proto.params):
            if p.kind is not inspect.Parameter.POSITIONAL_ONLY:
                problems.append(f"{protocol.__name__}.{name}: {pname} must be positional-only (ctypes takes no "
                                f"keywords)")
            if not _accepts(ctype, hints.get(pname), header):
                problems.append(f"{protocol.__name__}.{name}: {pname} is annotated {hints.get(pname)}, which does "
                                f"not pass as the header's {ctype.base}{' *' if ctype.pointer else ''}")
        if hints.get("return") is not _PY_SCALARS.get(proto.ret.base) or proto.ret.pointer:
            problems.append(f"{protocol.__name__}.{name} returns {hints.get('return')}, the header "
                            f"{proto.ret.base}{' *' if proto.ret.pointer else ''}")
    return problems


def check(header: Header) -> List[str]:
    """Every difference between the Python side (FAMILIES, MIRRORS) and the header."""
    problems: List[str] = []
    for name in sorted(set(header.structs) - set(MIRRORS)):
        problems.append(f"engine_kernels.h declares struct {name}, which has no mirror in MIRRORS")
    for name, mirror in MIRRORS.items():
        problems += check_mirror(name, mirror, header)
    for name in sorted({p.family for p in header.functions.values()} - set(FAMILIES)):
        problems.append(f"engine_kernels.h declares family {name}, which FAMILIES lacks")
    for family, protocol in FAMILIES.items():
        problems += check_protocol(family, protocol, header)
    return problems


class _Family:
    """A family's functions as attributes (typed by its protocol at the accessor)."""

    def __init__(self, functions: Dict[str, object]) -> None:
        self.__dict__.update(functions)


def bind(lib: ctypes.CDLL, header: Optional[Header] = None) -> Dict[str, object]:
    """Per family, an object with its functions, argtypes and restype declared from the header, after
    checking the Python side against it (BoundaryMismatch lists every difference)."""
    header = header if header is not None else read_header()
    problems = check(header)
    if problems:
        raise BoundaryMismatch("the kernel boundary disagrees with csrc/engine_kernels.h:\n  " + "\n  ".join(problems))
    families: Dict[str, Dict[str, object]] = {family: {} for family in FAMILIES}
    for name, proto in header.functions.items():
        fn = getattr(lib, name)  # AttributeError: declared in the header, not built into the library
        fn.argtypes = [_ctype(t, header) for _, t in proto.params]
        fn.restype = _ctype(proto.ret, header)
        families[proto.family][name] = fn
    return {family: _Family(functions) for family, functions in families.items()}
