"""Progress bars: one helper, so that every long loop shows a bar on a terminal and nothing in a log.

A bar is drawn only when it is wanted (`enabled`) and stderr is a terminal; otherwise the
helpers return objects that do nothing, so callers never test for None.
"""
import sys


def on_terminal(stream=None):
    """Whether `stream` (default stderr) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # replaced or closed streams
        return False


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress_bar(total=None, desc=None, unit="it", enabled=True, leave=True):
    """A tqdm bar on stderr when `enabled` and stderr is a terminal, else a do-nothing stand-in."""
    if not enabled or not on_terminal():
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, smoothing=0.1,
                leave=leave)


class tracked:
    """Iterate over `iterable` with a progress bar (see progress_bar); other attributes pass through.

    For loops that take a DataLoader and read attributes of it (`loader.dataset_has_labels`).
    """

    def __init__(self, iterable, desc=None, unit="batch", enabled=True, total=None, leave=False):
        self._iterable = iterable
        self._bar_args = {"desc": desc, "unit": unit, "enabled": enabled, "leave": leave}
        if total is None:
            try:
                total = len(iterable)
            except TypeError:
                total = None
        self._total = total

    def __iter__(self):
        bar = progress_bar(self._total, **self._bar_args)
        try:
            for item in self._iterable:
                yield item
                bar.update(1)
        finally:
            bar.close()

    def __len__(self):
        return len(self._iterable)

    def __getattr__(self, name):
        return getattr(self._iterable, name)


def say(message, enabled=True):
    """A status line on stderr that does not break a bar being drawn."""
    if not enabled:
        return
    if on_terminal():
        from tqdm import tqdm
        tqdm.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr)


__all__ = ["on_terminal", "progress_bar", "say", "tracked"]
