"""``python -m kvasync``: the command line of ``kvasync.cli``."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="kvasync")
