"""The translator's settings as plain data: model and attention names, sizes, what each task
trains by default, and the named recipes (presets).

Kept apart from :mod:`.models`, :mod:`.rnn` and :mod:`.pipeline` (which import torch) so that
the command-line parsers can offer them as choices without importing torch:
``attnlab train --help`` answers at once.
"""

from __future__ import annotations

MODELS = ("rnn", "transformer")
RNN_ATTENTIONS = (
    "none",
    "bahdanau",
    "luong-dot",
    "luong-general",
    "luong-concat",
    "multihead",
    "hard",
)
TRANSFORMER_ATTENTIONS = ("multihead", "gqa")

# Sizes by name: the default of each model, and a tiny one for tests and smoke runs.
SIZES = {
    "rnn": {
        "tiny": {"emb_dim": 32, "hidden": 64, "enc_layers": 1, "heads": 2, "dropout": 0.0},
        "small": {"emb_dim": 128, "hidden": 256, "enc_layers": 1, "heads": 4, "dropout": 0.1},
        "base": {"emb_dim": 256, "hidden": 512, "enc_layers": 1, "heads": 4, "dropout": 0.2},
    },
    "transformer": {
        "tiny": {
            "d_model": 32,
            "heads": 2,
            "d_ff": 64,
            "enc_layers": 1,
            "dec_layers": 1,
            "dropout": 0.0,
        },
        "small": {
            "d_model": 192,
            "heads": 4,
            "d_ff": 768,
            "enc_layers": 3,
            "dec_layers": 3,
            "dropout": 0.1,
        },
        "base": {
            "d_model": 256,
            "heads": 4,
            "d_ff": 1024,
            "enc_layers": 4,
            "dec_layers": 4,
            "dropout": 0.1,
        },
    },
}

# What each task trains by default (a plain `attnlab train` is the first row). For 15 minutes
# of CPU the RNN with Luong attention learns fastest: its decoder GRU and its attention each run
# over all target positions at once (no step-by-step loop in training). At 20 CPU-minutes on
# the Bible it reached BLEU 20.1 where Bahdanau's step-by-step decoder reached 7.9; the
# Transformer needs more time (`--preset bible-long`). Your own pairs (`--data`) get the same
# model: an option never changes the model behind the user's back (`--model transformer` asks).
TASK_DEFAULTS = {
    "bible": {
        "model": "rnn",
        "attention": "luong-general",
        "size": "small",
        "tokenizer": "bpe",
        "vocab_size": 8000,
        "time_budget": 15.0,
    },
    "dates": {
        "model": "rnn",
        "attention": "luong-general",
        "size": "small",
        "tokenizer": "char",
        "time_budget": 4.0,
        "max_tokens": 1024,
    },
}
TASK_DEFAULTS["tsv"] = dict(TASK_DEFAULTS["bible"])  # your own pairs: as the Bible
# Small batches, many steps: with minutes to hours of CPU, more updates of fewer tokens learn
# faster (at 6 CPU-minutes on the Bible, 1,536-token batches at lr 2e-3 reached a validation
# loss of 4.79 where 4,096-token batches at lr 1e-3 reached 5.54).
MODEL_DEFAULTS = {
    "transformer": {"lr": 2e-3, "warmup": 200, "max_tokens": 1536, "label_smoothing": 0.1},
    "rnn": {"lr": 2e-3, "warmup": 200, "max_tokens": 1536, "label_smoothing": 0.1},
}
# Named recipes; every key is an option of `attnlab train`.
PRESETS = {
    "bible-long": {
        # A Transformer of 7.5M parameters for 5 hours or 30 epochs, whichever ends first
        # (an epoch costs about 13 minutes of one CPU core).
        "task": "bible",
        "model": "transformer",
        "size": "base",
        "layers": 3,
        "time_budget": 300.0,
        "epochs": 30.0,
        "vocab_size": 8000,
        "lr": 1.5e-3,
        "warmup": 800,
        "max_tokens": 2048,
    },
    "dates": {"task": "dates", "model": "rnn", "attention": "luong-general", "size": "small"},
}
