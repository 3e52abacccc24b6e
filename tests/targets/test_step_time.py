"""The step-time model of compile-only targets (``step_time``): each instruction of the
optimized program priced at the chip's peaks, loops counted per iteration, collectives at
the inter-chip bandwidth. On a hand-written module, where every figure can be worked out,
and on programs the real TPU compiler made."""

from __future__ import annotations

import pytest

from remat_search.measure.executables import Executables, measure
from remat_search.measure.measurement import Measurement
from remat_search.report.text import describe_trial, time_models_note
from remat_search.plans.plan import RematPlan
from remat_search.report.results import TrialResult
from remat_search.spec.models import TimingConfig, TpuTarget
from remat_search.spec.workloads import TransformerConfig
from remat_search.targets.chips import CHIPS, GPUS, Chip, gpu_chip
from remat_search.targets.step_time import estimate_step
from remat_search.targets.base import target_of
from remat_search.workloads.base import build_workload

CHIP = Chip(name="test", bf16_flops=1e12, hbm_bytes_per_second=1e9, ici_bytes_per_second=1e8)

MODULE = """HloModule jit_step, is_scheduled=true

%fused_matmul (param_0: bf16[64,128], param_1: bf16[128,256]) -> bf16[64,256] {
  %param_0 = bf16[64,128]{1,0} parameter(0)
  %param_1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_scale (param_0.1: f32[1024,1024]) -> f32[1024,1024] {
  %param_0.1 = f32[1024,1024]{1,0} parameter(0)
  ROOT %multiply.1 = f32[1024,1024]{1,0} multiply(%param_0.1, %param_0.1)
}

%gathering (param_0.2: bf16[64,256]) -> bf16[128,256] {
  %param_0.2 = bf16[64,256]{1,0} parameter(0)
  ROOT %all-gather.2 = bf16[128,256]{1,0} all-gather(%param_0.2), channel_id=7, replica_groups={{0,1}}, dimensions={0}
}

%body (p: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %p = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024,1024]{1,0} get-tuple-element(%p), index=1
  %fusion.2 = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_scale
  ROOT %tuple.1 = (s32[], f32[1024,1024]{1,0}) tuple(%i, %fusion.2)
}

%cond (q: (s32[], f32[1024,1024])) -> pred[] {
  %q = (s32[], f32[1024,1024]{1,0}) parameter(0)
  ROOT %constant.1 = pred[] constant(true)
}

ENTRY %main (a: bf16[64,128], w: bf16[128,256], v: f32[4096], x: f32[1024,1024]) -> bf16[64,256] {
  %a = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %v = f32[4096]{0:S(1)} parameter(2)
  %x = f32[1024,1024]{1,0} parameter(3)
  %fusion.1 = bf16[64,256]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_matmul
  %copy.1 = f32[4096]{0:S(1)} copy(%v)
  %all-reduce.1 = f32[1024,1024]{1,0} all-reduce(%x), channel_id=3, replica_groups=[1,4]<=[4], to_apply=%cond
  %fusion.3 = bf16[128,256]{1,0} fusion(%fusion.1), kind=kLoop, calls=%gathering
  %fusion.4 = bf16[128,256]{1,0} fusion(%fusion.1), kind=kLoop, calls=%gathering
  %constant.2 = s32[] constant(0)
  %t = (s32[], f32[1024,1024]{1,0}) tuple(%constant.2, %x)
  %while.1 = (s32[], f32[1024,1024]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %fusion.5 = bf16[64,256]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_matmul
}
"""


def test_each_instruction_costs_the_slower_of_its_flops_and_its_hbm_bytes() -> None:
    e = estimate_step(MODULE, CHIP)
    matmul_flops = 2 * 64 * 256 * 128
    matmul_bytes = (64 * 128 + 128 * 256 + 64 * 256) * 2
    scale_bytes = 2 * 1024 * 1024 * 4  # elementwise: its FLOPs are not priced, its bytes are
    assert e.flops == 2 * matmul_flops
    # The copy within on-chip memory (S(1)) moves no HBM bytes; the loop runs its body 3 times;
    # a fusion that only gathers moves its bytes over the ICI, as an unfused all-gather does.
    assert e.hbm_bytes == 2 * matmul_bytes + 3 * scale_bytes
    each = [max(matmul_flops / 1e12, matmul_bytes / 1e9)] * 2 + [scale_bytes / 1e9] * 3
    assert e.compute_seconds == pytest.approx(sum(each))
    # the matmuls, the copy, the all-reduce, the two gathering fusions, the loop's three iterations
    assert e.instructions == 2 + 1 + 1 + 2 + 3 and e.unknown_trip_counts == 0


