"""scripts/gpu_shard.py: the shares of the GPU test files (``GPU_SHARD=i/n`` of
scripts/gpu_check.sh) cover each file once, and a bad share is refused with a message."""

from pathlib import Path

import pytest

from tests.support.scripts import SCRIPTS, load_script


@pytest.fixture(scope="module")
def shard():
    return load_script("gpu_shard")


@pytest.mark.parametrize("text, message", [("3/3", "below the number of shares"), ("1", "i/n"), ("a/2", "i/n"),
                                           ("-1/2", "i/n"), ("1/2/3", "i/n"), ("0/0", "below the number")])
def test_a_bad_share_is_refused_by_name(shard, text, message, capsys):
    with pytest.raises(ValueError, match=message):
        shard.parse_share(text)
    assert shard.main([text]) == 2
    assert text in capsys.readouterr().err


def test_files_once_each_in_path_order(shard):
    ids = ["tests/b.py::t1", "tests/a.py::t[x::y]", "tests/b.py::t2", "2 tests collected", ""]
    assert shard.test_files(ids) == ["tests/a.py", "tests/b.py"]


def test_the_shares_of_this_suite_cover_its_gpu_test_files_once(shard, capsys, monkeypatch):
    monkeypatch.chdir(SCRIPTS.parent)
    shares = []
    for index in range(2):
        assert shard.main([f"{index}/2", "tests"]) == 0
        shares.append(capsys.readouterr().out.split())
    assert shard.main(["0/1", "tests"]) == 0
    every = capsys.readouterr().out.split()
    assert len(every) > 10 and sorted(shares[0] + shares[1]) == every and not set(shares[0]) & set(shares[1])
    assert "tests/compute/test_grouped_gemm_gpu.py" in every and str(Path(__file__).relative_to(SCRIPTS.parent)) \
        not in every  # no GPU test here
