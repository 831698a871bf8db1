"""Write the synthetic single-digit addition task ("3+4=" -> "7") for the CPU demo.

    python scripts/make_synthetic_data.py --output_dir data/tiny_arith --n_train 2000 --n_test 100

Writes OUTPUT_DIR/train.parquet and OUTPUT_DIR/test.parquet (data_source "synthetic/arith").
Bad input ends in one `error: ...` line and exit code 2.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hybridrl.data.synthetic import write_synthetic_arith  # noqa: E402
from hybridrl.log import UsageError, run_cli  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="data/tiny_arith")
    parser.add_argument("--n_train", type=int, default=2000)
    parser.add_argument("--n_test", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_operand", type=int, default=9, help="operands are in [0, max_operand]")
    args = parser.parse_args(argv)
    return run_cli(write, args)


def write(args) -> None:
    for name in ("n_train", "n_test"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)}: need at least one row; pass --{name} 1 or more")
    if args.max_operand < 0:
        raise UsageError(f"--max_operand {args.max_operand}: operands are drawn from [0, max_operand]; "
                         f"pass 0 or more (the demo uses 9)")
    for path in write_synthetic_arith(args.output_dir, args.n_train, args.n_test, args.seed,
                                      args.max_operand):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
