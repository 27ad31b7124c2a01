"""Lesson 06's suite, by exercise (lessons/_testing.py's `exercise` tags; untagged tests are the
"integration" criterion): the atomic write (the order of its calls, a crash before the rename),
the commit (manifest, then `latest`, then rotation; a crash between them), verified load (every
kind of damage refused, naming the file), the failure-safe save (every rank agrees before the
commit), exact resume (LR, scheduler, GradScaler, data cursor, RNG); then, all together:
every crash point, a failing write on any rank of a real run, the export, resharding 3 -> 2 and
3 -> 1, the demo end to end (in process and under torchrun), a real SIGKILL + resume, and the
numbers the README quotes.

Each exercise's tests use only that exercise's functions of main.py where that is possible:
the commit's tests write plainly instead of atomically, the verified-load tests read
checkpoints the test writes itself, the failure-safe save's ranks record instead of writing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib
import io
import json
import math
import os
import random
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import warnings
from pathlib import Path
from unittest import mock

import torch

from lessons._checks import max_abs_diff
from lessons._launch import launch
from lessons._testing import assert_argument_error, exercise, torchrun_demo

M = importlib.import_module("lessons.06_checkpointing.main")  # the technique: the protocol
F = importlib.import_module("lessons.06_checkpointing.atomic_file")  # the technique: one file
R = importlib.import_module("lessons.06_checkpointing.exact_resume")  # the technique: resume
C = importlib.import_module("lessons.06_checkpointing.checks")  # the harness
T = importlib.import_module("lessons.06_checkpointing.trainer")
W = importlib.import_module("lessons.06_checkpointing.tests.workers")
SCRIPT = Path(M.__file__)
REPO_ROOT = SCRIPT.parents[2]
README = SCRIPT.with_name("README.md")


class TmpDir(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()


# ============================================================================ atomic-write


class _WatchedOs:
    """`os` as main.py sees it, recording what survives a power cut depends on: every fsync
    (of a file: its inode and size at that moment; of a directory: its inode) and every rename
    (the source's inode and both paths)."""

    def __init__(self):
        self.events: list[tuple] = []

    def __getattr__(self, name: str):
        return getattr(os, name)

    def _sync(self, fd: int, real) -> None:
        info = os.fstat(fd)
        kind = "fsync dir" if stat.S_ISDIR(info.st_mode) else "fsync file"
        self.events.append((kind, info.st_ino, info.st_size))
        real(fd)

    def fsync(self, fd: int) -> None:
        self._sync(fd, os.fsync)

    def fdatasync(self, fd: int) -> None:
        self._sync(fd, os.fdatasync)

    def _move(self, src, dst, real) -> None:
        self.events.append(("rename", os.stat(src).st_ino, Path(src), Path(dst)))
        real(src, dst)

    def replace(self, src, dst) -> None:
        self._move(src, dst, os.replace)

    def rename(self, src, dst) -> None:
        self._move(src, dst, os.rename)


@exercise("atomic-write")
class TestAtomicWrite(TmpDir):
    def test_replaces_the_file_and_leaves_no_temporary_file(self):
        target = self.dir / "f"
        F.atomic_write_bytes(target, b"old")
        self.assertEqual(target.read_bytes(), b"old")
        F.atomic_write_bytes(target, b"")
        self.assertEqual(target.read_bytes(), b"")
        F.atomic_write_bytes(target, bytes(range(256)) * 64)
        self.assertEqual(target.read_bytes(), bytes(range(256)) * 64)
        self.assertEqual(sorted(p.name for p in self.dir.iterdir()), ["f"])

    def test_fsyncs_the_bytes_before_the_rename_and_the_directory_after(self):
        """A power cut after a rename of bytes still in the page cache can leave `f` empty;
        one after the rename but before the directory's fsync can lose the new name."""
        target, data = self.dir / "f", b"new bytes " * 1000
        F.atomic_write_bytes(target, b"old")
        watched = _WatchedOs()
        with mock.patch.object(F, "os", watched):
            F.atomic_write_bytes(target, data)
        events = watched.events
        renames = [index for index, event in enumerate(events) if event[0] == "rename"]
        self.assertEqual(len(renames), 1, f"exactly one os.replace expected: {events}")
        at = renames[0]
        _, inode, src, dst = events[at]
        self.assertEqual(Path(dst), target, "the rename's target")
        self.assertEqual(Path(src).parent, target.parent,
                         "the temporary file must be in the same directory (same filesystem)")
        self.assertEqual(Path(src).name, f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}",
                         "the temporary name must be unique per process and thread (asynchronous "
                         "saves write from threads)")
        synced = [event for event in events[:at] if event[:2] == ("fsync file", inode)]
        self.assertTrue(synced, f"the temporary file was not fsynced before the rename: {events}")
        self.assertEqual(synced[-1][2], len(data), "fsynced before the bytes were flushed to it")
        self.assertIn(("fsync dir", self.dir.stat().st_ino), [event[:2] for event in events[at:]],
                      f"the directory was not fsynced after the rename: {events}")
        self.assertEqual(target.read_bytes(), data)

    def test_fsync_directory_fsyncs_the_directory_itself(self):
        watched = _WatchedOs()
        with mock.patch.object(F, "os", watched):
            F.fsync_directory(self.dir)
        self.assertIn(("fsync dir", self.dir.stat().st_ino), [e[:2] for e in watched.events],
                      f"fsync_directory({self.dir}) did not fsync the directory: {watched.events}")

    def test_fsync_directory_closes_its_descriptor_even_when_fsync_fails(self):
        opened, closed = [], []

        class FailingOs(_WatchedOs):
            def open(self, *args, **kwargs):
                fd = os.open(*args, **kwargs)
                opened.append(fd)
                return fd

            def close(self, fd):
                closed.append(fd)
                os.close(fd)

            def fsync(self, fd):
                raise OSError(5, "Input/output error (injected)")
        with mock.patch.object(F, "os", FailingOs()), self.assertRaises(OSError):
            F.fsync_directory(self.dir)
        self.assertEqual((len(opened), closed), (1, opened),
                         "fsync_directory leaked its directory descriptor when fsync raised")

    def test_leaves_the_old_file_on_a_crash_before_the_rename(self):
        target = self.dir / "f"
        F.atomic_write_bytes(target, b"old")
        with mock.patch.object(F, "os", C._OsRenameCrash("f")), self.assertRaises(C.SimulatedCrash):
            F.atomic_write_bytes(target, b"new")
        self.assertEqual(target.read_bytes(), b"old")
        self.assertEqual(len(list(self.dir.glob(".f.tmp-*"))), 1)  # the fsynced temp file stays
        F.atomic_write_bytes(target, b"new")
        self.assertEqual(target.read_bytes(), b"new")


