"""What the device's allocator holds: the memory model's buffers replayed through
a simulation of TensorFlow's BFC allocator.

The memory model counts the bytes of live tensors. TensorFlow's BFC allocator
(every GPU; the CPU with TF_CPU_ALLOCATOR_USE_BFC=true, as memsave measures)
holds more: it serves a request from the smallest free chunk that fits, and
splits that chunk only when it is at least twice the request, so a 13.5 MB
tensor may hold a 24.6 MB chunk freed by an earlier, larger one; and its peak
(`peak_bytes_in_use`) counts chunks, not tensors. Which chunk a request gets
depends on everything allocated and freed before it, so the model replays its
whole step: one step to grow the allocator's regions as TensorFlow's first step
does (each region twice the last, from 2 MiB, when growing), then the measured
step on the regions that left, with the resident tensors (weights, inputs)
allocated first and kept.

The replay follows the order the memory model simulates; an executor running
ops side by side frees and allocates in a somewhat different order, so which
tensors land in oversized chunks, and the peak, move between runs of the same
step (by ~10% on some models here); the replay gives one such order.
"""

import bisect
import dataclasses

_MIN_CHUNK = 256                      # BFC rounds every request up to this multiple
_SPLIT_ANYWAY = 128 << 20             # ... and splits a chunk this much larger regardless
_FIRST_GROWTH_REGION = 2 << 20        # the first region when the allocator grows
_WHOLE_DEVICE = 1 << 46               # "one region": larger than any step


@dataclasses.dataclass(frozen=True)
class Allocator:
    """How the simulated allocator gets its memory.

    Attributes:
      name: for reports, e.g. 'BFC (CPU, growing)'.
      first_region: bytes of the first region it reserves; later regions double
        (TensorFlow's allow_growth), or one region holds everything.
      needs_extent: what a step needs of it is the highest address a chunk reaches in
        its one region, not the bytes in use: a device whose memory is one region of a
        limit serves a request only where a free chunk of that region fits it, so a
        step whose chunks the best fit scatters runs out below the bytes it uses
        (the one-region allocator memsave.capacity plans for).
    """
    name: str
    first_region: int
    needs_extent: bool = False


def named(name):
    """The Allocator of memsave.environment.Environment.allocator `name`, or None for
    the CPU's default allocator (it takes what each tensor needs from malloc)."""
    if name is None:
        return None
    growing = "growing" in name
    return Allocator(name, _FIRST_GROWTH_REGION if growing else _WHOLE_DEVICE,
                     needs_extent="one region" in name)


def of_device():
    """The Allocator TensorFlow uses for the step's tensors in this process (read now)."""
    from memsave.environment import Environment  # (tf.config: read only when asked)

    return named(Environment.read(None).allocator)


