"""Kernel loading: ``raw_kernels/*.cu`` compiled by NVRTC through ``cupy.RawModule``.

Each ``.cu`` file lists the kernels the Python side fetches on lines of the form
``//! kernels: name_a, name_b<float>`` -- ``extern "C"`` names or template instances
(compiled as ``name_expressions``). That list is the single source of truth: the
loader compiles exactly those, and the CI compile check instantiates the same ones
with ``nvcc``. A file may add NVRTC options on ``//! nvrtc-options:`` lines (e.g.
``-arch=sm_90a`` for wgmma, which NVRTC honours next to the ``-arch`` CuPy adds).

A module is compiled once per process and cached on disk by CuPy (``CUPY_CACHE_DIR``).
``defines`` (``(("NAME", value), ...)``, passed as ``-DNAME=value``) compile a variant of a
module whose ``#define``s are ``#ifndef``-guarded, e.g. the fused kernels' task sizes: each
distinct set is a module of its own, cached alike (CuPy's key includes the options).
With a group, local rank 0 compiles first and the others load from the cache after a
barrier, so ranks never race to write the same cache entry. That barrier comes with the
group's first load of each module on every rank, whatever the process loaded before
without the group (a rank that measured a machine profile alone has modules its peers
lack), so every rank posts the same collectives.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.resources
import operator
import os
import re
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ultraep.runtime.group import EPGroup

COMPILE_OPTIONS = ("--std=c++17",)
_KERNEL_LINE = re.compile(r"^//!\s*kernels:\s*(.+)$", re.MULTILINE)
_OPTIONS_LINE = re.compile(r"^//!\s*nvrtc-options:\s*(.+)$", re.MULTILINE)
_modules: dict[tuple[str, tuple], object] = {}          # (filename, defines) -> module
_functions: dict[tuple[str, tuple, str], object] = {}  # (filename, defines, name) -> kernel
_group_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> modules loaded through it


def kernel_dir() -> Path:
    """``$ULTRAEP_KERNEL_DIR``, else the package's ``raw_kernels/`` data.

    In a checkout (and an editable install) ``ultraep/raw_kernels`` is a link to the
    repository's top-level ``raw_kernels/``; a wheel holds a copy of those files there."""
    override = os.environ.get("ULTRAEP_KERNEL_DIR")
    if override:
        return Path(override)
    data = importlib.resources.files("ultraep") / "raw_kernels"
    if not isinstance(data, Path):  # e.g. a zipped install: the compilers read sources by path
        raise FileNotFoundError(f"ultraep's kernel sources are not files on disk ({data}); set ULTRAEP_KERNEL_DIR")
    if not data.is_dir():  # a checkout whose link was not made (core.symlinks off, a copy that drops links)
        return data.parents[1] / "raw_kernels"
    return data


def kernel_source(filename: str) -> Path:
    path = kernel_dir() / filename
    if not path.is_file():
        where = "$ULTRAEP_KERNEL_DIR" if os.environ.get("ULTRAEP_KERNEL_DIR") else "ultraep's package data"
        raise FileNotFoundError(f"kernel source {path} not found (looked in {where})")
    return path


def declared_kernels(path: Path) -> list[str]:
    """Name expressions declared on the file's ``//! kernels:`` lines."""
    names: list[str] = []
    for line in _KERNEL_LINE.findall(path.read_text()):
        names += [n.strip() for n in _split_top_level(line) if n.strip()]
    if not names:
        raise ValueError(f"{path.name} declares no kernels (a '//! kernels: ...' line is required)")
    return names


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside template brackets: ``f<int, 4>, g`` -> ``['f<int, 4>', 'g']``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def load_module(filename: str, *, group: "EPGroup | None" = None, defines: tuple = ()):
    """The compiled ``cupy.RawModule`` of ``raw_kernels/<filename>`` (all declared kernels
    built), with ``defines`` (a tuple of ``(name, int)``) as ``-D`` options."""
    key = (filename, _checked_defines(defines))
    if group is None:
        if key not in _modules:
            _modules[key] = _compile(*key)
        return _modules[key]
    loaded = _group_modules.setdefault(group, set())
    if key in loaded:
        return _modules[key]
    what = f"loading {filename}{_define_text(key[1])} (local rank 0 compiles it first)"
    if group.local_rank != 0:
        group.barrier(what=what)
    module = _modules.get(key)
    if module is None:
        module = _compile(*key)
    if group.local_rank == 0:
        group.barrier(what=what)
    _modules[key] = module
    loaded.add(key)
    return module


def _checked_defines(defines) -> tuple:
    defines = tuple((str(name), int(value)) for name, value in defines)
    for name, _ in defines:
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            raise ValueError(f"kernel define {name!r} is not a macro name")
    return defines


def _define_text(defines: tuple) -> str:
    return "".join(f" -D{name}={value}" for name, value in defines)


