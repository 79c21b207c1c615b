"""``--help`` that shows each option's default, for ``kvroute`` and the benchmarks' commands."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default; one without a default (None, or a flag that
    is off) says nothing rather than ``(default: None)``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)
