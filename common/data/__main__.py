"""An operator's check of a node's data before it joins: ``python -m common.data check PATH [--model NAME]``
(and ``python -m common.data members DIR``: three members' demo data, ``common.data.members``).

Prints the detected format, the example and token counts, the split sizes with the run's fractions, how many
prompts were cut and how many examples exceed the token limit, and the first rows that cannot be read, without
starting Flower (and without loading the model's weights: only its tokenizer). Exit status 0 when a node could
train on the data, 1 when it would be refused (the reason is printed as the node would log it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.core_sections import DataSection, TrainSection

from .example import DataError
from .files import read_file
from .formats import FORMATS
from .node import OwnData, check_sizes, split_own


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check a data file as a node would read it")
    check.add_argument("path", help="a .jsonl / .json / .csv / .parquet file or a save_to_disk directory")
    check.add_argument("--format", default="auto", choices=["auto", *FORMATS])
    check.add_argument("--test-path", default="", help="an explicit test file (node config data-test-path)")
    check.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer counts the tokens")
    check.add_argument("--test-fraction", type=float, default=DataSection().test_fraction)
    check.add_argument("--validation-fraction", type=float, default=DataSection().validation_fraction)
    check.add_argument("--max-prompt-chars", type=int, default=DataSection().max_prompt_chars)
    check.add_argument("--max-seq-len", type=int, default=TrainSection().max_seq_len)
    members = sub.add_parser("members", help="write three members' demo data (real text, three formats)")
    members.add_argument("directory")
    members.add_argument("--examples", type=int, default=60, help="examples per member")
    args = parser.parse_args(argv)
    import datasets

    datasets.disable_progress_bars()  # the check's own lines, not Arrow's progress
    if args.command == "members":
        from .members import write_members

        for partition, (path, examples) in write_members(Path(args.directory), args.examples).items():
            print(f"node {partition}: {path} ({len(examples)} examples)")
        return 0
    cfg = DataSection(
        test_fraction=args.test_fraction,
        validation_fraction=args.validation_fraction,
        max_prompt_chars=args.max_prompt_chars,
    )
    try:
        return _check(args, cfg)
    except DataError as err:
        print(f"refused: {err.detail}")
        return 1


def _check(args: argparse.Namespace, cfg: DataSection) -> int:
    loose = read_file(args.path, args.format, cfg.max_prompt_chars, cfg.max_row_chars, strict=False)
    print(f"format: {loose.format}")
    if loose.problems:
        print(f"rows that cannot be read (a node refuses the file at the first; showing {len(loose.problems)}):")
        for problem in loose.problems:
            print(f"  {problem}")
    test = None
    if args.test_path:
        test = read_file(args.test_path, loose.format, cfg.max_prompt_chars, cfg.max_row_chars).examples
    splits, dropped = split_own(cfg, loose.examples, test)
    print(f"examples: {len(loose.examples):,} ({loose.clipped:,} with a prompt cut to {cfg.max_prompt_chars:,} chars)")
    sizes = ", ".join(f"{name} {len(splits[name]):,}" for name in ("train", "validation", "test"))
    print(f"split (by content: the same on every run): {sizes}")
    if args.test_path:
        print(f"copies of test examples left out of training: {dropped:,}")
    from common.model import load_tokenizer
    from common.training import token_counts

    tokenizer = load_tokenizer(args.model)
    examples = [e for part in splits.values() for e in part]
    tokens, over, _ = token_counts(tokenizer, examples, args.max_seq_len)  # every example: the check may take time
    print(
        f"tokens ({args.model}): {tokens:,}, {tokens / max(len(examples), 1):.0f} an example; {over:,} over "
        f"train.max-seq-len {args.max_seq_len} (cut from the left, the last answer kept)"
    )
    turns = sum(len(e.messages()) for e in examples)
    print(f"turns: {turns:,} ({turns / max(len(examples), 1):.1f} an example)")
    check_sizes(cfg, splits, OwnData(args.path))
    if loose.problems:
        print("not ready: fix the rows above (a node reads the whole file or nothing)")
        return 1
    print("ready: a node with this data-path can join")
    return 0


if __name__ == "__main__":
    sys.exit(main())