class _BestFit:
    """The BFC allocator's bookkeeping: best-fit chunks, split only when a chunk is
    at least twice the request, neighbours merged when freed, regions never merged."""

    def __init__(self, first_region):
        self.next_region = first_region
        self.free = []          # sorted (size, address) of free chunks
        self.free_at = {}       # address -> size of a free chunk
        self.free_ending = {}   # end address -> address of a free chunk
        self.used = {}          # address -> size of a chunk in use
        self.end_of_regions = 0
        self.in_use = 0
        self.peak = 0
        self.extent = 0  # the highest end of a chunk in use

    def allocate(self, nbytes):
        """Returns the address of the chunk serving a request of `nbytes`."""
        wanted = -(-max(nbytes, 1) // _MIN_CHUNK) * _MIN_CHUNK
        index = bisect.bisect_left(self.free, (wanted, -1))
        if index == len(self.free):
            self._grow(wanted)
            index = bisect.bisect_left(self.free, (wanted, -1))
        size, address = self.free[index]
        self._unlist(index)
        if size >= 2 * wanted or size - wanted >= _SPLIT_ANYWAY:
            self._list(address + wanted, size - wanted)
            size = wanted
        self.used[address] = size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        self.extent = max(self.extent, address + size)
        return address

    def release(self, address):
        size = self.used.pop(address)
        self.in_use -= size
        following = address + size
        if following in self.free_at:
            size += self._unlist_at(following)
        if address in self.free_ending:
            previous = self.free_ending[address]
            size += self._unlist_at(previous)
            address = previous
        self._list(address, size)

    def _grow(self, wanted):
        grew = False
        while wanted > self.next_region:
            self.next_region *= 2
            grew = True
        region = self.next_region
        if not grew:
            self.next_region *= 2
        # A gap after each region: chunks of two regions never merge.
        self._list(self.end_of_regions, region)
        self.end_of_regions += region + _MIN_CHUNK

    def _list(self, address, size):
        bisect.insort(self.free, (size, address))
        self.free_at[address] = size
        self.free_ending[address + size] = address

    def _unlist(self, index):
        size, address = self.free.pop(index)
        del self.free_at[address]
        del self.free_ending[address + size]

    def _unlist_at(self, address):
        size = self.free_at[address]
        self._unlist(bisect.bisect_left(self.free, (size, address)))
        return size


# A buffer made of many equal allocations (a TensorList's elements, what each iteration
# of a loop keeps) is replayed as at most this many, each placed where it fits: one
# chunk of them all would need a region of its own (2 x Keras LSTM(256), 'memory', AMD
# EPYC without AVX-512: predicted 36.2 MiB so, measured 30.1-32.1).
MAX_PIECES = 128


def replayed_peak(allocator, starts, ends, sizes, resident, steps, pieces=None):
    """(peak bytes in use, the step it is reached at) of the allocator during the second
    of two identical steps (of an allocator that `needs_extent`: the highest end of a
    chunk instead).

    Args:
      allocator: an Allocator.
      starts, ends, sizes: per buffer, the steps it is made and last read at
        (ends beyond the last step: alive to the end of the step) and its bytes.
      resident: per buffer, whether it exists before the step and outlives it.
      steps: how many steps the step has.
      pieces: per buffer, how many equal allocations it is made of (None: one each).
    """
    made_at = [[] for _ in range(steps)]
    freed_at = [[] for _ in range(steps)]
    state = _BestFit(allocator.first_region)
    requests = [_requests(nbytes, 1 if pieces is None else pieces[buffer])
                for buffer, nbytes in enumerate(sizes)]
    for buffer, (start, end, nbytes) in enumerate(zip(starts, ends, sizes)):
        if nbytes <= 0:
            continue
        if resident[buffer]:
            for request in requests[buffer]:
                state.allocate(request)
            continue
        made_at[start].append(buffer)
        if end < steps:
            freed_at[end].append(buffer)
    needed = "extent" if allocator.needs_extent else "peak"
    made_in_order = _side_by_side if allocator.needs_extent else _one_after_another
    at = 0
    for _ in range(2):
        # (The extent is of both steps, and where it was reached: the region serves the
        # first step too; the peak in use is the second's.)
        state.peak = state.in_use
        if not allocator.needs_extent:
            at = 0
        address = {}
        for step in range(steps):
            for buffer in made_at[step]:
                address[buffer] = []
            for buffer, request in made_in_order(made_at[step], requests):
                before = getattr(state, needed)
                address[buffer].append(state.allocate(request))
                if getattr(state, needed) > before:
                    at = step
            for buffer in freed_at[step]:
                for chunk in address.pop(buffer):
                    state.release(chunk)
        for left in address.values():  # returned at the step's end (the gradients)
            for chunk in left:
                state.release(chunk)
    return getattr(state, needed), at


def _one_after_another(buffers, requests):
    """(buffer, request) for `buffers` made in one step, each buffer's pieces in turn."""
    return [(buffer, request) for buffer in buffers for request in requests[buffer]]


def _side_by_side(buffers, requests):
    """(buffer, request) for `buffers` made in one step, in the order the allocator gets
    them under a limit: buffers of one allocation in turn, those of many (what a loop
    makes, an allocation per iteration) interleaved, the k-th of n pieces at k/n of the
    loop.

    A loop's iterations make their pieces side by side, and under a limit where they land
    decides what runs: a Keras LSTM's gradient loop writes each step's input gradient
    between the carries its recomputing copy kept, so the list's 100 elements of 304 KiB
    lay over 99 MiB of a 128-MiB region, and stacking them (a 29.7-MiB tensor) found no
    free chunk that large with 51.8 MiB in use (Intel Xeon, 2 x LSTM(256) at batch 304).
    Replayed one after another, max_batch_size answered 283 there, and 280 ran out of
    memory in one run of two; side by side it answers 227, which ran three times of three
    (273 ran out in two of three). A growing allocator is not replayed so: a new region
    takes what fits no hole, and the bytes in use are what count (the LSTM stack of
    tests/test_memory.py: 25.6 MiB predicted one after another for 23.4-24.0 measured;
    32.0 side by side, before a loop's temporaries were pieces too).
    """
    many = [buffer for buffer in buffers if len(requests[buffer]) > 1]
    if not many:
        return _one_after_another(buffers, requests)
    interleaved = sorted(((index + 1) / len(requests[buffer]), rank, buffer, request)
                         for rank, buffer in enumerate(many)
                         for index, request in enumerate(requests[buffer]))
    # (the pieces are made where the first buffer of many stands)
    first = buffers.index(many[0])
    return (_one_after_another(buffers[:first], requests)
            + [(buffer, request) for _, _, buffer, request in interleaved]
            + _one_after_another([buffer for buffer in buffers[first:]
                                  if len(requests[buffer]) == 1], requests))


def _requests(nbytes, pieces):
    """The allocations of a buffer of `nbytes` made of `pieces` equal ones (at most
    MAX_PIECES: more are grouped)."""
    count = max(1, min(pieces, MAX_PIECES, nbytes // _MIN_CHUNK or 1))
    each = nbytes // count
    return [each] * (count - 1) + [nbytes - each * (count - 1)]
