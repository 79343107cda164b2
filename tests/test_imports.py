"""The package's import graph, read from the source with ``ast``: no cycle, and the layers
import only downwards (runtime -> planner -> transfer / token, compute -> the fused layer
(compute.fused, which fuses the token path with compute) -> tune -> integration; analysis
and bench beside and above them, never imported by the runtime path).

Every ``import`` statement counts, at module level or inside a function, except those
under ``if TYPE_CHECKING:`` (they never run). ``from ultraep.x import y`` is an edge to
``ultraep.x.y`` when that is a module, else to ``ultraep.x``. Imports by name string
(``importlib.import_module``, the lazy top-level API) are not edges."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ultraep"
RUNTIME_PATH = ("runtime", "planner", "transfer", "token", "compute", "fused", "tune", "integration")



def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


class _Imports(ast.NodeVisitor):
    """The names of every module one module's source imports (the package's and others')."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.names: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[:len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            self.names.add(submodule if submodule in MODULES else source)


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    return visitor.names


IMPORTS = {module: imports_of(module) for module in MODULES}
GRAPH = {module: {name for name in names if name in MODULES and name != module} for module, names in IMPORTS.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components with more than one module (each holds at least one cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete cycle inside ``component``, as a path that returns to its start."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for succ in sorted(graph[node] & component):
            if succ == start:
                path = [node]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if succ not in parents:
                parents[succ] = node
                frontier.append(succ)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


# Command-line tools inside a runtime package: they measure the layers below, as the benchmarks do.
TOOLS = {"ultraep.tune.__main__": "bench", "ultraep.tune.validate": "bench", "ultraep.tune.sync_timing": "bench"}


def layer_of(module: str) -> str:
    """The layer a module belongs to: its top-level package, but ``fused`` for the fused
    kernels' ``compute.fused`` (above ``token``, which ``compute``'s grouped GEMM is not)."""
    if module in TOOLS:
        return TOOLS[module]
    parts = module.split(".")
    if parts[1:3] == ["compute", "fused"]:
        return "fused"
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_is_read():
    assert "ultraep.runtime.kernels" in GRAPH and "ultraep.integration.balancer" in GRAPH
    assert "ultraep.planner.plan" in GRAPH["ultraep.integration.stats"]
    assert "ultraep.analysis.traces" in GRAPH["ultraep.bench.plan"]
    assert "ultraep.tune.replicas" in GRAPH["ultraep.integration.balancer"]
    assert "ultraep.token.reference" in GRAPH["ultraep.compute.fused.forward"]
    assert (layer_of("ultraep.compute.fused.forward"), layer_of("ultraep.compute.grouped_gemm")) == ("fused", "compute")
    assert one_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]


def test_no_import_cycle():
    cycles = strongly_connected(GRAPH)
    report = [f"{' -> '.join(one_cycle(GRAPH, c))}  (modules in this knot: {', '.join(sorted(c))})" for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(report)


def test_layers_import_only_downwards():
    forbidden = {
        "runtime": {"planner", "transfer", "token", "compute", "fused", "tune", "integration", "analysis", "bench"},
        "planner": {"transfer", "token", "compute", "fused", "tune", "integration", "analysis", "bench"},
        "compute": {"planner", "transfer", "token", "fused", "tune", "integration", "analysis", "bench"},
        # the data plane's two halves stand beside each other
        "transfer": {"token", "fused", "tune", "integration", "analysis", "bench"},
        "token": {"transfer", "fused", "tune", "integration", "analysis", "bench"},
        # the fused kernels join the token path and the grouped GEMM; the tuner chooses their configuration
        "fused": {"planner", "transfer", "tune", "integration", "analysis", "bench"},
        # the profile measures compute and runtime; the cost model reads an ExpertSpec it is handed
        "tune": {"planner", "transfer", "token", "integration", "analysis", "bench"},
        "integration": {"analysis", "bench"},
        "errors": {layer_of(m) for m in MODULES} - {"errors"},  # it imports nothing from the package
    }
    wrong = [f"{module} imports {target}" for module, targets in sorted(GRAPH.items())
             for target in sorted(targets) if layer_of(target) in forbidden.get(layer_of(module), ())]
    assert not wrong, "\n".join(wrong)


def test_runtime_path_never_imports_the_analysis_packages():
    """SciPy and matplotlib are the optional ``analysis`` extra: not even a lazy import on the runtime path."""
    wrong = [f"{module} imports {name}" for module, names in sorted(IMPORTS.items()) if layer_of(module) in RUNTIME_PATH
             for name in sorted(names) if name.split(".")[0] in ("scipy", "matplotlib")]
    assert not wrong, "\n".join(wrong)
