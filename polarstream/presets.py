"""The presets an experiment file can name: the CLI's registry. ``train: builtin:arith`` (examples/arith.yaml,
polarstream/demo/demo.yaml) is the demo's arith family (polarstream/demo/preset.py); any other source is
the file's own tasks, which the driver reads itself. The driver imports no preset: this is where the CLI
hands it one. A script hands its own straight to ``polarstream.driver.run`` (examples/my_preset.py).
"""

from __future__ import annotations

from polarstream.driver.experiment import BUILTIN_SOURCES, Experiment
from polarstream.driver.preset import MakePreset, from_config


def arith(cfg):
    """The demo's arith family (imported only when a run names it: it brings the demo's modules)."""
    from polarstream.demo.preset import arith_preset

    return arith_preset(cfg)


# A train source of BUILTIN_SOURCES -> the preset that provides it (with its held-out split, builtin:arith-heldout)
PRESETS: dict[str, MakePreset] = {"builtin:arith": arith}


def preset_for(exp: Experiment) -> MakePreset | None:
    """The preset ``exp``'s train source names, the file's own tasks (``from_config``) for a file or
    directory, or None for a built-in source no preset provides (run_config then says so)."""
    return PRESETS.get(exp.train) if exp.train in BUILTIN_SOURCES else from_config
