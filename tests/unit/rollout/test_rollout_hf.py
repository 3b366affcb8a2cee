import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_logra.algo.logprobs import completion_logits, token_logprobs
from lightning_logra.rollout import HFEngine, SamplingParams


def _engine(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model, tokenizer, HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)


def test_greedy_matches_transformers_generate(tiny_arith_model):
    model, tokenizer, engine = _engine(tiny_arith_model)
    prompts = ["12+34=", "7+5=", "99+99="]  # unequal lengths: exercises left padding
    rollout = engine.generate(tokenizer(prompts)["input_ids"], 1, SamplingParams(0.0, 1.0, 6), seeds=[0, 0, 0])
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    expected = model.generate(**batch, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
    expected = expected[:, batch["input_ids"].shape[1]:]
    for row in range(3):
        n = int(rollout.completion_mask[row].sum())
        assert rollout.completion_ids[row, :n].tolist() == expected[row, :n].tolist()


def test_sampling_is_a_function_of_each_prompts_seed_and_logprobs_match_the_trainer(tiny_arith_model):
    model, tokenizer, engine = _engine(tiny_arith_model)
    ids = tokenizer(["12+34=", "50+50="])["input_ids"]
    sampling = SamplingParams(temperature=1.3, top_p=1.0, max_new_tokens=5)
    a = engine.generate(ids, 4, sampling, seeds=[7, 8])
    b = engine.generate(ids, 4, sampling, seeds=[7, 8])
    c = engine.generate(ids, 4, sampling, seeds=[9, 8])
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids[:4], c.completion_ids[:4])  # prompt 0's seed changed
    assert a.prompt_ids.shape[0] == 8 and torch.equal(a.prompt_ids[0], a.prompt_ids[3])
    # a prompt's completions depend on its own seed only, not on the batch it is sampled in (sharded runs)
    alone = engine.generate(ids[1:], 4, sampling, seeds=[8])
    assert torch.equal(alone.completion_ids, c.completion_ids[4:, : alone.completion_ids.shape[1]])
    # the samples of one prompt differ from each other
    assert len({tuple(row) for row in a.completion_ids[:4].tolist()}) > 1
    # the sampler's log-probs are those the loss computes from a full forward pass at the same temperature
    with torch.no_grad():
        logits = completion_logits(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask)
    recomputed = token_logprobs(logits, a.completion_ids, 1.3) * a.completion_mask
    torch.testing.assert_close(a.sampler_logprobs, recomputed, rtol=1e-4, atol=1e-5)


def test_completion_mask_stops_after_eos_and_top_p_narrows(tiny_arith_model):
    _, tokenizer, engine = _engine(tiny_arith_model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = tokenizer(["1+1=", "23+45="])["input_ids"]
    hot = engine.generate(ids, 32, SamplingParams(3.0, 1.0, 4), seeds=[0, 1])  # hot sampling: some rows hit <eos>
    stopped = 0
    for tokens, mask in zip(hot.completion_ids.tolist(), hot.completion_mask.tolist()):
        if eos in tokens:
            stop = tokens.index(eos)
            stopped += stop < len(tokens) - 1
            assert mask == [1] * (stop + 1) + [0] * (len(tokens) - stop - 1)  # the stop token counts, no more
            assert all(t == pad for t in tokens[stop + 1:])
        else:
            assert mask == [1] * len(tokens)
    assert stopped > 0
    # a tiny top_p keeps only the most likely token: sampling becomes greedy
    greedy = engine.generate(ids, 1, SamplingParams(0.0, 1.0, 4), seeds=[0, 1])
    narrow = engine.generate(ids, 3, SamplingParams(1.0, 1e-6, 4), seeds=[2, 3])
    assert torch.equal(narrow.completion_ids, greedy.completion_ids.repeat_interleave(3, 0))


def test_inverse_cdf_sampling_follows_the_tempered_distribution():
    from lightning_logra.rollout.hf import sample_next

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)  # (N, 4)
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=2.0), torch.arange(20000))
    expected = torch.softmax(logits[0] / 2.0, -1)
    frequencies = torch.bincount(tokens, minlength=4) / 20000.0
    # 20,000 draws: standard error ≤ 0.0035 per frequency
    torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.015)
    torch.testing.assert_close(logprobs, expected.log()[tokens])
    # probabilities 0.455, 0.276, 0.167, 0.102: top-p 0.7 keeps the first two (0.455 < 0.7 ≤ 0.455 + 0.276)
    narrow, _ = sample_next(logits, SamplingParams(temperature=2.0, top_p=0.7), torch.arange(20000))
    assert set(narrow.unique().tolist()) == {0, 1}