def test_collectives_cost_what_a_ring_moves_per_chip_once_a_channel_at_the_ici_bandwidth() -> None:
    e = estimate_step(MODULE, CHIP)
    # all-reduce over 4: 2 × (4 − 1)/4 of its 4 MiB; the all-gather over 2, printed in two
    # fusions of one channel (as the TPU compiler chains one), received once: half its result.
    all_reduce, all_gather = 2 * 4 * 2**20 * 3 / 4, 128 * 256 * 2 / 2
    assert e.collective_bytes == all_reduce + all_gather
    assert e.collective_seconds == pytest.approx((all_reduce + all_gather) / 1e8)
    assert e.seconds == pytest.approx(e.compute_seconds + e.collective_seconds)
    assert estimate_step(MODULE, CHIP.model_copy(update={"ici_bytes_per_second": None})).collective_seconds == 0


TAKE = """%take (p0: f32[8,1024], p1: s32[]) -> f32[1,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%p0, %p1, %c), dynamic_slice_sizes={1,1024}
}
"""
"""A fusion's computation that takes one row (a layer) out of a stack of 8."""

SLICED = """HloModule sliced, is_scheduled=true

""" + TAKE + """
%put (p0.1: f32[8,1024], p1.1: f32[1,1024], p2.1: s32[]) -> f32[8,1024] {
  %p0.1 = f32[8,1024]{1,0} parameter(0)
  %p1.1 = f32[1,1024]{1,0} parameter(1)
  %p2.1 = s32[] parameter(2)
  %c.1 = s32[] constant(0)
  %neg = f32[1,1024]{1,0} negate(%p1.1)
  ROOT %dus = f32[8,1024]{1,0} dynamic-update-slice(%p0.1, %neg, %p2.1, %c.1)
}

ENTRY %main (stack: f32[8,1024], saved: f32[8,1024], i: s32[]) -> f32[8,1024] {
  %stack = f32[8,1024]{1,0} parameter(0)
  %saved = f32[8,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %layer = f32[1,1024]{1,0} fusion(%stack, %i), kind=kLoop, calls=%take
  %slice.1 = f32[2,1024]{1,0} slice(%stack), slice={[0:2], [0:1024]}
  ROOT %out = f32[8,1024]{1,0} fusion(%saved, %layer, %i), kind=kLoop, calls=%put
}
"""


def test_a_slice_reads_what_it_keeps_and_an_update_in_place_moves_only_the_update() -> None:
    # As a scanned model's loop takes its layer out of the stacked weights, and writes the
    # activations it saves into a stacked buffer: not the whole stack each iteration.
    row = 1024 * 4
    layer = row + 4 + row  # one row of the stack read, the index, the row written
    sliced = 2 * (2 * row)  # two rows read and written
    put = 0 + row + 4 + row  # the buffer updated in place is not read; the update is written
    assert estimate_step(SLICED, CHIP).hbm_bytes == layer + sliced + put


NESTED = """HloModule nested, is_scheduled=true

""" + TAKE + """
%outer (q0: f32[8,1024], q1: s32[]) -> f32[1,1024] {
  %q0 = f32[8,1024]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %b = f32[8,1024]{1,0} bitcast(%q0)
  %taken = f32[1,1024]{1,0} fusion(%b, %q1), kind=kLoop, calls=%take
  ROOT %neg = f32[1,1024]{1,0} negate(%taken)
}

ENTRY %main (stack: f32[8,1024], i: s32[]) -> f32[1,1024] {
  %stack = f32[8,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %layer = f32[1,1024]{1,0} fusion(%stack, %i), kind=kOutput, calls=%outer
}
"""


def test_a_slice_in_a_fusion_nested_in_another_reads_what_it_keeps() -> None:
    # The TPU compiler's collective-matmul fusions nest the fusion that takes one layer out of
    # a scanned stack (Llama 2 70B's backward: 80 layers, each read whole every layer before).
    row = 1024 * 4
    assert estimate_step(NESTED, CHIP).hbm_bytes == row + 4 + row


SPARSECORE = """HloModule sparsecore, is_scheduled=true

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}, execution_thread="sparsecore"

%reducing (g: f32[1024,1024], t: token[]) -> f32[1024,1024] {
  %t = token[] parameter(1)
  %g = f32[1024,1024]{1,0} parameter(0)
  ROOT %all-reduce.1 = f32[1024,1024]{1,0} all-reduce(%g), channel_id=5, replica_groups=[1,4]<=[4], to_apply=%sum
}, execution_thread="sparsecore"

%fused_scale (param_0.1: f32[1024,1024]) -> f32[1024,1024] {
  %param_0.1 = f32[1024,1024]{1,0} parameter(0)
  ROOT %multiply.1 = f32[1024,1024]{1,0} multiply(%param_0.1, %param_0.1)
}

ENTRY %main (x: f32[1024,1024], t: token[]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  %t = token[] parameter(1)
  %call-start = ((f32[1024,1024]{1,0}, token[]), f32[1024,1024]{1,0}) call-start(%x, %t), async_execution_thread="sparsecore", to_apply=%reducing
  %scaled = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_scale
  %call-done = f32[1024,1024]{1,0} call-done(%call-start)
  ROOT %out = f32[1024,1024]{1,0} fusion(%call-done), kind=kLoop, calls=%fused_scale
}
"""
"""The v6e's SparseCore runs an all-reduce (``--xla_tpu_enable_sparse_core_collective_offload_all_reduce``,
MaxText's v6e flags) as an asynchronous call of a computation on its own execution thread."""


