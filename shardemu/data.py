"""Training text without a download: a synthetic corpus with learnable structure, and
the Python standard library's own source as bytes (`--data stdlib`).

Text is a mixture of `topics` sparse Markov chains over the word ids: under topic t a
word w is followed by one of `branching` successors `succ[t, w, :]`, uniformly. The
successors are drawn from a Zipf distribution over words (p(rank r) ~ 1/r^zipf, as word
frequencies in natural text roughly are), so a model first learns word frequencies (the
loss falls within tens of steps from ln(V)) and then the chains themselves, which bring
the per-token loss towards ln(branching) (1.39 nats for 4).

BERT pairs follow Devlin et al. 2019, Section 3.1 and Appendix A.1: [CLS] A [SEP] B [SEP];
half the time B continues A's chain (IsNext, label 0), otherwise B comes from another
topic (NotNext, label 1); 15% of word positions are chosen for prediction, of which 80%
become [MASK], 10% a random word and 10% stay unchanged. Lengths vary so that padding
(and the attention mask) is exercised.

A batch depends only on (corpus seed, split, step, batch, seq): the same global batch
reaches every mesh, which is what makes sharded and single-device runs comparable. Each
corpus has a `validation` split that training never sees: for the synthetic corpus,
other draws from the same chains; for the standard library, one file in ten.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from shardemu.config import MASKED_LM_PROB
from shardemu.errors import ConfigError

PAD, CLS, SEP, MASK = 0, 1, 2, 3
FIRST_WORD = 4  # ids below this are special tokens


class SyntheticCorpus:
    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        topics: int = 8,
        branching: int = 4,
        zipf: float = 1.1,
        split: str = "train",
    ):
        if vocab_size < FIRST_WORD + branching:
            raise ConfigError(
                f"ModelConfig.vocab_size {vocab_size} is too small for the synthetic corpus "
                f"({FIRST_WORD} special tokens and {branching} words at least); use a "
                f"vocabulary of {FIRST_WORD + branching} or more"
            )
        self.vocab_size = vocab_size
        self.seed = seed
        self.split = _split_id(split)
        self.topics = topics
        self.branching = branching
        table_rng = np.random.default_rng([seed, 0xC0])
        words = table_rng.permutation(np.arange(FIRST_WORD, vocab_size))
        freq = 1.0 / np.arange(1, len(words) + 1) ** zipf
        self.succ = table_rng.choice(
            words, size=(topics, vocab_size, branching), p=freq / freq.sum()
        )

    def _rng(self, step: int) -> np.random.Generator:
        # the training split keeps the streams it always had
        key = [self.seed, step] if self.split == 0 else [self.seed, step, self.split]
        return np.random.default_rng(key)

    def _chains(
        self, rng: np.random.Generator, topic: np.ndarray, first: np.ndarray, length: int
    ) -> np.ndarray:
        """[n, length] word ids: row i is a chain under topic[i] starting after first[i]."""
        out = np.empty((len(topic), length), dtype=np.int32)
        prev = first
        for j in range(length):
            pick = rng.integers(0, self.branching, size=len(topic))
            prev = self.succ[topic, prev, pick]
            out[:, j] = prev
        return out

    def _random_words(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(FIRST_WORD, self.vocab_size, size=n)

    def gpt_batch(self, step: int, batch: int, seq: int) -> dict[str, np.ndarray]:
        """Next-token prediction: `targets` is `tokens` shifted left by one."""
        rng = self._rng(step)
        topic = rng.integers(0, self.topics, size=batch)
        text = self._chains(rng, topic, self._random_words(rng, batch), seq + 1)
        return {"tokens": text[:, :-1], "targets": text[:, 1:]}

    def bert_batch(
        self, step: int, batch: int, seq: int, predictions: int
    ) -> dict[str, np.ndarray]:
        """Sentence pairs with a next-sentence label and, for the masked-LM head, up to
        `predictions` masked positions a sequence with their original tokens, as
        BERT's pre-training data holds them (`masked_lm_positions`, `_ids`, `_weights`
        in Google's create_pretraining_data.py)."""
        rng = self._rng(step)
        tokens = np.full((batch, seq), PAD, dtype=np.int32)
        segments = np.zeros((batch, seq), dtype=np.int32)
        next_sentence = (rng.random(batch) < 0.5).astype(np.int32)  # 1 = NotNext
        for i in range(batch):
            n_real = int(rng.integers((3 * seq) // 4, seq + 1))
            words = n_real - 3
            len_a = int(rng.integers(1, words))
            a, b = self._pair(rng, words, len_a, bool(next_sentence[i]))
            row = np.concatenate([[CLS], a, [SEP], b, [SEP]])
            tokens[i, :n_real] = row
            segments[i, len_a + 2 : n_real] = 1
        attention_mask = (tokens != PAD).astype(np.int32)
        masked, positions, targets, weights = self._mask(rng, tokens, predictions)
        return {
            "tokens": masked,
            "segments": segments,
            "attention_mask": attention_mask,
            "mlm_positions": positions,
            "mlm_targets": targets,
            "mlm_weights": weights,
            "next_sentence": next_sentence,
        }

    def _pair(
        self, rng: np.random.Generator, words: int, len_a: int, unrelated: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sentences A and B of `words` words in all: B continues A's chain, or (when
        `unrelated`) comes from another topic."""
        topic_a = int(rng.integers(0, self.topics))
        a_then_b = self._chains(rng, np.array([topic_a]), self._random_words(rng, 1), words)[0]
        b = a_then_b[len_a:]
        if unrelated:
            other = (topic_a + int(rng.integers(1, self.topics))) % self.topics
            b = self._chains(rng, np.array([other]), self._random_words(rng, 1), len(b))[0]
        return a_then_b[:len_a], b

    def _mask(
        self,
        rng: np.random.Generator,
        tokens: np.ndarray,
        predictions: int,
        rate: float = MASKED_LM_PROB,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """BERT's 80/10/10 masking of `rate` of each row's word positions, at most
        `predictions` of them: the masked tokens, and [b, predictions] the chosen
        positions (ascending), their original tokens and weight 1, then weight-0
        padding."""
        if predictions < 1:
            raise ConfigError(f"a BERT batch needs at least 1 masked position, got {predictions}")
        masked = tokens.copy()
        positions, targets, weights = (
            np.zeros((tokens.shape[0], predictions), dtype=np.int32) for _ in range(3)
        )
        for i in range(tokens.shape[0]):
            candidates = np.flatnonzero(tokens[i] >= FIRST_WORD)
            n = min(predictions, max(1, round(rate * len(candidates))))
            chosen = rng.choice(candidates, size=n, replace=False)
            u = rng.random(n)
            masked[i, chosen[u < 0.8]] = MASK
            swap = chosen[(u >= 0.8) & (u < 0.9)]
            masked[i, swap] = self._random_words(rng, len(swap))
            positions[i, :n] = np.sort(chosen)
            targets[i, :n] = tokens[i, positions[i, :n]]
            weights[i, :n] = 1
        return masked, positions, targets, weights


SPLITS = ("train", "validation")


def _split_id(split: str) -> int:
    if split not in SPLITS:
        raise ConfigError(f"a corpus split is one of {', '.join(SPLITS)}, got {split!r}")
    return SPLITS.index(split)


BYTES = 256  # byte-level tokens: a byte b is token FIRST_WORD + b


@functools.cache
def stdlib_text(split: str) -> np.ndarray:
    """The bytes of the standard library's `.py` files (site-packages and tests left
    out), in path order; a file belongs to `validation` when the first byte of the MD5
    of its relative path is below 26 (about one in ten), else to `train`. Every
    installation of one Python version gives the same text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in f"/{rel}":
            continue
        held_out = hashlib.md5(rel.encode()).digest()[0] < 26
        if held_out == (split == "validation"):
            chunks.append(path.read_bytes())
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


class StdlibCorpus(SyntheticCorpus):
    """Byte-level text of the Python standard library's source (`stdlib_text`): real
    text with real structure, so sparse and dense models can differ in quality. GPT
    reads spans of it; BERT's sentence B is the span after A (IsNext) or a span from
    elsewhere (NotNext). Masking and special tokens are the synthetic corpus's."""

    def __init__(self, vocab_size: int, seed: int = 0, split: str = "train") -> None:
        if vocab_size < FIRST_WORD + BYTES:
            raise ConfigError(
                f"TrainConfig.data stdlib has {FIRST_WORD + BYTES} tokens (256 bytes and 4 "
                f"special); the model's vocabulary of {vocab_size} is too small (use a "
                f"vocabulary of 260 or more)"
            )
        self.vocab_size, self.seed, self.split = vocab_size, seed, _split_id(split)
        self.text = stdlib_text(split).astype(np.int32) + FIRST_WORD

    def _span(self, rng: np.random.Generator, length: int) -> np.ndarray:
        start = int(rng.integers(0, len(self.text) - length))
        return self.text[start : start + length]

    def gpt_batch(self, step: int, batch: int, seq: int) -> dict[str, np.ndarray]:
        rng = self._rng(step)
        text = np.stack([self._span(rng, seq + 1) for _ in range(batch)])
        return {"tokens": text[:, :-1], "targets": text[:, 1:]}

    def _pair(
        self, rng: np.random.Generator, words: int, len_a: int, unrelated: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        a_then_b = self._span(rng, words)
        b = self._span(rng, words - len_a) if unrelated else a_then_b[len_a:]
        return a_then_b[:len_a], b

    def _random_words(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(FIRST_WORD, FIRST_WORD + BYTES, size=n)


CORPORA = {"synthetic": SyntheticCorpus, "stdlib": StdlibCorpus}


def make_corpus(name: str, vocab_size: int, seed: int, split: str = "train") -> SyntheticCorpus:
    """The corpus called `name` (`--data`)."""
    if name not in CORPORA:
        raise ConfigError(f"TrainConfig.data {name!r} is not one of {', '.join(CORPORA)}")
    return CORPORA[name](vocab_size, seed=seed, split=split)
