"""The grouped GEMM's trial variants (ULTRAEP_GEMM_VARIANT): chosen by name, refused by a
clear error when unknown, the default the headers' own build, every one within the
shared memory a Hopper block may have. On the GPU, scripts/gemm_variants.sh runs the
compute tests per variant and holds each to the default's output bits."""

import pytest

from ultraep.compute.checks import KERNELS
from ultraep.compute.device import VARIANTS, variant_defines
from ultraep.errors import GroupedGemmError
from ultraep.runtime.kernels import kernel_constant, kernel_macro

HOPPER_SHARED_BYTES = 227 * 1024  # the most one block may opt in to on sm_90


def test_unset_and_named_variants(monkeypatch):
    monkeypatch.delenv("ULTRAEP_GEMM_VARIANT", raising=False)
    assert variant_defines() == {}
    monkeypatch.setenv("ULTRAEP_GEMM_VARIANT", "cluster2")
    assert variant_defines() == VARIANTS["cluster2"]


def test_unknown_variant_is_refused_with_the_names(monkeypatch):
    monkeypatch.setenv("ULTRAEP_GEMM_VARIANT", "stages5")
    with pytest.raises(GroupedGemmError, match="stages5.*default, stages4"):
        variant_defines()


def test_default_is_the_headers_build():
    assert VARIANTS["default"] == {}
    staged = kernel_constant(KERNELS, "GG_STAGED_BF16")
    assert kernel_macro(KERNELS, "GG_SMEM_BYTES", stages=kernel_constant(KERNELS, "GH_STAGES"),
                        staged=staged) == kernel_constant(KERNELS, "GH_SMEM_BYTES")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_fits_in_shared_memory(name):
    defines = VARIANTS[name]
    setting = lambda key: defines.get(key, kernel_constant(KERNELS, key))  # noqa: E731
    dynamic = kernel_macro(KERNELS, "GG_SMEM_BYTES", stages=setting("GH_STAGES"), staged=setting("GG_STAGED_BF16"))
    offsets_tables = 2 * 4 * (kernel_constant(KERNELS, "GG_MAX_EXPERTS") + 1)  # the kernels' static int arrays
    barriers = 8 * (2 * setting("GH_STAGES") + 2)
    assert dynamic + offsets_tables + barriers <= HOPPER_SHARED_BYTES
