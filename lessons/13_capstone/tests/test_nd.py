"""Lesson 13 in N dimensions (nd.py): the mesh's groups against a pure enumeration of the grid;
every layout trains the losses, gradient norms and final weights of one process (float64: to
rounding) at a degree of 3 in each dimension (dp3, tp3, pp3 with a middle stage and 4
micro-batches, cp3) and composed on 6 ranks (tp2 x pp3, dp3 x cp2, dp2 x cp3 in bf16), with
sizes no degree divides (hidden 20 and vocabulary 37: ZeRO's shards are uneven) and batches
whose targets are partly ignored (padding, packed documents); a run saved in one layout
resumes in another on the same trajectory; the verified load refuses what it cannot reshard;
a layout the model cannot split is refused with one line. Every run passes device="cpu".

Two launches make every run: one of 3 ranks (dp3, cp3, pp3, tp3; cp3 and tp3 save
checkpoints) and one of 6 (the compositions, then resumes of those checkpoints on 6 ranks);
graded alone (a planted bug, a mutant), a case is launched by itself when first asked for. A
launch that fails is remembered: the other tests re-raise its error without launching again.
unittest (and so the grader) runs the classes in the order of this file, as pytest does: an
exercise's checks in this process come before its launches.

Tolerances: float64 runs of the same arithmetic in another summation order (sums split over
ranks, attention merged block by block) differ by a few ulps per operation: 1e-12 on losses
near 3.6 and norms near 1-3 is about 1000 ulps after 4 steps. AdamW divides each gradient by
its own running RMS, which amplifies the rounding of the small ones: the weights differ by up
to about 1e-12 (measured 1.2e-12 after 4 steps), so they get 1e-9, a third of a millionth of
the learning rate 3e-3 that bounds one step's update; a planted composition bug moves the
losses, norms or weights by 1e-4 or more."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import tempfile
import types
import unittest
from pathlib import Path

import torch
import torch.nn.functional as F

from lessons._testing import (
    assert_argument_error,
    exercise,
    in_file_order,
    run_under_torchrun,
    selected_exercises,
)

nd = importlib.import_module("lessons.13_capstone.nd")  # the technique
nd_model = importlib.import_module("lessons.13_capstone.nd_model")
nd_placement = importlib.import_module("lessons.13_capstone.nd_placement")
nd_checks = importlib.import_module("lessons.13_capstone.nd_checks")  # the harness
tensor_parallel = importlib.import_module("lessons.04_tensor_parallel.main")
checkpointing = importlib.import_module("lessons.06_checkpointing.main")
C = importlib.import_module("lessons.13_capstone.checks")  # the capstone's CLI
MAIN = Path(nd.__file__).with_name("main.py")
README = MAIN.with_name("README.md").read_text()

TOLERANCE = {"loss": 1e-12, "norm": 1e-12, "params": 1e-9}
DATA, PIPE, HEADS = nd_checks.DATA, nd_checks.PIPE, nd_checks.HEADS  # uneven sizes: nd_checks
SAVE_AT = 2  # the saving runs checkpoint every 2 steps; the resumes start from step 2


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the suite: a layout, its config, its batches ("padded", "packed" or
    "random"), and what else it does."""

    layout: nd.Layout
    config: nd_model.GPTConfig
    batches: str
    save: bool = False
    bf16: bool = False
    resume_of: str | None = None  # the saving case whose checkpoint this one resumes
    resume_step: int = SAVE_AT
    dcp: bool = False


CASES = {  # nd_checks.PROOF (world 3: a degree of 3 in each dimension; world 6: compositions) ...
    **{name: Case(*nd_checks.PROOF[name]) for name in ("dp3", "pp3", "tp2xpp3", "dp3xcp2")},
    "cp3": Case(*nd_checks.PROOF["cp3"], save=True, dcp=True),
    "tp3": Case(*nd_checks.PROOF["tp3"], save=True),
    # ... then on 6 ranks: bf16, and the world-3 checkpoints resharded
    "dp2xcp3-bf16": Case(nd.Layout(dp=2, cp=3), DATA, "random", bf16=True),
    "cp3-as-dp3xtp2": Case(nd.Layout(dp=3, tp=2), DATA, "packed", resume_of="cp3"),
    "tp3-as-dp3xcp2": Case(nd.Layout(dp=3, cp=2), HEADS, "packed", resume_of="tp3"),
    "cp3-end-as-dp3xtp2-dcp": Case(nd.Layout(dp=3, tp=2), DATA, "packed", resume_of="cp3",
                                   resume_step=DATA.steps, dcp=True),
}
FROM_SCRATCH = [name for name, case in CASES.items() if case.resume_of is None and not case.bf16]


