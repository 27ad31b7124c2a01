"""Lesson 08's suite: chunk packing, the LRU pool, bitwise training under offloading and
recomputation (with Adam, AdamW and SGD, frozen and unused parameters: the optimizer contract),
the memory between forward and backward, the cost model against lesson 07's tracker (peaks,
fetches and the elements they copy), the planner and its safety factor, the numbers the README
and the quiz quote, the CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import math
import unittest
import unittest.mock
from pathlib import Path

import torch

from lessons._launch import launch
from lessons._testing import assert_argument_error, assert_every_check_passes, exercise

M = importlib.import_module("lessons.08_offload.main")  # the technique: chunks, pool, manager
CM = importlib.import_module("lessons.08_offload.cost_model")  # the technique: cost model, planner
C = importlib.import_module("lessons.08_offload.checks")  # the harness
W = importlib.import_module("lessons.08_offload.tests.workers")
CONFIG = W.CONFIG
README = Path(M.__file__).with_name("README.md").read_text()
QUIZ = Path(M.__file__).with_name("quiz.json").read_text()
_THREADS = torch.get_num_threads()


class OraclePool:
    """An independent LRU pool (the chunk manager's tests run on it, so a mistake in the
    learner's BufferPool or access_plan shows in the buffer-pool row only)."""

    def __init__(self, n_buffers):
        self.n_buffers, self.resident, self.fetches = n_buffers, {}, 0

    def acquire(self, chunks, keep=()):
        if len(chunks) + len(keep) > self.n_buffers:
            raise ValueError(f"only {self.n_buffers} buffers")
        placed = []
        for chunk in chunks:
            fetched = chunk not in self.resident
            if fetched:
                taken = set(self.resident.values())
                free = [b for b in range(self.n_buffers) if b not in taken]
                if free:
                    buffer = free[0]
                else:
                    victim = [c for c in self.resident if c not in chunks and c not in keep][0]
                    buffer = self.resident.pop(victim)
                self.fetches += 1
            else:
                buffer = self.resident.pop(chunk)
            self.resident[chunk] = buffer  # dicts keep insertion order: most recent last
            placed.append((chunk, buffer, fetched))
        return placed

    def clear(self):
        self.resident.clear()


def oracle_access_plan(block_chunks, n_persist, block, direction, pool):
    wanted = [c for c in block_chunks[block] if c >= n_persist]
    plan = [(wanted, ())]
    if 0 <= block + direction < len(block_chunks):
        missing = [c for c in block_chunks[block + direction]
                   if c >= n_persist and c not in wanted and c not in pool.resident]
        if missing and len(wanted) < pool.n_buffers:
            plan.append(([missing[0]], tuple(wanted)))
    return plan


@contextlib.contextmanager
def oracle_pool():
    with unittest.mock.patch.object(M, "BufferPool", OraclePool), \
            unittest.mock.patch.object(M, "access_plan", oracle_access_plan):
        yield


def assert_same_training(case, run: dict, reference: dict, where: str) -> None:
    """Losses and every weight bitwise equal to the plain run, naming the first difference."""
    case.assertEqual(run["losses"], reference["losses"], f"{where}: losses per step differ from "
                     "the plain run's")
    for index, (got, want) in enumerate(zip(run["weights"], reference["weights"], strict=True)):
        case.assertTrue(torch.equal(got, want), f"{where}: parameter {index} ({tuple(want.shape)}) "
                        f"differs from the plain run by up to {float((got - want).abs().max()):.2e}")


def setUpModule():  # one thread, as the demo's rank runs (no spinning on a loaded machine)
    torch.set_num_threads(1)


def tearDownModule():
    torch.set_num_threads(_THREADS)


@exercise("buffer-pool")
class TestBufferPool(unittest.TestCase):
    def test_lru_pool(self):
        pool = M.BufferPool(2)
        placed = [pool.acquire([5]), pool.acquire([6]), pool.acquire([5]), pool.acquire([7])]
        # 5 and 6 take the lowest free buffers; 5 is a hit; 7 evicts 6, the least recently used
        self.assertEqual(placed, [[(5, 0, True)], [(6, 1, True)], [(5, 0, False)], [(7, 1, True)]],
                         "acquire([5]), ([6]), ([5]), ([7]) on 2 buffers: (chunk, buffer, fetched)")
        self.assertEqual(list(pool.resident.items()), [(5, 0), (7, 1)],
                         "resident chunk -> buffer, least recently used first")
        self.assertEqual(pool.fetches, 3, "3 misses (5, 6, 7); the second 5 is a hit")
        with self.assertRaisesRegex(ValueError, "only 2 buffers"):
            pool.acquire([1, 2, 3])

    def test_the_pool_never_evicts_a_kept_chunk(self):
        pool = M.BufferPool(2)
        pool.acquire([1])
        pool.acquire([2])
        placed = pool.acquire([3], keep=(1,))  # 1 is the LRU, but the running block needs it
        self.assertEqual(set(pool.resident), {1, 3}, "acquire([3], keep=(1,)) evicted a kept chunk")
        self.assertEqual(placed, [(3, 1, True)], "3 must take 2's buffer (1)")

    def test_a_block_never_evicts_its_own_chunks(self):
        pool = M.BufferPool(3)
        pool.acquire([4, 5, 6])
        placed = pool.acquire([6, 7, 4])  # 5 is the only chunk this block does not need
        self.assertEqual(placed, [(6, 2, False), (7, 1, True), (4, 0, False)],
                         "acquire([6, 7, 4]) after [4, 5, 6] on 3 buffers")
        self.assertEqual(list(pool.resident), [6, 7, 4], "most recently used last")

    def test_access_plan_prefetches_the_next_blocks_first_missing_chunk(self):
        block_chunks = [[0], [1, 2], [3]]
        pool = M.BufferPool(3)
        self.assertEqual(M.access_plan(block_chunks, 0, 0, 1, pool), [([0], ()), ([1], (0,))])
        self.assertEqual(M.access_plan(block_chunks, 0, 2, -1, pool), [([3], ()), ([1], (3,))])
        self.assertEqual(M.access_plan(block_chunks, 0, 2, 1, pool), [([3], ())])  # no next block
        self.assertEqual(M.access_plan(block_chunks, 2, 1, 1, pool), [([2], ()), ([3], (2,))])
        self.assertEqual(M.access_plan(block_chunks, 4, 1, 1, pool), [([], ())])  # all persistent
        pool.acquire([1])
        self.assertEqual(M.access_plan(block_chunks, 0, 0, 1, pool), [([0], ()), ([2], (0,))])
        full = M.BufferPool(1)  # no room to prefetch next to the block's own chunk
        self.assertEqual(M.access_plan(block_chunks, 0, 0, 1, full), [([0], ())])


class TestChunks(unittest.TestCase):
    def test_packing_keeps_order_and_never_straddles(self):
        model = M.make_offload_model(CONFIG, 0)
        slots, used = M.pack_chunks(model.layers, CONFIG["chunk_numel"])
        self.assertEqual(sum(used), sum(p.numel() for p in model.layers.parameters()),
                         "chunks must hold every block parameter once")
        self.assertTrue(all(0 < u <= CONFIG["chunk_numel"] for u in used),
                        f"chunk sizes {used} not in (0, {CONFIG['chunk_numel']}]")
        for before, after in zip(slots, slots[1:]):
            self.assertTrue((after.chunk, after.offset) == (before.chunk, before.offset + before.numel)
                            or (after.chunk == before.chunk + 1 and after.offset == 0),
                            f"slot at (chunk {after.chunk}, offset {after.offset}) does not follow "
                            f"(chunk {before.chunk}, offset {before.offset}, {before.numel} elements)")

    def test_a_parameter_larger_than_a_chunk_is_refused(self):
        with self.assertRaisesRegex(ValueError, "does not fit in a chunk"):
            M.pack_chunks(M.make_offload_model(CONFIG, 0).layers, 1000)


@exercise("chunk-manager")
class TestChunkManager(unittest.TestCase):
    """On the oracle pool and prefetch plan: only fetch_block, _pack and _unpack are graded."""

    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(1)
        with oracle_pool():  # all persistent: the profile needs no fetch of the learner's
            cls.profile, plain = C.profile_model(CONFIG, 1, repeats=1)
        # what forward leaves beyond the blocks (logits, loss), measured on the plain run
        cls.end_extra = plain["forward_end"] - plain["start"] - CONFIG["layers"] * cls.profile.act_block

    def test_offloaded_and_recomputed_equal_plain_bitwise(self):
        reference = C.train_plain(CONFIG, 3, 1)
        for candidate in (M.OffloadConfig(0, 0), M.OffloadConfig(1, 2), M.OffloadConfig(0, 3)):
            with self.subTest(offload=candidate), oracle_pool():
                run = C.train_offloaded(CONFIG, candidate, 3, 1)
                assert_same_training(self, run, reference, f"{candidate}, Adam")

    def test_fetches_copy_each_chunks_used_elements_into_its_buffer(self):
        """What the copies really move (counted at the aten level), against the plan: every
        fetch copies its chunk's used elements, the last chunk of a block being short."""
        for candidate in (M.OffloadConfig(0, 0), M.OffloadConfig(2, 3)):
            with self.subTest(offload=candidate), oracle_pool():
                run = C.train_offloaded(CONFIG, candidate, 2, 1)
                expected = (CM.count_fetches(self.profile, candidate),
                            CM.fetched_numel(self.profile, candidate))
                self.assertEqual((run["copies"], run["copied_numel"]), expected,
                                 f"{candidate}: (copies into buffers, elements copied) in one step")

    def test_memory_between_forward_and_backward(self):
        """At the end of forward the device holds the static bytes (fixed and persistent states,
        the buffers), the activations, and nothing else: a saved weight is a reference to its
        chunk, not a copy, and no buffer is allocated per fetch."""
        for candidate in (M.OffloadConfig(0, 0), M.OffloadConfig(1, 3)):
            with self.subTest(offload=candidate), oracle_pool():
                run = C.train_offloaded(CONFIG, candidate, 2, 1)
                kept = [self.profile.act_input if b < candidate.n_checkpoint else self.profile.act_block
                        for b in range(CONFIG["layers"])]
                expected = CM.static_bytes(self.profile, candidate) + sum(kept) + self.end_extra
                self.assertEqual(run["moments"]["forward_end"], expected,
                                 f"{candidate}: device bytes at the end of forward (static "
                                 f"{CM.static_bytes(self.profile, candidate):,} + kept activations "
                                 f"{sum(kept):,} + logits and loss {self.end_extra:,})")

    def test_buffers_are_reused_in_place_and_weights_are_views_of_them(self):
        with oracle_pool():
            model = M.make_offload_model(CONFIG, 1)
            manager = M.ChunkManager(model, M.OffloadConfig(0, 0), CONFIG["chunk_numel"])
            storages = [b.untyped_storage().data_ptr() for b in manager.buffers]
            for block in (0, 1, 2, 1, 0):
                manager.fetch_block(block)
                for slot in (s for s in manager.slots if s.block == block):
                    buffer = manager.buffers[manager.chunk_in_buffer[slot.chunk]]
                    self.assertEqual(slot.param.untyped_storage().data_ptr(),
                                     buffer.untyped_storage().data_ptr(),
                                     f"block {block}: a weight of chunk {slot.chunk} is not a view "
                                     "into its buffer (it must share the buffer's storage)")
                    self.assertTrue(torch.equal(slot.param, slot.master),
                                    f"block {block}: a weight of chunk {slot.chunk} differs from "
                                    "its host copy")
            self.assertEqual([b.untyped_storage().data_ptr() for b in manager.buffers], storages,
                             "a fetch allocated a new buffer instead of copying into the pool's")

    def test_saved_weights_are_packed_as_chunk_references(self):
        with oracle_pool():
            model = M.make_offload_model(CONFIG, 1)
            manager = M.ChunkManager(model, M.OffloadConfig(0, 0), CONFIG["chunk_numel"])
            manager.fetch_block(1)
            slot = next(s for s in manager.slots if s.block == 1 and s.param.dim() == 2)
            weight_t = slot.param.t()  # a strided view into the chunk buffer, as Linear saves it
            chunk, buffer = slot.chunk, manager.chunk_in_buffer[slot.chunk]
            self.assertTrue(torch.equal(slot.param, manager.flat[chunk][slot.offset:slot.offset
                                                                        + slot.numel].view(slot.shape)),
                            "after fetch_block(1) a weight of block 1 differs from its chunk")
            packed = manager._pack(weight_t)
            self.assertEqual(packed, (chunk, weight_t.shape, weight_t.stride(), weight_t.storage_offset()),
                             "_pack of a weight's .t() view: (chunk, shape, stride, storage offset)")
            other = torch.randn(3)
            self.assertIs(manager._pack(other), other, "_pack must keep a non-buffer tensor as it is")
            self.assertIs(manager._unpack(other), other, "_unpack must return a plain tensor as it is")
            self.assertTrue(torch.equal(manager._unpack(packed), weight_t),
                            "_unpack(_pack(w.t())) differs from w.t()")
            manager.buffers[buffer].zero_()  # the buffer's contents are what _unpack returns
            self.assertEqual(float(manager._unpack(packed).abs().sum()), 0.0,
                             "_unpack must read the buffer (now zeroed), not a copy made at _pack")
            del manager.chunk_in_buffer[chunk]
            with self.assertRaisesRegex(RuntimeError, f"chunk {chunk} is needed in backward"):
                manager._unpack(packed)

    def test_fetches_follow_the_plan_in_both_directions(self):
        with oracle_pool():
            model = M.make_offload_model(CONFIG, 1)
            config = M.OffloadConfig(0, 1)
            manager = M.ChunkManager(model, config, CONFIG["chunk_numel"])
            profile = CM.Profile(manager.used, manager.block_chunks, CONFIG["chunk_numel"], 0, 0, 0, 0)
            expected = CM.count_fetches(profile, config)  # the oracle pool, forward then backward
            calls = []
            original = manager.pool.acquire
            manager.pool.acquire = lambda chunks, keep=(): calls.append((list(chunks), keep)) or \
                original(chunks, keep)
            manager.step(*C.offload_batches(CONFIG, 1, 1)[0])
            self.assertEqual(manager.pool.fetches, expected, f"fetches in one step of {config} "
                             "(forward 0..L-1, backward L-1..0, the recomputed block twice)")
            self.assertTrue(any(keep for _, keep in calls), f"nothing was prefetched: {calls}")

    def test_a_stale_resident_copy_would_be_caught(self):
        """Skip the invalidation after the host step: the next forward uses old weights."""
        with oracle_pool():
            model = M.make_offload_model(CONFIG, 1)
            manager = M.ChunkManager(model, M.OffloadConfig(0, 0), CONFIG["chunk_numel"])
            batches = C.offload_batches(CONFIG, 3, 1)
            manager.pool.clear = lambda: None  # the bug: the pool still believes its copies are fresh
            manager.step(*batches[0])
            stale = manager.step(*batches[1])
        reference = C.train_plain(CONFIG, 2, 1)["losses"][1]
        self.assertNotEqual(stale, reference, "with the pool never cleared, the second step "
                            "must use stale weights (else this check tests nothing)")


class TestOptimizerContract(unittest.TestCase):
    """ChunkManager(model, config, chunk_numel, optimizer_class, **defaults): any torch.optim
    class steps the host and device copies exactly as it steps the plain model, skipping the
    parameters without a gradient (frozen from the start, or unused in one step)."""

    FROZEN = ("layers.0.qkv.weight", "layers.2.down.bias", "norm.weight")
    UNUSED = {1: ("layers.1.up.weight", "embed.weight")}  # no gradient in step 1 only

    def test_adam_adamw_and_sgd_with_frozen_and_unused_parameters(self):
        for optimizer_class, defaults in ((torch.optim.Adam, {"lr": 1e-2}),
                                          (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                                          (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
            reference = C.train_plain(CONFIG, 3, 1, optimizer_class, self.FROZEN, self.UNUSED,
                                      **defaults)
            for candidate in (M.OffloadConfig(0, 0), M.OffloadConfig(2, 1)):
                with self.subTest(optimizer=optimizer_class.__name__, offload=candidate):
                    run = C.train_offloaded(CONFIG, candidate, 3, 1, optimizer_class, self.FROZEN,
                                            self.UNUSED, **defaults)
                    assert_same_training(self, run, reference, f"{optimizer_class.__name__} "
                                         f"{defaults}, {candidate}, frozen and unused parameters")

    def test_frozen_parameters_keep_their_values_and_get_no_state(self):
        model = M.make_offload_model(CONFIG, 2)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        C.freeze(model, self.FROZEN)
        manager = M.ChunkManager(model, M.OffloadConfig(1, 0), CONFIG["chunk_numel"],
                                 torch.optim.AdamW, lr=0.1, weight_decay=0.5)
        for tokens, targets in C.offload_batches(CONFIG, 2, 2):
            manager.step(tokens, targets)
        weights = dict(zip((n for n, _ in model.named_parameters()), C.final_weights(manager)))
        for name in self.FROZEN:
            self.assertTrue(torch.equal(weights[name], before[name]), f"frozen {name} changed: "
                            "AdamW's weight decay must not touch a parameter without a gradient")
        names = {id(p): n for n, p in model.named_parameters()}
        stepped = {id(s.master): names[id(s.param)] for s in manager.slots}
        stepped.update(names)  # the fixed parameters are stepped as themselves
        with_state = {stepped[id(t)] for opt in (manager.device_optimizer, manager.host_optimizer)
                      for t in opt.state if id(t) in stepped}
        self.assertEqual(sorted(with_state & set(self.FROZEN)), [],
                         "frozen parameters got optimizer state (they never had a gradient)")
        self.assertGreater(len(with_state), 0, "no parameter was stepped at all")


class TestCostModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(1)
        cls.profile, cls.moments = C.profile_model(CONFIG, 0, repeats=1)

    def test_static_bytes_of_the_plain_run(self):
        plain = M.OffloadConfig(len(self.profile.chunk_used), 0)
        self.assertEqual(self.moments["start"], CM.static_bytes(self.profile, plain),
                         "device bytes at the start of an all-persistent step")

    def test_peaks_and_fetches_of_configurations_not_profiled(self):
        for candidate in (M.OffloadConfig(0, 0), M.OffloadConfig(2, 1), M.OffloadConfig(0, 3)):
            with self.subTest(offload=candidate):
                run = C.train_offloaded(CONFIG, candidate, 2, 0)
                predicted = CM.predict_peak(self.profile, candidate)
                self.assertLessEqual(abs(predicted - run["peak_bytes"]) / run["peak_bytes"], 0.10,
                                     f"{candidate}: predicted peak {predicted:,} B, measured "
                                     f"{run['peak_bytes']:,} B")
                self.assertEqual((run["fetches"], run["copies"], run["copied_numel"]),
                                 (CM.count_fetches(self.profile, candidate),) * 2
                                 + (CM.fetched_numel(self.profile, candidate),),
                                 f"{candidate}: (fetches, copies, copied elements)")

    def test_the_real_planner_on_the_measured_profile(self):
        plain = M.OffloadConfig(len(self.profile.chunk_used), 0)
        roomy = CM.required_budget(self.profile, plain)
        self.assertEqual(CM.plan(self.profile, roomy), plain, f"budget {roomy:,} B fits everything")

    def test_recomputation_and_copies_only_add_time(self):
        base = CM.predict_time(self.profile, M.OffloadConfig(len(self.profile.chunk_used), 0))
        for candidate in CM.all_configs(self.profile):
            self.assertGreaterEqual(CM.predict_time(self.profile, candidate), base,
                                    f"{candidate} predicted faster than all persistent")

    def test_a_fetch_is_charged_its_chunks_used_elements(self):
        """The time model charges what the manager copies: a short last chunk costs its size."""
        profile = dataclasses.replace(self.profile, t_h2d_per_byte=1.0, t_plain_step=0.0,
                                      t_forward_block=0.0, t_d2h_per_byte=0.0, t_adam_host=0.0,
                                      t_adam_device=0.0)
        for candidate in (M.OffloadConfig(0, 0), M.OffloadConfig(3, 2)):
            chunks = CM.fetched_chunks(profile, candidate)
            self.assertEqual(CM.predict_time(profile, candidate),
                             CM.ITEMSIZE * sum(profile.chunk_used[c] for c in chunks),
                             f"{candidate}: copy time at 1 s/B for fetches of chunks {chunks} "
                             f"(sizes {profile.chunk_used})")


@exercise("planner")
class TestPlanner(unittest.TestCase):
    """On a profile written by hand: three blocks, one chunk each, copies and recomputation cost
    time, so the planner keeps as much on the device as the budget allows."""

    @classmethod
    def setUpClass(cls):
        cls.profile = CM.Profile([1000, 1000, 1000], [[0], [1], [2]], 1000, 500, 200,
                                act_block=6000, act_input=400, forward_extra=300, backward_extra=700,
                                step_extra=50, t_plain_step=1.0, t_forward_block=0.1,
                                t_h2d_per_byte=1e-5, t_d2h_per_byte=1e-5, t_adam_device=1e-6,
                                t_adam_host=1e-5)

    def test_required_budget(self):
        for candidate in CM.all_configs(self.profile):
            peak = CM.predict_peak(self.profile, candidate)
            self.assertEqual(CM.required_budget(self.profile, candidate), math.ceil(1.1 * peak),
                             f"{candidate}: ceil(1.1 x peak {peak:,})")
            self.assertEqual(CM.required_budget(self.profile, candidate, safety=1.0), peak,
                             f"{candidate}: safety 1.0 requires the peak itself")
            self.assertEqual(CM.required_budget(self.profile, candidate, safety=1.3),
                             math.ceil(1.3 * peak), f"{candidate}: the safety argument is used")

    def test_planner(self):
        plain = M.OffloadConfig(len(self.profile.chunk_used), 0)
        roomy = CM.required_budget(self.profile, plain)
        self.assertEqual(CM.plan(self.profile, roomy), plain, f"budget {roomy:,} B fits everything")
        smallest = min(CM.required_budget(self.profile, c) for c in CM.all_configs(self.profile))
        chosen = CM.plan(self.profile, smallest)
        self.assertLessEqual(CM.required_budget(self.profile, chosen), smallest,
                             f"plan({smallest:,}) chose {chosen}, which needs more")
        with self.assertRaisesRegex(CM.BudgetError, f"smallest feasible budget is {smallest:,} bytes"):
            CM.plan(self.profile, smallest - 1)
        for budget in [smallest, (smallest + roomy) // 2, *range(24_000, 90_000, 2_000)]:
            chosen = CM.plan(self.profile, budget)
            fitting = [c for c in CM.all_configs(self.profile)
                       if CM.required_budget(self.profile, c) <= budget]
            self.assertEqual(CM.predict_time(self.profile, chosen),
                             min(CM.predict_time(self.profile, c) for c in fitting),
                             f"budget {budget:,} B: plan chose {chosen}, not the fastest that fits")

    def test_ties_keep_more_chunks_then_recompute_fewer_blocks(self):
        """With free copies and free recomputation every configuration takes the same time: the
        docstring's tie rule (more persistent chunks, then fewer recomputed blocks) decides."""
        free = dataclasses.replace(self.profile, t_forward_block=0.0, t_h2d_per_byte=0.0,
                                   t_d2h_per_byte=0.0, t_adam_host=0.0, t_adam_device=0.0)
        for budget in range(30_000, 90_000, 3_000):
            fitting = [c for c in CM.all_configs(free) if CM.required_budget(free, c) <= budget]
            if not fitting:
                continue
            want = max(fitting, key=lambda c: (c.n_persist, -c.n_checkpoint))
            self.assertEqual(CM.plan(free, budget), want, f"budget {budget:,} B, all times equal")

    def test_the_safety_factor_leaves_a_margin(self):
        for budget in range(60_000, 90_000, 1_000):
            chosen = CM.plan(self.profile, budget)
            self.assertLessEqual(math.ceil(1.1 * CM.predict_peak(self.profile, chosen)), budget,
                                 f"budget {budget:,} B: {chosen} leaves no 10% margin")
        plain = M.OffloadConfig(len(self.profile.chunk_used), 0)
        peak = CM.predict_peak(self.profile, plain)
        self.assertNotEqual(CM.plan(self.profile, peak), plain,
                            f"a budget equal to the all-persistent peak ({peak:,} B) must not keep it")
        self.assertEqual(CM.plan(self.profile, peak, safety=1.0), plain,
                         "with safety=1.0 a budget equal to the peak keeps everything")


class TestDocNumbers(unittest.TestCase):
    """Every number the README and the quiz quote, recomputed. All are bytes or counts (exact on
    every machine); the planner's choice depends on measured times and is not quoted."""

    def assertQuoted(self, text: str, where: str = README):
        self.assertTrue(text in " ".join(where.split()), f"{text!r} is not quoted")

    def test_default_configuration(self):
        args = C.parse_args([])
        config = C.model_config(args)
        profile, _ = C.profile_model(config, args.seed, repeats=1)
        plain = M.OffloadConfig(len(profile.chunk_used), 0)
        layers = config["layers"]
        self.assertQuoted(f"{len(profile.chunk_used)} chunks")
        self.assertQuoted(f"the {len(CM.all_configs(profile))} configurations")
        for candidate in (plain, M.OffloadConfig(0, 0), M.OffloadConfig(0, layers - 1)):
            self.assertQuoted(f"{CM.predict_peak(profile, candidate):,} B")
        self.assertQuoted(f"{int(0.6 * CM.predict_peak(profile, plain)):,} B")
        everything = M.OffloadConfig(0, layers)
        run = C.train_offloaded(config, everything, 2, args.seed)
        self.assertQuoted(f"{CM.predict_peak(profile, everything):,} predicted vs "
                          f"{run['peak_bytes']:,} measured")
        self.assertQuoted(f"{CM.count_fetches(profile, M.OffloadConfig(0, 0))} per step")
        self.assertQuoted(f"{CM.fetched_numel(profile, M.OffloadConfig(0, 0)):,} elements copied")
        smallest = min(CM.required_budget(profile, c) for c in CM.all_configs(profile))
        self.assertQuoted(f"{smallest:,} B")

    def test_gpt2_xl(self):
        layout = C.named_model_layout(**C.GPT2_XL)
        for text in (f"{layout['static_all_persistent'] / 1e9:.1f} GB",
                     f"{layout['static_all_offloaded'] / 1e9:.2f} GB",
                     f"{layout['host_all_offloaded'] / 1e9:.1f} GB",
                     f"{layout['chunks']} chunks", f"{layout['buffers']} buffers",
                     f"{layout['fetches_all_offloaded']} chunk fetches"):
            self.assertQuoted(text)
        self.assertQuoted(f"{layout['static_all_persistent'] / 1e9:.1f} GB", QUIZ)
        fp32, bf16 = C.offload_traffic(layout, 1024, itemsize=4), C.offload_traffic(layout, 1024)
        self.assertEqual((fp32["ours_bytes"], bf16["ours_bytes"]),
                         (4 * (layout["fetched_numel_all_offloaded"] + layout["block_params"]),
                          2 * (layout["fetched_numel_all_offloaded"] + layout["block_params"])),
                         "copies: fetched elements up, block gradients down, x itemsize")
        self.assertEqual(bf16["zero_offload_bytes"], 4 * (layout["block_params"] + layout["fixed_params"]),
                         "ZeRO-Offload: 2 + 2 bytes for every parameter, embeddings included")
        for text in (f"{layout['fetched_numel_all_offloaded']:,} elements",
                     f"**{fp32['ours_h2d_bytes'] / 1e9:.1f} GB**", f"({fp32['ours_d2h_bytes'] / 1e9:.1f} GB)",
                     f"**{fp32['ours_bytes'] / 1e9:.1f} GB**", f"**{fp32['ours_seconds']:.2f} s**",
                     f"**{bf16['ours_bytes'] / 1e9:.1f} GB**", f"**{bf16['ours_seconds']:.2f} s**",
                     f"about {bf16['ours_seconds'] / bf16['compute_seconds']:.0f} times the compute",
                     f"**{bf16['zero_offload_bytes'] / 1e9:.1f} GB**",
                     f"**{bf16['zero_offload_seconds']:.2f} s**",
                     f"**{bf16['compute_seconds'] * 1e3:.0f} ms**",
                     f"**{bf16['break_even_tokens_ours']:,} tokens**",
                     f"**{bf16['break_even_tokens_zero_offload']:,} tokens**"):
            self.assertQuoted(text)
        for text in (f"{bf16['zero_offload_bytes'] / 1e9:.1f} GB per step",
                     f"{bf16['zero_offload_seconds']:.2f} s", f"{fp32['ours_bytes'] / 1e9:.1f} GB"):
            self.assertQuoted(text, QUIZ)


class TestDemo(unittest.TestCase):
    def test_every_check_passes(self):
        assert_every_check_passes(self, {1: launch(W.quick_checks, 1, device="cpu", timeout_s=120)})

    def test_bad_arguments(self):
        assert_argument_error(self, C.parse_args, ["--hidden", "30", "--heads", "4"], "--hidden 30")
        assert_argument_error(self, C.parse_args, ["--device", "cuda"], "runs on the CPU")
        assert_argument_error(self, C.parse_args, ["--chunk-numel", "1000"], "largest weight")
        assert_argument_error(self, C.parse_args, ["--budget", "0"], "--budget")
        assert_argument_error(self, C.parse_args, ["--safety", "0.9"], "--safety")

    def test_more_than_one_torchrun_process_is_refused(self):
        with unittest.mock.patch.dict("os.environ", {"RANK": "0", "WORLD_SIZE": "2"}):
            assert_argument_error(self, C.parse_args, [], "--nproc-per-node=1")

    def test_impossible_budget_exits_2_naming_the_smallest(self):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = C.main(["--budget", "1000", "--layers", "2", "--steps", "2"])
        self.assertEqual(code, 2, stderr.getvalue())
        self.assertRegex(stderr.getvalue().strip(), r"^error: .*smallest feasible budget is [\d,]+ bytes")


if __name__ == "__main__":
    unittest.main()
