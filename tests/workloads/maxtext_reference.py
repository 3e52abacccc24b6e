"""MaxText's own compile of a train step, for tests/workloads/test_maxtext.py: run as
``python -m tests.workloads.maxtext_reference KEY=VALUE ...`` it prints one JSON line of the
compiled program's memory (argument, output, alias, temp, the compiler's peak).

With ``compile_topology`` among the settings it runs ``train_compile.main`` itself, MaxText's
ahead-of-time compile, keeping the object ``jit_and_compile`` returns (its ``main`` prints
``memory_analysis()`` without the peak). Without, there is no topology to name (MaxText's
``train_compile`` compiles for TPU and GPU topologies only), so it runs the same functions,
in ``main``'s order, over the local devices' mesh (``create_device_mesh``, as ``train.py``)."""

from __future__ import annotations

import json
import os
import sys


def _memory(compiled) -> dict[str, int | None]:  # noqa: ANN001
    m = compiled.memory_analysis()
    return {
        "argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
        "peak": getattr(m, "peak_memory_in_bytes", None),
    }


def main(settings: list[str]) -> None:
    """Compile MaxText's train step with ``settings`` (``KEY=VALUE``, as its train command takes them)."""
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.configs import pyconfig

    # no JAX compilation cache (base.yml's ~/jax_cache): every figure from this compile, none from a cached one
    argv = ["train_compile", os.path.join(os.path.dirname(pyconfig.__file__), "base.yml"), "jax_cache_dir=", *settings]
    kept = []
    if any(s.startswith("compile_topology=") for s in settings):
        own = train_compile.jit_and_compile
        train_compile.jit_and_compile = lambda *a, **k: kept.append(own(*a, **k)) or kept[-1]
        train_compile.main(argv)
    else:
        import jax
        from jax.sharding import Mesh
        from maxtext.utils import maxtext_utils, sharding

        jax.config.update("jax_default_prng_impl", "unsafe_rbg")
        config = pyconfig.initialize(argv)
        jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
        mesh = Mesh(maxtext_utils.create_device_mesh(config, jax.devices()[:1]), config.mesh_axes)  # one device, as the study's
        args, kwargs, state_sh, _, model = train_compile.get_shaped_inputs(mesh, config)
        params_sh, state_sh = sharding.maybe_update_params_sharding_with_opt(config, state_sh)
        in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_sh, params_sh)
        data = sharding.get_input_data_sharding(config, mesh)
        func, ins, outs, static, donate = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data, in_state, model, config, params_sh
        )
        kept.append(train_compile.jit_and_compile(
            func, args, kwargs, mesh, ins, outs, static, donate, config, train_compile.axis_rules(config.logical_axis_rules)
        ))
    print("MEMORY " + json.dumps(_memory(kept[-1])), flush=True)


if __name__ == "__main__":
    for each in json.loads(sys.argv[1]):
        main([f"{key}={value}" for key, value in each.items()])
