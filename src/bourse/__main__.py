"""``python -m bourse``: the same as the ``bourse`` command."""

from bourse.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
