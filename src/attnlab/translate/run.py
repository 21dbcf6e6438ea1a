"""Use a trained run directory: :func:`load_run` -> :class:`Translator`.

Example:
    >>> tr = load_run("runs/dates-rnn-bahdanau")                      # doctest: +SKIP
    >>> out = tr.translate(["mardi 1 février 2005"], beam_size=4)     # doctest: +SKIP
    >>> out[0].text, out[0].attention.shape                          # doctest: +SKIP
    ('2005-02-01', (11, 21))
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnlab.translate import checkpoint as ckpt
from attnlab.translate.batching import length_sorted_chunks, source_tensor
from attnlab.translate.checkpoint import RunFileError, UsageError  # noqa: F401 - API
from attnlab.translate.decoding import decode, length_limits
from attnlab.translate.models import MODELS, build_model, count_parameters
from attnlab.translate.tokenizer import KINDS, SPECIALS, Tokenizer
from attnlab.translate.trainer import TrainOptions


@dataclass
class Translation:
    """One translated sentence.

    Attributes:
        source: the input text.
        source_tokens: the source subwords as text, then ``"</s>"`` (the attention's columns).
        target_tokens: the generated subwords, then ``"</s>"`` if the model ended the sentence
            (the attention's rows).
        text: the translation, detokenized.
        attention: cross-attention, ``(T, S)`` for an RNN, ``(layers, heads, T, S)`` for a
            Transformer, ``T = len(target_tokens)``, ``S = len(source_tokens)``; None when not
            requested, or for the attention-free RNN.
        score: the decoder's score (log-probability, length-normalised for beam search).
        complete: whether the model ended the sentence; False when decoding stopped at the
            length limit (1.5 x (the source's tokens + 1, its end-of-sentence token) + 10, at
            most 512) and the text is cut.
    """

    source: str
    source_tokens: list[str]
    target_tokens: list[str]
    text: str
    attention: np.ndarray | None
    score: float
    complete: bool = True


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    path = Path(run_dir)
    if not path.exists():
        raise UsageError(
            f"run directory {str(path)!r} does not exist; train one with: "
            f"attnlab train --out {path}"
        )
    if not path.is_dir() or not (path / ckpt.CONFIG).is_file():
        raise UsageError(
            f"{str(path)!r} is not a run directory (no {ckpt.CONFIG}); pass the folder that "
            "`attnlab train` wrote (it prints it at the end)"
        )
    return path


CONFIG_SECTIONS = ("task", "tokenizer", "model", "train")
MAX_PARAMETERS = 2_000_000_000
MODEL_INTS = (
    "emb_dim",
    "hidden",
    "enc_layers",
    "dec_layers",
    "heads",
    "kv_heads",
    "d_model",
    "d_ff",
)


def read_config(run_dir: str | os.PathLike[str]) -> dict:
    """The run's ``config.json``, checked: its sections, their keys and types, and that its model
    section builds a model. Any problem raises :class:`RunFileError` naming the file."""
    path = check_run_dir(run_dir) / ckpt.CONFIG
    config = ckpt.read_json_object(path)
    missing = [k for k in CONFIG_SECTIONS if k not in config]
    if missing:
        raise RunFileError(
            path,
            f"missing section(s) {', '.join(map(repr, missing))}: not a config written by "
            "attnlab train",
        )
    for key in (*CONFIG_SECTIONS, "decode"):
        if key in config and not isinstance(config[key], dict):
            raise RunFileError(path, f"section {key!r} must be a JSON object")
    if not isinstance(config["task"].get("name"), str):
        raise RunFileError(path, "section 'task' needs a 'name' (a string)")
    if config["tokenizer"].get("kind") not in KINDS:
        raise RunFileError(path, f"'tokenizer' 'kind' must be one of {KINDS}")
    _check_model_section(config["model"], path)
    try:
        TrainOptions.from_dict(config["train"])
    except ValueError as e:
        raise RunFileError(path, str(e)) from None
    decode = config.get("decode", {})
    beam = decode.get("beam_size", 1)
    if not (ckpt.is_int(beam) and beam >= 1):
        raise RunFileError(path, f"'decode' 'beam_size' must be an integer >= 1, got {beam!r}")
    if not ckpt.is_number(decode.get("length_penalty", 0.0)):
        raise RunFileError(path, "'decode' 'length_penalty' must be a number")
    budget = config.get("time_budget_minutes")
    if budget is not None and not (ckpt.is_number(budget) and budget > 0):
        raise RunFileError(
            path, f"'time_budget_minutes' must be a number > 0 or null, got {budget!r}"
        )
    return config


def _check_model_section(model: dict, path: Path) -> None:
    """The model settings must have their types and build a model (tried on the meta device:
    no memory is used, so absurd sizes fail here, not in an allocation)."""
    if model.get("kind") not in MODELS:
        raise RunFileError(
            path, f"'model' 'kind' must be one of {MODELS}, got {model.get('kind')!r}"
        )
    for key in MODEL_INTS:
        value = model.get(key)
        if key in model and not (value is None or (ckpt.is_int(value) and 1 <= value <= 65536)):
            raise RunFileError(
                path, f"'model' {key!r} must be an integer in [1, 65536], got {value!r}"
            )
    dropout = model.get("dropout", 0.0)
    if not (ckpt.is_number(dropout) and 0 <= dropout < 1):
        raise RunFileError(path, f"'model' 'dropout' must be a number in [0, 1), got {dropout!r}")
    try:
        with torch.device("meta"):
            probe = build_model(model, len(SPECIALS) + 1)
    except Exception as e:  # noqa: BLE001 - whatever the constructors reject
        reason = " ".join(str(e).split())
        raise RunFileError(path, f"its 'model' section does not build a model ({reason})") from None
    if count_parameters(probe) > MAX_PARAMETERS:
        raise RunFileError(
            path,
            f"its 'model' section describes {count_parameters(probe):,} parameters, over the "
            f"limit of {MAX_PARAMETERS:,}",
        )


def _weights_bytes(config: dict, vocab_size: int) -> int:
    """Bytes of the saved weights of the model ``config`` describes (built on the meta device;
    tied weights once, buffers that are saved included)."""
    with torch.device("meta"):
        probe = build_model(config, vocab_size)
    saved = set(probe.state_dict())
    tensors = [*probe.parameters(), *(b for n, b in probe.named_buffers() if n in saved)]
    return sum(t.numel() * t.element_size() for t in tensors)


class Translator:
    """A trained model with its tokenizer, ready to translate.

    Args:
        run_dir: a folder written by ``attnlab train``.
        device: ``"cpu"`` or ``"cuda"``.

    A run whose training has not finished (interrupted, or still training) has no final
    ``model.safetensors``: its latest checkpoint is loaded instead, with a warning on stderr
    naming the checkpoint's step and the run's budget. ``checkpoint_step`` is then that step
    (None when the final weights are loaded) and ``finished`` whether the checkpoint had used
    up the run's budget (True for the final weights); :func:`evaluate` records both.

    ``compile_decoding = True`` (a Transformer's run) decodes with the decoder step compiled
    once and replayed (CUDA graphs on a GPU: see :meth:`TransformerSeq2Seq.start`); the same
    translations. It is for where launches dominate a step (a GPU); on CPU decoding was 1.05-1.3x
    slower and compiling costs ~20 s (``benchmarks/bench_beam.py``).
    """

    compile_decoding = False

    def __init__(self, run_dir: str | os.PathLike[str], device: str = "cpu"):
        self.run_dir = check_run_dir(run_dir)
        self.config = read_config(self.run_dir)
        if not (self.run_dir / ckpt.TOKENIZER).is_file():
            raise UsageError(
                f"{self.run_dir} has no {ckpt.TOKENIZER}: training stopped before it was written; "
                f"train again with: attnlab train --out {self.run_dir} --resume"
            )
        self.tokenizer = Tokenizer.load(self.run_dir / ckpt.TOKENIZER)
        if self.tokenizer.kind != self.config["tokenizer"]["kind"]:
            raise RunFileError(
                self.run_dir / ckpt.TOKENIZER,
                f"a {self.tokenizer.kind} tokenizer, but {ckpt.CONFIG} says "
                f"{self.config['tokenizer']['kind']}",
            )
        self.device = torch.device(device)
        weights = self.run_dir / ckpt.WEIGHTS
        self.checkpoint_step: int | None = None  # (the final weights)
        self.finished = True
        checkpoint = None  # (folder, state) of the checkpoint whose weights are loaded
        if not weights.is_file():
            # an unfinished run: its newest checkpoint that reads intact (a damaged newer one
            # is named and skipped, as a resume skips it)
            checkpoint = ckpt.intact_checkpoint(self.run_dir)
            if checkpoint is None:
                raise UsageError(
                    f"{self.run_dir} has no trained weights yet; finish training with: "
                    f"attnlab train --out {self.run_dir} --resume"
                )
            weights = checkpoint[0] / ckpt.WEIGHTS
        tensors = ckpt.load_tensors(weights)
        need = _weights_bytes(self.config["model"], self.tokenizer.vocab_size)
        have = sum(t.numel() * t.element_size() for t in tensors.values())
        if need > have:  # before allocating a model that these weights cannot fill
            raise RunFileError(
                weights,
                f"holds {have:,} bytes of tensors; the model that {ckpt.CONFIG} and "
                f"{ckpt.TOKENIZER} describe needs {need:,}",
            )
        self.model = build_model(self.config["model"], self.tokenizer.vocab_size)
        self._check_vocabulary(tensors, weights)
        ckpt.load_model_state(self.model, tensors, weights)
        self.model.to(self.device).eval()
        self.decode_options = dict(self.config.get("decode", {}))
        if checkpoint is not None:  # (said once loaded: a damaged one said its error)
            self._from_checkpoint(checkpoint[1])

    def _from_checkpoint(self, state: dict) -> None:
        """Record and say that the weights are a checkpoint's (``state``: its state.json), and
        how far training had got."""
        from attnlab.translate.cmd_train import budget_reached, done_so_far

        train = self.config["train"]
        self.checkpoint_step = int(state["step"])
        self.finished = budget_reached(train, done_so_far(state)) is not None
        resume = f"attnlab train --out {self.run_dir} --resume"
        if self.finished:
            how = f"training used its whole budget ({describe_budget(train)}), but its final "
            how += f"files were not written; finish them with: {resume}"
        else:
            how = "training has not finished (interrupted, or still training) and its budget is "
            how += f"{describe_budget(train)}: not the trained model. Train on with: {resume}"
        print(
            f"warning: {self.run_dir} has no {ckpt.WEIGHTS}: these are the weights of its last "
            f"checkpoint, step {self.checkpoint_step}; {how}",
            file=sys.stderr,
        )

    def _check_vocabulary(self, tensors: dict, weights: Path) -> None:
        """Weights whose vocabulary rows differ from the tokenizer's size (and nothing else):
        the tokenizer is not the one these weights were trained with."""
        V = self.tokenizer.vocab_size
        for name, like in ckpt.model_state(self.model).items():
            got = tensors.get(name)
            if got is None or got.dim() != like.dim() or tuple(got.shape) == tuple(like.shape):
                continue
            differ = [
                i for i, (a, b) in enumerate(zip(got.shape, like.shape, strict=True)) if a != b
            ]
            if all(like.shape[i] == V for i in differ):
                raise RunFileError(
                    self.run_dir / ckpt.TOKENIZER,
                    f"has {V:,} symbols, but {weights} was trained with {got.shape[differ[0]]:,}: "
                    "this tokenizer does not belong to these weights",
                )

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.model)

    def _src_tensors(self, id_lists):
        src, lengths = source_tensor(id_lists)
        return src.to(self.device), lengths.to(self.device)

    @torch.no_grad()
    def translate(
        self,
        texts: list[str] | str,
        *,
        beam_size: int | None = None,
        return_attention: bool = True,
        batch_size: int = 32,
        progress: bool = False,
    ) -> list[Translation]:
        """Translate sentences.

        Args:
            texts: sentences (or one string).
            beam_size: 1 = greedy; default from the run's config (4).
            return_attention: also return the cross-attention maps (slower: the attention
                kernels must then materialise their weights).
            batch_size: sentences decoded together (sorted by length first).
            progress: show a progress bar.
        """
        if isinstance(texts, str):
            texts = [texts]
        beam = beam_size or self.decode_options.get("beam_size", 4)
        lp = self.decode_options.get("length_penalty", 0.6)
        encoded = [self.tokenizer.encode(t) for t in texts]
        results: list[Translation | None] = [None] * len(texts)
        chunks = length_sorted_chunks([len(ids) for ids, _ in encoded], batch_size)
        if progress:
            from attnlab.translate.progress import progress_bar

            chunks = progress_bar(chunks, desc="translating", unit="batch", leave=False)
        for chunk in chunks:
            src, lengths = self._src_tensors([encoded[i][0] for i in chunk])
            hyps = decode(
                self.model,
                src,
                lengths,
                beam_size=beam,
                limits=length_limits(lengths),
                return_attention=return_attention,
                length_penalty=lp,
                compile=self.compile_decoding,
            )
            for i, hyp in zip(chunk, hyps, strict=True):
                ids, spans = encoded[i]
                source_tokens = [texts[i][a:b] for a, b in spans] + [SPECIALS[2]]
                target_tokens = self.tokenizer.token_strings(hyp.tokens) + (
                    [SPECIALS[2]] if hyp.eos else []
                )
                attention = None
                if hyp.attention is not None:
                    attention = hyp.attention.float().numpy()[..., : len(source_tokens)]
                results[i] = Translation(
                    texts[i],
                    source_tokens,
                    target_tokens,
                    self.tokenizer.decode(hyp.tokens),
                    attention,
                    hyp.score,
                    hyp.eos,
                )
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def forced_attention(self, pairs, *, batch_size: int = 32, progress: bool = False):
        """Cross-attention while reading the *reference* translation (teacher forcing).

        Yields, per pair in order: ``(source spans, target spans, attention)`` with attention
        ``(T, S)`` (RNN) or ``(layers, heads, T, S)`` (Transformer), ``T`` = target tokens + EOS,
        ``S`` = source tokens + EOS; None for the attention-free RNN.
        """
        from attnlab.translate.batching import pad
        from attnlab.translate.tokenizer import BOS

        src_enc = [self.tokenizer.encode(p.source) for p in pairs]
        tgt_enc = [self.tokenizer.encode(p.target) for p in pairs]
        chunks = length_sorted_chunks([len(s[0]) for s in src_enc], batch_size)
        out = [None] * len(pairs)
        if progress:
            from attnlab.translate.progress import progress_bar

            chunks = progress_bar(chunks, desc="attention", unit="batch", leave=False)
        for chunk in chunks:
            src, lengths = self._src_tensors([src_enc[i][0] for i in chunk])
            tgt_in = pad([[BOS] + tgt_enc[i][0] for i in chunk]).to(self.device)
            _, attn = self.model(src, lengths, tgt_in, return_attention=True)
            for row, i in enumerate(chunk):
                S, T = len(src_enc[i][0]) + 1, len(tgt_enc[i][0]) + 1
                a = None if attn is None else attn[row][..., :T, :S].float().cpu().numpy()
                out[i] = (src_enc[i][1], tgt_enc[i][1], a)
        return out


def describe_budget(train: dict) -> str:
    """A run's training budget in words: ``"300 steps"``, ``"the first of 2 epochs, 5.00
    minutes of training"``."""
    parts = [
        text
        for key, text in (
            ("max_steps", f"{train.get('max_steps')} steps"),
            ("epochs", f"{train.get('epochs', 0):g} epochs"),
            ("train_seconds", f"{train.get('train_seconds', 0) / 60:.2f} minutes of training"),
            ("cpu_seconds", f"{train.get('cpu_seconds', 0) / 60:.2f} CPU-minutes of training"),
        )
        if train.get(key)
    ]
    if not parts:
        return "none recorded"
    return parts[0] if len(parts) == 1 else "the first of " + ", ".join(parts)


def load_run(run_dir: str | os.PathLike[str], device: str = "cpu") -> Translator:
    """Load a run directory written by ``attnlab train`` (see :class:`Translator`)."""
    return Translator(run_dir, device=device)
