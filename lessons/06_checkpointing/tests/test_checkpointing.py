"""Lesson 06's suite: the atomic write and every crash point of the protocol, every rejection,
a failing write on any rank, rotation, the export, exact resume (LR, GradScaler, RNG),
resharding 3 -> 2 and 3 -> 1, the demo end to end (spawned and under torchrun), a real SIGKILL
+ resume, and the numbers the README quotes."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

import torch

from lessons._checks import max_abs_diff
from lessons._launch import launch
from lessons._testing import assert_argument_error, run_under_torchrun

M = importlib.import_module("lessons.06_checkpointing.main")  # the technique
C = importlib.import_module("lessons.06_checkpointing.checks")  # the harness
T = importlib.import_module("lessons.06_checkpointing.trainer")
W = importlib.import_module("lessons.06_checkpointing.tests.workers")
SCRIPT = Path(M.__file__)
REPO_ROOT = SCRIPT.parents[2]
README = SCRIPT.with_name("README.md")


class TestProtocol(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def test_atomic_write_leaves_the_old_file_on_a_crash_before_the_rename(self):
        target = self.dir / "f"
        M.atomic_write_bytes(target, b"old")
        with mock.patch.object(M, "os", C._OsRenameCrash("f")), self.assertRaises(C.SimulatedCrash):
            M.atomic_write_bytes(target, b"new")
        self.assertEqual(target.read_bytes(), b"old")
        self.assertEqual(len(list(self.dir.glob(".f.tmp-*"))), 1)  # the fsynced temp file stays
        M.atomic_write_bytes(target, b"new")
        self.assertEqual(target.read_bytes(), b"new")

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

    def test_every_damage_is_rejected_naming_the_file(self):
        step_dir = C.save_single(self.dir / "ck", 5, keep=10, world=3)
        checks = C.corrupt_and_expect(step_dir, self.dir, 3)
        self.assertEqual(len(checks), 9)
        for check in checks:
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_the_good_checkpoint_verifies_and_bad_pointers_are_refused(self):
        ckpt = self.dir / "ck"
        C.save_single(ckpt, 2, world=2)
        self.assertEqual(M.verify_checkpoint(M.read_latest(ckpt), 2)["step"], 2)
        for pointer, fragment in (("../../etc", "not a step directory"),
                                  ("step-00000009", "which is missing")):
            (ckpt / M.LATEST).write_text(pointer)
            with self.assertRaisesRegex(M.CheckpointError, fragment):
                M.read_latest(ckpt)
        with self.assertRaisesRegex(M.CheckpointError, "no such checkpoint directory"):
            M.read_latest(self.dir / "nothing")

    def test_extra_shard_file_and_foreign_fingerprint(self):
        step_dir = C.save_single(self.dir / "ck", 1, world=2)
        with self.assertRaisesRegex(M.CheckpointError, "belongs to another run"):
            M.verify_checkpoint(step_dir, 2, fingerprint="other")
        (step_dir / M.shard_name(0, 3)).write_bytes(b"x")
        with self.assertRaisesRegex(M.CheckpointError, "extra shard file"):
            M.verify_checkpoint(step_dir, 2)

    def test_load_runs_no_pickled_code(self):
        """A shard that verifies (its hash is in the manifest) but holds a pickled object is
        refused by torch.load(weights_only=True), naming the file."""
        ckpt = self.dir / "ck"
        step_dir = ckpt / M.step_dir_name(1)
        step_dir.mkdir(parents=True)
        entry = M.write_shard(step_dir, 0, 1, M.serialize({"config": T.TrainConfig()}))
        M.commit(ckpt, 1, 1, [entry], "f", keep=1)
        with self.assertRaisesRegex(M.CheckpointError, "shard-00000-of-00001.pt: cannot be deserialised"):
            M.load_latest(ckpt, 1, False, "f")

    def test_rotation_keeps_newest_by_step_number_not_time(self):
        ckpt = self.dir / "ck"
        for step in (10, 2, 30, 4):  # written out of order: file times disagree with steps
            C.save_single(ckpt, step, keep=10)
        (ckpt / M.step_dir_name(99)).mkdir()  # uncommitted leftover, newer than everything
        (ckpt / M.step_dir_name(1)).mkdir()  # uncommitted leftover, older
        self.assertEqual(sorted(M.rotate(ckpt, 2)), [2, 4])
        self.assertEqual(M.committed_steps(ckpt), [10, 30])
        self.assertFalse((ckpt / M.step_dir_name(1)).exists())
        self.assertTrue((ckpt / M.step_dir_name(99)).exists())  # discard_newer_than's job
        self.assertEqual(M.discard_newer_than(ckpt, 30), [M.step_dir_name(99)])
        with self.assertRaises(ValueError):
            M.rotate(ckpt, 0)

    def test_export_round_trip_and_failures(self):
        tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.float64)}
        path = self.dir / "m.safetensors"
        self.assertEqual(M.export_safetensors(tensors, path), path.stat().st_size)
        with self.assertRaisesRegex(M.CheckpointError, "empty"):
            M.export_safetensors({}, self.dir / "e.safetensors")
        with self.assertRaisesRegex(M.CheckpointError, "differs from the live model"):
            M.verify_export(dict(tensors, a=tensors["a"] + 1), path)
        (self.dir / "t.safetensors").write_bytes(path.read_bytes()[:-4])
        with self.assertRaisesRegex(M.CheckpointError, "expected 8 \\+"):
            M.verify_export(tensors, self.dir / "t.safetensors")
        check = C.empty_export_check(self.dir, T.TrainConfig(), tensors)
        self.assertTrue(check.passed, check.detail)

    def test_cursor_and_schedule(self):
        cursor = M.DataCursor(12, 4, 0)
        seen = torch.cat([cursor.next_indices() for _ in range(3)])
        self.assertEqual(sorted(seen.tolist()), list(range(12)))
        self.assertEqual(cursor.state_dict(), {"epoch": 1, "position": 0})
        factor = M.cosine_with_warmup(2, 10)
        self.assertEqual([factor(0), factor(1)], [0.5, 1.0])
        self.assertAlmostEqual(factor(10), 0.0)


class TestExactResume(unittest.TestCase):
    def test_the_first_resumed_step_needs_the_saved_lr(self):
        for check in C.lr_checks():
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_the_grad_scaler_matters_only_under_fp16_overflow(self):
        for check in C.scaler_checks("cpu"):
            self.assertTrue(check.passed, f"{check.name}: {check.detail}")

    def test_rng_state_touches_no_cuda_device_unless_asked(self):
        with mock.patch.object(torch.cuda, "get_rng_state_all") as every_device, \
                mock.patch.object(torch.cuda, "get_rng_state") as one_device:
            state = M.rng_state("cpu")
            M.set_rng_state(state, "cpu")
            self.assertNotIn("cuda", state)
            every_device.assert_not_called()
            one_device.assert_not_called()
            one_device.return_value = torch.zeros(16, dtype=torch.uint8)
            self.assertIn("cuda", M.rng_state(torch.device("cuda", 3)))
            one_device.assert_called_once_with(torch.device("cuda", 3))
            every_device.assert_not_called()

    def test_restore_refuses_a_different_number_of_param_groups(self):
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        cursor = M.DataCursor(4, 2, 0)
        state = M.exact_resume_state(3, optimizer, scheduler, None, cursor)
        state["lr"] = [0.1, 0.2]
        with self.assertRaises(ValueError):
            M.restore_exact_resume_state(state, optimizer, scheduler, None, cursor)


class TestOnSpawnedRanks(unittest.TestCase):
    """One run saved by 3 ranks, resumed on 2 (resharding 3 -> 2) and in this process (3 -> 1);
    then, on the same 2 ranks, a failing write on each rank, synchronous and asynchronous. The
    demo test below reshards 2 -> 3, the torchrun one 2 -> 1."""

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
            self.assertLess(max_abs_diff(result["params"], self.reference), C.RESHARD_TOLERANCE)
        self.assertEqual(self.unsharded["saved_world"], 3)

    def test_a_failed_write_on_any_rank_commits_nothing_and_every_rank_raises(self):
        for rank, result in enumerate(self.per_rank):
            for run, (fail_rank, async_save) in zip(result["failed"], [(0, False), (0, True),
                                                                       (1, False), (1, True)]):
                with self.subTest(rank=rank, fail_rank=fail_rank, async_save=async_save):
                    self.assertIsNotNone(run["error"], "the failed save was not reported")
                    self.assertIn(f"rank {fail_rank}: OSError", run["error"])
                    self.assertIn("latest and older checkpoints are untouched", run["error"])
                    self.assertEqual(run["latest"], M.step_dir_name(2))
                    self.assertEqual(run["committed"], [2])


class TestCommandLine(unittest.TestCase):
    def run_cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout)

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
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr):  # refused before any rank starts
                    code = C.main(["--ckpt-dir", str(directory), "--resume", "--world-size", "1",
                                   "--device", "cpu"])
                self.assertEqual(code, 1)
                self.assertEqual(len(stderr.getvalue().strip().splitlines()), 1, stderr.getvalue())
                self.assertIn(fragment, stderr.getvalue())

    def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(self):
        """Bitwise between two runs on THIS machine: another CPU's kernels may round differently."""
        common = ["--steps", "18", "--save-every", "3", "--keep", "2", "--world-size", "2",
                  "--device", "cpu"]
        with tempfile.TemporaryDirectory() as tmp:
            clean = self.run_cli("--ckpt-dir", f"{tmp}/clean", *common, "--json", f"{tmp}/clean.json")
            self.assertEqual(clean.returncode, 0, clean.stderr)
            expected = json.loads(Path(f"{tmp}/clean.json").read_text())["metrics"]

            victim = subprocess.Popen([sys.executable, str(SCRIPT), "--ckpt-dir", f"{tmp}/k",
                                       *common, "--sleep-per-step", "0.15"], cwd=REPO_ROOT,
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
            proc = subprocess.run([sys.executable, str(SCRIPT), "--world-size", "2", "--device",
                                   "cpu", "--timeout", "180", "--json", f"{tmp}/r.json"],
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
            self.assertTrue(Path(f"{tmp}/r.json").exists(), proc.stderr[-2000:])
            report = json.loads(Path(f"{tmp}/r.json").read_text())
        failed = [c for c in report["checks"] if not c["passed"]]
        self.assertEqual(proc.returncode, 0, failed)
        self.assertEqual(failed, [])
        names = [c["name"] for c in report["checks"]]
        self.assertGreaterEqual(len(names), 28)
        self.assertEqual(report["metrics"]["resumed_from_step"], 6)
        self.assertIn("resharded 2 -> 3 ranks == unsharded reference", names)
        self.assertIn("a failed write (rank 1, step 6, async, keep 1) commits nothing", names)

    def test_under_torchrun_every_rank_shares_one_directory(self):
        """torchrun --standalone --nproc-per-node=2 on CPU: rank 0 chooses the directory and
        broadcasts it; resharding runs 2 -> 1 in each process (torchrun fixes the world size)."""
        report = run_under_torchrun(SCRIPT, ["--timeout", "180"], nproc_per_node=2, timeout=400)
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
        self.assertEqual(len(data), M.safetensors_file_bytes(header, psi * 8))
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

    def test_checkpoint_interval(self):
        young = M.young_interval(60, 86400)
        daly = M.daly_interval(60, 86400)
        self.assertEqual(round(young), 3220)
        self.assertIn(f"{young:,.0f} s", self.readme)
        self.assertIn(f"{daly:,.0f} s", self.readme)
        saves = 25 * 3600 / young
        self.assertIn(f"about {saves:.0f} saves", self.readme)
        self.assertIn(f"{100 * math.sqrt(2 * 60 / 86400):.1f}%", self.readme)
        for c, m, want, half_unit in C.DALY_EXAMPLES:
            self.assertLessEqual(abs(M.daly_interval(c, m) - want), half_unit)

    def test_scaler_story(self):
        full, saved, skipped = C.scaler_run(torch.float16, {1: 96.0, 5: 48.0}, 10_000)
        _, _, forgot = C.scaler_run(torch.float16, {1: 96.0, 5: 48.0}, 10_000, resume=saved,
                                    restore_scaler=False)
        self.assertEqual((skipped, forgot), ([1], [5]))
        self.assertIn("skips step 5 as well", self.readme)


if __name__ == "__main__":
    unittest.main()
