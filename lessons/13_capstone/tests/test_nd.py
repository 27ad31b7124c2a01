"""Lesson 13 in N dimensions (nd.py): the mesh's groups against a pure enumeration of the grid;
every layout (dp2, tp2, pp2, cp2, dp2 x tp2, tp2 x pp2, dp2 x pp2 x cp2) trains the losses,
gradient norms and final weights of one process (float64: to rounding); a run saved in one
layout resumes in another on the same trajectory, in the same layout bit for bit; the verified
load refuses what it cannot reshard. Every run passes device="cpu".

Tolerances: float64 runs of the same arithmetic in another summation order (sums split over
ranks, attention merged block by block) differ by a few ulps per operation: 1e-12 on losses
near 3.5 and norms near 1-3 is about 1000 ulps after 4 steps. AdamW divides each gradient by
its own running RMS, which amplifies the rounding of the small ones: the weights differ by up
to about 1e-12 (measured 1.1e-12 after 4 steps), so they get 1e-9, a millionth of the
learning rate 3e-3 that bounds one step's update; a planted composition bug moves the losses,
norms or weights by 1e-4 or more."""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
import unittest
from pathlib import Path

import torch

from lessons._testing import assert_argument_error, exercise, run_under_torchrun

nd = importlib.import_module("lessons.13_capstone.nd")  # the technique
nd_model = importlib.import_module("lessons.13_capstone.nd_model")
nd_placement = importlib.import_module("lessons.13_capstone.nd_placement")
nd_checks = importlib.import_module("lessons.13_capstone.nd_checks")  # the harness
tensor_parallel = importlib.import_module("lessons.04_tensor_parallel.main")
checkpointing = importlib.import_module("lessons.06_checkpointing.main")
C = importlib.import_module("lessons.13_capstone.checks")  # the capstone's CLI
MAIN = Path(nd.__file__).with_name("main.py")

TOLERANCE = {"loss": 1e-12, "norm": 1e-12, "params": 1e-9}
CONFIG = nd_model.GPTConfig(steps=4)
LAYOUTS = {"dp2": nd.Layout(dp=2), "tp2": nd.Layout(tp=2), "pp2": nd.Layout(pp=2),
           "cp2": nd.Layout(cp=2), "dp2xtp2": nd.Layout(dp=2, tp=2), "tp2xpp2": nd.Layout(tp=2, pp=2),
           "dp2xpp2xcp2": nd.Layout(dp=2, pp=2, cp=2)}
SAVED = ("dp2xtp2", "pp2")  # these runs save at steps 2 and 4, for the resume tests


class Runs:
    """Each layout's run, made the first time a test asks for it and kept for the others (one
    per test process): a test that stops at its first wrong layout runs no more of them."""

    results: dict[str, list[dict]] = {}
    scratch: Path | None = None

    @classmethod
    def setup(cls) -> None:
        if cls.scratch is None:
            cls.scratch = Path(tempfile.mkdtemp(prefix="capstone-nd-"))
            cls.batches = nd_checks.random_batches(CONFIG, CONFIG.steps)
            cls.reference, cls.model = nd_model.train_one_process(CONFIG, cls.batches)

    @classmethod
    def of(cls, name: str) -> list[dict]:
        cls.setup()
        if name not in cls.results:
            ckpt = cls.scratch / name if name in SAVED else None
            dcp_dir = cls.scratch / "dcp" if name == SAVED[0] else None  # the end, as DCP saves it
            cls.results[name] = nd_checks.run_layout(CONFIG, LAYOUTS[name], cls.batches, "cpu",
                                                     ckpt_dir=ckpt, save_every=2 if ckpt else 0,
                                                     dcp_dir=dcp_dir, dcp_save=True)
        return cls.results[name]

    @classmethod
    def resume(cls, saved: str, layout: nd.Layout, from_step: int) -> list[dict]:
        """A copy of `saved`'s checkpoints with `latest` at `from_step`, resumed in `layout`."""
        copy = Path(tempfile.mkdtemp(prefix="resume-", dir=cls.scratch))
        shutil.copytree(cls.scratch / saved, copy, dirs_exist_ok=True)
        checkpointing.atomic_write_bytes(copy / checkpointing.LATEST,
                                         (checkpointing.step_dir_name(from_step) + "\n").encode())
        return nd_checks.run_layout(CONFIG, layout, cls.batches, "cpu", ckpt_dir=copy, resume=True)


