"""Lesson 11's suite: the corpus and tokenizer, the data order for any number of ranks, FLOPs
and MFU, our DDP == torch DDP, SIGKILL + resume bitwise, resuming on another world size, the
demo and its README numbers, the CLI."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch

from lessons._launch import WorkerError
from lessons._testing import assert_argument_error

M = importlib.import_module("lessons.11_capstone.main")
ROOT = Path(M.__file__).resolve().parents[2]
SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "32", "--global-batch", "8",
         "--accum", "2", "--steps", "12", "--save-every", "4", "--sample-chars", "0", "--no-resume-check"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(Path(M.__file__)), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def metrics_of(path: Path) -> dict:
    return json.loads(path.read_text())["metrics"]


class TestPieces(unittest.TestCase):
    def test_corpus_is_verified(self):
        text = M.load_text()
        self.assertEqual(len(text), 31742)
        scratch = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, scratch)
        edited = scratch / "coriolanus.txt"
        edited.write_text(text.replace("Rome", "Rime", 1))
        with self.assertRaisesRegex(ValueError, r"coriolanus.txt: sha256 .* \(edited or corrupt\)"):
            M.load_text(edited)
        with self.assertRaisesRegex(FileNotFoundError, "missing"):
            M.load_text(scratch / "absent.txt")

    def test_tokenizer_round_trip(self):
        text = M.load_text()
        tokenizer = M.CharTokenizer(text)
        self.assertEqual(tokenizer.decode(tokenizer.encode(text[:500])), text[:500])

    def test_the_global_batch_does_not_depend_on_the_number_of_ranks(self):
        data = torch.arange(1000)
        config = M.RunConfig(global_batch=8, accum=2, seq=16)
        one = torch.cat([M.batch_for_step(data, config, 3, 0, 1, m)[0] for m in range(2)])
        two = torch.cat([M.batch_for_step(data, config, 3, r, 2, m)[0] for r in range(2) for m in range(2)])
        self.assertTrue(torch.equal(one, two))
        tokens, targets = M.batch_for_step(data, config, 3, 0, 2, 0)
        self.assertTrue(torch.equal(tokens[:, 1:], targets[:, :-1]))
        with self.assertRaisesRegex(ValueError, "not divisible"):
            M.RunConfig(global_batch=6, accum=2).micro_batch(4)

    def test_flops_and_mfu(self):
        self.assertEqual(M.flops_per_token(1000, 2, 64, 128), 6000 + 12 * 2 * 64 * 128)
        self.assertAlmostEqual(M.mfu(1e6, 1_000_000, 2, 989e12), 1e12 / (2 * 989e12))
        self.assertIsNone(M.mfu(1e6, 1000, 1, None))
        self.assertIsNone(M.device_peak_flops(torch.device("cpu")))
        gpt2 = M.flops_per_token(124_000_000, 12, 768, 1024)  # the README's worked example
        self.assertEqual(round(gpt2 / 1e6), 857)
        self.assertEqual(round(100 * M.mfu(1e6, gpt2, 8, 989e12), 1), 10.8)


class TestRuns(unittest.TestCase):
    """Runs as a learner makes them: a real SIGKILL from the command line, then resume,
    reshard and the two DDPs through main() (the same code, without the interpreter start)."""

    @classmethod
    def setUpClass(cls):
        cls.dir = Path(tempfile.mkdtemp(prefix="capstone-test-"))
        cls.killed = cli(*SMALL, "--out", str(cls.dir / "a"), "--kill-at-step", "7")
        shutil.copytree(cls.dir / "a", cls.dir / "a-copy")
        cls.resumed = M.main([*SMALL, "--out", str(cls.dir / "a"), "--resume",
                              "--json", str(cls.dir / "a.json")])
        cls.plain = M.main([*SMALL, "--out", str(cls.dir / "b"), "--json", str(cls.dir / "b.json")])
        cls.torch_ddp = M.main([*SMALL, "--out", str(cls.dir / "c"), "--dp", "torch",
                                "--json", str(cls.dir / "c.json")])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_sigkill_then_resume_is_bitwise_equal(self):
        self.assertEqual(self.killed.returncode, 1)
        self.assertRegex(self.killed.stderr.strip().splitlines()[-1], r"^error: rank 0 .*SIGKILL")
        self.assertEqual(self.resumed, 0)
        resumed, plain = metrics_of(self.dir / "a.json"), metrics_of(self.dir / "b.json")
        self.assertEqual(resumed["resumed_from"], 4)
        self.assertEqual(resumed["final_param_sha256"], plain["final_param_sha256"])

    def test_our_ddp_equals_torch_ddp_bitwise_on_two_ranks(self):
        # two ranks: each gradient is a + b (one addition, commutative) then / 2 (exact), in
        # either implementation, so the weights are bitwise equal
        self.assertEqual(self.torch_ddp, 0)
        self.assertEqual(metrics_of(self.dir / "c.json")["final_param_sha256"],
                         metrics_of(self.dir / "b.json")["final_param_sha256"])

    def test_another_world_size_is_refused_then_resharded(self):
        with self.assertRaisesRegex(WorkerError, "saved by 2 ranks but 1 are running; pass --reshard"):
            M.main([*SMALL, "--out", str(self.dir / "a-copy"), "--resume", "--world-size", "1"])
        code = M.main([*SMALL, "--out", str(self.dir / "a-copy"), "--resume", "--world-size", "1",
                       "--reshard", "--json", str(self.dir / "d.json")])
        self.assertEqual(code, 0)
        resharded, plain = metrics_of(self.dir / "d.json"), metrics_of(self.dir / "b.json")
        self.assertEqual(resharded["resumed_from"], 4)
        # one rank sums the same global batch in another order, and its dropout stream is new
        # (RNG states are per rank): close to the two-rank run, not equal
        self.assertLess(abs(resharded["final_val_loss"] - plain["final_val_loss"]), 0.05)

    def test_existing_checkpoints_without_resume_exit_2(self):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = M.main([*SMALL, "--out", str(self.dir / "b")])
        self.assertEqual(code, 2)
        self.assertEqual(len(stderr.getvalue().strip().splitlines()), 1)
        self.assertIn("pass --resume", stderr.getvalue())


class TestDemo(unittest.TestCase):
    def test_the_demo_passes_and_the_readme_quotes_it(self):
        scratch = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, scratch)
        self.assertEqual(M.main(["--json", str(scratch / "m.json"), "--out", str(scratch / "out")]), 0)
        metrics = metrics_of(scratch / "m.json")
        self.assertIsNone(metrics["mfu"])
        readme = Path(M.__file__).with_name("README.md").read_text()
        start, end = metrics["val_losses"][0][1], metrics["val_losses"][-1][1]
        for text in (f"{start:.3f}", f"{end:.3f}", metrics["final_param_sha256"][:16],
                     f"{metrics['params']:,}", f"{metrics['flops_per_token']:,}"):
            self.assertIn(text, readme)

    def test_bad_arguments(self):
        assert_argument_error(self, M.parse_args, ["--global-batch", "6"], "--global-batch 6")
        assert_argument_error(self, M.parse_args, ["--resume"], "--out is required")
        assert_argument_error(self, M.parse_args, ["--hidden", "30", "--heads", "4"], "--hidden 30")


if __name__ == "__main__":
    unittest.main()
