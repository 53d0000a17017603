"""An operator's check of a node's data before it joins: `python -m common.data check PATH [--model NAME]`
(and `python -m common.data members DIR`: three members' demo data, `common.data.members`).

Prints the detected format, the example and token counts, the split sizes with the run's fractions, how many
prompts were cut and how many examples exceed the token limit, and the first rows that cannot be read, without
starting Flower (and without loading the model's weights: only its tokenizer). Exit status 0 when a node could
train on the data, 1 when it would be refused (the reason is printed as the node would log it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from common.core_sections import DataSection, TrainSection

from .example import DataError
from .files import read_file
from .formats import FORMATS
from .node import OwnData, check_sizes, split_own

# check's flags -> the run-config keys they stand for (a bad value is named by its flag)
FLAGS = {
    "test_fraction": "--test-fraction",
    "validation_fraction": "--validation-fraction",
    "max_prompt_chars": "--max-prompt-chars",
    "max_row_chars": "--max-row-chars",
    "max_seq_len": "--max-seq-len",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="check a data file as a node would read it",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Read a node's data file as a node would, and say what a run would make of it.",
    )
    check.add_argument("path", help="a .jsonl / .json / .csv / .parquet file or a save_to_disk directory")
    check.add_argument("--format", default="auto", choices=["auto", *FORMATS], help="node config data-format")
    check.add_argument("--test-path", default="", help="an explicit test file (node config data-test-path)")
    check.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer counts the tokens")
    data, train = DataSection(), TrainSection()
    check.add_argument("--test-fraction", type=float, default=data.test_fraction, help="data.test-fraction")
    check.add_argument(
        "--validation-fraction", type=float, default=data.validation_fraction, help="data.validation-fraction"
    )
    check.add_argument("--max-prompt-chars", type=int, default=data.max_prompt_chars, help="data.max-prompt-chars")
    check.add_argument("--max-row-chars", type=int, default=data.max_row_chars, help="data.max-row-chars")
    check.add_argument("--max-seq-len", type=int, default=train.max_seq_len, help="train.max-seq-len")
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
    try:
        cfg = DataSection(
            test_fraction=args.test_fraction,
            validation_fraction=args.validation_fraction,
            max_prompt_chars=args.max_prompt_chars,
            max_row_chars=args.max_row_chars,
        )
        TrainSection(max_seq_len=args.max_seq_len)
    except ValidationError as err:
        for problem in err.errors():
            flag = FLAGS.get(str(problem["loc"][0]), str(problem["loc"][0]))
            print(f"check: {flag}: {problem['msg']} (got {problem['input']!r})", file=sys.stderr)
        return 2
    try:
        tokenizer = _tokenizer(args.model)  # first: a model that cannot be had stops the check before it reads
        return _check(args, cfg, tokenizer)
    except DataError as err:
        print(f"refused: {err.detail}")
        return 1


def _tokenizer(model: str):
    from common.model import load_tokenizer

    try:
        return load_tokenizer(model)
    except (OSError, ValueError) as err:
        raise DataError(
            "no tokenizer",
            f"--model {model}: its tokenizer cannot be loaded ({type(err).__name__}). Name a local "
            "checkpoint directory, a .gguf file or a built-in model (smollm2-135m-instruct, "
            "qwen2.5-coder-0.5b-instruct); a hub id needs a model hub",
        ) from None


class Progress:
    """A line on stderr at most every ``every`` seconds while a long count goes on (a large file's tokens), so that
    a check of millions of rows says it is working and how far it is; nothing for a count that ends sooner."""

    def __init__(self, what: str, every: float = 5.0) -> None:
        self.what, self.every = what, every
        self.started = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every and done < total:
            self.last = now
            left = (now - self.started) / done * (total - done)
            print(f"{self.what}: {done:,} of {total:,} ({done / total:.0%}; about {left:.0f} s left)", file=sys.stderr)


def _check(args: argparse.Namespace, cfg: DataSection, tokenizer) -> int:
    size = Path(args.path).stat().st_size if Path(args.path).is_file() else 0
    if size > 50_000_000:
        print(f"reading {size / 1e6:,.0f} MB ...", file=sys.stderr)
    loose = read_file(args.path, args.format, cfg.max_prompt_chars, cfg.max_row_chars, strict=False)
    print(f"format: {loose.format}")
    if loose.problems:
        print(
            f"rows that cannot be read: {loose.refused:,} (a node refuses the file at the first; the first "
            f"{len(loose.problems)}):"
        )
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
    from common.training import token_counts

    examples = [e for part in splits.values() for e in part]
    # every example: on a large file this takes a while, and says how far it is
    tokens, over, _ = token_counts(tokenizer, examples, args.max_seq_len, progress=Progress("counting tokens"))
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
    if loose.clipped or over:  # ready, and what the settings cut: the keys that keep more
        print(
            f"note: {loose.clipped:,} of {len(loose.examples):,} prompts cut to data.max-prompt-chars "
            f"({cfg.max_prompt_chars:,}) and {over:,} of {len(examples):,} examples over train.max-seq-len "
            f"({args.max_seq_len}); to keep more, raise them in the run config (here: --max-prompt-chars, "
            "--max-seq-len)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
