"""`lightning-logra serve`'s command line as vLLM gets it: on the CPU backend eager and with prompts prefilled whole
unless the user says otherwise after `--` (as VLLMEngine is), on a GPU vLLM's own defaults (CUDA graphs, chunked
prefill)."""

import pytest
from transformers import LlamaConfig, LlavaConfig

from lightning_logra.rollout.server.command import parser, vllm_arguments
from lightning_logra.rollout.vllm.launch import CPU_BATCHED_TOKENS, model_context, whole_prefills


def _args(*extra: str, cpu: bool) -> list[str]:
    return vllm_arguments(parser().parse_args(["--model", "m", *extra]), cpu_backend=cpu)


@pytest.mark.parametrize("extra, cpu, eager", [
    ((), True, True),
    ((), False, False),
    (("--", "--no-enforce-eager"), True, False),
    (("--", "--enforce-eager"), False, True),
])
def test_the_cpu_backend_serves_eager_unless_told_otherwise(extra, cpu, eager):
    args = _args(*extra, cpu=cpu)
    assert args[:2] == ["--model", "m"] and "--worker-extension-cls" in args
    flags = [arg for arg in args if arg.split("=")[0] in ("--enforce-eager", "--no-enforce-eager")]
    assert len(flags) <= 1  # never both: the user's flag, or ours
    assert (flags == ["--enforce-eager"]) == eager


def test_on_the_cpu_backend_prompts_are_prefilled_whole_in_a_budget_that_holds_the_longest(tmp_path):
    # vLLM's seeded sampling cannot rewind a CPU generator after the chunk of a split prefill (`whole_prefills`)
    model = tmp_path / "model"
    LlamaConfig(max_position_embeddings=8192).save_pretrained(model)
    assert whole_prefills({}, str(model)) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert whole_prefills({"max_model_len": 512}, str(model))["max_num_batched_tokens"] == CPU_BATCHED_TOKENS
    assert whole_prefills({"max_model_len": 512, "max_num_batched_tokens": 16384}, str(model)) == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 16384}
    assert whole_prefills({"enable_chunked_prefill": True}, str(model)) == {}  # the user's choice
    args = vllm_arguments(parser().parse_args(["--model", str(model), "--max-model-len", "512"]), cpu_backend=True)
    assert args[-3:] == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(CPU_BATCHED_TOKENS)]
    assert "--no-enable-chunked-prefill" not in _args(cpu=False)
    theirs = _args("--", "--max-num-batched-tokens", "9000", cpu=True)
    assert theirs.count("--max-num-batched-tokens") == 1 and theirs[-2:] == ["--max-num-batched-tokens", "9000"]
    assert "--no-enable-chunked-prefill" not in _args("--", "--enable-chunked-prefill", cpu=True)


def test_the_cpu_backend_serves_blocks_of_32_tokens_unless_told_otherwise():
    # a group's samples share their prompt's whole blocks (kv_cache.cpu_blocks), as VLLMEngine's on the CPU
    args = _args(cpu=True)
    assert args[args.index("--block-size") + 1] == "32"
    assert "--block-size" not in _args(cpu=False)
    theirs = _args("--", "--block-size", "128", cpu=True)
    assert theirs.count("--block-size") == 1 and theirs[-2:] == ["--block-size", "128"]


def test_the_context_is_read_as_vllm_reads_it(tmp_path):
    LlavaConfig(text_config={"model_type": "llama", "max_position_embeddings": 16384}).save_pretrained(tmp_path / "vl")
    assert model_context(str(tmp_path / "vl")) == 16384  # a text model inside a vision-language one
    assert model_context(str(tmp_path / "missing")) == 0  # vLLM names the budget and max_model_len itself



def test_serve_takes_a_fetched_models_short_name_and_says_how_to_fetch_it(tmp_path, monkeypatch):
    from lightning_logra import paths
    from lightning_logra.rollout import server

    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    with pytest.raises(SystemExit, match="serve --model: .* run `lightning-logra fetch smollm2-135m-instruct` once"):
        server.main(["--model", "smollm2-135m-instruct"])
