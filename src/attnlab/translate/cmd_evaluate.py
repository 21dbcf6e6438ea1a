"""``attnlab evaluate RUN_DIR``: BLEU, chrF (and exact match for dates) on a held-out split, and
the alignment error rate (AER) of the model's cross-attention against reference word alignments
(Bible test/validation splits): per head and head-averaged for a Transformer.
"""

from __future__ import annotations

import argparse
import json

EPILOG = """\
examples:
  attnlab evaluate runs/bible-rnn-luong-general
  attnlab evaluate runs/bible-rnn-bahdanau --split validation --beam-size 1
  attnlab evaluate runs/dates-rnn-bahdanau --json > scores.json

AER: each target word is linked to the source word it attends to most (subword attention summed
over a source word's pieces, averaged over a target word's pieces), while the model reads the
reference translation. The AER printed first (JSON "aer_referenced") scores the target words the
reference links at all; the one "over all target words" (JSON "aer") also counts the words it
links to nothing, which no aligner can get right (a perfect one scores ~24% on the Bible test
split, ~11% on dates).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.cli import positive_int
    from attnlab.translate.cmd_translate import add_run_arguments

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    add_run_arguments(parser)
    parser.add_argument(
        "--split",
        choices=["test", "validation"],
        default="test",
        help="held-out split (default test)",
    )
    parser.add_argument(
        "--limit", type=positive_int, default=None, metavar="N", help="first N pairs only"
    )
    parser.add_argument("--no-aer", action="store_true", help="skip the alignment error rate")
    parser.add_argument("--json", action="store_true", help="print the scores as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    from attnlab.translate.evaluation import evaluate, format_scores
    from attnlab.translate.pipeline import open_run
    from attnlab.translate.tasks import run_task

    translator = open_run(args)
    # data only from the shipped tasks or the run folder, never a path config.json makes up
    task = run_task(args.run_dir, translator.config["task"])
    res = evaluate(
        translator,
        task,
        args.split,
        beam_size=args.beam_size,
        aer=not args.no_aer,
        progress=not args.no_progress,
        limit=args.limit,
    )
    if args.json:
        print(json.dumps(res, indent=1, ensure_ascii=False))
        return 0
    m = translator.config["model"]
    step = res["checkpoint_step"]
    print(
        f"{args.run_dir}: {m['kind']} with {m['attention']} attention, "
        f"{translator.num_parameters:,} parameters"
        + (f"; the weights of checkpoint step {step}" if step is not None else "")
        + ("" if res["finished"] else " (training unfinished)")
    )
    print(
        "\n".join(format_scores(res, args.split, alignment_heading="attention as word alignment:"))
    )
    if "alignment" not in res and task.alignments.get(args.split) and not args.no_aer:
        print("alignment: this model has no attention (the fixed-vector baseline)")
    return 0
