"""Prompts as the rollout engine receives them: conversations through the chat template whole (system message
included), data.max_prompt_length with its two policies, drop and truncate, the model's context as the limit when
it is unset, and prompts that tokenize to nothing."""

import logging
from types import SimpleNamespace

import pytest
from lightning.pytorch import Callback, Trainer
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import MambaConfig, MambaForCausalLM, PreTrainedTokenizerFast

from conftest import write_rows
from lightning_logra.data.arith import build_tokenizer
from lightning_logra.data.module import (
    ArithDataModule,
    PromptDataModule,
    TokenizedPrompts,
    collate_rows,
    limit_prompt_length,
)
from lightning_logra.data.prompts import PromptDataset
from lightning_logra.rollout import VLLMEngine
from lightning_logra.train.module import RLVRModule

pytestmark = pytest.mark.usefixtures("hf_cache")

SPECIALS = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB = {token: i for i, token in enumerate([*SPECIALS, "\n", *(chr(c) for c in range(32, 127))])}
# Each message as <|role|>content and a newline, then the assistant's turn: a chat template small enough to write the
# expected token ids by hand.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM = {"role": "system", "content": "Be brief."}


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of printable ASCII and newline, the role markers as special tokens."""
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                      unk_token="<unk>", padding_side="left")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def ids(*pieces: str) -> list[int]:
    """The expected ids, written out: a role marker is one token, any other text one token per character."""
    return [token for piece in pieces for token in ([VOCAB[piece]] if piece in SPECIALS else [VOCAB[c] for c in piece])]


def encoder(chat_template: bool) -> RLVRModule:
    """The module's own encode_prompts with the chat tokenizer (no weights are needed to tokenize)."""
    module = RLVRModule("test/tokenizer-only", chat_template=chat_template, scoring={"timeout_s": None})
    module.tokenizer = chat_tokenizer()
    return module


def test_a_conversation_goes_through_the_chat_template_whole_system_message_included(tmp_path):
    chat = [SYSTEM, {"role": "user", "content": "2+2?"}]
    path = write_rows(tmp_path / "chat.parquet", [{"prompt": chat, "answer": "4"}])
    data = PromptDataModule(train=str(path), template="{prompt} Box it.", batch_size=1)
    data.setup("fit")
    batch = collate_rows(data.train_set.__getitems__([0]))
    expected = ids("<|system|>", "Be brief.\n", "<|user|>", "2+2? Box it.\n", "<|assistant|>")
    # With or without model.chat_template: a conversation is always templated (TRL's conversational format).
    for chat_template in (True, False):
        assert encoder(chat_template).encode_prompts(batch["prompt"]) == [expected]


def test_a_conversation_without_a_chat_template_names_the_data_and_the_setting():
    # transformers' error ("Cannot use chat template functions because tokenizer.chat_template is not set") named
    # neither
    module = encoder(chat_template=False)
    module.tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"the prompts are conversations .*no chat template.*data.train"):
        module.encode_prompts([[SYSTEM, {"role": "user", "content": "2+2?"}]])
    module = encoder(chat_template=True)
    module.tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"model.chat_template is set.*turn model.chat_template off"):
        module.encode_prompts(["2+2?"])


def test_text_prompts_as_they_are_or_as_one_user_message():
    assert encoder(chat_template=False).encode_prompts(["2+2?", "1"]) == [ids("2+2?"), ids("1")]
    assert encoder(chat_template=True).encode_prompts(["2+2?"]) == [ids("<|user|>", "2+2?\n", "<|assistant|>")]


def prompt_set(tmp_path, prompts: list[str]) -> PromptDataset:
    return PromptDataset(str(write_rows(tmp_path / "p.jsonl", [{"prompt": p, "answer": "1"} for p in prompts])))


