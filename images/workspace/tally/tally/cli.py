"""The `python3 -m tally` command: summaries of CSV files and word counts of text files."""

import argparse
import sys

from tally.reader import read_csv
from tally.report import render_markdown, render_text
from tally.textstats import line_stats, top_words


def build_parser():
    parser = argparse.ArgumentParser(prog="tally", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    summary = sub.add_parser("summary", help="group a CSV file and aggregate a column")
    summary.add_argument("path")
    summary.add_argument("--by", required=True, help="column to group by")
    summary.add_argument("--sum", dest="sum_column", help="column to sum")
    summary.add_argument("--mean", dest="mean_column", help="column to average")
    summary.add_argument("--markdown", action="store_true")

    word = sub.add_parser("words", help="most frequent words of a text file")
    word.add_argument("path")
    word.add_argument("--top", type=int, default=10)

    stats = sub.add_parser("wc", help="line, word and character counts")
    stats.add_argument("path")
    return parser


def main(argv=None, out=None):
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    try:
        if args.command == "summary":
            table = read_csv(args.path)
            aggregates = {"rows": ("count", args.by)}
            if args.sum_column:
                aggregates[f"sum_{args.sum_column}"] = ("sum", args.sum_column)
            if args.mean_column:
                aggregates[f"mean_{args.mean_column}"] = ("mean", args.mean_column)
            result = table.group_by(args.by, **aggregates).sort_by(args.by)
            out.write(render_markdown(result) if args.markdown else render_text(result))
        elif args.command == "words":
            with open(args.path, encoding="utf-8") as handle:
                for word, count in top_words(handle.read(), n=args.top):
                    out.write(f"{count:6d} {word}\n")
        elif args.command == "wc":
            with open(args.path, encoding="utf-8") as handle:
                stats = line_stats(handle.read())
            out.write(" ".join(f"{k}={v}" for k, v in stats.items()) + "\n")
    except (OSError, KeyError, ValueError) as exc:
        print(f"tally: {exc}", file=sys.stderr)
        return 1
    return 0