class Runs:
    """Every case's run, one launch per world size, made the first time a test asks for one
    of its cases and kept for the others (one per test process). A launch that raised is
    remembered and re-raised, never launched again. The grader running an exercise alone
    (a planted bug, a mutant: `selected_exercises()`) stops at its first failure, so there
    each case is launched alone when first asked for (a mistake that dp3 shows costs one run
    of 3 ranks, not four)."""

    results: dict[str, list[dict]] = {}
    failed: dict[str, BaseException] = {}
    scratch: Path | None = None
    batches: dict[tuple, list] = {}
    references: dict[tuple, tuple] = {}

    @classmethod
    def batches_of(cls, case: Case) -> list:
        key = (case.config, case.batches)
        if key not in cls.batches:
            cls.batches[key] = nd_checks.make_batches(case.config, case.batches)
        return cls.batches[key]

    @classmethod
    def reference(cls, case: Case, dtype: torch.dtype = torch.float64) -> tuple:
        """nd_model.train_one_process on the case's batches: ([(loss, norm)], model)."""
        key = (case.config, case.batches, dtype)
        if key not in cls.references:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as every rank runs: one thread is fastest on a busy machine
            try:
                cls.references[key] = nd_model.train_one_process(case.config, cls.batches_of(case), dtype)
            finally:
                torch.set_num_threads(threads)
        return cls.references[key]

    @classmethod
    def run_of(cls, name: str) -> nd_checks.LayoutRun:
        case = CASES[name]
        ckpt = None
        if case.save:
            ckpt = cls.scratch / name
        elif case.resume_of is not None:  # a copy whose `latest` is the step to resume from
            ckpt = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=cls.scratch))
            shutil.copytree(cls.scratch / case.resume_of, ckpt, dirs_exist_ok=True)
            checkpointing.atomic_write_bytes(
                ckpt / checkpointing.LATEST, (checkpointing.step_dir_name(case.resume_step) + "\n").encode())
        dcp_dir = str(cls.scratch / "dcp") if case.dcp else None
        return nd_checks.LayoutRun(case.config, case.layout, cls.batches_of(case),
                                   None if ckpt is None else str(ckpt), SAVE_AT if case.save else 0,
                                   case.resume_of is not None, dcp_dir, case.save and case.dcp, case.bf16)

    @classmethod
    def of(cls, name: str) -> list[dict]:
        """The case's results, one dict per rank (nd_checks.train_layout's)."""
        if cls.scratch is None:
            cls.scratch = Path(tempfile.mkdtemp(prefix="capstone-nd-"))
        world = CASES[name].layout.world
        alone = selected_exercises() is not None
        names = [n for n, case in CASES.items() if case.layout.world == world and (n == name or not alone)]
        if name in cls.failed:
            raise AssertionError(f"the {world}-rank launch ({', '.join(names)}) failed before, not "
                                 f"launched again: {cls.failed[name]}") from cls.failed[name]
        if name not in cls.results:
            for source in dict.fromkeys(CASES[n].resume_of for n in names if CASES[n].resume_of):
                cls.of(source)  # the world-3 checkpoints the world-6 launch resumes
            try:
                results = nd_checks.run_layouts([cls.run_of(n) for n in names], "cpu", timeout_s=60.0)
            except Exception as exc:
                cls.failed.update(dict.fromkeys(names, exc))
                raise AssertionError(f"the {world}-rank launch ({', '.join(names)}) failed: {exc}") from exc
            cls.results.update(zip(names, results))
        return cls.results[name]


def tearDownModule():
    if Runs.scratch is not None:
        shutil.rmtree(Runs.scratch, ignore_errors=True)


def differences_from_one_process(name: str) -> dict[str, float]:
    case = CASES[name]
    reference, model = Runs.reference(case, torch.float32 if case.bf16 else torch.float64)
    return nd_checks.largest_differences(Runs.of(name), reference, model)


def assert_equals_one_process(test: unittest.TestCase, name: str) -> None:
    case = CASES[name]
    for what, difference in differences_from_one_process(name).items():
        test.assertLess(difference, TOLERANCE[what],
                        f"layout {case.layout} ({name}, {case.batches} batches, hidden "
                        f"{case.config.hidden}, vocab {case.config.vocab}): the {what} differs from "
                        f"one process by {difference:.3g}, expected < {TOLERANCE[what]:g}")


