"""Trace format round trip, bad files, recorder, and the seeded load generators."""

import json

import numpy as np
import pytest

from ultraep.analysis import traces
from ultraep.analysis.traces import GENERATORS, rank_imbalance, topk_from_loads, zipf_loads, zipf_topk
from ultraep.integration.traces import TRACE_FORMAT_VERSION, Trace, TraceRecorder, load_trace, save_trace


@pytest.mark.parametrize("ranks,experts,top_k,tokens,target", [
    (64, 128, 8, 8192, 1.5), (64, 256, 8, 8192, 3.0), (16, 64, 8, 1024, 2.0), (8, 32, 4, 256, 1.2),
    (4, 8, 2, 128, 1.5),
])
def test_zipf_hits_target_imbalance(ranks, experts, top_k, tokens, target):
    loads = zipf_loads(ranks, experts, top_k, tokens, target, seed=7)
    assert loads.dtype == np.int32 and loads.shape == (ranks, experts)
    assert abs(rank_imbalance(loads) - target) <= 0.01 * target
    # Every token picks top_k distinct experts.
    assert (loads.sum(axis=1) == tokens * top_k).all()
    assert loads.max() <= tokens and loads.min() >= 0


def test_zipf_is_seeded():
    a = zipf_loads(16, 64, 8, 512, 2.0, seed=3)
    assert np.array_equal(a, zipf_loads(16, 64, 8, 512, 2.0, seed=3))
    assert not np.array_equal(a, zipf_loads(16, 64, 8, 512, 2.0, seed=4))


@pytest.mark.parametrize("target,match", [(0.9, ">= 1"), (40.0, "unreachable"), (float("nan"), ">= 1")])
def test_zipf_rejects_impossible_targets(target, match):
    with pytest.raises(ValueError, match=match):
        zipf_loads(8, 16, 2, 256, target, seed=0)


def test_zipf_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible"):
        zipf_loads(3, 16, 2, 64, 1.5, seed=0)
    with pytest.raises(ValueError, match="top_k"):
        zipf_loads(4, 8, 9, 64, 1.5, seed=0)


def test_zipf_topk_matches_loads_with_distinct_experts_per_token():
    loads = zipf_loads(8, 32, 4, 256, 2.5, seed=11)
    ids = zipf_topk(8, 32, 4, 256, 2.5, seed=11)
    assert ids.dtype == np.int32 and ids.shape == (8, 256, 4)
    for rank in range(8):
        assert np.array_equal(np.bincount(ids[rank].ravel(), minlength=32), loads[rank])
        assert (np.sort(ids[rank], axis=1)[:, 1:] != np.sort(ids[rank], axis=1)[:, :-1]).all()


def test_topk_from_loads_rejects_unrealisable_rows():
    with pytest.raises(ValueError, match="exceeds"):
        topk_from_loads(np.array([[5, 1]], dtype=np.int32), 2, seed=0)  # 3 tokens cannot give expert 0 five
    with pytest.raises(ValueError, match="sum"):
        topk_from_loads(np.array([[2, 1], [1, 1]], dtype=np.int32), 1, seed=0)


def _small_trace(steps=3, layers=2, ranks=4, experts=8, top_k=2, tokens=16):
    trace = traces.lognormal_trace(steps=steps, layers=layers, num_ranks=ranks, num_experts=experts,
                                   top_k=top_k, tokens_per_rank=tokens, seed=1)
    topk = np.stack([np.stack([topk_from_loads(trace.loads[s, l], top_k, seed=s * layers + l)
                               for l in range(layers)]) for s in range(steps)])
    return trace.loads, topk


def test_save_load_round_trip(tmp_path):
    loads, topk = _small_trace()
    path = save_trace(tmp_path / "t.npz", loads, topk, {"model": "toy", "note": [1, 2]})
    trace = load_trace(path)
    assert np.array_equal(trace.loads, loads) and trace.loads.dtype == np.int32
    assert np.array_equal(trace.topk, topk)
    assert trace.metadata["model"] == "toy" and trace.metadata["note"] == [1, 2]
    assert trace.metadata["trace_format_version"] == TRACE_FORMAT_VERSION
    assert (trace.num_steps, trace.num_layers, trace.num_ranks, trace.num_experts) == loads.shape
    # Loads alone, no metadata.
    bare = load_trace(save_trace(tmp_path / "bare.npz", loads))
    assert bare.topk is None and np.array_equal(bare.loads, loads)


def _write(path, **arrays):
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    return path


