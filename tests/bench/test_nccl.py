"""``ultraep.bench.nccl``: the all-ranks verdict on whether the NCCL baseline can run, taken
before any NCCL call (NCCL refuses two ranks on one GPU; torch is optional)."""

from ultraep.bench.nccl import NcclBaseline, skip_reason


def test_one_rank_per_gpu_runs():
    identities = [("host-a", "0000:18:00.0"), ("host-a", "0000:2a:00.0"), ("host-b", "0000:18:00.0")]
    assert skip_reason(identities, [None] * 3) is None


def test_ranks_sharing_a_gpu_are_not_run_and_the_count_is_the_largest_sharing():
    gpu0, gpu1 = ("host", "0000:18:00.0"), ("host", "0000:2a:00.0")
    assert skip_reason([gpu0] * 4, [None] * 4) == "not run (4 ranks share one GPU)"
    assert skip_reason([gpu0, gpu1, gpu1, gpu0, gpu1], [None] * 5) == "not run (3 ranks share one GPU)"


def test_sharing_is_reported_before_a_rank_without_torch():
    gpu = ("host", "0000:18:00.0")
    assert skip_reason([gpu, gpu], [None, "torch is not importable (x)"]) == "not run (2 ranks share one GPU)"


def test_a_rank_without_torch_or_gpu_names_the_rank():
    gpus = [("host", f"0000:{i:02x}:00.0") for i in range(3)]
    assert skip_reason(gpus, [None, None, "torch is not importable (x)"]) == \
        "not run (rank 2: torch is not importable (x))"
    assert skip_reason([gpus[0], None, gpus[2]], [None] * 3) == "not run (rank 1 has no GPU)"


class FakeGroup:
    """One CPU rank: what NcclBaseline reads of an EPGroup."""

    rank, size, has_gpu, hostname, all_on_one_host = 0, 1, False, "host", True

    def allgather(self, value):
        return [value]


def test_baseline_without_gpu_measures_nothing_and_says_why():
    with NcclBaseline(FakeGroup()) as nccl:
        assert not nccl.runs and nccl.reason == "not run (rank 0 has no GPU)"
        assert nccl.batch_isend_irecv_ms([(0, 1, 1024)], repeats=2) is None
        assert nccl.all_to_all_single_ms([[1024]], repeats=2) is None

