"""The order in which a 1F1B pipeline runs its forward and backward passes -- for driving
several micro-batches in flight through one process in examples, tests and benchmarks.

Stage ``s`` of ``P`` runs ``min(P - s, N)`` warm-up forwards, then alternates one backward
and one forward, then drains its backwards. A forward of stage ``s > 0`` waits for the
same micro-batch's forward on stage ``s - 1``; a backward waits for the same
micro-batch's backward on stage ``s + 1`` (the last stage's backward for its own
forward). Each tick every stage whose next op is ready runs it.
"""

from __future__ import annotations


def stage_program(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """``[("F" | "B", micro-batch), ...]`` of one stage, in its own order."""
    warmup = min(stages - stage, micro_batches)
    ops = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        ops += [("B", i), ("F", warmup + i)]
    return ops + [("B", i) for i in range(micro_batches - warmup, micro_batches)]


def one_f_one_b(stages: int, micro_batches: int) -> list[tuple[int, str, int]]:
    """Every stage's ops merged by tick (lower stage first within a tick): ``[(stage, kind, micro-batch)]``."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {stages}, {micro_batches}")
    programs = [stage_program(s, stages, micro_batches) for s in range(stages)]
    cursor, done, order = [0] * stages, set(), []
    while any(c < len(p) for c, p in zip(cursor, programs)):
        ready = []
        for stage, program in enumerate(programs):
            if cursor[stage] == len(program):
                continue
            kind, mb = program[cursor[stage]]
            if kind == "F":
                needs = None if stage == 0 else (stage - 1, "F", mb)
            else:
                needs = (stage + 1, "B", mb) if stage + 1 < stages else (stage, "F", mb)
            if needs is None or needs in done:
                ready.append((stage, kind, mb))
        if not ready:
            raise AssertionError("1F1B schedule deadlocked")  # cannot happen for the programs above
        for op in ready:
            order.append(op)
            done.add(op)
            cursor[op[0]] += 1
    return order


def max_in_flight(order, stage: int) -> int:
    """Largest number of micro-batches of ``stage`` forwarded but not yet backwarded."""
    live, peak = set(), 0
    for s, kind, mb in order:
        if s == stage:
            (live.add if kind == "F" else live.discard)(mb)
            peak = max(peak, len(live))
    return peak
