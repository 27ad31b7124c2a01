"""Print, one per line, the `uv pip install` options that give uv the package sources pip is
configured with here (pip's config files and PIP_* variables, as `pip config list` shows them):
uv reads neither, and without them it could resolve torch==2.13.0 from another source than pip
does (a CUDA build instead of the CPU wheel this machine offers).

Usage: python .ci/uv_args.py  (run with the environment's python: its pip is asked)."""

from __future__ import annotations

import ast
import subprocess
import sys

# pip option -> uv option; each value of a multi-valued pip option becomes one uv option.
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links", "constraint": "--constraint"}
FLAGS = {"no-index": "--no-index"}
SCOPES = (":env:", "install", "global")  # pip's precedence: environment, then command, then global


def pip_settings() -> dict[str, str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True,
                            capture_output=True, text=True).stdout
    found: dict[tuple[str, str], str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        found[(scope, name)] = ast.literal_eval(value)
    settings: dict[str, str] = {}
    for scope in reversed(SCOPES):  # global first, then overridden
        settings.update({name: value for (where, name), value in found.items() if where == scope})
    return settings


def uv_args(settings: dict[str, str]) -> list[str]:
    args = ["--index-strategy", "unsafe-best-match"]  # pip takes the best match across every index
    for name, option in OPTIONS.items():
        for value in settings.get(name, "").split():
            args += [option, value]
    for name, flag in FLAGS.items():
        if settings.get(name, "").lower() in ("1", "true", "yes", "on"):
            args.append(flag)
    return args


if __name__ == "__main__":
    print("\n".join(uv_args(pip_settings())))
