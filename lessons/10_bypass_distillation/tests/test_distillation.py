"""Lesson 10's suite: fingerprints, the block losses and students, the teacher's cost per step,
kill (simulated and SIGKILL) and resume bitwise, checkpoint errors, the sweep plan, parallel ==
serial, broken exports, the CLI, torchrun, and the README's numbers (TestDocNumbers).

Learner mode: tests tagged `@exercise(...)` grade one exercise of main.py or resumable.py
each. The resume tests run with a reference `distill_step` patched in (and the distill-step
tests with a reference loss), so a wrong loss or step fails its own exercise, not the resume
logic; the untagged tests (the demo, the sweep on ranks, exports, the docs' numbers, the CLI)
are the "integration" criterion."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch

from lessons._checks import fingerprint, max_abs_diff
from lessons._launch import WorkerError, one_thread
from lessons._testing import assert_argument_error, exercise, torchrun_demo

M = importlib.import_module("lessons.10_bypass_distillation.main")
R = importlib.import_module("lessons.10_bypass_distillation.resumable")
C = importlib.import_module("lessons.10_bypass_distillation.checks")
TEACHER = M.TeacherConfig(hidden=32, heads=2, layers=2, seq=16, batch=4, steps=30)
RUN = R.RunConfig(kind="mlp1", steps=20, warmup=3, save_every=10, teacher=TEACHER)


class TempDirCase(unittest.TestCase):
    def setUp(self):
        self.dir = Path(tempfile.mkdtemp(prefix="bld-test-"))
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.enterContext(one_thread())  # as every rank runs: tiny tensors, no thread contention


def stop_after(step: int):
    return C.kill_hook(step, real=False)


def reference_loss(y, t):
    return (y - t).pow(2).sum() / (t.pow(2).sum() + M.EPS)


def reference_distill_step(block, optimizer, scheduler, x, t) -> float:
    """The step the resume tests train with (not the learner's `distill_step`)."""
    loss = reference_loss(block(x), t)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


def step_setup(seed: int = 0):
    """A LinearBlock made non-trivial, AdamW, warmup + cosine schedule, and (x, t)."""
    torch.manual_seed(seed)
    block = M.LinearBlock(8)
    with torch.no_grad():
        block.proj.weight.normal_(0, 0.3)
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, R.checkpointing.cosine_with_warmup(2, 6))
    x, t = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    return block, optimizer, scheduler, x, t


@exercise("block-loss")
class TestBlockLoss(unittest.TestCase):
    def test_values(self):
        torch.manual_seed(0)
        y, x, t = torch.randn(4, 3, 5), torch.randn(4, 3, 5), 3 * torch.randn(4, 3, 5)
        want = float(((y - t) ** 2).sum() / ((t ** 2).sum() + M.EPS))
        self.assertAlmostEqual(float(M.normalized_mse(y, t)), want, places=5)
        want = float(((y - t) ** 2).sum() / (((t - x) ** 2).sum() + M.EPS))
        self.assertAlmostEqual(float(M.block_change_mse(y, x, t)), want, places=5)
        self.assertEqual(M.normalized_mse(y, t).dim(), 0)
        self.assertAlmostEqual(float(M.normalized_mse(5 * y, 5 * t)), float(M.normalized_mse(y, t)), places=5)

    def test_differentiable_in_the_student_output(self):
        y, t = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
        M.normalized_mse(y, t).backward()
        want = 2 * (y - t).detach() / ((t ** 2).sum() + M.EPS)
        self.assertTrue(torch.allclose(y.grad, want),
                        f"d loss / d y: expected 2 (y - t) / (sum t^2 + eps), max gap "
                        f"{max_abs_diff(y.grad, want):.3g}")
        self.assertEqual(float(M.normalized_mse(torch.zeros(3), torch.zeros(3))), 0.0)  # eps: no 0/0

    def test_a_zero_denominator_gives_a_large_positive_loss(self):
        """A student that outputs something where the teacher outputs nothing (t = 0), or where
        the teacher block changes nothing (t = x): the loss is sum((y - t)^2) / eps, positive
        and finite, never negative or infinite."""
        y, zero = torch.tensor([1.0, -2.0]), torch.zeros(2)
        for name, loss in (("normalized_mse(y, 0)", M.normalized_mse(y, zero)),
                           ("block_change_mse(y, x, t = x)", M.block_change_mse(y, zero, zero))):
            self.assertTrue(torch.isfinite(loss) and float(loss) > 0, f"{name} = {float(loss)}")
            self.assertAlmostEqual(float(loss) * M.EPS, 5.0, places=3, msg=f"{name} x eps")


