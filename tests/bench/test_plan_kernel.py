"""``bench plan-kernel`` on the CPU (its NumPy columns): the anchor case with the cap and
the proven fewest replicas."""

import json

from ultraep.bench import plan_kernel
from ultraep.runtime.group import gpu_count


def test_cap_columns_and_replica_bound(tmp_path, capsys):
    out = tmp_path / "plan-kernel.json"
    assert plan_kernel.main(["--experts", "128", "--initial-imbalance", "1.5", "--replica-bound",
                             "--json", str(out)]) == 0
    assert "cap_slots_bound" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["after"] <= row["cap_after"] <= 1.005 < row["before"]
    assert row["cap_slots"] < row["slots"]  # settling for the cap needs fewer replicas
    assert isinstance(row["cap_slots_bound"], int) and 0 < row["cap_slots_bound"] <= row["cap_slots"]
    if gpu_count() == 0:
        assert row.get("plan_ms") is None  # the kernel columns stay empty, not faked
