"""The synthetic corpus: deterministic, BERT's masking proportions, sentence pairs."""

import numpy as np

from shardemu.data import CLS, FIRST_WORD, MASK, PAD, SEP, SyntheticCorpus

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


def test_bert_masking_is_15_percent_80_10_10():
    batch = corpus.bert_batch(0, 256, 128)
    original, masked, w = batch["mlm_targets"], batch["tokens"], batch["mlm_weights"] == 1
    words = original >= FIRST_WORD
    assert not (w & ~words).any()  # only words are chosen, never specials or padding
    assert abs(w.sum() / words.sum() - 0.15) < 0.005
    chosen_masked = (masked[w] == MASK).mean()
    chosen_same = (masked[w] == original[w]).mean()
    assert abs(chosen_masked - 0.8) < 0.02
    assert abs(chosen_same - 0.1) < 0.02  # kept (plus the rare random draw of itself)
    np.testing.assert_array_equal(masked[~w], original[~w])


def test_bert_pairs_have_structure_and_padding():
    batch = corpus.bert_batch(1, 64, 64)
    tokens, seg, att = batch["mlm_targets"], batch["segments"], batch["attention_mask"]
    assert (tokens[:, 0] == CLS).all()
    assert ((tokens == SEP).sum(axis=1) == 2).all()
    np.testing.assert_array_equal(att, tokens != PAD)
    assert (att == 0).any()  # lengths vary: the padding mask is exercised
    assert ((seg == 1) <= (att == 1)).all()
    assert 0.3 < batch["next_sentence"].mean() < 0.7