def test_drop_leaves_out_the_prompts_over_the_limit_and_says_how_many(tmp_path, caplog):
    dataset = prompt_set(tmp_path, ["abcd", "abcdefg", "ab", "abcdef", "abcde"])
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.module"):
        limited = limit_prompt_length(dataset, encoder(False).encode_prompts, 5, "drop", "data.train")
    rows = limited.__getitems__(list(range(len(limited))))
    assert [row["prompt"] for row in rows] == ["abcd", "ab", "abcde"]  # the rest in their order
    assert [row["prompt_ids"] for row in rows] == [ids("abcd"), ids("ab"), ids("abcde")]
    assert limited[2] == rows[2]
    assert ("data.train: 2 of 5 prompts are longer than data.max_prompt_length=5 tokens and were dropped, 3 left"
            in caplog.text)


def test_truncate_keeps_the_last_tokens_of_the_templated_prompt(tmp_path, caplog):
    dataset = prompt_set(tmp_path, ["abcdefgh", "ab"])
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.module"):
        limited = limit_prompt_length(dataset, encoder(True).encode_prompts, 6, "truncate", "data.val")
    # "<|user|>abcdefgh\n<|assistant|>" is 11 tokens: the last 6 are the end of the question and the generation prompt.
    assert [limited[0]["prompt_ids"], limited[1]["prompt_ids"]] == [ids("efgh\n", "<|assistant|>"),
                                                                    ids("<|user|>", "ab\n", "<|assistant|>")]
    assert limited[0]["prompt"] == "abcdefgh"  # the reward still sees the whole prompt
    assert "data.val: 1 of 2 prompts are longer than data.max_prompt_length=6 tokens and keep only their last 6" in (
        caplog.text)


def test_limits_that_leave_nothing_or_make_no_sense_fail_naming_the_key(tmp_path):
    dataset = prompt_set(tmp_path, ["abcd", "abc"])
    with pytest.raises(ValueError, match=r"data.train: every prompt is longer than data.max_prompt_length=2 tokens "
                                         r"\(the shortest has 3\)"):
        limit_prompt_length(dataset, encoder(False).encode_prompts, 2, "drop", "data.train")
    path = str(tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match="data.max_prompt_length must be a positive number of tokens"):
        PromptDataModule(train=path, max_prompt_length=0)
    with pytest.raises(ValueError, match="data.overlong_prompts must be 'drop' or 'truncate', got 'cut'"):
        PromptDataModule(train=path, overlong_prompts="cut")
    data = PromptDataModule(train=path, max_prompt_length=3, batch_size=1)
    data.setup("fit")
    with pytest.raises(ValueError, match="data.max_prompt_length counts tokens with the model's encode_prompts"):
        data.train_dataloader()  # no Trainer, no tokenizer


class PromptsSeen(Callback):
    """The token ids the rollout engine was given, and the columns of each batch."""

    def __init__(self) -> None:
        self.engine_prompts: list[list[int]] = []
        self.batches: list[dict] = []

    def on_fit_start(self, trainer, pl_module):
        self._wrap(pl_module)

    def on_validation_start(self, trainer, pl_module):
        self._wrap(pl_module)

    def _wrap(self, pl_module):
        generate = pl_module.engine.generate
        if getattr(generate, "recorded", False):
            return

        def recorded_generate(prompt_ids, *args):
            self.engine_prompts.extend(prompt_ids)
            return generate(prompt_ids, *args)

        recorded_generate.recorded = True
        pl_module.engine.generate = recorded_generate

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(dict(batch))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.batches.append(dict(batch))


