"""What an offloaded tensor costs on this device: the host link's bandwidth, and how much of an
offload's transfer the computation around it hides.

The step-time model prices an ``offload`` policy's tensors at the chip's host link, overlapped
with the instructions scheduled between a transfer's start and its done. This measures both
halves on the device at hand (a GPU; a TPU VM's chips too), one process, side by side:

* **link**: ``jax.device_put`` of a 256 MiB array to pinned host memory and back (median of 5):
  the link's bandwidth each way, as the runtime's copy moves it;
* **offload**: a scanned stack of ``layers`` layers, each saving one tensor of the same bytes
  (``rows × width`` bf16) under ``jax.checkpoint``, its gradient compiled twice: the tensor kept
  on the device (``save_only_these_names``) and offloaded to pinned host memory
  (``save_and_offload_only_these_names``). Their difference is the transfer time the step
  waits for. The layers' width changes the computation each layer gives the transfer to hide
  behind (a layer's matmuls grow with the width, its saved bytes do not): where the waited
  time falls as the computation grows, the device overlaps the transfers; where it stays at
  the bytes over the link, it does not.

    python benchmarks/host_link.py --out /tmp/link     # host_link.json and .md

A figure of one device, measured: the docs (docs/step_time.md) read them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(32768, 1024), (8192, 4096), (4096, 8192), (2048, 16384)]
"""(rows, width) of a layer's saved tensor: 64 MiB of bf16 each, the computation growing with width."""
LAYERS = 8
REPEATS = 10


def _median_seconds(run: Callable[[], Any], repeats: int = REPEATS) -> float:
    import jax

    jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def link(mib: int = 256) -> dict[str, float]:
    """The link's bandwidth each way (bytes/s), as ``jax.device_put`` moves ``mib`` MiB."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    device = jax.devices()[0]
    on_device, on_host = SingleDeviceSharding(device), SingleDeviceSharding(device, memory_kind="pinned_host")
    x = jax.device_put(jnp.ones((mib * 2**20 // 2,), jnp.bfloat16), on_device)
    h = jax.device_put(x, on_host)
    nbytes = mib * 2**20
    return {"bytes": nbytes,
            "to_host_bytes_per_second": nbytes / _median_seconds(lambda: jax.device_put(x, on_host), 5),
            "to_device_bytes_per_second": nbytes / _median_seconds(lambda: jax.device_put(h, on_device), 5)}


def offload(rows: int, width: int, layers: int = LAYERS) -> dict[str, float]:
    """One gradient step of a ``layers``-deep scanned stack whose layers save a ``rows × width``
    bf16 tensor, kept on the device and offloaded: each one's median seconds, the bytes moved."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    policies = jax.checkpoint_policies
    keep = policies.save_only_these_names("saved")
    move = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["saved"],
        offload_src="device", offload_dst="pinned_host")

    def step(policy: Any) -> Callable[..., Any]:
        def layer(x: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
            h = checkpoint_name(jnp.tanh(x @ w[0]), "saved")
            return x + jnp.tanh(h @ w[1]), None

        def loss(ws: jax.Array, x: jax.Array) -> jax.Array:
            y, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)
            return jnp.mean(y.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss))

    key = jax.random.key(0)
    ws = (jax.random.normal(key, (layers, 2, width, width), jnp.bfloat16) / width**0.5)
    x = jax.random.normal(key, (rows, width), jnp.bfloat16)
    kept, moved = step(keep), step(move)
    host = kept.lower(ws, x).compile().memory_analysis(), moved.lower(ws, x).compile().memory_analysis()
    row = {"rows": rows, "width": width, "layers": layers, "saved_bytes": 2 * rows * width * layers,
           "kept_s": _median_seconds(lambda: kept(ws, x)), "offloaded_s": _median_seconds(lambda: moved(ws, x)),
           "host_bytes": float(getattr(host[1], "host_temp_size_in_bytes", 0) or 0)}
    row["flops"] = float((kept.lower(ws, x).compile().cost_analysis() or {}).get("flops", 0.0))
    row["waited_s"] = row["offloaded_s"] - row["kept_s"]
    return row


def table(result: dict[str, Any]) -> str:
    """The markdown of :func:`main`'s result."""
    lk = result["link"]
    lines = [f"Device: {result['device']}; medians of {REPEATS} steps.", "",
             f"`jax.device_put` of {lk['bytes'] / 2**20:.0f} MiB: to pinned host "
             f"{lk['to_host_bytes_per_second'] / 1e9:.1f} GB/s, back {lk['to_device_bytes_per_second'] / 1e9:.1f} GB/s.",
             "", "| saved tensor | layers | bytes moved (out and back) | kept on device ms | offloaded ms "
             "| waited ms | waited / (bytes at the measured link) |", "|---|---:|---:|---:|---:|---:|---:|"]
    both = 2 / (1 / lk["to_host_bytes_per_second"] + 1 / lk["to_device_bytes_per_second"])
    for r in result["offload"]:
        if "error" in r:
            lines.append(f"| {r['rows']}×{r['width']} | | {r['error'][:100]} | | | | |")
            continue
        moved = 2 * r["saved_bytes"]
        lines.append(f"| {r['rows']}×{r['width']} | {r['layers']} | {moved / 2**20:.0f} MiB | {r['kept_s'] * 1e3:.2f} "
                     f"| {r['offloaded_s'] * 1e3:.2f} | {r['waited_s'] * 1e3:.2f} | {r['waited_s'] / (moved / both):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--shapes", nargs="*", default=[f"{r}x{w}" for r, w in SHAPES],
                        help="ROWSxWIDTH of each layer's saved tensor")
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    import jax

    result: dict[str, Any] = {"device": jax.devices()[0].device_kind, "link": link(), "offload": []}
    for shape in args.shapes:
        rows, width = (int(v) for v in shape.split("x"))
        try:
            result["offload"].append(offload(rows, width, args.layers))
        except Exception as e:  # noqa: BLE001 - a shape that fails is a row
            result["offload"].append({"rows": rows, "width": width, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(result["offload"][-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_link.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "host_link.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