@exercise("compose-step")
class TestClipOnShards(unittest.TestCase):
    """clip() in this process on a stand-in trainer that holds only what clip reads, on a
    one-rank gloo group (its all-reduce the identity): hand-worked gradients, float64. Below
    the threshold nothing changes; above it every shard scales by clip / (norm + 1e-6); tp
    rank 1 leaves the replicated tensors out of the norm, not out of the scaling."""

    GRADS = (torch.tensor([3.0, -1.0, 2.0], dtype=torch.float64),  # a tp-split tensor's shard
             torch.tensor([1.0, 0.5, -2.0, 4.0, 0.0], dtype=torch.float64))  # a replicated one

    @classmethod
    def setUpClass(cls):
        folder = tempfile.mkdtemp(prefix="capstone-clip-")
        torch.distributed.init_process_group("gloo", init_method=f"file://{folder}/rendezvous",
                                             rank=0, world_size=1)
        cls.addClassCleanup(shutil.rmtree, folder, ignore_errors=True)
        cls.addClassCleanup(torch.distributed.destroy_process_group)

    def clip(self, tp_rank: int, threshold: float, cp_rank: int = 0, dp_rank: int = 0
             ) -> tuple[float, list[torch.Tensor]]:
        shards = []
        for grad in self.GRADS:
            shard = torch.zeros_like(grad)
            shard.grad = grad.clone()
            shards.append(shard)
        Placement = nd_placement.Placement
        trainer = types.SimpleNamespace(
            device=torch.device("cpu"), coords={"dp": dp_rank, "tp": tp_rank, "pp": 0, "cp": cp_rank},
            config=types.SimpleNamespace(clip=threshold), zero=types.SimpleNamespace(shards=shards),
            placements=[Placement("w", (6,), 0), Placement("b", (5,), None)])
        norm = nd.NDTrainer.clip(trainer)
        return float(norm), [shard.grad for shard in shards]

    def test_a_norm_below_clip_leaves_the_gradients_alone(self):
        norm, grads = self.clip(tp_rank=0, threshold=100.0)
        self.assertAlmostEqual(norm, 35.25 ** 0.5, delta=1e-12,
                               msg="||g|| over both shards: sqrt(14 + 21.25)")
        for grad, expected in zip(grads, self.GRADS):
            self.assertTrue(torch.equal(grad, expected),
                            f"||g|| {norm:.4f} < clip 100: expected the gradient unchanged "
                            f"{expected.tolist()}, got {grad.tolist()} (scale = min(1, clip / norm))")

    def test_a_norm_above_clip_scales_every_shard(self):
        # tp rank 1: the split shard only; every dp x cp rank counts its own ZeRO shard, the
        # ranks other than dp 0 and cp 0 as well
        for tp_rank, cp_rank, dp_rank, squares in ((0, 0, 0, 35.25), (1, 0, 0, 14.0), (0, 1, 0, 35.25),
                                                   (1, 1, 0, 14.0), (0, 0, 1, 35.25)):
            where = f"tp rank {tp_rank}, cp rank {cp_rank}, dp rank {dp_rank}"
            norm, grads = self.clip(tp_rank=tp_rank, threshold=0.5, cp_rank=cp_rank, dp_rank=dp_rank)
            self.assertAlmostEqual(norm, squares ** 0.5, delta=1e-12,
                                   msg=f"{where}: ||g|| (this rank's shards; replicated tensors on tp "
                                       f"rank 0 only)")
            scale = 0.5 / (squares ** 0.5 + 1e-6)
            for grad, expected in zip(grads, self.GRADS):
                self.assertLess(float((grad - expected * scale).abs().max()), 1e-15,
                                f"{where}: expected every shard times clip / (||g|| + 1e-6) "
                                f"= {scale:.6f}: {(expected * scale).tolist()}, got {grad.tolist()}")