@exercise("distill-step")
class TestDistillStep(unittest.TestCase):
    """Three `distill_step`s against the same steps written here, on copies of one setup (the
    learner's normalized_mse replaced by the reference loss: this grades the step alone)."""

    def test_three_steps_equal_the_reference(self):
        mine, ref = step_setup(), step_setup()
        x0, t0 = mine[3].clone(), mine[4].clone()
        with mock.patch.object(M, "normalized_mse", reference_loss):
            losses = [M.distill_step(*mine) for _ in range(3)]
        want = [reference_distill_step(*ref) for _ in range(3)]
        for got, expected in zip(losses, want):
            self.assertIsInstance(got, float)
            self.assertAlmostEqual(got, expected, places=6)
        for (name, a), b in zip(mine[0].named_parameters(), ref[0].parameters()):
            self.assertTrue(torch.allclose(a, b, atol=1e-6), name)
        self.assertEqual(mine[2].last_epoch, 3)
        self.assertEqual(mine[1].param_groups[0]["lr"], ref[1].param_groups[0]["lr"])
        self.assertTrue(torch.equal(mine[3], x0) and torch.equal(mine[4], t0),
                        "distill_step changed its input x or its target t (it must only read them)")


class TestPieces(TempDirCase):
    @exercise("resumable-block")
    def test_fingerprint_is_canonical_and_sensitive(self):
        self.assertEqual(fingerprint({"a": 1, "b": [1, 2]}), fingerprint({"b": [1, 2], "a": 1}))
        self.assertNotEqual(RUN.fingerprint(), dataclasses.replace(RUN, lr=1e-3).fingerprint())
        other_teacher = dataclasses.replace(RUN, teacher=dataclasses.replace(TEACHER, seed=1))
        self.assertNotEqual(RUN.fingerprint(), other_teacher.fingerprint())
        self.assertEqual(len(RUN.fingerprint()), 16)
        for field, value in (("kind", "linear"), ("steps", 21), ("warmup", 4), ("save_every", 5)):
            with self.subTest(field=field):
                changed = dataclasses.replace(RUN, **{field: value})
                self.assertNotEqual(RUN.fingerprint(), changed.fingerprint())
        self.assertEqual(RUN.fingerprint(), dataclasses.replace(RUN).fingerprint())

    @exercise("block-loss")
    def test_block_losses(self):
        t, x = torch.randn(4, 5), torch.randn(4, 5)
        self.assertAlmostEqual(float(M.normalized_mse(torch.zeros_like(t), t)), 1.0, places=6)
        self.assertEqual(float(M.normalized_mse(t, t)), 0.0)
        self.assertAlmostEqual(float(M.block_change_mse(x, x, t)), 1.0, places=6)  # skipping the block
        self.assertEqual(float(M.block_change_mse(t, x, t)), 0.0)

    def test_students(self):
        teacher = M.make_teacher(TEACHER)
        mlp1 = M.make_student_block("mlp1", teacher.layers[0], 32, 2)
        self.assertEqual(mlp1.up.weight.shape, (32, 32))
        self.assertTrue(torch.equal(mlp1.qkv.weight, teacher.layers[0].qkv.weight),
                        "the student keeps the teacher's attention weights")
        self.assertTrue(torch.equal(mlp1.up.weight, teacher.layers[0].up.weight[:32]),
                        "the student's MLP starts from the teacher's first 32 rows")
        self.assertLess(M.params_of(mlp1), M.params_of(teacher.layers[0]))
        self.assertEqual(M.params_of(teacher.layers[0]), M.teacher_block_params(32))
        linear = M.make_student_block("linear", teacher.layers[0], 32, 2)
        x = torch.randn(16, 4, 32)
        self.assertTrue(torch.equal(linear(x), x), "the linear student is the identity at initialisation")
        with self.assertRaisesRegex(ValueError, "unknown student block kind"):
            M.make_student_block("wide", teacher.layers[0], 32, 2)

    def test_teacher_block_forwards_per_step(self):
        config = dataclasses.replace(TEACHER, layers=4, steps=2)
        run = dataclasses.replace(RUN, teacher=config, steps=3)
        teacher = M.train_teacher(config)
        calls = []
        for layer in teacher.layers:
            layer.register_forward_hook(lambda *_: calls.append(1))
        for world in (1, 2, 3):
            calls.clear()
            for rank in range(world):
                R.train_rank_blocks(run, self.dir / f"w{world}", teacher, rank, world, {})
            self.assertEqual(len(calls), run.steps * M.teacher_block_forwards(4, world)["ours"], world)
        self.assertEqual(M.teacher_block_forwards(4, 2), {"ours": 7, "per_block_prefix": 10, "pipelined": 4})
        self.assertEqual(M.teacher_block_forwards(4, 1)["ours"], 4)


