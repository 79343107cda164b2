"""ExpertLayout: derived sizes, slot numbering, validation, value semantics."""

import pickle

import pytest

from ultraep.planner import ExpertLayout


def test_sizes_and_slots():
    lay = ExpertLayout(8, 32, 2, domain_size=4)
    assert (lay.experts_per_rank, lay.slots_per_rank, lay.num_physical, lay.num_domains) == (4, 6, 48, 2)
    assert lay.max_instances == 4  # min(D, 16)
    assert lay.master_rank(0) == 0 and lay.master_rank(31) == 7 and lay.master_rank(5) == 1
    assert lay.domain_of(3) == 0 and lay.domain_of(4) == 1
    assert lay.physical_slot(2, 5) == 17
    assert lay.master_slot(5) == 7  # rank 1, slot 1


def test_defaults():
    lay = ExpertLayout(64, 256, 2)
    assert lay.domain_size == 64 and lay.max_instances == 16
    assert ExpertLayout(72, 576, 2, max_instances=72).max_instances == 72


@pytest.mark.parametrize("args, kwargs, message", [
    ((4, 10, 1), {}, "divisible"),
    ((6, 12, 1), {"domain_size": 4}, "divide"),
    ((0, 8, 1), {}, "num_ranks"),
    ((4, 8, -1), {}, "redundant_slots"),
    ((4, 8.0, 1), {}, "integer"),
    ((4, 8, True), {}, "integer"),
    ((4, 8, 1), {"domain_size": 0}, "domain_size"),
    ((4, 8, 1), {"max_instances": 5}, "max_instances"),
    ((4, 8, 1), {"max_instances": 0}, "max_instances"),
])
def test_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertLayout(*args, **kwargs)


def test_index_checks():
    lay = ExpertLayout(4, 8, 1)
    for call in (lambda: lay.master_rank(8), lambda: lay.domain_of(-1), lambda: lay.physical_slot(0, 3)):
        with pytest.raises(ValueError, match="out of range"):
            call()


def test_value_semantics():
    a, b = ExpertLayout(4, 8, 1, 2), ExpertLayout(4, 8, 1, domain_size=2)
    assert a == b and hash(a) == hash(b) and a != ExpertLayout(4, 8, 2, 2)
    assert pickle.loads(pickle.dumps(a)) == a
    assert "num_ranks=4" in repr(a)
    with pytest.raises(AttributeError):
        a.num_ranks = 3