@pytest.mark.parametrize("policy", ["drop", "truncate"])
def test_a_run_rolls_out_only_prompts_within_the_limit(tmp_path, tiny_arith_model, policy):
    # The embedded task's tokenizer has one token per character: "12+34=" is 6 tokens, "123+456=" 8.
    prompts = ["12+34=", "123+456=", "1+2=", "98+76=", "5+5=", "1234+5="]
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": p, "answer": "1"} for p in prompts])
    data = PromptDataModule(train=str(path), val=str(path), batch_size=2, eval_batch_size=6, max_prompt_length=6,
                            overlong_prompts=policy)
    module = RLVRModule(tiny_arith_model, reward="conftest.odd_first_digit",
                        sampling={"num_generations": 2, "max_new_tokens": 2}, scoring={"timeout_s": None})
    seen = PromptsSeen()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, val_check_interval=100, check_val_every_n_epoch=None,
                      num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[seen])
    trainer.fit(module, data)
    trainer.validate(module, data, verbose=False)
    tokenizer = build_tokenizer()
    full = {p: tokenizer(p)["input_ids"] for p in prompts}
    if policy == "drop":
        expected = {p: full[p] for p in prompts if len(full[p]) <= 6}
    else:
        expected = {p: full[p][-6:] for p in prompts}
    training_set = data.train_dataloader().dataset  # the set made at fit start (made once, kept)
    assert isinstance(training_set, TokenizedPrompts) and len(training_set) == len(expected)
    rows = [row for batch in seen.batches for row in zip(batch["prompt"], batch["prompt_ids"])]
    assert len(rows) == 2 * 2 + len(expected)  # 2 training steps of 2 prompts, then the whole validation set
    assert all(ids == expected[prompt] for prompt, ids in rows)
    # The engine got those ids: the module did not tokenize the prompts again.
    assert seen.engine_prompts == [ids for _, ids in rows]


