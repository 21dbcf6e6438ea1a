"""From sentence pairs to padded batches: encode once, bucket by length, a reproducible order.

* Each pair is encoded once: the source as ``ids + [EOS]``, the target as the decoder input
  ``[BOS] + ids`` and the output to predict ``ids + [EOS]``.
* **Bucketing.** Padding is wasted work, so sentences of similar length go together: the
  epoch's shuffled pairs are cut into pools of ``pool`` batches' worth, each pool is sorted by
  length and cut into batches holding at most ``max_tokens`` tokens (padding included), and the
  batches are shuffled. Long verses make small batches, short ones large batches.
* **Reproducible.** The order of epoch ``e`` depends only on ``(seed, e)``, so a resumed run
  skips the batches it has done and continues with exactly the batches an uninterrupted run
  would see.
* **Distributed.** Every process computes the same batch list; process ``r`` of ``W`` takes the
  sentences ``r, r + W, ...`` of each batch, so every process makes the same number of steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnlab.translate.tokenizer import BOS, EOS, PAD, Tokenizer


@dataclass
class Encoded:
    """Token ids of a list of pairs (sources and targets), without BOS/EOS."""

    src: list[list[int]]
    tgt: list[list[int]]

    def __len__(self) -> int:
        return len(self.src)


def encode_pairs(tokenizer: Tokenizer, pairs, max_len: int | None = None) -> tuple[Encoded, int]:
    """Encode pairs; drop those whose source or target has ``max_len`` tokens or more.

    Returns:
        ``(encoded, dropped)``.
    """
    src = tokenizer.encode_batch([p.source for p in pairs])
    tgt = tokenizer.encode_batch([p.target for p in pairs])
    if max_len is None:
        return Encoded(src, tgt), 0
    keep = [i for i in range(len(src)) if len(src[i]) < max_len and len(tgt[i]) < max_len]
    return Encoded([src[i] for i in keep], [tgt[i] for i in keep]), len(src) - len(keep)


@dataclass
class Batch:
    """A padded batch. ``src`` (B, S), ``src_lengths`` (B,), ``tgt_in`` / ``tgt_out`` (B, T)."""

    src: torch.Tensor
    src_lengths: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    def to(self, device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in vars(self).values()))

    @property
    def num_tokens(self) -> int:
        return int((self.tgt_out != PAD).sum())


def pad(seqs: list[list[int]], value: int = PAD) -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def source_tensor(src: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources (ids without EOS) -> padded ``(B, S)`` ids with EOS appended, and lengths."""
    seqs = [s + [EOS] for s in src]
    return pad(seqs), torch.tensor([len(s) for s in seqs], dtype=torch.long)


def source_mask(src_lengths: torch.Tensor, S: int) -> torch.Tensor:
    """(B,) source lengths -> (B, S) key padding mask, True = real token (no host sync)."""
    return torch.arange(S, device=src_lengths.device)[None, :] < src_lengths[:, None]


def collate(data: Encoded, indices) -> Batch:
    src, lengths = source_tensor([data.src[i] for i in indices])
    tgt_in = pad([[BOS] + data.tgt[i] for i in indices])
    tgt_out = pad([data.tgt[i] + [EOS] for i in indices])
    return Batch(src, lengths, tgt_in, tgt_out)


SAMPLE_SEED = 0  # of fixed_sample: one sample for every run, seed and resume


def fixed_sample(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices of ``range(n)``, drawn at random with a fixed seed (a generator of
    its own: the global random states are untouched), in increasing order.

    The validation loss and the choice of the best attention head read such a sample of the
    validation split rather than its first ``k`` pairs: the Bible's splits are in canonical
    order, and their first few hundred verses are all Genesis..2 Kings.
    """
    if n <= k:
        return list(range(n))
    return sorted(np.random.default_rng(SAMPLE_SEED).choice(n, size=k, replace=False).tolist())


def epoch_batches(
    data: Encoded,
    *,
    seed: int,
    epoch: int,
    max_tokens: int,
    max_sentences: int | None = None,
    pool: int = 64,
    min_sentences: int = 1,
) -> list[list[int]]:
    """The batches of one epoch, as lists of pair indices; depends only on its arguments.

    Args:
        data: encoded pairs.
        seed, epoch: the order; the same pair gives the same batches.
        max_tokens: tokens per batch, padding included, counted on the longer side (+1 for
            BOS/EOS).
        max_sentences: optional cap on sentences per batch.
        pool: batches per sorting pool (more: less padding, less randomness).
        min_sentences: at least this many per batch (the number of distributed processes).
            A pool's last few sentences join the next pool, the very last ones the last batch
            (which may then pass ``max_tokens`` by those few): every pair is in one batch.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(data))
    length = np.array([max(len(s), len(t)) + 1 for s, t in zip(data.src, data.tgt, strict=True)])
    batches: list[list[int]] = []
    per_pool = max(1, pool * max_tokens // max(1, int(length.mean())))
    left: list[int] = []  # a pool's last sentences, fewer than min_sentences: into the next
    for start in range(0, len(order), per_pool):
        chunk = np.concatenate(
            [np.asarray(left, dtype=order.dtype), order[start : start + per_pool]]
        )
        chunk = chunk[np.argsort(length[chunk], kind="stable")]
        batch: list[int] = []
        longest = 0
        for i in chunk:
            new_longest = max(longest, int(length[i]))
            too_many = max_sentences is not None and len(batch) >= max_sentences
            if batch and (new_longest * (len(batch) + 1) > max_tokens or too_many):
                if len(batch) >= min_sentences:
                    batches.append(batch)
                    batch, new_longest = [], int(length[i])
            batch.append(int(i))
            longest = new_longest
        left = []
        if len(batch) >= min_sentences:
            batches.append(batch)
        else:
            left = batch
    if left and batches:  # (the very last: joins the last batch, a little over max_tokens)
        batches[-1].extend(left)
    rng.shuffle(batches)
    return batches


def shard(batch: list[int], rank: int, world: int) -> list[int]:
    """This process's share of a batch (every ``world``-th sentence from ``rank``)."""
    return batch[rank::world]


def length_sorted_chunks(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (for decoding); covers every index once."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
