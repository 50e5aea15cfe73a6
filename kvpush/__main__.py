"""``python -m kvpush``: the command line (see :mod:`kvpush.cli`)."""

from __future__ import annotations

from kvpush.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