def test_a_collective_a_sparsecore_runs_is_priced_and_its_computation_read_whole() -> None:
    # Before, the computations of the sparsecore thread ('}, execution_thread=...' closes them)
    # ran on into the next one, and the call's all-reduce went unpriced: Llama 2 70B's gradient
    # all-reduces under MaxText's flags, 0.7 s of its step.
    e = estimate_step(SPARSECORE, CHIP)
    assert e.collective_bytes == 2 * 4 * 2**20 * 3 / 4  # the all-reduce over 4, once
    scale = 2 * 4 * 2**20  # each scaling fusion reads and writes 4 MiB; the call moves nothing on HBM itself
    assert e.hbm_bytes == 2 * scale and e.instructions == 3


CHAINED = """HloModule chained, is_scheduled=true

%start (s0: bf16[4,256]) -> (bf16[4,256], bf16[16,256], u32[]) {
  %s0 = bf16[4,256]{1,0} parameter(0)
  %ag.1 = bf16[16,256]{1,0} all-gather(%s0), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %cc.1 = (bf16[4,256]{1,0}, bf16[16,256]{1,0}, u32[]{:S(2)}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%matmul_on (m0: bf16[4,256], m1: bf16[16,256], m2: bf16[64,16], m3: bf16[16,256]) -> (bf16[64,256], bf16[4,256], bf16[16,256], bf16[16,256]) {
  %m0 = bf16[4,256]{1,0} parameter(0)
  %m1 = bf16[16,256]{1,0} parameter(1)
  %m2 = bf16[64,16]{1,0} parameter(2)
  %m3 = bf16[16,256]{1,0} parameter(3)
  %dot.1 = bf16[64,256]{1,0} dot(%m2, %m3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag.2 = bf16[16,256]{1,0} all-gather(%m0), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %t = (bf16[64,256]{1,0}, bf16[4,256]{1,0}, bf16[16,256]{1,0}, bf16[16,256]{1,0}) tuple(%dot.1, %m0, %m1, %ag.2)
}

%done (d0: bf16[4,256], d1: bf16[16,256]) -> bf16[16,256] {
  %d0 = bf16[4,256]{1,0} parameter(0)
  %d1 = bf16[16,256]{1,0} parameter(1)
  %ag.3 = bf16[16,256]{1,0} all-gather(%d0), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %cc.2 = bf16[16,256]{1,0} custom-call(%d0, %d1, %ag.3), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (shard: bf16[4,256], x: bf16[64,16], w: bf16[16,256]) -> bf16[16,256] {
  %shard = bf16[4,256]{1,0} parameter(0)
  %x = bf16[64,16]{1,0} parameter(1)
  %w = bf16[16,256]{1,0} parameter(2)
  %s = (bf16[4,256]{1,0}, bf16[16,256]{1,0}, u32[]{:S(2)}) fusion(%shard), kind=kCustom, calls=%start
  %s0 = bf16[4,256]{1,0} get-tuple-element(%s), index=0
  %s1 = bf16[16,256]{1,0} get-tuple-element(%s), index=1
  %m = (bf16[64,256]{1,0}, bf16[4,256]{1,0}, bf16[16,256]{1,0}, bf16[16,256]{1,0}) fusion(%s0, %s1, %x, %w), kind=kOutput, output_to_operand_aliasing={{1}: (0, {}), {2}: (1, {}), {3}: (1, {})}, calls=%matmul_on
  %m1 = bf16[4,256]{1,0} get-tuple-element(%m), index=1
  %m2 = bf16[16,256]{1,0} get-tuple-element(%m), index=3
  ROOT %d = bf16[16,256]{1,0} fusion(%m1, %m2), kind=kCustom, output_to_operand_aliasing={{}: (1, {})}, calls=%done
}
"""
"""The TPU compiler's asynchronous all-gather (``--xla_tpu_enable_async_collective_fusion``): a
fusion starts it, one that runs a matmul meanwhile hands its buffers on, and one waits for it."""


