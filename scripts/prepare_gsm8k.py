"""Convert local GSM8k train/test files (jsonl or parquet) to hybridrl's parquet prompt layout.

    python scripts/prepare_gsm8k.py --input path/to/gsm8k/main --output_dir data/gsm8k

Writes OUTPUT_DIR/train.parquet and OUTPUT_DIR/test.parquet. No downloads: fetch GSM8k yourself.
Bad input ends in one `error: ...` line and exit code 2.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hybridrl.data.gsm8k import prepare_gsm8k  # noqa: E402
from hybridrl.log import run_cli  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="a folder holding train*/test* files, or the two files themselves")
    parser.add_argument("--output_dir", required=True, help="where train/test.parquet go")
    args = parser.parse_args(argv)
    return run_cli(convert, args)


def convert(args) -> None:
    for split, path in prepare_gsm8k(args.input, args.output_dir).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    sys.exit(main())
