"""Every name of ``ultraep.__all__`` used as a framework would, for ``mypy --strict``
(``tests/typing/test_public_api_types.py``): type-checked, never run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import ultraep
from ultraep import (BalanceHandle, Balancer, BalancerError, BarrierTimeout, CollectiveError, Dispatcher,
                     DispatchError, EPGroup, ExpertLayout, ExpertSpec, GroupedGemmError, GroupMismatchError,
                     HeapError, LaunchError, MPSUnavailable, Plan, StaleHandleError, TraceRecorder, TransferTimeout,
                     UltraEPError, WaitTimeout, WeightTransfer, load_trace, open_heap, plan_placement, reroute,
                     save_trace)

ERRORS: tuple[type[UltraEPError], ...] = (BalancerError, BarrierTimeout, CollectiveError, DispatchError,
                                          GroupedGemmError, GroupMismatchError, HeapError, LaunchError,
                                          MPSUnavailable, StaleHandleError, TransferTimeout, WaitTimeout)


def planner(loads: np.ndarray) -> tuple[Plan, Any]:
    layout = ExpertLayout(4, 16, 2, domain_size=4)
    plan: Plan = plan_placement(loads, layout, min_replica_tokens=64)
    plan.validate(64)
    fraction: float = plan.remote_fraction()
    assert fraction >= 0 and plan.slots_used >= 0 and plan.max_fanout >= 0
    split = plan.to_numpy().split()
    return plan, reroute(np.zeros((8, 2), np.int32), plan, 0) + split.sum()


def training_step(comm: Any, weights: list[list[Any]], grads: list[list[Any]], ids: Any, x: Any,
                  gates: Any) -> Path:
    group = EPGroup(comm, use_gpu=False)
    layout = ExpertLayout(group.size, 4 * group.size, 1)
    spec = ExpertSpec([("w_in", (8, 16), "float32"), ("w_out", (16, 8), "float32")], grad_dtype="float32")
    with Balancer(group, layout, spec, num_layers=1, record_trace=True) as balancer, \
            Dispatcher.for_layout(group, layout, hidden=8, dtype="float32", top_k=2, max_tokens=16) as dispatcher:
        balancer.register_layer(0, weights, grads)
        handle: BalanceHandle = balancer.update(0, ids)
        balancer.weight_sync(handle)
        slots = balancer.reroute(handle, ids)
        received = dispatcher.dispatch(x, slots, gates)
        y = dispatcher.combine(received.x, received.handle)
        dispatcher.combine_backward(y, received.x, received.handle)
        dispatcher.dispatch_backward(received.x, received.handle)
        balancer.restore(handle)
        balancer.reduce_grads(handle)
        assert balancer.local_experts(handle) is not None
        return balancer.save_trace("trace.npz")


def transfer(comm: Any, weights: list[list[Any]], grads: list[list[Any]], plan: Plan) -> None:
    group = EPGroup(comm)
    layout, spec = plan.layout, ExpertSpec([("w", (4, 4), "float32")])
    heap = open_heap(group, WeightTransfer.heap_requirements(layout, spec), backend="host")
    try:
        with WeightTransfer(heap, layout, spec) as engine:
            engine.register_layer(0, weights, grads)
            engine.weight_sync(0, plan)
            engine.restore(0, plan)
            engine.reduce_grads(0, plan)
            engine.synchronize()
    except ERRORS as exc:
        raise UltraEPError(str(exc)) from exc
    finally:
        heap.close()


def traces(loads: np.ndarray) -> int:
    recorder = TraceRecorder(4, 16, metadata={"model": "toy"})
    recorder.record(0, 0, loads)
    path: Path = recorder.save("a.npz")
    save_trace("b.npz", loads[None, None])
    return load_trace(path).num_steps + len(ultraep.__all__)