@exercise("compose-step")
class TestDimensionGroups(unittest.TestCase):
    def test_small_grids_by_hand(self):
        layout = nd.Layout(dp=2, tp=2)  # ranks (dp, tp): 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1)
        for dims, expected in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]]),
                               ("pp", [[0], [1], [2], [3]]), (("dp", "tp"), [[0, 1, 2, 3]])):
            got = nd.dimension_groups(layout, dims)
            self.assertEqual(got, expected, f"dimension_groups({layout}, {dims!r}): expected "
                                            f"{expected}, got {got}")
        # dp2 x cp3 x tp2: rank = (dp x 3 + cp) x 2 + tp; the dp x cp groups, dp outermost
        layout = nd.Layout(dp=2, cp=3, tp=2)
        for dims, expected in ((("dp", "cp"), [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]),
                               ("cp", [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]),
                               (("cp", "tp"), [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])):
            got = nd.dimension_groups(layout, dims)
            self.assertEqual(got, expected, f"dimension_groups({layout}, {dims!r}): expected "
                                            f"{expected}, got {got}")

    def test_every_dimension_and_pair_partitions_the_ranks_and_varies_only_itself(self):
        layout = nd.Layout(dp=3, tp=2, pp=2, cp=3)
        for dims in [*nd.DIMS, ("dp", "cp"), ("pp", "tp"), ("dp", "tp")]:
            varied = (dims,) if isinstance(dims, str) else dims
            groups = nd.dimension_groups(layout, dims)
            ranks = sorted(r for g in groups for r in g)
            self.assertEqual(ranks, list(range(layout.world)),
                             f"{layout}, {dims!r}: every rank in exactly one group")
            for group in groups:
                coords = [layout.coordinates(r) for r in group]
                seen = [tuple(c[d] for d in varied) for c in coords]
                expected = sorted(seen)  # each combination once, the first dimension outermost
                self.assertEqual(seen, expected, f"{layout}, {dims!r}: group {group} is not in "
                                                 f"the order of its coordinates")
                self.assertEqual(len(set(seen)), len(group), f"{layout}, {dims!r}: group {group}")
                for other in set(nd.DIMS) - set(varied):
                    self.assertEqual(len({c[other] for c in coords}), 1,
                                     f"{layout}, {dims!r}: group {group} varies {other}")


def loss_shares(pieces: list[tuple[torch.Tensor, torch.Tensor]], tokens: int, microbatches: int) -> list:
    """What nd.NDTrainer.loss_fn returns for each (logits (n, b, V), targets (b, n)) piece, on a
    stand-in trainer that holds what loss_fn reads, and the layout the pieces come from (cp2:
    each micro-batch's positions in 2 pieces)."""
    trainer = types.SimpleNamespace(config=types.SimpleNamespace(microbatches=microbatches),
                                    tokens=torch.tensor(tokens), layout=nd.Layout(cp=2))
    return [nd.NDTrainer.loss_fn(trainer, logits, targets) for logits, targets in pieces]


