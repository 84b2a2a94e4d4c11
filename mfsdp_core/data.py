"""A deterministic, seekable synthetic token stream for training runs and tests.

Sample ``i`` is a pure function of ``(seed, i)``: a walk through a fixed sparse transition table
(each token has a few likely successors, drawn with Zipf-like weights), so there is structure to
learn, and any sample can be produced without producing the ones before it. A trainer saves the
index of the next sample and resumes the same sequence of samples at any world size: the global
batch of a step is the same whatever the number of ranks; each rank takes its slice.
"""

from __future__ import annotations

import torch

__all__ = ["SyntheticText"]


class SyntheticText:
    """``vocab``-token "language": ``successors`` per token, chosen with weights 1/1, 1/2, 1/3…"""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, successors: int = 4) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        table_gen = torch.Generator().manual_seed(seed)
        self.table = torch.randint(vocab, (vocab, successors), generator=table_gen)
        self.weights = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)

    def sample(self, index: int) -> torch.Tensor:
        """Tokens ``[seq_len + 1]`` of sample ``index`` (inputs are ``[:-1]``, targets ``[1:]``)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        choice = torch.multinomial(self.weights, self.seq_len, replacement=True, generator=gen)
        tokens = torch.empty(self.seq_len + 1, dtype=torch.long)
        tokens[0] = torch.randint(self.vocab, (1,), generator=gen)
        for t in range(self.seq_len):
            tokens[t + 1] = self.table[tokens[t], choice[t]]
        return tokens

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start + count - 1`` stacked: ``[count, seq_len + 1]``."""
        return torch.stack([self.sample(start + i) for i in range(count)])