@exercise("resumable-block")
class TestTrainBlockAgainstAReference(TempDirCase):
    """`train_block` from scratch against the loop its docstring describes, written here with
    plain torch (AdamW at run.lr, warmup + cosine, the students' batch stream 1, block i's input
    states[i] and target states[i + 1]): the same losses, bitwise, and the same weights. 13
    steps saved every 5: the last save (13) is not a multiple of the cadence, and the mean of
    the last 10 losses is not the mean of losses[10:]. Both blocks: the first (index 0) and the
    last (index 1), so an index off by one shows."""

    RUN13 = dataclasses.replace(RUN, steps=13, save_every=5)

    def setUp(self):
        super().setUp()
        self.enterContext(mock.patch.object(M, "distill_step", reference_distill_step))
        self.teacher = M.train_teacher(TEACHER)

    def reference(self, index: int) -> tuple[list[float], str]:
        run = self.RUN13
        block = R.initial_block(run, self.teacher, index)
        optimizer = torch.optim.AdamW(block.parameters(), lr=run.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, R.checkpointing.cosine_with_warmup(run.warmup, run.steps))
        data = M.batches(run.teacher, run.steps, 1)
        losses = []
        for step in range(run.steps):
            states = M.teacher_block_io(self.teacher, data[step][0])
            x, t = states[index], states[index + 1]
            losses.append(reference_distill_step(block, optimizer, scheduler, x, t))
        return losses, R.tensor_digest(block.state_dict())

    def test_a_fresh_run_is_the_described_loop(self):
        run = self.RUN13
        for index in range(TEACHER.layers):
            forwards, calls = [], []
            count = forwards.append
            hooks = [layer.register_forward_hook(lambda *_, count=count: count(1))
                     for layer in self.teacher.layers]
            try:
                got = R.train_block(run, self.dir, index, self.teacher, after_step=calls.append)
            finally:
                for hook in hooks:
                    hook.remove()
            want_losses, want_digest = self.reference(index)
            where = f"block {index} of {TEACHER.layers}, {run.steps} steps"
            self.assertEqual(sorted(got),
                             ["block", "final_loss", "losses", "resumed_from", "sha256", "status"],
                             f"{where}: the keys train_block returns")
            self.assertEqual((got["block"], got["status"], got["resumed_from"]), (index, "trained", 0), where)
            self.assertEqual(got["losses"], want_losses, f"{where}: every step's loss against the loop")
            self.assertEqual(got["sha256"], want_digest, f"{where}: the trained block's weights")
            self.assertEqual(got["final_loss"], sum(want_losses[-10:]) / 10, f"{where}: mean of the last 10")
            self.assertEqual(calls, list(range(1, run.steps + 1)),
                             f"{where}: after_step(step) gets the number of steps done so far")
            self.assertEqual(len(forwards), run.steps * (index + 1),
                             f"{where}: teacher block forwards (block i costs i + 1 per step, no more)")
            directory = R.block_dir(self.dir, index)
            self.assertEqual((directory / "latest").read_text(), f"step-{run.steps:06d}.pt",
                             f"{where}: the last checkpoint is the final step's (saved at the end too)")
            done = json.loads((directory / "done.json").read_text())
            self.assertEqual((done["sha256"], done["losses"]), (want_digest, want_losses),
                             f"{where}: done.json")
            again = R.train_block(run, self.dir, index, self.teacher)
            self.assertEqual((again["block"], again["status"], again["sha256"]),
                             (index, "skipped", want_digest),
                             f"{where}: a finished block is skipped and reports its result")