@exercise("compose-step")
class TestLossOverRealTokens(unittest.TestCase):
    """loss_fn by hand: 2 micro-batches x 2 pieces (as cp or tp would cut the positions) of a
    batch of 2 rows x 4 positions, whose pieces hold 4, 1, 0 and 4 real targets."""

    def setUp(self):
        generator = torch.Generator().manual_seed(3)
        self.logits = torch.randn(2, 4, 2, 5, generator=generator, dtype=torch.float64)  # (mb, s, b, V)
        self.logits.requires_grad_()
        self.targets = torch.randint(0, 5, (2, 2, 4), generator=generator)  # (mb, b, s)
        ignored = [(0, 0, 3), (0, 1, 2), (0, 1, 3), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
        for mb, row, position in ignored:
            self.targets[mb, row, position] = nd_model.IGNORE_INDEX
        self.pieces = [(self.logits[mb, half * 2:half * 2 + 2], self.targets[mb, :, half * 2:half * 2 + 2])
                       for mb in range(2) for half in range(2)]
        self.real = int((self.targets != nd_model.IGNORE_INDEX).sum())  # 9
        flat_logits = self.logits.permute(0, 2, 1, 3).reshape(-1, 5)  # rows (mb, b, s)
        self.expected = F.cross_entropy(flat_logits, self.targets.reshape(-1),
                                        ignore_index=nd_model.IGNORE_INDEX)

    def test_the_shares_add_up_to_the_one_process_mean_and_its_gradient(self):
        shares = loss_shares(self.pieces, self.real, microbatches=2)
        counts = [int((targets != nd_model.IGNORE_INDEX).sum()) for _, targets in self.pieces]
        self.assertEqual(counts, [4, 1, 0, 4], "the hand-worked case")
        total = sum(shares) / 2  # pipeline_step divides each micro-batch's loss by m = 2
        self.assertAlmostEqual(total.item(), self.expected.item(), delta=1e-12,
                               msg=f"sum of the shares / m: expected the mean over the {self.real} real "
                                   f"targets {self.expected.item():.6f}, got {total.item():.6f}")
        ours = torch.autograd.grad(total, self.logits)[0]
        theirs = torch.autograd.grad(self.expected, self.logits)[0]
        self.assertLess(float((ours - theirs).abs().max()), 1e-14,
                        "the shares' gradient must be the one-process loss's gradient")
        means = [F.cross_entropy(lg.reshape(-1, 5), tg.t().reshape(-1), ignore_index=nd_model.IGNORE_INDEX)
                 for lg, tg in self.pieces if (tg != nd_model.IGNORE_INDEX).any()]
        mean_of_means = (sum(means) / len(means)).item()
        self.assertGreater(abs(mean_of_means - self.expected.item()), 1e-3,
                           "the case must tell the mean over targets from a mean of the pieces' means")
        for quoted in (f"is **{self.expected.item():.3f}**", f"means **{mean_of_means:.3f}**"):
            self.assertIn(quoted, README, "the README's worked example (The math)")

    def test_a_piece_without_real_targets_adds_zero(self):
        shares = loss_shares(self.pieces, self.real, microbatches=2)
        for share, (_, targets) in zip(shares, self.pieces):
            self.assertEqual(share.dim(), 0, f"loss_fn returns a 0-d tensor, got shape {tuple(share.shape)}")
            if not (targets != nd_model.IGNORE_INDEX).any():
                self.assertEqual(share.item(), 0.0, "a piece with no real target: expected a share "
                                                    f"of 0, got {share.item()}")


@exercise("compose-step")
class TestEveryLayoutIsOneProcess(unittest.TestCase):
    """unittest runs these in alphabetical order: the 3-rank layouts first (they catch most
    composition mistakes in a third of the 6-rank launch's time), then the 6-rank ones. One
    test per dimension at degree 3: the suite runs the four in one launch (Runs.of), the grader
    running one exercise launches only the layout of the test it runs, so a mistake in one
    dimension costs that dimension's launch."""

    def test_a_context_parallel_degree_of_3(self):
        assert_equals_one_process(self, "cp3")

    def test_a_data_parallel_degree_of_3(self):
        assert_equals_one_process(self, "dp3")

    def test_a_pipeline_parallel_degree_of_3(self):
        assert_equals_one_process(self, "pp3")

    def test_a_tensor_parallel_degree_of_3(self):
        assert_equals_one_process(self, "tp3")

    def test_compositions_on_6_ranks(self):
        for name in ("tp2xpp3", "dp3xcp2"):
            assert_equals_one_process(self, name)

    def test_the_init_device_mesh_groups_are_the_enumerated_groups(self):
        """Every run's mesh groups, against dimension_groups (after the runs' own checks)."""
        for name in [*FROM_SCRATCH, "dp2xcp3-bf16"]:
            layout = CASES[name].layout
            for rank, result in enumerate(Runs.of(name)):
                self.assertEqual(result["coords"], layout.coordinates(rank), f"{layout}, rank {rank}")
                for dims in [*nd.DIMS, ("dp", "cp")]:
                    key = dims if isinstance(dims, str) else "_".join(dims)
                    mine = [g for g in nd.dimension_groups(layout, dims) if rank in g][0]
                    self.assertEqual(result["groups"][key], mine,
                                     f"{layout}, rank {rank}: the {key} group is "
                                     f"{result['groups'][key]}, expected {mine}")

    def test_the_proofs_data_has_teeth(self):
        # clipping acts (else a bug in the clipping could not show), and the pieces of the
        # padded and packed batches hold different numbers of real targets (else a mean of
        # their means would equal the batch's mean)
        for name in FROM_SCRATCH:
            case = CASES[name]
            reference, _ = Runs.reference(case)
            self.assertGreater(max(norm for _, norm in reference), case.config.clip,
                               f"{name}: no step's norm exceeds clip {case.config.clip}")
            _, targets = nd_model.inputs_and_targets(Runs.batches_of(case)[0])
            counts = {int(n) for n in (targets != nd_model.IGNORE_INDEX).sum(1)}
            self.assertGreater(len(counts), 1 if case.batches == "packed" else 3,
                               f"{name}: rows of {case.batches} batches hold {sorted(counts)} real targets")


@exercise("placements")
class TestPlacements(unittest.TestCase):
    def test_cut_gives_lesson_04s_shards_at_tp3(self):
        torch.manual_seed(0)
        block = nd_model.Block(21, 3).double()
        qkv = torch.cat([block.q.weight, block.k.weight, block.v.weight]).detach()
        Placement = nd_placement.Placement
        fused, rows = Placement("qkv", (63, 21), 0, 3), Placement("o", (21, 21), 1)
        up = Placement("up", (84, 21), 0)
        for rank in range(3):
            tp = tensor_parallel.TensorParallelGroup(rank, 3)
            split = tensor_parallel.ColumnParallelLinear([block.q, block.k, block.v], tp)
            row = tensor_parallel.RowParallelLinear(block.o, tp)
            column = tensor_parallel.ColumnParallelLinear(block.up, tp)
            for placement, full, theirs in ((fused, qkv, split.weight), (rows, block.o.weight, row.weight),
                                            (up, block.up.weight, column.weight)):
                mine = nd_placement.cut(full.detach(), placement, rank, 3)
                self.assertTrue(torch.equal(mine, theirs.detach()),
                                f"cut({placement.name}, rank {rank} of 3): expected lesson 04's shard "
                                f"{tuple(theirs.shape)}, got {tuple(mine.shape)} "
                                f"{'with other values' if mine.shape == theirs.shape else ''}")

    def test_cut_and_join_a_fused_tensor_along_dim_1(self):
        # parts and pieces both along dim 1 (no placement of the block has that, the
        # specification allows it): part j's columns 4j..4j+3, rank r of 2 holds 2 of each
        full = torch.arange(5.0 * 12).view(5, 12)  # every row and column differs
        placement = nd_placement.Placement("w", (5, 12), 1, 3)
        pieces = []
        for rank in range(2):
            columns = [4 * j + 2 * rank + c for j in range(3) for c in range(2)]
            mine = nd_placement.cut(full, placement, rank, 2)
            pieces.append(mine)
            self.assertTrue(torch.equal(mine, full[:, columns]),
                            f"cut({placement}, rank {rank} of 2): expected columns {columns} "
                            f"(piece {rank} of each of the 3 parts along dim 1), got shape "
                            f"{tuple(mine.shape)}")
        joined = nd_placement.join(pieces, placement)
        self.assertTrue(torch.equal(joined, full),
                        f"join of {placement}'s 2 pieces: expected the (5, 12) tensor back, got "
                        f"shape {tuple(joined.shape)}")

    def test_join_inverts_cut(self):
        full = torch.arange(36.0 * 6).view(36, 6)  # every row and column differs
        Placement = nd_placement.Placement
        for placement in (Placement("a", (36, 6), 0, 3), Placement("b", (36, 6), 1, 1),
                          Placement("c", (36, 6), 0, 2), Placement("d", (36, 6), None)):
            for size in (1, 2, 3):
                pieces = [nd_placement.cut(full, placement, r, size) for r in range(size)]
                joined = nd_placement.join(pieces, placement)
                self.assertTrue(torch.equal(joined, full),
                                f"join(cut(...)) of {placement} over {size} ranks: not the tensor back")
                if placement.dim is not None and size > 1:
                    self.assertFalse(torch.equal(pieces[0], pieces[1]), f"{placement}: pieces differ")

    def test_an_uneven_cut_is_refused(self):
        Placement = nd_placement.Placement
        with self.assertRaisesRegex(ValueError, r"qkv.*3 x 2"):
            nd_placement.cut(torch.zeros(9, 4), Placement("qkv", (9, 4), 0, 3), 0, 2)
        with self.assertRaisesRegex(ValueError, "o"):
            nd_placement.cut(torch.zeros(4, 5), Placement("o", (4, 5), 1), 1, 2)

    def test_the_shards_join_into_the_global_tensors_each_element_once(self):
        for name in ("dp3xcp2", "tp3"):  # ZeRO over 6 ranks; tp pieces over 3
            results = Runs.of(name)
            counted = sum(t["params"].numel() for r in results for t in r["state"]["tensors"].values())
            expected = sum(t.numel() for t in nd_model.global_state(Runs.reference(CASES[name])[1]).values())
            self.assertEqual(counted, expected, f"{CASES[name].layout}: the shards hold {counted} "
                                                f"elements, the model {expected}")


class TestResumeInAnotherLayout(unittest.TestCase):
    """The world-3 checkpoints (step 2 of 4) resumed on 6 ranks in other layouts: tp pieces
    cut (cp3 as dp3 x tp2) and joined (tp3 as dp3 x cp2), ZeRO's shards over 1 or 3 ranks
    recut over 3 or 6; the trajectory must be one process's."""

    def test_cp3_resumes_as_dp3_x_tp2(self):
        self.assertEqual(Runs.of("cp3-as-dp3xtp2")[0]["resumed_from"], SAVE_AT)
        assert_equals_one_process(self, "cp3-as-dp3xtp2")

    def test_tp3_resumes_as_dp3_x_cp2(self):
        self.assertEqual(Runs.of("tp3-as-dp3xcp2")[0]["resumed_from"], SAVE_AT)
        assert_equals_one_process(self, "tp3-as-dp3xcp2")

    def test_our_resharded_load_equals_torch_distributed_checkpoint(self):
        # the cp3 run's end, saved by us and by DCP (DTensors), loaded as dp3 x tp2
        for rank, result in enumerate(Runs.of("cp3-end-as-dp3xtp2-dcp")):
            self.assertEqual(result["resumed_from"], DATA.steps, rank)
            self.assertGreater(result["dcp"]["tensors"], 50, rank)
            self.assertEqual(result["dcp"]["max_abs_diff"], 0.0,
                             f"rank {rank}: DCP's load differs from ours by {result['dcp']['max_abs_diff']}")

    def test_a_missing_slice_is_named(self):
        states = [dict(r["state"], tensors=dict(r["state"]["tensors"])) for r in Runs.of("tp3")]
        del states[2]["tensors"]["blocks.0.qkv.weight"]  # tp rank 2's piece
        with self.assertRaisesRegex(checkpointing.CheckpointError, r"blocks\.0\.qkv\.weight: tp rank 2"):
            nd_placement.assemble(states)

    def test_another_model_is_refused_before_any_tensor_is_used(self):
        Runs.of("cp3")
        other = dataclasses.replace(DATA, hidden=24)  # what resume() checks first, on every rank
        with self.assertRaisesRegex(checkpointing.CheckpointError, "fingerprint"):
            checkpointing.load_latest(Runs.scratch / "cp3", 3, True, other.fingerprint())


class TestBf16(unittest.TestCase):
    """bf16 autocast, what the N-D run uses on GPUs, exercised on the CPU (float32 weights) on
    dp2 x cp3, against the float32 one-process run without autocast."""

    def test_bf16_stays_within_bf16_rounding_of_the_fp32_run(self):
        case = CASES["dp2xcp3-bf16"]
        differences = differences_from_one_process("dp2xcp3-bf16")
        reference, _ = Runs.reference(case, torch.float32)
        loss = max(loss for loss, _ in reference)
        # bf16 keeps 8 significant bits (each rounding 2^-9 = 2e-3 relative); the mean loss over
        # 144 tokens averages those errors out: 1e-3 relative (measured 1.9e-4 on a loss of 3.8)
        self.assertLess(differences["loss"], 1e-3 * loss,
                        f"bf16 {case.layout}: the loss differs by {differences['loss']:.3g}, expected "
                        f"< {1e-3 * loss:.3g}")
        self.assertLess(differences["norm"], 2e-2, f"bf16 {case.layout}: the norm differs by "
                        f"{differences['norm']:.3g} (measured 3.1e-3), expected < 2e-2")
        # the weights: rounding can flip an element's update, and one AdamW step moves an
        # element by at most lr_t |m/sqrt(v)| <= 1.01 lr_t in these first steps (m and v the
        # bias-corrected moments: Cauchy-Schwarz), so the runs differ by <= 2.02 x sum of lr_t
        schedule = checkpointing.cosine_with_warmup(case.config.warmup, case.config.steps)
        bound = 2.02 * sum(case.config.lr * schedule(step) for step in range(case.config.steps))
        self.assertLess(differences["params"], bound,
                        f"bf16 {case.layout}: the weights differ by {differences['params']:.3g} "
                        f"(measured 8.3e-3), expected < {bound:.3g}")
        self.assertGreater(differences["loss"], 1e-5, f"bf16 {case.layout}: a loss {differences['loss']:.2g} "
                                                      "from fp32's: autocast did not run in bf16")


ND_ARGS = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--global-batch", "8",
           "--accum", "2", "--steps", "8", "--save-every", "4", "--sample-chars", "0"]


