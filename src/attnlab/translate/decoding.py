"""Greedy and batched beam-search decoding, for any model with the ``encode / start / step /
reorder`` interface of :mod:`attnlab.translate.models`.

Both stop a sentence at EOS or at its length limit, and can return the cross-attention maps
they used: one row per generated token (the EOS step included when EOS was generated).
RNN maps are ``(T, S)``; Transformer maps ``(layers, heads, T, S)``.

Beam search keeps ``K`` hypotheses per sentence in one ``(B*K)``-row batch. Each step scores
all ``K * V`` extensions, keeps the ``2K`` best, finishes those ending in EOS (among the ``K``
best) and continues with the ``K`` best others; the decoder state (GRU state, KV cache) is
re-indexed to follow the surviving hypotheses. A sentence is done when it has ``K`` finished
hypotheses; the winner has the best length-normalised score ``log p / lp(len)`` with the GNMT
penalty ``lp = ((5 + len) / 6) ** alpha`` (Wu et al. 2016). With ``K = 1`` this is greedy search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.translate.models import select_rows
from attnlab.translate.tokenizer import BOS, EOS, PAD


@dataclass
class Hypothesis:
    """A decoded sentence: token ids (no BOS/EOS), its score, its attention rows (or None)."""

    tokens: list[int]
    score: float
    attention: torch.Tensor | None  # (T, S) or (layers, heads, T, S); T counts the EOS step
    eos: bool = True  # ended with EOS (False: stopped by the length limit)


def length_limits(src_lengths: torch.Tensor, a: float = 1.5, b: int = 10, cap: int = 512):
    """Max target tokens per sentence: ``a * source length + b``, at most ``cap``."""
    return (src_lengths.float() * a + b).long().clamp(max=cap)


def _time_dim(a: torch.Tensor) -> int:
    return a.dim() - 2  # attention rows: (..., T, S)


@torch.no_grad()
def greedy(
    model, src, src_lengths, *, limits=None, return_attention=False, compile=False
) -> list[Hypothesis]:
    """Pick the most likely token at every step. src (B, S) -> B hypotheses."""
    B = src.shape[0]
    limits = length_limits(src_lengths) if limits is None else limits
    max_length = int(limits.max())
    reuse = {"reuse_cache": True} if compile else {}  # one decoding at a time: see start()
    state = model.start(
        model.encode(src, src_lengths), max_length=max_length, compile=compile, **reuse
    )
    tokens = torch.full((B,), BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    ended_by_eos = torch.zeros(B, dtype=torch.bool, device=src.device)
    steps, attns, scores = [], [], torch.zeros(B, device=src.device)
    for t in range(max_length):
        logits, state, attn = model.step(tokens, state, return_attention=return_attention)
        logp = torch.log_softmax(logits.float(), dim=-1)
        nxt = logp.argmax(-1)
        scores += torch.where(done, 0.0, logp.gather(1, nxt[:, None])[:, 0])
        nxt = torch.where(done, PAD, nxt)
        steps.append(nxt)
        if return_attention:
            attns.append(attn)
        ended_by_eos |= ~done & (nxt == EOS)
        done |= (nxt == EOS) | (t + 1 >= limits)
        if bool(done.all()):
            break
        tokens = nxt
    out = torch.stack(steps, 1).tolist()  # (B, T)
    hyps = []
    for b in range(B):
        seq = out[b]
        n = seq.index(EOS) if ended_by_eos[b] else int(min(limits[b], len(seq)))
        rows = n + 1 if ended_by_eos[b] else n
        attention = None
        if return_attention and attns[0] is not None:
            a = torch.stack([x[b] for x in attns[:rows]], dim=-2)  # (..., T, S)
            attention = a.cpu()
        hyps.append(Hypothesis(seq[:n], float(scores[b]), attention, bool(ended_by_eos[b])))
    return hyps


@torch.no_grad()
def beam_search(
    model,
    src,
    src_lengths,
    *,
    beam_size: int = 4,
    limits=None,
    length_penalty: float = 0.6,
    return_attention: bool = False,
    compile=False,
) -> list[Hypothesis]:
    """Batched beam search. src (B, S) -> the best hypothesis of each sentence.

    ``compile``: the Transformer's decoder step compiled once and replayed (see
    :meth:`TransformerSeq2Seq.start`); the same hypotheses as without.
    """
    if beam_size < 1:
        raise ValueError(f"beam size must be >= 1, got {beam_size}")
    B, K, device = src.shape[0], beam_size, src.device
    limits = (length_limits(src_lengths) if limits is None else limits).tolist()
    memory = model.encode(src, src_lengths)
    rows = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,): hypothesis -> sentence
    reuse = {"reuse_cache": True} if compile else {}  # one decoding at a time: see start()
    state = model.start(select_rows(memory, rows), max_length=max(limits), compile=compile, **reuse)
    scores = torch.zeros(B, K, device=device)
    scores[:, 1:] = float("-inf")  # all K start identical: let only the first one expand
    tokens = torch.full((B * K,), BOS, dtype=torch.long, device=device)
    history = torch.zeros(B * K, 0, dtype=torch.long, device=device)
    attn_history = None
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = [False] * B

    def penalty(n: int) -> float:
        return ((5.0 + n) / 6.0) ** length_penalty

    for t in range(max(limits)):
        logits, state, attn = model.step(tokens, state, return_attention=return_attention)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B*K, V)
        V = logp.shape[-1]
        cand = (scores.view(-1, 1) + logp).view(B, K * V)
        top_scores, top_ids = cand.topk(min(2 * K, K * V), dim=1)  # (B, 2K)
        top_beam, top_tok = (top_ids // V).tolist(), (top_ids % V).tolist()
        top_scores = top_scores.tolist()
        if attn is not None:
            step_attn = attn.unsqueeze(_time_dim(attn) + 1)  # (B*K, ..., 1, S)
            full_attn = (
                step_attn
                if attn_history is None
                else torch.cat([attn_history, step_attn], dim=_time_dim(attn) + 1)
            )
        hist_list = None
        next_rows = torch.zeros(B, K, dtype=torch.long)
        next_tok = torch.full((B, K), PAD, dtype=torch.long)
        next_scores = torch.full((B, K), float("-inf"))
        for b in range(B):
            if done[b]:
                next_rows[b] = b * K
                continue
            alive = 0
            at_limit = t + 1 >= limits[b]
            for rank, (s, beam, tok) in enumerate(
                zip(top_scores[b], top_beam[b], top_tok[b], strict=True)
            ):
                if s == float("-inf"):
                    break
                row = b * K + beam
                if tok == EOS or at_limit:
                    if rank < K:
                        if hist_list is None:
                            hist_list = history.tolist()
                        seq = hist_list[row] + ([] if tok == EOS else [tok])
                        a = None
                        if attn is not None:
                            a = full_attn[row].cpu()
                        finished[b].append(
                            # (len counts the scored tokens: EOS too, where it ended one)
                            Hypothesis(seq, s / penalty(len(seq) + (tok == EOS)), a, tok == EOS)
                        )
                elif alive < K:
                    next_rows[b, alive], next_tok[b, alive], next_scores[b, alive] = row, tok, s
                    alive += 1
                if alive == K:
                    break
            if len(finished[b]) >= K or at_limit or alive == 0:
                done[b] = True
        if all(done):
            break
        index = next_rows.view(-1).to(device)
        state = model.reorder(state, index)
        tokens = next_tok.view(-1).to(device)
        history = torch.cat([history.index_select(0, index), tokens[:, None]], dim=1)
        if attn is not None:
            attn_history = full_attn.index_select(0, index)
        scores = next_scores.to(device)

    best = []
    for b in range(B):
        if not finished[b]:  # cannot happen with limits >= 1, kept for safety
            finished[b].append(Hypothesis([], float("-inf"), None, False))
        best.append(max(finished[b], key=lambda h: h.score))
    return best


def decode(
    model,
    src,
    src_lengths,
    *,
    beam_size=1,
    limits=None,
    return_attention=False,
    compile=False,
    **kw,
):
    """Greedy for ``beam_size == 1``, beam search otherwise (``compile``: see beam_search)."""
    if beam_size == 1:
        return greedy(
            model,
            src,
            src_lengths,
            limits=limits,
            return_attention=return_attention,
            compile=compile,
        )
    return beam_search(
        model,
        src,
        src_lengths,
        beam_size=beam_size,
        limits=limits,
        return_attention=return_attention,
        compile=compile,
        **kw,
    )