@pytest.mark.parametrize("arrays,match", [
    (dict(loads=np.ones((2, 1, 2, 4), dtype=np.int64)), "int32"),
    (dict(loads=np.ones((2, 2, 4), dtype=np.int32)), "shape"),
    (dict(loads=np.ones((2, 1, 3, 4), dtype=np.int32)), "divisible"),
    (dict(loads=-np.ones((1, 1, 2, 4), dtype=np.int32)), "non-negative"),
    (dict(other=np.ones((1, 1, 2, 4), dtype=np.int32)), "no 'loads'"),
    (dict(loads=np.ones((1, 1, 2, 4), dtype=np.int32), topk=np.zeros((1, 1, 2, 2, 2), dtype=np.int32)),
     "does not match"),
    (dict(loads=np.ones((1, 1, 2, 4), dtype=np.int32), topk=np.zeros((1, 1, 2, 2), dtype=np.int32)), "topk"),
    (dict(loads=np.ones((1, 1, 2, 4), dtype=np.int32), metadata_json=np.array("{not json")), "JSON"),
])
def test_bad_trace_files_raise_clear_errors(tmp_path, arrays, match):
    path = _write(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "nope.npz")
    junk = tmp_path / "junk.npz"
    junk.write_text("not a zip")
    with pytest.raises(ValueError, match=r"not a readable \.npz archive \(not a NumPy file\)"):
        load_trace(junk)
    np.save(tmp_path / "one.npy", np.ones(3))
    with pytest.raises(ValueError, match=r"\(a lone \.npy array\)"):
        load_trace(tmp_path / "one.npy")
    with pytest.raises(ValueError, match="is a directory"):
        load_trace(tmp_path)


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="int32"):
        save_trace(tmp_path / "x.npz", np.ones((1, 1, 2, 4)))
    with pytest.raises(ValueError, match="JSON"):
        save_trace(tmp_path / "x.npz", np.ones((1, 1, 2, 4), dtype=np.int32), metadata={"f": object()})


def test_recorder_collects_grid_and_saves(tmp_path):
    loads, topk = _small_trace(steps=2, layers=3)
    recorder = TraceRecorder(4, 8, metadata={"run": "unit"})
    for s in range(2):
        for l in reversed(range(3)):  # order of recording does not matter
            recorder.record(s, l, loads[s, l].astype(np.int64), topk[s, l])
    trace = load_trace(recorder.save(tmp_path / "rec.npz"))
    assert np.array_equal(trace.loads, loads) and np.array_equal(trace.topk, topk)
    assert trace.metadata["run"] == "unit"


def test_recorder_rejects_gaps_and_bad_shapes():
    recorder = TraceRecorder(4, 8)
    with pytest.raises(ValueError, match="nothing recorded"):
        recorder.to_trace()
    with pytest.raises(ValueError, match="shape"):
        recorder.record(0, 0, np.zeros((4, 4), dtype=np.int32))
    recorder.record(0, 0, np.zeros((4, 8), dtype=np.int32))
    recorder.record(1, 1, np.zeros((4, 8), dtype=np.int32))
    with pytest.raises(ValueError, match="never recorded"):
        recorder.to_trace()
    with pytest.raises(ValueError, match="multiple"):
        TraceRecorder(3, 8)


SIZES = dict(steps=12, layers=3, num_ranks=8, num_experts=32, top_k=4, tokens_per_rank=512)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_seeded_and_well_formed(name):
    trace = GENERATORS[name](seed=5, **SIZES)
    again = GENERATORS[name](seed=5, **SIZES)
    other = GENERATORS[name](seed=6, **SIZES)
    assert isinstance(trace, Trace)
    assert trace.loads.shape == (12, 3, 8, 32) and trace.loads.dtype == np.int32
    assert np.array_equal(trace.loads, again.loads) and not np.array_equal(trace.loads, other.loads)
    assert (trace.loads.sum(axis=-1) == 512 * 4).all() and trace.loads.max() <= 512
    assert trace.metadata["generator"] == name
    json.dumps(trace.metadata)


def test_zipf_trace_hits_its_target_every_step():
    trace = traces.zipf_trace(seed=2, initial_imbalance=1.8, **SIZES)
    assert np.all(np.abs(rank_imbalance(trace.loads) - 1.8) <= 0.05 * 1.8)


def test_drift_moves_the_hot_rank():
    trace = traces.drift_trace(seed=0, **SIZES)
    per_rank = trace.loads.sum(axis=2).reshape(12, 3, 8, 4).sum(-1)  # [steps, layers, ranks]
    hottest = per_rank.argmax(axis=-1)
    assert all(len(set(hottest[:, l].tolist())) >= 4 for l in range(3))


def test_domain_switch_changes_popularity_abruptly():
    trace = traces.domain_switch_trace(seed=0, domains=2, switch_every=4, **SIZES)
    popularity = trace.loads.sum(axis=2).astype(float)  # [steps, layers, experts]

    def corr(a, b):
        return np.mean([np.corrcoef(popularity[a, l], popularity[b, l])[0, 1] for l in range(3)])

    within = np.mean([corr(s, s + 1) for s in range(12 - 1) if (s + 1) % 4])
    across = np.mean([corr(s, s + 1) for s in (3, 7)])
    assert within > 0.8 and across < within - 0.3


def test_per_layer_skew_rises_with_depth():
    trace = traces.per_layer_trace(seed=0, **SIZES)
    by_layer = rank_imbalance(trace.loads).mean(axis=0)
    assert by_layer[0] < by_layer[1] < by_layer[2]


def test_zipf_unreachable_names_the_most_it_reached():
    # 2 ranks: the hottest expert's capped share spills onto the other rank, so the largest
    # exponent is not where the imbalance peaks; the message names the peak, and below it is reachable.
    with pytest.raises(ValueError, match="unreachable") as refused:
        zipf_loads(2, 8, 2, 256, 40.0, seed=0)
    reached = float(str(refused.value).rsplit("the most reached: ", 1)[1].rstrip(")"))
    assert reached > 1.2
    assert rank_imbalance(zipf_loads(2, 8, 2, 256, reached * 0.99, seed=0)) == pytest.approx(reached * 0.99, rel=0.01)