def test_a_prompt_of_no_tokens_is_dropped_and_counted(tmp_path, caplog):
    # A tokenizer without an unknown token drops the characters it has no token for: "αβγ" becomes no tokens.
    tokenizer = Tokenizer(models.BPE({token: i for token, i in VOCAB.items() if token != "<unk>"}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    module = encoder(chat_template=False)
    module.tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    dataset = prompt_set(tmp_path, ["ab", "αβγ", "abc"])
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.module"):
        limited = limit_prompt_length(dataset, module.encode_prompts, 5, "drop", "data.train")
    assert [limited[i]["prompt"] for i in range(len(limited))] == ["ab", "abc"]
    assert "data.train: 1 of 3 prompts tokenize to no tokens at all and were dropped" in caplog.text
    with pytest.raises(ValueError, match="data.test: every prompt tokenizes to no tokens at all"):
        limit_prompt_length(prompt_set(tmp_path, ["αβ", "γ"]), module.encode_prompts, 5, "drop", "data.test")


def test_the_limit_is_what_the_model_context_leaves_beside_each_stage_s_completions(tiny_arith_model):
    # The embedded tokenizer's model has 32 positions.
    module = RLVRModule(tiny_arith_model, sampling={"max_new_tokens": 4}, scoring={"timeout_s": None},
                        evaluation={"max_new_tokens": 8})
    module.configure_model()
    assert module.prompt_token_limit("fit") == (28, "model.model's max_position_embeddings=32, less "
                                                    "model.sampling.max_new_tokens=4")
    assert module.prompt_token_limit("validate") == (24, "model.model's max_position_embeddings=32, less "
                                                         "model.evaluation.max_new_tokens=8")
    too_long = RLVRModule(tiny_arith_model, sampling={"max_new_tokens": 4}, scoring={"timeout_s": None},
                          evaluation={"max_new_tokens": 32})
    too_long.policy = module.policy
    assert too_long.prompt_token_limit("fit")[0] == 28
    with pytest.raises(ValueError, match=r"model.evaluation.max_new_tokens=32 leaves no room for a prompt in the "
                                         r"model's context of 32 tokens \(model.model's max_position_embeddings\): set "
                                         r"model.evaluation.max_new_tokens below 32, or use a model with a longer one"):
        too_long.prompt_token_limit("test")
    # An engine that sets a context of its own: that one holds the prompt and the completion.
    module = RLVRModule(tiny_arith_model, sampling={"max_new_tokens": 4}, scoring={"timeout_s": None},
                        rollouts={"engine": VLLMEngine(max_model_len=20)})
    assert module.prompt_token_limit("fit") == (16, "model.rollouts.engine's max_model_len=20, less "
                                                    "model.sampling.max_new_tokens=4")
    assert module.prompt_token_limit("validate")[0] == 16  # eval_max_new_tokens unset: max_new_tokens
    module = RLVRModule(tiny_arith_model, sampling={"max_new_tokens": 4}, scoring={"timeout_s": None},
                        rollouts={"engine": VLLMEngine(max_model_len=4)})
    with pytest.raises(ValueError, match=r"model.sampling.max_new_tokens=4 leaves no room .* context of 4 tokens "
                                         r"\(model.rollouts.engine's max_model_len\): set "
                                         r"model.sampling.max_new_tokens below 4, or raise it"):
        module.prompt_token_limit("fit")


def test_a_model_without_a_fixed_context_sets_no_limit(tmp_path):
    module = encoder(chat_template=False)
    module.policy = MambaForCausalLM(MambaConfig(vocab_size=len(VOCAB), hidden_size=8, num_hidden_layers=1,
                                                 state_size=2))  # a state-space model: no max_position_embeddings
    assert module.prompt_token_limit("fit") is None
    limited = limit_prompt_length(prompt_set(tmp_path, ["a" * 100, "b"]), module.encode_prompts, None, "drop",
                                  "data.train")
    assert [len(limited[i]["prompt_ids"]) for i in range(2)] == [100, 1]


LONG_PROMPT = "1+" * 3000 + "1="  # 6,002 tokens (one per character) for a model of 32 positions
SHORT_PROMPTS = ["12+34=", "56+7=", "8+9=", "10+11="]


def fit_one_step_without_a_length_limit(run_cli, tmp_path, *overrides):
    """One training step through the CLI, on four short prompts and LONG_PROMPT, data.max_prompt_length unset."""
    rows = [{"prompt": p, "answer": "1"} for p in [*SHORT_PROMPTS[:2], LONG_PROMPT, *SHORT_PROMPTS[2:]]]
    path = write_rows(tmp_path / "p.jsonl", rows)
    config = tmp_path / "data.yaml"
    config.write_text(f"""data:
  class_path: lightning_logra.data.module.PromptDataModule
  init_args: {{train: {path}, batch_size: 4}}
""")
    return run_cli("tiny_arith", "--config", str(config), *overrides, steps=1, root=tmp_path)


CONTEXT = ("28 tokens (the model's context: model.model's max_position_embeddings=32, less "
           "model.sampling.max_new_tokens=4; data.max_prompt_length is unset)")


def test_without_max_prompt_length_a_prompt_past_the_model_context_is_dropped(run_cli, tmp_path, caplog):
    # Before, the 6,002-token prompt went to generation whole and grew the run past 19 GB.
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.module"):
        cli = fit_one_step_without_a_length_limit(run_cli, tmp_path)
    assert cli.trainer.global_step == 1
    assert f"data.train: 1 of 5 prompts are longer than {CONTEXT} and were dropped, 4 left" in caplog.text
    trained = cli.datamodule.train_dataloader().dataset  # the set the run was given (made once, kept)
    assert sorted(trained[i]["prompt"] for i in range(len(trained))) == sorted(SHORT_PROMPTS)


def test_without_max_prompt_length_truncate_keeps_the_end_that_fits_the_context(run_cli, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_logra.data.module"):
        cli = fit_one_step_without_a_length_limit(run_cli, tmp_path, "--data.init_args.overlong_prompts", "truncate",
                                                  "--data.init_args.batch_size", "5")  # every prompt in the step
    assert cli.trainer.global_step == 1
    assert f"data.train: 1 of 5 prompts are longer than {CONTEXT} and keep only their last 28" in caplog.text
    trained = cli.datamodule.train_dataloader().dataset
    cut = next(trained[i]["prompt_ids"] for i in range(len(trained)) if trained[i]["prompt"] == LONG_PROMPT)
    assert cut == build_tokenizer()(LONG_PROMPT)["input_ids"][-28:]
    # Every sample (8 per prompt) fit the 32 positions: the rollouts were given the cut prompt.
    assert cli.model.num_tokens <= 5 * 8 * 32


def test_new_tokens_that_fill_the_model_context_fail_naming_the_key(run_cli, tmp_path):
    with pytest.raises(ValueError, match=r"model.sampling.max_new_tokens=32 leaves no room for a prompt in the model's "
                                         r"context of 32 tokens \(model.model's max_position_embeddings\)"):
        fit_one_step_without_a_length_limit(run_cli, tmp_path, "--model.sampling.max_new_tokens", "32")


def test_the_embedded_tasks_check_their_longest_prompt_and_fall_back_to_every_prompt(run_cli):
    # Their prompts fit the shipped model's context: the sets are passed on untokenized (add3's 807,946 prompts
    # are not tokenized one by one at every start); when the longest does not fit, every prompt is checked.
    cli = run_cli("tiny_arith", "--trainer.val_check_interval", "1000", steps=1)
    assert not isinstance(cli.datamodule.train_dataloader().dataset, TokenizedPrompts)
    # "12+34=" and the like are 6 tokens; 32 positions less 27 new tokens leave 5
    with pytest.raises(ValueError, match=r"data.train: every prompt is longer than 5 tokens \(the model's context"):
        run_cli("tiny_arith", "--trainer.val_check_interval", "1000", "--model.sampling.max_new_tokens", "27", steps=1)


def test_the_embedded_tasks_shortcut_leaves_a_max_prompt_length_to_be_checked_and_applied(tiny_arith_model):
    # The embedded modules do not take the key (the command line refuses it), but a subclass may set it: the shortcut
    # that passes their sets on untokenized when the longest prompt fits the context returned the set with a limit of
    # 6100 on the 32-position model, never reaching the check.
    module = RLVRModule(tiny_arith_model, sampling={"max_new_tokens": 4}, scoring={"timeout_s": None})
    module.configure_model()
    for limit in (6100, 6):
        data = ArithDataModule(batch_size=2)
        data.max_prompt_length = limit
        data.trainer = SimpleNamespace(lightning_module=module, global_step=0, global_rank=0, world_size=1)
        data.setup("fit")
        if limit == 6100:
            with pytest.raises(ValueError, match=r"data.max_prompt_length=6100 is longer than the 28 tokens the "
                                                 r"model's context leaves for a prompt"):
                data.train_dataloader()
        else:  # every "ab+cd=" is 6 tokens: all kept, tokenized against the key's limit
            held = data.train_dataloader().dataset
            assert isinstance(held, TokenizedPrompts) and len(held) == len(data.train_set)


def test_a_max_prompt_length_past_the_model_context_is_refused_naming_both(run_cli, tmp_path):
    # data.max_prompt_length: 6100 let the 6,002-token prompt reach generation on the 32-position model, which then
    # tried to allocate 4.6 GB.
    with pytest.raises(ValueError, match=r"data.max_prompt_length=6100 is longer than the 28 tokens the model's "
                                         r"context leaves for a prompt \(model.model's max_position_embeddings=32, "
                                         r"less model.sampling.max_new_tokens=4\): set data.max_prompt_length to 28 "
                                         r"or less, or leave it unset"):
        fit_one_step_without_a_length_limit(run_cli, tmp_path, "--data.init_args.max_prompt_length", "6100")


def test_a_max_prompt_length_is_checked_against_every_stage_when_fitting_starts(tmp_path, tiny_arith_model):
    # The evaluation's longer completions leave less room: refused before the first step, not at the first validation.
    path = str(write_rows(tmp_path / "p.jsonl", [{"prompt": p, "answer": "1"} for p in SHORT_PROMPTS]))
    module = RLVRModule(tiny_arith_model, sampling={"max_new_tokens": 4}, evaluation={"max_new_tokens": 12},
                        scoring={"timeout_s": None})
    module.configure_model()
    data = PromptDataModule(train=path, val=path, max_prompt_length=24, batch_size=2)
    data.trainer = SimpleNamespace(lightning_module=module, global_step=0, global_rank=0, world_size=1)
    data.setup("fit")
    with pytest.raises(ValueError, match=r"data.max_prompt_length=24 is longer than the 20 tokens .*"
                                         r"less model.evaluation.max_new_tokens=12\)"):
        data.train_dataloader()
    data = PromptDataModule(train=path, val=path, max_prompt_length=20, batch_size=2)
    data.trainer = SimpleNamespace(lightning_module=module, global_step=0, global_rank=0, world_size=1)
    data.setup("fit")
    assert len(data.train_dataloader().dataset) == len(SHORT_PROMPTS)
