"""After training: score the run on the test split, draw its attention, tell the user what next."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from attnlab._files import kill_point
from attnlab.data import words
from attnlab.translate.evaluation import evaluate, format_scores
from attnlab.translate.metrics import token_to_word, word_attention


def pick_map(attention: np.ndarray, head: str | None = None) -> tuple[np.ndarray, str]:
    """One (T, S) map from a model's attention: an RNN's own, or a Transformer head / average."""
    if attention.ndim == 2:
        return attention, ""
    if head and "." in head:
        layer, h = (int(x) for x in head.split("."))
        return attention[layer, h], f"layer {layer} head {h}"
    return attention.mean(axis=(0, 1)), "average of all heads"


def draw_attention(translator, task, path: Path, results: dict | None = None) -> str | None:
    """Save an attention heatmap of one test sentence; returns a description, or None."""
    from attnlab.translate.plot import attention_heatmap

    results = results or {}
    head = (results.get("alignment") or {}).get("best_head", {}).get("head")
    m = translator.config["model"]
    what = f"{m['kind']}, {m['attention']} attention"
    refs = task.alignments.get("test")
    if (
        refs and getattr(task, "target_units", "words") == "words"
    ):  # word level, reference links overlaid, attention while reading the reference
        candidates = [
            p for p in task.test if 8 <= len(words(p.source)) <= 16 and len(refs[p.id].sure) >= 4
        ] or task.test[:1]
        pair = candidates[0]
        src_spans, tgt_spans, attn = translator.forced_attention([pair])[0]
        if attn is None:
            return None
        A, label = pick_map(attn, head)
        src_words, tgt_words = words(pair.source), words(pair.target)
        W = word_attention(
            A,
            token_to_word(src_spans, pair.source),
            token_to_word(tgt_spans, pair.target),
            len(src_words),
            len(tgt_words),
        )
        ref = refs[pair.id]
        title = f"{pair.id}: {what}{', ' + label if label else ''}\n(red: reference alignment)"
        attention_heatmap(
            path,
            W,
            src_words,
            tgt_words,
            sure=set(ref.sure),
            possible=set(ref.possible),
            title=title,
        )
        return f"{pair.id}, word level, with the reference alignment"
    pair = task.test[0]
    tr = translator.translate([pair.source], return_attention=True)[0]
    if tr.attention is None:
        return None
    A, label = pick_map(tr.attention)
    title = f"{what}{', ' + label if label else ''}: {tr.text!r}"
    attention_heatmap(path, A, tr.source_tokens, tr.target_tokens, title=title)
    return f"{pair.source!r} -> {tr.text!r}"


def fitting_beam(translator, task, beam: int, seconds_left: float, limit=None) -> int:
    """``beam``, or 1 (greedy) if decoding the test split with ``beam`` would overrun the time
    budget: timed on a sample of 32 sentences (and the alignment scoring, which reads the
    references once, is counted as a quarter of a greedy pass)."""
    from attnlab.translate.pipeline import log

    pairs = task.test[:limit]
    sample = [p.source for p in pairs[:32]]
    start = time.monotonic()
    translator.translate(sample, beam_size=beam, return_attention=False)
    per_sentence = (time.monotonic() - start) / max(1, len(sample))
    needed = per_sentence * len(pairs) * (1 + 0.25 / beam) + 10
    if needed <= seconds_left - (time.monotonic() - start):
        return beam
    log(
        f"note: beam {beam} would take about {needed:.0f} s and {max(0, seconds_left):.0f} s of "
        "the budget remain: scoring with greedy decoding (attnlab evaluate RUN_DIR uses the beam)"
    )
    return 1


def final_report(
    run_dir: Path,
    task,
    state,
    *,
    beam_size=None,
    eval_limit=None,
    deadline=None,
    quiet=False,
    progress=None,
    plot=True,
    device: str = "cpu",
) -> dict:
    """Evaluate the trained run on the test split, write results.json and the heatmap, print.

    ``quiet``: print nothing; ``progress``: progress bars (default: unless quiet); ``device``:
    where to decode, the training's (a GPU-trained run decoded on CPU: its evaluation slower,
    and under a deadline :func:`fitting_beam` could fall back to greedy for it).
    """
    from attnlab.translate.pipeline import log, write_results
    from attnlab.translate.run import load_run

    translator = load_run(run_dir, device=device)
    kill_point("report")  # trained and saved; evaluated and written, not yet
    beam = beam_size or translator.decode_options.get("beam_size", 4)
    if deadline is not None and beam > 1:
        beam = fitting_beam(translator, task, beam, deadline - time.monotonic(), eval_limit)
    start = time.monotonic()
    res = evaluate(
        translator,
        task,
        "test",
        beam_size=beam,
        progress=not quiet if progress is None else progress,
        limit=eval_limit,
    )
    res["eval_seconds"] = round(time.monotonic() - start, 1)
    history = state.history if state is not None else []
    results = {
        "run_dir": str(run_dir),
        "task": translator.config["task"]["name"],
        "model": translator.config["model"],
        "parameters": translator.num_parameters,
        "train": {
            "steps": getattr(state, "step", None),
            "epochs": getattr(state, "epochs_done", None),
            "seconds": round(state.elapsed, 1) if state else None,
            "cpu_seconds": round(getattr(state, "cpu_seconds", 0.0), 1) if state else None,
            "tokens": getattr(state, "tokens", None),
            "val_loss": history[-1]["val_loss"] if history else None,
            "val_loss_pairs": history[-1].get("val_pairs") if history else None,
        },
        "test": res,
    }
    if plot:
        try:
            desc = draw_attention(translator, task, run_dir / "attention.png", res)
            results["heatmap"] = str(run_dir / "attention.png") if desc else None
            results["heatmap_of"] = desc
        except ModuleNotFoundError as e:  # matplotlib missing: everything else still works
            log(f"note: no heatmap ({e})")
    write_results(run_dir, results)
    if not quiet:
        print_report(results)
    return results


def print_report(results: dict) -> None:
    res = results["test"]
    m = results["model"]
    tr = results["train"]
    print()
    print(
        f"Run {results['run_dir']}: {m['kind']} with {m['attention']} attention, "
        f"{results['parameters']:,} parameters, trained {tr['steps']} steps "
        f"({tr['epochs']} epochs) in {tr['seconds']:.0f} s"
        + (f" ({tr['cpu_seconds']:.0f} s of CPU)" if tr.get("cpu_seconds") else "")
        + (
            f", {tr['tokens'] / tr['seconds']:,.0f} target tokens/s"
            if tr.get("tokens") and tr.get("seconds")
            else ""
        )
        + f", validation loss {tr['val_loss']}"
        + (
            f" (on a fixed random sample of {tr['val_loss_pairs']:,} validation pairs)"
            if tr.get("val_loss_pairs")
            else ""
        )
    )
    heading = "Attention as word alignment (vs the reference links of the test split):"
    print("\n".join(format_scores(res, "Test", alignment_heading=heading)))
    print("Samples:")
    for s in res["samples"][:3]:
        print(f"  source:      {s['source']}")
        print(f"  reference:   {s['reference']}")
        print(f"  translation: {s['translation']}")
        print()
    if results.get("heatmap"):
        print(f"Attention heatmap: {results['heatmap']} ({results['heatmap_of']})")
    run = results["run_dir"]
    example = "In the beginning God created the heaven and the earth."
    if results["task"] == "dates":
        example = "mardi 1 février 2005"
    elif results["task"] != "bible":
        example = res["samples"][0]["source"] if res["samples"] else "..."
    print("Use it:")
    print(f'  attnlab translate {run} "{example}"')
    print(f"  attnlab translate {run} --input file.txt     (one sentence per line; or stdin)")
    print(f"  attnlab evaluate {run}                       (BLEU, chrF, alignment error rate)")
    print(f"  attnlab show {run}                           (attention pictures)")
    print(f"  attnlab train --out {run} --resume --more-minutes MIN  (train longer)")
    print(f"  python: attnlab.translate.load_run({str(run)!r}).translate([...])")
