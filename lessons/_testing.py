"""Assertions every lesson's test suite shares (the plumbing, not the lesson's ideas)."""

from __future__ import annotations

import contextlib
import io
import unittest
from collections.abc import Callable

from lessons._report import merge_rank_checks


def assert_every_check_passes(case: unittest.TestCase, results_by_world: dict[int, list[dict]]) -> None:
    """Every named check of a demo worker passed on every rank, for every world size."""
    for world, per_rank in results_by_world.items():
        for check in merge_rank_checks([result["checks"] for result in per_rank]):
            with case.subTest(world=world, check=check.name):
                case.assertTrue(check.passed, check.detail)


def assert_argument_error(case: unittest.TestCase, parse_args: Callable, argv: list[str],
                          fragment: str) -> str:
    """`parse_args(argv)` exits 2 with exactly one 'error:' line containing `fragment`."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), case.assertRaises(SystemExit) as caught:
        parse_args(argv)
    case.assertEqual(caught.exception.code, 2)
    errors = [line for line in stderr.getvalue().splitlines() if "error:" in line]
    case.assertEqual(len(errors), 1, stderr.getvalue())
    case.assertIn(fragment, errors[0])
    return stderr.getvalue()