# ============================================================================ commit


def _plain_write(path: Path, data: bytes) -> None:
    Path(path).write_bytes(data)


def plain_writes():
    """main.py's atomic_write_bytes as a plain write: the commit's tests grade the ORDER of the
    protocol's writes, not the atomic write (its own exercise)."""
    return mock.patch.object(M, "atomic_write_bytes", _plain_write)


def load_plainly(ckpt: Path, world, reshard, fingerprint) -> tuple[dict, list[dict]]:
    """What `latest` names, read without main.py's verified load (its own exercise)."""
    try:
        step_dir = ckpt / (ckpt / M.LATEST).read_text().strip()
        manifest = json.loads((step_dir / M.MANIFEST).read_text())
        return manifest, [torch.load(step_dir / entry["name"], weights_only=True)
                          for entry in manifest["files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise M.CheckpointError(f"{ckpt}: broken ({type(exc).__name__}: {exc})") from None


@exercise("commit")
class TestCommit(TmpDir):
    def test_write_shard_writes_its_file_atomically_and_returns_its_entry(self):
        for rank, payload in ((1, b"payload"), (2, b"")):  # an empty shard is still a shard
            calls = []
            record = calls.append
            with mock.patch.object(M, "atomic_write_bytes", lambda p, d, record=record: record((Path(p), d))):
                entry = M.write_shard(self.dir, rank, 3, payload)
            name = f"shard-0000{rank}-of-00003.pt"
            self.assertEqual(calls, [(self.dir / name, payload)], f"rank {rank} of 3: the write")
            self.assertEqual(entry, {"name": name, "rank": rank, "bytes": len(payload),
                                     "sha256": hashlib.sha256(payload).hexdigest()},
                             f"rank {rank} of 3, {len(payload)} bytes: the manifest entry")

    def test_commit_writes_the_manifest_then_latest_then_rotates(self):
        ckpt, order = self.dir / "ck", []
        (ckpt / M.step_dir_name(7)).mkdir(parents=True)

        def write(path, data):
            order.append(Path(path).relative_to(ckpt).as_posix())
            _plain_write(path, data)

        def rotate(ckpt_dir, keep):
            order.append(f"rotate(keep={keep})")
            return []
        entries = [{"name": M.shard_name(rank, 2), "rank": rank, "bytes": 10 + rank,
                    "sha256": str(rank) * 64} for rank in (1, 0)]  # in arrival order
        with mock.patch.object(M, "atomic_write_bytes", write), mock.patch.object(M, "rotate", rotate):
            M.commit(ckpt, 7, 2, entries, "fp", keep=3)
        self.assertEqual(order, ["step-00000007/manifest.json", "latest", "rotate(keep=3)"],
                         "the manifest (step 7 complete), then latest (the run's commit point), "
                         "then rotation")
        manifest = json.loads((ckpt / M.step_dir_name(7) / M.MANIFEST).read_text())
        self.assertEqual(manifest, {"format_version": M.FORMAT_VERSION, "world_size": 2, "step": 7,
                                    "fingerprint": "fp", "files": entries[::-1]},
                         "the manifest of step 7: entries sorted by rank")
        self.assertEqual((ckpt / M.LATEST).read_bytes(), b"step-00000007\n",
                         "latest holds the step directory's name and a newline")

    def test_a_crash_between_the_commit_steps_leaves_a_loadable_checkpoint(self):
        points = [p for p in C.SAVE_CRASH_POINTS if "rename" not in p]  # the renames: atomic-write
        with plain_writes():
            checks = C.crash_during_save_checks(self.dir, tuple(points), load=load_plainly)
        self.assertEqual(len(checks), 3, "crash points between the commit's writes")
        for check in checks:
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_rotation_keeps_newest_by_step_number_not_time(self):
        ckpt = self.dir / "ck"
        with plain_writes():
            for step in (10, 2, 30, 4):  # written out of order: file times disagree with steps
                C.save_single(ckpt, step, keep=10)
        self.assertEqual(M.committed_steps(ckpt), [2, 4, 10, 30], "committed steps")
        (ckpt / M.step_dir_name(99)).mkdir()  # uncommitted leftover, newer than everything
        (ckpt / M.step_dir_name(1)).mkdir()  # uncommitted leftover, older
        removed = M.rotate(ckpt, 2)
        kept = M.committed_steps(ckpt)
        self.assertEqual(kept, [10, 30], f"rotate(keep=2) of steps [2, 4, 10, 30] (written in "
                         f"the order 10, 2, 30, 4) kept {kept}: expected the newest two, [10, 30]")
        self.assertEqual(removed, [2, 4], "rotate returns the removed committed steps, oldest first")
        self.assertFalse((ckpt / M.step_dir_name(1)).exists(), "an older uncommitted leftover must go")
        self.assertTrue((ckpt / M.step_dir_name(99)).exists(),
                        "a newer uncommitted leftover must stay (discard_newer_than's job)")
        self.assertEqual(M.rotate(ckpt, 5), [], "rotate(keep=5) with 2 committed removes nothing")
        self.assertEqual(M.committed_steps(ckpt), [10, 30], "committed after rotate(keep=5)")
        self.assertEqual(M.discard_newer_than(ckpt, 30), [M.step_dir_name(99)], "discard_newer_than(30)")
        with self.assertRaises(ValueError, msg="rotate(keep=0) must be refused"):
            M.rotate(ckpt, 0)

    def test_rotation_without_a_commit_removes_nothing(self):
        ckpt = self.dir / "ck"
        ckpt.mkdir()
        self.assertEqual(M.rotate(ckpt, 1), [], "rotate(keep=1) of an empty checkpoint directory")
        (ckpt / M.step_dir_name(0)).mkdir()  # the first save, half-written: nothing committed yet
        removed, left = M.rotate(ckpt, 1), sorted(p.name for p in ckpt.iterdir())
        self.assertEqual((removed, left), ([], [M.step_dir_name(0)]),
                         "rotate(keep=1) with no committed step and an uncommitted step-00000000/ "
                         "(no commit, so nothing is older than the newest commit): expected "
                         f"([], ['step-00000000']), got {(removed, left)}")

    def test_a_checkpoint_that_cannot_be_deleted_does_not_fail_the_rotation(self):
        """rotate runs after `latest` has moved: an exception there would report a committed
        save as failed ("latest and older checkpoints are untouched", which is then false)."""
        ckpt = self.dir / "ck"
        with plain_writes():
            for step in (1, 2, 3):
                C.save_single(ckpt, step, keep=10)
        leftover = ckpt / M.step_dir_name(0)  # uncommitted, older than the newest commit
        leftover.mkdir()
        (leftover / M.shard_name(0, 1)).write_bytes(b"half")
        real_unlink = os.unlink

        def unlink(path, *args, **kwargs):  # a shard file that cannot be deleted
            if Path(path).name.startswith("shard-"):
                raise PermissionError(errno.EACCES, "Permission denied (injected)", str(path))
            return real_unlink(path, *args, **kwargs)
        with mock.patch.object(os, "unlink", unlink):
            try:
                M.rotate(ckpt, 1)
                raised = None
            except OSError as exc:
                raised = exc
        self.assertIsNone(raised, "rotate(keep=1) of steps [1, 2, 3] plus an uncommitted "
                          "step-00000000/, every shard file undeletable: expected a best-effort "
                          f"removal (no exception), got {raised!r}")
        self.assertEqual((ckpt / M.LATEST).read_text(), "step-00000003\n", "latest after rotate")


# ============================================================================ verified-load


def refusal(function, *args) -> str:
    """"Type: message" of the exception `function(*args)` raised, or "accepted"."""
    try:
        function(*args)
    except Exception as exc:  # noqa: BLE001 (any exception is a result here)
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def committed_fixture(ckpt: Path, step: int, world: int = 1, fingerprint: str = "f",
                      state: dict | None = None) -> Path:
    """A committed checkpoint the test writes itself (plain writes, hashlib): `world` small
    shards, the manifest, `latest`; the verified-load tests need none of the learner's commit."""
    step_dir = ckpt / M.step_dir_name(step)
    step_dir.mkdir(parents=True)
    files = []
    for rank in range(world):
        buffer = io.BytesIO()
        torch.save(state if state is not None else {"rank": rank, "step": step}, buffer)
        data = buffer.getvalue()
        (step_dir / M.shard_name(rank, world)).write_bytes(data)
        files.append({"name": M.shard_name(rank, world), "rank": rank, "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()})
    (step_dir / M.MANIFEST).write_text(json.dumps(
        {"format_version": M.FORMAT_VERSION, "world_size": world, "step": step,
         "fingerprint": fingerprint, "files": files}))
    (ckpt / M.LATEST).write_text(M.step_dir_name(step) + "\n")
    return step_dir


@exercise("verified-load")
class TestVerifiedLoad(TmpDir):
    def test_every_damage_is_rejected_naming_the_file(self):
        step_dir = committed_fixture(self.dir / "ck", 5, world=3)
        checks = C.corrupt_and_expect(step_dir, self.dir, 3)
        self.assertEqual(len(checks), 9)
        for check in checks:
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_the_good_checkpoint_loads_and_bad_pointers_are_refused(self):
        ckpt = self.dir / "ck"
        committed_fixture(ckpt, 2, world=2)
        self.assertEqual(M.read_latest(ckpt), ckpt / M.step_dir_name(2))
        manifest, shards = M.load_latest(ckpt, 2, False, "f")
        self.assertEqual((manifest["step"], [s["rank"] for s in shards]), (2, [0, 1]))
        self.assertEqual(M.verify_checkpoint(M.read_latest(ckpt), 3, reshard=True)["world_size"], 2)
        self.assertEqual(M.verify_checkpoint(M.read_latest(ckpt), None)["step"], 2)
        for pointer, fragment in (("../../etc", "not a step directory"),
                                  ("step-00000009", "which is missing")):
            (ckpt / M.LATEST).write_text(pointer)
            with self.assertRaisesRegex(M.CheckpointError, fragment):
                M.read_latest(ckpt)
        (ckpt / M.LATEST).unlink()
        with self.assertRaisesRegex(M.CheckpointError, "holds no committed checkpoint"):
            M.read_latest(ckpt)
        with self.assertRaisesRegex(M.CheckpointError, "no such checkpoint directory"):
            M.read_latest(self.dir / "nothing")

    def test_a_broken_manifest_extra_shard_file_and_foreign_fingerprint(self):
        step_dir = committed_fixture(self.dir / "ck", 1, world=2)
        with self.assertRaisesRegex(M.CheckpointError, "belongs to another run"):
            M.verify_checkpoint(step_dir, 2, fingerprint="other")
        (step_dir / M.shard_name(0, 3)).write_bytes(b"x")
        with self.assertRaisesRegex(M.CheckpointError, "extra shard file"):
            M.verify_checkpoint(step_dir, 2)
        manifest = json.loads((step_dir / M.MANIFEST).read_text())
        for text, fragment in (("{not json", "not valid JSON"),
                               (json.dumps(dict(manifest, world_size="2")), "'world_size' missing"),
                               (json.dumps(dict(manifest, step=True)), "'step' missing")):
            (step_dir / M.MANIFEST).write_text(text)
            with self.assertRaisesRegex(M.CheckpointError,
                                        f"^{re.escape(str(step_dir / M.MANIFEST))}: .*{fragment}"):
                M.verify_checkpoint(step_dir, 2)

    def test_load_runs_no_pickled_code(self):
        """A shard that verifies (its hash is in the manifest) but holds a pickled object is
        refused by torch.load(weights_only=True), naming the file."""
        ckpt = self.dir / "ck"
        committed_fixture(ckpt, 1, state={"config": T.TrainConfig()})
        with self.assertRaisesRegex(M.CheckpointError, "shard-00000-of-00001.pt: cannot be deserialised"):
            M.load_latest(ckpt, 1, False, "f")
        # torch honours TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only where the call does not say
        # weights_only (torch/serialization.py): the docstring's explicit weights_only=True holds
        with mock.patch.dict(os.environ, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = refusal(M.load_latest, ckpt, 1, False, "f")
        self.assertIn("cannot be deserialised", got, "a shard holding a pickled TrainConfig, loaded "
                      "with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 set: expected the CheckpointError of "
                      "torch.load(weights_only=True)")

    def test_every_manifest_entry_is_checked_against_its_rank(self):
        """Damage the 2-rank manifest (or `latest`) one way at a time: each is refused with a
        CheckpointError that starts with the offending file and says why."""
        def entries(change):
            def apply(step_dir, manifest):
                change(manifest["files"])
            return apply

        def drop_rank_1(step_dir, manifest):
            manifest["files"] = manifest["files"][:1]
            (step_dir / M.shard_name(1, 2)).unlink()
        cases = [
            ("an entry without its sha256", entries(lambda f: f[0].pop("sha256")), M.MANIFEST,
             "needs name, rank, bytes and sha256"),
            ("the name '.'", entries(lambda f: f[0].update(name=".")), M.MANIFEST, "escapes"),
            ("the name '..'", entries(lambda f: f[0].update(name="..")), M.MANIFEST, "escapes"),
            ("a name with a backslash", entries(lambda f: f[0].update(name="..\\shard-00000-of-00002.pt")),
             M.MANIFEST, "escapes"),
            ("rank 0's file listed as rank 1's and rank 1's as rank 0's (sizes, hashes right)",
             entries(lambda f: (f[0].update(rank=1), f[1].update(rank=0))), M.MANIFEST,
             "is not the shard name"),
            ("a name of a 3-rank checkpoint", entries(lambda f: f[0].update(name=M.shard_name(0, 3))),
             M.MANIFEST, "is not the shard name"),
            ("a name that is no shard name", entries(lambda f: f[0].update(name="weights.pt")),
             M.MANIFEST, "is not the shard name"),
            ("no entry for rank 1 (its file gone too)", drop_rank_1, M.shard_name(1, 2), "missing shard"),
        ]
        for index, (label, damage, culprit, fragment) in enumerate(cases):
            with self.subTest(label):
                step_dir = committed_fixture(self.dir / f"case-{index}", 4, world=2)
                manifest = json.loads((step_dir / M.MANIFEST).read_text())
                damage(step_dir, manifest)
                (step_dir / M.MANIFEST).write_text(json.dumps(manifest))
                got = refusal(M.verify_checkpoint, step_dir, 2)
                self.assertTrue(got.startswith(f"CheckpointError: {step_dir / culprit}:") and fragment in got,
                                f"verify_checkpoint of a 2-rank checkpoint, manifest with {label}: expected "
                                f"CheckpointError('{step_dir / culprit}: ... {fragment} ...'), got {got}")
        step_dir = committed_fixture(self.dir / "a_list", 4, world=2)
        (step_dir / M.MANIFEST).write_text("[1, 2]")
        got = refusal(M.verify_checkpoint, step_dir, 2)
        self.assertTrue(got.startswith(f"CheckpointError: {step_dir / M.MANIFEST}:"),
                        f"a manifest that is a JSON list, not an object: expected a CheckpointError "
                        f"naming {step_dir / M.MANIFEST}, got {got}")
        ckpt = self.dir / "a_list"
        (ckpt / M.LATEST).write_bytes(b"\xff\xfestep-00000004\n")
        got = refusal(M.read_latest, ckpt)
        self.assertTrue(got.startswith("CheckpointError: ") and "is not a step directory name" in got,
                        "`latest` holding bytes that are not UTF-8: expected CheckpointError('... is "
                        f"not a step directory name ...'), got {got}")

    def test_load_latest_verifies_with_its_own_arguments(self):
        ckpt = self.dir / "ck"
        committed_fixture(ckpt, 2, world=2)
        for args, fragment in (((2, False, "other"), "belongs to another run"),
                               ((3, False, "f"), "pass --reshard"),
                               ((1, False, "f"), "pass --reshard")):
            got = refusal(M.load_latest, ckpt, *args)
            self.assertIn(fragment, got, f"load_latest(ckpt, world={args[0]}, reshard={args[1]}, "
                          f"fingerprint={args[2]!r}) of a 2-rank checkpoint of run 'f': expected "
                          f"CheckpointError('... {fragment} ...'), got {got}")
        manifest, shards = M.load_latest(ckpt, 3, True, "f")
        self.assertEqual((manifest["world_size"], [s["rank"] for s in shards]), (2, [0, 1]),
                         "load_latest(ckpt, world=3, reshard=True, 'f') of a 2-rank checkpoint")


# ============================================================================ failure-safe-save


@exercise("failure-safe-save")
class TestCheckpointerAgreement(unittest.TestCase):
    """Two saves through `Checkpointer` on 3 spawned ranks (one launch for the class), on the
    world (an odd size) and on the subgroup {1, 2} with rank 0 idle (`group=`: group rank 0,
    who commits, is global rank 1), with the shard writes and the commit replaced by recorders
    (tests/workers.py): only the agreement, `_commit_everywhere`, is graded. A save that fails
    anywhere commits nothing, and every rank raises the same CheckpointError naming the
    failing group rank."""

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as tmp:
            cls.per_rank = launch(W.checkpointer_votes, 3, (tmp,), device="cpu", timeout_s=120)

    def runs(self, failure):
        """(where, run) for every rank of every configuration (world of 3, subgroup {1, 2})."""
        for layout in ("world", "subgroup"):
            for rank, results in enumerate(self.per_rank):
                for run in results[layout] or ():
                    if run["failure"] == failure:
                        where = (f"{layout} ({run['size']} ranks), global rank {rank} = group rank "
                                 f"{run['group_rank']}, {'async' if run['async'] else 'sync'}")
                        yield layout, where, run

    def test_the_subgroup_ran_on_its_ranks_only(self):
        self.assertEqual([r["subgroup"] is None for r in self.per_rank], [True, False, False],
                         "the subgroup {1, 2}: rank 0 idle, ranks 1 and 2 saving")
        self.assertEqual(sorted({run["group_rank"] for r in self.per_rank[1:] for run in r["subgroup"]}),
                         [0, 1], "group ranks of global ranks 1 and 2")

    def test_without_failures_group_rank_0_commits_every_save_with_every_rank(self):
        for _layout, where, run in self.runs(None):
            with self.subTest(where):
                self.assertEqual(run["errors"], [None, None], f"{where}: no save may fail")
                size = run["size"]
                expected = [{"in": "the checkpointer's directory", "step": step, "world": size,
                             "fingerprint": "fp", "keep": 2, "ranks": list(range(size))}
                            for step in (1, 2)] if run["group_rank"] == 0 else []
                self.assertEqual(run["commits"], expected, f"{where}: only group rank 0 commits, "
                                 "into the checkpointer's directory, "
                                 "with every group rank's entry in group-rank order and the group's size")

    def test_a_failed_write_on_any_rank_commits_nothing_and_every_rank_raises(self):
        for layout, size in (("world", 3), ("subgroup", 2)):
            for fail_rank in range(size):
                messages = set()
                for _, where, run in self.runs(f"rank {fail_rank}"):
                    if run["size"] != size:
                        continue
                    with self.subTest(where, fail_rank=fail_rank):
                        self.assertNotIn(2, [commit["step"] for commit in run["commits"]],
                                         f"{where}: step 2 was committed although group rank "
                                         f"{fail_rank}'s write failed")
                        self.assertEqual(run["commits"], [{"in": "the checkpointer's directory",
                                                           "step": 1, "world": size, "fingerprint": "fp",
                                                           "keep": 2, "ranks": list(range(size))}]
                                         if run["group_rank"] == 0 else [],
                                         f"{where}: the commits made (only step 1, by group rank 0)")
                        first, second = run["errors"]
                        self.assertIsNone(first, f"{where}: step 1 must succeed")
                        self.assertIsNotNone(second, f"{where}: the failed save of step 2 was not "
                                             f"reported on this rank (group rank {fail_rank} failed)")
                        for fragment in (f"{M.step_dir_name(2)}: not saved", f"rank {fail_rank}: OSError",
                                         "latest and older checkpoints are untouched"):
                            self.assertIn(fragment, second, f"{where}: the error message")
                        messages.add((run["async"], second.split(M.step_dir_name(2))[-1]))
                self.assertEqual(len(messages), 2, f"{layout}, group rank {fail_rank} failing: not "
                                 f"the same message on every rank: {messages}")

    def test_a_failed_commit_raises_on_every_rank(self):
        for _layout, where, run in self.runs("commit"):
            with self.subTest(where):
                self.assertEqual([commit["step"] for commit in run["commits"]],
                                 [1] if run["group_rank"] == 0 else [],
                                 f"{where}: commits made (step 2's commit fails)")
                self.assertIsNone(run["errors"][0], f"{where}: step 1 must succeed")
                self.assertIn("rank 0 (commit): OSError", run["errors"][1] or "no error raised",
                              f"{where}: step 2's failed commit must be reported on every rank")


# ============================================================================ exact-resume


def resumable_run(steps: int = 8, save_at: int = 4, resume: dict | None = None) -> tuple[list, dict]:
    """A tiny run with every piece exact resume must bring back: SGD under
    LambdaLR(cosine_with_warmup), a GradScaler that grows every 2 clean steps, a DataCursor,
    and draws from Python's and torch's RNGs. Returns per step (LR, loss scale, batch, Python
    draw, torch draw) and the state `exact_resume_state` saved at `save_at`, or resumes from
    `resume` (restored after seeding differently: only the saved streams can continue)."""
    torch.manual_seed(11 if resume else 5)
    random.seed(11 if resume else 5)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, R.cosine_with_warmup(3, steps))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    cursor = R.DataCursor(12, 4, seed=3)
    step, saved, trace = 0, None, []
    if resume is not None:
        step = R.restore_exact_resume_state(resume, optimizer, scheduler, scaler, cursor, "cpu")
    while step < steps:
        trace.append({"lr": optimizer.param_groups[0]["lr"], "scale": scaler.get_scale(),
                      "batch": cursor.next_indices().tolist(), "python": random.random(),
                      "torch": torch.rand(1).item()})
        optimizer.zero_grad()
        scaler.scale((param * 0.01).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1
        if step == save_at:  # through the bytes, as a checkpoint holds it
            saved = torch.load(io.BytesIO(M.serialize(R.exact_resume_state(
                step, optimizer, scheduler, scaler, cursor, "cpu"))), weights_only=True)
    return trace, saved


@exercise("exact-resume")
class TestExactResume(unittest.TestCase):
    def test_a_resumed_run_continues_exactly(self):
        trace, saved = resumable_run()
        self.assertEqual(saved["step"], 4)
        resumed, _ = resumable_run(resume=saved)
        self.assertEqual(len(resumed), 4, "restore_exact_resume_state must return the saved step")
        for key, what in (("lr", "the LR (restore the scheduler and write its LR back)"),
                          ("scale", "the GradScaler's scale"), ("batch", "the data cursor"),
                          ("python", "Python's RNG"), ("torch", "torch's RNG")):
            with self.subTest(piece=key):
                got, want = [t[key] for t in resumed], [t[key] for t in trace[4:]]
                first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), 0)
                self.assertTrue(got == want, f"after resuming, {what} differs from the "
                                f"uninterrupted run from resumed step {first} on: "
                                f"{got[first:first + 2]} != {want[first:first + 2]}")

    def test_the_grad_scaler_matters_only_under_fp16_overflow(self):
        for check in C.scaler_checks("cpu"):
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_rng_state_touches_no_cuda_device_unless_asked(self):
        with mock.patch.object(torch.cuda, "get_rng_state_all") as every_device, \
                mock.patch.object(torch.cuda, "get_rng_state") as one_device:
            state = R.rng_state("cpu")
            R.set_rng_state(state, "cpu")
            self.assertNotIn("cuda", state)
            every_device.assert_not_called()
            one_device.assert_not_called()
            one_device.return_value = torch.zeros(16, dtype=torch.uint8)
            self.assertIn("cuda", R.rng_state(torch.device("cuda", 3)))
            one_device.assert_called_once_with(torch.device("cuda", 3))
            every_device.assert_not_called()

    def test_every_param_group_gets_its_own_lr_back_in_place(self):
        def build():
            params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
            optimizer = torch.optim.SGD([{"params": params[:1], "lr": 0.1},
                                         {"params": params[1:], "lr": 0.03}], lr=1.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, [R.cosine_with_warmup(2, 8), R.cosine_with_warmup(4, 8)])
            return optimizer, scheduler
        optimizer, scheduler = build()
        for _ in range(3):
            optimizer.step()
            scheduler.step()
        want = [group["lr"] for group in optimizer.param_groups]
        state = torch.load(io.BytesIO(M.serialize(R.exact_resume_state(
            3, optimizer, scheduler, None, R.DataCursor(4, 2, 0)))), weights_only=True)
        optimizer, scheduler = build()
        groups, cursor = optimizer.param_groups, R.DataCursor(4, 2, 0)
        self.assertEqual(R.restore_exact_resume_state(state, optimizer, scheduler, None, cursor), 3,
                         "restore returns the saved step")
        self.assertEqual([group["lr"] for group in optimizer.param_groups], want,
                         "two param groups with their own base LR and schedule: each group's LR")
        self.assertIs(optimizer.param_groups, groups, "restore must update the param groups in place")

    def test_restore_rng_false_leaves_the_generators_alone(self):
        saved = torch.load(io.BytesIO(M.serialize(R.exact_resume_state(
            1, *self._tiny(), None, R.DataCursor(4, 2, 0)))), weights_only=True)
        random.seed(123)
        torch.manual_seed(123)
        R.restore_exact_resume_state(saved, *self._tiny(), None, R.DataCursor(4, 2, 0),
                                     restore_rng=False)
        got = (random.random(), torch.rand(1).item())
        random.seed(123)
        torch.manual_seed(123)
        self.assertEqual(got, (random.random(), torch.rand(1).item()),
                         "restore_rng=False (resharding) must not touch Python's or torch's RNG")

    def test_the_cuda_generator_of_the_given_device_is_saved_and_restored(self):
        """No GPU here: torch.cuda's generator calls are recorders (the CPU generators are real).
        The state saved for cuda:3 holds that device's generator, and restoring it for cuda:3
        sets that generator; a CPU (or no) device, or a state without one, touches no CUDA."""
        device, cuda_state = torch.device("cuda", 3), torch.arange(16, dtype=torch.uint8)

        def restored(calls) -> list:
            """(the state passed is the saved one, the device) per torch.cuda.set_rng_state call."""
            return [((c.args or [c.kwargs.get("new_state")])[0] is cuda_state,
                     torch.device(c.args[1] if len(c.args) > 1 else c.kwargs.get("device", "cuda")))
                    for c in calls]
        with mock.patch.object(torch.cuda, "get_rng_state", return_value=cuda_state) as get_one, \
                mock.patch.object(torch.cuda, "set_rng_state") as set_one:
            state = R.exact_resume_state(1, *self._tiny(), None, R.DataCursor(4, 2, 0), device)
            self.assertEqual(sorted(state["rng"]), ["cuda", "python", "torch"],
                             "exact_resume_state(..., device=cuda:3): the RNG states saved")
            self.assertIs(state["rng"]["cuda"], cuda_state, "the saved CUDA state is cuda:3's")
            self.assertEqual([torch.device(*c.args) for c in get_one.call_args_list], [device],
                             "exact_resume_state(..., device=cuda:3) reads cuda:3's generator, once")
            R.restore_exact_resume_state(state, *self._tiny(), None, R.DataCursor(4, 2, 0), device)
            self.assertEqual(restored(set_one.call_args_list), [(True, device)],
                             "restore_exact_resume_state(..., device=cuda:3): expected one "
                             "torch.cuda.set_rng_state(the saved state, cuda:3), got "
                             f"{restored(set_one.call_args_list)}")
            set_one.reset_mock()
            without = {key: value for key, value in state["rng"].items() if key != "cuda"}
            for rng, where, label in ((state["rng"], "cpu", "a CUDA state restored on the CPU"),
                                      (state["rng"], None, "a CUDA state restored without a device"),
                                      (without, device, "a CPU-only state restored on cuda:3")):
                R.set_rng_state(rng, where)
                self.assertEqual(restored(set_one.call_args_list), [],
                                 f"set_rng_state: {label} must not set a CUDA generator")

    @staticmethod
    def _tiny():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def test_restore_refuses_a_different_number_of_param_groups(self):
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        cursor = R.DataCursor(4, 2, 0)
        state = R.exact_resume_state(3, optimizer, scheduler, None, cursor)
        self.assertEqual(set(state), {"step", "scheduler", "lr", "scaler", "cursor", "rng"},
                         "the keys of exact_resume_state")
        self.assertIsNone(state["scaler"], "no scaler: None is saved")
        state["lr"] = [0.1, 0.2]
        with self.assertRaises(ValueError, msg="2 saved LRs for 1 param group must be refused"):
            R.restore_exact_resume_state(state, optimizer, scheduler, None, cursor)


# ============================================================================ integration


class TestProtocolTogether(TmpDir):
    """The reference pieces together (and the harness's own checks)."""

    def test_every_crash_point_is_safe(self):
        checks = C.crash_during_save_checks(self.dir)
        self.assertEqual(len(checks), len(C.SAVE_CRASH_POINTS))
        for check in checks:
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_the_crash_checks_catch_latest_moved_before_the_manifest(self):
        def latest_first(ckpt_dir, step, world, entries, fingerprint, keep):
            M.atomic_write_bytes(ckpt_dir / M.LATEST, (M.step_dir_name(step) + "\n").encode())
            M.atomic_write_bytes(ckpt_dir / M.step_dir_name(step) / M.MANIFEST, json.dumps(
                {"format_version": 1, "world_size": world, "step": step,
                 "fingerprint": fingerprint, "files": entries}).encode())
        with mock.patch.object(M, "commit", latest_first):
            failed = [c.name for c in C.crash_during_save_checks(self.dir) if not c.passed]
        self.assertIn("crash at 'shard in place, before the manifest' leaves a loadable checkpoint",
                      failed)

    def test_the_damage_checks_refuse_a_checkpoint_our_commit_wrote(self):
        step_dir = C.save_single(self.dir / "ck", 5, keep=10, world=3)
        failed = [f"{c.name}: {c.detail}" for c in C.corrupt_and_expect(step_dir, self.dir, 3)
                  if not c.passed]
        self.assertEqual(failed, [], "damaged copies of a checkpoint our commit wrote (3 ranks)")

    def test_export_round_trip_and_failures(self):
        tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.float64)}
        path = self.dir / "m.safetensors"
        self.assertEqual(F.export_safetensors(tensors, path), path.stat().st_size)
        with self.assertRaisesRegex(M.CheckpointError, "empty"):
            F.export_safetensors({}, self.dir / "e.safetensors")
        with self.assertRaisesRegex(M.CheckpointError, "differs from the live model"):
            F.verify_export(dict(tensors, a=tensors["a"] + 1), path)
        (self.dir / "t.safetensors").write_bytes(path.read_bytes()[:-4])
        with self.assertRaisesRegex(M.CheckpointError, "expected 8 \\+"):
            F.verify_export(tensors, self.dir / "t.safetensors")
        check = C.empty_export_check(self.dir, T.TrainConfig(), tensors)
        self.assertTrue(check.passed, check.detail)

    def test_reshard_sizes_no_world_divides_and_empty_shards(self):
        for numel, saved, world in ((7, 3, 2), (2, 3, 5), (5, 4, 3), (0, 2, 3)):
            full = torch.arange(float(numel))
            slices = [full[slice(*T.zero.shard_bounds(numel, saved, r))] for r in range(saved)]
            got = [R.reshard(slices, world, r) for r in range(world)]
            self.assertEqual(torch.cat(got).tolist(), full.tolist(),
                             f"{numel} elements saved by {saved} ranks, resharded to {world}")
            self.assertEqual([g.numel() for g in got],
                             [b - a for a, b in (T.zero.shard_bounds(numel, world, r) for r in range(world))],
                             f"{numel} elements on {world} ranks: lesson 03's shard sizes (some empty)")

    def test_save_time_from_bytes_and_bandwidth(self):
        self.assertEqual(R.save_seconds(70e9, 14, 10e9), 98.0, "70B params x 14 B at 10 GB/s")

    def test_cursor_and_schedule(self):
        cursor = R.DataCursor(12, 4, 0)
        seen = torch.cat([cursor.next_indices() for _ in range(3)])
        self.assertEqual(sorted(seen.tolist()), list(range(12)))
        self.assertEqual(cursor.state_dict(), {"epoch": 1, "position": 0})
        factor = R.cosine_with_warmup(2, 10)
        self.assertEqual([factor(0), factor(1)], [0.5, 1.0])
        self.assertAlmostEqual(factor(10), 0.0)

    def test_the_first_resumed_step_needs_the_saved_lr(self):
        for check in C.lr_checks():
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_main_keeps_the_names_later_lessons_import(self):
        """Lessons 10 and 13 import these from main.py; those of atomic_file.py and
        exact_resume.py are the same objects, so a patch or a stub in either place is seen."""
        for name in ("Checkpointer", "load_latest", "LATEST", "step_dir_name", "serialize",
                     "committed_steps", "discard_newer_than"):
            self.assertTrue(hasattr(M, name), name)
        for module, names in ((F, ("CheckpointError", "atomic_write_bytes", "sha256_hex",
                                   "export_safetensors", "verify_export")),
                              (R, ("cosine_with_warmup", "rng_state", "set_rng_state"))):
            for name in names:
                self.assertIs(getattr(M, name), getattr(module, name), name)


class TestOnSpawnedRanks(unittest.TestCase):
    """One run saved by 3 ranks, resumed on 2 (resharding 3 -> 2) and in this process (3 -> 1);
    then, on the same 2 ranks, real training runs whose write fails on one rank. The demo test
    below reshards 2 -> 3, the torchrun one 2 -> 1."""

    @classmethod
    def setUpClass(cls):
        config = T.TrainConfig(steps=6)
        plain = dataclasses.replace(config, noise=False)
        cls.reference = T.reference_params(plain)
        with tempfile.TemporaryDirectory() as tmp:
            launch(W.save_at, 3, (dataclasses.asdict(config), tmp, 3), device="cpu", timeout_s=120)
            cls.unsharded = T.resume_unsharded(plain, Path(tmp))
            cls.per_rank = launch(W.resume_resharded_then_fail_saves, 2,
                                  (dataclasses.asdict(config), tmp, 2), device="cpu", timeout_s=180)

    def test_3_to_2_and_3_to_1_equal_the_unsharded_reference(self):
        for result in [r["resumed"] for r in self.per_rank] + [self.unsharded]:
            self.assertEqual(result["resumed_from"], 3)
            self.assertLess(max_abs_diff(result["params"], self.reference), C.RESHARD_TOLERANCE,
                            f"resharded from 3 ranks (resumed at {result['resumed_from']}) vs one process")
        self.assertEqual(self.unsharded["saved_world"], 3)

    def test_a_failed_write_in_a_real_run_commits_nothing(self):
        for rank, result in enumerate(self.per_rank):
            for run, (fail_rank, async_save) in zip(result["failed"], W.FULL_STACK_FAILURES,
                                                    strict=True):
                with self.subTest(rank=rank, fail_rank=fail_rank, async_save=async_save):
                    self.assertIsNotNone(run["error"], "the failed save was not reported")
                    self.assertIn(f"rank {fail_rank}: OSError", run["error"])
                    self.assertIn("latest and older checkpoints are untouched", run["error"])
                    self.assertEqual(run["latest"], M.step_dir_name(2))
                    self.assertEqual(run["committed"], [2])


def main_in_process(*argv: str) -> tuple[int, str]:
    """checks.main (what `python main.py ...` runs) in this process: its ranks come from this
    process's forkserver, so no interpreter starts. Returns (exit code, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = C.main(list(argv))
    return code, stderr.getvalue()


class TestCommandLine(unittest.TestCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--keep", "0"], "out of range")
        assert_argument_error(self, C.parse_args, ["--resume"], "need --ckpt-dir")
        assert_argument_error(self, C.parse_args, ["--batch", "10"], "not divisible")
        assert_argument_error(self, C.parse_args, ["--keep", "3"], "more saves than --keep")
        assert_argument_error(self, C.parse_args, ["--steps", "9", "--keep", "1"],
                              "a kept save before the last step")
        assert_argument_error(self, C.parse_args, ["--device", "tpu"], "invalid choice")

    def test_missing_corrupt_and_foreign_directories_give_one_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            foreign = Path(tmp) / "foreign"
            foreign.mkdir()
            (foreign / "notes.txt").write_text("hello")
            corrupt = Path(tmp) / "corrupt"
            step_dir = C.save_single(corrupt, 3, fingerprint=T.TrainConfig().fingerprint())
            (step_dir / M.shard_name(0, 1)).write_bytes(b"garbage")
            for directory, fragment in ((Path(tmp) / "missing", "no such checkpoint directory"),
                                        (foreign, "holds no committed checkpoint"),
                                        (corrupt, "bytes, the manifest says")):
                # refused before any rank starts
                code, stderr = main_in_process("--ckpt-dir", str(directory), "--resume",
                                               "--world-size", "1", "--device", "cpu")
                self.assertEqual(code, 1)
                self.assertEqual(len(stderr.strip().splitlines()), 1, stderr)
                self.assertIn(fragment, stderr)


# the demo's defaults, spelled out: the SIGKILL test's runs must train exactly what the demo did
DEMO_ARGS = ("--steps", "10", "--save-every", "3", "--keep", "2", "--world-size", "2",
             "--device", "cpu")


class TestDemo(unittest.TestCase):
    """The demo once, in this process (the script's own entry point runs under torchrun
    below); its uninterrupted run is also the reference of the SIGKILL test."""

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as tmp:
            cls.code, cls.stderr = main_in_process(*DEMO_ARGS, "--timeout", "180",
                                                   "--json", f"{tmp}/r.json")
            cls.report = json.loads(Path(f"{tmp}/r.json").read_text()) \
                if Path(f"{tmp}/r.json").exists() else None

    def test_demo_passes_every_check(self):
        self.assertIsNotNone(self.report, self.stderr[-2000:])
        failed = [c for c in self.report["checks"] if not c["passed"]]
        self.assertEqual(self.code, 0, failed)
        self.assertEqual(failed, [])
        names = [c["name"] for c in self.report["checks"]]
        self.assertGreaterEqual(len(names), 28, f"the demo's checks: {names}")
        self.assertEqual(self.report["metrics"]["resumed_from_step"], 6)
        self.assertIn("resharded 2 -> 3 ranks == unsharded reference", names)
        self.assertIn("a failed write (rank 1, step 6, async, keep 1) commits nothing", names)

    def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(self):
        """A real run (`python main.py --ckpt-dir ...`, its ranks with it) killed mid-run, then
        resumed (in this process) to the parameters of the demo's uninterrupted run of the same
        configuration. Bitwise between two runs on THIS machine: another CPU's kernels may
        round differently."""
        self.assertIsNotNone(self.report, self.stderr[-2000:])
        expected = self.report["metrics"]["final_param_sha256"]
        with tempfile.TemporaryDirectory() as tmp:
            victim = subprocess.Popen([sys.executable, str(SCRIPT), "--ckpt-dir", f"{tmp}/k",
                                       *DEMO_ARGS, "--sleep-per-step", "0.3"], cwd=REPO_ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
            try:
                deadline = time.monotonic() + 120
                while not (Path(tmp) / "k" / M.LATEST).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.assertTrue((Path(tmp) / "k" / M.LATEST).exists(), "no checkpoint appeared")
                time.sleep(random.uniform(0.0, 1.5))  # somewhere mid-run, maybe mid-save
                self.assertIsNone(victim.poll(), "the run ended before it could be killed")
                os.killpg(victim.pid, signal.SIGKILL)
            finally:
                if victim.poll() is None:
                    os.killpg(victim.pid, signal.SIGKILL)
                victim.wait(timeout=30)
            code, stderr = main_in_process("--ckpt-dir", f"{tmp}/k", *DEMO_ARGS, "--resume",
                                           "--json", f"{tmp}/k.json")
            self.assertEqual(code, 0, stderr)
            got = json.loads(Path(f"{tmp}/k.json").read_text())["metrics"]
        self.assertGreater(got["resumed_from_step"], 0,
                           "the killed run must have left a checkpoint to resume from")
        self.assertEqual(got["final_param_sha256"], expected)

    @torchrun_demo(["--timeout", "180"])
    def test_under_torchrun_every_rank_shares_one_directory(self, report):
        """torchrun --standalone --nproc-per-node=2 on CPU: rank 0 chooses the directory and
        broadcasts it; resharding runs 2 -> 1 in each process (torchrun fixes the world size)."""
        failed = [c for c in report["checks"] if not c["passed"]]
        self.assertTrue(report["passed"], failed)
        self.assertEqual(report["world_size"], 2)
        self.assertIn("resharded 2 -> 1 process (each rank) == unsharded reference",
                      [c["name"] for c in report["checks"]])


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed (machine-independent: sizes,
    float64 Python arithmetic, and fp16 decisions with a wide margin)."""

    readme = " ".join(README.read_text().split())  # line breaks do not matter

    def test_model_and_export_sizes(self):
        from safetensors.torch import save
        model = T.data_parallel.make_model(0)
        psi = sum(p.numel() for p in model.parameters())
        self.assertIn(f"{psi:,} float64 parameters", self.readme)
        data = save({k: v.detach() for k, v in model.named_parameters()})
        header = int.from_bytes(data[:8], "little")
        self.assertEqual(len(data), F.safetensors_file_bytes(header, psi * 8))
        self.assertIn(f"{len(data):,} bytes: 8 (header length) + {header} (JSON header) + "
                      f"{psi:,} x 8 (data)", self.readme)

    def test_rotation_and_resume_steps(self):
        config = T.TrainConfig()
        kept = C.kept_steps(config.steps, 3, 2)
        self.assertEqual(kept, [6, 9])
        self.assertIn("saves at steps 3, 6 and 9", self.readme)
        self.assertIn("rotation removes step 3 and keeps steps 6 and 9", self.readme)

    def test_metadata_only_export(self):
        with tempfile.TemporaryDirectory() as tmp:
            size = C.metadata_only_export(Path(tmp) / "e.safetensors", T.TrainConfig()).stat().st_size
        self.assertIn(f"a {size}-byte file", self.readme)

    def test_lr_of_the_first_resumed_step(self):
        wrong, right = C.lr_of_first_resumed_step(restore_lr=False)
        self.assertIn(f"{wrong:.4f} instead of {right:.4f}", self.readme)

    def test_save_cost_at_scale(self):
        self.assertIn(f"**{70e9 * 14 / 1e9:,.0f} GB**, **{R.save_seconds(70e9, 14, 10e9):.0f} s** at "
                      "an aggregate 10 GB/s", self.readme)
        self.assertIn("14 bytes per parameter (16-bit weights 2, fp32 master 4, m 4, v 4", self.readme)

    def test_checkpoint_interval(self):
        young = R.young_interval(60, 86400)
        daly = R.daly_interval(60, 86400)
        self.assertEqual(round(young), 3220)
        self.assertIn(f"{young:,.0f} s", self.readme)
        self.assertIn(f"{daly:,.0f} s", self.readme)
        saves = 25 * 3600 / young
        self.assertIn(f"about {saves:.0f} saves", self.readme)
        self.assertIn(f"{100 * math.sqrt(2 * 60 / 86400):.1f}%", self.readme)
        for c, m, want, half_unit in C.DALY_EXAMPLES:
            self.assertLessEqual(abs(R.daly_interval(c, m) - want), half_unit,
                                 f"Daly's optimum for C={c}, M={m} min: {R.daly_interval(c, m):.2f}, "
                                 f"paper {want}")

    def test_scaler_story(self):
        full, saved, skipped = C.scaler_run(torch.float16, {1: 96.0, 5: 48.0}, 10_000)
        _, _, forgot = C.scaler_run(torch.float16, {1: 96.0, 5: 48.0}, 10_000, resume=saved,
                                    restore_scaler=False)
        self.assertEqual((skipped, forgot), ([1], [5]))
        self.assertIn("skips step 5 as well", self.readme)


if __name__ == "__main__":
    unittest.main()
