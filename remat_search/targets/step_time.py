"""The step-time model of a compile-only target: one step's time, read off the compiled program.

Where plans are compiled ahead of time and never run (a TPU topology), a step's time is an
estimate. :func:`estimate_step` reads the optimized HLO module (``Compiled.as_text()``) the way
the chip would execute it, one scheduled instruction after another, and prices each one:

* a fusion, an unfused op or a kernel (``custom-call``) costs the slower of its FLOPs at the
  chip's peak and its HBM traffic (operands read, results written: the buffers in the default
  memory space, not those the compiler placed on the chip) at the chip's HBM bandwidth — a
  roofline per instruction, summed, so that recomputing elementwise work costs bandwidth and
  recomputing a matmul costs FLOPs. FLOPs are those of the matmuls (``dot``, ``convolution``)
  inside, or of a kernel's: a Pallas TPU kernel's matmuls counted in its Mosaic body over its
  grid (:mod:`~remat_search.targets.pallas_kernels`) and priced as the chip's matrix unit
  spends them, each padded to its tiles (:mod:`~remat_search.targets.mxu`: a 128-wide head
  runs at half rate on a v6e), a GPU library kernel's read off its call
  (:mod:`~remat_search.targets.gpu_kernels`);
* a collective (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute; also
  those the TPU compiler fused with a matmul, and those a v6e's SparseCore runs, called
  asynchronously on its own thread: ``call-start``) costs the bytes each chip receives in a ring over
  its group, at the chip's inter-chip (ICI) bandwidth, over all of its links
  (:attr:`Chip.ici_links`); a ``collective-permute``, each chip sending to one neighbour (a
  collective matmul's steps), over one. Computation waits for it whole where it runs
  synchronously, which is how a fully rematerialised FSDP layer's second gather of its weights
  shows; where it runs asynchronously beside computation, only for what that computation does
  not cover: an asynchronous one (``…-start`` … ``…-done``) overlaps the instructions scheduled
  between its start and its done, and one the TPU compiler chains over fusions
  (``AsyncCollectiveStart`` … ``AsyncCollectiveDone``, a channel printed in each) the fusions
  scheduled between its first and its last. Its buffers cost no HBM time (the chip's DMA
  engines fill them as the slower ICI delivers): the chained fusions cost what else they
  compute;
* a transfer to or from pinned host memory (``S(5)``: an ``offload`` policy's tensors) costs
  its bytes at the chip's host link (:attr:`Chip.host_bytes_per_second`), one transfer after
  another on the link, overlapped with the instructions scheduled between the transfer's
  start and its done as far as the chip runs them side by side (:attr:`Chip.host_overlap`: all
  of them on a TPU, none on a GPU, whose copies queue on the kernels' stream): computation
  waits only for what they do not cover;
* a loop's body is counted as many times as the compiler knows it runs (``known_trip_count``);
  of a conditional's branches, the dearest.

What it leaves out: the vector unit's own throughput (elementwise FLOPs are priced by their
bytes alone), XLA's own matmuls' padding to the MXU's tiles (the compiler lays their
dimensions out, folding heads into one, say: the HLO does not say how), overlap of on-chip copies and of
collectives the program runs synchronously with computation, which links a collective's group
spans on the torus, per-instruction launch overheads, and the host's own work. It is a lower
bound on compute and memory time and an upper bound on communication, deterministic, and the
same for every plan of a study: good for ranking plans, not a promise of wall time.

What each instruction does is read once (:mod:`remat_search.targets.work`, from the HLO text by
:mod:`~remat_search.targets.hlo`: FLOPs by :mod:`~remat_search.targets.matmuls`, bytes by
:mod:`~remat_search.targets.traffic` and :mod:`~remat_search.targets.collectives`); this module
prices that work at a chip's figures (:mod:`~remat_search.targets.chips`) and the fractions of
them the chip reaches (:class:`Efficiencies`: its free figures, 1 and no launch cost until a
calibration (:mod:`~remat_search.targets.calibration`) fits them to measured steps).

The whole-program roofline this replaced (:func:`roofline_seconds`: one max over the
program's total FLOPs and bytes) is kept beside it for one release.
"""


from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from remat_search.targets.chips import Chip
from remat_search.targets.collectives import keep_largest
from remat_search.targets.work import Op, Work, read_work

TIME_MODEL = "fusions"
"""The name of :func:`estimate_step`'s model, as measurements record it (``time_model``);
measurements without one were estimated by the whole-program roofline."""


