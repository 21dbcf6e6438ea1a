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
"""

from attnlab.translate.run import Translation, Translator, load_run

__all__ = ["Translation", "Translator", "load_run"]
