"""Parse-only mode for the documented-commands tests (tests/documented.py).

Python imports `sitecustomize` at start-up when it is on the path, so putting this folder first on
PYTHONPATH makes every Python program started by a documented command stop right after its first
successful `ArgumentParser.parse_args`: the command's flags are checked by the program's own parser,
and nothing runs (no server starts, no benchmark runs for minutes). A bad flag still fails, with
argparse's exit status 2. The marker line on stderr lets the test prove that the parse happened.
"""

import argparse
import sys

_parse_args = argparse.ArgumentParser.parse_args


def _parse_then_stop(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
    _parse_args(self, args, namespace)
    print(f"[parse-only] {self.prog}: flags accepted", file=sys.stderr, flush=True)
    raise SystemExit(0)


argparse.ArgumentParser.parse_args = _parse_then_stop  # type: ignore[method-assign]
