"""The synthetic corpus: deterministic, BERT's masking proportions, sentence pairs."""

import numpy as np
import pytest

from shardemu.config import ConfigError
from shardemu.data import CLS, FIRST_WORD, MASK, PAD, SEP, SyntheticCorpus
from shardemu.models import get_preset

corpus = SyntheticCorpus(vocab_size=512, seed=3)


def test_batches_depend_only_on_seed_and_step():
    a, b = corpus.gpt_batch(5, 4, 32), SyntheticCorpus(512, seed=3).gpt_batch(5, 4, 32)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], corpus.gpt_batch(6, 4, 32)["tokens"])
    assert not np.array_equal(
        a["tokens"], SyntheticCorpus(512, seed=4).gpt_batch(5, 4, 32)["tokens"]
    )


def test_gpt_targets_are_next_tokens_from_the_chains():
    batch = corpus.gpt_batch(0, 8, 32)
    np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
    prev, nxt = batch["tokens"].ravel(), batch["targets"].ravel()
    # every transition is one of the successors of `prev` under some topic
    ok = (corpus.succ[:, prev, :] == nxt[None, :, None]).any(axis=(0, 2))
    assert ok.all()


def unmasked(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """The tokens before masking, and which positions were chosen, [b, s] each."""
    original, chosen = batch["tokens"].copy(), np.zeros(batch["tokens"].shape, bool)
    for i, (pos, target, w) in enumerate(
        zip(batch["mlm_positions"], batch["mlm_targets"], batch["mlm_weights"], strict=True)
    ):
        original[i, pos[w == 1]] = target[w == 1]
        chosen[i, pos[w == 1]] = True
    return original, chosen


def test_bert_masking_is_15_percent_80_10_10():
    batch = corpus.bert_batch(0, 256, 128, 20)
    masked = batch["tokens"]
    original, w = unmasked(batch)
    words = original >= FIRST_WORD
    assert not (w & ~words).any()  # only words are chosen, never specials or padding
    assert abs(w.sum() / words.sum() - 0.15) < 0.005
    chosen_masked = (masked[w] == MASK).mean()
    chosen_same = (masked[w] == original[w]).mean()
    assert abs(chosen_masked - 0.8) < 0.02
    assert abs(chosen_same - 0.1) < 0.02  # kept (plus the rare random draw of itself)
    assert not (masked[~w] == MASK).any()


def test_bert_masked_positions_are_ascending_and_capped():
    """[b, P] positions, each row's chosen ones first and ascending, then weight-0
    padding; at most P a sequence (BERT's max_predictions_per_seq)."""
    full = corpus.bert_batch(2, 32, 128, 20)
    capped = corpus.bert_batch(2, 32, 128, 5)
    assert full["mlm_positions"].shape == (32, 20) and capped["mlm_positions"].shape == (32, 5)
    assert (capped["mlm_weights"].sum(axis=1) == 5).all()  # 15% of >= 93 words is > 5
    for pos, w in zip(full["mlm_positions"], full["mlm_weights"], strict=True):
        n = int(w.sum())
        assert (w[:n] == 1).all() and (w[n:] == 0).all() and (pos[n:] == 0).all()
        assert (np.diff(pos[:n]) > 0).all()
    with pytest.raises(ConfigError, match="at least 1 masked position"):
        corpus.bert_batch(0, 2, 16, 0)


def test_bert_pairs_have_structure_and_padding():
    batch = corpus.bert_batch(1, 64, 64, 10)
    tokens, seg, att = unmasked(batch)[0], batch["segments"], batch["attention_mask"]
    assert (tokens[:, 0] == CLS).all()
    assert ((tokens == SEP).sum(axis=1) == 2).all()
    np.testing.assert_array_equal(att, tokens != PAD)
    assert (att == 0).any()  # lengths vary: the padding mask is exercised
    assert ((seg == 1) <= (att == 1)).all()
    assert 0.3 < batch["next_sentence"].mean() < 0.7


def test_validation_split_is_other_draws_of_the_same_corpus():
    val = SyntheticCorpus(512, seed=3, split="validation")
    assert not np.array_equal(
        val.gpt_batch(0, 4, 32)["tokens"], corpus.gpt_batch(0, 4, 32)["tokens"]
    )
    np.testing.assert_array_equal(val.succ, corpus.succ)  # the same chains


def test_stdlib_corpus_is_the_standard_library_as_bytes_with_files_held_out():
    import sysconfig
    from pathlib import Path

    from shardemu.data import StdlibCorpus, stdlib_text

    train, val = stdlib_text("train"), stdlib_text("validation")
    assert len(val) > 100_000 and 0.03 < len(val) / (len(train) + len(val)) < 0.2
    # a file of the library is in exactly one split
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes()
    in_train, in_val = source in train.tobytes(), source in val.tobytes()
    assert in_train != in_val
    stdlib = StdlibCorpus(512, seed=0)
    batch = stdlib.gpt_batch(7, 4, 64)
    np.testing.assert_array_equal(
        batch["tokens"], StdlibCorpus(512, seed=0).gpt_batch(7, 4, 64)["tokens"]
    )
    np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
    assert batch["tokens"].min() >= FIRST_WORD and batch["tokens"].max() < FIRST_WORD + 256
    text = bytes((batch["tokens"][0] - FIRST_WORD).astype(np.uint8))
    assert text in train.tobytes()  # a span of the training text
    pairs = stdlib.bert_batch(0, 8, 64, 10)
    assert (pairs["tokens"][:, 0] == CLS).all() and pairs["mlm_weights"].sum() > 0


def test_bert_predicts_15_percent_of_a_sequence_unless_told():
    """P = ceil(0.15 s): 20 at s = 128 as Google's and NVIDIA's BERT gather; a model may
    set its own (Graphcore's 76 at 512), at most s."""
    bert = get_preset("bert-base")
    assert [bert.predictions(s) for s in (128, 512, 4)] == [20, 77, 1]
    assert bert.replace(max_predictions=76).predictions(512) == 76
    assert bert.replace(max_predictions=76).predictions(64) == 64
    with pytest.raises(ConfigError, match="max_predictions"):
        bert.replace(max_predictions=-1)