def tearDownModule():
    if Runs.scratch is not None:
        shutil.rmtree(Runs.scratch, ignore_errors=True)


@exercise("compose-step")
class TestDimensionGroups(unittest.TestCase):
    def test_a_small_grid_by_hand(self):
        layout = nd.Layout(dp=2, tp=2)  # ranks (dp, tp): 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1)
        self.assertEqual(nd.dimension_groups(layout, "tp"), [[0, 1], [2, 3]])
        self.assertEqual(nd.dimension_groups(layout, "dp"), [[0, 2], [1, 3]])
        self.assertEqual(nd.dimension_groups(layout, "pp"), [[0], [1], [2], [3]])

    def test_every_dimension_partitions_the_ranks_and_varies_only_itself(self):
        layout = nd.Layout(dp=2, tp=2, pp=2, cp=3)
        for dim in nd.DIMS:
            groups = nd.dimension_groups(layout, dim)
            self.assertEqual(sorted(r for g in groups for r in g), list(range(layout.world)), dim)
            for group in groups:
                coords = [layout.coordinates(r) for r in group]
                self.assertEqual([c[dim] for c in coords], list(range(getattr(layout, dim))), dim)
                for other in set(nd.DIMS) - {dim}:
                    self.assertEqual(len({c[other] for c in coords}), 1, (dim, other))

    def test_init_device_mesh_builds_the_enumerated_groups(self):
        for name, layout in LAYOUTS.items():
            for rank, result in enumerate(Runs.of(name)):
                self.assertEqual(result["coords"], layout.coordinates(rank))
                for dim in nd.DIMS:
                    mine = [g for g in nd.dimension_groups(layout, dim) if rank in g]
                    self.assertEqual(result["groups"][dim], mine[0], (name, rank, dim))


@exercise("compose-step")
class TestEveryLayoutIsOneProcess(unittest.TestCase):
    def test_losses_norms_and_weights_equal_one_process(self):
        for name in LAYOUTS:  # stops at the first layout that differs
            differences = nd_checks.largest_differences(Runs.of(name), Runs.reference, Runs.model)
            for what, difference in differences.items():
                self.assertLess(difference, TOLERANCE[what], f"{name}: {what} differs by {difference:.3g}")

    def test_clipping_acts_in_these_runs(self):  # else a bug in the clipping could not show
        Runs.setup()
        self.assertGreater(max(norm for _, norm in Runs.reference), CONFIG.clip)


@exercise("placements")
class TestPlacements(unittest.TestCase):
    def test_cut_gives_lesson_04s_shards(self):
        torch.manual_seed(0)
        block = nd_model.Block(16, 4).double()
        qkv = torch.cat([block.q.weight, block.k.weight, block.v.weight]).detach()
        for rank in range(2):
            tp = tensor_parallel.TensorParallelGroup(rank, 2)
            split = tensor_parallel.ColumnParallelLinear([block.q, block.k, block.v], tp)
            row = tensor_parallel.RowParallelLinear(block.o, tp)
            Placement = nd_placement.Placement
            fused, rows = Placement("qkv", (48, 16), 0, 3), Placement("o", (16, 16), 1)
            self.assertTrue(torch.equal(nd_placement.cut(qkv, fused, rank, 2), split.weight.detach()))
            self.assertTrue(torch.equal(nd_placement.cut(block.o.weight.detach(), rows, rank, 2),
                                        row.weight.detach()))

    def test_join_inverts_cut(self):
        full = torch.arange(24.0).view(6, 4)
        Placement = nd_placement.Placement
        for placement in (Placement("a", (6, 4), 0, 3), Placement("b", (6, 4), 1, 1),
                          Placement("c", (6, 4), None)):
            for size in (1, 2):
                pieces = [nd_placement.cut(full, placement, r, size) for r in range(size)]
                self.assertTrue(torch.equal(nd_placement.join(pieces, placement), full), (placement, size))

    def test_the_shards_join_into_the_global_tensors_each_element_once(self):
        results = Runs.of("dp2xtp2")
        counted = sum(t["params"].numel() for r in results for t in r["state"]["tensors"].values())
        self.assertEqual(counted, sum(t.numel() for t in nd_model.global_state(Runs.model).values()))


