"""How every `graftlab` command refuses: one line on stderr, never a traceback, and its exit status, 2 for
the command line (argparse's refusals and `UsageError`), 1 for the data the files hold."""

from __future__ import annotations

import argparse
import sys

from graftlab.errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are `UsageError`s: one line, as every other refusal, not argparse's
    usage block (its subcommands' parsers are of this class too). A flag is its whole name: argparse's
    abbreviations would take a misspelt `--scal` as `--scale`, and a new flag could change what one means."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str):
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        # argparse hands a flag written `--flag=--` an empty list, never its type (its '--' handling): refused
        # as the value missing that it is (found by tests/test_bad_input_properties).
        for word in sys.argv[1:] if args is None else args:
            flag, equals, value = str(word).partition("=")
            if flag.startswith("--") and equals and value == "--":
                self.error(f"argument {flag}: expected one argument")
        return super().parse_known_args(args, namespace)


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a refusal is one line on stderr and its exit status."""
    from safetensors import SafetensorError

    from graftlab.errors import GraftlabError

    try:
        args.run(args)
    except UsageError as e:
        return refused(e, 2)
    except (GraftlabError, OSError, SafetensorError) as e:
        # OSError covers files vanishing or disks filling mid-run; SafetensorError a corrupt shard.
        return refused(e, 1)
    return 0


def refused(error: Exception, status: int) -> int:
    message = " ".join(str(error).split())  # one line, whatever the exception carried
    print(f"graftlab: error: {message}", file=sys.stderr)
    return status