def test_an_asynchronous_collectives_fusions_move_on_hbm_only_what_they_compute() -> None:
    # As an unfused all-gather is priced: its bytes over the ICI, none on HBM. Before, its start
    # wrote the gathered buffer, the matmul's fusion read and wrote it again, and its done read
    # and wrote it once more (a pure gather's fusions priced 0.45 s of Llama 2 70B's step).
    e = estimate_step(CHAINED, CHIP)
    assert e.collective_bytes == 16 * 256 * 2 * 3 / 4  # one channel, received once
    assert e.hbm_bytes == (64 * 16 + 16 * 256 + 64 * 256) * 2  # the matmul's operands and result
    assert e.flops == 2 * 64 * 256 * 16
    # The gather runs on the ICI while the matmul's fusion computes: computation waits only for
    # the rest (the matmul moves 43,008 bytes of HBM, 4.3e-5 s; the gather takes 6.1e-5 s).
    matmul = (64 * 16 + 16 * 256 + 64 * 256) * 2 / 1e9
    assert e.collective_seconds == pytest.approx(16 * 256 * 2 * 3 / 4 / 1e8 - matmul)
    assert e.seconds == pytest.approx(e.compute_seconds + e.collective_seconds)


PERMUTING = """HloModule permuting, is_scheduled=true

%fused_scale (param_0.1: f32[1024,1024]) -> f32[1024,1024] {
  %param_0.1 = f32[1024,1024]{1,0} parameter(0)
  ROOT %multiply.1 = f32[1024,1024]{1,0} multiply(%param_0.1, %param_0.1)
}

ENTRY %main (x: f32[1024,1024], y: f32[256,256]) -> f32[256,256] {
  %x = f32[1024,1024]{1,0} parameter(0)
  %y = f32[256,256]{1,0} parameter(1)
  %cp-start = (f32[256,256]{1,0}, f32[256,256]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%y), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %scaled = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_scale
  ROOT %cp-done = f32[256,256]{1,0} collective-permute-done(%cp-start)
}
"""
"""A collective matmul's step as the TPU compiler schedules it (v5p, ``tensor`` > 1): each chip
sends a shard to its neighbour while the chip computes."""


def test_an_asynchronous_permute_crosses_one_link_beside_the_computation_scheduled_before_its_done() -> None:
    # Its 256 KiB go to one neighbour over one of a 2D torus' four links: 1.05e-2 s at 1e8 B/s
    # spread over four; the scaling fusion between its start and its done (8 MiB, 8.4e-3 s) hides
    # the rest. Over a chip of one link it hides it all; scheduled with nothing between, none.
    sent, scale = 256 * 256 * 4, 2 * 1024 * 1024 * 4 / 1e9
    torus = CHIP.model_copy(update={"ici_links": 4})
    e = estimate_step(PERMUTING, torus)
    assert e.collective_bytes == sent and e.compute_seconds == pytest.approx(scale)
    assert e.collective_seconds == pytest.approx(4 * sent / 1e8 - scale)
    assert e.seconds == pytest.approx(e.compute_seconds + e.collective_seconds)
    assert estimate_step(PERMUTING, CHIP).collective_seconds == 0
    back_to_back = PERMUTING.replace("  %scaled = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_scale\n", "")
    assert estimate_step(back_to_back, torus).collective_seconds == pytest.approx(4 * sent / 1e8)


STEPPED = """HloModule stepped, is_scheduled=true

%fused_matmul (param_0: bf16[64,128], param_1: bf16[128,256]) -> bf16[64,256] {
  %param_0 = bf16[64,128]{1,0} parameter(0)
  %param_1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (u32[], bf16[64,128], bf16[128,256])) -> (u32[], bf16[64,128], bf16[128,256]) {
  %p = (u32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %a = bf16[64,128]{1,0} get-tuple-element(%p), index=1
  %w = bf16[128,256]{1,0} get-tuple-element(%p), index=2
  %fusion.1 = bf16[64,256]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_matmul
  %fusion.2 = bf16[64,256]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_matmul
  %copy.1 = u32[] copy(%i)
  %two = u32[] constant(2)
  %next = u32[] add(%copy.1, %two)
  ROOT %tuple.1 = (u32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%next, %a, %w)
}

%cond (q: (u32[], bf16[64,128], bf16[128,256])) -> pred[] {
  %q = (u32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %j = u32[] get-tuple-element(%q), index=0
  %eight = u32[] constant(8)
  ROOT %lt = pred[] compare(%j, %eight), direction=LT
}

ENTRY %main (a: bf16[64,128], w: bf16[128,256]) -> (u32[], bf16[64,128], bf16[128,256]) {
  %a = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %zero = u32[] constant(0)
  %t = (u32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%zero, %a, %w)
  ROOT %while.1 = (u32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) while(%t), condition=%cond, body=%body
}
"""