class TestResume(TempDirCase):
    def setUp(self):
        super().setUp()
        self.enterContext(mock.patch.object(M, "distill_step", reference_distill_step))

    @exercise("resumable-block")
    def test_killed_and_resumed_equals_uninterrupted_bitwise(self):
        teacher = M.train_teacher(TEACHER)
        with self.assertRaises(C.SimulatedKill):
            R.train_block(RUN, self.dir / "a", 1, teacher, after_step=stop_after(15))
        self.assertEqual(C.sweep_plan([RUN], self.dir / "x"), {RUN.fingerprint(): "new"})
        resumed = R.train_block(RUN, self.dir / "a", 1, teacher)
        self.assertEqual(resumed["resumed_from"], 10)
        fresh = R.train_block(RUN, self.dir / "b", 1, teacher)
        self.assertEqual(resumed["sha256"], fresh["sha256"])
        self.assertEqual(resumed["losses"], fresh["losses"])
        self.assertEqual(R.train_block(RUN, self.dir / "a", 1, teacher)["status"], "skipped")

    @exercise("resumable-block")
    def test_sweep_plan(self):
        teacher = M.train_teacher(TEACHER)
        run_dir = self.dir / RUN.fingerprint()
        with self.assertRaises(C.SimulatedKill):
            R.train_block(RUN, run_dir, 0, teacher, after_step=stop_after(12))
        plan = C.sweep_plan([RUN], self.dir)
        self.assertEqual(plan, {RUN.fingerprint(): "resume: blocks at steps [10, 0]"})
        for block in range(TEACHER.layers):
            R.train_block(RUN, run_dir, block, teacher)
        self.assertEqual(C.finish_runs([RUN], self.dir), [RUN.fingerprint()])
        self.assertEqual(C.sweep_plan([RUN], self.dir), {RUN.fingerprint(): "finished"})

    def test_bad_checkpoints_name_the_file(self):
        directory = self.dir / "block-000"
        directory.mkdir()
        self.assertIsNone(R.load_block(directory))
        (directory / "latest").write_text("step-000010.pt")
        with self.assertRaisesRegex(R.checkpointing.CheckpointError, "latest: names 'step-000010.pt'"):
            R.load_block(directory)
        (directory / "step-000010.pt").write_bytes(b"not a checkpoint")
        with self.assertRaisesRegex(R.checkpointing.CheckpointError, "step-000010.pt: unreadable"):
            R.load_block(directory)

    @exercise("resumable-block")
    def test_a_crash_before_the_pointer_moves_keeps_the_previous_checkpoint(self):
        teacher = M.train_teacher(TEACHER)
        directory = R.block_dir(self.dir, 0)
        with self.assertRaises(C.SimulatedKill):
            R.train_block(RUN, self.dir, 0, teacher, after_step=stop_after(15))  # saved at 10
        (directory / "step-000020.pt").write_bytes(b"half written")  # pointer never moved
        self.assertEqual(R.load_block(directory)["step"], 10)


def uninterrupted_digests(run) -> dict[int, str]:
    """Every block of `run` trained in this process without a break: the serial reference."""
    teacher = M.train_teacher(run.teacher)
    with tempfile.TemporaryDirectory(prefix="bld-serial-") as folder:
        return {i: R.train_block(run, Path(folder), i, teacher)["sha256"] for i in range(run.teacher.layers)}


class TestParallel(TempDirCase):
    def test_three_ranks_train_the_same_blocks_as_one_process(self):
        """3 ranks (odd), 2 blocks: rank 2 owns none (round robin) and must still finish."""
        three = C.sweep([C.job(self.dir / "three", RUN)], self.dir, 3, 120)
        self.assertEqual([[b["block"] for b in rank[0]["blocks"]] for rank in three], [[0], [1], []],
                         "blocks per rank (round robin over 3 ranks)")
        self.assertEqual({b["block"]: b["sha256"] for rank in three for b in rank[0]["blocks"]},
                         uninterrupted_digests(RUN), "each block's weights against one process")

    def test_sigkill_then_resume_equals_uninterrupted(self):
        """A real SIGKILL of the one rank after block 0's step 15 (the launcher reports it; block
        1 never started), then a sweep on two ranks resumes from what the process left on disk."""
        with self.assertRaisesRegex(WorkerError, "SIGKILL"):
            C.sweep([C.job(self.dir / "runs", RUN, kill_after=15, real_kill=True)], self.dir, 1, 120)
        self.assertEqual(C.sweep_plan([RUN], self.dir / "runs"),
                         {RUN.fingerprint(): "resume: blocks at steps [10, 0]"})
        resumed = C.sweep([C.job(self.dir / "runs", RUN)], self.dir, 2, 120)
        self.assertEqual({b["block"]: b["resumed_from"] for rank in resumed for b in rank[0]["blocks"]},
                         {0: 10, 1: 0})
        done = json.loads((self.dir / "runs" / RUN.fingerprint() / "done.json").read_text())
        self.assertEqual(dict(enumerate(done["block_sha256"])), uninterrupted_digests(RUN))


