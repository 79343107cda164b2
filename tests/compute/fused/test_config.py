"""The fused kernels' configuration: refusals naming the knob and the bound, the kernel
variant each configuration compiles, and the schedule's buckets."""

import pytest

from ultraep.errors import MoELayerError
from ultraep.runtime.kernels import kernel_constant
from ultraep.compute.fused.config import SEND_SHARE, FusedConfig, FusedSchedule, share_of_ctas


def test_defaults_are_the_kernel_sources_and_compile_the_plain_module():
    config = FusedConfig(132)
    assert (config.send_tokens, config.reduce_tokens, config.copy_unroll, config.reduce_unroll) == tuple(
        kernel_constant("fused_moe.cu", name) for name in ("FM_SEND_TOKENS", "FM_REDUCE_TOKENS", "FM_UNROLL",
                                                           "FM_REDUCE_UNROLL"))
    assert config.defines() == ()
    assert FusedConfig(8, send_tokens=32, reduce_unroll=2).defines() == (("FM_SEND_TOKENS", 32),
                                                                          ("FM_REDUCE_UNROLL", 2))
    assert str(FusedConfig(8, send_tokens=32)) == "ctas=8 senders=8 send=32 reduce=16 unroll=4/8"


def test_senders_default_to_a_share_of_the_ctas_and_round_trip():
    assert [FusedConfig(c).send_ctas for c in (1, 2, 3, 33, 132)] == [max(1, min(c, round(c * SEND_SHARE)))
                                                                      for c in (1, 2, 3, 33, 132)]
    assert share_of_ctas([1, 2, 33, 132], 0.25).tolist() == [1, 1, 8, 33]  # rounded, at least one
    assert share_of_ctas([1, 33], 0.0).tolist() == [0, 0] and FusedConfig(33, send_ctas=0).send_ctas == 0
    assert FusedConfig(33, send_ctas=40).send_ctas == 33  # never more than the grid
    assert FusedConfig(33, send_ctas=FusedConfig(33).send_ctas) == FusedConfig(33)
    assert FusedConfig(33, send_ctas=5) != FusedConfig(33, send_ctas=6)
    for config in (FusedConfig(33, send_ctas=5, send_tokens=8), FusedConfig(132)):
        assert FusedConfig.parse(str(config)) == config
    assert FusedConfig.parse("ctas=27 send=16 reduce=16 unroll=4/8") == FusedConfig(27, send_ctas=27)  # every CTA sent
    assert FusedConfig.parse("ctas=4 senders=0 send=16 reduce=16 unroll=4/8") == FusedConfig(4, send_ctas=0)


@pytest.mark.parametrize("knobs, message", [
    (dict(ctas=0), "ctas must be a positive integer, got 0"),
    (dict(ctas=True), "ctas must be a positive integer"),
    (dict(ctas=4, send_tokens=2.5), "send_tokens must be a positive integer, got 2.5"),
    (dict(ctas=4, reduce_tokens=-1), "reduce_tokens must be a positive integer"),
    (dict(ctas=4, copy_unroll=9), "copy_unroll must be at most 8, got 9"),
    (dict(ctas=4, reduce_unroll=17), "reduce_unroll must be at most 16, got 17"),
    (dict(ctas=4, send_ctas=-1), "send_ctas must be an integer >= 0 or None, got -1"),
])
def test_bad_knobs_are_refused_by_name(knobs, message):
    with pytest.raises(MoELayerError, match=message):
        FusedConfig(**knobs)


def test_a_grid_above_the_resident_ctas_names_both_numbers():
    FusedConfig(33).check_resident(33)
    with pytest.raises(MoELayerError, match="ctas 34 exceeds the 33 CTAs"):
        FusedConfig(34).check_resident(33)
    with pytest.raises(MoELayerError, match="ctas 132 exceeds the 33 CTAs"):
        FusedSchedule((FusedConfig(8), FusedConfig(132))).check_resident(33)
    with pytest.raises(MoELayerError, match="needs FusedConfigs"):
        FusedSchedule(())


def test_a_configuration_parses_back_from_its_text():
    config = FusedConfig(27, 64, 4, copy_unroll=2, reduce_unroll=16)
    assert FusedConfig.parse(str(config)) == config
    assert str(config) == f"ctas=27 senders={config.send_ctas} send=64 reduce=4 unroll=2/16"
    with pytest.raises(MoELayerError, match="not a fused configuration"):
        FusedConfig.parse("ctas=27 send=64")
