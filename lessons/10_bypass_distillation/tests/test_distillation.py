"""Lesson 10's suite: fingerprints, the per-block loss and students, kill/resume bitwise,
checkpoint errors, the sweep plan, parallel == serial, broken exports, the demo, the CLI."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import tempfile
import unittest
from pathlib import Path

import torch

from lessons._testing import assert_argument_error

M = importlib.import_module("lessons.10_bypass_distillation.main")
TEACHER = M.TeacherConfig(hidden=32, heads=2, layers=2, seq=16, batch=4, steps=30)
RUN = M.RunConfig(kind="mlp1", steps=20, warmup=3, save_every=10, teacher=TEACHER)


class TempDirCase(unittest.TestCase):
    def setUp(self):
        self.dir = Path(tempfile.mkdtemp(prefix="bld-test-"))
        self.addCleanup(shutil.rmtree, self.dir, True)


class TestPieces(TempDirCase):
    def test_fingerprint_is_canonical_and_sensitive(self):
        self.assertEqual(M.fingerprint({"a": 1, "b": [1, 2]}), M.fingerprint({"b": [1, 2], "a": 1}))
        self.assertNotEqual(RUN.fingerprint(), dataclasses.replace(RUN, lr=1e-3).fingerprint())
        other_teacher = dataclasses.replace(RUN, teacher=dataclasses.replace(TEACHER, seed=1))
        self.assertNotEqual(RUN.fingerprint(), other_teacher.fingerprint())
        self.assertEqual(len(RUN.fingerprint()), 16)

    def test_normalized_mse(self):
        t = torch.randn(4, 5)
        self.assertAlmostEqual(float(M.normalized_mse(torch.zeros_like(t), t)), 1.0, places=6)
        self.assertEqual(float(M.normalized_mse(t, t)), 0.0)

    def test_students(self):
        teacher = M.make_teacher(TEACHER)
        mlp1 = M.make_student_block("mlp1", teacher.layers[0], 32, 2)
        self.assertEqual(mlp1.up.weight.shape, (32, 32))
        self.assertTrue(torch.equal(mlp1.qkv.weight, teacher.layers[0].qkv.weight))
        self.assertTrue(torch.equal(mlp1.up.weight, teacher.layers[0].up.weight[:32]))
        self.assertLess(M.params_of(mlp1), M.params_of(teacher.layers[0]))
        self.assertEqual(M.params_of(teacher.layers[0]), M.teacher_block_params(32))
        linear = M.make_student_block("linear", teacher.layers[0], 32, 2)
        x = torch.randn(16, 4, 32)
        self.assertTrue(torch.equal(linear(x), x))  # the identity at initialisation
        with self.assertRaisesRegex(ValueError, "unknown student block kind"):
            M.make_student_block("wide", teacher.layers[0], 32, 2)


class TestResume(TempDirCase):
    def test_killed_and_resumed_equals_uninterrupted_bitwise(self):
        teacher = M.train_teacher(TEACHER)
        killed = M.train_block(RUN, self.dir / "a", 1, teacher, stop_after=15)
        self.assertEqual(killed["status"], "killed")
        self.assertEqual(M.sweep_plan([RUN], self.dir / "x"), {RUN.fingerprint(): "new"})
        resumed = M.train_block(RUN, self.dir / "a", 1, teacher)
        self.assertEqual(resumed["resumed_from"], 10)
        fresh = M.train_block(RUN, self.dir / "b", 1, teacher)
        self.assertEqual(resumed["sha256"], fresh["sha256"])
        self.assertEqual(resumed["losses"], fresh["losses"])
        self.assertEqual(M.train_block(RUN, self.dir / "a", 1, teacher)["status"], "skipped")

    def test_sweep_plan(self):
        teacher = M.train_teacher(TEACHER)
        run_dir = self.dir / RUN.fingerprint()
        M.train_block(RUN, run_dir, 0, teacher, stop_after=12)
        plan = M.sweep_plan([RUN], self.dir)
        self.assertEqual(plan, {RUN.fingerprint(): "resume: blocks at steps [10, 0]"})
        for block in range(TEACHER.layers):
            M.train_block(RUN, run_dir, block, teacher)
        self.assertEqual(M.finish_runs([RUN], self.dir), [RUN.fingerprint()])
        self.assertEqual(M.sweep_plan([RUN], self.dir), {RUN.fingerprint(): "finished"})

    def test_bad_checkpoints_name_the_file(self):
        directory = self.dir / "block-000"
        directory.mkdir()
        self.assertIsNone(M.load_block(directory))
        (directory / "latest").write_text("step-000010.pt")
        with self.assertRaisesRegex(M.CKPT.CheckpointError, "latest: names 'step-000010.pt'"):
            M.load_block(directory)
        (directory / "step-000010.pt").write_bytes(b"not a checkpoint")
        with self.assertRaisesRegex(M.CKPT.CheckpointError, "step-000010.pt: unreadable"):
            M.load_block(directory)

    def test_a_crash_before_the_pointer_moves_keeps_the_previous_checkpoint(self):
        teacher = M.train_teacher(TEACHER)
        directory = M.block_dir(self.dir, 0)
        M.train_block(RUN, self.dir, 0, teacher, stop_after=15)  # saved at 10
        (directory / "step-000020.pt").write_bytes(b"half written")  # pointer never moved
        self.assertEqual(M.load_block(directory)["step"], 10)


class TestParallel(TempDirCase):
    def test_two_ranks_train_the_same_blocks_as_one(self):
        one = M.sweep([(self.dir / "one", RUN, None)], self.dir, 1, 120)
        two = M.sweep([(self.dir / "two", RUN, None)], self.dir, 2, 120)
        self.assertEqual([b["block"] for rank in two for b in rank[0]["blocks"]], [0, 1])
        digest = {b["block"]: b["sha256"] for rank in one for b in rank[0]["blocks"]}
        self.assertEqual(digest, {b["block"]: b["sha256"] for rank in two for b in rank[0]["blocks"]})


class TestExport(TempDirCase):
    def test_export_and_broken_exports(self):
        teacher = M.make_teacher(TEACHER)
        student = M.make_student(teacher, "mlp1", TEACHER)
        size = M.export_student(student, self.dir / "s.safetensors")
        self.assertEqual(size, (self.dir / "s.safetensors").stat().st_size)
        for check in M.broken_export_checks(student, self.dir):
            with self.subTest(check=check.name):
                self.assertTrue(check.passed, check.detail)


class TestDemo(TempDirCase):
    def test_the_demo_passes_and_the_readme_quotes_it(self):
        self.assertEqual(M.main(["--json", str(self.dir / "m.json")]), 0)
        metrics = json.loads((self.dir / "m.json").read_text())["metrics"]
        readme = Path(M.__file__).with_name("README.md").read_text()
        quoted = [f"{x:.4f}" for losses in metrics["block_losses"].values() for x in losses]
        quoted += [f"**{metrics['teacher']['loss']:.3f}**", f"{metrics['export_bytes']:,} B"]
        for name in ("stitched_mlp1", "stitched_linear", "end_to_end_mlp1"):
            quoted += [f"**{metrics[name]['loss']:.3f}**", f"**{metrics[name]['kl']:.4f}**"
                       if metrics[name]["kl"] < 0.1 else f"**{metrics[name]['kl']:.3f}**"]
        quoted += [f"**{n:,}**" for n in metrics["params_per_block"].values()]
        for text in quoted:
            self.assertIn(text, readme)

    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--steps", "30"], "--steps 30")
        assert_argument_error(self, M.parse_args, ["--device", "cuda"], "runs on the CPU")
        assert_argument_error(self, M.parse_args, ["--layers", "0"], "--layers")


if __name__ == "__main__":
    unittest.main()