class Efficiencies(BaseModel):
    """The step-time model's free figures: what fraction of each published peak a chip reaches,
    and what each instruction costs besides its work. 1 (and no launch cost) is the datasheet's
    chip; a calibration fits them to measured steps (``targets.calibration``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    matmul: float = Field(1.0, gt=0)
    """Of the chip's bf16 FLOP/s, what an instruction's matmuls reach."""
    hbm: float = Field(1.0, gt=0)
    """Of the chip's HBM bandwidth, what an instruction's reads and writes reach."""
    ici: float = Field(1.0, gt=0)
    """Of the chip's inter-chip bandwidth, what a collective reaches."""
    host_link: float = Field(1.0, gt=0)
    """Of the chip's host link, what an offload's transfers reach."""
    host_overlap: float | None = Field(None, ge=0, le=1)
    """How much of the computation between a transfer's start and its done hides it; None: the
    chip's own (:attr:`Chip.host_overlap`)."""
    launch_seconds: float = Field(0.0, ge=0)
    """What each priced instruction costs besides its work (a kernel's launch, the gaps)."""


UNCALIBRATED = Efficiencies()


class StepEstimate(BaseModel):
    """One step's estimated time on a chip (:func:`estimate_step`), and what it is made of."""

    model_config = ConfigDict(frozen=True)

    seconds: float
    """The estimate: :attr:`compute_seconds` + :attr:`host_wait_seconds` + :attr:`collective_seconds`."""
    compute_seconds: float
    """Sum over the executed instructions of max(MXU FLOPs / peak, HBM bytes / bandwidth)."""
    collective_seconds: float
    """The time computation waits for collectives: their bytes received per chip at the ICI
    bandwidth, less what computation scheduled beside an asynchronous one covers (0 where the
    chip has no figure)."""
    flops: float
    hbm_bytes: float
    mxu_flops: float = 0.0
    """:attr:`flops` as the chip's matrix unit spends them, its tiles' padding included
    (:attr:`Chip.mxu`); the same where the chip pads nothing."""
    collective_bytes: float
    instructions: int
    """Instructions priced (each loop iteration counted)."""
    host_bytes: float = 0.0
    """Bytes moved between the device and pinned host memory (offloaded tensors, both ways)."""
    host_seconds: float = 0.0
    """:attr:`host_bytes` at the chip's host-link bandwidth: how long the link is busy."""
    host_wait_seconds: float = 0.0
    """The part of :attr:`host_seconds` that computation waits for: a transfer overlaps
    the instructions scheduled between its start and its done, as far as the chip lets it."""
    unknown_trip_counts: int = 0
    """Loops whose trip count the compiler did not state: counted once each."""
    roofline_seconds: float | None = None
    """The whole-program roofline of the same program (:func:`roofline_seconds`, the model
    before this one), kept beside it for one release."""
    calibration: str | None = None
    """The calibration whose figures priced it (``targets.calibration``); None: the datasheet's."""
    band: tuple[float, float] | None = None
    """Where measured step / this estimate falls 95 times in 100 for a model the calibration never
    saw: the 95% prediction interval of its samples' ratios with each model family left out, for
    plans of this kind (:func:`~remat_search.targets.calibration.prediction_band`; uncalibrated,
    that of the published runs of this chip's generation). A study keeps the band it was priced
    with. None: unknown."""
    outside: str | None = None
    """What puts the plan outside its calibration's samples ("no sample offloads"): its band was
    measured on other kinds of plan, so it is an extrapolation. None within them, or uncalibrated."""


def estimate_step(hlo: str, chip: Chip, cost: dict[str, float] | None = None,
                  efficiencies: Efficiencies = UNCALIBRATED) -> StepEstimate:
    """The per-instruction model of one step of the optimized HLO module ``hlo`` on ``chip``
    at ``efficiencies`` (see the module's docstring), with the whole-program roofline of the
    compiler's cost analysis ``cost`` beside it where given."""
    estimate = price(read_work(hlo, chip.mxu), chip, efficiencies)
    return estimate.model_copy(update={"roofline_seconds": roofline_seconds(cost, chip)}) if cost is not None else estimate


