"""The model summary counts what a sketched run trains, not the sketch carriers' broadcast shapes."""

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_summary import summarize

from conftest import SKETCH_TARGETS, make_tiny_qwen2
from lightning_logra.callbacks.summary import format_summary, trained_counts
from lightning_logra.sketch import install_sketches


class Holder(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.policy = make_tiny_qwen2()


def test_counts_split_sketched_dense_and_frozen_exactly():
    module = Holder()
    install_sketches(module.policy, SKETCH_TARGETS, rank=16)
    # The tiny Qwen2: hidden 64, MLP 128, 4 heads of 16, 2 KV heads, 2 layers, vocab 97, tied embeddings.
    # Per layer, d×k: q 64×64, k 32×64, v 32×64, o 64×64, gate 128×64, up 128×64, down 64×128 = 36,864 (×2 layers);
    # d×r at rank 16: (64+32+32+64+128+128+64)·16 = 8,192 (×2).
    # Dense: the embedding 97·64 = 6,208, the norms 2·2·64 + 64 = 320 (install_sketches freezes nothing else).
    # Frozen: the q/k/v biases of the sketched layers, (64+32+32)·2 = 256 (train_bias is off).
    counts = trained_counts(module)
    assert (counts.matrices, counts.sketched, counts.ranks, counts.sketch_numbers) == (14, 73_728, (16,), 16_384)
    assert (counts.dense, counts.frozen, counts.total) == (6_528, 256, 80_512)
    assert counts.megabytes == 80_512 * 4 / 1e6  # fp32 weights; the carriers' 4 bytes each are not weights
    # Lightning's own count, for contrast: the carriers as "trainable" d×r tensors, the sketched weights as frozen.
    lightning = summarize(module)
    assert (lightning.trainable_parameters, lightning.total_parameters) == (16_384 + 6_528, 80_512 + 16_384)


def test_the_printed_summary_says_what_is_trained():
    module = Holder()
    install_sketches(module.policy, SKETCH_TARGETS, rank=16)
    lines = format_summary(module).splitlines()
    assert lines[2].split(" | ")[3].strip() == "80.5 K"  # the policy's row: 96.9 K with the carriers counted
    assert lines[4:] == [
        "73.7 K    Trained params, sketched: 14 matrices at rank 16 (their sketches hold 16.4 K numbers)",
        "6.5 K     Trained params, dense",
        "256       Frozen params",
        "80.5 K    Total params",
        "0.322     Total estimated model params size (MB)",
    ]


def test_a_dense_model_is_summarized_as_dense():
    lines = format_summary(Holder()).splitlines()
    assert lines[4:6] == ["0         Trained params, sketched: none (no sketches installed)",
                          "80.5 K    Trained params, dense"]
