"""The course's lessons, one package per folder (lessons/NN_slug), and their shared plumbing.

Importing the package starts the launcher's forkserver in the background (lessons/_prewarm.py),
so that spawned ranks start in a fraction of a second.
"""

from lessons._prewarm import prewarm

prewarm()