def test_a_loop_whose_counter_steps_by_two_runs_half_as_many_times() -> None:
    # The TPU compiler's windowed matmuls over an FSDP gather unroll their loop twice: the body
    # holds two matmuls and adds 2 to its counter, and the condition says `counter < 8` with no
    # stated trip count (seen on MaxText's 16B layer over v5e:4x4, where reading 8 iterations
    # counted those matmuls twice). 4 iterations of 2 matmuls: 8 matmuls, not 16.
    e = estimate_step(STEPPED, CHIP)
    assert e.unknown_trip_counts == 0
    assert e.flops == 8 * 2 * 64 * 256 * 128
    assert e.instructions == 4 * 4  # each iteration: the two matmuls, the counter's copy and its add


SCHEDULED_AFTER_ROOT = STEPPED.replace(
    "  ROOT %tuple.1 = (u32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%next, %a, %w)\n",
    "  ROOT %tuple.1 = (u32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%next, %a, %w)\n"
    '  %kernel.1 = bf16[64,256]{1,0} custom-call(%a, %w), custom_call_target="tpu_custom_call", '
    'frontend_attributes={"xprof_metadata":"{\\"block_q\\": 512}"\n'
    '}}, metadata={op_name="jit(train_step)/pallas_call"}\n',
)


def test_a_loop_body_printed_past_its_root_over_lines_a_kernel_breaks_keeps_its_trip_count() -> None:
    # MaxText's scanned decoder with splash attention, compiled for a v5e: the scheduled loop body
    # prints its ROOT tuple before the Pallas call it overlaps, whose attributes hold a line
    # break (and a line starting "}}"). Reading the last line as the root, or that "}}" as the
    # body's end, lost the trip count: each scanned layer counted once, a 16B step estimated at
    # 165 ms, not 9.1 s.
    e = estimate_step(SCHEDULED_AFTER_ROOT, CHIP)
    assert e.unknown_trip_counts == 0
    assert e.flops == 8 * 2 * 64 * 256 * 128


V5E = TpuTarget(platform="tpu", topology="v5e:2x2")
MODEL = {"kind": "transformer", "layers": 2, "d_model": 128, "heads": 4, "d_ff": 512, "seq_len": 256, "batch": 16,
         "vocab": 256, "attention": "dense"}


def _estimated(policy: str, mesh: dict[str, int], **changes: object) -> Measurement:
    workload = build_workload(TransformerConfig(**{**MODEL, **changes}))
    target = target_of(V5E)
    executables = Executables(workload, target=target, mesh=target.mesh(mesh))
    plan = RematPlan.uniform(policy, workload.layers)
    return measure(executables, plan, budget=2**40, timing=TimingConfig(), gradient_tolerance=1e-3)


@pytest.fixture(scope="module")
def compiled() -> dict[str, Measurement]:
    """The 2-layer model for a v5e 2x2 (three TPU compiles, a few seconds each)."""
    fsdp = {"data": 2, "fsdp": 2}
    return {
        "none": _estimated("none", fsdp), "full": _estimated("full", fsdp),
        "scanned": _estimated("none", fsdp, scan=True),
    }


def test_the_model_finds_the_compilers_matmul_flops_and_prices_recomputation(compiled: dict[str, Measurement]) -> None:
    none, full = compiled["none"], compiled["full"]
    for m in (none, full):
        # Matmuls are nearly all of the compiler's own FLOP count; the rest is elementwise.
        assert 0.9 * m.flops <= m.estimate.flops <= m.flops
    assert full.estimate.flops > 1.2 * none.estimate.flops  # the forward pass again
    assert full.estimate.compute_seconds > none.estimate.compute_seconds
    # FSDP: full remat gathers each layer's weights again for the recomputed forward pass
    # (jax 0.10.2, libtpu 0.0.42.1: 3.65 vs 3.51 MB received per chip).
    assert full.estimate.collective_bytes > none.estimate.collective_bytes > 0


def test_a_scanned_stack_is_counted_once_per_layer(compiled: dict[str, Measurement]) -> None:
    unrolled, scanned = compiled["none"], compiled["scanned"]
    # The compiler's own cost analysis counts a loop's body once; the trip count is read off
    # the loop's condition (the TPU compiler does not state it), and each layer is counted, as
    # unrolled: the same matmuls, and the loop slices one layer out of the stacked weights (jax
    # 0.10.2, libtpu 0.0.42.1, 2 layers: 3.42 GFLOP both ways, 1.87 in the compiler's count;
    # 3.63 vs 3.13 MB of HBM traffic).
    assert scanned.estimate.unknown_trip_counts == 0
    assert scanned.estimate.flops > 1.5 * scanned.flops
    assert scanned.estimate.flops == pytest.approx(unrolled.estimate.flops, rel=0.01)
    assert scanned.estimate.hbm_bytes < 1.25 * unrolled.estimate.hbm_bytes


