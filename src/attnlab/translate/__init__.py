"""Neural machine translation with attention, trained for real.

* Data: the embedded English -> Spanish Bible corpus, the dates task, or your own TSV file
  (:mod:`attnlab.translate.tasks`); BPE or character vocabularies (:mod:`.tokenizer`).
* Models, built from :mod:`attnlab.nn` layers: an RNN encoder-decoder with pluggable attention
  (none, Bahdanau, Luong dot/general/concat, multi-head, hard) (:mod:`.rnn`) and a Transformer
  with optional grouped-query heads and KV-cache decoding (:mod:`.transformer`).
* Greedy and batched beam search returning the attention maps they used (:mod:`.decoding`).
* Training with time/epoch budgets, atomic checkpoints, exact resume and DDP (:mod:`.trainer`).
* BLEU, chrF and the alignment error rate of attention (:mod:`.metrics`, :mod:`.evaluation`).
* The commands ``attnlab train / translate / evaluate / compare`` (``cmd_*`` modules).

Use a trained run from Python::

    from attnlab.translate import load_run
    tr = load_run("runs/bible-rnn-luong-general")
    out = tr.translate(["In the beginning God created the heaven and the earth."])
    out[0].text, out[0].source_tokens, out[0].target_tokens, out[0].attention.shape

The names below are imported on first use, so the command-line parsers (``cmd_*`` modules,
which live in this package) build without importing torch.
"""

from __future__ import annotations

from attnlab._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "Translation": "attnlab.translate.run",
    "Translator": "attnlab.translate.run",
    "load_run": "attnlab.translate.run",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