def price(work: Work, chip: Chip, efficiencies: Efficiencies = UNCALIBRATED) -> StepEstimate:
    """One step of ``work`` on ``chip`` at ``efficiencies``."""
    pricing = _Pricing(work, chip, efficiencies)
    total = pricing.computation(work.entry)
    return StepEstimate(
        seconds=total.compute_seconds + total.host_wait_seconds + total.collective_seconds,
        compute_seconds=total.compute_seconds, collective_seconds=total.collective_seconds, flops=total.flops,
        mxu_flops=total.mxu_flops, hbm_bytes=total.hbm_bytes,
        collective_bytes=total.collective_bytes, instructions=total.instructions,
        unknown_trip_counts=total.unknown_trips, host_bytes=total.host_bytes,
        host_seconds=pricing.link_seconds(total.host_bytes), host_wait_seconds=total.host_wait_seconds,
    )


def roofline_seconds(cost: dict[str, float], chip: Chip) -> float:
    """The whole-program roofline (the model before :func:`estimate_step`): the slower of the
    program's FLOPs at peak and its bytes accessed at HBM bandwidth, from the compiler's cost
    analysis."""
    return max(cost.get("flops", 0.0) / chip.bf16_flops, cost.get("bytes accessed", 0.0) / chip.hbm_bytes_per_second)


@dataclass
class _Cost:
    """What a run of instructions adds up to, at one chip."""

    flops: float = 0.0
    mxu_flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: float = 0.0
    instructions: int = 0
    unknown_trips: int = 0
    compute_seconds: float = 0.0
    """Each priced instruction's max(MXU FLOPs / peak, HBM bytes / bandwidth) and launch, summed."""
    host_bytes: float = 0.0
    host_wait_seconds: float = 0.0
    """Time computation waits for transfers to or from host memory."""
    collective_seconds: float = 0.0
    """Collectives' time that computation waits for: a synchronous one's whole, an asynchronous
    one's beyond the computation scheduled between its start and its done."""
    channels: dict[str, tuple[float, bool]] = field(default_factory=dict)
    """Bytes of synchronous collectives by channel (and whether over one link): the TPU compiler
    splits one collective over a chain of fusions, each printing it whole, so a channel counts
    once a computation."""

    def add(self, other: _Cost, times: int = 1) -> None:
        self.flops += other.flops * times
        self.mxu_flops += other.mxu_flops * times
        self.hbm_bytes += other.hbm_bytes * times
        self.collective_bytes += other.collective_bytes * times
        self.collective_seconds += other.collective_seconds * times
        keep_largest(self.channels, other.channels.items())
        self.instructions += other.instructions * times
        self.unknown_trips += other.unknown_trips * times
        self.compute_seconds += other.compute_seconds * times
        self.host_bytes += other.host_bytes * times
        self.host_wait_seconds += other.host_wait_seconds * times


