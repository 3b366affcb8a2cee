"""Dynamic sampling (model.rollouts.dynamic_sampling): which groups a step keeps, round by round, on one process and on
several (simulated with threads and a summing barrier), and the data module's extra prompts."""

import threading
from types import SimpleNamespace

import pytest
import torch

from lightning_logra.base.batch import Rollout, concat
from lightning_logra.data.module import ArithDataModule
from lightning_logra.train.dynamic_sampling import Drawn, DynamicSampling, kept_per_round, learnable

G = 2  # completions per prompt


def drawn(round_: int, learnable_groups: list[bool], rank: int = 0) -> Drawn:
    """A round of len(learnable_groups) prompts named (round, rank, index), a learnable group's rewards (0, 1)."""
    n = len(learnable_groups)
    names = [f"r{round_}k{rank}i{i}" for i in range(n)]
    rewards = torch.tensor([[0.0, 1.0] if ok else [1.0, 1.0] for ok in learnable_groups]).view(-1)
    width = 2 + round_  # rounds differ in completion width: concat pads them
    ids = torch.arange(n * G)[:, None].repeat(1, width) + 100 * round_
    ones = torch.ones(n * G, width, dtype=torch.long)
    rollout = Rollout(ids[:, :1], ones[:, :1], ids, ones, torch.zeros(n * G, width))
    return Drawn({"prompt": names}, rollout, rewards, rewards[:, None], torch.full((n * G,), float(round_ == 0)))


def test_the_first_learnable_groups_in_the_order_one_process_holds_them():
    counts = torch.tensor([[3, 2], [4, 4]])  # (round, rank): learnable groups found
    assert kept_per_round(counts, 0, 8).tolist() == [3, 3] and kept_per_round(counts, 1, 8).tolist() == [2, 0]
    assert kept_per_round(counts, 0, 20).tolist() == [3, 4] and kept_per_round(counts, 1, 20).tolist() == [2, 4]
    assert kept_per_round(counts, 1, 3).tolist() == [0, 0]


def test_more_rounds_until_the_batch_is_learnable_then_the_first_groups_are_kept():
    rounds = {0: [True, False, False, True], 1: [False, True, False, False], 2: [True, True, True, False]}
    asked = []

    def more(r):
        asked.append(r)
        return drawn(r, rounds[r])

    sampler = DynamicSampling(max_rounds=5, group_size=G, rank=0, world_size=1, sum_over_ranks=lambda t: t)
    kept, metrics = sampler.fill(drawn(0, rounds[0]), more)
    assert asked == [1, 2]  # 2 + 1 learnable after two rounds, 6 after three: stop
    assert kept.batch["prompt"] == ["r0k0i0", "r0k0i3", "r1k0i1", "r2k0i0"]
    assert learnable(kept.rewards, G).all() and kept.rollout.completion_ids.shape == (8, 4)
    assert kept.rollout.completion_ids[4, 0] == 100 + 2 and kept.rollout.completion_mask[0].tolist() == [1, 1, 0, 0]
    assert kept.staleness.tolist() == [1.0] * 4 + [0.0] * 4  # only the first round was drawn ahead
    assert metrics == {"rollout/generation_rounds": 3.0, "rollout/prompts_drawn": 12.0,
                       "rollout/filtered_groups": 6.0, "rollout/missing_groups": 0.0}


def test_at_the_round_limit_the_step_trains_on_what_it_has_and_says_so(caplog):
    sampler = DynamicSampling(max_rounds=2, group_size=G, rank=0, world_size=1, sum_over_ranks=lambda t: t)
    kept, metrics = sampler.fill(drawn(0, [False, True, False]), lambda r: drawn(r, [False, False, False]))
    assert kept.batch["prompt"] == ["r0k0i1"]
    assert metrics["rollout/missing_groups"] == 2.0 and metrics["rollout/generation_rounds"] == 2.0
    # nothing learnable in any round: the first round as drawn (model.scoring.max_unlearnable_steps counts it)
    first = drawn(0, [False, False, False])
    with caplog.at_level("WARNING"):
        kept, metrics = sampler.fill(first, lambda r: drawn(r, [False, False, False]))
    assert kept is first and metrics["rollout/filtered_groups"] == 6.0
    # said, naming the settings (it ran every round each step with a loss of 0 and no word)
    assert ("model.rollouts.dynamic_sampling: none of the 6 groups drawn in 2 rounds "
            "(model.rollouts.max_generation_rounds)") in caplog.text
    assert "model.scoring.max_unlearnable_steps" in caplog.text


