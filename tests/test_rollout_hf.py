import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_logra.loss import completion_logits, token_logprobs
from lightning_logra.rollout import HFEngine, SamplingParams


def _engine(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model, tokenizer, HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)


def test_greedy_matches_transformers_generate(tiny_arith_model):
    model, tokenizer, engine = _engine(tiny_arith_model)
    prompts = ["12+34=", "7+5=", "99+99="]  # unequal lengths: exercises left padding
    rollout = engine.generate(tokenizer(prompts)["input_ids"], 1, SamplingParams(0.0, 1.0, 6), seed=0)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    expected = model.generate(**batch, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
    expected = expected[:, batch["input_ids"].shape[1]:]
    for row in range(3):
        n = int(rollout.completion_mask[row].sum())
        assert rollout.completion_ids[row, :n].tolist() == expected[row, :n].tolist()


def test_sampling_is_a_function_of_the_seed_and_logprobs_match_the_trainer(tiny_arith_model):
    model, tokenizer, engine = _engine(tiny_arith_model)
    ids = tokenizer(["12+34=", "50+50="])["input_ids"]
    sampling = SamplingParams(temperature=1.3, top_p=1.0, max_new_tokens=5)
    a = engine.generate(ids, 4, sampling, seed=7)
    b = engine.generate(ids, 4, sampling, seed=7)
    c = engine.generate(ids, 4, sampling, seed=8)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert a.prompt_ids.shape[0] == 8 and torch.equal(a.prompt_ids[0], a.prompt_ids[3])
    # the sampler's log-probs are those the loss computes from a full forward pass at the same temperature
    with torch.no_grad():
        logits = completion_logits(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask)
    recomputed = token_logprobs(logits, a.completion_ids, 1.3) * a.completion_mask
    torch.testing.assert_close(a.sampler_logprobs, recomputed, rtol=1e-4, atol=1e-5)


def test_completion_mask_stops_after_eos_and_top_p_narrows(tiny_arith_model):
    _, tokenizer, engine = _engine(tiny_arith_model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = tokenizer(["1+1=", "23+45="])["input_ids"]
    hot = engine.generate(ids, 32, SamplingParams(3.0, 1.0, 4), seed=0)  # hot sampling: some rows hit <eos>
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
    greedy = engine.generate(ids, 1, SamplingParams(0.0, 1.0, 4), seed=0)
    narrow = engine.generate(ids, 3, SamplingParams(1.0, 1e-6, 4), seed=1)
    assert torch.equal(narrow.completion_ids, greedy.completion_ids.repeat_interleave(3, 0))