class TestResumeInAnotherLayout(unittest.TestCase):
    def assert_continues_the_run(self, results: list[dict], exact: bool) -> None:
        self.assertEqual(results[0]["resumed_from"], 2)
        differences = nd_checks.largest_differences(results, Runs.reference, Runs.model)
        for what, difference in differences.items():
            self.assertLess(difference, TOLERANCE[what], what)
        if exact:
            saved = Runs.of("dp2xtp2")
            self.assertEqual([r["history"] for r in results], [r["history"][2:] for r in saved])
            for mine, theirs in zip(results, saved):
                for name, entry in mine["state"]["tensors"].items():
                    self.assertTrue(torch.equal(entry["params"], theirs["state"]["tensors"][name]["params"]))

    def test_dp2_x_tp2_resumes_as_tp4(self):
        Runs.of("dp2xtp2")
        self.assert_continues_the_run(Runs.resume("dp2xtp2", nd.Layout(tp=4), 2), exact=False)

    def test_pp2_resumes_as_dp2(self):
        Runs.of("pp2")
        self.assert_continues_the_run(Runs.resume("pp2", nd.Layout(dp=2), 2), exact=False)

    def test_the_same_layout_resumes_bit_for_bit(self):
        Runs.of("dp2xtp2")
        self.assert_continues_the_run(Runs.resume("dp2xtp2", nd.Layout(dp=2, tp=2), 2), exact=True)

    def test_our_resharded_load_equals_torch_distributed_checkpoint(self):
        # the dp2 x tp2 run's end, saved by us and by DCP (DTensors), loaded as dp2 x pp2
        Runs.of("dp2xtp2")
        results = nd_checks.run_layout(CONFIG, nd.Layout(dp=2, pp=2), Runs.batches, "cpu",
                                       ckpt_dir=Runs.scratch / "dp2xtp2", resume=True,
                                       dcp_dir=Runs.scratch / "dcp")
        for rank, result in enumerate(results):
            self.assertEqual(result["resumed_from"], 4)
            self.assertGreater(result["dcp"]["tensors"], 100, rank)
            self.assertEqual(result["dcp"]["max_abs_diff"], 0.0, rank)

    def test_a_missing_slice_is_named(self):
        states = [dict(r["state"], tensors=dict(r["state"]["tensors"])) for r in Runs.of("dp2xtp2")]
        del states[3]["tensors"]["blocks.0.qkv.weight"]  # tp rank 1's second dp slice
        with self.assertRaisesRegex(checkpointing.CheckpointError, r"blocks\.0\.qkv\.weight: tp rank 1"):
            nd_placement.assemble(states)

    def test_another_model_is_refused_before_any_tensor_is_used(self):
        Runs.of("pp2")
        other = nd_model.GPTConfig(hidden=48, heads=4)  # what resume() checks first, on every rank
        with self.assertRaisesRegex(checkpointing.CheckpointError, "fingerprint"):
            checkpointing.load_latest(Runs.scratch / "pp2", 2, True, other.fingerprint())


