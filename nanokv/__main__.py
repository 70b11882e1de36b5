"""`python -m nanokv ...` (and `torchrun ... -m nanokv generate ...`): the nanokv CLI."""

from nanokv.entrypoints.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