def test_two_ranks_keep_what_one_process_keeps_and_run_as_many_rounds():
    # rank r of round j holds prompts (j, r, i): one process would hold rank 0's then rank 1's of each round
    rounds = {(0, 0): [True, False], (0, 1): [False, False], (1, 0): [True, True], (1, 1): [False, True],
              (2, 0): [True, True], (2, 1): [True, True]}
    barrier, totals, lock = threading.Barrier(2), {}, threading.Lock()
    calls = [0, 0]

    def summing(rank):
        def sum_over_ranks(tensor):  # a collective: both ranks' tensors summed
            key = calls[rank]
            calls[rank] += 1
            with lock:
                totals[key] = tensor.clone() if key not in totals else totals[key] + tensor
            barrier.wait()
            result = totals[key].clone()
            barrier.wait()
            return result
        return sum_over_ranks

    results = {}

    def rank_main(rank):
        sampler = DynamicSampling(5, G, rank, 2, summing(rank))
        results[rank] = sampler.fill(drawn(0, rounds[0, rank], rank), lambda r: drawn(r, rounds[r, rank], rank))

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    # one process, its batch each round the ranks' prompts in rank order
    one = DynamicSampling(5, G, 0, 1, lambda t: t)
    merged = {j: rounds[j, 0] + rounds[j, 1] for j in range(3)}
    single, metrics = one.fill(drawn(0, merged[0]), lambda r: drawn(r, merged[r]))
    assert metrics == results[0][1] == results[1][1]  # the same rounds and counts on every rank
    assert len(single.batch["prompt"]) == 4
    kept = [name for rank in (0, 1) for name in results[rank][0].batch["prompt"]]
    order = lambda name: (name[1], name[3], name[5])  # noqa: E731  (round, rank, index): one process's order
    assert sorted(kept, key=order) == ["r0k0i0", "r1k0i0", "r1k0i1", "r1k1i1"]
    assert metrics["rollout/generation_rounds"] == 2.0 and metrics["rollout/filtered_groups"] == 4.0
    # each kept row knows where one process holds it (the KL controller's subset is drawn by it)
    placed = {}
    for rank in (0, 1):
        part = results[rank][0]
        for row, position in enumerate(part.positions.tolist()):
            placed[position] = (part.batch["prompt"][row // G], int(part.rollout.completion_ids[row, 0]))
    assert sorted(placed) == list(range(4 * G)) and single.positions.tolist() == list(range(4 * G))
    assert [placed[p][0] for p in range(0, 4 * G, G)] == ["r0k0i0", "r1k0i0", "r1k0i1", "r1k1i1"]
    assert [placed[p][1] % 100 for p in range(4 * G)] == [0, 1, 0, 1, 2, 3, 2, 3]  # sample i of its group, in order


def test_a_rank_that_keeps_no_group_trains_one_whose_tokens_count_zero():
    rounds = {(0, 0): [True, True, True, True], (0, 1): [False, False, False, False]}
    sums = {0: torch.tensor([4.0], dtype=torch.float64)}

    def sum_over_ranks(tensor):  # rank 1's view of the collectives: rank 0 found 4 learnable groups
        if tensor.shape == (1,):
            return tensor + sums[0]
        return tensor + torch.tensor([[4.0, 0.0]], dtype=torch.float64)

    sampler = DynamicSampling(1, G, 1, 2, sum_over_ranks)  # one round: rank 0's 4 groups are all there is
    kept, metrics = sampler.fill(drawn(0, rounds[0, 1], 1), lambda r: pytest.fail("no second round"))
    assert metrics["rollout/generation_rounds"] == 1.0 and len(kept.batch["prompt"]) == 1
    assert kept.rollout.completion_mask.sum() == 0 and kept.rollout.completion_ids.shape[0] == G
    assert kept.positions.numel() == 0  # none of its rows is in the step's batch


def test_concat_pads_prompts_left_and_completions_right():
    a = Rollout(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7]]), torch.tensor([[1]]),
                torch.tensor([[-0.5]]))
    b = Rollout(torch.tensor([[8]]), torch.tensor([[1]]), torch.tensor([[9, 10, 11]]), torch.tensor([[1, 1, 0]]),
                torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[0, 1, 1]]))
    both = concat([a, b])
    assert both.prompt_ids.tolist() == [[5, 6], [0, 8]] and both.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert both.completion_ids.tolist() == [[7, 0, 0], [9, 10, 11]]
    assert both.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0]]
    assert both.sampler_logprobs.tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, 0.0]]
    assert both.in_flight_updates.tolist() == [[0, 0, 0], [0, 1, 1]]  # rows drawn without in-flight updates saw none
    assert concat([a, a]).in_flight_updates is None


def test_extra_prompts_depend_on_the_step_and_round_alone_and_the_ranks_split_them():
    data = ArithDataModule(batch_size=8, seed=3)
    data.setup("fit")
    one = data.extra_batch(5, 1)
    assert len(one["prompt"]) == 8 and one == data.extra_batch(5, 1)
    assert one["prompt"] != data.extra_batch(5, 2)["prompt"] != data.extra_batch(6, 1)["prompt"]
    parts = []
    for rank in (0, 1):
        data.trainer = SimpleNamespace(global_rank=rank, world_size=2, lightning_module=None)
        parts.append(data.extra_batch(5, 1))
    assert parts[0]["prompt"] + parts[1]["prompt"] == one["prompt"]


def test_rows_whose_tokens_all_count_zero_keep_one_column():
    # a rank that keeps no group, or a micro-batch of completions all cut (mask_truncated_completions), still runs a
    # pass: zero columns crashed the chunked log-probs' reshape under DDP
    rollout = drawn(0, [True, True])
    rollout.rollout.completion_mask[:2] = 0
    assert rollout.rollout.select(torch.tensor([0, 1])).completion_ids.shape == (2, 1)