def metrics_of(path: Path) -> dict:
    return json.loads(path.read_text())["metrics"]


class TestCorpusRuns(unittest.TestCase):
    """The capstone's CLI with --dp --tp --pp --cp on the shipped corpus (float64 on the CPU):
    the demo's checks (its run equals one process's; a bitwise resume from the middle
    checkpoint), a resume in another layout, a pipeline under torchrun on two nodes. (The
    real SIGKILL is test_capstone's: the N-D run goes through the same worker and resume.)"""

    @classmethod
    def setUpClass(cls):
        cls.dir = Path(tempfile.mkdtemp(prefix="capstone-nd-cli-"))
        cls.plain = C.main([*ND_ARGS, "--tp", "2", "--cp", "2", "--device", "cpu",
                            "--out", str(cls.dir / "plain"), "--json", str(cls.dir / "plain.json")])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_the_n_d_demo_passes_equals_one_process_and_resumes_bit_for_bit(self):
        self.assertEqual(self.plain, 0)
        metrics = metrics_of(self.dir / "plain.json")
        self.assertEqual(metrics["layout"], {"dp": 1, "tp": 2, "pp": 1, "cp": 2})
        self.assertEqual(metrics["resume_check"], "bitwise from step 4")
        gap = metrics["one_process"]
        self.assertEqual((gap["precision"], gap["steps"], gap["passed"]), ("float64", 8, True), gap)
        for key, limit in nd_checks.DEMO_TOLERANCE["float64"].items():
            self.assertLessEqual(gap[key], limit, f"tp2 x cp2 on the corpus: {key} {gap[key]:.3g}")

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
        # the resumed steps and the final weights against one process trained from step 0
        self.assertEqual((other["one_process"]["steps"], other["one_process"]["passed"]), (4, True),
                         other["one_process"])
        self.assertLess(abs(other["final_val_loss"] - plain["final_val_loss"]), 1e-9,
                        "float64, sums in another order: the same trajectory to rounding")

    def test_torchrun_two_nodes_runs_a_pipeline_across_them(self):
        out = self.dir / "torchrun"
        report = run_under_torchrun(MAIN, [*ND_ARGS, "--pp", "2", "--out", str(out)],
                                    nproc_per_node=1, nnodes=2)
        self.assertTrue(report["passed"], report["checks"])
        self.assertEqual(report["metrics"]["layout"], {"dp": 1, "tp": 1, "pp": 2, "cp": 1})
        self.assertTrue(report["metrics"]["one_process"]["passed"], report["metrics"]["one_process"])