_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def sources_digest(filenames) -> str:
    """A short digest of kernel sources (each with its headers inlined): what a measurement
    of those kernels was taken with; "" for none."""
    if not filenames:
        return ""
    digest = hashlib.sha256()
    for name in sorted(filenames):
        digest.update(f"{name}\0{inline_local_includes(kernel_source(name))}\0".encode())
    return digest.hexdigest()[:16]


def inline_local_includes(path: Path, seen: set | None = None) -> str:
    """The source with ``#include "x.cuh"`` replaced by the header's text, so CuPy's cache
    key (a hash of the code string) changes whenever a header does. Headers live beside
    the file."""
    seen = set() if seen is None else seen

    def expand(match):
        header = path.parent / match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return inline_local_includes(header, seen)
    return _LOCAL_INCLUDE.sub(expand, path.read_text())


_DEFINE = re.compile(r"^#define\s+(\w+)\s+([^\n]*?)\s*(?://.*)?$", re.MULTILINE)
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
              ast.BitAnd: operator.and_, ast.BitXor: operator.xor, ast.USub: operator.neg, ast.Invert: operator.invert}


@functools.cache
def kernel_constants(filename: str) -> dict[str, int]:
    """The integer ``#define`` constants of ``raw_kernels/<filename>`` and the headers it
    includes, evaluated (``#define B (32 * A)`` gives ``B`` once ``A`` is known).

    The host reads its launch constants and limits from here, so a kernel's source is the
    one place each is written; macros that are not integer expressions are left out."""
    values: dict[str, int] = {}
    for name, expression in _DEFINE.findall(inline_local_includes(kernel_source(filename))):
        value = _integer_expression(_INT_SUFFIX.sub(r"\1", expression).replace("/", "//"), values)
        if value is not None:
            values[name] = value
    return values


def kernel_constant(filename: str, name: str) -> int:
    """One integer ``#define`` of a kernel source (KeyError naming the file if it has none)."""
    constants = kernel_constants(filename)
    if name not in constants:
        raise KeyError(f"{filename} defines no integer constant {name!r}")
    return constants[name]


_FUNCTION_DEFINE = r"^#define\s+{name}\(([^)]*)\)\s+([^\n]*?)\s*(?://.*)?$"


def kernel_macro(filename: str, name: str, **arguments: int) -> int:
    """A function-like integer ``#define NAME(a, b) expression`` of a kernel source, evaluated
    for ``arguments`` (the file's constants are known too), e.g. the dynamic shared memory a
    kernel carves for a given layout: the kernel source stays its one definition."""
    match = re.search(_FUNCTION_DEFINE.format(name=re.escape(name)), inline_local_includes(kernel_source(filename)),
                      re.MULTILINE)
    if match is None:
        raise KeyError(f"{filename} defines no function-like macro {name!r}")
    parameters = [p.strip() for p in match.group(1).split(",")]
    if sorted(parameters) != sorted(arguments):
        raise TypeError(f"{filename} {name} takes ({', '.join(parameters)}), got {sorted(arguments)}")
    value = _integer_expression(_INT_SUFFIX.sub(r"\1", match.group(2)).replace("/", "//"),
                                {**kernel_constants(filename), **{k: int(v) for k, v in arguments.items()}})
    if value is None:
        raise ValueError(f"{filename} {name} is not an integer expression: {match.group(2)}")
    return value


def _integer_expression(text: str, known: dict[str, int]) -> int | None:
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in known:
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not an integer expression")

    try:
        return value(tree)
    except ValueError:
        return None


def _compile(filename: str, defines: tuple = ()):
    import cupy

    path = kernel_source(filename)
    names = declared_kernels(path)
    code = inline_local_includes(path)
    options = COMPILE_OPTIONS + tuple(o for line in _OPTIONS_LINE.findall(code) for o in line.split()) \
        + tuple(_define_text(defines).split())
    module = cupy.RawModule(code=code, options=options, name_expressions=names)
    module.compile()  # compile now, not at the first launch inside a timed or captured region
    return module


def get_function(filename: str, name: str, *, group: "EPGroup | None" = None, defines: tuple = ()):
    """A ``cupy.RawKernel`` for ``name`` (as declared on the file's ``//! kernels:`` line) of
    the module variant compiled with ``defines`` (:func:`load_module`).

    Cached: hot paths look their kernels up on every launch, and reading the source to
    check the declaration cost tens of microseconds of host time per call."""
    defines = _checked_defines(defines)
    function = _functions.get((filename, defines, name))
    if function is not None and (group is None or (filename, defines) in _group_modules.get(group, ())):
        return function
    module = load_module(filename, group=group, defines=defines)
    declared = declared_kernels(kernel_source(filename))
    if name not in declared:
        raise KeyError(f"{name!r} is not declared in {filename} (declared: {', '.join(declared)})")
    function = _functions[(filename, defines, name)] = module.get_function(name)
    return function