def test_show_says_which_model_estimated_a_time(compiled: dict[str, Measurement]) -> None:
    shown = describe_trial(TrialResult(number=0, status="measured", measurement=compiled["none"]))
    assert "by the per-instruction model" in shown and "the whole-program roofline says" in shown
    assert "padded to their tiles" not in shown  # nothing padded: not said
    estimate = compiled["none"].estimate
    padded = compiled["none"].model_copy(update={"estimate": estimate.model_copy(update={"mxu_flops": 2 * estimate.flops})})
    shown = describe_trial(TrialResult(number=0, status="measured", measurement=padded))
    assert f"{2 * estimate.flops / 1e9:.1f} as the matrix units spend them, padded to their tiles" in shown
    older = compiled["none"].model_copy(update={"estimate": None})  # as measured before this model
    shown = describe_trial(TrialResult(number=1, status="measured", measurement=older))
    assert "by the whole-program roofline" in shown and "per-instruction" not in shown
    assert older.time_model == "roofline" and compiled["none"].time_model == "fusions"
    # A study searched before this model and resumed after it says its times do not compare.
    trials = [TrialResult(number=i, status="measured", measurement=m) for i, m in enumerate((compiled["full"], older))]
    assert "do not compare" in time_models_note(trials)
    assert time_models_note(trials[:1]) is None and time_models_note(trials[1:]) is None


def test_published_chips_have_their_ici_bandwidth_but_v4() -> None:
    assert {name for name, chip in CHIPS.items() if chip.ici_bytes_per_second is None} == {"v4"}


OFFLOADED = """HloModule offloaded, is_scheduled=true

%fused_matmul (param_0: bf16[64,128], param_1: bf16[128,256]) -> bf16[64,256] {
  %param_0 = bf16[64,128]{1,0} parameter(0)
  %param_1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[64,128], w: bf16[128,256], x: f32[1024,1024]) -> f32[1024,1024] {
  %a = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %x = f32[1024,1024]{1,0} parameter(2)
  %copy-start.1 = (f32[1024,1024]{1,0:S(5)}, f32[1024,1024]{1,0}, u32[]) copy-start(%x)
  %fusion.1 = bf16[64,256]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_matmul
  %copy-done.1 = f32[1024,1024]{1,0:S(5)} copy-done(%copy-start.1)
  %copy-start.2 = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0:S(5)}, u32[]) copy-start(%copy-done.1)
  %copy-done.2 = f32[1024,1024]{1,0} copy-done(%copy-start.2)
  %copy-start.3 = (f32[1024,1024]{1,0:S(1)}, f32[1024,1024]{1,0}, u32[]) copy-start(%copy-done.2)
  ROOT %copy-done.3 = f32[1024,1024]{1,0:S(1)} copy-done(%copy-start.3)
}
"""


def test_host_transfers_cost_the_host_link_beside_the_compute_between_start_and_done() -> None:
    # 4 MiB to pinned host memory (S(5)) while a matmul runs, then back with nothing to hide
    # behind; a copy into on-chip memory (S(1)) crosses no host link.
    chip = CHIP.model_copy(update={"host_bytes_per_second": 1e9, "hbm_bytes_per_second": 1e12})
    e = estimate_step(OFFLOADED, chip)
    array = 1024 * 1024 * 4
    matmul = max(2 * 64 * 256 * 128 / chip.bf16_flops, (64 * 128 + 128 * 256 + 64 * 256) * 2 / chip.hbm_bytes_per_second)
    assert e.host_bytes == 2 * array
    assert e.host_seconds == pytest.approx(2 * array / 1e9)
    # out: the start (reading its HBM source) and the matmul cover part of it; back: all of
    # it is waited for
    assert e.host_wait_seconds == pytest.approx((array / 1e9 - array / 1e12 - matmul) + array / 1e9)
    assert e.seconds == pytest.approx(e.compute_seconds + e.host_wait_seconds + e.collective_seconds)
    # Without a figure for the link, transfers are counted and not priced.
    free = estimate_step(OFFLOADED, chip.model_copy(update={"host_bytes_per_second": None}))
    assert free.host_bytes == 2 * array and free.host_wait_seconds == 0 and free.host_seconds == 0
    assert e.seconds - free.seconds == pytest.approx(e.host_wait_seconds)


def test_published_chips_price_the_host_link() -> None:
    assert all(chip.host_bytes_per_second for chip in [*CHIPS.values(), *GPUS.values()])


@pytest.fixture(scope="module")
def offloaded() -> dict[str, Measurement]:
    """A scanned 4-layer model on v5e 2x2, q/k/v offloaded, kept, or recomputed (three TPU compiles)."""
    model = {"layers": 4, "d_model": 128, "heads": 4, "d_ff": 512, "seq_len": 128, "batch": 16, "scan": True,
             "attention": "flash"}
    offload = {"kind": "offload", "names": ["query_proj", "key_proj", "value_proj"]}
    keep = {"kind": "names", "names": ["query_proj", "key_proj", "value_proj"]}
    workload = build_workload(TransformerConfig(**{**MODEL, **model}))
    target = target_of(V5E)
    executables = Executables(workload, target=target, mesh=target.mesh(None))
    return {
        label: measure(executables, RematPlan.model_validate({"layers": [policy] * 4}), budget=2**40,
                       timing=TimingConfig(), gradient_tolerance=1e-3)
        for label, policy in (("offload", offload), ("keep", keep), ("full", {"kind": "full"}))
    }


