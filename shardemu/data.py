"""A deterministic synthetic corpus with learnable structure; nothing is downloaded.

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

A batch depends only on (corpus seed, step, batch, seq): the same global batch reaches
every mesh, which is what makes sharded and single-device runs comparable.
"""

from __future__ import annotations

import numpy as np

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
    ):
        if vocab_size < FIRST_WORD + branching:
            raise ValueError(
                f"vocab_size {vocab_size} is too small for a synthetic corpus; "
                f"need at least {FIRST_WORD + branching}"
            )
        self.vocab_size = vocab_size
        self.seed = seed
        self.topics = topics
        self.branching = branching
        table_rng = np.random.default_rng([seed, 0xC0])
        words = table_rng.permutation(np.arange(FIRST_WORD, vocab_size))
        freq = 1.0 / np.arange(1, len(words) + 1) ** zipf
        self.succ = table_rng.choice(
            words, size=(topics, vocab_size, branching), p=freq / freq.sum()
        )

    def _rng(self, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step])

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

    def bert_batch(self, step: int, batch: int, seq: int) -> dict[str, np.ndarray]:
        """Sentence pairs with masked-LM targets and weights and a next-sentence label."""
        rng = self._rng(step)
        tokens = np.full((batch, seq), PAD, dtype=np.int32)
        segments = np.zeros((batch, seq), dtype=np.int32)
        next_sentence = (rng.random(batch) < 0.5).astype(np.int32)  # 1 = NotNext
        for i in range(batch):
            n_real = int(rng.integers((3 * seq) // 4, seq + 1))
            words = n_real - 3
            len_a = int(rng.integers(1, words))
            topic_a = int(rng.integers(0, self.topics))
            a_then_b = self._chains(rng, np.array([topic_a]), self._random_words(rng, 1), words)[0]
            b = a_then_b[len_a:]
            if next_sentence[i]:
                other = (topic_a + int(rng.integers(1, self.topics))) % self.topics
                b = self._chains(rng, np.array([other]), self._random_words(rng, 1), len(b))[0]
            row = np.concatenate([[CLS], a_then_b[:len_a], [SEP], b, [SEP]])
            tokens[i, :n_real] = row
            segments[i, len_a + 2 : n_real] = 1
        attention_mask = (tokens != PAD).astype(np.int32)
        masked, targets, weights = self._mask(rng, tokens)
        return {
            "tokens": masked,
            "segments": segments,
            "attention_mask": attention_mask,
            "mlm_targets": targets,
            "mlm_weights": weights,
            "next_sentence": next_sentence,
        }

    def _mask(
        self, rng: np.random.Generator, tokens: np.ndarray, rate: float = 0.15
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """BERT's 80/10/10 masking of `rate` of each row's word positions."""
        masked = tokens.copy()
        weights = np.zeros(tokens.shape, dtype=np.int32)
        for i in range(tokens.shape[0]):
            candidates = np.flatnonzero(tokens[i] >= FIRST_WORD)
            n = max(1, round(rate * len(candidates)))
            chosen = rng.choice(candidates, size=n, replace=False)
            weights[i, chosen] = 1
            u = rng.random(n)
            masked[i, chosen[u < 0.8]] = MASK
            swap = chosen[(u >= 0.8) & (u < 0.9)]
            masked[i, swap] = self._random_words(rng, len(swap))
        return masked, tokens.copy(), weights