class _Pricing:
    """One pricing of a program's work: each computation's cost, once."""

    def __init__(self, work: Work, chip: Chip, efficiencies: Efficiencies) -> None:
        self.work, self.e = work, efficiencies
        self.flop_rate = chip.bf16_flops * efficiencies.matmul
        self.hbm_rate = chip.hbm_bytes_per_second * efficiencies.hbm
        self.link_rate = chip.host_bytes_per_second * efficiencies.host_link if chip.host_bytes_per_second else None
        self.overlap = chip.host_overlap if efficiencies.host_overlap is None else efficiencies.host_overlap
        self.ici_rate = chip.ici_bytes_per_second * efficiencies.ici if chip.ici_bytes_per_second else None
        self.ici_links = chip.ici_links
        self.memo: dict[str, _Cost] = {}

    def seconds(self, op: Op) -> float:
        """A priced instruction's time: the slower of its matmuls and its HBM traffic, and its launch."""
        return max(op.mxu_flops / self.flop_rate, op.hbm_bytes / self.hbm_rate) + self.e.launch_seconds

    def link_seconds(self, nbytes: float) -> float:
        """``nbytes`` over the chip's host link (0 where the chip has no figure)."""
        return nbytes / self.link_rate if self.link_rate else 0.0

    def ici_seconds(self, nbytes: float, one_link: bool) -> float:
        """``nbytes`` received over the chip's inter-chip links: all of them, or one (0 where the
        chip has no figure)."""
        if not self.ici_rate:
            return 0.0
        return nbytes / self.ici_rate * (self.ici_links if one_link else 1)

    def computation(self, name: str) -> _Cost:
        """The cost of running computation ``name`` once, as a schedule of instructions.

        Host transfers run on the chip's host link beside computation: one started
        asynchronously (a ``-start``) queues on the link, first come first served, and the
        instruction that waits for it (its ``-done``) waits only for what the instructions
        scheduled between them did not cover, of which the chip runs :attr:`overlap` beside
        the link (``cover`` is the time the link has seen go by); a synchronous one waits for
        itself. A transfer still running at the end of the computation is waited for there.

        Collectives run on the chip's inter-chip links beside computation, each on its own
        (``clock`` is the computation's time so far): an asynchronous one is waited for at its
        done for what the instructions since its start did not cover; a channel the TPU
        compiler chains over fusions, for what the instructions between its first fusion and
        its last did not; any other, whole."""
        if name in self.memo:
            return self.memo[name]
        total = _Cost()
        cover = link = 0.0  # the link's view of this computation's time so far, and when it is next free
        running: dict[str, float] = {}  # asynchronous host transfers: when each ends
        clock = 0.0  # this computation's time so far, as computation waits for it
        collectives: dict[str, float] = {}  # asynchronous collectives: when each ends, on the clock
        chained: dict[str, tuple[float, float]] = {}  # a fused collective's channel: its first fusion's end, its last's start
        for op in self.work.computations.get(name, ()):
            if op.priced and not op.host_bytes:  # most instructions: summed here, as op() and add() would
                seconds = self.seconds(op)
                total.flops += op.flops
                total.mxu_flops += op.mxu_flops
                total.hbm_bytes += op.hbm_bytes
                total.instructions += 1
                total.compute_seconds += seconds
                if op.channels:
                    keep_largest(total.channels, op.channels)
                    for channel, _ in op.channels:
                        chained[channel] = (chained.get(channel, (clock + seconds,))[0], clock)
                cover += self.overlap * seconds
                clock += seconds
                continue
            if op.collective and op.starts:  # an asynchronous collective: on the ICI beside computation
                total.instructions += 1
                for _, (nbytes, one_link) in op.channels:
                    total.collective_bytes += nbytes
                    collectives[op.name] = max(collectives.get(op.name, clock), clock + self.ici_seconds(nbytes, one_link))
                continue
            cost = self.op(op)
            total.add(cost)
            busy = cost.compute_seconds + cost.host_wait_seconds
            wait = 0.0
            if op.host_bytes:
                total.host_bytes += op.host_bytes
                link = max(cover, link) + self.link_seconds(op.host_bytes)
                if op.starts:
                    running[op.name] = link
                else:
                    wait = max(0.0, link - cover - self.overlap * busy)
            elif op.waits_for in running:
                wait = max(0.0, running.pop(op.waits_for) - cover - self.overlap * busy)
            elif op.waits_for in collectives:
                waited = max(0.0, collectives.pop(op.waits_for) - clock - busy)
                total.collective_seconds += waited
                cover += waited
                clock += waited
            total.host_wait_seconds += wait
            cover += self.overlap * busy + wait
            clock += busy + wait + cost.collective_seconds
        if running:
            total.host_wait_seconds += max(0.0, max(running.values()) - cover)
        if collectives:
            total.collective_seconds += max(0.0, max(collectives.values()) - clock)
        total.collective_bytes += sum(nbytes for nbytes, _ in total.channels.values())
        for channel, found in total.channels.items():
            first_end, last_start = chained.get(channel, (0.0, 0.0))
            total.collective_seconds += max(0.0, self.ici_seconds(*found) - max(0.0, last_start - first_end))
        total.channels = {}
        self.memo[name] = total
        return total

    def op(self, op: Op) -> _Cost:
        """The cost of one scheduled instruction, its host transfer aside (:meth:`computation`
        times those)."""
        if op.body is not None:
            cost = _Cost(unknown_trips=0 if op.trips else 1)
            cost.add(self.computation(op.body), op.trips or 1)
            return cost
        if op.branches:
            branches = [self.computation(n) for n in op.branches]
            return max(branches, key=lambda c: (c.flops, c.hbm_bytes, c.collective_bytes), default=_Cost())
        if op.calls is not None:
            return self.computation(op.calls)
        if op.collective:
            return _Cost(instructions=1, channels=dict(op.channels))
        if not op.priced:
            return _Cost()
        return _Cost(flops=op.flops, mxu_flops=op.mxu_flops, hbm_bytes=op.hbm_bytes, instructions=1,
                     compute_seconds=self.seconds(op), channels=dict(op.channels))
