"""The 1F1B order used to drive pipelines in one process."""

from ultraep.integration.pipeline import max_in_flight, one_f_one_b, stage_program


def test_one_f_one_b_order():
    order = one_f_one_b(2, 4)
    assert [op for op in order if op[0] == 0] == [(0, k, mb) for k, mb in stage_program(0, 2, 4)]
    assert stage_program(0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    for stage, kind, mb in order:  # every backward after its forward and after the next stage's backward
        position = order.index((stage, kind, mb))
        if kind == "B":
            assert order.index((stage, "F", mb)) < position
            if stage == 0:
                assert order.index((1, "B", mb)) < position
    assert [max_in_flight(order, s) for s in range(2)] == [2, 1]
    assert [max_in_flight(one_f_one_b(4, 8), s) for s in range(4)] == [4, 3, 2, 1]
