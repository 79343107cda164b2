"""ExpertSpec with FP8 weights and float32 block scales: packing, what ranks agree on, and
the specs it refuses."""

import numpy as np
import pytest

from ultraep.runtime.dtypes import FLOAT8_E4M3FN, FLOAT8_E5M2
from ultraep.transfer.spec import SLOT_ALIGN, ExpertSpec

FFN, HIDDEN = 2048, 7168


def deepseek_spec(grad_dtype="bfloat16"):
    return ExpertSpec([("fc1", (2 * FFN, HIDDEN), "float8_e4m3fn"),
                       ("fc1_scale", (2 * FFN // 128, HIDDEN // 128), "float32", "fc1"),
                       ("fc2", (HIDDEN, FFN), "float8_e5m2"),
                       ("fc2_scale", (HIDDEN // 128, FFN // 128), "float32", "fc2")], grad_dtype=grad_dtype)


def test_fp8_weights_pack_at_one_byte_and_scales_beside_them():
    spec = deepseek_spec()
    assert [t.dtype for t in spec.weights] == [FLOAT8_E4M3FN, np.float32, FLOAT8_E5M2, np.float32]
    assert spec.scale_of == {"fc1_scale": "fc1", "fc2_scale": "fc2"}
    fc1, fc1_scale, fc2, fc2_scale = (t.nbytes for t in spec.weights)
    assert (fc1, fc1_scale) == (2 * FFN * HIDDEN, 4 * (2 * FFN // 128) * (HIDDEN // 128))
    assert spec.weight_offsets == (0, fc1, fc1 + fc1_scale, fc1 + fc1_scale + fc2)  # all multiples of 256 here
    assert all(offset % SLOT_ALIGN == 0 for offset in spec.weight_offsets + spec.grad_offsets)
    bf16 = ExpertSpec([("fc1", (2 * FFN, HIDDEN), "bfloat16"), ("fc2", (HIDDEN, FFN), "bfloat16")])
    # the bytes a sync moves: FP8 weights and their scales are about half of bf16's
    assert 0.5 < spec.weight_slot_bytes / bf16.weight_slot_bytes < 0.51
    # gradients stay parallel to the weights, all of the gradient dtype (scales' included)
    assert [(g.name, g.shape) for g in spec.grads] == [(w.name, w.shape) for w in spec.weights]
    assert {g.dtype.name for g in spec.grads} == {"bfloat16"}


def test_ranks_agree_on_which_tensor_scales_which():
    spec = deepseek_spec()
    assert spec.key() == deepseek_spec().key()
    assert ("fc1_scale", (32, 56), "float32", "fc1") in spec.key()
    plain = ExpertSpec([(t.name, t.shape, t.dtype) for t in spec.weights], grad_dtype="bfloat16")
    assert plain.key() != spec.key(), "a scale declared on one rank and not on another must not agree"
    assert "'fc1_scale', (32, 56), 'float32', 'fc1')" in repr(spec)


def test_other_block_grids_and_unscaled_fp8_weights():
    # 64 x 64 blocks with a ragged edge, a per-tensor scale, and an FP8 weight without a scale
    spec = ExpertSpec([("a", (200, 130), "float8_e4m3fn"), ("a_scale", (4, 3), "float32", "a"),
                       ("b", (96, 80), "float8_e5m2"), ("b_scale", (1, 1), "float32", "b"),
                       ("c", (37,), "float8_e4m3fn")])
    assert spec.scale_of == {"a_scale": "a", "b_scale": "b"}


@pytest.mark.parametrize("tensors, needle", [
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (2, 4), "float32", "fc1")], "per square block"),  # transposed
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (4, 3), "float32", "fc1")], "(4, 2)"),
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (8,), "float32", "fc1")], "per square block"),
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (4, 2), "bfloat16", "fc1")], "scales are float32"),
    ([("fc1", (512, 256), "bfloat16"), ("s", (4, 2), "float32", "fc1")], "only FP8 weights"),
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (4, 2), "float32", "fc2")], "no weight tensor 'fc2'"),
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (4, 2), "float32", "s")], "no weight tensor 's'"),
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (4, 2), "float32", "fc1"), ("t", (4, 2), "float32", "fc1")],
     "more than one scale"),
    ([("fc1", (512, 256), "float8_e4m3fn"), ("s", (4, 2), "float32", "fc1", "x")], "scaled weight"),
    ([("fc1", (512, 256), "float8_e4m3fnuz")], "not supported"),
    ([("fc1", (512, 256), "float8_e8m0fnu")], "not supported"),
])
def test_bad_fp8_specs_are_refused(tensors, needle):
    with pytest.raises(ValueError) as info:
        ExpertSpec(tensors)
    assert needle in str(info.value)


@pytest.mark.parametrize("grad_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_gradients_are_refused(grad_dtype):
    with pytest.raises(ValueError, match="FP8 training keeps bfloat16 or float32 gradients"):
        deepseek_spec(grad_dtype)