class TestBf16(unittest.TestCase):
    """bf16 autocast, what the N-D run uses on GPUs, exercised on the CPU (float32 weights)."""

    def test_bf16_forwards_stay_within_bf16_rounding_of_the_fp32_run(self):
        batches = nd_checks.random_batches(CONFIG, CONFIG.steps)
        fp32, model = nd_model.train_one_process(CONFIG, batches, torch.float32)
        results = nd_checks.run_layout(CONFIG, nd.Layout(tp=2, pp=2), batches, "cpu", bf16=True)
        differences = nd_checks.largest_differences(results, fp32, model)
        # bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3): the mean loss over 128
        # tokens moves by about 1e-4 relative, the norm by about 1e-3 (measured 6.7e-4 on a loss
        # of 3.5 and 4.6e-3 on norms of 1-3); 1e-5 below: autocast really ran in bf16
        self.assertLess(differences["loss"], 3.5 * 1e-3)
        self.assertLess(differences["norm"], 2e-2)
        self.assertGreater(differences["loss"], 1e-5)


ND_ARGS = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--global-batch", "8",
           "--accum", "2", "--steps", "8", "--save-every", "4", "--sample-chars", "0"]


def metrics_of(path: Path) -> dict:
    return json.loads(path.read_text())["metrics"]


class TestCorpusRuns(unittest.TestCase):
    """The capstone's CLI with --dp --tp --pp --cp on the shipped corpus: the demo's checks
    (including a bitwise resume from the middle checkpoint), a resume in another layout, a
    pipeline under torchrun on two nodes. (The real SIGKILL is test_capstone's:
    the N-D run goes through the same worker and resume.)"""

    @classmethod
    def setUpClass(cls):
        cls.dir = Path(tempfile.mkdtemp(prefix="capstone-nd-cli-"))
        cls.plain = C.main([*ND_ARGS, "--tp", "2", "--cp", "2", "--device", "cpu",
                            "--out", str(cls.dir / "plain"), "--json", str(cls.dir / "plain.json")])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_the_n_d_demo_passes_and_resumes_bit_for_bit(self):
        self.assertEqual(self.plain, 0)
        metrics = metrics_of(self.dir / "plain.json")
        self.assertEqual(metrics["layout"], {"dp": 1, "tp": 2, "pp": 1, "cp": 2})
        self.assertEqual(metrics["resume_check"], "bitwise from step 4")

    def test_a_tp2_x_cp2_checkpoint_resumes_as_dp2_x_pp2(self):
        copy = self.dir / "other-layout"
        shutil.copytree(self.dir / "plain", copy)
        checkpointing.atomic_write_bytes(copy / "checkpoints" / checkpointing.LATEST,
                                         (checkpointing.step_dir_name(4) + "\n").encode())
        code = C.main([*ND_ARGS, "--dp", "2", "--pp", "2", "--device", "cpu", "--resume",
                       "--out", str(copy), "--json", str(self.dir / "other.json")])
        self.assertEqual(code, 0)
        other, plain = metrics_of(self.dir / "other.json"), metrics_of(self.dir / "plain.json")
        self.assertEqual(other["resumed_from"], 4)
        # float32 on the CPU, sums in another order: the same trajectory to rounding
        self.assertLess(abs(other["final_val_loss"] - plain["final_val_loss"]), 1e-4)

    def test_torchrun_two_nodes_runs_a_pipeline_across_them(self):
        out = self.dir / "torchrun"
        report = run_under_torchrun(MAIN, [*ND_ARGS, "--pp", "2", "--out", str(out)],
                                    nproc_per_node=1, nnodes=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual(report["metrics"]["layout"], {"dp": 1, "tp": 1, "pp": 2, "cp": 1})


class TestLayoutFlags(unittest.TestCase):
    """The N-D flags' refusals: argument parsing only, no ranks."""

    def test_bad_layouts_exit_2_with_one_line(self):
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--tp", "4"], "--heads 2 is not divisible")
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--pp", "3"], "--layers 2 is not divisible")
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--cp", "3"], "--seq 32 is not divisible")
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--heads", "4", "--tp", "4", "--seq", "6"],
                              "--seq 6 / cp = 6 positions do not split over tp = 4")
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--dp", "3"], "--global-batch 8")
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--tp", "2", "--ddp", "torch"], "--ddp torch")


if __name__ == "__main__":
    unittest.main()
