"""Lesson 06's suite: atomic writes and the protocol's crash points, every rejection, rotation,
the export, resharding 4 -> 2 and 2 -> 3, the demo end to end, and a real SIGKILL + resume."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error

M = importlib.import_module("lessons.06_checkpointing.main")
W = importlib.import_module("lessons.06_checkpointing.tests.workers")
SCRIPT = Path(M.__file__)
REPO_ROOT = SCRIPT.parents[2]


def fake_checkpoint(ckpt: Path, step: int, world: int, keep: int = 10,
                    fingerprint: str = "fp") -> Path:
    """A committed checkpoint of `world` tiny shards (no process group needed)."""
    step_dir = ckpt / M.step_dir_name(step)
    step_dir.mkdir(parents=True)
    entries = [M.write_shard(step_dir, rank, world, M.serialize({"rank": rank, "step": step}))
               for rank in range(world)]
    M.commit(ckpt, step, world, entries, fingerprint, keep)
    return step_dir


class TestProtocol(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def test_atomic_write_leaves_old_file_on_crash(self):
        target = self.dir / "f"
        M.atomic_write_bytes(target, b"old")
        with self.assertRaises(M.SimulatedCrash):
            M.atomic_write_bytes(target, b"new", crash_at="f:written")
        self.assertEqual(target.read_bytes(), b"old")
        M.atomic_write_bytes(target, b"new")
        self.assertEqual(target.read_bytes(), b"new")

    def test_every_crash_point_is_safe(self):
        checks = M.crash_during_save_checks(self.dir)
        self.assertEqual(len(checks), len(M.SAVE_CRASH_POINTS))
        for check in checks:
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_every_damage_is_rejected_naming_the_file(self):
        step_dir = fake_checkpoint(self.dir / "ck", 5, 3)
        checks = M.corrupt_and_expect(step_dir, self.dir, 3)
        self.assertGreaterEqual(len(checks), 9)
        for check in checks:
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_the_good_checkpoint_verifies_and_bad_pointers_are_refused(self):
        ckpt = self.dir / "ck"
        fake_checkpoint(ckpt, 2, 2)
        self.assertEqual(M.verify_checkpoint(M.read_latest(ckpt), 2)["step"], 2)
        for pointer, fragment in (("../../etc", "not a step directory"),
                                  ("step-00000009", "which is missing")):
            (ckpt / M.LATEST).write_text(pointer)
            with self.assertRaisesRegex(M.CheckpointError, fragment):
                M.read_latest(ckpt)
        with self.assertRaisesRegex(M.CheckpointError, "no such checkpoint directory"):
            M.read_latest(self.dir / "nothing")

    def test_extra_shard_file_and_foreign_fingerprint(self):
        step_dir = fake_checkpoint(self.dir / "ck", 1, 2)
        with self.assertRaisesRegex(M.CheckpointError, "belongs to another run"):
            M.verify_checkpoint(step_dir, 2, fingerprint="other")
        (step_dir / M.shard_name(0, 3)).write_bytes(b"x")
        with self.assertRaisesRegex(M.CheckpointError, "extra shard file"):
            M.verify_checkpoint(step_dir, 2)

    def test_rotation_keeps_newest_by_step_number_not_time(self):
        ckpt = self.dir / "ck"
        for step in (10, 2, 30, 4):  # written out of order: file times disagree with steps
            fake_checkpoint(ckpt, step, 1)
        (ckpt / M.step_dir_name(99)).mkdir()  # uncommitted leftover, newer than everything
        (ckpt / M.step_dir_name(1)).mkdir()  # uncommitted leftover, older
        removed = M.rotate(ckpt, 2)
        self.assertEqual(sorted(removed), [2, 4])
        self.assertEqual(M.committed_steps(ckpt), [10, 30])
        self.assertFalse((ckpt / M.step_dir_name(1)).exists())
        with self.assertRaises(ValueError):
            M.rotate(ckpt, 0)

    def test_export_round_trip_and_failures(self):
        tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.float64)}
        size = M.export_safetensors(tensors, self.dir / "m.safetensors")
        self.assertEqual(size, (self.dir / "m.safetensors").stat().st_size)
        with self.assertRaisesRegex(M.CheckpointError, "empty"):
            M.export_safetensors({}, self.dir / "e.safetensors")
        tampered = dict(tensors, a=tensors["a"] + 1)
        with self.assertRaisesRegex(M.CheckpointError, "differs from the live model"):
            M.verify_export(tampered, self.dir / "m.safetensors")

    def test_cursor_and_schedule(self):
        cursor = M.DataCursor(12, 4, 0)
        seen = torch.cat([cursor.next_indices() for _ in range(3)])
        self.assertEqual(sorted(seen.tolist()), list(range(12)))
        self.assertEqual(cursor.state_dict(), {"epoch": 1, "position": 0})
        factor = M.cosine_with_warmup(2, 10)
        self.assertEqual([factor(0), factor(1)], [0.5, 1.0])
        self.assertAlmostEqual(factor(10), 0.0)

    def test_readme_numbers(self):
        readme = SCRIPT.with_name("README.md").read_text()
        psi = sum(p.numel() for p in M.DP.make_model(0).parameters())
        self.assertIn(f"{psi:,} float64 parameters", readme)
        from safetensors.torch import save
        data = save({k: v.detach() for k, v in M.DP.make_model(0).named_parameters()})
        header = int.from_bytes(data[:8], "little")
        self.assertIn(f"{len(data):,} bytes: 8 (header length) + {header}", readme)
        self.assertIn("steps 3 and 6", readme)


class TestResharding(unittest.TestCase):
    """4 -> 2 here; the demo test below runs on 2 ranks and reshards 2 -> 3."""

    def test_4_to_2(self):
        config = dataclasses.asdict(M.TrainConfig(steps=6))
        reference = M.reference_params(dataclasses.replace(M.TrainConfig(steps=6), noise=False))
        for saved, loaded in ((4, 2),):
            with self.subTest(saved=saved, loaded=loaded), tempfile.TemporaryDirectory() as tmp:
                launch(W.save_at, saved, (config, tmp, 3), device="cpu", timeout_s=60)
                results = launch(W.resume_resharded, loaded, (config, tmp), device="cpu",
                                 timeout_s=60)
                for result in results:
                    self.assertEqual(result["resumed_from"], 3)
                    self.assertLess(M.DP.max_abs_diff(result["params"], reference),
                                    M.RESHARD_TOLERANCE)


class TestCommandLine(unittest.TestCase):
    def run_cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout)

    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--keep", "0"], "out of range")
        assert_argument_error(self, M.parse_args, ["--resume"], "need --ckpt-dir")
        assert_argument_error(self, M.parse_args, ["--batch", "10"], "not divisible")

    def test_missing_corrupt_and_foreign_directories_give_one_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            foreign = Path(tmp) / "foreign"
            foreign.mkdir()
            (foreign / "notes.txt").write_text("hello")
            corrupt = Path(tmp) / "corrupt"
            step_dir = fake_checkpoint(corrupt, 3, 1, fingerprint=M.TrainConfig().fingerprint())
            (step_dir / M.shard_name(0, 1)).write_bytes(b"garbage")
            for directory, fragment in ((Path(tmp) / "missing", "no such checkpoint directory"),
                                        (foreign, "holds no committed checkpoint"),
                                        (corrupt, "bytes, the manifest says")):
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr):  # refused before any rank starts
                    code = M.main(["--ckpt-dir", str(directory), "--resume", "--world-size", "1"])
                self.assertEqual(code, 1)
                self.assertEqual(len(stderr.getvalue().strip().splitlines()), 1, stderr.getvalue())
                self.assertIn(fragment, stderr.getvalue())

    def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(self):
        common = ["--steps", "18", "--save-every", "3", "--keep", "2", "--world-size", "2"]
        with tempfile.TemporaryDirectory() as tmp:
            clean = self.run_cli("--ckpt-dir", f"{tmp}/clean", *common, "--json", f"{tmp}/clean.json")
            self.assertEqual(clean.returncode, 0, clean.stderr)
            expected = json.loads(Path(f"{tmp}/clean.json").read_text())["metrics"]

            victim = subprocess.Popen([sys.executable, str(SCRIPT), "--ckpt-dir", f"{tmp}/k",
                                       *common, "--sleep-per-step", "0.15"], cwd=REPO_ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
            try:
                deadline = time.monotonic() + 60
                while not (Path(tmp) / "k" / M.LATEST).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.assertTrue((Path(tmp) / "k" / M.LATEST).exists(), "no checkpoint appeared")
                time.sleep(random.uniform(0.0, 1.5))  # somewhere mid-run, maybe mid-save
                self.assertIsNone(victim.poll(), "the run ended before it could be killed")
                os.killpg(victim.pid, signal.SIGKILL)
            finally:
                victim.wait(timeout=30)
            resumed = self.run_cli("--ckpt-dir", f"{tmp}/k", *common, "--resume", "--json",
                                   f"{tmp}/k.json")
            self.assertEqual(resumed.returncode, 0, resumed.stderr)
            got = json.loads(Path(f"{tmp}/k.json").read_text())["metrics"]
        self.assertGreater(got["resumed_from_step"], 0)
        self.assertEqual(got["final_param_sha256"], expected["final_param_sha256"])


class TestDemo(unittest.TestCase):
    def test_demo_passes_every_check(self):
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run([sys.executable, str(SCRIPT), "--world-size", "2", "--json",
                                   f"{tmp}/r.json"], cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=180)
            report = json.loads(Path(f"{tmp}/r.json").read_text())
        failed = [c for c in report["checks"] if not c["passed"]]
        self.assertEqual(proc.returncode, 0, failed)
        self.assertEqual(failed, [])
        self.assertGreaterEqual(len(report["checks"]), 20)
        self.assertEqual(report["metrics"]["resumed_from_step"], 6)
        self.assertIn("resharded 2 -> 3 ranks == unsharded reference",
                      [c["name"] for c in report["checks"]])


if __name__ == "__main__":
    unittest.main()
