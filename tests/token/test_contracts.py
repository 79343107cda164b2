"""The token path's contracts with its kernels and within its package, on the CPU: every
constant the host shares with ``raw_kernels/dispatch.cu`` is read from there and used by
the kernels, the host applies them, and no token module imports the Dispatcher back."""

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import ultraep.token
from ultraep.runtime.kernels import kernel_constants, kernel_source
from ultraep.token import Dispatcher, base, device, dispatcher, reference

KERNEL = kernel_constants("dispatch.cu")

# Every constant the host holds, and the kernel #define it must equal.
SHARED = [
    (base, "BAD_EXPERT_ID", "BAD_EXPERT_ID"),
    (base, "NAN_GATE", "NAN_GATE"),
    (base, "BAD_RECORD_FIELDS", "BAD_RECORD_FIELDS"),
    (device, "NO_BAD_ITEM", "NO_BAD_ITEM"),
    (device, "OUTCOME_BAD_INPUT", "OUTCOME_BAD_INPUT"),
    (device, "OUTCOME_TOO_MANY_ROWS", "OUTCOME_TOO_MANY_ROWS"),
    (device, "WARP", "WARP"),
    (device, "VECTOR_BYTES", "VECTOR_BYTES"),
    (dispatcher, "MAX_TOP_K", "WARP"),
    (dispatcher, "MAX_RANKS", "MAX_RANKS"),
    (dispatcher, "VECTOR_BYTES", "VECTOR_BYTES"),
    (reference, "WARP", "WARP"),
    (reference, "VECTOR_BYTES", "VECTOR_BYTES"),
]


def kernel_code() -> str:
    """dispatch.cu without comments and without its #define lines."""
    source = kernel_source("dispatch.cu").read_text()
    source = re.sub(r"//[^\n]*", "", source)
    return re.sub(r"^#define[^\n]*", "", source, flags=re.MULTILINE)


@pytest.mark.parametrize("module, name, define", SHARED, ids=[f"{m.__name__}.{n}" for m, n, _ in SHARED])
def test_host_constant_is_the_kernels(module, name, define):
    assert getattr(module, name) == KERNEL[define]


@pytest.mark.parametrize("define", sorted({d for _, _, d in SHARED}))
def test_kernel_uses_each_shared_constant(define):
    """A #define the kernels do not use would tie the host to nothing."""
    assert re.search(rf"\b{define}\b", kernel_code()), f"dispatch.cu defines {define} but its code never uses it"


def test_codes_are_distinct():
    assert len({KERNEL["BAD_EXPERT_ID"], KERNEL["NAN_GATE"], 0}) == 3  # 0: no bad item in the record
    assert len({KERNEL["OUTCOME_OK"], KERNEL["OUTCOME_BAD_INPUT"], KERNEL["OUTCOME_TOO_MANY_ROWS"]}) == 3


def test_host_applies_the_codes_and_the_record_width():
    ids = np.array([[0, 1], [9, 2]])
    weights = np.array([[0.5, np.nan], [0.5, 0.5]], np.float32)
    assert base.first_bad_item(ids, weights, 8) == (KERNEL["NAN_GATE"], 0, 1, 1)
    weights[0, 1] = 0.5
    assert base.first_bad_item(ids, weights, 8) == (KERNEL["BAD_EXPERT_ID"], 1, 0, 9)
    assert "outside [0, 8)" in base.bad_input_message(3, KERNEL["BAD_EXPERT_ID"], 1, 0, 9, 8)
    assert "NaN" in base.bad_input_message(3, KERNEL["NAN_GATE"], 0, 1, 1, 8)
    needs = Dispatcher.heap_requirements(4, hidden=64, dtype="bfloat16", top_k=4, num_experts=8, max_tokens=16)
    table = dict((name, shape) for name, shape, _ in needs.tensors)["token.count_table"]
    assert table == (4, 8 + 4 + KERNEL["BAD_RECORD_FIELDS"])


def test_set_up_limits_are_the_kernels():
    setup = dict(hidden=64, dtype="bfloat16", top_k=4, num_experts=8, max_tokens=16)
    Dispatcher.heap_requirements(4, **{**setup, "top_k": KERNEL["WARP"]})
    with pytest.raises(ValueError, match=f"top_k must be <= {KERNEL['WARP']}"):
        Dispatcher.heap_requirements(4, **{**setup, "top_k": KERNEL["WARP"] + 1})
    with pytest.raises(ValueError, match=f"multiple of {KERNEL['VECTOR_BYTES']} bytes"):
        Dispatcher.heap_requirements(4, **{**setup, "hidden": KERNEL["VECTOR_BYTES"] // 2 + 1})
    with pytest.raises(ValueError, match=f"at most {KERNEL['MAX_RANKS']} ranks"):
        Dispatcher.heap_requirements(KERNEL["MAX_RANKS"] + 1, **{**setup, "num_experts": KERNEL["MAX_RANKS"] + 1})


def test_heap_requirements_do_not_depend_on_the_backend():
    """Both backends allocate one list: the device's barrier signals are declared on the host too."""
    needs = Dispatcher.heap_requirements(2, hidden=32, dtype="float32", top_k=2, num_experts=4, max_tokens=8)
    assert [name for name, _ in needs.signals] == ["token.sync"]
    assert [name for name, _, _ in needs.tensors][:2] == ["token.count_table", "token.landing"]
    rows = 2 * 8 * 2
    assert dict((n, s) for n, s, _ in needs.tensors)["token.row_origin"] == (rows,)
    bounded = Dispatcher.heap_requirements(2, hidden=32, dtype="float32", top_k=2, num_experts=4, max_tokens=8,
                                           max_recv_rows=5)
    assert dict((n, s) for n, s, _ in bounded.tensors)["token.row_origin"] == (5,)


def test_expert_input_adds_the_receive_buffer_to_the_heap():
    """With expert_input the receive buffer [max_recv_rows, H] is one more heap tensor, last,
    so every other tensor keeps its offset; without it nothing changes."""
    setup = dict(hidden=32, dtype="bfloat16", top_k=2, num_experts=4, max_tokens=8, max_recv_rows=20)
    plain = Dispatcher.heap_requirements(2, **setup)
    for expert_output in (False, True):
        without = Dispatcher.heap_requirements(2, **setup, expert_output=expert_output)
        pushed = Dispatcher.heap_requirements(2, **setup, expert_output=expert_output, expert_input=True)
        assert pushed.tensors[:-1] == without.tensors and pushed.signals == without.signals == plain.signals
        name, shape, dtype = pushed.tensors[-1]
        assert (name, shape, dtype.itemsize) == ("token.expert_in", (20, 32), 2)


def token_imports() -> dict[str, set[str]]:
    """For each module of ultraep.token, the ultraep.token modules it imports (at any depth)."""
    package = Path(ultraep.token.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ultraep.token"):
                if node.module == "ultraep.token":
                    found.update(f"ultraep.token.{alias.name}" for alias in node.names)
                else:
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ultraep.token."))
        graph[f"ultraep.token.{path.stem}"] = found - {"ultraep.token"}
    return graph


def test_no_import_cycle_in_the_token_package():
    graph = token_imports()
    assert "ultraep.token.dispatcher" not in graph["ultraep.token.host"] | graph["ultraep.token.device"]
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            assert state.get(target) != "open", "import cycle: " + " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state and not module.endswith("__init__"):
            visit(module, [module])