def test_offloaded_tensors_cross_the_host_link_both_ways(offloaded: dict[str, Measurement]) -> None:
    # q, k and v of every layer: f32[batch / 4 chips, 128, 4 heads, 32] each, to a stacked
    # buffer in host memory a layer at a time, and back in the backward loop.
    each = 16 // 4 * 128 * 128 * 4
    e = offloaded["offload"].estimate
    assert e.host_bytes == 2 * 4 * 3 * each
    assert e.host_wait_seconds > 0 and e.seconds > offloaded["keep"].estimate.seconds
    assert offloaded["keep"].estimate.host_bytes == 0


def test_a_scanned_stack_offloads_below_keeping_on_the_device(offloaded: dict[str, Measurement]) -> None:
    # Scanned, each layer's q/k/v go to a stacked buffer in host memory and come back one
    # layer at a time in the backward loop: the device peak is full remat's, below keeping
    # them (jax 0.10.2, libtpu 0.0.42.1). Unrolled, the TPU compiler brings them back as
    # soon as they land on the host, long before the backward needs them, so they are on
    # the device at the peak (docs/tpu.md, "Offload"); no claim is made of that order.
    assert offloaded["offload"].peak_bytes < offloaded["keep"].peak_bytes
    assert offloaded["offload"].memory.host_temp > 0 == offloaded["keep"].memory.host_temp


# --- XLA:GPU programs ---------------------------------------------------------------------
# Instructions below are copied from programs XLA:GPU compiled on an H100 (jax 0.11.2; the
# built-in transformer's step and jax.nn.dot_product_attention with implementation="cudnn"),
# metadata and most of each backend_config trimmed.

GPU = Chip(name="test GPU", bf16_flops=1e15, hbm_bytes_per_second=1e12)

GPU_MODULE = """HloModule jit_train_step, is_scheduled=true

%gemm_fusion_dot.47_computation (parameter_0.3: bf16[256,2048,64], parameter_1.3: bf16[256,64,2048]) -> f32[256,2048,2048] {
  %parameter_0.3 = bf16[256,2048,64]{2,1,0} parameter(0)
  %parameter_1.3 = bf16[256,64,2048]{2,1,0} parameter(1)
  ROOT %dot.61 = f32[256,2048,2048]{2,1,0} dot(%parameter_0.3, %parameter_1.3), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, algorithm=dot_bf16_bf16_f32, backend_config={"sizes":["64"]}
}

%fused_dynamic_update_slice.25.clone (param_0: f32[8,16,2048,2048], param_1: f32[1,16,2048,2048], param_2: s32[]) -> f32[8,16,2048,2048] {
  %param_0 = f32[8,16,2048,2048]{3,2,1,0} parameter(0)
  %param_1 = f32[1,16,2048,2048]{3,2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %constant_0 = s32[] constant(0)
  ROOT %dynamic_update_slice.1 = f32[8,16,2048,2048]{3,2,1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %constant_0, %constant_0, %constant_0)
}

ENTRY %main.73 (x: bf16[32768,1024], w: bf16[1024,1024], q: bf16[256,2048,64], k: bf16[256,64,2048], saved: f32[8,16,2048,2048], i: s32[], scores: f32[1,16,2048,2048]) -> (bf16[32768,1024], f32[256,2048,2048], f32[8,16,2048,2048]) {
  %x = bf16[32768,1024]{1,0} parameter(0)
  %w = bf16[1024,1024]{1,0} parameter(1)
  %q = bf16[256,2048,64]{2,1,0} parameter(2)
  %k = bf16[256,64,2048]{2,1,0} parameter(3)
  %saved = f32[8,16,2048,2048]{3,2,1,0} parameter(4)
  %i = s32[] parameter(5)
  %scores = f32[1,16,2048,2048]{3,2,1,0} parameter(6)
  %custom-call.9 = (bf16[32768,1024]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"device_type":"DEVICE_TYPE_INVALID","gemm_backend_config":{"alpha_imag":0,"alpha_real":1,"autotune_workspace_size":"33554432","beta":0,"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT","selected_algorithm":"3"},"operation_queue_id":"0"}
  %get-tuple-element.1 = bf16[32768,1024]{1,0} get-tuple-element(%custom-call.9), index=0
  %gemm_fusion_dot.47 = f32[256,2048,2048]{2,1,0} fusion(%q, %k), kind=kCustom, calls=%gemm_fusion_dot.47_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %fusion-start.12 = ((f32[8,16,2048,2048]{3,2,1,0}, f32[1,16,2048,2048]{3,2,1,0}, s32[]), f32[8,16,2048,2048]{3,2,1,0}, u32[]) fusion-start(%saved, %scores, %i), kind=kLoop, calls=%fused_dynamic_update_slice.25.clone
  %fusion-done.12 = f32[8,16,2048,2048]{3,2,1,0} fusion-done(%fusion-start.12)
  ROOT %tuple.1 = (bf16[32768,1024]{1,0}, f32[256,2048,2048]{2,1,0}, f32[8,16,2048,2048]{3,2,1,0}) tuple(%get-tuple-element.1, %gemm_fusion_dot.47, %fusion-done.12)
}
"""