class TestExport(TempDirCase):
    def test_export_and_broken_exports(self):
        teacher = M.make_teacher(TEACHER)
        student = M.make_student(teacher, "mlp1", TEACHER)
        size = R.export_student(student, self.dir / "s.safetensors")
        self.assertEqual(size, (self.dir / "s.safetensors").stat().st_size)
        for check in C.broken_export_checks(student, self.dir):
            with self.subTest(check=check.name):
                self.assertTrue(check.passed, check.detail)


def table_rows(markdown: str) -> dict[str, list[str]]:
    """Markdown table rows: first cell (without markup) -> the other cells."""
    rows = {}
    for line in markdown.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) > 1:
            rows[cells[0].replace("*", "")] = [cell.replace("*", "").replace(",", "") for cell in cells[1:]]
    return rows


class TestDocNumbers(unittest.TestCase):
    """The demo passes, and the README quotes its numbers. They come from float32 arithmetic on
    one thread: another CPU's kernels may round differently, so each quote is checked within
    half a unit of its last digit plus 0.2% (the runs differ by about 1e-5 across ATen kernel
    sets)."""

    @classmethod
    def setUpClass(cls):
        folder = Path(tempfile.mkdtemp(prefix="bld-doc-"))
        try:
            cls.code = C.main(["--json", str(folder / "m.json"), "--timeout", "300"])
            cls.report = json.loads((folder / "m.json").read_text())
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        cls.metrics = cls.report["metrics"]
        cls.rows = table_rows(Path(M.__file__).with_name("README.md").read_text())

    def assert_quoted(self, quoted: str, value: float):
        decimals = len(quoted.split(".")[1]) if "." in quoted else 0
        self.assertLessEqual(abs(float(quoted) - value), 0.5 * 10 ** -decimals + 2e-3 * abs(value),
                             f"README quotes {quoted}, the code gives {value}")

    def test_the_demo_passes(self):
        self.assertEqual(self.code, 0, [c for c in self.report["checks"] if not c["passed"]])

    def test_per_block_table(self):
        m = self.metrics
        expected = {"mlp1: training loss": m["block_losses"]["mlp1"],
                    "linear: training loss": m["block_losses"]["linear"],
                    "no-op baseline (skip the block)": m["blocks_mlp1"]["skip"],
                    "mlp1: relative to the block's change": m["blocks_mlp1"]["relative"],
                    "linear: relative to the block's change": m["blocks_linear"]["relative"]}
        for label, values in expected.items():
            with self.subTest(row=label):
                self.assertEqual(len(self.rows[label]), len(values))
                for quoted, value in zip(self.rows[label], values):
                    self.assert_quoted(quoted, value)

    def test_end_to_end_table(self):
        m = self.metrics
        for label, key in (("teacher", "teacher"), ("stitched mlp1", "stitched_mlp1"),
                           ("stitched linear", "stitched_linear"),
                           ("mlp1 trained end to end, same steps", "end_to_end_mlp1")):
            with self.subTest(row=label):
                loss, kl = self.rows[label][:2]
                self.assert_quoted(loss, m[key]["loss"])
                self.assert_quoted(kl, m[key]["kl"])

    def test_exact_counts(self):
        readme = Path(M.__file__).with_name("README.md").read_text()
        for count in self.metrics["params_per_block"].values():
            self.assertIn(f"**{count:,}**", readme)
        self.assertIn(f"{self.metrics['export_bytes']:,} B", readme)
        forwards = self.metrics["teacher_block_forwards"]
        self.assertRegex(readme, rf"\b{forwards['ours']} teacher block forwards per step")


class TestCommandLine(TempDirCase):
    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--steps", "30"], "--steps 30")
        assert_argument_error(self, C.parse_args, ["--device", "cuda"], "trains its blocks on the CPU")
        assert_argument_error(self, C.parse_args, ["--layers", "0"], "--layers")

    @torchrun_demo(["--quick", "--layers", "2", "--timeout", "200"])  # one block per rank
    def test_under_torchrun_the_ranks_share_one_directory(self, report):
        self.assertTrue(report["passed"], [c for c in report["checks"] if not c["passed"]])
        self.assertEqual(report["world_size"], 2)

    def test_out_keeps_the_runs(self):
        argv = ["--quick", "--world-size", "1", "--layers", "1", "--out", str(self.dir)]
        self.assertEqual(C.main(argv), 0)
        self.assertEqual(len(list(self.dir.glob("bld-*/runs/*/done.json"))), 2)  # mlp1 and linear


if __name__ == "__main__":
    unittest.main()
