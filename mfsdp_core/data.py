"""The trainer's samples: a deterministic, seekable synthetic token stream (runs and tests), and a
memory-mapped tokenized corpus (:class:`TokenFile`).

In both, sample ``i`` is a pure function of ``(seed, i)``, so any sample can be produced without
producing the ones before it. A trainer saves the index of the next sample and resumes the same
sequence of samples at any world size: the global batch of a step is the same whatever the number
of ranks; each rank takes its slice. The synthetic stream is a walk through a fixed sparse
transition table (each token has a few likely successors, drawn with Zipf-like weights), so there
is structure to learn.
"""

from __future__ import annotations

import numpy as np
import torch

from mfsdp_core.token_files import TOKEN_DTYPES, describe_token_file, token_windows

__all__ = ["SyntheticText", "TokenFile", "TOKEN_DTYPES", "describe_token_file"]


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


class TokenFile:
    """A tokenized corpus: one flat binary file of ``uint16`` or ``uint32`` token ids, native byte
    order, no header (what nanoGPT's ``prepare.py`` writes, and the ``.bin`` half of Megatron's
    preprocessed data). Memory-mapped: only the windows a rank trains on are read.

    The file is cut into ``(tokens - 1) // seq_len`` windows of ``seq_len + 1`` tokens (each
    window's last token is the next one's first, so every token is a target once). Sample ``i``
    is window ``perm_e[i % windows]`` of epoch ``e = i // windows``, where ``perm_e`` is a
    permutation seeded by ``(seed, e)``: a pure function of ``i``, like :class:`SyntheticText`, so
    a trainer that saves the next sample index resumes the same samples at any world size.
    """

    def __init__(self, path: str, seq_len: int, vocab: int, *, dtype: str = "uint16", seed: int = 0) -> None:
        self.path, self.seq_len, self.vocab, self.seed = path, seq_len, vocab, seed
        self.tokens, self.windows = token_windows(path, seq_len, dtype)
        np_dtype = TOKEN_DTYPES[dtype]
        self._ids = np.memmap(path, dtype=np_dtype, mode="r")
        self._perm: tuple[int, torch.Tensor] | None = None

    def _window(self, index: int) -> int:
        epoch, within = divmod(index, self.windows)
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            self._perm = (epoch, torch.randperm(self.windows, generator=gen))
        return int(self._perm[1][within])

    def sample(self, index: int) -> torch.Tensor:
        """Tokens ``[seq_len + 1]`` of sample ``index`` as int64; ValueError naming the file and
        the offset of a token id outside the model's vocabulary."""
        start = self._window(index) * self.seq_len
        tokens = torch.from_numpy(self._ids[start : start + self.seq_len + 1].astype(np.int64))
        bad = (tokens >= self.vocab).nonzero()
        if bad.numel():
            at = int(bad[0, 0])
            raise ValueError(
                f"--data {self.path}: token id {int(tokens[at])} at token {start + at} is outside the "
                f"model's vocabulary ({self.vocab}); is --data-dtype right, and the tokenizer the model's?"
            )
        return tokens

    def batch(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start + count - 1`` stacked: ``[count, seq_len + 1]``."""
        return torch.stack([self.sample(start + i) for i in range(count)])
