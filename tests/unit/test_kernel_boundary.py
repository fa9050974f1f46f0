"""The typed boundary of the native kernel library (engine/kernels/boundary.py) against its header
(csrc/engine_kernels.h): the Python side agrees with it, and each kind of drift is caught: a
Structure mirror with a field renamed, retyped, missing or laid out differently (the latter by
C's own offsetof, compiled here), a protocol whose parameters differ from a prototype, a header
that changed under the Python side, and a C definition that no longer matches its prototype."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Tuple

import pytest

from engine.kernels import boundary, library
from engine.kernels.boundary import (HEADER, BoundaryMismatch, ExtendAttentionArgs, Layer, check, check_mirror,
                                     check_protocol, parse_header, read_header)

CC = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


def test_the_python_side_agrees_with_the_header():
    header = read_header()
    assert check(header) == []
    # The parser saw the whole header: every family and struct, the long argument lists as structs.
    assert {p.family for p in header.functions.values()} == set(boundary.FAMILIES)
    assert set(header.structs) == set(boundary.MIRRORS)
    assert [n for n, _ in header.functions["decode_attention"].params] == ["args"]
    assert len(header.functions["rope_neox"].params) == 13
    assert header.structs["step_t"][-1] == ("num_threads", boundary.CType("int", False))


# ------------------------------------------------------------------------------ Structure mirrors
def _fields(mirror: type) -> List[Tuple[str, type]]:
    return list(mirror._fields_)  # type: ignore[attr-defined]


def _mirror(name: str, fields: List[Tuple[str, type]], pack: Optional[int] = None) -> type:
    attrs: Dict[str, object] = {"__slots__": (), "_fields_": fields}
    if pack is not None:
        attrs["_pack_"] = pack
    return type(name, (ctypes.Structure,), attrs)


def test_a_mirror_with_two_fields_swapped_is_caught():
    fields = _fields(Layer)
    i, j = [n for n, _ in fields].index("k_stride"), [n for n, _ in fields].index("v_stride")
    fields[i], fields[j] = fields[j], fields[i]  # same types: only the names tell
    problems = check_mirror("layer_t", _mirror("SwappedLayer", fields), read_header())
    assert any("field 13 is v_stride" in p and "the header has k_stride" in p for p in problems), problems


def test_a_mirror_with_a_wrong_type_or_a_missing_field_is_caught():
    fields = _fields(ExtendAttentionArgs)
    retyped = [(n, ctypes.c_int if n == "bs" else t) for n, t in fields]  # int64_t in C
    problems = check_mirror("extend_attention_args_t", _mirror("Retyped", retyped), read_header())
    assert any("bs: c_int, the header has bs: c_long" in p or "bs: c_int, the header has bs: c_int64" in p
               for p in problems), problems
    shorter = [f for f in fields if f[0] != "num_threads"]
    problems = check_mirror("extend_attention_args_t", _mirror("Shorter", shorter), read_header())
    assert any("has 18 fields, the header 19" in p for p in problems), problems


def test_a_wrong_mirror_makes_the_library_unavailable(monkeypatch, caplog):
    """At load: the kernels are not used with a mirror that disagrees (the layers keep torch)."""
    if CC is None:
        pytest.skip("no C compiler")
    fields = _fields(Layer)
    wrong = _mirror("WrongLayer", fields[:-1])  # qk_eps dropped
    monkeypatch.setitem(boundary.MIRRORS, "layer_t", wrong)
    monkeypatch.setattr(library, "_kernel", library._UNSET)
    assert library._kernels() is None
    assert library.ops() is None and library.attention() is None
    assert "disagrees with csrc/engine_kernels.h" in caplog.text and "WrongLayer" in caplog.text


def test_a_mirror_field_that_is_not_declared_cannot_be_set():
    args = ExtendAttentionArgs()
    with pytest.raises(AttributeError):
        args.num_thread = 2  # type: ignore[attr-defined]  # a typo would otherwise be a Python attribute
    with pytest.raises(AttributeError):
        ExtendAttentionArgs(q_strid=1)
    # A mirror (or a subclass of one) without its own `__slots__ = ()` has an instance dict again.
    assert check_mirror("extend_attention_args_t", type("Sub", (ExtendAttentionArgs,), {}), read_header()) == [
        "Sub does not declare __slots__ = ()"]


def _c_layout(tmp_path: Path) -> Dict[Tuple[str, str], int]:
    """(struct, field) -> offsetof and (struct, "sizeof") -> sizeof, as the C compiler lays them out."""
    header = read_header()
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "engine_kernels.h"', "int main(void) {"]
    for struct, fields in header.structs.items():
        lines.append(f'    printf("{struct} sizeof %zu\\n", sizeof({struct}));')
        for field, _ in fields:
            lines.append(f'    printf("{struct} {field} %zu\\n", offsetof({struct}, {field}));')
    lines += ["    return 0;", "}"]
    probe = tmp_path / "probe.c"
    probe.write_text("\n".join(lines) + "\n")
    subprocess.run([CC, "-I", str(HEADER.parent), str(probe), "-o", str(tmp_path / "probe")], check=True, timeout=120)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True, timeout=60).stdout
    return {(s, f): int(v) for s, f, v in (line.split() for line in out.splitlines())}


def _layout_differences(c: Dict[Tuple[str, str], int], mirrors: Dict[str, type]) -> List[str]:
    problems = []
    for struct, mirror in mirrors.items():
        if c[(struct, "sizeof")] != ctypes.sizeof(mirror):
            problems.append(f"{struct}: sizeof {c[(struct, 'sizeof')]} in C, {ctypes.sizeof(mirror)} in ctypes")
        for field, _ in _fields(mirror):
            if c[(struct, field)] != getattr(mirror, field).offset:
                problems.append(f"{struct}.{field}: offset {c[(struct, field)]} in C, "
                                f"{getattr(mirror, field).offset} in ctypes")
    return problems


@needs_cc
def test_the_mirrors_lay_out_as_c_does_and_a_packed_one_is_caught(tmp_path):
    c = _c_layout(tmp_path)
    assert _layout_differences(c, boundary.MIRRORS) == []
    # Same names and types, packed: the name/type check passes it, C's offsetof does not.
    packed = _mirror("PackedExtendArgs", _fields(ExtendAttentionArgs), pack=1)
    assert check_mirror("extend_attention_args_t", packed, read_header()) == []
    problems = _layout_differences(c, {"extend_attention_args_t": packed})
    assert any(p.startswith("extend_attention_args_t.out: offset") for p in problems), problems


# ------------------------------------------------------------------------------ family protocols
class _SwappedOps(Protocol):
    def rms_norm(self, x: int, residual: Optional[int], weight: int, out: int, res_out: Optional[int], n: int,
                 rows: int, eps: float, dtype: int, num_threads: int, /) -> None: ...


class _KeywordAndWrongType(Protocol):
    def argmax_rows(self, x: int, rows: float, n: int, stride: int, out: int, num_threads: int) -> None: ...


class _WrongStructPointer(Protocol):
    def decode_attention(self, args: ExtendAttentionArgs, /) -> None: ...


def test_a_protocol_that_differs_from_a_prototype_is_caught():
    header = read_header()
    problems = check_protocol("ops", _SwappedOps, header)
    assert any("rms_norm takes (x, residual, weight, out, res_out, n, rows," in p for p in problems), problems
    # The protocol declares one function of the family: the others are missing from it.
    assert any("lacks argmax_rows" in p for p in problems), problems
    problems = check_protocol("ops", _KeywordAndWrongType, header)
    assert any("argmax_rows: rows is annotated <class 'float'>" in p for p in problems), problems
    assert any("argmax_rows: x must be positional-only" in p for p in problems), problems
    problems = check_protocol("attention", _WrongStructPointer, header)
    assert any("decode_attention: args is annotated" in p for p in problems), problems
    assert not any("decode_attention" in p for p in check_protocol("attention", boundary.AttentionKernels, header))


def test_a_header_that_changed_under_the_python_side_is_caught():
    text = HEADER.read_text()
    grown = text.replace("int64_t rows, int64_t n, float eps, int dtype, int num_threads);",
                         "int64_t rows, int64_t n, float eps, int dtype, int num_threads, int64_t stride);")
    assert grown != text
    assert any("OpsKernels.rms_norm takes" in p for p in check(parse_header(grown)))
    field = text.replace("    float qk_eps;\n", "    float qk_eps;\n    int64_t window;\n")
    assert field != text
    assert any("Layer (layer_t) has 43 fields, the header 44" in p for p in check(parse_header(field)))
    new_fn = text.replace("ENGINE_API int amx_active(void);", "ENGINE_API int amx_active(void);\n"
                                                             "ENGINE_API int amx_tiles(void);")
    assert any("LibraryKernels lacks amx_tiles" in p for p in check(parse_header(new_fn)))
    with pytest.raises(BoundaryMismatch, match="cannot read"):
        parse_header("/* Family: ops */\nENGINE_API void f(int a[4]);\n")


@needs_cc
def test_a_c_definition_that_differs_from_its_prototype_does_not_compile(tmp_path):
    """The C half of the boundary: every source includes the header, so the compiler holds each
    definition to it (here: rms_norm's rows declared int instead of int64_t)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(HEADER.parent, csrc)
    (csrc / "engine_kernels.h").write_text(HEADER.read_text().replace(
        "void *res_out,\n                         int64_t rows,", "void *res_out,\n                         int rows,"))
    assert (csrc / "engine_kernels.h").read_text() != HEADER.read_text()
    proc = subprocess.run([CC, "-fsyntax-only", "-std=c11", str(csrc / "cpu_ops.c")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "conflicting types for" in proc.stderr and "rms_norm" in proc.stderr
    ok = subprocess.run([CC, "-fsyntax-only", "-std=c11", str(HEADER.parent / "cpu_ops.c")], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.skipif(CC is None or shutil.which("nm") is None, reason="no C compiler or no nm")
def test_the_library_exports_exactly_the_header_functions(tmp_path):
    """Built with -fvisibility=hidden: what Python can reach is what engine_kernels.h declares (the
    thread pool and the kernels' helpers stay inside)."""
    kernels = library._kernels()
    assert kernels is not None
    copy = tmp_path / "lib.so"
    shutil.copyfile(kernels.cdll._name, copy)  # by this process's descriptor (/proc/self/fd/N) or its path
    out = subprocess.run(["nm", "-D", "--defined-only", str(copy)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    exported = {parts[2] for parts in (line.split() for line in out.splitlines()) if len(parts) == 3
                and parts[1] == "T"}
    assert exported == set(read_header().functions)
