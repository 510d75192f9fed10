"""Progress on stderr for the long commands (tqdm), silent under ``--quiet``; stdout stays
for results (JSON, text) so that it can be piped."""
from __future__ import annotations

import sys
from contextlib import contextmanager

from tqdm import tqdm


def progress_bar(total: int, desc: str, unit: str, quiet: bool) -> tqdm:
    """A bar over ``total`` items on stderr (looked up now: click's test runner swaps it)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet, dynamic_ncols=True)


@contextmanager
def stage_progress(desc: str, quiet: bool):
    """For work reported as stage messages (``build``): yields a ``log(message)`` that prints
    each message on stderr, below which a terminal also gets a status line with the current
    stage and the time elapsed (a log file gets the messages alone: a redrawn line would
    leave carriage returns in it); under ``quiet`` it prints nothing."""
    if quiet:
        yield lambda message: None
        return
    bar = tqdm(desc=desc, file=sys.stderr, bar_format="{desc} [{elapsed}]", dynamic_ncols=True,
               disable=not sys.stderr.isatty())

    def log(message: str) -> None:
        bar.write(message, file=sys.stderr)
        bar.set_description_str(f"{desc}: {message.split(': ', 1)[-1][:60]}")

    try:
        yield log
    finally:
        bar.close()