class TestLayoutRefusals(unittest.TestCase):
    """What a model cannot split is refused with one line (nd.check_layout, and the N-D flags
    that call it): no ranks."""

    def test_check_layout_names_what_does_not_divide(self):
        for config, layout, fragment in (
                (HEADS, nd.Layout(tp=2), "layout tp2: heads = 3 is not divisible by tp = 2"),
                (DATA, nd.Layout(pp=3), "layers = 2 is not divisible by pp = 3"),
                (DATA, nd.Layout(cp=4), "seq = 12 is not divisible by 2 x cp = 8"),
                (DATA, nd.Layout(cp=2, tp=4), "seq / cp = 6 positions do not split over tp = 4"),
                (DATA, nd.Layout(dp=5), "global_batch = 12 is not divisible by dp x microbatches = 10")):
            with self.subTest(layout=str(layout)), self.assertRaises(ValueError) as caught:
                nd.check_layout(config, layout)
            self.assertIn(fragment, str(caught.exception))
        for layout in (nd.Layout(dp=3), nd.Layout(cp=3), nd.Layout(tp=2, pp=3), nd.Layout(dp=3, cp=2)):
            nd.check_layout(PIPE if layout.pp > 1 else DATA, layout)  # the suite's layouts pass

    def test_a_block_refuses_heads_that_tp_does_not_divide(self):
        # uneven head splits are refused where the block is built (lesson 04), as Megatron-LM
        # and torch's TP split whole heads
        gpt = nd_model.build_gpt(HEADS, torch.float64)
        with self.assertRaisesRegex(ValueError, r"attention heads \(3\) must be divisible .* \(2\)"):
            nd.ParallelBlock(gpt.blocks[0], tensor_parallel.TensorParallelGroup(0, 2), None, HEADS.seq)

    def test_bad_layouts_exit_2_with_one_line(self):
        for flags, fragment in ((["--tp", "4"], "heads = 2 is not divisible by tp = 4"),
                                (["--pp", "3"], "layers = 2 is not divisible by pp = 3"),
                                (["--cp", "3"], "seq = 32 is not divisible by 2 x cp = 6")):
            assert_argument_error(self, C.parse_args, [*ND_ARGS, *flags], fragment)
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--heads", "4", "--tp", "4", "--seq", "6"],
                              "seq / cp = 6 positions do not split over tp = 4")
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--dp", "3"], "global_batch = 8")
        assert_argument_error(self, C.parse_args, [*ND_ARGS, "--tp", "2", "--ddp", "torch"], "--ddp torch")

    def test_odd_degrees_parse_with_sizes_that_split(self):
        args = C.parse_args([*ND_ARGS, "--global-batch", "12", "--layers", "3", "--heads", "3",
                             "--hidden", "33", "--seq", "36", "--dp", "3"])
        self.assertEqual((args.layout, args.world_size), (nd.Layout(dp=3), 3))
        for flags in (["--pp", "3"], ["--tp", "3"], ["--cp", "3"]):
            args = C.parse_args([*ND_ARGS, "--global-batch", "12", "--layers", "3", "--heads", "3",
                                 "--hidden", "33", "--seq", "36", *flags])
            self.assertEqual(args.world_size, 3, flags)


load_tests = in_file_order(__name__)  # unittest and the grader: the in-process checks first

if __name__ == "__main__":
    unittest.main()
