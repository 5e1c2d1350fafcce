"""The BFC allocator replay (memsave.planner.allocator): hand-computed chunk
sizes, TensorFlow's own allocator on one tensor, and the model's use of it."""

import numpy as np
import pytest
import tensorflow as tf

from memsave import planner
from memsave.measure import run_isolated
from memsave.planner import allocator
from memsave.planner.memory import MemoryModel
from memsave.region import ForwardRegion

MiB = 2**20
ONE_REGION = allocator.Allocator("one region", 1 << 40)
GROWING = allocator.Allocator("growing", 2 * MiB)


def _peak(buffers, steps, alloc=ONE_REGION):
    """Replayed peak of buffers given as (start, end, bytes); the first is resident
    when its start is None."""
    starts = [b[0] or 0 for b in buffers]
    resident = [b[0] is None for b in buffers]
    return allocator.replayed_peak(alloc, starts, [b[1] for b in buffers],
                                   [b[2] for b in buffers], resident, steps)[0]


def test_a_request_takes_a_freed_chunk_whole_unless_it_is_twice_the_request():
    # Step 0: A (1 MiB) then K (256 B, alive to the end) are made, and A is freed: a
    # 1 MiB free chunk lies before K, the rest of the region after it. Step 1: B is
    # made (best fit: A's old chunk), then C from the rest.
    def peak(b_bytes):
        return _peak([(0, 0, MiB), (0, 2, 256), (1, 1, b_bytes), (1, 1, MiB // 2)], 3)

    # 0.5 MiB + 256 B: the 1 MiB chunk is less than twice it, so B holds all of it.
    assert peak(MiB // 2 + 256) == MiB + 256 + MiB // 2
    # Exactly 0.5 MiB: split; B holds what it asked for (C is the same size).
    assert peak(MiB // 2) == MiB + 256
    # The tensors alone never pass 1 MiB + 256 B (step 0).


def test_the_replay_says_at_which_step_the_allocator_peaks():
    # Step 0: A (1 MiB) and K (256 B, kept); A freed. Step 1: B (600 KiB) takes A's chunk
    # whole, C (300 KiB) comes from the rest. The tensors peak at step 0 (1 MiB + 256 B
    # against 900 KiB + 256 B); the allocator at step 1, holding 1 MiB + 300 KiB + 256 B.
    kib = 1024
    buffers = [(0, 0, MiB), (0, 2, 256), (1, 1, 600 * kib), (1, 1, 300 * kib)]
    held, at = allocator.replayed_peak(ONE_REGION, [b[0] for b in buffers],
                                       [b[1] for b in buffers], [b[2] for b in buffers],
                                       [False] * 4, 3)
    assert (held, at) == (MiB + 300 * kib + 256, 1)


def test_freed_neighbours_merge_and_requests_round_up_to_256_bytes():
    # A and B (600 KiB each) side by side, then K (1 byte: a 256 B chunk), alive to the
    # end; A and B are freed after step 0 and merge into one 1200 KiB chunk, which a
    # 1100 KiB request takes whole (less than twice it); neither 600 KiB chunk alone
    # could serve it. C (300 KiB + 1 byte) is rounded up to 300 KiB + 256 B.
    kib = 1024
    buffers = [(0, 0, 600 * kib), (0, 0, 600 * kib), (0, 2, 1), (1, 1, 1100 * kib),
               (1, 1, 300 * kib + 1)]
    assert _peak(buffers, 3) == 1200 * kib + 256 + (300 * kib + 256)
    # Unmerged, the 1100 KiB would have been split from the rest of the region:
    # 1100 KiB + 256 + 300 KiB + 256 = 1434112 bytes, not 1536512.
    assert _peak(buffers, 3) == 1536512


def test_a_growing_allocator_holds_a_whole_region_for_a_tensor_over_half_of_it():
    # From 2 MiB, a 3 MiB request grows a 4 MiB region, which it holds whole.
    assert _peak([(0, 0, 3 * MiB)], 1, GROWING) == 4 * MiB
    assert _peak([(0, 0, 3 * MiB)], 1, ONE_REGION) == 3 * MiB
    # 1 MiB splits the first 2 MiB region; the next region is twice it (4 MiB), so
    # 1.5 MiB, which the 1 MiB left cannot serve, splits that (a 2 MiB one it would hold whole).
    assert _peak([(0, 0, MiB), (0, 0, 3 * MiB // 2)], 1, GROWING) == 5 * MiB // 2
    # Resident tensors are held before and after the step, never freed.
    assert _peak([(None, 9, MiB), (0, 0, MiB)], 1) == 2 * MiB


def test_a_buffer_of_many_allocations_holds_no_oversized_chunk():
    # Step 0: A (1.5 MiB) then K (256 B, kept); A freed: a 1.5 MiB hole. Step 1: C (1 MiB)
    # then E (1 MiB). As one chunk, C takes the hole whole (less than twice it); as two
    # allocations of 0.5 MiB (a TensorList of two elements) each splits it, and the
    # allocator holds only what is asked for.
    buffers = [(0, 0, 3 * MiB // 2), (0, 2, 256), (1, 1, MiB), (1, 1, MiB)]
    starts, ends, sizes = ([b[i] for b in buffers] for i in range(3))

    def held(pieces):
        return allocator.replayed_peak(ONE_REGION, starts, ends, sizes, [False] * 4, 3,
                                       [1, 1, pieces, 1])[0]

    assert held(1) == 5 * MiB // 2 + 256 == _peak(buffers, 3)
    assert held(2) == 2 * MiB + 256
    # More pieces than MAX_PIECES are grouped; none is smaller than BFC's 256 B.
    assert allocator._requests(10 * MiB, 1000) == [10 * MiB // 128] * 128
    assert allocator._requests(1000, 100) == [333, 333, 334]  # (3 of 256 B or more)


def test_under_a_limit_a_loops_pieces_are_made_side_by_side():
    """Step 0: a loop makes A (4 pieces of 1 MiB, kept) and B (4 pieces, freed when it
    ends), an iteration's piece of each at a time; step 1 stacks A into C (4 MiB at
    once). Made side by side, A's pieces lie among B's holes, and C fits in none: under a
    limit (one region; what counts is the highest address) the step reaches 11 MiB, not
    the 8 MiB of A and B one after the other. (A Keras LSTM's input gradient stacked
    after its gradient loop: max_batch_size's answer ran out of memory in three runs of
    four before.) A growing allocator is replayed one after the other either way."""
    buffers = [(0, 2, 4 * MiB), (0, 0, 4 * MiB), (1, 1, 4 * MiB)]
    starts, ends, sizes = ([b[i] for b in buffers] for i in range(3))

    def replayed(alloc, pieces):
        return allocator.replayed_peak(alloc, starts, ends, sizes, [False] * 3, 2, pieces)[0]
    limit = allocator.Allocator("one region", 1 << 40, needs_extent=True)
    assert replayed(limit, [4, 4, 1]) == 11 * MiB
    assert replayed(limit, [1, 1, 1]) == 8 * MiB  # (one allocation each: in turn)
    assert replayed(ONE_REGION, [4, 4, 1]) == 8 * MiB  # (bytes in use: the same)
    assert allocator._side_by_side([0, 1, 2], [[1], [2, 2], [3, 3, 3, 3]]) == [
        (0, 1), (2, 3), (1, 2), (2, 3), (2, 3), (1, 2), (2, 3)]


@pytest.mark.measures
def test_tensorflows_cpu_allocator_holds_what_the_replay_says():
    """The rules above are TensorFlow's: one 3 MiB tensor holds a 4 MiB chunk (measured
    in a fresh process with the CPU BFC allocator on), as the replay predicts."""
    result = run_isolated("_memory_cases:one_tensor", env={"PYTHONPATH": "tests"},
                          nbytes=3 * MiB)
    assert result["allocator"] == "BFC (CPU, growing)"
    assert result["simulated"] == 4 * MiB
    # (TensorFlow also holds a 256 B chunk for the fill's shape argument, freed later.)
    assert result["measured"] in (4 * MiB, 4 * MiB + 256), result


@pytest.mark.measures
def test_a_steps_inputs_are_in_the_allocators_memory():
    """memsave.measure.device_input: every input the tests and benchmarks measure a step
    with is held by the allocator whose peak they read (tf.constant of a NumPy array
    kept its copy outside it in about one conversion in three)."""
    result = run_isolated("_memory_cases:inputs_held", env={"PYTHONPATH": "tests"},
                          nbytes=MiB)
    assert result["held"] == [MiB] * 6, result


@pytest.mark.parametrize("value", [
    np.float64(2.5) * np.ones(()),                              # 0-d
    np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],      # not contiguous
    np.arange(6, dtype=">f4").reshape(3, 2),                    # big-endian
    np.arange(6, dtype=np.int32), np.array([True, False]),
    np.arange(6, dtype=np.uint32),                              # (no DecodeRaw dtype)
], ids=["0-d", "strided", "big-endian", "int32", "bool", "uint32"])
def test_a_device_input_has_the_arrays_values_shape_and_dtype(value):
    from memsave.measure import device_input

    got = device_input(value)
    assert got.shape == value.shape
    assert got.dtype.as_numpy_dtype == value.dtype.newbyteorder("=")
    np.testing.assert_array_equal(got.numpy(), value)


def _tanh_chain_graph(n=12):
    """The StepGraph of x -> tanh^n -> sum (tensors of 0.25 MiB), and every third tanh."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [256, 256], name="x")
        h, outs = x, []
        for _ in range(n):
            h = tf.tanh(h)
            outs.append(h)
        graph = planner.model_of(ForwardRegion.build([tf.reduce_sum(h)], [x])).graph
        return graph, [graph.id_of(t) for t in outs[2::3]]


def test_the_model_replays_only_when_asked_and_only_with_an_allocator():
    graph, plan = _tanh_chain_graph()
    plain = MemoryModel(graph)
    assert plain.predict(plan, allocator=True).allocator_peak_bytes is None
    model = MemoryModel(graph, allocator=GROWING)
    live = model.predict(plan)
    assert live.allocator_peak_bytes is None and live.device_peak_bytes == live.peak_bytes
    held = model.predict(plan, allocator=True)
    assert held.peak_bytes == live.peak_bytes
    assert held.allocator_peak_bytes >= held.peak_bytes
    assert held.device_peak_bytes == held.allocator_peak_bytes
    assert live.device_peak_at == live.peak_at and live.allocator_peak_at is None
    assert held.device_peak_at == held.allocator_peak_at
    assert held.allocator_peak_at.startswith(("backward", "recomputation", "forward"))
    assert model.baseline(allocator=True).allocator_peak_bytes >= model.baseline().peak_bytes


def test_of_device_follows_the_environment(monkeypatch):
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    assert allocator.of_device() is None
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    assert allocator.of_device().first_region == 2 * MiB


def test_a_budget_plan_fits_as_the_allocator_holds_it():
    """A plan whose tensors fit the limit but whose chunks do not is passed over for the
    next cheapest (the tensors' peak alone would break the budget here)."""
    from memsave.planner import search

    graph, _ = _tanh_chain_graph()
    model = MemoryModel(graph, allocator=GROWING)
    live_only = MemoryModel(graph)
    limits = sorted({model.predict(plan).peak_bytes
                     for plan in search._subsets(search.Candidates(graph).tensors)})
    overflowing = 0
    for limit in limits:
        chosen = search.within_budget(model, limit, [])
        if chosen is not None:
            assert chosen[0].device_peak_bytes <= limit
        blind = search.within_budget(live_only, limit, [])
        if blind is not None and model.predict(blind[1], allocator=True).device_peak_bytes > limit:
            overflowing += 1
    assert overflowing > 0  # (else this graph would not tell the two apart)


def test_a_replay_asked_for_later_equals_one_made_with_the_prediction():
    """The model replays the timeline it simulated last when asked right after (a
    search checks tensors, then chunks), and simulates again otherwise: same figures."""
    graph, plan = _tanh_chain_graph()
    other, third = plan[:1], plan[1:]
    direct = MemoryModel(graph, allocator=GROWING)
    expected = {tuple(p): direct.predict(p, allocator=True) for p in (plan, other, third)}
    later = MemoryModel(graph, allocator=GROWING)
    later.predict(plan)
    assert later.predict(plan, allocator=True) == expected[tuple(plan)]  # the last timeline
    later.predict(third)
    later.predict(other)  # simulated last: `third` is simulated again for its replay
    assert later.predict(third, allocator=True) == expected[tuple(third)]
    assert later.predict(other, allocator=True) == expected[tuple(other)]
    assert later.baseline().allocator_peak_bytes is None
    assert later.baseline(allocator=True) == direct.baseline(allocator=True)
    assert expected[tuple(plan)].allocator_peak_bytes != expected[tuple(other)].allocator_peak_bytes