_FMHA_CONFIG = (
    '"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","8","1024","1024"],'
    '"element_type":"BF16"},"is_flash_attention":true,"mask_type":"CAUSAL"}'
)
CUDNN_MODULE = f"""HloModule jit_attention, is_scheduled=true

ENTRY %main.20 (q.1: bf16[2,1024,8,128], k.1: bf16[2,1024,8,128], v.1: bf16[2,1024,8,128], g: bf16[2,1024,8,128]) -> bf16[2,8,1024,128] {{
  %q.1 = bf16[2,1024,8,128]{{3,2,1,0}} parameter(0)
  %k.1 = bf16[2,1024,8,128]{{3,2,1,0}} parameter(1)
  %v.1 = bf16[2,1024,8,128]{{3,2,1,0}} parameter(2)
  %g = bf16[2,1024,8,128]{{3,2,1,0}} parameter(3)
  %dot_product_attention_fwd.5 = (bf16[2,8,1024,128]{{3,1,2,0}}, f32[2,8,1024]{{2,1,0}}, u8[256]{{0}}) custom-call(%q.1, %k.1, %v.1), custom_call_target="__cudnn$fmhaSoftmax", backend_config={{{_FMHA_CONFIG}}}
  %out = bf16[2,8,1024,128]{{3,1,2,0}} get-tuple-element(%dot_product_attention_fwd.5), index=0
  %stats = f32[2,8,1024]{{2,1,0}} get-tuple-element(%dot_product_attention_fwd.5), index=1
  ROOT %dot_product_attention_bwd.8 = (bf16[2,8,1024,128]{{3,1,2,0}}, bf16[2,8,1024,128]{{3,1,2,0}}, bf16[2,8,1024,128]{{3,1,2,0}}, u8[8454400]{{0}}) custom-call(%q.1, %k.1, %v.1, %stats, %g, %out), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={{{_FMHA_CONFIG}}}
}}
"""


def test_gpu_chips_are_found_by_the_device_kind_jax_reports() -> None:
    assert gpu_chip("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert gpu_chip("NVIDIA H200") is GPUS["h200"]
    assert gpu_chip("NVIDIA A100-SXM4-80GB") is None
    assert gpu_chip("TPU v5 lite") is None
    assert not set(GPUS) & set(CHIPS)  # CHIPS's keys are TPU topology generations
    assert all(chip.ici_bytes_per_second is None for chip in GPUS.values())


def test_gpu_matmuls_count_in_cublas_calls_and_triton_fusions_and_async_fusions_once() -> None:
    estimate = estimate_step(GPU_MODULE, GPU)
    cublas = 2 * 32768 * 1024 * 1024  # 2 × output elements × the contracted 1024
    triton = 2 * 256 * 2048 * 2048 * 64  # the dot inside the nested gemm fusion
    assert estimate.flops == cublas + triton
    gemm_bytes = (32768 * 1024 + 1024 * 1024) * 2 + 32768 * 1024 * 2  # no 32 MiB workspace
    triton_bytes = 2 * 256 * 2048 * 64 * 2 + 256 * 2048 * 2048 * 4
    update_bytes = 2 * 16 * 2048 * 2048 * 4 + 4  # the async update in place: the slice read and written, the index
    assert estimate.hbm_bytes == gemm_bytes + triton_bytes + update_bytes
    assert estimate.instructions == 3  # fusion-done is free; so is the tuple
    expected = max(cublas / 1e15, gemm_bytes / 1e12) + max(triton / 1e15, triton_bytes / 1e12) + update_bytes / 1e12
    assert estimate.seconds == pytest.approx(expected)
    assert estimate.collective_seconds == 0.0


def test_cudnn_attention_counts_two_matmuls_forward_and_five_backward() -> None:
    one = 2 * 2 * 8 * 1024 * 1024 * 128  # 2·B·H·Sq·Sk·D
    estimate = estimate_step(CUDNN_MODULE, GPU)
    assert estimate.flops == 2 * one + 5 * one
    q = 2 * 1024 * 8 * 128 * 2
    assert estimate.hbm_bytes == (3 * q + q + 2 * 8 * 1024 * 4) + (5 * q + 2 * 8 * 1024 * 4 + 3 * q)
