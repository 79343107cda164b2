"""``bench balancer --plot`` on the CPU backend: the table streams and one PNG decodes."""

import pytest

from ultraep.bench import balancer as bench


@pytest.mark.mpi
def test_balancer_bench_streams_rows_progress_and_one_plot(tmp_path, capfd):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = tmp_path / "balancer.png"
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "1.5", "2.0", "--min-replica-tokens", "16",
                       "--repeats", "1", "--plot", str(png)])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("weights"))
    assert len([line for line in lines[header + 2:] if line.startswith("bf16")]) == 2  # both rows, below one header
    assert "[bench balancer]" in err and "timing the balanced MoE layer" in err
    image = matplotlib.image.imread(png)
    assert png.stat().st_size > 0 and image.shape[0] > 100 and image.shape[1] > 100
